"""The lane path's narrow columns (csrc/forward_lanes.h: narrow_rows): columns exactly
LANE_BLOCK lanes wide (16, inner 16) or half that (inner 8) scan NARROW_ROWS rows at a
time with each lane's running value in a register, the rest a row at a time. Against a
float64 sequential oracle: lengths around the block, both directions, the exclusive
variant, a carry-in (``initial=``), chunked columns (few columns, several threads) and
wider or narrower columns beside them (which keep the row at a time). The segmented
kernel's narrow columns (csrc/segmented.h: seg_narrow_rows) against fscan's torch
engine, with a mask per lane, per row and 1-D.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_kernel import assert_close_to, linrec, needs_compiler, num_threads, oracle

import fscan

pytestmark = pytest.mark.filterwarnings("ignore::fscan.NotAssociativeWarning")

LENGTHS = [1, 2, 7, 8, 9, 16, 17, 25, 64, 5003]


@pytest.fixture(scope="module", autouse=True)
def eager_kernel():
    with fscan.config.override(cpu_kernel="eager"):
        yield


def _data(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) * 0.5 + 0.5, torch.randn(shape, generator=gen)


@needs_compiler
@pytest.mark.parametrize("inner", [16, 8, 15, 32])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("reverse", [False, True])
def test_affine_pair_matches_the_oracle(inner, length, reverse):
    threads = 2 if length > 1000 else 1  # one column of 5003 rows: chunked on 2 threads
    xs = _data((3 if length < 1000 else 1, length, inner), length + inner)
    with num_threads(threads), torch.no_grad():
        out = fscan.associative_scan(linrec, xs, dim=1, reverse=reverse)
    ref = oracle(linrec, xs, 1, reverse)
    assert_close_to(out, tuple(r.float() for r in ref), f"{inner} {length}")


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("exclusive", [False, True])
@pytest.mark.parametrize("lanes", [16, 8])
def test_cumsum_and_cummax_match_the_oracle(dtype, length, reverse, exclusive, lanes):
    x = torch.randn(length, lanes, generator=torch.Generator().manual_seed(length)).to(dtype)
    with num_threads(2 if length > 1000 else 1):
        got = fscan.cumsum(x, 0, reverse=reverse, exclusive=exclusive)
        values, indices = fscan.cummax(x, 0, reverse=reverse, exclusive=exclusive)
    wide = x.double().flip(0) if reverse else x.double()
    want = torch.cumsum(wide, 0)
    if exclusive:
        want = want - wide
    want = want.flip(0) if reverse else want
    torch.testing.assert_close(got, want.to(dtype), rtol=1e-5, atol=1e-4)
    ref_values, ref_indices = torch.cummax(x.flip(0) if reverse else x, 0)
    if reverse:
        ref_values, ref_indices = ref_values.flip(0), length - 1 - ref_indices.flip(0)
    if exclusive:  # one step behind in scan order, the start value (-inf, -1) first
        lowest = torch.full((1, lanes), -float("inf"), dtype=dtype)
        start = torch.full((1, lanes), -1)
        if reverse:
            ref_values = torch.cat([ref_values[1:], lowest])
            ref_indices = torch.cat([ref_indices[1:], start])
        else:
            ref_values = torch.cat([lowest, ref_values[:-1]])
            ref_indices = torch.cat([start, ref_indices[:-1]])
    torch.testing.assert_close(values, ref_values)
    assert torch.equal(indices, ref_indices)


@needs_compiler
@pytest.mark.parametrize("length", [8, 9, 17, 40])
@pytest.mark.parametrize("reverse", [False, True])
def test_carry_in_matches_the_oracle(length, reverse):
    xs = _data((2, length, 16), 7)
    initial = _data((2, 16), 8)  # one element: the leaves without dim 1
    with torch.no_grad():
        out = fscan.associative_scan(linrec, xs, dim=1, reverse=reverse, initial=initial)
    heads = [i.unsqueeze(1) for i in initial]
    ends = [torch.cat([h, x] if not reverse else [x, h], 1) for h, x in zip(heads, xs)]
    ref = oracle(linrec, tuple(ends), 1, reverse)
    ref = tuple(r[:, 1:] if not reverse else r[:, :-1] for r in ref)
    assert_close_to(out, tuple(r.float() for r in ref), f"{length}")


def _mask(kind: str, shape: tuple[int, ...], seed: int, density: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "per lane":  # a flag per lane: seg_narrow_rows' LANE mode
        return torch.rand(shape, generator=gen) < density
    if kind == "per lane, apart":  # the same, its lanes apart in memory (transposed)
        return (torch.rand(shape, generator=gen) < density).mT.contiguous().mT
    if kind == "per row":  # one flag a row, broadcast over the lanes: ROW mode
        return torch.rand((*shape[:-1], 1), generator=gen) < density
    return torch.rand(shape[1], generator=gen) < density  # 1-D along dim 1


@needs_compiler
@pytest.mark.parametrize("op", ["cumsum", "cumprod", "cummax", "logcumsumexp"])
@pytest.mark.parametrize("kind", ["per lane", "per lane, apart", "per row", "1-D"])
@pytest.mark.parametrize("length", [8, 9, 16, 17, 40, 5003])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("density", [0.15, 0.01])
def test_segmented_drop_ins_match_the_torch_engine(op, kind, length, reverse, lanes, density):
    # The segmented kernel's narrow columns (csrc/segmented.h: seg_narrow_rows), against
    # the same call on fscan's torch engine (tests/test_segmented.py checks that one
    # against a per-segment loop). Sparse flags leave most blocks without any (the
    # inclusive loop), dense ones few; 5003 rows on 2 threads: a split column, whose
    # first chunk keeps its total (ALL) while the next one's is taken (seen marked).
    shape = (3 if length < 1000 else 1, length, lanes)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(length))
    mask = _mask(kind, shape, length + 1, density)
    with num_threads(2 if length > 1000 else 1):
        got = getattr(fscan, op)(x, 1, reverse=reverse, reset=mask)
    with fscan.config.override(cpu_kernel="off"):
        want = getattr(fscan, op)(x, 1, reverse=reverse, reset=mask)
    if op == "cummax":
        assert torch.equal(got.indices, want.indices)
        got, want = got.values, want.values
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("lanes", [16, 8])
@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
def test_segmented_split_column_with_one_restarting_lane(lanes, apart, reverse):
    # One lane restarts once, in the middle chunk of a column split on 2 threads: that
    # chunk's total must mark the lane (seen), or the next chunk's carry composes across
    # the restart. The other lanes' totals compose. A mask whose lanes lie apart in
    # memory takes the row at a time (its flags gathered), an adjacent one the blocks.
    shape = (1, 9001, lanes)  # 3 chunks of 3001 steps at 8 lanes and at 16
    x = torch.randn(shape, generator=torch.Generator().manual_seed(lanes))
    mask = torch.zeros(shape, dtype=torch.bool)
    mask[0, 4500, 3] = True
    if apart:
        mask = mask.mT.contiguous().mT
    with num_threads(2):
        got = fscan.cumsum(x, 1, reverse=reverse, reset=mask)
    with fscan.config.override(cpu_kernel="off"):
        want = fscan.cumsum(x, 1, reverse=reverse, reset=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
