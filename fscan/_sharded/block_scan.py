"""Steps 2 to 5 of the deterministic sharded scan (:mod:`fscan._sharded.deterministic`)
on one rank's pieces: :func:`scan_blocks`, given the block plan
(:mod:`fscan._sharded.blocks`) and ``combine_fn`` on flat leaves.

Every ``combine_fn`` call goes through :mod:`fscan._sharded.fixed_batch`; every
exchange is :func:`~fscan._sharded.exchange.exchange`'s ``all_gather`` (its backward
a ``reduce_scatter``), and the results are tied to the last gathered buffer, with
the totals tied to the rows before them, so that every rank runs the backward
collectives, in one order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._combine import FlatCombine
from .blocks import Piece, Plan
from .exchange import exchange, tie
from .fixed_batch import combine_rows, dense, fold_blocks, rows_per_call

__all__ = ["gathered", "scan_blocks"]


def scan_blocks(
    combine: FlatCombine,
    plan: Plan,
    pieces: list[Piece],
    own: list[list[torch.Tensor]],
    pg: Any,
    anchors: list[torch.Tensor],
) -> tuple[list[list[list[torch.Tensor]]], torch.Tensor | None]:
    """Steps 2 to 5 of :mod:`fscan._sharded.deterministic` on this rank's pieces (``own[p]``: the
    leaves of its piece ``p``, scan order, steps first): for each piece and leaf, the
    parts of its results in order; and the last gathered buffer (None: nothing was
    exchanged), which every rank's results must depend on (:func:`tie`)."""
    like = own[0]
    # 2. the steps of the blocks that reach into a piece from before it
    others, anchor = None, None  # every rank's segments, (W, rows, ...) per leaf
    if plan.segment_rows:
        sent = [_segments(plan, pieces, own, i) for i in range(len(like))]
        others, anchor = gathered(sent, pg, anchors)
    # 3. every block a piece touches, from the block's first step, folded left to right:
    # all of them in one tensor (G, B, ...), G padded to whole calls
    parts, firsts, count = [[] for _ in like], [], 0
    for piece, xs in zip(pieces, own):
        firsts.append(count)
        if piece.length:
            blocks = plan.last_block(piece) - plan.first_block(piece) + 1
            before = piece.start - plan.first_block(piece) * plan.size  # the prefix's steps
            runs = plan.prefix(piece)
            for i, x in enumerate(xs):
                prefix = [others[i][r, row : row + c] for r, row, c in runs]
                pad = blocks * plan.size - before - x.shape[0]
                parts[i] += [*prefix, x, _copies(x[-1:], pad)]
            count += blocks
    folded = []
    if count:
        rows = rows_per_call([x[:1] for x in like], count)
        pad = (-count % rows) * plan.size
        whole = [torch.cat([*p, _copies(p[0][:1], pad)]) for p in parts]
        blocks = [x.reshape(-1, plan.size, *x.shape[1:]) for x in whole]
        folded = [x.flatten(0, 1) for x in fold_blocks(combine, blocks)]  # steps in order
    # 4. every block's total, folded one by one in global order into the carries
    carries: list[list[torch.Tensor]] = []
    if plan.count > 1:
        sent = _totals(plan, pieces, firsts, folded, like)
        if anchor is not None:  # every rank: the totals' backward before the rows'
            sent = tie(anchor, sent)
        totals, anchor = gathered(sent, pg, anchors)
        carries = _carries(combine, plan, pieces, totals)
    # 5. the steps of every block after the first: the block's carry in front
    parts = [
        _carried(combine, plan, piece, folded, first, carries) if piece.length else [[]] * len(like)
        for piece, first in zip(pieces, firsts)
    ]
    return parts, anchor


