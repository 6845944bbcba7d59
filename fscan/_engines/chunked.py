"""The chunked walk: an elementwise linear recurrence ``h_t = a_t h_{t-1} + b_t``.

:func:`chunked_solve` walks each chunk of ``chunk`` steps from a zero state (all
chunks at once), solves the recurrence over the chunks' end states, then walks
every chunk again from its entering state (see :mod:`fscan._linear`);
:func:`sequential` is the loop itself, for scans under 32 steps. The walk's
operations come in an :class:`Algebra`: plain (``a h + b``) or log space (see
:mod:`fscan._recurrences.log_solve`). What the walk needs from other engines, the
recurrence over chunk ends, is passed in by the router
(:mod:`fscan._routing.recurrence`), as is the repair of carries whose composed gates
are not exact (:mod:`fscan._recurrences.composed_gates`).

Shapes: ``a`` has ``b``'s number of dimensions (sizes 1 where it broadcasts),
``initial`` a step's (``b``'s without ``dim``), ``mask`` ``b``'s (sizes 1 where it
broadcasts, n along ``dim``). All share one dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "Algebra",
    "Carries",
    "Operands",
    "Solve",
    "chunk_size",
    "chunked_solve",
    "plain_step",
    "sequential",
    "toward_end",
    "toward_start",
]

# Chunk sizes: 64 steps per chunk measured fastest on (8, 4096, 256) (fewer,
# larger chunks mean more sequential calls on smaller slices); below 8 steps per
# chunk the walks cost more than they save and the tree scan is used directly.
_MAX_CHUNK = 64
_MIN_CHUNK = 8


class Operands(NamedTuple):
    """One recurrence's operands, checked and shaped (module doc): the gates ``a``, the
    inputs ``b``, the time dimension, the state before the first step (or None), the
    direction and the ``reset`` mask (or None)."""

    a: torch.Tensor
    b: torch.Tensor
    dim: int
    initial: torch.Tensor | None
    reverse: bool
    mask: torch.Tensor | None


# ``(operands, fast) -> states``: a solver of the recurrence over chunk ends (the
# router's, which may pick the kernel, the walk again or the tree).
Solve = Callable[[Operands, bool], torch.Tensor]


def toward_start(x: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    """``y_t = x_{t+1}`` in scan order (toward the start by one); zero (False) last."""
    return toward_end(x, dim, not reverse, None)


def toward_end(
    x: torch.Tensor, dim: int, reverse: bool, first: torch.Tensor | None, empty: float = 0.0
) -> torch.Tensor:
    """``y_t = x_{t-1}`` in scan order; ``first`` (a step), or the empty state ``empty``
    (zero; ``-inf`` in log space), at the scan's start."""
    n = x.shape[dim]
    start = torch.full_like(x.narrow(dim, 0, 1), empty)
    if first is not None:
        start = first.unsqueeze(dim).expand_as(start)
    if reverse:
        return torch.cat([x.narrow(dim, 1, n - 1), start], dim)
    return torch.cat([start, x.narrow(dim, 0, n - 1)], dim)


def chunk_size(n: int) -> int | None:
    """The largest power of two up to ``_MAX_CHUNK`` giving at least 4 chunks, or None."""
    chunk = _MAX_CHUNK
    while chunk > n // 4:
        chunk //= 2
    return chunk if chunk >= _MIN_CHUNK else None


