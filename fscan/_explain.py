"""``fscan.explain``: the engine a scan would run on now, and why the faster ones are passed over.

The report reads fscan's state without changing it: it runs no scan and no
``combine_fn``, starts no kernel build or toolchain lookup, records no verdict and
touches no cache's order (:func:`fscan._knowledge.store.known` and
:meth:`~fscan._cache.BoundedCache.peek` look entries up without storing them).
The router's order (``fscan._routing.scan``'s table) is followed: ``empty``,
``traced``, a ``torch.func`` transform (``tree``), ``triton``, ``cpp``, then
``tree``; a gradient route (``adjoint`` or ``autograd``) is an attribute of the
report, not an engine. :func:`scan_route` is also how the ``"fscan"`` log's
records of ``associative_scan`` get their reasons (:mod:`fscan._route_why`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from ._call import ScanCall
from ._config import config
from ._context import Where, where
from ._engines.cpp import cpu_kernel
from ._engines.cpp._cpp_build import compiler_problem
from ._engines.cpp._kernel_builder import warm
from ._engines.cpp.cpu_kernel import MIN_CALLS, MIN_ELEMENTS, State, leaf_refusal, slot_key
from ._engines.triton import codegen_unavailable
from ._entry import checked_call
from ._knowledge.store import Knowledge, Reach, known, reach
from ._pytree import flatten
from ._segmented import segmented_scan
from ._sharded.dtensor import any_dtensor

__all__ = ["Explanation", "RouteFacts", "explain", "kernel_refusal", "scan_route"]

_API = "fscan.associative_scan"


@dataclass(frozen=True)
class Explanation:
    """Which engine a call runs on (one of ``fscan``'s engine names: docs/routes.md), the
    engines passed over with their reasons, and how gradients flow back (``"adjoint"``:
    fscan's adjoint scan; ``"autograd"``: autograd through the engine's torch ops; None:
    no gradient wanted)."""

    api: str
    engine: str
    refused: Mapping[str, str]
    grad: str | None = None

    def __str__(self) -> str:
        lines = [f"{self.api} runs on engine {self.engine!r}"]
        if self.grad is not None:
            lines[0] += f", gradients by {self.grad!r}"
        lines += [f"  passed over {e!r}: {why}" for e, why in self.refused.items()]
        return "\n".join(lines)


class RouteFacts(NamedTuple):
    """What :func:`scan_route` found: the engine, the refusals, the gradient route."""

    engine: str
    refused: dict[str, str]
    grad: str | None


def explain(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool = False,
    combine_mode: str = "pointwise",
    *,
    validate: bool | None = None,
    reset: torch.Tensor | None = None,
    initial: Any = None,
) -> Explanation:
    """The engine ``fscan.associative_scan`` would run this call on now, and why not faster ones.

    Takes ``associative_scan``'s arguments and checks them alike (the same errors), but
    runs nothing: no scan, no ``combine_fn``, no kernel build; nothing is recorded or
    cached (module doc). On a first call, or while a kernel builds, ``refused`` says so.

    Args:
        combine_fn: as for ``fscan.associative_scan`` (so are the rest).
        xs: the pytree of tensors to scan.
        dim: the dimension to scan along.
        reverse: scan from the last element to the first.
        combine_mode: ``"pointwise"`` or ``"generic"``.
        validate: checks ``combine_fn``; it changes no route.
        reset: the segment starts, as for ``fscan.associative_scan``.
        initial: the carry-in, as for ``fscan.associative_scan``.

    Returns:
        Explanation: ``.engine`` (a name of the closed set in docs/routes.md),
        ``.refused`` (engine -> reason), ``.grad`` (``"adjoint"``, ``"autograd"`` or None);
        printable.

    Example:
        >>> import fscan, torch
        >>> with fscan.config.override(cpu_kernel="off"):
        ...     report = fscan.explain(torch.add, torch.ones(8), 0)
        >>> report.engine, report.refused["cpp"]
        ('tree', "fscan.config.cpu_kernel is 'off'")
    """
    del validate  # it checks combine_fn; it changes no route
    leaves, spec = flatten(xs)
    if any_dtensor(leaves):
        return Explanation(_API, "distributed", MappingProxyType({}))
    call = checked_call(_API, combine_fn, xs, leaves, spec, dim, reverse, combine_mode)
    dim = call.dim
    if reset is not None:  # the pairs (flag, value) are scanned: describe that scan
        seen: list[ScanCall] = []
        capture = lambda pair_call: seen.append(pair_call) or (None, None)
        segmented_scan(capture, call._replace(reset=reset))
        combine_fn, leaves, spec = seen[0].combine_fn, seen[0].leaves, seen[0].spec
    heads = [] if initial is None else flatten(initial)[0]
    facts = scan_route(combine_fn, spec, leaves, dim, reverse, combine_mode, where(leaves), heads)
    return Explanation(_API, facts.engine, MappingProxyType(facts.refused), facts.grad)


def explain_arguments(args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """``associative_scan``'s arguments bound to their names (its signature is explain's)."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


_SIGNATURE = inspect.signature(explain)


def scan_route(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    combine_mode: str,
    at: Where,
    heads: Sequence[torch.Tensor] = (),
) -> RouteFacts:
    """The route ``fscan._routing.scan`` picks for checked ``leaves``, read without side effects."""
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
        cpp = _kernel_unavailable(leaves) or pointwise
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
) -> str | None:
    """Why the C++ kernel would not serve a scan like this now, or None if it would (read
    as ``fscan._engines.cpp.cpu_kernel`` decides, without its side effects). ``backward``: 0 the
    forward kernel, 1 the gradient kernel, 2 that with captured tensors' gradients."""
    static = _kernel_unavailable(leaves)
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
    key = slot_key(aliases, element, positions, dropped, backward > 0, backward > 1)
    entry = None if slots is None else slots.peek(key)
    what = "the gradient kernel" if backward else "the kernel"
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


def _kernel_unavailable(leaves: Sequence[torch.Tensor]) -> str | None:
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
