"""Trace a pointwise ``combine_fn`` to elementwise aten ops and translate it to C++.

``combine_fn`` on flat leaves is traced once with ``make_fx`` (core ATen
decompositions, but for the ops of ``WHOLE``: ``logaddexp`` stays one op, which the
kernel computes branch-free, in ``csrc/logaddexp.h``) on small example tensors of the
leaf dtypes. Every node must be
an elementwise op of the table in :mod:`._cpp_ops`; anything else raises
:class:`Unsupported`, and the caller runs fscan's torch engine instead. Nodes that do not depend on
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
    >>> program = translate_combine(TraceInput(lambda a, b: a + b, spec, [torch.float64], (), []))
    >>> print(program.body)
    const double v0 = static_cast<double>((static_cast<double>(l0) + static_cast<double>(r0)));
    o0 = static_cast<double>(v0);
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from optree import PyTreeSpec

from ._cpp_ops import (
    COMPUTING_OPS,
    DTYPES,
    WHOLE,
    Program,
    Unsupported,
    fill_value,
    op_name,
    rounds,
)
from ._cpp_structs import needed
from ._cpp_translator import Translator

__all__ = [
    "COMPUTING_OPS",
    "DTYPES",
    "Program",
    "TraceInput",
    "Unsupported",
    "dead_cotangents",
    "translate_combine",
    "translate_param_vjp",
    "translate_vjp",
]


# make_fx and the decompositions share process-wide tracing state: one trace at a time.
_trace_lock = threading.Lock()


class TraceInput(NamedTuple):
    """What a translation traces: ``combine_fn`` on flat leaves of ``dtypes`` whose
    elements have the shape ``element``, and the tensors it closes over, in a fixed walk
    order (the prologue takes a list in the same order at each call)."""

    combine_fn: Callable[[Any, Any], Any]
    spec: PyTreeSpec
    dtypes: Sequence[torch.dtype]
    element: Sequence[int]
    captured: Sequence[torch.Tensor]


def _examples(dtypes: Sequence[torch.dtype], element: Sequence[int]) -> list[torch.Tensor]:
    # Distinct tensors (make_fx maps identity to graph inputs), two elements of the call's
    # element shape: the trace holds what combine_fn does at exactly this shape (a slice
    # over a whole dimension, say, traces as an alias), so the kernel is keyed by it.
    return [torch.ones((2, *element), dtype=d) for d in dtypes]


def _make_fx(
    fn: Callable[..., Any], examples: Sequence[torch.Tensor], vjp: bool = False
) -> torch.fx.GraphModule:
    """``fn`` traced to core ATen ops on ``examples``. ``vjp``: ``fn`` computes a VJP with
    ``torch.func``; it is functionalized (no views or in-place updates left) and traced in
    the caller's grad mode, a forward without grad."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if vjp:
        fn = torch.func.functionalize(fn, remove="mutations_and_views")
    with _trace_lock, contextlib.nullcontext() if vjp else torch.no_grad():
        return make_fx(fn, decomposition_table=_decompositions())(*examples)


@functools.cache
def _decompositions() -> dict[Any, Callable[..., Any]]:
    """Core ATen's decompositions, but for the ops the kernel computes whole (``WHOLE``)."""
    from torch._decomp import core_aten_decompositions

    return {op: fn for op, fn in core_aten_decompositions().items() if op_name(op) not in WHOLE}


def translate_combine(what: TraceInput) -> Program:
    """Trace ``what.combine_fn`` on its flat example leaves and translate it."""
    return _forward_translator(what)[1]


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


def _forward_translator(what: TraceInput) -> tuple[Translator, Program]:
    combine_fn, spec, dtypes, element, captured = what
    n = len(dtypes)
    flat = _flat(combine_fn, spec, n)
    gm = _make_fx(flat, _examples(dtypes, element) + _examples(dtypes, element))
    names = [f"l{k}" for k in range(n)] + [f"r{k}" for k in range(n)]
    wide = rounds(gm) and torch.float32 in dtypes
    translator = Translator(gm, names, captured, wide, element, flush_outputs=True)
    return translator, translator.program(list(dtypes))


