"""The compiled pointwise engine: Inductor's Triton scan for eager calls on CUDA/XPU.

Inductor lowers torch's ``associative_scan`` higher-order op to a single Triton
scan kernel when its ``combine_fn`` is elementwise. This module wraps that op in
a ``torch.compile(fullgraph=True)`` function per ``(dim, reverse)`` in the
``combine_fn``'s :class:`~fscan._knowledge.store.Knowledge` entry (keyed on its code,
what it reaches, the pytree structure and each leaf's metadata), caches it,
and calls it with the user's ``combine_fn`` as an argument, so Dynamo's
guards, not the key, decide when two functions with one key differ (say two
lambdas capturing different floats): a new length, or a new captured number,
recompiles that entry; nothing else does.
Each entry gets its own code object, so Dynamo's recompile limit (8 per code
object) counts per entry rather than across every ``combine_fn`` in the process.

:func:`codegen_scan` returns None, and the caller runs the generic engine with
the same result, wherever the kernel cannot serve:

* leaves not on CUDA/XPU (CPU, MPS, ...), or of a dtype the kernel does not take;
* Triton not installed (or no GPU it supports);
* gradients wanted (a leaf requires grad, forward AD, a ``torch.func``
  transform): the autograd paths of :mod:`fscan._engines.adjoint_probe` take those;
* ``combine_fn`` closes over tensors: Inductor's lowering takes no tensor
  inputs besides ``xs`` (and the HOP's autograd none at all);
* the compile failed before for this key.

The expected cases are logged once each at debug level (logger ``fscan``). A
compile failure is the unexpected one: it emits one :class:`UserWarning` per
key with the reason, marks the key, and the call still returns the fallback's
result; it never surfaces as an error of the user's call.
"""

from __future__ import annotations

import functools
import itertools
import logging
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from optree import PyTreeSpec

from .._call import ScanCall
from .._combine import FlatCombine
from .._context import under_dispatch_mode
from .._knowledge.store import Knowledge, Reach, knowledge, on_clear
from .hop import CODEGEN_DEVICES, SpecSource, hop_combine, spec_source

__all__ = ["SCAN_DTYPES", "codegen_backward_scan", "codegen_scan", "codegen_unavailable"]

logger = logging.getLogger("fscan")

# Dtypes Inductor's scan codegen takes (complex and bool are not among them).
SCAN_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64}
)
# The torch.compile backend; tests run the machinery on CPU with "aot_eager".
BACKEND: Any = "inductor"


@dataclass
class CompiledScan:
    """One compiled scan function and whether compiling it failed."""

    run: Callable[..., list[torch.Tensor]]
    failed: bool = False


_logged: set[str] = set()  # the reasons logged once (again after fscan.clear_caches())


@on_clear
def _forget_logged() -> None:
    _logged.clear()


def codegen_scan(call: ScanCall, found: Reach, entry: Knowledge) -> list[torch.Tensor] | None:
    """The pointwise scan of a checked call's flat leaves along its ``dim`` by a compiled
    Triton kernel, or None where that kernel cannot serve (see module doc); the router
    then runs another engine.

    Example (on CPU there is no kernel):
        >>> import optree
        >>> from fscan._knowledge.store import Knowledge, reach
        >>> x = torch.ones(4)
        >>> spec = optree.tree_structure(x)
        >>> call = ScanCall("demo", torch.add, x, spec, [x], 0, False, "pointwise")
        >>> codegen_scan(call, reach(torch.add), Knowledge()) is None
        True
    """
    api, combine_fn, _, spec, leaves, dim, reverse = call[:7]
    reason = codegen_unavailable(leaves, found)
    if reason is not None:
        _log_once(reason)
        return None
    with entry.lock:  # one compiled function per (dim, reverse) in the combine_fn's entry
        compiled = entry.compiled.get((dim, reverse))
        if compiled is None:
            compiled = entry.compiled[(dim, reverse)] = CompiledScan(
                _compile(api, spec, dim, reverse)
            )
    if compiled.failed:
        return None
    try:
        # Captured numbers become constants of the kernel (guarded, so a new value
        # recompiles): the lowering takes no scalar inputs either.
        with torch._dynamo.config.patch(specialize_float=True, specialize_int=True):
            out = compiled.run(combine_fn, *leaves)
    except Exception as err:  # any failure to compile falls back: see module doc
        compiled.failed = True
        warnings.warn(_failure_message(api, err), UserWarning, stacklevel=4)
        return None
    return out


