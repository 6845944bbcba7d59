"""``python -m fscan.bench.linear [--quick]``: linear recurrences in training.

Four tables:

* ``fscan.linear_recurrence`` forward and forward+backward on ``(B, L, D, N)``
  selective-scan shapes (Mamba's ``h_t = exp(delta A) h_{t-1} + delta B x``,
  time along dim 1), against autograd through fscan's chunked walk (the
  backward before the custom one) and a hand-written Blelloch scan in
  mamba.py's ``pscan`` style (in place on ``(B, D, L, N)`` views, padded to a
  power of two, its backward the reverse scan of the shifted gates). Time is
  the median of round-robin runs in this process; memory is the extra peak RSS
  of one forward+backward in a fresh process (Linux ``VmHWM``).
* issue 11's bar for the backward: forward and forward+backward over ``(T, 256)``
  against a copy of the leaves ``a``, ``b`` into preallocated memory.
* ``acc_dtype=``: the error of bfloat16/float16 inputs against float64, by the
  dtype the walk accumulates in.
* ``fscan.log_linear_recurrence`` against the two-prefix-sum (Heinsen 2023,
  minGRU) formulation and a float32 sequential loop in log space: error
  against float64, forward and forward+backward time.
"""

from __future__ import annotations

import argparse
import functools
import math
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import fscan
from fscan._engines.chunked import Operands
from fscan._recurrences import solve as _linear_solve
from fscan._recurrences.solve import LINEAR
from fscan._routing import recurrence as _router
from fscan._routing.recurrence import solve

from ._timing import Table, fmt_ms, fwd_bwd, interleaved_medians
from .log_space import log_table

__all__ = [
    "BlellochScan",
    "accuracy_table",
    "copy_table",
    "engines_of",
    "main",
    "training_table",
]

SHAPES = [(2, 1024, 64, 16), (1, 4096, 32, 16), (8, 256, 64, 16)]
QUICK_SHAPES = [(2, 256, 16, 16)]
ACC_SHAPE = (4096, 64)


# ---- the hand-written Blelloch scan (mamba.py's pscan style) --------------------


def _pad_pow2(x: torch.Tensor) -> torch.Tensor:
    """``x`` (B, L, D, N) zero-padded along L to the next power of two (a new tensor)."""
    length = x.size(1)
    return F.pad(x, (0, 0, 0, 0, 0, 2 ** math.ceil(math.log2(length)) - length))


