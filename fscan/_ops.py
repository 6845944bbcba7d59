"""Drop-in cumulative ops: ``torch.cumsum`` & co. with ``reverse=``, each a scan underneath.

``fscan.cumsum``, ``cumprod``, ``cummax``, ``cummin`` and ``logcumsumexp`` take
torch's arguments in torch's order (extras keyword-only) and return what torch
returns: the same dtypes (integers and bool sum and multiply in int64, ``dtype=``
casts first), shapes (0-d inputs, empty dimensions), ``(values, indices)``
structs with torch's tie-breaking and NaN rules, and the same precision
(accumulation in float64 for float32, in float32 for half types).

Each call takes the fastest of three paths, as measured (:mod:`fscan._cumulative.rules`:
:func:`~fscan._cumulative.rules.path` says which; ``route``'s docstring has the table):

* torch's native kernel, taken first and cheaply by ``_native_fast`` (a few
  µs of checks) where nothing else can win: under ``MIN_NUMEL`` elements, and at
  a ``dim`` with fewer than 8 contiguous elements after it (the innermost, say):
  over several such lanes for every op but logcumsumexp, and over a single lane
  (1-D, say) for cummax/cummin/logcumsumexp and for cumsum/cumprod below
  ``KERNEL_MIN_NUMEL_ONE_LANE``. There torch's walk is contiguous (and torch
  spreads the lanes over its threads). ``reverse=True`` is flip, op, flip.
* the generated C++ kernel of :mod:`fscan._engines.cpp.cpu_kernel`, once it is compiled
  for the op and dtype (in the background, from the second large call), where it
  wins (:func:`kernel_wins`): no gradient wanted, at least ``KERNEL_MIN_NUMEL``
  elements, and a ``dim`` with at least 8 elements after it, in any layout (the
  kernel reads views in place through their strides: transposes, step slices,
  expanded tensors, permutations); over fewer (the innermost ``dim``) for
  logcumsumexp over more than one lane (compute-bound: the kernel's math wins;
  over one it is a tie, and torch's op runs), for cumsum and cumprod over a single
  contiguous lane from ``KERNEL_MIN_NUMEL_ONE_LANE`` elements (torch's 1-D walk uses
  one thread), for every op but logcumsumexp reversed over a single lane (torch
  then pays two flips; torch's branchy cummax/cummin walk predicts well otherwise),
  and for a view over several lanes reversed (torch copies to flip), or, for cumsum
  and cumprod, with steps ``KERNEL_MIN_STRIDE`` elements apart (torch's walk jumps
  pages).
  cummax/cummin scan (value, index) pairs; the kernel makes the indices from each
  element's position, reading only the values. Where no kernel can run (mode
  ``"off"``, no compiler: :func:`~fscan._engines.cpp.cpu_kernel.kernel_possible`),
  ``_native_fast`` sends these calls to the next path itself, without the checks.
* fscan's parallel scan (:mod:`fscan._cumulative.blocked`), which combines whole
  contiguous slices at a time. When ``dim`` has a large stride, every step of
  torch's walk lands on a new cache line; then the parallel scan is faster for
  logcumsumexp, and for the others once the walk spans more memory than the
  caches hold (:func:`parallel_wins`; the rule and its measurements are below).
  Where the kernel is compiled it beats this path too.

Gradients are torch's on the native path and autograd's through the scan on
the other; they agree (cumprod with zeros included: the scan multiplies, it
never divides; cummax and cummin gather their values at the indices found, so
the whole gradient goes to the chosen element, as in torch).
"""

from __future__ import annotations

from typing import Any

import torch

from ._checks import check_dense, normalize_dim
from ._cumulative.blocked import LOGSUMEXP, PRODUCT, SUM, Accumulation, blocked_scan, extremum_scan
from ._cumulative.rules import kernel_call, native_fast, route
from ._engines.cpp.cpu_kernel import kernel_scan
from ._errors import ScanTypeError
from ._route_log import logs_route, ran

