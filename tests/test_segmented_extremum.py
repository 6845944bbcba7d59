"""cummax/cummin's segmented walk without branches on the data (``SEG_EXTREMUM``:
``extremum_step`` and ``extremum_blocks`` in
fscan/_engines/cpp/csrc/extremum.h): the combine is
recognised from its translation, and the walk (a max/min and a conditional move or mask,
NaN on a branch of its own) gives what torch's ``>=`` / ``<=`` and NaN rules give: ties to
the later step (+0/-0 included, by the sign), a NaN kept until the next restart (a later
NaN taking its index), each type's extremes (-inf / +inf, an integer type's lowest and
highest) as data, restarts at the first step, at every step or nowhere, both
directions, 1-3 threads (the chain path's chunks), every dtype the kernel takes."""

from __future__ import annotations

import pytest
import torch
from helpers import torch_threads
from test_segmented_kernel import mask, oracle, run

import fscan
from fscan._engines.cpp._cpp_codegen import TraceInput, translate_combine
from fscan._engines.cpp._cpp_tiles import extremum
from fscan._engines.cpp._kernel_segmented import segmented_source
from fscan._routing.cumulative import kernel_call, path

EXTREMA = {"cummax": torch.cummax, "cummin": torch.cummin}
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def walked(name, x, dim, reset, reverse):
    """The walk along ``dim`` in x's own dtype, a step at a time (torch's compares: no
    rounding through float64, so an integer type's extremes stay apart)."""
    x = x.movedim(dim, 0)
    n = x.shape[0]
    flags = reset.expand(x.movedim(0, dim).shape).movedim(dim, 0) if reset.ndim > 1 else reset
    values, indices = torch.empty_like(x), torch.zeros(x.shape, dtype=torch.int64)
    acc = idx = None
    for step, t in enumerate(range(n - 1, -1, -1) if reverse else range(n)):
        restart = flags[t] if flags.ndim > 1 else flags[t].expand(x.shape[1:])
        if step == 0:
            acc, idx = x[t].clone(), torch.full(x.shape[1:], t)
        else:
            beats = x[t] >= acc if name == "cummax" else x[t] <= acc
            take = restart | beats | torch.isnan(x[t])
            acc, idx = torch.where(take, x[t], acc), torch.where(take, t, idx)
        values[t], indices[t] = acc, idx
    return values.movedim(0, dim), indices.movedim(0, dim)


def same(got, want):
    """Values bit for bit but NaN's payload (a zero's sign included), indices exactly."""
    values, indices = want
    torch.testing.assert_close(got[1], indices, rtol=0, atol=0)
    g, w = got[0], values.to(got[0].dtype)
    if g.is_floating_point():
        nan = torch.isnan(g)
        assert torch.equal(nan, torch.isnan(w))
        assert torch.equal(torch.signbit(g[~nan]), torch.signbit(w[~nan]))
        g, w = g[~nan], w[~nan]
    assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extremum_recognises_the_drop_ins_combines(dtype):
    x = torch.zeros(4, dtype=dtype)
    for name, sign in (("cummax", 1), ("cummin", -1)):
        combine, spec, leaves, positions = kernel_call(EXTREMA[name], x)
        dtypes = [leaf.dtype for leaf in leaves]
        program = translate_combine(TraceInput(combine, spec, dtypes, (), ()))
        assert extremum(program, positions) == sign
        assert f"SEG_EXTREMUM = {sign};" in segmented_source(dtypes, program, positions)


def _strict_max(left, right):  # earlier ties win: not torch's cummax
    take = (right[0] > left[0]) | torch.isnan(right[0])
    return torch.where(take, right[0], left[0]), torch.where(take, right[1], left[1])


def _no_nan_rule(left, right):  # NaN not taken over
    take = right[0] >= left[0]
    return torch.where(take, right[0], left[0]), torch.where(take, right[1], left[1])


def _index_first(left, right):  # (index, value): the pair the other way round
    take = (right[1] >= left[1]) | torch.isnan(right[1])
    return torch.where(take, right[0], left[0]), torch.where(take, right[1], left[1])


def test_extremum_refuses_other_combines():
    """Selects that are not torch's cummax/cummin walk with the combine itself."""
    x = torch.zeros(4)
    combine, spec, _, positions = kernel_call(torch.cummax, x)
    f32 = [torch.float32, torch.int64]
    for fn in (_strict_max, _no_nan_rule):
        program = translate_combine(TraceInput(fn, spec, f32, (), ()))
        assert extremum(program, positions) == 0
    program = translate_combine(
        TraceInput(_index_first, spec, [torch.int64, torch.float32], (), ())
    )
    assert extremum(program, (0,)) == 0
    program = translate_combine(TraceInput(combine, spec, f32, (), ()))
    assert extremum(program, ()) == 0  # the index read, not made by the kernel
    _, spec1, _, _ = kernel_call(torch.cumsum, x)
    program = translate_combine(TraceInput(torch.maximum, spec1, [torch.float32], (), ()))
    assert extremum(program, ()) == 0


