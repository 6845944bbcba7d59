"""The door of ``fscan.linear_recurrence``: ``h_t = a_t * h_{t-1} + b_t``, elementwise.

(Matrices: ``_linear_matrix``.) This module holds the public function and its
DTensor dispatch; the entry and the gradients live in :mod:`fscan._recurrences.solve`,
the choice of engine in :mod:`fscan._routing.recurrence` and the chunked walks in
:mod:`fscan._engines.chunked`.

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
which the loop never does: where that product leaves the floats' range and meets an
infinite, zero or huge state, the carry is walked step by step instead
(:mod:`fscan._recurrences.composed_gates`); scans under 32 steps are the loop itself.
``initial`` enters as the carry of the first chunk (folded into the first step of
the chunk recurrence), not as an extra pass; ``reset`` selects ``h_t = b_t`` with
``torch.where`` where it is set (a zero gate would turn an inf or NaN before the
reset into NaN after it).

Gradients come from a custom autograd Function
(:class:`fscan._recurrences.solve.LinearRecurrenceFn`): the adjoint of a linear
recurrence is a linear recurrence running the other way, so the backward reuses the
same walk, saving only ``a`` and ``h``. Without a tape to feed, the walks write into
preallocated memory (``out=``).
"""

from __future__ import annotations

from numbers import Number

import torch

from ._exclusive import refuse_sharded_exclusive
from ._recurrences.solve import run_linear_recurrence
from ._route_log import logs_route
from ._sharded.dtensor import any_dtensor, dtensor_linear_recurrence

__all__ = ["linear_recurrence"]

_API = "fscan.linear_recurrence"


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
    exclusive: bool = False,
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
        exclusive (bool, default False): return the state entering each step instead,
            ``h[t - 1]`` (``h[t + 1]`` reversed): ``initial`` (else 0) at the first step
            and 0 at the resets, which restart from zero; same shape.

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
        >>> fscan.linear_recurrence(0.5, torch.ones(4), 0, exclusive=True)
        tensor([0.0000, 1.0000, 1.5000, 1.7500])
    """
    if any_dtensor((a, b, initial, reset)):  # sharded across ranks: see fscan._sharded.dtensor
        if exclusive is not False:
            refuse_sharded_exclusive(_API)
        args = dict(initial=initial, reverse=reverse, reset=reset, acc_dtype=acc_dtype)
        return dtensor_linear_recurrence(a, b, dim, **args)
    return run_linear_recurrence(_API, a, b, dim, initial, reverse, reset, acc_dtype, exclusive)
