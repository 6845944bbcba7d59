"""``out=`` on the drop-ins as torch has it: the checks before a call, the write after.

Where fscan (not torch's op) serves a drop-in with ``out=``, :func:`check_out` /
:func:`check_extremum_out` apply torch's rules before the call (cumsum/cumprod compute
in ``out``'s dtype, which ``dtype=`` must equal; the others want ``out`` in the input's
dtype, cummax/cummin's indices in int64; no ``out=`` while autograd records a tensor
that requires grad) and :func:`write_out` writes the result (resizing ``out`` with
torch's warning where its shape differs) and returns ``out``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ._errors import OutArgumentError, ScanTypeError

__all__ = [
    "OUT_TYPES",
    "check_extremum_out",
    "check_out",
    "direct_out",
    "refuse_autograd",
    "write_out",
    "written",
]

OUT_TYPES = {
    torch.cummax: torch.return_types.cummax_out,
    torch.cummin: torch.return_types.cummin_out,
}


def check_out(
    api: str,
    input: Any,
    out: Any,
    dtype: torch.dtype | None = None,
    computes_in_out_dtype: bool = False,
) -> torch.dtype | None:
    """torch's checks of one ``out`` tensor before the call; the dtype to compute in.

    cumsum and cumprod (``computes_in_out_dtype``) cast ``input`` to ``out``'s dtype,
    which ``dtype`` (if given) must equal; the other ops want ``out`` in ``input``'s
    dtype. Every op refuses ``out=`` while autograd records a tensor requiring grad."""
    if not isinstance(out, torch.Tensor):
        raise ScanTypeError(f"{api}: `out` must be a torch.Tensor, got {type(out).__name__}.")
    if computes_in_out_dtype:
        if dtype is not None and out.dtype != dtype:
            raise OutArgumentError(
                f"{api}: expected `out` to have the dtype asked, {dtype}, got {out.dtype}."
            )
        dtype = out.dtype
    elif isinstance(input, torch.Tensor) and out.dtype != input.dtype:
        raise OutArgumentError(
            f"{api}: expected `out` in `input`'s dtype {input.dtype}, got {out.dtype}."
        )
    refuse_autograd(api, input, out)
    return dtype


def check_extremum_out(api: str, input: Any, out: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's checks of cummax/cummin's ``out=(values, indices)``, as a tuple."""
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        got = f"{len(out)} items" if isinstance(out, (tuple, list)) else type(out).__name__
        raise ScanTypeError(
            f"{api}: `out` must be a tuple of two tensors (values, indices), got {got}."
        )
    values, indices = out
    check_out(api, input, values)
    if not isinstance(indices, torch.Tensor):
        raise ScanTypeError(
            f"{api}: `out`'s indices must be a torch.Tensor, got {type(indices).__name__}."
        )
    if indices.dtype != torch.int64:
        raise OutArgumentError(
            f"{api}: expected `out`'s indices in torch.int64, got {indices.dtype}."
        )
    refuse_autograd(api, input, indices)
    return values, indices


def refuse_autograd(api: str, input: Any, out: torch.Tensor) -> None:
    if torch.is_grad_enabled() and (
        out.requires_grad or (isinstance(input, torch.Tensor) and input.requires_grad)
    ):
        raise OutArgumentError(
            f"{api}(): functions with out=... arguments don't support automatic "
            "differentiation, but one of the arguments requires grad: call it under "
            "torch.no_grad(), or without `out=`."
        )


def write_out(result: torch.Tensor, out: torch.Tensor, stacklevel: int = 4) -> torch.Tensor:
    """``result`` copied into ``out``, resized first where its shape differs, with torch's
    warning when ``out`` had elements (``resize_output`` in ATen), pointed at the
    caller ``stacklevel`` frames up; ``out`` returned."""
    if out.device != result.device:  # copy_ would move the values; torch refuses
        raise OutArgumentError(
            f"expected `out` on {result.device}, the input's device, got {out.device}."
        )
    if out.shape != result.shape:
        if out.numel() != 0:
            warnings.warn(
                f"An output with one or more elements was resized since it had shape "
                f"{list(out.shape)}, which does not match the required output shape "
                f"{list(result.shape)}. This behavior is deprecated, and in a future "
                "PyTorch release outputs will not be resized unless they have zero "
                "elements. You can explicitly reuse an out tensor t by resizing it, "
                "inplace, to zero elements with t.resize_(0).",
                UserWarning,
                stacklevel=stacklevel,
            )
        out.resize_(result.shape)
    return out.copy_(result)


def direct_out(
    outs: list[torch.Tensor], x: torch.Tensor, dtypes: list[torch.dtype], reset: Any = None
) -> list[torch.Tensor] | None:
    """``outs`` (``out=``'s tensors, checked), where the engine may write the result of
    scanning ``x`` (its outputs in ``dtypes``) straight into them, else None: it then
    writes a new tensor, which :func:`write_out` copies in, a pass more over memory
    (cumsum over (4096, 256) dim 1 on the kernel: 1.3-1.6x the call without ``out=``;
    cummax's pair with ``reset=`` over (4096, 256) dim 0: 2.5x).
    Direct where each has ``x``'s shape (no resize, whose warning :func:`write_out`
    gives) and its output's dtype, is contiguous (every element its own memory: an
    expanded ``out`` gets torch's error from ``copy_``), sits on ``x``'s device, and
    shares no storage with ``x``, the ``reset=`` mask or another of them (an engine
    reads ``x`` and the mask after writing some of its output)."""
    if x.ndim == 0 or torch.compiler.is_compiling():
        return None
    storages = {x.untyped_storage().data_ptr()}
    if isinstance(reset, torch.Tensor):
        storages.add(reset.untyped_storage().data_ptr())
    for out, dtype in zip(outs, dtypes):
        if out.shape != x.shape or out.dtype != dtype or out.device != x.device:
            return None
        if not out.is_contiguous():
            return None
        storage = out.untyped_storage().data_ptr()
        if storage in storages:
            return None
        storages.add(storage)
    return outs


def written(result: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether ``result`` is ``out``'s memory (an engine wrote :func:`direct_out`'s
    tensor). Eager only: :func:`direct_out` gives no tensors under ``torch.compile``."""
    return result.data_ptr() == out.data_ptr() and result.stride() == out.stride()
