"""The scan's ``repeat`` route: a scan identical, in everything the route depends on, to
one the router already sent to the C++ kernel runs that kernel again, without the checks.

A small scan (64 elements) spends most of its time above the kernel: the argument
checks, the walk over ``combine_fn``, the knowledge lookups, the route and the kernel
lookup cost ~10 µs around ~2 µs of allocation and kernel. Once :func:`scan_flat
<fscan._routing.scan.scan_flat>` served a call on the kernel, :func:`remember` stores
a :class:`~fscan._engines.cpp._kernel_run.PreparedRun` under the call's key
(:mod:`fscan._routing.repeat_key`); ``fscan.associative_scan`` asks :func:`repeat_scan`
first, which answers from the store or returns None (the full path then runs). The
engine is the kernel, noted as ``cpp`` like any route (the ``"fscan"`` log and
``fscan.explain`` read the same state the full route would have read, and name the
same engine).

Only calls with no ``reset=``/``initial=`` are looked up or stored. A call is stored
only once the checks ``validate`` asks for ran for the key (the purity probe, and for
``validate=None`` the once-per-key associativity check), and never where ``validate``
asks for checks on every call. The store is bounded and cleared by
``fscan.clear_caches()``. (The drop-ins' repeat routes: :mod:`fscan._routing.repeat_drop_ins`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._cache import BoundedCache
from .._call import ScanCall
from .._config import config
from .._engines.cpp.cpu_kernel import PreparedRun, prepare_run, run_prepared
from .._knowledge.store import Knowledge, Reach, on_clear
from .._pytree import LEAF, unflatten
from .._route_log import ran
from .repeat_key import call_parts, stored_run

__all__ = ["remember", "repeat_scan", "repeats"]

# Keys of calls served on the kernel (each a few shapes of a few combine_fns, typically).
repeats: BoundedCache[PreparedRun] = BoundedCache(maxsize=256)
on_clear(repeats.clear)


def repeat_scan(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: Any,
    reverse: Any,
    combine_mode: Any,
    validate: Any,
) -> Any:
    """The scan of ``xs`` by the kernel a call with the same key ran on (module doc), as
    a pytree of ``xs``'s structure; None where no such call was stored (or the captured
    tensors no longer broadcast): the caller then takes the full path."""
    stored = stored_run(repeats, combine_fn, xs, dim, reverse, combine_mode, validate)
    if stored is None:
        return None
    run, leaves, spec, found = stored
    out = run_prepared(run, leaves, found.tensors)
    if out is None:
        return None
    ran("cpp")
    return out[0] if spec is LEAF else unflatten(spec, out)


def remember(call: ScanCall, found: Reach, entry: Knowledge) -> None:
    """Store the kernel that just served ``call`` on the full route (with no carry-in)
    for the calls :func:`repeat_scan` finds identical to it."""
    validate = call.validate
    if call.reset is not None or call.initial is not None or not entry.pure:
        return
    if validate is None:  # the full path checks on every call, or once: checked?
        if config._validate or not entry.associativity_checked:
            return
    elif validate is not False:
        return
    if found.key is None or (found.tensors and found.aliases is None):
        return
    leaves, dim, reverse = call.leaves, call.dim, call.reverse
    parts = call_parts(call.spec, leaves, dim, reverse, call.combine_mode, validate)
    if parts is None:
        return
    key = (found.key, found.aliases, *parts)
    if key not in repeats:
        run = prepare_run(entry, found.aliases if found.tensors else (), leaves, dim, reverse)
        if run is not None:
            repeats.put(key, run)
