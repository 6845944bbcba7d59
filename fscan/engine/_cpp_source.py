# ruff: noqa: E501  (C++ templates keep their own line lengths)
"""C++ source of the scan kernels, around a translated combine (or its VJP).

The generated part is small: structs holding one element's values (``Vals``),
the leaves (``In``/``Out``: strided pointers), the broadcast inputs (``Par``)
and scratch buffers (``Buf``), with loads, stores and ``combine``. The
algorithms are fixed C++ written once against those names. The kernel works
on the ``(outer, T, inner)`` view of the leaves (any ``dim``). The inputs are
read through strides passed at run time (``sa, sb, st, si`` per input, with
the outer index split in two dims of ``nb`` lanes in the second: see
:func:`fscan.engine.cpu_kernel.strided_view`), so transposes, step slices,
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
  lanes stay dense vector loops in every layout (contiguous leaves: one
  untaken branch per row and input).
* Chain path (``inner < 8``: 1-D, or a scan over the last dim; or inputs laid
  out along T, such as a transpose, whose T stride is below their inner
  stride): each lane is a chain; 8 chains run interleaved (instruction-level
  parallelism), each walking its steps.
* Either path splits T into chunks when there are too few columns or chains
  for the threads (and, on the chain path, for the 8-way interleave):
  reduce-then-scan (chunk totals, a short scan of the totals, then each chunk
  scanned from its carry-in).
"""

from __future__ import annotations

import platform
from collections.abc import Sequence

import torch

from ._cpp_codegen import STORAGE, Program, compute_ctype

__all__ = ["forward_argtypes", "forward_source", "mvec_declarations", "param_dtype"]

PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>
#include <omp.h>

#define FSCAN_INLINE __attribute__((always_inline)) inline

// The ops below as torch computes them (tests/test_cpu_kernel_ops.py checks each against
// eager torch on every dtype, special values included).
// torch.maximum/minimum: NaN wins from either side.
template <typename T> static FSCAN_INLINE T fscan_max(T a, T b) { if (a != a) return a; return a > b ? a : b; }
template <typename T> static FSCAN_INLINE T fscan_min(T a, T b) { if (a != a) return a; return a < b ? a : b; }
// torch.fmax/fmin: NaN loses; integers compare as themselves (std::fmax would go through
// double, which rounds int64 beyond 2**53).
template <typename T> static FSCAN_INLINE T fscan_fmax(T a, T b) { return fscan_max(a, b); }
template <typename T> static FSCAN_INLINE T fscan_fmin(T a, T b) { return fscan_min(a, b); }
static FSCAN_INLINE float fscan_fmax(float a, float b) { return std::fmax(a, b); }
static FSCAN_INLINE double fscan_fmax(double a, double b) { return std::fmax(a, b); }
static FSCAN_INLINE float fscan_fmin(float a, float b) { return std::fmin(a, b); }
static FSCAN_INLINE double fscan_fmin(double a, double b) { return std::fmin(a, b); }
// torch.clamp's bounds: x where it ties (clamp(-0.0, 0) is -0.0), NaN from x or the bound.
template <typename T> static FSCAN_INLINE T fscan_clamp_lo(T x, T lo) { if (lo != lo) return lo; return x < lo ? lo : x; }
template <typename T> static FSCAN_INLINE T fscan_clamp_hi(T x, T hi) { if (hi != hi) return hi; return x > hi ? hi : x; }
template <typename T> static FSCAN_INLINE T fscan_relu(T a) { return a < T(0) ? T(0) : a; }  // relu(-0.0) is -0.0
// torch.sign: 0 for NaN and for -0.0.
template <typename T> static FSCAN_INLINE T fscan_sign(T a) { return (T)((T(0) < a) - (a < T(0))); }
template <typename T> static FSCAN_INLINE T fscan_abs(T a) { return a < T(0) ? -a : a; }
// torch's integer pow: products that wrap; a negative exponent gives 1 / a truncated.
template <typename T> static FSCAN_INLINE T fscan_powi(T a, T b) {
  if (b < T(0)) return a == T(1) ? T(1) : (a == T(-1) ? ((-b) % 2 ? T(-1) : T(1)) : T(0));
  T r = 1;
  while (b) { if (b & 1) r = (T)(r * a); b = (T)(b / 2); a = (T)(a * a); }
  return r;
}
static FSCAN_INLINE bool fscan_abs(bool a) { return a; }
static FSCAN_INLINE float fscan_abs(float a) { return std::fabs(a); }
static FSCAN_INLINE double fscan_abs(double a) { return std::fabs(a); }
// f(i) for the lanes i in [0, w), vectorised. The lane paths walk rows of lanes; where
// they walk the rows backwards in memory (reverse scans, the backward pass), the lanes of
// a row go in descending blocks of B too (a cache line of the narrowest leaf, at least
// 16 lanes), so that memory is read in a descending stream: ascending rows read
// backwards ran 3x slower than forwards (the hardware prefetcher follows each row up,
// into the row already read); this way, 1.1x (float32: blocks of 16, 32 or 64 lanes
// alike; 128 lanes 2.3x again).
template <int64_t B, typename F> static FSCAN_INLINE void fscan_lanes(int64_t w, bool down, F&& f) {
  if (!down) {
#pragma GCC ivdep
    for (int64_t i = 0; i < w; ++i) f(i);
    return;
  }
  for (int64_t hi = w; hi > 0; hi -= B) {
    const int64_t lo = hi > B ? hi - B : 0;
#pragma GCC ivdep
    for (int64_t i = lo; i < hi; ++i) f(i);
  }
}
// A leaf in memory: its data and the strides (in elements) of the (outer, T, inner) view,
// outer split in two dims (o / nb, o % nb) so that a permuted (B, C, T) view of (B, T, C)
// data needs no copy. Inputs come with their own strides (views: transposes, step slices,
// stride-0 broadcasts); outputs too (fresh and dense, or a caller's views of its memory).
template <typename P> struct Ptr { P* p; int64_t sa, sb, st, si; };
// Where a lane (o, i) is at step t.
template <typename P> static FSCAN_INLINE Ptr<P> shift(Ptr<P> q, int64_t o, int64_t nb, int64_t t, int64_t i) {
  q.p += (nb == 1 ? o * q.sa : (o / nb) * q.sa + (o % nb) * q.sb) + t * q.st + i * q.si; return q; }
template <typename P> static FSCAN_INLINE Ptr<P> row(Ptr<P> q, int64_t t) { q.p += t * q.st; return q; }
// Lane i of a row (U: unit inner stride, the contiguous case, kept a plain vector load);
// step t of a lane.
template <bool U, typename P> static FSCAN_INLINE P& lane(const Ptr<P>& q, int64_t i) { return q.p[U ? i : i * q.si]; }
template <typename P> static FSCAN_INLINE P& step(const Ptr<P>& q, int64_t t) { return q.p[t * q.st]; }
template <typename P> static FSCAN_INLINE Ptr<P> dense(P* p, int64_t nb, int64_t T, int64_t inner) {
  return Ptr<P>{p, nb * T * inner, T * inner, inner, 1}; }
