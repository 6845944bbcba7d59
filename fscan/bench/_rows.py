"""Ratio rows: fscan against a baseline, each row with its median, ratio and engine.

A :class:`Row` pairs an fscan call with the baseline it is judged against (a copy of
the leaves, torch's op, the forward alone...). :func:`run_rows` first calls every
row's fscan call once, with ``fscan.config.cpu_kernel = "eager"`` (unless "off"), so
that every C++ kernel a row times is built or loaded before any timing starts, and
says how long that took; then names each row's engine from fscan's route log; then
times the rows (fscan and baseline taking turns, torch's Timer) under a progress line.
:func:`render` groups the results into tables, :func:`compare` gives torch's own
``Compare`` table of the same measurements, :func:`to_json` writes them for
``scripts/bench_compare.py``.

Only public fscan API is used here, so the rows also run against older checkouts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from torch.utils.benchmark import Compare, Measurement
from torch.utils.benchmark.utils.common import set_torch_threads

import fscan

from ._allocator import pin_allocator
from ._timing import Progress, Table, engine_of, interleaved, warm_up

__all__ = ["Result", "Row", "compare", "render", "run_rows", "to_json"]


@dataclass(frozen=True)
class Row:
    """One judged workload.

    ``group`` names the table (one bar of the issue); ``run`` is the fscan call,
    ``base`` the baseline called ``base_name``; both timed on ``threads`` threads.
    ``bar`` is the ratio the row should reach (None: no bar); ``more_bar_s``, where given,
    is a bar on the difference instead: the most seconds fscan may take over its baseline
    (a compiled call's overhead over the eager one). ``engine`` overrides the
    route log's name for calls that log none (compiled graphs), or adds to it
    (a backward's node). ``fresh``, where given, is a second limit timed beside the
    baseline and shown, never judged: writing the same outputs into fresh memory (a
    ``clone`` of the leaves), which every out-of-place op pays where its outputs are
    32 MiB or more (glibc maps those fresh each call, and every page faults).
    """

    group: str
    label: str
    run: Callable[[], object]
    base_name: str
    base: Callable[[], object]
    threads: int = 1
    bar: float | None = None
    engine: Callable[[], str] | None = None
    fresh: Callable[[], object] | None = None
    more_bar_s: float | None = None


@dataclass(frozen=True)
class Result:
    """A timed row (seconds are medians), as written by :func:`to_json`."""

    group: str
    label: str
    threads: int
    engine: str
    fscan_s: float
    base_name: str
    base_s: float
    bar: float | None
    # torch's own record of both sides (labels: group, row, "fscan" / "baseline"), for Compare
    measurements: tuple[Measurement, ...] = field(default=(), compare=False, repr=False)
    fresh_s: float | None = None  # the fresh-output limit (Row.fresh), shown, not judged
    more_bar_s: float | None = None  # Row.more_bar_s: judged on fscan_s - base_s

    @property
    def ratio(self) -> float:
        return self.fscan_s / self.base_s

    @property
    def fresh_ratio(self) -> float | None:
        return None if self.fresh_s is None else self.fscan_s / self.fresh_s


def run_rows(rows: Sequence[Row], budget_s: float, title: str = "rows") -> list[Result]:
    """Build, name and time ``rows`` (module doc); prints the build line."""
    mode = "off" if fscan.config.cpu_kernel == "off" else "eager"
    print(f"{title}: {pin_allocator()}", flush=True)
    with fscan.config.override(cpu_kernel=mode):
        start = time.perf_counter()
        progress = Progress(f"{title}: building kernels", len(rows))
        for row in rows:
            progress.step(row.label)
            # On the row's thread count, as its Timer times it: the drop-ins' route table
            # reads the count, so a row is warmed (and named, below) on its timed route.
            with set_torch_threads(row.threads):
                warm_up(row.run)
        progress.close()
        built = time.perf_counter() - start
        print(
            f"{title}: the first calls of {len(rows)} rows (C++ kernel builds and disk-cache "
            f"loads, cpu_kernel={mode!r}) took {built:.1f} s, before any timing",
            flush=True,
        )
        engines = [_engine(row) for row in rows]
        progress = Progress(f"{title}: timing", len(rows))
        results = []
        for row, engine in zip(rows, engines):
            progress.step(f"{row.group}: {row.label}")
            runners = {"fscan": row.run, "baseline": row.base}
            if row.fresh is not None:
                runners["fresh output"] = row.fresh
            times = interleaved(
                runners,
                budget_s=budget_s,
                threads=row.threads,
                label=row.group,
                sub_label=row.label,
            )
            results.append(
                Result(
                    row.group,
                    row.label,
                    row.threads,
                    engine,
                    times["fscan"].median,
                    row.base_name,
                    times["baseline"].median,
                    row.bar,
                    (times["fscan"], times["baseline"]),
                    times["fresh output"].median if row.fresh is not None else None,
                    row.more_bar_s,
                )
            )
        progress.close()
    return results


def _engine(row: Row) -> str:
    with set_torch_threads(row.threads):
        logged = engine_of(row.run, none="", warm=False)  # run_rows made the first call
    extra = row.engine() if row.engine is not None else ""
    return " ".join(part for part in (logged, extra) if part) or "torch"


def _time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.3f} ms"


def render(results: Sequence[Result]) -> str:
    """One table per group, in order of first appearance; a group with fresh-output limits
    gets a column for them (shown, not judged: the bar is on the ratio)."""
    groups: dict[str, Table] = {}
    fresh = {r.group for r in results if r.fresh_s is not None}
    more = {r.group for r in results if r.more_bar_s is not None}
    for r in results:
        table = groups.get(r.group)
        if table is None:
            title = f"{r.group} (medians; ratio = fscan / baseline; bar = the ratio to reach"
            if r.group in more:
                title += ", or +<= the most time over the baseline"
            columns = ["thr", "engine", "fscan", "baseline", "baseline time", "ratio", "bar"]
            if r.group in fresh:
                title += (
                    "; vs clone = fscan / a clone of the leaves, the limit with fresh "
                    "outputs of 32 MiB or more, shown, not judged"
                )
                columns.append("vs clone")
            table = groups[r.group] = Table(title + ")", columns)
        table.add(r.label, _cells(r, r.group in fresh))
    return "\n\n".join(t.render() for t in groups.values())


def _bar(r: Result) -> str:
    """The bar cell: the ratio's bar, or the difference's (``+<=30 us``), and its verdict."""
    if r.more_bar_s is not None:
        more = r.fscan_s - r.base_s
        return f"+<={r.more_bar_s * 1e6:g} us " + ("ok" if more <= r.more_bar_s else "OVER")
    if r.bar is None:
        return "-"
    return f"<={r.bar:g} " + ("ok" if r.ratio <= r.bar else "OVER")


def _cells(r: Result, fresh: bool) -> list[str]:
    return [
        str(r.threads),
        r.engine,
        _time(r.fscan_s),
        r.base_name,
        _time(r.base_s),
        f"{r.ratio:.2f}",
        _bar(r),
        *([_fresh(r)] if fresh else []),
    ]


def _fresh(r: Result) -> str:
    if r.fresh_s is None or r.fresh_ratio is None:
        return "-"
    return f"{r.fresh_ratio:.2f} ({_time(r.fresh_s)})"


def compare(results: Sequence[Result]) -> str:
    """torch's own table of the same measurements (``torch.utils.benchmark.Compare``): per
    group and thread count, fscan and the baseline side by side, noisy ones flagged."""
    table = Compare([m for r in results for m in r.measurements])
    table.trim_significant_figures()
    table.highlight_warnings()
    return str(table)


def to_json(results: Sequence[Result], path: str) -> None:
    """Write the results (a list of :class:`Result` fields and the ratio) to ``path``."""
    data = []
    for r in results:
        fields = asdict(r)
        del fields["measurements"]
        data.append({**fields, "ratio": r.ratio})
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1)