def translate_vjp(
    what: TraceInput, missing: Sequence[int] = ()
) -> tuple[Program, list[int], list[int]]:
    """The VJP of ``combine_fn`` w.r.t. both operands' float leaves, translated.

    Inputs ``l0.., r0..`` (all leaves) and ``c0..`` (cotangents of the float leaves);
    outputs ``o0..``: the left cotangents of the float leaves not dead (below), then
    the right ones of every float leaf. Returns the program, the indices of the float
    leaves and the dead ones. Compute types as for the forward.

    ``missing``: float leaves whose output has no cotangent (autograd's None: the output
    is unused). Those of them no other output reads through its left operand
    (:func:`dead_cotangents`) are *dead*: their running cotangent stays zero along the
    whole scan, so the VJP is traced without them (their ``c`` is not read, their left
    cotangent is no output) and the kernel neither reads nor carries them. E.g. the
    affine pair ``(a1 a2, a2 b1 + b2)`` with only ``b``'s output used: the gate
    products' cotangent is dead, and ``dL/da2 = c_b b1`` no longer reads them.
    """
    combine_fn, spec, dtypes, element, captured = what
    n = len(dtypes)
    floats = [k for k, d in enumerate(dtypes) if d.is_floating_point]
    if not floats:
        raise Unsupported("no float leaf to differentiate")
    dead = dead_cotangents(what, floats, missing)
    live = [k for k in floats if k not in dead]

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
            return [out[k] for k in live]

        _, pull = torch.func.vjp(f, [ls[k] for k in floats], [rs[k] for k in floats])
        lbar, rbar = pull([c for c, k in zip(cs, floats) if k in live])
        return [*_live(lbar, floats, dead), *rbar]

    examples = _examples(dtypes, element) + _examples(dtypes, element)
    examples += _examples([dtypes[k] for k in floats], element)
    gm = _vjp_graph(flat, examples, dead)
    names = [f"l{k}" for k in range(n)] + [f"r{k}" for k in range(n)]
    names += [f"c{k}" for k in floats]
    out_dtypes = [dtypes[k] for k in live] + [dtypes[k] for k in floats]
    wide = rounds(gm) and torch.float32 in dtypes
    # The cotangents of float32 leaves sum in double (the backward kernel's lam): keep
    # what is computed from them in double too.
    wide_c = [f"c{k}" for k in floats if dtypes[k] == torch.float32]
    translator = Translator(gm, names, captured, wide, element, wide_c)
    return translator.program(out_dtypes), floats, dead


def dead_cotangents(what: TraceInput, floats: Sequence[int], missing: Sequence[int]) -> list[int]:
    """The leaves of ``missing`` (float leaves whose output has no cotangent) whose
    running cotangent stays zero along the scan: those no output with a cotangent reads
    through its left operand, step after step (:func:`~._cpp_structs.needed` on the
    forward's trace, with the other outputs dropped). A leaf some live output reads
    keeps a cotangent, summed from theirs, and the kernel reads a zero for its own."""
    if not missing or all(k in missing for k in floats):  # none, or no cotangent at all
        return []
    n = len(what.dtypes)
    forward = translate_combine(what)
    without = [k for k in range(n) if k in missing or k not in floats]
    kept = set(needed(forward, n, without))
    return [k for k in floats if k in missing and k not in kept]


def _live(lbar: Sequence[torch.Tensor], floats: Sequence[int], dead: Sequence[int]) -> list:
    """The left cotangents of the float leaves that are not dead."""
    return [b for b, k in zip(lbar, floats) if k not in dead]


