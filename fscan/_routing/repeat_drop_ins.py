"""The drop-ins' repeat routes: a drop-in's kernel call (inclusive, exclusive, or with
``reset=`` on the segmented kernel) identical, in everything its route depends on, to
one the drop-ins' router ran on the kernel runs that kernel again, without the checks
(the key: :mod:`fscan._routing.repeat_key`; the scan's own repeat route:
:mod:`fscan._routing.repeat`).

The inclusive drop-ins (``fscan.cumsum``, ``cumprod``, ``logcumsumexp``, and
``cummax``/``cummin``, whose index leaf the kernel makes: int64 outputs):
:func:`remember_cumulative` stores the run the drop-ins' router
(:mod:`fscan._routing.cumulative`) just made on the kernel, under the op (its combine
is fscan's own, capturing nothing), torch's thread count and
:func:`~fscan._routing.repeat_key.call_parts` of its input (with the thread count it
holds all the route table reads: dtype, shape, a contiguous layout, ``dim``,
``reverse``, requires_grad and grad mode; the kernel's thread cap follows from the
shape), and :func:`repeat_cumulative` answers an identical call with it before the
drop-in's checks. Only calls the router ran without ``dtype=``, ``out=``, ``reset=``
or ``exclusive=`` and without promoting the input (a float input) are repeated there;
a call with ``out=`` runs the checks (torch's ``out=`` rules) and then the stored run
into ``out`` where it is laid out as the run's fresh outputs (:func:`repeat_into`).

Their exclusive form (``exclusive=True``, no ``dtype=``, ``out=`` or ``reset=``) is
served the same way, under its own key (the same ``call_parts``, marked exclusive):
:func:`remember_exclusive` stores an :class:`ExclusiveRun`, the kernel's exclusive run
of all ``n`` steps from the op's identity (on the kernel's exclusive variant, built for
exclusive calls alone: see :func:`~fscan._engines.cpp.cpu_kernel.exclusive_ready` and
:func:`~fscan._engines.cpp.cpu_kernel.exclusive_run`), once the exclusive router
(:mod:`fscan._routing.exclusive`) finds that variant READY for a call (nothing
recorded), and :func:`repeat_exclusive` repeats it: one kernel pass writes every step of
fresh outputs, the first in scan order the identity (and index -1), each later one the
scan of the identity and the input's steps before it
(:func:`~fscan._engines.cpp.cpu_kernel.run_exclusive_prepared`), on every path of the
kernel (lanes, chains, tiles, split columns and chunks).
A checked call whose input was promoted or cast is stored under the dtype the kernel
scanned, which an identical later call in that dtype takes as it is, so the key fits
it too.

Their segmented form (``reset=``, inclusive, no ``dtype=`` or ``out=``) likewise:
:func:`remember_segmented` stores the segmented kernel's prepared run
(:class:`~fscan._engines.cpp._kernel_segmented.PreparedSegmentedRun`) once the drop-in's
own call ran on it, under the inclusive key plus the mask's shape and strides (with the
input's shape they fix the mask's check, the kernel's flag mode and where it reads the
flags; only a plain dense bool CPU mask); :func:`repeat_segmented` runs it on the new
input and mask, whose values are read on every call. (The exclusive ``reset=`` path
scans into new memory, then shifts: not repeated.)

The store is bounded and cleared by ``fscan.clear_caches()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from .._cache import BoundedCache
from .._engines.cpp._kernel_segmented import (
    PreparedSegmentedRun,
    prepare_segmented,
    run_segmented_prepared,
)
from .._engines.cpp.cpu_kernel import (
    PreparedRun,
    exclusive_ready,
    exclusive_run,
    prepare_run,
    run_exclusive_prepared,
    run_prepared,
)
from .._knowledge.store import knowledge, on_clear
from .._pytree import LEAF
from .._route_log import ran
from .cumulative_table import EXTREMA
from .repeat_key import call_parts, mask_kind, memo_reach

__all__ = [
    "ExclusiveRun",
    "drop_in_repeats",
    "remember_cumulative",
    "remember_exclusive",
    "remember_segmented",
    "repeat_cumulative",
    "repeat_exclusive",
    "repeat_into",
    "repeat_segmented",
    "run_exclusive",
]


class ExclusiveRun(NamedTuple):
    """An exclusive drop-in's kernel run: ``run`` (an
    :func:`~fscan._engines.cpp.cpu_kernel.exclusive_run`) writes the exclusive scan of all
    ``n`` steps of a contiguous input in one pass from ``start`` (the op's identity, one
    element: ``run`` holds its address)."""

    run: PreparedRun
    start: torch.Tensor


# Keys of drop-in calls served on the kernel (a few ops and shapes, typically).
drop_in_repeats: BoundedCache[PreparedRun | ExclusiveRun | PreparedSegmentedRun] = BoundedCache(
    maxsize=256
)
on_clear(drop_in_repeats.clear)


def repeat_cumulative(op: Any, x: Any, dim: Any, reverse: Any) -> Any:
    """The drop-in of torch's ``op`` on ``x`` by the kernel run an identical call made
    (module doc), or None: the drop-in's checked path then runs."""
    run = _stored(_CUMULATIVE, op, x, dim, reverse)
    if run is None:
        return None
    out = run_prepared(run, [x], ())
    if out is None:  # no params to broadcast: never; the full path would say why
        return None
    ran("cpp")
    return EXTREMA[op]((out[0], out[1])) if run.positions else out[0]


