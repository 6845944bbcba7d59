"""When composing gates is exact: the numerics the chunked and the sharded recurrences share.

The chunked walk composes a chunk's steps into one map ``e -> A e + B`` (``A`` the
product of its gates, ``B`` its end state from zero), and the recurrence over
chunks applies these maps. Up to rounding that is the loop, except where ``A`` is
not a normal number: a product that underflowed to 0 (or a subnormal) meets an
infinite state (``0 * inf`` is NaN where the loop keeps the inf) or a huge one
(whose decayed part the loop keeps); a product that overflowed (or met an inf or
NaN gate) meets a zero or finite state (``inf * 0``). The loop never forms the
product, so it has none of these. Every composed carry is checked (one vectorised
test of the chunks' products, a few more where one is not normal) and the lanes
where one fails are walked step by step over the chunks where it fails
(:func:`repair_carries`, the plain chunked walk's repair).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._context import values_hidden
from .._engines.chunked import Carries, Operands

__all__ = ["all_normal", "inexact_carries", "repair_carries"]


def inexact_carries(
    gate: torch.Tensor, entering: torch.Tensor, end: torch.Tensor, reset: torch.Tensor | None
) -> torch.Tensor:
    """Where ``end = gate * entering + local`` (a composed chunk) may differ from the
    steps' result by more than rounding: see the comment above. A product below the
    smallest normal number loses at most ``|entering| * tiny`` of the loop's state,
    which matters where it exceeds the end state's rounding (``eps |end|``). A chunk
    holding a reset drops what enters it (a selection, exact). A complex product meets
    an infinite state exactly only step by step."""
    size = gate.abs()  # real, also for complex gates
    info = torch.finfo(size.dtype)
    wild = ~torch.isfinite(gate) & ~torch.isnan(entering)  # NaN stays NaN either way
    lost = torch.isinf(entering) | (entering.abs() * info.tiny > end.abs() * info.eps)
    bad = wild | ((size < info.tiny) & lost)
    if entering.is_complex():  # (a1 a2) inf and a1 (a2 inf) differ in their NaN parts
        bad = bad | torch.isinf(entering)
    return bad if reset is None else bad & ~reset


def all_normal(gates: torch.Tensor) -> bool:
    """Whether every gate product is a normal number (one reduction, one sync)."""
    size = gates.abs()
    low, high = torch.aminmax(size)
    info = torch.finfo(size.dtype)
    return bool((low >= info.tiny) & (high <= info.max))  # False where a NaN is


def repair_carries(
    step: Callable[..., torch.Tensor],
    toward_end: Callable[..., torch.Tensor],
    carries: Carries,
    chunks: Callable[[torch.Tensor], torch.Tensor],
    ops: Operands,
) -> torch.Tensor:
    """``carries.ends`` with the carries :func:`inexact_carries` flags walked step by step.

    The first flagged chunk (in scan order, over all lanes) is entered correctly:
    every carry before it is exact. From there the flagged lanes run the
    recurrence over chunks one chunk at a time, each chunk composed (``A e + B``)
    where that is exact for every one of them and walked step by step where not.
    """
    gates, local, ends, reset, initial = carries
    a, b, dim, _, reverse, mask = ops
    dtype = ends.dtype
    if not (dtype.is_floating_point or dtype.is_complex) or values_hidden(gates, ends):
        return ends  # integers wrap alike in any order; see values_hidden
    if not dtype.is_complex and all_normal(gates):  # the common case: one reduction, one sync
        return ends
    entering = toward_end(ends, dim, reverse, initial)
    shape = ends.movedim(dim, 0).shape  # (chunks, *the step's shape)
    count = shape[0]
    bad = inexact_carries(gates, entering, ends, reset).expand(ends.shape).movedim(dim, 0)
    bad = bad.reshape(count, -1)  # (chunks, lanes)
    order = range(count - 1, -1, -1) if reverse else range(count)
    if initial is None:  # the first chunk starts from nothing: its end is `local`, exact
        bad = bad & (torch.arange(count, device=bad.device) != order[0])[:, None]
    by_chunk = bad.any(1)
    if not bool(by_chunk.any()):
        return ends
    lanes = bad.any(0)  # the lanes to walk
    first = order.index(int(by_chunk.nonzero().flatten()[-1 if reverse else 0]))
    # Boolean indexing over the step's dims (a 1-D scan: one lane) reads the walked
    # lanes of `a` and `b` without copying the rest (they may be stride-0 broadcasts).
    pick = lanes.view(shape[1:]) if len(shape) > 1 else lanes

    def lanes_of(x: torch.Tensor, leading: int) -> torch.Tensor:
        return x[(slice(None),) * leading + (pick,)] if len(shape) > 1 else x[..., None][..., pick]

    def per_chunk(x: torch.Tensor) -> torch.Tensor:  # (chunks, lanes walked)
        return lanes_of(x.expand(ends.shape).movedim(dim, 0), 1)

    def per_step(x: torch.Tensor) -> torch.Tensor:  # (chunks, steps, lanes walked)
        return lanes_of(chunks(x.expand(b.shape)).movedim((dim, dim + 1), (0, 1)), 2)

    g, loc, state = per_chunk(gates), per_chunk(local), per_chunk(entering)
    flags = None if reset is None else per_chunk(reset)
    a_steps, b_steps = per_step(a), per_step(b)
    m_steps = None if mask is None else per_step(mask)
    within = range(a_steps.shape[1] - 1, -1, -1) if reverse else range(a_steps.shape[1])
    e, fixed = state[order[first]], []
    for k in order[first:]:
        f_k = None if flags is None else flags[k]
        composed = step(g[k], loc[k], f_k, e, None)
        if bool(inexact_carries(g[k], e, composed, f_k).any()):
            for t in within:
                m_t = None if m_steps is None else m_steps[k, t]
                e = step(a_steps[k, t], b_steps[k, t], m_t, e, None)
        else:
            e = composed
        fixed.append(e)
    chunk_index = torch.tensor(list(order[first:]), device=ends.device)
    lane_index = lanes.nonzero().flatten()
    flat = ends.movedim(dim, 0).reshape(count, -1)
    flat = flat.index_put((chunk_index[:, None], lane_index[None, :]), torch.stack(fixed))
    return flat.reshape(shape).movedim(0, dim)
