"""``python -m fscan.bench [--quick] [--plot DIR]``: print every benchmark table in one process
run, or with ``--plot DIR`` draw the charts of :mod:`fscan.bench.plot` into ``DIR`` instead."""

from __future__ import annotations

import argparse

import torch

from . import autograd, core, extras, gpu, kernel, linear, ops, overhead
from . import compile as compile_bench
from . import distributed as distributed_bench


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fscan.bench", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="a short subset (used by `python -m fscan`)"
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
    print(core.forward_table(quick=args.quick).render(), flush=True)
    print()
    print(overhead.overhead_table(quick=args.quick).render(), flush=True)
    print()
    print(autograd.autograd_table(quick=args.quick).render(), flush=True)
    print()
    print(ops.ops_table(quick=args.quick).render(), flush=True)
    print()
    print(ops.linear_table(quick=args.quick).render(), flush=True)
    print()
    print(kernel.kernel_table(quick=args.quick).render(), flush=True)
    if not args.quick:
        print()
        print(ops.cumsum_precision().render(), flush=True)
        print()
        print(core.forward_memory(), flush=True)
        print()
        print(linear.training_table().render(), flush=True)
        print()
        print(linear.accuracy_table().render(), flush=True)
        print()
        print(linear.log_table().render(), flush=True)
        print()
        print(kernel.backward_table().render(), flush=True)
        print()
        print(kernel.latency_table().render(), flush=True)
        # Compiling takes tens of seconds per workload: full runs only.
        print()
        print(compile_bench.compile_table().render(), flush=True)
        for table in (extras.initial_table, extras.reduce_table, extras.matrix_table):
            print()
            print(table().render(), flush=True)
        # gloo ranks as processes on this machine: full runs only.
        print()
        print(distributed_bench.distributed_table(), flush=True)
        if torch.cuda.is_available():
            print()
            print(gpu.gpu_table().render(), flush=True)


if __name__ == "__main__":
    main()
