"""Charts of the benchmarks: ``python -m fscan.bench --plot DIR [--quick]``.

Writes PNG charts (matplotlib: the ``plot`` extra) and the numbers behind them
(``bench_data.json``) into ``DIR``:

* ``time_add.png``: forward time of an add scan over dim 0 of ``(T, 64)``
  float32 against ``T``;
* ``time_linrec.png``: the same for the linear-recurrence pair ``(a, b)``;
* ``time_fwd_bwd.png`` and ``memory_fwd_bwd.png``: forward+backward time and
  extra peak memory of the linear recurrence over ``(T, 256)``.

The contenders and the measurements are those of the tables (:mod:`.core` for
the forward scans, :mod:`.autograd` for forward+backward, whose memory is the
extra peak RSS of a fresh process per point, :mod:`._memprobe`); this module
only sweeps the length and draws. The Python loop is timed on a prefix of at
most ``LOOP_STEPS`` steps and scaled linearly, as in the tables.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import fscan

from . import autograd, core
from ._timing import interleaved_medians

__all__ = ["line_chart", "measure_forward", "measure_fwd_bwd", "measure_memory", "write_plots"]

FORWARD_LENGTHS = [2**k for k in range(6, 17, 2)]  # 64 .. 65536
QUICK_FORWARD_LENGTHS = [256, 4096]
FORWARD_WIDTH = 64
QUICK_AUTOGRAD_LENGTHS = [1024, 4096]

Series = dict[str, list[float | None]]


def _forward_jobs(workload: str, length: int) -> tuple[dict[str, Callable[[], object]], int]:
    """The forward contenders of :mod:`.core` at one length (and fscan's drop-in op), and
    how many steps the Python loop runs."""
    gen = torch.Generator().manual_seed(0)
    if workload == "add":
        leaves = [torch.randn(length, FORWARD_WIDTH, generator=gen)]
    else:
        leaves = [
            torch.rand(length, FORWARD_WIDTH, generator=gen),
            torch.randn(length, FORWARD_WIDTH, generator=gen),
        ]
    jobs = {name: run for name, run in core._contenders(workload, leaves).items() if run}
    if workload == "add":
        jobs["fscan.cumsum"] = lambda: fscan.cumsum(leaves[0], 0)
    else:
        jobs["fscan.linear_recurrence"] = lambda: fscan.linear_recurrence(*leaves, 0)
    return jobs, min(length, core.LOOP_STEPS)


def measure_forward(workload: str, lengths: Sequence[int], budget_s: float) -> Series:
    """Median forward seconds per contender at each length (None where one does not run)."""
    series: Series = {}
    for i, length in enumerate(lengths):
        jobs, loop_steps = _forward_jobs(workload, length)
        times = interleaved_medians(jobs, budget_s=budget_s)
        times["python loop"] *= length / loop_steps
        for name, seconds in times.items():
            series.setdefault(name, [None] * len(lengths))[i] = seconds
    return series


def measure_fwd_bwd(lengths: Sequence[int], budget_s: float) -> Series:
    """Median forward+backward seconds of :mod:`.autograd`'s contenders at each length."""
    series: Series = {name: [] for name in autograd.RUNNERS}
    for length in lengths:
        times = interleaved_medians(autograd._jobs(length), budget_s=budget_s)
        for name in autograd.RUNNERS:
            series[name].append(times[name] * length / autograd._steps(name, length))
    return series


def measure_memory(lengths: Sequence[int]) -> Series:
    """Extra peak RSS in bytes of one forward+backward per contender and length."""
    return {
        name: [float(autograd.peak_memory(name, length)[0]) for length in lengths]
        for name in autograd.RUNNERS
    }


def line_chart(
    path: Path,
    title: str,
    ylabel: str,
    lengths: Sequence[int],
    series: Series,
    *,
    scale: float = 1.0,
    note: str = "",
) -> Path:
    """Draw ``series`` (values times ``scale``) against ``lengths`` on log-log axes into ``path``.

    Needs matplotlib (not a doctest for that reason; ``tests/test_bench_plot.py``)::

        line_chart(Path("demo.png"), "demo", "time (ms)", [1, 2, 4], {"a": [1e-3, None, 4e-3]},
                   scale=1e3)
    """
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    fig = Figure(figsize=(7.5, 4.8), layout="constrained")
    ax = fig.add_subplot()
    markers = "osD^vP*X"
    for i, (name, values) in enumerate(series.items()):
        points = [(n, v * scale) for n, v in zip(lengths, values) if v is not None]
        if not points:
            continue
        style = "--" if name.startswith(("python", "torch", "jax")) else "-"
        if name.startswith("input"):  # a reference line, not a contender
            ax.plot(*zip(*points), ":", color="0.3", label=name)
            continue
        ax.plot(*zip(*points), style, marker=markers[i % len(markers)], label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("scan length T")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if note:  # below the axis label, in space the layout reserves for it
        fig.supxlabel(note, fontsize=7, color="0.4", x=0.01, ha="left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def write_plots(directory: str | Path, quick: bool = False) -> list[Path]:
    """Measure and draw every chart into ``directory``; return the files written."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise SystemExit(
            "python -m fscan.bench --plot needs matplotlib: pip install -e '.[plot]'"
        ) from err
    out = Path(directory)
    lengths = QUICK_FORWARD_LENGTHS if quick else FORWARD_LENGTHS
    grad_lengths = QUICK_AUTOGRAD_LENGTHS if quick else autograd.LENGTHS
    budget = 0.3 if quick else 3.0
    threads = torch.get_num_threads()
    plural = "" if threads == 1 else "s"
    machine = f"{platform.machine()} CPU, {threads} thread{plural}, torch {torch.__version__}"
    loop_note = f"{machine}; python loop timed on <= {{}} steps and scaled linearly (dashed: peers)"

    data = {
        "machine": machine,
        "forward_lengths": lengths,
        "autograd_lengths": grad_lengths,
        "add": measure_forward("add", lengths, budget),
        "linrec": measure_forward("linrec", lengths, budget),
        "fwd_bwd": measure_fwd_bwd(grad_lengths, budget),
        "memory": measure_memory(grad_lengths),
    }
    inputs = {"input size (a and b)": [2.0 * n * autograd.WIDTH * 4 for n in grad_lengths]}
    timed = [  # file, title, lengths, series, python loop steps
        (
            "time_add.png",
            f"forward add scan over dim 0 of (T, {FORWARD_WIDTH}) float32 (median)",
            lengths,
            "add",
            core.LOOP_STEPS,
        ),
        (
            "time_linrec.png",
            f"forward linear recurrence h = a h + b over (T, {FORWARD_WIDTH}) float32 (median)",
            lengths,
            "linrec",
            core.LOOP_STEPS,
        ),
        (
            "time_fwd_bwd.png",
            f"forward+backward, linear recurrence over (T, {autograd.WIDTH}) float32 (median)",
            grad_lengths,
            "fwd_bwd",
            autograd.LOOP_STEPS,
        ),
    ]
    files = [
        *(
            line_chart(
                out / name,
                title,
                "time (ms)",
                xs,
                data[key],
                scale=1e3,
                note=loop_note.format(steps),
            )
            for name, title, xs, key, steps in timed
        ),
        line_chart(
            out / "memory_fwd_bwd.png",
            f"forward+backward, linear recurrence over (T, {autograd.WIDTH}) float32: "
            "extra peak RSS",
            "extra peak memory (MiB)",
            grad_lengths,
            {**data["memory"], **inputs},
            scale=2.0**-20,
            note=f"{machine}; one fresh process per point; "
            f"python loop measured on <= {autograd.LOOP_STEPS} steps and scaled",
        ),
    ]
    data_path = out / "bench_data.json"
    data_path.write_text(json.dumps(data, indent=1) + "\n")
    return [*files, data_path]
