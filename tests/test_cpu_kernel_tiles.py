"""The chain path's tiles (csrc/forward_chains.h: tile_chains, tile_scan) against a sequential
float64 oracle: float32 leaves scanned 16 chains side by side, each chain's running value
held in a register across a tile's 16 steps.

Lengths sit around the tile's edges (15, 16, 17, 32, 33 steps: a tile, a tail, none) and
the chunk edges of a 1-D scan (chunks of at least 2048 steps), in both directions, on 1
and 2 threads; single leaves (add, mul, max with NaN and inf, a non-commutative pick of
the last nonzero), the affine pair, logaddexp (two vectors of chains per tile), and
layouts other than float32 that walk instead.
"""

from __future__ import annotations

import optree
import pytest
import torch
from helpers import add, mul, sequential_scan
from helpers import linear_recurrence as affine
from helpers import logaddexp as lse  # expensive: two vectors of chains per tile
from helpers import maximum as cmax

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._engines.cpp.cpu_kernel import kernel_scan
from fscan._routing.cumulative import path

pytestmark = [
    pytest.mark.skipif(
        compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
    ),
    pytest.mark.filterwarnings("ignore::fscan.NotAssociativeWarning"),
]


def last_nonzero(a, b):  # associative, not commutative
    return torch.where(b != 0, b, a)


