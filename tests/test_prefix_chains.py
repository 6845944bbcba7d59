"""The chain path's prefix chains (csrc/forward_prefix.h: torch.maximum / torch.minimum of one
float32 leaf along the last dim and 1-D, a chain at a time, vectors of 8 steps scanned in
registers) against a sequential oracle, bit for bit.

Lengths 1-35 and around the vector width (8) and the chunk edges of a 1-D scan on 2 threads
(chunks of at least 2048 steps), both directions, odd row counts, NaN at every offset of a
vector, +-inf, -0.0/+0.0 ties (the later step wins, as the walked chains give it), a carry-in
(``initial=``), and transposed and strided views (strided steps walk: the same bits).
"""

from __future__ import annotations

import optree
import pytest
import torch
from helpers import maximum, minimum, sequential_scan, torch_threads

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._engines.cpp._cpp_codegen import TraceInput, translate_combine
from fscan._engines.cpp._cpp_source import forward_source
from fscan._engines.cpp.cpu_kernel import kernel_scan

pytestmark = [
    pytest.mark.skipif(
        compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
    ),
    pytest.mark.filterwarnings("ignore::fscan.NotAssociativeWarning"),
]

COMBINES = {"max": maximum, "min": minimum}


# The kernel's combines (csrc/prelude.h fscan_max / fscan_min) as the oracle computes them:
# the left operand where it is NaN, else the strict comparison's winner, the right on ties
# (eager torch.maximum keeps the left on -0.0/+0.0 ties; the walked chains, the right).
def walked_max(a, b):
    return torch.where(a != a, a, torch.where(a > b, a, b))


def walked_min(a, b):
    return torch.where(a != a, a, torch.where(a < b, a, b))


ORACLES = {"max": walked_max, "min": walked_min}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _scan(name: str, x: torch.Tensor, dim: int, reverse: bool, threads: int = 1, **kw):
    with torch_threads(threads), torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
        return fscan.associative_scan(COMBINES[name], x, dim, reverse=reverse, **kw)


def _kernel(name: str, x: torch.Tensor, dim: int, reverse: bool, threads: int = 1):
    _, spec = optree.tree_flatten(x)
    with torch_threads(threads), torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
        out = kernel_scan("test", COMBINES[name], spec, [x], dim, reverse)
    assert out is not None, f"the kernel did not serve {name}"
    return out[0]


# A one-lane case's oracle results, kept until its runs on every thread count took them:
# the same data, and the loop over up to 70001 steps cost more than the kernel.
CHUNK_THREADS = (1, 2, 3)
_SHARED: dict[tuple, list] = {}


def _oracle(name: str, x: torch.Tensor, dim: int, reverse: bool, key: tuple | None):
    if key is None:
        return sequential_scan(ORACLES[name], x, dim, reverse)
    found = _SHARED.setdefault(key, [None, len(CHUNK_THREADS)])
    if found[0] is None:
        found[0] = sequential_scan(ORACLES[name], x, dim, reverse)
    found[1] -= 1
    if found[1] == 0:
        del _SHARED[key]
    return found[0]


def _check(name: str, x: torch.Tensor, dim: int, reverse: bool, threads: int = 1, key=None):
    """The kernel's scan of ``x`` against the oracle's, bit for bit; ``key`` names ``x``
    where its runs on CHUNK_THREADS share the oracle's results."""
    got = _kernel(name, x, dim, reverse, threads)
    ref = _oracle(name, x, dim, reverse, key)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.equal(_bits(got), _bits(ref))


