"""Timing, memory and table helpers shared by every benchmark section."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Table", "median_time", "optional_jax"]


def median_time(fn: Callable[[], object], *, reps: int = 15, budget_s: float = 2.0) -> float:
    """Median wall time of ``fn()`` in seconds, after one warm-up call.

    Stops early once ``budget_s`` is spent (at least one timed run), so slow
    baselines such as a Python loop over a million steps stay affordable.
    """
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < reps and (not times or spent < budget_s):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        spent += times[-1]
    return statistics.median(times)


def optional_jax():
    """``(jax, jax.numpy)`` configured for float32 CPU runs, or ``None`` if not installed."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        return None
    return jax, jnp


@dataclass
class Table:
    """A plain-text table: one row per workload, one column per contender."""

    title: str
    columns: list[str]
    rows: list[tuple[str, list[str]]] = field(default_factory=list)

    def add(self, label: str, cells: list[str]) -> None:
        self.rows.append((label, cells))

    def render(self) -> str:
        header = ["workload", *self.columns]
        body = [[label, *cells] for label, cells in self.rows]
        widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
        line = lambda r: "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        )
        rule = "-" * len(line(header))
        return "\n".join([self.title, rule, line(header), rule, *map(line, body), rule])


def fmt_ms(seconds: float | None, reference: float | None = None) -> str:
    """``1.234 ms`` and, against a reference time, the ratio ``(0.50x)``."""
    if seconds is None:
        return "n/a"
    text = f"{seconds * 1e3:.3f} ms"
    if reference:
        text += f" ({seconds / reference:.2f}x)"
    return text
