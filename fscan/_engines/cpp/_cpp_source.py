"""C++ source of the scan kernels: fixed C++ files around a translated combine (or its VJP).

The generated part is small: structs holding one element's values (``Vals``),
the leaves (``In``/``Out``: strided pointers), the broadcast inputs (``Par``)
and scratch buffers (``Buf``), with loads, stores (:mod:`._cpp_structs`) and
``combine``. The algorithms are fixed C++ written once against those names, in
files shipped with the package (``fscan/_engines/cpp/csrc``): ``prelude.h`` (ops as
torch computes them, strided pointers), ``tuning.h`` (the constants),
``forward.h`` (with ``forward_lanes.h`` and ``forward_chains.h``, its two paths,
``forward_prefix.h``, the chain path's prefix chains, and ``chunk_totals.h``, its chunks'
totals for a sum or logaddexp) and
``backward.h`` (the scans); each kernel is a template
(``forward.cpp.in``, ``backward.cpp.in``, ``step.cpp.in``, with ``combine.cpp.in``)
whose ``${name}`` holes this module fills. The files' text is part of the source
that Inductor's cache is keyed by, so a change to them builds every kernel again.

The kernel works on the ``(outer, T, inner)`` view of the leaves (any ``dim``). The inputs are
read through strides passed at run time (``sa, sb, st, si`` per input, with
the outer index split in two dims of ``nb`` lanes in the second: see
:func:`fscan._engines.cpp.cpu_kernel.strided_view`), so transposes, step slices,
permutations and stride-0 broadcasts need no copy. The outputs are written through
runtime strides of the same form (fresh dense outputs, or a caller's ``out=``
memory: narrowed, step-sliced or transposed views).
``reverse``, the strides and the thread count are runtime arguments, so one
compiled kernel serves every shape and layout.

* Lane path (``inner >= 8``): columns (outer index, tile of up to 1024
  lanes) run in parallel with OpenMP; each walks T sequentially with vector
  loops over its lanes, its running values in a local buffer of the compute
  type. Inputs whose inner stride is not 1 are gathered a row at a time into
  an L1 row buffer (a stride-0 row: filled with its value), so the loops over
  lanes stay dense vector loops in every layout; the kernel's gather variant
  does that (see ``scan`` in csrc/forward.h), the ordinary kernel's rows are
  all dense. A column exactly ``LANE_BLOCK`` lanes wide (16) goes 8 rows at a
  time with its running values in registers instead (``narrow_rows``).
* Chain path (``inner < 8``: 1-D, or a scan over the last dim; or inputs laid
  out along T, such as a transpose, whose T stride is below their inner
  stride): each lane is a chain. float32 leaves whose steps are dense (AVX-512 or
  AVX2) go 16 chains side by side on AVX-512, 8 on AVX2 (twice that for an expensive
  combine), as the lanes of vector loops: 16 steps of each are transposed into a tile
  in registers, scanned with each
  chain's running value in a register, and transposed back (``tile_chains``; the
  steps after the last whole tile make a partial tile, masked). ``torch.maximum`` /
  ``torch.minimum`` of one float32 leaf (AVX2) go a chain at a time instead, 8 steps
  to a vector scanned in registers, no transposes (``prefix_chain`` in
  ``forward_prefix.h``; see :func:`._cpp_tiles.prefix_op`). Other
  leaves: 8 chains run interleaved (instruction-level parallelism), each walking its
  steps (long ones 16 steps apart, off one cache set); but cummax/cummin's pairs (position
  leaves) walk chains of :data:`WALK_FROM` steps or more one at a time, in memory order.
* Either path splits T into chunks when there are too few columns or chains
  for the threads (and, on the chain path, for the 8-way interleave):
  reduce-then-scan (chunk totals, a short scan of the totals, then each chunk
  scanned from its carry-in).
"""

from __future__ import annotations

import functools
import string
from collections.abc import Sequence
from importlib import resources

import torch

