"""The C++ kernel's op table: the dtypes it takes and how each aten op translates.

Storage and compute C types per dtype (:data:`STORAGE`, :func:`compute_ctype`),
the tables of binary, logical, comparison, unary and libm ops with their C++
spellings, the ops that round (a float32 combine of only exact ops needs no
double accumulator), constants in C++, and the conversions and roundings that
make each op compute what eager torch computes for its dtype (see
:mod:`._cpp_codegen`). :class:`Program` is a translation's result.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


class Unsupported(Exception):
    """The kernel cannot serve this ``combine_fn`` (an op, dtype or structure it lacks)."""


# Storage C type of each supported leaf dtype (bool as bytes: GCC if-converts selects on
# loaded bytes, not on loaded C++ bools; half types as their bits, see fscan_f16_load).
STORAGE = {
    torch.bool: "uint8_t",
    torch.uint8: "uint8_t",
    torch.int8: "int8_t",
    torch.int16: "int16_t",
    torch.int32: "int32_t",
    torch.int64: "int64_t",
    torch.float16: "uint16_t",
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
EXPENSIVE = frozenset(
    {"exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "tanh", "sin", "cos", "tan"}
    | {"erf", "erfc", "sinh", "cosh", "asin", "acos", "atan", "asinh", "acosh", "atanh"}
    | {"lgamma", "pow", "atan2", "sigmoid", "sqrt", "rsqrt", "logaddexp"}
)
BINARY = {
    "add": "({a} + {b})",
    "sub": "({a} - {b})",
    "mul": "({a} * {b})",
    "div": "({a} / {b})",
    "maximum": "fscan_max({a}, {b})",
    "minimum": "fscan_min({a}, {b})",
    "fmax": "fscan_fmax({a}, {b})",
    "fmin": "fscan_fmin({a}, {b})",
    "atan2": "std::atan2({a}, {b})",
    "logaddexp": "fscan_logaddexp({a}, {b})",
    "pow": "std::pow({a}, {b})",
    "bitwise_and": "({a} & {b})",
    "bitwise_or": "({a} | {b})",
    "bitwise_xor": "({a} ^ {b})",
}
# Ops traced whole, not decomposed into core ATen ops: the kernel has a vectorisable
# form of each (csrc/logaddexp.h); logaddexp's decomposition (isinf, selects, exp,
# log1p) kept GCC from vectorising any loop it sat in.
WHOLE = frozenset({"logaddexp"})
# float32 held in double (a running value): the spelling that keeps the math in float.
WIDE_FLOAT32 = {"logaddexp": "fscan_logaddexp_f32({a}, {b})"}
LOGICAL = {"logical_and": "&&", "logical_or": "||", "logical_xor": "!="}
COMPARE = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
UNARY = {
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
INTEGER_IDENTITY = frozenset({"round", "floor", "ceil", "trunc"})
# Ops that are not continuous: they read their operands rounded to the dtype (_value).
DISCRETE = INTEGER_IDENTITY | {"sign"}
# Products and quotients of a half or bfloat16 tensor and a Python number take the
# number at float precision (torch's scalar path); other ops round it to the dtype.
OPMATH_SCALAR = frozenset({"mul", "div"})
# pow(x, c) for these c, as torch computes them (pow_tensor_scalar): exact products,
# sqrt, rsqrt or a reciprocal, not std::pow (pow(-inf, 0.5) is inf, sqrt(-inf) NaN).
POW_SPECIAL = (0, 1, 2, 3, -1, -2, 0.5, -0.5)
HALVES = (torch.float16, torch.bfloat16)
LIBM = [
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
# everything of LIBM but the correctly rounded (sqrt) and exact (floor...) ones.
FLOAT_MATH = frozenset(LIBM) - {"sqrt", "floor", "ceil", "trunc"}
# The ops that compute (views and copies aside): what tests/test_cpu_kernel_ops.py
# checks one by one against eager torch.
COMPUTING_OPS = (
    (frozenset(BINARY) | frozenset(LOGICAL) | frozenset(COMPARE) | frozenset(UNARY))
    | frozenset(LIBM)
    | {"logical_not", "rsqrt", "where", "clamp", "_to_copy"}
)
IDENTITY = frozenset({"clone", "alias", "detach", "lift_fresh_copy", "_to_copy", "copy"})
# Views allowed on leaf-dependent values: they only broadcast, which is implicit per element.
BROADCASTS = frozenset({"expand", "view", "unsqueeze", "squeeze", "reshape", "_unsafe_view"})


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


def rounds(gm: torch.fx.GraphModule) -> bool:
    """Whether any op of ``gm`` may round a float result (a division by a power of two
    only scales, as in the backward of ``maximum``, which splits ties in halves)."""
    return any(
        node.op == "call_function" and op_name(node.target) not in _EXACT and not _halves(node)
        for node in gm.graph.nodes
    )


def _halves(node: torch.fx.Node) -> bool:
    if op_name(node.target) != "div" or len(node.args) != 2 or node.kwargs:
        return False
    divisor = node.args[1]
    if isinstance(divisor, torch.fx.Node):
        divisor = fill_value(divisor)
    return power_of_two_reciprocal(divisor) is not None


def op_name(target: Any) -> str:
    return getattr(target, "_opname", None) or getattr(target, "__name__", str(target))


def cpp_const(value: Any, ctype: str) -> str:
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


def range_format(dtype: torch.dtype, ctype: str) -> str | None:
    """A format string bringing a value of ``ctype`` into ``dtype``'s range (overflow to
    +-inf, underflow to +-0, as rounding to ``dtype`` would) where ``ctype`` holds more,
    else None."""
    narrow = _narrower(dtype, ctype)
    # WATCH and `outside`: the combine's template flag and out-parameter (combine.cpp.in)
    return None if narrow is None else f"fscan_range_{narrow}<WATCH>({{}}, outside)"


def rounding_format(dtype: torch.dtype, ctype: str) -> str | None:
    """A format string rounding a value of ``ctype`` to ``dtype``, where ``ctype`` holds
    more (float32 in double, half and bfloat16 in float), else None."""
    narrow = _narrower(dtype, ctype)
    return None if narrow is None else f"fscan_round_{narrow}({{}})"


def _narrower(dtype: torch.dtype, ctype: str) -> str | None:
    """The suffix of the prelude's helpers for ``dtype`` held in a wider ``ctype``, else None."""
    if dtype == torch.float32 and ctype == "double":
        return "f32"
    return {torch.float16: "f16", torch.bfloat16: "bf16"}.get(dtype)


