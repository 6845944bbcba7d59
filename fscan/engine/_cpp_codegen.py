"""Trace a pointwise ``combine_fn`` to elementwise aten ops and translate it to C++.

``combine_fn`` on flat leaves is traced once with ``make_fx`` (core ATen
decompositions) on small example tensors of the leaf dtypes. Every node must be
an elementwise op of the table below; anything else raises :class:`Unsupported`,
and the caller runs fscan's torch engine instead. Nodes that do not depend on
the leaves (they only read tensors ``combine_fn`` closes over, or constants)
form a *prologue*: it is evaluated with torch at each call, on that call's
captured tensors, and its results enter the kernel as extra inputs broadcast to
one element. The rest becomes a C++ function ``combine(l, r, p, e)`` over one
element position.

Compute types: float64 in ``double``; float16/bfloat16 in ``float``; float32 in
``double`` when the combine rounds (add, mul, exp...), so a sequential
accumulation rounds once per stored output, and in ``float`` when it is exact
(max, min, where, comparisons); integers in their own type; bool as ``bool``
(stored as bytes). In a float32 combine computed in double, transcendental
functions (exp, log1p, tanh...) still run in float, on their argument rounded
to float, as eager float32 runs them: their vector versions are twice as wide,
and the accumulation, which is what grows the error of a long scan, stays double
(``logaddexp``'s scan stays as accurate as ``torch.logcumsumexp``, which
accumulates in double).

Semantics: each op computes what eager torch computes for its dtype, special
values included (tests/test_cpu_kernel_ops.py checks every op on every dtype
against eager): operands are converted as torch converts them (an int64 to float32
rounds once, to float; a Python number is rounded to the op's dtype, or kept at
float in products and quotients of half types, as torch's scalar path does);
integers wrap; bools stay 0 or 1 (``~`` is ``!``); ``pow``, ``fmax``, ``clamp``,
``sign``, ``relu`` and add with ``alpha`` follow ATen's kernels. A value held wider
than its dtype keeps that precision but takes its dtype's range (overflow is inf,
underflow 0, as rounding would make them: ``a * b * 0`` is NaN where ``a * b``
overflows); discrete ops (comparisons, floor, sign, conversions) read it rounded to
its dtype. Ops that raise in torch for some values (integer division: a zero
divisor) are not translated.

Example:
    >>> import optree, torch
    >>> _, spec = optree.tree_flatten(0)
    >>> program = translate_combine(lambda a, b: a + b, spec, [torch.float64], (), [])
    >>> print(program.body)
    const double v0 = static_cast<double>((static_cast<double>(l0) + static_cast<double>(r0)));
    o0 = static_cast<double>(v0);
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from optree import PyTreeSpec

__all__ = [
    "COMPUTING_OPS",
    "DTYPES",
    "Program",
    "Unsupported",
    "translate_combine",
    "translate_param_vjp",
    "translate_vjp",
]


class Unsupported(Exception):
    """The kernel cannot serve this ``combine_fn`` (an op, dtype or structure it lacks)."""


# Storage C type of each supported leaf dtype (bool as bytes: GCC if-converts selects on
# loaded bytes, not on loaded C++ bools; half types as their bits or _Float16).
STORAGE = {
    torch.bool: "uint8_t",
    torch.uint8: "uint8_t",
    torch.int8: "int8_t",
    torch.int16: "int16_t",
    torch.int32: "int32_t",
    torch.int64: "int64_t",
    torch.float16: "_Float16",
    torch.bfloat16: "uint16_t",
    torch.float32: "float",
    torch.float64: "double",
}
DTYPES = frozenset(STORAGE)
_COMPUTE = {**STORAGE, torch.bool: "bool", torch.float16: "float", torch.bfloat16: "float"}

# Ops whose float results are exact (no rounding): a float32 combine of only these
# (max, min, selects, comparisons...) needs no double accumulator.
_EXACT = frozenset(
    {
        "maximum",
        "minimum",
        "fmax",
        "fmin",
        "where",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "logical_and",
        "logical_or",
        "logical_xor",
        "logical_not",
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
        "bitwise_not",
        "neg",
        "abs",
        "clamp",
        "relu",
        "isnan",
        "isinf",
        "floor",
        "ceil",
        "trunc",
        "round",
        "sign",
        "scalar_tensor",
        "full",
    }
    | {"clone", "alias", "detach", "lift_fresh_copy", "_to_copy", "copy", "view", "expand"}
)
# Ops that make a combine compute-bound (libm calls).
_EXPENSIVE = frozenset(
    {"exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "tanh", "sin", "cos", "tan"}
    | {"erf", "erfc", "sinh", "cosh", "asin", "acos", "atan", "asinh", "acosh", "atanh"}
    | {"lgamma", "pow", "atan2", "sigmoid", "sqrt", "rsqrt"}
)
_BINARY = {
    "add": "({a} + {b})",
    "sub": "({a} - {b})",
    "mul": "({a} * {b})",
    "div": "({a} / {b})",
    "maximum": "fscan_max({a}, {b})",
    "minimum": "fscan_min({a}, {b})",
    "fmax": "fscan_fmax({a}, {b})",
    "fmin": "fscan_fmin({a}, {b})",
    "atan2": "std::atan2({a}, {b})",
    "pow": "std::pow({a}, {b})",
    "bitwise_and": "({a} & {b})",
    "bitwise_or": "({a} | {b})",
    "bitwise_xor": "({a} ^ {b})",
}
_LOGICAL = {"logical_and": "&&", "logical_or": "||", "logical_xor": "!="}
_COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_UNARY = {
    "neg": "(-{a})",
    "bitwise_not": "(~{a})",
    "reciprocal": "(1 / {a})",
    "isnan": "({a} != {a})",
    "isinf": "std::isinf({a})",
    "sigmoid": "(1 / (1 + std::exp(-{a})))",
    "relu": "fscan_relu({a})",
    "round": "std::nearbyint({a})",
    "sign": "fscan_sign({a})",
    "abs": "fscan_abs({a})",
}
# Rounding ops that leave an integer as it is (torch.round of an int64 is that int64).
_INTEGER_IDENTITY = frozenset({"round", "floor", "ceil", "trunc"})
# Ops that are not continuous: they read their operands rounded to the dtype (_value).
_DISCRETE = _INTEGER_IDENTITY | {"sign"}
# Products and quotients of a half or bfloat16 tensor and a Python number take the
# number at float precision (torch's scalar path); other ops round it to the dtype.
_OPMATH_SCALAR = frozenset({"mul", "div"})
# pow(x, c) for these c, as torch computes them (pow_tensor_scalar): exact products,
# sqrt, rsqrt or a reciprocal, not std::pow (pow(-inf, 0.5) is inf, sqrt(-inf) NaN).
_POW_SPECIAL = (0, 1, 2, 3, -1, -2, 0.5, -0.5)
_HALVES = (torch.float16, torch.bfloat16)
_LIBM = [
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "log2",
    "log10",
    "sqrt",
    "tanh",
    "sin",
    "cos",
    "tan",
    "erf",
    "erfc",
    "floor",
    "ceil",
    "trunc",
    "sinh",
    "cosh",
    "asin",
    "acos",
    "atan",
    "asinh",
    "acosh",
    "atanh",
    "lgamma",
]
# Functions a float32 combine evaluates in float even when it computes in double:
# everything of _LIBM but the correctly rounded (sqrt) and exact (floor...) ones.
_FLOAT_MATH = frozenset(_LIBM) - {"sqrt", "floor", "ceil", "trunc"}
# The ops that compute (views and copies aside): what tests/test_cpu_kernel_ops.py
# checks one by one against eager torch.
COMPUTING_OPS = (
    (frozenset(_BINARY) | frozenset(_LOGICAL) | frozenset(_COMPARE) | frozenset(_UNARY))
    | frozenset(_LIBM)
    | {"logical_not", "rsqrt", "where", "clamp", "_to_copy"}
)
_IDENTITY = frozenset({"clone", "alias", "detach", "lift_fresh_copy", "_to_copy", "copy"})
# Views allowed on leaf-dependent values: they only broadcast, which is implicit per element.
_BROADCASTS = frozenset({"expand", "view", "unsqueeze", "squeeze", "reshape", "_unsafe_view"})


@dataclass(frozen=True)
class Param:
    """A kernel input computed by the prologue: broadcast to one element, of ``dtype``."""

    dtype: torch.dtype


@dataclass(frozen=True)
class Program:
    """The C++ translation of a traced function over one element position.

    ``body`` assigns outputs ``o0..`` from inputs ``l0.., r0..`` (and ``c0..`` for a
    VJP) of the compute types and params ``p0[e]..``. ``prologue(captured)`` returns
    the params' values for one call, from that call's captured tensors.
    ``reads[k]``: the inputs (names) output ``k`` depends on, where known (else empty:
    assume all), so a kernel that drops outputs can drop what only they need.
    """

    body: str
    params: tuple[Param, ...]
    prologue: Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
    wide: bool
    expensive: bool
    reads: tuple[frozenset[str], ...] = ()


def compute_ctype(dtype: torch.dtype, wide: bool) -> str:
    """The C type ``dtype`` values are computed in."""
    if wide and dtype == torch.float32:
        return "double"
    try:
        return _COMPUTE[dtype]
    except KeyError:
        raise Unsupported(f"dtype {dtype}") from None


# make_fx and the decompositions share process-wide tracing state: one trace at a time.
_trace_lock = threading.Lock()


def _examples(dtypes: Sequence[torch.dtype], element: Sequence[int]) -> list[torch.Tensor]:
    # Distinct tensors (make_fx maps identity to graph inputs), two elements of the call's
    # element shape: the trace holds what combine_fn does at exactly this shape (a slice
    # over a whole dimension, say, traces as an alias), so the kernel is keyed by it.
    return [torch.ones((2, *element), dtype=d) for d in dtypes]


def _make_fx(fn: Callable[..., Any], examples: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    with _trace_lock, torch.no_grad():
        return make_fx(fn, decomposition_table=core_aten_decompositions())(*examples)


def translate_combine(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    dtypes: Sequence[torch.dtype],
    element: Sequence[int],
    captured: Sequence[torch.Tensor],
) -> Program:
    """Trace ``combine_fn`` on flat leaves of ``dtypes`` (elements of shape ``element``)
    and translate it.

    ``captured`` are the tensors ``combine_fn`` closes over, in a fixed walk order; the
    prologue takes a list in the same order at each call.
    """
    return _forward_translator(combine_fn, spec, dtypes, element, captured)[1]


def _flat(combine_fn: Callable[[Any, Any], Any], spec: PyTreeSpec, n: int) -> Callable[..., Any]:
    """``combine_fn`` on ``2 n`` flat leaves (left then right), returning flat leaves."""

    def flat(*args: torch.Tensor) -> list[torch.Tensor]:
        left = optree.tree_unflatten(spec, list(args[:n]))
        right = optree.tree_unflatten(spec, list(args[n:]))
        out, out_spec = optree.tree_flatten(combine_fn(left, right), none_is_leaf=False)
        if out_spec != spec:
            raise Unsupported("combine_fn returned another pytree structure")
        return out

    return flat


def _forward_translator(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    dtypes: Sequence[torch.dtype],
    element: Sequence[int],
    captured: Sequence[torch.Tensor],
) -> tuple[_Translator, Program]:
    n = len(dtypes)
    flat = _flat(combine_fn, spec, n)
    gm = _make_fx(flat, _examples(dtypes, element) + _examples(dtypes, element))
    names = [f"l{k}" for k in range(n)] + [f"r{k}" for k in range(n)]
    wide = _rounds(gm) and torch.float32 in dtypes
    translator = _Translator(gm, names, captured, wide, element)
    return translator, translator.program(list(dtypes))


def translate_vjp(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    dtypes: Sequence[torch.dtype],
    element: Sequence[int],
    captured: Sequence[torch.Tensor],
) -> tuple[Program, list[int]]:
    """The VJP of ``combine_fn`` w.r.t. both operands' float leaves, translated.

    Inputs ``l0.., r0..`` (all leaves) and ``c0..`` (cotangents of the float leaves);
    outputs ``o0..`` (left cotangents) then the right ones. Returns the program and
    the indices of the float leaves. Compute types as for the forward.
    """
    n = len(dtypes)
    floats = [k for k, d in enumerate(dtypes) if d.is_floating_point]
    if not floats:
        raise Unsupported("no float leaf to differentiate")

    def flat(*args: torch.Tensor) -> list[torch.Tensor]:
        ls, rs, cs = list(args[:n]), list(args[n : 2 * n]), list(args[2 * n :])

        def f(lf: list[torch.Tensor], rf: list[torch.Tensor]) -> list[torch.Tensor]:
            lft, rgt = list(ls), list(rs)
            for j, k in enumerate(floats):
                lft[k], rgt[k] = lf[j], rf[j]
            out = optree.tree_leaves(
                combine_fn(optree.tree_unflatten(spec, lft), optree.tree_unflatten(spec, rgt)),
                none_is_leaf=False,
            )
            return [out[k] for k in floats]

        _, pull = torch.func.vjp(f, [ls[k] for k in floats], [rs[k] for k in floats])
        lbar, rbar = pull(cs)
        return [*lbar, *rbar]

    examples = _examples(dtypes, element) + _examples(dtypes, element)
    examples += _examples([dtypes[k] for k in floats], element)
    functional = torch.func.functionalize(flat, remove="mutations_and_views")
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    with _trace_lock:
        gm = make_fx(functional, decomposition_table=core_aten_decompositions())(*examples)
    names = [f"l{k}" for k in range(n)] + [f"r{k}" for k in range(n)]
    names += [f"c{k}" for k in floats]
    out_dtypes = [dtypes[k] for k in floats] * 2
    wide = _rounds(gm) and torch.float32 in dtypes
    # The cotangents of float32 leaves sum in double (the backward kernel's lam): keep
    # what is computed from them in double too.
    wide_c = [f"c{k}" for k in floats if dtypes[k] == torch.float32]
    translator = _Translator(gm, names, captured, wide, element, wide_c)
    return translator.program(out_dtypes), floats


def translate_param_vjp(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    dtypes: Sequence[torch.dtype],
    element: Sequence[int],
    captured: Sequence[torch.Tensor],
) -> tuple[Program, list[int], list[int]]:
    """The VJP of ``combine_fn`` w.r.t. both operands' float leaves *and* its float
    params (what it computes from the tensors it closes over), translated.

    The forward is traced first; its prologue stays the params' source, and its
    leaf-dependent part becomes a function of the leaves and the params, whose VJP
    is traced on params of a whole element's shape: their cotangents are then
    per element position (the kernel sums them over the steps, the caller over
    the positions a param broadcasts to). Outputs ``o0..``: left cotangents, right
    cotangents, then the params' cotangents. Returns the program (with the
    forward's params and prologue), the float leaves and the float params.
    """
    forward_translator, forward = _forward_translator(combine_fn, spec, dtypes, element, captured)
    n, npar = len(dtypes), len(forward.params)
    floats = [k for k, d in enumerate(dtypes) if d.is_floating_point]
    pfloats = [j for j, p in enumerate(forward.params) if p.dtype.is_floating_point]
    if not floats or not pfloats:
        raise Unsupported("no float leaf or float captured tensor to differentiate")
    run = _leaf_part(forward_translator)

    def flat(*args: torch.Tensor) -> list[torch.Tensor]:
        ls, rs = list(args[:n]), list(args[n : 2 * n])
        ps, cs = list(args[2 * n : 2 * n + npar]), list(args[2 * n + npar :])

        def f(lf: list[torch.Tensor], rf: list[torch.Tensor], pf: list[torch.Tensor]) -> Any:
            lft, rgt, pv = list(ls), list(rs), list(ps)
            for j, k in enumerate(floats):
                lft[k], rgt[k] = lf[j], rf[j]
            for j, q in enumerate(pfloats):
                pv[q] = pf[j]
            out = run(lft + rgt, pv)
            return [out[k] for k in floats]

        primals = ([ls[k] for k in floats], [rs[k] for k in floats], [ps[q] for q in pfloats])
        _, pull = torch.func.vjp(f, *primals)
        lbar, rbar, pbar = pull(cs)
        return [*lbar, *rbar, *pbar]

    examples = _examples(dtypes, element) + _examples(dtypes, element)
    examples += _examples([p.dtype for p in forward.params], element)
    examples += _examples([dtypes[k] for k in floats], element)
    functional = torch.func.functionalize(flat, remove="mutations_and_views")
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    with _trace_lock:
        gm = make_fx(functional, decomposition_table=core_aten_decompositions())(*examples)
    names = [f"l{k}" for k in range(n)] + [f"r{k}" for k in range(n)]
    names += [f"P{j}" for j in range(npar)] + [f"c{k}" for k in floats]
    out_dtypes = [dtypes[k] for k in floats] * 2 + [forward.params[q].dtype for q in pfloats]
    wide = _rounds(gm) and torch.float32 in dtypes
    wide_c = [f"c{k}" for k in floats if dtypes[k] == torch.float32]
    vjp = _Translator(gm, names, (), wide, element, wide_c).program(out_dtypes)
    if vjp.params:  # the VJP reads nothing but its inputs and constants
        raise Unsupported("the VJP of combine_fn reads tensors of its own")
    program = Program(vjp.body, forward.params, forward.prologue, vjp.wide, vjp.expensive)
    return program, floats, pfloats


def _leaf_part(translator: _Translator) -> Callable[[list[Any], list[Any]], list[Any]]:
    """The leaf-dependent nodes of a translated forward graph as a function of the
    leaves and the params (the prologue's results), for tracing its VJP."""
    nodes = list(translator.gm.graph.nodes)
    params = {node: j for j, node in enumerate(translator.param_nodes)}
    dynamic = translator.dynamic

    def run(inputs: list[Any], ps: list[Any]) -> list[Any]:
        env: dict[torch.fx.Node, Any] = {}
        load = lambda a: env[a] if isinstance(a, torch.fx.Node) else a
        feed = iter(inputs)
        for node in nodes:
            if node.op == "placeholder":
                env[node] = next(feed)
            elif node in params:
                env[node] = ps[params[node]]
            elif node.op == "output":
                return [load(o) for o in node.args[0]]
            elif node in dynamic or _fill_value(node) is not None:
                args = torch.fx.node.map_aggregate(node.args, load)
                kwargs = torch.fx.node.map_aggregate(node.kwargs, load)
                env[node] = node.target(*args, **kwargs)
        raise Unsupported("a traced graph without output")

    return run


def _rounds(gm: torch.fx.GraphModule) -> bool:
    """Whether any op of ``gm`` may round a float result (a division by a power of two
    only scales, as in the backward of ``maximum``, which splits ties in halves)."""
    return any(
        node.op == "call_function" and _op_name(node.target) not in _EXACT and not _halves(node)
        for node in gm.graph.nodes
    )


def _halves(node: torch.fx.Node) -> bool:
    if _op_name(node.target) != "div" or len(node.args) != 2 or node.kwargs:
        return False
    divisor = node.args[1]
    if isinstance(divisor, torch.fx.Node):
        divisor = _fill_value(divisor)
    return _power_of_two_reciprocal(divisor) is not None


def _op_name(target: Any) -> str:
    return getattr(target, "_opname", None) or getattr(target, "__name__", str(target))


def _cpp_const(value: Any, ctype: str) -> str:
    if isinstance(value, bool):
        return f"static_cast<{ctype}>({'true' if value else 'false'})"
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise Unsupported(f"integer constant {value} out of range")
        return f"static_cast<{ctype}>(INT64_C({value}))" if value != -(2**63) else "INT64_MIN"
    if isinstance(value, float):
        if math.isnan(value):
            return f"std::numeric_limits<{ctype}>::quiet_NaN()"
        if math.isinf(value):
            sign = "-" if value < 0 else ""
            return f"({sign}std::numeric_limits<{ctype}>::infinity())"
        return f"static_cast<{ctype}>({float.hex(value)})"  # exact, in C++17 hex float
    raise Unsupported(f"constant {value!r} of type {type(value).__name__}")


class _Translator:
    """One pass over a traced graph: split the prologue off, then emit C++ statements."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        input_names: Sequence[str],
        captured: Sequence[torch.Tensor],
        wide: bool,
        element: Sequence[int],
        wide_inputs: Sequence[str] = (),
    ) -> None:
        self.gm = gm
        self.wide = wide
        # Values computed in double even when the rest is not (float32 only): those
        # derived from the inputs named in wide_inputs (a VJP's cotangents, which sum
        # along the whole scan in a double buffer: rounding them to float each step
        # would make that sum a float32 accumulation).
        self.wide_nodes: set[torch.fx.Node] = set()
        self.node_wide = False  # whether the node being emitted is one of them
        self.full = (2, *element)  # every value that depends on the operands has this shape
        self.names: dict[torch.fx.Node, str] = {}
        # Nodes whose value other ops read rounded to their dtype: the unrounded value.
        self.exact: dict[torch.fx.Node, str] = {}
        placeholders = [nd for nd in gm.graph.nodes if nd.op == "placeholder"]
        for node, name in zip(placeholders, input_names):
            self.names[node] = name
            if name in wide_inputs:
                self.wide_nodes.add(node)
        self.dynamic = set(placeholders)
        self.captured_ids = {id(t): i for i, t in enumerate(captured)}
        self.lines: list[str] = []
        self.param_nodes: list[torch.fx.Node] = []
        self.expensive = False

    def program(self, out_dtypes: Sequence[torch.dtype]) -> Program:
        static: list[torch.fx.Node] = []
        params: list[torch.fx.Node] = []
        constants: dict[torch.fx.Node, Any] = {}
        for node in self.gm.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":
                constants[node] = self._constant(node)
                static.append(node)
                continue
            if node.op != "call_function":
                raise Unsupported(f"graph node {node.op} {node.target}")
            if _op_name(node.target) == "_local_scalar_dense":
                raise Unsupported("combine_fn reads a tensor's value into Python (.item())")
            if not any(a in self.dynamic for a in node.all_input_nodes):
                static.append(node)
                continue
            for a in node.all_input_nodes:
                if a not in self.dynamic and a not in self.names and _fill_value(a) is None:
                    self.names[a] = f"P{len(params)}"
                    params.append(a)
            self.dynamic.add(node)
            self._emit(node)
        self._emit_outputs(out_dtypes)
        self.param_nodes = params
        param_specs = tuple(Param(_dtype(p)) for p in params)
        prologue = _Prologue(static, params, constants)
        self._release_constants(constants)
        body = "\n".join(self.lines)
        return Program(body, param_specs, prologue, self.wide, self.expensive, self._reads())

    def _reads(self) -> tuple[frozenset[str], ...]:
        """The input names each output depends on (through any node of the graph)."""
        reads: dict[torch.fx.Node, frozenset[str]] = {}
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                reads[node] = frozenset([self.names[node]]) if node in self.names else frozenset()
            elif node.op != "output":
                reads[node] = frozenset().union(*(reads[a] for a in node.all_input_nodes))
        (output,) = [nd for nd in self.gm.graph.nodes if nd.op == "output"]
        return tuple(
            reads[o] if isinstance(o, torch.fx.Node) else frozenset() for o in output.args[0]
        )

    def _constant(self, node: torch.fx.Node) -> Any:
        value = getattr(self.gm, node.target)
        if isinstance(value, torch.Tensor) and id(value) in self.captured_ids:
            return ("captured", self.captured_ids[id(value)])
        made_inside = all(_op_name(user.target) == "lift_fresh_copy" for user in node.users)
        if (
            made_inside
            and isinstance(value, torch.Tensor)
            and value.numel() <= 1
            and value.device.type == "cpu"
        ):
            # torch.tensor(...) inside combine_fn, from its code and captured numbers
            # (which key the kernel): fixed for this key. A tensor reached some other way
            # (a module attribute, say) may change between calls: not baked in.
            return ("value", value.detach().clone())
        raise Unsupported("combine_fn uses a tensor that is neither captured nor a scalar")

    def _release_constants(self, constants: dict[torch.fx.Node, Any]) -> None:
        # The graph must not keep the user's captured tensors alive once the kernel is cached.
        for node, kind in constants.items():
            if kind[0] == "captured":
                setattr(self.gm, node.target, None)

    def _val(self, node: Any) -> Any:
        return node.meta.get("val") if isinstance(node, torch.fx.Node) else node

    def _ctype(self, dtype: torch.dtype) -> str:
        return compute_ctype(dtype, self.wide or self.node_wide)

    def _value(
        self, a: Any, dtype: torch.dtype, opmath: bool = False, discrete: bool = False
    ) -> str:
        """Operand ``a`` (a node or a Python number) converted to ``dtype`` as torch
        converts an operand, as an expression of ``dtype``'s compute type.

        A Python number is rounded to ``dtype`` (torch wraps it in a tensor of the
        operation's dtype), or, with ``opmath``, to float for half and bfloat16 (the
        scalar path of torch's products and quotients keeps it at float precision).
        ``discrete``: for an op that is not continuous (a comparison, floor, sign...),
        which reads a value held wider than its dtype rounded to the dtype, as eager
        holds it (1 / 0.1f is 10 in float32, and its floor 10, not 9); a conversion to
        another dtype does too."""
        ctype = self._ctype(dtype)
        if isinstance(a, torch.fx.Node):
            fill = _fill_value(a) if a not in self.dynamic else None
            if fill is not None:  # a constant tensor (zeros, full...): its dtype's value
                return _cpp_const(_converted(_converted(fill, _dtype(a)), dtype), ctype)
            name, source = self.names[a], _dtype(a)
            if name.startswith("P"):
                name = f"static_cast<{self._ctype(source)}>(p.{name.lower()}[e])"
            held = _rounding(source, compute_ctype(source, self.wide))
            if held is not None and (discrete or source != dtype) and a not in self.wide_nodes:
                name = held.format(name)
            return f"static_cast<{ctype}>({_conversion(name, source, dtype, ctype)})"
        if opmath and dtype in _HALVES:
            return _cpp_const(_converted(a, torch.float32), ctype)
        return _cpp_const(_converted(a, dtype), ctype)

    def _emit(self, node: torch.fx.Node) -> None:
        out = self._val(node)
        if not isinstance(out, torch.Tensor):
            raise Unsupported(f"{node.target} returns {type(out).__name__}")
        if tuple(out.shape) != self.full:  # indexing, reshaping or reducing an element
            raise Unsupported(f"{node.target} changes the shape of the operands")
        name = _op_name(node.target)
        self.node_wide = any(a in self.wide_nodes for a in node.all_input_nodes)
        if self.node_wide:
            self.wide_nodes.add(node)
        oc = self._ctype(out.dtype)
        expr = self._expression(node, name, out, oc)
        in_range = None if self.node_wide else _range(out.dtype, oc)
        self.node_wide = False
        if name in _EXPENSIVE or name in _LIBM:
            self.expensive = True
        var = f"v{len(self.lines)}"
        self.lines.append(f"const {oc} {var} = static_cast<{oc}>({expr});")
        self.names[node] = var
        if in_range is not None:
            # Every op of eager torch rounds its result to its dtype. The values other
            # ops read here keep the compute type's precision (the accuracy the module
            # doc describes) but take the dtype's range: a float32 product that
            # overflows float is inf, as in eager, and inf * 0 NaN; one that underflows
            # is 0. Discrete ops read them rounded (see _value). An output keeps the
            # value as computed: the running state is kept in the compute type.
            self.exact[node] = var
            self.names[node] = f"{var}r"
            self.lines.append(f"const {oc} {var}r = {in_range.format(var)};")

    def _expression(self, node: torch.fx.Node, name: str, out: torch.Tensor, oc: str) -> str:
        args, kwargs = list(node.args), dict(node.kwargs)
        dtype = out.dtype
        value = lambda a, opmath=False: self._value(a, dtype, opmath, name in _DISCRETE)
        if name in _BROADCASTS:
            return value(args[0])
        if name in _IDENTITY:
            if name == "copy":  # copy(dst, src): the value of src
                return value(args[1])
            return value(args[0])
        if name in _INTEGER_IDENTITY and not dtype.is_floating_point:
            return value(args[0])
        if name in _COMPARE or name in ("isnan", "isinf"):
            operands = [self._val(a) for a in args[: 1 if name in ("isnan", "isinf") else 2]]
            common = _result_type(operands)
            if name in _COMPARE:
                left = self._value(args[0], common, discrete=True)
                right = self._value(args[1], common, discrete=True)
                return f"({left} {_COMPARE[name]} {right})"
            return _UNARY[name].format(a=self._value(args[0], common, discrete=True))
        if name in _LOGICAL:
            a, b = (f"({self._value(x, _dtype_of(self._val(x)))} != 0)" for x in args)
            return f"({a} {_LOGICAL[name]} {b})"
        if name == "logical_not":
            return f"!({self._value(args[0], _dtype_of(self._val(args[0])))} != 0)"
        if name == "bitwise_not" and dtype == torch.bool:
            return f"!{value(args[0])}"  # ~ of a C++ bool is an int (~true == -2): truthy
        if name == "pow":
            return self._pow(args, dtype, oc)
        if name in _BINARY:
            return self._binary(name, args, kwargs, dtype, oc)
        if name == "where":
            cond = self._value(args[0], torch.bool)
            return f"({cond} ? {value(args[1])} : {value(args[2])})"
        if name == "rsqrt":  # as torch: the square root rounded, then its reciprocal
            root = _rounding(torch.float32, oc) if dtype == torch.float32 else None
            sqrt = f"std::sqrt({value(args[0])})"
            return f"(1 / {root.format(sqrt) if root else sqrt})"
        if name in _UNARY:
            return _UNARY[name].format(a=value(args[0]))
        if name in _LIBM and out.is_floating_point():
            if oc == "double" and dtype == torch.float32 and name in _FLOAT_MATH:
                # As eager float32 does, at float precision (libmvec's float variants are
                # twice as wide); the carry and the arithmetic around it stay double.
                arg = f"static_cast<float>({value(args[0])})"
                return f"static_cast<double>(std::{name}({arg}))"
            return f"std::{name}({value(args[0])})"
        if name == "clamp":  # clamp_min and clamp_max decompose to it
            return self._clamp(args, dtype)
        if name == "scalar_tensor":
            return value(args[0])
        if name == "full" and len(args) > 1:
            return value(args[1])
        raise Unsupported(f"op aten.{name}")

    def _binary(
        self, name: str, args: list[Any], kwargs: dict[str, Any], dtype: torch.dtype, oc: str
    ) -> str:
        value = lambda a: self._value(a, dtype, opmath=name in _OPMATH_SCALAR)
        if name == "div" and kwargs.get("rounding_mode") is not None:
            # Integer division by zero raises in torch (and traps in C++); floor and
            # trunc division of floats are not translated: the torch engine serves them.
            raise Unsupported("div with rounding_mode")
        if name == "div" and dtype.is_floating_point:
            scale = _power_of_two_reciprocal(self._constant_value(args[1]))
            if scale is not None:  # exact, and a division costs 10-20x a product
                return f"({value(args[0])} * {_cpp_const(scale, oc)})"
        alpha = kwargs.get("alpha", 1)
        if name in ("add", "sub") and alpha != 1:
            a, b = value(args[0]), value(args[1])
            if dtype.is_floating_point:
                # As torch's vectorised add: a fused a + alpha * b, at float precision for
                # half and bfloat16 (inf + 3 * -max is inf; its scalar path, for tensors
                # of a few elements, gives NaN there and rounds alpha * b apart)
                at = torch.float32 if dtype in _HALVES else dtype
                scale = _cpp_const(_converted(alpha if name == "add" else -alpha, at), oc)
                return f"std::fma({b}, {scale}, {a})"
            scale = _cpp_const(_converted(alpha, dtype), oc)
            return _BINARY[name].format(a=a, b=f"({b} * {scale})")
        return _BINARY[name].format(a=value(args[0]), b=value(args[1]))

    def _pow(self, args: list[Any], dtype: torch.dtype, oc: str) -> str:
        base, exponent = args[0], args[1]
        constant = self._constant_value(exponent)
        if not dtype.is_floating_point:
            if dtype == torch.bool:
                raise Unsupported("pow of bools")
            if constant is not None and constant < 0:
                raise Unsupported("an integer to a negative power (torch raises)")
            return f"fscan_powi({self._value(base, dtype)}, {self._value(exponent, dtype)})"
        x = self._value(base, dtype)
        # A number exponent as torch's pow_tensor_scalar takes it: rounded to the dtype;
        # 0 and 1 fill and copy; the exponents of _POW_SPECIAL (not for float16, which
        # calls pow) as products, sqrt, rsqrt or reciprocals, each product rounded to the
        # dtype (bfloat16's Vectorized ops too), rsqrt's root to float.
        special = _POW_SPECIAL if dtype != torch.float16 else (0, 1)
        if constant is None or constant not in special:
            return f"std::pow({x}, {self._value(exponent, dtype)})"
        rounding = _rounding(dtype, oc)
        square = rounding.format(f"({x} * {x})") if rounding else f"({x} * {x})"
        root = _rounding(torch.float32, oc) if dtype == torch.float32 else None
        sqrt = f"std::sqrt({x})"
        return {
            0: _cpp_const(1, oc),
            1: x,
            2: f"({x} * {x})",
            3: f"({square} * {x})",
            -1: f"(1 / {x})",
            -2: f"(1 / {square})",
            0.5: sqrt,
            -0.5: f"(1 / {root.format(sqrt) if root else sqrt})",
        }[constant]

    def _constant_value(self, a: Any) -> Any:
        """The Python number ``a`` stands for, if it is a constant, else None."""
        if isinstance(a, torch.fx.Node):
            return _fill_value(a) if a not in self.dynamic else None
        return a if isinstance(a, (int, float)) and not isinstance(a, bool) else None

    def _clamp(self, args: list[Any], dtype: torch.dtype) -> str:
        # torch.clamp: min(max(x, lo), hi), x where it ties with a bound (clamp(-0.0, 0)
        # is -0.0), NaN where x or a bound is NaN, hi where lo > hi; a bound may be None.
        expr = self._value(args[0], dtype)
        lo = args[1] if len(args) > 1 else None
        hi = args[2] if len(args) > 2 else None
        if lo is not None:
            expr = f"fscan_clamp_lo({expr}, {self._value(lo, dtype)})"
        if hi is not None:
            expr = f"fscan_clamp_hi({expr}, {self._value(hi, dtype)})"
        return expr

    def _emit_outputs(self, out_dtypes: Sequence[torch.dtype]) -> None:
        (output,) = [nd for nd in self.gm.graph.nodes if nd.op == "output"]
        outs = output.args[0]
        if len(outs) != len(out_dtypes):
            raise Unsupported("combine_fn returned another number of leaves")
        for k, (o, dtype) in enumerate(zip(outs, out_dtypes)):
            oc = compute_ctype(dtype, self.wide or o in self.wide_nodes)
            if (
                isinstance(o, torch.fx.Node)
                and o not in self.dynamic
                and _fill_value(o) is not None
            ):
                # A constant output (a VJP's zero cotangent of an input that is not used)
                if _dtype(o) != dtype:
                    raise Unsupported("combine_fn changes a leaf's dtype")
                self.lines.append(f"o{k} = {_cpp_const(_converted(_fill_value(o), dtype), oc)};")
            elif isinstance(o, torch.fx.Node):
                if o not in self.dynamic:
                    raise Unsupported("an output does not depend on the operands")
                val = self._val(o)
                if val.dtype != dtype:
                    raise Unsupported("combine_fn changes a leaf's dtype")
                self.lines.append(f"o{k} = static_cast<{oc}>({self.exact.get(o, self.names[o])});")
            else:
                self.lines.append(f"o{k} = {_cpp_const(_converted(o, dtype), oc)};")


def _range(dtype: torch.dtype, ctype: str) -> str | None:
    """A format string bringing a value of ``ctype`` into ``dtype``'s range (overflow to
    +-inf, underflow to +-0, as rounding to ``dtype`` would) where ``ctype`` holds more,
    else None."""
    if dtype == torch.float32 and ctype == "double":
        return "fscan_range_f32({})"
    if dtype == torch.float16:
        return "fscan_range_f16({})"
    if dtype == torch.bfloat16:
        return "fscan_range_bf16({})"
    return None


def _rounding(dtype: torch.dtype, ctype: str) -> str | None:
    """A format string rounding a value of ``ctype`` to ``dtype``, where ``ctype`` holds
    more (float32 in double, half and bfloat16 in float), else None."""
    if dtype == torch.float32 and ctype == "double":
        return "fscan_round_f32({})"
    if dtype == torch.float16:
        return "fscan_round_f16({})"
    if dtype == torch.bfloat16:
        return "fscan_round_bf16({})"
    return None


def _conversion(name: str, source: torch.dtype, dtype: torch.dtype, ctype: str) -> str:
    """``name`` (a value of ``source`` in its compute type) converted to ``dtype`` (in
    ``ctype``) as torch converts: through the float type itself where ``ctype`` is
    wider (an int64 to float32 rounds once, to float, not to double then float)."""
    if source == dtype or source == torch.bool:
        return name
    if dtype in _HALVES:
        return _rounding(dtype, "float").format(f"static_cast<float>({name})")  # type: ignore[union-attr]
    if dtype == torch.float32 and ctype == "double":
        return f"static_cast<double>(static_cast<float>({name}))"
    if dtype.is_floating_point:
        return name
    if dtype == torch.bool:
        return f"({name} != 0)"
    if source.is_floating_point and dtype == torch.uint8:
        # torch converts floats to uint8 through int64 (-1.5 is 255): C++ would not define it
        return f"static_cast<int64_t>({name})"
    return name


def _converted(value: Any, dtype: torch.dtype) -> Any:
    """A Python number (or a value of a constant tensor) as torch converts it to ``dtype``."""
    if isinstance(value, bool):
        source = torch.bool
    elif isinstance(value, int):
        source = torch.int64
    elif isinstance(value, float):
        source = torch.float64
    else:
        raise Unsupported(f"constant {value!r} of type {type(value).__name__}")
    if source == dtype:
        return value
    try:
        return torch.tensor(value, dtype=source).to(dtype).item()
    except (RuntimeError, OverflowError) as err:
        raise Unsupported(f"constant {value!r} as {dtype}: {err}") from None


def _power_of_two_reciprocal(value: Any) -> float | None:
    """``1 / value`` where ``value`` is a power of two whose reciprocal is a normal float32
    (then ``x / value == x * (1 / value)`` exactly, in every float type), else None."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value == 0:
        return None
    if not math.isfinite(value):
        return None
    mantissa, exponent = math.frexp(abs(value))
    if mantissa != 0.5 or not -125 <= 1 - exponent <= 126:
        return None
    return 1.0 / value


def _fill_value(node: torch.fx.Node) -> Any:
    """The scalar a ``full``/``scalar_tensor`` node fills with, or None for any other node."""
    if node.op != "call_function":
        return None
    name = _op_name(node.target)
    if name == "scalar_tensor" and node.args and isinstance(node.args[0], (bool, int, float)):
        return node.args[0]
    if name == "full" and len(node.args) > 1 and isinstance(node.args[1], (bool, int, float)):
        return node.args[1]
    return None


def _dtype(node: torch.fx.Node) -> torch.dtype:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise Unsupported(f"{node.target} is not a tensor")
    return val.dtype


def _dtype_of(value: Any) -> torch.dtype:
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, float):
        return torch.float64
    raise Unsupported(f"operand {value!r}")


