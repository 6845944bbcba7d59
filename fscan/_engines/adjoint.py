"""The pointwise backward: the adjoint of a scan is itself an associative scan.

For a forward scan ``y[0] = x[0]``, ``y[t] = f(y[t-1], x[t])`` with the Jacobians
``J[t] = df/dleft`` and ``K[t] = df/dright`` at ``(y[t-1], x[t])``, the
cotangents ``g`` of the outputs pull back as::

    lam[T-1] = g[T-1]
    lam[t]   = g[t] + J[t+1]^T lam[t+1]      # a reverse linear recurrence
    xbar[t]  = K[t]^T lam[t],  xbar[0] = lam[0]

In pointwise mode ``f`` acts on every element position on its own, so across the
L float leaves ``J[t]`` is an L x L block per position, read off with one
backward pass per output leaf (``torch.autograd.grad`` with a cotangent of ones;
a leaf the output does not depend on comes back ``None``: a structural zero).
The recurrence composes affine maps ``v -> g + M v``, which is associative, so
it runs on fscan's own engine, on L x L blocks kept as separate per-entry
tensors so that every product is an elementwise op and structural zeros cost
nothing. Only ``xs`` and the outputs are saved; ``f`` is re-evaluated once, over
all steps at once, in the backward. ``reverse=True`` mirrors every direction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from .._combine import FlatCombine
from .adjoint_blocks import Rows, StepBlocks, jacobian_blocks
from .affine import BlockIndex, affine_combine
from .tree import scan_along, scan_functional_along

__all__ = [
    "CHUNK_ELEMENTS",
    "Backward",
    "BackwardScan",
    "PointwiseScan",
    "ScanPlan",
    "adjoint",
    "all_finite",
    "differentiable_backward",
    "saved_backward",
    "stepwise_adjoint",
]

# A faster engine for the adjoint's reverse scan, chosen by the router (fscan._routing.scan):
# ``(combine, key, leaves, reverse) -> outputs``, or None where it does not serve. ``key``
# names all that ``combine`` depends on (see :func:`_adjoint_scan`).
BackwardScan = Callable[[FlatCombine, tuple, list[torch.Tensor], bool], "list[torch.Tensor] | None"]

# Elements per leaf re-evaluated at once in a first-order backward: small enough
# for the temporaries to stay in cache and be reused by the allocator (large
# fresh tensors cost page faults on CPU), large enough for per-call overhead to vanish.
CHUNK_ELEMENTS = 2**18


class ScanPlan(NamedTuple):
    """What the backward needs besides tensors: the combine and the scan's layout.

    ``n_leaves`` leaves of ``xs`` come first among the Function's tensor inputs,
    followed by the tensors ``combine`` closes over that need gradients. An engine never
    picks another engine: the router passes in ``backward_scan``. (A NamedTuple,
    immutable like a frozen dataclass: made on every call, and ~0.5 us cheaper.)
    """

    combine: FlatCombine
    n_leaves: int
    dim: int
    reverse: bool
    # The engine the router passed in for the backward's reverse scan (None: fscan's own).
    backward_scan: BackwardScan | None = None


class Backward(NamedTuple):
    """One backward call of a scan's autograd Function, as the adjoint takes it."""

    plan: ScanPlan
    xs: Sequence[torch.Tensor]  # the leaves, saved
    captured: Sequence[torch.Tensor]  # the captured tensors that are inputs of the Function
    ys: Sequence[torch.Tensor]  # the outputs, saved
    grads: Sequence[torch.Tensor | None]  # the outputs' cotangents (None: unused)
    needs: Sequence[bool]  # which tensor inputs (leaves, then captured) want a gradient


def saved_backward(ctx: Any, plan: ScanPlan, grads: Sequence[torch.Tensor | None]) -> Backward:
    """The :class:`Backward` of a Function whose forward took ``(plan-like, *leaves,
    *captured)`` and saved ``(*leaves, *captured, *outputs)``."""
    saved = ctx.saved_tensors
    n = plan.n_leaves
    xs, captured, ys = saved[:n], saved[n:-n], saved[-n:]
    return Backward(plan, xs, captured, ys, grads, ctx.needs_input_grad[1:])


