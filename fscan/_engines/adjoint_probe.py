"""Whether the pointwise adjoint serves a call's gradients: the probe and its verdict.

In grad mode, pointwise calls (see :mod:`fscan._routing.scan`) run
:class:`~fscan._engines.adjoint.PointwiseScan`, which saves only inputs and outputs and
runs the backward as a scan, wherever the adjoint applies. A custom autograd
Function only routes gradients to its inputs, so the tensors ``combine_fn``
closes over are passed as extra inputs; :mod:`fscan._knowledge.store` finds them
(closures, defaults, partials, bound ``self``, modules, named globals and
attributes) and keys the verdict on their ``requires_grad`` too. The probe
calls ``combine_fn`` once on two steps with grad enabled and walks its autograd
graph: a tensor requiring grad that is neither an operand nor found sends the
call to the out-of-place engine, which is always correct. It also checks that
``combine_fn`` does not mix element positions, which the adjoint relies on.
The verdict is stored in the knowledge entry per element shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._combine import FlatCombine
from .._knowledge.pointwise_check import is_elementwise
from .._knowledge.purity import run_higher_order
from .._knowledge.store import Knowledge
from .adjoint_blocks import jacobian_blocks

__all__ = ["adjoint_applies"]

PROBE_STEPS = 2


# --- Whether the pointwise adjoint serves this call -----------------------------


def adjoint_applies(
    entry: Knowledge,
    combine: FlatCombine,
    leaves: Sequence[torch.Tensor],
    captured: Sequence[torch.Tensor],
    dim: int,
) -> bool:
    """The adjoint needs real float leaves of one shape and dtype and a probed ``combine_fn``."""
    floats = [x for x in leaves if x.is_floating_point()]
    if not floats:
        return False
    if len(leaves) > 1:  # (a lone float leaf is neither complex nor unlike itself)
        if any(x.is_complex() for x in leaves):
            return False
        if any(x.shape != floats[0].shape or x.dtype != floats[0].dtype for x in floats):
            return False
    if leaves[0].shape[dim] == 1:  # combine_fn never runs
        return True
    element = tuple([x.shape[:dim] + x.shape[dim + 1 :] for x in leaves])
    verdict = entry.adjoint.get(element)
    if verdict is None:
        verdict = _probe(combine, leaves, captured, dim)
        entry.adjoint[element] = verdict
    return verdict


def _probe(
    combine: FlatCombine,
    leaves: Sequence[torch.Tensor],
    captured: Sequence[torch.Tensor],
    dim: int,
) -> bool:
    """Call ``combine`` on the first steps with grad and check what the adjoint assumes."""
    steps = min(leaves[0].shape[dim] - 1, PROBE_STEPS)
    moved = [x.movedim(dim, 0) for x in leaves]
    # Finite stand-ins for NaN/inf: the verdict is about the ops, and NaN Jacobians
    # would compare unequal (or poison the tolerance) whatever the ops are.
    operand = lambda x: _finite(x.detach()).requires_grad_(x.is_floating_point())
    with torch.enable_grad():
        left = [operand(x[:steps]) for x in moved]
        right = [operand(x[1 : steps + 1]) for x in moved]
        with _PositionsWatch([t for t in (*left, *right) if t.requires_grad]) as watch:
            outs = combine(left, right)
    if not watch.apart:
        return False
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


class _PositionsWatch(TorchDispatchMode):
    """Whether every op keeps each position of the float operands apart, whatever the values.

    The numeric probe below sees only the Jacobian at the probe's values, and some ops'
    Jacobians depend on them: ``torch.maximum(a[..., :1], b)`` mixes column 0 of ``a``
    into every column only where ``a[..., 0]`` wins, which the first steps may not show.
    So the probe call also runs under this mode: a tensor computed from a float operand
    must keep the operands' shape, be made by an elementwise op, and a view of one must be
    the identity (same shape, strides and offset). Slicing, broadcasting, reductions or
    indexing of such a tensor set ``apart`` to False, and the call takes the out-of-place
    engine. Tensors not computed from the operands (captured, constants) are free.
    """

    supports_higher_order_operators = True

    @classmethod
    def is_infra_mode(cls) -> bool:
        # as fscan._knowledge.pointwise_check._ElementwiseWatch: Dynamo must not skip frames
        return True

    def __init__(self, operands: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.apart = True
        self.shape = operands[0].shape if operands else None
        # id -> tensor, kept alive so that an id names one tensor while the mode runs.
        self.derived: dict[int, torch.Tensor] = {id(t): t for t in operands}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return run_higher_order(self, func, args, kwargs, self._unwatched(func))
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        sources = [t for t in tensors if id(t) in self.derived]
        out = func(*args, **kwargs)
        if sources and self.apart:
            results = [r for r in pytree.tree_leaves(out) if isinstance(r, torch.Tensor)]
            self.apart = self._keeps_positions(func, sources, results)
            self.derived.update((id(r), r) for r in results)
        return out

    def _keeps_positions(
        self, func: Any, sources: list[torch.Tensor], results: list[torch.Tensor]
    ) -> bool:
        if not is_elementwise(func) or any(t.shape != self.shape for t in sources):
            return False
        if any(r.shape != self.shape for r in results):
            return False
        if not func.is_view:
            return True
        layout = lambda t: (t.stride(), t.storage_offset())
        return all(layout(r) == layout(sources[0]) for r in results)

    def _unwatched(self, op: torch._ops.HigherOrderOperator) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.apart = False  # its body cannot be watched: keeping positions apart is not shown
            return op(*args, **kwargs)

        return run


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
        scale = max(_abs_max(got), _abs_max(blockwise), 1.0)
        if not torch.allclose(got, blockwise, 64 * eps, 64 * eps * scale, equal_nan=True):
            return False
    return True


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN and infinities replaced by ordinary values (a copy if any were)."""
    if not x.is_floating_point() or bool(torch.isfinite(x).all()):
        return x
    return torch.where(torch.isfinite(x), x, torch.full_like(x, 0.5))


def _abs_max(x: torch.Tensor) -> float:
    """The largest finite magnitude in ``x`` (0 if none): a tolerance scale NaN cannot poison."""
    finite = x[torch.isfinite(x)]
    return float(finite.abs().max()) if finite.numel() else 0.0
