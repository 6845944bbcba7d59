"""Negative-bit views (``z.conj().imag``: a real tensor whose values are the negation of
its memory) through every route, the generated C++ kernel included, which reads memory
through data pointers: the kernel must not serve them as they lie in memory."""

from __future__ import annotations

import pytest
import torch

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem

needs_compiler = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)

F64 = torch.float64


def _neg_view(*shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    complex_dtype = torch.complex128 if dtype == F64 else torch.complex64
    view = torch.randn(*shape, dtype=complex_dtype).conj().imag
    assert view.is_neg()
    return view


def _add(x, y):
    return x + y


def _loop(x: torch.Tensor, reverse: bool, gate: float = 1.0) -> torch.Tensor:
    """``out[i] = gate * out[i-1] + x[i]`` along dim 0, one step at a time, in float64."""
    x = x.resolve_neg().double()
    order = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    out, h = torch.empty_like(x), None
    for i in order:
        h = x[i] if h is None else gate * h + x[i]
        out[i] = h
    return out


# 4096 x 16: past the drop-ins' and linear_recurrence's thresholds for the kernel.
@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_the_kernel_route_reads_neg_bit_leaves_as_values(dtype, reverse):
    x = _neg_view(4096, 16, dtype=dtype)
    plain = x.resolve_neg()
    tol = dict(rtol=1e-4, atol=1e-3) if dtype == torch.float32 else {}
    with fscan.config.override(cpu_kernel="eager"), torch.no_grad():
        for _ in range(2):  # the first call builds the kernel, the second runs it
            out = fscan.associative_scan(_add, x, 0, reverse=reverse)
            torch.testing.assert_close(out, _loop(x, reverse).to(dtype), **tol)
            got = fscan.cumsum(x, 0, reverse=reverse)
            torch.testing.assert_close(got, fscan.cumsum(plain, 0, reverse=reverse), **tol)
            got = fscan.cummax(x, 0, reverse=reverse)
            want = fscan.cummax(plain, 0, reverse=reverse)
            torch.testing.assert_close(got.values, want.values, rtol=0, atol=0)
            torch.testing.assert_close(got.indices, want.indices, rtol=0, atol=0)
            got = fscan.linear_recurrence(0.5, x, 0, reverse=reverse)
            torch.testing.assert_close(got, _loop(x, reverse, 0.5).to(dtype), **tol)


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
def test_the_kernel_backward_reads_a_neg_bit_cotangent_as_values(reverse):
    x = torch.randn(4096, 16, dtype=F64, requires_grad=True)
    cotangent = _neg_view(4096, 16)
    with fscan.config.override(cpu_kernel="eager"):
        for _ in range(2):
            out = fscan.associative_scan(_add, x, 0, reverse=reverse)
            (got,) = torch.autograd.grad(out, x, cotangent)
    # The adjoint of a cumulative sum: the cumulative sum the other way.
    torch.testing.assert_close(got, _loop(cotangent, not reverse))
