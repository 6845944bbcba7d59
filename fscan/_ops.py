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
  torch's walk lands on a new cache line; then the parallel scan is faster for
  cummax, cummin and logcumsumexp, and for cumsum and cumprod once the walk
  spans more than the L2 cache (the rule and its measurements are below).

Before both, once the generated C++ kernel of :mod:`fscan.engine.cpu_kernel` is
compiled for the op and dtype (in the background, from the second large call),
a call it serves faster takes it (:func:`kernel_wins`): no gradient wanted, at
least ``KERNEL_MIN_NUMEL`` elements, and ``dim`` not the innermost (there torch's
walk is contiguous; the kernel walks its lanes side by side) unless the scan is
reversed over a single lane (torch then pays two flips) or is ``logcumsumexp``
(compute-bound: the kernel's vector math wins at every layout).

Gradients are torch's on the native path and autograd's through the scan on
the other; they agree (cumprod with zeros included: the scan multiplies, it
never divides; cummax and cummin gather their values at the indices found, so
the whole gradient goes to the chosen element, as in torch).
"""

from __future__ import annotations

from typing import Any

import torch

from ._checks import normalize_dim
from ._errors import ScanTypeError
from ._ops_parallel import LOGSUMEXP, PRODUCT, SUM, Accumulation, blocked_scan, extremum_scan
from ._pytree import flatten
from .engine.cpu_kernel import kernel_scan

__all__ = [
    "cummax",
    "cummin",
    "cumprod",
    "cumsum",
    "kernel_wins",
    "logcumsumexp",
    "parallel_wins",
]

# The dispatch rule, measured on CPU (fscan/bench/ops.py and its sweeps over
# shapes; a Xeon with 2 MiB of L2 per core). torch's kernel walks `dim` for one
# column after another. When `dim` is contiguous that walk streams and nothing
# beats it. When consecutive steps are >= MIN_STRIDE elements apart, every step
# lands on a new cache line, and the cost depends on the op:
# * cumsum and cumprod are memory-bound: their walk costs ~3-5 ns per element
#   while the lines of one column walk (n * stride bytes) stay in L2 for the
#   next columns, and 8-20 ns once that span passes L2. The parallel scan costs
#   ~6-8 ns per element (one thread; two threads halve both): it wins only past L2.
# * cummax, cummin and logcumsumexp cost 20-40 ns per element in torch's strided
#   walk at any span; the parallel scan costs 20-25 (cummax) and ~10 (log-sum-exp).
# Below MIN_LENGTH steps or MIN_NUMEL elements, the scan's ~0.1-0.3 ms of Python
# calls are not repaid.
MIN_STRIDE = 64
MIN_LENGTH = 32
MIN_NUMEL = 2**15
L2_BYTES = 2 * 2**20
_MEMORY_BOUND = (torch.cumsum, torch.cumprod)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# Measured on this repository's 2-core CI-like machine (python -m fscan.bench.kernel):
# below ~2**15 elements torch's op (2-20 us) beats the kernel's ~15 us fixed cost.
KERNEL_MIN_NUMEL = 2**15
_KERNEL_INNER = 8  # the kernel's lane path needs this many contiguous lanes after dim
_ONE_LEAF = flatten(torch.zeros(()))[1]


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def _mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


def _logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(a, b)


def kernel_wins(x: torch.Tensor, dim: int, reverse: bool, op: Any) -> bool:
    """Whether the compiled C++ kernel beats torch's ``op`` on ``x`` (see module doc).

    Example:
        >>> kernel_wins(torch.ones(4096, 256), 0, False, torch.cumsum)
        True
        >>> kernel_wins(torch.ones(4096, 256), 1, False, torch.cumsum)
        False
    """
    # First, before any size is read: under torch.compile a read size is a guard.
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.ndim == 0:
        return False
    if x.numel() < KERNEL_MIN_NUMEL or (x.requires_grad and torch.is_grad_enabled()):
        return False
    if not x.is_contiguous():  # the kernel would copy it first; torch's walk may not need to
        return False
    inner = x[(0,) * (dim + 1)].numel() if dim + 1 < x.ndim else 1
    single_lane = x.numel() == x.shape[dim]
    return op is torch.logcumsumexp or inner >= _KERNEL_INNER or (reverse and single_lane)


def _kernel(
    api: str, combine: Any, op: Any, x: torch.Tensor, dim: int, reverse: bool
) -> torch.Tensor | None:
    """The kernel's scan of ``x`` where it wins and is compiled, else None."""
    if not kernel_wins(x, dim, reverse, op):
        return None
    out = kernel_scan(api, combine, _ONE_LEAF, [x], dim, reverse)
    return None if out is None else out[0]


def parallel_wins(x: torch.Tensor, dim: int, op: Any) -> bool:
    """Whether fscan's parallel scan beats torch's ``op`` (e.g. ``torch.cumsum``) on ``x``.

    Measured on CPU only; on other devices torch's kernels scan any dimension well.
    While ``torch.compile`` or ``torch.export`` traces, torch's op is always taken:
    one graph for every shape and layout, with no guards on them, and an op that
    the compiler lowers itself.

    Example:
        >>> x = torch.ones(4096, 256)
        >>> parallel_wins(x, 0, torch.cumsum), parallel_wins(x, 1, torch.cumsum)
        (True, False)
        >>> y = torch.ones(8, 1024, 256)  # a 1 MiB walk: stays in L2
        >>> parallel_wins(y, 1, torch.cumsum), parallel_wins(y, 1, torch.cummax)
        (False, True)
    """
    if torch.compiler.is_compiling() or x.device.type != "cpu" or x.ndim == 0:
        return False
    n, stride = x.shape[dim], x.stride(dim)
    if stride < MIN_STRIDE or n < MIN_LENGTH or x.numel() < MIN_NUMEL:
        return False
    return op not in _MEMORY_BOUND or n * stride * x.element_size() >= L2_BYTES


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
    if (out := _kernel("fscan.cumsum", _add, torch.cumsum, x, dim, reverse)) is not None:
        return out
    if not parallel_wins(x, dim, torch.cumsum) or x.dtype == torch.bool:
        return _native(torch.cumsum, x, dim, reverse, dtype=x.dtype)  # already promoted
    return _accumulate(SUM, x, dim, reverse)


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
    if (out := _kernel("fscan.cumprod", _mul, torch.cumprod, x, dim, reverse)) is not None:
        return out
    if not parallel_wins(x, dim, torch.cumprod) or x.dtype == torch.bool:
        return _native(torch.cumprod, x, dim, reverse, dtype=x.dtype)  # already promoted
    return _accumulate(PRODUCT, x, dim, reverse)


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
    if (
        x.dtype in _FLOATS
        and (out := _kernel("fscan.logcumsumexp", _logaddexp, torch.logcumsumexp, x, dim, reverse))
        is not None
    ):
        return out
    if not parallel_wins(x, dim, torch.logcumsumexp) or x.dtype not in _FLOATS:
        return _native(torch.logcumsumexp, x, dim, reverse)
    return _accumulate(LOGSUMEXP, x, dim, reverse)


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


def _accumulate(how: Accumulation, x: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    """The parallel path in torch's accumulation types: half types are computed in
    float32 with float64 carries, float32 with float64 carries."""
    work, acc = {
        torch.float16: (torch.float32, torch.float64),
        torch.bfloat16: (torch.float32, torch.float64),
        torch.float32: (torch.float32, torch.float64),
        torch.complex64: (torch.complex64, torch.complex128),
    }.get(x.dtype, (x.dtype, x.dtype))
    out = blocked_scan(how, x.to(work), dim, reverse, acc)
    return out.to(x.dtype)


def _extremum(api: str, native: Any, result: Any, input: Any, dim: Any, reverse: Any) -> Any:
    x, dim = _prepare(api, input, dim, reverse)
    if parallel_wins(x, dim, native) and not x.is_complex():
        return result(extremum_scan(x, dim, reverse, largest=native is torch.cummax))
    if not reverse or x.ndim == 0:
        return native(x, dim)
    values, indices = native(x.flip(dim), dim)
    return result((values.flip(dim), (x.shape[dim] - 1 - indices).flip(dim)))