template <typename P> static FSCAN_INLINE int64_t mag(const Ptr<P>& q, bool t) { const int64_t s = t ? q.st : q.si; return s < 0 ? -s : s; }
// The shape of the scan: outer lanes (in two dims of nb inner ones), T steps, inner lanes.
struct Geo { int64_t outer, nb, T, inner; };
// bfloat16 stored as its bits; rounding to nearest even as torch does.
static FSCAN_INLINE float fscan_bf16_load(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; std::memcpy(&f, &u, 4); return f; }
static FSCAN_INLINE uint16_t fscan_bf16_store(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
// A value rounded to a narrower float type and held in the wider one: what an eager op of
// that dtype returns (the translator rounds what discrete ops read: comparisons, floor...).
static FSCAN_INLINE double fscan_round_f32(double x) { return (double)(float)x; }
static FSCAN_INLINE float fscan_round_f16(float x) { return (float)(_Float16)x; }
static FSCAN_INLINE float fscan_round_bf16(float x) { return fscan_bf16_load(fscan_bf16_store(x)); }
// A value brought into a narrower float type's range, its precision kept: +-inf where
// rounding to that type overflows (from its largest finite value plus half an ulp, a
// tie that rounds to even: inf), +-0 where it underflows (to half its least subnormal).
template <typename T> static FSCAN_INLINE T fscan_range(T x, T over, T under) {
  const T m = std::fabs(x);
  return m >= over ? std::copysign(std::numeric_limits<T>::infinity(), x) : (m <= under ? std::copysign(T(0), x) : x);
}
static FSCAN_INLINE double fscan_range_f32(double x) { return fscan_range(x, 0x1.ffffffp127, 0x1p-150); }
static FSCAN_INLINE float fscan_range_f16(float x) { return fscan_range(x, 65520.0f, 0x1p-25f); }
static FSCAN_INLINE float fscan_range_bf16(float x) { return fscan_range(x, 0x1.ffp127f, 0x1p-134f); }
"""

_GLIBC = platform.libc_ver()
_GLIBC_VERSION = (
    tuple(int(p) for p in _GLIBC[1].split(".")[:2])
    if _GLIBC[0] == "glibc" and _GLIBC[1]
    else (0, 0)
)
MVEC = platform.machine() == "x86_64" and _GLIBC_VERSION >= (2, 22)
_MVEC_222 = ["exp", "log", "sin", "cos"]
_MVEC_235 = [
    "log1p",
    "expm1",
    "exp2",
    "log2",
    "log10",
    "tanh",
    "tan",
    "sinh",
    "cosh",
    "erf",
    "atan",
    "asin",
    "acos",
]


def mvec_declarations() -> str:
    """glibc's vector math (libmvec) variants: glibc declares them only under -ffast-math."""
    if not MVEC:
        return ""
    names = _MVEC_222 + (_MVEC_235 if _GLIBC_VERSION >= (2, 35) else [])
    decls = []
    for n in names:
        decls.append(f'__attribute__((__simd__("notinbranch"))) double {n}(double) noexcept;')
        decls.append(f'__attribute__((__simd__("notinbranch"))) float {n}f(float) noexcept;')
    body = "\n".join(decls)
    return (
        "#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__GLIBC__)\n"
        f'extern "C" {{\n{body}\n}}\n#endif\n'
    )


def _load(dtype: torch.dtype, expr: str, ctype: str) -> str:
    if dtype == torch.bfloat16:
        return f"static_cast<{ctype}>(fscan_bf16_load({expr}))"
    if dtype == torch.bool:
        return f"({expr} != 0)"
    return f"static_cast<{ctype}>({expr})"


def _store(dtype: torch.dtype, expr: str) -> str:
    if dtype == torch.bfloat16:
        return f"fscan_bf16_store(static_cast<float>({expr}))"
    return f"static_cast<{STORAGE[dtype]}>({expr})"


def _strided(name: str, fields: Sequence[tuple[str, str]]) -> list[str]:
    """A struct ``name`` of strided pointers (``fields``: member name, pointee C type) and
    its placement helpers: ``at`` (a lane at a step), ``row`` (step t from a lane's
    start), ``unit`` (every inner stride is 1) and ``along`` (some member is laid out
    along T: its T stride, nonzero, is below its inner stride)."""
    members = " ".join(f"Ptr<{c}> {f};" for f, c in fields)
    each = lambda expr: " ".join(f"r.{f} = {expr.format(f=f)};" for f, _ in fields)
    return [
        f"struct {name} {{ {members} }};",
        f"static FSCAN_INLINE {name} at(const {name} x, const Geo& G, int64_t o, int64_t t, int64_t i) "
        f"{{ {name} r = x; (void)G; (void)o; (void)t; (void)i; "
        + each("shift(x.{f}, o, G.nb, t, i)")
        + " return r; }",
        f"static FSCAN_INLINE {name} row(const {name} x, int64_t t) {{ {name} r = x; (void)t; "
        + each("row(x.{f}, t)")
        + " return r; }",
        f"static FSCAN_INLINE bool unit(const {name} x) {{ (void)x; return true"
        + "".join(f" && x.{f}.si == 1" for f, _ in fields)
        + "; }",
        f"static FSCAN_INLINE bool along(const {name} x) {{ (void)x; return false"
        + "".join(f" || (x.{f}.st != 0 && mag(x.{f}, true) < mag(x.{f}, false))" for f, _ in fields)
        + "; }",
    ]


def _gathered(name: str, fields: Sequence[tuple[str, str]]) -> list[str]:
    """Row buffers for the inputs ``name`` (see :func:`_strided`) and ``gather``: a row
    whose members are dense (inner stride 1) where they were not, each other member
    copied into its buffer (a stride-0 broadcast: filled with its one value, again only
    where that value's address or the width changed, so a scalar broadcast is filled
    once; a step slice: its elements packed), so that the lane loops stay plain vector
    loops whatever the layout; the copy is of one row, in L1, not of the tensor."""
    plain = [(f, c.removeprefix("const ")) for f, c in fields]
    lines = [
        f"struct {name}Row {{ "
        + " ".join(
            f"std::unique_ptr<{c}[]> {f}; mutable const {c}* {f}_at = nullptr; "
            f"mutable int64_t {f}_w = -1;"
            for f, c in plain
        )
        + f" explicit {name}Row(int64_t n) "
        + (": " + ", ".join(f"{f}(new {c}[n > 0 ? n : 1])" for f, c in plain) if plain else "")
        + " { (void)n; } };",
        f"static FSCAN_INLINE {name} gather(const {name} x, const {name}Row& b, int64_t w, bool down) "
        f"{{ {name} r = x; (void)b; (void)w; (void)down;",
    ]
    for f, c in plain:
        lines.append(
            f"  if (x.{f}.si != 1) {{ {c}* d = b.{f}.get(); const auto q = x.{f}; "
            f"if (q.si == 0) {{ if (q.p != b.{f}_at || w != b.{f}_w) {{ const {c} v = q.p[0]; "
            f"for (int64_t i = 0; i < w; ++i) d[i] = v; b.{f}_at = q.p; b.{f}_w = w; }} }} "
            f"else {{ b.{f}_at = nullptr; "
            f"fscan_lanes<LANE_BLOCK>(w, down, [&](int64_t i) {{ d[i] = lane<false>(q, i); }}); }} "
            f"r.{f}.p = d; r.{f}.si = 1; }}"
        )
    lines.append("  return r; }")
    return lines


def _scattered(name: str, fields: Sequence[tuple[str, str]]) -> list[str]:
    """Row buffers for the outputs ``name`` (see :func:`_strided`): ``buffered`` points
    each member whose inner stride is not 1 at its buffer (a dense row, so that the lane
    loops stay plain vector loops), ``scatter`` then stores that row to its strided
    place (in the lanes' order ``down``: see ``fscan_lanes``). Members of inner stride 1
    are written in place and cost one untaken branch per row."""
    lines = [
        f"struct {name}Row {{ "
        + " ".join(f"std::unique_ptr<{c}[]> {f};" for f, c in fields)
        + f" explicit {name}Row(int64_t n) "
        + (": " + ", ".join(f"{f}(new {c}[n > 0 ? n : 1])" for f, c in fields) if fields else "")
        + " { (void)n; } };",
        f"static FSCAN_INLINE {name} buffered(const {name} y, const {name}Row& b) "
        f"{{ {name} r = y; (void)b;"
        + "".join(
            f" if (y.{f}.si != 1) {{ r.{f}.p = b.{f}.get(); r.{f}.si = 1; }}" for f, _ in fields
        )
        + " return r; }",
        f"static FSCAN_INLINE void scatter(const {name} y, const {name}Row& b, int64_t w, bool down) "
        f"{{ (void)y; (void)b; (void)w; (void)down;",
    ]
    for f, c in fields:
        lines.append(
            f"  if (y.{f}.si != 1) {{ const {c}* s = b.{f}.get(); const auto q = y.{f}; "
            f"fscan_lanes<LANE_BLOCK>(w, down, [&](int64_t i) {{ lane<false>(q, i) = s[i]; }}); }}"
        )
    lines.append("}")
    return lines


def _structs(
    dtypes: Sequence[torch.dtype],
    compute: Sequence[str],
    program: Program,
    positions: Sequence[int] = (),
    dropped: Sequence[int] = (),
) -> str:
    """Vals/In/Out/Buf/Par and their accessors for leaves of ``dtypes``; the leaves in
    ``positions`` are not read: loads give them the position ``t`` along the scan dim;
    those in ``dropped`` are not stored: ``Out`` has no pointer for them (outputs the
    caller does not keep cost no memory traffic), and those of them no kept output
    needs (see :func:`needed`) are not kept in the running buffers either (``get``
    gives them 0), so the compiler drops their computation.

    ``load_i(x, i, t)``/``store_i(y, i, v)``: lane i of a dense row (see ``row`` and
    ``gather``); ``load_t(x, k, t)``/``store_t(y, k, v)``: k steps from where a lane's
    pointers are (see ``at``, ``row``), position t (the value of position leaves)."""
    R = range(len(dtypes))
    read = [k for k in R if k not in positions]
    kept = [k for k in R if k not in dropped]
    live = needed(program, len(dtypes), dropped)
    st = [STORAGE[d] for d in dtypes]
    # Values and buffers hold compute values, but bools as bytes: C++ bools kept in memory
    # (a struct, a buffer) block GCC's vectorisation.
    bt = ["uint8_t" if c == "bool" else c for c in compute]
    narrowest = min(torch.empty((), dtype=d).element_size() for d in dtypes)

    def loads(ref: str) -> str:
        return " ".join(
            f"v.v{k} = static_cast<{compute[k]}>(t);"
            if k in positions
            else f"v.v{k} = {_load(dtypes[k], ref.format(f=f'x.x{k}'), compute[k])};"
            for k in R
        )

    lines = [
        f"static constexpr int64_t LANE_BLOCK = {max(16, 64 // narrowest)};",
        "struct Vals { " + " ".join(f"{bt[k]} v{k};" for k in R) + " };",
        *_strided("In", [(f"x{k}", f"const {st[k]}") for k in read]),
        *_gathered("In", [(f"x{k}", f"const {st[k]}") for k in read]),
        *_strided("Out", [(f"y{k}", st[k]) for k in kept]),
        *_scattered("Out", [(f"y{k}", st[k]) for k in kept]),
        # A carry-in: one element per read leaf (contiguous, element position e at e)
        # that replaces the scan's first element in scan order; all null: none.
        "struct Heads { " + " ".join(f"const {st[k]}* h{k};" for k in read) + " bool any; };",
        "static FSCAN_INLINE In head_at(const In x, const Heads& H, int64_t e) { In r = x; "
        "(void)H; (void)e; "
        + " ".join(f"r.x{k}.p = H.h{k} + e; r.x{k}.st = 0; r.x{k}.si = 1;" for k in read)
        + " return r; }",
        "struct Buf { " + " ".join(f"{bt[k]}* v{k};" for k in R) + " };",
        "struct Par { "
        + " ".join(f"const {_param_ctype(p.dtype)}* p{j};" for j, p in enumerate(program.params))
        + " };",
        "static FSCAN_INLINE Vals load_i(const In x, int64_t i, int64_t t) "
        "{ Vals v; (void)x; (void)i; (void)t; " + loads("lane<true>({f}, i)") + " return v; }",
        "static FSCAN_INLINE Vals load_t(const In x, int64_t k, int64_t t) "
        "{ Vals v; (void)x; (void)k; (void)t; " + loads("step({f}, k)") + " return v; }",
        "static FSCAN_INLINE void store_i(const Out y, int64_t i, const Vals& v) { "
        "(void)y; (void)i; (void)v; "
        + " ".join(f"lane<true>(y.y{k}, i) = {_store(dtypes[k], f'v.v{k}')};" for k in kept)
        + " }",
        "static FSCAN_INLINE void store_t(const Out y, int64_t t, const Vals& v) { "
        "(void)y; (void)t; (void)v; "
        + " ".join(f"step(y.y{k}, t) = {_store(dtypes[k], f'v.v{k}')};" for k in kept)
        + " }",
        "static FSCAN_INLINE Vals get(const Buf b, int64_t i) { Vals v; (void)b; (void)i; "
        + " ".join(f"v.v{k} = b.v{k}[i];" if k in live else f"v.v{k} = 0;" for k in R)
        + " return v; }",
        "static FSCAN_INLINE void put(const Buf b, int64_t i, const Vals& v) { "
        "(void)b; (void)i; (void)v; " + " ".join(f"b.v{k}[i] = v.v{k};" for k in live) + " }",
        # Every leaf: a chunk's total is the right operand of the carries composed from
        # it, whose gates (e.g.) a kept output reads though it is not kept itself.
        "static FSCAN_INLINE Vals get_all(const Buf b, int64_t i) { Vals v; "
        + " ".join(f"v.v{k} = b.v{k}[i];" for k in R)
        + " return v; }",
        "static FSCAN_INLINE void put_all(const Buf b, int64_t i, const Vals& v) { "
        + " ".join(f"b.v{k}[i] = v.v{k};" for k in R)
        + " }",
        "template <bool ALL> static FSCAN_INLINE Vals get_as(const Buf b, int64_t i) "
        "{ return ALL ? get_all(b, i) : get(b, i); }",
        "template <bool ALL> static FSCAN_INLINE void put_as(const Buf b, int64_t i, const Vals& v) "
        "{ if (ALL) put_all(b, i, v); else put(b, i, v); }",
        "static FSCAN_INLINE Buf offset(const Buf b, int64_t i) { return Buf{"
        + ", ".join(f"b.v{k} + i" for k in R)
        + "}; }",
        "struct Store { "
        + " ".join(f"std::unique_ptr<{bt[k]}[]> v{k};" for k in R)
        + " explicit Store(int64_t n) : "
        + ", ".join(f"v{k}(new {bt[k]}[n > 0 ? n : 1])" for k in R)
        + " {} Buf buf() { return Buf{"
        + ", ".join(f"v{k}.get()" for k in R)
        + "}; } };",
    ]
    return "\n".join(lines)


def needed(program: Program, n: int, dropped: Sequence[int]) -> list[int]:
    """The leaves whose running values the kept outputs need: the kept ones and, step
    after step, every left operand leaf a needed output reads (all where the program
    does not say what it reads). E.g. ``(a1 a2, a2 b1 + b2)`` keeping ``b``: only ``b``
    (the gate products are read from the right operand, the input, alone)."""
    if not dropped or len(program.reads) != n:
        return list(range(n))
    live = {k for k in range(n) if k not in dropped}
    todo = list(live)
    while todo:
        for name in program.reads[todo.pop()]:
            k = int(name[1:]) if name[:1] == "l" and name[1:].isdigit() else None
            if k is not None and k < n and k not in live:
                live.add(k)
                todo.append(k)
    return sorted(live)


def _param_ctype(dtype: torch.dtype) -> str:
    """Params enter as float64, int64 or bool bytes (see :func:`param_dtype`)."""
    if dtype.is_floating_point:
        return "double"
    return "uint8_t" if dtype == torch.bool else "int64_t"


def param_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a param of ``dtype`` is passed in (exact for every supported dtype)."""
    if dtype.is_floating_point:
        return torch.float64
    return torch.bool if dtype == torch.bool else torch.int64


def _signature(
    dtypes: Sequence[torch.dtype], program: Program, extra: Sequence[str], positions: Sequence[int]
) -> list[str]:
    st = [STORAGE[d] for d in dtypes]
    args = [f"const {c}* x{k}" for k, c in enumerate(st) if k not in positions]
    args += extra
    args += [f"const {_param_ctype(p.dtype)}* p{j}" for j, p in enumerate(program.params)]
    return args


STRIDES = ("sa", "sb", "st", "si")  # per strided input: see Ptr in PRELUDE


def _stride_params(names: Sequence[str]) -> str:
    """``int64_t nb`` and the strides of each input in ``names``, as C parameters."""
    return ", int64_t nb" + "".join(f", int64_t {n}_{s}" for n in names for s in STRIDES)


def _strided_init(names: Sequence[str]) -> str:
    return ", ".join("{" + ", ".join([n] + [f"{n}_{s}" for s in STRIDES]) + "}" for n in names)


def _dense_init(names: Sequence[str]) -> str:
    return ", ".join(f"dense({n}, nb, T, inner)" for n in names)


def _combine_function(compute: Sequence[str], program: Program) -> str:
    """``combine(l, r, p, e)``: the translated body over one element's ``Vals``."""
    R = range(len(compute))
    return (
        "static FSCAN_INLINE Vals combine(const Vals& l, const Vals& r, const Par p, int64_t e) {\n"
        + "".join(f"  const {compute[k]} l{k} = l.v{k};\n" for k in R)
        + "".join(f"  const {compute[k]} r{k} = r.v{k};\n" for k in R)
        + "  (void)p; (void)e;\n"
        + "".join(f"  {compute[k]} o{k};\n" for k in R)
        + "".join(f"  {line}\n" for line in program.body.splitlines())
        + "  Vals o;\n"
        + "".join(f"  o.v{k} = o{k};\n" for k in R)
        + "  return o;\n}\n"
    )


def forward_argtypes(
    dtypes: Sequence[torch.dtype],
    program: Program,
    positions: Sequence[int] = (),
    dropped: Sequence[int] = (),
) -> list[str]:
    """C types of the forward kernel's arguments (for the Python binding)."""
    st = [STORAGE[d] for d in dtypes]
    types = [f"const {c}*" for k, c in enumerate(st) if k not in positions]
    types += [f"{c}*" for k, c in enumerate(st) if k not in dropped]
    types += [f"const {_param_ctype(p.dtype)}*" for p in program.params]
    n_read = len(dtypes) - len(set(positions))
    n_kept = len(dtypes) - len(set(dropped))
    return types + ["int64_t"] * (5 + 1 + len(STRIDES) * (n_read + n_kept) + n_read)


def forward_source(
    dtypes: Sequence[torch.dtype],
    program: Program,
    positions: Sequence[int] = (),
    dropped: Sequence[int] = (),
) -> str:
    """The complete forward kernel:
    ``kernel(x.., y.., p.., outer, T, inner, rev, threads, nb, x strides.., y strides..,
    heads..)``.

    The inputs ``x`` are read and the outputs ``y`` written through their strides
    (``sa, sb, st, si`` each, of the ``(outer // nb, nb, T, inner)`` view: see Ptr;
    outputs must not overlap each other or the inputs: the caller checks). The
    leaves in ``positions`` have no input ``x``: each element's value is its index
    along the scan dim (as for the indices of ``cummax``). The leaves in ``dropped``
    have no output ``y``: they are computed (the kept ones may depend on them) but
    never stored. ``heads``: per input, the address of one element (contiguous, in the
    leaf's dtype) that replaces the scan's first element in scan order (the last for
    ``rev``), or 0 for none (all or none): a carry-in folded into that element, read
    without copying the leaves."""
    compute = [compute_ctype(d, program.wide) for d in dtypes]
    R = range(len(dtypes))
    st = [STORAGE[d] for d in dtypes]
    combine = _combine_function(compute, program)
    kept = [k for k in R if k not in dropped]
    # A carry composed from two chunk totals that a kept float output gets as NaN from
    # non-NaN operands, or infinite from finite ones, is walked step by step instead
    # (see FORWARD_TEMPLATE): composing is exact only up to the floats' range, e.g. the
    # linear recurrence's gate product underflows to 0 and meets an inf state (0 * inf),
    # or overflows and meets a zero one, where the steps never form that product.
    checks = [
        f"(std::isnan(o.v{k}) && !std::isnan(l.v{k}) && !std::isnan(r.v{k})) || "
        f"(std::isinf(o.v{k}) && std::isfinite(l.v{k}) && std::isfinite(r.v{k}))"
        for k in kept
        if dtypes[k].is_floating_point
    ]
    suspect = (
        "static FSCAN_INLINE bool suspect(const Vals& l, const Vals& r, const Vals& o) {\n"
        "  (void)l; (void)r; (void)o;\n"
        f"  return {' || '.join(checks) or 'false'};\n}}\n"
    )
    args = _signature(dtypes, program, [f"{st[k]}* y{k}" for k in kept], positions)
    read_idx = [k for k in R if k not in positions]
    read = [f"x{k}" for k in read_idx]
    written = [f"y{k}" for k in kept]
    entry = (
        'extern "C" void kernel('
        + ", ".join(args)
        + ", int64_t outer, int64_t T, int64_t inner, int64_t rev, int64_t threads"
        + _stride_params(read + written)
        + "".join(f", int64_t h{k}" for k in read_idx)
        + ") {\n"
        + "  const In x{"
        + _strided_init(read)
        + "}; const Out y{"
        + _strided_init(written)
        + "}; const Par p{"
        + ", ".join(f"p{j}" for j in range(len(program.params)))
        + "}; const Heads H{"
        + "".join(f"reinterpret_cast<const {st[k]}*>(h{k}), " for k in read_idx)
        + (f"h{read_idx[0]} != 0" if read_idx else "false")
        + "};\n  scan(x, y, p, Geo{outer, nb, T, inner}, rev != 0, (int)threads, H);\n}\n"
    )
    return "\n".join(
        [
            PRELUDE,
            mvec_declarations(),
            _structs(dtypes, compute, program, positions, dropped),
            combine,
            suspect,
            FORWARD_TEMPLATE,
            entry,
        ]
    )


FORWARD_TEMPLATE = r"""
static constexpr int64_t TILE = 1024;      // lanes per column of the lane path
static constexpr int64_t VEC_MIN = 8;      // inner sizes below this take the chain path
static constexpr int64_t MIN_CHUNK = 2048; // steps per chunk, at least, when T is split
static constexpr int64_t PER_THREAD = 16384; // elements per thread, at least
static constexpr int G = 8;                // chains interleaved on the chain path

// Steps [s0, s1) (in scan order) of lanes [i0, i0 + w) of outer index o. The running
// values live in acc (w entries); carry (or nullptr) holds the inclusive result before s0.
// GATHER: inputs of other inner strides than 1 are gathered, a row at a time, into rows
// (a separate instantiation: dense inputs keep the loop they had before strides existed;
// the gather's pointer select in the same loop cost seg 1.45x).
// Outputs of other inner strides than 1 are written, a row at a time, into orows and
// scattered from there (GATHER only: the dense instantiation has unit outputs too).
// H: a carry-in (if H.any): step 0 (in scan order) reads the head element instead of x.
// !WRITE: a chunk total, kept with every leaf in acc (and carry), since the carries
// composed from it read its leaves as a right operand (see get_all).
template <bool WRITE, bool GATHER>
static void lane_run(const In x, const Out y, const Par p, const Geo& S, int64_t o, int64_t i0,
                     int64_t w, int64_t s0, int64_t s1, bool rev, const Buf* carry, const Buf acc,
                     const InRow& rows, const OutRow& orows, const Heads& H) {
  const In xc = at(x, S, o, 0, i0);
  const Out yc = at(y, S, o, 0, i0);
  const int64_t e0 = o * S.inner + i0, T = S.T, dt = rev ? -1 : 1;
  int64_t sb = s0;  // the first step read from x
  if (s0 == 0 && H.any && s1 > 0) {  // peeled: the loop below stays as it was
    const int64_t t = rev ? T - 1 : 0;
    const In hr = head_at(x, H, e0);
    const Out yr = GATHER ? buffered(row(yc, t), orows) : row(yc, t);
    fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) {
      const Vals v = load_i(hr, i, t);
      put_as<!WRITE>(acc, i, v);
      if (WRITE) store_i(yr, i, v);
    });
    if (WRITE && GATHER) scatter(row(yc, t), orows, w, rev);
    carry = &acc;
    sb = 1;
  }
  if (sb >= s1) return;
  // The rows' pointers step along (recomputing them from t cost 10% on 8-step columns).
  In xs = row(xc, rev ? T - 1 - sb : sb);
  Out ys = row(yc, rev ? T - 1 - sb : sb);
  for (int64_t s = sb; s < s1; ++s) {
    const int64_t t = rev ? T - 1 - s : s;
    if (s > sb) { xs = row(xs, dt); ys = row(ys, dt); }
    const In xr = GATHER ? gather(xs, rows, w, rev) : xs;
    const Out yr = GATHER ? buffered(ys, orows) : ys;
    if (s == sb && carry == nullptr) {
      fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) {
        const Vals v = load_i(xr, i, t);
        put_as<!WRITE>(acc, i, v);
        if (WRITE) store_i(yr, i, v);
      });
    } else {
      const Buf left = s == sb ? *carry : acc;
      fscan_lanes<LANE_BLOCK>(w, rev, [&](int64_t i) {
        const Vals v = combine(get_as<!WRITE>(left, i), load_i(xr, i, t), p, e0 + i);
        put_as<!WRITE>(acc, i, v);
        if (WRITE) store_i(yr, i, v);
      });
    }
    if (WRITE && GATHER) scatter(ys, orows, w, rev);
  }
}

static void lane_path(const In x, const Out y, const Par p, const Geo& S, bool rev, int nt,
                      const Heads& H) {
  const int64_t outer = S.outer, T = S.T, inner = S.inner;
  int64_t W = std::min<int64_t>(inner, TILE);
  while (outer * ((inner + W - 1) / W) < nt && W > 16) W = (W / 2 + 15) / 16 * 16;
  const int64_t ntiles = (inner + W - 1) / W, ncols = outer * ntiles;
  int64_t C = 1;  // chunks per column
  if (ncols < nt) C = std::min<int64_t>((nt + ncols - 1) / ncols * 2, std::max<int64_t>(1, T / MIN_CHUNK));
  const int64_t L = (T + C - 1) / C;
  C = (T + L - 1) / L;
  // Totals of chunks 0..C-2 of every column, W lanes each, then their inclusive scan.
  Store tot(C > 1 ? ncols * (C - 1) * W : 0);
  const Buf tb = tot.buf();
#pragma omp parallel num_threads(nt)
  {
    Store scratch(W);
    const Buf acc = scratch.buf();
    const bool dense = unit(x) && unit(y);
    const InRow rows(dense ? 0 : W);
    const OutRow orows(dense ? 0 : W);
    if (C > 1) {
#pragma omp for schedule(static)
      for (int64_t k = 0; k < ncols * (C - 1); ++k) {
        const int64_t col = k / (C - 1), c = k % (C - 1);
        const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
        if (dense) lane_run<false, false>(x, y, p, S, o, i0, w, c * L, (c + 1) * L, rev, nullptr, offset(tb, k * W), rows, orows, H);
        else lane_run<false, true>(x, y, p, S, o, i0, w, c * L, (c + 1) * L, rev, nullptr, offset(tb, k * W), rows, orows, H);
      }
#pragma omp for schedule(static)
      for (int64_t col = 0; col < ncols; ++col) {
        const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
        for (int64_t c = 1; c < C - 1; ++c) {
          const Buf prev = offset(tb, (col * (C - 1) + c - 1) * W), cur = offset(tb, (col * (C - 1) + c) * W);
          bool walk = false;
          for (int64_t i = 0; i < w; ++i) {
            const Vals l = get_all(prev, i), r = get_all(cur, i), v = combine(l, r, p, o * inner + i0 + i);
            walk |= suspect(l, r, v);
            put_all(cur, i, v);
          }
          // Composing the chunk is not what its steps give (see suspect): walk them.
          if (walk && dense) lane_run<false, false>(x, y, p, S, o, i0, w, c * L, (c + 1) * L, rev, &prev, cur, rows, orows, H);
          else if (walk) lane_run<false, true>(x, y, p, S, o, i0, w, c * L, (c + 1) * L, rev, &prev, cur, rows, orows, H);
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t k = 0; k < ncols * C; ++k) {
      const int64_t col = k / C, c = k % C;
      const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
      const Buf carry = c > 0 ? offset(tb, (col * (C - 1) + c - 1) * W) : tb;
      const int64_t s1 = std::min(T, (c + 1) * L);
      if (dense) lane_run<true, false>(x, y, p, S, o, i0, w, c * L, s1, rev, c == 0 ? nullptr : &carry, acc, rows, orows, H);
      else lane_run<true, true>(x, y, p, S, o, i0, w, c * L, s1, rev, c == 0 ? nullptr : &carry, acc, rows, orows, H);
    }
  }
}

// NG chains interleaved: chain g is the lane whose start (t = 0) is xb[g]/yb[g]; it runs
// len[g] steps from position t0[g], tstep (+-1) apart, at element position elem[g];
// carry[g] (if has[g]) is its inclusive carry-in.
// WRITE: store every output; else only the final values, into last[g].
// head[g]: the chain's first step reads hb[g] (a carry-in's head element) instead of x.
template <int NG, bool WRITE>
static FSCAN_INLINE void chains(const In* xb, const Out* yb, const Par p, const int64_t* t0,
                                const int64_t* len, const int64_t* elem, int64_t tstep,
                                const Vals* carry, const bool* has, Vals* last,
                                const In* hb, const bool* head) {
  Vals acc[NG];
  In xp[NG];  // each chain's inputs and outputs at its first step
  Out yp[NG];
  int64_t common = len[0];
  for (int g = 1; g < NG; ++g) common = std::min(common, len[g]);
#pragma GCC unroll 8
  for (int g = 0; g < NG; ++g) {
    xp[g] = row(xb[g], t0[g]);
    yp[g] = row(yb[g], t0[g]);
    const Vals v = head[g] ? load_t(hb[g], 0, t0[g]) : load_t(xp[g], 0, t0[g]);
    acc[g] = has[g] ? combine(carry[g], v, p, elem[g]) : v;
    if (WRITE) store_t(yp[g], 0, acc[g]);
  }
  for (int64_t s = 1; s < common; ++s) {
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      acc[g] = combine(acc[g], load_t(xp[g], s * tstep, t0[g] + s * tstep), p, elem[g]);
      if (WRITE) store_t(yp[g], s * tstep, acc[g]);
    }
  }
  for (int g = 0; g < NG; ++g) {
    for (int64_t s = common; s < len[g]; ++s) {
      acc[g] = combine(acc[g], load_t(xp[g], s * tstep, t0[g] + s * tstep), p, elem[g]);
      if (WRITE) store_t(yp[g], s * tstep, acc[g]);
    }
    if (!WRITE) last[g] = acc[g];
  }
}

template <bool WRITE>
static void chain_group(const In* xb, const Out* yb, const Par p, int ng, const int64_t* t0,
                        const int64_t* len, const int64_t* elem, int64_t tstep, const Vals* carry,
                        const bool* has, Vals* last, const In* hb, const bool* head) {
  if (ng == G) {
    chains<G, WRITE>(xb, yb, p, t0, len, elem, tstep, carry, has, last, hb, head);
    return;
  }
  for (int g = 0; g < ng; ++g)
    chains<1, WRITE>(xb + g, yb + g, p, t0 + g, len + g, elem + g, tstep, carry + g, has + g,
                     last + g, hb + g, head + g);
}

static void chain_path(const In x, const Out y, const Par p, const Geo& S, bool rev, int nt,
                       const Heads& H) {
  const int64_t T = S.T, inner = S.inner, lanes = S.outer * inner;
  int64_t C = 1;  // chunks per lane
  if (lanes < (int64_t)nt * G) {
    C = std::min<int64_t>(((int64_t)nt * G + lanes - 1) / lanes, std::max<int64_t>(1, T / MIN_CHUNK));
    if (C >= G) C = C / G * G;
  }
  int64_t L = (T + C - 1) / C;
  // Interleaved chunks of one lane at power-of-two distances share cache sets: skew them.
  if (C > 1 && inner == 1) L = (L + 15) / 16 * 16 + 16;
  C = (T + L - 1) / L;
  const int64_t tstep = rev ? -1 : 1;
  const int64_t items = lanes * C, groups = (items + G - 1) / G;
  auto describe = [&](int64_t k, In& xb, Out& yb, int64_t& t0, int64_t& len, int64_t& elem,
                      In& hb, bool& head) {
    const int64_t lane = k / C, c = k % C, o = lane / inner, i = lane % inner;
    const int64_t s = c * L;
    t0 = rev ? T - 1 - s : s;
    xb = at(x, S, o, 0, i);
    yb = at(y, S, o, 0, i);
    len = std::min(T, s + L) - s;
    elem = lane;
    head = H.any && c == 0;  // the scan's first step: from the carry-in's head element
    if (head) hb = head_at(x, H, lane);
  };
  std::vector<Vals> tot(C > 1 ? items : 0);
#pragma omp parallel num_threads(nt)
  {
    In xb[G], hb[G];
    Out yb[G];
    int64_t t0[G], len[G], elem[G];
    Vals carry[G];
    bool has[G], head[G];
    if (C > 1) {
#pragma omp for schedule(static)
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int ng = (int)std::min<int64_t>(G, items - gi * G);
        for (int g = 0; g < ng; ++g) { describe(gi * G + g, xb[g], yb[g], t0[g], len[g], elem[g], hb[g], head[g]); has[g] = false; }
        chain_group<false>(xb, yb, p, ng, t0, len, elem, tstep, carry, has, tot.data() + gi * G, hb, head);
      }
#pragma omp for schedule(static)
      for (int64_t lane = 0; lane < lanes; ++lane)
        for (int64_t c = 1; c < C - 1; ++c) {
          const int64_t k = lane * C + c;
          const Vals v = combine(tot[k - 1], tot[k], p, lane);
          if (!suspect(tot[k - 1], tot[k], v)) {
            tot[k] = v;
            continue;
          }
          // Composing the chunk is not what its steps give (see suspect): walk them.
          describe(k, xb[0], yb[0], t0[0], len[0], elem[0], hb[0], head[0]);
          has[0] = true;
          carry[0] = tot[k - 1];
          chain_group<false>(xb, yb, p, 1, t0, len, elem, tstep, carry, has, &tot[k], hb, head);
        }
    }
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int ng = (int)std::min<int64_t>(G, items - gi * G);
      for (int g = 0; g < ng; ++g) {
        const int64_t k = gi * G + g;
        describe(k, xb[g], yb[g], t0[g], len[g], elem[g], hb[g], head[g]);
        has[g] = k % C != 0;
        if (has[g]) carry[g] = tot[k - 1];
      }
      chain_group<true>(xb, yb, p, ng, t0, len, elem, tstep, carry, has, nullptr, hb, head);
    }
  }
}

// The lane path wants lanes next to each other in memory (SIMD over them); where an
// input or output is laid out along T instead (a transpose: T stride below the inner
// stride), the chain path walks each lane along its contiguous steps.
static void scan(const In x, const Out y, const Par p, const Geo& S, bool rev, int threads,
                 const Heads& H) {
  if (S.T <= 0 || S.outer <= 0 || S.inner <= 0) return;
  const int64_t total = S.outer * S.T * S.inner;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, total / PER_THREAD));
  if (S.inner >= VEC_MIN && !along(x) && !along(y)) {
    lane_path(x, y, p, S, rev, nt, H);
  } else {
    chain_path(x, y, p, S, rev, nt, H);
  }
}
"""


def backward_argtypes(
    dtypes: Sequence[torch.dtype],
    floats: Sequence[int],
    program: Program,
    pfloats: Sequence[int] = (),
) -> list[str]:
    """C types of the backward kernel's arguments: x.., y.., g.., xbar.., pbar.., p.., sizes."""
    st = [STORAGE[d] for d in dtypes]
    types = [f"const {c}*" for c in st] * 2
    types += [f"const {st[k]}*" for k in floats] + [f"{st[k]}*" for k in floats]
    types += ["double*"] * len(pfloats)
    types += [f"const {_param_ctype(p.dtype)}*" for p in program.params]
    return types + ["int64_t"] * (5 + 1 + len(STRIDES) * (2 * len(dtypes) + len(floats)))


def backward_source(
    dtypes: Sequence[torch.dtype],
    floats: Sequence[int],
    program: Program,
    pfloats: Sequence[int] = (),
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
    """
    compute = [compute_ctype(d, program.wide) for d in dtypes]
    F = list(floats)
    R = range(len(dtypes))
    st = [STORAGE[d] for d in dtypes]
    lam_types = ["double" if dtypes[k] == torch.float32 else compute[k] for k in F]
    J = range(len(F))
    structs = [
        _structs(dtypes, compute, program),
        "struct Lam { " + " ".join(f"{lam_types[j]} v{j};" for j in J) + " };",
        *_strided("Grad", [(f"g{j}", f"const {st[k]}") for j, k in enumerate(F)]),
        *_gathered("Grad", [(f"g{j}", f"const {st[k]}") for j, k in enumerate(F)]),
        *_strided("Bar", [(f"b{j}", st[k]) for j, k in enumerate(F)]),
        "struct LamBuf { " + " ".join(f"{lam_types[j]}* v{j};" for j in J) + " };",
        "static FSCAN_INLINE Lam load_g_i(const Grad g, int64_t i) { Lam v; "
        + " ".join(
            f"v.v{j} = {_load(dtypes[k], f'lane<true>(g.g{j}, i)', lam_types[j])};"
            for j, k in enumerate(F)
        )
        + " return v; }",
        "static FSCAN_INLINE Lam load_g_t(const Grad g, int64_t t) { Lam v; "
        + " ".join(
            f"v.v{j} = {_load(dtypes[k], f'step(g.g{j}, t)', lam_types[j])};"
            for j, k in enumerate(F)
        )
        + " return v; }",
        "static FSCAN_INLINE void store_bar_i(const Bar b, int64_t i, const Lam& v) { "
        + " ".join(
            f"lane<true>(b.b{j}, i) = {_store(dtypes[k], f'v.v{j}')};" for j, k in enumerate(F)
        )
        + " }",
        "static FSCAN_INLINE void store_bar_t(const Bar b, int64_t t, const Lam& v) { "
        + " ".join(f"step(b.b{j}, t) = {_store(dtypes[k], f'v.v{j}')};" for j, k in enumerate(F))
        + " }",
        "static FSCAN_INLINE Lam get_lam(const LamBuf b, int64_t i) { Lam v; "
        + " ".join(f"v.v{j} = b.v{j}[i];" for j in J)
        + " return v; }",
        "static FSCAN_INLINE void put_lam(const LamBuf b, int64_t i, const Lam& v) { "
        + " ".join(f"b.v{j}[i] = v.v{j};" for j in J)
        + " }",
        "static FSCAN_INLINE Lam lam_add(const Lam& a, const Lam& b) { Lam v; "
        + " ".join(f"v.v{j} = a.v{j} + b.v{j};" for j in J)
        + " return v; }",
        # A carry composed through a chunk's transfer matrix (a product of Jacobians)
        # that turns NaN from non-NaN operands or infinite from finite ones: see
        # walk_down in BACKWARD_TEMPLATE, and suspect() in the forward.
        "static FSCAN_INLINE bool lam_suspect(const Lam& a, const Lam& b, const Lam& o) { "
        "(void)a; (void)b; (void)o; return false"
        + "".join(
            f" || (std::isnan(o.v{j}) && !std::isnan(a.v{j}) && !std::isnan(b.v{j}))"
            f" || (std::isinf(o.v{j}) && std::isfinite(a.v{j}) && std::isfinite(b.v{j}))"
            for j in J
        )
        + "; }",
        "struct PLam { " + " ".join(f"double v{q};" for q in range(len(pfloats))) + " };",
        "struct PBar { " + " ".join(f"double* q{q};" for q in range(len(pfloats))) + " };",
        "static FSCAN_INLINE void zero_pbar(const PBar q, int64_t e) { (void)q; (void)e; "
        + " ".join(f"q.q{q}[e] = 0;" for q in range(len(pfloats)))
        + " }",
        "static FSCAN_INLINE void add_pbar(const PBar q, int64_t e, const PLam& v) { (void)q; (void)e; (void)v; "
        + " ".join(f"q.q{q}[e] += v.v{q};" for q in range(len(pfloats)))
        + " }",
        f"static constexpr int NF = {len(F)};",
        "static FSCAN_INLINE Lam lam_zero() { Lam v; "
        + " ".join(f"v.v{j} = 0;" for j in J)
        + " return v; }",
        "static FSCAN_INLINE Lam lam_unit(int u) { Lam v; "
        + " ".join(f"v.v{j} = u == {j} ? 1 : 0;" for j in J)
        + " return v; }",
        "static FSCAN_INLINE Lam lam_axpy(const Lam& a, const Lam& col, const Lam& s, int u) { Lam v; "
        + "const double k = "
        + " + ".join(f"(u == {j} ? (double)s.v{j} : 0.0)" for j in J)
        + "; "
        + " ".join(f"v.v{j} = a.v{j} + col.v{j} * k;" for j in J)
        + " return v; }",
        "static FSCAN_INLINE PLam plam_zero() { PLam v; "
        + " ".join(f"v.v{q} = 0;" for q in range(len(pfloats)))
        + " return v; }",
        "static FSCAN_INLINE PLam plam_add(const PLam& a, const PLam& b) { PLam v; (void)a; (void)b; "
        + " ".join(f"v.v{q} = a.v{q} + b.v{q};" for q in range(len(pfloats)))
        + " return v; }",
        "struct LamStore { "
        + " ".join(f"std::unique_ptr<{lam_types[j]}[]> v{j};" for j in J)
        + " explicit LamStore(int64_t n) : "
        + ", ".join(f"v{j}(new {lam_types[j]}[n > 0 ? n : 1])" for j in J)
        + " {} LamBuf buf() { return LamBuf{"
        + ", ".join(f"v{j}.get()" for j in J)
        + "}; } };",
    ]
    nf = len(F)
    vjp = (
        "static FSCAN_INLINE void vjp(const Vals& l, const Vals& r, const Lam& c, const Par p,"
        " int64_t e, Lam& lb, Lam& rb, PLam& pb) {\n  (void)pb;\n"
        + "".join(f"  const {compute[k]} l{k} = l.v{k};\n" for k in R)
        + "".join(f"  const {compute[k]} r{k} = r.v{k};\n" for k in R)
        + "".join(f"  const {lam_types[j]} c{k} = c.v{j};\n" for j, k in enumerate(F))
        + "  (void)p; (void)e;\n"
        + "".join(f"  {lam_types[j]}& o{j} = lb.v{j};\n" for j in J)
        + "".join(f"  {lam_types[j]}& o{nf + j} = rb.v{j};\n" for j in J)
        + "".join(f"  double& o{2 * nf + q} = pb.v{q};\n" for q in range(len(pfloats)))
        + "".join(f"  {line}\n" for line in program.body.splitlines())
        + "}\n"
    )
    args = [f"const {c}* x{k}" for k, c in enumerate(st)]
    args += [f"const {c}* y{k}" for k, c in enumerate(st)]
    args += [f"const {st[k]}* g{j}" for j, k in enumerate(F)]
    args += [f"{st[k]}* b{j}" for j, k in enumerate(F)]
    args += [f"double* q{q}" for q in range(len(pfloats))]
    args += [f"const {_param_ctype(p.dtype)}* p{j}" for j, p in enumerate(program.params)]
    strided = [f"x{k}" for k in R] + [f"y{k}" for k in R] + [f"g{j}" for j in J]
    entry = (
        'extern "C" void kernel('
        + ", ".join(args)
        + ", int64_t outer, int64_t T, int64_t inner, int64_t rev, int64_t threads"
        + _stride_params(strided)
        + ") {\n"
        + "  const In x{"
        + _strided_init([f"x{k}" for k in R])
        + "};"
        + " const In y{"
        + _strided_init([f"y{k}" for k in R])
        + "};"
        + " const Grad g{"
        + _strided_init([f"g{j}" for j in J])
        + "};"
        + " const Bar b{"
        + _dense_init([f"b{j}" for j in J])
        + "};"
        + " const PBar q{"
        + ", ".join(f"q{q}" for q in range(len(pfloats)))
        + "};"
        + " const Par p{"
        + ", ".join(f"p{j}" for j in range(len(program.params)))
        + "};\n"
        + "  backward(x, y, g, b, q, p, Geo{outer, nb, T, inner}, rev != 0, (int)threads);\n}\n"
    )
    return "\n".join([PRELUDE, mvec_declarations(), *structs, vjp, BACKWARD_TEMPLATE, entry])


BACKWARD_TEMPLATE = r"""
static constexpr int64_t TILE = 1024;
static constexpr int64_t VEC_MIN = 8;
static constexpr int64_t PER_THREAD = 16384;

// Lanes [i0, i0 + w) of outer index o, all T steps backwards in scan order.
// The params' cotangents of these lanes (element positions e0..) sum into q, which
// this column owns. Rows of x, y and g with other inner strides than 1 are gathered.
struct BwdRows { InRow x, y; GradRow g; explicit BwdRows(int64_t n) : x(n), y(n), g(n) {} };

template <bool GATHER>
static void lane_bwd(const In x, const In y, const Grad g, const Bar b, const PBar q, const Par p,
                     const Geo& S, int64_t o, int64_t i0, int64_t w, bool rev, const LamBuf lam,
                     const BwdRows& rows) {
  const In xc = at(x, S, o, 0, i0), yc = at(y, S, o, 0, i0);
  const Grad gc = at(g, S, o, 0, i0);
  const Bar bc = at(b, S, o, 0, i0);
  const int64_t T = S.T, e0 = o * S.inner + i0;
  const Grad glast = GATHER ? gather(row(gc, rev ? 0 : T - 1), rows.g, w, false) : row(gc, rev ? 0 : T - 1);
#pragma GCC ivdep
  for (int64_t i = 0; i < w; ++i) { put_lam(lam, i, load_g_i(glast, i)); zero_pbar(q, e0 + i); }
  for (int64_t s = T - 1; s >= 1; --s) {
    const int64_t tc = rev ? T - 1 - s : s, tp = rev ? T - s : s - 1;
    const In xr = GATHER ? gather(row(xc, tc), rows.x, w, !rev) : row(xc, tc);
    const In yr = GATHER ? gather(row(yc, tp), rows.y, w, !rev) : row(yc, tp);
    const Grad gr = GATHER ? gather(row(gc, tp), rows.g, w, !rev) : row(gc, tp);
    const Bar br = row(bc, tc);
    fscan_lanes<LANE_BLOCK>(w, !rev, [&](int64_t i) {  // !rev: walking memory backwards
      Lam lb, rb;
      PLam pb;
      vjp(load_i(yr, i, tp), load_i(xr, i, tc), get_lam(lam, i), p, e0 + i, lb, rb, pb);
      store_bar_i(br, i, rb);
      put_lam(lam, i, lam_add(load_g_i(gr, i), lb));
      add_pbar(q, e0 + i, pb);
    });
  }
  const Bar bfirst = row(bc, rev ? T - 1 : 0);
#pragma GCC ivdep
  for (int64_t i = 0; i < w; ++i) store_bar_i(bfirst, i, get_lam(lam, i));
}

// --- Chains: few lanes (1-D, or a scan over the last dim), or lanes laid out along T (a
// transpose), G interleaved per thread, each lane in C chunks of steps. The adjoint
// recurrence lam[s-1] = g[s-1] + A_s^T lam[s] is linear, so a chunk [a, z) maps the lam
// its top step receives from above (in) to what its bottom step passes down
// (out = M in + o). With C > 1, pass 1: o and M (M's columns: the VJP of unit
// cotangents, NF extra VJPs a step, no stores); pass 2: each lane's chunk carries, top
// down. Pass 3: each chunk (again) from its true carry, storing the gradients; then the
// params' per-chunk sums are added in chunk order.
static constexpr int64_t MIN_CHUNK = 2048;
static constexpr int G = 8;

struct Chunk { In x, y; Grad g; Bar b; int64_t e, a, z; };  // a lane's start, position, steps [a, z)

static FSCAN_INLINE int64_t pos(int64_t s, int64_t T, bool rev) { return rev ? T - 1 - s : s; }

template <int NG>
static FSCAN_INLINE void transfer(const Par p, const Chunk* k, int64_t T, bool rev, Lam* out, Lam* M) {
  Lam lam[NG], U[NG][NF];
  int64_t n[NG], common = INT64_MAX;
  for (int c = 0; c < NG; ++c) {
    lam[c] = load_g_t(k[c].g, pos(k[c].z - 1, T, rev));
    for (int u = 0; u < NF; ++u) U[c][u] = lam_unit(u);
    n[c] = k[c].z - std::max<int64_t>(k[c].a, 1);
    common = std::min(common, n[c]);
    out[c] = lam_zero();
  }
  auto one = [&](int c, int64_t r) {
    const int64_t s = k[c].z - 1 - r, tc = pos(s, T, rev), tp = pos(s - 1, T, rev);
    const Vals l = load_t(k[c].y, tp, tp), v = load_t(k[c].x, tc, tc);
    Lam lb, rb; PLam pb;
    vjp(l, v, lam[c], p, k[c].e, lb, rb, pb);
    for (int u = 0; u < NF; ++u) { Lam ub, urb; PLam upb; vjp(l, v, U[c][u], p, k[c].e, ub, urb, upb); U[c][u] = ub; }
    if (s > k[c].a) lam[c] = lam_add(load_g_t(k[c].g, tp), lb); else out[c] = lb;
  };
  for (int64_t r = 0; r < common; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NG; ++c) one(c, r);
  }
  for (int c = 0; c < NG; ++c) {
    for (int64_t r = common; r < n[c]; ++r) one(c, r);
    for (int u = 0; u < NF; ++u) M[c * NF + u] = U[c][u];
  }
}

template <int NG>
static FSCAN_INLINE void finish(const Par p, const Chunk* k, int64_t T, bool rev, const Lam* in,
                                PLam* ptot) {
  Lam lam[NG]; PLam pacc[NG];
  int64_t n[NG], common = INT64_MAX;
  for (int c = 0; c < NG; ++c) {
    lam[c] = lam_add(load_g_t(k[c].g, pos(k[c].z - 1, T, rev)), in[c]);
    pacc[c] = plam_zero();
    n[c] = k[c].z - std::max<int64_t>(k[c].a, 1);
    common = std::min(common, n[c]);
  }
  auto one = [&](int c, int64_t r) {
    const int64_t s = k[c].z - 1 - r, tc = pos(s, T, rev), tp = pos(s - 1, T, rev);
    Lam lb, rb; PLam pb;
    vjp(load_t(k[c].y, tp, tp), load_t(k[c].x, tc, tc), lam[c], p, k[c].e, lb, rb, pb);
    store_bar_t(k[c].b, tc, rb);
    pacc[c] = plam_add(pacc[c], pb);
    if (s > k[c].a) lam[c] = lam_add(load_g_t(k[c].g, tp), lb);
  };
  for (int64_t r = 0; r < common; ++r) {
#pragma GCC unroll 8
    for (int c = 0; c < NG; ++c) one(c, r);
  }
  for (int c = 0; c < NG; ++c) {
    for (int64_t r = common; r < n[c]; ++r) one(c, r);
    if (k[c].a == 0) store_bar_t(k[c].b, pos(0, T, rev), lam[c]);
    ptot[c] = pacc[c];
  }
}

// What a chunk passes below its first step, walked from `in` (what the chunk above passes
// down): the exact answer where composing its transfer matrix is not (see lam_suspect),
// e.g. a product of gates that underflowed to 0 against an infinite cotangent.
static Lam walk_down(const Par p, const Chunk& k, int64_t T, bool rev, const Lam& in) {
  Lam lam = lam_add(load_g_t(k.g, pos(k.z - 1, T, rev)), in), out = lam_zero();
  for (int64_t s = k.z - 1; s >= std::max<int64_t>(k.a, 1); --s) {
    const int64_t tc = pos(s, T, rev), tp = pos(s - 1, T, rev);
    Lam lb, rb; PLam pb;
    vjp(load_t(k.y, tp, tp), load_t(k.x, tc, tc), lam, p, k.e, lb, rb, pb);
    if (s > k.a) lam = lam_add(load_g_t(k.g, tp), lb); else out = lb;
  }
  return out;
}

// Chunks per lane: 1 with lanes enough for the threads (and the interleave).
static int64_t chunks_per_lane(int64_t lanes, int64_t T, int nt) {
  if (lanes >= (int64_t)nt * G) return 1;
  int64_t C = std::min<int64_t>(((int64_t)nt * G + lanes - 1) / lanes, std::max<int64_t>(1, T / MIN_CHUNK));
  if (C >= G) C = C / G * G;
  return C;
}

static void chain_bwd(const In x, const In y, const Grad g, const Bar b, const PBar q, const Par p,
                      const Geo& S, bool rev, int nt, int64_t C) {
  const int64_t T = S.T, inner = S.inner, lanes = S.outer * inner;
  const int64_t L = (T + C - 1) / C;
  C = (T + L - 1) / L;
  const int64_t items = lanes * C, groups = (items + G - 1) / G;
  auto describe = [&](int64_t item) {
    const int64_t lane = item / C, c = item % C, o = lane / inner, i = lane % inner;
    return Chunk{at(x, S, o, 0, i), at(y, S, o, 0, i), at(g, S, o, 0, i), at(b, S, o, 0, i),
                 lane, c * L, std::min(T, (c + 1) * L)};
  };
  std::vector<Lam> outs(C > 1 ? items : 0), ins(items, lam_zero()), M(C > 1 ? items * NF : 0);
  std::vector<PLam> ptot(items);
#pragma omp parallel num_threads(nt)
  {
    Chunk k[G];
    if (C > 1) {
#pragma omp for schedule(static)
      for (int64_t gi = 0; gi < groups; ++gi) {
        const int ng = (int)std::min<int64_t>(G, items - gi * G);
        for (int c = 0; c < ng; ++c) k[c] = describe(gi * G + c);
        if (ng == G) transfer<G>(p, k, T, rev, &outs[gi * G], &M[gi * G * NF]);
        else for (int c = 0; c < ng; ++c) transfer<1>(p, k + c, T, rev, &outs[gi * G + c], &M[(gi * G + c) * NF]);
      }
#pragma omp for schedule(static)
      for (int64_t lane = 0; lane < lanes; ++lane) {
        Lam carry = lam_zero();  // what the chunk above passes down
        for (int64_t c = C - 1; c >= 0; --c) {
          const int64_t item = lane * C + c;
          ins[item] = carry;
          Lam next = outs[item];
          for (int u = 0; u < NF; ++u) next = lam_axpy(next, M[item * NF + u], carry, u);
          if (c > 0 && lam_suspect(outs[item], carry, next)) next = walk_down(p, describe(item), T, rev, carry);
          carry = next;
        }
      }
    }
#pragma omp for schedule(static)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int ng = (int)std::min<int64_t>(G, items - gi * G);
      for (int c = 0; c < ng; ++c) k[c] = describe(gi * G + c);
      if (ng == G) finish<G>(p, k, T, rev, &ins[gi * G], &ptot[gi * G]);
      else for (int c = 0; c < ng; ++c) finish<1>(p, k + c, T, rev, &ins[gi * G + c], &ptot[gi * G + c]);
    }
#pragma omp for schedule(static)
    for (int64_t lane = 0; lane < lanes; ++lane) {
      zero_pbar(q, lane);
      for (int64_t c = 0; c < C; ++c) add_pbar(q, lane, ptot[lane * C + c]);
    }
  }
}

