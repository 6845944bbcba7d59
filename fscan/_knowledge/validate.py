"""The ``combine_fn`` checks a scan runs before it starts: one hook for the front end.

* Always: the purity probe (:mod:`fscan._knowledge.purity`) on the first call per key,
  a cache lookup after that.
* With ``validate=None`` (the default) and ``fscan.config.validate`` False: on
  the first call per key, also the quick associativity check of
  :mod:`fscan._knowledge.associativity` (a few elements of this call's data, in float64
  where they are floating point); a failure warns once, with
  :class:`fscan.NotAssociativeWarning`, and the scan runs. ``validate=False``
  skips it.
* With ``validate=True`` (or ``fscan.config.validate`` when ``validate`` is None):
  the probe on every call, uncached, then the full randomized associativity check
  on this call's data, which raises.
* Under a ``torch.func`` transform (``vmap``, ``grad``, ...) or a forward-AD dual
  level, whose wrapped tensors hide values and refuse random draws: nothing beyond
  the cached probe; a plain call with the same ``combine_fn`` runs the checks.
* While ``torch.compile`` or ``torch.export`` traces (``torch.compiler.is_compiling()``):
  nothing, not even with ``validate=True``. The probe reads version counters,
  compares values and installs a dispatch mode, none of which belongs in a
  graph; skipping keeps ``fullgraph=True`` compilation free of graph breaks.
  The checks run on eager calls.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

from .._call import ScanCall
from .._config import config
from .._context import under_transform
from .._errors import NotAssociativeWarning, ScanTypeError
from .associativity import assert_associative, quick_violation
from .purity import ensure_pure, probe_purity, probeable
from .store import Knowledge

__all__ = ["validate_combine_fn"]

# Frames from files under this folder are fscan's; a warning points past them.
# fscan/, the package root (this module is in fscan/_knowledge/).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def validate_combine_fn(call: ScanCall, entry: Knowledge) -> None:
    """Run the checks ``call.validate`` asks for on a checked call's flat leaves.

    Example:
        >>> import fscan, optree, warnings
        >>> from fscan._knowledge.store import Knowledge
        >>> xs = torch.randn(16)
        >>> call = ScanCall("demo", torch.add, xs, optree.tree_structure(xs), [xs], 0, False, "")
        >>> call = call._replace(combine_mode="pointwise", validate=True)
        >>> validate_combine_fn(call, Knowledge())
        >>> try:
        ...     validate_combine_fn(call._replace(combine_fn=torch.sub), Knowledge())
        ... except fscan.NotAssociativeError as err:
        ...     print(str(err)[:47])
        demo: `combine_fn` is not associative: for leaf
        >>> entry, sub = Knowledge(), call._replace(combine_fn=torch.sub, validate=None)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     validate_combine_fn(sub, entry)
        ...     validate_combine_fn(sub, entry)  # checked once
        >>> [type(w.message).__name__ for w in caught]
        ['NotAssociativeWarning']
    """
    leaves, dim, validate, api = call.leaves, call.dim, call.validate, call.api
    if validate is not None and not isinstance(validate, bool):
        raise ScanTypeError(
            f"{api}: `validate` must be a bool or None, got {type(validate).__name__} {validate!r}."
        )
    if torch.compiler.is_compiling():
        return
    if not (config.validate if validate is None else validate):
        ensure_pure(call, entry)
        if validate is None and not entry.associativity_checked:
            _check_associative_once(call, entry)
        return
    if leaves[0].shape[dim] == 0 or not probeable(leaves):
        return  # under a torch.func transform: values are hidden; checked on plain calls
    probe_purity(call)
    assert_associative(call)


def _check_associative_once(call: ScanCall, entry: Knowledge) -> None:
    """The quick associativity check, once per ``entry``; warns if it fails."""
    leaves, dim = call.leaves, call.dim
    if leaves[0].shape[dim] == 0 or not probeable(leaves) or under_transform():
        return  # no values to compare (or none visible): the next plain call checks
    message = quick_violation(call)
    entry.associativity_checked = True
    if message is not None:
        message += (
            " (Checked once per combine_fn, on a few elements of this call's data; "
            "validate=True raises instead, validate=False skips the check.)"
        )
        warnings.warn(message, NotAssociativeWarning, stacklevel=_user_stacklevel())


def _user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel`` for the first frame outside fscan (the user's
    call), counted from the caller of this function."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
