"""The generated C++ scan kernel for pointwise ``combine_fn``s on CPU.

:func:`kernel_scan` serves a pointwise scan on CPU with a kernel generated from
``combine_fn`` (see :mod:`._cpp_codegen` and :mod:`._cpp_source`) and compiled
with Inductor's C++ code cache (:mod:`._cpp_build`), or returns None, and the
caller runs fscan's torch engine with the same results. One kernel serves
every length, ``dim``, ``reverse`` and thread count; it is compiled once per
:class:`fscan._knowledge.Knowledge` entry (the key of :func:`fscan._knowledge.reach`:
the code of ``combine_fn`` and the values of the numbers it reaches, which become
constants of the kernel; the pytree structure; each leaf's dtype, device, ndim
and requires_grad) and per pattern of which captured tensors are the same object.
Captured tensors are inputs of the kernel, read at every call. Leaves (and, in the
backward, saved inputs, outputs and cotangents) are read through their strides where
:func:`strided_view` can describe them, without a copy; outputs are fresh and
contiguous, as torch's scans return them, or written in place into a caller's
memory of any strides (``out=``: see :func:`kernel_scan`); outputs a caller drops (``keep=``)
are neither allocated nor stored (a kernel per pattern of kept outputs, in the
slot key), and a carry-in (``head=``: the first element in scan order, replaced)
is a runtime argument of every forward kernel. The entries live
in ``Knowledge.kernels``: bounded with the knowledge cache, cleared by
``fscan.clear_caches()``.

Latency. Compiling costs seconds (about 1-3 s warm, 5-13 s cold on a loaded
2-core machine), so by default (``fscan.config.cpu_kernel == "on"``) a key is
compiled in a background thread from its second call, or its first one that
scans at least ``MIN_ELEMENTS`` elements; fscan's torch engine answers until
the kernel is ready. ``"eager"`` compiles on the first call and waits;
``"off"`` never uses the kernel. Compiled kernels persist in Inductor's disk
cache, so a new process only loads them. :func:`precompile` builds one ahead.

Fallbacks: not CPU, a dtype or op the kernel lacks, leaves of different shapes,
gradients wanted, a ``torch.func`` transform, no C++ compiler: None, with one
debug log per reason (logger ``fscan``). A failed compile warns once per key.
Never an error of the user's call, never a different result beyond rounding.
"""

from __future__ import annotations

import enum
import functools
import itertools
import logging
import math
import os
import queue
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from .._adjoint import (
    ScanPlan,
    _all_finite,
    _differentiable_backward,
    adjoint,
    stepwise_adjoint,
)
from .._cache import BoundedCache
from .._combine import FlatCombine
from .._config import config
from .._errors import ScanTypeError, ScanValueError
from .._generic import scan_along
from .._knowledge import Knowledge, Reach, _references, knowledge, reach
from .._purity import probeable, under_transform
from .._pytree import flatten
from ._cpp_build import compiler_problem, load_kernel
from ._cpp_codegen import (
    DTYPES,
    Program,
    Unsupported,
    translate_combine,
    translate_param_vjp,
    translate_vjp,
)
from ._cpp_source import (
    backward_argtypes,
    backward_source,
    forward_argtypes,
    forward_source,
    param_dtype,
)

__all__ = [
    "MIN_CALLS",
    "MIN_ELEMENTS",
    "Counters",
    "KernelScan",
    "counters",
    "kernel_entries",
    "kernel_grad_scan",
    "kernel_possible",
    "kernel_ready",
    "kernel_scan",
    "precompile",
    "reads_in_place",
    "slot_key",
    "strided_layout",
    "strided_view",
]

logger = logging.getLogger("fscan")

MIN_CALLS = 2  # a key is compiled from this call on (counted once the pointwise check passed)...
MIN_ELEMENTS = 2**15  # ...or from its first call that scans this many elements per leaf
SHAPES_PER_KEY = 16  # element shapes with a kernel entry, per knowledge entry


class State(enum.Enum):
    NEW = "new"
    PENDING = "compiling"
    READY = "ready"
    FAILED = "failed"


@dataclass
class Entry:
    """One compiled kernel (or why there is none) for one key."""

    backward: bool = False  # the VJP kernel of the forward entry of the same key
    param_grads: bool = False  # backward: also the cotangents of the float params
    state: State = State.NEW
    calls: int = 0
    floats: tuple[int, ...] = ()  # backward: the leaves it differentiates
    pfloats: tuple[int, ...] = ()  # backward with param_grads: the params it differentiates
    source: str | None = None  # traced and translated in the calling thread...
    argtypes: tuple[str, ...] = ()  # ...compiled in the background
    kernel: Callable[..., None] | None = None
    program: Program | None = None
    reason: str = ""
    warning: str | None = None  # a compile failure, to be shown once on a user's call
    lock: threading.Lock = field(default_factory=threading.Lock)


_logged: set[str] = set()


def slot_key(
    aliases: Hashable,
    element: tuple[int, ...],
    positions: tuple[int, ...],
    dropped: tuple[int, ...],
    backward: bool,
    param_grads: bool,
) -> Hashable:
    """The key of a kernel entry within its knowledge entry: the generated source depends
    on all of it (and on the knowledge entry's key), on no length, dim, layout or thread
    count. The one place that spells it (lookups of READY entries build it directly)."""
    return (aliases, element, positions, dropped, backward, param_grads)


class _Call(NamedTuple):
    """What a build needs from the call that triggered it (a NamedTuple: made on every
    call, and a frozen dataclass costs ~2 us to make)."""

    combine_fn: Callable[[Any, Any], Any]
    spec: PyTreeSpec
    dtypes: tuple[torch.dtype, ...]
    element: tuple[int, ...]  # the shape of one element: the leaves' without the scan dim
    captured: tuple[torch.Tensor, ...]
    positions: tuple[int, ...] = ()  # leaves that are not read: their position along dim
    dropped: tuple[int, ...] = ()  # leaves whose outputs are not stored (the caller drops them)

    def slot(self, aliases: Hashable, backward: bool, param_grads: bool = False) -> Hashable:
        """This call's :func:`slot_key`."""
        return slot_key(aliases, self.element, self.positions, self.dropped, backward, param_grads)