def repeat_into(
    op: Any, x: torch.Tensor, dim: int, reverse: bool, outs: list[torch.Tensor]
) -> list[torch.Tensor] | None:
    """The kernel run an identical call made (as :func:`repeat_cumulative`), written into
    ``outs`` (contiguous, ``x``'s shape and the outputs' dtypes, sharing no memory with
    ``x`` or each other: the caller checked them), or None. For the checked path of
    ``out=``, whose arguments torch's rules must see first: it skips the kernel's lookup
    and layout (a (256, 256) cumsum with ``out=`` 48.7 -> 28.5 us, 19.4 without ``out=``;
    cummax 79.8 -> 38.4, 29.3 without; 1 thread, medians of 300)."""
    run = _stored(_CUMULATIVE, op, x, dim, reverse)
    return None if run is None else run_prepared(run, [x], (), outs=outs)


def _stored(kind: str, op: Any, x: Any, dim: Any, reverse: Any) -> Any:
    """The run stored under ``kind``'s key for a drop-in of ``op`` on ``x`` (a plain tensor
    whose call :func:`~fscan._routing.repeat_key.call_parts` lets repeat), or None."""
    if type(x) is not torch.Tensor:
        return None
    parts = call_parts(LEAF, [x], dim, reverse, "pointwise", False)
    return None if parts is None else drop_in_repeats.get((kind, op, _threads(), *parts))


def remember_cumulative(
    op: Any,
    call: KernelCall,
    dim: int,
    reverse: bool,
    threads: int | None,
) -> None:
    """Store the kernel run the drop-ins' router just made for ``op`` (``call``: the
    combine, fscan's own, capturing nothing, the spec, the leaves of a checked input and
    the position leaves the kernel scanned; ``dim`` non-negative; on ``threads`` threads
    at most) for :func:`repeat_cumulative`."""
    combine, spec, leaves, positions = call
    parts = call_parts(LEAF, leaves[:1], dim, reverse, "pointwise", False)
    if parts is None:
        return
    key = (_CUMULATIVE, op, _threads(), *parts)
    if key not in drop_in_repeats:  # the lookup the kernel's run made, once per key
        holder = knowledge(memo_reach(combine), spec, "pointwise", leaves)
        run = prepare_run(holder, (), leaves, dim, reverse, threads, positions)
        if run is not None:
            drop_in_repeats.put(key, run)


_CUMULATIVE = "cumulative"  # the drop-ins' keys: (this, torch's op, threads, *call_parts)
_EXCLUSIVE = "exclusive"  # their exclusive form's: (this, torch's op, threads, *call_parts)
# The route table reads the thread count (cumulative_table.ONE_THREAD_MIN_LENGTH): so do
# the keys of the runs it picked.
_threads = torch.get_num_threads
# A drop-in's kernel call: combine, spec, leaves (the input, then any position leaf), positions
KernelCall = tuple[Callable[[Any, Any], Any], PyTreeSpec, Sequence[torch.Tensor], tuple[int, ...]]


def repeat_exclusive(op: Any, x: Any, dim: Any, reverse: Any) -> Any:
    """The exclusive drop-in of torch's ``op`` on ``x`` by the kernel run an identical
    call made (module doc), or None: the drop-in's checked path then runs."""
    found = _stored(_EXCLUSIVE, op, x, dim, reverse)
    if found is None:
        return None
    out = run_exclusive(found, x)
    ran("cpp")
    return EXTREMA[op]((out[0], out[1])) if len(out) == 2 else out[0]