from ..._knowledge.store import on_clear
from ._cpp_mvec import mvec_declarations
from ._cpp_ops import STORAGE, Program, compute_ctype
from ._cpp_structs import (
    STRIDES,
    backward_structs,
    leaf_structs,
    param_ctype,
    param_dtype,
)
from ._cpp_tiles import (
    chunk_totals,
    extremum,
    float32_sum,
    prefix_op,
    prefix_structs,
    tile_structs,
    tiled,
)

__all__ = [
    "backward_argtypes",
    "backward_source",
    "compiles_exclusive",
    "csrc",
    "forward_argtypes",
    "forward_source",
    "param_dtype",
    "reduce_argtypes",
    "reduce_source",
    "step_argtypes",
    "step_source",
    "suspect_check",
]


@functools.cache
def csrc(name: str) -> str:
    """The text of the package's C++ file ``csrc/<name>`` (read once per process).

    Example:
        >>> "static constexpr int64_t TILE" in csrc("tuning.h")
        True
    """
    return resources.files(__package__).joinpath("csrc", name).read_text(encoding="utf-8")


# Read again after fscan.clear_caches(): an edited file then reaches the next kernels built.
on_clear(csrc.cache_clear)


def _fill(template: str, **holes: str) -> str:
    """The template file ``csrc/<template>`` with its ``${name}`` holes filled (a hole
    left unfilled is a KeyError, a stray ``$`` a ValueError: no silent gaps)."""
    return string.Template(csrc(template)).substitute(holes)


def _kernel(template: str, **holes: str) -> str:
    """A whole kernel: every one starts with the prelude, logaddexp and glibc's vector math."""
    prelude = csrc("prelude.h") + csrc("logaddexp.h")
    return _fill(template, prelude=prelude, mvec=mvec_declarations(), **holes)


def _signature(
    dtypes: Sequence[torch.dtype], program: Program, extra: Sequence[str], positions: Sequence[int]
) -> list[str]:
    st = [STORAGE[d] for d in dtypes]
    args = [f"const {c}* x{k}" for k, c in enumerate(st) if k not in positions]
    args += extra
    args += _param_args(program)
    return args


def _param_args(program: Program) -> list[str]:
    return [f"const {param_ctype(p.dtype)}* p{j}" for j, p in enumerate(program.params)]


def _param_names(program: Program) -> str:
    return ", ".join(f"p{j}" for j in range(len(program.params)))


def _stride_params(names: Sequence[str]) -> str:
    """``int64_t nb`` and the strides of each input in ``names``, as C parameters."""
    return ", int64_t nb" + "".join(f", int64_t {n}_{s}" for n in names for s in STRIDES)


def _strided_init(names: Sequence[str]) -> str:
    return ", ".join("{" + ", ".join([n] + [f"{n}_{s}" for s in STRIDES]) + "}" for n in names)


def _dense_init(names: Sequence[str]) -> str:
    return ", ".join(f"dense({n}, nb, T, inner)" for n in names)


def _lines(lines: Sequence[str]) -> str:
    """``lines`` as indented lines of a function body."""
    return "".join(f"  {line}\n" for line in lines)


def _combine_function(compute: Sequence[str], program: Program) -> str:
    """``combine(l, r, p, e)``: the translated body over one element's ``Vals``."""
    R = range(len(compute))
    return _fill(
        "combine.cpp.in",
        operands=_lines([f"const {compute[k]} l{k} = l.v{k};" for k in R])
        + _lines([f"const {compute[k]} r{k} = r.v{k};" for k in R]),
        results=_lines([f"{compute[k]} o{k};" for k in R]),
        body=_lines(program.body.splitlines()),
        outputs=_lines([f"o.v{k} = o{k};" for k in R]),
        ranged="true" if "fscan_range_" in program.body else "false",
    )


