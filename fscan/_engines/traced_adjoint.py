"""A differentiable traced pointwise scan whose forward and backward are both scans.

While ``torch.compile`` traces a differentiable pointwise scan on CUDA/XPU, the
forward and backward should each be one Triton scan kernel. torch's
``associative_scan`` HOP lowers to one, but its autograd treats each leaf on its
own, so it is wrong as soon as ``combine_fn`` mixes leaves, and it drops the
gradients of tensors ``combine_fn`` closes over. So the HOP runs without a
tape, and the gradient goes around it (``fscan._engines.adjoint`` has the maths):

1. ``ys = scan(xs)`` with grad mode off: the values.
2. ``steps[t] = f(ys[t-1], xs[t])`` re-evaluated for every ``t`` at once with
   ``ys`` detached, under autograd, and ``steps[0] = xs[0]``. Equal to ``ys[t]``
   in exact arithmetic, so its vector-Jacobian product with the total cotangent
   ``lam[t]`` of ``ys[t]`` is ``K[t]^T lam[t]`` for ``xs[t]`` and, summed over
   ``t``, the gradient of every tensor ``f`` closes over: autograd does that part,
   and sees closures as it sees any other tensor.
3. ``J[t]^T``, the per-position blocks of ``df/dleft``, by one
   vector-Jacobian product (``torch.func.vjp``) per float leaf.
4. :class:`_Seam` returns ``ys`` as the outputs and ``steps`` as where their
   gradient goes. Its backward turns the output cotangents ``g`` into
   ``lam[t] = g[t] + J[t+1]^T lam[t+1]``: a reverse scan of affine maps, itself a
   pointwise scan, run by the same kernel as the forward.

The backward's products let an exact zero absorb what it multiplies (``0 * inf
= 0``): a zero block means ``f`` did not depend on that operand there (e.g.
``torch.where`` picked the other branch, as after a ``reset=`` restart), and the
sequential loop's autograd does not carry a NaN or inf across it either. Eager
calls get the same result by a finite check and a stepwise fall-back, which a
trace cannot branch on.

Second derivatives through a compiled graph are refused by torch.compile itself
(its backward is not differentiable again), so :class:`_Seam` needs none.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .._combine import FlatCombine
from .affine import affine_combine

__all__ = ["Scan", "adjoint_serves", "adjoint_traced_scan"]

# A length-polymorphic inclusive scan along dimension 0, ``scan(make_combine, leaves)``,
# where ``make_combine(operands)`` gives the flat combine in the scan's own trace
# (``fscan._engines.hop.hop_scan``, ``fscan._engines.traced.traced_blocked_scan``).
MakeCombine = Callable[[Sequence[torch.Tensor]], FlatCombine]
Scan = Callable[[MakeCombine, Sequence[torch.Tensor]], list[torch.Tensor]]


def adjoint_traced_scan(
    make_combine: MakeCombine, xs: Sequence[torch.Tensor], scan: Scan
) -> list[torch.Tensor]:
    """Scan ``xs`` along dimension 0 with ``scan``, differentiable by the adjoint scan (module doc).

    Example:
        >>> from fscan._engines.tree import scan_functional
        >>> scan = lambda make, leaves: scan_functional(make(leaves), leaves)
        >>> x = torch.arange(1.0, 5.0, requires_grad=True)
        >>> (y,) = adjoint_traced_scan(lambda ops: lambda a, b: [a[0] * b[0]], [x], scan)
        >>> y.sum().backward()
        >>> y.detach(), x.grad
        (tensor([ 1.,  2.,  6., 24.]), tensor([33., 16., 10.,  6.]))
    """
    with torch.no_grad():
        ys = scan(make_combine, xs)
    floats = [i for i, x in enumerate(xs) if x.is_floating_point()]
    if not floats:
        return ys
    earlier = [y[:-1] for y in ys]  # the left operand of combine t = 1..n-1
    later = [x[1:] for x in xs]
    combine = make_combine(xs)
    stepped = combine(earlier, later)
    steps = [torch.cat([xs[i][:1], stepped[i]]) for i in floats]
    blocks = _left_jacobian_blocks(combine, earlier, [x.detach() for x in later], floats)
    plan = _SeamPlan(len(xs), floats, scan)
    return list(_Seam.apply(plan, *ys, *steps, *blocks))


def adjoint_serves(xs: Sequence[torch.Tensor]) -> bool:
    """Whether the float leaves share one shape, so that each position has one ``L x L``
    block (a leaf broadcast against another, e.g. a ``(T, 1)`` gate for ``(T, D)``
    values, mixes positions of the wider one into one entry of the narrower).

    Example:
        >>> adjoint_serves([torch.ones(4, 2), torch.ones(4, 2), torch.ones(4, dtype=torch.int64)])
        True
        >>> adjoint_serves([torch.ones(4, 1), torch.ones(4, 2)])
        False
    """
    shapes = [x.shape for x in xs if x.is_floating_point()]
    return all(shape == shapes[0] for shape in shapes)


def _left_jacobian_blocks(
    combine: FlatCombine,
    earlier: list[torch.Tensor],
    later: list[torch.Tensor],
    floats: list[int],
) -> list[torch.Tensor]:
    """``M[(j, k)] = d out_k / d left_j`` per position for the float leaves, row-major.

    One vector-Jacobian product per float output ``k`` with a cotangent of ones
    on it reads entry ``k`` of every block's row at once (positions do not mix).
    The values only: the backward does not differentiate them again.
    (``torch.func.jvp`` would read columns, but its first call warns from torch.)
    """
    lefts = tuple(earlier[i] for i in floats)

    def float_outs(*left: torch.Tensor) -> tuple[torch.Tensor, ...]:
        operands = list(earlier)
        for i, t in zip(floats, left):
            operands[i] = t
        out = combine(operands, later)
        return tuple(out[k] for k in floats)

    with torch.no_grad():
        outs, pull = torch.func.vjp(float_outs, *lefts)
        entries: dict[tuple[int, int], torch.Tensor] = {}
        for k in range(len(outs)):
            cotangents = tuple(
                torch.ones_like(o) if m == k else torch.zeros_like(o) for m, o in enumerate(outs)
            )
            for j, block in enumerate(pull(cotangents)):
                entries[(j, k)] = block
    width = len(floats)
    return [entries[(j, k)] for j in range(width) for k in range(width)]


class _SeamPlan(NamedTuple):
    n_leaves: int
    floats: list[int]  # indices of the float leaves, whose gradients flow
    scan: Scan


class _Seam(torch.autograd.Function):
    """Outputs ``ys``; routes each output's total cotangent ``lam`` to ``steps`` (module doc)."""

    @staticmethod
    def forward(ctx: Any, plan: _SeamPlan, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ys = tensors[: plan.n_leaves]
        blocks = tensors[plan.n_leaves + len(plan.floats) :]
        ctx.plan = plan
        # The float outputs only shape the zero cotangents of unused outputs.
        ctx.save_for_backward(*blocks, *(ys[i] for i in plan.floats))
        ctx.set_materialize_grads(False)
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan: _SeamPlan = ctx.plan
        saved = ctx.saved_tensors
        width = len(plan.floats)
        blocks, ys = saved[:-width], saved[-width:]
        lam = _total_cotangents(plan, blocks, ys, [grads[i] for i in plan.floats])
        return (None, *([None] * plan.n_leaves), *lam, *([None] * len(blocks)))


def _total_cotangents(
    plan: _SeamPlan,
    blocks: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
) -> list[torch.Tensor | None]:
    """``lam[t] = g[t] + J[t+1]^T lam[t+1]``, by a reverse scan of affine maps."""
    if all(g is None for g in grads):
        return [None] * len(grads)
    # One dtype for the whole recurrence (a scan's combine keeps its leaves' dtypes).
    dtype = functools.reduce(torch.promote_types, [y.dtype for y in ys])
    gs = [torch.zeros_like(y, dtype=dtype) if g is None else g.to(dtype) for y, g in zip(ys, grads)]
    # Position t of the adjoint takes the blocks of combine t + 1; the last has none.
    padded = [torch.cat([m.to(dtype), m.new_zeros((1, *m.shape[1:]), dtype=dtype)]) for m in blocks]
    width = len(plan.floats)
    pattern = [(j, k) for j in range(width) for k in range(width)]
    combine = affine_combine(pattern, width, absorb_zeros=True)
    flipped = plan.scan(lambda operands: combine, [t.flip(0) for t in (*padded, *gs)])
    return [t.flip(0).to(y.dtype) for t, y in zip(flipped[len(padded) :], ys)]
