"""Which path a drop-in cumulative op takes: torch's op, the C++ kernel or the blocked scan.

The thresholds, measured (the comments above each), the routing table
(:func:`route`'s docstring), the fast exit to torch's op (:func:`native_fast`),
and each op as the kernel scans it (:func:`kernel_call`). The drop-ins themselves
are in :mod:`fscan._ops`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._engines.cpp.cpu_kernel import kernel_possible, kernel_ready, reads_in_place
from .._pytree import flatten

__all__ = [
    "KERNEL_MIN_NUMEL",
    "kernel_call",
    "kernel_wins",
    "native_fast",
    "parallel_wins",
    "path",
    "route",
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
# calls are not repaid. Where the C++ kernel is compiled it beats both (kernel_wins).
MIN_STRIDE = 64
MIN_LENGTH = 32
MIN_NUMEL = 2**15
SPAN_BYTES = 16 * 2**20
CUMSUM_MIN_STRIDE = 1024


# Measured on this repository's 2-core machine (AMD EPYC; /tmp-style sweeps of the kernel
# against torch's op, and python -m fscan.bench.ops, 1 and 2 threads, float32; December 2026):
# * below ~2**15 elements torch's op (2-30 us) beats the kernel's fixed cost.
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
KERNEL_MIN_NUMEL = 2**15
KERNEL_MIN_NUMEL_ONE_LANE = 2**20  # cumsum/cumprod over one lane: past the ties below
_KERNEL_INNER = 8  # the kernel's lane path needs this many lanes after dim
# Not contiguous (the kernel reads strided inputs in place; torch's op walks each lane;
# 1 thread, float32, December 2026, /work/notes/dropins2.md): with >= 8 lanes after dim
# the kernel ran 0.06-0.8x torch ((256, 4096).t() dim 0, x[:, ::2], x[::2], expanded
# lanes or steps, a (B, T, C) view of (B, C, T) memory, channels-last over C). Over
# fewer (the innermost dim), forward, cumsum and cumprod win where torch's walk jumps
# a page or more per step: 0.3-0.5x at a stride of 4096 elements ((256, 4096).t() dim
# 1), 0.7-0.9x at 1024, a tie at 256 (0.86-1.15x); they lose at strides 0-2 (1.0-1.7x;
# 1-D x[::2]: 1.45x). cummax/cummin there: 0.75-1.2x at 4096 (torch's). Reversed, torch
# copies twice to flip: the kernel ran 0.3-0.8x over several lanes and one, if it reads
# the view in place (channels-last over W, which it copies first: 1.6x for cumsum).
KERNEL_MIN_STRIDE = 4096
_FAR_STRIDE_OPS = (torch.cumsum, torch.cumprod)  # innermost, forward, >= KERNEL_MIN_STRIDE
# Forward over a single lane (and < _KERNEL_INNER elements after dim), the kernel's
# minimum size per op; the others stay torch's there (logcumsumexp: a tie).
_ONE_LANE_KERNEL_FROM = {
    torch.cumsum: KERNEL_MIN_NUMEL_ONE_LANE,
    torch.cumprod: KERNEL_MIN_NUMEL_ONE_LANE,
}
_NATIVE_BELOW = min(MIN_NUMEL, KERNEL_MIN_NUMEL)  # every op is torch's below this size
_is_compiling = torch.compiler.is_compiling  # bound once: Dynamo folds it by identity
_ONE_LEAF = flatten(torch.zeros(()))[1]
_PAIR = flatten((torch.zeros(()), torch.zeros(())))[1]


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


def kernel_wins(x: torch.Tensor, dim: int, reverse: bool, op: Any) -> bool:
    """Whether the compiled C++ kernel beats torch's ``op`` on ``x`` (see module doc).

    Example:
        >>> kernel_wins(torch.ones(4096, 256), 0, False, torch.cumsum)
        True
        >>> kernel_wins(torch.ones(4096, 256), 1, False, torch.cumsum)
        False
    """
    return route(op, x, dim, reverse)[0]


def route(op: Any, x: torch.Tensor, dim: int, reverse: bool) -> tuple[bool, bool]:
    """(:func:`kernel_wins`, :func:`parallel_wins`) for a drop-in of ``op`` on ``x``.

    The routing table (CPU, no ``torch.compile`` tracing; else always torch's op;
    ``inner`` = the elements after ``dim``, ``n`` its length, ``stride`` its stride;
    the kernel reads any layout in place, through its strides):

    ============================  ==========================  ===================
    call                          kernel (once compiled)      else
    ============================  ==========================  ===================
    numel < 2**15 (``MIN_NUMEL``)  never                       native
    no grad wanted,               inner >= 8: every op, any   parallel if it
    numel >= 2**15                layout; inner < 8, several  wins, else native
                                  lanes: logcumsumexp; the
                                  not contiguous, read in
                                  place: reversed, cumsum/
                                  cumprod from ``stride >=
                                  4096``; one lane:
                                  reversed, all but
                                  logcumsumexp; forward,
                                  cumsum/cumprod if
                                  contiguous, from 2**20
    grad wanted                   never                       parallel if it
                                                              wins, else native
    ============================  ==========================  ===================

    The parallel scan wins (:func:`parallel_wins`) at ``stride >= 64``, ``n >= 32``:
    logcumsumexp always, cumsum from ``stride >= 1024`` and a 16 MiB walk (``n *
    stride`` bytes), the others from a 16 MiB walk. Measurements: the comments above
    the constants. :func:`native_fast` takes the forward ``native`` cells before
    anything else is read, from the shape, ``stride`` (and the element size) alone;
    with no kernel to be had (:func:`~fscan._engines.cpp.cpu_kernel.kernel_possible`: mode
    ``"off"``, no compiler) also the kernel's cells where the parallel scan does not win.

    The tensor's facts are read once: each read costs about 1-3 µs on a cache
    cold from the op before (the calls routed to torch's op pay it).
    """
    # First, before any size is read: under torch.compile a read size is a guard.
    # (`is_cpu`, not `device.type`: making a torch.device slowed the op after it by 2-3%.)
    if _is_compiling() or not x.is_cpu or x.ndim == 0:
        return False, False
    shape = x.shape
    numel = math.prod(shape)
    if numel < _NATIVE_BELOW:
        return False, False
    n, stride = shape[dim], x.stride(dim)
    kernel = numel >= KERNEL_MIN_NUMEL and not (x.requires_grad and torch.is_grad_enabled())
    if kernel:
        inner = math.prod(shape[dim + 1 :])
        if inner >= _KERNEL_INNER:
            kernel = True  # the lane path, in place for any layout: no is_contiguous read
        else:
            contiguous = x.is_contiguous()
            kernel = kernel_rule(op, numel, n == numel, reverse, stride, contiguous)
            if kernel and not contiguous and op is not torch.logcumsumexp:
                kernel = reads_in_place(x, dim)  # else the kernel's copy loses (1.6x)
    return kernel, stride >= MIN_STRIDE and parallel_rule(op, n, stride, numel, x.element_size())


def parallel_rule(op: Any, n: int, stride: int, numel: int, itemsize: int) -> bool:
    """The parallel column of ``route``'s table (see the comments above ``MIN_STRIDE``)."""
    if stride < MIN_STRIDE or n < MIN_LENGTH or numel < MIN_NUMEL:
        return False
    if op is torch.logcumsumexp:
        return True
    if op is torch.cumsum and stride < CUMSUM_MIN_STRIDE:
        return False
    return n * stride * itemsize >= SPAN_BYTES


def kernel_rule(
    op: Any, numel: int, single_lane: bool, reverse: bool, stride: int, contiguous: bool
) -> bool:
    """The kernel column of ``route``'s table for ``inner < 8`` (the innermost ``dim``,
    say), without grad: the kernel's chained path, whose wins depend on the layout."""
    if op is torch.logcumsumexp:  # one lane: a chunked scan, twice the math; a tie
        return not single_lane
    if single_lane:  # torch's walk is serial, and reversed it flips (copies) twice
        return reverse or (contiguous and numel >= _ONE_LANE_KERNEL_FROM.get(op, math.inf))
    # Several lanes: contiguous, torch's threads split them and its walk streams. Not
    # contiguous: torch copies twice to flip, and its walk along a far-strided dim lands
    # every step on another page; the kernel reads 8 neighbouring lanes per cache line.
    return not contiguous and (reverse or (stride >= KERNEL_MIN_STRIDE and op in _FAR_STRIDE_OPS))


def native_fast(op: Any, x: Any, dim: Any) -> Any:
    """torch's ``op(x, dim)`` where ``route``'s table certainly picks it (a forward call
    with a plain int ``dim``), else None: the front end of a call that torch's op serves
    costs a few µs on top of it (about 3 here, against ~30 for the checks and the full
    route, whose code is cold in the cache after the op before). Also where the table
    picks the kernel but no kernel can run (:func:`kernel_possible`: mode ``"off"``, no
    compiler) and the parallel scan does not win: then torch's op is the route."""
    if type(dim) is not int or not isinstance(x, torch.Tensor) or _is_compiling():
        return None
    try:
        numel = x.numel()
        if numel < _NATIVE_BELOW:
            return op(x, dim)
        stride, n = x.stride(dim), None
        # The kernel's cells of the table, for a forward call (grad aside: the checked path
        # sees to it). Reads cost µs each on a cold cache: the contiguous case reads least.
        if x.is_contiguous():  # `stride` elements after dim
            if stride >= _KERNEL_INNER:
                kernel = True
            elif (n := x.size(dim)) != numel:  # several lanes
                kernel = op is torch.logcumsumexp
            else:
                kernel = numel >= _ONE_LANE_KERNEL_FROM.get(op, math.inf)
        else:
            shape = x.shape
            n = shape[dim]
            if math.prod(shape[dim:]) >= _KERNEL_INNER * n:  # also for a negative dim
                kernel = True
            elif n != numel:
                far = stride >= KERNEL_MIN_STRIDE and op in _FAR_STRIDE_OPS
                kernel = op is torch.logcumsumexp or (far and reads_in_place(x, dim % x.ndim))
            else:  # one lane, not contiguous: its stride is not 1
                kernel = False
        if kernel and kernel_possible():
            return None
        if stride >= MIN_STRIDE:
            n = x.size(dim) if n is None else n
            if parallel_rule(op, n, stride, numel, x.element_size()):
                return None
        return op(x, dim)
    except (IndexError, RuntimeError, NotImplementedError):
        # dim out of range, or a tensor torch's op cannot take (sparse, nested, quantized):
        # the checked path says so in fscan's words
        return None


def kernel_call(op: Any, x: torch.Tensor) -> tuple[Any, Any, list[torch.Tensor], tuple[int, ...]]:
    """The combine, pytree spec, leaves and position leaves of ``op``'s kernel scan:
    cummax/cummin scan (value, index) pairs whose indices the kernel makes itself."""
    combine = _KERNEL_COMBINES[op]
    if op in (torch.cummax, torch.cummin):
        index = torch.zeros((), dtype=torch.int64).expand(x.shape)  # never read
        return combine, _PAIR, [x, index], (1,)
    return combine, _ONE_LEAF, [x], ()


def path(op: Any, x: torch.Tensor, dim: int, reverse: bool = False) -> str:
    """The engine a drop-in for torch's ``op`` takes on ``x`` now: ``"cpp"`` (the compiled
    kernel, once loaded), ``"blocked"`` (fscan's parallel scan) or ``"native"`` (torch's).

    Example:
        >>> path(torch.cumsum, torch.ones(4096, 256), 1)
        'native'
    """
    if kernel_wins(x, dim, reverse, op):
        combine, spec, leaves, positions = kernel_call(op, x)
        if kernel_ready(combine, spec, leaves, dim, positions):
            return "cpp"
    return "blocked" if parallel_wins(x, dim, op) else "native"


def parallel_wins(x: torch.Tensor, dim: int, op: Any) -> bool:
    """Whether fscan's parallel scan beats torch's ``op`` (e.g. ``torch.cumsum``) on ``x``.

    Measured on CPU only; on other devices torch's kernels scan any dimension well.
    While ``torch.compile`` or ``torch.export`` traces, torch's op is always taken:
    one graph for every shape and layout, with no guards on them, and an op that
    the compiler lowers itself.

    Example:
        >>> x = torch.ones(4096, 256)
        >>> parallel_wins(x, 0, torch.logcumsumexp), parallel_wins(x, 1, torch.logcumsumexp)
        (True, False)
        >>> y = torch.ones(16384, 1024)  # a 64 MiB walk: past the caches
        >>> parallel_wins(x, 0, torch.cummax), parallel_wins(y, 0, torch.cummax)
        (False, True)
    """
    return route(op, x, dim, False)[1]
