"""The kernel's gradient route: a differentiable scan whose forward and backward are kernels.

:func:`kernel_grad_scan` serves the ``adjoint`` route once its probe agreed:
:class:`KernelScan` runs the forward kernel and, for a first-order backward on
plain tensors, the backward kernel (:func:`run_backward`), which also sums the
cotangents of captured tensors that require grad; elsewhere (``create_graph=True``,
a transform, params that do not fit) fscan's adjoint scan runs.

Outputs autograd hands no cotangent (None: unused, as the gate products of a linear
RNN written as the affine pair) select a backward kernel built without them (the
slot's ``dropped``): their running cotangents, where no other output feeds them,
are the constant 0, neither read nor carried (``Entry.dead``), so what only they need
(the gate products, for the pair) is not read either.
:func:`~fscan._engines.cpp._kernel_vjp.kernel_vjp` runs such a kernel for callers with an
autograd Function of their own: the linear recurrence's backward is the pair's with
only ``h``'s cotangent, one pass.

:func:`prepare_grad_run` keeps, for the router's repeat route, the two kernels a call's
key was served with and the forward's arguments worked out (:class:`PreparedGradRun`);
:func:`run_grad_prepared` runs :class:`KernelScan` with them on an identical call, without
the lookups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from ..._call import ScanCall
from ..._combine import FlatCombine
from ..._config import config
from ..._context import under_transform
from ..._knowledge.purity import probeable
from ..._knowledge.store import Knowledge, Reach
from ..._memory import HUGE_MIN_BYTES, advise_huge_pages
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
from ._kernel_run import (
    PreparedRun,
    ends_first,
    gathered,
    kernel_params,
    prepare_run,
    run_kernel,
    run_prepared,
)

__all__ = [
    "KernelScan",
    "PreparedGradRun",
    "kernel_grad_scan",
    "prepare_grad_run",
    "run_backward",
    "run_grad_prepared",
]


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
    gather = gathered(leaves, dim)  # the forward's gather variant (KernelScan's run_kernel)
    slots = kernel_slots(holder)
    forward = slots.get(slot_key(aliases, element, (), (), False, False, False, gather))
    backward = slots.get(slot_key(aliases, element, (), (), True, bool(needing)))
    if not (is_ready(forward) and is_ready(backward)):  # counted, built or queued
        dtypes = tuple([x.dtype for x in leaves])
        build = BuildCall(combine_fn, spec, dtypes, element, captured)
        numel = leaves[0].numel()
        forward = ready_entry(holder, aliases, build, numel, backward=False, gather=gather)
        backward = ready_entry(
            holder, aliases, build, numel, backward=True, param_grads=bool(needing)
        )
        if forward is None or backward is None:
            return None
    plan = ScanPlan(combine, len(leaves), dim, reverse)
    slots = _Slots(holder, aliases, combine_fn, spec, element)
    info = _GradInfo(forward, backward, plan, captured, needing, slots)
    return list(KernelScan.apply(info, *leaves, *needing))


class _Slots(NamedTuple):
    """Where the kernels of a call's key live: for the backward kernel without the
    cotangents autograd leaves out, looked up (or built) in the backward."""

    holder: Knowledge
    aliases: Hashable
    combine_fn: Callable[[Any, Any], Any]
    spec: PyTreeSpec
    element: tuple[int, ...]


class _GradInfo(NamedTuple):  # made on every call: a NamedTuple is ~1 us cheaper
    forward: Entry
    backward: Entry  # the backward kernel with every cotangent
    plan: ScanPlan
    captured: tuple[torch.Tensor, ...]  # every captured tensor, distinct, in walk order
    needing: tuple[torch.Tensor, ...]  # those that require grad: inputs of KernelScan
    slots: _Slots | None = None  # None: only ``backward`` serves (missing cotangents: zeros)
    # The repeat route's: ``forward``'s prepared run and the params it reads (they fit).
    run: PreparedRun | None = None
    params: Sequence[torch.Tensor] = ()


class PreparedGradRun(NamedTuple):
    """The READY forward and backward kernels that served a call with gradients, with the
    forward's :class:`~._kernel_run.PreparedRun` for contiguous leaves of its shape,
    ``dim`` and ``reverse``: what the router's repeat route runs (:func:`run_grad_prepared`)."""

    forward: Entry
    backward: Entry  # with every cotangent; one without some is looked up in the backward
    run: PreparedRun
    holder: Knowledge
    aliases: Hashable
    n_leaves: int
    dim: int
    reverse: bool


