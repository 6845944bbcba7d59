"""The drop-ins' router: which engine runs ``fscan.cumsum``, ``cumprod``, ``cummax``,
``cummin`` and ``logcumsumexp``, for eager, traced, gradient and ``torch.func`` calls.

:func:`route` is the one decision (side-effect free: the ``"fscan"`` log's reasons
ask it too, through :func:`refusals`); :func:`native_first` (:func:`native_first_into`
with ``out=``) serves the calls it sends to torch's op before any of fscan's checks;
:func:`cumulative` runs a checked call on the engine it picks. Every engine, in the
order they are tried (``inner``: the elements after ``dim``, ``n`` its length,
``stride`` its stride):

===========  ======================================================================
engine       when
===========  ======================================================================
``cpp``      the generated C++ kernel (:mod:`fscan._engines.cpp.cpu_kernel`), once
             compiled for the op and dtype (in the background, from the second large
             call): on CPU, no gradient wanted, at least 2**15 elements
             (``KERNEL_MIN_NUMEL``), and ``inner >= 8``, in any layout (the kernel
             reads views in place through their strides); with ``inner < 8`` (the
             innermost ``dim``, say) logcumsumexp over several lanes; over one lane,
             every op but logcumsumexp reversed (torch flips twice) and cumsum/cumprod
             forward if contiguous from 2**20 elements; over several lanes not
             contiguous, read in place, reversed (torch copies to flip) or cumsum/
             cumprod at ``stride >= 4096`` (torch's walk jumps pages). Not for
             logcumsumexp off float types, cummax/cummin on complex inputs
``blocked``  fscan's two-level parallel scan (:mod:`fscan._engines.blocked`), where
             the kernel is not picked or not compiled yet: on CPU, at ``stride >= 64``
             and ``n >= 32``, at least 2**15 elements: logcumsumexp always, cumsum
             from ``stride >= 1024`` and a 16 MiB walk (``n * stride`` bytes), the
             others from a 16 MiB walk; gradients too (autograd through its scans).
             Its inner scans are handed to it: scans of fscan's own elementwise ops,
             routed by :mod:`fscan._routing.scan` (the C++ kernel once compiled, the
             adjoint when gradients are wanted), without checks of the op
``native``   torch's own op (``reverse=True``: flip, op, flip): every other call; and
             always while ``torch.compile``/``torch.export`` traces (one graph for
             every shape and layout, no guards on them, an op the compiler lowers
             itself), off the CPU, below 2**15 elements, for logcumsumexp off float
             types, cummax/cummin on complex inputs, and cumsum/cumprod in bool
===========  ======================================================================

Under a ``torch.func`` transform the table is read as for an eager call; the kernel
refuses the transform's wrapped tensors (torch's op or the blocked scan then runs).
Gradients are torch's on ``native`` and autograd's through the scans on ``blocked``;
they agree (cumprod with zeros included: the scan multiplies, it never divides;
cummax/cummin gather their values at the indices found, so the whole gradient goes
to the chosen element, as in torch).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._call import SCAN_API, ScanCall
from .._context import where as runs_at  # not `where`: the combines below name torch.where
from .._engines.blocked import LOGSUMEXP, PRODUCT, SUM, Op, accumulate, extremum_scan
from .._engines.cpp.cpu_kernel import (
    KERNEL_MIN_NUMEL,
    kernel_possible,
    kernel_ready,
    kernel_scan,
    reads_in_place,
)
from .._errors import ScanTypeError
from .._knowledge.store import knowledge, reach
from .._pytree import flatten, unflatten
from .._route_log import ran
from .._segmented import check_reset, segmented_scan
from .scan import scan_flat, scan_traced
from .segmented import run_segmented, segmented_route

__all__ = [
    "cumulative",
    "engine",
    "kernel_call",
    "native",
    "native_first",
    "native_first_into",
    "path",
    "route",
    "segmented",
]

# The parallel-scan rule, measured on CPU (fscan/bench/ops.py and sweeps over shapes,
# one thread, float32). torch's kernel walks `dim` for one column after another. When
# `dim` is contiguous that walk streams and nothing beats it. When consecutive steps
# are >= MIN_STRIDE elements apart, every step lands on a new cache line, and the cost
# depends on the op and on the span of one column's walk (n * stride bytes):
# * logcumsumexp costs 20-40 ns per element in torch's strided walk at any span; the
#   parallel scan ~10 (0.25-0.35x torch at 1-16 MiB spans, on a Xeon and an AMD EPYC).
# * cumsum, cumprod, cummax and cummin: on a Xeon (2 MiB L2 per core) the parallel
#   scan won once the span passed L2; on an AMD EPYC (1 MiB L2 per core, 32 MiB L3)
#   it lost at 1-4 MiB spans (1.1-2.5x torch; (4096, 256) and (8, 1024, 256)) and
#   won from 16 MiB on (0.33-0.81x at (4096, 1024) and (16384, 1024) dim 0, cummax
#   and cumprod also at (65536, 64)), except cumsum at strides below 1024 elements
#   (1.6x at (65536, 64)): its carries are float64. So: spans of SPAN_BYTES.
# Below MIN_LENGTH steps or MIN_NUMEL elements, the scan's ~0.1-0.3 ms of Python
# calls are not repaid. Where the C++ kernel is compiled it beats both.
MIN_STRIDE = 64
MIN_LENGTH = 32
MIN_NUMEL = 2**15
SPAN_BYTES = 16 * 2**20
CUMSUM_MIN_STRIDE = 1024


# The kernel, measured on this repository's 2-core machine (AMD EPYC; sweeps of the kernel
# against torch's op, and python -m fscan.bench.ops, 1 and 2 threads, float32; December 2026):
# * below ~2**15 elements (KERNEL_MIN_NUMEL) torch's op (2-30 us) beats its fixed cost.
# * at a dim with >= 8 contiguous lanes after it, the kernel ran 0.05-0.5x torch (every op,
#   (4096, 256) dim 0, (8, 1024, 256) dim 1, (16384, 16) dim 0).
# * over fewer lanes (the innermost dim; the kernel's chained path): cumsum and cumprod
#   over one lane (1-D) on one kernel thread (see _kernel) 0.67-0.85x torch at (2**20,)
#   with 1 or 2 torch threads; below, ties that went either way between runs: 0.79-1.10x
#   at 2**18 and 0.81-1.00x at 2**19, 0.85-1.25x at 2**17, 1.2-1.4x at 2**15. Over
#   several lanes torch spreads the rows over its threads: the kernel won at 1 thread
#   ((4096, 256) dim 1 0.6x, (512, 512) 0.82x) but not at 2 ((1024, 1024) dim 1 1.2-1.3x,
#   (65536, 4) dim 0 2.8-3.3x, (16384, 64) dim 1 a tie): torch's. cummax/cummin 1.5-2.7x
#   (torch's branchy walk predicts well) except reversed over one lane (0.1-0.7x: torch
#   flips twice); logcumsumexp 0.4-0.8x over several lanes (compute-bound), but over a
#   single lane (1-D) the chunked scan does the math twice: 0.8-1.1x, a tie, torch's.
KERNEL_MIN_NUMEL_ONE_LANE = 2**20  # cumsum/cumprod over one lane: past the ties below
_KERNEL_INNER = 8  # the kernel's lane path needs this many lanes after dim
# Not contiguous (the kernel reads strided inputs in place; torch's op walks each lane;
# 1 thread, float32, December 2026): with >= 8 lanes after dim the kernel ran 0.06-0.8x
# torch ((256, 4096).t() dim 0, x[:, ::2], x[::2], expanded lanes or steps, a (B, T, C)
# view of (B, C, T) memory, channels-last over C). Over fewer (the innermost dim),
# forward, cumsum and cumprod win where torch's walk jumps a page or more per step:
# 0.3-0.5x at a stride of 4096 elements ((256, 4096).t() dim 1), 0.7-0.9x at 1024, a tie
# at 256 (0.86-1.15x); they lose at strides 0-2 (1.0-1.7x; 1-D x[::2]: 1.45x).
# cummax/cummin there: 0.75-1.2x at 4096 (torch's). Reversed, torch copies twice to flip:
# the kernel ran 0.3-0.8x over several lanes and one, if it reads the view in place
# (channels-last over W, which it copies first: 1.6x for cumsum).
KERNEL_MIN_STRIDE = 4096
_FAR_STRIDE_OPS = (torch.cumsum, torch.cumprod)  # innermost, forward, >= KERNEL_MIN_STRIDE
# Forward over a single lane (and < _KERNEL_INNER elements after dim), the kernel's
# minimum size per op; the others stay torch's there (logcumsumexp: a tie).
_ONE_LANE_KERNEL_FROM = {
    torch.cumsum: KERNEL_MIN_NUMEL_ONE_LANE,
    torch.cumprod: KERNEL_MIN_NUMEL_ONE_LANE,
}
_NATIVE_BELOW = min(MIN_NUMEL, KERNEL_MIN_NUMEL)  # every op is torch's below this size
_NATIVE = (False, False)  # route's answer for torch's op
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUMS = (torch.cumsum, torch.cumprod)  # torch's op takes dtype=
_EXTREMA = {torch.cummax: torch.return_types.cummax, torch.cummin: torch.return_types.cummin}
_is_compiling = torch.compiler.is_compiling  # bound once: Dynamo folds it by identity
_ONE_LEAF = flatten(torch.zeros(()))[1]
_PAIR = flatten((torch.zeros(()), torch.zeros(())))[1]


def route(op: Any, x: torch.Tensor, dim: int, reverse: bool) -> tuple[bool, bool]:
    """Whether the table (module doc) picks the C++ kernel and whether the blocked scan
    beats torch's ``op`` (e.g. ``torch.cumsum``) for a drop-in on ``x``: ``(kernel,
    blocked)``. ``dim`` may be negative; one out of range raises ``IndexError``.

    Example:
        >>> route(torch.cumsum, torch.ones(4096, 256), 0, False)
        (True, False)
        >>> route(torch.logcumsumexp, torch.ones(4096, 256), 0, False)
        (True, True)
        >>> route(torch.cumsum, torch.ones(4096, 256), 1, False)
        (False, False)
    """
    # First, before any size is read: under torch.compile a read size is a guard.
    if _is_compiling():
        return _NATIVE
    return _cells(op, x, dim, reverse)


def _cells(op: Any, x: torch.Tensor, dim: int, reverse: bool) -> tuple[bool, bool]:
    """:func:`route` outside tracing. The tensor's facts are read once, fewest first for
    the calls torch's op serves: each read costs about 1-3 µs on a cache cold from the op
    before. (``is_cpu``, not ``device.type``: making a torch.device slowed the op after it
    by 2-3%.)"""
    numel = x.numel()
    if numel < _NATIVE_BELOW or not x.is_cpu:
        return _NATIVE
    stride, n = x.stride(dim), None
    if numel < KERNEL_MIN_NUMEL or (x.requires_grad and torch.is_grad_enabled()):
        kernel = False
    elif x.is_contiguous():  # `stride` elements after dim
        if stride >= _KERNEL_INNER:
            kernel = True  # the lane path
        elif (n := x.size(dim)) != numel:  # several lanes: torch's threads split them
            kernel = op is torch.logcumsumexp  # compute-bound: the kernel's math wins
        else:  # one lane: torch's walk is serial, and reversed it flips (copies) twice
            large = numel >= _ONE_LANE_KERNEL_FROM.get(op, math.inf)
            kernel = op is not torch.logcumsumexp and (reverse or large)
    else:
        shape = x.shape
        n = shape[dim]
        if math.prod(shape[dim:]) >= _KERNEL_INNER * n:  # the lane path, read in place
            kernel = True
        elif op is torch.logcumsumexp:  # one lane: a chunked scan, twice the math; a tie
            kernel = n != numel
        else:  # torch copies to flip; a far-strided walk lands every step on a new page
            far = n != numel and stride >= KERNEL_MIN_STRIDE and op in _FAR_STRIDE_OPS
            kernel = (reverse or far) and reads_in_place(x, dim % x.ndim)  # else a copy: 1.6x
    parallel = stride >= MIN_STRIDE and _parallel_wins(
        op, x.size(dim) if n is None else n, stride, numel, x.element_size()
    )
    if kernel or parallel:
        kernel_bar, parallel_bar = _dtype_refusals(op, x.dtype)
        return kernel and kernel_bar is None, parallel and parallel_bar is None
    return _NATIVE


def _parallel_wins(op: Any, n: int, stride: int, numel: int, itemsize: int) -> bool:
    """The blocked scan's cells of the table (see the comments above ``MIN_STRIDE``)."""
    if stride < MIN_STRIDE or n < MIN_LENGTH or numel < MIN_NUMEL:
        return False
    if op is torch.logcumsumexp:
        return True
    if op is torch.cumsum and stride < CUMSUM_MIN_STRIDE:
        return False
    return n * stride * itemsize >= SPAN_BYTES


