"""The drop-ins' route table reads torch's thread count: over several contiguous lanes (the
innermost dim) the kernel takes cumsum's and cumprod's rows of at least
``ONE_THREAD_MIN_LENGTH`` steps (``ONE_THREAD_MIN_LENGTHS`` for float32 and reversed
float64) on one thread, torch's op on more; cummax/cummin's cells
there do not read the count (torch's walk of them is serial: the kernel runs them on one
thread); the route log names the engine taken and, where the thread count kept the kernel
away, says so; the drop-ins' repeat keys hold the thread count; values are torch's either
way."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import torch_threads
from test_exclusive import _shifted_reference

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._routing import repeat_drop_ins
from fscan._routing.cumulative import kernel_threads, path, route
from fscan._routing.cumulative_table import (
    EXTREMUM_FORWARD_MIN_NUMEL,
    ONE_THREAD_MIN_LENGTH,
    WALK_FROM,
    threads_decide,
)

# (op, shape, dim, reverse, kernel on one thread): the kernel cell on more threads is False
ROWS = [
    (torch.cumsum, (4096, 256), 1, False, True),
    (torch.cumsum, (4096, 256), 1, True, True),
    (torch.cumprod, (4096, 256), 1, False, True),
    (torch.cumprod, (4096, 256), 1, True, True),
    (torch.cumsum, (65536, 4), 0, True, True),  # 4 lanes after dim, 65536 steps
    (torch.cumsum, (8192, ONE_THREAD_MIN_LENGTH // 2), 1, False, True),  # float32 tiled
    (torch.cumprod, (8192, 16), 1, True, True),
    (torch.cumsum, (8192, 32), 1, False, False),  # short rows
    (torch.cumprod, (16384, 8), 1, True, False),
]

# (op, dtype, steps, reverse, kernel on one thread) over 2**17 elements: the kernel's rows
# from ONE_THREAD_MIN_LENGTHS' lengths (float32 tiled; float64 walked) or from 128
LENGTH_ROWS = [
    (torch.cumsum, torch.float32, 8, True, False),
    (torch.cumprod, torch.float32, 16, True, True),
    (torch.cumsum, torch.float32, 48, False, False),
    (torch.cumprod, torch.float32, 64, False, True),
    (torch.cumsum, torch.float64, 32, True, False),
    (torch.cumprod, torch.float64, 64, True, True),
    (torch.cumsum, torch.float64, 96, False, False),
    (torch.cumsum, torch.float64, 128, False, True),
    (torch.cumsum, torch.int64, 64, True, False),
    (torch.cumprod, torch.bfloat16, 128, True, True),
]


@pytest.mark.parametrize(("op", "dtype", "steps", "reverse", "kernel"), LENGTH_ROWS)
def test_rows_on_one_thread_take_the_kernel_from_their_dtypes_length(
    op, dtype, steps, reverse, kernel
):
    x = torch.ones(2**17 // steps, steps, dtype=dtype)
    with torch_threads(1):
        assert route(op, x, 1, reverse) == (kernel, False)
    with torch_threads(2):
        assert route(op, x, 1, reverse) == (False, False)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", [torch.cumsum, torch.cumprod])
def test_forward_rows_and_one_lane_off_float32_and_float64_are_torchs(op, dtype):
    # Forward, the kernel walks these dtypes a step at a time, slower than torch's op
    # (CHAIN_SUM_DTYPES); reversed (torch flips twice) it keeps them.
    rows, lane = torch.ones(1024, 256, dtype=dtype), torch.ones(2**20, dtype=dtype)
    with torch_threads(1):
        for x, dim in ((rows, 1), (lane, 0)):
            assert route(op, x, dim, False) == (False, False)
            assert route(op, x, dim, True)[0]
            assert route(op, x.double(), dim, False)[0]


# (op, dtype, shape, dim, reverse, kernel): cummax/cummin over several contiguous lanes, the
# same cell on 1 and 2 threads
TILED = EXTREMUM_FORWARD_MIN_NUMEL // 16
EXTREMUM_ROWS = [
    (torch.cummax, torch.float32, (4096, 256), 1, False, True),  # walked alone
    (torch.cummax, torch.float32, (4096, 256), 1, True, True),  # torch flips twice
    (torch.cummin, torch.float32, (256, 4096), 1, True, True),
    (torch.cummax, torch.float32, (TILED, 16), 1, False, True),  # the kernel's tiles
    (torch.cummin, torch.float32, (TILED // 32, 8, WALK_FROM // 2), 2, False, True),
    (torch.cummax, torch.float32, (TILED, 16), 1, True, True),
    (torch.cummax, torch.float32, (TILED // 2, 16), 1, False, False),  # the call's fixed cost
    (torch.cummax, torch.float32, (TILED // 8, WALK_FROM), 1, False, True),  # walked alone
    (torch.cummin, torch.float32, (TILED * 16,), 0, False, True),  # one lane, walked
    (torch.cummin, torch.float32, (TILED // 16, WALK_FROM), 1, False, False),  # fixed cost
    (torch.cummin, torch.float64, (TILED // 8, WALK_FROM), 1, False, False),  # float32's
    (torch.cummin, torch.float64, (TILED, 16), 1, False, False),  # tiles are float32's
    (torch.cummax, torch.int64, (TILED, 16), 1, True, False),  # 8 chains interleaved
    (torch.cummax, torch.int64, (1024, WALK_FROM), 1, True, True),  # walked alone
    (torch.cummin, torch.bfloat16, (4096, 256), 1, True, True),
    (torch.cummax, torch.float32, (TILED // 2, 16, 2), 1, False, False),  # strided chains
]


@pytest.mark.parametrize(("op", "shape", "dim", "reverse", "one"), ROWS)
def test_the_table_reads_the_thread_count(op, shape, dim, reverse, one):
    x = torch.randn(shape)
    with torch_threads(1):
        assert route(op, x, dim, reverse) == (one, False)
        assert not threads_decide(op, x, dim, reverse)
    with torch_threads(2):
        assert route(op, x, dim, reverse) == (False, False)
        assert threads_decide(op, x, dim, reverse) is one
    with torch_threads(1):  # other cells keep their answer on any count
        assert route(torch.logcumsumexp, x, dim, reverse)[0]
        assert route(op, torch.randn(2**20), 0, False)[0] is (op in (torch.cumsum, torch.cumprod))


@pytest.mark.parametrize(("op", "dtype", "shape", "dim", "reverse", "kernel"), EXTREMUM_ROWS)
def test_extremum_cells_do_not_read_the_thread_count(op, dtype, shape, dim, reverse, kernel):
    x = torch.randn(shape).to(dtype)
    for threads in (1, 2, 3):
        with torch_threads(threads):
            assert route(op, x, dim, reverse) == (kernel, False)
            assert not threads_decide(op, x, dim, reverse)
    assert kernel_threads(x, dim, op) == 1  # torch's walk of these rows is serial
    # (the segmented scan's: all of torch's threads, but over one lane, always one)
    assert kernel_threads(x, dim) == (1 if x.ndim == 1 else None)
    assert kernel_threads(torch.randn(4096, 256), 0, op) is None  # the lane path


needs_kernel = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)


def _reference(op, x, dim, reverse):
    """torch's op in float64 (flip, op, flip reversed, indices mapped back to ``x``)."""
    wide = x.double()
    if not reverse:
        return op(wide, dim)
    out = op(wide.flip(dim), dim)
    if isinstance(out, torch.Tensor):
        return out.flip(dim)
    return type(out)((out.values.flip(dim), (x.shape[dim] - 1 - out.indices).flip(dim)))