__all__ = ["cummax", "cummin", "cumprod", "cumsum", "logcumsumexp"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _kernel(api: str, op: Any, x: torch.Tensor, dim: int, reverse: bool) -> Any:
    """The kernel's scan of ``x`` (a tensor, or (values, indices)) if it is compiled,
    else None (the caller checked that it wins).

    Over a single lane the kernel runs on one thread: torch's walk there is serial, and
    the kernel alone beats it (0.7-0.85x). Its threads would double that margin on an idle
    machine, but each of its reduce-then-scan steps waits for every thread, and on a
    shared one a descheduled thread cost 10-25x torch's time (2 threads, another process
    busy), where torch's serial walk does not wait."""
    combine, spec, leaves, positions = kernel_call(op, x)
    threads = 1 if x.shape[dim] == x.numel() else None
    out = kernel_scan(
        api, combine, spec, leaves, dim, reverse, positions=positions, threads=threads
    )
    if out is None:
        return None
    ran("cpp")
    return out[0] if len(out) == 1 else tuple(out)


@logs_route("fscan.cumsum")
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
    if (
        dtype is None
        and reverse is False
        and (out := native_fast(torch.cumsum, input, dim)) is not None
    ):
        return out  # torch promotes integers and bool to int64 itself
    x, dim = _prepare("fscan.cumsum", input, dim, reverse, dtype, promote_integers=True)
    kernel, parallel = route(torch.cumsum, x, dim, reverse)
    if kernel and (out := _kernel("fscan.cumsum", torch.cumsum, x, dim, reverse)) is not None:
        return out
    if not parallel or x.dtype == torch.bool:
        return _native(torch.cumsum, x, dim, reverse, dtype=x.dtype)  # already promoted
    return _accumulate(SUM, x, dim, reverse)


@logs_route("fscan.cumprod")
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
    if (
        dtype is None
        and reverse is False
        and (out := native_fast(torch.cumprod, input, dim)) is not None
    ):
        return out  # torch promotes integers and bool to int64 itself
    x, dim = _prepare("fscan.cumprod", input, dim, reverse, dtype, promote_integers=True)
    kernel, parallel = route(torch.cumprod, x, dim, reverse)
    if kernel and (out := _kernel("fscan.cumprod", torch.cumprod, x, dim, reverse)) is not None:
        return out
    if not parallel or x.dtype == torch.bool:
        return _native(torch.cumprod, x, dim, reverse, dtype=x.dtype)  # already promoted
    return _accumulate(PRODUCT, x, dim, reverse)


@logs_route("fscan.logcumsumexp")
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
    if reverse is False and (out := native_fast(torch.logcumsumexp, input, dim)) is not None:
        return out
    x, dim = _prepare("fscan.logcumsumexp", input, dim, reverse)
    kernel, parallel = route(torch.logcumsumexp, x, dim, reverse)
    if x.dtype not in _FLOATS:
        return _native(torch.logcumsumexp, x, dim, reverse)
    out = _kernel("fscan.logcumsumexp", torch.logcumsumexp, x, dim, reverse) if kernel else None
    if out is not None:
        return out
    if not parallel:
        return _native(torch.logcumsumexp, x, dim, reverse)
    return _accumulate(LOGSUMEXP, x, dim, reverse)


@logs_route("fscan.cummax")
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


@logs_route("fscan.cummin")
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
    check_dense(api, "`input`", input)
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
    ran("blocked")
    work, acc = {
        torch.float16: (torch.float32, torch.float64),
        torch.bfloat16: (torch.float32, torch.float64),
        torch.float32: (torch.float32, torch.float64),
        torch.complex64: (torch.complex64, torch.complex128),
    }.get(x.dtype, (x.dtype, x.dtype))
    out = blocked_scan(how, x.to(work), dim, reverse, acc)
    return out.to(x.dtype)


def _extremum(api: str, native: Any, result: Any, input: Any, dim: Any, reverse: Any) -> Any:
    if reverse is False and (out := native_fast(native, input, dim)) is not None:
        return out
    x, dim = _prepare(api, input, dim, reverse)
    kernel, parallel = route(native, x, dim, reverse)
    if x.is_complex() or not (kernel or parallel):
        return _native_extremum(native, result, x, dim, reverse)
    if kernel and (out := _kernel(api, native, x, dim, reverse)) is not None:
        return result(out)
    if parallel:
        ran("blocked")
        return result(extremum_scan(x, dim, reverse, largest=native is torch.cummax))
    return _native_extremum(native, result, x, dim, reverse)


def _native_extremum(native: Any, result: Any, x: torch.Tensor, dim: int, reverse: bool) -> Any:
    if not reverse or x.ndim == 0:
        return native(x, dim)
    values, indices = native(x.flip(dim), dim)
    return result((values.flip(dim), (x.shape[dim] - 1 - indices).flip(dim)))
