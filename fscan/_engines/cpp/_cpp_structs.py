# ruff: noqa: E501  (generated C++ lines keep their own lengths)
"""The generated part of the kernels' C++: one element's values, the leaves' pointers.

For leaves of given dtypes and a translated combine (:class:`~._cpp_codegen.Program`)
this writes the structs and accessors the fixed C++ (``csrc/*.h``) is written
against: ``Vals`` (one element's values), ``In``/``Out`` (strided pointers to the
leaves, with row buffers for layouts whose inner stride is not 1), ``Heads`` (a
carry-in), ``Buf``/``Store`` (running values), ``Par`` (the broadcast params) and
their loads and stores; for the backward, ``Lam`` (cotangents), ``Grad``/``Bar``
and the params' sums (``PLam``/``PBar``). Also the C types
params are passed in. :mod:`._cpp_source` places these into the
kernels' templates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._cpp_ops import STORAGE, Program

__all__ = [
    "STRIDES",
    "backward_structs",
    "leaf_structs",
    "needed",
    "param_ctype",
    "param_dtype",
]


def _load(dtype: torch.dtype, expr: str, ctype: str, walked: bool = False) -> str:
    """A load of ``expr`` into ``ctype``; ``walked``: in a walk a step at a time (``load_t``),
    where float16 converts by its one instruction instead of the bit arithmetic that the
    lane loops' vectoriser packs (see fscan_f16_load in csrc/prelude.h)."""
    if dtype == torch.bfloat16:
        return f"static_cast<{ctype}>(fscan_bf16_load({expr}))"
    if dtype == torch.float16:
        return f"static_cast<{ctype}>(fscan_f16_{'walk' if walked else 'load'}({expr}))"
    if dtype == torch.bool:
        return f"({expr} != 0)"
    return f"static_cast<{ctype}>({expr})"


def _store(dtype: torch.dtype, expr: str, walked: bool = False) -> str:
    """A store of ``expr`` (see :func:`_load`)."""
    if dtype == torch.bfloat16:
        return f"fscan_bf16_store(static_cast<float>({expr}))"
    if dtype == torch.float16:
        return f"fscan_f16_{'put' if walked else 'store'}(static_cast<float>({expr}))"
    return f"static_cast<{STORAGE[dtype]}>({expr})"


def _strided(name: str, fields: Sequence[tuple[str, str]], extra: str = "") -> list[str]:
    """A struct ``name`` of strided pointers (``fields``: member name, pointee C type; then
    the members ``extra`` declares) and its placement helpers: ``at`` (a lane at a step),
    ``row`` (step t from a lane's start), ``unit`` (every inner stride is 1), ``along``
    (some member is laid out along T: its T stride, nonzero, is below its inner stride) and
    ``steps_dense`` (every member's steps next to each other, or one element: a lane walked
    alone is one stream through memory)."""
    members = " ".join(f"Ptr<{c}> {f};" for f, c in fields) + extra
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
        f"static FSCAN_INLINE bool steps_dense(const {name} x) {{ (void)x; return true"
        + "".join(f" && (x.{f}.st == 1 || x.{f}.st == 0)" for f, _ in fields)
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


