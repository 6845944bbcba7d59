"""The generated segmented kernel: a ``reset=`` scan in one pass, the flags read in place.

:func:`kernel_segmented` serves a segmented scan (``reset=``) on CPU where the scan
kernel would serve the scan without flags (the same lookup, refusals and build policy:
the forward entry of the same key is built, or counted towards its build, first). Its
source is that entry's translation around ``csrc/segmented.h`` and
``csrc/segmented_chains.h`` (no second trace),
compiled as the forward is and kept beside it in the knowledge entry's kernel slots.
The flags are one more strided input: a 1-D mask, read with stride 0 along the other
dims, costs a byte a step, not a byte an element. It is a forward kernel only: callers use it where
no gradient is wanted (the (flag, value) pairs' scan has the backward). Until it is
ready, or where it cannot serve, None: the caller scans the pairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from ..._config import config
from ._cpp_ops import STORAGE, Program, compute_ctype
from ._cpp_source import (
    _combine_function,
    _kernel,
    _param_names,
    _signature,
    _stride_params,
    _strided_init,
    csrc,
    forward_argtypes,
    leaf_structs,
    suspect_check,
)
from ._cpp_tiles import extremum, tile_structs, tiled
from ._kernel_entry import BuildCall, is_ready, kernel_slots, slot_key
from ._kernel_layout import element_shape, read_leaves, strided_view
from ._kernel_registry import ready_derived, serving_lookup
from ._kernel_run import advise_outputs, fresh_outputs, kernel_params

__all__ = [
    "PreparedSegmentedRun",
    "kernel_segmented",
    "prepare_segmented",
    "run_segmented_prepared",
    "segmented_argtypes",
    "segmented_source",
]


def segmented_argtypes(
    dtypes: Sequence[torch.dtype], program: Program, positions: Sequence[int]
) -> list[str]:
    """C types of the segmented kernel's arguments: the forward's (no heads), then the
    flags and their four strides."""
    forward = forward_argtypes(dtypes, program, positions, tail=False)
    return [*forward, "const uint8_t*", *["int64_t"] * 4]


def chains_tiled(program: Program) -> bool:
    """Whether the segmented chain path tiles its chains (``SEG_TILED``, see
    csrc/segmented_tiles.h): for an expensive combine, whose math the tiles' vector loops
    run vectorised. Per element over (1048576,), a restart every 97 steps, 1 thread:
    logcumsumexp walked 14 ns, tiled 5.5 (the inclusive scan, tiled too: 7.5); cumsum and
    cumprod walked 0.4, tiled 0.95 (the tiles' scalar gathers cost more than the combine).
    Float32 tiles transpose in registers (``seg_transposed_chains``, as the forward's):
    logcumsumexp over (4096, 256) dim 1, restarts every 97 steps, 1 thread, thread CPU
    time against the inclusive call, medians of 3 alternating rounds (load 11): 1.24x
    (reversed 1.15x) with the gathering tiles, 1.01x (0.99x) transposed with a 1-D mask's
    flags read once a row; (1048576,) 0.98x -> 0.84x. Positions
    (cummax's pairs) are not tiled: the gathering tiles' vector loops stayed scalar on
    the (float, int64) pair and ran 4-8x the walked chains. Cumsum/cumprod stay walked:
    transposed tiles for them (the flags of a 1-D mask broadcast a row at a time) ran
    (4096, 256) dim 1 and (1048576,) with restarts at 2.3-3.1x the inclusive call, against
    0.7-1.8x walked (one A/B round, load 12: a direction, not a figure). Again, the kernel
    alone on warm outputs (load 10): cumsum (1048576,) tiled 1.46/1.70 ns an element
    (forward/reversed), walked 0.73; (4096, 256) dim 1 1.61/1.34 against 0.97. perf on
    the tiled (1048576,): the flags gathered into the tile's 32-bit rows (a byte load, a
    compare and a scattered store an element) 38% of the path outside seg_tile_scan, and
    seg_tile_scan (vectorised) a third of the kernel: by those shares, flags that cost
    nothing would leave it near 1.1, still above the walk (an estimate, not tried).
    Tried since, for a 1-D mask over whole lanes only (the flags read once a row, and a
    tile without a restart, 5 in 6, scanned without flags, as the forward's tile_scan,
    vectorised): cumsum over (4096, 256) dim 1, reset call / inclusive call (which tiles,
    0.5-0.6 ns an element) 1.54-1.87 tiled against 1.15-1.36 walked (alternating fresh
    processes, thread CPU time, load 6-8); the kernel alone, tiled 0.79-1.06 ns an
    element against 0.74-1.14 walked: no gain, not kept. perf (the kernel alone): 40% of
    the tiled path in the group's loop around tile_in (the rows' pointers built from the
    chains' and the tiles' loads), 6.5% in seg_tile_scan. Nor did the walk gain from
    chains sharing a 1-D mask's flags walked a segment at a time without the pick (the
    kernel alone 0.74-0.86 ns an element, as the walk with it): the flags are not what
    the walk of cumsum pays for.
    Why those tiles lost (s36, valgrind's instruction counts and standalone builds of the
    generated source, cumsum over (4096, 256) dim 1, the kernel alone into one output at
    16 offsets mod 4 KiB, thread CPU time, load 4-7): seg_transposed_chains was inlined
    into seg_chain_path's team lambda, where GCC spilled the transposes' registers (328
    vector stores to the stack against 64 in the forward's chain_path): 1.67x the
    forward's kernel, against 1.32-1.38x walked. A function of its own (noinline), each
    tile's restarts as bits read once a call (not a tile's 16 flags per group of chains),
    a tile without one scanned as the forward's tile_scan and one with one by a blend on
    a broadcast row bit: 1.16-1.18x (reversed 1.11-1.18x), walked 1.21-1.34x in the same
    runs. So an arithmetic combine of float32 leaves tiles where whole lanes read a 1-D
    mask (SEG_TILE_ROWS), and walks otherwise. What is left over the forward: the
    transposes' spills in the tile loop and the restarted tiles' blends (~4%): scanning
    those without the blend too ran 1.14x. The walked rows pay a little for the tiles'
    code beside them: over (1048576,) (chunks, walked), against the forward's kernel,
    cumsum 0.96/0.92x (fwd/rev) where it ran 0.93/0.87x before, cumprod reversed 0.86x
    (0.81x); 1.04-1.06x while the gathering tiles, which SEG_TILE_ROWS never reaches,
    were compiled in too.
    What was left was not the tile loop (s37, perf of the kernel alone, cumsum over
    (4096, 256) dim 1, 1 thread, AVX-512 machine): its tiles' transposes and scans took
    within 3% of the forward's samples (the forward's loop, inlined into chain_path, has
    more stack references, 92 against 24 in a tile's ~250-310 instructions), but the
    group's set-up 1.55x the forward's: seg_chain_path described each chain of a group
    apart (k / C, k % C) and seg_transposed_chains divided again for each chain's lane
    (o, i) and rebuilt its row pointers every tile, 2-3 64-bit divisions a chain where
    the forward's chain_path steps its items by increments. Whole lanes reading a 1-D
    mask now go to seg_row_tiles: one division a group, the lanes' bases stepped, every
    row at the same step (one offset for the tile), a tile without a restart scanned by
    the forward's own tile_scan (chain_tiles.h, shared). The kernel alone against the
    forward's (min of 60 rounds, load 4-6): cumsum 1.05-1.12 -> 0.95-1.0, cumprod
    0.98-1.10 -> 0.94-1.0; the drop-in calls as the bench's rows: see docs/performance.md.
    Whole lanes reading each their own flags as adjacent bytes (a mask of x's shape along
    its last dim) go there too (s48): each lane's 16 flags of a tile read by one load as
    bits, blended on each lane's bit (LANE_BITS), a tile without a restart scanned without
    them. Against the inclusive call in the same process, a restart about every 100 steps
    a lane, alternating processes, 1 thread, thread CPU: cumsum (4096, 256) dim 1
    1.75-2.81x walked -> 1.16-1.38x (one round 2.01x), reversed 1.29-2.46x -> 1.13-1.43x,
    cumprod 1.93-2.12x -> 1.27-1.43x, (1024, 8, 64) dim 2 1.62-1.82x -> 1.09-1.14x;
    logcumsumexp's whole
    lanes with such a mask too (SEG_TILED: each chain described apart before), (4096, 256)
    dim 1 1.32-1.67x -> 0.99-1.24x (docs/performance.md, "A mask of x's shape along the
    last dim, tiled").
    Chunks of one lane (a 1-D input, fewer lanes than a group of chains a thread), whose
    flags are adjacent bytes, tile too (s50): each chunk a chain of seg_transposed_chains,
    its carry the chunks' totals composed, a tile's flags read as bits (LANE_BITS, as
    seg_row_tiles; spread into the tile's 32-bit rows before). Cumsum over (1048576,),
    1 thread, thread CPU time against the inclusive call in the same process, medians of
    60, 4 rounds of alternating processes: with a random mask (a restart about every
    100 steps) walked 571-582 us (1.15-1.18x), tiled 504-530 (1.02-1.07x; with the flags
    spread 530-558); but with the bench's mask (a restart every 97 steps exactly) walked
    494-501 (1.00-1.02x), tiled 521-565 (1.03-1.12x), reversed 1.00 -> 1.06-1.08x. The
    walk is 15% faster on the regular mask because GCC compiles its pick as a branch
    (seg_chains: `cmpb $0x0,(flag)`, `jne` past the add, objdump of cumsum's segmented
    kernel), which the predictor learns on a mask of a fixed period and misses at each
    restart of a random one; the tiles blend, alike on both. Cumprod, 2 rounds: random
    1.00-1.09x -> 0.93-1.02x, regular 0.96-0.97x -> 0.94-1.00x. Kept: episodes do not end
    on a fixed period, and the worst case goes 1.18x -> 1.12x."""
    return program.expensive


def chains_interleaved(positions: Sequence[int]) -> int:
    """Chains the segmented chain path walks interleaved where it does not tile them
    (``SEG_G``, see csrc/segmented_walk.h): 3, so that an arithmetic combine's latency
    (add's, mul's) hides behind the other chains' while each chain's pointers (input,
    output, flags) stay in registers; 1 where a leaf is a position (cummax/cummin's
    (value, index) pairs), whose combine selects one operand and compiles to a branch, so
    a chain alone waits on no latency. With 8 (the forward's G), every step reloaded the
    chains' pointers from the stack. AVX2 machine, resets every 97 steps, 1 thread, ratio to
    the inclusive drop-in (medians of 3 alternating runs): cumsum/cumprod (1048576,)
    1.15/1.58 with 8 -> 0.93/1.01 with 4, (4096, 256) dim 1 0.99/1.14 -> 0.77/0.88; cummax
    over (4096, 256) dim 1: 8 chains 5.2 ms, 4 3.5, 2 3.5, 1 2.5 (torch.cummax without
    resets 2.1), over (1048576,) (one chain: one pass on one thread, no chunk totals):
    2.75 ms, 2.7, 2.1, 2.1 (torch 1.2). The one chain tests its flag before the combine
    (seg_chains): the drop-in over (1048576,) 2.21 -> 1.87 ms, over (4096, 256) dim 1
    2.33 -> 1.97 (its inclusive call, torch's: 1.12 and 1.45), medians of 3 alternating
    processes, thread CPU time, load 6. 3 against 4 (the kernel alone through ctypes,
    warm outputs, medians of 30 calls, thread CPU time, load 3-5), ns an element,
    forward/reversed: cumsum (1048576,) 0.73/0.73 -> 0.60/0.61, (4096, 256) dim 1
    0.77/0.77 -> 0.64/0.66; cumprod 0.73/0.70 -> 0.60/0.54, 0.73/0.76 -> 0.66/0.77 (2:
    0.69, 0.74-0.80 for cumsum). cumsum's flag tested before the combine, as for one
    chain, ran 0.96-1.03 (a branch the pick does without).
    Not measured with more than one leaf (the affine pair walked)."""
    return 1 if positions else 3


def wide_flags(dtypes: Sequence[torch.dtype], positions: Sequence[int]) -> bool:
    """Whether the lane path reads a flag per lane widened to int32 where it goes down a
    row in blocks (``WIDE_FLAGS``, see ``widened_lanes`` in csrc/segmented.h): where a lane moves
    16 bytes or more, read and written (a position leaf is written as int64, not read).
    The generated kernel alone over (4096, 256) dim 0, a flag per lane about 1 in 100, one
    process timing both in turns, reversed / forward, bytes then widened: cummax (float32
    value, int64 index: 16 bytes) 931-1001 / 582-584 us then 591-634 / 565-586; float64
    cumsum (16 bytes) 608-629 / 381-388 then 369-380 / 386-396; float32 cumsum (8 bytes)
    209 / 210, widened 273 / 267: its widening pass not paid back (those by a pass of
    their own a row; widened in registers a block at a time, as now, float32 cumsum's
    reversed rows still ran 1.17x its inclusive call against 1.05x on the bytes). Forward
    rows keep the bytes (one ascending loop over the row: widened, no gain above)."""
    size = lambda d: torch.empty((), dtype=d).element_size()
    read = sum(size(d) for k, d in enumerate(dtypes) if k not in positions)
    written = sum(8 if k in positions else size(d) for k, d in enumerate(dtypes))
    return read + written >= 16


def segmented_source(
    dtypes: Sequence[torch.dtype], program: Program, positions: Sequence[int]
) -> str:
    """The complete segmented kernel: ``kernel(x.., y.., p.., outer, T, inner, rev,
    threads, nb, strides.., r, r strides..)``, the forward's arguments (every output
    kept, no carry-in) and the flags ``r`` (uint8, read through their strides)."""
    compute = [compute_ctype(d, program.wide) for d in dtypes]
    st = [STORAGE[d] for d in dtypes]
    every = range(len(dtypes))
    read_idx = [k for k in every if k not in positions]
    read = [f"x{k}" for k in read_idx]
    # The chain tiles transpose in registers where the forward's would (float32, no
    # positions): every group of chains where they tile at all (chains_tiled), else groups
    # that share a 1-D mask's rows or read each their own as adjacent bytes (SEG_TILE_ROWS,
    # see chains_tiled).
    transposed = tiled(st, positions)
    written = [f"y{k}" for k in every]
    return _kernel(
        "segmented.cpp.in",
        structs=leaf_structs(dtypes, compute, program, positions, ()),
        combine=_combine_function(compute, program),
        suspect=suspect_check(dtypes, list(every)),
        tuning=csrc("tuning.h"),
        tiles=tile_structs(read_idx if transposed else None, list(every), program.expensive),
        segmented=csrc("segmented.h"),
        segmented_chains=csrc("chain_tiles.h")
        + csrc("extremum.h")
        + csrc("segmented_walk.h")
        + csrc("segmented_tiles.h")
        + csrc("segmented_chains.h"),
        seg_tiled="true" if chains_tiled(program) else "false",
        seg_tile_rows="true" if transposed else "false",
        seg_interleave=str(chains_interleaved(positions)),
        seg_extremum=str(extremum(program, positions)),
        wide_flags="true" if wide_flags(dtypes, positions) else "false",
        pick="".join(f"  o.v{k} = f ? a.v{k} : b.v{k};\n" for k in every),
        arguments=", ".join(
            _signature(dtypes, program, [f"{st[k]}* {y}" for k, y in enumerate(written)], positions)
        ),
        strides=_stride_params(read + written),
        x=_strided_init(read),
        y=_strided_init(written),
        params=_param_names(program),
    )


def kernel_segmented(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    flags: torch.Tensor,
    positions: tuple[int, ...] = (),
    threads: int | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor] | None:
    """The scan of ``leaves`` along ``dim`` restarting where ``flags`` (bool: the leaves'
    shape, an expanded mask read in place; or 1-D, one flag a step shared by every lane)
    is True, by the segmented kernel, into fresh contiguous outputs, or into ``out`` (one
    tensor per leaf, the position leaves' int64: contiguous, the leaves' shape, sharing
    memory with no input, the mask or each other, as a drop-in's ``out=`` checked by
    :func:`fscan._ops_out.direct_out`); or None (module doc). ``positions``: as for
    :func:`~.cpu_kernel.kernel_scan`. ``threads``: at most this many."""
    found = _ready_kernel(combine_fn, spec, leaves, dim, positions)
    if found is None:
        return None
    kernel, params = found
    shape = leaves[0].shape
    dim = dim % len(shape)
    outer, steps, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    # As run_kernel's (a few us a call, 5-10% of a 2**20-element scan on the lane path):
    # empty_like where it gives contiguous memory, huge pages asked only where they may
    # be granted (fresh outputs only: a caller's memory is left as it is), and contiguous
    # inputs' strides written down, not laid out.
    if out is not None:
        ys = list(out)
    else:
        ys = [
            torch.empty_like(x) if x.is_contiguous() else torch.empty(shape, dtype=x.dtype)
            for x in leaves
        ]
    if outer * steps * inner == 0:
        return ys
    if out is None:
        advise_outputs(ys, (outer, steps, inner, int(reverse)))
    read = read_leaves(leaves, positions)
    views, nb, strides = _read_layout(read, flags, shape, dim)
    dense = [nb * steps * inner, steps * inner, inner, 1] * len(ys)
    threads = torch.get_num_threads() if threads is None else min(threads, torch.get_num_threads())
    kernel(
        *views[:-1], *ys, *params, outer, steps, inner, int(reverse), threads,
        nb, *strides[:-4], *dense, views[-1], *strides[-4:],
    )  # fmt: skip
    return ys


class PreparedSegmentedRun(NamedTuple):
    """A READY segmented kernel, capturing nothing, with the arguments
    :func:`kernel_segmented` works out for one contiguous input leaf (and any position
    leaves) of one shape, ``dim``, ``reverse`` and a mask of one shape and strides: what
    the router's repeat route calls (:func:`run_segmented_prepared`)."""

    kernel: Callable[..., None]
    sizes: tuple[int, ...]  # outer, steps, inner, reverse
    tail: tuple[int, ...]  # nb, the input's strides, the outputs'
    flag_strides: tuple[int, ...]  # the mask's four, as the kernel reads it
    threads: int | None  # at most this many (None: torch.get_num_threads())
    positions: tuple[int, ...]  # position leaves: not read, their outputs int64


def prepare_segmented(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    reset: torch.Tensor,
    positions: tuple[int, ...] = (),
    threads: int | None = None,
) -> PreparedSegmentedRun | None:
    """The :class:`PreparedSegmentedRun` of the call :func:`kernel_segmented` just served
    (``dim`` non-negative; ``reset`` the checked mask, 1-D or expanded here as the caller
    expanded it), else None: a combine with parameters, a kernel not READY, an input not
    contiguous, an empty one, or a mask the layout would copy (its strides then say
    nothing of the next mask's memory)."""
    read = read_leaves(leaves, positions)
    shape = leaves[0].shape
    if len(read) != 1 or not read[0].is_contiguous() or read[0].numel() == 0:
        return None
    if any(x.shape != shape for x in leaves):
        return None
    found = _ready_kernel(combine_fn, spec, leaves, dim, positions)
    if found is None or found[1]:
        return None
    outer, steps, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    flags = reset if reset.ndim == 1 else reset.expand(shape)
    views, nb, strides = _read_layout(read, flags, shape, dim)
    if views[-1].data_ptr() != flags.data_ptr():  # the mask copied
        return None
    dense = (nb * steps * inner, steps * inner, inner, 1) * len(leaves)
    return PreparedSegmentedRun(
        found[0],
        (outer, steps, inner, int(reverse)),
        (nb, *strides[:-4], *dense),
        tuple(strides[-4:]),
        threads,
        positions,
    )


def run_segmented_prepared(
    run: PreparedSegmentedRun, x: torch.Tensor, reset: torch.Tensor
) -> list[torch.Tensor]:
    """``run`` on ``x`` and the mask ``reset`` (of the dtype, shape and layout, and the
    mask's shape and strides, it was prepared for; a full mask unexpanded: the kernel
    reads it through the stored strides): fresh outputs, the position leaves' int64."""
    ys = fresh_outputs([x], run.positions)
    advise_outputs(ys, run.sizes)
    threads = torch.get_num_threads()
    if run.threads is not None:
        threads = min(run.threads, threads)
    # The bool mask as it is: the binding takes any tensor's address (bool is a byte, 0 or
    # 1), and the uint8 view the checked path makes cost ~0.5 us of a ~6 us call.
    run.kernel(x, *ys, *run.sizes, threads, *run.tail, reset, *run.flag_strides)
    return ys


def _ready_kernel(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    positions: tuple[int, ...],
) -> tuple[Callable[..., None], list[torch.Tensor]] | None:
    """The READY segmented kernel of this call and its parameters, or None: not ready yet
    (its build is counted or started), refused, or captured tensors that do not broadcast."""
    if config.cpu_kernel == "off":
        return None
    lookup = serving_lookup(combine_fn, spec, leaves, None, None, gradients=False)
    if lookup is None:
        return None
    holder, aliases, captured = lookup
    element = element_shape(leaves, dim)
    key = ("segmented", slot_key(aliases, element, positions, (), False, False))
    kernel = kernel_slots(holder).get(key)
    if not is_ready(kernel):
        dtypes = tuple([x.dtype for x in leaves])
        call = BuildCall(combine_fn, spec, dtypes, element, captured, positions, ())
        written = lambda program: (
            segmented_source(dtypes, program, positions),
            tuple(segmented_argtypes(dtypes, program, positions)),
        )
        numel = leaves[0].numel()
        kernel = ready_derived(holder, aliases, call, numel, key, written, "the segmented kernel")
        if kernel is None:
            return None
    assert kernel.program is not None and kernel.kernel is not None
    params = kernel_params(kernel.program, captured, element) if kernel.program.params else []
    if params is None:  # captured tensors that do not broadcast: the caller decides
        return None
    return kernel.kernel, params


def _read_layout(
    read: Sequence[torch.Tensor], flags: torch.Tensor, shape: torch.Size, dim: int
) -> tuple[list[torch.Tensor], int, list[int]]:
    """The leaves read (of ``shape``, ``dim`` non-negative) and the flags (as uint8, last)
    as the kernel reads them, ``nb`` and their strides (:func:`~._kernel_layout.strided_view`)."""
    if flags.ndim == 1 and len(shape) > 1:
        # One flag a step: strides 0 across lanes, which fit any grouping of the leaves'
        # dims (expanding the mask and laying it out cost 5 us a call, 5% at 2**20).
        if all(x.is_contiguous() for x in read):
            steps, inner = shape[dim], math.prod(shape[dim + 1 :])
            views, nb, strides = list(read), 1, [steps * inner, 0, inner, 1] * len(read)
        else:
            views, nb, strides = strided_view(read, dim)
        views.append(flags.view(torch.uint8))
        return views, nb, [*strides, 0, 0, flags.stride(0), 0]
    return strided_view([*read, flags.view(torch.uint8)], dim)
