"""Per-call cost of ``fscan.swap_cumulative_ops()``.

For ``torch.cumsum`` on a (64,) and a (4096, 256) tensor, the time per call of:
torch's op alone and under an empty pass-through mode (what torch's mode machinery
costs any mode); ``fscan.cumsum`` called directly; ``torch.cumsum`` under the swap
(which runs ``fscan.cumsum``); and ``torch.add``, which the swap passes through,
with and without it. The swap's own cost is the "swapped" row minus the
``fscan.cumsum`` row; what a model pays in all is that row minus torch's. fscan's C++
kernel is off, so the rows compare the swap, not the kernel's compile state; torch
runs on one thread.

Run: PYTHONPATH=. python scripts/swap_overhead.py
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import benchmark

import fscan


class PassThrough(TorchFunctionMode):
    """The cheapest mode: what torch's mode machinery itself costs a call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def median_us(stmt: str, x: torch.Tensor, mode: TorchFunctionMode | None) -> float:
    timer = benchmark.Timer(stmt=stmt, globals={"torch": torch, "fscan": fscan, "x": x})
    # The mode is active while the timer runs its loop (it starts no thread of its own).
    with mode if mode is not None else contextlib.nullcontext():
        return timer.blocked_autorange(min_run_time=0.1).median * 1e6


def main(rounds: int = 11) -> None:
    # One thread: the large rows then measure the op, not how a busy machine schedules
    # two threads that wait for each other.
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; us per call:")
    print("the lowest of the rounds' medians (other processes only slow a round down)")
    print(f"{'shape, dim':>16} {'row':>26} {'us':>9}")
    with fscan.config.override(cpu_kernel="off"):
        for shape, dim in (((64,), 0), ((4096, 256), -1), ((4096, 256), 0)):
            x = torch.randn(shape)
            swap = fscan.swap_cumulative_ops()
            rows = [
                ("torch.cumsum", f"torch.cumsum(x, {dim})", None),
                ("torch.cumsum, empty mode", f"torch.cumsum(x, {dim})", PassThrough()),
                ("fscan.cumsum", f"fscan.cumsum(x, {dim})", None),
                ("torch.cumsum, swapped", f"torch.cumsum(x, {dim})", swap),
                ("torch.add", "torch.add(x, 1)", None),
                ("torch.add, swapped", "torch.add(x, 1)", swap),
            ]
            # Rounds interleave the rows, so a busy spell slows every row alike.
            best = [
                min(times)
                for times in zip(*[[median_us(s, x, m) for _, s, m in rows] for _ in range(rounds)])
            ]
            for (label, _, _), us in zip(rows, best):
                print(f"{str(shape) + ', ' + str(dim):>16} {label:>26} {us:9.2f}")


if __name__ == "__main__":
    main()
