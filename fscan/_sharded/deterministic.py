"""``deterministic=True``: sharded scans whose values are bitwise the same for any
number of ranks and any split of the sequence, equal to the same call on one rank
holding the whole sequence.

The default sharded scan (:mod:`fscan._sharded.scan`) combines in an order that
follows the pieces (each piece's local scan, then the totals of the pieces before
it), so its last bits change with the split. Here the order is fixed by global
position alone. Summary of the algorithm, in scan order (``reverse=True`` flips each
piece, runs forward, and flips back), with blocks of ``B = ceil(sqrt(n))`` steps
aligned to the first step (:mod:`fscan._sharded.blocks`):

1. every rank learns every piece's length (from the ``Layout``, else one
   ``all_gather``) and so the blocks;
2. the steps of a block that starts before a piece travel to the piece's rank (one
   ``all_gather`` of at most ``B - 1`` rows per piece), so that every block a rank
   touches is whole up to its last step there;
3. each block is folded left to right, ``y[j] = (((x[0] . x[1]) . x[2]) ... x[j])``,
   step ``j`` of all of a rank's blocks in one batched call
   (:func:`~fscan._sharded.fixed_batch.fold_blocks`);
4. the block totals travel to every rank (one ``all_gather``) and each rank folds
   them one by one in global order into the carry into block ``k``,
   ``c[k] = ((t[0] . t[1]) . t[2]) ... t[k-1]``;
5. every step of block ``k >= 1`` becomes ``c[k] . y[j]`` (batched again).

Every value is thus one fixed bracketing of the sequence, and every batched call has
a fixed width (:mod:`fscan._sharded.fixed_batch`), so torch's kernels round each
element alike whatever the batch. ``reset=`` is the scan of ``(flag, value)`` pairs
(:mod:`fscan._segmented`); ``linear_recurrence`` is the scan of ``(a, b)`` pairs
under ``(a1, b1) . (a2, b2) = (a2 a1, a2 b1 + b2)``, with ``initial`` folded into the
first step as ``a[0] initial + b[0]``. Gradients are autograd's through these calls
(equal up to rounding, not bitwise). Never traced by ``torch.compile``: see
``NOT_TRACED``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._call import RecurrenceCall, ScanCall
from .._combine import FlatCombine, flat_combine
from .._knowledge.pointwise_check import checked_on_first_call
from .._knowledge.store import knowledge, reach
from .._knowledge.validate import validate_combine_fn
from .._pytree import flatten, unflatten
from .._recurrences.args import accumulation_dtype, check_recurrence_args, reset_mask
from .._segmented import segmented_scan
from .agree import Agreement, agree, recurrence_facts, scan_facts
from .blocks import Piece, Plan
from .exchange import exchange, tie
from .fixed_batch import combine_rows, dense, fold_blocks, rows_per_call
from .layout import Layout
from .scan import check_layout, combine_anchors

__all__ = ["NOT_TRACED", "deterministic_recurrence", "deterministic_scan"]

Head = Callable[[list[torch.Tensor]], list[torch.Tensor]]


# Why the doors run this mode outside torch.compile's graphs (Dynamo shows it where
# fullgraph=True refuses; without it the call is a graph break and runs eagerly).
NOT_TRACED = (
    "fscan.distributed: `deterministic=True` runs eagerly, outside the graph: its fixed "
    "chain of about 2 sqrt(n) small combine_fn calls would unroll into the trace, and "
    "compiled kernels that fuse them could round differently by shape. Compile without "
    "fullgraph=True (the call is a graph break), or drop `deterministic=True`."
)


# ---- associative_scan ------------------------------------------------------------


def deterministic_scan(call: ScanCall, agreement: Agreement, layout: Layout | None) -> Any:
    """The body of ``fscan.distributed.associative_scan(..., deterministic=True)``:
    ``call`` checked, run inside :func:`~fscan._sharded.agree.agreeing`; never
    traced (``NOT_TRACED``)."""
    agreement.describe = lambda: scan_facts(call, layout, deterministic=True)
    anchors = combine_anchors(call)
    if call.reset is None:
        return unflatten(call.spec, _scan(call, agreement, layout, anchors))

    def run(pairs: ScanCall) -> Any:  # the (flag, value) pairs: see fscan._segmented
        return unflatten(pairs.spec, _scan(pairs, agreement, layout, anchors))

    return segmented_scan(run, call)


def _checked_combine(call: ScanCall) -> FlatCombine:
    """``combine_fn`` on flat leaves (batched along dimension 0), with the checks a local
    scan runs (:func:`fscan._entry.run_scan`): purity, associativity as ``validate``
    asks, elementwise on its first pointwise call."""
    entry = knowledge(reach(call.combine_fn), call.spec, call.combine_mode, call.leaves)
    validate_combine_fn(call, entry)
    combine = flat_combine(call.api, call.combine_fn, call.spec, call.combine_mode)
    if call.combine_mode != "pointwise":
        return combine
    if not entry.elementwise:
        combine = checked_on_first_call(call.api, combine, entry, call.leaves)
    return _checked_once(combine, call)


def _checked_once(checked: FlatCombine, call: ScanCall) -> FlatCombine:
    """``checked`` on the first call, then ``combine_fn`` without the output checks: the
    mode makes thousands of small calls with the operands of that first one (shapes,
    dtypes, structure), where the checks would cost as much as the call."""
    combine_fn, spec, pending = call.combine_fn, call.spec, [True]

    def combine(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
        if pending:
            out = checked(a, b)
            pending.clear()
            return out
        return flatten(combine_fn(unflatten(spec, list(a)), unflatten(spec, list(b))))[0]

    return combine


def _scan(
    call: ScanCall,
    agreement: Agreement,
    layout: Layout | None,
    anchors: list[torch.Tensor],
    head: Head | None = None,
) -> list[torch.Tensor]:
    """The deterministic scan of ``call`` (no ``reset``) across the ranks: its leaves.

    ``head``: applied to the first step of the sequence (rows of length 1, scan order)
    by the rank that holds it, before anything moves (``initial`` of a recurrence).
    """
    api, leaves, dim, reverse = call.api, call.leaves, call.dim, call.reverse
    pg = agreement.group
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    layout = layout or Layout.contiguous(world)
    mine = check_layout(api, layout, pg, leaves[0].shape[dim])
    rows = [x.movedim(dim, 0) for x in leaves]  # steps first, as combine_fn sees them
    combine = _checked_combine(call)
    if rows[0].shape[0] >= 2:  # a first call on this rank's data, before any exchange
        with torch.no_grad():
            combine([x[:1] for x in rows], [x[1:2] for x in rows])
    _agree(agreement, leaves, anchors)
    if layout.lengths is None:  # every rank's lengths, for the blocks
        sent = torch.tensor(mine, dtype=torch.int64, device=leaves[0].device)
        lengths = _gathered([sent], pg, [])[0][0].tolist()
    else:
        lengths = layout.lengths
    plan = Plan.build(layout.order, lengths, reverse)
    starts = [sum(mine[:p]) for p in range(len(mine))]
    own = [[x.narrow(0, s, m) for x in rows] for s, m in zip(starts, mine)]
    if reverse:
        own = [[x.flip(0) for x in piece] for piece in own]
    pieces = [plan.piece(rank, p) for p in range(len(own))]
    if head is not None:
        for p, piece in enumerate(pieces):
            if piece.start == 0 and piece.length:
                first = head([x[:1] for x in own[p]])
                own[p] = [torch.cat([f, x[1:]]) for f, x in zip(first, own[p])]
    parts, anchor = _scan_pieces(combine, plan, pieces, own, pg, anchors)
    if reverse:  # each piece's results flipped back
        parts = [[[torch.cat(p).flip(0)] if p else [] for p in piece] for piece in parts]
    outs = [_joined([t for piece in parts for t in piece[i]], x) for i, x in enumerate(rows)]
    if anchor is not None:  # every rank runs the backward collectives
        outs = tie(anchor, outs)
    return [x.movedim(0, dim) for x in outs]


def _agree(agreement: Agreement, leaves: list[torch.Tensor], anchors: list[torch.Tensor]) -> None:
    """The ranks' agreement (:func:`~fscan._sharded.agree.agree`), before the first exchange
    (some calls exchange nothing, and every rank must still hear of a peer's error)."""
    if agreement.agreed:
        return
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*leaves, *anchors))
    agreement.more = [("a backward exchange (grad mode, requires_grad)", None, str(needs_grad))]
    agree(agreement)