def kernel_scan(
    api: str,
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    found: Reach | None = None,
    entry: Knowledge | None = None,
    positions: tuple[int, ...] = (),
    threads: int | None = None,
    keep: Sequence[bool] | None = None,
    head: Sequence[torch.Tensor] | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor | None] | None:
    """The scan of ``leaves`` along ``dim`` by the compiled kernel, or None (module doc).

    ``found``/``entry``: this call's :func:`~fscan._knowledge.reach` and knowledge
    entry if the caller has them (the routing does), else computed here.
    ``positions``: leaves whose values are not read but are each element's index along
    ``dim`` (int64; pass any tensor of the right shape and dtype, e.g. an expanded
    scalar): the kernel makes them on the fly, as ``cummax`` needs for its indices.
    ``threads``: at most this many threads (default ``torch.get_num_threads()``).
    ``keep``: which outputs the caller keeps, one bool per leaf (default all); the
    others are None, neither allocated nor written (their values are still computed
    where kept ones depend on them). It is compiled in: a kernel per pattern.
    ``head``: a carry-in, one element per leaf (each leaf's shape without ``dim``, its
    dtype) that replaces the scan's first element in scan order (the last for
    ``reverse``), as ``combine_fn(initial, xs[first])`` folded by the caller; read
    in place, the leaves are not copied (a runtime argument: the same kernel serves).
    Not with ``positions``.
    ``out``: memory for the results, one tensor per kept output (each its leaf's shape
    and dtype, on CPU, any strides: narrowed, step-sliced or transposed views), written
    in place by the kernel through runtime strides (no dense buffer, no new kernel) and
    returned in the results' places. It must not overlap the inputs (leaves, ``head``,
    captured tensors) or another output: a :class:`~fscan.ScanValueError` names it.
    A layout the kernel cannot describe (see :func:`strided_layout`) is served by a
    dense result copied into it (``counters.out_copies``). None (no kernel) leaves
    ``out`` unwritten.

    Example:
        >>> import fscan, optree
        >>> _, spec = optree.tree_flatten(0)
        >>> x = torch.arange(1.0, 5.0)
        >>> with fscan.config.override(cpu_kernel="off"):
        ...     kernel_scan("demo", torch.add, spec, [x], 0, False) is None
        True
    """
    if config.cpu_kernel == "off":
        return None
    dropped = _dropped(keep, len(leaves)) if keep is not None else ()
    outs = None if out is None else _check_out(out, leaves, dropped, positions, head)
    reason = _unavailable(leaves) or _grad_wanted(leaves)
    if reason is not None:
        _log_once(reason)
        return None
    lookup = _lookup(combine_fn, spec, leaves, found, entry)
    if lookup is None:
        return None
    holder, aliases, captured = lookup
    if captured and torch.is_grad_enabled() and any(t.requires_grad for t in captured):
        _log_once("combine_fn captures tensors that require grad: the autograd engine runs")
        return None
    element = _element(leaves, dim)
    kernel = _slots(holder).get(slot_key(aliases, element, positions, dropped, False, False))
    if not _is_ready(kernel):  # counted, built or queued
        dtypes = tuple([x.dtype for x in leaves])
        call = _Call(combine_fn, spec, dtypes, element, captured, positions, dropped)
        kernel = _ready(holder, aliases, call, leaves[0].numel(), backward=False)
        if kernel is None:
            return None
    heads = None if head is None else _heads(head, leaves, element, positions)
    if outs is not None and captured:
        _check_disjoint(outs, [(f"captured tensor {i}", t) for i, t in enumerate(captured)])
    return run_kernel(
        kernel, leaves, dim, reverse, captured, positions, threads, dropped, heads, outs
    )


def _check_out(
    out: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor],
    dropped: tuple[int, ...],
    positions: tuple[int, ...],
    head: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """``out`` checked (one tensor per kept output, of its leaf's shape and dtype, on CPU,
    each element its own memory, sharing none with the leaves read, ``head`` or another
    output), or an error naming the argument and the fix. The captured tensors, known
    once the combine is looked up, are checked by :func:`_check_disjoint`."""
    kept = [k for k in range(len(leaves)) if k not in dropped]
    if isinstance(out, torch.Tensor) or len(out) != len(kept):
        got = "a tensor" if isinstance(out, torch.Tensor) else f"{len(out)} entries"
        raise ScanValueError(
            f"kernel_scan: out must be a sequence of one tensor per kept output "
            f"({len(kept)}: leaves {kept}), got {got}."
        )
    outs = list(out)
    for j, (k, y) in enumerate(zip(kept, outs)):
        x = leaves[k]
        if type(y) is not torch.Tensor:
            raise ScanTypeError(
                f"kernel_scan: out[{j}] must be a plain torch.Tensor, got {type(y).__name__}."
            )
        if y.shape != x.shape or y.dtype != x.dtype or not y.is_cpu:
            raise ScanValueError(
                f"kernel_scan: out[{j}] (the output of leaf {k}) is {y.dtype} "
                f"{tuple(y.shape)} on {y.device}, expected {x.dtype} {tuple(x.shape)} on cpu "
                f"like leaf {k}."
            )
        if y.requires_grad and torch.is_grad_enabled():
            raise ScanValueError(
                f"kernel_scan: out[{j}] requires grad; out= memory is written without "
                "autograd: pass a tensor that does not require grad, or run under no_grad."
            )
        if not _distinct_elements(y):
            raise ScanValueError(
                f"kernel_scan: out[{j}] has strides {y.stride()} for shape {tuple(y.shape)}, "
                "whose elements may share memory (an expand, say); each output element "
                "needs its own memory: pass a fresh tensor or a view such as a narrow, "
                "step slice or transpose of one."
            )
    inputs = [(f"leaf {k}", x) for k, x in enumerate(leaves) if k not in positions]
    inputs += [(f"head leaf {k}", h) for k, h in enumerate(head or ())]
    _check_disjoint(outs, inputs)
    for j in range(1, len(outs)):
        _check_disjoint(outs[j : j + 1], [(f"out[{i}]", outs[i]) for i in range(j)], j)
    return outs


def _check_disjoint(
    outs: Sequence[torch.Tensor], inputs: Sequence[tuple[str, torch.Tensor]], first: int = 0
) -> None:
    """An error naming the first output (``out[first + j]``) that overlaps a named input."""
    for j, y in enumerate(outs):
        for name, t in inputs:
            if _overlap(y, t):
                raise ScanValueError(
                    f"kernel_scan: out[{first + j}] overlaps {name} in memory; outputs must "
                    "not alias the inputs or each other: pass separate memory for out."
                )


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[start, end)`` a tensor's elements lie in (empty: ``(0, 0)``)."""
    if t.numel() == 0:
        return 0, 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of ``a`` and ``b`` intersect (conservative: interleaved
    views of one tensor, e.g. its even and odd columns, count as overlapping)."""
    a0, a1 = _extent(a)
    b0, b1 = _extent(b)
    return a0 < b1 and b0 < a1


def _distinct_elements(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements certainly lie at distinct addresses: its dims of size > 1,
    ordered by stride, each step past the whole span of the dims below (true of every
    narrow, slice, transpose or permutation of a fresh tensor; false of an expand).

    Example:
        >>> _distinct_elements(torch.zeros(3, 4).t()[::2])
        True
        >>> _distinct_elements(torch.zeros(3).expand(2, 3))
        False
    """
    reach = 0  # the farthest offset the dims of smaller strides reach
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride <= reach:
            return False
        reach += (size - 1) * stride
    return True


