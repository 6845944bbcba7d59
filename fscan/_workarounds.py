"""Workarounds for two torch bugs met by the ``while_loop`` of fscan's traced scan.

A differentiable scan traced by Dynamo runs through the blocked scan of
``fscan._traced``, whose ``while_loop`` gets its backward from torch. Two torch
bugs (2.13) break that backward; :func:`prepare_loop_backward` works around both,
while Dynamo traces, before the graph reaches AOT autograd and the backend.

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
   ``torch.add`` and ``BLOCK = 8``: row 7 got the gradients of rows 6 and 7 once
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

``tests/test_compile.py`` has canaries that tell when torch no longer needs these.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import torch

__all__ = [
    "allow_loop_scalars",
    "prepare_loop_backward",
    "subgraph_inputs_undonated",
    "undonate_subgraph_inputs",
]

_MARK = "_fscan_inputs_undonated"


def prepare_loop_backward() -> bool:
    """Both workarounds of the module doc, called while Dynamo traces; True.

    Example:
        >>> prepare_loop_backward()  # outside a trace: only the Inductor patch applies
        True
    """
    undonate_subgraph_inputs()
    allow_loop_scalars()
    return True


# Dynamo cannot trace an import or a class patch: it calls a function so marked while
# it traces and keeps the result as a constant. This is what
# torch.compiler.assume_constant_result does, without importing Dynamo with fscan.
prepare_loop_backward._dynamo_marked_constant = True  # type: ignore[attr-defined]


def undonate_subgraph_inputs() -> bool:
    """Make Inductor's subgraph lowerings donate none of their inputs (bug 1); idempotent.

    Returns whether the fix is in place (False only where this torch has no
    ``SubgraphLowering`` to fix).

    Example:
        >>> undonate_subgraph_inputs() and subgraph_inputs_undonated()
        True
    """
    try:
        from torch._inductor.graph import SubgraphLowering
    except ImportError:  # a torch without Inductor has no such bug
        return False
    if getattr(SubgraphLowering, _MARK, False):
        return True
    init = SubgraphLowering.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # Read by GraphLowering.placeholder when the subgraph's inputs are made,
        # after __init__: the parent's positions mean nothing here.
        self.bw_donated_idxs = None

    SubgraphLowering.__init__ = __init__
    setattr(SubgraphLowering, _MARK, True)
    return True


def subgraph_inputs_undonated() -> bool:
    """Whether :func:`undonate_subgraph_inputs` has patched this process's Inductor."""
    graph = sys.modules.get("torch._inductor.graph")
    return bool(graph is not None and getattr(graph.SubgraphLowering, _MARK, False))


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
