"""How much one process's timings of the same call move over time, row by row.

A bench row is one process's sample. On a shared machine some rows move 2x between
rounds while others stay put (docs/performance.md, "On an AVX-512 CPU"); this script
tells the two apart: every row is timed in turns, ``--rounds`` times, in one process,
on the same tensors (the same memory every call), and each row prints its times in
order with min, median and max/min. A row whose times switch between levels while
``torch.cumsum`` and the copy stay flat is moved by something outside the call (not
its memory, which does not change): compare such rows in alternating processes, not
from one round. ``--cold`` evicts the caches before every call (a copy between two
64 MiB buffers; a ``fill_`` evicted nothing on the machine this was written on), which
gives the data-from-memory level every time.

    PYTHONPATH=. taskset -c 0 python scripts/spread.py [--rounds 24] [--shape 4096,256] [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fscan


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--shape", default="4096,256")
    parser.add_argument("--cold", action="store_true", help="evict the caches before each call")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    fscan.config.cpu_kernel = "eager"  # the kernels built before the first timing
    shape = tuple(int(s) for s in args.shape.split(","))
    last = len(shape) - 1
    x = torch.randn(shape)
    y = torch.empty_like(x)
    rows = {
        f"add dim {last} (chain tiles)": lambda: fscan.associative_scan(torch.add, x, last),
        f"max dim {last} (prefix chains)": lambda: fscan.associative_scan(torch.maximum, x, last),
        "add dim 0 (lanes)": lambda: fscan.associative_scan(torch.add, x, 0),
        f"torch.cumsum dim {last}": lambda: torch.cumsum(x, last),
        "copy": lambda: y.copy_(x),
    }
    for run in rows.values():  # built, loaded and warm
        for _ in range(3):
            run()
    junk = [torch.empty(16 << 20), torch.empty(16 << 20)] if args.cold else []
    series: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, run in rows.items():
            times = []
            for _ in range(7):
                if junk:
                    junk[1].copy_(junk[0])
                start = time.thread_time()
                run()
                times.append(time.thread_time() - start)
            series[name].append(statistics.median(times) * 1e6)
    cold = ", caches evicted before each call" if args.cold else ""
    print(
        f"{shape}, 1 thread, thread CPU time (us){cold}, medians of 7 calls a turn, in turn order"
    )
    for name, times in series.items():
        low, high = min(times), max(times)
        print(
            f"{name:28s} min {low:7.0f}  median {statistics.median(times):7.0f}  "
            f"max/min {high / low:4.2f} | " + " ".join(f"{t:.0f}" for t in times)
        )


if __name__ == "__main__":
    main()