def _result_type(operands: Sequence[Any]) -> torch.dtype:
    tensors = [o for o in operands if isinstance(o, torch.Tensor)]
    if not tensors:
        raise Unsupported("an op without tensor operands")
    if len(operands) == 1:
        return tensors[0].dtype
    return torch.result_type(*operands[:2])


class _Prologue:
    """Evaluate the leaf-independent nodes on one call's captured tensors (torch ops)."""

    def __init__(
        self,
        static: list[torch.fx.Node],
        params: list[torch.fx.Node],
        constants: dict[torch.fx.Node, Any],
    ) -> None:
        needed = set(params)
        for node in reversed(static):  # keep only what the params depend on
            if node in needed:
                needed.update(node.all_input_nodes)
        self.steps = [
            (node, constants.get(node), node.target, node.args, node.kwargs)
            for node in static
            if node in needed
        ]
        self.params = params

    def __call__(self, captured: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        env: dict[torch.fx.Node, Any] = {}
        for node, constant, target, args, kwargs in self.steps:
            if constant is not None:
                kind, value = constant
                env[node] = captured[value] if kind == "captured" else value
                continue
            load = lambda a: env[a] if isinstance(a, torch.fx.Node) else a
            env[node] = target(*torch.fx.node.map_aggregate(args, load), **kwargs)
        return [env[p] for p in self.params]