def _heads(
    head: Sequence[torch.Tensor],
    leaves: Sequence[torch.Tensor],
    element: tuple[int, ...],
    positions: tuple[int, ...],
) -> list[torch.Tensor]:
    """``head`` as the kernel reads it: contiguous elements, or an error naming the leaf."""
    if positions:
        raise ValueError("kernel_scan: head= with positions= (position leaves read no input)")
    if len(head) != len(leaves):
        raise ValueError(f"kernel_scan: head has {len(head)} leaves, expected {len(leaves)}")
    out = []
    for k, (h, x) in enumerate(zip(head, leaves)):
        if h.dtype != x.dtype or tuple(h.shape) != element or not h.is_cpu:
            raise ValueError(
                f"kernel_scan: head leaf {k} is {h.dtype} {tuple(h.shape)} on {h.device}, "
                f"expected one element of leaf {k}: {x.dtype} {element} on cpu"
            )
        out.append(h.contiguous())
    return out


def _dropped(keep: Sequence[bool], n: int) -> tuple[int, ...]:
    """The leaves ``keep`` drops (``keep``: one bool per leaf, at least one True)."""
    if len(keep) != n or not any(keep):
        raise ValueError(
            f"kernel_scan: keep must hold one bool per leaf ({n}) and keep at least one "
            f"output, got {tuple(keep)!r}"
        )
    return tuple([k for k, kept in enumerate(keep) if not kept])


def kernel_ready(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    positions: tuple[int, ...] = (),
) -> bool:
    """Whether a compiled kernel for scans like this one is loaded (counts no call and
    builds nothing: for benchmarks and tests that report which engine ran)."""
    if config.cpu_kernel == "off" or _unavailable(leaves) is not None:
        return False
    lookup = _lookup(combine_fn, spec, leaves, None, None)
    if lookup is None:
        return False
    holder, aliases, captured = lookup
    dtypes = tuple(x.dtype for x in leaves)
    call = _Call(combine_fn, spec, dtypes, _element(leaves, dim), captured, positions)
    entry = _slots(holder).get(call.slot(aliases, False))
    return entry is not None and entry.state is State.READY


def _lookup(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    found: Reach | None,
    entry: Knowledge | None,
) -> tuple[Knowledge, Hashable, tuple[torch.Tensor, ...]] | None:
    """The knowledge entry holding this call's kernels, the aliasing pattern of the
    captured tensors, and those tensors (distinct, in walk order); None if uncacheable."""
    if found is None:
        found = reach(combine_fn)
    if found.key is None:
        _log_once("combine_fn reaches state fscan cannot key: no kernel is cached for it")
        return None
    if entry is None:
        entry = knowledge(found, spec, "pointwise", leaves)
    if not found.tensors:
        return entry, (), ()
    if found.aliases is not None:  # the plain walk numbered the places itself
        return entry, found.aliases, found.tensors
    # The walk for each place a tensor is reached from (aliasing is part of the kernel's
    # key), where reach's general walk keeps only distinct tensors.
    occurrences = captured_occurrences(combine_fn)
    if occurrences is None:
        return None
    first: dict[int, int] = {}
    aliases = tuple(first.setdefault(id(t), len(first)) for t in occurrences)
    distinct = tuple({id(t): t for t in occurrences}.values())
    return entry, aliases, distinct


def _element(leaves: Sequence[torch.Tensor], dim: int) -> tuple[int, ...]:
    shape = tuple(leaves[0].shape)
    if len(shape) == 1:
        return ()
    dim = dim % max(1, len(shape))
    return shape[:dim] + shape[dim + 1 :]


def _slots(holder: Knowledge) -> BoundedCache[Entry]:
    """The kernel entries of a knowledge entry, by (aliasing of the captured tensors,
    element shape, backward). The trace is exact for one element shape only (Python
    code may read sizes: a slice over a whole dimension traces as an alias), so each
    shape gets its own entry; shapes that translate to the same source share one
    compiled library (Inductor's cache is keyed by source), so a new shape costs a
    trace (about 0.1-0.2 s), not a compile."""
    slots = holder.kernels.get("cpp")
    if slots is None:
        with holder.lock:
            slots = holder.kernels.setdefault("cpp", BoundedCache(maxsize=SHAPES_PER_KEY))
    return slots


def kernel_entries(holder: Knowledge) -> list[Entry]:
    """The kernel entries a knowledge entry holds (for tests and benchmarks)."""
    slots = holder.kernels.get("cpp")
    if slots is None:
        return []
    return [e for e in (slots.get(k) for k in list(slots._data)) if e is not None]


def _is_ready(entry: Entry | None) -> bool:
    return entry is not None and entry.state is State.READY


def _ready(
    holder: Knowledge,
    aliases: Hashable,
    call: _Call,
    numel: int,
    backward: bool,
    param_grads: bool = False,
) -> Entry | None:
    """The READY kernel entry, or None after counting the call and, per the mode,
    building it now or queueing its build."""
    entry = _slots(holder).get_or_compute(
        call.slot(aliases, backward, param_grads),
        lambda: Entry(backward=backward, param_grads=param_grads),
    )
    eager = config.cpu_kernel == "eager"
    if entry.state is State.NEW or (eager and entry.state is State.PENDING):
        entry.calls += 1
        if eager:  # waits for a background build of this key too
            _build(entry, call)
        elif entry.calls >= MIN_CALLS or numel >= MIN_ELEMENTS:
            _submit(entry, call)
    if entry.state is State.FAILED:
        _warn_once(entry)
        return None
    return entry if entry.state is State.READY else None


