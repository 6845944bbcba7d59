"""``log h`` for ``h_t = a_t h_{t-1} + b_t`` with positive ``a``, ``b`` given as logs.

The minGRU/minLSTM "parallel scan in log space". The two-prefix-sum formulation
(Heinsen 2023), ``log h = A* + logcumsumexp(log b - A*)`` with ``A* =
cumsum(log a)``, subtracts a running sum that grows without bound: in float32
its error grows with the length (relative 1e-4 at 512 steps, 1e-3 at 4096). Here
the recurrence is walked in log space instead, ``log h_t = logaddexp(log a_t +
log h_{t-1}, log b_t)``, with the chunked form of :mod:`fscan._recurrences.chunked`: walk
chunks from the empty state (``-inf``), solve the chunk-level recurrence (gates:
each chunk's summed ``log a``), walk the chunks again. Every operand stays the
size of a log state, so the error is that of a float32 sequential loop.

The backward is one linear recurrence (:mod:`fscan._recurrences.solve`) with gates in
``[0, 1]``: for ``G_t = dL/dlog h_t``, ``Lam_t = G_t + w_{t+1} Lam_{t+1}`` with
``w_t = exp(log a_t + log h_{t-1} - log h_t) = a_t h_{t-1} / h_t``; then
``dL/dlog a_t = Lam_t w_t`` and ``dL/dlog b_t = Lam_t exp(log b_t - log h_t)``.
Where ``h_t = 0`` (``log h_t = -inf``) both factors are ``0/0``; they are taken as
0, so an empty state passes no NaN into the gradients of the others.
"""

from __future__ import annotations

from numbers import Number
from typing import Any

import torch

from ._checks import check_dense, normalize_dim
from ._context import where
from ._entry import scan_tree
from ._errors import ScanTypeError, ScanValueError
from ._pytree import describe
from ._recurrences.args import broadcasts_to, reset_mask, result_dtype
from ._recurrences.chunked import Algebra, chunk_size, chunked_solve
from ._recurrences.solve import adjoint_grads, adjoint_grads_differentiable
from ._route_log import logs_route, ran

__all__ = ["log_linear_recurrence"]

_API = "fscan.log_linear_recurrence"
_NEG_INF = float("-inf")


