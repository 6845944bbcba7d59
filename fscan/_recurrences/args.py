"""Argument checks of the linear recurrences (elementwise, matrix, log-space, sharded).

One place for what ``fscan.linear_recurrence`` and its siblings accept: tensor
types, shapes that broadcast, devices, the dtype the gates, inputs and ``initial``
promote to, the ``reset`` mask and ``acc_dtype``. Errors name the calling API.
"""

from __future__ import annotations

from numbers import Number
from typing import Any, NamedTuple

import torch

from .._checks import check_dense, normalize_dim, refuse_reverse
from .._engines.chunked import Operands
from .._errors import ScanTypeError, ScanValueError
from .._pytree import describe
from .._segmented import check_reset

__all__ = [
    "RecurrenceCall",
    "accumulation_dtype",
    "broadcasts_to",
    "check_initial_fits",
    "check_recurrence_args",
    "checked_widened",
    "reset_mask",
    "result_dtype",
    "shaped_operands",
]

_API = "fscan.linear_recurrence"


def reset_mask(reset: Any, b: torch.Tensor, dim: int, api: str = _API) -> torch.Tensor:
    """``reset`` checked against ``b`` and viewed with ``b``'s number of dimensions."""
    mask = check_reset(api, reset, b, [b], dim)
    return mask.reshape(tuple(mask.shape) + (1,) * (b.ndim - mask.ndim))