def _same(got, want):
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-3)
    else:
        assert torch.equal(got.indices, want.indices)
        torch.testing.assert_close(got.values, want.values.float())


@needs_kernel
@pytest.mark.parametrize(("op", "shape", "dim", "reverse", "one"), ROWS[:5])
def test_each_count_runs_its_engine_with_torchs_values(op, shape, dim, reverse, one, caplog):
    x = torch.randn(shape)
    drop_in = getattr(fscan, op.__name__)
    want = _reference(op, x, dim, reverse)
    caplog.set_level(logging.DEBUG, logger="fscan")
    shifted = []
    for threads, engine in ((1, "cpp" if one else "native"), (2, "native")):
        with torch_threads(threads), torch.no_grad():
            drop_in(x, dim, reverse=reverse)  # builds the kernel (the session's mode)
            assert path(op, x, dim, reverse) == engine
            caplog.clear()
            _same(drop_in(x, dim, reverse=reverse), want)
            shifted.append(drop_in(x, dim, reverse=reverse, exclusive=True))
            records = [r for r in caplog.records if hasattr(r, "fscan_engine")]
            assert [r.fscan_engine for r in records] == [engine, engine]
            why = records[0].fscan_refused.get("cpp", "")
            assert ("threads" in why) is (engine == "native" and one), why
    _same(shifted[0], shifted[1])  # the exclusive drop-in on each engine


