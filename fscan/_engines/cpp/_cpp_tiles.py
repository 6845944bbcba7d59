"""The chain path's tiles in a forward kernel's source (see tile_chains in csrc/forward_chains.h).

Where chains are tiled, TB steps of TW chains of each leaf are transposed in registers
into a tile and scanned as the lane path scans rows; :func:`tiled` says where (by the
leaves' storage), :func:`tile_structs` writes the tile types and their transposes for one
leaf layout (stubs where chains are walked instead), and how many vectors of TV chains a
tile holds (by the combine's cost). Where the combine has a vector form (:func:`prefix_op`),
chains take a third kind instead, a chain at a time by in-register prefix scans
(csrc/forward_prefix.h); :func:`prefix_structs` writes what it reads. cummax's and
cummin's combine is recognised by :func:`extremum`: their lone chains (and the segmented
kernel's) walk 16 steps a vector instead (csrc/extremum.h). A float32 sum is recognised by
:func:`float32_sum`: the reduce kernel sums its blocks in float32 (csrc/reduce_sum.h).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ._cpp_ops import Program

__all__ = [
    "chunk_totals",
    "extremum",
    "float32_sum",
    "prefix_op",
    "prefix_structs",
    "tile_structs",
    "tiled",
]


def tiled(storage: Sequence[str], positions: Sequence[int], with_positions: bool = False) -> bool:
    """Whether the chain path tiles its chains (see tile_chains in csrc/forward_chains.h): float32
    leaves, none of them positions. Per element over (4096, 256) dim 1, 1 thread: add, mul
    and max walked 8 chains interleaved in 0.38-0.47 ns, tiled 0.25-0.30 (once each
    chain's running value stayed in a register across a tile's steps); the affine pair
    walked 4.6, tiled 1.0; logaddexp walked 17 (expf and log1pf calls), tiled 1.8.
    ``with_positions``: for a kernel whose tiles compute position leaves (the forward's,
    where cummax/cummin's int64 indices are each step's position, written out of an int64
    tile), float32 read leaves and int64 position leaves."""
    if with_positions and positions:
        read = {s for k, s in enumerate(storage) if k not in positions}
        return read == {"float"} and all(storage[k] == "int64_t" for k in positions)
    return not positions and set(storage) == {"float"}


def tile_ways(expensive: bool) -> int:
    """Vectors of TV chains per tile (``WAYS``), scanned interleaved: 2 for an expensive
    combine, whose steps' latency a lone vector of chains waits on (logaddexp over (4096,
    256) dim 1: 2.6 ns an element with one, 1.8 with two), else 1 (add and max ran 1.5x
    slower with two: 32 chains a power of two apart share the L1 sets of their lines)."""
    return 2 if expensive else 1


def tile_structs(
    read: Sequence[int] | None,
    kept: Sequence[int],
    expensive: bool = False,
    wide: Sequence[int] = (),
) -> str:
    """The chain path's tiles (see tile_chains in csrc/forward_chains.h): ``InTile``/``OutTile``,
    TB steps of TW chains of each read/kept leaf (``WAYS`` blocks of TV chains, each its
    TB rows, see :func:`tile_ways`), transposed in and out by ``tile_in``/``tile_out``
    (``m``: the rows read and written, a bit each, fewer than TB in a partial tile);
    ``tile_base`` (a chain's first leaf's memory) and ``tile_ahead`` (``n`` lines from
    element ``d`` of every leaf asked of the caches: see ahead_lines in
    csrc/chain_tiles.h)
    (float32 leaves, no position leaves: ``read`` is None otherwise, and ``TILED`` false,
    with stubs). ``wide``: the kept leaves that are int64 (cummax/cummin's position leaves,
    computed in the tile scan: not read), whose out tiles hold int64 and transpose out by
    ``fscan_tile_out_i64``."""
    ways = tile_ways(expensive) if read is not None else 1
    # An expensive combine's chains are tiled in any layout (see chain_group).
    gathers = "true" if read is not None and expensive else "false"
    shape = [
        f"static constexpr int WAYS = {ways};",
        "static constexpr int TW = TV * WAYS;",
        f"static constexpr bool TILE_ANY = {gathers};",
    ]
    if read is None:
        return "\n".join(
            [
                *shape,
                "static constexpr bool TILED = false;",
                "struct InTile {}; struct OutTile {};",
                "static FSCAN_INLINE bool tileable(const In, const Out) { return false; }",
                "static FSCAN_INLINE bool tile_rows_fit(const In*, const Out*, const int64_t*) "
                "{ return false; }",
                "static FSCAN_INLINE void tile_in(const In*, const int64_t*, InTile&, unsigned) {}",
                "static FSCAN_INLINE void tile_out(const Out*, const int64_t*, const OutTile&, "
                "unsigned) {}",
                "static FSCAN_INLINE const float* tile_base(const In) { return nullptr; }",
                "template <bool W> static FSCAN_INLINE void tile_ahead(const In, const Out, "
                "int64_t, int64_t) {}",
                "static FSCAN_INLINE In tile_row(const In x, const InTile&, int64_t) { return x; }",
                "static FSCAN_INLINE Out tile_row(const Out y, OutTile&, int64_t) { return y; }",
            ]
        )
    xs, ys = [f"x{k}" for k in read], [f"y{k}" for k in kept]
    wides = {f"y{k}" for k in wide}
    ctype = lambda f: "int64_t" if f in wides else "float"
    tile = lambda name, fields: (
        f"struct {name} {{ "
        + " ".join(f"alignas(64) {ctype(f)} {f}[TB * TW];" for f in fields)
        + " };"
    )
    transpose_out = lambda f: "fscan_tile_out_i64" if f in wides else "fscan_tile_out"
    # An int64 row of a tile's 16 steps spans two cache lines.
    lines = lambda f: ["", " + 8"] if f in wides else [""]
    units = [f"x.{f}.st == 1" for f in xs] + [f"y.{f}.st == 1" for f in ys]
    return "\n".join(
        [
            *shape,
            "static constexpr bool TILED = FSCAN_TILES;",
            tile("InTile", xs),
            tile("OutTile", ys),
            "static FSCAN_INLINE bool tileable(const In x, const Out y) "
            "{ (void)x; (void)y; return " + " && ".join(units or ["true"]) + "; }",
            # A tile's chains side by side in memory (see tile_rows_fit): T stride not 1.
            "static FSCAN_INLINE bool tile_rows_fit(const In* x, const Out* y, const int64_t* t0) "
            "{ for (int g = 1; g < TW; ++g) { if (t0[g] != t0[0]"
            + "".join(
                f" || (x[0].{f}.st != 1 && x[g].{f}.p != x[0].{f}.p + g)"
                f" || x[g].{f}.st != x[0].{f}.st"
                for f in xs
            )
            + "".join(
                f" || (y[0].{f}.st != 1 && y[g].{f}.p != y[0].{f}.p + g)"
                f" || y[g].{f}.st != y[0].{f}.st"
                for f in ys
            )
            + ") return false; } return true; }",
            # Each vector of TV chains: transposed (steps dense), rows copied (side by
            # side, as tile_rows_fit checks), or (TILE_ANY) gathered an element at a time.
            "static FSCAN_INLINE void tile_in(const In* x, const int64_t* t, InTile& b, "
            "unsigned m) { (void)m; "
            + " ".join(
                f"for (int h = 0; h < TW; h += TV) {{ const float* s[TV]; "
                f"const int64_t st = x[h].{f}.st; if (st != 1) {{ "
                f"for (int g = 0; g < TV; ++g) s[g] = x[h + g].{f}.p + t[h + g] * st; "
                f"if (TILE_ANY && !fscan_side_by_side<TV>(s)) "
                f"fscan_gather_in<TV, TB>(s, st, b.{f} + h * TB, m); "
                f"else fscan_rows_in<TV, TB>(s[0], st, b.{f} + h * TB, m); continue; }} "
                f"for (int g = 0; g < TV; ++g) s[g] = x[h + g].{f}.p + t[h + g]; "
                f"fscan_tile_in(s, b.{f} + h * TB, m); }}"
                for f in xs
            )
            + " }",
            "static FSCAN_INLINE void tile_out(const Out* y, const int64_t* t, const OutTile& b, "
            "unsigned m) "
            "{ (void)m; "
            + " ".join(
                f"for (int h = 0; h < TW; h += TV) {{ {ctype(f)}* d[TV]; "
                f"const int64_t st = y[h].{f}.st; if (st != 1) {{ "
                f"for (int g = 0; g < TV; ++g) d[g] = y[h + g].{f}.p + t[h + g] * st; "
                f"if (TILE_ANY && !fscan_side_by_side<TV>(d)) "
                f"fscan_scatter_out<TV, TB>(b.{f} + h * TB, d, st, m); "
                f"else fscan_rows_out<TV, TB>(b.{f} + h * TB, d[0], st, m); continue; }} "
                f"for (int g = 0; g < TV; ++g) d[g] = y[h + g].{f}.p + t[h + g]; "
                f"{transpose_out(f)}(b.{f} + h * TB, d, m); }}"
                for f in ys
            )
            + " }",
            "static FSCAN_INLINE const float* tile_base(const In x) { return x." + xs[0] + ".p; }",
            "template <bool W> static FSCAN_INLINE void tile_ahead(const In x, const Out y, "
            "int64_t d, int64_t n) { for (int64_t k = 0; k < n; ++k) { "
            + " ".join(f"__builtin_prefetch(x.{f}.p + d + 16 * k, 0, 2);" for f in xs)
            + " if (W) { "
            + " ".join(
                f"if (y.{f}.st == 1) __builtin_prefetch(y.{f}.p + d + 16 * k{a}, 1, 2);"
                for f in ys
                for a in lines(f)
            )
            + " } } }",
            "static FSCAN_INLINE In tile_row(const In x, const InTile& b, int64_t j) { In r = x; "
            + " ".join(f"r.{f} = Ptr<const float>{{b.{f} + j * TV, 0, 0, 0, 1}};" for f in xs)
            + " return r; }",
            "static FSCAN_INLINE Out tile_row(const Out y, OutTile& b, int64_t j) { Out r = y; "
            + " ".join(f"r.{f} = Ptr<{ctype(f)}>{{b.{f} + j * TV, 0, 0, 0, 1}};" for f in ys)
            + " return r; }",
        ]
    )


# The body the translator writes for torch.maximum / torch.minimum of one float32 leaf.
_PREFIX_BODY = re.compile(
    r"const float v0 = static_cast<float>\(fscan_(max|min)\(static_cast<float>\(l0\), "
    r"static_cast<float>\(r0\)\)\);\no0 = static_cast<float>\(v0\);"
)
# The body the translator writes for the sum of one float32 leaf accumulated in double
# (torch.add, ``a + b``, ``b + a``).
_SUM_BODY = re.compile(
    r"const double v0 = static_cast<double>\(\(static_cast<double>\("
    r"(l0\) \+ static_cast<double>\(r0|r0\) \+ static_cast<double>\(l0)"
    r"\)\)\);\no0 = static_cast<double>\(v0\);"
)


def float32_sum(program: Program, storage: Sequence[str]) -> bool:
    """Whether the combine is the sum of one float32 leaf held in double (the reduce's
    ``SUM_F32``: csrc/reduce.h sums blocks of rows in float32 and widens each block's sum
    once; the forward's chunk totals summed in double: :func:`chunk_totals`). Float
    addition is commutative, so ``r0 + l0`` counts too."""
    return _one_float32_held_in_double(program, storage, _SUM_BODY)


def _one_float32_held_in_double(program: Program, storage: Sequence[str], body: re.Pattern) -> bool:
    """Whether the combine is ``body`` over one float32 leaf held in double, no params."""
    if list(storage) != ["float"] or not program.wide or program.params:
        return False
    return body.fullmatch(program.body) is not None


# The body the translator writes for logaddexp of one float32 leaf held in double
# (fscan.logcumsumexp's combine; either operand order).
_LOGADDEXP_BODY = re.compile(
    r"const double v0 = static_cast<double>\(fscan_logaddexp_f32\("
    r"(static_cast<double>\(l0\), static_cast<double>\(r0\)|"
    r"static_cast<double>\(r0\), static_cast<double>\(l0\))"
    r"\)\);\no0 = static_cast<double>\(v0\);"
)


def chunk_totals(program: Program, storage: Sequence[str]) -> int:
    """How the forward's chunked chain path takes its chunks' totals (``CHUNK_TOTALS``,
    chunk_totals in csrc/chunk_totals.h): 1, a sum in double (:func:`float32_sum`); 2,
    a logsumexp over the chunk's maximum (logaddexp of one float32 leaf held in double,
    commutative too); 0, by the tiles (a scan without writes)."""
    if float32_sum(program, storage):
        return 1
    return 2 if _one_float32_held_in_double(program, storage, _LOGADDEXP_BODY) else 0


# The vector forms csrc/forward_prefix.h has (its PREFIX values).
_PREFIX_OPS = {"max": 1, "min": 2}


def prefix_op(
    program: Program, storage: Sequence[str], positions: Sequence[int], dropped: Sequence[int]
) -> str | None:
    """The combine's vector form for the prefix chains (csrc/forward_prefix.h), or None:
    ``"max"``/``"min"`` where it is ``torch.maximum``/``torch.minimum`` of one float32 leaf
    (running value float32, exact: no double accumulation to keep), no position leaf.
    1 thread, AVX2, over (4096, 256) dim 1 max ran 1.7-2.1x a copy so, 3.4 tiled (4.6
    reversed). add, mul and the affine pair stay tiled: their running values are double
    (torch.cumsum's error), and add by a prefix scan of doubles (4 to a vector: twice the
    vectors, and a widening) ran 4.2-4.7x a copy in scripts/roofline.py's loop, against
    3.7 for the tiles' (see docs/performance.md, "Floors")."""
    if positions or dropped or list(storage) != ["float"] or program.wide or program.params:
        return None
    found = _PREFIX_BODY.fullmatch(program.body)
    return found.group(1) if found else None


