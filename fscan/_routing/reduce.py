"""The router of ``fscan.associative_reduce``: which engine reduces a checked call.

=========  ===================================================================
engine     when, and what runs
=========  ===================================================================
``traced`` ``torch.compile``/``torch.export`` traces: the last output (first for
           ``reverse``) of the traced scan (:mod:`fscan._engines.traced`), one
           length-polymorphic graph; the tree's levels would specialise the graph
           to the length. Nothing is inspected or cached in a graph
``cpp``    where the scan router would pick its C++ kernel (pointwise, CPU,
           ``combine_fn`` checked elementwise, no gradient wanted): the generated
           reduce kernel (:mod:`fscan._engines.cpp._kernel_reduce`), one read of the
           leaves, once compiled (in the background); ``tree`` until then, or where
           it cannot serve
``tree``   otherwise: the tree reduction (:mod:`fscan._engines.reduce`), half the
           scan's combines, on the flat combine with the first-call checks of
           ``combine_fn`` (purity, elementwise, ``validate=``)
=========  ===================================================================

The length-0 case never reaches the router: the face returns ``initial`` there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._call import ScanCall
from .._combine import flat_combine
from .._context import where
from .._engines.cpp._kernel_reduce import kernel_reduce
from .._engines.reduce import tree_reduce
from .._engines.traced import traced_scan
from .._knowledge.pointwise_check import checked_on_first_call
from .._knowledge.store import knowledge, reach
from .._knowledge.validate import validate_combine_fn
from .._route_log import ran
from .scan import check_untouched, leaf_versions, pick_route

__all__ = ["reduce_flat"]


def reduce_flat(call: ScanCall, init: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    """The total of a checked call's flat leaves (length >= 1 along ``call.dim``), a batch of
    one element per leaf, with the carry-in ``init`` (checked, one element per leaf, or
    None) combined in front.

    Example:
        >>> import optree
        >>> xs = torch.arange(1.0, 6.0)
        >>> spec = optree.tree_structure(xs)
        >>> call = ScanCall("demo", torch.add, xs, spec, [xs], 0, False, "pointwise")
        >>> reduce_flat(call, None)
        [tensor([15.])]
    """
    api, combine_fn, _, spec, leaves, dim, reverse, combine_mode = call[:8]
    combine = flat_combine(api, combine_fn, spec, combine_mode)
    if torch.compiler.is_compiling():  # no ran(): Dynamo cannot trace the log's ContextVar
        scanned = traced_scan(call)
        # select, not narrow(n - 1): an index from the end keeps no expression in the length.
        total = [y.select(dim, 0 if reverse else -1).unsqueeze(0) for y in scanned]
    else:
        found = reach(combine_fn)
        entry = knowledge(found, spec, combine_mode, leaves)
        validate_combine_fn(call, entry)
        total = None
        if pick_route(call, where(leaves), found, entry) == "cpp":
            total = kernel_reduce(combine_fn, spec, leaves, dim, reverse, found, entry)
        if total is not None:
            ran("cpp")
        else:
            ran("tree")
            if combine_mode == "pointwise" and not entry.elementwise:
                combine = checked_on_first_call(api, combine, entry, leaves)
            versions = leaf_versions(leaves)
            total = tree_reduce(combine, [x.movedim(dim, 0) for x in leaves], reverse)
            # The combines ran on views of `xs`: see fscan._routing.scan.
            check_untouched(api, spec, leaves, versions)
    if init is not None:
        total = combine([i.unsqueeze(0) for i in init], total)
    return total
