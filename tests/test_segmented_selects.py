"""The segmented chain path's walk for a combine that selects (cummax/cummin's (value,
index) pairs: csrc/segmented_walk.h, seg_chains with SEG_G == 1, the flag tested before
the combine), against a per-segment torch loop: every segment length from 1 to 35 (around
the 16-step stretches the other paths tile by and the chunks' edges), a restart at every
offset of a 16-step stretch, ties (the latest equal value wins) and NaN (the first NaN's
value sticks to the segment's end) inside segments, both directions, 1-D (one chain, or
chunks on more threads) and the last dim of 2-D (many chains), float32 as the drop-ins
call it."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import torch_threads
from test_segmented_kernel import run

import fscan

OPS = {"cummax": torch.cummax, "cummin": torch.cummin}


def per_segment(name, x, reset, reverse):
    """torch's op on each segment of the last dim alone (the mask a row of flags shared by
    every lane), indices shifted to positions in the whole input."""
    op = OPS[name]
    xs, rs = (x.flip(-1), reset.flip(0)) if reverse else (x, reset)
    n = xs.shape[-1]
    starts = [0, *[t for t in range(1, n) if rs[t]], n]
    values, indices = [], []
    for a, b in itertools.pairwise(starts):
        v, i = op(xs[..., a:b], -1)
        values.append(v)
        indices.append(i + a)
    v, i = torch.cat(values, -1), torch.cat(indices, -1)
    if reverse:
        v, i = v.flip(-1), n - 1 - i.flip(-1)
    return v, i


def check(name, x, reset, reverse, threads=None):
    """The kernel's values and indices against :func:`per_segment`, bit for bit; the
    drop-in (fscan.cummax/cummin with reset=) too."""
    kernel = run("cummax", -x if name == "cummin" else x, x.ndim - 1, reset, reverse, threads)
    got = -kernel[0] if name == "cummin" else kernel[0]
    values, indices = per_segment(name, x, reset, reverse)
    torch.testing.assert_close(got, values, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(kernel[1], indices)
    with fscan.config.override(cpu_kernel="eager"):
        drop_in = getattr(fscan, name)(x, -1, reset=reset, reverse=reverse)
    torch.testing.assert_close(drop_in.values, values, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(drop_in.indices, indices)


def with_ties_and_nan(shape, seed):
    """Small integers (ties in every segment) and a NaN about every 40 elements."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=gen).float()
    x[torch.rand(shape, generator=gen) < 0.025] = float("nan")
    return x


# 1 + 2 + ... + 35 = 630 steps: every segment length once, in an order that puts the
# short ones next to long ones (segments ending on both sides of every 16th step).
LENGTHS = [k for pair in zip(range(1, 18), range(35, 17, -1)) for k in pair] + [18]


def segments_mask(lengths):
    reset = torch.zeros(sum(lengths), dtype=torch.bool)
    reset[torch.tensor([0, *lengths[:-1]]).cumsum(0)] = True
    return reset


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("rows", [0, 5])
def test_every_segment_length_from_1_to_35(name, reverse, rows):
    """Segments of 1..35 steps: 1-D (one chain), or 5 rows of them (the last dim)."""
    reset = segments_mask(LENGTHS)
    n = reset.numel()
    x = with_ties_and_nan((rows, n) if rows else (n,), seed=rows + 1)
    check(name, x, reset, reverse)


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("offset", list(range(16)))
@pytest.mark.parametrize("reverse", [False, True])
def test_a_restart_at_every_offset(name, offset, reverse):
    """A restart at one offset of every 16 steps, plus the first step, 3 lanes of 16 * 4 + 7."""
    n = 16 * 4 + 7
    reset = torch.arange(n) % 16 == offset
    x = with_ties_and_nan((3, n), seed=offset)
    check(name, x, reset, reverse)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(OPS))
def test_one_lane_in_chunks_with_ties_and_nan(threads, name):
    """1-D, long enough to split into chunks on more threads (their totals start at the
    last restart): segments of 1..35 steps repeated, ties and NaN throughout."""
    reset = segments_mask(LENGTHS * 40)
    x = with_ties_and_nan((reset.numel(),), seed=threads)
    with torch_threads(threads):
        for reverse in (False, True):
            check(name, x, reset, reverse, threads)


def test_nan_sticks_and_the_latest_tie_wins_inside_a_segment():
    """The cases spelled out: a NaN holds its value to the segment's end and no further;
    an equal value later in the segment takes the index."""
    nan = float("nan")
    x = torch.tensor([1.0, 3.0, 3.0, nan, 5.0, nan, 2.0, 2.0, 1.0, 2.0])
    reset = torch.tensor([1, 0, 0, 0, 0, 0, 1, 0, 0, 0], dtype=torch.bool)
    for name in OPS:
        for reverse in (False, True):
            check(name, x, reset, reverse)
    got = run("cummax", x, 0, reset, False)
    assert torch.equal(got[1], torch.tensor([0, 1, 2, 3, 3, 5, 6, 7, 7, 9]))
    assert got[0][3:6].isnan().all() and torch.equal(got[0][6:], torch.tensor([2.0, 2, 2, 2]))
