"""Overhead benchmark: what the ``combine_fn`` checks cost a scan.

* ``cached hook``: the checks on a second call, i.e. the walk over what
  ``combine_fn`` reaches (its key), the knowledge-entry lookup and
  ``validate_combine_fn`` with the purity verdict cached, timed alone
  over many calls, with a fresh closure each call as inside a training step.
* ``front end``: everything ``associative_scan`` does before the engine on a
  second call (flatten, argument checks, the hook).
* ``first call``: the hook with an empty cache, i.e. including the purity probe
  and the quick associativity check.
* ``validate=True``: the extra time of a scan with the full checks (the hook with
  ``validate=True``: uncached probe plus associativity check), and its ratio to
  the scan.

Bars (issue 5): the cached hook under 5% of a scan over ``(4096, 256)`` and
under 20 us on a length-64 scan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import fscan
from fscan._call import ScanCall
from fscan._checks import check_scan_args
from fscan._knowledge.store import knowledge, reach
from fscan._knowledge.validate import validate_combine_fn
from fscan._pytree import flatten

from ._timing import Table, median_time

__all__ = ["overhead_table"]


def _linrec(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


def _workloads(quick: bool) -> list[tuple[str, Callable[[Any], Callable], Any, str]]:
    """(label, closure factory, xs, combine_mode); the factory makes a fresh closure."""
    w = torch.zeros(())
    add = lambda _: lambda a, b: a + b + w
    linrec = lambda _: lambda x, y: _linrec(x, y)
    matmul = lambda _: lambda a, b: a @ b
    rows = [
        ("add (4096, 256) pointwise", add, torch.randn(4096, 256), "pointwise"),
        ("add (64,) pointwise", add, torch.randn(64), "pointwise"),
    ]
    if not quick:
        rows += [
            ("add (64,) generic", add, torch.randn(64), "generic"),
            (
                "linrec (4096, 256) pointwise",
                linrec,
                (torch.rand(4096, 256), torch.randn(4096, 256)),
                "pointwise",
            ),
            ("matmul (64, 3, 3) generic", matmul, torch.randn(64, 3, 3) / 2, "generic"),
        ]
    return rows


def _per_call(fn: Callable[[], object]) -> float:
    """Median seconds per call of a cheap ``fn`` (torch's Timer times it in blocks of
    calls long enough that the clock's own cost vanishes)."""
    return median_time(fn, budget_s=0.5)


def overhead_table(quick: bool = False) -> Table:
    """Median costs of the checks per workload, against the scan itself."""
    table = Table(
        f"combine_fn checks: cost per scan, {torch.get_num_threads()} threads (median; a fresh "
        "closure each call; hook = the checks with a cached verdict, i.e. a second call)",
        ["scan", "cached hook", "hook / scan", "front end", "first call", "validate=True"],
    )
    for label, make, xs, mode in _workloads(quick):
        table.add(label, _row(make, xs, mode))
    return table


def _row(make: Callable[[Any], Callable], xs: Any, mode: str) -> list[str]:
    leaves, spec = flatten(xs)

    def checks(fn: Callable, tree: Any, flat: list, dim: int, validate: bool | None) -> None:
        entry = knowledge(reach(fn), tree, mode, flat)
        call = ScanCall("bench", fn, xs, tree, flat, dim, False, mode, validate)
        validate_combine_fn(call, entry)

    hook = lambda validate: checks(make(0), spec, leaves, 0, validate)

    def front_end() -> None:
        flat, tree = flatten(xs)
        fn = make(0)
        dim = check_scan_args("bench", fn, xs, flat, 0, False, mode)
        checks(fn, tree, flat, dim, None)

    def first_call() -> None:
        fscan.clear_caches()
        hook(None)

    t_scan = median_time(lambda: fscan.associative_scan(make(0), xs, 0, combine_mode=mode))
    hook(None)
    t_hook = _per_call(lambda: hook(None))
    t_front = _per_call(front_end)
    t_first = median_time(first_call, budget_s=0.5)
    # The extra work of validate=True is exactly the hook with validate=True; timing
    # it alone avoids subtracting two noisy scan times.
    t_validate = median_time(lambda: hook(True), budget_s=1.0)
    return [
        f"{t_scan * 1e3:.3f} ms",
        f"{t_hook * 1e6:.2f} us",
        f"{t_hook / t_scan:.2%}",
        f"{t_front * 1e6:.2f} us",
        f"{t_first * 1e6:.0f} us",
        f"+{t_validate * 1e3:.3f} ms (+{t_validate / t_scan:.0%})",
    ]


if __name__ == "__main__":
    print(overhead_table().render())
