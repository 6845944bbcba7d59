"""Linear recurrences ``h_t = a_t * h_{t-1} + b_t``, elementwise (matrices: ``_linear_matrix``).

``h -> a h + b`` maps compose associatively, ``(a1, b1) then (a2, b2) = (a1 a2,
a2 b1 + b2)``, so the whole sequence of states is one scan. The elementwise
recurrence does not scan every step with the tree, though: that costs about ten
passes over memory (products, sums and copies at each of log n levels). It runs
the standard chunked form instead (as in chunked SSM kernels):

1. Split ``dim`` into chunks of ``C`` steps. Walk each chunk from a zero state, all
   chunks at once (``C`` fused multiply-adds on ``1/C`` of the data each), keeping
   only each chunk's end state and its total gate (the product of its ``a``).
2. The state entering each chunk is then a linear recurrence over chunks, ``C``
   times shorter: solve it by recursion, which ends in fscan's parallel tree scan.
3. Walk each chunk again from its entering state, keeping every step.

That is about four passes over memory in ``2 C + O(log n)`` sequential calls, and
plain differentiable, vmappable torch ops. Composing a chunk multiplies its gates,
which the loop never does: where that product leaves the floats' range and meets
an infinite, zero or huge state, the carry is walked step by step instead
(:func:`_repair`); scans under 32 steps are the loop itself. ``initial`` enters as the carry of the
first chunk (folded into the first step of the chunk recurrence), not as an extra
pass; ``reset`` selects ``h_t = b_t`` with ``torch.where`` where it is set (a zero
gate would turn an inf or NaN before the reset into NaN after it).

Gradients come from a custom autograd Function (:class:`_LinearRecurrenceFn`):
the adjoint of a linear recurrence is a linear recurrence running the other way,
so the backward reuses the same walk, saving only ``a`` and ``h``. Without a
tape to feed, the walks write into preallocated memory (``out=``).
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Number
from typing import Any, NamedTuple

import optree
import torch

from ._checks import check_dense, normalize_dim
from ._dtensor import any_dtensor, dtensor_linear_recurrence
from ._errors import ScanTypeError, ScanValueError
from ._pytree import describe
from ._route_log import logs_route, ran
from ._routing import where
from ._scan import associative_scan
from ._segmented import check_reset

__all__ = ["linear_recurrence"]

_API = "fscan.linear_recurrence"
# Chunk sizes: 64 steps per chunk measured fastest on (8, 4096, 256) (fewer,
# larger chunks mean more sequential calls on smaller slices); below 8 steps per
# chunk the walks cost more than they save and the tree scan is used directly.
_MAX_CHUNK = 64
_MIN_CHUNK = 8
_PAIR = optree.tree_structure((0, 0))
_KEEP_H = (False, True)  # of the pair (a, b) scanned by the kernel: only h


@logs_route(_API)
def linear_recurrence(
    a: torch.Tensor | Number,
    b: torch.Tensor,
    dim: int,
    *,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    acc_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """All states of ``h_t = a_t * h_{t-1} + b_t`` along ``dim``, in one call.

    Semantics (``h_{-1} = initial``; without it ``h_0 = b_0``)::

        for t in range(n):
            h[t] = (b[t] if reset[t] else a[t] * h[t - 1] + b[t])   # along `dim`

    NaN and inf go where this loop takes them, also where the parallel forms'
    products of gates under- or overflow (see docs/linear.md, "NaN and inf").

    With ``reverse=True`` the recurrence runs from the end, ``h_t = a_t * h_{t+1}
    + b_t`` with ``h_n = initial``, and ``reset[t]`` drops ``h_{t+1}``.

    Args:
        a (Tensor or number): the gates, broadcastable to ``b``: a scalar gate, a
            per-channel gate (e.g. shape ``(d,)`` for ``b`` of shape ``(n, d)``), a
            per-step gate (``(n, 1)``) or a full gate (``b``'s shape).
        b (Tensor): the inputs, at least 1-D; the result has its shape.
        dim (int): the time dimension of ``b``; negative counts from the end.
        initial (Tensor or None, default None): the state before the first step,
            broadcastable to one step of ``b`` (``b`` with ``dim`` removed).
        reverse (bool, default False): run from the end of ``dim``.
        reset (bool Tensor or None, default None): restart where True, ``h_t = b_t``
            (packed sequences, episode boundaries): a 1-D mask of length ``n`` or a
            mask with ``b``'s dimensions broadcastable to it, as in
            ``fscan.associative_scan``. A reset at the first step drops ``initial``;
            nothing before a reset reaches it, not even a NaN or an inf.
        acc_dtype (torch.dtype or None, default None): accumulate in this
            (floating or complex) dtype and round once at the end, e.g.
            ``torch.float32`` for bfloat16/float16 inputs.

    Returns:
        Tensor: ``h``, of ``b``'s shape and the promoted dtype of ``a``, ``b`` and
        ``initial``; differentiable in all three (complex too, to any order) and
        usable under ``torch.func`` transforms, ``torch.compile`` and ``torch.export``.

    Example:
        >>> import fscan, torch
        >>> fscan.linear_recurrence(0.5, torch.ones(4), 0)
        tensor([1.0000, 1.5000, 1.7500, 1.8750])
        >>> fscan.linear_recurrence(torch.tensor(2.0), torch.ones(3), 0, initial=torch.tensor(1.0))
        tensor([ 3.,  7., 15.])
        >>> fscan.linear_recurrence(0.5, torch.ones(4), 0, reset=torch.tensor([0, 0, 1, 0]) > 0)
        tensor([1.0000, 1.5000, 1.0000, 1.5000])
    """
    if any_dtensor((a, b, initial, reset)):  # sharded across ranks: see fscan._dtensor
        args = dict(initial=initial, reverse=reverse, reset=reset, acc_dtype=acc_dtype)
        return dtensor_linear_recurrence(a, b, dim, **args)
    a, b, initial, dim = _check_args(_API, a, b, dim, initial, reverse, matrix=False)
    dtype = b.dtype
    if acc_dtype is not None:
        wide = _accumulation_dtype(acc_dtype, dtype)
        a, b = a.to(wide), b.to(wide)
        initial = None if initial is None else initial.to(wide)
    mask = None if reset is None else _mask_for(reset, b, dim)
    # Gates and `initial` with b's number of dimensions (a step's, for `initial`):
    # views, so that every path below can broadcast and unsqueeze along `dim`.
    a = a.reshape((1,) * (b.ndim - a.ndim) + tuple(a.shape))
    if initial is not None:
        initial = initial.reshape((1,) * (b.ndim - 1 - initial.ndim) + tuple(initial.shape))
    return _recurrence(a, b, dim, initial, reverse, mask).to(dtype)


# ---- the elementwise recurrence ---------------------------------------------
#
# Shapes from here on: `a` has b's number of dimensions (sizes 1 where it
# broadcasts), `initial` a step's (b's without `dim`), `mask` b's (sizes 1 where
# it broadcasts, n along `dim`). All share one dtype.


def _recurrence(
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None,
    reverse: bool,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Pick the route: each one computes the same states, differentiably.

    * ``torch.compile`` / ``torch.export`` tracing: the tree scan, one
      length-polymorphic op (see ``fscan._traced``), which autograd traces too.
    * ``torch.func`` transforms and forward-mode AD: the chunked walk in plain
      differentiable torch ops, which functorch differentiates and batches.
    * Eager, with a gradient wanted: :class:`_LinearRecurrenceFn`, whose backward
      is one more (reverse) linear recurrence; it saves only ``a`` and ``h``.
    * Eager without gradients: the chunked walk writing into preallocated memory.
    """
    if b.numel() == 0:
        return _empty(a, b, dim, initial)
    at = where([b])  # fscan._routing: tracing, transform, grad mode
    if at.tracing:
        return _tree(a, b, dim, initial, reverse, mask)
    if at.transform:
        return _solve(a, b, dim, initial, reverse, mask, fast=False)
    if at.grad and any(t is not None and t.requires_grad for t in (a, b, initial)):
        return _LinearRecurrenceFn.apply(a, b, initial, mask, dim, reverse)
    return _solve(a, b, dim, initial, reverse, mask, fast=True)


def _empty(
    a: torch.Tensor, b: torch.Tensor, dim: int, initial: torch.Tensor | None
) -> torch.Tensor:
    """The (empty) result of an empty ``b``, still connected to ``a`` and ``initial`` so
    that their gradients are zeros of their shapes, as the sequential loop's are."""
    h = torch.addcmul(b, a, torch.zeros_like(b))
    return h if initial is None else h + initial.unsqueeze(dim) * 0


class _LinearRecurrenceFn(torch.autograd.Function):
    """``h = linear_recurrence(a, b)`` with the adjoint recurrence as its backward.

    For ``h_t = a_t h_{t-1} + b_t`` and ``g_t = dL/dh_t`` the adjoint state
    ``lam_t = dL/db_t`` obeys the reverse recurrence ``lam_t = g_t + conj(a_{t+1})
    lam_{t+1}``; then ``dL/da_t = lam_t conj(h_{t-1})`` and ``dL/dinitial =
    conj(a_0) lam_0``: one linear recurrence and pointwise products, from ``a``
    and ``h`` alone (the walk's intermediates are not kept). A reset at ``t``
    cuts both the forward carry into ``t`` and the adjoint carry out of it.

    The backward is written with differentiable ops (and calls this Function
    again), so gradients of gradients work to any order.
    """

    @staticmethod
    def forward(ctx, a, b, initial, mask, dim, reverse):  # type: ignore[override]
        h = _solve(a, b, dim, initial, reverse, mask, fast=True)
        ctx.save_for_backward(a, h, initial, mask)
        ctx.dim, ctx.reverse = dim, reverse
        return h

    @staticmethod
    def backward(ctx, grad_h):  # type: ignore[override]
        a, h, initial, mask = ctx.saved_tensors
        args = (a, h, initial, mask, grad_h, ctx.dim, ctx.reverse, ctx.needs_input_grad[:3])
        # create_graph=True runs the backward with grad mode on: differentiable ops.
        grads = _adjoint_differentiable(*args) if torch.is_grad_enabled() else _adjoint(*args)
        return (*grads, None, None, None)


Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def _adjoint(
    a: torch.Tensor,
    h: torch.Tensor,
    initial: torch.Tensor | None,
    mask: torch.Tensor | None,
    grad_h: torch.Tensor,
    dim: int,
    reverse: bool,
    needs: tuple[bool, ...],
) -> Grads:
    """The gradients of ``a``, ``b``, ``initial``, on views and into preallocated memory.

    The adjoint gate at ``t`` is the forward gate one step later in scan order, so
    the adjoint recurrence runs on the views "all but the scan's first step" of
    ``a`` and "all but its last step" of ``grad_h``, with ``lam``'s last step
    (``grad_h``'s) as its initial state: no shifted copies of ``a`` or ``h``.
    """
    n = h.shape[dim]
    first, last = (n - 1, 0) if reverse else (0, n - 1)

    def later(x: torch.Tensor) -> torch.Tensor:  # every step but the scan's first
        return x.narrow(dim, 0, n - 1) if reverse else x.narrow(dim, 1, n - 1)

    def earlier(x: torch.Tensor) -> torch.Tensor:  # every step but the scan's last
        return x.narrow(dim, 1, n - 1) if reverse else x.narrow(dim, 0, n - 1)

    a = a.conj()
    lam = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    lam.select(dim, last).copy_(grad_h.select(dim, last))
    if n > 1:
        gate = a if a.shape[dim] == 1 else later(a)
        step_mask = None if mask is None else later(mask)
        end = grad_h.select(dim, last)
        _solve(gate, earlier(grad_h), dim, end, not reverse, step_mask, True, earlier(lam))
    grad_a = grad_initial = None
    if needs[0]:
        grad_a = torch.empty_like(lam)
        torch.mul(later(lam), earlier(h).conj(), out=later(grad_a))
        start = grad_a.select(dim, first)
        if initial is None:  # h_{-1} = 0
            start.zero_()
        else:
            torch.mul(lam.select(dim, first), initial.conj(), out=start)
        if mask is not None:
            grad_a.masked_fill_(mask, 0)
        grad_a = grad_a.sum_to_size(a.shape)
    if needs[2]:
        grad_initial = a.select(dim, min(first, a.shape[dim] - 1)) * lam.select(dim, first)
        if mask is not None:
            grad_initial = grad_initial.masked_fill(mask.select(dim, first), 0)
        grad_initial = grad_initial.sum_to_size(initial.shape)
    return grad_a, lam if needs[1] else None, grad_initial


def _adjoint_differentiable(
    a: torch.Tensor,
    h: torch.Tensor,
    initial: torch.Tensor | None,
    mask: torch.Tensor | None,
    grad_h: torch.Tensor,
    dim: int,
    reverse: bool,
    needs: tuple[bool, ...],
) -> Grads:
    """:func:`_adjoint` in differentiable ops (shifted copies, this Function again)."""
    n = h.shape[dim]
    a_next = a.conj() if a.shape[dim] == 1 else _toward_start(a.conj(), dim, reverse)
    mask_next = None if mask is None else _toward_start(mask, dim, reverse)
    lam = _adjoint_solve(a_next, grad_h, dim, not reverse, mask_next)
    grad_a = grad_initial = None
    if needs[0]:
        grad_a = lam * _toward_end(h, dim, reverse, initial).conj()
        if mask is not None:
            grad_a = torch.where(mask, 0, grad_a)
        grad_a = grad_a.sum_to_size(a.shape)
    if needs[2]:
        first = n - 1 if reverse else 0
        grad_initial = a.select(dim, min(first, a.shape[dim] - 1)).conj() * lam.select(dim, first)
        if mask is not None:
            grad_initial = torch.where(mask.select(dim, first), 0, grad_initial)
        grad_initial = grad_initial.sum_to_size(initial.shape)
    return grad_a, lam if needs[1] else None, grad_initial


def _adjoint_solve(
    a: torch.Tensor, g: torch.Tensor, dim: int, reverse: bool, mask: torch.Tensor | None
) -> torch.Tensor:
    """The adjoint recurrence: differentiable when a higher-order gradient is built."""
    if torch.is_grad_enabled() and (a.requires_grad or g.requires_grad):
        return _LinearRecurrenceFn.apply(a, g, None, mask, dim, reverse)
    return _solve(a, g, dim, None, reverse, mask, fast=True)


def _toward_start(x: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    """``y_t = x_{t+1}`` in scan order (toward the start by one); zero (False) last."""
    return _toward_end(x, dim, not reverse, None)


def _toward_end(
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


def _solve(
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
    if mask is None and (h := _kernel_solve(a, b, dim, reverse, initial, out)) is not None:
        ran("cpp")
        return h  # `out` itself if given: the kernel wrote it in place
    ran("blocked")  # the chunked walk (a single chunk, the loop, under 32 steps)
    chunk = _chunk_size(n)
    if chunk is not None:
        return _chunked(a, b, dim, initial, reverse, mask, chunk, fast, out)
    # Under 32 steps, the loop itself: no product of gates is formed, so none can
    # under/overflow into 0 * inf or inf * 0 (the tree multiplies them).
    return _sequential(_step, a, b, dim, initial, reverse, mask, fast, out)


def _kernel_solve(
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    reverse: bool,
    initial: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The recurrence by fscan's compiled C++ kernel (fscan.engine.cpu_kernel) where it is
    built and wins: no gradient wanted, one float dtype, enough elements, leaves of one
    shape after broadcasting. A broadcast gate is expanded to ``b``'s shape (a view:
    stride 0) and read in place, at any size: with only ``h`` stored, the kernel beat
    the chunked walk at (16384, 512) for (T, 1) and (1, C) gates (docs/linear.md).
    ``initial`` enters as the kernel's carry-in: the first step's pair becomes
    ``(a_0, a_0 initial + b_0)``, read in place of the leaves' (no copy of them).
    ``out``: written in place through its strides (the backward's narrowed view of
    ``lam``) and returned; unwritten where the kernel does not serve (None)."""
    from ._ops import KERNEL_MIN_NUMEL
    from .engine.cpu_kernel import kernel_scan

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
        _API, _compose, _PAIR, [a, b], dim, reverse, keep=_KEEP_H, head=head, out=into
    )
    return None if found is None else found[1]


def _chunk_size(n: int) -> int | None:
    """The largest power of two up to ``_MAX_CHUNK`` giving at least 4 chunks, or None."""
    chunk = _MAX_CHUNK
    while chunk > n // 4:
        chunk //= 2
    return chunk if chunk >= _MIN_CHUNK else None


def _compose(x: tuple[torch.Tensor, torch.Tensor], y: tuple[torch.Tensor, torch.Tensor]):
    """``(a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2)``: ``h -> a2 (a1 h + b1) + b2``."""
    return x[0] * y[0], torch.addcmul(y[1], y[0], x[1])


def _tree(
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
        return associative_scan(_compose, (a, b), dim, reverse)[1]
    return associative_scan(_compose, (a, b), dim, reverse, reset=mask)[1]


def _step(
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

    step: Callable[..., torch.Tensor]  # one step: ``_step``'s signature
    solve: Callable[..., torch.Tensor]  # the recurrence over chunk ends: ``_solve``'s
    toward_end: Callable[..., torch.Tensor]  # ``_toward_end``'s
    total: Callable[[torch.Tensor, int], torch.Tensor]  # the gates of a chunk composed
    # ``_repair``'s signature, or None where composing chunks is exact (log space:
    # sums of logs neither under- nor overflow)
    repair: Callable[..., torch.Tensor] | None = None


def _chunked(
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
    step, solve, toward_end, total, repair = algebra or _PLAIN
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
        # One unbind of the walked span instead of a `select` per step (see _chunked).
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


# ---- carries that gate products cannot give -------------------------------------
#
# The chunked walk composes a chunk's steps into one map ``e -> A e + B`` (``A`` the
# product of its gates, ``B`` its end state from zero), and the recurrence over
# chunks applies these maps. Up to rounding that is the loop, except where ``A`` is
# not a normal number: a product that underflowed to 0 (or a subnormal) meets an
# infinite state (``0 * inf`` is NaN where the loop keeps the inf) or a huge one
# (whose decayed part the loop keeps); a product that overflowed (or met an inf or
# NaN gate) meets a zero or finite state (``inf * 0``). The loop never forms the
# product, so it has none of these. Every composed carry is checked (one vectorised
# test of the chunks' products, a few more where one is not normal) and the lanes
# where one fails are walked step by step over the chunks where it fails.


class _Carries(NamedTuple):
    """The chunk-level recurrence of :func:`_chunked`, chunks along ``dim``: each
    chunk's gate product and end state from zero (``local``), the solved end states
    (``ends``), the chunks holding a reset (or None) and the state before the first."""

    gates: torch.Tensor
    local: torch.Tensor
    ends: torch.Tensor
    reset: torch.Tensor | None
    initial: torch.Tensor | None


def _inexact(
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


def _all_normal(gates: torch.Tensor) -> bool:
    """Whether every gate product is a normal number (one reduction, one sync)."""
    size = gates.abs()
    low, high = torch.aminmax(size)
    info = torch.finfo(size.dtype)
    return bool((low >= info.tiny) & (high <= info.max))  # False where a NaN is


def _values_hidden(*ts: torch.Tensor) -> bool:
    """Under ``vmap`` (also ``jacrev``'s, and the legacy batching of
    ``autograd.functional.jacobian(vectorize=True)``) no branch can depend on values."""
    functorch = torch._C._functorch
    if any(functorch.is_legacy_batchedtensor(t) for t in ts):
        return True
    if functorch.peek_interpreter_stack() is None:
        return False
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    vmap = functorch.TransformType.Vmap
    return any(i.key() == vmap for i in retrieve_all_functorch_interpreters())


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
    """``carries.ends`` with the carries :func:`_inexact` flags walked step by step.

    The first flagged chunk (in scan order, over all lanes) is entered correctly:
    every carry before it is exact. From there the flagged lanes run the
    recurrence over chunks one chunk at a time, each chunk composed (``A e + B``)
    where that is exact for every one of them and walked step by step where not.
    """
    gates, local, ends, reset, initial = carries
    dtype = ends.dtype
    if not (dtype.is_floating_point or dtype.is_complex) or _values_hidden(gates, ends):
        return ends  # integers wrap alike in any order; see _values_hidden
    if not dtype.is_complex and _all_normal(gates):  # the common case: one reduction, one sync
        return ends
    entering = toward_end(ends, dim, reverse, initial)
    shape = ends.movedim(dim, 0).shape  # (chunks, *the step's shape)
    count = shape[0]
    bad = _inexact(gates, entering, ends, reset).expand(ends.shape).movedim(dim, 0)
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
        if bool(_inexact(g[k], e, composed, f_k).any()):
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


_PLAIN = Algebra(_step, _solve, _toward_end, torch.prod, _repair)


# ---- shared pieces -----------------------------------------------------------


def _mask_for(reset: Any, b: torch.Tensor, dim: int, api: str = _API) -> torch.Tensor:
    """``reset`` checked against ``b`` and viewed with ``b``'s number of dimensions."""
    mask = check_reset(api, reset, b, [b], dim)
    return mask.reshape(tuple(mask.shape) + (1,) * (b.ndim - mask.ndim))


def _check_args(
    api: str,
    a: Any,
    b: Any,
    dim: Any,
    initial: Any,
    reverse: Any,
    matrix: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Check the arguments; return ``a``, ``b``, ``initial`` in one dtype and ``dim``."""
    gate = "A" if matrix else "a"
    if not isinstance(b, torch.Tensor):
        raise ScanTypeError(f"{api}: `b` must be a torch.Tensor, got {describe(b)}.")
    check_dense(api, "`b`", b)
    if isinstance(a, Number) and not matrix:
        # In b's dtype (promoted as a Python scalar would be), not rounded to float32.
        a = torch.tensor(a, dtype=_result_dtype(b, a), device=b.device)
    if not isinstance(a, torch.Tensor):
        raise ScanTypeError(f"{api}: `{gate}` must be a torch.Tensor, got {describe(a)}.")
    if not isinstance(reverse, bool):
        raise ScanTypeError(
            f"{api}: `reverse` must be a bool, got {type(reverse).__name__} {reverse!r}."
        )
    if initial is not None and not isinstance(initial, torch.Tensor):
        raise ScanTypeError(
            f"{api}: `initial` must be a torch.Tensor or None, got {describe(initial)}."
        )
    for name, t in ((gate, a), ("initial", initial)):
        if t is not None:
            check_dense(api, f"`{name}`", t)
    if b.ndim < (2 if matrix else 1):
        need = "(*batch, d) with a time dimension in batch" if matrix else "at least 1-D"
        raise ScanValueError(f"{api}: `b` has shape {tuple(b.shape)}, expected {need}.")
    dim = normalize_dim(api, dim, b.ndim, lambda: "`b`")
    if matrix and dim == b.ndim - 1:
        raise ScanValueError(
            f"{api}: `dim` {dim} is the state dimension of `b` (shape {tuple(b.shape)}), "
            "expected a batch dimension; `b` is (*batch, d) with time in batch."
        )
    for name, t in ((gate, a), ("initial", initial)):
        if t is not None and t.device != b.device:
            raise ScanValueError(f"{api}: `{name}` is on {t.device}, expected {b.device} like `b`.")
    _check_gate_shape(api, gate, a, b, matrix)
    if initial is not None:
        step = b.shape[:dim] + b.shape[dim + 1 :]
        if not _broadcasts_to(initial.shape, step):
            raise ScanValueError(
                f"{api}: `initial` of shape {tuple(initial.shape)} does not broadcast to one "
                f"step of `b`, shape {tuple(step)} (`b` with dim {dim} removed)."
            )
    dtype = _result_dtype(b, a)
    if initial is not None:
        dtype = torch.promote_types(dtype, initial.dtype)
    return a.to(dtype), b.to(dtype), None if initial is None else initial.to(dtype), dim


def _check_gate_shape(api: str, gate: str, a: torch.Tensor, b: torch.Tensor, matrix: bool) -> None:
    if not matrix:
        if not _broadcasts_to(a.shape, b.shape):
            raise ScanValueError(
                f"{api}: `a` of shape {tuple(a.shape)} does not broadcast to `b` of shape "
                f"{tuple(b.shape)}; gates are a scalar, per-channel, per-step or full."
            )
        return
    d = b.shape[-1]
    batch = b.shape[:-1]
    if a.ndim != b.ndim + 1 or a.shape[-2:] != (d, d) or not _broadcasts_to(a.shape[:-2], batch):
        raise ScanValueError(
            f"{api}: `A` of shape {tuple(a.shape)} does not fit `b` of shape "
            f"{tuple(b.shape)}: expected {(*batch, d, d)}, sizes 1 allowed in the batch."
        )


def _broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


_COMPLEX = {
    torch.float16: torch.complex32,
    torch.float32: torch.complex64,
    torch.float64: torch.complex128,
}


def _result_dtype(b: torch.Tensor, a: torch.Tensor | Number) -> torch.dtype:
    """``torch.result_type(b, a)`` for ``b`` of at least one dimension, worked out from
    dtypes alone: Dynamo cannot trace an op returning a dtype (a graph break), and
    ``torch.promote_types`` ignores that a 0-d tensor or a number only counts when
    it is of a higher category (bool < integer < floating < complex) than ``b``.

    Example:
        >>> _result_dtype(torch.ones(2), torch.tensor(1.0, dtype=torch.float64))
        torch.float32
        >>> _result_dtype(torch.ones(2, dtype=torch.int64), 0.5)
        torch.float32
    """
    if isinstance(a, torch.Tensor) and a.ndim > 0:
        return torch.promote_types(b.dtype, a.dtype)
    if isinstance(a, torch.Tensor):
        low = a.dtype
    elif isinstance(a, bool):
        low = torch.bool
    elif isinstance(a, int):
        low = torch.int64
    elif isinstance(a, complex):
        low = _COMPLEX[torch.get_default_dtype()]
    else:
        low = torch.get_default_dtype()
    high = b.dtype
    # c10's combine_categories: the tensor with dimensions wins within its category.
    if high.is_complex:
        return high
    if low.is_complex:
        return _COMPLEX.get(high, low) if high.is_floating_point else low
    if high.is_floating_point:
        return high
    if high == torch.bool or low.is_floating_point:
        return torch.promote_types(high, low)
    return high


def _accumulation_dtype(acc_dtype: Any, dtype: torch.dtype, api: str = _API) -> torch.dtype:
    """The dtype the walk runs in: ``acc_dtype`` promoted with the inputs' ``dtype``."""
    if not isinstance(acc_dtype, torch.dtype) or not (
        acc_dtype.is_floating_point or acc_dtype.is_complex
    ):
        raise ScanTypeError(
            f"{api}: `acc_dtype` must be a floating or complex torch.dtype such as "
            f"torch.float32, got {describe(acc_dtype)}."
        )
    return torch.promote_types(dtype, acc_dtype)