def _scan_pieces(
    combine: FlatCombine,
    plan: Plan,
    pieces: list[Piece],
    own: list[list[torch.Tensor]],
    pg: Any,
    anchors: list[torch.Tensor],
) -> tuple[list[list[list[torch.Tensor]]], torch.Tensor | None]:
    """Steps 2 to 5 of the module docstring on this rank's pieces (``own[p]``: the
    leaves of its piece ``p``, scan order, steps first): for each piece and leaf, the
    parts of its results in order; and the last gathered buffer (None: nothing was
    exchanged), which every rank's results must depend on (:func:`tie`)."""
    like = own[0]
    # 2. the steps of the blocks that reach into a piece from before it
    gathered, anchor = None, None
    if plan.segment_rows:
        sent = [_segments(plan, pieces, own, i) for i in range(len(like))]
        gathered, anchor = _gathered(sent, pg, anchors)
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
                prefix = [gathered[i][r, row : row + c] for r, row, c in runs]
                pad = blocks * plan.size - before - x.shape[0]
                parts[i] += [*prefix, x, _copies(x[-1:], pad)]
            count += blocks
    folded = []
    if count:
        calls = rows_per_call([x[:1] for x in like], count)
        pad = (-count % calls) * plan.size
        whole = [torch.cat([*p, _copies(p[0][:1], pad)]) for p in parts]
        blocks = [x.reshape(-1, plan.size, *x.shape[1:]) for x in whole]
        folded = [x.flatten(0, 1) for x in fold_blocks(combine, blocks)]  # steps in order
    # 4. every block's total, folded one by one in global order into the carries
    carries: list[list[torch.Tensor]] = []
    if plan.count > 1:
        sent = _totals(plan, pieces, firsts, folded, like)
        if anchor is not None:  # every rank: the totals' backward before the rows'
            sent = tie(anchor, sent)
        totals, anchor = _gathered(sent, pg, anchors)
        carries = _carries(combine, plan, pieces, totals)
    # 5. the steps of every block after the first: the block's carry in front
    parts = [
        _carried(combine, plan, piece, folded, first, carries) if piece.length else [[]] * len(like)
        for piece, first in zip(pieces, firsts)
    ]
    return parts, anchor