@needs_kernel
def test_the_repeat_keys_hold_the_thread_count():
    x = torch.randn(4096, 256)
    with torch_threads(1), torch.no_grad():
        for _ in range(3):
            fscan.cumsum(x, 1)
            fscan.cumsum(x, 1, exclusive=True)
        assert repeat_drop_ins.repeat_cumulative(torch.cumsum, x, 1, False) is not None
        assert repeat_drop_ins.repeat_exclusive(torch.cumsum, x, 1, False) is not None
    with torch_threads(2), torch.no_grad():  # a key of its own: the table's answer differs
        assert repeat_drop_ins.repeat_cumulative(torch.cumsum, x, 1, False) is None
        assert repeat_drop_ins.repeat_exclusive(torch.cumsum, x, 1, False) is None


@needs_kernel
@pytest.mark.parametrize(
    ("op", "dtype", "shape", "dim", "reverse", "kernel"), [r for r in EXTREMUM_ROWS if r[-1]]
)
def test_extremum_rows_run_the_kernel_with_torchs_values(
    op, dtype, shape, dim, reverse, kernel, caplog
):
    x = torch.randint(-40, 40, shape).to(dtype)  # ties everywhere: torch's tie rule
    x.view(-1)[:: x.numel() // 7] = float("nan") if dtype.is_floating_point else 0
    drop_in = getattr(fscan, op.__name__)
    if reverse:
        out = op(x.flip(dim), dim)
        want = (out.values.flip(dim), (x.shape[dim] - 1 - out.indices).flip(dim))
    else:
        want = tuple(op(x, dim))
    caplog.set_level(logging.DEBUG, logger="fscan")
    for threads in (1, 2):
        with torch_threads(threads), torch.no_grad():
            drop_in(x, dim, reverse=reverse)  # builds the kernel (the session's mode)
            assert path(op, x, dim, reverse) == "cpp"
            caplog.clear()
            got = drop_in(x, dim, reverse=reverse)
            records = [r for r in caplog.records if hasattr(r, "fscan_engine")]
            assert [r.fscan_engine for r in records] == ["cpp"]
            torch.testing.assert_close(got.values, want[0], rtol=0, atol=0, equal_nan=True)
            assert torch.equal(got.indices, want[1])
            drop_in(x, dim, reverse=reverse, exclusive=True)  # builds the exclusive variant
            caplog.clear()
            shifted = drop_in(x, dim, reverse=reverse, exclusive=True)
            records = [r for r in caplog.records if hasattr(r, "fscan_engine")]
            assert [r.fscan_engine for r in records] == ["cpp"]
            values, indices = _shifted_reference(op.__name__, x, dim, reverse)
            values = values.to(x.dtype)  # (the reference is float64: exact on these integers)
            torch.testing.assert_close(shifted.values, values, rtol=0, atol=0, equal_nan=True)
            assert torch.equal(shifted.indices, indices)