def _data(name: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if name == "mul":
        x = torch.exp(x * 0.05)
    if name in ("max", "lse") and x.numel() > 40:
        x.view(-1)[7] = float("nan")
        x.view(-1)[29] = float("inf")
        x.view(-1)[-3] = float("-inf")
    if name == "last_nonzero":
        x = torch.where(torch.rand(shape, generator=gen) < 0.6, 0.0, x)
    if name == "affine":
        return (torch.rand(shape, generator=gen).to(dtype) * 0.5 + 0.5, x.to(dtype))
    if dtype == torch.int64:
        return (x * 4).round().to(dtype)
    return x.to(dtype)


COMBINES = {
    "add": add,
    "mul": mul,
    "max": cmax,
    "last_nonzero": last_nonzero,
    "affine": affine,
    "lse": lse,
}


# The float64 loop's results for a test run on 1 thread and again on 2, kept by the first
# run for the second (which takes them): at 70001 steps the loop costs more than the kernel.
_ORACLES: dict[tuple, list[torch.Tensor]] = {}


def _oracle(fn, xs, dim: int, reverse: bool, key: tuple | None) -> list[torch.Tensor]:
    if key in _ORACLES:
        return _ORACLES.pop(key)
    wide = optree.tree_map(lambda x: x.double() if x.is_floating_point() else x, xs)
    ref = optree.tree_leaves(sequential_scan(fn, wide, dim, reverse))
    if key is not None:
        _ORACLES[key] = ref
    return ref


def _check(name: str, xs, dim: int, reverse: bool, threads: int, key: tuple | None = None):
    """The kernel's scan of ``xs`` against the oracle's; ``key`` names ``xs`` (without the
    threads) where another run of the same data may reuse the oracle's results."""
    fn = COMBINES[name]
    leaves, spec = optree.tree_flatten(xs)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
            out = kernel_scan("test", fn, spec, leaves, dim, reverse)
    finally:
        torch.set_num_threads(previous)
    assert out is not None, f"the kernel did not serve {name}"
    ref = _oracle(fn, xs, dim, reverse, None if key is None else (*key, dim, reverse))
    for o, r, x in zip(out, ref, leaves):
        assert o.dtype == x.dtype and o.shape == x.shape
        if not o.is_floating_point():
            assert torch.equal(o, r)
            continue
        tol = {torch.bfloat16: 1e-2}.get(o.dtype, 1e-5)
        torch.testing.assert_close(
            o.double(), r.to(o.dtype).double(), rtol=tol, atol=tol, equal_nan=True
        )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("steps", [1, 15, 16, 17, 32, 33, 100])
@pytest.mark.parametrize("name", sorted(COMBINES))
def test_last_dim_chains_in_tiles_match_the_oracle(name, steps, reverse, threads):
    # 37 chains: whole groups of 16 (of 32 for lse) and the rest walked one by one.
    xs = _data(name, (37, steps), torch.float32, seed=steps)
    _check(name, xs, 1, reverse, threads, key=(name, (37, steps)))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("length", [2047, 2048 * 16 - 1, 2048 * 16 + 17, 70001])
@pytest.mark.parametrize("name", sorted(COMBINES))
def test_one_dim_chunks_in_tiles_match_the_oracle(name, length, reverse, threads):
    # One lane split into chunks, scanned as the chains of a tile (totals, then carries).
    xs = _data(name, (length,), torch.float32, seed=length)
    _check(name, xs, 0, reverse, threads, key=(name, (length,)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.bfloat16])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", ["add", "max", "last_nonzero"])
def test_other_dtypes_walk_and_match_the_oracle(name, dtype, reverse):
    # (19, 700): two groups of 8 chains interleaved, each chain SKEW steps ahead of the
    # one before (from 512 steps), and 3 walked alone.
    for shape, dim in [((37, 33), 1), ((5000,), 0), ((19, 700), 1)]:
        xs = _data(name, shape, dtype, seed=3)
        _check(name, xs, dim, reverse, 1)


def test_transposed_float32_input_reads_its_chains_in_place():
    # A transpose lays each lane out along its steps: the chain path, tiled, no copy.
    x = torch.randn(40, 300)
    _check("last_nonzero", x.t(), 0, False, 1)
    _check("affine", (torch.rand(40, 300).t() * 0.5 + 0.5, x.t()), 0, True, 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", ["add", "last_nonzero", "affine", "lse"])
def test_whole_lanes_tiled_across_outer_rows(name, reverse, threads):
    # Groups of whole lanes (lane_tiles, forward_chains.h) step their lanes' bases from the
    # group's first lane. Steps dense in and out (a permuted input scanned into a permuted
    # out=) with 10 lanes an outer index: a group's lanes cross from one outer index to the
    # next, and 3 x 10 or 7 x 10 lanes leave a part group to the chains beside the tiles.
    for outer, steps in [(3, 16), (7, 33), (7, 5)]:
        memory = (outer, 10, steps)
        data = _data(name, memory, torch.float32, seed=outer * steps)
        xs = optree.tree_map(lambda x: x.permute(0, 2, 1), data)
        leaves, spec = optree.tree_flatten(xs)
        outs = [torch.full(memory, -7.0).permute(0, 2, 1) for _ in leaves]
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
                got = kernel_scan("test", COMBINES[name], spec, leaves, 1, reverse, out=outs)
        finally:
            torch.set_num_threads(previous)
        assert got is not None and all(g.data_ptr() == o.data_ptr() for g, o in zip(got, outs))
        for g, r in zip(got, _oracle(COMBINES[name], xs, 1, reverse, None)):
            torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("name", sorted(COMBINES))
def test_transposed_views_tile_their_rows(name, dim, reverse):
    # x.t() of (lanes, steps) memory scanned into torch's contiguous outputs: one of the
    # two has its steps a row apart, its group's chains side by side (tile_rows_fit: rows
    # copied, the other transposed). dim 0: the input's steps dense, the outputs rows; dim
    # 1: the input rows, the outputs dense. 37 and 70 lanes: whole groups, a group split
    # across no boundary, the rest walked; steps around the tile's edge.
    for lanes, steps in [(37, 15), (37, 17), (70, 33), (40, 100)]:
        memory = (lanes, steps) if dim == 0 else (steps, lanes)
        xs = optree.tree_map(lambda x: x.t(), _data(name, memory, torch.float32, seed=lanes))
        _check(name, xs, dim, reverse, 1)
    if name == "affine":  # one leaf transposed, the other contiguous: rows for one only
        a, b = _data(name, (64, 40), torch.float32, seed=9)
        _check(name, (a.t().contiguous(), b.t()), 1 - dim, reverse, 1)
        _check(name, (a.t(), b.t().contiguous()), 1 - dim, reverse, 2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", sorted(COMBINES))
def test_step_sliced_views_gather_their_tiles(name, reverse, threads):
    # Steps 2 apart, chains neither dense nor side by side: an expensive combine's tiles
    # gather and scatter them an element at a time (TILE_ANY), the others walk. Rows of
    # 37 lanes, a 1-D slice (one lane in chunks, their tiles' chains at different steps),
    # and the outputs into a step-sliced out= (scattered too).
    cases = [((37, 2 * 40), 1, lambda x: x[:, ::2]), ((2 * 5001,), 0, lambda x: x[::2])]
    for memory, dim, view in cases:
        xs = optree.tree_map(view, _data(name, memory, torch.float32, seed=len(memory)))
        _check(name, xs, dim, reverse, threads)
    x = _data("add", (37, 2 * 40), torch.float32, seed=4)[:, ::2]
    out = torch.full((37, 2 * 40), -7.0)
    with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
        leaves, spec = optree.tree_flatten(x)
        (got,) = kernel_scan("test", lse, spec, leaves, 1, reverse, out=[out[:, 1::2]])
    assert got.data_ptr() == out[:, 1::2].data_ptr()  # written in place, not copied
    want = torch.logcumsumexp(x.double().flip(1) if reverse else x.double(), 1)
    want = want.flip(1) if reverse else want
    torch.testing.assert_close(out[:, 1::2].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, ::2], torch.full((37, 40), -7.0))


@pytest.mark.parametrize("reverse", [False, True])
def test_transposed_views_tile_their_rows_exclusive(reverse):
    # The exclusive variant's tiles write each step's carry-in through the same rows.
    x = torch.randn(130, 300, generator=torch.Generator().manual_seed(2)).t()  # kernel-sized
    for dim in (0, 1):
        with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
            for _ in range(2):  # the second call: the drop-ins' exclusive kernel run, if any
                got = fscan.cumsum(x, dim, reverse=reverse, exclusive=True)
            assert path(torch.cumsum, x, dim, reverse) == "cpp"
        wide = x.double().flip(dim) if reverse else x.double()
        want = torch.cumsum(wide, dim) - wide
        want = want.flip(dim) if reverse else want
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", ["add", "max", "last_nonzero", "affine", "lse"])
def test_every_partial_tile_length_matches_the_oracle(name, reverse):
    # Every chain length from 1 to 35 steps: tiles of 16 and a partial last tile of
    # 1-15 steps (masked rows), in 32 chains (whole groups, none walked).
    for steps in range(1, 36):
        xs = _data(name, (32, steps), torch.float32, seed=100 + steps)
        _check(name, xs, 1, reverse, 1)


@pytest.mark.parametrize("reverse", [False, True])
def test_partial_tiles_read_and_write_only_their_steps(reverse):
    # The chains sit in rows of a wider buffer, with NaN past each chain's last step and
    # before its first: the partial tile's masked rows must not bring them in, nor write
    # over them (the output is a view of a buffer filled with a sentinel).
    steps = 21
    buf = torch.full((32, steps + 16), float("nan"))
    x = buf[:, 8 : 8 + steps]
    x.copy_(torch.randn(32, steps, generator=torch.Generator().manual_seed(5)))
    _check("add", x, 1, reverse, 1)
    out = torch.full((32, steps + 16), -7.0)
    with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
        got = fscan.cumsum(x, 1, reverse=reverse, out=out[:, 8 : 8 + steps])
    expected = torch.cumsum(x.double().flip(1) if reverse else x.double(), 1)
    expected = expected.flip(1) if reverse else expected
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, :8], torch.full((32, 8), -7.0))
    assert torch.equal(out[:, 8 + steps :], torch.full((32, 8), -7.0))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", ["add", "max", "affine"])
