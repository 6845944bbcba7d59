"""The walks that solve an elementwise linear recurrence ``h_t = a_t h_{t-1} + b_t``.

:func:`solve` picks by length and by what is built: the C++ kernel
(:func:`kernel_solve`), the chunked walk (:func:`chunked_solve`: walk each chunk
from zero, solve the recurrence over chunk ends, walk again from the entering
states; see :mod:`fscan._linear`), or under 32 steps the loop itself.
:func:`tree_solve` is the tree scan of the pairs (for tracing). Carries whose
composed gates are not exact are walked step by step (:mod:`fscan._recurrences.composed_gates`).
The log-space recurrence reuses the walks with its own :class:`Algebra`.

Shapes: ``a`` has ``b``'s number of dimensions (sizes 1 where it broadcasts),
``initial`` a step's (``b``'s without ``dim``), ``mask`` ``b``'s (sizes 1 where it
broadcasts, n along ``dim``). All share one dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import optree
import torch

from .._cumulative.rules import KERNEL_MIN_NUMEL
from .._engines.cpp.cpu_kernel import kernel_scan
from .._entry import scan_tree
from .._route_log import ran
from .composed_gates import all_normal, inexact_carries, values_hidden

__all__ = [
    "PLAIN",
    "Algebra",
    "chunk_size",
    "chunked_solve",
    "compose",
    "kernel_solve",
    "solve",
    "toward_end",
    "toward_start",
    "tree_solve",
]

_API = "fscan.linear_recurrence"
# Chunk sizes: 64 steps per chunk measured fastest on (8, 4096, 256) (fewer,
# larger chunks mean more sequential calls on smaller slices); below 8 steps per
# chunk the walks cost more than they save and the tree scan is used directly.
_MAX_CHUNK = 64
_MIN_CHUNK = 8
PAIR_SPEC = optree.tree_structure((0, 0))
_KEEP_H = (False, True)  # of the pair (a, b) scanned by the kernel: only h


def toward_start(x: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    """``y_t = x_{t+1}`` in scan order (toward the start by one); zero (False) last."""
    return toward_end(x, dim, not reverse, None)


def toward_end(
    x: torch.Tensor, dim: int, reverse: bool, first: torch.Tensor | None
) -> torch.Tensor:
    """``y_t = x_{t-1}`` in scan order; ``first`` (a step, or zero) at the scan's start."""
    n = x.shape[dim]
    start = torch.zeros_like(x.narrow(dim, 0, 1))
    if first is not None:
        start = first.unsqueeze(dim).expand_as(start)
    if reverse:
        return torch.cat([x.narrow(dim, 1, n - 1), start], dim)
    return torch.cat([start, x.narrow(dim, 0, n - 1)], dim)


