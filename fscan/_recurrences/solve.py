"""Solving a checked elementwise linear recurrence: its entry, and its gradients.

:func:`run_linear_recurrence` is the body of ``fscan.linear_recurrence`` below its
door (and DTensor's and the sharded recurrence's local solve): widen to
``acc_dtype``, shape the operands, and hand :data:`LINEAR` (what the plain
recurrence is to the router: its walk, its tree scan, its autograd Function) to
the router (:mod:`fscan._routing.recurrence`). Gradients come from
:class:`LinearRecurrenceFn`, whose backward is one more linear recurrence running
the other way (:func:`adjoint_grads`), saving only ``a`` and ``h``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from .._engines.chunked import Algebra, Operands, plain_step, toward_end, toward_start
from .._entry import scan_tree
from .._exclusive import Shift, Steps, check_exclusive, exclusive
from .._routing.recurrence import KERNEL_BAR, Recurrence, compose, kernel_adjoint, route, solve
from .args import RecurrenceCall, shaped_operands
from .composed_gates import repair_carries

__all__ = [
    "LINEAR",
    "Adjoint",
    "LinearRecurrenceFn",
    "adjoint_grads",
    "exclusive_states",
    "run_linear_recurrence",
    "tree_solve",
]


def run_linear_recurrence(
    api: str,
    a: Any,
    b: Any,
    dim: Any,
    initial: Any,
    reverse: Any,
    reset: Any,
    acc_dtype: Any,
    exclusive: Any = False,
) -> torch.Tensor:
    """``fscan.linear_recurrence`` on plain tensors, its arguments checked here with
    errors naming ``api``."""
    ops, dtype = shaped_operands(RecurrenceCall(api, a, b, dim, initial, reverse, reset, acc_dtype))
    if exclusive is not False:
        check_exclusive(api, exclusive)
        if exclusive:
            return exclusive_states(LINEAR, ops, 0.0).to(dtype)
    return route(LINEAR, ops).to(dtype)


def exclusive_states(kind: Recurrence, ops: Operands, empty: float) -> torch.Tensor:
    """The states entering each step of the recurrence ``kind`` (``exclusive=True``):
    ``initial`` (else ``empty``, the zero state) at the first step, ``empty`` at the
    resets (which restart from it), and the state after the step before elsewhere; the
    shift of :func:`fscan._exclusive.exclusive`, the walks writing into its view."""
    a, b, dim, initial, reverse, mask = ops
    shift = Shift(dim, b.shape[dim], reverse)

    def inclusive(steps: Steps, outs: list[torch.Tensor] | None) -> list[torch.Tensor]:
        part = Operands(
            steps(a), steps(b), dim, initial, reverse, None if mask is None else steps.mask(mask)
        )
        return [route(kind, part, None if outs is None else outs[0])]

    start = empty if initial is None else initial
    outputs, inputs = [(b.shape, b.dtype)], (a, b, initial)
    return exclusive(shift, inclusive, outputs, b.device, [start], inputs, mask, [empty])[0]


def tree_solve(
    compose: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    step: Callable[..., torch.Tensor],
    ops: Operands,
) -> torch.Tensor:
    """The pairs ``(a_t, b_t)`` scanned with ``compose`` through the internal entry (a
    segmented scan with ``mask``); ``initial`` enters the first pair by one ``step``."""
    a, b, dim, initial, reverse, mask = ops
    n = b.shape[dim]
    # One shape for both leaves: a per-row mask must broadcast to each of them.
    shape = torch.broadcast_shapes(a.shape, b.shape)
    a, b = a.expand(shape), b.expand(shape)
    if initial is not None:
        first = n - 1 if reverse else 0
        # A reset at the first step drops `initial`, inf and NaN too.
        m_first = None if mask is None else mask.select(dim, first)
        head = step(a.select(dim, first), b.select(dim, first), m_first, initial, None)
        # Not a `cat` with the other n - 1 steps: that makes torch.export guard on n.
        b = torch.slice_scatter(b, head.unsqueeze(dim), dim, first, first + 1)
    if mask is None:
        return scan_tree(compose, (a, b), dim, reverse)[1]
    return scan_tree(compose, (a, b), dim, reverse, reset=mask)[1]


class LinearRecurrenceFn(torch.autograd.Function):
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
    def forward(ctx, a, b, dim, initial, reverse, mask):  # type: ignore[override]
        h = solve(LINEAR, Operands(a, b, dim, initial, reverse, mask), fast=True)
        ctx.save_for_backward(a, h, initial, mask)
        ctx.dim, ctx.reverse = dim, reverse
        return h

    @staticmethod
    def backward(ctx, grad_h):  # type: ignore[override]
        a, h, initial, mask = ctx.saved_tensors
        needs = ctx.needs_input_grad
        wanted = (needs[0], needs[1], needs[3])
        adjoint = Adjoint(a, h, initial, mask, grad_h, ctx.dim, ctx.reverse, wanted)
        grad_a, grad_b, grad_initial = adjoint_grads(adjoint)
        return grad_a, grad_b, None, grad_initial, None, None


Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


class Adjoint(NamedTuple):
    """What the backward of ``h = linear_recurrence(a, b)`` reads: the gates, the states,
    ``initial`` and the mask of the forward, the cotangent ``grad_h``, and which of the
    gradients of ``a``, ``b``, ``initial`` are wanted."""

    a: torch.Tensor
    h: torch.Tensor
    initial: torch.Tensor | None
    mask: torch.Tensor | None
    grad_h: torch.Tensor
    dim: int
    reverse: bool
    needs: tuple[bool, bool, bool]


def adjoint_grads(adjoint: Adjoint) -> Grads:
    """The gradients of ``a``, ``b``, ``initial`` (None where not wanted): in place, or
    in differentiable ops where grad mode is on (``create_graph=True``)."""
    if torch.is_grad_enabled():
        return _adjoint_grads_differentiable(adjoint)
    return _adjoint_grads_in_place(adjoint)


def _adjoint_grads_in_place(adjoint: Adjoint) -> Grads:
    """The gradients of ``a``, ``b``, ``initial``, on views and into preallocated memory.

    Where the gates' gradient is wanted, the router's :func:`kernel_adjoint` first: one
    pass of the C++ kernel reads ``a``, ``h`` and ``grad_h`` and writes both gradients.
    Else the adjoint gate at ``t`` is the forward gate one step later in scan order, so
    the adjoint recurrence runs on the views "all but the scan's first step" of
    ``a`` and "all but its last step" of ``grad_h``, with ``lam``'s last step
    (``grad_h``'s) as its initial state: no shifted copies of ``a`` or ``h``.
    """
    a, h, initial, mask, grad_h, dim, reverse, needs = adjoint
    n = h.shape[dim]
    first, last = (n - 1, 0) if reverse else (0, n - 1)

    def later(x: torch.Tensor) -> torch.Tensor:  # every step but the scan's first
        return x.narrow(dim, 0, n - 1) if reverse else x.narrow(dim, 1, n - 1)

    def earlier(x: torch.Tensor) -> torch.Tensor:  # every step but the scan's last
        return x.narrow(dim, 1, n - 1) if reverse else x.narrow(dim, 0, n - 1)

    fused = kernel_adjoint(LINEAR, a, h, grad_h, dim, reverse, mask) if needs[0] else None
    a = a.conj()
    grad_a = grad_initial = None
    if fused is not None:
        lam, grad_a = fused  # grad_a: 0 at the first step, which reads `initial`
    else:
        lam = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        lam.select(dim, last).copy_(grad_h.select(dim, last))
        if n > 1:
            gate = a if a.shape[dim] == 1 else later(a)
            step_mask = None if mask is None else later(mask)
            end = grad_h.select(dim, last)
            adjoint = Operands(gate, earlier(grad_h), dim, end, not reverse, step_mask)
            solve(LINEAR, adjoint, True, earlier(lam))
        if needs[0]:
            grad_a = torch.empty_like(lam)
            torch.mul(later(lam), earlier(h).conj(), out=later(grad_a))
            if initial is None:  # h_{-1} = 0
                grad_a.select(dim, first).zero_()
    if grad_a is not None:
        if initial is not None:
            torch.mul(lam.select(dim, first), initial.conj(), out=grad_a.select(dim, first))
        if mask is not None:
            grad_a.masked_fill_(mask, 0)
        grad_a = grad_a.sum_to_size(a.shape)
    if needs[2]:
        grad_initial = a.select(dim, min(first, a.shape[dim] - 1)) * lam.select(dim, first)
        if mask is not None:
            grad_initial = grad_initial.masked_fill(mask.select(dim, first), 0)
        grad_initial = grad_initial.sum_to_size(initial.shape)
    return grad_a, lam if needs[1] else None, grad_initial


def _adjoint_grads_differentiable(adjoint: Adjoint) -> Grads:
    """:func:`_adjoint_grads_in_place` in differentiable ops (shifted copies, and this
    Function again)."""
    a, h, initial, mask, grad_h, dim, reverse, needs = adjoint
    n = h.shape[dim]
    a_next = a.conj() if a.shape[dim] == 1 else toward_start(a.conj(), dim, reverse)
    mask_next = None if mask is None else toward_start(mask, dim, reverse)
    lam = _adjoint_solve(a_next, grad_h, dim, not reverse, mask_next)
    grad_a = grad_initial = None
    if needs[0]:
        grad_a = lam * toward_end(h, dim, reverse, initial).conj()
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
        return LinearRecurrenceFn.apply(a, g, dim, None, reverse, mask)
    return solve(LINEAR, Operands(a, g, dim, None, reverse, mask), fast=True)


LINEAR = Recurrence(
    Algebra(plain_step, toward_end, torch.prod, repair_carries),
    partial(tree_solve, compose, plain_step),
    LinearRecurrenceFn.apply,
    short="loop",
    kernel=KERNEL_BAR,
)
"""The plain recurrence ``h_t = a_t h_{t-1} + b_t`` as the router solves it."""
