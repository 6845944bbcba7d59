"""Where a scan runs and which engine runs it: one place for every dispatch decision.

:func:`where` answers "where are we running" (tracing, a ``torch.func``
transform or dual level, grad mode, device) and :func:`pick_route` turns that,
the leaves and what :mod:`fscan._knowledge.store` knows about ``combine_fn`` into a
route. :func:`scan_flat` runs it. Every route, in the order they are tried:

=============  ===================================================================
route          when, and what runs
=============  ===================================================================
``empty``      length 0 along ``dim``, or no element at all: copies of the leaves
``traced``     ``torch.compile``/``torch.export`` traces: one length-polymorphic
               op (:mod:`fscan._engines.traced` has its own table: HOP, blocked scan,
               sequential ``scan``; unrolled inside a ``torch.func`` transform)
``functional`` a ``torch.func`` transform or a dual level (forward AD) is active:
               the out-of-place engine, which those transforms differentiate
``triton``     pointwise, CUDA/XPU, ``combine_fn`` checked elementwise, no
               gradient wanted, no captured tensor: the compiled Triton kernel
               (:mod:`fscan._engines.triton`); falls back to ``inplace`` if it cannot
``cpp``        pointwise, CPU, ``combine_fn`` checked elementwise, no gradient
               wanted: the generated C++ kernel (:mod:`fscan._engines.cpp.cpu_kernel`)
               once compiled (in the background); ``inplace`` until then, or if
               it cannot serve. A carry-in (``initial=``, no gradient wanted, no
               ``reset=``) is read by the kernel in place of the first element;
               every other route gets it folded into a copy of the leaves
               (:mod:`fscan._carry`), as do calls that want gradients
``adjoint``    grad mode and a leaf or captured tensor requires grad, pointwise
               mode, and the probe says the adjoint serves: on CPU,
               ``KernelScan`` (C++ forward and backward kernels; the backward
               also sums the gradients of captured tensors) once compiled;
               else ``PointwiseScan`` (saves
               inputs and outputs only; the backward is a reverse scan).
               Not for ``reset=`` scans: their restarts are selections, and the
               adjoint's Jacobian products would turn a zero times a NaN or inf
               from after a restart into NaN before it (``0 * inf``)
``autograd``   grad wanted otherwise: the out-of-place engine under autograd
``inplace``    nothing requires grad: the in-place engine, no tape (if grad mode
               is on and ``combine_fn`` reached a tensor requiring grad that the
               walk missed, the result says so and ``autograd`` reruns it)
=============  ===================================================================

A call identical, in everything this choice depends on, to one that ``cpp`` (or
``adjoint`` on the C++ kernels) served with no carry-in is answered by
:mod:`fscan._routing.repeat` before the checks: ``fscan.associative_scan`` asks it
first, :func:`scan_flat` stores what it runs.

Pointwise calls whose ``combine_fn`` has not passed the elementwise check yet
run ``inplace``/``adjoint``/``autograd`` with the check watching their first
combine call (:mod:`fscan._knowledge.pointwise_check`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from optree import PyTreeSpec

from .._call import ScanCall
from .._carry import swap_heads
from .._combine import FlatCombine, flat_combine
from .._context import Where, where
from .._engines.adjoint import PointwiseScan, ScanPlan
from .._engines.adjoint_probe import adjoint_applies
from .._engines.cpp.cpu_kernel import kernel_grad_scan, kernel_scan
from .._engines.traced import traced_scan
from .._engines.tree import scan_along, scan_functional_along
from .._engines.triton import codegen_backward_scan, codegen_scan, codegen_unavailable
from .._errors import ImpureCombineError
from .._knowledge.pointwise_check import checked_on_first_call
from .._knowledge.store import Knowledge, Reach
from .._route_log import ran
from .repeat import remember

__all__ = [
    "check_untouched",
    "leaf_versions",
    "pick_route",
    "scan_flat",
    "scan_traced",
]


def pick_route(call: ScanCall, at: Where, found: Reach, entry: Knowledge) -> str:
    """The route for ``call`` (table in the module doc); ``triton`` and ``cpp`` may still
    decline, and the router then runs ``inplace``."""
    leaves, combine_mode = call.leaves, call.combine_mode
    if leaves[0].shape[call.dim] == 0 or _no_element(leaves):
        return "empty"
    if at.tracing:
        return "traced"
    if at.transform:
        return "functional"
    wants_grad = at.grad and (_any_requires_grad(leaves) or _any_requires_grad(found.tensors))
    pointwise_ok = combine_mode == "pointwise" and entry.elementwise and not wants_grad
    if pointwise_ok and codegen_unavailable(leaves, found) is None:
        return "triton"
    if pointwise_ok and at.device == "cpu":
        return "cpp"
    if not wants_grad:
        return "inplace"
    if combine_mode == "pointwise" and not getattr(call.combine_fn, "selects_by_mask", False):
        return "adjoint"  # if the probe agrees: see scan_flat
    return "autograd"


def _no_element(leaves: Sequence[torch.Tensor]) -> bool:
    # Loops, not all()/any() of a generator: about 0.3 us less per call.
    for x in leaves:  # noqa: SIM110
        if x.numel():
            return False
    return True


def _any_requires_grad(tensors: Sequence[torch.Tensor]) -> bool:
    for t in tensors:  # noqa: SIM110
        if t.requires_grad:
            return True
    return False


def scan_flat(
    call: ScanCall,
    found: Reach,
    entry: Knowledge,
    head: list[torch.Tensor] | None = None,
    into: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Scan a checked call's flat leaves on the route :func:`pick_route` picks.

    ``found`` and ``entry`` are :func:`~fscan._knowledge.store.reach` of ``combine_fn``
    and its :func:`~fscan._knowledge.store.knowledge` entry for this call (not while
    tracing: see :func:`scan_traced`). ``call.reset`` and ``call.initial`` are already
    folded in (:mod:`fscan._entry`). ``head``: a carry-in
    (:func:`fscan._carry.carried_heads`, no gradient wanted), the first element in scan
    order to scan instead of the leaves': the C++ kernel reads it in place; other routes
    scan a copy of the leaves with it swapped in. ``into``: memory the C++ kernel writes
    the results into (``kernel_scan``'s ``out=``); other routes return new memory.

    Example:
        >>> from fscan._call import ScanCall
        >>> from fscan._knowledge.store import knowledge, reach
        >>> from fscan._pytree import flatten
        >>> xs = torch.arange(1.0, 5.0)
        >>> leaves, spec = flatten(xs)
        >>> call = ScanCall("demo", torch.add, xs, spec, leaves, 0, False, "pointwise")
        >>> found = reach(torch.add)
        >>> scan_flat(call, found, knowledge(found, spec, "pointwise", leaves))
        [tensor([ 1.,  3.,  6., 10.])]
    """
    at = where(call.leaves)
    route = pick_route(call, at, found, entry)
    api, combine_fn, _, spec, leaves, dim, reverse = call[:7]
    if route == "cpp":  # the kernel never calls combine_fn: no versions to compare
        if head is None:
            out = kernel_scan(api, combine_fn, spec, leaves, dim, reverse, found, entry, out=into)
        elif (elements := _elements(head, leaves, dim)) is not None:
            args = (api, combine_fn, spec, leaves, dim, reverse, found, entry)
            out = kernel_scan(*args, head=elements, out=into)
        else:  # combine_fn changed the element's dtype or shape: the fold's cat decides
            out = None
        if out is not None:
            ran("cpp")
            if head is None:  # for the calls identical to this one: see fscan._routing.repeat
                remember(call, found, entry)
            return out
        route = "inplace"
    if head is not None:  # the fold: see fscan._carry
        leaves = swap_heads(leaves, head, dim, reverse)
        call = call._replace(leaves=leaves)
    versions = leaf_versions(leaves)
    out = _run(call, route, found, entry, at)
    check_untouched(api, spec, leaves, versions)
    return out


