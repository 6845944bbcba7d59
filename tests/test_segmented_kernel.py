"""The segmented C++ kernel (``reset=`` in one pass: fscan/_engines/cpp/csrc/segmented.h)
against a sequential float64 oracle, on each of its paths: the lane path with a flag per
row (1-D masks), a flag per lane (dense or strided masks), split into chunks for threads;
the chain path (lanes along T, or too few: csrc/segmented_chains.h), interleaved, tiled
(logcumsumexp, an expensive combine), and split into chunks whose totals start at their
last restart."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import torch_threads

import fscan
from fscan._engines.cpp._kernel_segmented import (
    kernel_segmented,
    prepare_segmented,
    run_segmented_prepared,
)
from fscan._routing.cumulative import kernel_call

OPS = {
    "cumsum": torch.cumsum,
    "cumprod": torch.cumprod,
    "cummax": torch.cummax,
    "logcumsumexp": torch.logcumsumexp,
}


def oracle(name, x, dim, reset, reverse):
    """In float64, each segment a walk of its own: torch's op (on CPU a sequential loop along
    a row: the walk's order, bit for bit for cumsum and cumprod) over every segment as a row
    of a padded table; cummax's indices are positions in the whole input (later ties win,
    as torch). (A loop over the steps in Python cost ~2 s a test on 40960 steps.)"""
    x = x.movedim(dim, 0).double()
    n = x.shape[0]
    if reset.ndim > 1:
        flags = reset.expand(x.movedim(0, dim).shape).movedim(dim, 0)
    else:
        flags = reset.reshape(n, *[1] * (x.ndim - 1)).expand(x.shape)
    if reverse:  # scan order
        x, flags = x.flip(0), flags.flip(0)
    lanes = x.reshape(n, -1).t().reshape(-1)  # lane by lane, each in scan order
    starts = flags.reshape(n, -1).t().clone()
    starts[:, 0] = True
    starts = starts.reshape(-1)
    seg = torch.cumsum(starts.long(), 0) - 1  # each element's segment
    first = torch.nonzero(starts).squeeze(1)  # each segment's first element
    pos = torch.arange(lanes.numel()) - first[seg]
    fill = {"cumsum": 0.0, "cumprod": 1.0}.get(name, float("-inf"))  # after the segment
    table = torch.full((first.numel(), int(pos.max()) + 1), fill, dtype=torch.float64)
    table[seg, pos] = lanes
    if name == "cummax":
        values, at = torch.cummax(table, 1)
        steps = (first % n)[seg] + at[seg, pos]  # scan order
        indices = n - 1 - steps if reverse else steps
    else:
        values = getattr(torch, name)(table, 1)
        indices = torch.zeros(lanes.shape, dtype=torch.int64)
    shape = (x.reshape(n, -1).shape[1], n)
    values = values[seg, pos].reshape(shape).t().reshape(x.shape)
    indices = indices.reshape(shape).t().reshape(x.shape)
    if reverse:
        values, indices = values.flip(0), indices.flip(0)
    return values.movedim(0, dim), indices.movedim(0, dim)


def walked_oracle(name, x, dim, reset, reverse):
    """The walk along ``dim`` in float64, a step at a time (what :func:`oracle` must equal)."""
    x = x.movedim(dim, 0).double()
    flags = reset.expand(x.movedim(0, dim).shape).movedim(dim, 0) if reset.ndim > 1 else reset
    n = x.shape[0]
    values, indices = torch.empty_like(x), torch.zeros(x.shape, dtype=torch.int64)
    order = range(n - 1, -1, -1) if reverse else range(n)
    acc = idx = None
    for step, t in enumerate(order):
        restart = flags[t] if flags.ndim > 1 else flags[t].expand(x.shape[1:])
        if step == 0:
            acc, idx = x[t].clone(), torch.full(x.shape[1:], t)
        elif name == "cumsum":
            acc = torch.where(restart, x[t], acc + x[t])
        elif name == "cumprod":
            acc = torch.where(restart, x[t], acc * x[t])
        elif name == "logcumsumexp":
            acc = torch.where(restart, x[t], torch.logaddexp(acc, x[t]))
        else:
            take = restart | (x[t] >= acc) | torch.isnan(x[t])
            acc, idx = torch.where(take, x[t], acc), torch.where(take, t, idx)
        values[t], indices[t] = acc, idx
    return values.movedim(0, dim), indices.movedim(0, dim)


def run(name, x, dim, reset, reverse, threads=None):
    """The segmented kernel's (values, indices) of torch op ``name`` (any drop-in's, cummin
    included) over ``x`` along ``dim``, built eagerly."""
    combine, spec, leaves, positions = kernel_call(getattr(torch, name), x)
    if reset.ndim == 1:
        reset = reset.reshape([-1 if d == dim else 1 for d in range(x.ndim)])
    with fscan.config.override(cpu_kernel="eager"):
        got = kernel_segmented(
            combine, spec, leaves, dim, reverse, reset.expand(x.shape), positions, threads
        )
    assert got is not None
    return got


def check(name, x, dim, reset, reverse, threads=None):
    got = run(name, x, dim, reset, reverse, threads)
    values, indices = oracle(name, x, dim, reset, reverse)
    assert got[0].is_contiguous() and got[0].shape == x.shape
    tol = {"rtol": 1e-5, "atol": 1e-5} if x.dtype == torch.float32 else {}
    torch.testing.assert_close(got[0].double(), values, equal_nan=True, **tol)
    if name == "cummax":
        torch.testing.assert_close(got[1], indices)


def mask(shape, p=0.1, seed=1):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < p


@pytest.mark.parametrize("name", list(OPS))
def test_the_oracle_is_the_walk(name):
    """The padded-table oracle equals the step-by-step walk (bit for bit but logcumsumexp):
    row and element flags, both directions, ties (cummax: later wins), inf and NaN."""
    for seed, (shape, dim) in enumerate([((13, 7), 0), ((5, 40), 1), ((4, 9, 3), 1), ((50,), 0)]):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randint(-3, 4, shape, generator=gen).double()
        x.view(-1)[::11] = float("nan") if name == "cummax" else x.view(-1)[::11]
        x.view(-1)[5::13] = float("inf")
        for reset in (mask(shape[dim], 0.2, seed), mask(shape, 0.2, seed)):
            for reverse in (False, True):
                want = walked_oracle(name, x, dim, reset, reverse)
                got = oracle(name, x, dim, reset, reverse)
                exact = {} if name == "logcumsumexp" else {"rtol": 0, "atol": 0}
                torch.testing.assert_close(got[0], want[0], equal_nan=True, **exact)
                if name == "cummax":
                    torch.testing.assert_close(got[1], want[1])


# (shape, dim): the lane path with many columns; a middle dim; few columns (chunks for
# threads); the chain path over the last dim (many lanes, interleaved) and 1-D (chunks).
LAYOUTS = [((300, 40), 0), ((20, 33, 24), 1), ((6000, 16), 0), ((40, 301), 1), ((9001,), 0)]


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("shape,dim", LAYOUTS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("flags", ["row", "element"])
def test_matches_the_walk(name, shape, dim, reverse, flags):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    if name == "cumprod":
        x = x * 0.1 + 1.0
    reset = mask(shape[dim]) if flags == "row" else mask(shape)
    if flags == "row":
        reset[0] = reset[5:8] = True  # the first step, and consecutive resets
    check(name, x, dim, reset, reverse)


@pytest.mark.parametrize("name", ["cumsum", "cummax", "logcumsumexp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,dim", [((50, 200), 0), ((30, 2, 130), 1), ((40, 64), 0)])
@pytest.mark.parametrize("threads", [1, 2])
def test_element_flags_reversed_over_wide_rows(name, dtype, shape, dim, threads):
    """A flag per lane, reversed, over rows of 64 lanes and more: the loop that reads the
    flags walks a row in descending blocks of 64 lanes (FLAG_LANES, csrc/segmented.h), then
    the lanes left below them; rows of 200, 130 and 64 lanes leave 8, 2 and 0 of them.
    Where a lane moves 16 bytes or more (cummax's pairs, float64: WIDE_FLAGS) rows of more
    than 64 lanes read the flags widened to int32, in blocks of LANE_BLOCK lanes."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    check(name, x, dim, mask(shape, 0.05, seed=4), True, threads)
    check(name, x, dim, mask(shape, 0.05, seed=4), False, threads)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape,dim", [((6000, 16), 0), ((9001,), 0), ((3, 5000), 1)])
@pytest.mark.parametrize("flags", ["row", "element", "none", "sparse"])
def test_chunks_for_threads(threads, shape, dim, flags):
    """Chunk totals compose in order except across a chunk that restarts a lane: flags in
    some chunks only, none at all, and every lane of a chunk."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    n = shape[dim]
    if flags == "row":
        reset = mask(n, 0.3)
    elif flags == "element":
        reset = mask(shape, 0.001)
    elif flags == "none":
        reset = torch.zeros(n, dtype=torch.bool)
    else:  # one restart in the middle of the scan only
        reset = torch.zeros(n, dtype=torch.bool)
        reset[n // 2 + 1] = True
    with torch_threads(threads):
        for reverse in (False, True):
            check("cumsum", x, dim, reset, reverse, threads)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("name", ["cumsum", "cummax"])
@pytest.mark.parametrize("flags", ["row", "element"])
def test_restarts_at_and_inside_chunk_boundaries(threads, name, flags):
    """(6000, 16) dim 0 on 2 or 3 threads: one column split into threads + 1 chunks of
    2000 or 1500 steps (csrc/tuning.h lane_columns), the first scanned while the others'
    totals are taken. Restarts on a chunk's first step, on its last, and inside one (for
    element flags, in some lanes only: the others compose through)."""
    x = torch.randn(6000, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    steps = [1499, 1500, 2000, 2345, 3000, 3999, 4500]  # scan order
    with torch_threads(threads):
        for reverse in (False, True):
            at = [5999 - s if reverse else s for s in steps]
            if flags == "row":
                reset = torch.zeros(6000, dtype=torch.bool)
                reset[at] = True
            else:
                reset = torch.zeros(6000, 16, dtype=torch.bool)
                reset[at, ::3] = True
            check(name, x, 0, reset, reverse, threads)


# Lengths around the chain path's tiles (16 steps of 16 chains) and groups (8 walked):
# no whole tile, one, one and a step, several and a remainder.
CHAIN_LENGTHS = [2, 15, 16, 17, 33, 255, 257]


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("steps", CHAIN_LENGTHS)
@pytest.mark.parametrize("reverse", [False, True])
def test_chain_path_lengths(name, steps, reverse):
    """37 lanes along the last dim: two whole groups of 16 (tiles, for logcumsumexp) or
    twelve of 3 (walked; cummax's one by one), then the last lane alone; flags at the first and
    last steps, two adjacent ones, and a flag per lane elsewhere."""
    gen = torch.Generator().manual_seed(steps)
    x = torch.randn(37, steps, generator=gen, dtype=torch.float64)
    if name == "cumprod":
        x = x * 0.1 + 1.0
    reset = mask((37, steps), 0.05, seed=steps)
    reset[:, 0] = reset[3, -1] = True
    reset[5, steps // 2 : steps // 2 + 2] = True
    check(name, x, 1, reset, reverse)


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("flags", ["edges", "none", "all", "first", "last", "sparse"])
def test_one_lane_in_chunks(name, threads, flags):
    """One lane (1-D) split into chunks, 8 or 16 per thread: a chunk's total starts at its
    last restart, or composes with the chunks before where it has none. "edges": a flag
    on every step next to a multiple of 16 (the chunks' lengths are multiples of 16, so
    every chunk starts and ends on one, both ways: 40960 = 16 * 2560)."""
    n = 40960
    x = torch.randn(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    if name == "cumprod":
        x = x * 0.001 + 1.0
    t = torch.arange(n)
    reset = {
        "edges": (t % 16 == 0) | (t % 16 == 15),
        "none": torch.zeros(n, dtype=torch.bool),
        "all": torch.ones(n, dtype=torch.bool),
        "first": t == 0,
        "last": t == n - 1,
        "sparse": t % 4099 == 7,
    }[flags]
    with torch_threads(threads):
        for reverse in (False, True):
            check(name, x, 0, reset, reverse, threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
@pytest.mark.parametrize("dim", [0, 1])
def test_dtypes_on_both_paths(dtype, dim):
    """dim 0: the lane path; dim 1 (24 lanes along their steps): the chain path."""
    x = (torch.randn(500, 24) * 4).to(dtype)
    if dim == 1:
        x = x.t().contiguous()
    names = ["cumsum", "cummax"] + ["logcumsumexp"] * dtype.is_floating_point
    for name in names:
        reset = mask(500)
        got = run(name, x, dim, reset, False)
        values, indices = oracle(name, x, dim, reset, False)
        assert got[0].dtype == dtype
        if name == "cummax" and dtype != torch.bfloat16:  # bfloat16 ties from rounding
            torch.testing.assert_close(got[1], indices)
        torch.testing.assert_close(got[0], values.to(dtype), atol=0.1, rtol=0.02)


def test_strided_inputs_and_masks():
    base = torch.randn(64, 80, dtype=torch.float64)
    for x, dim in [(base.t(), 0), (base[:, ::2], 0), (base[::3], 1)]:
        for reset in (mask(x.shape[dim]), mask(x.shape).t().contiguous().t()):
            check("cumsum", x, dim, reset, False)
            check("cummax", x, dim, reset, True)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    "shape,mask_shape,dim",
    [
        ((3, 301, 40), (3, 301, 1), 1),  # a (batch, T) mask over features: a flag a row
        ((301, 40), (301, 1), 0),
        ((4, 301, 5, 8), (4, 301, 5, 1), 1),  # shared by some lanes only
        ((3, 301, 40), (3, 301, 80), 1),  # every other lane of a wider mask: strided flags
        ((2, 301, 100), (2, 301, 200), 1),  # the same over rows of more than 64 lanes
    ],
)
def test_masks_shared_by_lanes_or_strided_on_the_lane_path(threads, shape, mask_shape, dim):
    """Masks broadcast over the lanes of each outer index (one flag for a row's lanes,
    R.si == 0, whatever the outer strides) and masks whose lanes are strided (gathered into
    adjacent bytes a row at a time), on the lane path, split into chunks on threads."""
    gen = torch.Generator().manual_seed(threads + len(shape) + mask_shape[-1])
    x = torch.randn(shape, dtype=torch.float64, generator=gen)
    reset = torch.rand(mask_shape, generator=gen) < 0.05
    if mask_shape[-1] == 2 * shape[-1]:
        reset = reset[..., ::2]
    with torch_threads(threads):
        for reverse in (False, True):
            for name in ("cumsum", "cummax"):
                check(name, x, dim, reset, reverse, threads)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape,dim", [((9001,), 0), ((37, 301), 1), ((5, 4099), 1)])
def test_cummax_chains_walked_alone_ties_and_nan(threads, shape, dim):
    """cummax's chains (a position leaf) are walked one at a time, 1-D in one pass on
    one thread, in chunks on more: ties (later wins), NaN (kept until a reset), flags at
    the first and last steps and on both sides of every 16th step (the chunks' edges)."""
    gen = torch.Generator().manual_seed(shape[-1] + threads)
    x = torch.randint(-3, 4, shape, generator=gen).double()
    x[torch.rand(shape, generator=gen) < 0.002] = float("nan")
    t = torch.arange(shape[dim])
    reset = (t % 16 == 0) | (t % 16 == 15) | (t % 97 == 13) | (t == shape[dim] - 1)
    with torch_threads(threads):
        for reverse in (False, True):
            check("cummax", x, dim, reset, reverse, threads)


def test_nan_and_inf_before_a_reset_do_not_reach_the_next_segment():
    x = torch.tensor([1.0, float("nan"), 2.0, float("inf"), 3.0, 4.0], dtype=torch.float64)
    reset = torch.tensor([False, False, True, False, True, False])
    got = run("cumsum", x, 0, reset, False)[0]
    assert torch.equal(got[2:3], torch.tensor([2.0], dtype=torch.float64))
    assert torch.equal(got[4:], torch.tensor([3.0, 7.0], dtype=torch.float64))
    got = run("cumprod", x.expand(20, 6).t(), 0, reset, False)[0]  # the lane path
    assert torch.equal(got[4:, 0], torch.tensor([3.0, 12.0], dtype=torch.float64))


def test_the_drop_ins_take_it_and_log_it(caplog):
    x, reset = torch.randn(300, 40), mask(300)
    with fscan.config.override(cpu_kernel="eager"), caplog.at_level("DEBUG", logger="fscan"):
        fscan.cumsum(x, 0, reset=reset)  # builds
        caplog.clear()
        got = fscan.cummin(x, 0, reset=reset, reverse=True)
    engines = [
        r.fscan_engine for r in caplog.records if getattr(r, "fscan_api", "") == "fscan.cummin"
    ]
    assert engines == ["cpp"]
    values, _ = oracle("cummax", -x, 0, reset, True)
    torch.testing.assert_close(got.values.double(), -values)


def test_gradients_take_the_pairs_scan(caplog):
    x = torch.randn(300, 40, dtype=torch.float64, requires_grad=True)
    reset = mask(300)
    with fscan.config.override(cpu_kernel="eager"), caplog.at_level(logging.DEBUG, logger="fscan"):
        out = fscan.cumsum(x, 0, reset=reset)
    assert out.grad_fn is not None
    segments = torch.cumsum(reset.long(), 0)
    grad = torch.autograd.grad(out.sum(), x)[0]
    # d(sum of a segment's running sums)/dx[t] = the steps left in t's segment from t.
    n = 300
    left = torch.tensor(
        [int(((segments == segments[t]) & (torch.arange(n) >= t)).sum()) for t in range(n)]
    )
    torch.testing.assert_close(grad, left[:, None].double().expand(n, 40))


def _affine(p, q):
    return (p[0] * q[0], q[0] * p[1] + q[1])


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("flags", ["row", "element"])
def test_associative_scan_takes_it_and_explain_agrees(reverse, flags, caplog):
    gen = torch.Generator().manual_seed(3)
    a = torch.rand(200, 24, generator=gen, dtype=torch.float64) * 0.5 + 0.5
    b = torch.randn(200, 24, generator=gen, dtype=torch.float64)
    reset = mask(200) if flags == "row" else mask((200, 24))
    with fscan.config.override(cpu_kernel="eager"):
        fscan.associative_scan(_affine, (a, b), 0, reverse, reset=reset)  # builds
        report = fscan.explain(_affine, (a, b), 0, reverse, reset=reset)
        with caplog.at_level("DEBUG", logger="fscan"):
            got = fscan.associative_scan(_affine, (a, b), 0, reverse, reset=reset)
    assert report.engine == "cpp"
    (record,) = [r for r in caplog.records if getattr(r, "fscan_api", "") == SCAN]
    assert record.fscan_engine == "cpp"
    with fscan.config.override(cpu_kernel="off"):
        want = fscan.associative_scan(_affine, (a, b), 0, reverse, reset=reset)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


SCAN = "fscan.associative_scan"


def test_associative_scan_checks_combine_fn_before_the_kernel():
    """The kernel never calls combine_fn: a combine that mixes elements fails on the
    first call's check, as on the scan without a mask."""
    x, reset = torch.randn(64, 8), mask(64)
    mixing = lambda p, q: p + q.flip(0)  # reverses the batch of elements
    with fscan.config.override(cpu_kernel="eager"), pytest.raises(fscan.NotElementwiseError):
        fscan.associative_scan(mixing, x, 0, reset=reset)


def test_associative_scan_with_gradients_takes_the_pairs():
    a = torch.rand(50, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, 4, dtype=torch.float64, requires_grad=True)
    reset = mask(50, 0.2)
    with fscan.config.override(cpu_kernel="eager"):
        report = fscan.explain(_affine, (a, b), 0, reset=reset)
        assert report.engine != "cpp" and "gradients" in report.refused["cpp"]
        scan = lambda a, b: fscan.associative_scan(_affine, (a, b), 0, reset=reset)[1]
        assert torch.autograd.gradcheck(scan, (a, b))


# ---- the prepared run the repeat route reruns ---------------------------------------


def _prepared_masks(shape, dim):
    n = shape[dim]
    lanes = [1] * len(shape)
    lanes[dim] = n
    full = torch.rand(shape) < 0.1
    return {
        "1-D": torch.rand(n) < 0.1,
        "full": full,
        "broadcast": torch.rand(lanes) < 0.1,
        "full, transposed": (torch.rand(tuple(reversed(shape))) < 0.1).permute(
            *reversed(range(len(shape)))
        ),
    }


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("kind", ["1-D", "full", "broadcast", "full, transposed"])
@pytest.mark.parametrize(("shape", "dim", "reverse"), [((96, 40), 0, True), ((6, 96, 5), 1, False)])
def test_a_prepared_run_matches_the_kernel_call(name, kind, shape, dim, reverse):
    """prepare_segmented's run, on a new mask of the same shape and strides, gives what
    kernel_segmented gives for it (bitwise: the same kernel on the same layout), or is
    None where the layout copies the mask (the stored strides would not describe the
    next mask's memory)."""
    x = torch.randn(shape)
    first, second = _prepared_masks(shape, dim)[kind], _prepared_masks(shape, dim)[kind]
    combine, spec, leaves, positions = kernel_call(OPS[name], x)
    flags = lambda r: r if r.ndim == 1 else r.expand(shape)
    with fscan.config.override(cpu_kernel="eager"):
        assert kernel_segmented(combine, spec, leaves, dim, reverse, flags(first), positions)
        prepared = prepare_segmented(combine, spec, leaves, dim, reverse, first, positions)
        if prepared is None:  # only a mask the layout copies
            assert kind == "full, transposed"
            return
        got = run_segmented_prepared(prepared, x, second)
        want = kernel_segmented(combine, spec, leaves, dim, reverse, flags(second), positions)
    assert want is not None and len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.equal(g, w) and g.is_contiguous()
    values, indices = oracle(name, x, dim, second, reverse)
    torch.testing.assert_close(got[0], values.float(), rtol=1e-5, atol=1e-5)
    if name == "cummax":
        assert torch.equal(got[1], indices)
