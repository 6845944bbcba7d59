"""The drop-ins' kernels in cache and from memory: inclusive against ``reset=``, both directions.

For each op, this runs ``fscan.<op>(x, dim, reverse=..., [reset=...])`` until its kernel
serves it from the repeat route, takes that prepared run, and times the kernel alone
(no Python around it) writing into one output (which stays in cache) and into ``--outputs``
outputs in turn (each write then leaves the cache: the case where a path's prefetch shows),
on one thread, wall clock, medians. The reset mask restarts every 97 steps, as the bench's.
It is how the reversed segmented row tiles' fault was found (docs/performance.md: they
took their groups from the last against their prefetch, 2x from memory).

    PYTHONPATH=. taskset -c 0 python scripts/segmented_from_memory.py [--shape 4096,256]
        [--dim 1] [--ops cumsum,cumprod,logcumsumexp,cummax,cummin] [--outputs 6] [--reps 41]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fscan
from fscan._routing import repeat_drop_ins


def median_us(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e3


def prepared(op, x: torch.Tensor, dim: int, reverse: bool, reset: torch.Tensor | None):
    """The prepared run the repeat route serves this call with (the kernel built first)."""
    seen = []
    segmented, inclusive = repeat_drop_ins.run_segmented_prepared, repeat_drop_ins.run_prepared
    repeat_drop_ins.run_segmented_prepared = lambda run, *a: seen.append(run) or segmented(run, *a)
    repeat_drop_ins.run_prepared = lambda run, *a, **k: seen.append(run) or inclusive(run, *a, **k)
    try:
        with fscan.config.override(cpu_kernel="eager"):
            for _ in range(3):
                op(x, dim, reverse=reverse, **({} if reset is None else {"reset": reset}))
    finally:
        repeat_drop_ins.run_segmented_prepared = segmented
        repeat_drop_ins.run_prepared = inclusive
    if not seen:
        raise SystemExit(f"{op.__name__}: no repeat route served the call (not on the kernel?)")
    return seen[-1]


def cache_and_memory(call, outs: list[list[torch.Tensor]], reps: int) -> tuple[float, float]:
    """Medians of ``call`` into one output, then into ``outs`` in turn."""
    turn = iter(range(10**9))
    one = median_us(lambda: call(outs[0]), reps)
    return one, median_us(lambda: call(outs[next(turn) % len(outs)]), reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4096,256")
    parser.add_argument("--dim", type=int, default=1)
    parser.add_argument("--ops", default="cumsum,cumprod,logcumsumexp")
    parser.add_argument("--outputs", type=int, default=6)
    parser.add_argument("--reps", type=int, default=41)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = tuple(int(v) for v in args.shape.split(","))
    x = torch.rand(shape)
    reset = torch.arange(shape[args.dim]) % 97 == 13
    print(f"{args.shape} dim {args.dim}, 1 thread, us: one output / {args.outputs} in turn")
    for name in args.ops.split(","):
        op = getattr(fscan, name)
        # cummax/cummin write two outputs (values, indices): a set of both each turn.
        like = op(x, args.dim)
        like = tuple(like) if isinstance(like, tuple) else (like,)
        outs = [[torch.empty_like(y) for y in like] for _ in range(args.outputs)]
        for mask in (None, reset):
            for reverse in (False, True):
                run = prepared(op, x, args.dim, reverse, mask)
                flags = () if mask is None else (reset, *run.flag_strides)
                call = lambda ys, run=run, flags=flags: run.kernel(
                    x, *ys, *run.sizes, 1, *run.tail, *flags
                )
                one, many = cache_and_memory(call, outs, args.reps)
                kind = "inclusive" if mask is None else "reset"
                where = "reversed" if reverse else "forward"
                print(f"{name:13} {kind:9} {where:8} {one:8.0f} {many:8.0f}")


if __name__ == "__main__":
    main()
