"""The drop-ins' router: runs ``fscan.cumsum``, ``cumprod``, ``cummax``, ``cummin`` and
``logcumsumexp`` on the engine the route table (:mod:`fscan._routing.cumulative_table`,
whose docstring has the table) picks.

:func:`native_first` (:func:`native_first_into` with ``out=``) serves the calls the
table sends to torch's op before any of fscan's checks; :func:`cumulative` runs a
checked call on the engine the table picks (:func:`engine`), or fscan's segmented scan
with ``reset=`` (:func:`segmented`); :func:`path` says which engine a call takes.
"""

from __future__ import annotations

from typing import Any

import torch

from .._call import SCAN_API, ScanCall
from .._context import where as runs_at  # not `where`: the combines below name torch.where
from .._engines.blocked import LOGSUMEXP, PRODUCT, SUM, Op, accumulate, extremum_scan
from .._engines.cpp.cpu_kernel import kernel_ready, kernel_scan
from .._errors import ScanTypeError
from .._knowledge.store import knowledge, reach
from .._pytree import flatten, unflatten
from .._route_log import ran
from .._segmented import check_reset, segmented_scan
from .cumulative_table import (
    EXTREMA,
    FLOATS,
    LANE_PATH_INNER,
    NATIVE_BELOW,
    SUMS,
    route,
    torch_serves,
)
from .cumulative_table import dtype_refusals as dtype_refusals
from .repeat_drop_ins import remember_cumulative, remember_segmented, repeat_into
from .repeat_drop_ins import repeat_cumulative as repeat_cumulative
from .repeat_drop_ins import repeat_exclusive as repeat_exclusive
from .repeat_drop_ins import repeat_segmented as repeat_segmented
from .scan import scan_flat, scan_traced
from .segmented import run_segmented, segmented_route

__all__ = [
    "cumulative",
    "dtype_refusals",
    "engine",
    "kernel_call",
    "kernel_threads",
    "native",
    "native_first",
    "native_first_into",
    "path",
    "repeat_cumulative",
    "repeat_exclusive",
    "repeat_segmented",
    "route",
    "segmented",
]

_is_compiling = torch.compiler.is_compiling  # bound once: Dynamo folds it by identity
_ONE_LEAF = flatten(torch.zeros(()))[1]
_PAIR = flatten((torch.zeros(()), torch.zeros(())))[1]


def native_first(op: Any, x: Any, dim: Any, reverse: bool = False) -> Any:
    """torch's ``op(x, dim)`` for a call with unchecked arguments where the table certainly
    picks it (also where it picks the kernel but none can run: mode ``"off"``, no compiler,
    :func:`~fscan._engines.cpp.cpu_kernel.kernel_possible`), else None: the checks and
    :func:`cumulative` cost a few µs on top of torch's op (about 3 here, against ~30 for
    the checks and the full route, whose code is cold in the cache after the op before).
    ``reverse`` (True or False: the caller passes nothing else) reads the table's reversed
    cells and runs :func:`native`'s flip, op, flip. While ``torch.compile`` traces, None:
    the checked path raises fscan's errors."""
    if type(dim) is not int or not isinstance(x, torch.Tensor) or _is_compiling():
        return None
    try:
        # The table's first row, read before the call into it: most calls end here, and
        # the call would add ~3% to them.
        if x.numel() < NATIVE_BELOW or torch_serves(op, x, dim, reverse):
            return _flipped(op, x, dim) if reverse else op(x, dim)
        return None
    except (IndexError, RuntimeError, NotImplementedError):
        # dim out of range, or a tensor torch's op cannot take (sparse, nested, quantized):
        # the checked path says so in fscan's words
        return None


def _flipped(op: Any, x: torch.Tensor, dim: int) -> Any:
    """:func:`native` reversed, on unchecked ``x`` (torch promotes integers itself)."""
    if x.ndim == 0:
        return op(x, dim)
    out = op(x.flip(dim), dim)
    if op not in EXTREMA:
        return out.flip(dim)
    values, indices = out
    return EXTREMA[op]((values.flip(dim), (x.shape[dim] - 1 - indices).flip(dim)))


