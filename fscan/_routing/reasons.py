"""The router's reasons: the route :mod:`fscan._routing.scan` picks, with why each
faster engine is passed over, read without side effects; and the drop-ins' router's
(:func:`cumulative_refusals`).

:func:`scan_route` follows the router's order (its table): ``empty``, ``traced``, a
``torch.func`` transform (``tree``), ``triton``, ``cpp``, then ``tree``; a gradient
route (``adjoint`` or ``autograd``) is an attribute of the answer, not an engine. It
runs no scan and no ``combine_fn``, starts no kernel build or toolchain lookup and
records nothing: ``fscan.explain`` and the ``"fscan"`` log's reasons ask it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .._call import ScanCall
from .._context import Where
from .._engines.cpp.cpu_kernel import KERNEL_MIN_NUMEL
from .._engines.cpp.refusal import kernel_refusal, kernel_unavailable
from .._engines.triton import codegen_unavailable
from .._knowledge.store import Knowledge, known, reach
from .cumulative_table import dtype_refusals, route, threads_decide

__all__ = ["RouteFacts", "cumulative_refusals", "scan_route"]


class RouteFacts(NamedTuple):
    """What :func:`scan_route` found: the engine, the refusals, the gradient route."""

    engine: str
    refused: dict[str, str]
    grad: str | None


def scan_route(call: ScanCall, at: Where, heads: Sequence[torch.Tensor] = ()) -> RouteFacts:
    """The route :mod:`fscan._routing.scan` picks for a checked call, and why (module doc).
    ``heads``: the carry-in's leaves (their ``requires_grad`` counts)."""
    combine_fn, spec, leaves, dim = call.combine_fn, call.spec, call.leaves, call.dim
    reverse, combine_mode = call.reverse, call.combine_mode
    if leaves[0].shape[dim] == 0 or all(x.numel() == 0 for x in leaves):
        return RouteFacts("empty", {}, None)
    if at.tracing:
        return RouteFacts("traced", {}, None)
    grad_leaves = at.grad and any(t.requires_grad for t in (*leaves, *heads))
    if at.transform:
        why = "a torch.func transform or forward-AD level is active: the torch engine runs"
        return RouteFacts("tree", {"triton": why, "cpp": why}, "autograd" if grad_leaves else None)
    found = reach(combine_fn)
    holder = known(found, spec, combine_mode, leaves)
    wants_grad = grad_leaves or (at.grad and any(t.requires_grad for t in found.tensors))
    refused: dict[str, str] = {}
    pointwise = _pointwise_refusal(combine_mode, holder)
    triton = codegen_unavailable(leaves, found) or pointwise
    if triton is None and wants_grad:
        triton = "gradients are wanted: the autograd engines run"
    if triton is None and _triton_failed(holder, dim, reverse):
        triton = "compiling the Triton kernel failed before for this combine_fn"
    if triton is None:
        return RouteFacts("triton", refused, None)
    refused["triton"] = triton
    if not wants_grad:
        # The kernel's own limits (mode, device, dtype) first: they hold whatever the check says.
        cpp = kernel_unavailable(leaves) or pointwise
        cpp = cpp or kernel_refusal(combine_fn, spec, leaves, dim, found, holder)
        if cpp is None:
            return RouteFacts("cpp", refused, None)
        refused["cpp"] = cpp
        return RouteFacts("tree", refused, None)
    if combine_mode != "pointwise" or getattr(combine_fn, "selects_by_mask", False):
        why = "generic mode" if combine_mode != "pointwise" else "reset= (restarts select)"
        refused["cpp"] = f"gradients are wanted in {why}: autograd runs the torch engine"
        return RouteFacts("tree", refused, "autograd")
    element = tuple([x.shape[:dim] + x.shape[dim + 1 :] for x in leaves])
    verdict = None if holder is None else holder.adjoint.get(element)
    if verdict is False:
        refused["cpp"] = "the adjoint probe refused combine_fn's gradients: autograd runs"
        return RouteFacts("tree", refused, "autograd")
    needing = any(t.requires_grad for t in found.tensors)
    cpp = kernel_refusal(combine_fn, spec, leaves, dim, found, holder)
    if cpp is None:
        cpp = kernel_refusal(combine_fn, spec, leaves, dim, found, holder, backward=needing + 1)
    if cpp is None and verdict is None:
        cpp = "first gradient call: the adjoint probe checks combine_fn on this call"
    if cpp is None:
        return RouteFacts("cpp", refused, "adjoint")
    refused["cpp"] = cpp
    return RouteFacts("tree", refused, "adjoint")


def _pointwise_refusal(combine_mode: str, holder: Knowledge | None) -> str | None:
    """Why the compiled kernels cannot take this ``combine_fn`` (mode or elementwise check)."""
    if combine_mode != "pointwise":
        return "combine_mode='generic': the compiled kernels take pointwise combine_fns"
    elementwise = None if holder is None else holder.elementwise
    if elementwise is None:
        return "first call: combine_fn's elementwise check runs on this call's first combine"
    if not elementwise:
        return "combine_fn is not elementwise (its pointwise check failed)"
    return None


def _triton_failed(holder: Knowledge | None, dim: int, reverse: bool) -> bool:
    compiled = None if holder is None else holder.compiled.get((dim, reverse))
    return bool(compiled is not None and compiled.failed)


def cumulative_refusals(op: Any, x: torch.Tensor, dim: int, reverse: bool) -> dict[str, str]:
    """Why the drop-ins' router (:mod:`fscan._routing.cumulative`) passes over the kernel
    (``"cpp"``) and the blocked scan (``"blocked"``) for torch's ``op`` on ``x``, for each
    it does not pick; changes nothing.

    Example:
        >>> cumulative_refusals(torch.cumsum, torch.ones(8), 0, False)["cpp"]
        "fewer than 32768 elements: torch's op is faster"
    """
    if not x.is_cpu or x.ndim == 0:
        return {"cpp": "torch's op serves tensors off the CPU and 0-d ones"}
    kernel, parallel = route(op, x, dim, reverse)
    kernel_bar, parallel_bar = dtype_refusals(op, x.dtype)
    why = {}
    if not kernel:
        if x.numel() < KERNEL_MIN_NUMEL:
            why["cpp"] = f"fewer than {KERNEL_MIN_NUMEL} elements: torch's op is faster"
        elif x.requires_grad and torch.is_grad_enabled():
            why["cpp"] = "gradients are wanted: the kernel has none here"
        elif threads_decide(op, x, dim, reverse):
            why["cpp"] = (
                f"on {torch.get_num_threads()} threads torch's op splits the rows over them: "
                "the kernel takes these rows on one thread (the drop-ins' route table)"
            )
        else:
            layout = "torch's op is faster for this dim and layout (the drop-ins' route table)"
            why["cpp"] = kernel_bar or layout
    if not parallel:
        why["blocked"] = parallel_bar or "torch's op is faster for this layout"
    return why
