"""``fscan.linear_recurrence_matrix``: ``h_t = A_t @ h_{t-1} + B_t`` with matrix gates.

States are vectors ``(d,)`` or matrices ``(d, k)`` (the DeltaNet / linear-attention
state); gates ``A`` are ``(d, d)``, per step or shared. One recursion serves every
case: the odd/even scan of :mod:`fscan._engines.tree` (combine neighbouring pairs, scan
the pairs, fill in the rest), specialised to the affine maps ``h -> A h + B``::

    (A1, B1) then (A2, B2) = (A2 @ A1, A2 @ B1 + B2)

* A gate shared over time (``A`` of shape ``(d, d)``, or size 1 along ``dim``,
  e.g. ``(batch, 1, d, d)``) is never materialised per step: every element at
  recursion level ``l`` covers ``2**l`` steps and has the same gate ``A**(2**l)``,
  so a level costs one ``d x d`` product for its gate plus the batched
  ``A**(2**l) @ B`` products: O(n d^2 k) work instead of O(n d^3), and no
  ``(n, d, d)`` tensor in memory.
* Per-step gates compose pairwise as usual, O(n d^3) work.
* ``reset`` marks steps where ``h_{t-1}`` is dropped. Each element carries a flag
  (a reset somewhere in the steps it covers) and the combine *masks the earlier
  operand* where the later one is flagged, ``A2 @ where(f2, 0, B1) + B2``, instead
  of multiplying by a zero gate: ``0 * inf = nan`` never happens, in the forward or
  the backward pass, so NaN and inf propagate exactly as in the sequential loop.
* ``initial`` is carried into the recursion: at every level the first element
  is combined with it (one ``d x d`` by ``d x k`` product per level), rather than
  folded into a copy of ``B``.
* ``reverse`` flips the inputs along time, scans and flips back.
* Products of gates can leave the floats' range (``(2 I)**1024`` is inf, ``(0.1
  I)**512`` is 0) and meet a state the loop would carry (``inf * 0``, ``0 * inf``:
  NaN); the loop never forms them. Any non-finite state in the result is such a
  suspect, so there the result is walked step by step instead (the loop's cost, on
  inputs that are infinite, NaN or out of range anyway).
* While ``torch.compile`` or ``torch.export`` traces, the recursion (which unrolls
  per length) gives way to a generic-mode scan over ``(flag, A, B)`` triples, one
  length-polymorphic op.

The tree and the loop are :mod:`fscan._engines.matrix_tree`; the router
(:func:`fscan._routing.recurrence.route_matrix`) picks among them and the traced
scan; the checks and the layout are the entry's (:mod:`fscan._recurrences.matrix`).
"""

from __future__ import annotations

import torch

from ._recurrences.args import RecurrenceCall
from ._recurrences.matrix import run_linear_recurrence_matrix
from ._route_log import logs_route

__all__ = ["linear_recurrence_matrix"]

_API = "fscan.linear_recurrence_matrix"


@logs_route(_API)
def linear_recurrence_matrix(
    A: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    *,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    matrix_state: bool = False,
    exclusive: bool = False,
) -> torch.Tensor:
    """All states of ``h_t = A_t @ h_{t-1} + b_t`` along ``dim`` (matrix-valued gates).

    Semantics (``h_{-1} = initial``, or 0)::

        for t in range(n):
            h[t] = (0 if reset[t] else A[t] @ h[t - 1]) + b[t]   # along `dim`

    Args:
        A (Tensor): gates ``(*batch_A, d, d)``; ``batch_A`` broadcasts to ``b``'s
            batch (right-aligned, as in torch). Size 1 along ``dim`` (or missing,
            e.g. a plain ``(d, d)``) shares one gate over time, never expanded per step.
        b (Tensor): inputs ``(*batch, d)``, or ``(*batch, d, k)`` with ``matrix_state``.
        dim (int): the time dimension, one of ``batch``; negative counts from the end.
        initial (Tensor or None, default None): the state before the first step,
            broadcastable to one step of ``b`` (``b`` with ``dim`` removed).
        reverse (bool, default False): run from the end, ``h_t = A_t @ h_{t+1} + b_t``.
        reset (bool Tensor or None, default None): where True, ``h_t = b_t``: a 1-D
            mask of length ``n``, or a mask with the batch's dimensions (``b``'s
            dimensions also work if the state's are size 1), broadcastable to it.
        matrix_state (bool, default False): states are ``(d, k)`` matrices.
        exclusive (bool, default False): return the state entering each step instead,
            ``h[t - 1]`` (``h[t + 1]`` reversed): ``initial`` (else 0) at the first step,
            0 at the resets; same shape.

    Returns:
        Tensor: ``h``, of ``b``'s shape and the promoted dtype; differentiable in
        ``A``, ``b`` and ``initial``, vmappable and compilable.

    Example:
        >>> import fscan, torch
        >>> rotate = torch.tensor([[0.0, -1.0], [1.0, 0.0]])  # one gate for every step
        >>> fscan.linear_recurrence_matrix(rotate, torch.tensor([[1.0, 0.0]]).expand(4, 2), 0)
        tensor([[1., 0.],
                [1., 1.],
                [0., 1.],
                [0., 0.]])
        >>> state = fscan.linear_recurrence_matrix(0.5 * torch.eye(3), torch.ones(6, 3, 2), 0,
        ...                                        matrix_state=True)
        >>> tuple(state.shape), state[-1, 0, 0].item()
        ((6, 3, 2), 1.96875)
    """
    call = RecurrenceCall(_API, A, b, dim, initial, reverse, reset, matrix_state=matrix_state)
    return run_linear_recurrence_matrix(call, exclusive)