def prefix_structs(op: str | None) -> str:
    """What csrc/forward_prefix.h reads for one leaf layout: ``PREFIX`` (0: no prefix
    chains), whether a chain's steps are dense in and out (``prefixable``), its addresses
    and its value as a float."""
    if op is None:
        return "\n".join(
            [
                "static constexpr int PREFIX = 0;",
                "static FSCAN_INLINE bool prefixable(const In, const Out) { return false; }",
                "static FSCAN_INLINE const float* prefix_in(const In) { return nullptr; }",
                "static FSCAN_INLINE float* prefix_out(const Out) { return nullptr; }",
                "static FSCAN_INLINE float prefix_get(const Vals&) { return 0; }",
                "static FSCAN_INLINE Vals prefix_put(float) { return Vals{}; }",
            ]
        )
    return "\n".join(
        [
            f"static constexpr int PREFIX = {_PREFIX_OPS[op]};  // {op}",
            "static FSCAN_INLINE bool prefixable(const In x, const Out y) "
            "{ return x.x0.st == 1 && y.y0.st == 1; }",
            "static FSCAN_INLINE const float* prefix_in(const In x) { return x.x0.p; }",
            "static FSCAN_INLINE float* prefix_out(const Out y) { return y.y0.p; }",
            "static FSCAN_INLINE float prefix_get(const Vals& v) { return v.v0; }",
            "static FSCAN_INLINE Vals prefix_put(float f) { Vals v; v.v0 = f; return v; }",
        ]
    )


