"""When composing gates is exact: the numerics the chunked and the sharded recurrences share.

The chunked walk composes a chunk's steps into one map ``e -> A e + B`` (``A`` the
product of its gates, ``B`` its end state from zero), and the recurrence over
chunks applies these maps. Up to rounding that is the loop, except where ``A`` is
not a normal number: a product that underflowed to 0 (or a subnormal) meets an
infinite state (``0 * inf`` is NaN where the loop keeps the inf) or a huge one
(whose decayed part the loop keeps); a product that overflowed (or met an inf or
NaN gate) meets a zero or finite state (``inf * 0``). The loop never forms the
product, so it has none of these. Every composed carry is checked (one vectorised
test of the chunks' products, a few more where one is not normal) and the lanes
where one fails are walked step by step over the chunks where it fails.

"""

from __future__ import annotations

import torch
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

__all__ = ["all_normal", "inexact_carries", "values_hidden"]


def inexact_carries(
    gate: torch.Tensor, entering: torch.Tensor, end: torch.Tensor, reset: torch.Tensor | None
) -> torch.Tensor:
    """Where ``end = gate * entering + local`` (a composed chunk) may differ from the
    steps' result by more than rounding: see the comment above. A product below the
    smallest normal number loses at most ``|entering| * tiny`` of the loop's state,
    which matters where it exceeds the end state's rounding (``eps |end|``). A chunk
    holding a reset drops what enters it (a selection, exact). A complex product meets
    an infinite state exactly only step by step."""
    size = gate.abs()  # real, also for complex gates
    info = torch.finfo(size.dtype)
    wild = ~torch.isfinite(gate) & ~torch.isnan(entering)  # NaN stays NaN either way
    lost = torch.isinf(entering) | (entering.abs() * info.tiny > end.abs() * info.eps)
    bad = wild | ((size < info.tiny) & lost)
    if entering.is_complex():  # (a1 a2) inf and a1 (a2 inf) differ in their NaN parts
        bad = bad | torch.isinf(entering)
    return bad if reset is None else bad & ~reset


def all_normal(gates: torch.Tensor) -> bool:
    """Whether every gate product is a normal number (one reduction, one sync)."""
    size = gates.abs()
    low, high = torch.aminmax(size)
    info = torch.finfo(size.dtype)
    return bool((low >= info.tiny) & (high <= info.max))  # False where a NaN is


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
