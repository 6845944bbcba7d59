"""The C++ kernel's chunk carries against the sequential loop (fscan._engines.cpp._cpp_source).

Where the kernel splits the scan dimension into chunks (few lanes for the threads, or
the 8-way interleave of the chain path), it composes chunk totals: associative up to
the floats' range only. A product of chunk totals that leaves the range and meets a
state the loop carries (``0 * inf``, ``inf * 0``) must give the loop's answer, in the
forward and in the backward (whose chunk carries compose products of Jacobians).
"""

from __future__ import annotations

import functools

import optree
import pytest
import torch
from helpers import parametrize

import fscan
from fscan._engines.cpp.cpu_kernel import kernel_scan

INF = float("inf")
_API = "fscan.associative_scan"
_ONE = optree.tree_structure(0)


@pytest.fixture
def four_threads():
    """Enough threads for the lane path to split time into chunks too (2 cores suffice)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(threads)


def _affine(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


def _lanes(x: torch.Tensor, shape: str) -> torch.Tensor:
    """``x`` (T,) as one lane (the chain path) or 16 equal lanes (the lane path)."""
    return x if shape == "one lane" else x[:, None].repeat(1, 16)


@parametrize(shape=["one lane", "16 lanes"], reverse=[False, True])
def test_products_overflow_then_underflow(four_threads, shape, reverse):
    """cumprod over 1e200 then 1e-200: the loop is inf from the second step on; a
    carry composed from chunk products is inf * 0."""
    f64 = dict(dtype=torch.float64)
    x = torch.cat([torch.full((20000,), 1e200, **f64), torch.full((20000,), 1e-200, **f64)])
    x = _lanes(x.flip(0) if reverse else x, shape)
    with fscan.config.override(cpu_kernel="eager"):  # the kernel itself: the routing
        got = kernel_scan(_API, torch.mul, _ONE, [x], 0, reverse)[0]  # prefers the tree
    want = x.flip(0).cumprod(0).flip(0) if reverse else x.cumprod(0)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-9, atol=0)
    assert not got.isnan().any()


def _affine_inputs(n: int, shape: str, reverse: bool):
    """Gates 0.5 and inputs 1 as ``shape`` (grad leaves), and a cotangent of ones that is
    infinite at the scan's last step."""
    a = _lanes(torch.full((n,), 0.5, dtype=torch.float64), shape).requires_grad_()
    b = _lanes(torch.ones(n, dtype=torch.float64), shape).requires_grad_()
    cot = torch.ones(b.shape, dtype=torch.float64)
    cot[0 if reverse else -1] = INF
    return a, b, cot


@functools.cache
def _torch_engine_grads(n: int, reverse: bool) -> tuple[torch.Tensor, ...]:
    """The torch engine's gradients of one lane of :func:`_affine_inputs` (about 4 CPU-s
    each): the 16 lanes are 16 copies of it (the same elementwise ops, lane by lane), so
    both shapes compare against it."""
    a, b, cot = _affine_inputs(n, "one lane", reverse)
    with fscan.config.override(cpu_kernel="off"):
        h = fscan.associative_scan(_affine, (a, b), 0, reverse=reverse)[1]
        return torch.autograd.grad(h, (a, b), cot)


@parametrize(shape=["one lane", "16 lanes"], reverse=[False, True])
def test_backward_carries_an_infinite_cotangent(four_threads, shape, reverse):
    """The adjoint of the affine pair: gates 0.5, whose chunk products underflow to 0,
    carry an infinite cotangent: inf at every step, as the torch engine (and the loop)."""
    n = 40000
    a, b, cot = _affine_inputs(n, shape, reverse)
    with fscan.config.override(cpu_kernel="eager"):
        for _ in range(2):  # the first call builds
            h = fscan.associative_scan(_affine, (a, b), 0, reverse=reverse)[1]
            grads = torch.autograd.grad(h, (a, b), cot)
    for got, want in zip(grads, _torch_engine_grads(n, reverse)):
        torch.testing.assert_close(got, _lanes(want, shape), equal_nan=True, rtol=1e-9, atol=0)
    assert torch.isinf(grads[1]).all()
