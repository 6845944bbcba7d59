"""The block plan of a deterministic sharded scan (:mod:`fscan._sharded.deterministic`):
host arithmetic on positions only, the same on every rank.

The whole sequence, in scan order (reversed for ``reverse=True``), is cut into blocks
of ``size`` steps aligned to its first step; ``size`` depends on the length ``n``
alone, so the blocks are the same whatever the ranks and pieces. A block that starts
before a piece and reaches into it is folded by the rank holding that piece, from
the block's first step: the rows of the block that lie on other pieces travel to it
(:meth:`Plan.segment`: each piece sends the rows of its last block, if that block
goes on past the piece). A block's total is sent by the rank holding its last step
(:meth:`Plan.totals_of`).

Example:
    >>> plan = Plan.build(order=((0,), (1,)), lengths=((3,), (6,)), reverse=False)
    >>> plan.n, plan.size, plan.count
    (9, 3, 3)
    >>> [plan.segment(p) for p in plan.pieces]  # rank 0's piece ends with block 0
    [None, None]
    >>> plan = Plan.build(order=((0,), (1,)), lengths=((4,), (5,)), reverse=False)
    >>> plan.segment(plan.piece(0, 0)), plan.prefix(plan.piece(1, 0))
    ((3, 4), [(0, 0, 1)])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

__all__ = ["Piece", "Plan", "block_size"]


def block_size(n: int) -> int:
    """The block length for a sequence of ``n`` steps: ``ceil(sqrt(n))``, which balances
    the steps folded inside a block against the block totals folded one by one.

    Example:
        >>> [block_size(n) for n in (0, 1, 2, 9, 10, 1 << 20)]
        [1, 1, 2, 3, 4, 1024]
    """
    return max(1, math.isqrt(max(n - 1, 0)) + 1) if n > 1 else 1


@dataclass(frozen=True)
class Piece:
    """One piece of the sequence: its first step in scan order, its length, where it lives."""

    start: int
    length: int
    rank: int
    slot: int  # its index among its rank's pieces (the Layout's order)

    @property
    def stop(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Plan:
    """The blocks of a sequence of ``n`` steps and the pieces of every rank, in scan order."""

    n: int
    size: int
    pieces: tuple[Piece, ...]
    world: int

    @classmethod
    def build(
        cls,
        order: tuple[tuple[int, ...], ...],
        lengths: tuple[tuple[int, ...], ...] | list[list[int]],
        reverse: bool,
    ) -> Plan:
        """The plan of a Layout's ``order`` with every piece's length (``lengths[r][p]``)."""
        placed = sorted((key, r, p) for r, row in enumerate(order) for p, key in enumerate(row))
        starts, at = {}, 0
        for _, r, p in placed:
            starts[r, p] = at
            at += lengths[r][p]
        n = at
        pieces = []
        for (r, p), start in starts.items():
            length = lengths[r][p]
            pieces.append(Piece(n - start - length if reverse else start, length, r, p))
        pieces.sort(key=lambda q: (q.start, q.length))
        return cls(n, block_size(n), tuple(pieces), len(order))

    @property
    def count(self) -> int:
        """The number of blocks."""
        return -(-self.n // self.size)

    def piece(self, rank: int, slot: int) -> Piece:
        return next(q for q in self.pieces if (q.rank, q.slot) == (rank, slot))

    def first_block(self, piece: Piece) -> int:
        return piece.start // self.size

    def last_block(self, piece: Piece) -> int:
        return (piece.stop - 1) // self.size

    def block_stop(self, k: int) -> int:
        return min((k + 1) * self.size, self.n)

    def segment(self, piece: Piece) -> tuple[int, int] | None:
        """The steps ``[u, v)`` of ``piece`` that a later piece needs: its part of its
        last block, where that block goes on past the piece (None: nothing)."""
        if not piece.length:
            return None
        k = self.last_block(piece)
        if self.block_stop(k) <= piece.stop:
            return None
        return max(piece.start, k * self.size), piece.stop

    @cached_property
    def segment_rows(self) -> int:
        """The longest segment: the rows every piece sends (padded), 0 if none."""
        spans = [s for s in map(self.segment, self.pieces) if s is not None]
        return max((v - u for u, v in spans), default=0)

    def prefix(self, piece: Piece) -> list[tuple[int, int, int]]:
        """Where the steps of ``piece``'s first block before the piece were sent:
        ``(rank, row, count)`` runs in the gathered segments, in scan order (each
        rank sends ``segment_rows`` rows per piece, in its pieces' order)."""
        begin = self.first_block(piece) * self.size
        runs = []
        for q in self.pieces:
            span = self.segment(q)
            if span is not None and span[0] >= begin and span[1] <= piece.start:
                runs.append((span[0], q.rank, q.slot * self.segment_rows, span[1] - span[0]))
        runs.sort()  # they tile the steps before the piece: the pieces tile the sequence
        return [(r, row, c) for _, r, row, c in runs]

    def totals_in(self, piece: Piece) -> range:
        """The blocks whose totals ``piece`` sends: those whose last step it holds (the
        last block's total is never needed)."""
        return range(piece.start // self.size, min(piece.stop // self.size, self.count - 1))

    @cached_property
    def total_rows(self) -> tuple[dict[int, tuple[int, int]], int]:
        """Where each block's total lies in the gathered totals, ``{block: (rank, row)}``
        (each rank sends its blocks' totals in block order), and the rows every rank
        sends (padded)."""
        at, most = {}, 0
        for r in range(self.world):
            mine = sorted(k for q in self.pieces if q.rank == r for k in self.totals_in(q))
            most = max(most, len(mine))
            at.update({k: (r, i) for i, k in enumerate(mine)})
        return at, most
