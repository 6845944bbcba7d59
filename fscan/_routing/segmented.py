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

from .._config import config
from .._context import Where, under_dispatch_mode
from .._engines.cpp._kernel_segmented import kernel_segmented
from .._route_log import ran

__all__ = ["run_segmented", "segmented_route"]


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
) -> list[torch.Tensor] | None:
    """The segmented kernel's scan of ``leaves`` (``dim`` non-negative) restarting where
    ``reset`` (checked: 1-D of the scan's length, or the leaves' dimensions with sizes 1
    or theirs) is True, logged as ``cpp``; None where it does not serve (yet): the caller
    scans the pairs. :func:`segmented_route` said yes."""
    shape = leaves[0].shape
    if any(x.shape != shape for x in leaves):
        return None
    if reset.ndim == 1:  # one flag a step: stride 0 along every other dim
        reset = reset.reshape([-1 if d == dim else 1 for d in range(len(shape))])
    found = kernel_segmented(
        combine_fn, spec, leaves, dim, reverse, reset.expand(shape), positions, threads
    )
    if found is not None:
        ran("cpp")
    return found