def leaf_structs(
    dtypes: Sequence[torch.dtype],
    compute: Sequence[str],
    program: Program,
    positions: Sequence[int] = (),
    dropped: Sequence[int] = (),
) -> str:
    """Vals/In/Out/Buf/Par and their accessors for leaves of ``dtypes``; the leaves in
    ``positions`` are not read: loads give them the position ``t`` along the scan dim
    plus ``In::pos0`` (0 unless the forward kernel's entry sets it: the position of the
    first step of a view that starts later in a larger input);
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

    def loads(ref: str, walked: bool = False) -> str:
        return " ".join(
            f"v.v{k} = static_cast<{compute[k]}>(t + x.pos0);"
            if k in positions
            else f"v.v{k} = {_load(dtypes[k], ref.format(f=f'x.x{k}'), compute[k], walked)};"
            for k in R
        )

    lines = [
        f"static constexpr int64_t LANE_BLOCK = {max(16, 64 // narrowest)};",
        "struct Vals { " + " ".join(f"{bt[k]} v{k};" for k in R) + " };",
        *_strided(
            "In",
            [(f"x{k}", f"const {st[k]}") for k in read],
            " int64_t pos0 = 0;" * bool(positions),
        ),
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
        + " ".join(f"const {param_ctype(p.dtype)}* p{j};" for j, p in enumerate(program.params))
        + " };",
        "static FSCAN_INLINE Vals load_i(const In x, int64_t i, int64_t t) "
        "{ Vals v; (void)x; (void)i; (void)t; " + loads("lane<true>({f}, i)") + " return v; }",
        "static FSCAN_INLINE Vals load_t(const In x, int64_t k, int64_t t) "
        "{ Vals v; (void)x; (void)k; (void)t; "
        + loads("step({f}, k)", walked=True)
        + " return v; }",
        "static FSCAN_INLINE void store_i(const Out y, int64_t i, const Vals& v) { "
        "(void)y; (void)i; (void)v; "
        + " ".join(f"lane<true>(y.y{k}, i) = {_store(dtypes[k], f'v.v{k}')};" for k in kept)
        + " }",
        "static FSCAN_INLINE void store_t(const Out y, int64_t t, const Vals& v) { "
        "(void)y; (void)t; (void)v; "
        + " ".join(f"step(y.y{k}, t) = {_store(dtypes[k], f'v.v{k}', True)};" for k in kept)
        + " }",
        "static FSCAN_INLINE Vals get(const Buf b, int64_t i) { Vals v; (void)b; (void)i; "
        + " ".join(f"v.v{k} = b.v{k}[i];" if k in live else f"v.v{k} = 0;" for k in R)
        + " return v; }",
        "static FSCAN_INLINE void put(const Buf b, int64_t i, const Vals& v) { "
        "(void)b; (void)i; (void)v; " + " ".join(f"b.v{k}[i] = v.v{k};" for k in live) + " }",
        # Every leaf: a chunk's total is the right operand of the carries composed from
        # it, whose gates (e.g.) a kept output reads though it is not kept itself.
        *_buffer_access("get_all", "put_all", "Vals", "Buf", len(R)),
        "template <bool ALL> static FSCAN_INLINE Vals get_as(const Buf b, int64_t i) "
        "{ return ALL ? get_all(b, i) : get(b, i); }",
        "template <bool ALL> static FSCAN_INLINE void put_as(const Buf b, int64_t i, const Vals& v) "
        "{ if (ALL) put_all(b, i, v); else put(b, i, v); }",
        "static FSCAN_INLINE Buf offset(const Buf b, int64_t i) { return Buf{"
        + ", ".join(f"b.v{k} + i" for k in R)
        + "}; }",
        _buffer_store("Store", "Buf", bt),
    ]
    return "\n".join(lines)


def _buffer_access(get: str, put: str, vals: str, buf: str, n: int) -> list[str]:
    """``get``/``put``: one position of a struct ``vals`` of ``n`` values ``v0..`` read
    from and written to the buffers ``buf`` (a pointer per value)."""
    return [
        f"static FSCAN_INLINE {vals} {get}(const {buf} b, int64_t i) {{ {vals} v; "
        + " ".join(f"v.v{k} = b.v{k}[i];" for k in range(n))
        + " return v; }",
        f"static FSCAN_INLINE void {put}(const {buf} b, int64_t i, const {vals}& v) {{ "
        + " ".join(f"b.v{k}[i] = v.v{k};" for k in range(n))
        + " }",
    ]


def _buffer_store(store: str, buf: str, types: Sequence[str]) -> str:
    """``store``: owned buffers of ``n`` positions, one per value type, and ``buf()``,
    the pointers ``buf`` to them."""
    R = range(len(types))
    return (
        f"struct {store} {{ "
        + " ".join(f"std::unique_ptr<{types[k]}[]> v{k};" for k in R)
        + f" explicit {store}(int64_t n) : "
        + ", ".join(f"v{k}(new {types[k]}[n > 0 ? n : 1])" for k in R)
        + f" {{}} {buf} buf() {{ return {buf}{{"
        + ", ".join(f"v{k}.get()" for k in R)
        + "}; } };"
    )


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


def param_ctype(dtype: torch.dtype) -> str:
    """Params enter as float64, int64 or bool bytes (see :func:`param_dtype`)."""
    if dtype.is_floating_point:
        return "double"
    return "uint8_t" if dtype == torch.bool else "int64_t"


def param_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a param of ``dtype`` is passed in (exact for every supported dtype)."""
    if dtype.is_floating_point:
        return torch.float64
    return torch.bool if dtype == torch.bool else torch.int64


