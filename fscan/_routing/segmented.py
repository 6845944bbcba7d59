"""The segmented route: a ``reset=`` scan on the segmented C++ kernel, where it serves.

A scan with ``reset=`` is otherwise a scan over (flag, value) pairs
(:mod:`fscan._segmented`), which every engine runs, gradients included. On CPU, with
no gradient wanted, no tracing and no ``torch.func`` transform, the segmented kernel
(:mod:`fscan._engines.cpp._kernel_segmented`) runs it in one pass over the data, the
mask read in place (a 1-D mask: a byte a step). The pairs cost 7-180x the scan without
a mask there: the flag leaf, of another shape or width, sent them to the tree engine or
slowed the kernel's vector loops. :func:`segmented_route` says whether the kernel may
serve a call (the reason when it may not, for the log and ``fscan.explain``);
:func:`run_segmented` runs it, or returns None while its kernel builds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from optree import PyTreeSpec

from .._call import ScanCall
from .._combine import flat_combine
from .._config import config
from .._context import Where, under_dispatch_mode, where
from .._engines.cpp._kernel_segmented import kernel_segmented
from .._engines.cpp.refusal import kernel_refusal
from .._knowledge.pointwise_check import checked_on_first_call
from .._knowledge.store import knowledge, known, reach
from .._knowledge.validate import validate_combine_fn
from .._route_log import ran
from .._segmented import check_reset

__all__ = ["run_segmented", "scan_segmented", "segmented_refusal", "segmented_route"]


def segmented_route(at: Where, leaves: Sequence[torch.Tensor]) -> str | None:
    """None where the segmented kernel may serve a call on ``leaves``, else why not (a
    combine capturing tensors that need grad is refused by the kernel's lookup)."""
    if config.cpu_kernel == "off":
        return "fscan.config.cpu_kernel is 'off'"
    if at.tracing or at.transform:
        return "traced or under a torch.func transform: the (flag, value) pairs' scan"
    if at.device != "cpu":
        return f"leaves on {at.device}: the segmented kernel runs on CPU"
    if at.grad and any(x.requires_grad for x in leaves):
        return "gradients wanted: the (flag, value) pairs' scan has the backward"
    if under_dispatch_mode():
        return "under a dispatch mode"
    return None


def run_segmented(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    reset: torch.Tensor,
    positions: tuple[int, ...] = (),
    threads: int | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor] | None:
    """The segmented kernel's scan of ``leaves`` (``dim`` non-negative) restarting where
    ``reset`` (checked: 1-D of the scan's length, or the leaves' dimensions with sizes 1
    or theirs) is True, logged as ``cpp``, into fresh outputs or ``out`` (see
    :func:`~fscan._engines.cpp._kernel_segmented.kernel_segmented`); None where it does
    not serve (yet): the caller scans the pairs. :func:`segmented_route` said yes."""
    shape = leaves[0].shape
    if any(x.shape != shape for x in leaves):
        return None
    flags = reset if reset.ndim == 1 else reset.expand(shape)  # 1-D: one flag a step
    found = kernel_segmented(combine_fn, spec, leaves, dim, reverse, flags, positions, threads, out)
    if found is not None:
        ran("cpp")
    return found


def scan_segmented(call: ScanCall) -> list[torch.Tensor] | None:
    """``fscan.associative_scan``'s ``reset=`` call (checked, ``initial`` folded in) on the
    segmented kernel, or None: the caller scans the pairs. ``combine_fn`` gets the checks
    ``validate`` asks for, as the scan without a mask would, and, on the first call of a
    ``combine_fn`` key, the elementwise check on two pairs of this call's elements (the
    kernel never calls it: a combine that mixes elements must fail here, not be compiled)."""
    leaves = call.leaves
    check_reset(call.api, call.reset, call.xs, leaves, call.dim)  # its errors come first
    if call.combine_mode != "pointwise" or segmented_route(where(leaves), leaves) is not None:
        return None
    if leaves[0].shape[call.dim] < 2:
        return None
    found = reach(call.combine_fn)
    entry = knowledge(found, call.spec, "pointwise", leaves)
    validate_combine_fn(call, entry)
    if not entry.elementwise:
        combine = flat_combine(call.api, call.combine_fn, call.spec, "pointwise")
        moved = [x.movedim(call.dim, 0) for x in leaves]
        n = moved[0].shape[0]
        a, b = (
            ([x[:2] for x in moved], [x[2:4] for x in moved])
            if n >= 4
            else ([x[:1] for x in moved], [x[1:2] for x in moved])
        )
        checked_on_first_call(call.api, combine, entry, leaves)(a, b)
        if not entry.elementwise:  # not probeable here: the pairs' scan checks it
            return None
    assert call.reset is not None
    return run_segmented(call.combine_fn, call.spec, leaves, call.dim, call.reverse, call.reset)


def segmented_refusal(call: ScanCall, at: Where) -> str | None:
    """Why :func:`scan_segmented` would not serve ``call`` now, or None if it would, read
    without side effects (for ``fscan.explain`` and the log)."""
    leaves = call.leaves
    if call.combine_mode != "pointwise":
        return "combine_mode='generic': the compiled kernels take pointwise combine_fns"
    why = segmented_route(at, leaves)
    if why is not None:
        return why
    if leaves[0].shape[call.dim] < 2 or any(x.shape != leaves[0].shape for x in leaves):
        return "leaves of different shapes, or one step: the (flag, value) pairs' scan"
    found = reach(call.combine_fn)
    holder = known(found, call.spec, "pointwise", leaves)
    if holder is not None and holder.elementwise is False:
        return "combine_fn is not elementwise"
    return kernel_refusal(
        call.combine_fn, call.spec, leaves, call.dim, found, holder, segmented=True
    )
