"""Solving a checked elementwise linear recurrence: which walk runs, and its gradients.

:func:`run_linear_recurrence` is the body of ``fscan.linear_recurrence`` below its
door (and DTensor's and the sharded recurrence's local solve): widen to
``acc_dtype``, shape the operands, route (:func:`_recurrence`). Gradients come from
:class:`LinearRecurrenceFn`, whose backward is one more linear recurrence running
the other way (:func:`adjoint_grads`), saving only ``a`` and ``h``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._context import where
from .args import accumulation_dtype, check_recurrence_args, reset_mask
from .chunked import solve, toward_end, toward_start, tree_solve

__all__ = [
    "LinearRecurrenceFn",
    "adjoint_grads",
    "adjoint_grads_differentiable",
    "run_linear_recurrence",
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
) -> torch.Tensor:
    """``fscan.linear_recurrence`` on plain tensors, its arguments checked here with
    errors naming ``api``."""
    a, b, initial, dim = check_recurrence_args(api, a, b, dim, initial, reverse, matrix=False)
    dtype = b.dtype
    if acc_dtype is not None:
        wide = accumulation_dtype(acc_dtype, dtype, api)
        a, b = a.to(wide), b.to(wide)
        initial = None if initial is None else initial.to(wide)
    mask = None if reset is None else reset_mask(reset, b, dim, api)
    # Gates and `initial` with b's number of dimensions (a step's, for `initial`):
    # views, so that every path below can broadcast and unsqueeze along `dim`.
    a = a.reshape((1,) * (b.ndim - a.ndim) + tuple(a.shape))
    if initial is not None:
        initial = initial.reshape((1,) * (b.ndim - 1 - initial.ndim) + tuple(initial.shape))
    return _recurrence(a, b, dim, initial, reverse, mask).to(dtype)


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
      length-polymorphic op (see ``fscan._engines.traced``), which autograd traces too.
    * ``torch.func`` transforms and forward-mode AD: the chunked walk in plain
      differentiable torch ops, which functorch differentiates and batches.
    * Eager, with a gradient wanted: :class:`LinearRecurrenceFn`, whose backward
      is one more (reverse) linear recurrence; it saves only ``a`` and ``h``.
    * Eager without gradients: the chunked walk writing into preallocated memory.
    """
    if b.numel() == 0:
        return _empty(a, b, dim, initial)
    at = where([b])  # fscan._routing.scan: tracing, transform, grad mode
    if at.tracing:
        return tree_solve(a, b, dim, initial, reverse, mask)
    if at.transform:
        return solve(a, b, dim, initial, reverse, mask, fast=False)
    if at.grad and any(t is not None and t.requires_grad for t in (a, b, initial)):
        return LinearRecurrenceFn.apply(a, b, initial, mask, dim, reverse)
    return solve(a, b, dim, initial, reverse, mask, fast=True)


def _empty(
    a: torch.Tensor, b: torch.Tensor, dim: int, initial: torch.Tensor | None
) -> torch.Tensor:
    """The (empty) result of an empty ``b``, still connected to ``a`` and ``initial`` so
    that their gradients are zeros of their shapes, as the sequential loop's are."""
    h = torch.addcmul(b, a, torch.zeros_like(b))
    return h if initial is None else h + initial.unsqueeze(dim) * 0


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
    def forward(ctx, a, b, initial, mask, dim, reverse):  # type: ignore[override]
        h = solve(a, b, dim, initial, reverse, mask, fast=True)
        ctx.save_for_backward(a, h, initial, mask)
        ctx.dim, ctx.reverse = dim, reverse
        return h

    @staticmethod
    def backward(ctx, grad_h):  # type: ignore[override]
        a, h, initial, mask = ctx.saved_tensors
        args = (a, h, initial, mask, grad_h, ctx.dim, ctx.reverse, ctx.needs_input_grad[:3])
        # create_graph=True runs the backward with grad mode on: differentiable ops.
        adjoint = adjoint_grads_differentiable if torch.is_grad_enabled() else adjoint_grads
        grads = adjoint(*args)
        return (*grads, None, None, None)


Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def adjoint_grads(
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
        solve(gate, earlier(grad_h), dim, end, not reverse, step_mask, True, earlier(lam))
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


def adjoint_grads_differentiable(
    a: torch.Tensor,
    h: torch.Tensor,
    initial: torch.Tensor | None,
    mask: torch.Tensor | None,
    grad_h: torch.Tensor,
    dim: int,
    reverse: bool,
    needs: tuple[bool, ...],
) -> Grads:
    """:func:`adjoint_grads` in differentiable ops (shifted copies, this Function again)."""
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
        return LinearRecurrenceFn.apply(a, g, None, mask, dim, reverse)
    return solve(a, g, dim, None, reverse, mask, fast=True)