def precompile(
    combine_fn: Callable[[Any, Any], Any], xs: Any, dim: int = 0, *, backward_too: bool = False
) -> bool:
    """Build the kernel for scans of leaves like ``xs`` now, and say whether it serves them.

    For services that should not compile while answering: call it at start-up with
    example data of the element shape to serve (any length; the kernel entry is per
    element shape, the leaves' shape without ``dim``), with
    ``backward_too=True`` to also build the gradient kernel. A second
    process finds the kernel in Inductor's disk cache and only loads it.

    Example:
        >>> import fscan
        >>> ok = fscan.precompile(lambda a, b: a + b, torch.ones(8))
        >>> ok in (True, False)  # False where no C++ compiler is installed
        True
    """
    leaves, spec = flatten(xs)
    if not leaves or config.cpu_kernel == "off" or _unavailable(leaves, wait=True) is not None:
        return False
    lookup = _lookup(combine_fn, spec, leaves, None, None)
    if lookup is None:
        return False
    holder, aliases, captured = lookup
    dim = dim % max(1, leaves[0].ndim)
    call = _Call(combine_fn, spec, tuple(x.dtype for x in leaves), _element(leaves, dim), captured)
    ready = True
    for backward in (False, True) if backward_too else (False,):
        entry = _slots(holder).get_or_compute(
            call.slot(aliases, backward), lambda b=backward: Entry(backward=b)
        )
        _build(entry, call)
        ready = ready and entry.state is State.READY
    return ready


def _unavailable(leaves: Sequence[torch.Tensor], wait: bool = False) -> str | None:
    """Why the kernel cannot serve leaves like these (gradients aside), or None. Unless
    ``wait`` (or the mode is "eager"), the compiler lookup is left to the background."""
    first = leaves[0]
    if not first.is_cpu:  # is_cpu, not device.type: a torch.device costs ~0.3 us per call
        return f"no C++ kernel on {first.device.type}"
    for x in leaves:  # loops, not any() of a generator: this runs on every scan
        if x.dtype not in DTYPES:
            return f"dtype {x.dtype} has no C++ kernel"
        if x.is_neg():  # e.g. `.conj().imag`: the kernel reads memory, not the lazy negation
            return "a negative-bit view (e.g. .conj().imag): the torch engine runs"
    if len(leaves) > 1 and any(x.shape != first.shape or not x.is_cpu for x in leaves):
        return "leaves of different shapes: the C++ kernel takes one shape"
    if not probeable(leaves) or under_transform():
        return "tensor subclasses or torch.func transforms: the torch engine runs"
    if not _warm.is_set():
        if not (wait or config.cpu_kernel == "eager"):
            # Finding the compiler imports Inductor (about a second): done in the background.
            _worker.warm_up()
            return "the C++ toolchain is being looked up in the background"
        # A caller that waits for its build imports all of it now: else the next call in
        # mode "on" would start the warm-up over in the background (seconds of CPU beside
        # the caller) and answer with the torch engine meanwhile, kernel built or not.
        _warm_up()
    return compiler_problem()


def kernel_possible() -> bool:
    """Whether the C++ kernel can serve any scan now: False in mode ``"off"`` and once the
    toolchain lookup found no compiler, else True (also while that lookup is still to run:
    the caller's checked path starts it). For callers that would otherwise pay their full
    checks only to hear None from :func:`kernel_scan` (on a cold cache after a large op
    the checks cost tens of µs; this, one dict lookup).

    The verdict is cached, keyed on all it depends on: the mode (``fscan.config.cpu_kernel``,
    which holds ``FSCAN_CPU_KERNEL`` as read at import), the compiler probe (the function
    itself: it caches its answer per process) and the toolchain lookup's flag (stored only
    once it is set, and it is never cleared).

    Example:
        >>> import fscan
        >>> with fscan.config.override(cpu_kernel="off"):
        ...     kernel_possible()
        False
    """
    # The slot, not the property: a property call costs ~5 us on a cold cache.
    key = (config._cpu_kernel, compiler_problem, _warm)
    verdict = _verdicts.get(key)
    if verdict is None:
        if key[0] == "off":
            verdict = False
        elif not _warm.is_set():
            return True  # not known yet, and not stored: the lookup may still find none
        else:
            verdict = compiler_problem() is None
        if len(_verdicts) >= 16:  # a few keys in a process (tests patch the probe)
            _verdicts.clear()
        _verdicts[key] = verdict
    return verdict


_verdicts: dict[tuple[str, Callable[[], str | None], threading.Event], bool] = {}


def _grad_wanted(leaves: Sequence[torch.Tensor]) -> str | None:
    if torch.is_grad_enabled():
        for x in leaves:
            if x.requires_grad:
                return "gradients are wanted: the autograd engine runs"
    return None


def captured_occurrences(fn: Callable[..., Any]) -> list[torch.Tensor] | None:
    """Every tensor ``fn`` reaches, once per place it is reached from, in walk order (the
    edges of :func:`fscan._knowledge.reach`); None where that order is not fixed (a set
    holding tensors).

    Example:
        >>> w = torch.ones(2)
        >>> [t is w for t in captured_occurrences(lambda a, b: a * w + b * w)]
        [True]
        >>> pair = lambda a, b: a * w + b * v
        >>> v = w
        >>> len(captured_occurrences(pair))
        2
    """
    tensors: list[torch.Tensor] = []
    seen: set[int] = set()
    names: set[str] = set()
    todo: list[Any] = [fn]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            continue
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, complex, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, (set, frozenset)) and any(isinstance(v, torch.Tensor) for v in obj):
            return None
        todo.extend(_references(obj, names))
    return tensors


# --- building ------------------------------------------------------------------
#
# Tracing (make_fx) uses process-wide state of torch.fx and the dispatcher: run beside
# a torch.compile or make_fx of another thread, either can fail. So a build traces and
# translates in the thread of the scan that triggers it (about 0.1-0.2 s once torch's
# tracing modules are imported), and only the C++ compile (seconds) runs in the
# background thread, which holds the source text and nothing of the user's. Of the
# imports, only torch._dynamo (about 3 s) is made in the background first: see _warm_up.


def _build(entry: Entry, call: _Call) -> None:
    """Trace, translate, compile and load, all in this thread; leaves ``entry`` READY or
    FAILED (or as it was if another thread finished it meanwhile)."""
    with entry.lock:
        if entry.state in (State.READY, State.FAILED):
            return
        if entry.source is None and not _translate(entry, call):
            return
        _compile(entry)


