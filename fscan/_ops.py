"""Drop-in cumulative ops: ``torch.cumsum`` & co. with ``reverse=``, each a scan underneath.

``fscan.cumsum``, ``cumprod``, ``cummax``, ``cummin`` and ``logcumsumexp`` take
torch's arguments in torch's order (extras keyword-only) and return what torch
returns: the same dtypes (integers and bool sum and multiply in int64, ``dtype=``
casts first), shapes (0-d inputs, empty dimensions), ``(values, indices)``
structs with torch's tie-breaking and NaN rules, and the same precision
(accumulation in float64 for float32, in float32 for half types).

Each call picks the faster of two paths (:func:`parallel_wins`):

* torch's native kernel, which walks ``dim`` sequentially for every other index.
  When ``dim`` is the innermost (stride-1) dimension that walk is contiguous
  and vectorized, and nothing beats it. ``reverse=True`` is flip, op, flip.
* fscan's parallel scan (:mod:`fscan._ops_parallel`), which combines whole
  contiguous slices at a time. When ``dim`` has a large stride, every step of
  torch's walk lands on a new cache line, and the parallel scan is 2-5x faster
  (cummax over ``dim=0`` of ``(4096, 256)``: 10x).

Gradients are torch's on the native path and autograd's through the scan on
the other; they agree (cumprod with zeros included: the scan multiplies, it
never divides).
"""

from __future__ import annotations

from typing import Any

import torch

from ._checks import normalize_dim
from ._errors import ScanTypeError
from ._ops_parallel import blocked_scan, extremum_scan

__all__ = ["cummax", "cummin", "cumprod", "cumsum", "logcumsumexp", "parallel_wins"]

# The dispatch rule, from `python -m fscan.bench` (fscan/bench/ops.py) on CPU:
# torch's kernel costs ~1 ns per element when `dim` is contiguous and 6-10 ns
# (cumsum) to 30-60 ns (cummax) when consecutive steps are >= 64 elements apart;
# the parallel scan costs ~2-3 ns per element in either case once its slices are
# that wide, plus ~0.1 ms of Python calls. Hence: parallel when the stride of
# `dim` is at least 64 elements and the scan is big enough to repay the calls.
MIN_STRIDE = 64
MIN_LENGTH = 32
MIN_NUMEL = 2**15
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def parallel_wins(x: torch.Tensor, dim: int) -> bool:
    """Whether the parallel scan beats torch's kernel for a scan of ``x`` along ``dim``.

    Measured on CPU only; on other devices torch's kernels scan any dimension well.

    Example:
        >>> parallel_wins(torch.ones(4096, 256), 0), parallel_wins(torch.ones(4096, 256), 1)
        (True, False)
    """
    return (
        x.device.type == "cpu"
        and x.ndim > 0
        and x.stride(dim) >= MIN_STRIDE
        and x.shape[dim] >= MIN_LENGTH
        and x.numel() >= MIN_NUMEL
    )


def cumsum(
    input: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None, reverse: bool = False
) -> torch.Tensor:
    """``torch.cumsum`` with ``reverse=``: ``out[i] = input[0] + ... + input[i]`` along ``dim``.

    Args:
        input (Tensor): the input; 0-d is allowed (``dim`` 0 or -1).
        dim (int): the dimension to sum along.
        dtype (torch.dtype, optional): cast ``input`` to this dtype first.
        reverse (bool, default False): sum from the end, ``out[i] = input[i] + ...
            + input[n - 1]``.

    Returns:
        Tensor: ``input``'s shape; dtype ``dtype``, else int64 for integer and bool
        inputs, else ``input``'s.

    Example:
        >>> import fscan, torch
        >>> x = torch.tensor([1, 2, 3])
        >>> fscan.cumsum(x, 0), fscan.cumsum(x, 0, reverse=True)
        (tensor([1, 3, 6]), tensor([6, 5, 3]))
    """
    x, dim = _prepare("fscan.cumsum", input, dim, reverse, dtype, promote_integers=True)
    if not parallel_wins(x, dim) or x.dtype == torch.bool:
        return _native(torch.cumsum, x, dim, reverse, dtype=x.dtype)  # already promoted
    return _accumulate(torch.add, 0.0, torch.sum, x, dim, reverse)


def cumprod(
    input: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None, reverse: bool = False
) -> torch.Tensor:
    """``torch.cumprod`` with ``reverse=``: ``out[i] = input[0] * ... * input[i]`` along ``dim``.

    Arguments and result dtype as in :func:`cumsum`. Gradients are exact with zeros.

    Example:
        >>> import fscan, torch
        >>> fscan.cumprod(torch.tensor([1.0, 2.0, 3.0]), 0, reverse=True)
        tensor([6., 6., 3.])
    """
    x, dim = _prepare("fscan.cumprod", input, dim, reverse, dtype, promote_integers=True)
    if not parallel_wins(x, dim) or x.dtype == torch.bool:
        return _native(torch.cumprod, x, dim, reverse, dtype=x.dtype)  # already promoted
    return _accumulate(torch.mul, 1.0, torch.prod, x, dim, reverse)


