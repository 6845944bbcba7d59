"""The exclusive drop-ins' repeat route in one kernel pass: the kernel's exclusive mode
from the op's identity (see fscan._engines.cpp._kernel_run.exclusive_run and scan in
csrc/forward.h), against a step-by-step oracle in float64, at the lengths and layouts
where an off-by-one would show: 1, 2 and 3 steps, around the kernel's lane blocks, tiles
(16 steps) and chunk splits, every dim, both directions, every path of the kernel (lanes,
chains, register-transposed tiles, split columns, chunked 1-D) on 1 and 2 threads. (Where
the route table sends a drop-in call to torch's op instead, the oracle still checks it
and nothing is served_exclusive.)"""

from __future__ import annotations

import math

import pytest
import torch

import fscan
from fscan._routing.cumulative import path

IDENTITY = {"cumsum": 0.0, "cumprod": 1.0, "logcumsumexp": -math.inf}
STEP = {"cumsum": torch.add, "cumprod": torch.mul, "logcumsumexp": torch.logaddexp}
BETTER = {"cummax": (-math.inf, torch.ge), "cummin": (math.inf, torch.le)}
OPS = ["cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"]


def oracle(name, x, dim, reverse):
    """The carry into each step, step by step in float64 (cummax/cummin: values and
    indices, positions in ``x``, the later element in scan order winning ties)."""
    xs = x.double().movedim(dim, 0)
    n = xs.shape[0]
    start = BETTER[name][0] if name in BETTER else IDENTITY[name]
    carry = torch.full(xs.shape[1:], start, dtype=torch.float64)
    at = torch.full(xs.shape[1:], -1, dtype=torch.int64)
    values, indices = [None] * n, [None] * n
    for t in range(n - 1, -1, -1) if reverse else range(n):
        values[t], indices[t] = carry, at
        if name in BETTER:
            take = BETTER[name][1](xs[t], carry) | torch.isnan(xs[t])
            carry, at = torch.where(take, xs[t], carry), torch.where(take, t, at)
        else:
            carry = STEP[name](carry, xs[t])
    return torch.stack(values).movedim(0, dim), torch.stack(indices).movedim(0, dim)


def data(name, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if name in BETTER:  # distinct values: ties cannot hide an index off by one
        return torch.randperm(math.prod(shape), generator=g).reshape(shape).float()
    if name == "cumprod":
        return 1 + 0.01 * torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g)


def check(name, x, dim, reverse, out):
    values, indices = oracle(name, x, dim, reverse)
    if name in BETTER:
        torch.testing.assert_close(out.values.double(), values, rtol=0, atol=0)
        assert torch.equal(out.indices, indices)
    else:
        torch.testing.assert_close(out.double(), values, rtol=1e-4, atol=1e-4)


def twice_then(name, x, dim, reverse, served_exclusive):
    """Two calls (the first stores the run), then the call the repeat route serves."""
    op = getattr(fscan, name)
    for _ in range(2):
        op(x, dim, reverse=reverse, exclusive=True)
    served_exclusive.clear()
    return op(x, dim, reverse=reverse, exclusive=True)


def on_kernel(name, x, dim, reverse):
    return path(getattr(torch, name), x, dim, reverse, exclusive=True) == "cpp"


