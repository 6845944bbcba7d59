"""Autograd benchmark: forward+backward of the linear recurrence over ``(T, 256)`` float32.

Run alone with ``python -m fscan.bench.autograd [--quick]``; on a shared machine
``OMP_NUM_THREADS=1`` keeps other processes from stalling torch's thread pool.

Time is the median wall time in this process, the contenders timed in turn
(round-robin) so that drifting load hits all alike. Memory is the extra peak
RSS of one forward+backward in a fresh process (``_memprobe``: Linux ``VmHWM``
reset before the run, baseline taken once the inputs and cotangents exist), so
it counts the outputs, the gradients and everything autograd keeps alive.
torch's prototype runs its pointwise mode only on CUDA/XPU (on CPU it raises),
so only its generic mode is here.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable

import torch

import fscan

from ._timing import Progress, Table, interleaved_medians
from .core import steady_engine

__all__ = ["RUNNERS", "autograd_table", "fwd_bwd", "linrec_inputs"]

LENGTHS = [1024, 4096, 16384, 65536]
QUICK_LENGTHS = [1024]
WIDTH = 256
# The Python loop makes one autograd node per op per step: timed (and its memory
# measured) on this many steps and scaled linearly, marked "est.".
LOOP_STEPS = 4096
# The generic modes cost about a second per 1024 steps here (Python per tree level,
# autograd through plain torch ops), linear in T: measured on at most this many steps
# and scaled the same way, which keeps the full table within minutes.
STEP_CAPS = {"python loop": LOOP_STEPS, "torch assoc_scan generic": 2048, "fscan generic": 4096}


def _linrec(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


def _torch_generic(a: torch.Tensor, b: torch.Tensor):
    from torch._higher_order_ops.associative_scan import associative_scan

    return associative_scan(_linrec, (a, b), 0, combine_mode="generic")


def _loop(a: torch.Tensor, b: torch.Tensor):
    """One combine per step, results stacked at the end. The steps are taken with
    ``unbind``: indexing ``a[t]`` would make every step's backward zero-fill a
    gradient the size of ``a`` (quadratic time)."""
    steps = list(zip(a.unbind(0), b.unbind(0)))
    acc = steps[0]
    outs = [acc]
    for step in steps[1:]:
        acc = _linrec(acc, step)
        outs.append(acc)
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])


RUNNERS: dict[str, Callable] = {
    "fscan pointwise": lambda a, b: fscan.associative_scan(_linrec, (a, b), 0),
    "fscan generic": lambda a, b: fscan.associative_scan(
        _linrec, (a, b), 0, combine_mode="generic"
    ),
    "torch assoc_scan generic": _torch_generic,
    "python loop": _loop,
}


def linrec_inputs(length: int) -> tuple[torch.Tensor, ...]:
    """``(a, b, cot_a, cot_b)``: a stable gate in (0, 1), and random inputs and cotangents."""
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(length, WIDTH, generator=gen).requires_grad_()
    b = torch.randn(length, WIDTH, generator=gen).requires_grad_()
    return (
        a,
        b,
        torch.randn(length, WIDTH, generator=gen),
        torch.randn(length, WIDTH, generator=gen),
    )


def fwd_bwd(runner: Callable, a, b, cot_a, cot_b) -> tuple[torch.Tensor, ...]:
    """One forward and backward: the gradients of ``<out, cot>`` w.r.t. ``a`` and ``b``."""
    return torch.autograd.grad(runner(a, b), (a, b), (cot_a, cot_b))


def _steps(name: str, length: int, capped: bool = False) -> int:
    """The steps ``name`` runs at ``length``: the Python loop's always capped, the
    generic modes' in the table only (``capped``; the charts draw them measured)."""
    if not capped and name != "python loop":
        return length
    return min(length, STEP_CAPS.get(name, length))


def _jobs(length: int, capped: bool = False) -> dict[str, Callable[[], object]]:
    """What is timed at one length: fwd+bwd of every contender, and fscan's forwards."""
    jobs: dict[str, Callable[[], object]] = {}
    for name, runner in RUNNERS.items():
        a, b, ca, cb = (t[: _steps(name, length, capped)].detach() for t in linrec_inputs(length))
        if name.startswith("fscan"):
            jobs[name + " fwd"] = functools.partial(runner, a, b)
        a, b = a.requires_grad_(), b.requires_grad_()
        jobs[name] = functools.partial(fwd_bwd, runner, a, b, ca, cb)
    return jobs


def peak_memory(name: str, length: int, capped: bool = False) -> tuple[int, int]:
    """``(extra peak RSS, input bytes)`` of one forward+backward, in a fresh process
    (on at most the contender's capped steps, scaled)."""
    steps = _steps(name, length, capped)
    extra, size = _probe(name, steps)
    return extra * length // steps, size * length // steps


@functools.cache
def _probe(name: str, steps: int) -> tuple[int, int]:
    """One fresh process per contender and step count: a capped contender's longer
    lengths reuse the probe of its cap."""
    probe = [sys.executable, "-m", "fscan.bench._memprobe", "fwd_bwd_linrec", str(steps), name]
    extra, size = map(int, subprocess.check_output(probe, text=True).split())
    return extra, size


def autograd_table(quick: bool = False) -> Table:
    """Forward+backward time and peak memory per length, with fscan's fwd+bwd / fwd ratio."""
    lengths = QUICK_LENGTHS if quick else LENGTHS
    table = Table(
        f"forward+backward, linear recurrence over (T, {WIDTH}) float32, "
        f"threads={torch.get_num_threads()} (median time"
        + (")" if quick else " | extra peak RSS of one run in a fresh process)"),
        list(RUNNERS),
    )
    memory: dict[str, dict[int, int]] = {name: {} for name in RUNNERS}
    progress = Progress("forward+backward", len(lengths))
    for length in lengths:
        progress.step(f"T={length}")
        # Steady state: fscan pointwise's kernels built first (see core.steady_engine).
        engine = steady_engine("linrec", [t.detach() for t in linrec_inputs(length)[:2]], True)
        times = interleaved_medians(_jobs(length, True), budget_s=1.0 if quick else 4.0, rounds=2)
        cells = []
        for name in RUNNERS:
            mem = None if quick else peak_memory(name, length, True)
            if mem is not None:
                memory[name][length] = mem[0]
            cells.append(_cell(name, length, times, mem))
        table.add(f"T={length} [{engine}]", cells)
    progress.close()
    if not quick:
        table.add("mem ratio 16384->65536", [_growth(n, memory[n], 16384, 65536) for n in RUNNERS])
    return table


def _cell(name: str, length: int, times: dict[str, float], mem) -> str:
    seconds = times[name] * length / _steps(name, length, True)
    text = f"{seconds * 1e3:.1f} ms"
    if name + " fwd" in times:
        text += f" ({seconds / times[name + ' fwd']:.1f}x fwd)"
    if mem is not None:
        text += f" | {mem[0] / 2**20:.0f} MiB"
    if _steps(name, length, True) < length:
        text += " est."
    return text


def _growth(name: str, memory: dict[int, int], small: int, large: int) -> str:
    if small not in memory or large not in memory:
        return "n/a"
    if _steps(name, large, True) < large:  # scaled from fewer steps: linear by construction
        return "est."
    return f"{memory[large] / memory[small]:.2f}x"


if __name__ == "__main__":
    print(autograd_table(quick="--quick" in sys.argv).render())
