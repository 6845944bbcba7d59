"""Timing, engine names, progress and table helpers shared by every benchmark section.

Times come from torch's own harness, :class:`torch.utils.benchmark.Timer`:
``blocked_autorange`` runs the call in blocks long enough that the clock's own cost
vanishes (its block-size estimate doubles as a second warm-up), sets torch's thread
count for the measurement (``num_threads``: here the count asked for, else the current
one, never Timer's default of 1 behind the caller's back) and synchronises CUDA
around each block. A slow baseline (a Python loop over many steps) stays affordable:
a call longer than the time budget runs once to estimate and once to measure.

:func:`measure` calls the function once before the Timer sees it, and adds that
call's time to :data:`warm_up_seconds`: with ``fscan.config.cpu_kernel = "eager"``
(which ``python -m fscan.bench`` sets) that first call builds or loads the C++ kernel,
so no timing ever runs beside a compiler, and the run can say how long the builds took.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils.benchmark import Measurement, Timer
from torch.utils.benchmark.utils.common import set_torch_threads

__all__ = [
    "Progress",
    "Table",
    "engine_of",
    "fmt_ms",
    "fwd_bwd",
    "interleaved",
    "interleaved_medians",
    "measure",
    "median_time",
    "optional_jax",
    "time_once",
    "warm_up",
    "warm_up_seconds",
]

# Seconds spent in first (warm-up) calls: kernel builds and disk-cache loads included.
warm_up_seconds = [0.0]


def warm_up(fn: Callable[[], object]) -> float:
    """One untimed call of ``fn`` (where kernels get built), counted in
    :data:`warm_up_seconds`; returns its seconds."""
    start = time.perf_counter()
    fn()
    spent = time.perf_counter() - start
    warm_up_seconds[0] += spent
    return spent


def measure(
    fn: Callable[[], object],
    *,
    budget_s: float = 0.2,
    threads: int | None = None,
    clock: Callable[[], float] | None = None,
    warm: bool = True,
    known_s: float | None = None,
    label: str | None = None,
    sub_label: str | None = None,
    description: str | None = None,
) -> Measurement:
    """``Timer(...).blocked_autorange(min_run_time=budget_s)`` of ``fn()``, after a warm-up.

    ``threads`` defaults to ``torch.get_num_threads()``; ``clock`` (e.g.
    ``time.process_time``) replaces the wall clock; the labels feed
    :class:`torch.utils.benchmark.Compare`. A call known (``known_s``, else from the
    warm-up) to take ``budget_s`` or more is timed once (:func:`time_once`): the
    autorange's block-size estimate would run it once more for nothing.
    """
    if warm:
        spent = warm_up(fn)
        known_s = spent if known_s is None else min(known_s, spent)
    timer = Timer(
        stmt="fn()",
        globals={"fn": fn},
        num_threads=threads or torch.get_num_threads(),
        label=label,
        sub_label=sub_label,
        description=description,
        **({} if clock is None else {"timer": clock}),
    )
    if known_s is not None and known_s >= budget_s:
        return time_once(timer)
    return timer.blocked_autorange(min_run_time=budget_s)


def time_once(timer: Timer) -> Measurement:
    """One call timed by ``timer`` (its clock, thread count and labels). Not
    ``Timer.timeit(1)``: that runs two warm-up calls first, tripling the cost of a slow
    baseline and, between ranks that a barrier just lined up, letting them drift."""
    spec = timer._task_spec  # Timer keeps its settings here; timeit() reads them alike
    with set_torch_threads(spec.num_threads):
        return Measurement(number_per_run=1, raw_times=[timer._timeit(1)], task_spec=spec)


def median_time(
    fn: Callable[[], object], *, budget_s: float = 0.2, threads: int | None = None
) -> float:
    """Median seconds of ``fn()`` by :func:`measure`."""
    return measure(fn, budget_s=budget_s, threads=threads).median


def interleaved(
    runners: dict[str, Callable[[], object]],
    *,
    budget_s: float = 1.0,
    rounds: int = 3,
    threads: int | None = None,
    clock: Callable[[], float] | None = None,
    label: str | None = None,
    sub_label: str | None = None,
) -> dict[str, Measurement]:
    """One merged :class:`Measurement` per runner: the runners take turns, ``rounds``
    times, each turn a ``blocked_autorange`` of ``budget_s / (rounds * len(runners))``,
    so that load drifting over the run falls on all of them alike. Every runner is
    warmed up before any is timed; a runner slower than its turn runs once per turn."""
    known = {name: warm_up(run) for name, run in runners.items()}
    turn = budget_s / (rounds * len(runners))
    parts: dict[str, list[Measurement]] = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            part = measure(
                run,
                budget_s=turn,
                threads=threads,
                clock=clock,
                warm=False,
                known_s=known[name],
                label=label,
                sub_label=sub_label,
                description=name,
            )
            known[name] = part.median
            parts[name].append(part)
    return {name: Measurement.merge(ms)[0] for name, ms in parts.items()}


def interleaved_medians(
    runners: dict[str, Callable[[], object]], budget_s: float = 1.0, **options
) -> dict[str, float]:
    """Median seconds per runner by :func:`interleaved`."""
    return {k: m.median for k, m in interleaved(runners, budget_s=budget_s, **options).items()}


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.engines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        engine = getattr(record, "fscan_engine", None)
        if engine is not None:
            self.engines.append(engine)


@contextmanager
def _route_records() -> Iterator[_Collect]:
    """The ``"fscan"`` log's records of the calls inside, kept from every other handler."""
    logger = logging.getLogger("fscan")
    handler = _Collect()
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def engine_of(fn: Callable[[], object], none: str = "torch", warm: bool = True) -> str:
    """The engine(s) fscan's route log names for a steady call of ``fn`` (``"cpp"``,
    ``"tree"``, ...; joined by ``+`` if several public calls ran), or ``none`` if no fscan
    public call logged one (a torch op, or a compiled graph, which logs nothing).

    The call named is the second (``warm=False``: the caller made the first): a first
    call of a ``combine_fn`` runs its checks, and may build a kernel, on its way to a
    route that later calls do not take."""
    if warm:
        warm_up(fn)
    with _route_records() as records:
        fn()
    return "+".join(dict.fromkeys(records.engines)) or none