def _data(dtype, shape, seed):
    """Few distinct values (ties), and each type's extremes and specials among them."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.3
    x = torch.randint(-3, 4, shape, generator=gen)
    if dtype == torch.uint8:
        x = x + 3
    x = x.to(dtype)
    flat, n = x.view(-1), x.numel()
    if dtype.is_floating_point:
        pick = torch.randint(0, n, (max(1, n // 40),), generator=gen)
        specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
        flat[pick] = specials[torch.arange(pick.numel()) % 5].to(dtype)
    else:
        info = torch.iinfo(dtype)
        pick = torch.randint(0, n, (max(1, n // 30),), generator=gen)
        flat[pick] = torch.tensor([info.min, info.max])[torch.arange(pick.numel()) % 2].to(dtype)
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["cummax", "cummin"])
def test_walk_matches_torch_rules_every_dtype(dtype, name):
    """1-D and lanes along T (the chain path), both directions, restarts every few steps,
    at every step, at none; the first and last steps flagged."""
    for seed, (shape, dim) in enumerate([((301,), 0), ((7, 67), 1), ((67, 3), 0)]):
        x = _data(dtype, shape, seed)
        n = shape[dim]
        resets = [
            mask(n, 0.15, seed) | (torch.arange(n) == 0) | (torch.arange(n) == n - 1),
            mask(shape, 0.1, seed),
            torch.ones(n, dtype=torch.bool),
            torch.zeros(n, dtype=torch.bool),
        ]
        for reset in resets:
            for reverse in (False, True):
                got = run(name, x, dim, reset, reverse)
                same(got, walked(name, x, dim, reset, reverse))


@pytest.mark.parametrize("name", ["cummax", "cummin"])
def test_nan_and_signed_zeros_at_heads_and_restarts(name):
    """NaN at a chain's first step, just after and just before a restart, two NaN in a row
    (the later one's index), the identity (-inf for cummax, +inf for cummin) right after a
    restart and as the first element; +0 then -0 (the later sign)."""
    nan, inf = float("nan"), float("inf")
    big = inf if name == "cummin" else -inf
    rows = [
        ([nan, 1.0, 2.0, nan, 5.0, nan, nan, 0.0], [0, 0, 1, 0, 1, 0, 0, 0]),
        ([1.0, nan, 3.0, 2.0, big, big, 0.0, big], [0, 0, 1, 0, 1, 0, 1, 0]),
        ([big, big, 0.0, -0.0, 0.0, -0.0, nan, 1.0], [0, 0, 0, 0, 1, 0, 0, 1]),
        ([-0.0, 0.0, -0.0, 1.0, nan, inf, -inf, nan], [0, 0, 1, 0, 0, 0, 0, 0]),
    ]
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for values, flags in rows:
            x = torch.tensor(values, dtype=dtype)
            reset = torch.tensor(flags, dtype=torch.bool)
            for reverse in (False, True):
                same(run(name, x, 0, reset, reverse), walked(name, x, 0, reset, reverse))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [32767, 40960, 40961, 65537])
@pytest.mark.parametrize("name", ["cummax", "cummin"])
def test_chunked_lanes_around_chunk_sizes(threads, n, name):
    """One long lane, on 1-3 threads (split into chunks of at least 2048 steps, skewed by
    16, whose totals compose): restarts at the chunks' edges, a chunk without any, ties and
    NaN across the edges; the float64 padded-table oracle (cummin: cummax of -x)."""
    gen = torch.Generator().manual_seed(n + threads)
    x = torch.randint(-3, 4, (n,), generator=gen).float()
    x[torch.rand(n, generator=gen) < 0.001] = float("nan")
    t = torch.arange(n)
    reset = ((t % 2048 == 0) | (t % 2048 == 2047) | (t % 97 == 13)) & ((t < 8192) | (t > 20000))
    with torch_threads(threads):
        for reverse in (False, True):
            got = run(name, x, 0, reset, reverse, threads)
            sign = 1.0 if name == "cummax" else -1.0
            values, indices = oracle("cummax", sign * x, 0, reset, reverse)
            torch.testing.assert_close(got[1], indices, rtol=0, atol=0)
            torch.testing.assert_close(got[0].double(), sign * values, equal_nan=True)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", ["cummax", "cummin"])
def test_dense_float32_blocks_and_their_carries(name, reverse):
    """Dense float32 chains go 16 steps a vector where AVX-512 is compiled in
    (``extremum_blocks``: blocks of steps [1, 17), [17, 33), ..., then the rest a step at
    a time): chains of 16-50 steps; restarts on a block's first and last lanes and their
    neighbours, at random, per lane; ties everywhere (the later wins, across the carry
    too), a first element beyond all the rest (the carry wins every lane), zeros of both
    signs, a NaN inside a block (walked a step at a time) carried into the next blocks;
    and the same data strided (the walk a step at a time) against the same oracle."""
    gen = torch.Generator().manual_seed(5)
    sign = 1.0 if name == "cummax" else -1.0
    for n in (16, 17, 18, 32, 33, 34, 49, 50):
        t = torch.arange(n)
        x = torch.randint(-2, 3, (5, n), generator=gen).float()
        x[1, 0 if not reverse else -1] = 9.0 * sign
        x[2] = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0, -0.0)
        x[3, n // 2] = float("nan")
        x[4] = torch.rand(n, generator=gen)
        resets = [
            torch.zeros(n, dtype=torch.bool),
            t % 16 == 1,
            t % 16 == 0,
            (t % 16 == 2) | (t % 16 == 15),
            torch.rand(n, generator=gen) < 0.2,
            torch.rand((5, n), generator=gen) < 0.1,
        ]
        strided = torch.stack([x, x + 1], -1)[..., 0]
        assert strided.stride(1) == 2
        for reset in resets:
            want = walked(name, x, 1, reset, reverse)
            same(run(name, x, 1, reset, reverse), want)
            same(run(name, strided, 1, reset, reverse), want)


@pytest.mark.parametrize("name", ["cummax", "cummin"])
def test_forward_kernel_blocks_inclusive_and_exclusive(name):
    """The forward kernel's lone chains (cummax/cummin walked one at a time from
    ``WALK_FROM`` steps) take the same 16-step blocks, inclusive and exclusive (the blocks
    write through the outputs shifted a step): reversed lanes of 128-161 steps and a
    forward 1-D row of 2**17 + 5 (both the kernel's cells), ties, signed zeros, a first
    element beyond the rest, NaN; against the step walk's oracle, shifted for exclusive."""
    gen = torch.Generator().manual_seed(11)
    sign = 1.0 if name == "cummax" else -1.0
    cases = [((1024, n), 1, True) for n in (128, 129, 143, 144, 145, 161)]
    cases.append(((2**17 + 5,), 0, False))
    op = getattr(fscan, name)
    for shape, dim, reverse in cases:
        n = shape[dim]
        x = torch.randint(-2, 3, shape, generator=gen).float()
        rows = x.view(-1, n) if dim == len(shape) - 1 else x.view(1, -1)
        rows[0, -1 if reverse else 0] = 9.0 * sign
        if rows.shape[0] > 1:
            rows[1] = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0, -0.0)
            rows[2, n // 3] = float("nan")
        else:
            rows[0, 1000::40000] = float("nan")
        none = torch.zeros(n, dtype=torch.bool)
        values, indices = walked(name, x, dim, none, reverse)
        with fscan.config.override(cpu_kernel="eager"):
            got = op(x, dim, reverse=reverse)
            shifted = op(x, dim, reverse=reverse, exclusive=True)
        assert path(getattr(torch, name), x, dim, reverse) == "cpp"
        same(got, (values, indices))
        at, source = (0, 1) if reverse else (1, 0)  # output step t holds step t -+ 1's
        same(
            tuple(y.narrow(dim, at, n - 1) for y in shifted),
            (values.narrow(dim, source, n - 1), indices.narrow(dim, source, n - 1)),
        )
        first = n - 1 if reverse else 0
        assert (shifted[1].select(dim, first) == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int32])