def native_first_into(op: Any, x: Any, dim: Any, out: Any) -> Any:
    """:func:`native_first` with ``out=``: torch's ``op(x, dim, out=out)`` where the table
    certainly picks torch's op and ``out`` (each of cummax/cummin's pair) already has
    ``x``'s shape, else None. torch's op then applies its own ``out=`` rules; a call that
    resizes ``out`` takes the checked path, whose warning names the caller's line (torch's
    would name this one). Errors send the call to the checked path too: it raises them
    with torch's types, in fscan's words."""
    if type(dim) is not int or not isinstance(x, torch.Tensor) or _is_compiling():
        return None
    shape = x.shape
    if isinstance(out, torch.Tensor):
        if out.shape != shape:
            return None
    elif not (
        isinstance(out, (tuple, list))
        and len(out) == 2
        and all(isinstance(o, torch.Tensor) and o.shape == shape for o in out)
    ):
        return None
    try:
        if x.numel() < NATIVE_BELOW or torch_serves(op, x, dim):
            return op(x, dim, out=out)
        return None
    except (IndexError, RuntimeError, NotImplementedError):
        return None


def cumulative(
    api: str,
    op: Any,
    x: torch.Tensor,
    dim: int,
    reverse: bool,
    reset: Any = None,
    out: list | None = None,
) -> Any:
    """Run the drop-in ``api`` of torch's ``op`` on ``x`` on the engine the table picks:
    ``x`` in the dtype torch computes in, ``dim`` checked and non-negative. With
    ``reset=`` (torch's op has none), :func:`segmented` runs it. ``out``: the caller's
    ``out=`` tensors (``x``'s shape and dtype, storage of their own), which the kernel
    (the segmented one too) and torch's op forward write directly (see :func:`engine`);
    the result is then ``out``'s memory, else a new tensor the caller copies in.

    Example:
        >>> cumulative("fscan.cumsum", torch.cumsum, torch.tensor([1, 2, 3]), 0, True)
        tensor([6, 5, 3])
    """
    if reset is not None:
        return segmented(api, op, x, dim, reverse, reset, remember=out is None, out=out)
    return engine(api, op, x, dim, reverse, out)


def engine(
    api: str,
    op: Any,
    x: torch.Tensor,
    dim: int,
    reverse: bool,
    out: list | None = None,
    cells: tuple[bool, bool] | None = None,
    first_index: int = 0,
) -> Any:
    """:func:`cumulative` without ``reset=`` on the engine the table picks. An exclusive
    drop-in (:mod:`fscan._routing.exclusive`) passes ``out`` (views, no gradient wanted),
    which the kernel and torch's op forward write in place, ``cells``, the table's
    answer for its whole input (``x`` is one step shorter), and for cummax/cummin
    ``first_index``, the position in that input of ``x``'s first step: the indices are
    positions there (the kernel makes them so; the other engines add it after)."""
    kernel, parallel = route(op, x, dim, reverse) if cells is None else cells
    if kernel and (found := _kernel(api, op, x, dim, reverse, out, first_index)) is not None:
        ran("cpp")
        return found
    if not parallel:
        found = native(op, x, dim, reverse, out)
    else:
        ran("blocked")
        if op not in EXTREMA:
            return accumulate(_ACCUMULATIONS[op], x, dim, reverse, _inner_scan)
        largest = op is torch.cummax
        found = EXTREMA[op](extremum_scan(x, dim, reverse, largest, _inner_scan))
    if not first_index or op not in EXTREMA:
        return found
    values, indices = found  # in place where written into `out`; else new (autograd may save them)
    moved = indices.add_(first_index) if out is not None else indices + first_index
    return EXTREMA[op]((values, moved))


def segmented(
    api: str,
    op: Any,
    x: torch.Tensor,
    dim: int,
    reverse: bool,
    reset: Any,
    remember: bool = False,
    out: list | None = None,
) -> Any:
    """``op`` restarted wherever the bool mask ``reset`` is True (``out[i] = x[i]``
    there): fscan's segmented scan (:mod:`fscan._segmented`) of the op's combine, on the
    engine :mod:`fscan._routing.scan` picks and notes. cummax/cummin scan (value,
    position) pairs, so their indices are positions in the whole ``x``. The mask is
    checked here first, so that its errors name ``api``. ``remember``: the call is the
    drop-in's own (not an exclusive one's part): a run on the segmented kernel is stored
    for an identical call (:func:`~fscan._routing.repeat_drop_ins.repeat_segmented`).
    ``out``: memory the segmented kernel writes (as :func:`cumulative`'s; the scan of the
    pairs writes new tensors).

    Example:
        >>> reset = torch.tensor([False, False, True, False])
        >>> segmented("fscan.cumsum", torch.cumsum, torch.tensor([1, 2, 3, 4]), 0, False, reset)
        tensor([1, 3, 3, 7])
    """
    if x.ndim == 0:  # one step, as torch scans 0-d tensors
        out = segmented(api, op, x[None], 0, reverse, reset)
        return EXTREMA[op]((out[0][0], out[1][0])) if op in EXTREMA else out[0]
    check_reset(api, reset, x, [x], dim)
    if op is torch.logcumsumexp and x.dtype not in FLOATS:
        raise ScanTypeError(
            f"{api}: `reset=` takes float inputs, got {x.dtype}: the imaginary part of a "
            "complex log depends on torch's order of combination."
        )
    if segmented_route(runs_at([x]), [x]) is None:
        combine, spec, leaves, positions = kernel_call(op, x)
        threads = kernel_threads(x, dim)
        found = run_segmented(combine, spec, leaves, dim, reverse, reset, positions, threads, out)
        if found is not None:
            if remember:
                call = (combine, spec, leaves, positions)
                remember_segmented(op, call, dim, reverse, threads, reset)
            return EXTREMA[op](found) if op in EXTREMA else found[0]
    xs: Any = x
    if op in EXTREMA:
        n = x.shape[dim]
        positions = torch.arange(n, device=x.device).reshape([n] + [1] * (x.ndim - 1 - dim))
        xs = (x, positions.expand(x.shape))
    leaves, spec = flatten(xs)
    combine = _KERNEL_COMBINES[op]
    call = ScanCall(api, combine, xs, spec, leaves, dim, reverse, "pointwise", reset=reset)
    out = segmented_scan(_scan_pairs, call)
    if not _is_compiling():  # Dynamo cannot trace the log's ContextVar
        ran("tree")  # after the scan: an engine its router noted (the kernel) comes first
    return EXTREMA[op](out) if op in EXTREMA else out


