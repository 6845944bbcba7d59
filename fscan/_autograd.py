"""Gradients through a scan: pick the differentiable path for each call.

* Nothing needs a gradient: the fast in-place engine, without a tape.
* ``torch.func`` transforms, forward-mode AD, generic mode, and pointwise calls the
  adjoint cannot serve: the out-of-place engine, differentiated by autograd or
  functorch like any torch code (its tape holds O(n); a ``vmap``'ed call is one
  scan over the batch).
* Pointwise mode in eager autograd: :class:`~fscan._adjoint.PointwiseScan`,
  which saves only inputs and outputs and runs the backward as a scan.

A custom autograd Function only routes gradients to its inputs, so the tensors
``combine_fn`` closes over (closure cells, defaults, ``functools.partial``
arguments, bound ``self`` and ``nn.Module`` parameters and buffers, referenced
globals, recursively) are found and passed as extra inputs. Anything they miss
(say a tensor reached through an attribute of a global object) is caught by a
probe: ``combine_fn`` is called once on two steps with grad enabled and its
autograd graph is walked; a differentiable tensor that is neither an operand
nor found sends the call to the out-of-place engine, which is always correct.
The same probe checks that ``combine_fn`` does not mix element positions, which
the adjoint relies on. Its verdict is cached in a small bounded dict keyed by
``combine_fn``'s code object and the leaves' metadata.
"""

from __future__ import annotations

import functools
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from ._adjoint import PointwiseScan, ScanPlan, jacobian_blocks
from ._combine import FlatCombine
from ._generic import scan_along, scan_functional_along

__all__ = ["captured_tensors", "differentiable_scan", "gradients_possible"]

PROBE_STEPS = 2
VERDICT_CACHE_SIZE = 256
_MAX_VISITS = 2000


def gradients_possible() -> bool:
    """Whether this call could be differentiated: grad mode, a dual level or a functorch transform.

    Example:
        >>> with torch.no_grad():
        ...     gradients_possible()
        False
    """
    return torch.is_grad_enabled() or _under_transform()


def _under_transform() -> bool:
    """A dual level (forward-mode AD) or a ``torch.func`` transform is active.

    Both differentiate whatever torch ops run, so they get the out-of-place engine:
    a custom autograd Function would need rules for each, and in-place writes
    into a shared output break ``grad`` and ``jvp`` as they break autograd.
    """
    dual_level = getattr(torch.autograd.forward_ad, "_current_level", -1)
    return dual_level >= 0 or torch._C._functorch.peek_interpreter_stack() is not None


def differentiable_scan(
    combine_fn: Callable[[Any, Any], Any],
    combine: FlatCombine,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    combine_mode: str,
) -> list[torch.Tensor]:
    """Scan ``leaves`` along ``dim`` so that every gradient (and transform) is right.

    ``combine`` is ``combine_fn`` adapted to flat leaf lists for ``combine_mode``.

    Example:
        >>> from fscan._combine import flat_combine
        >>> from fscan._pytree import flatten
        >>> x = torch.ones(3, requires_grad=True)
        >>> _, spec = flatten(x)
        >>> add = flat_combine("demo", torch.add, spec, "pointwise")
        >>> (y,) = differentiable_scan(torch.add, add, [x], 0, False, "pointwise")
        >>> y.sum().backward()
        >>> x.grad
        tensor([3., 2., 1.])
    """
    if _under_transform():
        return scan_functional_along(combine, leaves, dim, reverse)
    captured = [t for t in captured_tensors(combine_fn) if t.requires_grad]
    if not captured and not any(x.requires_grad for x in leaves):
        out = scan_along(combine, leaves, dim, reverse)
        if not any(o.requires_grad for o in out):
            return out
        # combine_fn reached a tensor requiring grad that was not found: redo
        # the scan on the engine autograd can differentiate.
        return scan_functional_along(combine, leaves, dim, reverse)
    if combine_mode == "pointwise" and _adjoint_applies(combine_fn, combine, leaves, captured, dim):
        plan = ScanPlan(combine, len(leaves), dim, reverse)
        return list(PointwiseScan.apply(plan, *leaves, *captured))
    return scan_functional_along(combine, leaves, dim, reverse)


# --- Finding the tensors a combine_fn closes over --------------------------------


def captured_tensors(fn: Any) -> list[torch.Tensor]:
    """The tensors ``fn`` can reach without being passed them, found by inspection.

    Example:
        >>> w = torch.ones(2)
        >>> [t is w for t in captured_tensors(lambda a, b: a + b * w)]
        [True]
    """
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    todo = [fn]
    while todo and len(seen) < _MAX_VISITS:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[id(obj)] = obj
        else:
            todo.extend(_references(obj))
    return list(found.values())


def _references(obj: Any) -> Iterator[Any]:
    """What ``obj`` holds that may hold tensors; modules and classes are not entered."""
    if isinstance(obj, types.FunctionType):
        yield from _function_references(obj)
    elif isinstance(obj, types.MethodType):
        yield from (obj.__func__, obj.__self__)
    elif isinstance(obj, functools.partial):
        yield from (obj.func, *obj.args, *obj.keywords.values())
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
        for module in obj.modules():
            yield type(module).forward
            yield from (v for k, v in vars(module).items() if not k.startswith("_"))
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    elif isinstance(obj, dict):
        yield from obj.values()
    elif isinstance(obj, (types.ModuleType, type, str, bytes, int, float, complex, bool)):
        return
    elif hasattr(obj, "__dict__"):  # an object, perhaps callable
        yield from vars(obj).values()
        if callable(obj) and isinstance(type(obj).__call__, types.FunctionType):
            yield type(obj).__call__