# cummax's / cummin's combine (fscan._routing.cumulative's _take_max / _take_min) as the
# translator writes it for one compute type T: take the right operand where r0 >= l0 (<=)
# or r0 is NaN, for the value and its index alike. Float16/bfloat16 compare rounded
# values (fscan_round_*), which a select of loaded elements never changes: read through.
_EXTREMUM_BODY = re.compile(
    r"const bool (\w+) = static_cast<bool>\(\(static_cast<([\w:]+)>\(r0\) (>=|<=) "
    r"static_cast<\2>\(l0\)\)\);\n"
    r"const bool (\w+) = static_cast<bool>\(\(static_cast<\2>\(r0\) != static_cast<\2>\(r0\)\)\);\n"
    r"const bool (\w+) = static_cast<bool>\(\(static_cast<bool>\(\1\) \| "
    r"static_cast<bool>\(\4\)\)\);\n"
    r"const \2 (\w+) = static_cast<\2>\(\(static_cast<bool>\(\5\) \? static_cast<\2>\(r0\) : "
    r"static_cast<\2>\(l0\)\)\);\n"
    r"const int64_t (\w+) = static_cast<int64_t>\(\(static_cast<bool>\(\5\) \? "
    r"static_cast<int64_t>\(r1\) : static_cast<int64_t>\(l1\)\)\);\n"
    r"o0 = static_cast<\2>\(\6\);\n"
    r"o1 = static_cast<int64_t>\(\7\);\n?"
)