def _dtype_refusals(op: Any, dtype: torch.dtype) -> tuple[str | None, str | None]:
    """Why ``dtype`` keeps the kernel and the blocked scan from ``op`` whatever the layout
    (None where it does not)."""
    if op is torch.logcumsumexp and dtype not in _FLOATS:
        # complex: the imaginary part of a complex log is defined up to multiples of 2 pi,
        # and which one torch returns depends on its order of combination
        why = f"{dtype} runs on torch's op"
        return why, why
    if op in _EXTREMA and dtype.is_complex:
        return "complex inputs run on torch's op", "complex inputs run on torch's op"
    if dtype == torch.bool and op in _SUMS:  # dtype=torch.bool asked
        return None, "torch's op takes this dtype"
    return None, None


def native_first(op: Any, x: Any, dim: Any) -> Any:
    """torch's ``op(x, dim)`` for a forward call with unchecked arguments where the table
    certainly picks it (also where it picks the kernel but none can run: mode ``"off"``,
    no compiler, :func:`kernel_possible`), else None: the checks and :func:`cumulative`
    cost a few µs on top of torch's op (about 3 here, against ~30 for the checks and the
    full route, whose code is cold in the cache after the op before). While
    ``torch.compile`` traces, None: the checked path raises fscan's errors."""
    if type(dim) is not int or not isinstance(x, torch.Tensor) or _is_compiling():
        return None
    try:
        # The table's first row, read before the call into it: most calls end here, and
        # the call would add ~3% to them.
        if x.numel() < _NATIVE_BELOW or _torch_serves(op, x, dim):
            return op(x, dim)
        return None
    except (IndexError, RuntimeError, NotImplementedError):
        # dim out of range, or a tensor torch's op cannot take (sparse, nested, quantized):
        # the checked path says so in fscan's words
        return None


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
        if x.numel() < _NATIVE_BELOW or _torch_serves(op, x, dim):
            return op(x, dim, out=out)
        return None
    except (IndexError, RuntimeError, NotImplementedError):
        return None


