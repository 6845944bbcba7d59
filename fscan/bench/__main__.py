"""``python -m fscan.bench [--quick] [--json PATH] [--plot DIR]``: print every benchmark table in
one process run, or with ``--plot DIR`` draw the charts of :mod:`fscan.bench.plot` into ``DIR``
instead.

The run sets ``fscan.config.cpu_kernel = "eager"`` (unless it is "off"): every C++ kernel
is built, or loaded from the disk cache, by the first call of a workload, before any of
its timing; in the default mode "on" it would build in the background while the torch
engine answers, and a table timed meanwhile would time neither. Each table says how long
its first calls (the builds) took. ``--json PATH`` writes the rows of the speed bars
(:mod:`fscan.bench.bars`) for ``scripts/bench_compare.py``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import fscan

from . import autograd, bars, core, extras, gpu, kernel, linear, log_space, ops, overhead
from . import distributed as distributed_bench
from ._allocator import pin_allocator
from ._machine import machine_line
from ._rows import render, run_rows, to_json
from ._timing import Progress, warm_up_seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fscan.bench", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="a short subset (used by `python -m fscan`)"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write the bar rows (median, ratio, engine) to PATH"
    )
    parser.add_argument(
        "--plot",
        metavar="DIR",
        help="write PNG charts of time and memory against length into DIR (needs matplotlib)",
    )
    args = parser.parse_args(argv)
    if args.plot is not None:
        from .plot import write_plots  # matplotlib is optional: only --plot needs it

        for path in write_plots(args.plot, quick=args.quick):
            print(path, flush=True)
        return
    mode = "off" if fscan.config.cpu_kernel == "off" else "eager"
    with fscan.config.override(cpu_kernel=mode):
        _run(_tables(args.quick, args.json), mode)


def _bar_rows(quick: bool, json_path: str | None) -> Callable[[], str]:
    def table() -> str:
        results = run_rows(bars.bar_rows(quick), budget_s=0.3 if quick else 0.5, title="bars")
        if json_path:
            to_json(results, json_path)
        return render(results)

    return table


def _tables(quick: bool, json_path: str | None) -> list[tuple[str, Callable[[], str]]]:
    """(name, a function printing nothing and returning the rendered table), in order."""
    tables = [
        ("forward scans", lambda: core.forward_table(quick=quick).render()),
        ("combine_fn checks", lambda: overhead.overhead_table(quick=quick).render()),
        ("forward+backward", lambda: autograd.autograd_table(quick=quick).render()),
        ("linear_recurrence", lambda: ops.linear_table(quick=quick).render()),
        ("speed bars", _bar_rows(quick, json_path)),
    ]
    if quick:
        return tables
    tables += [
        ("cumsum precision", lambda: ops.cumsum_precision().render()),
        ("forward memory", core.forward_memory),
        *((table.__name__, lambda t=table: t().render()) for table in _FULL_ONLY),
        # gloo ranks as processes on this machine: full runs only.
        ("distributed", distributed_bench.distributed_table),
    ]
    if torch.cuda.is_available():
        tables.append(("gpu", lambda: gpu.gpu_table().render()))
    return tables


def _run(tables: list[tuple[str, Callable[[], str]]], mode: str) -> None:
    print(
        f"fscan.config.cpu_kernel={mode!r} for this run: kernels are built before they are "
        f"timed; {torch.get_num_threads()} threads unless a table says otherwise; "
        f"{pin_allocator()}",
        flush=True,
    )
    print(machine_line(), flush=True)
    progress = Progress("fscan.bench", len(tables))
    begin, first_calls = time.perf_counter(), 0.0
    for name, table in tables:
        progress.step(name)
        warm_up_seconds[0] = 0.0
        start = time.perf_counter()
        text = table()
        progress.close()
        spent = time.perf_counter() - start
        print(f"\n{text}", flush=True)
        print(
            f"({name}: {spent:.1f} s, of which {warm_up_seconds[0]:.1f} s in untimed first "
            "calls: kernel builds and loads, warm-ups)",
            flush=True,
        )
        first_calls += warm_up_seconds[0]
    print(
        f"\nall {len(tables)} tables: {time.perf_counter() - begin:.1f} s, of which "
        f"{first_calls:.1f} s in untimed first calls",
        flush=True,
    )


# Tables of full runs only, in print order. Run alone instead: kernel.kernel_table and
# ops.ops_table (python -m fscan.bench.kernel / .ops: the speed bars hold their rows) and
# compile.compile_table (python -m fscan.bench.compile: minutes of cold compiles; the
# speed bars time compiled fwd+bwd and a compiled call).
_FULL_ONLY = (
    linear.training_table,
    linear.accuracy_table,
    log_space.log_table,
    kernel.backward_table,
    kernel.latency_table,
    extras.initial_table,
    extras.reduce_table,
    extras.matrix_table,
)

if __name__ == "__main__":
    main()