def forward_argtypes(
    dtypes: Sequence[torch.dtype],
    program: Program,
    positions: Sequence[int] = (),
    dropped: Sequence[int] = (),
    tail: bool = True,
) -> list[str]:
    """C types of the forward kernel's arguments (for the Python binding); without
    ``tail``, those up to the strides (no heads, no first position: the part other
    kernels built from the forward's translation share)."""
    st = [STORAGE[d] for d in dtypes]
    types = [f"const {c}*" for k, c in enumerate(st) if k not in positions]
    types += [f"{c}*" for k, c in enumerate(st) if k not in dropped]
    types += [f"const {param_ctype(p.dtype)}*" for p in program.params]
    n_read = len(dtypes) - len(set(positions))
    n_kept = len(dtypes) - len(set(dropped))
    n_tail = n_read + bool(positions) if tail else 0  # heads, then pos0 with position leaves
    return types + ["int64_t"] * (5 + 1 + len(STRIDES) * (n_read + n_kept) + n_tail)


def forward_source(
    dtypes: Sequence[torch.dtype],
    program: Program,
    positions: Sequence[int] = (),
    dropped: Sequence[int] = (),
    exclusive: bool = False,
    gather: bool = False,
) -> str:
    """The complete forward kernel:
    ``kernel(x.., y.., p.., outer, T, inner, rev, threads, nb, x strides.., y strides..,
    heads.. [, pos0])``.

    The inputs ``x`` are read and the outputs ``y`` written through their strides
    (``sa, sb, st, si`` each, of the ``(outer // nb, nb, T, inner)`` view: see Ptr;
    outputs must not overlap each other or the inputs: the caller checks). The
    leaves in ``positions`` have no input ``x``: each element's value is its index
    along the scan dim (as for the indices of ``cummax``) plus ``pos0``, the last
    argument of a kernel with position leaves (a view that starts ``pos0`` steps into a
    larger input gets positions in that input: a runtime argument, so one compiled
    kernel serves every start). The leaves in ``dropped``
    have no output ``y``: they are computed (the kept ones may depend on them) but
    never stored. ``heads``: per input, the address of one element (contiguous, in the
    leaf's dtype) that replaces the scan's first element in scan order (the last for
    ``rev``), or 0 for none (all or none): a carry-in folded into that element, read
    without copying the leaves. ``exclusive``: the exclusive scan's variant instead (see
    ``scan`` in csrc/forward.h; only where :func:`compiles_exclusive`, else ValueError):
    the start value at the heads' first element, every lane's. ``gather``: the gather
    variant, the lane path over rows of other inner strides than 1 alone, for the calls
    :func:`~._kernel_layout.gathers` names (see ``scan`` in csrc/forward.h); without it
    the kernel takes every other call."""
    if exclusive and not compiles_exclusive(len(dtypes) - len(set(positions)), program):
        raise ValueError("forward_source: only one read leaf and no params compile exclusive")
    compute = [compute_ctype(d, program.wide) for d in dtypes]
    R = range(len(dtypes))
    st = [STORAGE[d] for d in dtypes]
    kept = [k for k in R if k not in dropped]
    read_idx = [k for k in R if k not in positions]
    read = [f"x{k}" for k in read_idx]
    written = [f"y{k}" for k in kept]
    heads = [f"reinterpret_cast<const {st[k]}*>(h{k}), " for k in read_idx]
    return _kernel(
        "forward.cpp.in",
        structs=leaf_structs(dtypes, compute, program, positions, dropped),
        combine=_combine_function(compute, program),
        suspect=suspect_check(dtypes, kept),
        tuning=csrc("tuning.h"),
        tiles=tile_structs(
            read_idx if tiled(st, positions, with_positions=True) else None,
            kept,
            program.expensive,
            wide=[k for k in kept if k in positions],
        )
        + f"\nstatic constexpr int64_t WALK_FROM = {WALK_FROM if positions else 'INT64_MAX'};\n"
        # cummax's / cummin's pair, both outputs kept: its lone chains walk by extremum.h.
        + f"static constexpr int EXTREMUM = {0 if dropped else extremum(program, positions)};\n"
        + prefix_structs(prefix_op(program, st, positions, dropped))
        # How the chunked chain path takes its chunks' totals (forward_chains.h).
        + f"static constexpr int CHUNK_TOTALS = {chunk_totals(program, st)};\n",
        exclusive="true" if exclusive else "false",
        gather="true" if gather else "false",
        forward=csrc("forward_lanes.h")
        + csrc("forward_prefix.h")
        + csrc("chain_tiles.h")
        + csrc("extremum.h")
        + csrc("chunk_totals.h")
        + csrc("forward_chains.h")
        + csrc("forward.h"),
        arguments=", ".join(
            _signature(dtypes, program, [f"{st[k]}* y{k}" for k in kept], positions)
        ),
        strides=_stride_params(read + written),
        heads="".join(f", int64_t h{k}" for k in read_idx) + ", int64_t pos0" * bool(positions),
        x=_strided_init(read) + ", pos0" * bool(positions),
        y=_strided_init(written),
        params=_param_names(program),
        head_init="".join(heads) + (f"h{read_idx[0]} != 0" if read_idx else "false"),
    )


