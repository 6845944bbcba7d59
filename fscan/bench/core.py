"""Core benchmark: forward scans against torch.cumsum, torch's prototype, a loop and JAX."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import torch

import fscan

from ._timing import Progress, Table, engine_of, fmt_ms, median_time, optional_jax, warm_up

__all__ = ["forward_memory", "forward_table"]

ADD_SHAPES = [(2**20,), (4096, 256), (1024, 8, 64), (64,)]
QUICK_ADD_SHAPES = [(4096, 256), (64,)]
LOOP_STEPS = 8192


def _torch_prototype() -> Callable | None:
    try:
        from torch._higher_order_ops.associative_scan import associative_scan
    except ImportError:  # older or newer torch without the prototype
        return None
    return associative_scan


def _linrec(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


def _sequential_loop(combine, leaves):
    """The baseline a user writes first: one combine per step, in Python."""
    out = [torch.empty_like(x) for x in leaves]
    acc = [x[0] for x in leaves]
    for o, a in zip(out, acc):
        o[0] = a
    for i in range(1, leaves[0].shape[0]):
        acc = combine(acc, [x[i] for x in leaves])
        acc = list(acc) if isinstance(acc, tuple) else [acc]
        for o, a in zip(out, acc):
            o[i] = a
    return out


def _jax_runner(workload: str, leaves: list[torch.Tensor]) -> Callable | None:
    found = optional_jax()
    if found is None:
        return None
    jax, jnp = found
    arrays = [jnp.asarray(x.numpy()) for x in leaves]
    if workload == "add":
        fn = jax.jit(lambda x: jax.lax.associative_scan(jnp.add, x, axis=0))
        return lambda: fn(arrays[0]).block_until_ready()
    fn = jax.jit(lambda a, b: jax.lax.associative_scan(_linrec, (a, b), axis=0))
    return lambda: jax.block_until_ready(fn(*arrays))


def _contenders(workload: str, leaves: list[torch.Tensor]) -> dict[str, Callable | None]:
    prototype = _torch_prototype()
    xs = leaves[0] if workload == "add" else tuple(leaves)
    combine = torch.add if workload == "add" else _linrec
    loop_combine = (lambda a, b: a[0] + b[0]) if workload == "add" else _linrec
    return {
        "fscan pointwise": lambda: fscan.associative_scan(combine, xs, 0),
        "fscan generic": lambda: fscan.associative_scan(combine, xs, 0, combine_mode="generic"),
        "torch.cumsum": (lambda: torch.cumsum(xs, 0)) if workload == "add" else None,
        "torch assoc_scan generic": prototype
        and (lambda: prototype(combine, xs, 0, combine_mode="generic")),
        # Timed on the first LOOP_STEPS steps and scaled: its cost is linear in
        # the length, and a million Python steps would dominate the whole run.
        "python loop": lambda: _sequential_loop(loop_combine, [x[:LOOP_STEPS] for x in leaves]),
        "jax.jit": _jax_runner(workload, leaves),
    }


def forward_table(quick: bool = False) -> Table:
    """Median forward time per workload; ratios are against fscan pointwise."""
    shapes = QUICK_ADD_SHAPES if quick else ADD_SHAPES
    workloads = [("add", [torch.randn(s)], s) for s in shapes]
    workloads.append(("linrec", [torch.rand(4096, 256), torch.randn(4096, 256)], (4096, 256)))
    table: Table | None = None
    progress = Progress("forward scans", len(workloads))
    for name, leaves, shape in workloads:
        progress.step(f"{name} {shape}")
        runners = _contenders(name, leaves)
        engine = steady_engine(name, leaves)
        if table is None:
            table = Table(
                f"forward scan over dim 0, float32, {torch.get_num_threads()} threads "
                "(median; ratio = time / fscan pointwise)",
                list(runners),
            )
        times = {
            k: (median_time(f, budget_s=0.5 if quick else 1.0) if f else None)
            for k, f in runners.items()
        }
        loop_scale = max(1.0, leaves[0].shape[0] / LOOP_STEPS)
        times["python loop"] = times["python loop"] * loop_scale
        base = times["fscan pointwise"]
        table.add(f"{name} {shape} [{engine}]", [fmt_ms(t, base) for t in times.values()])
    progress.close()
    assert table is not None
    return table


def steady_engine(workload: str, leaves: list[torch.Tensor], backward_too: bool = False) -> str:
    """Build the C++ kernel for fscan's pointwise row now and name the engine that serves it.

    By default the kernel builds in the background from the second call while the torch
    engine answers, with the compiler competing for the cores: timing those calls would
    report neither engine's steady state. The row label names the engine measured, as
    fscan's route log names it for a call made after the build. The build counts among the
    table's untimed first calls (a fresh venv's first kernel, with the precompiled header,
    took 8-13 s here, which the table's summary line did not show).
    """
    xs = leaves[0] if workload == "add" else tuple(leaves)
    combine = torch.add if workload == "add" else _linrec
    warm_up(lambda: fscan.precompile(combine, xs, 0, backward_too=backward_too))
    with fscan.config.override(cpu_kernel="eager"):
        return engine_of(lambda: fscan.associative_scan(combine, xs, 0))


def forward_memory(length: int = 2**24) -> str:
    """Extra peak RSS of a forward add scan over ``(length,)`` float32, per mode."""
    lines = [
        f"extra peak memory of a forward add scan over ({length},) float32 (RSS high-water mark)"
    ]
    for mode in ("pointwise", "generic"):
        probe = [sys.executable, "-m", "fscan.bench._memprobe", "forward_add", str(length), mode]
        extra, size = map(int, subprocess.check_output(probe, text=True).split())
        lines.append(
            f"  {mode:9s}: {extra / 2**20:7.1f} MiB = {extra / size:.2f}x input (incl. output)"
        )
    return "\n".join(lines)