def _translate(entry: Entry, call: _Call) -> bool:
    """Trace ``combine_fn`` (or its VJP) and write the kernel's source into ``entry``.
    On an op, dtype or structure the translator lacks: FAILED, one debug log."""
    try:
        if entry.param_grads:
            program, floats, pfloats = translate_param_vjp(
                call.combine_fn, call.spec, call.dtypes, call.element, call.captured
            )
            entry.source = backward_source(call.dtypes, floats, program, pfloats)
            entry.argtypes = tuple(backward_argtypes(call.dtypes, floats, program, pfloats))
            entry.floats, entry.pfloats = tuple(floats), tuple(pfloats)
        elif entry.backward:
            program, floats = translate_vjp(
                call.combine_fn, call.spec, call.dtypes, call.element, call.captured
            )
            entry.source = backward_source(call.dtypes, floats, program)
            entry.argtypes = tuple(backward_argtypes(call.dtypes, floats, program))
            entry.floats = tuple(floats)
        else:
            program = translate_combine(
                call.combine_fn, call.spec, call.dtypes, call.element, call.captured
            )
            entry.source = forward_source(call.dtypes, program, call.positions, call.dropped)
            entry.argtypes = tuple(
                forward_argtypes(call.dtypes, program, call.positions, call.dropped)
            )
    except Unsupported as err:
        entry.reason = f"unsupported: {err}"
        entry.state = State.FAILED
        logger.debug("fscan: no C++ kernel for this combine_fn: %s", err)
        return False
    except Exception as err:  # combine_fn fails on these examples: the torch engine runs
        # it and reports the user's error itself, if it is one.
        entry.reason = f"trace failed: {type(err).__name__}: {err}"
        entry.state = State.FAILED
        logger.debug("fscan: tracing combine_fn for the C++ kernel failed: %r", err)
        return False
    entry.program = program
    return True


def _compile(entry: Entry) -> None:
    """Compile (or load from the disk cache) the translated source: READY or FAILED."""
    assert entry.source is not None
    try:
        kernel = load_kernel(entry.source, entry.argtypes)
    except Exception as err:  # a compiler or loader failure: the torch engine serves
        _failed(entry, err)
        return
    entry.kernel = kernel
    entry.state = State.READY


def _failed(entry: Entry, err: BaseException) -> None:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    entry.reason = f"{type(err).__name__}: {first}"
    entry.warning = (
        f"fscan: building the C++ scan kernel failed ({entry.reason}); this "
        "combine_fn runs on fscan's torch engine instead, with the same results. "
        "Shown once per combine_fn and leaf layout; fscan.config.cpu_kernel = 'off' "
        "turns the kernel off."
    )
    entry.state = State.FAILED


_warm = threading.Event()


def _warm_up() -> None:
    """Import torch._dynamo (make_fx imports it on first use: about 3 s).

    In mode "on" this runs in the background thread, beside the user's code, so it
    imports nothing a trace could be running beside: imports add to ``sys.modules`` and
    to the pytree registries, and a Dynamo trace iterating one of those dicts meanwhile
    fails ("dictionary changed size during iteration"). No trace runs before
    torch._dynamo is imported, and one that starts during this import waits for it
    (an import in progress holds the module's lock). The rest (torch's decompositions
    and make_fx, Inductor's C++ builder and code cache, and what a compile imports:
    under a second, and no pytree node) is imported by the calling thread, which looks
    up the compiler (:func:`_unavailable`), translates and imports
    :func:`_compile_imports` before a compile is queued, so the compile thread imports
    nothing of its own (Inductor's loader still enters each kernel's module in
    ``sys.modules``, which nothing fscan traces reads)."""
    import torch._dynamo  # noqa: F401

    _warm.set()


@functools.cache
def _compile_imports() -> None:
    """Import what a compile on a cold disk cache imports (Inductor's builder reaches for
    torch.utils.cpp_extension, and setuptools with it), in the calling thread: see
    :func:`_warm_up`."""
    import torch.utils.cpp_extension  # noqa: F401


class _Worker:
    """One daemon thread for the warm-up and the compiles, one at a time (they are
    CPU-heavy); its jobs hold source text, never a combine_fn or a tensor."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.warming = False

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="fscan-kernel", daemon=True)
                self.thread.start()

    def warm_up(self) -> None:
        with self.lock:
            if self.warming:
                return
            self.warming = True
        self.submit(_warm_up)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                job()
            except Exception as err:  # never let the thread die: report at debug level
                logger.debug("fscan: a background kernel job failed: %r", err)
            del job


_worker = _Worker()


def _submit(entry: Entry, call: _Call) -> None:
    """Translate now (in this thread) and queue the compile; or, while torch's tracing
    modules are not imported yet, queue their import and leave ``entry`` for a later call."""
    if not _warm.is_set():
        _worker.warm_up()
        return
    with entry.lock:
        if entry.state is not State.NEW:
            return
        if entry.source is None and not _translate(entry, call):
            return
        entry.state = State.PENDING
    _compile_imports()
    _worker.submit(functools.partial(_compile_queued, entry))


def _compile_queued(entry: Entry) -> None:
    with entry.lock:
        if entry.state is State.PENDING:
            _compile(entry)


def _after_fork_in_child() -> None:
    """The compile thread does not survive a fork: its queued compiles start again."""
    global _worker
    _worker = _Worker()
    from .. import _knowledge

    for key in list(_knowledge.entries._data):
        holder = _knowledge.entries.get(key)
        for entry in kernel_entries(holder) if holder is not None else ():
            entry.lock = threading.Lock()
            if entry.state is State.PENDING:
                entry.state = State.NEW


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- running -------------------------------------------------------------------


def run_kernel(
    entry: Entry,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    captured: Sequence[torch.Tensor],
    positions: tuple[int, ...] = (),
    threads: int | None = None,
    dropped: tuple[int, ...] = (),
    heads: Sequence[torch.Tensor] | None = None,
    outs: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor | None] | None:
    """Run a READY entry's kernel into fresh outputs, or None where its params do not fit;
    on ``threads`` threads at most (default ``torch.get_num_threads()``). ``dropped``: the
    leaves the entry was built not to store (its ``_Call.dropped``): None in their place.
    ``heads``: contiguous carry-in elements, one per leaf (see :func:`kernel_scan`).
    ``outs``: checked ``out=`` memory (see :func:`kernel_scan`), one per kept output,
    written in place instead of fresh outputs where :func:`strided_layout` fits it.

    Inputs are read in place through their strides where :func:`strided_view` can
    describe them (no copy); fresh outputs are contiguous, as torch's own scans
    (``torch.cumsum`` of a transposed tensor is contiguous) and the torch engine give."""
    program, kernel = entry.program, entry.kernel
    assert program is not None and kernel is not None
    shape = leaves[0].shape
    dim = dim % len(shape)
    if len(shape) == 1:  # the cheap common case of the sizes below (torch.Size slices)
        outer, steps, inner = 1, shape[0], 1
    else:
        outer, steps, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    # empty_like is ~1 us cheaper per leaf than torch.empty(torch.Size): it matters at (64,).
    ys: list[torch.Tensor | None]
    if outs is not None:
        it = iter(outs)
        ys = [None if k in dropped else next(it) for k in range(len(leaves))]
    elif dropped:  # not allocated: a fresh tensor costs its page faults when written
        ys = [None if k in dropped else _fresh(x) for k, x in enumerate(leaves)]
    else:  # inline: ~1 us less per leaf than the call, which matters at (64,)
        ys = [torch.empty_like(x) if x.is_contiguous() else _empty(x) for x in leaves]
    if outer * steps * inner == 0:
        return ys
    params = _params(program, captured, shape[:dim] + shape[dim + 1 :]) if program.params else []
    if params is None:
        return None
    read = [x for k, x in enumerate(leaves) if k not in positions] if positions else leaves
    written = [y for y in ys if y is not None] if dropped else ys
    if outs is None:  # fresh outputs: dense
        for x in read:  # all contiguous (the common case) inline: ~1 us less than the call
            if not x.is_contiguous():
                xs, nb, strides = strided_view(read, dim)
                break
        else:
            xs, nb, strides = read, 1, [steps * inner, 0, inner, 1] * len(read)
        # Dense in the (outer // nb, nb, T, inner) view the inputs' strides use.
        strides = strides + [nb * steps * inner, steps * inner, inner, 1] * len(written)
    else:
        found = strided_layout([*read, *written], dim, fixed=len(written))
        if found is None:  # an out= layout the kernel cannot describe: a dense result
            args = (entry, leaves, dim, reverse, captured, positions, threads, dropped, heads)
            return _copied_out(run_kernel(*args), ys)
        xs, nb, strides = found
        xs = xs[: len(read)]
        counters.wrote(len(written))
    threads = torch.get_num_threads() if threads is None else min(threads, torch.get_num_threads())
    if heads is None:
        at = _NO_HEADS[len(read)] if len(read) < len(_NO_HEADS) else (0,) * len(read)
    else:  # the tensors stay alive in `heads` while the kernel reads them
        at = tuple([h.data_ptr() for k, h in enumerate(heads) if k not in positions])
    kernel(*xs, *written, *params, outer, steps, inner, int(reverse), threads, nb, *strides, *at)
    return ys


_NO_HEADS = [(0,) * n for n in range(9)]  # null carry-in addresses (made once: ~0.1 us)


def _copied_out(
    found: list[torch.Tensor | None] | None, ys: list[torch.Tensor | None]
) -> list[torch.Tensor | None] | None:
    """The kernel's dense results ``found`` copied into the ``out=`` memory ``ys``."""
    if found is None:
        return None
    n = 0
    for y, f in zip(ys, found):
        if y is not None and f is not None:
            y.copy_(f)
            n += 1
    counters.copied_out(n)
    return ys