def _elements(
    head: list[torch.Tensor], leaves: list[torch.Tensor], dim: int
) -> list[torch.Tensor] | None:
    """The carry-in as the kernel reads it (each leaf's element shape and dtype), or None
    where ``combine_fn`` gave it another dtype or shape (the fold's ``cat`` decides)."""
    out = []
    for h, x in zip(head, leaves):
        if h.dtype != x.dtype or tuple(h.shape) != (*x.shape[:dim], 1, *x.shape[dim + 1 :]):
            return None
        out.append(h.squeeze(dim))
    return out


def _run(
    call: ScanCall, route: str, found: Reach, entry: Knowledge, at: Where
) -> list[torch.Tensor]:
    api, combine_fn, _, spec, leaves, dim, reverse, combine_mode = call[:8]
    if route == "empty":
        return [x.clone() for x in leaves]
    if route == "traced":
        return scan_traced(call)
    if route == "triton":
        out = codegen_scan(call, found, entry)
        if out is not None:
            ran("triton")
            return out
        route = "inplace"
    combine = flat_combine(api, combine_fn, spec, combine_mode)
    if combine_mode == "pointwise" and not entry.elementwise:
        combine = checked_on_first_call(api, combine, entry, leaves)
    if route == "functional":
        return scan_functional_along(combine, leaves, dim, reverse)
    if route == "inplace":
        return _inplace(combine, leaves, dim, reverse, at)
    captured = found.needing_grad()
    if route == "adjoint" and adjoint_applies(entry, combine, leaves, captured, dim):
        out = kernel_grad_scan(call, combine, found, entry)
        if out is not None:
            ran("cpp")
            remember(call, found, entry, grads=True)  # see fscan._routing.repeat
            return out
        plan = ScanPlan(combine, len(leaves), dim, reverse, codegen_backward_scan)
        return list(PointwiseScan.apply(plan, *leaves, *captured))
    return scan_functional_along(combine, leaves, dim, reverse)