@logs_route(_API)
def log_linear_recurrence(
    log_a: torch.Tensor | Number,
    log_b: torch.Tensor,
    dim: int,
    *,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log h`` for ``h_t = a_t * h_{t-1} + b_t`` along ``dim``, from ``log a`` and ``log b``.

    Semantics (``log h_{-1} = initial``, or ``-inf``: ``h_{-1} = 0``)::

        for t in range(n):
            log_h[t] = log_b[t] if reset[t] else torch.logaddexp(log_a[t] + log_h[t - 1], log_b[t])

    Args:
        log_a (Tensor or number): the log gates, broadcastable to ``log_b``, as the
            gates of :func:`fscan.linear_recurrence`; ``-inf`` is a zero gate.
        log_b (Tensor): the log inputs, real floating point, at least 1-D; ``-inf``
            is a zero input. The result has its shape.
        dim (int): the time dimension of ``log_b``; negative counts from the end.
        initial (Tensor or None, default None): ``log h`` before the first step,
            broadcastable to one step of ``log_b``.
        reverse (bool, default False): run from the end of ``dim``.
        reset (bool Tensor or None, default None): restart where True,
            ``log h_t = log b_t``, as in :func:`fscan.linear_recurrence`.

    Returns:
        Tensor: ``log h``, of ``log_b``'s shape and the promoted dtype; differentiable
        (NaN-free wherever the true gradient is finite, also at ``-inf`` inputs),
        usable under ``torch.func`` transforms, ``torch.compile`` and ``torch.export``.

    Example:
        >>> import fscan, torch
        >>> log_h = fscan.log_linear_recurrence(torch.tensor(0.5).log(), torch.zeros(4), 0)
        >>> log_h.exp()
        tensor([1.0000, 1.5000, 1.7500, 1.8750])
    """
    log_a, log_b, initial, dim = _check_args(log_a, log_b, dim, initial, reverse)
    mask = None if reset is None else reset_mask(reset, log_b, dim, api=_API)
    log_a = log_a.reshape((1,) * (log_b.ndim - log_a.ndim) + tuple(log_a.shape))
    if initial is not None:
        initial = initial.reshape((1,) * (log_b.ndim - 1 - initial.ndim) + tuple(initial.shape))
    return _recurrence(log_a, log_b, dim, initial, reverse, mask)


def _recurrence(
    la: torch.Tensor,
    lb: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None,
    reverse: bool,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The routes of :func:`fscan._recurrences.solve._recurrence`, in log space."""
    if lb.numel() == 0:  # still connected to every input: zero gradients
        out = lb + la * 0
        return out if initial is None else out + initial.unsqueeze(dim) * 0
    at = where([lb])  # fscan._routing.scan: tracing, transform, grad mode
    if at.tracing:
        return _tree(la, lb, dim, initial, reverse, mask)
    if at.transform:
        return _solve(la, lb, dim, initial, reverse, mask, fast=False)
    if at.grad and any(t is not None and t.requires_grad for t in (la, lb, initial)):
        return _LogLinearFn.apply(la, lb, initial, mask, dim, reverse)
    return _solve(la, lb, dim, initial, reverse, mask, fast=True)


class _LogLinearFn(torch.autograd.Function):
    """The log-space recurrence with the stable adjoint of the module docstring."""

    @staticmethod
    def forward(ctx, la, lb, initial, mask, dim, reverse):  # type: ignore[override]
        log_h = _solve(la, lb, dim, initial, reverse, mask, fast=True)
        ctx.save_for_backward(la, lb, log_h, initial, mask)
        ctx.dim, ctx.reverse = dim, reverse
        return log_h

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        la, lb, log_h, initial, mask = ctx.saved_tensors
        dim, reverse = ctx.dim, ctx.reverse
        needs_a, needs_b, needs_initial = ctx.needs_input_grad[:3]
        n = log_h.shape[dim]
        previous = _toward_end(log_h, dim, reverse, initial)
        w = _ratio(la + previous, log_h)
        if mask is not None:
            w = torch.where(mask, 0, w)
        # Lam: the b-gradient of the linear recurrence with gates w (grad_h's shape).
        adjoint = adjoint_grads_differentiable if torch.is_grad_enabled() else adjoint_grads
        _, lam, _ = adjoint(w, grad, None, mask, grad, dim, reverse, (False, True, False))
        grad_a = (lam * w).sum_to_size(la.shape) if needs_a else None
        grad_b = (lam * _ratio(lb, log_h)).sum_to_size(lb.shape) if needs_b else None
        grad_initial = None
        if needs_initial:
            first = n - 1 if reverse else 0
            grad_initial = (lam.select(dim, first) * w.select(dim, first)).sum_to_size(
                initial.shape
            )
        return grad_a, grad_b, grad_initial, None, None, None


def _ratio(log_num: torch.Tensor, log_den: torch.Tensor) -> torch.Tensor:
    """``exp(log_num - log_den)``, with ``0/0`` (both ``-inf``) taken as 0."""
    return torch.where(log_den == _NEG_INF, 0, torch.exp(log_num - log_den))


def _toward_end(
    x: torch.Tensor, dim: int, reverse: bool, first: torch.Tensor | None
) -> torch.Tensor:
    """``y_t = x_{t-1}`` in scan order; ``first`` (or ``-inf``, the empty state) first."""
    n = x.shape[dim]
    start = torch.full_like(x.narrow(dim, 0, 1), _NEG_INF)
    if first is not None:
        start = first.unsqueeze(dim).expand_as(start)
    if reverse:
        return torch.cat([x.narrow(dim, 1, n - 1), start], dim)
    return torch.cat([start, x.narrow(dim, 0, n - 1)], dim)


def _compose(x: tuple[torch.Tensor, torch.Tensor], y: tuple[torch.Tensor, torch.Tensor]):
    """``(la1, lb1) then (la2, lb2) = (la1 + la2, logaddexp(la2 + lb1, lb2))``."""
    return x[0] + y[0], torch.logaddexp(y[0] + x[1], y[1])


def _tree(
    la: torch.Tensor,
    lb: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None,
    reverse: bool,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    n = lb.shape[dim]
    shape = torch.broadcast_shapes(la.shape, lb.shape)
    la, lb = la.expand(shape), lb.expand(shape)
    if initial is not None:
        first = n - 1 if reverse else 0
        lb_first = lb.select(dim, first)
        head = torch.logaddexp(la.select(dim, first) + initial, lb_first)
        if mask is not None:
            head = torch.where(mask.select(dim, first), lb_first, head)
        lb = torch.slice_scatter(lb, head.unsqueeze(dim), dim, first, first + 1)
    if mask is None:
        return scan_tree(_compose, (la, lb), dim, reverse)[1]
    return scan_tree(_compose, (la, lb), dim, reverse, reset=mask)[1]


def _solve(
    la: torch.Tensor,
    lb: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None,
    reverse: bool,
    mask: torch.Tensor | None,
    fast: bool,
) -> torch.Tensor:
    n = lb.shape[dim]
    la = la.expand(*(n if i == dim else s for i, s in enumerate(la.shape)))
    chunk = chunk_size(n)
    if chunk is None:
        return _tree(la, lb, dim, initial, reverse, mask)
    ran("blocked")
    return chunked_solve(la, lb, dim, initial, reverse, mask, chunk, fast, algebra=_LOG)


def _step(
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


_LOG = Algebra(_step, _solve, _toward_end, torch.sum)


def _check_args(
    log_a: Any, log_b: Any, dim: Any, initial: Any, reverse: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Check the arguments; return ``log_a``, ``log_b``, ``initial`` in one dtype and ``dim``."""
    if not isinstance(log_b, torch.Tensor):
        raise ScanTypeError(f"{_API}: `log_b` must be a torch.Tensor, got {describe(log_b)}.")
    check_dense(_API, "`log_b`", log_b)
    if isinstance(log_a, Number) and not isinstance(log_a, complex):
        log_a = torch.tensor(log_a, dtype=result_dtype(log_b, log_a), device=log_b.device)
    if not isinstance(log_a, torch.Tensor):
        raise ScanTypeError(f"{_API}: `log_a` must be a torch.Tensor, got {describe(log_a)}.")
    if not isinstance(reverse, bool):
        raise ScanTypeError(
            f"{_API}: `reverse` must be a bool, got {type(reverse).__name__} {reverse!r}."
        )
    if initial is not None and not isinstance(initial, torch.Tensor):
        raise ScanTypeError(
            f"{_API}: `initial` must be a torch.Tensor or None, got {describe(initial)}."
        )
    for name, t in (("log_a", log_a), ("initial", initial)):
        if t is not None:
            check_dense(_API, f"`{name}`", t)
    for name, t in (("log_b", log_b), ("log_a", log_a), ("initial", initial)):
        if t is not None and not t.is_floating_point():
            raise ScanTypeError(
                f"{_API}: `{name}` has dtype {t.dtype}, expected a real floating dtype: "
                "logs of positive gates and inputs (log space needs no complex numbers)."
            )
        if t is not None and t.device != log_b.device:
            raise ScanValueError(
                f"{_API}: `{name}` is on {t.device}, expected {log_b.device} like `log_b`."
            )
    if log_b.ndim < 1:
        raise ScanValueError(f"{_API}: `log_b` has shape (), expected at least 1-D.")
    dim = normalize_dim(_API, dim, log_b.ndim, lambda: "`log_b`")
    if not broadcasts_to(log_a.shape, log_b.shape):
        raise ScanValueError(
            f"{_API}: `log_a` of shape {tuple(log_a.shape)} does not broadcast to `log_b` of "
            f"shape {tuple(log_b.shape)}; gates are a scalar, per-channel, per-step or full."
        )
    step = log_b.shape[:dim] + log_b.shape[dim + 1 :]
    if initial is not None and not broadcasts_to(initial.shape, step):
        raise ScanValueError(
            f"{_API}: `initial` of shape {tuple(initial.shape)} does not broadcast to one step "
            f"of `log_b`, shape {tuple(step)} (`log_b` with dim {dim} removed)."
        )
    dtype = result_dtype(log_b, log_a)
    if initial is not None:
        dtype = torch.promote_types(dtype, initial.dtype)
    return (
        log_a.to(dtype),
        log_b.to(dtype),
        None if initial is None else initial.to(dtype),
        dim,
    )
