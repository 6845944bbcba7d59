"""``fscan.associative_reduce`` along dense steps (the last dim, 1-D, a step-contiguous
view): the reduce kernel's chains, tiled where every leaf is float32 (csrc/reduce.h,
tile_totals: TB = 16 steps of 16 chains transposed in registers), walked otherwise.
Lengths around the tiles' edges, chain counts around a group of 16, every dtype,
combines that do not commute, NaN/inf and the affine pair's range check, against a
sequential loop (floats in float64, or in float32 where the float32 range is the point)."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import sequential_total

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem

pytestmark = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)


def affine(a, b):
    return (a[0] * b[0], a[1] * b[0] + b[1])


def right(left, r):
    return r


@pytest.fixture
def engines(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG, logger="fscan")
    return lambda: [r.fscan_engine for r in caplog.records if hasattr(r, "fscan_engine")]


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"threads{n}")
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


def _reduce(fn, xs, dim, reverse):
    """The second call: the first one runs the elementwise check on the tree."""
    with fscan.config.override(cpu_kernel="eager"):
        fscan.associative_reduce(fn, xs, dim, reverse=reverse)
        return fscan.associative_reduce(fn, xs, dim, reverse=reverse)


LENGTHS = [1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 35]
CHAINS = [1, 15, 16, 17, 33]


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("chains", CHAINS)
def test_float32_last_dim_is_the_sequential_double_loop(chains, reverse, threads, engines):
    """Unchunked (T < 2 MIN_CHUNK), float32 add and mul along the last dim total in scan
    order in double, rounded once: bit for bit the sequential loop's, every length around
    the tiles' 16 steps (a partial tile, then chains longer than the shortest walked)."""
    gen = torch.Generator().manual_seed(chains * 7 + reverse)
    for n in LENGTHS:
        x = torch.randn(chains, n, generator=gen)
        g = torch.rand(chains, n, generator=gen) * 0.2 + 0.9
        for fn, data in ((torch.add, x), (torch.mul, g)):
            got = _reduce(fn, data, 1, reverse)
            assert engines()[-1] == "cpp" or data.numel() == 1  # one element: the tree
            assert torch.equal(got, sequential_total(fn, data, 1, reverse).float()), (fn, n)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_non_commuting_combines_keep_the_order(dtype, reverse, threads, engines):
    """The right projection and the affine pair with factors +-1 (exact in every dtype
    here) along the last dim, 1-D and a middle dim: tiles compose each chain's steps in
    scan order and chunks in order."""
    gen = torch.Generator().manual_seed(11 + reverse)
    cases = [((c, n), 1) for c in (1, 16, 17) for n in (1, 15, 16, 17, 35)]
    cases += [((n,), 0) for n in (1, 16, 33, 5000)]
    cases += [((3, 35, 5), 1), ((17, 33, 1), 1)]
    for shape, dim in cases:
        x = torch.randn(shape, generator=gen).to(dtype)
        got = _reduce(right, x, dim, reverse)
        assert engines()[-1] == "cpp" or x.numel() == 1
        assert torch.equal(got, x.select(dim, 0 if reverse else -1))
        sign = torch.randint(0, 2, shape, generator=gen).to(dtype) * 2 - 1
        step = torch.randint(-2, 3, shape, generator=gen).to(dtype)
        want = sequential_total(affine, (sign, step), dim, reverse)
        if dtype == torch.bfloat16:
            want = [w.float() for w in want]  # sums beyond 256 would round: stay small
            if want[1].abs().max() > 128:
                continue
        got = _reduce(affine, (sign, step), dim, reverse)
        assert engines()[-1] == "cpp" or x.numel() == 1
        for g, w in zip(got, want):
            assert g.dtype == dtype and torch.equal(g.double(), w.double()), shape


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(("shape", "dim"), [((33, 35), 1), ((20001,), 0), ((35, 17), 0)])
def test_views_with_dense_steps(shape, dim, reverse, threads, engines):
    """A transposed view whose steps are dense takes the chains (tiled); a view whose steps
    are 2 apart walks them; a chunked 1-D chain (20001 steps, chunks on 2 and 3 threads)."""
    gen = torch.Generator().manual_seed(sum(shape) + reverse)
    base = torch.randn(shape[::-1], generator=gen).t() if dim == 0 and len(shape) == 2 else None
    x = base if base is not None else torch.randn(shape, generator=gen)
    strided = torch.randn(*shape[:-1], 2 * shape[-1], generator=gen)[..., ::2]
    for data, d in ((x, dim), (strided, len(shape) - 1)):
        got = _reduce(torch.add, data, d, reverse)
        assert engines()[-1] == "cpp"
        torch.testing.assert_close(
            got, sequential_total(torch.add, data, d, reverse).float(), rtol=1e-6, atol=1e-5
        )