def scan_traced(call: ScanCall) -> list[torch.Tensor]:
    """The ``traced`` route: while ``torch.compile``/``torch.export`` traces, nothing is
    inspected or cached (Dynamo traces this code; guards, not fscan's keys, decide reuse)."""
    leaves = call.leaves
    if leaves[0].shape[call.dim] == 0:
        return [x.clone() for x in leaves]
    return traced_scan(call)


def leaf_versions(leaves: Sequence[torch.Tensor]) -> list[int | None]:
    # Inference tensors and functorch wrappers have no version counter to compare.
    return [None if x.is_inference() else x._version for x in leaves]


def check_untouched(
    api: str, spec: PyTreeSpec, leaves: Sequence[torch.Tensor], before: list[int | None]
) -> None:
    """A last line of defence behind the purity probe, whose verdict covers the sample it
    ran on: a ``combine_fn`` that writes into its operands only for some values would
    otherwise corrupt ``xs`` silently. Version counters cost nothing to read."""
    for i, (leaf, version) in enumerate(zip(leaves, before)):
        if version is not None and leaf._version != version:
            path = spec.accessors()[i].codify("xs")
            raise ImpureCombineError(
                f"{api}: `combine_fn` modified leaf {path} of `xs` in place during the scan "
                "(the first-call probe did not catch it: the write depends on the values). "
                "Your input has been changed. combine_fn must be pure: return new tensors "
                "(`a + b`, not `a.add_(b)` or `a += b`)."
            )


def _inplace(
    combine: FlatCombine, leaves: Sequence[torch.Tensor], dim: int, reverse: bool, at: Where
) -> list[torch.Tensor]:
    out = scan_along(combine, leaves, dim, reverse)
    if at.grad and any(o.requires_grad for o in out):
        # combine_fn reached a tensor requiring grad that the walk did not find:
        # redo the scan on the engine autograd can differentiate.
        return scan_functional_along(combine, leaves, dim, reverse)
    return out