class Counters:
    """What the kernel runs did that a test may want to see (not timing): ``copies``,
    the inputs copied to contiguous memory because :func:`strided_view` could not
    describe their layout; ``in_place``, the outputs written straight into a caller's
    ``out=`` memory; ``out_copies``, those computed densely and copied into it (a layout
    :func:`strided_layout` cannot describe). Counted under a lock."""

    def __init__(self) -> None:
        self.copies = 0
        self.in_place = 0
        self.out_copies = 0
        self.lock = threading.Lock()

    def copied(self, n: int) -> None:
        with self.lock:
            self.copies += n

    def wrote(self, n: int) -> None:
        with self.lock:
            self.in_place += n

    def copied_out(self, n: int) -> None:
        with self.lock:
            self.out_copies += n


counters = Counters()


def strided_view(
    tensors: Sequence[torch.Tensor], dim: int
) -> tuple[list[torch.Tensor], int, list[int]]:
    """The tensors (same shape) as the kernels read them, ``nb`` and each one's strides.

    The kernels index element ``(o, t, i)`` of the ``(outer, T, inner)`` view (``T``
    the scan dim) at ``(o // nb) * sa + (o % nb) * sb + t * st + i * si``: the dims
    before ``dim`` in at most two groups (``nb`` lanes in the second), those after it
    in one. A view fits when its dims merge that way (size-1 dims ignored): transposes,
    permutations such as a ``(B, C, T)`` view of ``(B, T, C)`` memory, step slices,
    slices along the scan dim, stride-0 broadcasts (``expand``, the cotangent of
    ``.sum()``). A tensor that does not fit (nor, where the groups of the others
    disagree with its own, one with a split of its own) is copied to contiguous memory,
    counted in ``counters.copies``. Nothing is written: the tensors are read only.
    :func:`strided_layout` describes outputs too.

    Example:
        >>> x = torch.zeros(4, 6)
        >>> _, nb, strides = strided_view([x.t()], 0)  # (6, 4): T stride 1, lanes 6 apart
        >>> nb, strides
        (1, [0, 0, 1, 6])
        >>> _, nb, strides = strided_view([torch.zeros(2, 5, 3).transpose(1, 2)], 2)
        >>> nb, strides  # outer (2, 3): 15 and 1 apart; T: 3 apart
        (3, [15, 1, 3, 1])
    """
    found = strided_layout(tensors, dim)
    assert found is not None  # every tensor may be copied
    return found


def strided_layout(
    tensors: Sequence[torch.Tensor], dim: int, fixed: int = 0
) -> tuple[list[torch.Tensor], int, list[int]] | None:
    """:func:`strided_view` where the last ``fixed`` tensors (outputs, written in place)
    are never copied: None where one of them does not fit, or where their outer groups
    disagree with each other.

    Example:
        >>> x, out = torch.zeros(4, 6), torch.zeros(6, 4).t()  # out: T stride 1
        >>> _, nb, strides = strided_layout([x, out], 0, fixed=1)
        >>> nb, strides
        (1, [0, 0, 6, 1, 0, 0, 1, 4])
        >>> y, out = torch.zeros(4, 2, 3), torch.zeros(4, 3, 2).transpose(1, 2)
        >>> strided_layout([y, out], 0, fixed=1) is None  # out's (2, 3) lanes do not merge
        True
    """
    if not tensors:  # every leaf a position leaf: nothing is read
        return [], 1, []
    shape = tensors[0].shape
    for x in tensors:  # all contiguous, the common case, kept cheap (no generator)
        if not x.is_contiguous():
            break
    else:
        steps, inner = shape[dim], math.prod(shape[dim + 1 :])
        return list(tensors), 1, [steps * inner, 0, inner, 1] * len(tensors)
    outer = [d for d in range(dim) if shape[d] != 1]
    inner = [d for d in range(dim + 1, len(shape)) if shape[d] != 1]
    xs = list(tensors)

    def merges(stride: Sequence[int], a: int, b: int) -> bool:
        return stride[a] == stride[b] * shape[b]

    copies = 0
    splits: list[set[int]] = []
    free = len(xs) - fixed  # the tensors that may be copied
    for k, x in enumerate(xs):
        stride = x.stride()
        if not all(merges(stride, a, b) for a, b in itertools.pairwise(inner)):
            if k >= free:
                return None
            xs[k] = x.contiguous()
            stride, copies = xs[k].stride(), copies + 1
        pairs = enumerate(itertools.pairwise(outer))
        splits.append({j for j, (a, b) in pairs if not merges(stride, a, b)})
    if len(set().union(*splits)) > 1:  # more than two outer groups: copy the split ones
        kept: set[int] = set().union(*splits[free:])  # the fixed ones' split, if any
        if len(kept) > 1:
            return None
        for k, split in enumerate(splits[:free]):
            if split and split != kept:
                xs[k], splits[k], copies = xs[k].contiguous(), set(), copies + 1
    if copies:
        counters.copied(copies)
    split = set().union(*splits)
    cut = min(split) if split else None
    nb = 1 if cut is None else math.prod(shape[d] for d in outer[cut + 1 :])
    strides: list[int] = []
    for x in xs:
        stride = x.stride()
        sa = 0 if not outer else stride[outer[-1] if cut is None else outer[cut]]
        sb = 0 if cut is None else stride[outer[-1]]
        strides += [sa, sb, stride[dim], stride[inner[-1]] if inner else 1]
    return xs, nb, strides


