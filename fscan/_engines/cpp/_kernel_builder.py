"""Building kernels: trace and translate in the calling thread, compile in the background.

Tracing (make_fx) uses process-wide state of torch.fx and the dispatcher: run beside
a torch.compile or make_fx of another thread, either can fail. So a build traces and
translates in the thread of the scan that triggers it (about 0.1-0.2 s once torch's
tracing modules are imported), and only the C++ compile (seconds) runs in the
background thread (:data:`worker`), which holds the source text and nothing of the
user's. Of the imports, only torch._dynamo (about 3 s) is made in the background
first: see :func:`warm_up`; :data:`warm` says it is done.
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import threading
from collections.abc import Callable

from ..._knowledge import store as _knowledge
from ._cpp_build import load_kernel
from ._cpp_codegen import Unsupported, translate_combine, translate_param_vjp, translate_vjp
from ._cpp_source import backward_argtypes, backward_source, forward_argtypes, forward_source
from ._kernel_entry import BuildCall, Entry, State, kernel_entries, logger

__all__ = ["build", "build_source", "submit", "warm", "warm_up", "worker"]


def build(entry: Entry, call: BuildCall) -> None:
    """Trace, translate, compile and load, all in this thread; leaves ``entry`` READY or
    FAILED (or as it was if another thread finished it meanwhile)."""
    with entry.lock:
        if entry.state in (State.READY, State.FAILED):
            return
        if entry.source is None and not _translate(entry, call):
            return
        _compile(entry)


def _translate(entry: Entry, call: BuildCall) -> bool:
    """Trace ``combine_fn`` (or its VJP) and write the kernel's source into ``entry``.
    On an op, dtype or structure the translator lacks: FAILED, one debug log."""
    try:
        if entry.param_grads:
            program, floats, pfloats, dead = translate_param_vjp(call.trace_input(), call.dropped)
            entry.source = backward_source(call.dtypes, floats, program, pfloats, dead)
            entry.argtypes = tuple(backward_argtypes(call.dtypes, floats, program, pfloats, dead))
            entry.floats, entry.pfloats, entry.dead = tuple(floats), tuple(pfloats), tuple(dead)
        elif entry.backward:
            program, floats, dead = translate_vjp(call.trace_input(), call.dropped)
            entry.source = backward_source(call.dtypes, floats, program, (), dead)
            entry.argtypes = tuple(backward_argtypes(call.dtypes, floats, program, (), dead))
            entry.floats, entry.dead = tuple(floats), tuple(dead)
        else:
            program = translate_combine(call.trace_input())
            entry.source = forward_source(
                call.dtypes, program, call.positions, call.dropped, entry.exclusive, entry.gather
            )
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


warm = threading.Event()


def warm_up() -> None:
    """Import torch._dynamo (make_fx imports it on first use: about 3 s).

    In mode "on" this runs in the background thread, beside the user's code, so it
    imports nothing a trace could be running beside: imports add to ``sys.modules`` and
    to the pytree registries, and a Dynamo trace iterating one of those dicts meanwhile
    fails ("dictionary changed size during iteration"). No trace runs before
    torch._dynamo is imported, and one that starts during this import waits for it
    (an import in progress holds the module's lock). The rest (torch's decompositions
    and make_fx, Inductor's C++ builder and code cache, and what a compile imports:
    under a second, and no pytree node) is imported by the calling thread, which looks
    up the compiler (:func:`~._kernel_registry.unavailable`), translates and imports
    :func:`_compile_imports` before a compile is queued, so the compile thread imports
    nothing of its own (Inductor's loader still enters each kernel's module in
    ``sys.modules``, which nothing fscan traces reads)."""
    import torch._dynamo  # noqa: F401

    warm.set()


@functools.cache
def _compile_imports() -> None:
    """Import what a compile on a cold disk cache imports (Inductor's builder reaches for
    torch.utils.cpp_extension, and setuptools with it), in the calling thread: see
    :func:`warm_up`."""
    import torch.utils.cpp_extension  # noqa: F401


class _Worker:
    """One daemon thread for the warm-up and the compiles, one at a time (they are
    CPU-heavy); its jobs hold source text, never a combine_fn or a tensor."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()
        self.warming = False
        self.closing = False

    def submit(self, job: Callable[[], None]) -> None:
        with self.lock:
            if self.closing:  # the interpreter is exiting: no new work
                return
            self.jobs.put(job)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="fscan-kernel", daemon=True)
                self.thread.start()

    def warm_up(self) -> None:
        with self.lock:
            if self.warming:
                return
            self.warming = True
        self.submit(warm_up)

    def close(self, timeout: float = 60.0) -> None:
        """At interpreter exit: drop the queued jobs and wait (at most ``timeout``) for the
        running one. A process that finalizes while this daemon thread is inside torch's
        C++ (importing torch._dynamo, or compiling) can abort ("terminate called without
        an active exception"); a short script whose first scan started the warm-up did."""
        with self.lock:
            self.closing = True
            thread = self.thread
        while True:
            try:
                self.jobs.get_nowait()
            except queue.Empty:
                break
        if thread is not None and thread.is_alive():
            self.jobs.put(_STOP)
            thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is _STOP:
                return
            try:
                job()
            except Exception as err:  # never let the thread die: report at debug level
                logger.debug("fscan: a background kernel job failed: %r", err)
            del job


def _stop() -> None:
    """The job that ends the worker's loop (see :meth:`_Worker.close`)."""


_STOP = _stop
worker = _Worker()


@atexit.register
def _close_worker() -> None:
    worker.close()


def submit(entry: Entry, call: BuildCall) -> None:
    """Translate now (in this thread) and queue the compile; or, while torch's tracing
    modules are not imported yet, queue their import and leave ``entry`` for a later call."""
    if not warm.is_set():
        worker.warm_up()
        return
    with entry.lock:
        if entry.state is not State.NEW:
            return
        if entry.source is None and not _translate(entry, call):
            return
        entry.state = State.PENDING
    _compile_imports()
    worker.submit(functools.partial(_compile_queued, entry))


def build_source(entry: Entry, eager: bool) -> None:
    """Compile an entry whose source its caller wrote (a reduce kernel, from its forward
    entry's translation): now if ``eager`` (waiting for a queued compile of it too), else
    queued on the compile thread as :func:`submit` queues one."""
    with entry.lock:
        if entry.state is State.NEW and not eager:
            entry.state = State.PENDING
        elif entry.state in (State.NEW, State.PENDING):
            _compile(entry)
            return
        else:
            return
    _compile_imports()
    worker.submit(functools.partial(_compile_queued, entry))


def _compile_queued(entry: Entry) -> None:
    with entry.lock:
        if entry.state is State.PENDING:
            _compile(entry)


def _after_fork_in_child() -> None:
    """The compile thread does not survive a fork: its queued compiles start again."""
    global worker
    worker = _Worker()
    for key in list(_knowledge.entries._data):
        holder = _knowledge.entries.get(key)
        for entry in kernel_entries(holder) if holder is not None else ():
            entry.lock = threading.Lock()
            if entry.state is State.PENDING:
                entry.state = State.NEW


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