SHAPES = [  # (shape, dim): lengths 2 and 3, odd lane counts, middle and last dims
    ((4000, 2, 8), 1),
    ((2000, 3, 17), 1),
    ((1000, 3, 40), 1),
    ((257, 600), 0),
    ((1500, 65, 3), 1),
    ((60, 9, 300), 2),
    ((3000, 17), 1),
]


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize(("shape", "dim"), SHAPES, ids=[f"{s}-{d}" for s, d in SHAPES])
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("threads", [1, 2])
def test_one_pass_matches_the_oracle(served_exclusive, name, shape, dim, reverse, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = data(name, shape)
        before = x.clone()
        out = twice_then(name, x, dim, reverse, served_exclusive)
        check(name, x, dim, reverse, out)
        assert len(served_exclusive) == on_kernel(name, x, dim, reverse)
        assert torch.equal(x, before)
        first = out.values if name in BETTER else out
        assert first.is_contiguous()
        assert first.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize("name", OPS)
def test_long_split_columns_and_one_lane(served_exclusive, name, reverse):
    """Columns split into chunks across 2 threads (the carry-in only in the first chunk),
    and one lane of 2**16 (the chain path): where the kernel serves them, the oracle."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for shape in [(20000, 8), (2**16,)]:
            x = data(name, shape, seed=1)
            out = twice_then(name, x, 0, reverse, served_exclusive)
            check(name, x, 0, reverse, out)
            assert len(served_exclusive) == on_kernel(name, x, 0, reverse)
    finally:
        torch.set_num_threads(old)


def test_a_contiguous_view_reads_its_own_steps(served_exclusive):
    """A view starting one step into a larger tensor: the step before it (forward: the
    kernel's address one step back) is the larger tensor's, never read."""
    base = torch.randn(257, 600)
    base[0] = float("nan")
    x = base[1:]
    out = twice_then("cumsum", x, 0, False, served_exclusive)
    assert served_exclusive
    check("cumsum", x, 0, False, out)
    assert not out.isnan().any()


def test_special_values_at_the_first_step(served_exclusive):
    """The identity combined with the first step keeps it: -inf ties cummax's start (the
    step wins, index 0), NaN propagates, +inf stays; -0.0 summed with 0 is +0.0, as
    torch.cumsum's running sum gives."""
    x = torch.randn(512, 256)
    x[0, :4] = torch.tensor([-math.inf, math.nan, math.inf, -0.0])
    mx = twice_then("cummax", x, 0, False, served_exclusive)
    assert served_exclusive
    assert mx.indices[1, :4].tolist() == [0, 0, 0, 0]
    assert mx.values[1, 0] == -math.inf and mx.values[1, 1].isnan()
    assert (mx.indices[0] == -1).all() and (mx.values[0] == -math.inf).all()
    s = twice_then("cumsum", x, 0, False, served_exclusive)
    assert served_exclusive
    assert s[1, 3] == 0 and math.copysign(1, s[1, 3].item()) == 1.0
    assert math.copysign(1, torch.cumsum(x[:1, 3], 0).item()) == 1.0
    lse = twice_then("logcumsumexp", x, 0, False, served_exclusive)
    assert served_exclusive
    assert lse[1, 0] == -math.inf and lse[1, 1].isnan() and lse[1, 2] == math.inf


def test_a_wide_input_keeps_one_start_element(served_exclusive):
    """Past 1 MiB of lanes the stored run holds one start element, as every run does
    (the kernel's exclusive mode shares it across lanes): the same values."""
    x = data("cumsum", (32, 2**18 + 8))
    out = twice_then("cumsum", x, 0, False, served_exclusive)
    assert on_kernel("cumsum", x, 0, False)
    assert [found.start.numel() for found in served_exclusive] == [1]
    check("cumsum", x, 0, False, out)


def kernel_exclusive(name, x, dim, reverse, threads):
    """The kernel's exclusive mode on ``x`` directly (whatever the route table picks), as
    the repeat route runs it: the kernel's exclusive variant."""
    from fscan._engines.cpp.cpu_kernel import (
        exclusive_ready,
        exclusive_run,
        prepare_run,
        run_exclusive_prepared,
    )
    from fscan._knowledge.store import knowledge
    from fscan._routing.cumulative import kernel_call
    from fscan._routing.exclusive import identity
    from fscan._routing.repeat_key import memo_reach

    op = getattr(torch, name)
    combine, spec, leaves, positions = kernel_call(op, x)
    cap = 1 if x.shape[dim] == x.numel() and threads == 1 else None
    with fscan.config.override(cpu_kernel="eager"):
        assert exclusive_ready(combine, spec, leaves, dim, positions)
    holder = knowledge(memo_reach(combine), spec, "pointwise", leaves)
    run = prepare_run(holder, (), leaves, dim, reverse, cap, positions, exclusive=True)
    assert run is not None
    start = torch.full((1,), identity(op, x.dtype), dtype=x.dtype)
    ys = run_exclusive_prepared(exclusive_run(run, start), x)
    return torch.return_types.cummax(ys) if name in BETTER else ys[0]


LENGTHS = [1, 2, 3, 16, 17, 33]
KERNEL_SHAPES = [  # (shape with T for the scanned dim, dim): every path of the kernel
    ((None, 40), 0),  # lanes (dim 0)
    ((5, None, 24), 1),  # lanes (a middle dim)
    ((40, None), 1),  # chains, tiled (float32, 16 and more lanes)
    ((3, None), 1),  # chains one by one
    ((None,), 0),  # one lane
]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize(("shape", "dim"), KERNEL_SHAPES, ids=[str(s) for s, _ in KERNEL_SHAPES])
@pytest.mark.parametrize("name", OPS)
def test_kernel_exclusive_mode_at_tile_and_block_edges(name, shape, dim, reverse, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in LENGTHS:
            x = data(name, tuple(n if s is None else s for s in shape), seed=n)
            for dtype in [torch.float32, torch.float64]:
                xd = x.to(dtype)
                before = xd.clone()
                check(name, xd, dim, reverse, kernel_exclusive(name, xd, dim, reverse, threads))
                assert torch.equal(xd, before)
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize("name", OPS)
def test_kernel_exclusive_mode_in_chunks_on_two_threads(name, reverse):
    """Chunked 1-D (the chain path's chunks and their carries), split lane-path columns
    and a few tiled lanes split into chunks, on 2 threads: the start value only in the
    first chunk of each lane."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for shape, dim in [((2**15 + 17,), 0), ((20001, 8), 0), ((4, 9000), 1), ((16, 5000), 1)]:
            x = data(name, shape, seed=2)
            check(name, x, dim, reverse, kernel_exclusive(name, x, dim, reverse, 2))
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("name", ["cumsum", "cummax"])
def test_kernel_exclusive_mode_on_long_skewed_chains(name):
    """8 chains of 8200 steps on one thread (float64, and cummax's pair: walked, not tiled),
    each walking SKEW steps ahead of the last (csrc/forward_chains.h: chains), their stores
    one step ahead of their inputs (the exclusive walk): the oracle, both directions."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = data(name, (8, 8200), seed=4).double()
        for reverse in [False, True]:
            check(name, x, 1, reverse, kernel_exclusive(name, x, 1, reverse, 1))
    finally:
        torch.set_num_threads(old)


def test_special_values_at_the_first_step_of_every_path():
    """NaN, inf and -0.0 at the first step in scan order, on the lanes, the tiles and the
    chains: the identity combined with them, as the drop-in's checked path gives."""
    for shape, dim in [((64, 256), 0), ((256, 64), 1), ((64,), 0)]:
        for reverse in [False, True]:
            x = torch.randn(shape)
            first = x.narrow(dim, shape[dim] - 1 if reverse else 0, 1).reshape(-1)
            first[:4] = torch.tensor([-math.inf, math.nan, math.inf, -0.0])[: first.numel()]
            for name in OPS:
                got = kernel_exclusive(name, x, dim, reverse, 1)
                want = getattr(fscan, name)(x.clone(), dim, reverse=reverse, exclusive=True)
                if name in BETTER:
                    assert torch.equal(got.indices, want.indices)
                    got, want = got.values, want.values
                torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-5, atol=1e-5)
                assert torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("name", OPS)
def test_non_contiguous_inputs(served_exclusive, name):
    """Transposed and sliced inputs (not the repeat route's: it takes contiguous ones),
    every dim, both directions: the oracle."""
    base = data(name, (70, 33, 20))
    for x in [base.transpose(0, 2), base[:, ::2], base[1:, :, 3:]]:
        for dim in range(3):
            for reverse in [False, True]:
                out = twice_then(name, x, dim, reverse, served_exclusive)
                check(name, x, dim, reverse, out)


@pytest.mark.parametrize("name", OPS)
def test_first_exclusive_call_runs_the_variant(fresh_eager_kernel, runs_of, name):
    """In mode "eager" the first exclusive call of a shape builds the kernel's exclusive
    variant and runs it (not the shift), after an inclusive call or without one: the
    oracle, both directions."""
    from fscan._routing import exclusive as router

    runs = runs_of("run_exclusive", router)
    for shape, dim in [((512, 64), 0), ((300, 40), 1)]:
        for reverse in [False, True]:
            for inclusive_first in [True, False]:
                fscan.clear_caches()
                x = data(name, shape, seed=3)
                op = getattr(fscan, name)
                if inclusive_first:
                    op(x, dim, reverse=reverse)
                before = len(runs)
                out = op(x, dim, reverse=reverse, exclusive=True)
                check(name, x, dim, reverse, out)
                assert len(runs) == before + on_kernel(name, x, dim, reverse)


def test_only_the_drop_ins_kernels_compile_the_exclusive_mode():
    """One read leaf and no params (the exclusive drop-ins' kernels) may be built as the
    exclusive variant; a pair's kernel, or one with captured params, may not
    (forward_source refuses), and exclusive_run refuses a run of an ordinary kernel (it
    would scan inclusively)."""
    from types import SimpleNamespace

    from fscan._engines.cpp._cpp_source import compiles_exclusive, forward_source
    from fscan._engines.cpp.cpu_kernel import PreparedRun, exclusive_run

    assert compiles_exclusive(1, SimpleNamespace(params=()))
    assert not compiles_exclusive(2, SimpleNamespace(params=()))
    assert not compiles_exclusive(1, SimpleNamespace(params=(object(),)))
    with pytest.raises(ValueError, match="exclusive"):
        forward_source((torch.float32,) * 2, SimpleNamespace(params=()), exclusive=True)
    run = PreparedRun(None, SimpleNamespace(params=()), (), (1, 4, 1, 0), (0, 0))
    with pytest.raises(ValueError, match="exclusive variant"):
        exclusive_run(run, torch.zeros(1))