def reads_in_place(x: torch.Tensor, dim: int) -> bool:
    """Whether :func:`strided_view` reads ``x`` alone, scanned along ``dim`` (>= 0), in
    place: its dims after ``dim`` merge into one, those before into at most two groups.

    Example:
        >>> x = torch.zeros(2, 6, 5, 4).contiguous(memory_format=torch.channels_last)
        >>> reads_in_place(x, 1), reads_in_place(x, 3)  # over C; over W: copied
        (True, False)
    """
    if x.is_contiguous():
        return True
    shape, stride = x.shape, x.stride()
    outer = [d for d in range(dim) if shape[d] != 1]
    inner = [d for d in range(dim + 1, len(shape)) if shape[d] != 1]
    if any(stride[a] != stride[b] * shape[b] for a, b in itertools.pairwise(inner)):
        return False
    return sum(stride[a] != stride[b] * shape[b] for a, b in itertools.pairwise(outer)) <= 1


def _fresh(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x) if x.is_contiguous() else _empty(x)


def _empty(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(x.shape), dtype=x.dtype)


def _params(
    program: Program, captured: Sequence[torch.Tensor], element: Sequence[int]
) -> list[torch.Tensor] | None:
    """The prologue's values, broadcast to one element (scan dim first, as combine_fn sees it)."""
    if not program.params:
        return []
    try:
        if torch.is_grad_enabled():  # no_grad only where it changes something (~1 us)
            with torch.no_grad():
                return _param_values(program, captured, element)
        return _param_values(program, captured, element)
    except RuntimeError:  # the captured tensors do not broadcast to this call's elements
        return None


def _param_values(
    program: Program, captured: Sequence[torch.Tensor], element: Sequence[int]
) -> list[torch.Tensor] | None:
    out = []
    for value, param in zip(program.prologue(captured), program.params):
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if value.ndim > len(element) + 1:
            return None
        if value.ndim or element:  # one number is one element already: no view needed
            value = torch.broadcast_to(value, (1, *element))
        out.append(value.to(param_dtype(param.dtype)).contiguous())
    return out


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.debug("fscan: pointwise scan without the C++ kernel: %s", reason)


def _warn_once(entry: Entry) -> None:
    message, entry.warning = entry.warning, None
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=5)


# --- gradients -----------------------------------------------------------------


def kernel_grad_scan(
    api: str,
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    combine: FlatCombine,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    found: Reach | None = None,
    entry: Knowledge | None = None,
) -> list[torch.Tensor] | None:
    """A differentiable scan whose forward and first-order backward are C++ kernels, or
    None where they cannot serve (then ``PointwiseScan`` runs).

    For the ``adjoint`` route once its probe agreed (float leaves of one dtype, a probed
    combine_fn). Captured tensors that require grad are inputs of ``KernelScan``; its
    backward kernel sums their cotangents too (a separate kernel entry). A backward
    that must itself be differentiable (``create_graph=True``) runs fscan's adjoint
    scan instead.

    Example:
        >>> import fscan, optree
        >>> _, spec = optree.tree_flatten(0)
        >>> x = torch.ones(4, requires_grad=True)
        >>> with fscan.config.override(cpu_kernel="off"):
        ...     kernel_grad_scan("demo", torch.add, spec, None, [x], 0, False) is None
        True
    """
    if config.cpu_kernel == "off" or not torch.is_grad_enabled():
        return None
    reason = _unavailable(leaves)
    if reason is not None:
        _log_once(reason)
        return None
    lookup = _lookup(combine_fn, spec, leaves, found, entry)
    if lookup is None:
        return None
    holder, aliases, captured = lookup
    needing = tuple([t for t in captured if t.requires_grad])
    element = _element(leaves, dim)
    slots = _slots(holder)
    forward = slots.get(slot_key(aliases, element, (), (), False, False))
    backward = slots.get(slot_key(aliases, element, (), (), True, bool(needing)))
    if not (_is_ready(forward) and _is_ready(backward)):  # counted, built or queued
        dtypes = tuple([x.dtype for x in leaves])
        call = _Call(combine_fn, spec, dtypes, element, captured)
        numel = leaves[0].numel()
        forward = _ready(holder, aliases, call, numel, backward=False)
        backward = _ready(holder, aliases, call, numel, backward=True, param_grads=bool(needing))
        if forward is None or backward is None:
            return None
    plan = ScanPlan(combine, len(leaves), dim, reverse)
    info = _GradInfo(forward, backward, plan, captured, needing)
    return list(KernelScan.apply(info, *leaves, *needing))


class _GradInfo(NamedTuple):  # made on every call: a NamedTuple is ~1 us cheaper
    forward: Entry
    backward: Entry
    plan: ScanPlan
    captured: tuple[torch.Tensor, ...]  # every captured tensor, distinct, in walk order
    needing: tuple[torch.Tensor, ...]  # those that require grad: inputs of KernelScan