def prepare_grad_run(
    holder: Knowledge,
    aliases: Hashable,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    param_grads: bool,
) -> PreparedGradRun | None:
    """The :class:`PreparedGradRun` of the READY kernels in ``holder`` that
    :func:`kernel_grad_scan` runs for contiguous ``leaves`` along ``dim`` (non-negative)
    (``param_grads``: a captured tensor requires grad), else None."""
    run = prepare_run(holder, aliases, leaves, dim, reverse)
    if run is None:
        return None
    slots = kernel_slots(holder)
    forward = slots.peek(slot_key(aliases, run.element, (), (), False, False))
    backward = slots.peek(slot_key(aliases, run.element, (), (), True, param_grads))
    if not (is_ready(forward) and is_ready(backward)):
        return None
    return PreparedGradRun(forward, backward, run, holder, aliases, len(leaves), dim, reverse)


def run_grad_prepared(
    prepared: PreparedGradRun,
    combine: FlatCombine,
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    captured: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, ...] | None:
    """:func:`kernel_grad_scan` of leaves of the shape, layout and dtypes ``prepared`` was
    made for, ``combine`` being this call's ``combine_fn`` (its fallbacks in the backward
    call it) and ``captured`` what it captures; None where the captured tensors do not
    broadcast to one element (the full route then decides)."""
    run = prepared.run
    params: Sequence[torch.Tensor] | None = ()
    if run.program.params:
        params = kernel_params(run.program, captured, run.element)
        if params is None:
            return None
    needing = tuple([t for t in captured if t.requires_grad]) if captured else ()
    plan = ScanPlan(combine, prepared.n_leaves, prepared.dim, prepared.reverse)
    slots = _Slots(prepared.holder, prepared.aliases, combine_fn, spec, run.element)
    forward, backward = prepared.forward, prepared.backward
    info = _GradInfo(forward, backward, plan, captured, needing, slots, run, params)
    return KernelScan.apply(info, *leaves, *needing)