def logcumsumexp(input: torch.Tensor, dim: int, *, reverse: bool = False) -> torch.Tensor:
    """``torch.logcumsumexp`` with ``reverse=``: ``out[i] = log(sum(exp(input[:i + 1])))``.

    ``-inf`` entries add nothing, ``+inf`` and NaN propagate, as in torch. Complex
    inputs always use torch's kernel: the imaginary part of a complex log is only
    defined up to multiples of 2 pi, and which one torch returns depends on its
    sequential order of combination.

    Example:
        >>> import fscan, torch
        >>> fscan.logcumsumexp(torch.tensor([0.0, float("-inf"), 0.0]), 0)
        tensor([0.0000, 0.0000, 0.6931])
    """
    x, dim = _prepare("fscan.logcumsumexp", input, dim, reverse)
    if not parallel_wins(x, dim) or x.dtype not in _FLOATS:
        return _native(torch.logcumsumexp, x, dim, reverse)
    return _accumulate(torch.logaddexp, float("-inf"), None, x, dim, reverse)


def cummax(input: torch.Tensor, dim: int, *, reverse: bool = False) -> Any:
    """``torch.cummax`` with ``reverse=``: running maxima and the index of each.

    Returns ``torch.return_types.cummax(values, indices)``, like torch. Ties go to
    the later index; a NaN, once met, is the maximum from there on, and a later
    NaN takes over the index. With ``reverse=True`` (flip, cummax, flip) the
    indices are positions in ``input`` and ties go to the smaller index.

    Example:
        >>> import fscan, torch
        >>> fscan.cummax(torch.tensor([1.0, 3.0, 3.0, 2.0]), 0)
        torch.return_types.cummax(
        values=tensor([1., 3., 3., 3.]),
        indices=tensor([0, 1, 2, 2]))
    """
    return _extremum("fscan.cummax", torch.cummax, torch.return_types.cummax, input, dim, reverse)


def cummin(input: torch.Tensor, dim: int, *, reverse: bool = False) -> Any:
    """``torch.cummin`` with ``reverse=``: running minima and their indices (see ``cummax``).

    Example:
        >>> import fscan, torch
        >>> fscan.cummin(torch.tensor([3, 1, 2, 1]), 0, reverse=True).indices
        tensor([1, 1, 3, 3])
    """
    return _extremum("fscan.cummin", torch.cummin, torch.return_types.cummin, input, dim, reverse)


# ---- shared pieces -----------------------------------------------------------


def _prepare(
    api: str,
    input: Any,
    dim: Any,
    reverse: Any,
    dtype: torch.dtype | None = None,
    promote_integers: bool = False,
) -> tuple[torch.Tensor, int]:
    """Check the arguments; return the input in the dtype torch computes in, and ``dim``."""
    if not isinstance(input, torch.Tensor):
        raise ScanTypeError(f"{api}: `input` must be a torch.Tensor, got {type(input).__name__}.")
    if not isinstance(reverse, bool):
        raise ScanTypeError(
            f"{api}: `reverse` must be a bool, got {type(reverse).__name__} {reverse!r}."
        )
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ScanTypeError(
            f"{api}: `dtype` must be a torch.dtype or None, got {type(dtype).__name__}."
        )
    # 0-d tensors scan over their one element, as in torch: dim 0 or -1.
    dim = normalize_dim(api, dim, max(input.ndim, 1), lambda: "`input`")
    if dtype is not None:
        input = input.to(dtype)
    elif promote_integers and not (input.is_floating_point() or input.is_complex()):
        input = input.to(torch.int64)
    return input, dim


def _native(op: Any, x: torch.Tensor, dim: int, reverse: bool, **kw: Any) -> torch.Tensor:
    if not reverse or x.ndim == 0:
        return op(x, dim, **kw)
    return op(x.flip(dim), dim, **kw).flip(dim)


def _accumulate(
    op: Any, identity: float, reduce: Any, x: torch.Tensor, dim: int, reverse: bool
) -> torch.Tensor:
    """The parallel path in torch's accumulation types: half types are computed in
    float32 with float64 carries, float32 with float64 carries."""
    work, acc = {
        torch.float16: (torch.float32, torch.float64),
        torch.bfloat16: (torch.float32, torch.float64),
        torch.float32: (torch.float32, torch.float64),
        torch.complex64: (torch.complex64, torch.complex128),
    }.get(x.dtype, (x.dtype, x.dtype))
    out = blocked_scan(op, identity, x.to(work), dim, reverse, acc, reduce)
    return out.to(x.dtype)


def _extremum(api: str, native: Any, result: Any, input: Any, dim: Any, reverse: Any) -> Any:
    x, dim = _prepare(api, input, dim, reverse)
    if parallel_wins(x, dim) and not x.is_complex():
        return result(extremum_scan(x, dim, reverse, largest=native is torch.cummax))
    if not reverse or x.ndim == 0:
        return native(x, dim)
    values, indices = native(x.flip(dim), dim)
    return result((values.flip(dim), (x.shape[dim] - 1 - indices).flip(dim)))