class KernelScan(torch.autograd.Function):
    """Forward and backward by the generated kernels; saves the inputs and outputs only.

    Inputs: the leaves, then the captured tensors that require grad (so that autograd
    routes their gradients: the backward kernel sums them over the steps)."""

    @staticmethod
    def forward(ctx: Any, info: _GradInfo, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        plan = info.plan
        xs = tensors[: plan.n_leaves]
        ys = run_kernel(info.forward, xs, plan.dim, plan.reverse, info.captured)
        if ys is None:  # captured tensors that do not broadcast: the torch engine decides
            ys = scan_along(plan.combine, xs, plan.dim, plan.reverse)
        ctx.info = info
        ctx.save_for_backward(*tensors, *ys)
        ctx.mark_non_differentiable(*[y for y in ys if not y.is_floating_point()])
        ctx.set_materialize_grads(False)
        return tuple(ys)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        info: _GradInfo = ctx.info
        saved = ctx.saved_tensors
        n = info.plan.n_leaves
        xs, needing, ys = saved[:n], saved[n:-n], saved[-n:]
        needs = ctx.needs_input_grad[1:]
        given = [g for g in grads if g is not None]
        if torch.is_grad_enabled() and needing:  # create_graph=True: differentiable
            return (None, *_differentiable_backward(info.plan, xs, needing, grads, needs))
        found = None
        # First order on plain tensors: the kernel. Under vmap (batched cotangents, e.g.
        # jacobian(vectorize=True)) the cotangents are wrappers without data pointers.
        if not torch.is_grad_enabled() and not under_transform() and probeable(given or xs):
            found = run_backward(info, xs, ys, grads)
        if found is None:  # create_graph=True, a transform, params that do not fit: adjoint
            found = adjoint(info.plan, xs, ys, grads, needing, needs)
            if needing and not _all_finite([*found[0], *found[1]]):
                found = stepwise_adjoint(info.plan, xs, ys, grads, needing, needs)
        xbar, capbar = found
        bars = [*xbar, *capbar]
        return (None, *(b if need else None for b, need in zip(bars, needs)))


def run_backward(
    info: _GradInfo,
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None:
    """The cotangents of the leaves and of ``info.needing`` by the backward kernel, or
    None where its params do not fit."""
    entry, plan = info.backward, info.plan
    assert entry.program is not None and entry.kernel is not None
    shape = xs[0].shape
    dim = plan.dim % len(shape)
    outer, steps, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    element = shape[:dim] + shape[dim + 1 :]
    params = _params(entry.program, info.captured, element)
    if params is None:
        return None
    floats = entry.floats
    # Cotangents are read through their strides (the cotangent of ``y.sum()`` is an
    # expanded scalar: stride 0, no copy); a missing one is a zero of stride 0. A
    # negative-bit view (a cotangent made from `.conj().imag`) is negated into memory:
    # the kernel reads memory, not the lazy negation.
    gs = [
        torch.zeros((), dtype=xs[k].dtype).expand(shape)
        if grads[k] is None
        else grads[k].resolve_neg()
        for k in floats
    ]
    bars = [torch.empty(shape, dtype=xs[k].dtype) for k in floats]
    # Per element position, summed over the steps (zero where no step combines).
    pbars = [torch.zeros(outer * inner, dtype=torch.float64) for _ in entry.pfloats]
    if outer * steps * inner:
        args, nb, strides = strided_view([*xs, *ys, *gs], dim)
        entry.kernel(
            *args, *bars, *pbars, *params, outer, steps, inner, int(plan.reverse),
            torch.get_num_threads(), nb, *strides,
        )  # fmt: skip
    xbar: list[torch.Tensor | None] = [None] * len(xs)
    for k, bar in zip(floats, bars):
        xbar[k] = bar
    capbar = _captured_grads(entry, info, pbars, element) if info.needing else []
    return xbar, capbar


def _captured_grads(
    entry: Entry, info: _GradInfo, pbars: Sequence[torch.Tensor], element: Sequence[int]
) -> list[torch.Tensor | None]:
    """The captured tensors' cotangents from the params' per-position sums: each sum is
    reduced over the positions its param broadcasts to, then pulled back through the
    prologue (torch ops on detached copies of the captured tensors)."""
    assert entry.program is not None
    copies = [t.detach().requires_grad_(t.requires_grad) for t in info.captured]
    with torch.enable_grad():
        values = entry.program.prologue(copies)
    outs, cots = [], []
    for q, pbar in zip(entry.pfloats, pbars):
        value = values[q]
        if not (isinstance(value, torch.Tensor) and value.requires_grad):
            continue
        full = pbar.view(1, *element).sum_to_size(value.shape) if value.ndim else pbar.sum()
        outs.append(value)
        cots.append(full.reshape(value.shape).to(value.dtype))
    inputs = [c for c, t in zip(copies, info.captured) if t.requires_grad]
    if not outs:
        return [torch.zeros_like(t) for t in info.needing]
    found = torch.autograd.grad(outs, inputs, cots, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(found, info.needing)]


# --- checking the translation ----------------------------------------------------


def combine_step(
    combine_fn: Callable[[Any, Any], Any], left: Any, right: Any, *, vectorized: bool = True
) -> Any:
    """``combine_fn(left, right)`` computed by its C++ translation, one element position
    at a time, as the forward kernel computes a step: for checking the translation of
    each op against eager torch (special values, every dtype) at the cost of one small
    build, where a scan kernel inlines ``combine`` in a dozen places.

    ``left``, ``right``: pytrees of 1-D CPU tensors of one length ``n`` and of dtypes the
    kernel takes; the result has their structure. ``vectorized``: the lane path's vector
    loop, else a scalar call per position (the chain path's code). Raises
    :class:`~fscan.engine._cpp_codegen.Unsupported` where the translator refuses
    ``combine_fn`` (the scan then runs on the torch engine), and the compiler's error
    where the build fails.

    Example:
        >>> import fscan
        >>> left, right = torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])
        >>> if compiler_problem() is None:  # a build: seconds, cached on disk
        ...     assert combine_step(torch.maximum, left, right).tolist() == [3.0, 5.0]
    """
    from .._knowledge import reach
    from ._cpp_source import step_argtypes, step_source

    lefts, spec = flatten(left)
    rights, right_spec = flatten(right)
    n = lefts[0].shape[0] if lefts else 0
    if right_spec != spec or any(
        x.ndim != 1 or x.shape[0] != n or x.dtype != y.dtype or not x.is_cpu
        for x, y in zip(lefts, rights)
    ):
        raise ScanValueError(
            "combine_step: left and right must be pytrees of one structure whose leaves are "
            "1-D CPU tensors of one length, leaf by leaf of one dtype."
        )
    dtypes = tuple(x.dtype for x in lefts)
    captured = reach(combine_fn).tensors
    program = translate_combine(combine_fn, spec, dtypes, (n,), captured)
    kernel = load_kernel(step_source(dtypes, program), step_argtypes(dtypes, program))
    xs = [torch.stack([x, y]).contiguous() for x, y in zip(lefts, rights)]
    ys = [torch.empty(n, dtype=d) for d in dtypes]
    params = _params(program, captured, (n,))
    if params is None:
        raise ScanValueError("combine_step: the captured tensors do not broadcast to one element")
    kernel(*xs, *ys, *params, n, int(vectorized))
    return spec.unflatten(ys)
