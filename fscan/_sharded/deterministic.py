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
from .block_scan import gathered, scan_blocks
from .blocks import Plan
from .exchange import tie
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
        lengths = gathered([sent], pg, [])[0][0].tolist()
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
    parts, anchor = scan_blocks(combine, plan, pieces, own, pg, anchors)
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


def _joined(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The parts of a leaf's results as one new tensor (``like``: the leaf, steps first)."""
    if not parts:
        return like.clone()  # no steps here
    if len(parts) == 1 and parts[0]._base is None:
        return parts[0]  # already a tensor of its own
    return torch.cat(parts)


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
