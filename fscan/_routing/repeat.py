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
same engine). Where no record is gathered (:func:`fscan._route_log.quiet`) the door asks
ahead of the log's wrapper, else inside it; a lone tensor's key is built by one function
(:func:`~fscan._routing.repeat_key.lone_parts`). A repeated (64,) add costs ~6.5 µs end
to end (thread CPU), ~1.2 µs of it allocating the output and ~0.5 µs in the kernel; the
rest: the key's checks (~1.8 µs), the lookup (~0.8 µs) and the calls between.

A call that wants gradients is repeated the same way where the full route served it on
the kernel's ``adjoint`` route (:func:`~fscan._engines.cpp._kernel_grad.kernel_grad_scan`:
a forward of ~10 µs took ~90 µs there, the lookups costing what the checks do):
:func:`remember` then stores a :class:`~fscan._engines.cpp._kernel_grad.PreparedGradRun`
(the forward and backward kernels, both READY, and the forward's prepared run) under
the same key, which holds what that route decided on besides: each leaf's
requires_grad, each captured tensor's (in ``combine_fn``'s reach key) and grad mode.
:func:`repeat_scan` runs the kernels' autograd Function with it, built around this
call's ``combine_fn`` and captured tensors (the backward's fallbacks, such as
``create_graph=True``, call them; its choice of kernel by the cotangents given is made
in the backward, as on the full route). Stored only where the full route's verdicts for
the key say it takes that route whatever the values: ``combine_fn`` checked elementwise
(else the full route watches its first call), and not a combine that selects by a mask
(read on every call, as the full route reads it).

Only calls with no ``reset=``/``initial=`` are looked up or stored. A call is stored
only once the checks ``validate`` asks for ran for the key (the purity probe, and for
``validate=None`` the once-per-key associativity check), and never where ``validate``
asks for checks on every call. The store is bounded and cleared by
``fscan.clear_caches()``. (The drop-ins' repeat routes: :mod:`fscan._routing.repeat_drop_ins`.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._cache import BoundedCache
from .._call import SCAN_API, ScanCall
from .._combine import flat_combine
from .._config import config
from .._engines.cpp._kernel_grad import PreparedGradRun, prepare_grad_run, run_grad_prepared
from .._engines.cpp.cpu_kernel import PreparedRun, prepare_run, run_prepared
from .._knowledge.store import Knowledge, Reach, on_clear
from .._pytree import LEAF, unflatten
from .._route_log import ran
from .repeat_key import ONE_LEAF, call_parts, lone_parts, memo_reach, stored_run

__all__ = ["remember", "repeat_scan", "repeats"]

# Keys of calls served on the kernel (each a few shapes of a few combine_fns, typically).
# A key's route is one (grad mode and every requires_grad are in it): a PreparedRun where
# no gradient is wanted, a PreparedGradRun where one is.
repeats: BoundedCache[PreparedRun | PreparedGradRun] = BoundedCache(maxsize=256)
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
    if type(xs) is torch.Tensor:  # a lone tensor, the small call: one key, no lists
        parts = lone_parts(ONE_LEAF, xs, dim, reverse, combine_mode, validate, True)
        if parts is None:
            return None
        key, tensors, aliases = found = memo_reach(combine_fn)
        if key is None or (tensors and aliases is None):
            return None
        run = repeats.get((key, aliases, *parts))
        if run is None:
            return None
        if type(run) is PreparedRun:
            out = run_prepared(run, (xs,), tensors)
            if out is None:
                return None
            ran("cpp")
            return out[0]
        leaves, spec = [xs], LEAF
    else:
        stored = stored_run(repeats, combine_fn, xs, dim, reverse, combine_mode, validate, True)
        if stored is None:
            return None
        run, leaves, spec, found = stored
        if type(run) is PreparedRun:
            out = run_prepared(run, leaves, found.tensors)
            if out is None:
                return None
            ran("cpp")
            return out[0] if spec is LEAF else unflatten(spec, out)
    if getattr(combine_fn, "selects_by_mask", False):  # the full route's autograd
        return None
    combine = flat_combine(SCAN_API, combine_fn, spec, "pointwise")
    out = run_grad_prepared(run, combine, combine_fn, spec, leaves, found.tensors)
    if out is None:
        return None
    ran("cpp")
    return out[0] if spec is LEAF else unflatten(spec, out)


def remember(call: ScanCall, found: Reach, entry: Knowledge, grads: bool = False) -> None:
    """Store the kernel that just served ``call`` on the full route (with no carry-in)
    for the calls :func:`repeat_scan` finds identical to it; ``grads``: the kernels of
    the ``adjoint`` route (:func:`~fscan._engines.cpp._kernel_grad.kernel_grad_scan`)."""
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
    if grads and entry.elementwise is not True:  # the full route watches combine_fn's call
        return
    leaves, dim, reverse = call.leaves, call.dim, call.reverse
    parts = call_parts(call.spec, leaves, dim, reverse, call.combine_mode, validate, grads)
    if parts is None:
        return
    key = (found.key, found.aliases, *parts)
    if key in repeats:
        return
    aliases = found.aliases if found.tensors else ()
    if grads:
        param_grads = any(t.requires_grad for t in found.tensors)
        run = prepare_grad_run(entry, aliases, leaves, dim, reverse, param_grads)
    else:
        run = prepare_run(entry, aliases, leaves, dim, reverse)
    if run is not None:
        repeats.put(key, run)