# The chain length from which a kernel with position leaves (cummax/cummin) walks its chains
# one at a time in memory order (a reversed scan's lanes from the last: one stream through
# memory), instead of tiles of 16 chains (see chain_path and chain_group in
# csrc/forward_chains.h). A tile's 16 chains are 48 streams (values in, values and int64
# indices out), which the hardware's prefetch does not follow; a lone walk has a set-up
# per chain, which short chains do not repay. cummax over float32, the kernel alone,
# 1 thread, thread CPU time (load 3-4), walked / tiled: (4096, 256) dim 1 0.47-0.74 in
# alternating processes, warm and evicted caches; (1048576,) 0.40-0.55 (one pass, where
# the tiles take two); over 2**20 elements, rows of 128 steps 1.3-2.3 ms walked against
# 1.5-2.3 tiled, of 64 1.9-2.3 against 2.1-2.8, of 32 2.7-2.9 against 2.0-2.9; (1024, 8,
# 64) dim 2 (in cache) 0.80-1.20, (16384, 16) dim 1 1.25-2.56.
WALK_FROM = 128


def compiles_exclusive(read_leaves: int, program: Program) -> bool:
    """Whether a forward kernel may be built as the exclusive scan's variant
    (``EXCLUSIVE_MODE``, see ``scan`` in csrc/forward.h): the exclusive drop-ins' kernels,
    one read leaf (and cummax/cummin's position leaf) and no params."""
    return read_leaves == 1 and not program.params


def suspect_check(dtypes: Sequence[torch.dtype], kept: Sequence[int]) -> str:
    """The body of ``suspect(l, r, o)`` (see csrc/forward.cpp.in): a composed carry whose
    kept float outputs came out NaN from non-NaN operands, or infinite from finite ones."""
    checks = [
        f"(std::isnan(o.v{k}) && !std::isnan(l.v{k}) && !std::isnan(r.v{k})) || "
        f"(std::isinf(o.v{k}) && std::isfinite(l.v{k}) && std::isfinite(r.v{k}))"
        for k in kept
        if dtypes[k].is_floating_point
    ]
    return " || ".join(checks) or "false"


def backward_argtypes(
    dtypes: Sequence[torch.dtype],
    floats: Sequence[int],
    program: Program,
    pfloats: Sequence[int] = (),
    dead: Sequence[int] = (),
) -> list[str]:
    """C types of the backward kernel's arguments: x.., y.., g.. (of the float leaves not
    ``dead``), xbar.., pbar.., p.., sizes."""
    st = [STORAGE[d] for d in dtypes]
    read = [k for k in floats if k not in dead]
    types = [f"const {c}*" for c in st] * 2
    types += [f"const {st[k]}*" for k in read] + [f"{st[k]}*" for k in floats]
    types += ["double*"] * len(pfloats)
    types += [f"const {param_ctype(p.dtype)}*" for p in program.params]
    return types + ["int64_t"] * (5 + 1 + len(STRIDES) * (2 * len(dtypes) + len(read)))


