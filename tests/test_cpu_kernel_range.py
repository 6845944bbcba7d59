"""The float32 (float16, bfloat16) range of values the kernel holds wider than their
dtype: an affine pair's product ``a_t * h`` that leaves the dtype's range is inf (or 0)
from there on, as in eager torch, on every path (lanes, chains, the reduce), in every
position of a row (its first and last lane, inside a vector, in a partial vector) and
both directions. The reduce's lane path runs rows with the checks left out and runs a
row again checked where a value left the range (csrc/reduce_lanes.h, lane_total_watched):
these rows are the ones it runs again."""

from __future__ import annotations

import logging

import pytest
import torch

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from tests.helpers import torch_threads

needs_compiler = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)


def affine(x, y):
    return (x[0] * y[0], y[0] * x[1] + y[1])


# Per dtype: BIG, whose product with FACTOR overflows the dtype (not the compute type);
# SMALL, two gates of which bring an unchecked overflow back into range (two of
# 1 / SMALL an unchecked underflow); TINY, whose square underflows the dtype to 0.
LIMITS = {
    torch.float32: (3e38, 4.0, 1e-20, 1e-30),
    torch.float16: (60000.0, 4.0, 1e-3, 1e-4),
    torch.bfloat16: (3e38, 4.0, 1e-20, 1e-30),
}
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def events(T: int, W: int, dtype: torch.dtype, lanes: list[int]) -> tuple[torch.Tensor, ...]:
    """(a, b) of shape (T, W), in scan order: gates near 1 and steps near 0 on every lane,
    and on each of ``lanes`` (alternately) an overflow early in the lane, one late, or an
    underflow, each followed by steps that would show an unchecked value."""
    gen = torch.Generator().manual_seed(T * 1000 + W)
    a = torch.rand(T, W, generator=gen, dtype=torch.float64) * 0.2 + 0.9
    b = torch.randn(T, W, generator=gen, dtype=torch.float64) * 0.01
    big, factor, small, tiny = LIMITS[dtype]
    for k, j in enumerate(lanes):
        kind = k % 3
        t = 1 if kind == 0 else (T - 4 if kind == 1 else T // 2)
        # Then gates of 1 and steps of 0: the lane's value stays what the event left.
        # (Not gates that underflow the product: a chunk's total composed with an
        # infinite carry is then 0 * inf, NaN, where the sequential scan keeps inf.)
        if kind < 2:  # a * h overflows at t + 1; two small gates would bring it back
            b[t, j], a[t + 1, j], b[t + 1, j] = big, factor, 0.0
            a[t + 2 : t + 4, j], a[t + 4 :, j], b[t + 2 :, j] = small, 1.0, 0.0
        else:  # a * h underflows to 0 at t + 1; two large gates would bring it back
            a[: t + 1, j], b[: t + 1, j] = 1.0, 0.0
            b[t, j], a[t + 1, j], b[t + 1, j] = tiny, tiny, 0.0
            a[t + 2 : t + 4, j], a[t + 4 :, j], b[t + 2 :, j] = 1.0 / small, 1.0, 0.0
    return a.to(dtype), b.to(dtype)


def eager_scan(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager combine in the leaves' dtype, applied step by step along dim 0."""
    outs = [(a[0], b[0])]
    for t in range(1, a.shape[0]):
        outs.append(affine(outs[-1], (a[t], b[t])))
    return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])


def assert_same_range(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, lanes: list[int]
) -> None:
    """Close values, the same infinities and NaNs, and on the event ``lanes`` (last dim)
    the same zeros (elsewhere a sum may cancel to 0 in eager rounding and not in the
    compute type)."""
    assert got.dtype == want.dtype == dtype
    for check in (torch.isinf, torch.isnan):
        assert torch.equal(check(got), check(want))
    assert torch.equal(got[..., lanes] == 0, want[..., lanes] == 0)
    tol = TOL[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, equal_nan=True)


