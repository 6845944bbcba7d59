"""The log-space table of ``python -m fscan.bench.linear``: ``fscan.log_linear_recurrence``
against two prefix sums (Heinsen 2023, minGRU's ``parallel_scan_log``) and a float32
loop, accuracy against float64 and time."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import fscan

from ._timing import Table, fmt_ms, fwd_bwd, interleaved_medians

__all__ = ["heinsen", "log_inputs", "log_table"]

LOG_LENGTHS = [512, 4096]
LOG_WIDTH = 256


def heinsen(log_a: torch.Tensor, log_b: torch.Tensor, dim: int) -> torch.Tensor:
    """``log h`` by two prefix sums (Heinsen 2023; minGRU's ``parallel_scan_log``)."""
    a_star = torch.cumsum(log_a, dim)
    return a_star + torch.logcumsumexp(log_b - a_star, dim)


def _log_loop(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """A sequential loop in log space along dim 1."""
    h, out = log_b[:, 0], [log_b[:, 0]]
    for t in range(1, log_b.shape[1]):
        h = torch.logaddexp(log_a[:, t] + h, log_b[:, t])
        out.append(h)
    return torch.stack(out, 1)


def log_inputs(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """minGRU's logs: ``log(1 - z)`` and ``log z + log h~`` for a gate ``z = sigmoid(k)``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, length, LOG_WIDTH, generator=gen)
    log_values = 0.5 * torch.randn(2, length, LOG_WIDTH, generator=gen)
    return -F.softplus(k), -F.softplus(-k) + log_values


def log_table(quick: bool = False, clock: Callable[[], float] = time.perf_counter) -> Table:
    """Accuracy against float64 and time, fscan vs two prefix sums vs a float32 loop."""
    runners = {
        "fscan.log_linear_recurrence": lambda la, lb: fscan.log_linear_recurrence(la, lb, 1),
        "two prefix sums (Heinsen)": lambda la, lb: heinsen(la, lb, 1),
        "float32 loop": _log_loop,
    }
    table = Table(
        f"log h for h_t = a_t h_(t-1) + b_t, (2, L, {LOG_WIDTH}) float32, "
        f"{torch.get_num_threads()} threads: max |log h - float64| (rms) / fwd / fwd+bwd, median",
        list(runners),
    )
    for length in [512] if quick else LOG_LENGTHS:
        la, lb = log_inputs(length)
        exact = fscan.log_linear_recurrence(la.double(), lb.double(), 1)
        ga, gb = la.clone().requires_grad_(), lb.clone().requires_grad_()
        cot = torch.randn_like(la)
        jobs: dict[str, Callable[[], object]] = {}
        for name, runner in runners.items():
            jobs[name + " fwd"] = functools.partial(runner, la, lb)
            if name != "float32 loop":  # its autograd tape is not a contender
                jobs[name] = functools.partial(fwd_bwd, runner, ga, gb, cot)
        times = interleaved_medians(jobs, budget_s=2 if quick else 3, rounds=2, clock=clock)
        cells = []
        for name, runner in runners.items():
            err = (runner(la, lb).double() - exact).abs()
            trained = fmt_ms(times[name]) if name in times else "-"
            cells.append(
                f"{err.max():.1e} ({err.pow(2).mean().sqrt():.1e}) / "
                f"{fmt_ms(times[name + ' fwd'])} / {trained}"
            )
        table.add(f"L={length}", cells)
    return table