class PointwiseScan(torch.autograd.Function):
    """Forward on the fast engine without a tape; backward by the adjoint scan.

    Example:
        >>> add = lambda a, b: [a[0] + b[0]]
        >>> x = torch.ones(4, requires_grad=True)
        >>> (y,) = PointwiseScan.apply(ScanPlan(add, 1, 0, False), x)
        >>> y.sum().backward()
        >>> x.grad
        tensor([4., 3., 2., 1.])
    """

    @staticmethod
    def forward(ctx: Any, plan: ScanPlan, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xs = tensors[: plan.n_leaves]
        ys = scan_along(plan.combine, xs, plan.dim, plan.reverse)
        ctx.plan = plan
        ctx.save_for_backward(*tensors, *ys)
        ctx.set_materialize_grads(False)
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call = saved_backward(ctx, ctx.plan, grads)
        if torch.is_grad_enabled():  # create_graph=True: this backward is differentiated too
            return (None, *differentiable_backward(call))
        xbar, capbar = adjoint(call)
        if not all_finite([*xbar, *capbar]):
            xbar, capbar = stepwise_adjoint(call)
        return (None, *xbar, *capbar)


def differentiable_backward(call: Backward) -> list[torch.Tensor | None]:
    """The backward as a differentiable function of ``xs``, the captured tensors and ``grads``.

    Re-evaluating ``combine`` on the saved outputs would differentiate through this
    Function's own outputs (a total derivative, and a backward that calls itself
    without end); re-running the forward out of place instead gives autograd a
    plain graph from the inputs, whose gradient it can differentiate again.
    """
    plan, xs, captured, _, grads, needs = call
    inputs = [t for t, need in zip([*xs, *captured], needs) if need and t.requires_grad]
    if not inputs:
        return [None] * len(needs)
    ys = scan_functional_along(plan.combine, xs, plan.dim, plan.reverse)
    pairs = [(y, g) for y, g in zip(ys, grads) if g is not None and y.requires_grad]
    if not pairs:
        return [None] * len(needs)
    found = torch.autograd.grad(
        [y for y, _ in pairs], inputs, [g for _, g in pairs], create_graph=True, allow_unused=True
    )
    by_id = {id(t): g for t, g in zip(inputs, found)}
    return [by_id.get(id(t)) if need else None for t, need in zip([*xs, *captured], needs)]


def adjoint(call: Backward) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Cotangents of ``xs`` and of the ``captured`` tensors, given those of ``ys``.

    Runs differentiably (so that second derivatives work) when grad mode is on,
    i.e. when autograd runs this backward with ``create_graph=True``. Otherwise
    ``f`` is re-evaluated in chunks of about ``CHUNK_ELEMENTS`` per leaf, whose
    temporaries stay in cache and are reused by the allocator, and the results
    are written into preallocated outputs.
    """
    plan, xs, captured, ys, grads, needs = call
    create_graph = torch.is_grad_enabled()
    xs, ys, floats, gs = _scan_dim_first(plan.dim, xs, ys, grads)
    n = xs[0].shape[0]
    if n == 1:  # no combine ran: the output is the input
        xbar = _scatter(len(xs), floats, [g if needs[i] else None for i, g in zip(floats, gs)])
        return _moved_back(xbar, plan.dim), [None] * len(captured)
    # Combine number c (of n - 1) took y[c] and x[c + 1] (y[c + 1] and x[c] if reversed).
    shift = int(plan.reverse)
    rows = n - 1 if create_graph else max(1, CHUNK_ELEMENTS // max(1, xs[0][0].numel()))
    blocks = StepBlocks(n, len(floats), shift, ys[floats[0]], create_graph)
    taped = []
    for start in range(0, n - 1, rows):
        span = slice(start, min(start + rows, n - 1))
        left_at, right_at = _shifted(span, shift), _shifted(span, 1 - shift)
        with torch.enable_grad():
            left = [_variable(y[left_at], create_graph) for y in ys]
            right = [_variable(x[right_at], create_graph) for x in xs]
            combined = plan.combine(left, right)
        outs = [combined[i] for i in floats]
        del combined
        blocks.add(left_at, jacobian_blocks(outs, [left[i] for i in floats], create_graph))
        # Keep only the graph of the re-evaluated outputs, not their values.
        taped.append((right_at, [_edge(o) for o in outs], right))
        del outs
    lam = _adjoint_scan(*blocks.finish(), gs, plan, create_graph)
    # xbar[t] = K[t]^T lam[t] at every step with a left operand, summed over steps
    # for the closed-over tensors; at the edge step (first, or last if reversed)
    # the output is the input, so xbar is lam itself there.
    want_x, want_c = _wanted(floats, captured, needs)
    edge_at = slice(n - 1, n) if plan.reverse else slice(0, 1)
    xbar_rows = {i: Rows(n, lam[floats.index(i)], create_graph) for i in want_x}
    for i, out in xbar_rows.items():
        out.write(edge_at, lam[floats.index(i)][edge_at])
    capbar: list[torch.Tensor | None] = [None] * len(captured)
    while taped:
        right_at, edges, right = taped.pop(0)  # frees each chunk's graph once pulled back
        inputs = [right[i] for i in want_x] + [captured[k] for k in want_c]
        pulled = _vjp(edges, inputs, [lm[right_at] for lm in lam], create_graph)
        for i, grad in zip(want_x, pulled):
            xbar_rows[i].write(right_at, grad)
        for k, grad in zip(want_c, pulled[len(want_x) :]):
            if grad is not None:  # a chunk that does not use the tensor adds nothing
                capbar[k] = grad if capbar[k] is None else capbar[k] + grad
    xbar = _scatter(len(xs), want_x, [xbar_rows[i].result() for i in want_x])
    return _moved_back(xbar, plan.dim), capbar


def stepwise_adjoint(
    call: Backward,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The cotangents :func:`adjoint` gives, computed as autograd through the sequential
    loop computes them: one vector-Jacobian product of ``combine`` per step, last first.

    Where an inf or NaN meets a zero the two differ. The adjoint carries products of
    Jacobians, so a cotangent of NaN times a block that is zero because ``torch.where``
    selected the other branch gives NaN; the loop's ``where`` backward selects a zero
    instead and the NaN stops there. The backward takes this walk (exact, one
    ``combine_fn`` call per step) only when the adjoint's result is not finite.

    Example:
        >>> mul = lambda a, b: [a[0] * b[0]]
        >>> x = torch.tensor([2.0, 3.0, 4.0])
        >>> ys = [torch.cumprod(x, 0)]
        >>> plan = ScanPlan(mul, 1, 0, False)
        >>> stepwise_adjoint(Backward(plan, [x], [], ys, [torch.ones(3)], [True]))[0]
        [tensor([16.,  10.,  6.])]
    """
    plan, xs, captured, ys, grads, needs = call
    xs, ys, floats, lam = _scan_dim_first(plan.dim, xs, ys, grads)
    want_x, want_c = _wanted(floats, captured, needs)
    n = xs[0].shape[0]
    xbar = {i: torch.zeros_like(xs[i]) for i in want_x}
    capbar: list[torch.Tensor | None] = [None] * len(captured)
    order = range(n - 1) if plan.reverse else range(n - 1, 0, -1)
    step = 1 if plan.reverse else -1  # where the step's left operand, the previous output, sits
    # The running cotangent of each output: its own plus what later steps pulled back.
    carry = [lm[n - 1 if not plan.reverse else 0].clone() for lm in lam]
    for t in order:
        prev = t + step
        with torch.enable_grad():
            left = [_variable(y[prev], False) for y in ys]
            right = [_variable(x[t], False) for x in xs]
            outs = plan.combine(left, right)
        inputs = [left[i] for i in floats] + [right[i] for i in want_x]
        inputs += [captured[k] for k in want_c]
        pulled = _vjp([outs[i] for i in floats], inputs, carry, False)
        back = [torch.zeros_like(left[i]) if g is None else g for i, g in zip(floats, pulled)]
        for i, g in zip(want_x, pulled[len(floats) : len(floats) + len(want_x)]):
            xbar[i][t] = 0 if g is None else g
        for k, g in zip(want_c, pulled[len(floats) + len(want_x) :]):
            if g is not None:
                capbar[k] = g if capbar[k] is None else capbar[k] + g
        carry = [lm[prev] + b for lm, b in zip(lam, back)]
    edge = 0 if not plan.reverse else n - 1
    for i in want_x:  # the edge output is the input itself
        xbar[i][edge] = carry[floats.index(i)]
    full = _scatter(len(xs), want_x, [xbar[i] for i in want_x])
    return _moved_back(full, plan.dim), capbar


def _scan_dim_first(
    dim: int,
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int], list[torch.Tensor]]:
    """``xs`` and ``ys`` with the scan dim first, the float leaves' indices, and their
    output cotangents (zeros for outputs nobody used), scan dim first too."""
    xs = [x.movedim(dim, 0) for x in xs]
    ys = [y.movedim(dim, 0) for y in ys]
    floats = [i for i, x in enumerate(xs) if x.is_floating_point()]
    gs = [_cotangent(grads[i], ys[i].movedim(0, dim)).movedim(dim, 0) for i in floats]
    return xs, ys, floats, gs