@pytest.mark.parametrize("name", ["cummax", "cummin"])
def test_lane_path_restarts_join_the_combine(name, dtype):
    """Lanes side by side (the scanned dim not the last: the lane path, a row of lanes a
    step) take a restart inside the combine's own select (``restarted`` in
    csrc/segmented.h): flagged lanes take their element, a NaN element is taken (and kept
    until the lane's next restart), ties go to the later step, zeros keep their sign; masks
    per lane, per row and broadcast over a middle dim, rows of 1-200 lanes (the byte loop's
    64-lane blocks and the widened int32 flags of a reversed row over more than one), both
    directions."""
    gen = torch.Generator().manual_seed(11)
    for shape, dim in [
        ((40, 200), 0),
        ((33, 64), 0),
        ((9, 6, 70), 1),
        ((30, 1), 0),
        ((7, 3, 5), 0),
    ]:
        x = torch.randint(-2, 3, shape, generator=gen).to(dtype)
        if dtype.is_floating_point:
            x[torch.rand(shape, generator=gen) < 0.03] = float("nan")
            zeros = torch.rand(shape, generator=gen) < 0.1
            x[zeros] = torch.where(torch.rand(shape, generator=gen) < 0.5, 0.0, -0.0)[zeros].to(
                dtype
            )
        n = shape[dim]
        per_row = [1] * len(shape)
        per_row[dim] = n
        resets = [
            torch.rand(shape, generator=gen) < 0.15,
            (torch.rand(per_row, generator=gen) < 0.3).expand(shape),
            torch.zeros(shape, dtype=torch.bool),
        ]
        if len(shape) == 3:  # one flag per (outer, step), broadcast over the last dim
            resets.append((torch.rand((*shape[:2], 1), generator=gen) < 0.2).expand(shape))
        for reset in resets:
            for reverse in (False, True):
                same(run(name, x, dim, reset, reverse), walked(name, x, dim, reset, reverse))
