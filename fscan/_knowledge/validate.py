"""The ``combine_fn`` checks a scan runs before it starts: one hook for the front end.

* Always: the purity probe (:mod:`fscan._knowledge.purity`) on the first call per key,
  a cache lookup after that.
* With ``validate=True`` (or ``fscan.config.validate`` when ``validate`` is None):
  the probe on every call, uncached, then the randomized associativity check of
  :mod:`fscan._knowledge.associativity` on this call's data.
* Under a ``torch.func`` transform (``vmap``, ``grad``, ...), whose wrapped
  tensors hide values and refuse random draws: nothing beyond the cached probe;
  a plain call with the same ``combine_fn`` runs the checks.
* While ``torch.compile`` or ``torch.export`` traces (``torch.compiler.is_compiling()``):
  nothing, not even with ``validate=True``. The probe reads version counters,
  compares values and installs a dispatch mode, none of which belongs in a
  graph; skipping keeps ``fullgraph=True`` compilation free of graph breaks.
  The checks run on eager calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from optree import PyTreeSpec

from .._config import config
from .._errors import ScanTypeError
from .associativity import assert_associative
from .purity import ensure_pure, probe_purity, probeable
from .store import Knowledge

__all__ = ["validate_combine_fn"]


def validate_combine_fn(
    api: str,
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    combine_mode: str,
    validate: bool | None,
    entry: Knowledge,
) -> None:
    """Run the checks ``validate`` asks for on already-checked flat ``leaves``.

    Example:
        >>> import fscan, optree
        >>> leaves, spec = optree.tree_flatten(torch.randn(16))
        >>> from fscan._knowledge.store import Knowledge
        >>> args = (spec, leaves, 0, "pointwise", True, Knowledge())
        >>> validate_combine_fn("demo", torch.add, *args)
        >>> try:
        ...     validate_combine_fn("demo", torch.sub, *args)
        ... except fscan.NotAssociativeError as err:
        ...     print(str(err)[:47])
        demo: `combine_fn` is not associative: for leaf
    """
    if validate is not None and not isinstance(validate, bool):
        raise ScanTypeError(
            f"{api}: `validate` must be a bool or None, got {type(validate).__name__} {validate!r}."
        )
    if torch.compiler.is_compiling():
        return
    if not (config.validate if validate is None else validate):
        ensure_pure(api, combine_fn, spec, leaves, dim, combine_mode, entry)
        return
    if leaves[0].shape[dim] == 0 or not probeable(leaves):
        return  # under a torch.func transform: values are hidden; checked on plain calls
    probe_purity(api, combine_fn, spec, leaves, dim, combine_mode)
    assert_associative(api, combine_fn, spec, leaves, dim, combine_mode)