def _gathered(
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


def _joined(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The parts of a leaf's results as one new tensor (``like``: the leaf, steps first)."""
    if not parts:
        return like.clone()  # no steps here
    if len(parts) == 1 and parts[0]._base is None:
        return parts[0]  # already a tensor of its own
    return torch.cat(parts)


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


# ---- linear_recurrence -----------------------------------------------------------


def _affine(x: tuple, y: tuple) -> tuple:
    """``(a1, b1)`` then ``(a2, b2)``: ``h -> a2 (a1 h + b1) + b2``, without an fma."""
    return y[0] * x[0], y[0] * x[1] + y[1]


def deterministic_recurrence(call: RecurrenceCall, agreement: Agreement) -> torch.Tensor:
    """The body of ``fscan.distributed.linear_recurrence(..., deterministic=True)``, run
    inside :func:`~fscan._sharded.agree.agreeing`: the scan of ``(a, b)`` pairs (module
    docstring), in ``acc_dtype`` if given, rounded once; never traced (``NOT_TRACED``)."""
    agreement.describe = lambda: recurrence_facts(call, deterministic=True)
    api, a, b, dim, initial, reverse, reset, acc_dtype = call
    a, b, initial, dim = check_recurrence_args(api, a, b, dim, initial, reverse, matrix=False)
    dtype = b.dtype
    if acc_dtype is not None:
        wide = accumulation_dtype(acc_dtype, dtype, api)
        a, b = a.to(wide), b.to(wide)
        initial = None if initial is None else initial.to(wide)
    gate = a.reshape((1,) * (b.ndim - a.ndim) + tuple(a.shape)).expand_as(b)
    leaves, spec = flatten((gate, b))
    pairs = ScanCall(api, _affine, (gate, b), spec, leaves, dim, reverse, "pointwise", False)
    anchors = [t for t in (a, initial) if t is not None and t.requires_grad]
    head = None if initial is None else _carried_in(initial)
    if reset is None:
        return _scan(pairs, agreement, None, anchors, head)[-1].to(dtype)

    def run(flagged: ScanCall) -> Any:  # the (flag, (a, b)) pairs: see fscan._segmented
        return unflatten(flagged.spec, _scan(flagged, agreement, None, anchors, head))

    mask = reset_mask(reset, b, dim, api=api)
    return segmented_scan(run, pairs._replace(reset=mask))[-1].to(dtype)


def _carried_in(initial: torch.Tensor) -> Head:
    """The first step with ``initial`` folded in: ``b[0] + a[0] initial``, or ``b[0]``
    where a reset drops what came before (a selection: ``0 * inf`` is NaN)."""

    def head(first: list[torch.Tensor]) -> list[torch.Tensor]:
        *flag, gate, b = first  # (flag,) gate, b: rows of one step
        state = initial.expand(b.shape[1:]).unsqueeze(0)
        if not flag:
            return [gate, gate * state + b]
        drops = flag[0]
        kept = torch.where(drops, 1, gate) * torch.where(drops, 0, state) + b
        return [*flag, gate, torch.where(drops, b, kept)]

    return head