def _scan_pairs(call: ScanCall) -> Any:
    """The scan of :func:`segmented`'s (flag, value) pairs, routed as any of fscan's
    scans (traced while ``torch.compile`` traces). The combine is fscan's own: nothing
    to validate, and no ``initial`` to fold."""
    if _is_compiling():
        return unflatten(call.spec, scan_traced(call))
    found = reach(call.combine_fn)
    entry = knowledge(found, call.spec, call.combine_mode, call.leaves)
    return unflatten(call.spec, scan_flat(call, found, entry))


def native(op: Any, x: torch.Tensor, dim: int, reverse: bool, out: list | None = None) -> Any:
    """torch's ``op`` on ``x``; reversed, flip, op, flip (cummax/cummin's indices mapped
    back to positions in ``x``). ``out``: memory torch's op writes forward (see :func:`engine`)."""
    if not reverse or x.ndim == 0:
        if out is not None:
            into = out[0] if len(out) == 1 else tuple(out)
            return op(x, dim, dtype=x.dtype, out=into) if op in SUMS else op(x, dim, out=into)
        return op(x, dim, dtype=x.dtype) if op in SUMS else op(x, dim)
    if op in SUMS:  # integers and bool already promoted, or cast to the dtype asked
        return op(x.flip(dim), dim, dtype=x.dtype).flip(dim)
    out = op(x.flip(dim), dim)
    if op not in EXTREMA:
        return out.flip(dim)
    values, indices = out
    return EXTREMA[op]((values.flip(dim), (x.shape[dim] - 1 - indices).flip(dim)))


def _kernel(
    api: str, op: Any, x: torch.Tensor, dim: int, reverse: bool, out: Any = None, first: int = 0
) -> Any:
    """The kernel's scan of ``x`` if it is compiled, else None (the caller checked that
    it wins); into ``out`` if given, cummax/cummin's indices from ``first`` (see
    :func:`engine`).

    Over a single lane the kernel runs on one thread: torch's walk there is serial, and
    the kernel alone beats it (0.7-0.85x). Its threads would double that margin on an idle
    machine, but each of its reduce-then-scan steps waits for every thread, and on a
    shared one a descheduled thread cost 10-25x torch's time (2 threads, another process
    busy), where torch's serial walk does not wait."""
    if out is not None and not first and _dense_like(out, x):
        # An identical call's stored run, into `out` (laid out as its fresh outputs)
        found = repeat_into(op, x, dim, reverse, out)
        if found is not None:
            return EXTREMA[op](found) if op in EXTREMA else found[0]
    call = kernel_call(op, x)
    combine, spec, leaves, positions = call
    threads = kernel_threads(x, dim, op)
    found = kernel_scan(
        api,
        combine,
        spec,
        leaves,
        dim,
        reverse,
        positions=positions,
        threads=threads,
        out=out,
        first_position=first,
    )
    if found is None:
        return None
    if not first:  # an identical call repeats this run (fscan._routing.repeat_drop_ins)
        remember_cumulative(op, call, dim, reverse, threads)
    return EXTREMA[op](found) if op in EXTREMA else found[0]


