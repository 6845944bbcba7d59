"""The reasons in the ``"fscan"`` log's records: one function per public function.

Each is registered with :func:`fscan._route_log.register` and runs only while a DEBUG
record is made, after the call: it gets the engine the call's choices noted (None if
none did: the engine every other path of that function runs) and the call's arguments,
and reads fscan's state without changing it, as ``fscan.explain`` does
(:mod:`fscan._explain`), to say why the engines before the one that ran were passed over.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ._context import under_transform, where
from ._engines.chunked import Operands
from ._engines.cpp.refusal import kernel_refusal
from ._explain import Explanation, explain, explain_arguments
from ._linear import linear_recurrence
from ._pytree import flatten
from ._recurrences.args import RecurrenceCall, shaped_operands
from ._recurrences.solve import LINEAR
from ._reduce import associative_reduce
from ._route_log import Route, register
from ._routing.cumulative import kernel_call
from ._routing.reasons import cumulative_refusals
from ._routing.recurrence import PAIR_SPEC, compose, kernel_refused, reset_refused

__all__: list[str] = []  # registers its functions on import; nothing to call

_NOT_READY = "it did not serve this call (not ready when it ran, or it could not take its inputs)"
_LINEAR_API = "fscan.linear_recurrence"
_SCAN_ORDER = ("triton", "cpp", "tree")  # the scan's engines, fastest first


def _explained(args: tuple, kwargs: dict) -> Explanation:
    """``fscan.explain`` of a scan ahead of it: the route as the router saw it."""
    return explain(**explain_arguments(args, kwargs).arguments)


def _scan(noted: str | None, args: tuple, kwargs: dict, route: Route) -> tuple[str, dict]:
    report = route.before if route.before is not None else _explained(args, kwargs)
    refused = dict(report.refused)
    if report.engine in ("empty", "distributed") or (noted is None and report.engine == "tree"):
        return report.engine, refused
    engine = noted or "tree"
    if engine != report.engine and report.engine in _SCAN_ORDER:
        refused[report.engine] = _NOT_READY  # it would serve now: it got ready meanwhile
    if engine in _SCAN_ORDER:
        before = _SCAN_ORDER[: _SCAN_ORDER.index(engine)]
        refused = {e: why for e, why in refused.items() if e in before}
    return engine, refused


_DROPIN_OPS = {
    "fscan.cumsum": torch.cumsum,
    "fscan.cumprod": torch.cumprod,
    "fscan.logcumsumexp": torch.logcumsumexp,
    "fscan.cummax": torch.cummax,
    "fscan.cummin": torch.cummin,
}


def _dropin(noted: str | None, args: tuple, kwargs: dict, route: Route) -> tuple[str, dict]:
    """Drop-ins: the kernel, else the parallel scan (``blocked``), else torch's op; the
    reasons are the router's (:func:`fscan._routing.reasons.cumulative_refusals`). With
    ``reset=``, fscan's segmented scan (:func:`fscan._routing.cumulative.segmented`)."""
    if kwargs.get("reset") is not None:
        return noted or "tree", {"native": "torch's op has no reset="}
    engine = noted or "native"
    if engine == "cpp":
        return engine, {}
    op = _DROPIN_OPS[route.api]
    x = args[0] if args else kwargs["input"]
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    reverse = bool(kwargs.get("reverse", False))
    refused = cumulative_refusals(op, x, dim, reverse)
    if "cpp" not in refused:  # the table picks the kernel: it did not serve
        combine, spec, leaves, positions = kernel_call(op, x)
        # An exclusive call of a contiguous input waits for the kernel's exclusive variant.
        exclusive = kwargs.get("exclusive") is True and x.is_contiguous()
        why = kernel_refusal(
            combine, spec, leaves, dim % x.ndim, positions=positions, exclusive=exclusive
        )
        refused = {"cpp": why or _NOT_READY, **refused}
    if engine == "blocked":
        refused.pop("blocked", None)
    return engine, refused


def _linear(noted: str | None, args: tuple, kwargs: dict, route: Route) -> tuple[str, dict]:
    """``linear_recurrence``: the kernel, else the chunked walk (``blocked``)."""
    bound = _bind(linear_recurrence, args, kwargs)
    a, b, dim = bound["a"], bound["b"], bound["dim"]
    if b.numel() == 0:
        return "empty", {}
    engine = noted or "blocked"
    if engine == "cpp":
        return engine, {}
    if bound["reset"] is not None:
        return engine, {"cpp": _reset_kernel(bound)}
    return engine, {"cpp": _linear_kernel(a, b, dim % b.ndim, bound)}


def _reset_kernel(bound: dict) -> str:
    # The operands as the router got them (checked, shaped, widened to acc_dtype).
    names = ("a", "b", "dim", "initial", "reverse", "reset", "acc_dtype")
    ops = shaped_operands(RecurrenceCall(_LINEAR_API, *(bound[k] for k in names)))[0]
    refused = reset_refused(LINEAR, ops, where([ops.b]))
    if refused is not None:  # the router's own reason
        return refused
    leaves = [ops.a.expand(ops.b.shape), ops.b]
    found = kernel_refusal(compose, PAIR_SPEC, leaves, ops.dim, segmented=True)
    return found or _NOT_READY


def _linear_kernel(a: Any, b: torch.Tensor, dim: int, bound: dict) -> str:
    # As the kernel sees them: one dtype, one shape, no tape (inside the autograd Function).
    gates = torch.broadcast_to(torch.as_tensor(a, dtype=b.dtype).detach(), b.shape)
    mask, initial = bound["reset"], bound["initial"]
    ops = Operands(gates, b, dim, initial, False, mask)
    refused = kernel_refused(LINEAR, ops, under_transform())
    if refused is not None:  # the router's own reason
        return refused
    found = kernel_refusal(compose, PAIR_SPEC, [gates, b.detach()], dim, dropped=(0,))
    return found or _NOT_READY


def _log_linear(noted: str | None, args: tuple, kwargs: dict, route: Route) -> tuple[str, dict]:
    """``log_linear_recurrence``: the chunked walk from 32 steps, else one tree scan."""
    log_b = args[1] if len(args) > 1 else kwargs["log_b"]
    if log_b.numel() == 0:
        return "empty", {}
    engine = noted or "tree"
    if engine == "blocked":
        return engine, {}
    return engine, {"blocked": "fewer than 32 steps: one scan instead of chunked walks"}


def _matrix(noted: str | None, args: tuple, kwargs: dict, route: Route) -> tuple[str, dict]:
    """``linear_recurrence_matrix``: its own tree of torch ops (no kernel route)."""
    b = args[1] if len(args) > 1 else kwargs["b"]
    dim = args[2] if len(args) > 2 else kwargs["dim"]
    return ("empty" if b.shape[dim] == 0 else "tree"), {}


def _reduce(noted: str | None, args: tuple, kwargs: dict, route: Route) -> tuple[str, dict]:
    """``associative_reduce``: the reduce kernel (``cpp``) where the router ran it, else a
    tree reduction in torch ops."""
    bound = _bind(associative_reduce, args, kwargs)
    leaves = flatten(bound["xs"])[0]
    if leaves[0].shape[bound["dim"]] == 0:
        return "empty", {}
    return ("cpp" if noted == "cpp" else "tree"), {}


def _bind(fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


register("fscan.associative_scan", _scan, before=_explained)
for _api in _DROPIN_OPS:
    register(_api, _dropin)
register("fscan.linear_recurrence", _linear)
register("fscan.log_linear_recurrence", _log_linear)
register("fscan.linear_recurrence_matrix", _matrix)
register("fscan.associative_reduce", _reduce)
