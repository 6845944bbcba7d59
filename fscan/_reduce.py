"""``fscan.associative_reduce``: the total of an associative scan, without its prefixes.

A tree reduction: combine neighbouring pairs in one call, then the pairs'
pairs, until one element is left: ``n - 1`` combines in ``ceil(log2 n)`` calls,
and no down-sweep. The scan's engine does about ``2 n`` combines (an up-sweep
and a down-sweep) and writes ``n`` outputs; the reduction does half the combine
work and keeps only halving intermediates (``n/2 + n/4 + ...`` elements, freed
level by level when nothing records them for backward).

An odd element out at some level is set aside and combined at the end, in
order (the deepest level's first), rather than concatenated onto the level:
no copy of the data per level. ``reverse=True`` reduces with the operands
swapped, ``g(a, b) = combine_fn(b, a)``, which is associative whenever
``combine_fn`` is and gives the reverse scan's first output. ``initial``
joins last, ``combine_fn(initial, total)`` in both directions: by associativity
that is the scan with ``initial`` in front (behind for ``reverse``).

Everything runs through ``combine_fn`` on plain torch ops, so autograd and
``torch.func`` transforms apply unchanged. Under ``torch.compile`` and
``torch.export`` the tree is not traced: its levels and the odd elements set
aside depend on the length, so the graph would be specialised to it (one
compile per length with ``dynamic=True``, and an export guard on its parity).
There the total is the last output of fscan's length-polymorphic traced scan
(:mod:`fscan._engines.traced`, the first output for ``reverse``): one graph for every
length, about twice the combines of the tree, which the compiled kernels fuse.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from optree import PyTreeSpec

from ._carry import check_initial
from ._checks import check_scan_args
from ._combine import FlatCombine, flat_combine
from ._engines.traced import traced_scan
from ._errors import ScanValueError
from ._knowledge.pointwise_check import checked_on_first_call
from ._knowledge.store import knowledge, reach
from ._knowledge.validate import validate_combine_fn
from ._pytree import flatten, unflatten
from ._route_log import logs_route
from ._routing.scan import check_untouched, leaf_versions

__all__ = ["associative_reduce"]

_API = "fscan.associative_reduce"


@logs_route(_API)
def associative_reduce(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    *,
    combine_mode: str = "pointwise",
    initial: Any = None,
    reverse: bool = False,
    validate: bool | None = None,
) -> Any:
    """The total ``combine_fn(...combine_fn(xs[0], xs[1])..., xs[n-1])`` along ``dim``.

    The last output of ``fscan.associative_scan`` (the first for ``reverse``) with
    half its work and memory: a tree reduction, O(n) work, O(log n) depth.

    Args:
        combine_fn: ``(pytree, pytree) -> pytree``, associative and pure, as for
            ``fscan.associative_scan``.
        xs: a tensor or a pytree of tensors of one length along ``dim``.
        dim (int): the dimension to reduce; negative counts from the end.
        combine_mode (str, default "pointwise"): as for ``fscan.associative_scan``;
            keyword-only, like every argument after ``dim``, so that a port of
            ``associative_scan(fn, xs, dim, reverse)`` cannot pass ``reverse`` here.
        initial (pytree or None, default None): one element combined in front
            (behind for ``reverse``): the result is ``combine_fn(initial, total)``.
            It is the result for an empty ``dim``, which is an error without it.
        reverse (bool, default False): reduce from the end,
            ``combine_fn(...combine_fn(xs[n-1], xs[n-2])..., xs[0])``.
        validate (bool or None, default None): as for ``fscan.associative_scan``.

    Returns:
        A pytree of the structure of ``xs`` whose leaves have ``dim`` removed, in
        new memory.

    Examples:
        >>> import fscan, torch
        >>> fscan.associative_reduce(torch.add, torch.arange(1.0, 5.0), 0)
        tensor(10.)
        >>> fscan.associative_reduce(torch.logaddexp, torch.zeros(2, 4), 1)
        tensor([1.3863, 1.3863])
        >>> shear = torch.tensor([[1.0, 1.0], [0.0, 1.0]]).expand(5, 2, 2)
        >>> fscan.associative_reduce(torch.matmul, shear, 0, combine_mode="generic")
        tensor([[1., 5.],
                [0., 1.]])
    """
    leaves, spec = flatten(xs)
    dim = check_scan_args(_API, combine_fn, xs, leaves, dim, reverse, combine_mode)
    init = None if initial is None else check_initial(_API, initial, xs, leaves, spec, dim)
    n = leaves[0].shape[dim]
    if n == 0:
        if init is None:
            raise ScanValueError(
                f"{_API}: `xs` has length 0 along dim {dim} and there is no `initial` to "
                "return; pass `initial=` (the identity of `combine_fn`, say)."
            )
        return unflatten(spec, [i.clone() for i in init])
    combine = flat_combine(_API, combine_fn, spec, combine_mode)
    if torch.compiler.is_compiling():  # no cache lookups or probes in a graph (module doc)
        total = traced_total(combine_fn, spec, leaves, dim, reverse, combine_mode)
    else:
        entry = knowledge(reach(combine_fn), spec, combine_mode, leaves)
        validate_combine_fn(_API, combine_fn, spec, leaves, dim, combine_mode, validate, entry)
        if combine_mode == "pointwise" and not entry.elementwise:
            combine = checked_on_first_call(_API, combine, entry, leaves)
        versions = leaf_versions(leaves)
        moved = [x.movedim(dim, 0) for x in leaves]
        total = tree_reduce(_swapped(combine) if reverse else combine, moved)
        # The combines ran on views of `xs`: see fscan._routing.
        check_untouched(_API, spec, leaves, versions)
    if init is not None:
        total = combine([i.unsqueeze(0) for i in init], total)
    # One element's copy: the total may be an input's view (length 1, or a combine_fn
    # returning an operand), and outputs never alias inputs; cheap next to n elements.
    return unflatten(spec, [t.squeeze(0).clone() for t in total])


def traced_total(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    combine_mode: str,
) -> list[torch.Tensor]:
    """The total while ``torch.compile``/``torch.export`` traces: the traced scan's last
    output (first for ``reverse``), a batch of one element, for any length (module doc).

    Example:
        >>> import optree
        >>> leaves, spec = optree.tree_flatten(torch.arange(1.0, 6.0))
        >>> traced_total(torch.add, spec, leaves, 0, False, "pointwise")
        [tensor([15.])]
    """
    scanned = traced_scan(_API, combine_fn, spec, leaves, dim, reverse, combine_mode)
    # select, not narrow(n - 1): an index from the end keeps no expression in the length.
    return [y.select(dim, 0 if reverse else -1).unsqueeze(0) for y in scanned]


def tree_reduce(combine: FlatCombine, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Reduce flat ``xs`` (scan dimension first, length >= 1) to a batch of one element.

    Example:
        >>> tree_reduce(lambda a, b: [a[0] + b[0]], [torch.arange(5.0)])
        [tensor([10.])]
    """
    level = list(xs)
    odd_ones: list[list[torch.Tensor]] = []  # set aside, shallowest level first
    while level[0].shape[0] > 1:
        m = level[0].shape[0]
        if m % 2:
            odd_ones.append([x.narrow(0, m - 1, 1) for x in level])
        pairs = 2 * (m // 2)
        level = combine([x[0:pairs:2] for x in level], [x[1:pairs:2] for x in level])
    total = level
    for odd in reversed(odd_ones):  # each covers steps after everything reduced before it
        total = combine(total, odd)
    return total


def _swapped(combine: FlatCombine) -> FlatCombine:
    """``combine`` with its operands swapped: reducing in index order with it is the
    reverse reduction, ``f(...f(x[n-1], x[n-2])..., x[0])``."""

    def swapped(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return combine(b, a)

    return swapped
