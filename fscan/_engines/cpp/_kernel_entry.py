"""What one compiled kernel is (:class:`Entry`) and where a combine's kernels are kept.

A kernel entry lives in its :class:`fscan._knowledge.store.Knowledge` entry, in a bounded
cache of slots keyed by :func:`slot_key`; :class:`BuildCall` is what building one
needs from the call that triggered it. Also the engine's logged-once reasons.
"""

from __future__ import annotations

import enum
import logging
import threading
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from ..._cache import BoundedCache
from ..._knowledge.store import Knowledge, on_clear
from ._cpp_codegen import Program, TraceInput

__all__ = [
    "SHAPES_PER_KEY",
    "BuildCall",
    "Entry",
    "State",
    "is_ready",
    "kernel_entries",
    "kernel_slots",
    "log_once",
    "logger",
    "slot_key",
    "warn_once",
]

logger = logging.getLogger("fscan")

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
    exclusive: bool = False  # the forward kernel's exclusive variant (csrc/forward.h: scan)
    gather: bool = False  # the forward kernel's gather variant (csrc/forward.h: scan)
    param_grads: bool = False  # backward: also the cotangents of the float params
    state: State = State.NEW
    calls: int = 0
    floats: tuple[int, ...] = ()  # backward: the leaves it differentiates
    pfloats: tuple[int, ...] = ()  # backward with param_grads: the params it differentiates
    dead: tuple[int, ...] = ()  # backward: leaves whose cotangent it neither reads nor carries
    source: str | None = None  # traced and translated in the calling thread...
    argtypes: tuple[str, ...] = ()  # ...compiled in the background
    kernel: Callable[..., None] | None = None
    program: Program | None = None
    reason: str = ""
    warning: str | None = None  # a compile failure, to be shown once on a user's call
    lock: threading.Lock = field(default_factory=threading.Lock)


# The reasons logged once per process (a reason logged again after fscan.clear_caches()).
_logged: set[str] = set()


@on_clear
def _forget_logged() -> None:
    _logged.clear()


def slot_key(
    aliases: Hashable,
    element: tuple[int, ...],
    positions: tuple[int, ...],
    dropped: tuple[int, ...],
    backward: bool,
    param_grads: bool,
    exclusive: bool = False,
    gather: bool = False,
) -> Hashable:
    """The key of a kernel entry within its knowledge entry: the generated source depends
    on all of it (and on the knowledge entry's key), on no length, dim, layout or thread
    count. The one place that spells it (lookups of READY entries build it directly).
    ``exclusive``: the forward kernel's exclusive variant, a kernel of its own (it compiles
    only the exclusive scan's paths, the ordinary one only the inclusive ones), so neither
    key finds the other's kernel. ``gather``: the forward kernel's gather variant, the only
    one whose lane path reads or writes rows of other inner strides than 1 (see
    :func:`~._kernel_layout.gathers`), likewise a kernel of its own."""
    return (aliases, element, positions, dropped, backward, param_grads, exclusive, gather)


class BuildCall(NamedTuple):
    """What a build needs from the call that triggered it (a NamedTuple: made on every
    call, and a frozen dataclass costs ~2 us to make)."""

    combine_fn: Callable[[Any, Any], Any]
    spec: PyTreeSpec
    dtypes: tuple[torch.dtype, ...]
    element: tuple[int, ...]  # the shape of one element: the leaves' without the scan dim
    captured: tuple[torch.Tensor, ...]
    positions: tuple[int, ...] = ()  # leaves that are not read: their position along dim
    # Leaves whose outputs are not stored (the caller drops them); of a backward kernel,
    # the outputs without a cotangent (autograd's None), see translate_vjp's ``missing``.
    dropped: tuple[int, ...] = ()

    def trace_input(self) -> TraceInput:
        """What the translation traces (made per build, not per call)."""
        return TraceInput(self.combine_fn, self.spec, self.dtypes, self.element, self.captured)

    def slot(
        self,
        aliases: Hashable,
        backward: bool,
        param_grads: bool = False,
        exclusive: bool = False,
        gather: bool = False,
    ) -> Hashable:
        """This call's :func:`slot_key`."""
        return slot_key(
            aliases,
            self.element,
            self.positions,
            self.dropped,
            backward,
            param_grads,
            exclusive,
            gather,
        )


def kernel_slots(holder: Knowledge) -> BoundedCache[Entry]:
    """The kernel entries of a knowledge entry, by (aliasing of the captured tensors,
    element shape, backward, the exclusive and gather variants: see :func:`slot_key`). The trace is
    exact for one element shape only (Python code may read sizes: a slice over a whole
    dimension traces as an alias), so each shape gets its own entry; shapes that
    translate to the same source share one compiled library (Inductor's cache is keyed by
    source), so a new shape costs a trace (about 0.1-0.2 s), not a compile."""
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


def is_ready(entry: Entry | None) -> bool:
    return entry is not None and entry.state is State.READY


def log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.debug("fscan: pointwise scan without the C++ kernel: %s", reason)


def warn_once(entry: Entry) -> None:
    message, entry.warning = entry.warning, None
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=5)
