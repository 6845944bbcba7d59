"""``python -m fscan.bench.linear [--quick]``: linear recurrences in training.

Three tables:

* ``fscan.linear_recurrence`` forward and forward+backward on ``(B, L, D, N)``
  selective-scan shapes (Mamba's ``h_t = exp(delta A) h_{t-1} + delta B x``,
  time along dim 1), against autograd through fscan's chunked walk (the
  backward before the custom one) and a hand-written Blelloch scan in
  mamba.py's ``pscan`` style (in place on ``(B, D, L, N)`` views, padded to a
  power of two, its backward the reverse scan of the shifted gates). Time is
  the median of round-robin runs in this process; memory is the extra peak RSS
  of one forward+backward in a fresh process (Linux ``VmHWM``).
* ``acc_dtype=``: the error of bfloat16/float16 inputs against float64, by the
  dtype the walk accumulates in.
* ``fscan.log_linear_recurrence`` against the two-prefix-sum (Heinsen 2023,
  minGRU) formulation and a float32 sequential loop in log space: error
  against float64, forward and forward+backward time.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

import fscan
from fscan._linear import _solve

from ._timing import Table, fmt_ms
from .autograd import interleaved_medians

__all__ = ["BlellochScan", "accuracy_table", "heinsen", "log_table", "training_table"]

SHAPES = [(2, 1024, 64, 16), (1, 4096, 32, 16), (8, 256, 64, 16)]
QUICK_SHAPES = [(2, 256, 16, 16)]
ACC_SHAPE = (4096, 64)
LOG_LENGTHS = [512, 4096]
LOG_WIDTH = 256


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
    return _solve(a, b, 1, None, False, None, fast=False)


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


def _fwd_bwd(runner: Callable, a: torch.Tensor, b: torch.Tensor, cot: torch.Tensor) -> None:
    h = runner(a, b)
    torch.autograd.backward(h, cot)
    a.grad = b.grad = None


def _memory(name: str, shape: tuple[int, ...]) -> int:
    """Extra peak RSS of one forward+backward of ``name``, in a fresh process."""
    probe = [sys.executable, "-m", "fscan.bench.linear", "--probe", name, *map(str, shape)]
    return int(subprocess.check_output(probe, text=True).split()[0])


def _probe(name: str, shape: tuple[int, ...]) -> None:
    from ._memprobe import _measure

    runner = RUNNERS[name]
    small = selective_inputs((1, 64, 2, 2))
    _fwd_bwd(runner, small[0].requires_grad_(), small[1].requires_grad_(), small[2])
    a, b, cot = selective_inputs(shape)
    a.requires_grad_(), b.requires_grad_()
    _measure(lambda: _fwd_bwd(runner, a, b, cot), a.nbytes + b.nbytes)


def training_table(quick: bool = False) -> Table:
    """Forward, forward+backward and peak memory per contender and shape."""
    table = Table(
        f"linear_recurrence on (B, L, D, N) float32, time along dim 1, "
        f"{torch.get_num_threads()} threads: fwd / fwd+bwd median (ratio to fscan) / "
        "fwd+bwd extra peak RSS",
        list(RUNNERS),
    )
    for shape in QUICK_SHAPES if quick else SHAPES:
        a, b, cot = selective_inputs(shape)
        ga, gb = a.clone().requires_grad_(), b.clone().requires_grad_()
        jobs = {}
        for name, runner in RUNNERS.items():
            jobs[name + " fwd"] = lambda runner=runner: runner(a, b)
            jobs[name] = lambda runner=runner: _fwd_bwd(runner, ga, gb, cot)
        times = interleaved_medians(jobs, budget_s=2 if quick else 8)
        base_f, base_fb = times[f"{next(iter(RUNNERS))} fwd"], times[next(iter(RUNNERS))]
        cells = []
        for name in RUNNERS:
            mem = _memory(name, shape) / 2**20
            cells.append(
                f"{fmt_ms(times[name + ' fwd'], base_f)} / {fmt_ms(times[name], base_fb)} "
                f"[{times[name] / times[name + ' fwd']:.2f}x fwd] / {mem:.0f} MiB"
            )
        table.add(str(shape), cells)
    return table


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m fscan.bench.linear", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--probe", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        _probe(args.probe[0], tuple(int(s) for s in args.probe[1:]))
    else:
        print(training_table(quick=args.quick).render(), flush=True)