def conversion(name: str, source: torch.dtype, dtype: torch.dtype, ctype: str) -> str:
    """``name`` (a value of ``source`` in its compute type) converted to ``dtype`` (in
    ``ctype``) as torch converts: through the float type itself where ``ctype`` is
    wider (an int64 to float32 rounds once, to float, not to double then float)."""
    if source == dtype or source == torch.bool:
        return name
    if dtype in HALVES:
        return rounding_format(dtype, "float").format(f"static_cast<float>({name})")  # type: ignore[union-attr]
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


def converted_constant(value: Any, dtype: torch.dtype) -> Any:
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


def power_of_two_reciprocal(value: Any) -> float | None:
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


def fill_value(node: torch.fx.Node) -> Any:
    """The scalar a ``full``/``scalar_tensor`` node fills with, or None for any other node."""
    if node.op != "call_function":
        return None
    name = op_name(node.target)
    if name == "scalar_tensor" and node.args and isinstance(node.args[0], (bool, int, float)):
        return node.args[0]
    if name == "full" and len(node.args) > 1 and isinstance(node.args[1], (bool, int, float)):
        return node.args[1]
    return None


def node_dtype(node: torch.fx.Node) -> torch.dtype:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise Unsupported(f"{node.target} is not a tensor")
    return val.dtype


def value_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.Tensor):
        return value.dtype
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, float):
        return torch.float64
    raise Unsupported(f"operand {value!r}")


def result_dtype(operands: Sequence[Any]) -> torch.dtype:
    tensors = [o for o in operands if isinstance(o, torch.Tensor)]
    if not tensors:
        raise Unsupported("an op without tensor operands")
    if len(operands) == 1:
        return tensors[0].dtype
    return torch.result_type(*operands[:2])