def plain_step(
    a_t: torch.Tensor,
    b_t: torch.Tensor,
    m_t: torch.Tensor | None,
    h: torch.Tensor,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """One step ``a_t h + b_t``, or ``b_t`` where ``m_t`` (``where``, not a zero gate:
    ``0 * inf`` is NaN), into ``out`` if given."""
    if out is None:
        if m_t is None:
            return torch.addcmul(b_t, a_t, h)
        # Where m_t drops the state the product runs on zeros: autograd through it
        # (torch.func transforms) would give a zero cotangent times an infinite state
        # or gate, NaN, where the loop does not use them (as in fscan._segmented).
        a_t, h = torch.where(m_t, 0, a_t), torch.where(m_t, 0, h)
        return torch.where(m_t, b_t, torch.addcmul(b_t, a_t, h))
    torch.addcmul(b_t, a_t, h, out=out)
    if m_t is not None:
        torch.where(m_t, b_t, out, out=out)
    return out


class Algebra(NamedTuple):
    """The operations of the chunked walk: plain (``a h + b``) or log space (see
    :mod:`fscan._recurrences.log_solve`), where products of gates become sums of logs."""

    step: Callable[..., torch.Tensor]  # one step: ``plain_step``'s signature
    toward_end: Callable[..., torch.Tensor]  # ``toward_end``'s
    total: Callable[[torch.Tensor, int], torch.Tensor]  # the gates of a chunk composed
    # ``(step, toward_end, carries, chunks, operands) -> ends``: the
    # solved chunk ends with inexact carries walked step by step, or None where
    # composing chunks is exact (log space: sums of logs neither under- nor overflow)
    repair: Callable[..., torch.Tensor] | None = None


def chunked_solve(
    ops: Operands,
    chunk: int,
    fast: bool,
    out: torch.Tensor | None,
    algebra: Algebra,
    solve_ends: Solve,
) -> torch.Tensor:
    """Walk chunks of ``chunk`` steps from a zero state, solve the chunk ends as a
    shorter recurrence (``solve_ends``), then walk every chunk again from its entering
    state."""
    step, toward_end, total, repair = algebra
    a, b, dim, initial, reverse, mask = ops
    n = b.shape[dim]
    tail = n % chunk
    # Whole chunks, aligned to where the scan starts; the short tail comes last.
    start = tail if reverse else 0

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return x.narrow(dim, start, n - tail).unflatten(dim, (-1, chunk))

    within = dim + 1
    steps = range(chunk - 1, -1, -1) if reverse else range(chunk)
    # Unbind once: a `select` per step would make autograd zero-fill a full-size
    # gradient for every step, turning the backward quadratic in the chunk length.
    a_steps, b_steps = chunks(a).unbind(within), chunks(b).unbind(within)
    m_steps = [None] * chunk if mask is None else chunks(mask).unbind(within)
    # Step 1: each chunk's end state from a zero start, and its total gate.
    ends = b_steps[steps[0]]
    for i, t in enumerate(steps[1:]):
        # In fast mode the first step allocates and the others update it in place.
        ends = step(a_steps[t], b_steps[t], m_steps[t], ends, ends if fast and i else None)
    gates = total(chunks(a), within)
    # A chunk holding a reset restarts the chunk-level recurrence (its gate is not used).
    chunk_mask = None if mask is None else chunks(mask).any(within)
    # Step 2: the true end state of every chunk, a recurrence over chunks.
    local = ends
    ends = solve_ends(Operands(gates, local, dim, initial, reverse, chunk_mask), fast)
    if repair is not None:  # where `gate * state` is not what the steps give: walk them
        carries = Carries(gates, local, ends, chunk_mask, initial)
        ends = repair(step, toward_end, carries, chunks, ops)
    entering = toward_end(ends, dim, reverse, initial)
    # Step 3: walk every chunk again from its entering state, keeping all steps.
    if fast and out is None:
        out = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    out_steps = chunks(out).unbind(within) if fast else [None] * chunk
    states, h = [], entering
    for i, t in enumerate(steps):
        h = step(a_steps[t], b_steps[t], m_steps[t], h, out_steps[t])
        if not i and initial is None:
            h = _scan_start(h, b_steps[t], dim, reverse, fast)
        states.append(h)
    last = ends.select(dim, 0 if reverse else ends.shape[dim] - 1)
    span = range(tail - 1, -1, -1) if reverse else range(n - tail, n)
    if fast:
        if tail:
            _walk(step, a, b, dim, mask, span, last, out)
        return out
    if reverse:
        states.reverse()
    main = torch.stack(states, within).flatten(dim, within)
    if not tail:
        return main
    rest = _walk(step, a, b, dim, mask, span, last, None)
    return torch.cat([rest, main] if reverse else [main, rest], dim)


def _scan_start(
    h: torch.Tensor, b_t: torch.Tensor, dim: int, reverse: bool, fast: bool
) -> torch.Tensor:
    """``h`` (one step of every chunk) with the first chunk's state in scan order set to
    its input: without ``initial`` the first state is ``b``'s first step, as in the loop,
    the tree and the kernel; a gate applied to the zero state would make an infinite or
    NaN first gate a NaN there."""
    at = h.shape[dim] - 1 if reverse else 0
    first = b_t.narrow(dim, at, 1)
    if fast:
        h.narrow(dim, at, 1).copy_(first)
        return h
    return torch.slice_scatter(h, first, dim, at, at + 1)


def _walk(
    step: Callable[..., torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    mask: torch.Tensor | None,
    steps: range,
    h: torch.Tensor,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """A plain sequential walk over a few ``steps`` from state ``h``: written into
    ``out`` if given, else stacked in index order."""
    low = min(steps)

    def span(x: torch.Tensor | None) -> list:
        # One unbind of the walked span instead of a `select` per step (see chunked_solve).
        return (
            [None] * len(steps) if x is None else list(x.narrow(dim, low, len(steps)).unbind(dim))
        )

    a_steps, b_steps, m_steps, out_steps = span(a), span(b), span(mask), span(out)
    states = {}
    for t in steps:
        i = t - low
        h = states[t] = step(a_steps[i], b_steps[i], m_steps[i], h, out_steps[i])
    return torch.stack([states[t] for t in sorted(states)], dim) if out is None else out


def sequential(
    step: Callable[..., torch.Tensor], ops: Operands, fast: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The loop, one step at a time (``b.shape[dim] >= 1``): into ``out`` (allocated
    if ``fast``), else stacked. Without ``initial`` the first state is ``b``'s first
    step, as in the tree and the kernel (no gate multiplies a zero state)."""
    a, b, dim, initial, reverse, mask = ops
    n = b.shape[dim]
    order = range(n - 1, -1, -1) if reverse else range(n)
    if fast and out is None:
        out = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    if initial is not None:
        return _walk(step, a, b, dim, mask, order, initial, out)
    first = b.select(dim, order[0])
    if out is not None:
        out.select(dim, order[0]).copy_(first)
        return _walk(step, a, b, dim, mask, order[1:], first, out) if n > 1 else out
    if n == 1:
        return b.clone()
    rest = _walk(step, a, b, dim, mask, order[1:], first, None)
    head = first.unsqueeze(dim)
    return torch.cat([rest, head] if reverse else [head, rest], dim)


class Carries(NamedTuple):
    """The chunk-level recurrence of :func:`chunked_solve`, chunks along ``dim``: each
    chunk's gate product and end state from zero (``local``), the solved end states
    (``ends``), the chunks holding a reset (or None) and the state before the first."""

    gates: torch.Tensor
    local: torch.Tensor
    ends: torch.Tensor
    reset: torch.Tensor | None
    initial: torch.Tensor | None