static void backward(const In x, const In y, const Grad g, const Bar b, const PBar q, const Par p,
                     const Geo& S, bool rev, int threads) {
  if (S.T <= 0 || S.outer <= 0 || S.inner <= 0) return;
  const int64_t outer = S.outer, inner = S.inner;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, outer * S.T * inner / PER_THREAD));
  // As the forward: chains for few inner lanes or inputs laid out along T.
  if (inner < VEC_MIN || along(x) || along(y) || along(g)) {
    chain_bwd(x, y, g, b, q, p, S, rev, nt, chunks_per_lane(outer * inner, S.T, nt));
    return;
  }
  // Columns of up to TILE lanes (halved until every thread has one).
  int64_t W = std::min<int64_t>(inner, TILE);
  while (W > 16 && outer * ((inner + W - 1) / W) < nt) W = (W / 2 + 15) / 16 * 16;
  const int64_t ntiles = (inner + W - 1) / W, ncols = outer * ntiles;
  const bool dense = unit(x) && unit(y) && unit(g);
#pragma omp parallel num_threads(nt)
  {
    LamStore store(W);
    const BwdRows rows(dense ? 0 : W);
#pragma omp for schedule(static)
    for (int64_t col = 0; col < ncols; ++col) {
      const int64_t o = col / ntiles, i0 = (col % ntiles) * W, w = std::min(W, inner - i0);
      if (dense) lane_bwd<false>(x, y, g, b, q, p, S, o, i0, w, rev, store.buf(), rows);
      else lane_bwd<true>(x, y, g, b, q, p, S, o, i0, w, rev, store.buf(), rows);
    }
  }
}
"""


def step_argtypes(dtypes: Sequence[torch.dtype], program: Program) -> list[str]:
    """C types of the step kernel's arguments (see :func:`step_source`)."""
    st = [STORAGE[d] for d in dtypes]
    types = [f"const {c}*" for c in st] + [f"{c}*" for c in st]
    types += [f"const {_param_ctype(p.dtype)}*" for p in program.params]
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
    args += [f"const {_param_ctype(q.dtype)}* p{j}" for j, q in enumerate(program.params)]
    entry = (
        "static __attribute__((noinline)) Vals scalar_step(const In l, const In r, const Par p, "
        "int64_t i) { return combine(load_i(l, i, 0), load_i(r, i, 1), p, i); }\n"
        'extern "C" void kernel('
        + ", ".join(args)
        + ", int64_t n, int64_t vec) {\n"
        + "  const In l{"
        + ", ".join(unit(f"x{k}") for k in R)
        + "}; const In r{"
        + ", ".join(unit(f"x{k} + n") for k in R)
        + "}; const Out y{"
        + ", ".join(unit(f"y{k}") for k in R)
        + "}; const Par p{"
        + ", ".join(f"p{j}" for j in range(len(program.params)))
        + "};\n"
        + "  if (vec) fscan_lanes<LANE_BLOCK>(n, false, [&](int64_t i) "
        "{ store_i(y, i, combine(load_i(l, i, 0), load_i(r, i, 1), p, i)); });\n"
        + "  else for (int64_t i = 0; i < n; ++i) store_i(y, i, scalar_step(l, r, p, i));\n}\n"
    )
    return "\n".join(
        [
            PRELUDE,
            mvec_declarations(),
            _structs(dtypes, compute, program),
            _combine_function(compute, program),
            entry,
        ]
    )