def lane_list(W: int) -> list[int]:
    """The first and last lane, lanes inside the first vectors, one in a partial vector."""
    return sorted({0, 1, 5, 9, W // 2, W - 2, W - 1})


@pytest.fixture
def engines(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG, logger="fscan")
    return lambda: [r.fscan_engine for r in caplog.records if hasattr(r, "fscan_engine")]


def _in_scan_order(x: torch.Tensor, along_last: bool, reverse: bool) -> torch.Tensor:
    """(T, W) data in scan order as the call's leaf: transposed for the chains (the scan
    along the last dim), flipped for a reverse scan."""
    x = x.flip(0) if reverse else x
    return x.t().contiguous() if along_last else x


def _back(x: torch.Tensor, along_last: bool, reverse: bool) -> torch.Tensor:
    x = x.t() if along_last else x
    return x.flip(0) if reverse else x


SHAPES = [(40, 37, False), (40, 256, False), (33, 12, True)]  # lanes (a partial vector), chains


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(("T", "W", "along_last"), SHAPES)
def test_products_out_of_range_as_eager(T, W, along_last, reverse, dtype, threads, engines):
    lanes = lane_list(W)
    a, b = events(T, W, dtype, lanes)
    want = eager_scan(a, b)
    dim = 1 if along_last else 0
    xs = tuple(_in_scan_order(v, along_last, reverse) for v in (a, b))
    with torch_threads(threads):
        for _ in range(2):  # the first call runs the tree: the second, the kernel
            got = fscan.associative_scan(affine, xs, dim, reverse=reverse)
        assert engines()[-1] == "cpp"
        for g, w in zip(got, want):
            assert_same_range(_back(g, along_last, reverse), w, dtype, lanes)
        for _ in range(2):
            total = fscan.associative_reduce(affine, xs, dim, reverse=reverse)
        assert engines()[-1] == "cpp"
    for g, w in zip(total, want):
        assert_same_range(g, w[-1], dtype, lanes)


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
def test_reduce_rows_run_again_only_where_needed_stay_exact(reverse, engines):
    """Chunked lanes (T split across the threads) with out-of-range products in some
    chunks only, and a row of NaN (kept, as the check keeps it): the totals against
    the eager scan's last row."""
    T, W = 3000, 40
    lanes = [0, 7, 39]
    a, b = events(T, W, torch.float32, lanes)
    a[T // 3, 20], b[T // 3, 21] = float("nan"), float("nan")
    want = eager_scan(a, b)
    xs = tuple(v.flip(0) if reverse else v for v in (a, b))
    with torch_threads(2):
        for _ in range(2):
            total = fscan.associative_reduce(affine, xs, 0, reverse=reverse)
        assert engines()[-1] == "cpp"
    for g, w in zip(total, want):
        assert_same_range(g, w[-1], torch.float32, lanes)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reverse", [False, True])
def test_reduce_exact_zeros_bit_for_bit(dtype, reverse, engines):
    """Exact zeros (a gate of 0, a state of +0 or -0 over many rows) are not flagged by the
    watched rows (a zero is what the check keeps): the reduce's totals are still the
    forward's last row bit for bit, signs of zero included, on one thread (both walk
    each lane's rows in order)."""
    T, W = 300, 40
    a, b = events(T, W, dtype, [3, 11, 30])
    a[50, :20] = 0.0  # a zero gate: a * h is 0 on that row
    a[120:, 25:] = -a[120:, 25:]  # negative gates over a zero state: -0.0 products
    b[: T // 2, 20:] = 0.0  # a state of exactly 0 (padding): every product is 0
    b[T // 2 - 1, 24] = -0.0
    xs = tuple(v.flip(0) if reverse else v for v in (a, b))
    with torch_threads(1):
        for _ in range(2):
            scan = fscan.associative_scan(affine, xs, 0, reverse=reverse)
            total = fscan.associative_reduce(affine, xs, 0, reverse=reverse)
        assert engines()[-2:] == ["cpp", "cpp"]
    for g, s in zip(total, scan):
        last = s[0] if reverse else s[-1]
        torch.testing.assert_close(g, last, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(g.signbit() | g.isnan(), last.signbit() | last.isnan())
    assert (total[1][20:] == 0).any()
