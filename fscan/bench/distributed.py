"""``python -m fscan.bench.distributed [--quick] [--world-sizes 1 2 4]``: sequence-parallel
scans on gloo (CPU), each rank one process with one thread.

For each world size ``W``, every rank holds ``T`` steps x 256 channels (float32)
of a ``W T``-long sequence and runs ``fscan.distributed``; the table gives the
median wall time per call of the slowest rank (the call ends when it does),
forward and forward + backward, next to one process scanning the whole ``W T``
sequence with one thread, and the same rank's plain local scan of its piece
(what the distributed call adds: the exchange and the fix-up). Bytes are what
one rank sends and receives per forward call (the backward moves as much
again): one element per rank, the same for every ``T``, as the last table shows.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.benchmark import Measurement, Timer

import fscan

from ._timing import Table, time_once

__all__ = ["distributed_table", "main"]

CHANNELS = 256
REPS = 5


def _pair(x: tuple, y: tuple) -> tuple:
    return x[0] * y[0], y[0] * x[1] + y[1]


def _workloads(t: int, world: int) -> dict[str, tuple[Callable, Callable, Callable, list]]:
    """name -> (distributed call, local call, whole-sequence call, inputs factory)."""
    import fscan.distributed as fd

    return {
        "add": (
            lambda x: fd.associative_scan(torch.add, x[0], 0),
            lambda x: fscan.associative_scan(torch.add, x[0], 0),
            lambda x: fscan.associative_scan(torch.add, x[0], 0),
            [lambda n: torch.randn(n, CHANNELS)],
        ),
        "linear-recurrence pair": (
            lambda x: fd.associative_scan(_pair, (x[0], x[1]), 0)[1],
            lambda x: fscan.associative_scan(_pair, (x[0], x[1]), 0)[1],
            lambda x: fscan.associative_scan(_pair, (x[0], x[1]), 0)[1],
            [lambda n: torch.rand(n, CHANNELS), lambda n: torch.randn(n, CHANNELS)],
        ),
        "linear_recurrence": (
            lambda x: fd.linear_recurrence(x[0], x[1], 0),
            lambda x: fscan.linear_recurrence(x[0], x[1], 0),
            lambda x: fscan.linear_recurrence(x[0], x[1], 0),
            [lambda n: torch.rand(n, CHANNELS), lambda n: torch.randn(n, CHANNELS)],
        ),
    }


def _timed(fn: Callable[[], Any], sync: bool) -> float:
    """Median wall seconds of ``fn()`` after one warm-up; ranks start every call together
    (a barrier before each ``Timer.timeit(1)``: a block of calls would let them drift)."""
    fn()
    timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    parts = []
    for _ in range(REPS):
        if sync:
            dist.barrier()
        parts.append(time_once(timer))
    return Measurement.merge(parts)[0].median


def _fwd_bwd(call: Callable, inputs: list[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        xs = [x.detach().requires_grad_() for x in inputs]
        call(xs).sum().backward()

    return run


def _rank_main(rank: int, world: int, port: int, t: int, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        from fscan._sharded.exchange import exchange

        out = {}
        torch.manual_seed(rank)
        for name, (dcall, lcall, _, makers) in _workloads(t, world).items():
            inputs = [make(t) for make in makers]
            out[name] = {
                "fwd": _timed(lambda d=dcall, x=inputs: d(x), True),
                "fwd+bwd": _timed(_fwd_bwd(dcall, inputs), True),
                "local fwd": _timed(lambda c=lcall, x=inputs: c(x), False),
                "local fwd+bwd": _timed(_fwd_bwd(lcall, inputs), False),
            }
        total = [torch.randn(CHANNELS)]
        out["exchange"] = _timed(lambda: exchange(total, dist.group.WORLD), True)
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def _run_ranks(world: int, t: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, t, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in range(world))
    for p in procs:
        p.join(timeout=60)
    return [results[r] for r in range(world)]


def _single(t_total: int) -> dict[str, dict[str, float]]:
    """One process, one thread, the whole sequence."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, (_, _, whole, makers) in _workloads(t_total, 1).items():
            inputs = [make(t_total) for make in makers]
            out[name] = {
                "fwd": _timed(lambda w=whole, x=inputs: w(x), False),
                "fwd+bwd": _timed(_fwd_bwd(whole, inputs), False),
            }
        return out
    finally:
        torch.set_num_threads(threads)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def distributed_table(quick: bool = False, world_sizes: tuple[int, ...] = (1, 2, 4)) -> str:
    """The timing table and the bytes table, rendered."""
    from fscan._sharded.exchange import exchange_bytes

    t = 2**12 if quick else 2**16
    timing = Table(
        f"fscan.distributed on gloo (CPU): T = {t} per rank x {CHANNELS} channels, float32, "
        f"1 thread per rank, {os.cpu_count()} cores; median of {REPS}, slowest rank",
        ["W", "distributed", "its local scan", "one process, W T", "ratio", "exchange"],
    )
    for world in world_sizes:
        ranks = _run_ranks(world, t)
        single = _single(world * t)
        for name in ranks[0]:
            if name == "exchange":
                continue
            for mode in ("fwd", "fwd+bwd"):
                call = max(r[name][mode] for r in ranks)
                local = max(r[name][f"local {mode}"] for r in ranks)
                whole = single[name][mode]
                exch = max(r["exchange"] for r in ranks)
                timing.add(
                    f"{name}, {mode}",
                    [
                        str(world),
                        _ms(call),
                        _ms(local),
                        _ms(whole),
                        f"{call / whole:.2f}x",
                        f"{exch * 1e3:.2f} ms",
                    ],
                )
    sizes = Table(
        "bytes one rank sends / receives per forward call (backward: the same again)",
        ["W", "T = 2^10", f"T = {t}", "T = 2^20", "one leaf of the piece"],
    )
    for world in world_sizes:
        for name, leaves in (("add", 1), ("pair", 2)):
            cells = []
            for n in (2**10, t, 2**20):
                xs = tuple(torch.empty(n, CHANNELS, device="meta") for _ in range(leaves))
                got = exchange_bytes(xs, 0, world)
                cells.append(f"{got['send']} / {got['recv']}")
            timing_cell = f"{t * CHANNELS * 4} B"
            sizes.add(f"{name}", [str(world), *cells, timing_cell])
    return timing.render() + "\n\n" + sizes.render()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fscan.bench.distributed", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="T = 2^12 instead of 2^16")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args(argv)
    print(distributed_table(args.quick, tuple(args.world_sizes)), flush=True)


if __name__ == "__main__":
    main()
