"""The sharded engines, :func:`sharded_scan` and :func:`sharded_recurrence`: scans over a
sequence sharded across the ranks of a ``torch.distributed`` group.

Each rank holds pieces of one long sequence along ``dim`` (by default one
contiguous piece per rank, in rank order) and gets back its pieces of the scan of
the whole sequence. The classic block scan (MPI_Exscan):

1. scan each local piece with fscan; its total is its last element (first, in
   reverse);
2. exchange the totals with one ``all_gather`` of one element per piece
   (:mod:`fscan._sharded.exchange`; its backward is one ``reduce_scatter``);
3. fold the totals of the pieces before each local piece (after it, in reverse)
   into its exclusive prefix ``P`` with a scan of at most ``W * K`` elements, and
   combine ``P`` into every local result with one ``combine_fn`` call.

Before step 2 the ranks agree (:func:`fscan._sharded.agree.agree`, one 16-byte
``all_gather``): the same call on every rank, and no rank failed, else every rank
raises.
Under ``torch.compile`` (``fullgraph=True`` works) the agreement is skipped, the
exchange is the same functional collectives, and lengths not given by a ``Layout``
are not read: emptiness travels as flags (:mod:`fscan._sharded.traced`).

Only totals cross ranks, so the exchange does not grow with the length.
Gradients come from autograd: the gather's transpose returns to each piece's
total the cotangents of the later ranks' folds.

Every rank must run the backward collective, also ranks whose results do not
depend on the gathered totals (nothing before them, or empty pieces), and also
under ``torch.autograd.grad(..., inputs=...)``, which prunes graph nodes that do
not lead to the requested inputs. ``tie`` puts the gathered tensor into
those ranks' graphs without arithmetic (``0 * total`` would turn an infinite
total into NaN), empty pieces send zeros computed from the piece, and the
tensors ``combine_fn`` closes over are extra inputs of the gather, so the
gather leads to the same requested inputs on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._call import SCAN_API, RecurrenceCall, ScanCall
from .._context import values_hidden
from .._entry import run_scan
from .._errors import ScanValueError
from .._knowledge.store import reach
from .._pytree import flatten, unflatten
from .._recurrences.args import accumulation_dtype, check_recurrence_args, reset_mask
from .._recurrences.composed_gates import all_normal, inexact_carries
from .._recurrences.solve import run_linear_recurrence
from .._segmented import segmented_scan
from .agree import Agreement, recurrence_facts, scan_facts
from .exchange import exchange, tie
from .layout import Layout
from .shift import combine_steps
from .traced import masked_prefix

__all__ = ["check_layout", "combine_anchors", "sharded_recurrence", "sharded_scan"]

# The local solves' errors name the local recurrence, as they always have.
_LOCAL_RECURRENCE_API = "fscan.linear_recurrence"


# ---- the scan ------------------------------------------------------------------


def _piece_total(piece: list[torch.Tensor], dim: int, reverse: bool) -> list[torch.Tensor]:
    """The total of a scanned piece, or zeros standing in for an empty piece's.

    The zeros of a floating leaf are computed from the piece (a sum over an empty
    dimension is exactly 0) so that the piece stays in the graph and this rank records
    the gather like every other rank, also under ``autograd.grad(inputs=piece)``, and
    carries a tangent under ``torch.func.jvp`` (whose gather rule runs only where one
    comes in: every rank must run it).
    """
    n = piece[0].shape[dim]
    if n:
        return [x.select(dim, 0 if reverse else n - 1) for x in piece]
    return [
        x.sum(dim) if _inexact(x) else x.new_zeros(x.shape[:dim] + x.shape[dim + 1 :])
        for x in piece
    ]


def _inexact(x: torch.Tensor) -> bool:
    return x.is_floating_point() or x.is_complex()


def _fixup(
    call: ScanCall, prefix: list[torch.Tensor], piece: list[torch.Tensor]
) -> list[torch.Tensor]:
    """``out[i] = combine_fn(prefix, piece[i])`` along ``dim``, in one batched call."""
    return combine_steps(call, prefix, piece, None)


def _local_scan(call: ScanCall, piece: list[torch.Tensor]) -> list[torch.Tensor]:
    """``piece`` (leaves like ``call``'s, maybe empty) scanned on its own through the
    internal entry; its errors name ``fscan.associative_scan``, as they always have."""
    local = call._replace(api=SCAN_API, xs=unflatten(call.spec, piece), leaves=piece)
    return flatten(run_scan(local))[0]


def check_layout(api: str, layout: Layout, group: Any, n: int) -> tuple[int, ...]:
    """This rank's piece lengths under ``layout``, checked against the group and ``n``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(layout.order) != world:
        raise ScanValueError(
            f"{api}: `layout` describes {len(layout.order)} ranks, the group has {world}."
        )
    if layout.lengths is None:
        return (n,)
    mine = layout.lengths[rank]
    if sum(mine) != n:
        raise ScanValueError(
            f"{api}: `layout` gives rank {rank} pieces of lengths {mine} (sum {sum(mine)}), "
            f"but its leaves have length {n} along the scan dimension."
        )
    return mine


def sharded_scan(call: ScanCall, agreement: Agreement, layout: Layout | None) -> Any:
    """The body of ``fscan.distributed.associative_scan`` (see its docstring) and of a
    DTensor's scan across ranks: ``call`` checked, run inside :func:`agreeing`
    (``agreement``), on ``layout`` (a Layout or None)."""
    agreement.describe = lambda: scan_facts(call, layout)
    if call.reset is not None:  # a scan of (flag, value) pairs: see fscan._segmented

        def run(pairs: ScanCall) -> Any:  # the pairs, scanned across the ranks again
            return _scan_pieces(pairs, agreement.group, layout)

        return segmented_scan(run, call)
    return _scan_pieces(call, agreement.group, layout)


def _scan_pieces(call: ScanCall, pg: Any, layout: Layout | None) -> Any:
    """The scan of ``call`` (no ``reset``) across the ranks of ``pg``."""
    api, spec, leaves, dim, reverse = call.api, call.spec, call.leaves, call.dim, call.reverse
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    layout = layout or Layout.contiguous(world)
    lengths = check_layout(api, layout, pg, leaves[0].shape[dim])
    starts = [sum(lengths[:p]) for p in range(len(lengths))]
    pieces = [[x.narrow(dim, s, n) for x in leaves] for s, n in zip(starts, lengths)]
    scanned = [_local_scan(call, p) for p in pieces]
    if world == 1 and layout.pieces == 1:
        return unflatten(spec, scanned[0])
    if layout.lengths is None and torch.compiler.is_compiling():  # no host read in a trace
        return unflatten(spec, _fold_traced(call, scanned[0], pg, layout))
    totals = [_piece_total(p, dim, reverse) for p in scanned]
    stacked = [torch.stack([t[i] for t in totals]) for i in range(len(leaves))]
    if layout.lengths is None:  # lengths travel with the totals, read on the host
        stacked.append(torch.tensor(lengths, dtype=torch.int64, device=leaves[0].device))
    gathered, anchor = exchange(stacked, pg, combine_anchors(call))
    if layout.lengths is None:
        all_lengths = [tuple(row) for row in gathered.pop().tolist()]
    else:
        all_lengths = layout.lengths
    # every non-empty piece of the whole sequence, in sequence order
    entries = sorted(
        (layout.order[r][p], r, p)
        for r in range(world)
        for p in range(layout.pieces)
        if all_lengths[r][p]
    )
    prefixes = _prefixes(call, gathered, entries)
    outs, tied = [], True
    for p, piece in enumerate(scanned):
        pos = next((i for i, e in enumerate(entries) if e[1:] == (rank, p)), None)
        before = None if pos is None else (pos + 1 if reverse else pos - 1)
        if before is None or not 0 <= before < len(entries):
            outs.append(piece)
            continue
        prefix = [f[before] for f in prefixes]
        outs.append(_fixup(call, prefix, piece))
        tied = False
    out = outs[0] if len(outs) == 1 else [torch.cat(col, dim) for col in zip(*outs)]
    return unflatten(spec, tie(anchor, out) if tied else out)


def combine_anchors(call: ScanCall) -> list[torch.Tensor]:
    """The differentiable tensors ``combine_fn`` closes over: inputs of the gather, so
    that it leads to them on every rank (see the module docstring). None under
    ``torch.compile``: Dynamo cannot read a closure made while tracing (the segmented
    combine of ``reset=``, a lambda in the compiled function), and the compiled call is
    one node of the autograd graph, whose backward runs whole."""
    if torch.compiler.is_compiling():
        return []
    return [t for t in reach(call.combine_fn).tensors if t.requires_grad]


def _fold_traced(call: ScanCall, piece: list[torch.Tensor], pg: Any, layout: Layout) -> list:
    """This rank's scanned ``piece`` with the prefix of every rank before it, lengths
    unknown: their emptiness travels as flags (see :mod:`fscan._sharded.traced`)."""
    dim, reverse, rank = call.dim, call.reverse, dist.get_rank(pg)
    totals = [t.unsqueeze(0) for t in _piece_total(piece, dim, reverse)]
    flag = torch.full((1,), bool(piece[0].shape[dim]), dtype=torch.bool, device=piece[0].device)
    gathered, anchor = exchange([*totals, flag], pg, combine_anchors(call))
    nonempty = gathered.pop()[:, 0]
    order = sorted(range(len(layout.order)), key=lambda r: layout.order[r][0])
    order = order[::-1] if reverse else order
    before = order[: order.index(rank)]
    if not before:
        return tie(anchor, piece)
    prefix, valid = masked_prefix(call, [g[:, 0] for g in gathered], nonempty, before)
    fixed = _fixup(call, prefix, piece)
    return [torch.where(valid, f, x) for f, x in zip(fixed, piece)]


def _prefixes(
    call: ScanCall, gathered: list[torch.Tensor], entries: list[tuple[int, int, int]]
) -> list[torch.Tensor]:
    """The inclusive scan of the non-empty pieces' totals in sequence order."""
    if len(entries) < 2:
        return []
    device = gathered[0].device
    ranks = torch.tensor([e[1] for e in entries], device=device)
    slots = torch.tensor([e[2] for e in entries], device=device)
    seq = [g[ranks, slots] for g in gathered]
    return _local_scan(call._replace(dim=0), seq)


# ---- linear recurrences --------------------------------------------------------


def sharded_recurrence(call: RecurrenceCall, agreement: Agreement) -> torch.Tensor:
    """The body of ``fscan.distributed.linear_recurrence`` (see its docstring) and of a
    DTensor's recurrence across ranks, run inside :func:`agreeing` (``agreement``).

    Each rank runs the local recurrence from nothing and reduces its piece to the map
    from its entering to its leaving state (:func:`_piece_map`: the product of its
    gates, its last state, whether it holds a reset), exchanges it, folds the earlier
    ranks' maps and ``initial`` into its entering state (:func:`_fold`), and runs the
    local recurrence again from there with fscan's ``initial=`` (the first rank in
    scan order keeps its first run). An empty piece's map is the identity, so no
    lengths are exchanged. With ``acc_dtype`` all of it runs in the wider dtype,
    the exchanged maps too, and the result is rounded once.
    """
    agreement.describe = lambda: recurrence_facts(call)
    api, a, b, dim, initial, reverse, reset, acc_dtype = call
    a, b, initial, dim = check_recurrence_args(api, a, b, dim, initial, reverse, matrix=False)
    dtype = b.dtype
    if acc_dtype is not None:
        wide = accumulation_dtype(acc_dtype, dtype, api)
        a, b = a.to(wide), b.to(wide)
        initial = None if initial is None else initial.to(wide)
    # The local solves: checked, widened operands; their errors name the local recurrence.
    local = RecurrenceCall(_LOCAL_RECURRENCE_API, a, b, dim, None, reverse, reset)

    def solve_from(state: torch.Tensor | None) -> torch.Tensor:  # this piece, from `state`
        return run_linear_recurrence(*local._replace(initial=state))

    pg = agreement.group
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if world == 1:
        return solve_from(initial).to(dtype)
    mask = None if reset is None else reset_mask(reset, b, dim, api=api)
    own = solve_from(None)
    (gates, ends, resets), anchor = exchange(_piece_map(a, b, own, mask, dim, reverse), pg)
    order = range(world - 1, -1, -1) if reverse else range(world)

    def walk_from(state: torch.Tensor) -> torch.Tensor:  # this piece's last state from `state`
        h = solve_from(state)
        n = b.shape[dim]
        return h.select(dim, 0 if reverse else n - 1) if n else state.expand(ends.shape[1:])

    h_in = _fold(gates, ends, resets, initial, order, rank, pg, walk_from)
    # The first rank, without `initial`: its first run is its result.
    out = own if h_in is None else solve_from(h_in)
    out = out.to(dtype)  # one rounding, of the result
    # the first rank and empty pieces do not use the gathered maps: tie them in
    return tie(anchor, [out])[0] if rank == order[0] or b.shape[dim] == 0 else out


def _piece_map(
    a: torch.Tensor,
    b: torch.Tensor,
    own: torch.Tensor,
    mask: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> list[torch.Tensor]:
    """``[A, B, R]``: ``h_out = B if R else A h_in + B`` over this piece, per lane.

    ``B`` is the last state of ``own`` (the local recurrence from nothing: exact, as
    the loop), ``A`` the product of the gates, ``R`` whether a reset drops what enters
    (a selection, never a zero gate: ``0 * inf`` is NaN). An empty piece is the
    identity ``(1, 0, False)``, computed from the piece so that it stays in the graph.
    """
    n = b.shape[dim]
    gate = a.reshape((1,) * (b.ndim - a.ndim) + tuple(a.shape)).expand_as(b)
    lane = b.shape[:dim] + b.shape[dim + 1 :]
    product = gate.prod(dim).expand(lane)
    if n:
        last = own.select(dim, 0 if reverse else n - 1)
    else:
        last = b.sum(dim) if _inexact(b) else b.new_zeros(lane)  # see _piece_total
    if mask is None:
        drops = torch.zeros(lane, dtype=torch.bool, device=b.device)
    else:
        drops = mask.expand(b.shape).any(dim)
    return [product, last, drops]


class _ValueOf(torch.autograd.Function):
    """``value`` with the gradient of ``like``: a carry walked step by step (exact, but
    across ranks, outside the graph) standing in for the composed one (``A h + B``),
    whose derivatives (``A``, ``h``, 1) are the walk's up to rounding."""

    @staticmethod
    def forward(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return None, grad

    @staticmethod
    def jvp(ctx: Any, value: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        return like.clone()


def _compose_map(
    gate: torch.Tensor, end: torch.Tensor, drops: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """``end if drops else gate * state + end``, also in the gradients: where the map
    drops the state, the product runs on ``(1, 0)`` (a zero cotangent times an
    infinite ``state`` or ``gate`` would be NaN)."""
    gate = torch.where(drops, 1, gate)
    state = torch.where(drops, 0, state)
    return torch.where(drops, end, torch.addcmul(end, gate, state))


def _fold(
    gates: torch.Tensor,
    ends: torch.Tensor,
    resets: torch.Tensor,
    initial: torch.Tensor | None,
    order: range,
    rank: int,
    group: Any,
    walk_from: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | None:
    """This rank's entering state: the maps of the ranks before it (in ``order``, the
    scan order) applied to ``initial`` (None: this rank comes first, no ``initial``).

    Composing a rank's map is the loop up to rounding except where its gate product
    is not a normal number and the state is infinite, zero or huge (see
    ``fscan._recurrences.composed_gates.inexact_carries``). Every rank folds the same gathered
    maps and finds the same such carries; each is then walked by the rank that holds the piece, from
    the exact state before it, and shared with one more ``all_gather`` (values only:
    the gradient is the composed map's, see :class:`_ValueOf`).
    """
    # Under torch.compile the walks are skipped: whether one is needed is a host read
    # and it is a collective of its own (the composed map stands, see the docs).
    check = not torch.compiler.is_compiling() and (gates.is_floating_point() or gates.is_complex())
    check = check and not values_hidden(gates, ends)
    # the common case: one reduction, one sync (complex: see inexact_carries)
    check = check and (gates.is_complex() or ends.is_complex() or not all_normal(gates))
    state = entering = initial
    # Every rank folds every map but the last: the walks are collectives that the
    # ranks after this one need too.
    for r in order[:-1]:
        if r == rank:
            entering = state
        if state is None:
            state = ends[r]
            continue
        composed = _compose_map(gates[r], ends[r], resets[r], state)
        if check:
            flags = inexact_carries(gates[r], state.detach(), composed.detach(), resets[r])
            if bool(flags.any()):  # the same on every rank: the same maps, the same ops
                with torch.no_grad():
                    mine = walk_from(state.detach()) if rank == r else torch.zeros_like(ends[r])
                    walked = exchange([mine.expand(ends.shape[1:])], group)[0][0][r]
                exact = torch.where(flags, walked, composed.detach())
                composed = _ValueOf.apply(exact, composed)
        state = composed
    return state if rank == order[-1] else entering