def run_exclusive(
    found: ExclusiveRun, x: torch.Tensor, outs: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """``found`` on ``x`` (of the dtype, shape and layout it was stored for): fresh outputs
    (or ``outs``, a checked ``out=``) the kernel writes in one pass, the first step in
    scan order the start values."""
    return run_exclusive_prepared(found.run, x, outs)


def remember_exclusive(
    op: Any,
    call: KernelCall,
    dim: int,
    reverse: bool,
    threads: int | None,
    starts: Sequence[Any],
) -> ExclusiveRun | None:
    """Store, for :func:`repeat_exclusive`, the kernel run the exclusive router makes for
    ``op`` (``call`` as for :func:`remember_cumulative`, of the whole input), as one
    exclusive pass of its kernel over all ``n`` steps from ``starts[0]`` (the identity;
    ``starts``: one per output, the index's -1 the kernel's own), on ``threads`` threads
    at most; the run stored (or found stored), for the router's own call too. The run is
    of the kernel's exclusive variant, a kernel of its own (see
    :func:`~fscan._engines.cpp.cpu_kernel.exclusive_ready`), which this counts, builds or
    queues as the mode says; until it is READY, or for a call the repeat route would not
    take, nothing is stored (None). (Until the kernel wrote the exclusive scan itself, the
    chain path (the last dim, 1-D), logcumsumexp and inputs of over 1 MiB of lanes kept a
    run of ``n - 1`` steps into the outputs' later steps and a fill of the first: see
    :func:`~fscan._engines.cpp.cpu_kernel.exclusive_run`.)"""
    combine, spec, leaves, positions = call
    x = leaves[0]
    parts = call_parts(LEAF, [x], dim, reverse, "pointwise", False)
    if parts is None or x.shape[dim] < 2:
        return None
    key = (_EXCLUSIVE, op, _threads(), *parts)
    found = drop_in_repeats.get(key)
    if found is None:
        if not exclusive_ready(combine, spec, leaves, dim, positions):
            return None
        holder = knowledge(memo_reach(combine), spec, "pointwise", leaves)
        run = prepare_run(holder, (), leaves, dim, reverse, threads, positions, exclusive=True)
        if run is None:
            return None
        start = torch.full((1,), starts[0], dtype=x.dtype)  # every lane's start value
        # Combined with the first step for cumsum only: 0 + -0.0 is +0.0, as torch.cumsum
        # gives; for the others combine(identity, x) is x (and logcumsumexp's -inf met
        # float32 subnormals in logaddexp: 1.10x the inclusive call, (1024, 8, 64) dim 1).
        fold = op is torch.cumsum
        found = ExclusiveRun(exclusive_run(run, start, fold), start)
        drop_in_repeats.put(key, found)
    return found  # type: ignore[return-value]


def repeat_segmented(op: Any, x: Any, dim: Any, reverse: Any, reset: Any) -> Any:
    """The drop-in of torch's ``op`` on ``x`` restarted where ``reset`` is True, by the
    segmented kernel run an identical call made (module doc), or None: the drop-in's
    checked path then runs. The mask's values are read on every call."""
    if type(x) is not torch.Tensor or type(reset) is not torch.Tensor:
        return None
    parts = call_parts(LEAF, [x], dim, reverse, "pointwise", False)  # first: not traced
    mask = None if parts is None else mask_kind(reset)
    if mask is None:
        return None
    run = drop_in_repeats.get((_SEGMENTED, op, *parts, *mask))
    if run is None:
        return None
    out = run_segmented_prepared(run, x, reset)
    ran("cpp")
    return EXTREMA[op]((out[0], out[1])) if run.positions else out[0]


def remember_segmented(
    op: Any,
    call: KernelCall,
    dim: int,
    reverse: bool,
    threads: int | None,
    reset: torch.Tensor,
) -> None:
    """Store the segmented kernel run the drop-ins' router just made for ``op`` (``call``
    as for :func:`remember_cumulative`; ``reset`` the checked mask) for
    :func:`repeat_segmented`."""
    combine, spec, leaves, positions = call
    parts = call_parts(LEAF, leaves[:1], dim, reverse, "pointwise", False)
    mask = None if parts is None else mask_kind(reset)
    if mask is None:
        return
    key = (_SEGMENTED, op, *parts, *mask)
    if key not in drop_in_repeats:
        run = prepare_segmented(combine, spec, leaves, dim, reverse, reset, positions, threads)
        if run is not None:
            drop_in_repeats.put(key, run)


_SEGMENTED = "segmented"  # the reset= drop-ins': (this, torch's op, *call_parts, mask kind)
