"""Compile benchmark: ``torch.compile(fullgraph=True)`` of a function containing a scan.

Reports the first call (tracing plus Inductor's compile, with Inductor's on-disk
graph cache off, so a cold compile), then the steady-state time of the
compiled function against eager fscan and ``torch.cumsum``, and the number of
compiles over four lengths with ``dynamic=True``. On CPU a traced pointwise scan is
torch's scan op lowered to fscan's C++ kernel where a compiler is installed, else the
blocked scan around a ``while_loop`` (see ``fscan._engines.traced``); generic scans always take
the blocked scan. Each row names the engines of both columns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch._dynamo.testing

import fscan
from fscan._engines.cpp.traced_kernel import kernel_traceable

from ._timing import Table, engine_of, fmt_ms, interleaved_medians

__all__ = ["compile_table"]

SHAPE = (4096, 256)
LENGTHS = (1000, 3000, 4097, 7)


def _linrec(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


def _workloads() -> dict[str, tuple[Callable, tuple, Callable | None]]:
    x = torch.randn(SHAPE)
    a, b = torch.rand(SHAPE), torch.randn(SHAPE)
    # The eager column's engine, as the route log names it for a call after the build.
    kernel = lambda combine, xs, mode="pointwise": engine_of(
        lambda: fscan.associative_scan(combine, xs, 0, combine_mode=mode)
    )
    m = torch.randn(4096, 2, 2) / 2
    traced = "traced (cpp scan op)" if kernel_traceable() else "traced (blocked scan)"
    return {
        f"add {SHAPE} [compiled: {traced}; eager: {kernel(torch.add, x)}]": (
            lambda x: fscan.associative_scan(torch.add, x, 0),
            (x,),
            lambda x: torch.cumsum(x, 0),
        ),
        f"linrec {SHAPE} [compiled: {traced}; eager: {kernel(_linrec, (a, b))}]": (
            lambda a, b: fscan.associative_scan(_linrec, (a, b), 0),
            (a, b),
            None,
        ),
        "generic 2x2 matmul (4096,) [compiled: blocked scan; "
        f"eager: {kernel(torch.matmul, m, 'generic')}]": (
            lambda m: fscan.associative_scan(torch.matmul, m, 0, combine_mode="generic"),
            (m,),
            None,
        ),
    }


def _first_call(fn: Callable, args: tuple, **options) -> tuple[Callable, float]:
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, **options)
    with torch._inductor.config.patch(fx_graph_cache=False):
        start = time.perf_counter()
        compiled(*args)
        return compiled, time.perf_counter() - start


def _compiles_over_lengths(fn: Callable, args: tuple) -> int:
    """Frames compiled when the same function sees ``LENGTHS`` (dynamic=True)."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=counter)
    for n in LENGTHS:
        compiled(*[x[:n] if n <= x.shape[0] else torch.cat([x, x[: n - x.shape[0]]]) for x in args])
    return counter.frame_count


def compile_table(quick: bool = False) -> Table:
    """First-call latency and steady-state time of compiled scans; ratio = time / eager fscan."""
    table = Table(
        f"torch.compile(fullgraph=True) on CPU, {torch.get_num_threads()} threads "
        "(medians of interleaved turns; ratio = time / eager fscan)",
        ["first call", "compiled", "eager fscan", "torch.cumsum", f"compiles over {LENGTHS}"],
    )
    for label, (fn, args, cumsum) in _workloads().items():
        table.add(label, _row(fn, args, cumsum, quick))
    return table


def _row(fn: Callable, args: tuple, cumsum: Callable | None, quick: bool) -> list[str]:
    compiled, first = _first_call(fn, args)
    runners = {"compiled": lambda: compiled(*args), "eager": lambda: fn(*args)}
    if cumsum is not None:
        runners["cumsum"] = lambda: cumsum(*args)
    times = interleaved_medians(runners, budget_s=1.5 if quick else 2.0)
    eager = times["eager"]
    compiles = "-" if quick else str(_compiles_over_lengths(fn, args))
    return [
        f"{first:.1f} s",
        fmt_ms(times["compiled"], eager),
        fmt_ms(eager),
        fmt_ms(times.get("cumsum"), eager),
        compiles,
    ]


if __name__ == "__main__":
    print(compile_table().render())