def backward_source(
    dtypes: Sequence[torch.dtype],
    floats: Sequence[int],
    program: Program,
    pfloats: Sequence[int] = (),
    dead: Sequence[int] = (),
) -> str:
    """The backward kernel: one reverse pass per lane through the traced VJP of combine.

    ``kernel(x.., y.., g.., xbar.., pbar.., p.., outer, T, inner, rev, threads, nb,
    strides..)`` (the strides of x, y and g, each read through them as the forward's
    inputs; xbar dense): for
    ``y[s] = f(y[s-1], x[s])`` (s in scan order) the cotangents pull back as
    ``lam[T-1] = g[T-1]``, ``(lb, rb) = vjp_f(y[s-1], x[s]; lam[s])``,
    ``xbar[s] = rb``, ``lam[s-1] = g[s-1] + lb`` and ``xbar[0] = lam[0]``;
    ``lam`` lives in a per-column buffer; it sums cotangents along the whole scan, so
    float32 leaves keep it in double whatever the VJP computes in (one rounding per
    stored gradient, as the forward's accumulation). With ``pfloats`` (the float
    params, from :func:`translate_param_vjp`), the VJP's cotangents of those params
    are summed over the steps per element position, in double, into ``pbar``
    (one element each); each position is one lane, summed by one thread.
    ``dead``: float leaves whose cotangent is zero along the whole scan (see
    :func:`~._cpp_codegen.translate_vjp`, whose program leaves their left cotangents
    out): no ``g`` is passed for them, and their ``lam`` is the constant 0.
    """
    compute = [compute_ctype(d, program.wide) for d in dtypes]
    F = list(floats)
    R = range(len(dtypes))
    J = range(len(F))
    st = [STORAGE[d] for d in dtypes]
    # lam sums cotangents along the whole scan: float32 leaves keep it in double.
    lam_types = ["double" if dtypes[k] == torch.float32 else compute[k] for k in F]
    nf = len(F)
    live = [j for j, k in enumerate(F) if k not in dead]
    nl = len(live)
    args = [f"const {c}* x{k}" for k, c in enumerate(st)]
    args += [f"const {c}* y{k}" for k, c in enumerate(st)]
    args += [f"const {st[F[j]]}* g{j}" for j in live]
    args += [f"{st[k]}* b{j}" for j, k in enumerate(F)]
    args += [f"double* q{q}" for q in range(len(pfloats))]
    args += _param_args(program)
    strided = [f"x{k}" for k in R] + [f"y{k}" for k in R] + [f"g{j}" for j in live]
    structs = [
        leaf_structs(dtypes, compute, program),
        *backward_structs(dtypes, lam_types, F, pfloats, dead),
    ]
    # The program's outputs: the live left cotangents, the right ones, the params' sums.
    results = [f"{lam_types[j]}& o{i} = lb.v{j};" for i, j in enumerate(live)]
    results += [f"lb.v{j} = 0;" for j in J if j not in live]
    results += [f"{lam_types[j]}& o{nl + j} = rb.v{j};" for j in J]
    results += [f"double& o{nl + nf + q} = pb.v{q};" for q in range(len(pfloats))]
    return _kernel(
        "backward.cpp.in",
        structs="\n".join(structs),
        operands=_lines([f"const {compute[k]} l{k} = l.v{k};" for k in R])
        + _lines([f"const {compute[k]} r{k} = r.v{k};" for k in R])
        + _lines([f"const {lam_types[j]} c{k} = c.v{j};" for j, k in enumerate(F)]),
        results=_lines(results),
        body=_lines(program.body.splitlines()),
        tuning=csrc("tuning.h"),
        backward=csrc("backward.h"),
        arguments=", ".join(args),
        strides=_stride_params(strided),
        x=_strided_init([f"x{k}" for k in R]),
        y=_strided_init([f"y{k}" for k in R]),
        g=_strided_init([f"g{j}" for j in live]),
        b=_dense_init([f"b{j}" for j in J]),
        q=", ".join(f"q{q}" for q in range(len(pfloats))),
        params=_param_names(program),
    )


