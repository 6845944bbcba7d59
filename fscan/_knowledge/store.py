"""One home for what fscan knows about a ``combine_fn``: its verdicts, cached by its key.

A scan's first call checks its ``combine_fn`` (purity, associativity on a few
elements, elementwise ops in pointwise mode, whether the pointwise adjoint
serves its gradients) and builds engines for it. :func:`knowledge` keeps those
verdicts in one bounded cache of :class:`Knowledge` entries, keyed by what
:func:`fscan._knowledge.reach.reach` found that ``combine_fn`` reaches plus the leaves'
pytree structure, mode and :func:`leaf_signature`. Stores kept elsewhere
register with :func:`on_clear`, so :func:`clear_caches` (``fscan.clear_caches``)
forgets everything.

This module is also the face of the walk: ``Reach`` and ``reach`` are
re-exported from :mod:`fscan._knowledge.reach` for the modules that need both.

Example:
    >>> import optree, torch
    >>> leaves, spec = optree.tree_flatten(torch.ones(3))
    >>> make = lambda k: (lambda a, b: a + b * k)
    >>> first = knowledge(reach(make(1)), spec, "pointwise", leaves)
    >>> first is knowledge(reach(make(1)), spec, "pointwise", leaves)
    True
    >>> first is knowledge(reach(make(2)), spec, "pointwise", leaves)
    False
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from optree import PyTreeSpec

from .._cache import BoundedCache
from .reach import Reach, reach
from .reach_keys import code_names

__all__ = [
    "Knowledge",
    "Reach",
    "clear_caches",
    "entries",
    "knowledge",
    "known",
    "leaf_signature",
    "on_clear",
    "reach",
]

ENTRIES = 1024


@dataclass
class Knowledge:
    """Every verdict about one ``combine_fn`` key, filled in as calls need them.

    ``pure``/``elementwise`` are None until checked; ``associativity_checked``
    says the first-call associativity check ran (and warned, if it failed);
    ``adjoint`` maps an element shape to whether the pointwise adjoint serves it;
    ``compiled`` and ``kernels`` hold engines keyed by what else they depend on
    (``dim``, ...).
    """

    pure: bool | None = None
    elementwise: bool | None = None
    associativity_checked: bool = False
    adjoint: dict[Hashable, bool] = field(default_factory=dict)
    compiled: dict[Hashable, Any] = field(default_factory=dict)
    kernels: dict[Hashable, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


entries: BoundedCache[Knowledge] = BoundedCache(maxsize=ENTRIES)
_clear_hooks: list[Callable[[], None]] = []


def knowledge(
    found: Reach, spec: PyTreeSpec, combine_mode: str, leaves: Sequence[torch.Tensor]
) -> Knowledge:
    """The cache entry for this call, or a fresh uncached one when ``found.key`` is None.

    Example:
        >>> import optree
        >>> leaves, spec = optree.tree_flatten(torch.ones(3))
        >>> found = reach(torch.add)
        >>> entry = knowledge(found, spec, "pointwise", leaves)
        >>> entry is knowledge(found, spec, "pointwise", leaves)
        True
    """
    if found.key is None:
        return Knowledge()
    key = (found.key, spec, combine_mode, leaf_signature(leaves))
    return entries.get_or_compute(key, Knowledge)


def known(
    found: Reach, spec: PyTreeSpec, combine_mode: str, leaves: Sequence[torch.Tensor]
) -> Knowledge | None:
    """The cache entry :func:`knowledge` would return, if there is one; stores nothing."""
    if found.key is None:
        return None
    return entries.peek((found.key, spec, combine_mode, leaf_signature(leaves)))


def leaf_signature(leaves: Sequence[torch.Tensor]) -> tuple[Hashable, ...]:
    """Dtype, device, ndim and requires_grad of each leaf: the leaves' part of a key.

    Sizes are left out, so batches of varying length share an entry; verdicts
    that depend on sizes key them inside the entry.

    Example:
        >>> leaf_signature([torch.ones(4, 2)])
        ((torch.float32, device(type='cpu'), 2, False),)
    """
    return tuple([(x.dtype, x.device, x.ndim, x.requires_grad) for x in leaves])


def on_clear(hook: Callable[[], None]) -> Callable[[], None]:
    """Register ``hook`` to run in :func:`clear_caches` (for caches outside the entries)."""
    _clear_hooks.append(hook)
    return hook


def clear_caches() -> None:
    """Forget every cached verdict and compiled engine; the next calls check afresh.

    For tests, benchmarks that time first calls, and code that changed something
    a verdict cannot see (say, a C extension's state that ``combine_fn`` reads).

    Example:
        >>> import fscan, torch
        >>> _ = fscan.associative_scan(torch.add, torch.ones(3), 0)
        >>> fscan.clear_caches()
    """
    entries.clear()
    code_names.cache_clear()
    for hook in _clear_hooks:
        hook()