def codegen_unavailable(leaves: Sequence[torch.Tensor], found: Reach) -> str | None:
    """Why the compiled kernel cannot serve this call, or None if it can.

    ``found`` is what :func:`fscan._knowledge.store.reach` found of ``combine_fn``.
    """
    first = leaves[0]
    device = "cpu" if first.is_cpu else first.device.type  # asked on every CPU call: keep it cheap
    if device not in CODEGEN_DEVICES:
        return f"no scan codegen on {device}"
    dtypes = {x.dtype for x in leaves} - SCAN_DTYPES
    if dtypes:
        return f"dtype {sorted(map(str, dtypes))[0]} has no scan codegen"
    if not _has_triton():
        return "Triton is not installed or supports no GPU here"
    if torch.is_grad_enabled() and any(x.requires_grad for x in leaves):
        return "gradients are wanted: the autograd engine runs"
    if found.tensors:
        return "combine_fn closes over tensors, which Inductor's scan lowering cannot take"
    if under_dispatch_mode():  # as for the C++ kernel: modes see aten ops
        return "a TorchDispatchMode is active: the kernel's work would be hidden from it"
    return None


@functools.cache
def _has_triton() -> bool:
    from torch.utils._triton import has_triton

    return has_triton()


def _compile(api: str, spec: PyTreeSpec, dim: int, reverse: bool) -> Callable[..., Any]:
    """``torch.compile`` of a fresh copy of :func:`_scan_with_hop` for one cache entry."""
    # Made here, outside the trace: see fscan._engines.hop on specs and Dynamo.
    spec_of = spec_source(spec)
    run = functools.partial(_fresh_copy(_scan_with_hop), api, spec_of, dim, reverse)
    return torch.compile(run, backend=BACKEND, fullgraph=True)


def _scan_with_hop(
    api: str,
    spec_of: SpecSource,
    dim: int,
    reverse: bool,
    combine_fn: Callable[[Any, Any], Any],
    *leaves: torch.Tensor,
) -> list[torch.Tensor]:
    from torch._higher_order_ops.associative_scan import associative_scan_op

    xs = [x.movedim(dim, 0) for x in leaves]
    if reverse:
        xs = [x.flip(0) for x in xs]
    ys = list(associative_scan_op(hop_combine(api, combine_fn, spec_of), xs, ()))
    if reverse:
        ys = [y.flip(0) for y in ys]
    return [y.movedim(0, dim) for y in ys]


_copies = itertools.count(1)


def _fresh_copy(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own, which Dynamo caches (and limits) separately."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _failure_message(api: str, err: BaseException) -> str:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return (
        f"{api}: compiling the pointwise scan kernel failed ({type(err).__name__}: {reason}); "
        "this combine_fn runs on fscan's generic engine instead, with the same results. "
        "This warning is shown once per combine_fn and leaf layout."
    )


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.debug("fscan: pointwise scan without compiled kernel: %s", reason)


def codegen_backward_scan(
    combine: FlatCombine, key: tuple, leaves: list[torch.Tensor], reverse: bool
) -> list[torch.Tensor] | None:
    """The adjoint recurrence of a pointwise scan as one compiled scan kernel (Triton on
    CUDA/XPU), or None; the router hands it to the adjoint (``ScanPlan.backward_scan``).

    The adjoint of a pointwise scan is itself a pointwise scan: composing affine maps
    is elementwise, so the forward's compiled engine takes it. ``combine`` is made
    afresh per backward from the block pattern and the leaf count alone, so ``key``
    names them instead of a walk over its closure (which gives up on long patterns).
    """
    if codegen_unavailable(leaves, Reach(None, ())) is not None:
        return None  # a CPU backward: no kernel to look up (the usual case, kept cheap)
    spec = optree.tree_structure(list(leaves))
    found = Reach(key, ())
    entry = knowledge(found, spec, "pointwise", leaves)
    call = ScanCall("fscan backward", combine, leaves, spec, leaves, 0, reverse, "pointwise")
    return codegen_scan(call, found, entry)
