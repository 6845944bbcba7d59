"""Workarounds for four torch bugs met by the backward of fscan's traced scan.

A differentiable scan traced by Dynamo runs through the blocked scan of
``fscan._engines.traced``: gathers (``index_select``) around a ``while_loop`` that gets
its backward from torch. Four torch bugs (2.13) break that backward;
:func:`prepare_loop_backward` works around them while Dynamo traces, before
the graph reaches AOT autograd and the backend.

1. **Wrong gradients under Inductor** (upstream pytorch/pytorch#192840, #193960).
   AOT autograd marks some inputs of a compiled *backward* graph "donated": saved
   tensors nobody else holds, which Inductor may overwrite in place. It records
   them as placeholder positions of that backward graph. Inductor's
   ``SubgraphLowering``, which compiles the body of a ``while_loop`` (or ``cond``,
   ``scan``, ...) inside the backward graph, read the same list and applied it to
   the *subgraph's* placeholders, an unrelated numbering. In the blocked scan's
   backward, the loop body's gradient carry sat at a position the list named:
   the body reused the carry's buffer for its result, so the loop's output *was*
   its initial-carry buffer, which the outer graph, believing it dead after the
   loop, reused for another result while the loop's output was still to be
   read. The gradients at the last step of every block came out wrong (with
   ``torch.add`` and ``TRACED_BLOCK = 8``: row 7 got the gradients of rows 6 and 7 once
   more). The fix is upstream's: a subgraph's inputs belong to its caller, so
   none is donated (:func:`undonate_subgraph_inputs`, applied once per process;
   it only ever turns an in-place reuse into a fresh buffer).

2. **A crash without ``fullgraph=True``.** The ``while_loop`` backward picks the
   saved carries of each iteration with ``.item()``. Dynamo lets a graph hold
   such data-dependent scalars only when ``fullgraph=True`` (or with
   ``torch._dynamo.config.capture_scalar_outputs``): otherwise AOT autograd fails
   with ``aten._local_scalar_dense``, Dynamo falls back to tracing fscan's eager
   engine piecewise, and that fails further on. :func:`allow_loop_scalars`
   lets the graph being traced hold them, as ``fullgraph=True`` would; Dynamo
   still graph-breaks on a user's own ``.item()`` as configured.

3. **Wrong gradients (and out-of-bounds writes) from Inductor's C++ backend**
   (upstream pytorch/pytorch#191837; fix proposed in #191861). The backward
   of a gather is a scatter-add, which the C++ backend writes with ``atomic_add``
   when it runs on more than one thread. When that scatter shares a loop with
   a transposed read, Inductor makes a 2-D tiled kernel, which shifts every
   index by the tile's inner loop variable (``x0 -> x0 + x0_inner``):
   ``CppTile2DKernel.store`` shifts the index, then the vectorised store
   rebuilds it through ``CppTile2DOverrides.index_expr``, which shifts it
   again (``x0 + 2*x0_inner``). fscan met it with symbolic lengths on reverse
   scans along a dimension other than 0: the scatter of the last gather read
   the flipped, transposed output gradient, and every column but the first
   of each 16-wide tile was scattered to the wrong place.
   :func:`shift_tile_indices_once` makes the shift idempotent (an index that
   already holds the inner loop variable is left as it is), which is right
   whether a given torch shifts once or twice.

4. **A spurious error where warnings are errors.** The blocked scan's step gathers
   are a ``torch.autograd.Function`` (``fscan._engines.traced.StepGather``, whose backward
   gathers instead of scattering: Inductor misordered the scatters' kernels). To
   trace one, Dynamo makes a ``torch.autograd.Function()``, whose constructor warns
   (``DeprecationWarning``: "should not be instantiated"); Dynamo means to swallow
   it with ``warnings.catch_warnings(record=True)``, which records warnings but
   still applies the filters, so under ``-W error`` (pytest's ``filterwarnings =
   error``) the trace fails. :func:`quiet_function_contexts` ignores that one
   warning while Dynamo makes such a context.

``tests/test_compile.py`` has canaries that tell when torch no longer needs these.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

__all__ = [
    "allow_loop_scalars",
    "prepare_loop_backward",
    "quiet_function_contexts",
    "shift_tile_indices_once",
    "subgraph_inputs_undonated",
    "tile_indices_shifted_once",
    "undonate_subgraph_inputs",
]


class _Patch(NamedTuple):
    """Where a fix goes, ``module.owner.name``; ``mark`` on ``owner`` says it is in."""

    module: str
    owner: str
    name: str
    mark: str


_UNDONATE = _Patch(
    "torch._inductor.graph", "SubgraphLowering", "__init__", "_fscan_inputs_undonated"
)
_SHIFT_ONCE = _Patch(
    "torch._inductor.codegen.cpp", "CppTile2DKernel", "transform_indexing", "_fscan_shifts_once"
)
_QUIET = _Patch(
    "torch._dynamo.side_effects", "SideEffects", "track_object_new", "_fscan_quiet_contexts"
)


def prepare_loop_backward() -> bool:
    """The workarounds of the module doc, called while Dynamo traces; True.

    Example:
        >>> prepare_loop_backward()  # outside a trace: only the Inductor patches apply
        True
    """
    undonate_subgraph_inputs()
    shift_tile_indices_once()
    allow_loop_scalars()
    quiet_function_contexts()
    return True


# Dynamo cannot trace an import or a class patch: it calls a function so marked while
# it traces and keeps the result as a constant. This is what
# torch.compiler.assume_constant_result does, without importing Dynamo with fscan.
prepare_loop_backward._dynamo_marked_constant = True  # type: ignore[attr-defined]


def undonate_subgraph_inputs() -> bool:
    """Make Inductor's subgraph lowerings donate none of their inputs (bug 1); idempotent.

    Returns whether the fix is in place (:func:`_patch_once`).

    Example:
        >>> undonate_subgraph_inputs() and subgraph_inputs_undonated()
        True
    """

    def undonating(init: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            # Read by GraphLowering.placeholder when the subgraph's inputs are made,
            # after __init__: the parent's positions mean nothing here.
            self.bw_donated_idxs = None

        return __init__

    return _patch_once(_UNDONATE, undonating)


def subgraph_inputs_undonated() -> bool:
    """Whether :func:`undonate_subgraph_inputs` has patched this process's Inductor."""
    return _is_patched(_UNDONATE)


