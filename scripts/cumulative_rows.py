"""A drop-in (``--op``: cummax by default, cummin, cumsum, cumprod) over several contiguous
lanes (the innermost dim), end to end: the kernel against torch's op, the cells of the
drop-ins' route table that rest on it.

For each dtype, size and row length, both directions, this times ``fscan.<op>(x, 1,
reverse=...)`` with the table's cell for these rows forced to the kernel, then forced to
torch's op (forward: ``torch.<op>``; reversed: flip, op, flip), fresh outputs each call
as a user gets them, on one thread by thread CPU time (medians), and prints the ratio
beside the engine the table picks now (``fscan._routing.cumulative_table.route``). The
kernel is built before anything is timed. Reversed times of torch's op swing 2-10x with
whether its flipped copies fault fresh pages: read them over several sizes.

    PYTHONPATH=. taskset -c 0 python scripts/cumulative_rows.py [--op cumsum]
        [--dtypes float32,int64] [--numels 32768,131072,1048576] [--lengths 8,16,64,128,256]
        [--reps 21] [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import torch
from extremum_kernel import thread_time_us  # this script's folder: the same timer

import fscan
from fscan._routing import cumulative_table


def timed(op: str, x: torch.Tensor, reverse: bool, kernel: bool, reps: int) -> float:
    """fscan.<op> with the table's several-lanes cell set to ``kernel``."""
    rows = cumulative_table._rows
    cumulative_table._rows = lambda *_: kernel
    drop_in = getattr(fscan, op)
    try:
        return thread_time_us(lambda: drop_in(x, 1, reverse=reverse), reps)
    finally:
        cumulative_table._rows = rows


def sample(op: str, dtype: torch.dtype, numel: int, n: int) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(numel // n, n) < 0.3
    if op == "cumprod":  # products that stay finite along the row
        return torch.exp(torch.randn(numel // n, n) * 0.01).to(dtype)
    return (torch.randn(numel // n, n) * 100).to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", default="cummax", choices=["cummax", "cummin", "cumsum", "cumprod"])
    parser.add_argument("--dtypes", default="float32,float64,bfloat16,int64")
    parser.add_argument("--numels", default="32768,131072,1048576")
    parser.add_argument("--lengths", default="8,16,32,64,96,128,256,1024")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {}
    with fscan.config.override(cpu_kernel="eager"):
        for dtype in [getattr(torch, name) for name in args.dtypes.split(",")]:
            for numel in [int(v) for v in args.numels.split(",")]:
                for n in [int(v) for v in args.lengths.split(",")]:
                    x = sample(args.op, dtype, numel, n)
                    for reverse in (False, True):
                        picked = (
                            "cpp"
                            if cumulative_table.route(getattr(torch, args.op), x, 1, reverse)[0]
                            else "torch"
                        )
                        kernel = timed(args.op, x, reverse, True, args.reps)
                        native = timed(args.op, x, reverse, False, args.reps)
                        way = "reversed" if reverse else "forward"
                        label = f"{str(dtype)[6:]:8s} {tuple(x.shape)!s:14s} {way:8s}"
                        rows[label] = {"kernel_us": kernel, "torch_us": native, "table": picked}
                        print(
                            f"{label}  kernel {kernel:9.1f} us  torch {native:9.1f} us  "
                            f"kernel/torch {kernel / native:5.2f}  table: {picked}",
                            flush=True,
                        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