def solve(
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None,
    reverse: bool,
    mask: torch.Tensor | None,
    fast: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch on length: chunked walks for long scans, the tree for short ones.

    ``fast`` writes the states into preallocated memory (``out=``, or ``out`` if
    given): only where no autograd or functorch transform watches the ops.
    """
    n = b.shape[dim]
    a = a.expand(*(n if i == dim else s for i, s in enumerate(a.shape)))  # stride 0 if constant
    if mask is None and (h := kernel_solve(a, b, dim, reverse, initial, out)) is not None:
        ran("cpp")
        return h  # `out` itself if given: the kernel wrote it in place
    ran("blocked")  # the chunked walk (a single chunk, the loop, under 32 steps)
    chunk = chunk_size(n)
    if chunk is not None:
        return chunked_solve(a, b, dim, initial, reverse, mask, chunk, fast, out)
    # Under 32 steps, the loop itself: no product of gates is formed, so none can
    # under/overflow into 0 * inf or inf * 0 (the tree multiplies them).
    return _sequential(plain_step, a, b, dim, initial, reverse, mask, fast, out)


def kernel_solve(
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    reverse: bool,
    initial: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The recurrence by fscan's compiled C++ kernel (fscan._engines.cpp.cpu_kernel) where it is
    built and wins: no gradient wanted, one float dtype, enough elements, leaves of one
    shape after broadcasting. A broadcast gate is expanded to ``b``'s shape (a view:
    stride 0) and read in place, at any size: with only ``h`` stored, the kernel beat
    the chunked walk at (16384, 512) for (T, 1) and (1, C) gates (docs/linear.md).
    ``initial`` enters as the kernel's carry-in: the first step's pair becomes
    ``(a_0, a_0 initial + b_0)``, read in place of the leaves' (no copy of them).
    ``out``: written in place through its strides (the backward's narrowed view of
    ``lam``) and returned; unwritten where the kernel does not serve (None)."""
    if a.dtype != b.dtype or not b.is_floating_point() or b.numel() < KERNEL_MIN_NUMEL:
        return None
    if a.shape != b.shape:
        a = a.expand(b.shape)  # `a` broadcasts to `b` (checked on entry)
    head = None
    if initial is not None:
        if initial.requires_grad and torch.is_grad_enabled():  # the walk's ops carry it
            return None
        first = b.shape[dim] - 1 if reverse else 0
        a0, b0 = a.select(dim, first), b.select(dim, first)
        head = [a0, torch.addcmul(b0, a0, initial).expand(b0.shape)]
    # Only h is kept: the gate products are neither allocated nor stored (half the
    # writes, and the page faults of a fresh output).
    into = None if out is None else [out]
    found = kernel_scan(
        _API, compose, PAIR_SPEC, [a, b], dim, reverse, keep=_KEEP_H, head=head, out=into
    )
    return None if found is None else found[1]


def chunk_size(n: int) -> int | None:
    """The largest power of two up to ``_MAX_CHUNK`` giving at least 4 chunks, or None."""
    chunk = _MAX_CHUNK
    while chunk > n // 4:
        chunk //= 2
    return chunk if chunk >= _MIN_CHUNK else None


def compose(x: tuple[torch.Tensor, torch.Tensor], y: tuple[torch.Tensor, torch.Tensor]):
    """``(a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2)``: ``h -> a2 (a1 h + b1) + b2``."""
    return x[0] * y[0], torch.addcmul(y[1], y[0], x[1])


def tree_solve(
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None,
    reverse: bool,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The pairs ``(a_t, b_t)`` scanned with the tree (a segmented scan with ``mask``)."""
    n = b.shape[dim]
    # One shape for both leaves: a per-row mask must broadcast to each of them.
    shape = torch.broadcast_shapes(a.shape, b.shape)
    a, b = a.expand(shape), b.expand(shape)
    if initial is not None:
        first = n - 1 if reverse else 0
        b_first = b.select(dim, first)
        head = torch.addcmul(b_first, a.select(dim, first), initial)
        if mask is not None:  # a reset at the first step drops `initial`, inf and NaN too
            head = torch.where(mask.select(dim, first), b_first, head)
        # Not a `cat` with the other n - 1 steps: that makes torch.export guard on n.
        b = torch.slice_scatter(b, head.unsqueeze(dim), dim, first, first + 1)
    if mask is None:
        return scan_tree(compose, (a, b), dim, reverse)[1]
    return scan_tree(compose, (a, b), dim, reverse, reset=mask)[1]


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
    :mod:`fscan._log_linear`), where products of gates become sums of logs."""

    step: Callable[..., torch.Tensor]  # one step: ``plain_step``'s signature
    solve: Callable[..., torch.Tensor]  # the recurrence over chunk ends: ``solve``'s
    toward_end: Callable[..., torch.Tensor]  # ``toward_end``'s
    total: Callable[[torch.Tensor, int], torch.Tensor]  # the gates of a chunk composed
    # ``_repair``'s signature, or None where composing chunks is exact (log space:
    # sums of logs neither under- nor overflow)
    repair: Callable[..., torch.Tensor] | None = None


def chunked_solve(
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None,
    reverse: bool,
    mask: torch.Tensor | None,
    chunk: int,
    fast: bool,
    out: torch.Tensor | None = None,
    algebra: Algebra | None = None,
) -> torch.Tensor:
    """Walk chunks of ``chunk`` steps from a zero state, solve the chunk ends as a
    shorter recurrence, then walk every chunk again from its entering state."""
    step, solve, toward_end, total, repair = algebra or PLAIN
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
    ends = solve(gates, local, dim, initial, reverse, chunk_mask, fast)
    if repair is not None:  # where `gate * state` is not what the steps give: walk them
        carries = _Carries(gates, local, ends, chunk_mask, initial)
        ends = repair(step, toward_end, carries, chunks, a, b, mask, dim, reverse)
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


def _sequential(
    step: Callable[..., torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None,
    reverse: bool,
    mask: torch.Tensor | None,
    fast: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loop, one step at a time (``b.shape[dim] >= 1``): into ``out`` (allocated
    if ``fast``), else stacked. Without ``initial`` the first state is ``b``'s first
    step, as in the tree and the kernel (no gate multiplies a zero state)."""
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


class _Carries(NamedTuple):
    """The chunk-level recurrence of :func:`chunked_solve`, chunks along ``dim``: each
    chunk's gate product and end state from zero (``local``), the solved end states
    (``ends``), the chunks holding a reset (or None) and the state before the first."""

    gates: torch.Tensor
    local: torch.Tensor
    ends: torch.Tensor
    reset: torch.Tensor | None
    initial: torch.Tensor | None


def _repair(
    step: Callable[..., torch.Tensor],
    toward_end: Callable[..., torch.Tensor],
    carries: _Carries,
    chunks: Callable[[torch.Tensor], torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    mask: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> torch.Tensor:
    """``carries.ends`` with the carries :func:`inexact_carries` flags walked step by step.

    The first flagged chunk (in scan order, over all lanes) is entered correctly:
    every carry before it is exact. From there the flagged lanes run the
    recurrence over chunks one chunk at a time, each chunk composed (``A e + B``)
    where that is exact for every one of them and walked step by step where not.
    """
    gates, local, ends, reset, initial = carries
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


PLAIN = Algebra(plain_step, solve, toward_end, torch.prod, _repair)
