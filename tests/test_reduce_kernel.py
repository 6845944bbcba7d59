"""``fscan.associative_reduce`` on the generated reduce kernel: values against a sequential
float64 oracle (lane and chain paths, chunked lanes, strided leaves, both directions,
thread counts), the route as logged, and the refusals that leave the tree reduction."""

from __future__ import annotations

import logging

import optree
import pytest
import torch
from helpers import assert_within_sum_bound, sequential_total

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem

needs_compiler = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)


def affine(a, b):
    return (a[0] * b[0], a[1] * b[0] + b[1])


@pytest.fixture
def engines(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG, logger="fscan")
    return lambda: [r.fscan_engine for r in caplog.records if hasattr(r, "fscan_engine")]


def _reduce_twice(fn, xs, dim, reverse):
    """The second call: the first one runs the elementwise check on the tree."""
    fscan.associative_reduce(fn, xs, dim, reverse=reverse)
    return fscan.associative_reduce(fn, xs, dim, reverse=reverse)


SHAPES = [
    ((300, 40), 0),  # lanes, one column
    ((7, 300, 5), 1),  # chains (inner < 8)
    ((5, 40, 16), 2),  # the last dim: chains
    ((9000, 16), 0),  # lanes, chunked when the columns are fewer than the threads
    ((20001,), 0),  # one chain, chunked
]


@needs_compiler
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("shape", "dim"), SHAPES)
@pytest.mark.parametrize("reverse", [False, True])
def test_matches_the_oracle_on_the_kernel(shape, dim, reverse, threads, engines):
    gen = torch.Generator().manual_seed(len(shape) * 7 + dim)
    a = torch.rand(shape, generator=gen, dtype=torch.float64) * 0.2 + 0.9
    b = torch.randn(shape, generator=gen, dtype=torch.float64)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for fn, xs in ((torch.add, b), (torch.maximum, b), (affine, (a, b))):
            got = _reduce_twice(fn, xs, dim, reverse)
            assert engines()[-1] == "cpp"
            want = sequential_total(fn, xs, dim, reverse)
            optree.tree_map(
                lambda g, w: torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-9), got, want
            )
    finally:
        torch.set_num_threads(previous)


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
def test_strided_float32_and_integer_leaves(reverse, engines):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 300, generator=gen).t()  # a transpose: read in place
    got = _reduce_twice(torch.add, x, 0, reverse)
    assert engines()[-1] == "cpp"
    torch.testing.assert_close(got, x.double().sum(0).float(), rtol=1e-5, atol=1e-5)
    step = torch.randn(600, 32, generator=gen)[::2]  # a step slice
    got = _reduce_twice(torch.maximum, step, 0, reverse)
    assert torch.equal(got, step.amax(0))
    ints = torch.randint(-5, 5, (50, 3, 10), generator=gen)
    got = _reduce_twice(torch.add, ints, 1, reverse)
    assert engines()[-1] == "cpp"
    assert got.dtype == torch.int64 and torch.equal(got, ints.sum(1))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("shape", "dim"), [((303, 40), 0), ((2, 302, 24), 1), ((3, 40), 0)])
@pytest.mark.parametrize("reverse", [False, True])
def test_row_blocks_keep_the_order(shape, dim, reverse, dtype, engines):
    """The lane path reads rows in blocks where a lane holds one compute value (one leaf,
    or two float16/bfloat16 leaves computed in float): lengths that leave 0 to 3 rows
    behind the blocks, combines that do not commute (the right operand; the affine pair
    with factors of +-1, whose sums stay exact in every dtype here)."""
    gen = torch.Generator().manual_seed(shape[dim] + dim)
    x = torch.randn(shape, generator=gen).to(dtype)
    got = _reduce_twice(lambda left, right: right, x, dim, reverse)
    assert engines()[-1] == "cpp"
    assert torch.equal(got, x.select(dim, 0 if reverse else -1))
    sign = torch.randint(0, 2, shape, generator=gen).to(dtype) * 2 - 1
    step = torch.randint(-2, 3, shape, generator=gen).to(dtype)
    want = sequential_total(affine, (sign, step), dim, reverse)
    assert want[1].abs().max() <= 128  # exact in bfloat16's 8 bits
    got = _reduce_twice(affine, (sign, step), dim, reverse)
    assert engines()[-1] == "cpp"
    for g, w in zip(got, want):
        assert g.dtype == dtype and torch.equal(g.double(), w)


@needs_compiler
def test_initial_and_length_one(engines):
    x = torch.randn(1, 20, dtype=torch.float64)
    init = torch.randn(20, dtype=torch.float64)
    y = torch.randn(50, 20, dtype=torch.float64)
    # First: a length-1 call runs no combine, so it cannot run the elementwise check
    # that opens the kernel route; this call does, in a process where no earlier test did.
    got = fscan.associative_reduce(torch.add, y, 0, initial=init)
    torch.testing.assert_close(got, init + y.sum(0))
    got = _reduce_twice(torch.add, x, 0, False)
    assert engines()[-1] == "cpp"
    assert torch.equal(got, x[0]) and got.data_ptr() != x.data_ptr()


