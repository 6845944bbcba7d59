"""``combine_fn`` calls whose rounding does not depend on the batch: the calls of the
deterministic sharded scan (:mod:`fscan._sharded.deterministic`).

A deterministic scan must round every step the same way whichever rank computes it
and whatever else that rank holds. For correctly rounded operations (``+``, ``*``,
``max``, ``where``, a fused-multiply-add-free affine map) that is automatic. It is
not for torch's CPU kernels of transcendental functions (``exp``, ``log1p``, so a
``logaddexp`` combine): an elementwise kernel runs a vectorised body over its first
elements and a scalar loop over the last few (fewer than two vectors), and the two
may differ in the last bit; from ``GRAIN`` numbers on, torch also splits the work
among threads, each part with its own tail. So the rounding of one element would
depend on how many elements share its call.

Every batched call here therefore holds ``rows_per_call`` rows (padded with copies
of real rows, whose results are dropped), contiguous, with a multiple of
``VECTOR`` numbers in every leaf and at most ``BUDGET`` of them: a multiple of two
vectors of every width torch uses (AVX-512 bytes included), so no number reaches a
scalar tail, and below the threading grain (with room for intermediates), so one
thread runs it. Where no such row count exists (elements of over ``BUDGET /
VECTOR`` numbers whose sizes do not allow it), each call holds one row: the same
shape for every element, so the same positions and the same rounding (for
elements of ``GRAIN`` numbers or more, torch splits that row among its threads:
bitwise only for the same thread count).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .._combine import FlatCombine

__all__ = ["combine_rows", "dense", "fold_blocks", "rows_per_call"]

GRAIN = 32768  # at::internal::GRAIN_SIZE: elementwise ops split among threads from here
BUDGET = GRAIN // 2  # numbers per leaf in one call; half the grain, for intermediates
VECTOR = 64  # two vectors of the widest CPU vector type (AVX-512 of 8-bit numbers)


def rows_per_call(leaves: Sequence[torch.Tensor], count: int | None = None) -> int:
    """The rows (elements, along dimension 0) of every batched call on ``leaves``, for a
    batch of ``count`` rows (None: as many as fit).

    Example:
        >>> rows_per_call([torch.zeros(5, 3), torch.zeros(5, 1, dtype=torch.bool)])
        5440
        >>> rows_per_call([torch.zeros(5, 3)], count=5)  # a multiple of 64 numbers
        64
        >>> rows_per_call([torch.zeros(5, 64)], count=363)  # two calls of 182 rows
        182
        >>> rows_per_call([torch.zeros(5, 64)]), rows_per_call([torch.zeros(5, 1001)])
        (256, 1)
    """
    sizes = [max(1, math.prod(x.shape[1:])) for x in leaves]
    step = math.lcm(*(VECTOR // math.gcd(VECTOR, e) for e in sizes))
    fits = BUDGET // (step * max(sizes))
    if not fits:
        return 1
    if count is None:
        return step * fits
    calls = -(-count // (step * fits))  # as few calls as fit, as even as the step allows
    return step * -(-count // (calls * step))


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with ``rows`` more copies of its first row (real data: ``combine_fn`` sees
    only values it could meet, and their results are dropped)."""
    if not rows:
        return x
    return torch.cat([x, x[:1].expand(rows, *x.shape[1:])])


def combine_rows(
    combine: FlatCombine, lefts: list[torch.Tensor], rights: list[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """``combine(lefts[i], rights[i])`` for every row ``i`` (dimension 0; contiguous
    leaves), in calls of :func:`rows_per_call` rows: for each leaf, the calls' results
    in order, for the caller to concatenate."""
    n = rights[0].shape[0]
    rows = rows_per_call(rights, n)
    # split, not slices: a slice's backward fills a tensor the size of the whole
    # operand for every call, split's concatenates once
    lefts, rights = [x.split(rows) for x in lefts], [x.split(rows) for x in rights]
    outs = []
    for left, right in zip(zip(*lefts), zip(*rights)):
        rest = right[0].shape[0]
        if rest == rows:
            outs.append(combine(list(left), list(right)))
        else:  # the last call, padded to a whole one
            pad = [_padded(x, rows - rest) for x in (*left, *right)]
            out = combine(pad[: len(left)], pad[len(left) :])
            outs.append([x[:rest] for x in out])
    return [list(col) for col in zip(*outs)]


def fold_blocks(combine: FlatCombine, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inclusive scan of each block, folded left to right: ``blocks`` are leaves of
    shape ``(G, size, *element)``, ``G`` a multiple of :func:`rows_per_call` (pad it
    with copies of real blocks); step ``j`` of each ``rows_per_call`` blocks is one
    call ``acc = combine(acc, x[:, j])``. Returns leaves of the same shape."""
    count, size = blocks[0].shape[:2]
    rows = rows_per_call([x[:, 0] for x in blocks], count)
    # (size, G, ...): step j of a call's blocks is one contiguous batch
    steps = [x.transpose(0, 1).contiguous() for x in blocks]
    outs = []
    for calls in zip(*(x.split(rows, dim=1) for x in steps)):  # split: see combine_rows
        views = [x.unbind(0) for x in calls]
        acc = [v[0] for v in views]
        folded = [acc]
        for j in range(1, size):
            acc = dense(combine(acc, [v[j] for v in views]))
            folded.append(acc)
        outs.append([torch.stack(col, 1) for col in zip(*folded)])  # (rows, size, ...)
    return [torch.cat(col) if len(col) > 1 else col[0] for col in zip(*outs)]


def dense(out: list[torch.Tensor]) -> list[torch.Tensor]:
    """``combine_fn``'s results as contiguous tensors: the next call's operands must lie
    as every other rank's do."""
    return [x.contiguous() for x in out]