class Progress:
    """A progress line on stderr while a long table runs: rewritten in place on a
    terminal, one plain line per step otherwise (a log file keeps every step)."""

    def __init__(self, title: str, total: int, stream=None) -> None:
        self.title, self.total, self.done = title, total, 0
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        spent = time.perf_counter() - self.start
        text = f"{self.title}: [{self.done}/{self.total}] {what} ({spent:.0f} s)"
        if self.tty:
            self.stream.write("\r\x1b[2K" + text[:160])
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()


def optional_jax():
    """``(jax, jax.numpy)`` configured for float32 CPU runs, or ``None`` if not installed."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    return jax, jnp


@dataclass
class Table:
    """A plain-text table: one row per workload, one column per contender."""

    title: str
    columns: list[str]
    rows: list[tuple[str, list[str]]] = field(default_factory=list)

    def add(self, label: str, cells: list[str]) -> None:
        self.rows.append((label, cells))

    def render(self) -> str:
        header = ["workload", *self.columns]
        body = [[label, *cells] for label, cells in self.rows]
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        line = lambda r: "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        )
        rule = "-" * len(line(header))
        return "\n".join([self.title, rule, line(header), rule, *map(line, body), rule])


def fmt_ms(seconds: float | None, reference: float | None = None) -> str:
    """``1.234 ms`` and, against a reference time, the ratio ``(0.50x)``."""
    if seconds is None:
        return "n/a"
    text = f"{seconds * 1e3:.3f} ms"
    if reference:
        text += f" ({seconds / reference:.2f}x)"
    return text


def fwd_bwd(runner: Callable, a: torch.Tensor, b: torch.Tensor, cot: torch.Tensor) -> None:
    """One timed training step of ``runner(a, b)``: forward, backward with ``cot``, the
    gradients dropped."""
    h = runner(a, b)
    torch.autograd.backward(h, cot)
    a.grad = b.grad = None
