"""The parallel-scan paths of the drop-in cumulative ops (see :mod:`fscan._ops`).

Two scans, both on the public ``fscan.associative_scan``:

* :func:`blocked_scan`, for sums, products and log-sum-exp. A tree scan rounds
  each output about ``log2 n`` times, while torch's CPU kernels accumulate in a
  wider type and round once (float32 sums in float64): a plain float32 tree is
  4-8x less accurate at ``n = 2**22``. Computing the whole tree in float64
  costs two extra casts and twice the memory traffic. Instead the scan is done
  in two levels: a tree within blocks of ``BLOCK`` steps in the working dtype
  (few roundings of small partial results), the running totals across blocks
  in the accumulation dtype (float64 for float32), and one final combine of
  each block's carry with its local results.
* :func:`extremum_scan`, for cummax/cummin: ``(value, index)`` pairs under
  "keep the later element if it is at least as large, or NaN", which is
  torch's rule (ties go to the later index; a NaN sticks, and a later NaN
  takes over its index). It is exact, so it needs no wider type.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._scan import associative_scan

__all__ = ["BLOCK", "blocked_scan", "extremum_scan"]

Op = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Reduce = Callable[..., torch.Tensor]
# Steps per block: 16 keeps the local tree to 4 roundings of partial sums of
# about 4 elements' size, and the carries (1/16 of the data) cheap.
BLOCK = 16


def blocked_scan(
    op: Op,
    identity: float,
    x: torch.Tensor,
    dim: int,
    reverse: bool,
    acc: torch.dtype,
    reduce: Reduce | None = None,
) -> torch.Tensor:
    """Inclusive scan of ``x`` with the elementwise, associative ``op``, carries in ``acc``.

    ``identity`` is ``op``'s neutral element (the carry into the first block).
    ``reduce(blocks, dim, dtype=acc)`` (``torch.sum``, ``torch.prod``) totals each
    block straight from ``x`` in ``acc``; without it the totals are read off the
    local scans, whose roundings then add up along the carries.

    Example:
        >>> blocked_scan(torch.add, 0.0, torch.ones(40, 2), 0, False, torch.float64)[-1]
        tensor([40., 40.])
    """
    n = x.shape[dim]
    if n < 2 * BLOCK:
        return associative_scan(op, x, dim, reverse)
    tail = n % BLOCK
    start = tail if reverse else 0
    blocks = x.narrow(dim, start, n - tail).unflatten(dim, (-1, BLOCK))
    local = associative_scan(op, blocks, dim + 1, reverse)
    if reduce is None:
        totals = local.select(dim + 1, 0 if reverse else BLOCK - 1).to(acc)
    else:
        totals = reduce(blocks, dim + 1, dtype=acc)
    carries = associative_scan(op, totals, dim, reverse)
    entering = _entering(carries, dim, identity, reverse)
    main = _carry_into(op, entering.unsqueeze(dim + 1), local).flatten(dim, dim + 1)
    if not tail:
        return main
    last = carries.narrow(dim, 0 if reverse else carries.shape[dim] - 1, 1)
    rest = associative_scan(op, x.narrow(dim, 0 if reverse else n - tail, tail), dim, reverse)
    rest = _carry_into(op, last, rest)
    return torch.cat([rest, main] if reverse else [main, rest], dim)


def _carry_into(op: Op, carry: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``op(carry, local)`` in ``local``'s dtype, rounded once like torch's kernels.

    A sum splits the wide carry into ``hi + lo`` of the narrow type and adds
    ``(local + lo) + hi``: as accurate as adding in the wide type, at a third of
    the cost (no wide copy of ``local``). Other ops combine in the wide type.
    """
    if carry.dtype == local.dtype:
        return op(carry, local)
    if op is torch.add:
        hi = carry.to(local.dtype)
        # inf - inf would make lo NaN where the carry is infinite: lo is 0 there.
        lo = torch.where(hi.isfinite(), carry - hi, 0).to(local.dtype)
        return (local + lo) + hi
    return op(carry, local.to(carry.dtype)).to(local.dtype)


def _entering(carries: torch.Tensor, dim: int, identity: float, reverse: bool) -> torch.Tensor:
    """The carry into each block: the previous block's inclusive total, ``identity`` first."""
    count = carries.shape[dim]
    first = torch.full_like(carries.narrow(dim, 0, 1), identity)
    if reverse:
        return torch.cat([carries.narrow(dim, 1, count - 1), first], dim)
    return torch.cat([first, carries.narrow(dim, 0, count - 1)], dim)


def extremum_scan(
    x: torch.Tensor, dim: int, reverse: bool, largest: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, indices)`` of the running max (``largest``) or min of ``x`` along ``dim``.

    With ``reverse`` the indices still refer to positions in ``x``, and ties go to
    the element met later in scan order (the smaller index), as flip, cummax, flip.

    Example:
        >>> extremum_scan(torch.tensor([1.0, 3.0, 3.0, 2.0]), 0, False, True)
        (tensor([1., 3., 3., 3.]), tensor([0, 1, 2, 2]))
    """
    n = x.shape[dim]
    index = torch.arange(n, device=x.device).view([n] + [1] * (x.ndim - dim - 1))
    combine = _keep_max if largest else _keep_min
    values, indices = associative_scan(combine, (x, index.expand(x.shape)), dim, reverse)
    return values, indices


def _keep_max(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    """``b`` (the later element in scan order) if ``b >= a`` or ``b`` is NaN, else ``a``."""
    take = (b[0] >= a[0]) | torch.isnan(b[0])
    return torch.where(take, b[0], a[0]), torch.where(take, b[1], a[1])


def _keep_min(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]):
    take = (b[0] <= a[0]) | torch.isnan(b[0])
    return torch.where(take, b[0], a[0]), torch.where(take, b[1], a[1])
