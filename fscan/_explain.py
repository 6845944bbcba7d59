"""``fscan.explain``: the engine a scan would run on now, and why the faster ones are passed over.

The report reads fscan's state without changing it: it runs no scan and no
``combine_fn``, starts no kernel build or toolchain lookup, records no verdict and
touches no cache's order (:func:`fscan._knowledge.store.known` and
:meth:`~fscan._cache.BoundedCache.peek` look entries up without storing them).
The route and its reasons are the router's own (:func:`fscan._routing.reasons.scan_route`),
which the ``"fscan"`` log's records of ``associative_scan`` read too
(:mod:`fscan._route_why`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ._call import ScanCall
from ._context import where
from ._engines.triton import codegen_unavailable
from ._entry import checked_call
from ._knowledge.store import reach
from ._pytree import flatten
from ._routing.reasons import scan_route
from ._routing.segmented import segmented_refusal
from ._scan import associative_scan
from ._segmented import segmented_scan
from ._sharded.dtensor import any_dtensor

__all__ = ["Explanation", "explain", "explain_arguments"]

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


def explain(
    combine_fn: Callable[[Any, Any], Any], xs: Any, dim: int, *args: Any, **kwargs: Any
) -> Explanation:
    """The engine ``fscan.associative_scan`` would run this call on now, and why not faster ones.

    Takes ``associative_scan``'s arguments (``reverse``, ``combine_mode``, ``validate``,
    ``reset``, ``initial`` after ``dim``, as there) and checks them alike (the same
    errors), but runs nothing: no scan, no ``combine_fn``, no kernel build; nothing is
    recorded or cached (module doc). On a first call, or while a kernel builds,
    ``refused`` says so. ``validate`` checks ``combine_fn``; it changes no route.

    Args:
        combine_fn: as for ``fscan.associative_scan``.
        xs: the pytree of tensors to scan.
        dim: the dimension to scan along.
        *args: the rest of ``fscan.associative_scan``'s positional arguments.
        **kwargs: the rest of its keyword arguments.

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
    bound = _SIGNATURE.bind(combine_fn, xs, dim, *args, **kwargs)
    bound.apply_defaults()
    reverse, combine_mode, reset, initial = (
        bound.arguments[name] for name in ("reverse", "combine_mode", "reset", "initial")
    )
    leaves, spec = flatten(xs)
    if any_dtensor(leaves):
        return Explanation(_API, "distributed", MappingProxyType({}))
    call = checked_call(ScanCall(_API, combine_fn, xs, spec, leaves, dim, reverse, combine_mode))
    at = where(call.leaves)
    if reset is not None and (why := segmented_refusal(call._replace(reset=reset), at)) is None:
        refused = {"triton": codegen_unavailable(call.leaves, reach(combine_fn)) or "a CPU scan"}
        return Explanation(_API, "cpp", MappingProxyType(refused))
    if reset is not None:  # the pairs (flag, value) are scanned: describe that scan
        seen: list[ScanCall] = []
        capture = lambda pair_call: seen.append(pair_call) or (None, None)
        segmented_scan(capture, call._replace(reset=reset))
        call = seen[0]
    # A number as initial (or as one of its leaves) is a constant: only tensors can need grad.
    heads = [] if initial is None else [h for h in flatten(initial)[0] if torch.is_tensor(h)]
    facts = scan_route(call, at, heads)
    refused = dict(facts.refused)
    if reset is not None and facts.engine != "cpp":
        refused["cpp"] = f"the segmented kernel: {why}"
    return Explanation(_API, facts.engine, MappingProxyType(refused), facts.grad)


def explain_arguments(args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """``associative_scan``'s arguments bound to their names."""
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


_SIGNATURE = inspect.signature(associative_scan)
