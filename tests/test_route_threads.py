"""The drop-ins' route table reads torch's thread count: over several contiguous lanes (the
innermost dim) the kernel takes rows of at least ``ONE_THREAD_MIN_LENGTH`` steps on one
thread (cumsum and cumprod forward, every op reversed), torch's op on more; the route log
names the engine taken and, where the thread count kept the kernel away, says so; the
drop-ins' repeat keys hold the thread count; values are torch's either way."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import torch_threads

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._routing import repeat_drop_ins
from fscan._routing.cumulative import path, route
from fscan._routing.cumulative_table import ONE_THREAD_MIN_LENGTH, threads_decide

# (op, shape, dim, reverse, kernel on one thread): the kernel cell on more threads is False
ROWS = [
    (torch.cumsum, (4096, 256), 1, False, True),
    (torch.cumsum, (4096, 256), 1, True, True),
    (torch.cumprod, (4096, 256), 1, False, True),
    (torch.cumprod, (4096, 256), 1, True, True),
    (torch.cummax, (4096, 256), 1, False, False),  # torch's branchy walk wins
    (torch.cummax, (4096, 256), 1, True, True),  # ... unless it flips twice
    (torch.cummin, (256, 4096), 1, True, True),
    (torch.cumsum, (65536, 4), 0, True, True),  # 4 lanes after dim, 65536 steps
    (torch.cumsum, (8192, ONE_THREAD_MIN_LENGTH // 2), 1, False, False),  # short rows
    (torch.cummin, (8192, ONE_THREAD_MIN_LENGTH // 2), 1, True, False),
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
@pytest.mark.parametrize(("op", "shape", "dim", "reverse", "one"), ROWS[:8])
def test_each_count_runs_its_engine_with_torchs_values(op, shape, dim, reverse, one, caplog):
    x = torch.randn(shape)
    if op in (torch.cummax, torch.cummin):  # distinct values: ties broken alike
        x = torch.randperm(x.numel()).reshape(shape).float()
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
