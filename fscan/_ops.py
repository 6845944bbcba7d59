"""Drop-in cumulative ops: ``torch.cumsum`` & co. with ``reverse=``, each a scan underneath.

``fscan.cumsum``, ``cumprod``, ``cummax``, ``cummin`` and ``logcumsumexp`` take
torch's arguments in torch's order (extras keyword-only) and return what torch
returns: the same dtypes (integers and bool sum and multiply in int64, ``dtype=``
casts first), shapes (0-d inputs, empty dimensions), ``(values, indices)``
structs with torch's tie-breaking and NaN rules, and the same precision
(accumulation in float64 for float32, in float32 for half types).

Each call takes the fastest of three paths, as measured (:func:`path` says which;
``_route``'s docstring has the table):

* torch's native kernel, taken first and cheaply by ``_native_fast`` (a few
  µs of checks) where nothing else can win: under ``MIN_NUMEL`` elements, and at
  a ``dim`` with fewer than 8 contiguous elements after it (the innermost, say):
  over several such lanes for every op but logcumsumexp, and over a single lane
  (1-D, say) for cummax/cummin/logcumsumexp and for cumsum/cumprod below
  ``KERNEL_MIN_NUMEL_ONE_LANE``. There torch's walk is contiguous (and torch
  spreads the lanes over its threads). ``reverse=True`` is flip, op, flip.
* the generated C++ kernel of :mod:`fscan.engine.cpu_kernel`, once it is compiled
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
  ``"off"``, no compiler: :func:`~fscan.engine.cpu_kernel.kernel_possible`),
  ``_native_fast`` sends these calls to the next path itself, without the checks.
* fscan's parallel scan (:mod:`fscan._ops_parallel`), which combines whole
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

import math
from typing import Any

import torch

from ._checks import check_dense, normalize_dim
from ._errors import ScanTypeError
from ._ops_parallel import LOGSUMEXP, PRODUCT, SUM, Accumulation, blocked_scan, extremum_scan
from ._pytree import flatten
from ._route_log import logs_route, ran
from .engine.cpu_kernel import kernel_possible, kernel_ready, kernel_scan, reads_in_place

__all__ = [
    "cummax",
    "cummin",
    "cumprod",
    "cumsum",
    "kernel_wins",
    "logcumsumexp",
    "parallel_wins",
    "path",
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
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
    return _route(op, x, dim, reverse)[0]


def _route(op: Any, x: torch.Tensor, dim: int, reverse: bool) -> tuple[bool, bool]:
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
    the constants. :func:`_native_fast` takes the forward ``native`` cells before
    anything else is read, from the shape, ``stride`` (and the element size) alone;
    with no kernel to be had (:func:`~fscan.engine.cpu_kernel.kernel_possible`: mode
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
            kernel = _kernel_rule(op, numel, n == numel, reverse, stride, contiguous)
            if kernel and not contiguous and op is not torch.logcumsumexp:
                kernel = reads_in_place(x, dim)  # else the kernel's copy loses (1.6x)
    return kernel, stride >= MIN_STRIDE and _parallel_rule(op, n, stride, numel, x.element_size())


def _parallel_rule(op: Any, n: int, stride: int, numel: int, itemsize: int) -> bool:
    """The parallel column of ``_route``'s table (see the comments above ``MIN_STRIDE``)."""
    if stride < MIN_STRIDE or n < MIN_LENGTH or numel < MIN_NUMEL:
        return False
    if op is torch.logcumsumexp:
        return True
    if op is torch.cumsum and stride < CUMSUM_MIN_STRIDE:
        return False
    return n * stride * itemsize >= SPAN_BYTES


def _kernel_rule(
    op: Any, numel: int, single_lane: bool, reverse: bool, stride: int, contiguous: bool
) -> bool:
    """The kernel column of ``_route``'s table for ``inner < 8`` (the innermost ``dim``,
    say), without grad: the kernel's chained path, whose wins depend on the layout."""
    if op is torch.logcumsumexp:  # one lane: a chunked scan, twice the math; a tie
        return not single_lane
    if single_lane:  # torch's walk is serial, and reversed it flips (copies) twice
        return reverse or (contiguous and numel >= _ONE_LANE_KERNEL_FROM.get(op, math.inf))
    # Several lanes: contiguous, torch's threads split them and its walk streams. Not
    # contiguous: torch copies twice to flip, and its walk along a far-strided dim lands
    # every step on another page; the kernel reads 8 neighbouring lanes per cache line.
    return not contiguous and (reverse or (stride >= KERNEL_MIN_STRIDE and op in _FAR_STRIDE_OPS))


