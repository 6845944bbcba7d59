"""The segmented chain path's register-transposed tiles (float32, steps dense: csrc/
segmented_tiles.h, seg_transposed_chains): chain lengths around the tiles' 16 steps,
a restart at every offset inside a tile, both directions, 1-3 threads (chunks of
unequal lengths, carries composed), row and element flags, against a float64 walk.
logcumsumexp tiles every group of chains; cumsum and cumprod only whole lanes reading a
1-D mask or each their own flags as adjacent bytes (a mask of x's shape along its last
dim): each tile's restarts as bits (SEG_TILE_ROWS, seg_row_tiles), the rest walked."""

from __future__ import annotations

import pytest
import torch
from helpers import torch_threads
from test_segmented_kernel import OPS, mask, oracle, run

import fscan
from fscan._engines.cpp._kernel_segmented import kernel_segmented
from fscan._routing.cumulative import kernel_call


def check32(x, dim, reset, reverse, threads=None, name="logcumsumexp"):
    if name == "cumprod":
        x = x * 0.1 + 1.0
    got = run(name, x, dim, reset, reverse, threads)
    values, _ = oracle(name, x, dim, reset, reverse)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0].double(), values, rtol=2e-6, atol=2e-6, equal_nan=True)


@pytest.mark.parametrize("name", ["cumsum", "cumprod", "logcumsumexp"])
@pytest.mark.parametrize("steps", [1, 2, 15, 16, 17, 31, 33, 48, 50])
@pytest.mark.parametrize("reverse", [False, True])
def test_row_flags_around_the_tiles(name, steps, reverse):
    """21 lanes (two whole groups of 8 chains, or one of 16, then lanes walked), a 1-D
    mask: restarts at the first and last steps, two adjacent, one about every 7 steps."""
    x = torch.randn(21, steps, generator=torch.Generator().manual_seed(steps))
    reset = torch.arange(steps) % 7 == 3
    reset[0] = reset[-1] = True
    reset[steps // 2 : steps // 2 + 2] = True
    check32(x, 1, reset, reverse, name=name)


@pytest.mark.parametrize("name", ["cumsum", "logcumsumexp"])
@pytest.mark.parametrize("steps", list(range(1, 36)))
@pytest.mark.parametrize("reverse", [False, True])
def test_chain_lengths_around_the_tiles(name, steps, reverse):
    """35 lanes (two whole groups of 16 chains, then lanes walked alone), element flags
    at the first and last steps and about one in eight elsewhere; cumsum's whole lanes
    read their flags as bits (seg_row_tiles, LANES), whole tiles and the partial one."""
    gen = torch.Generator().manual_seed(steps)
    x = torch.randn(35, steps, generator=gen)
    reset = mask((35, steps), 0.12, seed=steps)
    reset[:, 0] = reset[3, -1] = True
    check32(x, 1, reset, reverse, name=name)


@pytest.mark.parametrize("offset", list(range(16)))
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("flags", ["row", "element"])
def test_a_restart_at_every_offset_in_a_tile(offset, reverse, flags):
    """A restart at one offset of every tile (a whole tile's rows and the partial tile's),
    shared by every lane (a 1-D mask) or on every other lane; cumsum and cumprod too (row
    tiles: the row's bit, or each lane's own)."""
    x = torch.randn(32, 16 * 3 + 7, generator=torch.Generator().manual_seed(offset))
    n = x.shape[1]
    row = torch.arange(n) % 16 == offset
    reset = row if flags == "row" else (row[None, :] & (torch.arange(32)[:, None] % 2 == 0))
    for name in ("logcumsumexp", "cumsum", "cumprod"):
        check32(x, 1, reset, reverse, name=name)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape,dim", [((9001,), 0), ((3, 5003), 1), ((40, 301), 1)])
@pytest.mark.parametrize("flags", ["row", "sparse", "none"])
@pytest.mark.parametrize("reverse", [False, True])
def test_chunks_and_threads(threads, shape, dim, flags, reverse):
    """Lanes split into chunks of unequal lengths (the carries composed, chains longer
    than the shortest walked on after the tiles), on 1-3 threads."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(threads))
    n = shape[dim]
    if flags == "row":
        reset = torch.arange(n) % 97 == 13
    elif flags == "sparse":
        reset = mask(shape, 0.002, seed=threads)
    else:
        reset = torch.zeros(n, dtype=torch.bool)
    with torch_threads(threads):
        check32(x, dim, reset, reverse, threads)
        if flags == "row":  # cumsum: tiled on whole lanes ((40, 301): 1-3 threads), else walked
            check32(x, dim, reset, reverse, threads, name="cumsum")


@pytest.mark.parametrize("name", ["cumsum", "cumprod", "logcumsumexp"])
@pytest.mark.parametrize("layout", ["adjacent", "strided"])
@pytest.mark.parametrize("reverse", [False, True])
def test_element_flags_read_as_bits_or_a_byte_at_a_time(name, layout, reverse):
    """Element flags whose steps are adjacent bytes (a whole tile's read 16 a chain as bits,
    a tile without a restart scanned without its flags) or not (a transposed mask's,
    gathered a byte at a time; cumsum and cumprod walk those): tiles with every step
    restarted, with one restart on every third lane, with none, and the partial tile at
    the end."""
    x = torch.randn(40, 16 * 5 + 3, generator=torch.Generator().manual_seed(5))
    reset = torch.zeros(x.shape, dtype=torch.bool)
    reset[:, 16:32] = True
    reset[::3, 40] = True
    reset[7, 81] = True
    if layout == "strided":
        reset = reset.t().contiguous().t()
    assert (reset.stride(1) == 1) == (layout == "adjacent")
    check32(x, 1, reset, reverse, name=name)


def test_inf_and_nan_stay_in_their_segment():
    x = torch.randn(20, 64)
    x[:, 5] = float("inf")
    x[:, 20] = float("nan")
    x[:, 40] = float("-inf")
    reset = torch.arange(64) % 16 == 9
    for reverse in (False, True):
        check32(x, 1, reset, reverse)


def check_rows(name, x, dim, reset, reverse, threads=None):
    """As check32, the 1-D mask passed as it is (strides 0 across every lane dim), where
    run() expands it to the input's shape (a stride 1 over the inner dim of one): both
    reach the row tiles (seg_row_tiles: each tile's restarts read once for every lane)."""
    if name == "cumprod":
        x = x * 0.1 + 1.0
    combine, spec, leaves, positions = kernel_call(OPS[name], x)
    with fscan.config.override(cpu_kernel="eager"):
        got = kernel_segmented(combine, spec, leaves, dim, reverse, reset, positions, threads)
    assert got is not None
    values, _ = oracle(name, x, dim, reset, reverse)
    torch.testing.assert_close(got[0].double(), values, rtol=2e-6, atol=2e-6, equal_nan=True)


@pytest.mark.parametrize("name", ["cumsum", "cumprod", "logcumsumexp"])
@pytest.mark.parametrize("steps", [16, 48, 50])
@pytest.mark.parametrize("rows", ["all", "none", "first", "last"])
@pytest.mark.parametrize("reverse", [False, True])
def test_row_tiles_every_step_or_none(name, steps, rows, reverse):
    """Whole lanes reading a 1-D mask (seg_row_tiles): every step a restart (the output is
    the input), none, only the first step or only the last; 37 lanes (two whole groups,
    then lanes walked)."""
    x = torch.randn(37, steps, generator=torch.Generator().manual_seed(steps))
    reset = torch.zeros(steps, dtype=torch.bool)
    if rows == "all":
        reset[:] = True
    elif rows == "first":
        reset[0] = True
    elif rows == "last":
        reset[-1] = True
    check_rows(name, x, 1, reset, reverse)


@pytest.mark.parametrize("name", ["cumsum", "cumprod", "logcumsumexp"])
@pytest.mark.parametrize("offset", list(range(16)))
@pytest.mark.parametrize("reverse", [False, True])
def test_row_tiles_a_restart_at_every_offset(name, offset, reverse):
    """A restart at one offset of every tile (whole tiles, then a partial one), shared by
    every lane: the row bit blended at each step of the tile scan."""
    x = torch.randn(33, 16 * 3 + 9, generator=torch.Generator().manual_seed(offset))
    reset = torch.arange(x.shape[1]) % 16 == offset
    check_rows(name, x, 1, reset, reverse)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("name", ["cumsum", "cumprod"])
@pytest.mark.parametrize("reverse", [False, True])
def test_row_tiles_lanes_over_leading_dims(threads, name, reverse):
    """Lanes over two leading dims ((3, 23, 70) along the last: 69 lanes, four whole
    groups then walked ones), each group's lanes stepped from its first, on 1-3 threads;
    the same mask as a full one (each lane's own flags read as bits: LANES), and a mask of
    each leading row's own flags broadcast over the middle dim (stride 0 there)."""
    x = torch.randn(3, 23, 70, generator=torch.Generator().manual_seed(threads))
    reset = torch.arange(70) % 9 == 4
    per_row = mask((3, 1, 70), 0.1, seed=threads)
    with torch_threads(threads):
        check_rows(name, x, 2, reset, reverse, threads)
        check32(x, -1, reset.expand(3, 23, 70).contiguous(), reverse, threads, name=name)
        check32(x, -1, per_row, reverse, threads, name=name)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", ["cumsum", "cumprod"])
@pytest.mark.parametrize("flags", ["row", "sparse", "dense", "none"])
@pytest.mark.parametrize("reverse", [False, True])
def test_chunks_of_one_lane_tiled(threads, name, flags, reverse):
    """One lane long enough for a whole group of chunks (16 * 2048 steps and more: each
    chunk a chain of the transposed tiles, reading its own steps' flags as bits, its carry
    the chunks' totals composed), the last chunk shorter (walked on after the tiles); the
    mask a restart every 97 steps, a few, one every other step, or none; also as a
    (2, n) input along its last dim (two lanes, still fewer than a group)."""
    n = 16 * 2048 * 2 + 1234
    gen = torch.Generator().manual_seed(threads)
    x = torch.randn(n, generator=gen)
    if flags == "row":
        reset = torch.arange(n) % 97 == 13
    elif flags == "sparse":
        reset = mask((n,), 0.0005, seed=threads)
    elif flags == "dense":
        reset = torch.arange(n) % 2 == 1
    else:
        reset = torch.zeros(n, dtype=torch.bool)
    with torch_threads(threads):
        check32(x, 0, reset, reverse, threads, name=name)
        two = torch.randn(2, n // 2, generator=gen)
        check32(two, 1, mask((2, n // 2), 0.01, seed=threads + 1), reverse, threads, name=name)
