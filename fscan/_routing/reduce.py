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

The repeat route: a call identical, in everything the route depends on, to one the
reduce kernel served runs that kernel again without the checks and lookups (a reduce of
64 elements spent ~13 µs above a ~1 µs kernel). Once :func:`reduce_flat` served a call
with no ``initial`` on the kernel, :func:`remember_reduce` stores its
:class:`~fscan._engines.cpp._kernel_reduce.PreparedReduce` under the scan repeat
route's key (:func:`~fscan._routing.repeat_key.call_parts`: ``combine_fn``'s reach key
and captured places, the pytree, each leaf's dtype, shape and requires_grad, ``dim``,
``reverse``, ``combine_mode``, ``validate``, grad mode, ``fscan.config.validate``), on
the same terms: only calls that route could repeat (plain contiguous CPU leaves, no
transform, no tracing, ...) and only once the checks ``validate`` asks for ran for the
key. ``fscan.associative_reduce`` asks :func:`repeat_reduce` first; the engine is noted
as ``cpp``, as the full route notes it. The store is bounded and cleared by
``fscan.clear_caches()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._cache import BoundedCache
from .._call import ScanCall
from .._combine import flat_combine
from .._config import config
from .._context import where
from .._engines.cpp._kernel_reduce import PreparedReduce, kernel_reduce, prepare_reduce, run_reduce
from .._engines.reduce import tree_reduce
from .._engines.traced import traced_scan
from .._knowledge.pointwise_check import checked_on_first_call
from .._knowledge.store import Knowledge, Reach, knowledge, on_clear, reach
from .._knowledge.validate import validate_combine_fn
from .._pytree import LEAF, unflatten
from .._route_log import ran
from .repeat_key import call_parts, stored_run
from .scan import check_untouched, leaf_versions, pick_route

__all__ = ["reduce_flat", "remember_reduce", "repeat_reduce", "repeated_reduces"]

# Keys of calls the reduce kernel served (each a few shapes of a few combine_fns, typically).
repeated_reduces: BoundedCache[PreparedReduce] = BoundedCache(maxsize=256)
on_clear(repeated_reduces.clear)


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
            if init is None:  # for the calls identical to this one (module doc)
                remember_reduce(call, found, entry)
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


def repeat_reduce(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: Any,
    reverse: Any,
    combine_mode: Any,
    validate: Any,
) -> Any:
    """The total of ``xs`` by the reduce kernel a call with the same key ran on (module
    doc), as a pytree of ``xs``'s structure with ``dim`` removed, in new memory; None
    where no such call was stored (or the captured tensors no longer broadcast): the
    caller then takes the full path."""
    stored = stored_run(repeated_reduces, combine_fn, xs, dim, reverse, combine_mode, validate)
    if stored is None:
        return None
    run, leaves, spec, found = stored
    totals = run_reduce(run, leaves, found.tensors)
    if totals is None:
        return None
    ran("cpp")
    return totals[0] if spec is LEAF else unflatten(spec, totals)


def remember_reduce(call: ScanCall, found: Reach, entry: Knowledge) -> None:
    """Store the reduce kernel that just served ``call`` (no ``initial``) on the full
    route, for the calls :func:`repeat_reduce` finds identical to it: where the checks
    ``validate`` asks for will not run again for the key (as the scan's repeat route)."""
    validate = call.validate
    if not entry.pure:
        return
    if validate is None:  # the full path checks on every call, or once: checked?
        if config._validate or not entry.associativity_checked:
            return
    elif validate is not False:
        return
    if found.key is None or (found.tensors and found.aliases is None):
        return
    leaves, dim = call.leaves, call.dim
    parts = call_parts(call.spec, leaves, dim, call.reverse, call.combine_mode, validate)
    if parts is None:
        return
    key = (found.key, found.aliases, *parts)
    if key not in repeated_reduces:
        aliases = found.aliases if found.tensors else ()
        run = prepare_reduce(entry, aliases, leaves, dim, call.reverse)
        if run is not None:
            repeated_reduces.put(key, run)
