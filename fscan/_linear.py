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
plain differentiable, vmappable torch ops. ``initial`` enters as the carry of the
first chunk (folded into the first step of the chunk recurrence), not as an extra
pass; ``reset`` zeroes the gate where it is set, ``h_t = 0 * h_{t-1} + b_t``.
"""

from __future__ import annotations

from numbers import Number
from typing import Any

import torch

from ._checks import normalize_dim
from ._errors import ScanTypeError, ScanValueError
from ._pytree import describe
from ._scan import associative_scan
from ._segmented import check_reset

__all__ = ["linear_recurrence"]

_API = "fscan.linear_recurrence"
# Chunk sizes: 64 steps per chunk measured fastest on (8, 4096, 256) (fewer,
# larger chunks mean more sequential calls on smaller slices); below 8 steps per
# chunk the walks cost more than they save and the tree scan is used directly.
_MAX_CHUNK = 64
_MIN_CHUNK = 8


def linear_recurrence(
    a: torch.Tensor | Number,
    b: torch.Tensor,
    dim: int,
    *,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
) -> torch.Tensor:
    """All states of ``h_t = a_t * h_{t-1} + b_t`` along ``dim``, in one call.

    Semantics (``h_{-1} = initial``, or 0)::

        for t in range(n):
            h[t] = (0 if reset[t] else a[t] * h[t - 1]) + b[t]   # along `dim`

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
            ``fscan.associative_scan``. A reset at the first step drops ``initial``.

    Returns:
        Tensor: ``h``, of ``b``'s shape and the promoted dtype of ``a``, ``b`` and
        ``initial``; differentiable in all three (complex too) and vmappable.

    Example:
        >>> import fscan, torch
        >>> fscan.linear_recurrence(0.5, torch.ones(4), 0)
        tensor([1.0000, 1.5000, 1.7500, 1.8750])
        >>> fscan.linear_recurrence(torch.tensor(2.0), torch.ones(3), 0, initial=torch.tensor(1.0))
        tensor([ 3.,  7., 15.])
        >>> fscan.linear_recurrence(0.5, torch.ones(4), 0, reset=torch.tensor([0, 0, 1, 0]) > 0)
        tensor([1.0000, 1.5000, 1.0000, 1.5000])
    """
    a, b, initial, dim = _check_args(_API, a, b, dim, initial, reverse, matrix=False)
    if reset is not None:
        a = torch.where(_mask_for(reset, b, dim), 0, a)
    if b.shape[dim] == 0:
        return b.clone()
    return _solve(a, b, dim, initial, reverse)


# ---- the elementwise recurrence ---------------------------------------------


def _solve(
    a: torch.Tensor, b: torch.Tensor, dim: int, initial: torch.Tensor | None, reverse: bool
) -> torch.Tensor:
    """Dispatch on length: chunked walks for long scans, the tree for short ones."""
    n = b.shape[dim]
    a = a.reshape((1,) * (b.ndim - a.ndim) + tuple(a.shape))
    a = a.expand(*(n if i == dim else s for i, s in enumerate(a.shape)))  # stride 0 if constant
    chunk = _chunk_size(n)
    if chunk is None:
        return _tree(a, b, dim, initial, reverse)
    return _chunked(a, b, dim, initial, reverse, chunk)


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
    a: torch.Tensor, b: torch.Tensor, dim: int, initial: torch.Tensor | None, reverse: bool
) -> torch.Tensor:
    if initial is not None:
        b = _fold_initial(b, dim, reverse, lambda first: a.select(dim, first) * initial)
    return associative_scan(_compose, (a, b), dim, reverse)[1]


def _chunked(
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None,
    reverse: bool,
    chunk: int,
) -> torch.Tensor:
    n = b.shape[dim]
    tail = n % chunk
    # Whole chunks, aligned to where the scan starts; the short tail comes last.
    start = tail if reverse else 0
    a_main = a.narrow(dim, start, n - tail).unflatten(dim, (-1, chunk))
    b_main = b.narrow(dim, start, n - tail).unflatten(dim, (-1, chunk))
    within = dim + 1
    steps = range(chunk - 1, -1, -1) if reverse else range(chunk)
    # Unbind once: a `select` per step would make autograd zero-fill a full-size
    # gradient for every step, turning the backward quadratic in the chunk length.
    a_steps, b_steps = a_main.unbind(within), b_main.unbind(within)
    # Step 1: each chunk's end state from a zero start, and its total gate.
    ends = None
    for t in steps:
        ends = b_steps[t] if ends is None else torch.addcmul(b_steps[t], a_steps[t], ends)
    gates = a_main.prod(within)
    # Step 2: the true end state of every chunk, a recurrence over chunks.
    ends = _solve(gates, ends, dim, initial, reverse)
    entering = _shift(ends, dim, initial, reverse)
    # Step 3: walk every chunk again from its entering state, keeping all steps.
    states, h = [], entering
    for t in steps:
        h = torch.addcmul(b_steps[t], a_steps[t], h)
        states.append(h)
    if reverse:
        states.reverse()
    main = torch.stack(states, within).flatten(dim, within)
    if not tail:
        return main
    last = ends.select(dim, 0 if reverse else ends.shape[dim] - 1)
    rest = _walk(a, b, dim, range(tail - 1, -1, -1) if reverse else range(n - tail, n), last)
    return torch.cat([rest, main] if reverse else [main, rest], dim)


def _shift(
    ends: torch.Tensor, dim: int, initial: torch.Tensor | None, reverse: bool
) -> torch.Tensor:
    """The state entering each chunk: the previous chunk's end, ``initial`` (or 0) first."""
    count = ends.shape[dim]
    first = ends.narrow(dim, 0, 1)
    start = torch.zeros_like(first) if initial is None else initial.unsqueeze(dim).expand_as(first)
    if reverse:
        return torch.cat([ends.narrow(dim, 1, count - 1), start], dim)
    return torch.cat([start, ends.narrow(dim, 0, count - 1)], dim)


def _walk(
    a: torch.Tensor, b: torch.Tensor, dim: int, steps: range, h: torch.Tensor
) -> torch.Tensor:
    """A plain sequential walk over a few ``steps`` from state ``h``, stacked in index order."""
    states = {}
    low = min(steps)
    # One unbind of the walked span instead of a `select` per step (see _chunked).
    a_steps = a.narrow(dim, low, len(steps)).unbind(dim)
    b_steps = b.narrow(dim, low, len(steps)).unbind(dim)
    for t in steps:
        h = torch.addcmul(b_steps[t - low], a_steps[t - low], h)
        states[t] = h
    return torch.stack([states[t] for t in sorted(states)], dim)


# ---- shared pieces -----------------------------------------------------------


def _fold_initial(b: torch.Tensor, dim: int, reverse: bool, carried: Any) -> torch.Tensor:
    """``b`` with ``carried(first)`` (the initial state pushed through the first gate)
    added to its first step in scan order: ``b_0 + a_0 h_{-1}``."""
    n = b.shape[dim]
    first = n - 1 if reverse else 0
    head = (b.select(dim, first) + carried(first)).unsqueeze(dim)
    rest = b.narrow(dim, 0, n - 1) if reverse else b.narrow(dim, 1, n - 1)
    return torch.cat([rest, head] if reverse else [head, rest], dim)


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
    if isinstance(a, Number) and not matrix:
        # In b's dtype (promoted as a Python scalar would be), not rounded to float32.
        a = torch.tensor(a, dtype=torch.result_type(b, a), device=b.device)
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
    dtype = torch.result_type(a, b)
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