def _torch_serves(op: Any, x: torch.Tensor, dim: int) -> bool:
    """Whether the table picks torch's op for a forward call on ``x`` (also where it picks
    the kernel but none can run)."""
    cells = _cells(op, x, dim, False)
    if cells is not _NATIVE:  # the common answer needs no more reads
        kernel, parallel = cells
        if parallel or (kernel and kernel_possible()):
            return False
    return True


def cumulative(
    api: str, op: Any, x: torch.Tensor, dim: int, reverse: bool, reset: Any = None
) -> Any:
    """Run the drop-in ``api`` of torch's ``op`` on ``x`` on the engine the table picks:
    ``x`` in the dtype torch computes in, ``dim`` checked and non-negative. With
    ``reset=`` (torch's op has none), :func:`segmented` runs it.

    Example:
        >>> cumulative("fscan.cumsum", torch.cumsum, torch.tensor([1, 2, 3]), 0, True)
        tensor([6, 5, 3])
    """
    if reset is not None:
        return segmented(api, op, x, dim, reverse, reset)
    return engine(api, op, x, dim, reverse)


def engine(
    api: str,
    op: Any,
    x: torch.Tensor,
    dim: int,
    reverse: bool,
    out: list | None = None,
    cells: tuple[bool, bool] | None = None,
) -> Any:
    """:func:`cumulative` without ``reset=`` on the engine the table picks. An exclusive
    drop-in (:mod:`fscan._routing.exclusive`) passes ``out`` (views, no gradient wanted),
    which the kernel and torch's op forward write in place, and ``cells``, the table's
    answer for its whole input (``x`` is one step shorter)."""
    kernel, parallel = route(op, x, dim, reverse) if cells is None else cells
    if kernel and (found := _kernel(api, op, x, dim, reverse, out)) is not None:
        ran("cpp")
        return found
    if not parallel:
        return native(op, x, dim, reverse, out)
    ran("blocked")
    if op in _EXTREMA:
        largest = op is torch.cummax
        return _EXTREMA[op](extremum_scan(x, dim, reverse, largest, _inner_scan))
    return accumulate(_ACCUMULATIONS[op], x, dim, reverse, _inner_scan)