def backward_structs(
    dtypes: Sequence[torch.dtype],
    lam_types: Sequence[str],
    floats: Sequence[int],
    pfloats: Sequence[int],
    dead: Sequence[int] = (),
) -> list[str]:
    """The backward kernel's structs beyond the forward's: ``Lam`` (the cotangents of the
    leaves ``floats``, in ``lam_types``), ``Grad``/``Bar`` (the cotangents read and the
    gradients written), ``LamBuf``/``LamStore``, the params' sums ``PLam``/``PBar``
    (``pfloats``) and the ``lam_*`` helpers ``csrc/backward.h`` uses. The ``dead``
    leaves' cotangents (see :func:`~._cpp_codegen.translate_vjp`) are the constant 0:
    no ``Grad`` member, never stored or loaded, ``lam_dead`` true."""
    F = list(floats)
    st = [STORAGE[d] for d in dtypes]
    J = range(len(F))
    gone = [j for j, k in enumerate(F) if k in dead]
    read = [j for j in J if j not in gone]

    def g_load(access: str, walked: bool = False) -> str:
        return " ".join(
            f"v.v{j} = 0;"
            if j in gone
            else f"v.v{j} = {_load(dtypes[k], access.format(g=f'g.g{j}'), lam_types[j], walked)};"
            for j, k in enumerate(F)
        )

    return [
        "struct Lam { " + " ".join(f"{lam_types[j]} v{j};" for j in J) + " };",
        *_strided("Grad", [(f"g{j}", f"const {st[F[j]]}") for j in read]),
        *_gathered("Grad", [(f"g{j}", f"const {st[F[j]]}") for j in read]),
        *_strided("Bar", [(f"b{j}", st[k]) for j, k in enumerate(F)]),
        "struct LamBuf { " + " ".join(f"{lam_types[j]}* v{j};" for j in J) + " };",
        "static FSCAN_INLINE Lam load_g_i(const Grad g, int64_t i) { (void)g; (void)i; Lam v; "
        + g_load("lane<true>({g}, i)")
        + " return v; }",
        "static FSCAN_INLINE Lam load_g_t(const Grad g, int64_t t) { (void)g; (void)t; Lam v; "
        + g_load("step({g}, t)", walked=True)
        + " return v; }",
        "static FSCAN_INLINE void store_bar_i(const Bar b, int64_t i, const Lam& v) { "
        + " ".join(
            f"lane<true>(b.b{j}, i) = {_store(dtypes[k], f'v.v{j}')};" for j, k in enumerate(F)
        )
        + " }",
        "static FSCAN_INLINE void store_bar_t(const Bar b, int64_t t, const Lam& v) { "
        + " ".join(
            f"step(b.b{j}, t) = {_store(dtypes[k], f'v.v{j}', True)};" for j, k in enumerate(F)
        )
        + " }",
        "static FSCAN_INLINE Lam get_lam(const LamBuf b, int64_t i) { (void)b; (void)i; Lam v; "
        + " ".join(f"v.v{j} = 0;" if j in gone else f"v.v{j} = b.v{j}[i];" for j in J)
        + " return v; }",
        "static FSCAN_INLINE void put_lam(const LamBuf b, int64_t i, const Lam& v) { (void)b; (void)i; (void)v; "
        + " ".join(f"b.v{j}[i] = v.v{j};" for j in read)
        + " }",
        "static FSCAN_INLINE constexpr bool lam_dead(int u) { (void)u; return false"
        + "".join(f" || u == {j}" for j in gone)
        + "; }",
        "static FSCAN_INLINE Lam lam_add(const Lam& a, const Lam& b) { Lam v; "
        + " ".join(f"v.v{j} = a.v{j} + b.v{j};" for j in J)
        + " return v; }",
        # A carry composed through a chunk's transfer matrix (a product of Jacobians)
        # that turns NaN from non-NaN operands or infinite from finite ones: see
        # walk_down in csrc/backward.h, and suspect() in the forward.
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
        _buffer_store("LamStore", "LamBuf", lam_types),
    ]


STRIDES = ("sa", "sb", "st", "si")  # per strided input: see Ptr in csrc/prelude.h
