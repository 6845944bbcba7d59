"""Which kernel serves a call: the lookup, the verdicts, and when a kernel is built.

:func:`lookup_kernels` finds the knowledge entry holding a call's kernels (and the aliasing
pattern of the tensors ``combine_fn`` captures); :func:`ready_entry` counts calls and,
per ``fscan.config.cpu_kernel``, builds a kernel now (``"eager"``), queues its build
from the :data:`MIN_CALLS`-th call or a first one of :data:`MIN_ELEMENTS` elements
(``"on"``), or never (``"off"``). :func:`unavailable` and :func:`kernel_possible` say
why no kernel can serve; :func:`precompile` and :func:`kernel_ready` serve callers
that build ahead or report which engine ran.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from optree import PyTreeSpec

from ..._config import config
from ..._context import under_dispatch_mode, under_transform
from ..._knowledge.purity import probeable
from ..._knowledge.reach import references
from ..._knowledge.store import Knowledge, Reach, knowledge, on_clear, reach
from ..._pytree import flatten
from . import _kernel_builder as builder
from ._cpp_build import compiler_problem
from ._cpp_codegen import DTYPES
from ._kernel_builder import build, submit
from ._kernel_entry import BuildCall, Entry, State, kernel_slots, log_once, warn_once
from ._kernel_layout import element_shape
from ._kernel_run import gathered

__all__ = [
    "MIN_CALLS",
    "MIN_ELEMENTS",
    "captured_occurrences",
    "grad_wanted",
    "kernel_possible",
    "kernel_ready",
    "leaf_refusal",
    "lookup_kernels",
    "precompile",
    "ready_derived",
    "ready_entry",
    "serving_lookup",
    "unavailable",
]

MIN_CALLS = 2  # a key is compiled from this call on (counted once the pointwise check passed)...
MIN_ELEMENTS = 2**15  # ...or from its first call that scans this many elements per leaf


def kernel_ready(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    positions: tuple[int, ...] = (),
    exclusive: bool = False,
) -> bool:
    """Whether a compiled kernel for scans like this one is loaded (counts no call and
    builds nothing: for benchmarks and tests that report which engine ran); ``exclusive``:
    its exclusive variant; leaves whose layout needs it: its gather variant (see
    :func:`~._kernel_run.call_layout`)."""
    if config.cpu_kernel == "off" or unavailable(leaves) is not None:
        return False
    lookup = lookup_kernels(combine_fn, spec, leaves, None, None)
    if lookup is None:
        return False
    holder, aliases, captured = lookup
    dtypes = tuple(x.dtype for x in leaves)
    call = BuildCall(combine_fn, spec, dtypes, element_shape(leaves, dim), captured, positions)
    gather = gathered(leaves, dim, positions)
    entry = kernel_slots(holder).get(call.slot(aliases, False, False, exclusive, gather))
    return entry is not None and entry.state is State.READY


def serving_lookup(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    found: Reach | None,
    entry: Knowledge | None,
    gradients: bool,
) -> tuple[Knowledge, Hashable, tuple[torch.Tensor, ...]] | None:
    """:func:`lookup_kernels` for a call the kernel may serve, else None after one debug
    log of why not (:func:`unavailable`; and, unless ``gradients`` are what the caller
    computes, :func:`grad_wanted` or captured tensors that require grad)."""
    reason = unavailable(leaves) or (None if gradients else grad_wanted(leaves))
    if reason is not None:
        log_once(reason)
        return None
    lookup = lookup_kernels(combine_fn, spec, leaves, found, entry)
    if lookup is None or gradients:
        return lookup
    captured = lookup[2]
    if captured and torch.is_grad_enabled() and any(t.requires_grad for t in captured):
        log_once("combine_fn captures tensors that require grad: the autograd engine runs")
        return None
    return lookup


def lookup_kernels(
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
        log_once("combine_fn reaches state fscan cannot key: no kernel is cached for it")
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


def ready_entry(
    holder: Knowledge,
    aliases: Hashable,
    call: BuildCall,
    numel: int,
    backward: bool,
    param_grads: bool = False,
    exclusive: bool = False,
    gather: bool = False,
) -> Entry | None:
    """The READY kernel entry, or None after counting the call and, per the mode,
    building it now or queueing its build. ``exclusive``, ``gather``: the forward kernel's
    exclusive and gather variants (see :func:`~._kernel_entry.slot_key`), counted and
    built as any kernel."""
    entry = kernel_slots(holder).get_or_compute(
        call.slot(aliases, backward, param_grads, exclusive, gather),
        lambda: Entry(
            backward=backward, param_grads=param_grads, exclusive=exclusive, gather=gather
        ),
    )
    eager = config.cpu_kernel == "eager"
    if entry.state is State.NEW or (eager and entry.state is State.PENDING):
        entry.calls += 1
        if eager:  # waits for a background build of this key too
            build(entry, call)
        elif entry.calls >= MIN_CALLS or numel >= MIN_ELEMENTS:
            submit(entry, call)
    if entry.state is State.FAILED:
        warn_once(entry)
        return None
    return entry if entry.state is State.READY else None


def ready_derived(
    holder: Knowledge,
    aliases: Hashable,
    call: BuildCall,
    numel: int,
    key: Hashable,
    written: Callable[[Any], tuple[str, tuple[str, ...]]],
    what: str,
) -> Entry | None:
    """The READY entry of a kernel made from the forward entry's translation (the reduce
    and segmented kernels), or None: after :func:`ready_entry` of the forward (counted,
    built or queued) and, once that is ready, ``written(program)`` (its source and
    argtypes) compiled under ``key`` (now for ``"eager"``, else queued)."""
    forward = ready_entry(holder, aliases, call, numel, backward=False)
    if forward is None or forward.program is None:
        return None
    program = forward.program

    def new() -> Entry:
        source, argtypes = written(program)
        return Entry(source=source, argtypes=argtypes, program=program)

    entry = kernel_slots(holder).get_or_compute(key, new)
    builder.build_source(entry, eager=config.cpu_kernel == "eager")
    if entry.state is State.FAILED:
        # A compile failure warns once, as the forward's does: the call falls back to the
        # torch engine, 10x slower or more (a segmented kernel that failed to build ran
        # cummax with reset= over (1024, 8, 64) at 2.4 ms against 0.2, logged at debug
        # level only).
        warn_once(entry)
        log_once(f"{what} failed to build: {entry.reason}")
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
    if not leaves or config.cpu_kernel == "off" or unavailable(leaves, wait=True) is not None:
        return False
    lookup = lookup_kernels(combine_fn, spec, leaves, None, None)
    if lookup is None:
        return False
    holder, aliases, captured = lookup
    dim = dim % max(1, leaves[0].ndim)
    call = BuildCall(
        combine_fn, spec, tuple(x.dtype for x in leaves), element_shape(leaves, dim), captured
    )
    ready = True
    for backward in (False, True) if backward_too else (False,):
        entry = kernel_slots(holder).get_or_compute(
            call.slot(aliases, backward), lambda b=backward: Entry(backward=b)
        )
        build(entry, call)
        ready = ready and entry.state is State.READY
    return ready


def leaf_refusal(leaves: Sequence[torch.Tensor]) -> str | None:
    """Why the kernel cannot serve leaves like these (gradients and the toolchain aside),
    or None: the checks of :func:`unavailable` that have no side effect (``fscan.explain``
    asks them too)."""
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
    if under_dispatch_mode():
        # A TorchDispatchMode sees aten ops only: the kernel's work would be hidden from
        # it. The pointwise check is one (a scan nested in a combine_fn it watches would
        # pass unseen), FlopCounterMode and FakeTensorMode others.
        return "a TorchDispatchMode is active: the kernel's work would be hidden from it"
    return None


def unavailable(leaves: Sequence[torch.Tensor], wait: bool = False) -> str | None:
    """Why the kernel cannot serve leaves like these (gradients aside), or None. Unless
    ``wait`` (or the mode is "eager"), the compiler lookup is left to the background."""
    reason = leaf_refusal(leaves)
    if reason is not None:
        return reason
    if not builder.warm.is_set():
        if not (wait or config.cpu_kernel == "eager"):
            # Finding the compiler imports Inductor (about a second): done in the background.
            builder.worker.warm_up()
            return "the C++ toolchain is being looked up in the background"
        # A caller that waits for its build imports all of it now: else the next call in
        # mode "on" would start the warm-up over in the background (seconds of CPU beside
        # the caller) and answer with the torch engine meanwhile, kernel built or not.
        builder.warm_up()
    return compiler_problem()


def kernel_possible() -> bool:
    """Whether the C++ kernel can serve any scan now: False in mode ``"off"`` and once the
    toolchain lookup found no compiler, else True (also while that lookup is still to run:
    the caller's checked path starts it). For callers that would otherwise pay their full
    checks only to hear None from :func:`~.cpu_kernel.kernel_scan` (on a cold cache after a large op
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
    key = (config._cpu_kernel, compiler_problem, builder.warm)
    verdict = _verdicts.get(key)
    if verdict is None:
        if key[0] == "off":
            verdict = False
        elif not builder.warm.is_set():
            return True  # not known yet, and not stored: the lookup may still find none
        else:
            verdict = compiler_problem() is None
        if len(_verdicts) >= 16:  # a few keys in a process (tests patch the probe)
            _verdicts.clear()
        _verdicts[key] = verdict
    return verdict


_verdicts: dict[tuple[str, Callable[[], str | None], threading.Event], bool] = {}


@on_clear
def _forget_verdicts() -> None:
    _verdicts.clear()


def grad_wanted(leaves: Sequence[torch.Tensor]) -> str | None:
    if torch.is_grad_enabled():
        for x in leaves:
            if x.requires_grad:
                return "gradients are wanted: the autograd engine runs"
    return None


def captured_occurrences(fn: Callable[..., Any]) -> list[torch.Tensor] | None:
    """Every tensor ``fn`` reaches, once per place it is reached from, in walk order (the
    edges of :func:`fscan._knowledge.reach.reach`); None where that order is not fixed (a set
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
        todo.extend(references(obj, names))
    return tensors