def _native_fast(op: Any, x: Any, dim: Any) -> Any:
    """torch's ``op(x, dim)`` where ``_route``'s table certainly picks it (a forward call
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
            if _parallel_rule(op, n, stride, numel, x.element_size()):
                return None
        return op(x, dim)
    except (IndexError, RuntimeError, NotImplementedError):
        # dim out of range, or a tensor torch's op cannot take (sparse, nested, quantized):
        # the checked path says so in fscan's words
        return None


def _kernel_call(op: Any, x: torch.Tensor) -> tuple[Any, Any, list[torch.Tensor], tuple[int, ...]]:
    """The combine, pytree spec, leaves and position leaves of ``op``'s kernel scan:
    cummax/cummin scan (value, index) pairs whose indices the kernel makes itself."""
    combine = _KERNEL_COMBINES[op]
    if op in (torch.cummax, torch.cummin):
        index = torch.zeros((), dtype=torch.int64).expand(x.shape)  # never read
        return combine, _PAIR, [x, index], (1,)
    return combine, _ONE_LEAF, [x], ()


def _kernel(api: str, op: Any, x: torch.Tensor, dim: int, reverse: bool) -> Any:
    """The kernel's scan of ``x`` (a tensor, or (values, indices)) if it is compiled,
    else None (the caller checked that it wins).

    Over a single lane the kernel runs on one thread: torch's walk there is serial, and
    the kernel alone beats it (0.7-0.85x). Its threads would double that margin on an idle
    machine, but each of its reduce-then-scan steps waits for every thread, and on a
    shared one a descheduled thread cost 10-25x torch's time (2 threads, another process
    busy), where torch's serial walk does not wait."""
    combine, spec, leaves, positions = _kernel_call(op, x)
    threads = 1 if x.shape[dim] == x.numel() else None
    out = kernel_scan(
        api, combine, spec, leaves, dim, reverse, positions=positions, threads=threads
    )
    if out is None:
        return None
    ran("cpp")
    return out[0] if len(out) == 1 else tuple(out)


def path(op: Any, x: torch.Tensor, dim: int, reverse: bool = False) -> str:
    """The engine a drop-in for torch's ``op`` takes on ``x`` now: ``"cpp"`` (the compiled
    kernel, once loaded), ``"blocked"`` (fscan's parallel scan) or ``"native"`` (torch's).

    Example:
        >>> path(torch.cumsum, torch.ones(4096, 256), 1)
        'native'
    """
    if kernel_wins(x, dim, reverse, op):
        combine, spec, leaves, positions = _kernel_call(op, x)
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
    return _route(op, x, dim, False)[1]


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
        and (out := _native_fast(torch.cumsum, input, dim)) is not None
    ):
        return out  # torch promotes integers and bool to int64 itself
    x, dim = _prepare("fscan.cumsum", input, dim, reverse, dtype, promote_integers=True)
    kernel, parallel = _route(torch.cumsum, x, dim, reverse)
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
        and (out := _native_fast(torch.cumprod, input, dim)) is not None
    ):
        return out  # torch promotes integers and bool to int64 itself
    x, dim = _prepare("fscan.cumprod", input, dim, reverse, dtype, promote_integers=True)
    kernel, parallel = _route(torch.cumprod, x, dim, reverse)
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
    if reverse is False and (out := _native_fast(torch.logcumsumexp, input, dim)) is not None:
        return out
    x, dim = _prepare("fscan.logcumsumexp", input, dim, reverse)
    kernel, parallel = _route(torch.logcumsumexp, x, dim, reverse)
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
    if reverse is False and (out := _native_fast(native, input, dim)) is not None:
        return out
    x, dim = _prepare(api, input, dim, reverse)
    kernel, parallel = _route(native, x, dim, reverse)
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