@pytest.mark.parametrize("reverse", [False, True])
def test_integer_and_bool_leaves(reverse, threads, engines):
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.int32, torch.int64):
        x = torch.randint(-1000, 1000, (17, 35), generator=gen, dtype=dtype)
        got = _reduce(torch.add, x, 1, reverse)
        assert engines()[-1] == "cpp"
        assert got.dtype == dtype and torch.equal(got, x.sum(1, dtype=dtype))
    flags = torch.rand(17, 35, generator=gen) < 0.05
    got = _reduce(torch.logical_or, flags, 1, reverse)
    assert torch.equal(got, flags.any(1))


@pytest.mark.parametrize("reverse", [False, True])
def test_nan_and_inf(reverse, threads, engines):
    """NaN and +-inf planted at steps around the tiles' edges: add and max as the loop."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(33, 35, generator=gen)
    x[1, 0] = x[2, 15] = x[2, 16] = float("nan")
    x[3, 34] = float("inf")
    x[4, 7] = float("inf")
    x[4, 20] = -float("inf")  # inf - inf: NaN
    x[5, 16] = -float("inf")
    for fn in (torch.add, torch.maximum):
        got = _reduce(fn, x, 1, reverse)
        assert engines()[-1] == "cpp"
        want = sequential_total(fn, x, 1, reverse).float()
        assert torch.equal(got.isnan(), want.isnan())
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(("shape", "dim"), [((17, 35), 1), ((40000,), 0)])
def test_affine_range_check(shape, dim, reverse, threads, engines):
    """The affine pair's state product (read by the add) is range-checked at every step,
    held in double: with gates 2**+-40 and states +-1 it overflows to inf and underflows
    to 0 where float32 would, at the steps the scan's own kernel does. Unchunked (17
    chains of 35 steps): bit for bit the scan's last output; chunked 1-D: close to it.
    (The gate product itself is rounded to float32 only when stored, as in the scan.)"""
    gen = torch.Generator().manual_seed(len(shape) + reverse)
    up = torch.rand(shape, generator=gen) < 0.5
    a = torch.where(up, 2.0**40, 2.0**-40)
    b = torch.randint(0, 2, shape, generator=gen).float() * 2 - 1
    got = _reduce(affine, (a, b), dim, reverse)
    assert engines()[-1] == "cpp"
    with fscan.config.override(cpu_kernel="eager"):
        scan = fscan.associative_scan(affine, (a, b), dim, reverse=reverse)
    last = [s.select(dim, 0 if reverse else -1) for s in scan]
    for g, w in zip(got, last):
        if len(shape) == 2:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert got[1].isinf().any() or len(shape) == 1
    # Gates near 1 and finite states: against the float64 loop.
    a = torch.rand(shape, generator=gen) * 0.2 + 0.9
    b = torch.randn(shape, generator=gen)
    got = _reduce(affine, (a, b), dim, reverse)
    for g, w in zip(got, sequential_total(affine, (a, b), dim, reverse)):
        torch.testing.assert_close(g, w.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reverse", [False, True])
def test_captured_tensor_per_chain(reverse, threads, engines):
    """A captured tensor broadcast over the elements (one bound a lane): each tiled chain
    reads its own lane's bound (the tiles' element positions), 16 chains and one over."""
    gen = torch.Generator().manual_seed(9)
    cap = torch.randn(17, generator=gen)
    x = torch.randn(17, 35, generator=gen)
    got = _reduce(lambda left, r: torch.minimum(torch.maximum(left, r), cap), x, 1, reverse)
    assert engines()[-1] == "cpp"
    assert torch.equal(got, torch.minimum(x.amax(1), cap))
