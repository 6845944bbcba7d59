"""The log-space recurrence's entry and gradients (``fscan.log_linear_recurrence``).

:data:`LOG` is what the recurrence is to the router (:mod:`fscan._routing.recurrence`):
the chunked walk in log space (a step is ``logaddexp(log a_t + log h, log b_t)``, a
chunk's gate the sum of its ``log a``, the empty state ``-inf``), its tree scan of
pairs, and :class:`LogLinearFn`, whose backward is one linear recurrence
(:func:`fscan._recurrences.solve.adjoint_grads`) with gates in ``[0, 1]``: see
:mod:`fscan._log_linear`.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from .._engines.chunked import Algebra, Operands, toward_end
from .._exclusive import check_exclusive
from .._routing.recurrence import Recurrence, route, solve
from .args import RecurrenceCall, shaped_operands
from .solve import Adjoint, adjoint_grads, exclusive_states, tree_solve

__all__ = ["LOG", "LogLinearFn", "log_compose", "log_step", "run_log_linear_recurrence"]

_NEG_INF = float("-inf")
log_toward_end = partial(toward_end, empty=_NEG_INF)


def run_log_linear_recurrence(
    api: str,
    log_a: Any,
    log_b: Any,
    dim: Any,
    initial: Any,
    reverse: Any,
    reset: Any,
    exclusive: Any = False,
) -> torch.Tensor:
    """``fscan.log_linear_recurrence`` on plain tensors, its arguments checked here."""
    call = RecurrenceCall(api, log_a, log_b, dim, initial, reverse, reset)
    ops = shaped_operands(call, log_space=True)[0]
    if exclusive is not False:
        check_exclusive(api, exclusive)
        if exclusive:
            return exclusive_states(LOG, ops, _NEG_INF)
    return route(LOG, ops)


class LogLinearFn(torch.autograd.Function):
    """The log-space recurrence with the stable adjoint of the module docstring."""

    @staticmethod
    def forward(ctx, la, lb, dim, initial, reverse, mask):  # type: ignore[override]
        log_h = solve(LOG, Operands(la, lb, dim, initial, reverse, mask), fast=True)
        ctx.save_for_backward(la, lb, log_h, initial, mask)
        ctx.dim, ctx.reverse = dim, reverse
        return log_h

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        la, lb, log_h, initial, mask = ctx.saved_tensors
        dim, reverse = ctx.dim, ctx.reverse
        needs_a, needs_b, _, needs_initial = ctx.needs_input_grad[:4]
        n = log_h.shape[dim]
        previous = log_toward_end(log_h, dim, reverse, initial)
        w = _ratio(la + previous, log_h)
        if mask is not None:
            w = torch.where(mask, 0, w)
        # Lam: the b-gradient of the linear recurrence with gates w (grad_h's shape).
        adjoint = Adjoint(w, grad, None, mask, grad, dim, reverse, (False, True, False))
        _, lam, _ = adjoint_grads(adjoint)
        grad_a = (lam * w).sum_to_size(la.shape) if needs_a else None
        grad_b = (lam * _ratio(lb, log_h)).sum_to_size(lb.shape) if needs_b else None
        grad_initial = None
        if needs_initial:
            first = n - 1 if reverse else 0
            grad_initial = (lam.select(dim, first) * w.select(dim, first)).sum_to_size(
                initial.shape
            )
        return grad_a, grad_b, None, grad_initial, None, None


def _ratio(log_num: torch.Tensor, log_den: torch.Tensor) -> torch.Tensor:
    """``exp(log_num - log_den)``, with ``0/0`` (both ``-inf``) taken as 0."""
    return torch.where(log_den == _NEG_INF, 0, torch.exp(log_num - log_den))


def log_compose(x: tuple[torch.Tensor, torch.Tensor], y: tuple[torch.Tensor, torch.Tensor]):
    """``(la1, lb1) then (la2, lb2) = (la1 + la2, logaddexp(la2 + lb1, lb2))``."""
    return x[0] + y[0], torch.logaddexp(y[0] + x[1], y[1])


def log_step(
    la_t: torch.Tensor,
    lb_t: torch.Tensor,
    m_t: torch.Tensor | None,
    h: torch.Tensor,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """``logaddexp(la_t + h, lb_t)``, or ``lb_t`` where ``m_t``; into ``out`` if given."""
    if out is None:
        new = torch.logaddexp(la_t + h, lb_t)
        return new if m_t is None else torch.where(m_t, lb_t, new)
    torch.add(la_t, h, out=out)
    torch.logaddexp(out, lb_t, out=out)
    if m_t is not None:
        torch.where(m_t, lb_t, out, out=out)
    return out


LOG = Recurrence(
    Algebra(log_step, log_toward_end, torch.sum),
    partial(tree_solve, log_compose, log_step),
    LogLinearFn.apply,
    short="tree",
)
"""The log-space recurrence as the router solves it (no C++ kernel)."""
