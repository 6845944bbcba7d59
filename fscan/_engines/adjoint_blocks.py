"""The Jacobian blocks of a scan's steps, gathered for the adjoint's reverse scan.

:func:`jacobian_blocks` reads the per-position L x L blocks ``J^T = d out / d left`` of
a batch of steps (one backward pass per output leaf: positions do not mix in pointwise
mode); :class:`StepBlocks` gathers them over the steps into full-length tensors, one
per nonzero entry (a structural zero costs nothing), written into one preallocated
buffer per entry or, when the backward must itself be differentiable, concatenated
(:class:`Rows`); :func:`closed_pattern` is the set of entries a product of blocks can
fill, which the adjoint's affine scan carries (:mod:`fscan._engines.adjoint`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .affine import BlockIndex

__all__ = ["Rows", "StepBlocks", "closed_pattern", "jacobian_blocks"]


class Rows:
    """A tensor of ``n`` rows built from pieces: written into one preallocated buffer,
    or, when the backward must itself be differentiable, concatenated."""

    def __init__(self, n: int, like: torch.Tensor, differentiable: bool) -> None:
        self.n, self.like, self.differentiable = n, like, differentiable
        self.pieces: list[tuple[int, torch.Tensor]] = []
        shape = (n, *like.shape[1:])
        self.buffer = None if differentiable else like.new_empty(shape)

    def write(self, at: slice, value: torch.Tensor | None) -> None:
        if self.buffer is None:
            zeros = lambda: self.like.new_zeros((at.stop - at.start, *self.like.shape[1:]))
            self.pieces.append((at.start, zeros() if value is None else value))
        elif value is None:
            self.buffer[at].zero_()
        else:
            self.buffer[at].copy_(value)

    def read(self, at: slice) -> torch.Tensor:
        assert self.buffer is not None, "only buffered rows are read back"
        return self.buffer[at]

    def result(self) -> torch.Tensor:
        if self.buffer is not None:
            return self.buffer
        return torch.cat([v for _, v in sorted(self.pieces, key=lambda p: p[0])])


class StepBlocks:
    """The blocks ``M[t] = J^T`` of every step, gathered per entry into ``n``-row tensors.

    The step at the far edge (last, or first if reversed) multiplies nothing: its
    row is zero. While every block seen is ``a * I`` (first-order only), only
    ``a`` is kept: the recurrence then carries one tensor instead of L.
    """

    def __init__(
        self, n: int, n_leaves: int, shift: int, like: torch.Tensor, differentiable: bool
    ) -> None:
        self.n, self.n_leaves, self.like, self.differentiable = n, n_leaves, like, differentiable
        self.pad = slice(0, 1) if shift else slice(n - 1, n)
        self.rows: dict[BlockIndex, Rows] = {}
        self.written: list[slice] = []
        self.scalar = not differentiable

    def add(self, at: slice, blocks: dict[BlockIndex, torch.Tensor]) -> None:
        if self.scalar and not _is_scalar_identity(blocks, self.n_leaves):
            self.scalar = False
            for j in range(1, self.n_leaves):  # the diagonal so far was `a` throughout
                self.rows[(j, j)] = self._new_rows()
                for done in self.written:
                    self.rows[(j, j)].write(done, self.rows[(0, 0)].read(done))
        for entry, block in blocks.items():
            if self.scalar and entry != (0, 0):
                continue
            if entry not in self.rows:
                self.rows[entry] = self._new_rows()
            self.rows[entry].write(at, block)
        for entry, rows in self.rows.items():
            if entry not in blocks:
                rows.write(at, None)
        self.written.append(at)

    def _new_rows(self) -> Rows:
        """Rows for an entry first seen now: zero at the edge and at every earlier step."""
        rows = Rows(self.n, self.like, self.differentiable)
        for at in [self.pad, *self.written]:
            rows.write(at, None)
        return rows

    def finish(self) -> tuple[list[BlockIndex], dict[BlockIndex, torch.Tensor]]:
        """The entries to carry (closed under products) and the full-length blocks."""
        if self.scalar and self.rows:
            return [(0, 0)], {(0, 0): self.rows.pop((0, 0)).result()}
        pattern = closed_pattern(set(self.rows))
        return pattern, {e: self.rows.pop(e).result() for e in list(self.rows)}


def jacobian_blocks(
    outs: Sequence[torch.Tensor], lefts: Sequence[torch.Tensor], create_graph: bool
) -> dict[BlockIndex, torch.Tensor]:
    """``M[(j, k)] = d outs[k] / d lefts[j]`` per position, i.e. ``J^T``; absent = zero.

    One backward pass per output leaf with a cotangent of ones reads a whole
    column of every per-position block at once, because positions do not mix.
    """
    blocks: dict[BlockIndex, torch.Tensor] = {}
    for k, out in enumerate(outs):
        if not out.requires_grad:
            continue
        ones = torch.ones((), dtype=out.dtype, device=out.device).expand(out.shape)
        cols = torch.autograd.grad(
            out, lefts, ones, retain_graph=True, create_graph=create_graph, allow_unused=True
        )
        for j, col in enumerate(cols):
            if col is not None:
                blocks[(j, k)] = col
    return blocks


def closed_pattern(entries: set[BlockIndex]) -> list[BlockIndex]:
    """The entries a product of blocks can fill: the transitive closure of the nonzeros."""
    closed = set(entries)
    while True:
        grown = closed | {(j, k) for j, m in closed for m2, k in closed if m == m2}
        if grown == closed:
            return sorted(closed)
        closed = grown


def _is_scalar_identity(blocks: dict[BlockIndex, torch.Tensor], n: int) -> bool:
    """Every block is ``a * I`` (e.g. the linear recurrence): one tensor carries all of it."""
    diagonal = [(j, j) for j in range(n)]
    if sorted(blocks) != diagonal:
        return False
    first = blocks[(0, 0)]
    return all(torch.equal(first, blocks[e]) for e in diagonal[1:])