def _data(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Few distinct values: ties (equal values) along every chain.
    return (torch.randn(shape, generator=gen) * 4).round() / 4


def test_only_maximum_and_minimum_of_float32_take_prefix_chains():
    _, spec = optree.tree_flatten(0)

    def prefix(fn, dtype=torch.float32):
        program = translate_combine(TraceInput(fn, spec, [dtype], (), []))
        return "static constexpr int PREFIX = 0;" not in forward_source([dtype], program)

    assert prefix(torch.maximum) and prefix(torch.minimum)
    assert not prefix(lambda a, b: a + b)  # double running values: tiled
    assert not prefix(lambda a, b: torch.maximum(b, a))  # another NaN and tie rule
    assert not prefix(torch.maximum, torch.float64)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", sorted(COMBINES))
def test_every_length_to_35_matches_the_oracle(name, reverse):
    # Whole vectors, a partial last vector, chains shorter than a vector; 13 rows (odd).
    for steps in range(1, 36):
        _check(name, _data((13, steps), steps), 1, reverse)


@pytest.mark.parametrize("threads", CHUNK_THREADS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("length", [7, 8, 9, 2047, 4096, 2048 * 3 + 5, 70001])
@pytest.mark.parametrize("name", sorted(COMBINES))
def test_one_dim_chunks_match_the_oracle(name, length, reverse, threads):
    # One lane: chunked for the threads (totals, carries, then the scan), else one chain.
    x = _data((length,), length)
    x[length // 3] = float("nan") if length > 100 else x[length // 3]
    _check(name, x, 0, reverse, threads, key=(name, length, reverse))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", sorted(COMBINES))
def test_nan_at_every_offset_of_a_vector_sticks(name, reverse):
    # Row r has a NaN at step r (every lane of the first vector, of a pair of vectors, of
    # a last whole vector and of a partial one), row 37 none, the rest +-inf and finite
    # values: the first NaN in scan order sticks, bit for bit.
    steps = 37
    x = _data((38, steps), 7)
    x[:, 3] = float("inf")
    x[:, 11] = float("-inf")
    for r in range(steps):
        x[r, r] = float("nan")
    _check(name, x, 1, reverse)
    # A NaN in the carry only: the first vector's NaN reaches the later vectors.
    y = _data((3, 40), 8)
    y[:, 0] = float("nan")
    y[:, 39] = float("nan")
    _check(name, y, 1, reverse)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", sorted(COMBINES))
def test_signed_zero_ties_come_out_as_the_walk_gives_them(name, reverse):
    gen = torch.Generator().manual_seed(3)
    signs = torch.randint(0, 2, (9, 37), generator=gen).float() * 2 - 1
    x = signs * 0.0  # only -0.0 and +0.0: every step ties
    x[:, 20] = -1.0 if name == "max" else 1.0
    _check(name, x, 1, reverse)
    # A strided view's steps are walked one by one: the same bits as the prefix chains.
    wide = torch.zeros(9, 74)
    wide[:, ::2] = x
    walked = _kernel(name, wide[:, ::2], 1, reverse)
    assert torch.equal(_bits(walked), _bits(_kernel(name, x, 1, reverse)))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", sorted(COMBINES))
def test_views_match_the_oracle(name, reverse):
    base = _data((45, 70), 11)
    base[5, 9] = float("nan")
    _check(name, base.t(), 0, reverse)  # transposed: dense steps, chains along dim 0
    _check(name, base[:, 1:], 1, reverse)  # rows that start off a 32-byte boundary
    _check(name, base[:, ::3], 1, reverse)  # strided steps: walked
    _check(name, base[1::2, 3:60], 1, reverse)  # every other row, narrowed


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", sorted(COMBINES))
def test_a_carry_in_matches_the_oracle(name, reverse):
    # initial= as the step before the first (read as the chain's head element). Values
    # off the data's grid: no -0.0/+0.0 tie of the carry-in with the first step, which
    # the route may fold in eagerly (torch.maximum keeps the left one on a tie: so on main).
    for steps in (1, 5, 8, 9, 16, 19, 40):
        x = _data((11, steps), steps)
        init = _data((11,), 100 + steps) + 0.125
        init[3] = float("nan")
        out = _scan(name, x, 1, reverse, initial=init)
        joined = torch.cat([x, init[:, None]] if reverse else [init[:, None], x], 1)
        ref = sequential_scan(ORACLES[name], joined, 1, reverse)
        ref = ref[:, :-1] if reverse else ref[:, 1:]
        assert torch.equal(_bits(out), _bits(ref))