def _wanted(
    floats: list[int], captured: Sequence[torch.Tensor], needs: Sequence[bool]
) -> tuple[list[int], list[int]]:
    """The leaves and the captured tensors whose cotangents autograd asks for."""
    n_leaves = len(needs) - len(captured)
    want_x = [i for i in floats if needs[i]]
    want_c = [k for k, c in enumerate(captured) if needs[n_leaves + k] and c.requires_grad]
    return want_x, want_c


def all_finite(ts: Sequence[torch.Tensor | None]) -> bool:
    """Whether every value is finite; assumed so where values are hidden (a vmapped
    backward, e.g. ``jacobian(vectorize=True)``), as no walk could branch on them there."""
    present = [t for t in ts if t is not None]
    functorch = torch._C._functorch
    if functorch.peek_interpreter_stack() is not None or any(
        functorch.is_legacy_batchedtensor(t) for t in present
    ):
        return True
    return all(bool(torch.isfinite(t).all()) for t in present)


def _shifted(span: slice, by: int) -> slice:
    return slice(span.start + by, span.stop + by)


def _edge(out: torch.Tensor) -> torch.Tensor | GradientEdge:
    """Where ``out`` enters the graph; an operand returned as is stays a tensor."""
    return out if out.grad_fn is None else get_gradient_edge(out)