def test_chains_off_the_tile_with_a_carry_in_match_the_oracle(name, reverse):
    # initial= as the scan's step before the first: out = scan of [initial, xs] less it
    # (a carry-in's head element is read by the walked chains, not by a tile).
    fn = COMBINES[name]
    for steps in (5, 16, 19, 40):
        xs = _data(name, (32, steps), torch.float32, seed=steps)
        init = optree.tree_map(lambda x: x[:, 0] * 0.5 + 0.25, xs)
        with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
            out = fscan.associative_scan(fn, xs, 1, reverse=reverse, initial=init)
        joined = optree.tree_map(
            lambda x, i: torch.cat([x, i[:, None]] if reverse else [i[:, None], x], 1), xs, init
        )
        wide = optree.tree_map(lambda x: x.double(), joined)
        ref = sequential_scan(fn, wide, 1, reverse)
        ref = optree.tree_map(lambda r: r[:, :-1] if reverse else r[:, 1:], ref)
        for o, r in zip(optree.tree_leaves(out), optree.tree_leaves(ref)):
            torch.testing.assert_close(
                o.double(), r.float().double(), rtol=1e-5, atol=1e-5, equal_nan=True
            )


def _extremum_oracle(op, x: torch.Tensor, dim: int, reverse: bool, first: int):
    """torch's op (reversed: flip, op, flip, indices mapped back, ties to the smaller
    index), indices counted from ``first``."""
    if not reverse:
        values, indices = op(x, dim)
    else:
        flipped = op(x.flip(dim), dim)
        values, indices = flipped.values.flip(dim), (x.shape[dim] - 1 - flipped.indices).flip(dim)
    return values, indices + first


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    ("shape", "dim"),
    [
        *[((37, steps), 1) for steps in (1, 15, 16, 17, 33, 100, 127, 128, 130)],
        *[((32, 256), 1), ((4, 8, 64), 2), ((2047,), 0), ((2048 * 16 + 17,), 0), ((70001,), 0)],
        *[((300, 40), 1), ((64, 300), 0)],  # a transpose's chains: read in place
        ((300, 41), 1),  # a transpose's rows: copied into the tiles (tile_rows_fit)
    ],
)
@pytest.mark.parametrize("op", [torch.cummax, torch.cummin], ids=["cummax", "cummin"])
def test_cummax_indices_come_out_of_tiles(op, shape, dim, reverse, threads):
    """cummax/cummin's (value, index) pair on the chain path: float32 values tiled, the
    index each step's position, computed in the tile scan and transposed out of an int64
    tile (fscan_tile_out_i64): whole and partial tiles, chains walked past the tiles, a
    lane's chunks; from WALK_FROM (128) steps every chain walked alone, groups and chains
    of a reversed scan from the last; both directions, ties (rounded values) and NaN, a
    view's first position."""
    from fscan._routing.cumulative import kernel_call

    gen = torch.Generator().manual_seed(sum(shape) + dim)
    x = (torch.randn(shape, generator=gen) * 4).round()  # ties everywhere
    x.view(-1)[5::97] = float("nan")
    x.view(-1)[3::89] = float("inf")
    if shape == (300, 40):
        x = x.t().contiguous().t()  # (300, 40) of (40, 300) memory: chains along dim 1
    if shape == (64, 300):
        x = torch.randn(300, 64, generator=gen).t()
    if shape == (300, 41):
        x = x.t().contiguous().t()  # dim 1's steps 300 apart, its lanes side by side
    combine, spec, leaves, positions = kernel_call(op, x)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
            for first in (0, 11):  # 11: positions of a view that starts 11 steps in
                values, indices = kernel_scan(
                    "test",
                    combine,
                    spec,
                    leaves,
                    dim,
                    reverse,
                    positions=positions,
                    first_position=first,
                )
                want_values, want_indices = _extremum_oracle(op, x, dim, reverse, first)
                assert torch.equal(values.nan_to_num(0.5), want_values.nan_to_num(0.5))
                assert indices.dtype == torch.int64 and torch.equal(indices, want_indices)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 40, 256])
def test_exclusive_cummax_indices_come_out_of_tiles(length, reverse):
    """The exclusive variant's tiles: each step's output is the pair before it (the first
    step's the identity, index -1), the positions as in the inclusive scan."""
    gen = torch.Generator().manual_seed(length)
    x = (torch.randn(48, length, generator=gen) * 3).round()
    x.view(-1)[7::61] = float("nan")
    with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
        for _ in range(2):  # the second call: the drop-ins' exclusive kernel run, if any
            got = fscan.cummax(x, 1, reverse=reverse, exclusive=True)
    values, indices = _extremum_oracle(torch.cummax, x, 1, reverse, 0)
    lowest = torch.full((48, 1), -float("inf"))
    minus_one = torch.full((48, 1), -1, dtype=torch.int64)
    if reverse:
        want_values = torch.cat([values[:, 1:], lowest], 1)
        want_indices = torch.cat([indices[:, 1:], minus_one], 1)
    else:
        want_values = torch.cat([lowest, values[:, :-1]], 1)
        want_indices = torch.cat([minus_one, indices[:, :-1]], 1)
    assert torch.equal(got.values.nan_to_num(0.5), want_values.nan_to_num(0.5))
    assert torch.equal(got.indices, want_indices)
