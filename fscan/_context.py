"""Where a call runs: the one place that answers "are we tracing, inside a transform, ...?".

Every question about the surroundings of a call (``torch.compile``/``torch.export``
tracing, a ``torch.func`` transform or a forward-AD dual level, grad mode, the device,
a ``TorchDispatchMode``) is asked here, each in one way, so that engines, checks and
the router agree on the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

__all__ = [
    "Where",
    "in_functorch_transform",
    "under_dispatch_mode",
    "under_transform",
    "values_hidden",
    "where",
]


class Where(NamedTuple):
    """Where a call runs, read once per call."""

    tracing: bool  # torch.compile or torch.export traces it
    transform: bool  # a torch.func transform or a forward-AD dual level is active
    grad: bool  # autograd records (grad mode on)
    device: str


def where(leaves: Sequence[torch.Tensor]) -> Where:
    """Read where a call on ``leaves`` runs.

    Example:
        >>> with torch.no_grad():
        ...     where([torch.ones(2)])
        Where(tracing=False, transform=False, grad=False, device='cpu')
    """
    tracing = torch.compiler.is_compiling()
    transform = not tracing and under_transform()
    first = leaves[0]
    device = "cpu" if first.is_cpu else first.device.type  # is_cpu: no torch.device made
    return Where(tracing, transform, torch.is_grad_enabled(), device)


def under_transform() -> bool:
    """A ``torch.func`` transform (``grad``, ``vmap``, ...) or a dual level is active.

    Example:
        >>> inside = lambda x: torch.tensor(under_transform())
        >>> under_transform(), torch.func.vmap(inside)(torch.ones(1))
        (False, tensor([True]))
    """
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return True
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


def in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform is active (a trace inside ``vmap``, ``grad`` &
    co., e.g. a nested scan); Dynamo may call it while it traces.

    Example:
        >>> inside = lambda x: x * in_functorch_transform()
        >>> in_functorch_transform(), torch.func.vmap(inside)(torch.ones(2))
        (False, tensor([1., 1.]))
    """
    return torch._C._functorch.peek_interpreter_stack() is not None


# Dynamo cannot trace the functorch query itself: it calls a function so marked while
# it traces (torch.compiler.assume_constant_result, without importing Dynamo here).
in_functorch_transform._dynamo_marked_constant = True  # type: ignore[attr-defined]


def under_dispatch_mode() -> bool:
    """A ``TorchDispatchMode`` is active: it expects to see every aten op, which a
    native kernel would run behind its back."""
    return bool(torch._C._len_torch_dispatch_stack())


def values_hidden(*ts: torch.Tensor) -> bool:
    """Under ``vmap`` (also ``jacrev``'s, and the legacy batching of
    ``autograd.functional.jacobian(vectorize=True)``) no branch can depend on values."""
    functorch = torch._C._functorch
    if any(functorch.is_legacy_batchedtensor(t) for t in ts):
        return True
    if functorch.peek_interpreter_stack() is None:
        return False
    vmap = functorch.TransformType.Vmap
    return any(i.key() == vmap for i in retrieve_all_functorch_interpreters())