def segmented(api: str, op: Any, x: torch.Tensor, dim: int, reverse: bool, reset: Any) -> Any:
    """``op`` restarted wherever the bool mask ``reset`` is True (``out[i] = x[i]``
    there): fscan's segmented scan (:mod:`fscan._segmented`) of the op's combine, on the
    engine :mod:`fscan._routing.scan` picks and notes. cummax/cummin scan (value,
    position) pairs, so their indices are positions in the whole ``x``. The mask is
    checked here first, so that its errors name ``api``.

    Example:
        >>> reset = torch.tensor([False, False, True, False])
        >>> segmented("fscan.cumsum", torch.cumsum, torch.tensor([1, 2, 3, 4]), 0, False, reset)
        tensor([1, 3, 3, 7])
    """
    if x.ndim == 0:  # one step, as torch scans 0-d tensors
        out = segmented(api, op, x[None], 0, reverse, reset)
        return _EXTREMA[op]((out[0][0], out[1][0])) if op in _EXTREMA else out[0]
    check_reset(api, reset, x, [x], dim)
    if op is torch.logcumsumexp and x.dtype not in _FLOATS:
        raise ScanTypeError(
            f"{api}: `reset=` takes float inputs, got {x.dtype}: the imaginary part of a "
            "complex log depends on torch's order of combination."
        )
    if segmented_route(runs_at([x]), [x]) is None:
        combine, spec, leaves, positions = kernel_call(op, x)
        threads = 1 if x.shape[dim] == x.numel() else None  # one lane: as _kernel below
        found = run_segmented(combine, spec, leaves, dim, reverse, reset, positions, threads)
        if found is not None:
            return _EXTREMA[op](found) if op in _EXTREMA else found[0]
    xs: Any = x
    if op in _EXTREMA:
        n = x.shape[dim]
        positions = torch.arange(n, device=x.device).reshape([n] + [1] * (x.ndim - 1 - dim))
        xs = (x, positions.expand(x.shape))
    leaves, spec = flatten(xs)
    combine = _KERNEL_COMBINES[op]
    call = ScanCall(api, combine, xs, spec, leaves, dim, reverse, "pointwise", reset=reset)
    out = segmented_scan(_scan_pairs, call)
    if not _is_compiling():  # Dynamo cannot trace the log's ContextVar
        ran("tree")  # after the scan: an engine its router noted (the kernel) comes first
    return _EXTREMA[op](out) if op in _EXTREMA else out


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
            return op(x, dim, dtype=x.dtype, out=into) if op in _SUMS else op(x, dim, out=into)
        return op(x, dim, dtype=x.dtype) if op in _SUMS else op(x, dim)
    if op in _SUMS:  # integers and bool already promoted, or cast to the dtype asked
        return op(x.flip(dim), dim, dtype=x.dtype).flip(dim)
    out = op(x.flip(dim), dim)
    if op not in _EXTREMA:
        return out.flip(dim)
    values, indices = out
    return _EXTREMA[op]((values.flip(dim), (x.shape[dim] - 1 - indices).flip(dim)))