def _vjp(
    outs: list[torch.Tensor | GradientEdge],
    inputs: list[torch.Tensor],
    cotangents: list[torch.Tensor],
    create_graph: bool,
) -> list[torch.Tensor | None]:
    pairs = [(o, c) for o, c in zip(outs, cotangents) if _in_graph(o)]
    if not inputs or not pairs:
        return [None] * len(inputs)
    grads = torch.autograd.grad(
        [o for o, _ in pairs],
        inputs,
        [c for _, c in pairs],
        allow_unused=True,
        create_graph=create_graph,
    )
    return list(grads)


def _in_graph(out: torch.Tensor | GradientEdge) -> bool:
    return isinstance(out, GradientEdge) or out.requires_grad


def _scatter(n: int, at: list[int], values: list[Any]) -> list[Any]:
    full: list[Any] = [None] * n
    for i, v in zip(at, values):
        full[i] = v
    return full


def _moved_back(ts: list[torch.Tensor | None], dim: int) -> list[torch.Tensor | None]:
    return [None if t is None else t.movedim(0, dim) for t in ts]


def _cotangent(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Autograd passes ``None`` for an output nobody used: a zero cotangent, not materialised."""
    if grad is not None:
        return grad
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)


def _variable(t: torch.Tensor, create_graph: bool) -> torch.Tensor:
    """A float operand to differentiate the re-evaluated ``f`` by; other dtypes stay as they are."""
    if not t.is_floating_point() or (create_graph and t.requires_grad):
        return t
    return t.detach().requires_grad_()


def _adjoint_scan(
    pattern: list[BlockIndex],
    blocks: dict[BlockIndex, torch.Tensor],
    gs: list[torch.Tensor],
    plan: ScanPlan,
    create_graph: bool,
) -> list[torch.Tensor]:
    """``lam`` from ``lam[t] = g[t] + M[t] lam[t+1]`` (``lam[t-1]`` when reversed), on
    ``plan.backward_scan`` where the router gave one and it serves."""
    if not pattern:  # f ignores its left operand: nothing flows back along the scan
        return gs
    like = next(iter(blocks.values()))
    zero = torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)
    ms = [blocks.pop(e) if e in blocks else zero for e in pattern]
    del like
    combine = affine_combine(pattern, len(gs))
    leaves = [*ms, *gs]
    reverse = not plan.reverse
    out = None
    if plan.backward_scan is not None and not create_graph:
        key = ("fscan adjoint", tuple(pattern), len(gs))  # all that `combine` depends on
        out = plan.backward_scan(combine, key, leaves, reverse)
    if out is None:
        scan = scan_functional_along if create_graph else scan_along
        out = scan(combine, leaves, 0, reverse)
    return out[len(ms) :]
