"""cummax/cummin on the C++ kernel alone against torch's op, row by row.

The drop-ins' route table sends forward cummax/cummin rows to torch's op and reversed
ones to the kernel (docs/performance.md, the chain path's tiles); this script times
what that choice rests on: the kernel's scan into warm outputs (``out=``, so no fresh
pages), forward and reversed, beside ``torch.cummax`` into the same outputs, torch's
reversed call (flip, op, flip, indices mapped back) and a copy of the input, on one
thread, by thread CPU time (medians). ``--cold`` evicts the caches before every call (a
copy between two 64 MiB buffers); ``--dtype`` picks the values' dtype. Run it in
alternating processes to compare two trees (``PYTHONPATH`` picks the tree).

    PYTHONPATH=. taskset -c 0 python scripts/extremum_kernel.py [--json PATH] [--reps 31]
        [--cold] [--dtype float32|float64|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial

import torch

import fscan
from fscan._routing.cumulative import _kernel

SHAPES = [((1048576,), 0), ((4096, 256), 1), ((1024, 8, 64), 2), ((16384, 16), 1), ((4096, 256), 0)]


def thread_time_us(fn, reps: int, evict=None) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if evict is not None:
            evict()
        start = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - start)
    return statistics.median(times) / 1e3


def torch_reversed(x: torch.Tensor, dim: int):
    values, indices = torch.cummax(x.flip(dim), dim)
    return values.flip(dim), (x.shape[dim] - 1 - indices).flip(dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--cold", action="store_true", help="evict the caches before each call")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    junk = [torch.empty(16 << 20), torch.empty(16 << 20)]
    evict = partial(junk[1].copy_, junk[0]) if args.cold else None
    torch.set_num_threads(1)
    rows = {}
    with fscan.config.override(cpu_kernel="eager"):
        for shape, dim in SHAPES:
            x = torch.randn(shape).to(dtype)
            out = (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=torch.int64))
            for reverse in (False, True):
                run = partial(_kernel, "extremum_kernel", torch.cummax, x, dim, reverse, out)
                assert run() is not None, "the kernel did not serve"
                label = f"kernel cummax {shape} dim {dim} reverse={reverse}"
                rows[label] = thread_time_us(run, args.reps, evict)
            timed = {
                f"torch.cummax {shape} dim {dim}": partial(torch.cummax, x, dim, out=out),
                f"torch flip, cummax, flip {shape} dim {dim}": partial(torch_reversed, x, dim),
                f"copy {shape}": partial(out[0].copy_, x),
            }
            for label, run in timed.items():
                rows[label] = thread_time_us(run, args.reps, evict)
    for label, us in rows.items():
        print(f"{label:52s} {us:9.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