def _sweep(A: torch.Tensor, X: torch.Tensor) -> None:
    """In place over (B, D, L, N) views, L a power of two: ``X_t <- A_t X_{t-1} + X_t``."""
    B, D, L, _ = A.shape
    levels = int(math.log2(L))
    Aa, Xa = A, X
    for _ in range(levels):  # up-sweep: the right node of each pair absorbs the left
        T = Xa.size(2)
        Aa, Xa = Aa.view(B, D, T // 2, 2, -1), Xa.view(B, D, T // 2, 2, -1)
        Xa[:, :, :, 1].add_(Aa[:, :, :, 1].mul(Xa[:, :, :, 0]))
        Aa[:, :, :, 1].mul_(Aa[:, :, :, 0])
        Aa, Xa = Aa[:, :, :, 1], Xa[:, :, :, 1]
    for k in range(levels - 2, -1, -1):  # down-sweep: carry prefixes into left nodes
        Aa, Xa = A[:, :, 2**k - 1 : L : 2**k], X[:, :, 2**k - 1 : L : 2**k]
        T = Xa.size(2)
        Aa, Xa = Aa.view(B, D, T // 2, 2, -1), Xa.view(B, D, T // 2, 2, -1)
        Xa[:, :, 1:, 0].add_(Aa[:, :, 1:, 0].mul(Xa[:, :, :-1, 1]))
        Aa[:, :, 1:, 0].mul_(Aa[:, :, :-1, 1])


def _sweep_reverse(A: torch.Tensor, X: torch.Tensor) -> None:
    """:func:`_sweep` from the end: ``X_t <- A_t X_{t+1} + X_t``."""
    B, D, L, _ = A.shape
    levels = int(math.log2(L))
    Aa, Xa = A, X
    for _ in range(levels):
        T = Xa.size(2)
        Aa, Xa = Aa.view(B, D, T // 2, 2, -1), Xa.view(B, D, T // 2, 2, -1)
        Xa[:, :, :, 0].add_(Aa[:, :, :, 0].mul(Xa[:, :, :, 1]))
        Aa[:, :, :, 0].mul_(Aa[:, :, :, 1])
        Aa, Xa = Aa[:, :, :, 0], Xa[:, :, :, 0]
    for k in range(levels - 2, -1, -1):
        Aa, Xa = A[:, :, 0 : L : 2**k], X[:, :, 0 : L : 2**k]
        T = Xa.size(2)
        Aa, Xa = Aa.view(B, D, T // 2, 2, -1), Xa.view(B, D, T // 2, 2, -1)
        Xa[:, :, :-1, 1].add_(Aa[:, :, :-1, 1].mul(Xa[:, :, 1:, 0]))
        Aa[:, :, :-1, 1].mul_(Aa[:, :, 1:, 0])


class BlellochScan(torch.autograd.Function):
    """``H_t = A_t H_{t-1} + X_t`` over (B, L, D, N), ``H_{-1} = 0``, as mamba.py's pscan:
    clone (or pad), scan in place on the ``(B, D, L, N)`` view; the backward scans
    the gradient in reverse with the gates shifted by one and multiplies by the
    shifted states."""

    @staticmethod
    def forward(ctx, A_in, X_in):  # type: ignore[override]
        length = X_in.size(1)
        A, X = _pad_pow2(A_in), _pad_pow2(X_in)
        _sweep(A.transpose(2, 1), X.transpose(2, 1))
        ctx.save_for_backward(A_in, X)
        return X[:, :length]

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        A_in, X = ctx.saved_tensors
        length = grad_out.size(1)
        grad = _pad_pow2(grad_out).transpose(2, 1)
        A = _pad_pow2(A_in).transpose(2, 1)
        A = F.pad(A[:, :, 1:], (0, 0, 0, 1))  # A_{t+1}, zero past the end
        _sweep_reverse(A, grad)
        Xt = X.transpose(2, 1)
        Q = torch.zeros_like(Xt)
        Q[:, :, 1:].add_(Xt[:, :, :-1] * grad[:, :, 1:])
        return Q.transpose(2, 1)[:, :length], grad.transpose(2, 1)[:, :length]


# ---- contenders on (B, L, D, N) ------------------------------------------------


def _walk_autograd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fscan's chunked walk differentiated by autograd (the path before the custom backward)."""
    return solve(LINEAR, Operands(a, b, 1, None, False, None), fast=False)


RUNNERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "fscan.linear_recurrence": lambda a, b: fscan.linear_recurrence(a, b, 1),
    "autograd through walk": _walk_autograd,
    "Blelloch pscan": BlellochScan.apply,
}


def selective_inputs(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Mamba-like gates ``exp(delta A)`` in (0, 1), inputs, and a cotangent."""
    gen = torch.Generator().manual_seed(seed)
    delta = F.softplus(torch.randn(shape, generator=gen) - 2)
    A = -torch.rand(shape[2:], generator=gen) * 4 - 0.5
    a = torch.exp(delta * A)
    b = delta * torch.randn(shape, generator=gen)
    return a, b, torch.randn(shape, generator=gen)


def _memory(name: str, shape: tuple[int, ...]) -> int:
    """Extra peak RSS of one forward+backward of ``name``, in a fresh process."""
    probe = [sys.executable, "-m", "fscan.bench.linear", "--probe", name, *map(str, shape)]
    return int(subprocess.check_output(probe, text=True).split()[0])


def _probe(name: str, shape: tuple[int, ...]) -> None:
    from ._memprobe import _measure

    runner = RUNNERS[name]
    small = selective_inputs((1, 64, 2, 2))
    fwd_bwd(runner, small[0].requires_grad_(), small[1].requires_grad_(), small[2])
    a, b, cot = selective_inputs(shape)
    a.requires_grad_(), b.requires_grad_()
    _measure(lambda: fwd_bwd(runner, a, b, cot), a.nbytes + b.nbytes)


def engines_of(job: Callable[[], object]) -> str:
    """Run ``job`` once with fscan's kernels built first (``cpu_kernel="eager"``, as a
    service's warm-up would) and name the engines its recurrences ran on, in order:
    ``cpp`` (the compiled kernel), ``blocked`` (the chunked walk in torch ops), ``tree``
    (the tree scan); ``tree`` also where fscan solved none (docs/routes.md names them)."""
    ran: list[str] = []

    def spy(name: str, original: Callable) -> Callable:
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = original(*args, **kwargs)
            if out is not None:
                ran.append(name)
            return out

        return call

    # Each engine spied on where the router looks it up: the kernel and the walk in its
    # module, the tree in the recurrence it is handed.
    originals = {(_router, "kernel_solve"): "cpp", (_router, "chunked_solve"): "blocked"}
    saved = {key: getattr(*key) for key in originals}
    linear = _linear_solve.LINEAR
    try:
        for (module, attr), name in originals.items():
            setattr(module, attr, spy(name, saved[module, attr]))
        _linear_solve.LINEAR = linear._replace(tree=spy("tree", linear.tree))
        with fscan.config.override(cpu_kernel="eager"):
            job()
    finally:
        for (module, attr), original in saved.items():
            setattr(module, attr, original)
        _linear_solve.LINEAR = linear
    return ", ".join(dict.fromkeys(ran)) or "tree"


def training_table(quick: bool = False, clock: Callable[[], float] = time.perf_counter) -> Table:
    """Forward, forward+backward and peak memory per contender and shape."""
    table = Table(
        f"linear_recurrence on (B, L, D, N) float32, time along dim 1, "
        f"{torch.get_num_threads()} threads: fwd / fwd+bwd, median (ratio to fscan) "
        "[fwd+bwd / fwd] / extra peak RSS of fwd+bwd",
        list(RUNNERS),
    )
    for shape in QUICK_SHAPES if quick else SHAPES:
        a, b, cot = selective_inputs(shape)
        ga, gb = a.clone().requires_grad_(), b.clone().requires_grad_()
        jobs: dict[str, Callable[[], object]] = {}
        for name, runner in RUNNERS.items():
            jobs[name + " fwd"] = functools.partial(runner, a, b)
            jobs[name] = functools.partial(fwd_bwd, runner, ga, gb, cot)
        engines = {name: engines_of(job) for name, job in jobs.items()}  # kernels built here
        times = interleaved_medians(jobs, budget_s=2 if quick else 4, rounds=2, clock=clock)
        first = next(iter(RUNNERS))
        cells = []
        for name in RUNNERS:
            mem = _memory(name, shape) / 2**20
            cells.append(
                f"{fmt_ms(times[name + ' fwd'], times[first + ' fwd'])} / "
                f"{fmt_ms(times[name], times[first])} "
                f"[{times[name] / times[name + ' fwd']:.2f}x] / {mem:.0f} MiB"
            )
        table.add(str(shape), cells)
        table.add(
            "  engines: fwd / fwd+bwd",
            [f"{engines[name + ' fwd']} / {engines[name]}" for name in RUNNERS],
        )
    return table


# ---- against a copy ------------------------------------------------------------------

COPY_LENGTHS = [4096, 16384]
COPY_WIDTH = 256


def copy_table(quick: bool = False, clock: Callable[[], float] = time.perf_counter) -> Table:
    """Issue 11's bar for the backward: ``fscan.linear_recurrence`` over ``(T, 256)``
    float32, forward (inputs requiring grad) and forward+backward (``autograd.grad`` of
    ``a`` and ``b``), against a copy of both leaves into preallocated memory (one read and
    one write of each: the memory-bound floor). Round-robin medians in this process."""
    table = Table(
        f"linear_recurrence on (T, {COPY_WIDTH}) float32, dim 0, {torch.get_num_threads()} "
        "threads: against a copy of the leaves a, b (medians of turns)",
        ["copy ms", "fwd ms", "fwd+bwd ms", "fwd+bwd / fwd", "fwd+bwd / copy", "engines"],
    )
    for length in [256] if quick else COPY_LENGTHS:
        table.add(f"({length}, {COPY_WIDTH})", _copy_row(length, 2 if quick else 10, clock))
    return table


def _copy_row(length: int, budget_s: float, clock: Callable[[], float]) -> list[str]:
    gen = torch.Generator().manual_seed(0)
    a = (torch.rand(length, COPY_WIDTH, generator=gen) * 0.5 + 0.5).requires_grad_()
    b = torch.randn(length, COPY_WIDTH, generator=gen).requires_grad_()
    cot = torch.randn(length, COPY_WIDTH, generator=gen)
    into = (torch.empty_like(a), torch.empty_like(b))

    def copy() -> None:
        into[0].copy_(a.detach())
        into[1].copy_(b.detach())

    def both() -> None:
        torch.autograd.grad(fscan.linear_recurrence(a, b, 0), (a, b), cot)

    jobs = {"copy": copy, "fwd": lambda: fscan.linear_recurrence(a, b, 0), "both": both}
    engines = engines_of(both)  # the kernels built here, before timing
    t = interleaved_medians(jobs, budget_s=budget_s, clock=clock)
    return [
        *(fmt_ms(t[k]).removesuffix(" ms") for k in ("copy", "fwd", "both")),
        f"{t['both'] / t['fwd']:.2f}",
        f"{t['both'] / t['copy']:.2f}",
        engines,
    ]


# ---- acc_dtype -------------------------------------------------------------------


def _sequential(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The float64 reference along dim 0, one step at a time."""
    h, out = torch.zeros_like(b[0]), []
    for t in range(b.shape[0]):
        h = a[t] * h + b[t]
        out.append(h)
    return torch.stack(out)


def _relative_error(h: torch.Tensor, exact: torch.Tensor) -> str:
    err = (h.double() - exact).abs()
    rms = lambda x: x.pow(2).mean().sqrt()
    return f"{err.max() / exact.abs().max():.1e} ({rms(err) / rms(exact):.1e})"


def accuracy_table(quick: bool = False) -> Table:
    """Error of low-precision inputs against float64, by accumulation dtype."""
    length, width = (512, 64) if quick else ACC_SHAPE
    gen = torch.Generator().manual_seed(0)
    # Slow gates (a near 1) accumulate the most: the regime of long-memory SSMs.
    a = 1 - torch.rand(length, width, generator=gen, dtype=torch.float64) * 0.05
    b = torch.randn(length, width, generator=gen, dtype=torch.float64)
    choices = {"acc_dtype=None": None, "float32": torch.float32, "float64": torch.float64}
    table = Table(
        f"linear_recurrence ({length}, {width}), gates in [0.95, 1]: error vs float64 of "
        "inputs rounded to the dtype, max |err| / max |h| (rms |err| / rms |h|); "
        "'output rounding' = the float64 result rounded once",
        [*choices, "output rounding"],
    )
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        a_low, b_low = a.to(dtype), b.to(dtype)
        exact = _sequential(a_low.double(), b_low.double())
        outs = [fscan.linear_recurrence(a_low, b_low, 0, acc_dtype=acc) for acc in choices.values()]
        cells = [_relative_error(h, exact) for h in [*outs, exact.to(dtype)]]
        table.add(str(dtype).removeprefix("torch."), cells)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fscan.bench.linear", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time instead of wall time (a loaded machine)",
    )
    parser.add_argument("--probe", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        _probe(args.probe[0], tuple(int(s) for s in args.probe[1:]))
        return
    clock = time.process_time if args.cpu_time else time.perf_counter
    print(training_table(args.quick, clock).render(), end="\n\n", flush=True)
    print(copy_table(args.quick, clock).render(), end="\n\n", flush=True)
    print(accuracy_table(args.quick).render(), end="\n\n", flush=True)
    print(log_table(args.quick, clock).render(), flush=True)


if __name__ == "__main__":
    main()