class KernelScan(torch.autograd.Function):
    """Forward and backward by the generated kernels; saves the inputs and outputs only.

    Inputs: the leaves, then the captured tensors that require grad (so that autograd
    routes their gradients: the backward kernel sums them over the steps)."""

    @staticmethod
    def forward(ctx: Any, info: _GradInfo, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        plan = info.plan
        xs = tensors[: plan.n_leaves]
        if info.run is not None:  # the repeat route's: its params fit
            ys = run_prepared(info.run, xs, info.captured, info.params)
        else:
            ys = run_kernel(info.forward, xs, plan.dim, plan.reverse, info.captured)
        if ys is None:  # captured tensors that do not broadcast: the torch engine decides
            ys = scan_along(plan.combine, xs, plan.dim, plan.reverse)
        ctx.info = info
        ctx.save_for_backward(*tensors, *ys)
        fixed = [y for y in ys if not y.is_floating_point()]
        if fixed:  # (a call with nothing to mark costs ~1 us)
            ctx.mark_non_differentiable(*fixed)
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
    None where its params do not fit. Outputs without a cotangent are run by the kernel
    built without them where it is ready (else counted, built or queued, as any kernel,
    and ``info.backward`` reads zeros for them)."""
    entry = info.backward
    missing = tuple([k for k in entry.floats if call.grads[k] is None])
    if missing and info.slots is not None:
        param_grads = bool(info.needing)
        entry = _entry_without(info.slots, missing, call.xs, info.captured, param_grads) or entry
    found = _run(
        entry, call.xs, call.ys, call.grads, info.plan.dim, info.plan.reverse, info.captured
    )
    if found is None:
        return None
    xbar, pbars = found
    if not info.needing:
        return xbar, []
    return xbar, _captured_grads(entry, info, pbars, element_shape(call.xs, info.plan.dim))


def _entry_without(
    slots: _Slots,
    missing: tuple[int, ...],
    xs: Sequence[torch.Tensor],
    captured: tuple[torch.Tensor, ...],
    param_grads: bool,
) -> Entry | None:
    """The READY backward kernel without the cotangents of ``missing``, else None after
    counting the call (and, per the mode, building it or queueing its build)."""
    holder, aliases, combine_fn, spec, element = slots
    key = slot_key(aliases, element, (), missing, True, param_grads)
    entry = kernel_slots(holder).get(key)
    if is_ready(entry):
        return entry
    dtypes = tuple([x.dtype for x in xs])
    build = BuildCall(combine_fn, spec, dtypes, element, captured, (), missing)
    return ready_entry(
        holder, aliases, build, xs[0].numel(), backward=True, param_grads=param_grads
    )


def _run(
    entry: Entry,
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    dim: int,
    reverse: bool,
    captured: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], list[torch.Tensor]] | None:
    """The backward kernel ``entry`` on the saved leaves and outputs: the leaves'
    cotangents and the params' per-position sums, or None where its params do not fit."""
    assert entry.program is not None and entry.kernel is not None
    shape = xs[0].shape
    dim = dim % len(shape)
    outer, steps, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    element = shape[:dim] + shape[dim + 1 :]
    params = kernel_params(entry.program, captured, element)
    if params is None:
        return None
    floats, dead = entry.floats, entry.dead
    # Cotangents are read through their strides (the cotangent of ``y.sum()`` is an
    # expanded scalar: stride 0, no copy); a missing one the kernel reads (not dead) is
    # a zero of stride 0. A negative-bit view (a cotangent made from `.conj().imag`) is
    # negated into memory: the kernel reads memory, not the lazy negation.
    gs = [
        torch.zeros((), dtype=xs[k].dtype).expand(shape)
        if grads[k] is None
        else grads[k].resolve_neg()
        if grads[k].is_neg()
        else grads[k]
        for k in floats
        if k not in dead
    ]
    # empty_like of a contiguous leaf (the common case) is a few us cheaper than empty(shape)
    bars = [
        torch.empty_like(xs[k]) if xs[k].is_contiguous() else torch.empty(shape, dtype=xs[k].dtype)
        for k in floats
    ]
    if outer * steps * inner >= HUGE_MIN_BYTES // 16:  # as the forward's fresh outputs
        for bar in bars:  # (the backward walks against the scan)
            advise_huge_pages(bar, ends_first(not reverse, inner))
    # Per element position, summed over the steps (zero where no step combines).
    pbars = [torch.zeros(outer * inner, dtype=torch.float64) for _ in entry.pfloats]
    if outer * steps * inner:
        read = [*xs, *ys, *gs]
        # Contiguous tensors and expanded scalars (the cotangent of ``y.sum()``, a missing
        # one's zero: every stride 0) inline, the common case: strided_view costs ~7 us.
        dense, scalar = (steps * inner, 0, inner, 1), (0,) * len(shape)
        strides = []
        for t in read:
            if t.is_contiguous():
                strides += dense
            elif t.stride() == scalar:
                strides += _BROADCAST
            else:
                args, nb, strides = strided_view(read, dim)
                break
        else:
            args, nb = read, 1
        entry.kernel(
            *args, *bars, *pbars, *params, outer, steps, inner, int(reverse),
            torch.get_num_threads(), nb, *strides,
        )  # fmt: skip
    xbar: list[torch.Tensor | None] = [None] * len(xs)
    for k, bar in zip(floats, bars):
        xbar[k] = bar
    return xbar, pbars


_BROADCAST = (0, 0, 0, 0)  # the strides of an expanded scalar: one value read everywhere


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
