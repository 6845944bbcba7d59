"""The backward kernel for callers with an autograd Function of their own
(:func:`kernel_vjp`): the linear recurrence's backward is the affine pair's with only
``h``'s cotangent, by the kernel built without the others (see
:mod:`fscan._engines.cpp._kernel_grad`, whose slots and runner it shares)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from optree import PyTreeSpec

from ._kernel_entry import Entry
from ._kernel_grad import _entry_without, _run, _Slots
from ._kernel_layout import element_shape
from ._kernel_registry import serving_lookup

__all__ = ["kernel_vjp"]


def kernel_vjp(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    xs: Sequence[torch.Tensor | None],
    ys: Sequence[torch.Tensor | None],
    grads: Sequence[torch.Tensor | None],
    dim: int,
    reverse: bool,
) -> list[torch.Tensor | None] | None:
    """The cotangents of the leaves ``xs`` of the scan ``ys = scan(combine_fn, xs)`` along
    ``dim`` for the cotangents ``grads`` of its outputs (None: zero), by the backward kernel
    built without the None ones; or None where no READY kernel serves (the call is
    counted and the kernel built or queued per ``fscan.config.cpu_kernel``, as any).

    For callers with an autograd Function of their own (the linear recurrence's keeps
    neither ``b`` nor the gate products): an entry of ``xs`` or ``ys`` may be None where
    that kernel does not read it (the kernel gets another operand of the same shape and
    dtype in its place); None is returned where it would. No gradients of captured
    tensors. The leaves' dtypes and shapes must be those of a scan the kernel serves.

    Example:
        >>> import fscan, optree
        >>> x = torch.ones(4)
        >>> with fscan.config.override(cpu_kernel="off"):
        ...     kernel_vjp(torch.add, optree.tree_structure(0), [x], [x], [x], 0, False)
    """
    present = [t for t in (*xs, *ys) if t is not None]
    if not present or all(g is None for g in grads):
        return None
    stand_in = present[0].detach()
    leaves = [stand_in if x is None else x.detach() for x in xs]
    outs = [stand_in if y is None else y.detach() for y in ys]
    if any(t.dtype != u.dtype or t.shape != u.shape for t, u in zip(outs, leaves)):
        return None
    lookup = serving_lookup(combine_fn, spec, leaves, None, None, gradients=True)
    if lookup is None:
        return None
    holder, aliases, captured = lookup
    element = element_shape(leaves, dim)
    missing = tuple([k for k, g in enumerate(grads) if g is None])
    entry = _entry_without(
        _Slots(holder, aliases, combine_fn, spec, element), missing, leaves, captured, False
    )
    if entry is None or not _reads_present(entry, xs, ys):
        return None
    found = _run(entry, leaves, outs, grads, dim, reverse, captured)
    return None if found is None else found[0]


def _reads_present(
    entry: Entry, xs: Sequence[torch.Tensor | None], ys: Sequence[torch.Tensor | None]
) -> bool:
    """Whether the VJP of ``entry`` reads no leaf given as None: neither ``r{k}`` (``xs``)
    nor ``l{k}`` (``ys``, the left operand being the output one step before)."""
    assert entry.program is not None
    absent = {f"r{k}" for k, x in enumerate(xs) if x is None}
    absent |= {f"l{k}" for k, y in enumerate(ys) if y is None}
    reads = entry.program.reads
    if not absent:
        return True
    return bool(reads) and not any(absent & names for names in reads)
