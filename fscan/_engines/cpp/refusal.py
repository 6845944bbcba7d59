"""Why the C++ kernel would not serve a call now, read without side effects.

The kernel's own :func:`~fscan._engines.cpp.cpu_kernel.unavailable` path counts calls,
starts builds and looks the toolchain up; :func:`kernel_refusal` answers the same
question from the state those left behind (``known``/``peek`` store nothing), for
the router's reasons (``fscan.explain``, the ``"fscan"`` log).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from optree import PyTreeSpec

from ..._config import config
from ..._knowledge.store import Knowledge, Reach, known, reach
from . import cpu_kernel
from ._cpp_build import compiler_problem
from ._kernel_builder import warm
from ._kernel_run import gathered
from .cpu_kernel import MIN_CALLS, MIN_ELEMENTS, State, leaf_refusal, slot_key

__all__ = ["kernel_refusal", "kernel_unavailable"]


def kernel_refusal(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    found: Reach | None = None,
    holder: Knowledge | None = None,
    positions: tuple[int, ...] = (),
    dropped: tuple[int, ...] = (),
    backward: int = 0,
    segmented: bool = False,
    exclusive: bool = False,
) -> str | None:
    """Why the C++ kernel would not serve a scan like this now, or None if it would (read
    as ``fscan._engines.cpp.cpu_kernel`` decides, without its side effects). ``backward``: 0 the
    forward kernel, 1 the gradient kernel, 2 that with captured tensors' gradients.
    ``segmented``: the segmented kernel (``reset=``), built once the forward kernel is.
    ``exclusive``: the forward kernel's exclusive variant (an exclusive drop-in's). The
    forward kernel of leaves whose layout needs it is its gather variant (see
    :func:`~._kernel_run.call_layout`)."""
    static = kernel_unavailable(leaves)
    if static is not None:
        return static
    found = reach(combine_fn) if found is None else found
    if found.key is None:
        return "combine_fn reaches state fscan cannot key: no kernel is cached for it"
    if holder is None:
        holder = known(found, spec, "pointwise", leaves)
    if not backward and torch.is_grad_enabled() and any(t.requires_grad for t in found.tensors):
        return "combine_fn captures tensors that require grad: the autograd engine runs"
    aliases = _aliases(combine_fn, found)
    if aliases is None:
        return "combine_fn reaches tensors in no fixed order (a set): no kernel is cached"
    slots = None if holder is None else holder.kernels.get("cpp")
    element = tuple(leaves[0].shape[:dim] + leaves[0].shape[dim + 1 :])
    gather = not backward and gathered(leaves, dim, positions, dropped)
    key = slot_key(
        aliases, element, positions, dropped, backward > 0, backward > 1, exclusive, gather
    )
    entry = None if slots is None else slots.peek(key)
    what = "the gradient kernel" if backward else "the kernel"
    if exclusive:
        what = "the kernel's exclusive variant"
    elif gather:
        what = "the kernel's gather variant (this layout's strided rows)"
    if segmented and entry is not None and entry.state is State.READY:
        entry = slots.peek(("segmented", key))
        what = "the segmented kernel"
    state = State.NEW if entry is None else entry.state
    if state is State.READY:
        return None
    if state is State.FAILED:
        return f"building {what} failed ({entry.reason}): the torch engine runs"
    if config.cpu_kernel == "eager":
        return None  # the call builds it and waits: the kernel serves it
    if state is State.PENDING:
        return f"{what} is being built in the background; the torch engine answers meanwhile"
    calls = 0 if entry is None else entry.calls
    if calls + 1 >= MIN_CALLS or leaves[0].numel() >= MIN_ELEMENTS:
        return f"{what} is not built yet: a call now starts its build in the background"
    return (
        f"{what} is not built yet ({calls} call counted): its build starts in the background "
        f"at call {MIN_CALLS} (or at the first with {MIN_ELEMENTS} elements per leaf)"
    )


def kernel_unavailable(leaves: Sequence[torch.Tensor]) -> str | None:
    """``cpu_kernel``'s own checks of the leaves and the toolchain, minus its side effects
    (it starts the toolchain lookup where none ran yet)."""
    if config.cpu_kernel == "off":
        return "fscan.config.cpu_kernel is 'off'"
    reason = leaf_refusal(leaves)
    if reason is not None:
        return reason
    # The lookup's flag, read, never waited on: the engine sets it once the lookup ran.
    if not warm.is_set():
        if config.cpu_kernel == "eager":
            return None  # the call looks the compiler up and builds, then runs the kernel
        return "the C++ toolchain is not looked up yet (a call starts that in the background)"
    return compiler_problem()


def _aliases(combine_fn: Callable[[Any, Any], Any], found: Reach) -> tuple[int, ...] | None:
    """The aliasing pattern of the captured tensors, as the kernel's slot key spells it."""
    if not found.tensors:
        return ()
    if found.aliases is not None:
        return found.aliases
    occurrences = cpu_kernel.captured_occurrences(combine_fn)
    if occurrences is None:
        return None
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), len(first)) for t in occurrences)
