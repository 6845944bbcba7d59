"""The segmented lane path's columns over a middle dim (csrc/segmented.h, seg_lane_path):
reversed, the columns are walked down (as the forward's lane_path), forward up. Many
columns (outer > 1, inner >= VEC_MIN, inner not a multiple of the column width), a few
steps or many split into chunks for threads, segments of 1-35 steps, flags per row or per
element, NaN and ties inside a segment, 1-3 threads, against a float64 walk and the
drop-ins against a per-segment torch loop."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import torch_threads
from test_segmented_kernel import check, mask

import fscan


@pytest.mark.parametrize("name", ["cumsum", "cummax"])
@pytest.mark.parametrize("period", [1, 2, 5, 16, 17, 35])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shape", [(37, 8, 70), (5, 41, 24)])
def test_segment_lengths_over_a_middle_dim(name, period, reverse, shape):
    """A restart every ``period`` steps (a 1-D mask), plus element flags at random."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(period))
    x[:, 3, 5] = float("nan")
    x[:, :, 7] = 1.5  # ties along every lane
    n = shape[1]
    check(name, x, 1, torch.arange(n) % period == period // 2, reverse)
    check(name, x, 1, mask(shape, 1 / period, seed=period), reverse)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", [(3, 901, 20), (64, 8, 64), (2, 5000, 9)])
@pytest.mark.parametrize("reverse", [False, True])
def test_columns_and_chunks_for_threads(threads, shape, reverse):
    """Columns shared among threads, or split into chunks where they are fewer."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(threads))
    reset = torch.arange(shape[1]) % 97 == 13
    with torch_threads(threads):
        for name in ("cumsum", "cummax"):
            check(name, x, 1, reset, reverse, threads)
            check(name, x, 1, mask(shape, 0.01, seed=threads), reverse, threads)


@pytest.mark.parametrize("reverse", [False, True])
def test_the_drop_ins_over_a_middle_dim(reverse):
    """fscan's reset= drop-ins over (64, 200, 16) dim 1 against torch per segment
    (reversed, a flag starts a segment in scan order: it is the segment's last step)."""
    x = torch.randn(64, 200, 16, generator=torch.Generator().manual_seed(5))
    x[:, 50:60] = 0.25  # ties inside a segment
    x[3, 120, 4] = float("nan")
    reset = torch.arange(200) % 37 == 11
    flagged = torch.nonzero(reset).flatten().tolist()
    edges = sorted({0, *([t + 1 for t in flagged] if reverse else flagged), 200})
    pieces = [x[:, a:b] for a, b in itertools.pairwise(edges)]
    with fscan.config.override(cpu_kernel="eager"):
        for name in ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"):
            op = getattr(torch, name)
            got = getattr(fscan, name)(x, 1, reverse=reverse, reset=reset)
            parts = [op(p.flip(1), 1) if reverse else op(p, 1) for p in pieces]
            if name in ("cummax", "cummin"):
                values = [p.values.flip(1) if reverse else p.values for p in parts]
                offsets = [torch.tensor(a) for a in edges[:-1]]
                index = [
                    (p.shape[1] - 1 - q.indices.flip(1) if reverse else q.indices) + a
                    for p, q, a in zip(pieces, parts, offsets, strict=True)
                ]
                torch.testing.assert_close(got[0], torch.cat(values, 1), equal_nan=True)
                torch.testing.assert_close(got[1], torch.cat(index, 1))
            else:
                want = torch.cat([p.flip(1) if reverse else p for p in parts], 1)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
