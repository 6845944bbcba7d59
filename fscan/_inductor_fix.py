"""A fix for an Inductor bug that made compiled fscan gradients silently wrong.

The bug (torch <= 2.13; upstream pytorch/pytorch#192840 and #193960): AOT autograd
marks some inputs of a compiled *backward* graph as "donated", i.e. saved tensors
nobody else holds, which Inductor may overwrite in place. It records them as
placeholder positions of that backward graph. Inductor's ``SubgraphLowering``,
which compiles the body of a ``while_loop`` (or ``cond``, ``scan``, ...) inside
that backward graph, reads the same list and applies it to the *subgraph's*
placeholders, an unrelated numbering. In the backward of fscan's blocked scan
(``fscan._traced``) the body of the ``while_loop`` that runs the doubling scan
backwards has the gradient carry at position 1, which the parent's list happened
to name: the body reused the carry's buffer for its result, so the loop's output
*was* its initial-carry buffer, which the outer graph, believing it dead after
the loop, reused for another result while the loop's output was still to be
read. The gradients of the last step of every block came out wrong (with
``torch.add`` and ``BLOCK`` 8: row 7 got the gradients of rows 6 and 7 once more).

The fix is upstream's: a subgraph's inputs belong to its caller, so none is
donated. It is applied to ``torch._inductor.graph.SubgraphLowering`` once, the
first time fscan traces a differentiable blocked scan under Dynamo (from
``fscan._traced``); it only ever turns an in-place reuse into a fresh buffer.
``tests/test_compile.py`` has a canary that tells when torch no longer needs it.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

__all__ = ["subgraph_inputs_undonated", "undonate_subgraph_inputs"]

_MARK = "_fscan_inputs_undonated"


def undonate_subgraph_inputs() -> bool:
    """Make Inductor's subgraph lowerings donate none of their inputs (module doc); idempotent.

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


# Dynamo cannot trace an import or a class patch: it calls a function so marked while
# it traces and keeps the result as a constant. This is what
# torch.compiler.assume_constant_result does, without importing Dynamo with fscan.
undonate_subgraph_inputs._dynamo_marked_constant = True  # type: ignore[attr-defined]