def _vjp_graph(
    flat: Callable[..., Any], examples: Sequence[torch.Tensor], dead: Sequence[int]
) -> torch.fx.GraphModule:
    """``flat`` (a VJP) traced. The zeros ``torch.func`` makes for the cotangent of an
    input no output reads (``full_like`` of that input) become constants (``full``): the
    translator's constant outputs. With ``dead`` leaves, the zeros of their left
    cotangents (which ``flat`` drops) are removed, with the rest of what no output reads."""
    gm = _make_fx(flat, examples, vjp=True)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.full_like.default:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or len(node.args) < 2:
            continue
        with graph.inserting_before(node):
            constant = graph.call_function(
                torch.ops.aten.full.default, (list(val.shape), node.args[1]), {"dtype": val.dtype}
            )
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
        graph.erase_node(node)
    if dead:
        graph.eliminate_dead_code()
    gm.recompile()
    return gm


def translate_param_vjp(
    what: TraceInput, missing: Sequence[int] = ()
) -> tuple[Program, list[int], list[int], list[int]]:
    """The VJP of ``combine_fn`` w.r.t. both operands' float leaves *and* its float
    params (what it computes from the tensors it closes over), translated.

    The forward is traced first; its prologue stays the params' source, and its
    leaf-dependent part becomes a function of the leaves and the params, whose VJP
    is traced on params of a whole element's shape: their cotangents are then
    per element position (the kernel sums them over the steps, the caller over
    the positions a param broadcasts to). Outputs ``o0..``: left cotangents (of the
    float leaves not dead, as in :func:`translate_vjp`), right cotangents, then the
    params' cotangents. Returns the program (with the forward's params and prologue),
    the float leaves, the float params and the dead leaves.
    """
    forward_translator, forward = _forward_translator(what)
    dtypes, element = what.dtypes, what.element
    n, npar = len(dtypes), len(forward.params)
    floats = [k for k, d in enumerate(dtypes) if d.is_floating_point]
    pfloats = [j for j, p in enumerate(forward.params) if p.dtype.is_floating_point]
    if not floats or not pfloats:
        raise Unsupported("no float leaf or float captured tensor to differentiate")
    dead = dead_cotangents(what, floats, missing)
    live = [k for k in floats if k not in dead]
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
            return [out[k] for k in live]

        primals = ([ls[k] for k in floats], [rs[k] for k in floats], [ps[q] for q in pfloats])
        _, pull = torch.func.vjp(f, *primals)
        lbar, rbar, pbar = pull([c for c, k in zip(cs, floats) if k in live])
        return [*_live(lbar, floats, dead), *rbar, *pbar]

    examples = _examples(dtypes, element) + _examples(dtypes, element)
    examples += _examples([p.dtype for p in forward.params], element)
    examples += _examples([dtypes[k] for k in floats], element)
    gm = _vjp_graph(flat, examples, dead)
    names = [f"l{k}" for k in range(n)] + [f"r{k}" for k in range(n)]
    names += [f"P{j}" for j in range(npar)] + [f"c{k}" for k in floats]
    out_dtypes = [dtypes[k] for k in live] + [dtypes[k] for k in floats]
    out_dtypes += [forward.params[q].dtype for q in pfloats]
    wide = rounds(gm) and torch.float32 in dtypes
    wide_c = [f"c{k}" for k in floats if dtypes[k] == torch.float32]
    vjp = Translator(gm, names, (), wide, element, wide_c).program(out_dtypes)
    if vjp.params:  # the VJP reads nothing but its inputs and constants
        raise Unsupported("the VJP of combine_fn reads tensors of its own")
    program = Program(
        vjp.body, forward.params, forward.prologue, vjp.wide, vjp.expensive, vjp.reads
    )
    return program, floats, pfloats, dead


def _leaf_part(translator: Translator) -> Callable[[list[Any], list[Any]], list[Any]]:
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
            elif node in dynamic or fill_value(node) is not None:
                args = torch.fx.node.map_aggregate(node.args, load)
                kwargs = torch.fx.node.map_aggregate(node.kwargs, load)
                env[node] = node.target(*args, **kwargs)
        raise Unsupported("a traced graph without output")

    return run