def _dense_like(out: list[torch.Tensor], x: torch.Tensor) -> bool:
    """Whether ``out`` (memory of its own, the outputs' dtypes) is laid out as the kernel's
    fresh outputs for ``x``: contiguous, ``x``'s shape (an exclusive drop-in's views of
    its later steps are where they are slices along dim 0)."""
    shape = x.shape
    return all(o.shape == shape and o.is_contiguous() for o in out)


# ---- the ops as the engines scan them ---------------------------------------------


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def _mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


def _logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.logaddexp(a, b)


# (value, index) pairs for cummax/cummin, as torch breaks ties: the right operand (the
# later one in scan order) wins ties, and a NaN, once met, stays until a later NaN.
def _take_max(left: Any, right: Any) -> tuple[torch.Tensor, torch.Tensor]:
    take = (right[0] >= left[0]) | torch.isnan(right[0])
    return torch.where(take, right[0], left[0]), torch.where(take, right[1], left[1])


def _take_min(left: Any, right: Any) -> tuple[torch.Tensor, torch.Tensor]:
    take = (right[0] <= left[0]) | torch.isnan(right[0])
    return torch.where(take, right[0], left[0]), torch.where(take, right[1], left[1])


_KERNEL_COMBINES = {
    torch.cumsum: _add,
    torch.cumprod: _mul,
    torch.logcumsumexp: _logaddexp,
    torch.cummax: _take_max,
    torch.cummin: _take_min,
}
_ACCUMULATIONS = {torch.cumsum: SUM, torch.cumprod: PRODUCT, torch.logcumsumexp: LOGSUMEXP}
# The blocked engine's inner ops: fscan's own, pure and elementwise (no checks needed).
_INNER_REACH = {
    inner: reach(inner)
    for inner in (torch.add, torch.mul, torch.logaddexp, torch.maximum, torch.minimum)
}


def kernel_call(op: Any, x: torch.Tensor) -> tuple[Any, Any, list[torch.Tensor], tuple[int, ...]]:
    """The combine, pytree spec, leaves and position leaves of ``op``'s kernel scan:
    cummax/cummin scan (value, index) pairs whose indices the kernel makes itself."""
    combine = _KERNEL_COMBINES[op]
    if op in EXTREMA:
        index = torch.zeros((), dtype=torch.int64).expand(x.shape)  # never read
        return combine, _PAIR, [x, index], (1,)
    return combine, _ONE_LEAF, [x], ()


def kernel_threads(x: torch.Tensor, dim: int, op: Any = None) -> int | None:
    """The most threads the drop-ins' kernel runs ``x`` on: one where the table measured it
    against a serial walk of torch's, over a single lane (see :func:`_kernel`) and, for
    ``op`` cummax/cummin, over several contiguous lanes (the innermost ``dim``: torch's
    walk there is serial on any thread count, and the table's cells do not read it); else
    None (``torch.get_num_threads()``)."""
    if x.shape[dim] == x.numel():
        return 1
    if op in EXTREMA and x.stride(dim) < LANE_PATH_INNER and x.is_contiguous():
        return 1
    return None


def _inner_scan(inner: Op, x: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    """The blocked engine's inner scan of ``x`` by one of its elementwise ops, routed as any
    of fscan's scans (:func:`~fscan._routing.scan.scan_flat`: the C++ kernel once compiled,
    the adjoint when gradients are wanted). The op is fscan's own: its verdicts are set,
    not checked."""
    leaves, found = [x], _INNER_REACH[inner]
    entry = knowledge(found, _ONE_LEAF, "pointwise", leaves)
    entry.pure = entry.elementwise = True
    call = ScanCall(SCAN_API, inner, x, _ONE_LEAF, leaves, dim, reverse, "pointwise")
    return scan_flat(call, found, entry)[0]


# ---- what the table says, for the benchmarks (the log's reasons: fscan._routing.reasons) ----


def path(op: Any, x: torch.Tensor, dim: int, reverse: bool = False, exclusive: bool = False) -> str:
    """The engine a drop-in for torch's ``op`` takes on ``x`` now: ``"cpp"`` (the compiled
    kernel, once loaded; ``exclusive``: its exclusive variant, which an exclusive drop-in
    of a contiguous ``x`` runs), ``"blocked"`` (fscan's parallel scan) or ``"native"``
    (torch's).

    Example:
        >>> path(torch.cumsum, torch.ones(4096, 256), 1)
        'native'
    """
    kernel, parallel = route(op, x, dim, reverse)
    if kernel:
        combine, spec, leaves, positions = kernel_call(op, x)
        if kernel_ready(combine, spec, leaves, dim, positions, exclusive):
            return "cpp"
    return "blocked" if parallel else "native"
