"""The tree reduction: the total of an associative scan in ``ceil(log2 n)`` combine calls.

Combine neighbouring pairs in one call, then the pairs' pairs, until one element is
left: ``n - 1`` combines and no down-sweep, so half the scan's combine work, keeping
only halving intermediates (``n/2 + n/4 + ...`` elements, freed level by level when
nothing records them for backward). An odd element out at some level is set aside
and combined at the end, in order (the deepest level's first), rather than
concatenated onto the level: no copy of the data per level. Everything runs through
the flat combine on plain torch ops, so autograd and ``torch.func`` apply unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._combine import FlatCombine

__all__ = ["tree_reduce"]


def tree_reduce(
    combine: FlatCombine, xs: Sequence[torch.Tensor], reverse: bool = False
) -> list[torch.Tensor]:
    """Reduce flat ``xs`` (scan dimension first, length >= 1) to a batch of one element;
    ``reverse``: with the operands swapped, the reverse scan's first output.

    Example:
        >>> tree_reduce(lambda a, b: [a[0] + b[0]], [torch.arange(5.0)])
        [tensor([10.])]
    """
    if reverse:
        combine = _swapped(combine)
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