def _function_references(fn: types.FunctionType) -> Iterator[Any]:
    for cell in fn.__closure__ or ():
        try:
            yield cell.cell_contents
        except ValueError:  # a cell not yet assigned
            continue
    yield from fn.__defaults__ or ()
    yield from (fn.__kwdefaults__ or {}).values()
    names = fn.__globals__
    yield from (names[n] for n in _global_names(fn.__code__) if n in names)


@functools.lru_cache(maxsize=VERDICT_CACHE_SIZE)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names a code object (and the functions nested in it) may load from its globals."""
    nested = (c for c in code.co_consts if isinstance(c, types.CodeType))
    return tuple(dict.fromkeys([*code.co_names, *(n for c in nested for n in _global_names(c))]))


# --- Whether the pointwise adjoint serves this call -----------------------------

_verdicts: OrderedDict[Hashable, bool] = OrderedDict()
_verdicts_lock = threading.Lock()


def _adjoint_applies(
    combine_fn: Any,
    combine: FlatCombine,
    leaves: Sequence[torch.Tensor],
    captured: Sequence[torch.Tensor],
    dim: int,
) -> bool:
    """The adjoint needs real float leaves of one shape and dtype and a probed ``combine_fn``."""
    floats = [x for x in leaves if x.is_floating_point()]
    if not floats or any(x.is_complex() for x in leaves):
        return False
    if any(x.shape != floats[0].shape or x.dtype != floats[0].dtype for x in floats):
        return False
    if leaves[0].shape[dim] == 1:  # combine_fn never runs
        return True
    key = _verdict_key(combine_fn, leaves, dim)
    with _verdicts_lock:
        verdict = _verdicts.get(key)
        if verdict is not None:
            _verdicts.move_to_end(key)
    if verdict is None:
        verdict = _probe(combine, leaves, captured, dim)
        with _verdicts_lock:
            _verdicts[key] = verdict
            while len(_verdicts) > VERDICT_CACHE_SIZE:
                _verdicts.popitem(last=False)
    return verdict


def _verdict_key(fn: Any, leaves: Sequence[torch.Tensor], dim: int) -> Hashable:
    """The code behind ``fn`` plus the leaves' element metadata."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if isinstance(fn, types.MethodType):
        fn = fn.__func__
    if isinstance(fn, types.FunctionType):
        # Code objects compare by value: the globals tell equal code in two modules apart.
        code: Hashable = (fn.__code__, id(fn.__globals__))
    elif isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        code = fn
    else:  # a module or other callable object: its class holds the code
        code = type(fn)
    elements = tuple((x.dtype, x.device.type, x.shape[:dim] + x.shape[dim + 1 :]) for x in leaves)
    return code, elements


def _probe(
    combine: FlatCombine,
    leaves: Sequence[torch.Tensor],
    captured: Sequence[torch.Tensor],
    dim: int,
) -> bool:
    """Call ``combine`` on the first steps with grad and check what the adjoint assumes."""
    steps = min(leaves[0].shape[dim] - 1, PROBE_STEPS)
    moved = [x.movedim(dim, 0) for x in leaves]
    operand = lambda x: x.detach().requires_grad_(x.is_floating_point())
    with torch.enable_grad():
        left = [operand(x[:steps]) for x in moved]
        right = [operand(x[1 : steps + 1]) for x in moved]
        outs = combine(left, right)
    floats = [i for i, x in enumerate(moved) if x.is_floating_point()]
    differentiable = [outs[i] for i in floats if outs[i].requires_grad]
    if not _reaches_only(differentiable, [*left, *right, *captured]):
        return False
    return _positions_do_not_mix([outs[i] for i in floats], [left[i] for i in floats])


def _reaches_only(outs: Sequence[torch.Tensor], allowed: Sequence[torch.Tensor]) -> bool:
    """Whether the graph of ``outs`` reaches no tensor requiring grad but those in ``allowed``."""
    stops = {(t.grad_fn, t.output_nr) for t in allowed if t.grad_fn is not None}
    leaves = {id(t) for t in allowed if t.grad_fn is None}
    todo = [(o.grad_fn, o.output_nr) for o in outs]
    expanded: set[Any] = set()
    while todo:
        node, nr = todo.pop()
        if node is None or (node, nr) in stops or node in expanded:
            continue
        expanded.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf tensor
            if id(node.variable) not in leaves:
                return False
            continue
        todo.extend(node.next_functions)
    return True


def _positions_do_not_mix(outs: list[torch.Tensor], lefts: list[torch.Tensor]) -> bool:
    """A random vector-Jacobian product equals the one the per-position blocks give."""
    if not any(o.requires_grad for o in outs):
        return True
    blocks = jacobian_blocks(outs, lefts, create_graph=False)
    generator = torch.Generator().manual_seed(0)
    probes = [torch.rand(o.shape, generator=generator, dtype=o.dtype).to(o.device) for o in outs]
    pairs = [(o, p) for o, p in zip(outs, probes) if o.requires_grad]
    exact = torch.autograd.grad(
        [o for o, _ in pairs], lefts, [p for _, p in pairs], allow_unused=True
    )
    eps = torch.finfo(outs[0].dtype).eps
    for j, got in enumerate(exact):
        blockwise = sum(
            (blocks[(j, k)] * probes[k] for k in range(len(outs)) if (j, k) in blocks),
            torch.zeros_like(lefts[j]),
        )
        got = torch.zeros_like(lefts[j]) if got is None else got
        scale = max(got.abs().max().item(), blockwise.abs().max().item(), 1.0)
        if not torch.allclose(got, blockwise, rtol=64 * eps, atol=64 * eps * scale):
            return False
    return True
