"""The blocked engine of the drop-in cumulative ops: ``fscan.cumsum`` & co. as scans.

Two scans, whose inner scans (of one cheap elementwise op each) are the ``scan``
they are handed: :mod:`fscan._routing.cumulative` passes in a scan it routes as
any of fscan's own, so this engine chooses no other.

* :func:`blocked_scan`, for sums, products and log-sum-exp. A tree scan rounds
  each output about ``log2 n`` times, while torch's CPU kernels accumulate in a
  wider type and round once (float32 sums in float64): a plain float32 tree is
  3-5x less accurate at ``n = 2**22``, and a float64 tree doubles the memory
  traffic. So the scan runs in two levels: the handed-in scan within blocks of
  ``BLOCK`` steps in the working dtype (few roundings of small partial results),
  the block totals and the carries across blocks in the wide dtype (float64 for
  float32), and one final combine of each block's carry with its local results.
* :func:`extremum_scan`, for cummax/cummin, with torch's rule: an element takes
  over the index if it is at least as large as the running maximum, or NaN
  (ties go to the later index; a NaN sticks, and a later NaN takes over its
  index). It is exact, so it needs no wider type.

:func:`accumulate` runs :func:`blocked_scan` in torch's accumulation types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "BLOCK",
    "LOGSUMEXP",
    "PRODUCT",
    "SUM",
    "Accumulation",
    "Op",
    "Scan",
    "accumulate",
    "blocked_scan",
    "extremum_scan",
]

Op = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# scan(op, x, dim, reverse): the inclusive scan of the tensor x along dim by the
# elementwise op, from the router (module doc).
Scan = Callable[[Op, torch.Tensor, int, bool], torch.Tensor]
# Steps per block: 16 keeps the local tree to 4 roundings of partial results
# of a few elements' size, and the carries to 1/16 of the data.
BLOCK = 16


@dataclass(frozen=True)
class Accumulation:
    """What :func:`blocked_scan` needs to know about an operation."""

    op: Op  # the elementwise, associative, commutative combine
    identity: float  # its neutral element: the carry into the first block
    native: Callable[..., torch.Tensor]  # torch's scan, run on the block totals
    reduce: Callable[..., torch.Tensor] | None  # totals each block in the wide dtype


SUM = Accumulation(torch.add, 0.0, torch.cumsum, torch.sum)
PRODUCT = Accumulation(torch.mul, 1.0, torch.cumprod, torch.prod)
# No reduction takes a dtype here; log-sum-exp does not accumulate roundings the
# way a sum does anyway, so its totals are read off the local scans.
LOGSUMEXP = Accumulation(torch.logaddexp, float("-inf"), torch.logcumsumexp, None)


# The dtype blocked_scan works in and the one its carries are in, where they are not
# the input's: torch's accumulation types (half types and float32 carried in float64).
_WORK_AND_WIDE = {
    torch.float16: (torch.float32, torch.float64),
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float32: (torch.float32, torch.float64),
    torch.complex64: (torch.complex64, torch.complex128),
}


def accumulate(
    how: Accumulation, x: torch.Tensor, dim: int, reverse: bool, scan: Scan
) -> torch.Tensor:
    """:func:`blocked_scan` in torch's accumulation types, the result in ``x``'s dtype.

    Example:
        >>> from fscan._engines.tree import scan_functional_along
        >>> def scan(op, x, dim, reverse):
        ...     return scan_functional_along(lambda a, b: [op(a[0], b[0])], [x], dim, reverse)[0]
        >>> accumulate(SUM, torch.ones(40, dtype=torch.float16), 0, False, scan)[-1]
        tensor(40., dtype=torch.float16)
    """
    work, wide = _WORK_AND_WIDE.get(x.dtype, (x.dtype, x.dtype))
    return blocked_scan(how, x.to(work), dim, reverse, wide, scan).to(x.dtype)


def blocked_scan(
    how: Accumulation, x: torch.Tensor, dim: int, reverse: bool, wide: torch.dtype, scan: Scan
) -> torch.Tensor:
    """Inclusive scan of ``x`` along ``dim`` with ``how.op``; carries in the ``wide`` dtype.

    1. Scan within blocks of ``BLOCK`` steps with ``scan`` (fscan's parallel scan),
       in ``x``'s dtype.
    2. Total each block in ``wide`` (``how.reduce`` straight from ``x``, else the
       last local result) and scan the totals with torch's own kernel: they are
       ``BLOCK`` times fewer, and a sequential scan in ``wide`` rounds only once.
    3. Combine each block's entering carry with its local results.

    Example:
        >>> from fscan._engines.tree import scan_functional_along
        >>> def scan(op, x, dim, reverse):
        ...     return scan_functional_along(lambda a, b: [op(a[0], b[0])], [x], dim, reverse)[0]
        >>> blocked_scan(SUM, torch.ones(40, 2), 0, False, torch.float64, scan)[-1]
        tensor([40., 40.])
    """
    n = x.shape[dim]
    if n < 2 * BLOCK:
        return scan(how.op, x, dim, reverse)
    tail = n % BLOCK
    start = tail if reverse else 0
    blocks = x.narrow(dim, start, n - tail).unflatten(dim, (-1, BLOCK))
    local = scan(how.op, blocks, dim + 1, reverse)
    if how.reduce is None:
        totals = local.select(dim + 1, 0 if reverse else BLOCK - 1).to(wide)
    else:
        totals = how.reduce(blocks, dim + 1, dtype=wide)
    carries = how.native(totals.flip(dim), dim).flip(dim) if reverse else how.native(totals, dim)
    entering = _entering(carries, dim, how.identity, reverse)
    main = _carry_into(how.op, entering.unsqueeze(dim + 1), local).flatten(dim, dim + 1)
    if not tail:
        return main
    last = carries.narrow(dim, 0 if reverse else carries.shape[dim] - 1, 1)
    rest = scan(how.op, x.narrow(dim, 0 if reverse else n - tail, tail), dim, reverse)
    rest = _carry_into(how.op, last, rest)
    return torch.cat([rest, main] if reverse else [main, rest], dim)


def _carry_into(op: Op, carry: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``op(carry, local)`` in ``local``'s dtype, for a ``carry`` in a wider dtype.

    Sums split the carry into ``hi + lo`` of the narrow dtype and add
    ``(local + lo) + hi``: as accurate as adding in the wide dtype (the result is
    rounded once, as in torch's kernels), without a wide copy of ``local``. Other
    ops (products, log-sum-exp) combine with the carry rounded to the narrow
    dtype: one extra rounding, about 1.4x torch's error.
    """
    if carry.dtype == local.dtype:
        return op(carry, local)
    hi = carry.to(local.dtype)
    if op is not torch.add:
        return op(hi, local)
    # inf - inf would make lo NaN where the carry is infinite: lo is 0 there.
    lo = torch.where(hi.isfinite(), carry - hi, 0).to(local.dtype)
    return (local + lo) + hi


def _entering(carries: torch.Tensor, dim: int, identity: float, reverse: bool) -> torch.Tensor:
    """The carry into each block: the previous block's inclusive total, ``identity`` first."""
    count = carries.shape[dim]
    first = torch.full_like(carries.narrow(dim, 0, 1), identity)
    if reverse:
        return torch.cat([carries.narrow(dim, 1, count - 1), first], dim)
    return torch.cat([first, carries.narrow(dim, 0, count - 1)], dim)


def extremum_scan(
    x: torch.Tensor, dim: int, reverse: bool, largest: bool, scan: Scan
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the running max (``largest``) or min of ``x`` along ``dim``.

    With ``reverse`` the indices still refer to positions in ``x``, and ties go to
    the element met later in scan order (the smaller index), as flip, cummax, flip.

    Two scans of a single cheap op each, rather than one over ``(value, index)``
    pairs (five ops per combine): the running extreme with ``torch.maximum`` (it
    propagates NaN), then the index as the running latest position that took
    over, i.e. was at least as good as the extreme before it, or NaN. The values
    are then gathered at the indices, which gives torch's gradient exactly (all
    of it to the chosen element, ties included).

    Example:
        >>> from fscan._engines.tree import scan_functional_along
        >>> def scan(op, x, dim, reverse):
        ...     return scan_functional_along(lambda a, b: [op(a[0], b[0])], [x], dim, reverse)[0]
        >>> extremum_scan(torch.tensor([1.0, 3.0, 3.0, 2.0]), 0, False, True, scan)
        (tensor([1., 3., 3., 3.]), tensor([0, 1, 2, 2]))
    """
    n = x.shape[dim]
    with torch.no_grad():
        best = torch.maximum if largest else torch.minimum
        running = scan(best, x, dim, reverse)
        marks = _takeovers(x, running, dim, reverse, largest)
        latest = torch.minimum if reverse else torch.maximum
        indices = scan(latest, marks, dim, reverse).long() if n else marks.long()
    return x.gather(dim, indices), indices


def _takeovers(
    x: torch.Tensor, running: torch.Tensor, dim: int, reverse: bool, largest: bool
) -> torch.Tensor:
    """Each step's position where it takes over the index, else the scan's start."""
    n = x.shape[dim]
    start = n - 1 if reverse else 0
    index_dtype = torch.int32 if n < 2**31 else torch.int64  # half the traffic of int64
    first = torch.full_like(x.narrow(dim, 0, min(n, 1)), start, dtype=index_dtype)
    if n < 2:
        return first
    steps = x.narrow(dim, 0, n - 1) if reverse else x.narrow(dim, 1, n - 1)
    before = running.narrow(dim, 1, n - 1) if reverse else running.narrow(dim, 0, n - 1)
    takes = (steps >= before) if largest else (steps <= before)
    takes |= steps.isnan()
    low = 0 if reverse else 1
    positions = torch.arange(low, low + n - 1, dtype=index_dtype, device=x.device)
    positions = positions.view([n - 1] + [1] * (x.ndim - dim - 1))
    marks = torch.where(takes, positions, start)
    return torch.cat([marks, first] if reverse else [first, marks], dim)
