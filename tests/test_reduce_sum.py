"""``fscan.associative_reduce`` of a float32 sum on the kernel (csrc/reduce.h, ``SUM_F32``):
blocks of rows (the lane path) or of a lane's dense steps (the chain path) summed in float32,
each block's sum widened once into double. Values within the bound against a float64
oracle, no less accurate than ``torch.sum``, the double loop's answer wherever a block is
not finite (overflow, inf, NaN), signed zeros, and the combines recognised as a sum."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import assert_within_sum_bound, sequential_total, torch_threads

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem

pytestmark = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)


def add(a, b):
    return a + b


@pytest.fixture(autouse=True)
def _on_the_kernel(caplog: pytest.LogCaptureFixture):
    """Every reduce a test checks (the second call of each, see _reduce) ran on the kernel."""
    caplog.set_level(logging.DEBUG, logger="fscan")
    _CAPLOG[:] = [caplog]
    yield
    _CAPLOG.clear()


_CAPLOG: list[pytest.LogCaptureFixture] = []


def _reduce(fn, x, dim, reverse=False):
    """The second call, on the kernel: the first one runs the elementwise check on the tree."""
    fscan.associative_reduce(fn, x, dim, reverse=reverse)
    _CAPLOG[0].clear()
    total = fscan.associative_reduce(fn, x, dim, reverse=reverse)
    ran = [r.fscan_engine for r in _CAPLOG[0].records if hasattr(r, "fscan_engine")]
    assert ran == ["cpp"], ran
    return total


def _lane_layouts(steps: int) -> list[tuple[torch.Tensor, int]]:
    """(x, dim) of float32 data with ``steps`` steps along dim: lanes side by side (dim 0,
    a middle dim), dense chains (the last dim, 1-D), and a transposed view whose chains
    are dense (steps of stride 1 along dim 0)."""
    gen = torch.Generator().manual_seed(steps)
    rand = lambda *shape: torch.randn(*shape, generator=gen)
    return [
        (rand(steps, 40), 0),
        (rand(3, steps, 24), 1),
        (rand(5, steps), 1),
        (rand(steps), 0),
        (rand(7, steps).t(), 0),
    ]


@pytest.mark.parametrize("steps", [2, 15, 16, 17, 31, 32, 33, 255, 256, 257, 600, 20001])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_sum_within_its_bound(steps, reverse, threads):
    """Every layout and length around the blocks (16 rows; 8 rows of 32 steps) and the
    chunks that threads make: within 15 u sum|x| + u |total| of the exact sum."""
    with torch_threads(threads):
        for x, dim in _lane_layouts(steps):
            assert_within_sum_bound(_reduce(add, x, dim, reverse), x, dim)


@pytest.mark.parametrize(("shape", "dim"), [((4096, 256), 0), ((64, 512, 8), 1), ((4096, 256), 1)])
@pytest.mark.parametrize("kind", ["randn", "rand", "offset"])
def test_no_less_accurate_than_torch_sum(shape, dim, kind):
    """Over the lanes, the mean and largest error against the float64 sum are no larger
    than ``torch.sum``'s (float32, cascaded) on the same data, the drop-in's yardstick."""
    gen = torch.Generator().manual_seed(len(shape) * 7 + dim)
    x = _data(kind, shape, gen)
    exact = x.double().sum(dim)
    ours = (_reduce(add, x, dim).double() - exact).abs()
    theirs = (torch.sum(x, dim).double() - exact).abs()
    assert ours.mean() <= theirs.mean() and ours.max() <= theirs.max()


@pytest.mark.parametrize("kind", ["randn", "rand", "offset"])
def test_one_chain_no_less_accurate_than_torch_sum(kind):
    """1-D: one total a call, so 16 calls (seeds) make the sample; a single total's error
    is mostly its final rounding, which either may win."""
    ours, theirs = [], []
    for seed in range(16):
        x = _data(kind, (1 << 18,), torch.Generator().manual_seed(seed))
        exact = x.double().sum()
        ours.append(abs(float(_reduce(add, x, 0)) - float(exact)))
        theirs.append(abs(float(torch.sum(x)) - float(exact)))
    assert sum(ours) <= sum(theirs) and max(ours) <= max(theirs)


def _data(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """float32 data: standard normal, uniform [0, 1), or uniform with a large offset (every
    partial sum positive and growing: rounding errors add up)."""
    x = torch.randn(shape, generator=gen) if kind == "randn" else torch.rand(shape, generator=gen)
    return x * 1e4 + 3e3 if kind == "offset" else x


def _non_finite_cases() -> list[torch.Tensor]:
    """Columns whose float32 block sums are not finite: an overflow that later steps
    cancel (the double loop's total is finite), infs of both signs, a NaN."""
    big = torch.finfo(torch.float32).max / 2
    cancel = torch.ones(300)
    cancel[10:13] = big
    cancel[40:43] = -big
    infs = torch.randn(300)
    infs[5] = float("inf")
    both = infs.clone()
    both[250] = float("-inf")
    nan = torch.randn(300)
    nan[299] = float("nan")
    return [cancel, infs, both, nan]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("case", range(4))
def test_non_finite_blocks_run_in_double(case, reverse):
    """Where a block's float32 sum is not finite, its lanes run in double: the totals are
    the sequential double loop's (an overflow cancelled later is finite; inf and NaN as
    IEEE has them), on the lane path (one column among finite ones) and on chains."""
    column = _non_finite_cases()[case]
    lanes = torch.randn(300, 37)
    lanes[:, 20] = column
    for x, dim in ((lanes, 0), (lanes.t().contiguous(), 1), (column, 0)):
        got = _reduce(add, x, dim, reverse)
        want = sequential_total(add, x, dim, reverse).float()
        assert torch.equal(got.isnan(), want.isnan())
        finite = ~want.isnan()
        if case == 0:  # the cancelled overflow: within the bound, finite
            assert got[finite].isfinite().all()
            assert_within_sum_bound(got, x, dim)
        else:
            assert torch.equal(got.isinf(), want.isinf())
            assert torch.equal(got[got.isinf()], want[want.isinf()])


@pytest.mark.parametrize(("shape", "dim"), [((40, 33), 0), ((33, 600), 1), ((600,), 0)])
def test_signed_zeros(shape, dim):
    """A sum of negative zeros is -0.0 (its blocks, their accumulators and the pairwise
    adds keep the sign), and any positive zero among them makes it +0.0, as the loop."""
    x = torch.full(shape, -0.0)
    got = _reduce(add, x, dim)
    assert (got == 0).all() and got.signbit().all()
    x.select(dim, 3).fill_(0.0)
    got = _reduce(add, x, dim)
    assert (got == 0).all() and not got.signbit().any()


@pytest.mark.parametrize(("shape", "dim"), [((4096, 64), 0), ((64, 4096), 1)])
def test_sum_combines_recognised(shape, dim):
    """``torch.add``, ``a + b`` and ``b + a`` take the sum's blocks (bit for bit one
    another, and not the step-by-step double total on this data); ``a * 1.0 + b`` and
    float64 data do not."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    ours = _reduce(add, x, dim)
    loop = sequential_total(add, x, dim, False).float()
    assert not torch.equal(ours, loop)  # the data tells the two apart
    assert torch.equal(_reduce(torch.add, x, dim), ours)
    assert torch.equal(_reduce(lambda a, b: b + a, x, dim), ours)
    assert torch.equal(_reduce(lambda a, b: a * 1.0 + b, x, dim), loop)
    wide = x.double()
    assert torch.equal(_reduce(add, wide, dim), sequential_total(add, wide, dim, False))
