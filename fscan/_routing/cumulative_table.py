"""The drop-ins' route table: which engine runs ``fscan.cumsum``, ``cumprod``, ``cummax``,
``cummin`` and ``logcumsumexp``, for eager, traced, gradient and ``torch.func`` calls.

:func:`route` is the one decision (side-effect free: the ``"fscan"`` log's reasons
ask it too, through :func:`fscan._routing.reasons.cumulative_refusals`); the drop-ins'
router (:mod:`fscan._routing.cumulative`) runs each call on the engine it picks, and
serves the calls it sends to torch's op before any of fscan's checks. Every engine, in
the order they are tried (``inner``: the elements after ``dim``, ``n`` its length,
``stride`` its stride):

===========  ======================================================================
engine       when
===========  ======================================================================
``cpp``      the generated C++ kernel (:mod:`fscan._engines.cpp.cpu_kernel`), once
             compiled for the op and dtype (in the background, from the second large
             call): on CPU, no gradient wanted, at least 2**15 elements
             (``KERNEL_MIN_NUMEL``), and ``inner >= 8``, in any layout (the kernel
             reads views in place through their strides); with ``inner < 8`` (the
             innermost ``dim``, say) logcumsumexp over several lanes; cummax/cummin
             there on any thread count (run on one: torch's walk is serial)
             reversed in float32 or at ``n >= 128`` (``WALK_FROM``), forward in
             float32 over the innermost dim from 2**17 elements (the kernel's
             tiles under 128 steps, its lone walk from 128); on one thread
             (``torch.get_num_threads() == 1``) at ``n >= 128``
             (``ONE_THREAD_MIN_LENGTH``; float32 reversed from 16, forward
             from 64, float64 reversed from 64: ``ONE_THREAD_MIN_LENGTHS``)
             cumsum and cumprod reversed, and forward in float32/float64
             (``CHAIN_SUM_DTYPES``); over one lane,
             logcumsumexp, every op reversed (torch flips twice), cumsum/cumprod
             forward in float32/float64 if contiguous from 2**20 elements and
             cummax/cummin forward in float32 from 2**17;
             over several lanes not contiguous, read in place, reversed (torch
             copies to flip), cumsum/cumprod at ``stride >= 4096`` (torch's walk
             jumps pages), or float32 cumsum/cumprod/cummax/cummin whose lanes lie
             side by side (``ROW_TILE_MIN_LANES``: ``x.t()``, the kernel's tiles
             copying rows). Not for
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

from .._engines.cpp.cpu_kernel import KERNEL_MIN_NUMEL, WALK_FROM, kernel_possible, reads_in_place

__all__ = [
    "CHAIN_SUM_DTYPES",
    "CUMSUM_MIN_STRIDE",
    "EXTREMA",
    "EXTREMUM_FORWARD_MIN_NUMEL",
    "FLOATS",
    "KERNEL_MIN_NUMEL_ONE_LANE",
    "KERNEL_MIN_STRIDE",
    "LANE_PATH_INNER",
    "MIN_LENGTH",
    "MIN_NUMEL",
    "MIN_STRIDE",
    "NATIVE_BELOW",
    "ONE_THREAD_MIN_LENGTH",
    "ONE_THREAD_MIN_LENGTHS",
    "ROW_TILE_MIN_LANES",
    "SPAN_BYTES",
    "SUMS",
    "dtype_refusals",
    "route",
    "threads_decide",
    "torch_serves",
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
#   then (torch's branchy walk predicts well; since, EXTREMUM_FORWARD_MIN_NUMEL) except
#   reversed over one lane (0.1-0.7x: torch flips twice); logcumsumexp 0.4-0.8x over
#   several lanes (compute-bound), and over a single lane (1-D), its math vectorised since
#   (tiled chains, computed twice by the chunked scan): 0.20x at 2**20, 0.33x at 2**16,
#   0.45x at 2**15, 0.63x at 2**20 x[::2].
# On one thread (torch.get_num_threads() == 1) torch's op has no threads to split the rows
# over, and the kernel won over several contiguous lanes (the innermost dim; thread CPU
# time, medians of 21, 1 thread, float32, December 2026; kernel / torch): reversed (torch
# flips twice), every op at rows of >= 256 steps: cumsum 0.48-0.77, cumprod 0.54-0.86,
# cummax/cummin 0.59-0.82 ((4096, 256), (2048, 512), (1024, 1024), (256, 4096), (64,
# 16384), (8, 1024, 256) dim 2); at 128 steps 0.89-1.02, at 32-64 0.73-1.25. Forward,
# cumsum at >= 256 steps 0.53-0.91 (128: 1.03-1.29; 32-64: 1.2-2.0); cumprod 0.46-0.98
# (re-measured on an idle machine, an earlier "tie past 512 steps" having been timed under
# load: (4096, 256) 0.58-0.63, (2048, 512) 0.49-0.56, (1024, 1024) 0.46-0.97, (256, 4096)
# 0.46-0.49, (64, 16384) 0.48, (8192, 256) 0.88-0.98; the same values bit for bit);
# cummax/cummin 1.7-2.3x (8 chains walked interleaved then; since, long chains walk one
# at a time and short ones tile: see EXTREMUM_FORWARD_MIN_NUMEL). On 2 threads cumsum's and
# cumprod's rows stay torch's (see above; the shared machine's wall clock could not settle
# them).
# Re-measured December 6 (thread CPU, medians, kernel / torch, forward): the tiles have
# since taken float32 rows from 128 steps (1024, 128) 0.60 / 0.65 (cumsum / cumprod),
# (2048, 128) 0.55 / 0.59, (8192, 96) 0.58 / 0.63, (4096, 64) 0.72 / 0.79, (1024, 48)
# 1.02 / 1.12; float64 (1024, 128) 0.92 / 0.91, (8192, 96) 1.02 / 1.03, (4096, 192) 0.75.
# Re-measured after the forward's whole-lane tiles (lane_tiles, csrc/forward_chains.h: a
# group's lanes stepped, not described a chain at a time), scripts/cumulative_rows.py
# --op cumsum / cumprod (thread CPU, medians of 21, 1 thread, kernel / torch, 2**15, 2**17
# and 2**20 elements; cumsum, cumprod): float32 reversed at 16 steps 0.55-1.02, 0.80-0.83,
# at 32 0.59-0.81, at 48-96 0.38-0.72 (at 8: 0.83-1.49); float32 forward at 64 steps
# 0.69-0.79, 0.78-1.02, at 96 0.58-0.76 (at 48 0.76-1.00, at 32 1.01-1.36, at 16
# 1.22-2.45); float64 reversed at 64 steps 0.76-0.83, at 96 0.58-0.61 (at 32 0.73-1.13, at
# 16 0.86-1.58); float64 forward (walked, not tiled) 1.02-6.2 under 128. So on one thread
# these rows take the kernel from ONE_THREAD_MIN_LENGTHS' lengths, the rest from 128.
ONE_THREAD_MIN_LENGTH = 128
ONE_THREAD_MIN_LENGTHS = {  # (dtype, reverse): the kernel's rows from this many steps
    (torch.float32, True): 16,
    (torch.float32, False): 64,
    (torch.float64, True): 64,
}
KERNEL_MIN_NUMEL_ONE_LANE = 2**20  # cumsum/cumprod over one lane: past the ties below
# ... in float32 and float64 only (the chains tiled, or walked in double): forward in other
# dtypes the kernel walked them a step at a time, slower than torch's op (1 thread, thread
# CPU, medians, December 6; kernel / torch): one lane of 2**20 int64 cumsum 2.32, cumprod
# 1.06, bfloat16 1.51 / 2.21, float16 1.21-1.24; rows of 256-4096 steps int64 cumsum 1.95-
# 15.9 (interleaved chains a power of two apart thrash the L1's sets), cumprod 0.78-6.4,
# bfloat16 1.07-1.84, float16 0.91-1.02. Reversed (torch flips twice) the kernel stays.
CHAIN_SUM_DTYPES = (torch.float32, torch.float64)
# cummax/cummin over several contiguous lanes: torch's walk of them is serial on any thread
# count (torch.cummax (65536, 16) dim 1: 3.06 ms on 1 thread, 2.98 on 2; (4096, 256) 1.17 /
# 1.20), so the kernel runs them on one thread too (cumulative.kernel_threads) and these
# cells do not read the count. fscan.cummax end to end (route forced) against torch's op,
# 1 thread, thread CPU time, medians, December 2026 (scripts/cumulative_rows.py):
# * forward float32 rows under WALK_FROM steps (the chain tiles): from 2**17 elements 0.45-
#   0.75x ((8192, 16) 0.55, (2048, 64) 0.60, (65536, 16) 0.45-0.73, (2**20 / 96, 96) 0.55-
#   0.74; (262144 / n, n) 0.46-0.62), at 2**16 0.91-1.30, at 2**15 1.04-1.7 (the call's fixed
#   cost). From 128 steps (walked alone) 0.83-0.97x in a rerun of December 6 (thread CPU,
#   1 thread, 2 rounds, load ~1: (1024, 128) 0.96-0.97, (512, 256) 0.89-0.90, (1024, 256)
#   0.86-0.88, (4096, 256) 0.89, (256, 1024) 0.83), and over one lane 0.83-0.91 (2**17,
#   2**18, 2**20); at 2**15 (128, 256) 1.02-1.07. An earlier run read "about even (0.86-
#   1.02, one run 1.33)" and kept torch's; the exclusive drop-ins tip it: on torch's op they
#   pay a strided fill of the first step (values and indices) and run 1.03-1.17x the
#   inclusive call, on the kernel's exclusive variant 0.84-1.00x (same runs). So the kernel
#   takes forward float32 from 2**17 elements at any row length (_extremum_forward). Walked
#   from 128 steps, other dtypes forward: float64 0.99-1.01x, int64 1.01-1.21, int32
#   1.16-1.51, bfloat16 1.72-1.92 (converted each step): torch's. Under 128 steps other
#   dtypes are not tiled: float64 1.38-1.50x, bfloat16 1.9-2.4x, int32/int64 2.3-3.8x at 16-64
#   steps: torch's. Lanes that are not innermost (inner 2 or 4: the chains strided) 1.1-1.85x
#   forward (torch's); reversed 0.07-0.99x.
# * reversed (torch's op flips, scans, flips: its time swings 2-10x with whether its copies
#   fault fresh pages): float32 0.35-0.80x at any length from 2**15 elements; other dtypes
#   from WALK_FROM steps 0.05-0.85x (int8 (1024, 128) 1.02; float64, int32/int64, bfloat16,
#   float16, bool, int8, uint8), below it up to 1.7x (8 steps; at 64: 0.76-1.39).
EXTREMUM_FORWARD_MIN_NUMEL = 2**17  # forward float32 cummax/cummin: innermost rows, one lane
LANE_PATH_INNER = 8  # the kernel's lane path needs this many lanes after dim
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
# ... unless its lanes lie side by side (the lane dim before dim at stride 1, this many
# lanes or more: x.t() of contiguous memory): the kernel's tiles then copy rows in and
# transpose out (float32; 1 thread, scanning dim 1 of (S, M).t(), S = 4096 ... 16):
# cumsum 0.47-0.83x torch's op, cummax 0.61-0.85x (torch's 1.5-4.7 ms, its walk jumping
# S elements a step).
ROW_TILE_MIN_LANES = 64
_FAR_STRIDE_OPS = (torch.cumsum, torch.cumprod)  # innermost, forward, >= KERNEL_MIN_STRIDE
# Forward over a single lane (and < LANE_PATH_INNER elements after dim), the kernel's
# minimum size per op; the others stay torch's there.
_ONE_LANE_KERNEL_FROM = {
    torch.cumsum: KERNEL_MIN_NUMEL_ONE_LANE,
    torch.cumprod: KERNEL_MIN_NUMEL_ONE_LANE,
    torch.logcumsumexp: KERNEL_MIN_NUMEL,
}
NATIVE_BELOW = min(MIN_NUMEL, KERNEL_MIN_NUMEL)  # every op is torch's below this size
_NATIVE = (False, False)  # route's answer for torch's op
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SUMS = (torch.cumsum, torch.cumprod)  # torch's op takes dtype=
EXTREMA = {torch.cummax: torch.return_types.cummax, torch.cummin: torch.return_types.cummin}
_is_compiling = torch.compiler.is_compiling  # bound once: Dynamo folds it by identity


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


def _cells(
    op: Any, x: torch.Tensor, dim: int, reverse: bool, threads: int | None = None
) -> tuple[bool, bool]:
    """:func:`route` outside tracing (on ``threads`` threads; None: torch's count now).
    The tensor's facts are read once, fewest first for the calls torch's op serves: each
    read costs about 1-3 µs on a cache cold from the op before. (``is_cpu``, not
    ``device.type``: making a torch.device slowed the op after it by 2-3%.)"""
    numel = x.numel()
    if numel < NATIVE_BELOW or not x.is_cpu:
        return _NATIVE
    stride, n = x.stride(dim), None
    if numel < KERNEL_MIN_NUMEL or (x.requires_grad and torch.is_grad_enabled()):
        kernel = False
    elif x.is_contiguous():  # `stride` elements after dim
        if stride >= LANE_PATH_INNER:
            kernel = True  # the lane path
        elif (n := x.size(dim)) != numel:  # several lanes: torch's threads split them
            # logcumsumexp: compute-bound, the kernel's math wins; cummax/cummin: torch's
            # walk is serial; on one thread, long rows
            kernel = op is torch.logcumsumexp or _rows(op, x, n, stride, reverse, threads)
        else:  # one lane: torch's walk is serial, and reversed it flips (copies) twice
            large = numel >= _ONE_LANE_KERNEL_FROM.get(op, math.inf) or (
                op in EXTREMA and _extremum_forward(x)
            )
            kernel = reverse or (large and (op not in SUMS or x.dtype in CHAIN_SUM_DTYPES))
    else:
        shape = x.shape
        n = shape[dim]
        # The lane path, read in place; or logcumsumexp, compute-bound: the kernel's
        # vectorised math wins on any layout.
        if math.prod(shape[dim:]) >= LANE_PATH_INNER * n or op is torch.logcumsumexp:
            kernel = True
        else:  # torch copies to flip; a far-strided walk lands every step on a new page
            far = n != numel and stride >= KERNEL_MIN_STRIDE and op in _FAR_STRIDE_OPS
            d = dim % x.ndim
            rows = op in _ROW_TILE_OPS and _row_tiles(x, d)
            kernel = (reverse or far or rows) and reads_in_place(x, d)  # else a copy
    parallel = stride >= MIN_STRIDE and _parallel_wins(
        op, x.size(dim) if n is None else n, stride, numel, x.element_size()
    )
    if kernel or parallel:
        kernel_bar, parallel_bar = dtype_refusals(op, x.dtype)
        return kernel and kernel_bar is None, parallel and parallel_bar is None
    return _NATIVE


_ONE_THREAD_OPS = (torch.cumsum, torch.cumprod)  # rows on one thread: the kernel wins
_ROW_TILE_OPS = (*SUMS, *EXTREMA)


def _row_tiles(x: torch.Tensor, dim: int) -> bool:
    """Whether the kernel tiles a scan over the innermost ``dim`` of a view whose lanes lie
    side by side (the lane dim before ``dim`` at stride 1, ``ROW_TILE_MIN_LANES`` of them or
    more: ``x.t()`` of contiguous memory, say), float32: its tiles copy rows of the input
    (``tile_rows_fit`` in csrc/forward_chains.h) where torch's op walks each lane across
    pages. See ``ROW_TILE_MIN_LANES``."""
    if x.dtype != torch.float32:
        return False
    shape, stride = x.shape, x.stride()
    if math.prod(shape[dim + 1 :]) != 1:
        return False
    for d in range(dim - 1, -1, -1):
        if shape[d] != 1:
            return stride[d] == 1 and shape[d] >= ROW_TILE_MIN_LANES
    return False


def _extremum_forward(x: torch.Tensor) -> bool:
    """Whether the kernel takes forward cummax/cummin over contiguous lanes along the
    innermost dim, or over one lane (see ``EXTREMUM_FORWARD_MIN_NUMEL``)."""
    return x.dtype == torch.float32 and x.numel() >= EXTREMUM_FORWARD_MIN_NUMEL


def _rows(
    op: Any, x: torch.Tensor, n: int, stride: int, reverse: bool, threads: int | None
) -> bool:
    """The kernel's cells over several contiguous lanes (``n`` steps each, ``stride``
    apart) besides logcumsumexp's: cummax/cummin's on any thread count (see
    ``EXTREMUM_FORWARD_MIN_NUMEL``), and on one thread (``threads``, None: torch's count
    now) rows of at least ``ONE_THREAD_MIN_LENGTH`` steps (``ONE_THREAD_MIN_LENGTHS`` for
    float32 and reversed float64), cumsum and cumprod (forward in ``CHAIN_SUM_DTYPES``
    only)."""
    if op in EXTREMA:
        if reverse:
            return n >= WALK_FROM or x.dtype == torch.float32
        return stride == 1 and _extremum_forward(x)
    shortest = ONE_THREAD_MIN_LENGTHS.get((x.dtype, bool(reverse)), ONE_THREAD_MIN_LENGTH)
    if n < shortest or op not in _ONE_THREAD_OPS:
        return False
    if not reverse and x.dtype not in CHAIN_SUM_DTYPES:
        return False
    return (torch.get_num_threads() if threads is None else threads) == 1


def threads_decide(op: Any, x: torch.Tensor, dim: int, reverse: bool) -> bool:
    """Whether the thread count keeps the kernel from this call: :func:`route` picks it on
    one thread and not on this many (``fscan.explain`` and the log say so)."""
    if _is_compiling() or torch.get_num_threads() == 1:
        return False
    return _cells(op, x, dim, reverse, 1)[0] and not _cells(op, x, dim, reverse)[0]


def _parallel_wins(op: Any, n: int, stride: int, numel: int, itemsize: int) -> bool:
    """The blocked scan's cells of the table (see the comments above ``MIN_STRIDE``)."""
    if stride < MIN_STRIDE or n < MIN_LENGTH or numel < MIN_NUMEL:
        return False
    if op is torch.logcumsumexp:
        return True
    if op is torch.cumsum and stride < CUMSUM_MIN_STRIDE:
        return False
    return n * stride * itemsize >= SPAN_BYTES


def dtype_refusals(op: Any, dtype: torch.dtype) -> tuple[str | None, str | None]:
    """Why ``dtype`` keeps the kernel and the blocked scan from ``op`` whatever the layout
    (None where it does not)."""
    if op is torch.logcumsumexp and dtype not in FLOATS:
        # complex: the imaginary part of a complex log is defined up to multiples of 2 pi,
        # and which one torch returns depends on its order of combination
        why = f"{dtype} runs on torch's op"
        return why, why
    if op in EXTREMA and dtype.is_complex:
        return "complex inputs run on torch's op", "complex inputs run on torch's op"
    if dtype == torch.bool and op in SUMS:  # dtype=torch.bool asked
        return None, "torch's op takes this dtype"
    return None, None


def torch_serves(op: Any, x: torch.Tensor, dim: int, reverse: bool = False) -> bool:
    """Whether the table picks torch's op for a call on ``x`` outside tracing (also where
    it picks the kernel but none can run)."""
    cells = _cells(op, x, dim, reverse)
    if cells is not _NATIVE:  # the common answer needs no more reads
        kernel, parallel = cells
        if parallel or (kernel and kernel_possible()):
            return False
    return True
