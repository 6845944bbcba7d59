"""``log h`` for ``h_t = a_t h_{t-1} + b_t`` with positive ``a``, ``b`` given as logs.

The minGRU/minLSTM "parallel scan in log space". The two-prefix-sum formulation
(Heinsen 2023), ``log h = A* + logcumsumexp(log b - A*)`` with ``A* =
cumsum(log a)``, subtracts a running sum that grows without bound: in float32
its error grows with the length (relative 1e-4 at 512 steps, 1e-3 at 4096). Here
the recurrence is walked in log space instead, ``log h_t = logaddexp(log a_t +
log h_{t-1}, log b_t)``, with the chunked form of :mod:`fscan._engines.chunked`: walk
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

import torch

from ._recurrences.log_solve import run_log_linear_recurrence
from ._route_log import logs_route

__all__ = ["log_linear_recurrence"]

_API = "fscan.log_linear_recurrence"


@logs_route(_API)
def log_linear_recurrence(
    log_a: torch.Tensor | Number,
    log_b: torch.Tensor,
    dim: int,
    *,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    exclusive: bool = False,
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
        exclusive (bool, default False): return ``log h`` entering each step instead:
            ``initial`` (else ``-inf``) at the first step, ``-inf`` at the resets, as in
            :func:`fscan.linear_recurrence`.

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
    return run_log_linear_recurrence(_API, log_a, log_b, dim, initial, reverse, reset, exclusive)
