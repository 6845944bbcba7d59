"""The internal entry: :func:`run_scan` runs a checked :class:`~fscan._call.ScanCall`.

Below every public door and above the router. It folds ``initial`` into the first
element (:mod:`fscan._carry`), turns ``reset=`` into a scan of ``(flag, value)``
pairs (:mod:`fscan._segmented`, which it hands itself to), and gives the router
(:mod:`fscan._routing.scan`) flat leaves together with what :mod:`fscan._knowledge.store`
knows about ``combine_fn``, after the validation ``validate=`` asks for. fscan's own
scans (the drop-ins' blocked scans, the chunked recurrence's tree, ``fscan.lax``,
DTensor's local scans, the distributed pieces) enter here, never through
``fscan.associative_scan`` again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._call import SCAN_API, ScanCall
from ._carry import carried_heads, swap_heads
from ._checks import check_scan_args
from ._combine import FlatCombine
from ._exclusive import check_exclusive, exclusive_scan
from ._knowledge.pointwise_check import checked_on_first_call
from ._knowledge.store import knowledge, reach
from ._knowledge.validate import validate_combine_fn
from ._pytree import flatten, unflatten
from ._routing.scan import scan_flat, scan_traced
from ._routing.segmented import scan_segmented
from ._segmented import segmented_scan

__all__ = ["checked_call", "run_scan", "scan_tree"]


def checked_call(call: ScanCall) -> ScanCall:
    """``call`` as a door built it from a user's arguments, checked: its ``dim`` made
    non-negative (the other fields are checked where they are used)."""
    api, combine_fn, xs, spec, leaves, dim, reverse, combine_mode = call[:8]
    dim = check_scan_args(api, combine_fn, xs, leaves, dim, reverse, combine_mode)
    if call.exclusive is not False:
        check_exclusive(api, call.exclusive, call.initial, needs_initial=True)
    # tuple.__new__, not _replace: no Python frames on every public call (~0.2 us).
    return tuple.__new__(ScanCall, (api, combine_fn, xs, spec, leaves, dim, *call[6:]))


def scan_tree(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool = False,
    combine_mode: str = "pointwise",
    **options: Any,
) -> Any:
    """The scan of ``xs`` for fscan's own callers, whose arguments fscan made or checked:
    ``dim`` non-negative, every leaf a dense tensor with that dimension, of one length.
    ``options``: the call record's ``reset=``, ``initial=`` and ``exclusive=``
    (:class:`~fscan._call.ScanCall`; ``exclusive=True`` with an ``initial``).

    Example:
        >>> scan_tree(torch.add, torch.arange(1.0, 5.0), 0)
        tensor([ 1.,  3.,  6., 10.])
    """
    leaves, spec = flatten(xs)
    args = (combine_fn, xs, spec, leaves, dim, reverse, combine_mode)
    return run_scan(ScanCall(SCAN_API, *args, **options))


def run_scan(call: ScanCall, out: list[torch.Tensor] | None = None) -> Any:
    """Run a checked call; return a pytree of ``xs``'s structure and shapes, in new memory.

    ``out``: memory the C++ kernel may write the results into, one tensor per leaf (an
    exclusive scan's narrowed views of its outputs: see :mod:`fscan._exclusive`); other
    routes ignore it."""
    if call.exclusive:  # the scan of the steps before each step: see fscan._exclusive
        return exclusive_scan(run_scan, call)
    _, combine_fn, xs, spec, leaves, dim, reverse, combine_mode, _, reset, initial = call[:11]
    heads = None  # a carry-in the C++ kernel may read in place of the first element
    if initial is not None:  # folded into the first element: see fscan._carry
        heads = carried_heads(call, check=_fold_check(call))
        if heads is not None and (reset is not None or not _may_carry_in(leaves, heads)):
            leaves = swap_heads(leaves, heads, dim, reverse)
            xs, heads = unflatten(spec, leaves), None
            call = call._replace(xs=xs, leaves=leaves)
    if reset is not None:  # the segmented kernel, else a scan over (flag, value) pairs
        call = call._replace(initial=None)
        served = None if torch.compiler.is_compiling() else scan_segmented(call)
        return unflatten(spec, served) if served is not None else segmented_scan(run_scan, call)
    if torch.compiler.is_compiling():
        return unflatten(spec, scan_traced(call))
    found = reach(combine_fn)
    entry = knowledge(found, spec, combine_mode, leaves)
    validate_combine_fn(call, entry)
    return unflatten(spec, scan_flat(call, found, entry, heads, out))


def _fold_check(call: ScanCall) -> Callable[[FlatCombine], FlatCombine] | None:
    """The pointwise check for the fold's ``combine_fn`` call: in a one-step scan it is
    the only call, and on a batch of one element a non-elementwise ``combine_fn`` would
    give another answer than on the element (see fscan._knowledge.pointwise_check)."""
    if call.combine_mode != "pointwise" or torch.compiler.is_compiling():
        return None
    entry = knowledge(reach(call.combine_fn), call.spec, "pointwise", call.leaves)
    if entry.elementwise:
        return None
    return lambda combine: checked_on_first_call(call.api, combine, entry, call.leaves)


def _may_carry_in(leaves: list[torch.Tensor], heads: list[torch.Tensor]) -> bool:
    """Whether ``scan_flat`` may get the carry-in unfolded: not while tracing (the traced
    route folds), and no gradient wanted (gradients to ``initial`` flow through the
    fold's torch ops; the kernel's carry-in has no backward)."""
    if torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled():
        for t in (*leaves, *heads):
            if t.requires_grad:
                return False
    return True