def extremum(program: Program, positions: Sequence[int]) -> int:
    """1 where ``program`` is cummax's combine of a (value, index) pair (the index leaf
    a position), -1 cummin's, else 0: ``EXTREMUM`` (the forward kernel) and
    ``SEG_EXTREMUM`` (the segmented one), which walk the pair without branches on the
    data (``extremum_step``, csrc/extremum.h). The drop-ins'
    ``reset=`` rows, a restart every 97 steps, 1 thread, thread CPU time (standalone loops
    of the walk, float32, (1048576,)): the combine's own branches 1.5-1.7 ns an element,
    mispredicted at each new maximum (~5 a segment of 97), without them 0.95-1.1, where
    torch's inclusive cummax runs ~1.0. More chains interleaved (2, 4, 8 chunks of a 1-D
    input, heads fixed up after) gained nothing on one (1.07-1.6): one chain is already
    bound by its instructions a step (11-13, two stores), not by the select's latency.
    Dense float32 chains go 16 steps a vector instead where AVX-512 is compiled in
    (``extremum_blocks``), in both kernels: (1048576,) with a restart every 97 steps 577 us
    standalone against the step walk's 860-900 and an inclusive branchy walk's 681-686
    (docs/performance.md)."""
    if tuple(positions) != (1,) or program.params:
        return 0
    lines = [line.strip() for line in program.body.strip().splitlines()]
    body = re.sub(r"fscan_round_\w+\((\w+)\)", r"\1", "\n".join(lines))
    found = _EXTREMUM_BODY.fullmatch(body)
    if found is None:
        return 0
    return 1 if found.group(3) == ">=" else -1