def check_recurrence_args(
    api: str,
    a: Any,
    b: Any,
    dim: Any,
    initial: Any,
    reverse: Any,
    matrix: bool,
    log_space: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Check the arguments; return ``a``, ``b``, ``initial`` in one dtype and ``dim``.

    ``log_space``: the arguments are ``log_a``, ``log_b`` and a log ``initial``, all
    real floating point (``fscan.log_linear_recurrence``)."""
    gate = "A" if matrix else "log_a" if log_space else "a"
    inputs = "log_b" if log_space else "b"
    if not isinstance(b, torch.Tensor):
        raise ScanTypeError(f"{api}: `{inputs}` must be a torch.Tensor, got {describe(b)}.")
    check_dense(api, f"`{inputs}`", b)
    if isinstance(a, Number) and not matrix and not (log_space and isinstance(a, complex)):
        # In b's dtype (promoted as a Python scalar would be), not rounded to float32.
        a = torch.tensor(a, dtype=result_dtype(b, a), device=b.device)
    if not isinstance(a, torch.Tensor):
        raise ScanTypeError(f"{api}: `{gate}` must be a torch.Tensor, got {describe(a)}.")
    if not isinstance(reverse, bool):  # the test inline: it runs on every call
        refuse_reverse(api, reverse)
    if initial is not None and not isinstance(initial, torch.Tensor):
        raise ScanTypeError(
            f"{api}: `initial` must be a torch.Tensor or None, got {describe(initial)}."
        )
    for name, t in ((gate, a), ("initial", initial)):
        if t is not None:
            check_dense(api, f"`{name}`", t)
    if log_space:
        _check_real(api, ((inputs, b), (gate, a), ("initial", initial)), b.device, inputs)
    if b.ndim < (2 if matrix else 1):
        need = "(*batch, d) with a time dimension in batch" if matrix else "at least 1-D"
        raise ScanValueError(f"{api}: `{inputs}` has shape {tuple(b.shape)}, expected {need}.")
    dim = normalize_dim(api, dim, b.ndim, lambda: f"`{inputs}`")
    if matrix and dim == b.ndim - 1:
        raise ScanValueError(
            f"{api}: `dim` {dim} is the state dimension of `b` (shape {tuple(b.shape)}), "
            "expected a batch dimension; `b` is (*batch, d) with time in batch."
        )
    for name, t in ((gate, a), ("initial", initial)):
        if t is not None and t.device != b.device:
            raise ScanValueError(f"{api}: `{name}` is on {t.device}, expected {b.device} like `b`.")
    _check_gate_shape(api, gate, inputs, a, b, matrix)
    check_initial_fits(api, initial, b, dim, inputs)
    dtype = result_dtype(b, a)
    if initial is not None:
        dtype = torch.promote_types(dtype, initial.dtype)
    return a.to(dtype), b.to(dtype), None if initial is None else initial.to(dtype), dim


class RecurrenceCall(NamedTuple):
    """One call of a recurrence function as its door got it, unchecked: ``a`` is the
    gates (``log_a``, ``A``), ``b`` the inputs; ``acc_dtype`` is the elementwise
    recurrence's, ``matrix_state`` the matrix recurrence's. Errors name ``api``."""

    api: str
    a: Any
    b: Any
    dim: Any
    initial: Any
    reverse: Any
    reset: Any
    acc_dtype: Any = None
    matrix_state: Any = False


def check_initial_fits(
    api: str, initial: torch.Tensor | None, b: torch.Tensor, dim: int, inputs: str = "b"
) -> None:
    """``initial`` (if given) broadcasts to one step of ``b`` (``b`` without ``dim``)."""
    if initial is None:
        return
    step = b.shape[:dim] + b.shape[dim + 1 :]
    if not broadcasts_to(initial.shape, step):
        raise ScanValueError(
            f"{api}: `initial` of shape {tuple(initial.shape)} does not broadcast to one "
            f"step of `{inputs}`, shape {tuple(step)} (`{inputs}` with dim {dim} removed)."
        )


def shaped_operands(call: RecurrenceCall, log_space: bool = False) -> tuple[Operands, torch.dtype]:
    """The arguments of an elementwise recurrence checked and shaped for the router
    (``a``, ``b``, ``initial`` widened to ``acc_dtype`` if given, ``reset`` as a mask),
    and the dtype of the result. The gates and ``initial`` get ``b``'s number of
    dimensions (a step's, for ``initial``): views, so that every route can broadcast
    and unsqueeze along ``dim``."""
    a, b, initial, dim, dtype = checked_widened(call, log_space)
    mask = None if call.reset is None else reset_mask(call.reset, b, dim, call.api)
    a = a.reshape((1,) * (b.ndim - a.ndim) + tuple(a.shape))
    if initial is not None:
        initial = initial.reshape((1,) * (b.ndim - 1 - initial.ndim) + tuple(initial.shape))
    return Operands(a, b, dim, initial, call.reverse, mask), dtype


def checked_widened(
    call: RecurrenceCall, log_space: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int, torch.dtype]:
    """:func:`check_recurrence_args` of an elementwise recurrence's call, then ``a``,
    ``b``, ``initial`` widened to ``call.acc_dtype`` if given; and the dtype of the
    result (the inputs' promoted dtype, before widening)."""
    api, a, b, dim, initial, reverse, _, acc_dtype, _ = call
    a, b, initial, dim = check_recurrence_args(api, a, b, dim, initial, reverse, False, log_space)
    dtype = b.dtype
    if acc_dtype is not None:
        wide = accumulation_dtype(acc_dtype, dtype, api)
        a, b = a.to(wide), b.to(wide)
        initial = None if initial is None else initial.to(wide)
    return a, b, initial, dim, dtype


def _check_real(
    api: str, named: tuple[tuple[str, Any], ...], device: torch.device, inputs: str
) -> None:
    """Log space: every tensor real floating point, on the inputs' device."""
    for name, t in named:
        if t is not None and not t.is_floating_point():
            raise ScanTypeError(
                f"{api}: `{name}` has dtype {t.dtype}, expected a real floating dtype: "
                "logs of positive gates and inputs (log space needs no complex numbers)."
            )
        if t is not None and t.device != device:
            raise ScanValueError(
                f"{api}: `{name}` is on {t.device}, expected {device} like `{inputs}`."
            )


def _check_gate_shape(
    api: str, gate: str, inputs: str, a: torch.Tensor, b: torch.Tensor, matrix: bool
) -> None:
    if not matrix:
        if not broadcasts_to(a.shape, b.shape):
            raise ScanValueError(
                f"{api}: `{gate}` of shape {tuple(a.shape)} does not broadcast to `{inputs}` "
                f"of shape {tuple(b.shape)}; gates are a scalar, per-channel, per-step or full."
            )
        return
    d = b.shape[-1]
    batch = b.shape[:-1]
    if a.ndim != b.ndim + 1 or a.shape[-2:] != (d, d) or not broadcasts_to(a.shape[:-2], batch):
        raise ScanValueError(
            f"{api}: `A` of shape {tuple(a.shape)} does not fit `b` of shape "
            f"{tuple(b.shape)}: expected {(*batch, d, d)}, sizes 1 allowed in the batch."
        )


def broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether ``shape`` broadcasts to ``target`` (``torch.broadcast_shapes(shape, target)
    == target``). Sizes that are plain ints are compared here: torch's function (its
    symbolic-shape reference) costs 10-15 µs, a third of a small recurrence's call."""
    if shape == target:
        return True
    if len(shape) <= len(target) and all(type(s) is int for s in (*shape, *target)):
        return all(s == 1 or s == t for s, t in zip(reversed(shape), reversed(target)))
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


_COMPLEX = {
    torch.float16: torch.complex32,
    torch.float32: torch.complex64,
    torch.float64: torch.complex128,
}


def result_dtype(b: torch.Tensor, a: torch.Tensor | Number) -> torch.dtype:
    """``torch.result_type(b, a)`` for ``b`` of at least one dimension, worked out from
    dtypes alone: Dynamo cannot trace an op returning a dtype (a graph break), and
    ``torch.promote_types`` ignores that a 0-d tensor or a number only counts when
    it is of a higher category (bool < integer < floating < complex) than ``b``.

    Example:
        >>> result_dtype(torch.ones(2), torch.tensor(1.0, dtype=torch.float64))
        torch.float32
        >>> result_dtype(torch.ones(2, dtype=torch.int64), 0.5)
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


def accumulation_dtype(acc_dtype: Any, dtype: torch.dtype, api: str = _API) -> torch.dtype:
    """The dtype the walk runs in: ``acc_dtype`` promoted with the inputs' ``dtype``."""
    if not isinstance(acc_dtype, torch.dtype) or not (
        acc_dtype.is_floating_point or acc_dtype.is_complex
    ):
        raise ScanTypeError(
            f"{api}: `acc_dtype` must be a floating or complex torch.dtype such as "
            f"torch.float32, got {describe(acc_dtype)}."
        )
    return torch.promote_types(dtype, acc_dtype)