def _kernel(api: str, op: Any, x: torch.Tensor, dim: int, reverse: bool, out: Any = None) -> Any:
    """The kernel's scan of ``x`` if it is compiled, else None (the caller checked that
    it wins); into ``out`` if given (see :func:`engine`).

    Over a single lane the kernel runs on one thread: torch's walk there is serial, and
    the kernel alone beats it (0.7-0.85x). Its threads would double that margin on an idle
    machine, but each of its reduce-then-scan steps waits for every thread, and on a
    shared one a descheduled thread cost 10-25x torch's time (2 threads, another process
    busy), where torch's serial walk does not wait."""
    combine, spec, leaves, positions = kernel_call(op, x)
    threads = 1 if x.shape[dim] == x.numel() else None
    out = kernel_scan(
        api, combine, spec, leaves, dim, reverse, positions=positions, threads=threads, out=out
    )
    if out is None:
        return None
    return _EXTREMA[op](out) if op in _EXTREMA else out[0]


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
    if op in _EXTREMA:
        index = torch.zeros((), dtype=torch.int64).expand(x.shape)  # never read
        return combine, _PAIR, [x, index], (1,)
    return combine, _ONE_LEAF, [x], ()


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


def path(op: Any, x: torch.Tensor, dim: int, reverse: bool = False) -> str:
    """The engine a drop-in for torch's ``op`` takes on ``x`` now: ``"cpp"`` (the compiled
    kernel, once loaded), ``"blocked"`` (fscan's parallel scan) or ``"native"`` (torch's).

    Example:
        >>> path(torch.cumsum, torch.ones(4096, 256), 1)
        'native'
    """
    kernel, parallel = route(op, x, dim, reverse)
    if kernel:
        combine, spec, leaves, positions = kernel_call(op, x)
        if kernel_ready(combine, spec, leaves, dim, positions):
            return "cpp"
    return "blocked" if parallel else "native"
