"""One pass over a traced ``combine_fn`` graph: the prologue split off, C++ statements out.

:class:`Translator` walks the aten graph that :mod:`._cpp_codegen` traced: nodes
that do not depend on the leaves form the prologue (:class:`~._cpp_prologue.Prologue`,
run with torch at each call on that call's captured tensors, its results the kernel's
params); every other node must be an op of the table in :mod:`._cpp_ops` and
becomes one C++ statement of the body, a :class:`~._cpp_ops.Program`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from ._cpp_ops import (
    BINARY,
    BROADCASTS,
    COMPARE,
    DISCRETE,
    EXPENSIVE,
    FLOAT_MATH,
    HALVES,
    IDENTITY,
    INTEGER_IDENTITY,
    LIBM,
    LOGICAL,
    OPMATH_SCALAR,
    POW_SPECIAL,
    UNARY,
    WIDE_FLOAT32,
    Param,
    Program,
    Unsupported,
    compute_ctype,
    conversion,
    converted_constant,
    cpp_const,
    fill_value,
    node_dtype,
    op_name,
    power_of_two_reciprocal,
    range_format,
    result_dtype,
    rounding_format,
    value_dtype,
)
from ._cpp_prologue import Prologue, classify_constant, release_constants

__all__ = ["Translator"]


# Ops whose repeated application shrinks a value geometrically (a product of gates).
SCALING = frozenset({"mul", "div", "reciprocal", "pow"})
F32 = torch.float32


class Translator:
    """One pass over a traced graph: split the prologue off, then emit C++ statements."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        input_names: Sequence[str],
        captured: Sequence[torch.Tensor],
        wide: bool,
        element: Sequence[int],
        wide_inputs: Sequence[str] = (),
        flush_outputs: bool = False,
    ) -> None:
        self.gm = gm
        self.wide = wide
        # A forward combine's float32 outputs held in double, flushed where combine's
        # FLUSH says (see fscan_flush_f32 in the prelude); a VJP's are not.
        self.flush_outputs = flush_outputs
        # Values computed in double even when the rest is not (float32 only): those
        # derived from the inputs named in wide_inputs (a VJP's cotangents, which sum
        # along the whole scan in a double buffer: rounding them to float each step
        # would make that sum a float32 accumulation).
        self.wide_nodes: set[torch.fx.Node] = set()
        self.node_wide = False  # whether the node being emitted is one of them
        # Values a product or quotient went into: the outputs among them are flushed
        # (see fscan_flush_f32 in the prelude; sums of float32 values never reach
        # double's subnormals, so the others keep their loop as it was).
        self.scaled: set[torch.fx.Node] = set()
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
                constants[node] = classify_constant(self.gm, node, self.captured_ids)
                static.append(node)
                continue
            if node.op != "call_function":
                raise Unsupported(f"graph node {node.op} {node.target}")
            if op_name(node.target) == "_local_scalar_dense":
                raise Unsupported("combine_fn reads a tensor's value into Python (.item())")
            if not any(a in self.dynamic for a in node.all_input_nodes):
                static.append(node)
                continue
            for a in node.all_input_nodes:
                if a not in self.dynamic and a not in self.names and fill_value(a) is None:
                    self.names[a] = f"P{len(params)}"
                    params.append(a)
            self.dynamic.add(node)
            self._emit(node)
        self._emit_outputs(out_dtypes)
        self.param_nodes = params
        param_specs = tuple(Param(node_dtype(p)) for p in params)
        prologue = Prologue(static, params, constants)
        release_constants(self.gm, constants)
        body = "\n".join(_without_unread_ranges(self.lines))
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
            fill = fill_value(a) if a not in self.dynamic else None
            if fill is not None:  # a constant tensor (zeros, full...): its dtype's value
                return cpp_const(
                    converted_constant(converted_constant(fill, node_dtype(a)), dtype), ctype
                )
            name, source = self.names[a], node_dtype(a)
            if name.startswith("P"):
                name = f"static_cast<{self._ctype(source)}>(p.{name.lower()}[e])"
            held = rounding_format(source, compute_ctype(source, self.wide))
            if held is not None and (discrete or source != dtype) and a not in self.wide_nodes:
                name = held.format(name)
            return f"static_cast<{ctype}>({conversion(name, source, dtype, ctype)})"
        if opmath and dtype in HALVES:
            return cpp_const(converted_constant(a, torch.float32), ctype)
        return cpp_const(converted_constant(a, dtype), ctype)

    def _emit(self, node: torch.fx.Node) -> None:
        out = self._val(node)
        if not isinstance(out, torch.Tensor):
            raise Unsupported(f"{node.target} returns {type(out).__name__}")
        if tuple(out.shape) != self.full:  # indexing, reshaping or reducing an element
            raise Unsupported(f"{node.target} changes the shape of the operands")
        name = op_name(node.target)
        self.node_wide = any(a in self.wide_nodes for a in node.all_input_nodes)
        scales = name in SCALING or any(a in self.scaled for a in node.all_input_nodes)
        if scales and out.dtype.is_floating_point:  # (a product of bools is a logical and)
            self.scaled.add(node)
        if self.node_wide:
            self.wide_nodes.add(node)
        oc = self._ctype(out.dtype)
        expr = self._expression(node, name, out, oc)
        in_range = None if self.node_wide else range_format(out.dtype, oc)
        self.node_wide = False
        if name in EXPENSIVE or name in LIBM:
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
        value = lambda a, opmath=False: self._value(a, dtype, opmath, name in DISCRETE)
        if name in BROADCASTS:
            return value(args[0])
        if name in IDENTITY:
            if name == "copy":  # copy(dst, src): the value of src
                return value(args[1])
            return value(args[0])
        if name in INTEGER_IDENTITY and not dtype.is_floating_point:
            return value(args[0])
        if name in COMPARE or name in ("isnan", "isinf"):
            operands = [self._val(a) for a in args[: 1 if name in ("isnan", "isinf") else 2]]
            common = result_dtype(operands)
            if name in COMPARE:
                left = self._value(args[0], common, discrete=True)
                right = self._value(args[1], common, discrete=True)
                return f"({left} {COMPARE[name]} {right})"
            return UNARY[name].format(a=self._value(args[0], common, discrete=True))
        if name in LOGICAL:
            a, b = (f"({self._value(x, value_dtype(self._val(x)))} != 0)" for x in args)
            return f"({a} {LOGICAL[name]} {b})"
        if name == "logical_not":
            return f"!({self._value(args[0], value_dtype(self._val(args[0])))} != 0)"
        if name == "bitwise_not" and dtype == torch.bool:
            return f"!{value(args[0])}"  # ~ of a C++ bool is an int (~true == -2): truthy
        if name == "pow":
            return self._pow(args, dtype, oc)
        if name in BINARY:
            return self._binary(name, args, kwargs, dtype, oc)
        if name == "where":
            cond = self._value(args[0], torch.bool)
            return f"({cond} ? {value(args[1])} : {value(args[2])})"
        if name == "rsqrt":  # as torch: the square root rounded, then its reciprocal
            root = rounding_format(torch.float32, oc) if dtype == torch.float32 else None
            sqrt = f"std::sqrt({value(args[0])})"
            return f"(1 / {root.format(sqrt) if root else sqrt})"
        if name in UNARY:
            return UNARY[name].format(a=value(args[0]))
        if name in LIBM and out.is_floating_point():
            if oc == "double" and dtype == torch.float32 and name in FLOAT_MATH:
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
        value = lambda a: self._value(a, dtype, opmath=name in OPMATH_SCALAR)
        if name == "div" and kwargs.get("rounding_mode") is not None:
            # Integer division by zero raises in torch (and traps in C++); floor and
            # trunc division of floats are not translated: the torch engine serves them.
            raise Unsupported("div with rounding_mode")
        if name == "div" and dtype.is_floating_point:
            scale = power_of_two_reciprocal(self._constant_value(args[1]))
            if scale is not None:  # exact, and a division costs 10-20x a product
                return f"({value(args[0])} * {cpp_const(scale, oc)})"
        alpha = kwargs.get("alpha", 1)
        if name in ("add", "sub") and alpha != 1:
            a, b = value(args[0]), value(args[1])
            if dtype.is_floating_point:
                # As torch's vectorised add: a fused a + alpha * b, at float precision for
                # half and bfloat16 (inf + 3 * -max is inf; its scalar path, for tensors
                # of a few elements, gives NaN there and rounds alpha * b apart)
                at = torch.float32 if dtype in HALVES else dtype
                scale = cpp_const(converted_constant(alpha if name == "add" else -alpha, at), oc)
                return f"std::fma({b}, {scale}, {a})"
            scale = cpp_const(converted_constant(alpha, dtype), oc)
            return BINARY[name].format(a=a, b=f"({b} * {scale})")
        if name in WIDE_FLOAT32 and dtype == F32 and oc == "double":
            return WIDE_FLOAT32[name].format(a=value(args[0]), b=value(args[1]))
        return BINARY[name].format(a=value(args[0]), b=value(args[1]))

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
        # 0 and 1 fill and copy; the exponents of POW_SPECIAL (not for float16, which
        # calls pow) as products, sqrt, rsqrt or reciprocals, each product rounded to the
        # dtype (bfloat16's Vectorized ops too), rsqrt's root to float.
        special = POW_SPECIAL if dtype != torch.float16 else (0, 1)
        if constant is None or constant not in special:
            return f"std::pow({x}, {self._value(exponent, dtype)})"
        rounding = rounding_format(dtype, oc)
        square = rounding.format(f"({x} * {x})") if rounding else f"({x} * {x})"
        root = rounding_format(torch.float32, oc) if dtype == torch.float32 else None
        sqrt = f"std::sqrt({x})"
        return {
            0: cpp_const(1, oc),
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
            return fill_value(a) if a not in self.dynamic else None
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
            if isinstance(o, torch.fx.Node) and o not in self.dynamic and fill_value(o) is not None:
                # A constant output (a VJP's zero cotangent of an input that is not used)
                if node_dtype(o) != dtype:
                    raise Unsupported("combine_fn changes a leaf's dtype")
                self.lines.append(
                    f"o{k} = {cpp_const(converted_constant(fill_value(o), dtype), oc)};"
                )
            elif isinstance(o, torch.fx.Node):
                if o not in self.dynamic:
                    raise Unsupported("an output does not depend on the operands")
                val = self._val(o)
                if val.dtype != dtype:
                    raise Unsupported("combine_fn changes a leaf's dtype")
                value = f"static_cast<{oc}>({self.exact.get(o, self.names[o])})"
                # Two leaves or more (a gated recurrence): one leaf's product (cumprod)
                # keeps torch.cumprod's profile, the flush on its one-multiply critical
                # path doubled its walked chains (0.40 -> 0.86 ns an element).
                flush = self.flush_outputs and len(out_dtypes) > 1 and o in self.scaled
                if flush and oc == "double" and dtype == F32:
                    value = f"(FLUSH ? fscan_flush_f32({value}) : {value})"
                self.lines.append(f"o{k} = {value};")
            else:
                self.lines.append(f"o{k} = {cpp_const(converted_constant(o, dtype), oc)};")


_RANGE_LINE = re.compile(r"const \w+ (v\d+r) = fscan_range_")


def _without_unread_ranges(lines: Sequence[str]) -> list[str]:
    """``lines`` less the range checks (``vNr``) no other line reads: a value only
    stored keeps its compute type's range. The compiler dropped them as dead code, but
    the combine's watched form (``WATCH``, combine.cpp.in) flags what a check would
    change, which is not dead, and ``RANGED`` (a check is left) is read off the body."""
    kept = []
    for k, line in enumerate(lines):
        match = _RANGE_LINE.match(line)
        if match is not None:
            word = re.compile(rf"\b{match.group(1)}\b")
            if not any(word.search(other) for other in lines[k + 1 :]):
                continue
        kept.append(line)
    return kept