def gathered(
    sent: list[torch.Tensor], pg: Any, anchors: list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Every rank's ``sent``, ``(W, ...)`` per leaf, and the buffer to tie results to
    (:func:`~fscan._sharded.exchange.exchange`); a group of one keeps its own (the same
    values: the exchange moves them exactly) and needs no backward collective."""
    if dist.get_world_size(pg) == 1:
        return [x.unsqueeze(0) for x in sent], None
    return exchange(sent, pg, anchors)


def _copies(row: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` copies of ``row`` (a block's padding: real values, results dropped)."""
    return row.expand(rows, *row.shape[1:])


def _zeros(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``rows`` zero rows shaped like ``x``'s, computed from ``x`` where it is inexact (a
    sum over no rows: exact zeros in the graph, so the send buffer of a rank without
    data still leads to its input, as every rank's must: see fscan._sharded.scan)."""
    if x.is_floating_point() or x.is_complex():
        return x[:0].sum(0, keepdim=True).expand(rows, *x.shape[1:])
    return x.new_zeros(rows, *x.shape[1:])


def _segments(
    plan: Plan, pieces: list[Piece], own: list[list[torch.Tensor]], i: int
) -> torch.Tensor:
    """Leaf ``i``'s rows that later pieces need (:meth:`Plan.segment`), ``segment_rows``
    per piece, in the pieces' order."""
    parts = []
    for piece, xs in zip(pieces, own):
        span = plan.segment(piece)
        rows = xs[i][span[0] - piece.start : span[1] - piece.start] if span else xs[i][:0]
        parts += [rows, _zeros(xs[i], plan.segment_rows - rows.shape[0])]
    return torch.cat(parts)


def _totals(
    plan: Plan,
    pieces: list[Piece],
    firsts: list[int],
    folded: list[torch.Tensor],
    like: list[torch.Tensor],
) -> list[torch.Tensor]:
    """The totals of the blocks that end on this rank, in block order, padded to the
    rows every rank sends."""
    _, most = plan.total_rows
    ends = sorted(
        (k, (first + k - plan.first_block(q) + 1) * plan.size - 1)
        for q, first in zip(pieces, firsts)
        for k in plan.totals_in(q)
    )
    index = torch.tensor([row for _, row in ends], dtype=torch.long, device=like[0].device)
    sent = []
    for i, x in enumerate(like):
        mine = folded[i].index_select(0, index) if ends else x[:0]
        sent.append(torch.cat([mine, _zeros(x, most - len(ends))]))
    return sent


def _carries(
    combine: FlatCombine, plan: Plan, pieces: list[Piece], totals: list[torch.Tensor]
) -> list[list[torch.Tensor]]:
    """``carries[k]``, the carry into block ``k`` (``carries[0]`` unused): the totals of
    blocks ``0 .. k-1`` folded one by one, one-row calls, up to this rank's last block."""
    last = max((plan.last_block(q) for q in pieces if q.length), default=0)
    if not last:
        return []
    at, most = plan.total_rows
    index = [r * most + i for r, i in (at[k] for k in range(last))]
    where = torch.tensor(index, dtype=torch.long, device=totals[0].device)
    # one row per total, (1, ...) each: the same shape for every rank's calls
    rows = [t.flatten(0, 1).index_select(0, where).unsqueeze(1).unbind(0) for t in totals]
    carry = [r[0] for r in rows]
    carries = [carry, carry]
    for k in range(1, last):
        carry = dense(combine(carry, [r[k] for r in rows]))
        carries.append(carry)
    return carries


def _carried(
    combine: FlatCombine,
    plan: Plan,
    piece: Piece,
    folded: list[torch.Tensor],
    first: int,
    carries: list[list[torch.Tensor]],
) -> list[list[torch.Tensor]]:
    """A non-empty piece's results, as parts per leaf: its steps' block folds, with
    their block's carry in front from the second block of the sequence on."""
    k0, k1 = plan.first_block(piece), plan.last_block(piece)
    begin = first * plan.size + piece.start - k0 * plan.size  # the piece's first step
    mine = [f[begin : begin + piece.length] for f in folded]
    head = max(0, min(plan.size, piece.stop) - piece.start)  # steps in block 0: no carry
    if head == piece.length:
        return [[x] for x in mine]
    counts = [
        (k, min(piece.stop, (k + 1) * plan.size) - max(piece.start, k * plan.size))
        for k in range(max(k0, 1), k1 + 1)
    ]
    # row r of the carried steps takes its block's carry (an index, then one gather: a
    # tensor's own repeat_interleave is far slower on CPU)
    repeats = torch.tensor([c for _, c in counts], device=mine[0].device)
    which = torch.arange(len(counts), device=repeats.device)
    which = which.repeat_interleave(repeats, output_size=piece.length - head)
    lefts = [
        torch.cat([carries[k][i] for k, _ in counts]).index_select(0, which)
        for i in range(len(mine))
    ]
    fixed = combine_rows(combine, lefts, [x[head:] for x in mine])
    return [([x[:head]] if head else []) + f for x, f in zip(mine, fixed)]
