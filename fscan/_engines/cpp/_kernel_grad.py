"""The kernel's gradient route: a differentiable scan whose forward and backward are kernels.

:func:`kernel_grad_scan` serves the ``adjoint`` route once its probe agreed:
:class:`KernelScan` runs the forward kernel and, for a first-order backward on
plain tensors, the backward kernel (:func:`run_backward`), which also sums the
cotangents of captured tensors that require grad; elsewhere (``create_graph=True``,
a transform, params that do not fit) fscan's adjoint scan runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..._call import ScanCall
from ..._combine import FlatCombine
from ..._config import config
from ..._context import under_transform
from ..._knowledge.purity import probeable
from ..._knowledge.store import Knowledge, Reach
from ..adjoint import (
    Backward,
    ScanPlan,
    adjoint,
    all_finite,
    differentiable_backward,
    saved_backward,
    stepwise_adjoint,
)
from ..tree import scan_along
from ._kernel_entry import BuildCall, Entry, is_ready, kernel_slots, slot_key
from ._kernel_layout import element_shape, strided_view
from ._kernel_registry import ready_entry, serving_lookup
from ._kernel_run import kernel_params, run_kernel

__all__ = ["KernelScan", "kernel_grad_scan", "run_backward"]


def kernel_grad_scan(
    call: ScanCall,
    combine: FlatCombine,
    found: Reach | None = None,
    entry: Knowledge | None = None,
) -> list[torch.Tensor] | None:
    """A differentiable scan whose forward and first-order backward are C++ kernels, or
    None where they cannot serve (then ``PointwiseScan`` runs).

    For the ``adjoint`` route once its probe agreed (float leaves of one dtype, a probed
    combine_fn). Captured tensors that require grad are inputs of ``KernelScan``; its
    backward kernel sums their cotangents too (a separate kernel entry). A backward
    that must itself be differentiable (``create_graph=True``) runs fscan's adjoint
    scan instead.

    Example:
        >>> import fscan, optree
        >>> from fscan._call import ScanCall
        >>> x = torch.ones(4, requires_grad=True)
        >>> call = ScanCall("demo", torch.add, x, optree.tree_structure(0), [x], 0, False, "")
        >>> with fscan.config.override(cpu_kernel="off"):
        ...     kernel_grad_scan(call, None) is None
        True
    """
    if config.cpu_kernel == "off" or not torch.is_grad_enabled():
        return None
    _, combine_fn, _, spec, leaves, dim, reverse = call[:7]
    lookup = serving_lookup(combine_fn, spec, leaves, found, entry, gradients=True)
    if lookup is None:
        return None
    holder, aliases, captured = lookup
    needing = tuple([t for t in captured if t.requires_grad])
    element = element_shape(leaves, dim)
    slots = kernel_slots(holder)
    forward = slots.get(slot_key(aliases, element, (), (), False, False))
    backward = slots.get(slot_key(aliases, element, (), (), True, bool(needing)))
    if not (is_ready(forward) and is_ready(backward)):  # counted, built or queued
        dtypes = tuple([x.dtype for x in leaves])
        build = BuildCall(combine_fn, spec, dtypes, element, captured)
        numel = leaves[0].numel()
        forward = ready_entry(holder, aliases, build, numel, backward=False)
        backward = ready_entry(
            holder, aliases, build, numel, backward=True, param_grads=bool(needing)
        )
        if forward is None or backward is None:
            return None
    plan = ScanPlan(combine, len(leaves), dim, reverse)
    info = _GradInfo(forward, backward, plan, captured, needing)
    return list(KernelScan.apply(info, *leaves, *needing))


class _GradInfo(NamedTuple):  # made on every call: a NamedTuple is ~1 us cheaper
    forward: Entry
    backward: Entry
    plan: ScanPlan
    captured: tuple[torch.Tensor, ...]  # every captured tensor, distinct, in walk order
    needing: tuple[torch.Tensor, ...]  # those that require grad: inputs of KernelScan


class KernelScan(torch.autograd.Function):
    """Forward and backward by the generated kernels; saves the inputs and outputs only.

    Inputs: the leaves, then the captured tensors that require grad (so that autograd
    routes their gradients: the backward kernel sums them over the steps)."""

    @staticmethod
    def forward(ctx: Any, info: _GradInfo, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        plan = info.plan
        xs = tensors[: plan.n_leaves]
        ys = run_kernel(info.forward, xs, plan.dim, plan.reverse, info.captured)
        if ys is None:  # captured tensors that do not broadcast: the torch engine decides
            ys = scan_along(plan.combine, xs, plan.dim, plan.reverse)
        ctx.info = info
        ctx.save_for_backward(*tensors, *ys)
        ctx.mark_non_differentiable(*[y for y in ys if not y.is_floating_point()])
        ctx.set_materialize_grads(False)
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        info: _GradInfo = ctx.info
        call = saved_backward(ctx, info.plan, grads)
        given = [g for g in grads if g is not None]
        if torch.is_grad_enabled() and call.captured:  # create_graph=True: differentiable
            return (None, *differentiable_backward(call))
        found = None
        # First order on plain tensors: the kernel. Under vmap (batched cotangents, e.g.
        # jacobian(vectorize=True)) the cotangents are wrappers without data pointers.
        if not torch.is_grad_enabled() and not under_transform() and probeable(given or call.xs):
            found = run_backward(info, call)
        if found is None:  # create_graph=True, a transform, params that do not fit: adjoint
            found = adjoint(call)
            if call.captured and not all_finite([*found[0], *found[1]]):
                found = stepwise_adjoint(call)
        xbar, capbar = found
        bars = [*xbar, *capbar]
        return (None, *(b if need else None for b, need in zip(bars, call.needs)))


def run_backward(
    info: _GradInfo, call: Backward
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None:
    """The cotangents of the leaves and of ``info.needing`` by the backward kernel, or
    None where its params do not fit."""
    entry, plan = info.backward, info.plan
    xs, ys, grads = call.xs, call.ys, call.grads
    assert entry.program is not None and entry.kernel is not None
    shape = xs[0].shape
    dim = plan.dim % len(shape)
    outer, steps, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    element = shape[:dim] + shape[dim + 1 :]
    params = kernel_params(entry.program, info.captured, element)
    if params is None:
        return None
    floats = entry.floats
    # Cotangents are read through their strides (the cotangent of ``y.sum()`` is an
    # expanded scalar: stride 0, no copy); a missing one is a zero of stride 0. A
    # negative-bit view (a cotangent made from `.conj().imag`) is negated into memory:
    # the kernel reads memory, not the lazy negation.
    gs = [
        torch.zeros((), dtype=xs[k].dtype).expand(shape)
        if grads[k] is None
        else grads[k].resolve_neg()
        for k in floats
    ]
    bars = [torch.empty(shape, dtype=xs[k].dtype) for k in floats]
    # Per element position, summed over the steps (zero where no step combines).
    pbars = [torch.zeros(outer * inner, dtype=torch.float64) for _ in entry.pfloats]
    if outer * steps * inner:
        args, nb, strides = strided_view([*xs, *ys, *gs], dim)
        entry.kernel(
            *args, *bars, *pbars, *params, outer, steps, inner, int(plan.reverse),
            torch.get_num_threads(), nb, *strides,
        )  # fmt: skip
    xbar: list[torch.Tensor | None] = [None] * len(xs)
    for k, bar in zip(floats, bars):
        xbar[k] = bar
    capbar = _captured_grads(entry, info, pbars, element) if info.needing else []
    return xbar, capbar


def _captured_grads(
    entry: Entry, info: _GradInfo, pbars: Sequence[torch.Tensor], element: Sequence[int]
) -> list[torch.Tensor | None]:
    """The captured tensors' cotangents from the params' per-position sums: each sum is
    reduced over the positions its param broadcasts to, then pulled back through the
    prologue (torch ops on detached copies of the captured tensors)."""
    assert entry.program is not None
    copies = [t.detach().requires_grad_(t.requires_grad) for t in info.captured]
    with torch.enable_grad():
        values = entry.program.prologue(copies)
    outs, cots = [], []
    for q, pbar in zip(entry.pfloats, pbars):
        value = values[q]
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            continue
        full = pbar.view(1, *element).sum_to_size(value.shape) if value.ndim else pbar.sum()
        outs.append(value)
        cots.append(full.reshape(value.shape).to(value.dtype))
    inputs = [c for c, t in zip(copies, info.captured) if t.requires_grad]
    if not outs:
        return [torch.zeros_like(t) for t in info.needing]
    found = torch.autograd.grad(outs, inputs, cots, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(found, info.needing)]