def shift_tile_indices_once() -> bool:
    """Make Inductor's 2-D tiled C++ kernels shift an index by the tile once (bug 3); idempotent.

    Returns whether the fix is in place (:func:`_patch_once`).

    Example:
        >>> shift_tile_indices_once() and tile_indices_shifted_once()
        True
    """

    def shifting_once(shift: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def transform_indexing(self: Any, index: Any) -> Any:
            # The inner loop variable enters an index only through this shift: an
            # index holding it is already shifted, and shifting it again is the bug.
            if self.inner_itervar() in index.free_symbols:
                return index
            return shift(self, index)

        return transform_indexing

    return _patch_once(_SHIFT_ONCE, shifting_once)


def tile_indices_shifted_once() -> bool:
    """Whether :func:`shift_tile_indices_once` has patched this process's Inductor."""
    return _is_patched(_SHIFT_ONCE)


def allow_loop_scalars() -> bool:
    """Let the graph Dynamo is tracing hold data-dependent scalars (bug 2).

    Returns whether it could (False outside a Dynamo trace). The setting lives in
    the trace's ``ShapeEnv``, made afresh for every graph Dynamo traces.
    """
    context = torch._guards.TracingContext.try_get()
    shape_env = getattr(getattr(context, "fake_mode", None), "shape_env", None)
    settings = getattr(shape_env, "settings", None)
    if settings is None or not hasattr(settings, "allow_scalar_outputs"):
        return False
    if not settings.allow_scalar_outputs:
        shape_env.settings = dataclasses.replace(settings, allow_scalar_outputs=True)
    return True


def quiet_function_contexts() -> bool:
    """Ignore the warning Dynamo's own ``torch.autograd.Function()`` raises (bug 4); idempotent.

    Returns whether the fix is in place (:func:`_patch_once`).

    Example:
        >>> quiet_function_contexts()
        True
    """

    def quieted(track: Callable[..., Any]) -> Callable[..., Any]:
        def track_object_new(self: Any, *args: Any, **kwargs: Any) -> Any:
            # Only the constructor's warning: whatever else warns still reaches the filters.
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", r".* should not be instantiated\.", DeprecationWarning
                )
                return track(self, *args, **kwargs)

        return track_object_new

    return _patch_once(_QUIET, quieted)


quiet_function_contexts._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _patch_once(patch: _Patch, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ``patch``'s method by ``wrap(original)`` (wrapped: ``inspect.unwrap`` finds the
    original), once per process. Returns whether the fix is in place: False only where this
    torch has no such method, and so not the bug it fixes."""
    try:  # Inductor and Dynamo: imported when a trace needs the fix, not with fscan
        owner = getattr(importlib.import_module(patch.module), patch.owner)
    except (ImportError, AttributeError):
        return False
    if getattr(owner, patch.mark, False):
        return True
    original = getattr(owner, patch.name, None)
    if original is None:
        return False
    setattr(owner, patch.name, functools.wraps(original)(wrap(original)))
    setattr(owner, patch.mark, True)
    return True


def _is_patched(patch: _Patch) -> bool:
    """Whether :func:`_patch_once` applied ``patch``, without importing its module."""
    loaded = sys.modules.get(patch.module)
    return bool(loaded is not None and getattr(getattr(loaded, patch.owner), patch.mark, False))
