"""Drop-in ops against torch's, and linear_recurrence against a loop, torch's prototype and JAX.

Contenders take turns within each workload (one run of each, repeated), so load
from other processes falls on all of them alike; the tables report medians.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

import fscan
from fscan._routing.cumulative import path

from ._timing import Table, engine_of, fmt_ms, interleaved_medians, optional_jax
from .bars import DROP_IN_WORKLOADS, VIEWS

__all__ = ["cumsum_precision", "linear_engines", "linear_table", "ops_table"]

OPS = ["cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"]
WORKLOADS = DROP_IN_WORKLOADS  # (shape of the memory, dim, view): the rows of bars.py
QUICK_WORKLOADS = [((4096, 256), 0, ""), ((4096, 256), 1, ""), ((256, 4096), 0, ".t()")]
LINEAR_SHAPE = (8, 4096, 256)
QUICK_LINEAR_SHAPE = (8, 1024, 256)
LOOP_STEPS = 512


def ops_table(quick: bool = False) -> Table:
    """Each drop-in op against its torch counterpart, float32, forward, on contiguous
    tensors and on views (a transpose, a step slice, an expanded tensor, a permutation),
    which torch's op and fscan's kernel read in place.

    The C++ kernel is built (or loaded from the disk cache) before timing, as a
    service's warm-up would (``fscan.precompile`` does it for ``associative_scan``):
    ``fscan`` is the steady state, on the engine named in the last column;
    ``no kernel`` is the same call with ``fscan.config.cpu_kernel = "off"`` (no
    compiler, or before the background build is done).
    """
    table = Table(
        f"drop-in ops vs torch, float32 forward, {torch.get_num_threads()} threads "
        "(median; ratio = fscan / torch; engine = fscan's route log)",
        ["torch", "fscan", "ratio", "no kernel", "ratio", "engine"],
    )
    for shape, dim, view in QUICK_WORKLOADS if quick else WORKLOADS:
        x = VIEWS[view](torch.randn(shape, generator=torch.Generator().manual_seed(0)))
        for name in OPS[:2] if quick else OPS:
            ours, theirs = getattr(fscan, name), getattr(torch, name)
            with fscan.config.override(cpu_kernel="eager"):
                ours(x, dim)  # the warm-up: builds the kernel where it wins

            def off(ours=ours, x=x, dim=dim) -> object:
                # Not config.override: a context manager's cost (cold, after the op
                # before) would be timed with the call.
                previous, fscan.config.cpu_kernel = fscan.config.cpu_kernel, "off"
                try:
                    return ours(x, dim)
                finally:
                    fscan.config.cpu_kernel = previous

            times = interleaved_medians(
                {"torch": partial(theirs, x, dim), "fscan": partial(ours, x, dim), "off": off},
                budget_s=0.5 if quick else 1.0,
            )
            with fscan.config.override(cpu_kernel="eager"):
                engine = engine_of(partial(ours, x, dim))
            cells = [fmt_ms(times["torch"]), fmt_ms(times["fscan"])]
            cells += [f"{times['fscan'] / times['torch']:.2f}x", fmt_ms(times["off"])]
            cells += [f"{times['off'] / times['torch']:.2f}x", engine]
            table.add(f"{name} {shape}{view} dim {dim}", cells)
    return table


def _compose(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


def _loop(a: torch.Tensor, b: torch.Tensor, steps: int) -> torch.Tensor:
    """The baseline a user writes first: one step per iteration, over ``steps`` steps."""
    out = torch.empty_like(b[:, :steps])
    h = torch.zeros_like(b[:, 0])
    for t in range(steps):
        h = a[:, t] * h + b[:, t]
        out[:, t] = h
    return out


def _jax_linear(a: torch.Tensor, b: torch.Tensor) -> Callable[[], object] | None:
    found = optional_jax()
    if found is None:
        return None
    jax, jnp = found
    ja, jb = jnp.asarray(a.numpy()), jnp.asarray(b.numpy())
    fn = jax.jit(lambda a, b: jax.lax.associative_scan(_compose, (a, b), axis=1))
    return lambda: jax.block_until_ready(fn(ja, jb))


def linear_table(quick: bool = False) -> Table:
    """``h_t = a_t h_{t-1} + b_t`` over dim 1, float32, forward."""
    shape = QUICK_LINEAR_SHAPE if quick else LINEAR_SHAPE
    gen = torch.Generator().manual_seed(0)
    a, b = torch.rand(shape, generator=gen), torch.randn(shape, generator=gen)
    try:
        from torch._higher_order_ops.associative_scan import associative_scan as prototype
    except ImportError:  # a torch without the prototype
        prototype = None
    runners: dict[str, Callable[[], object] | None] = {
        "fscan.linear_recurrence": lambda: fscan.linear_recurrence(a, b, 1),
        "fscan.associative_scan": lambda: fscan.associative_scan(_compose, (a, b), 1),
        "torch assoc_scan generic": prototype
        and (lambda: prototype(_compose, (a, b), 1, combine_mode="generic")),
        # Timed on the first LOOP_STEPS steps and scaled by length: its cost is
        # linear in the number of steps, and 4096 Python steps would dominate.
        "python loop (est.)": lambda: _loop(a, b, LOOP_STEPS),
        "jax.jit assoc_scan": _jax_linear(a, b),
    }
    present = {k: f for k, f in runners.items() if f is not None}
    with fscan.config.override(cpu_kernel="eager"):  # steady state: kernels built first
        for name in ("fscan.linear_recurrence", "fscan.associative_scan"):
            runners[name]()
    times = interleaved_medians(present, budget_s=4 if quick else 20, rounds=2 if quick else 3)
    times["python loop (est.)"] *= shape[1] / LOOP_STEPS
    base = times["fscan.linear_recurrence"]
    engines = linear_engines(a, b)
    table = Table(
        f"linear_recurrence, float32 forward, {torch.get_num_threads()} threads "
        "(median; ratio = time / fscan.linear_recurrence; [engine])",
        [f"{k} [{engines[k]}]" if k in engines else k for k in runners],
    )
    table.add(f"{shape} dim 1", [fmt_ms(times.get(k), base) for k in runners])
    return table


def linear_engines(a: torch.Tensor, b: torch.Tensor, dim: int = 1) -> dict[str, str]:
    """The engine each fscan column of :func:`linear_table` ran on, as fscan's route log
    names it for one more call after the warm-up (kernels built: mode "eager")."""
    with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
        return {
            "fscan.linear_recurrence": engine_of(lambda: fscan.linear_recurrence(a, b, dim)),
            "fscan.associative_scan": engine_of(
                lambda: fscan.associative_scan(_compose, (a, b), dim)
            ),
        }


def cumsum_precision() -> Table:
    """RMS error of cumsum against a float64 reference at 2**22 elements."""
    table = Table(
        "cumsum RMS error vs float64 at 2**22 elements (ratio = fscan / torch; bar: <= 2)",
        ["torch", "fscan", "ratio", "path"],
    )
    for shape in [(2**22,), (2**16, 64)]:
        base = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = base.to(dtype)
            exact = x.double().cumsum(0)
            errors = [
                (op(x, 0).double() - exact).pow(2).mean().sqrt().item()
                for op in (torch.cumsum, fscan.cumsum)
            ]
            cells = [f"{e:.3g}" for e in errors]
            cells += [f"{errors[1] / errors[0]:.2f}", path(torch.cumsum, x, 0)]
            table.add(f"{str(dtype).removeprefix('torch.')} {shape} dim 0", cells)
    return table


if __name__ == "__main__":  # this section alone: python -m fscan.bench.ops
    for table in (ops_table(), linear_table(), cumsum_precision()):
        print(table.render(), end="\n\n", flush=True)