def step_argtypes(dtypes: Sequence[torch.dtype], program: Program) -> list[str]:
    """C types of the step kernel's arguments (see :func:`step_source`)."""
    st = [STORAGE[d] for d in dtypes]
    types = [f"const {c}*" for c in st] + [f"{c}*" for c in st]
    types += [f"const {param_ctype(p.dtype)}*" for p in program.params]
    return [*types, "int64_t", "int64_t"]


def step_source(dtypes: Sequence[torch.dtype], program: Program) -> str:
    """One application of the translated combine per element position, for checking the
    translation against eager torch: ``kernel(x.., y.., p.., n, vec)``.

    Each input ``x`` holds ``2 n`` contiguous elements, the left operands then the right
    ones; each output ``y``, ``n``. The loads, stores, compute types and ``combine`` are
    the forward kernel's (:func:`forward_source`); ``vec`` picks the vectorised lane
    loop of its lane path, else a scalar call per position, as on its chain path."""
    compute = [compute_ctype(d, program.wide) for d in dtypes]
    R = range(len(dtypes))
    st = [STORAGE[d] for d in dtypes]
    unit = lambda name: "{" + name + ", 0, 0, 0, 1}"
    args = [f"const {st[k]}* x{k}" for k in R] + [f"{st[k]}* y{k}" for k in R]
    return _kernel(
        "step.cpp.in",
        structs=leaf_structs(dtypes, compute, program),
        combine=_combine_function(compute, program),
        arguments=", ".join(args + _param_args(program)),
        lefts=", ".join(unit(f"x{k}") for k in R),
        rights=", ".join(unit(f"x{k} + n") for k in R),
        y=", ".join(unit(f"y{k}") for k in R),
        params=_param_names(program),
    )


def reduce_argtypes(dtypes: Sequence[torch.dtype], program: Program) -> list[str]:
    """C types of the reduce kernel's arguments: x.., z.., p.., sizes, x strides.."""
    st = [STORAGE[d] for d in dtypes]
    types = [f"const {c}*" for c in st] + [f"{c}*" for c in st]
    types += [f"const {param_ctype(p.dtype)}*" for p in program.params]
    return types + ["int64_t"] * (5 + 1 + len(STRIDES) * len(dtypes))


def reduce_source(dtypes: Sequence[torch.dtype], program: Program) -> str:
    """The complete reduce kernel (the forward's structs and combine around
    ``csrc/reduce_lanes.h`` and ``csrc/reduce.h``): ``kernel(x.., z.., p.., outer, T,
    inner, rev, threads, nb, x strides..)``. The inputs ``x`` are read through their
    strides; the totals ``z`` are contiguous ``(outer, inner)``, one element per lane,
    nothing else written."""
    compute = [compute_ctype(d, program.wide) for d in dtypes]
    st = [STORAGE[d] for d in dtypes]
    read = [f"x{k}" for k in range(len(dtypes))]
    return _kernel(
        "reduce.cpp.in",
        structs=leaf_structs(dtypes, compute, program, (), ()),
        combine=_combine_function(compute, program),
        suspect=suspect_check(dtypes, range(len(dtypes))),
        tuning=csrc("tuning.h"),
        # Two blocks of chains a tile (WAYS), whatever the combine's cost: max over dim 1
        # of (4096, 256) took 0.24-0.25 ns an element so, 0.31-0.34 with one (the affine
        # pair about the same: 0.91-1.07 against 0.86-1.13); see tile_total in csrc/reduce.h.
        tiles=tile_structs(list(range(len(dtypes))) if tiled(st, ()) else None, (), True),
        sum_f32=str(float32_sum(program, st)).lower(),
        reduce_sum=csrc("reduce_sum.h"),
        reduce=csrc("reduce_lanes.h") + csrc("reduce.h"),
        arguments=", ".join(
            _signature(dtypes, program, [f"{st[k]}* z{k}" for k in range(len(dtypes))], ())
        ),
        strides=_stride_params(read),
        x=_strided_init(read),
        z=", ".join(f"dense(z{k}, nb, 1, inner)" for k in range(len(dtypes))),
        params=_param_names(program),
    )