@needs_compiler
def test_gradients_and_off_take_the_tree(engines):
    x = torch.randn(30, 4, dtype=torch.float64, requires_grad=True)
    a = (torch.rand(30, 4, dtype=torch.float64) + 0.5).requires_grad_()
    _reduce_twice(torch.add, x.detach(), 0, False)
    for dim in (0, 1):
        for reverse in (False, True):
            assert torch.autograd.gradcheck(
                lambda a, x: fscan.associative_reduce(affine, (a, x), dim, reverse=reverse),
                (a, x),
            )
            assert engines()[-1] == "tree"
    with fscan.config.override(cpu_kernel="off"):
        fscan.associative_reduce(torch.add, x.detach(), 0)
    assert engines()[-1] == "tree"


def _planted_affine(case: str, shape, reverse: bool):
    """float32 affine pairs where composing chunk totals meets ``0 * inf`` and the steps
    do not: ``inf`` state at the first step (in scan order) with gates 0.5 (every later
    chunk's gate product underflows to 0), or gates 2.0 then 0.5 (the product overflows to
    inf, then every later chunk's product is 0)."""
    n = shape[0]
    a = torch.full(shape, 0.5)
    b = torch.linspace(-1.0, 1.0, n).reshape(n, *[1] * (len(shape) - 1)).expand(shape).clone()
    first = n - 1 if reverse else 0
    if case == "inf_state":
        b[first] = float("inf")
    elif case == "-inf_state":
        b[first] = -float("inf")
    else:  # "inf_gate": gates 2.0 over the first 400 steps in scan order, no state
        head = slice(n - 400, n) if reverse else slice(0, 400)
        a[head] = 2.0
        b.zero_()
    return a, b


# The float64 loop's totals of a case, kept by its run on 2 threads for its run on 3 (which
# takes them): the same data, and 40000 steps of the loop cost more than the kernel.
_TOTALS: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _shared_total(key: tuple, xs, dim: int, reverse: bool) -> tuple[torch.Tensor, ...]:
    if key in _TOTALS:
        return _TOTALS.pop(key)
    _TOTALS[key] = sequential_total(affine, xs, dim, reverse)
    return _TOTALS[key]


@needs_compiler
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize(("shape", "dim"), [((40000,), 0), ((40000, 3), 0), ((40000, 16), 0)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("case", ["inf_state", "-inf_state", "inf_gate"])
def test_chunk_join_walks_where_composing_overflows(case, shape, dim, reverse, threads, engines):
    """A chunked reduce (1-D and 2-column chains, a lane column) joins chunk totals as the
    sequential scan would walk them: where composing gives NaN from non-NaN totals (a gate
    product of 0 meeting an infinite carry), the chunk is walked from the carry, as the
    forward's chunk join does (csrc/forward_lanes.h). Against a float64 loop and the
    scan's last output on the same data."""
    a, b = _planted_affine(case, shape, reverse)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _reduce_twice(affine, (a, b), dim, reverse)
        assert engines()[-1] == "cpp"
        scan = fscan.associative_scan(affine, (a, b), dim, reverse=reverse)
    finally:
        torch.set_num_threads(previous)
    want = _shared_total((case, shape, dim, reverse), (a, b), dim, reverse)
    last = [s.select(dim, 0 if reverse else -1) for s in scan]
    for g, w, s in zip(got, want, last):
        assert not w.isnan().any()
        torch.testing.assert_close(g, w.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g, s, rtol=1e-5, atol=1e-5)


BLOCK_SHAPES = [((2, 43), 0), ((9, 43), 0), ((300, 40), 0), ((303, 41), 0), ((2, 307, 24), 1)]
BLOCK_SHAPES += [((9000, 16), 0)]  # chunked on 2 and 3 threads


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("shape", "dim"), BLOCK_SHAPES)
@pytest.mark.parametrize("reverse", [False, True])
def test_float32_blocks_keep_the_order(shape, dim, reverse, threads, engines):
    """float32 mul, accumulated in double, takes the lane path's blocks of rows
    (csrc/reduce_lanes.h, block_rows: 8 rows by 4 lanes in registers): lengths that leave 0 to 7
    rows behind the blocks, lane counts that leave 1 to 3 lanes behind the 4-lane blocks.
    Unchunked (1 thread, or columns enough for the threads), the total is the sequential
    double loop's, rounded once, bit for bit, and the scan's last output; chunked, close.
    float32 add sums blocks of 16 rows in float32 first (sum_rows): within its bound of
    the exact total (tests/test_reduce_sum.py has the rest)."""
    gen = torch.Generator().manual_seed(shape[dim] * 3 + dim)
    x = torch.randn(shape, generator=gen)
    g = torch.rand(shape, generator=gen) * 0.2 + 0.9
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _reduce_twice(torch.mul, g, dim, reverse)
        assert engines()[-1] == "cpp"
        last = fscan.associative_scan(torch.mul, g, dim, reverse=reverse).select(
            dim, 0 if reverse else -1
        )
        want = sequential_total(torch.mul, g, dim, reverse).float()
        if threads == 1 or shape == (2, 307, 24):
            assert torch.equal(got, want) and torch.equal(got, last)
        else:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        total = _reduce_twice(torch.add, x, dim, reverse)
        assert engines()[-1] == "cpp"
        assert_within_sum_bound(total, x, dim)
    finally:
        torch.set_num_threads(previous)
