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
    quick = args.quick
    tables = [
        lambda: core.forward_table(quick=quick).render(),
        lambda: overhead.overhead_table(quick=quick).render(),
        lambda: autograd.autograd_table(quick=quick).render(),
        lambda: ops.ops_table(quick=quick).render(),
        lambda: ops.linear_table(quick=quick).render(),
        lambda: kernel.kernel_table(quick=quick).render(),
    ]
    if not quick:
        tables += [
            lambda: ops.cumsum_precision().render(),
            core.forward_memory,
            *(lambda t=table: t().render() for table in _FULL_ONLY),
            # gloo ranks as processes on this machine: full runs only.
            distributed_bench.distributed_table,
        ]
        if torch.cuda.is_available():
            tables.append(lambda: gpu.gpu_table().render())
    for i, table in enumerate(tables):
        if i:
            print()
        print(table(), flush=True)


# Tables of full runs only (compiling takes tens of seconds per workload), in print order.
_FULL_ONLY = (
    linear.training_table,
    linear.accuracy_table,
    linear.log_table,
    kernel.backward_table,
    kernel.latency_table,
    compile_bench.compile_table,
    extras.initial_table,
    extras.reduce_table,
    extras.matrix_table,
)

if __name__ == "__main__":
    main()
