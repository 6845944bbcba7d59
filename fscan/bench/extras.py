"""Carry-in, reduce and matrix recurrences: ``python -m fscan.bench.extras [--quick]``.

Three tables, float32 on CPU, medians of interleaved runs:

* ``initial=``: the cost of a carry-in on ``fscan.associative_scan`` (folded into
  the first element) against the same scan without one;
* ``fscan.associative_reduce`` against the last output of ``fscan.associative_scan``
  (what one writes without it) and the formulation researchers use today, forward,
  forward+backward and the forward's extra peak memory (a fresh process each);
* ``fscan.linear_recurrence_matrix`` against a sequential loop and against
  ``fscan.associative_scan`` in generic mode over ``(A, B)`` pairs, forward and
  forward+backward.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import sys
from collections.abc import Callable

import torch

import fscan

from ._memprobe import _reset_peak, _status_bytes
from ._timing import Table, engine_of, fmt_ms, interleaved_medians

__all__ = ["initial_table", "matrix_table", "reduce_table"]


def _affine(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


def _log_matmul(x, y):
    return torch.logsumexp(x.unsqueeze(-1) + y.unsqueeze(-3), dim=-2)


def _compose_matrix(x, y):
    return y[0] @ x[0], y[0] @ x[1] + y[1]


def _fwd(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> Callable[[], object]:
    return lambda: fn(*args)


def _fwd_bwd(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> Callable[[], object]:
    leaves = [a.detach().requires_grad_() for a in args]
    return lambda: torch.autograd.grad(fn(*leaves).sum(), leaves)


def _engines(runs: dict[str, Callable[[], object]]) -> str:
    """``column: engine`` for each job, as fscan's route log names it (``torch``: no
    fscan call)."""
    return ", ".join(f"{name}: {engine_of(run)}" for name, run in runs.items())


# ---- initial= -----------------------------------------------------------------------


def initial_table(quick: bool = False) -> Table:
    """``initial=`` against no carry-in, on a linear recurrence in both modes."""
    T, D = (1024, 64) if quick else (4096, 256)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.rand(T, D, generator=gen), torch.randn(T, D, generator=gen)
    init = (torch.rand(D, generator=gen), torch.randn(D, generator=gen))
    table = Table(
        f"initial= on associative_scan, ({T}, {D}) float32, {torch.get_num_threads()} threads "
        "(median; ratio = with / without)",
        ["without", "initial=", "engines"],
    )
    for mode in ("pointwise", "generic"):
        jobs = {
            "without": lambda m=mode: fscan.associative_scan(_affine, (a, b), 0, False, m),
            "initial=": lambda m=mode: fscan.associative_scan(
                _affine, (a, b), 0, False, m, initial=init
            ),
        }
        t = interleaved_medians(jobs, budget_s=1.0 if quick else 2.0)
        cells = [fmt_ms(t["without"]), fmt_ms(t["initial="], t["without"]), _engines(jobs)]
        table.add(f"{mode} forward", cells)
    return table


# ---- associative_reduce ---------------------------------------------------------------


def _reduce_workloads(quick: bool) -> dict[str, tuple[str, dict[str, Callable], tuple]]:
    gen = torch.Generator().manual_seed(0)
    T, D = (1024, 64) if quick else (4096, 256)
    x = torch.randn(T, D, generator=gen)
    B, L, K = (4, 128, 8) if quick else (16, 512, 8)
    steps = torch.randn(B, L, K, K, generator=gen)
    lse = {
        "associative_reduce": lambda x: fscan.associative_reduce(torch.logaddexp, x, 0),
        "associative_scan[-1]": lambda x: fscan.associative_scan(torch.logaddexp, x, 0)[-1],
        "torch.logsumexp": lambda x: torch.logsumexp(x, 0),
    }
    crf = {
        "associative_reduce": lambda s: fscan.associative_reduce(
            _log_matmul, s, 1, combine_mode="generic"
        ),
        "associative_scan[-1]": lambda s: fscan.associative_scan(
            _log_matmul, s, 1, combine_mode="generic"
        )[:, -1],
        "forward algorithm loop": _forward_algorithm,
    }
    return {
        "logaddexp": (f"logaddexp ({T}, {D}) dim 0, pointwise", lse, (x,)),
        "crf": (f"CRF log-semiring ({B}, {L}, {K}, {K}) dim 1, generic", crf, (steps,)),
    }


def _forward_algorithm(steps: torch.Tensor) -> torch.Tensor:
    """The sequential baseline: the total log-semiring product, one step at a time."""
    total = steps[:, 0]
    for t in range(1, steps.shape[1]):
        total = _log_matmul(total, steps[:, t])
    return total


def reduce_table(quick: bool = False) -> Table:
    """Forward, forward+backward and forward peak memory of each reduction."""
    columns = ["associative_reduce", "associative_scan[-1]", "baseline"]
    table = Table(
        f"associative_reduce, float32, {torch.get_num_threads()} threads (median; ratio = time "
        "/ associative_reduce; mem = extra peak RSS of the forward, fresh process)",
        ["pass", *columns, "engines (fwd)"],
    )
    for key, (label, jobs, args) in _reduce_workloads(quick).items():
        names = list(jobs)
        fwds = {n: _fwd(f, *args) for n, f in jobs.items()}
        fwd = interleaved_medians(fwds, budget_s=1.0, rounds=2)
        bwds = {n: _fwd_bwd(f, *args) for n, f in jobs.items()}
        bwd = interleaved_medians(bwds, budget_s=1.0, rounds=2)
        engines = _engines({n: fwds[n] for n in names[:2]})
        for what, times in (("fwd", fwd), ("fwd+bwd", bwd)):
            base = times[names[0]]
            cells = [fmt_ms(times[n], base) for n in names]
            table.add(label, [what, *cells, engines if what == "fwd" else ""])
        mem = [_peak_memory(key, n, quick) for n in names]
        table.add(label, ["mem", *(f"{m / 2**20:.1f} MiB" for m in mem), ""])
    table.columns[-2] = "baseline (logsumexp / loop)"
    return table


def _peak_memory(workload: str, job: str, quick: bool) -> int:
    probe = [sys.executable, "-m", "fscan.bench.extras", "--probe", workload, job]
    probe += ["--quick"] if quick else []
    return int(subprocess.check_output(probe, text=True).split()[0])


def _probe(workload: str, job: str, quick: bool) -> None:
    """Print the extra peak RSS of one forward call, after a warm-up call."""
    _, jobs, args = _reduce_workloads(quick)[workload]
    run = jobs[job]
    run(*(a[..., :8, :, :] if a.ndim == 4 else a[:64] for a in args))  # one-time checks
    gc.collect()
    _reset_peak()
    baseline = _status_bytes("VmRSS")
    out = run(*args)
    del out
    print(_status_bytes("VmHWM") - baseline)


# ---- linear_recurrence_matrix -------------------------------------------------------


def _loop(A: torch.Tensor, b: torch.Tensor, shared: bool) -> torch.Tensor:
    """The sequential baseline over dim 1: ``h_t = A_t @ h_{t-1} + B_t``."""
    h, out = b[:, 0], [b[:, 0]]
    for t in range(1, b.shape[1]):
        h = (A if shared else A[:, t]) @ h + b[:, t]
        out.append(h)
    return torch.stack(out, 1)


def matrix_table(quick: bool = False) -> Table:
    """linear_recurrence_matrix against a loop and a generic-mode associative_scan."""
    gen = torch.Generator().manual_seed(0)
    Bt, T, d, k = (2, 256, 8, 8) if quick else (4, 1024, 16, 16)
    table = Table(
        f"linear_recurrence_matrix, float32, {torch.get_num_threads()} threads "
        "(median; ratio = time / linear_recurrence_matrix)",
        [
            "pass",
            "linear_recurrence_matrix",
            "sequential loop",
            "associative_scan generic",
            "engines",
        ],
    )
    for shared in (True, False):
        for kk in (1, k):
            A = torch.randn(*((d, d) if shared else (Bt, T, d, d)), generator=gen) / d**0.5
            b = torch.randn(Bt, T, d, kk, generator=gen)
            jobs = {
                "fscan": lambda A, b: fscan.linear_recurrence_matrix(A, b, 1, matrix_state=True),
                "loop": lambda A, b, s=shared: _loop(A, b, s),
                "generic": lambda A, b, s=shared: fscan.associative_scan(
                    _compose_matrix,
                    (A.expand(Bt, T, d, d) if s else A, b),
                    1,
                    combine_mode="generic",
                )[1],
            }
            kind = "shared (d, d)" if shared else "per-step"
            label = f"{kind} A, state ({d}, {kk}), B={Bt} T={T}"
            fwds = {n: _fwd(f, A, b) for n, f in jobs.items()}
            fwd = interleaved_medians(fwds, budget_s=1.0, rounds=2)
            bwds = {n: _fwd_bwd(f, A, b) for n, f in jobs.items()}
            bwd = interleaved_medians(bwds, budget_s=1.0, rounds=2)
            engines = _engines({n: fwds[n] for n in ("fscan", "generic")})
            for what, times in (("fwd", fwd), ("fwd+bwd", bwd)):
                cells = [fmt_ms(times[n], times["fscan"]) for n in jobs]
                table.add(label, [what, *cells, engines if what == "fwd" else ""])
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fscan.bench.extras", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller shapes")
    parser.add_argument("--probe", nargs=2, metavar=("WORKLOAD", "JOB"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        _probe(*args.probe, args.quick)
        return
    for table in (initial_table, reduce_table, matrix_table):
        print(table(quick=args.quick).render(), end="\n\n", flush=True)


if __name__ == "__main__":
    main()
