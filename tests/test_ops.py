"""Drop-in cumulative ops against torch's own, on both paths (native and parallel scan)."""

from __future__ import annotations

import itertools
import re
import threading

import numpy as np
import pytest
import torch
from helpers import parametrize, raises
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan
from fscan import _ops
from fscan._routing import cumulative as router
from fscan._routing.cumulative_table import CHAIN_SUM_DTYPES

OPS = ["cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"]
PATHS = ["native", "parallel"]
DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]
SPECIAL = [float("nan"), float("inf"), float("-inf")]


def pinned(kernel, parallel):
    """A stand-in for the router's ``route``: these cells for every layout and size, its
    dtype rules kept (torch's op serves complex cummax, integer logcumsumexp, ...)."""

    def route(op, x, dim, reverse):
        kernel_bar, parallel_bar = router.dtype_refusals(op, x.dtype)
        return kernel and kernel_bar is None, parallel and x.ndim > 0 and parallel_bar is None

    return route


@pytest.fixture
def force(monkeypatch):
    """``force("native")`` or ``force("parallel")``: pin the dispatch for this test."""

    def pin(path):
        wins = path == "parallel"
        monkeypatch.setattr(router, "route", pinned(False, wins))
        monkeypatch.setattr(_ops, "native_first", lambda *args: None)  # route decides

    return pin


def reference(name, x, dim, reverse, **kw):
    """torch's op; with ``reverse``, flip, op, flip (indices mapped back to ``x``)."""
    op = getattr(torch, name)
    if not reverse or x.ndim == 0:
        return op(x, dim, **kw)
    out = op(x.flip(dim), dim, **kw)
    if isinstance(out, torch.Tensor):
        return out.flip(dim)
    return type(out)((out.values.flip(dim), (x.shape[dim] - 1 - out.indices).flip(dim)))


def sample(shape, dtype, specials=True, generator=None):
    """Small integers (ties, zeros) as ``dtype``, with NaN and +-inf sprinkled in floats."""
    x = torch.randint(-3, 4, shape, generator=generator).to(torch.float64) / 2
    if dtype.is_complex:
        imag = torch.randint(-3, 4, shape, generator=generator).to(torch.float64) / 2
        x = torch.complex(x, imag)
    elif specials and dtype.is_floating_point and x.numel():
        flat = x.view(-1)
        where = torch.randint(0, x.numel(), (3 * len(SPECIAL),), generator=generator)
        flat[where] = torch.tensor(SPECIAL * 3, dtype=torch.float64)
    if dtype == torch.bool:
        return x > 0
    if not (dtype.is_floating_point or dtype.is_complex):
        return (x * 2).abs().to(dtype)
    return x.to(dtype)


def assert_same(got, expected):
    """Same type, dtype and shape; equal values (NaN == NaN), close for inexact dtypes."""
    assert type(got) is type(expected)
    if not isinstance(expected, torch.Tensor):
        assert torch.equal(got.indices, expected.indices)
        got, expected = got.values, expected.values
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype.is_floating_point or got.dtype.is_complex:
        low = got.dtype in (torch.float16, torch.bfloat16)
        tol = dict(rtol=1e-2, atol=1e-2) if low else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got, expected, equal_nan=True, **tol)
    else:
        assert torch.equal(got, expected)


def run_both(name, x, dim, reverse, **kw):
    """fscan's result and torch's, or the exception type of each when torch refuses."""
    try:
        expected = reference(name, x, dim, reverse, **kw)
    except (RuntimeError, TypeError, NotImplementedError) as err:
        with pytest.raises(type(err)):
            getattr(fscan, name)(x, dim, reverse=reverse, **kw)
        return None, None
    return getattr(fscan, name)(x, dim, reverse=reverse, **kw), expected


@parametrize(name=OPS, dtype=DTYPES, path=PATHS, reverse=[False, True])
def test_dtypes_ties_nan_inf(force, name, dtype, path, reverse):
    force(path)
    x = sample((70, 5), dtype)  # 70 steps: four blocks of 16 and a tail of 6
    got, expected = run_both(name, x, 0, reverse)
    if expected is not None:
        assert_same(got, expected)


SHAPES = [
    ((), 0),
    ((), -1),
    ((0,), 0),
    ((5, 0), 0),
    ((0, 5), 0),
    ((1,), 0),
    ((37,), 0),
    ((33, 4), -2),
    ((3, 40, 2), 1),
    ((3, 2, 50), 2),
]


@parametrize(name=OPS, shape_dim=SHAPES, path=PATHS, reverse=[False, True])
def test_shapes_and_dims(force, name, shape_dim, path, reverse):
    force(path)
    shape, dim = shape_dim
    x = sample(shape, torch.float64)
    assert_same(*run_both(name, x, dim, reverse))


@parametrize(name=["cumsum", "cumprod"], path=PATHS)
def test_dtype_argument_casts_first(force, name, path):
    force(path)
    x = sample((40, 3), torch.float64, specials=False) * 1.7
    for dtype in (torch.int32, torch.float32, torch.float64, torch.complex128):
        assert_same(*run_both(name, x, 0, False, dtype=dtype))
    assert_same(*run_both(name, sample((40, 3), torch.bool), 0, False))


@parametrize(name=OPS, path=PATHS, reverse=[False, True])
def test_gradients_match_torch(force, name, path, reverse):
    """Including cumprod through zeros and cummax/cummin through ties."""
    force(path)
    x = sample((70, 5), torch.float64, specials=False)
    grad = torch.randn(70, 5, dtype=torch.float64)

    def gradient(fn):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out = out if isinstance(out, torch.Tensor) else out.values
        return torch.autograd.grad(out, leaf, grad)[0]

    got = gradient(lambda t: getattr(fscan, name)(t, 0, reverse=reverse))
    expected = gradient(lambda t: reference(name, t, 0, reverse))
    torch.testing.assert_close(got, expected)


def test_blocked_engine_scans_with_the_scan_it_is_handed():
    """The blocked engine chooses no engine: its inner scans are the function the router
    passes in (here the router's own, recorded)."""
    from fscan._engines.blocked import SUM, accumulate, extremum_scan

    calls = []

    def scan(op, x, dim, reverse):
        calls.append(op)
        return router._inner_scan(op, x, dim, reverse)

    x = torch.randn(100, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(accumulate(SUM, x, 0, True, scan), x.flip(0).cumsum(0).flip(0))
    assert set(calls) == {torch.add}
    values, indices = extremum_scan(x, 0, False, True, scan)
    assert torch.equal(values, torch.cummax(x, 0).values)
    assert torch.equal(indices, torch.cummax(x, 0).indices)
    assert set(calls) == {torch.add, torch.maximum}


def test_cumprod_gradient_with_zeros_is_exact():
    steps = torch.tensor([2.0, 0.0, 3.0, 0.0, 5.0, 1.5, -1.0, 0.5] * 64, dtype=torch.float64)
    x = (steps[:, None] * torch.rand(1, 4096, dtype=torch.float64)).requires_grad_()
    assert router.route(torch.cumprod, x, 0, False)[1]  # the scan path, on its own merits
    (got,) = torch.autograd.grad(fscan.cumprod(x, 0).sum(), x)
    (expected,) = torch.autograd.grad(torch.cumprod(x, 0).sum(), x)
    torch.testing.assert_close(got, expected)
    assert torch.isfinite(got).all() and (got[:2] != 0).all()


def test_returns_torch_structs():
    out = fscan.cummax(torch.tensor([1.0, 3.0, 3.0, float("nan"), 5.0, float("nan")]), 0)
    assert isinstance(out, torch.return_types.cummax)
    assert out.indices.tolist() == [0, 1, 2, 3, 3, 5]  # ties: the later; NaN sticks
    values, indices = fscan.cummin(torch.tensor([2, 1, 1]), 0, reverse=True)
    assert values.tolist() == [1, 1, 1] and indices.tolist() == [1, 1, 2]


# ---- dispatch and precision -------------------------------------------------------


def test_dispatch_rule_on_the_benchmark_workloads():
    def wins(x, dim, op):
        return router.route(op, x, dim, False)[1]

    for op in (torch.cumsum, torch.cumprod, torch.cummax, torch.cummin, torch.logcumsumexp):
        assert not wins(torch.empty(2**20), 0, op)  # contiguous: torch's kernel
        assert not wins(torch.empty(4096, 256), 1, op)
        assert not wins(torch.empty(16, 64), 0, op)  # too small to repay the calls
        assert not wins(torch.empty(16, 4096), 0, op)  # too short
        assert wins(torch.empty(4096, 1024), 0, op)  # 1024 apart, a 16 MiB walk
        assert wins(torch.empty(1024, 4096).T, 1, op)  # layout, not shape, decides
    # logcumsumexp wins at any span; the others only past the caches (16 MiB).
    for shape, dim in [((4096, 256), 0), ((8, 1024, 256), 1)]:
        assert wins(torch.empty(shape), dim, torch.logcumsumexp)
        for op in (torch.cumsum, torch.cumprod, torch.cummax, torch.cummin):
            assert not wins(torch.empty(shape), dim, op)
    # A 16 MiB walk with steps 64 apart: cumsum's float64 carries do not pay there.
    assert wins(torch.empty(65536, 64), 0, torch.cummax)
    assert not wins(torch.empty(65536, 64), 0, torch.cumsum)


# Layouts of the routing table's non-contiguous cells: the memory's shape -> a view of it.
LAYOUTS = {
    "contiguous": lambda x: x,
    "t": lambda x: x.t(),
    "cols ::2": lambda x: x[:, ::2],
    "::2": lambda x: x[::2],
    "::64": lambda x: x[::64],
    "expand lanes": lambda x: x[:, :1].expand(x.shape),  # stride 0 after dim 0
    "expand steps": lambda x: x[:1].expand(x.shape),  # stride 0 along dim 0
    "transpose(1, 2)": lambda x: x.transpose(1, 2),
    "channels last": lambda x: x.contiguous(memory_format=torch.channels_last),
    "permute(3, 1, 0, 2)": lambda x: x.permute(3, 1, 0, 2),  # 3 outer groups: copied
}

# (op, layout, shape of memory, dim, reverse, route(...) = (kernel, blocked)): one call per
# cell of the router's table.
ROUTES = [
    (torch.cumsum, "contiguous", (2**15 - 1,), 0, False, (False, False)),  # small: torch's op
    (torch.cumsum, "contiguous", (2**19,), 0, False, (False, False)),  # one lane, below 2**20
    (torch.cumsum, "contiguous", (2**20,), 0, False, (True, False)),  # one lane, from 2**20
    (torch.cumprod, "contiguous", (1, 2**20), 1, False, (True, False)),
    (torch.cumprod, "contiguous", (2**17,), 0, True, (True, False)),  # one lane reversed: flips
    (torch.cumprod, "contiguous", (512, 512), 1, False, (False, False)),  # torch's threads
    (torch.cumsum, "contiguous", (65536, 4), 0, False, (False, False)),
    (torch.cumsum, "contiguous", (4096, 256), 0, False, (True, False)),  # 256 lanes: every op
    (torch.cummax, "contiguous", (4096, 256), 0, False, (True, False)),
    (torch.cummax, "contiguous", (2**20,), 0, False, (True, False)),  # float32: the lone walk
    (torch.cummax, "contiguous", (2**16,), 0, False, (False, False)),  # below 2**17
    (torch.cummax, "contiguous", (2**20,), 0, True, (True, False)),  # reversed: torch flips twice
    (torch.cummin, "contiguous", (4096, 256), 1, True, (True, False)),  # reversed, lanes
    (torch.cummax, "contiguous", (4096, 256), 1, False, (True, False)),  # walked alone
    (torch.cummax, "contiguous", (16384, 16), 1, False, (True, False)),  # float32 tiles
    (torch.cummin, "contiguous", (4096, 16), 1, False, (False, False)),  # below 2**17
    (torch.logcumsumexp, "contiguous", (2**15,), 0, True, (True, False)),  # one lane: its math
    (torch.logcumsumexp, "contiguous", (4, 8192), 1, False, (True, False)),  # compute-bound
    (torch.logcumsumexp, "contiguous", (4096, 256), 1, False, (True, False)),
    (torch.logcumsumexp, "contiguous", (4096, 256), 0, False, (True, True)),
    (torch.cummax, "contiguous", (16384, 1024), 0, False, (True, True)),  # a 64 MiB walk
    # Not contiguous: the kernel reads the view in place.
    (torch.cumsum, "t", (256, 4096), 0, False, (True, False)),  # 256 lanes after dim
    (torch.cummax, "t", (256, 4096), 0, False, (True, False)),
    (torch.cumsum, "t", (256, 4096), 1, False, (True, False)),  # innermost, 4096 apart
    (torch.cummin, "t", (256, 4096), 1, True, (True, False)),
    (torch.logcumsumexp, "t", (256, 4096), 1, False, (True, True)),
    (torch.cummax, "t", (256, 4096), 1, False, (True, False)),  # lanes side by side: rows
    (torch.cumprod, "transpose(1, 2)", (8, 256, 1024), 2, False, (True, False)),  # likewise
    (torch.cumsum, "transpose(1, 2)", (8, 256, 1024), 2, True, (True, False)),
    (torch.cumsum, "transpose(1, 2)", (8, 1024, 256), 2, False, (True, False)),  # likewise
    (torch.cummin, "transpose(1, 2)", (8, 256, 1024), 1, False, (True, False)),
    (torch.cumsum, "cols ::2", (4096, 512), 0, False, (True, False)),
    (torch.cumsum, "cols ::2", (4096, 512), 1, False, (False, False)),  # 2 apart: streams
    (torch.cummax, "cols ::2", (4096, 512), 1, True, (True, False)),  # reversed: torch copies
    (torch.logcumsumexp, "cols ::2", (4096, 512), 1, False, (True, False)),
    (torch.cumsum, "::2", (8192, 256), 0, False, (True, False)),
    (torch.cumprod, "expand lanes", (4096, 256), 0, False, (True, False)),
    (torch.cumprod, "expand lanes", (4096, 256), 1, False, (False, False)),  # stride 0
    (torch.cumsum, "expand steps", (4096, 256), 0, False, (True, False)),
    (torch.cumsum, "channels last", (8, 64, 32, 32), 1, False, (True, False)),  # over C
    (torch.cummax, "channels last", (8, 64, 32, 32), 0, False, (True, False)),  # copied: wins
    (torch.cumsum, "channels last", (8, 64, 32, 32), 3, True, (False, False)),  # copied: loses
    (torch.logcumsumexp, "channels last", (8, 64, 32, 32), 3, True, (True, True)),
    (torch.cumsum, "permute(3, 1, 0, 2)", (2, 2, 8, 4096), 3, False, (False, False)),  # copied
    (torch.cumsum, "::2", (2**21,), 0, False, (False, False)),  # one strided lane: torch's
    (torch.cumsum, "::2", (2**21,), 0, True, (True, False)),
    (torch.logcumsumexp, "::2", (2**21,), 0, True, (True, False)),
    (torch.cummax, "::64", (2**22,), 0, False, (False, True)),  # one lane, a 16 MiB walk
]


def routed(layout, shape):
    return LAYOUTS[layout](torch.randn(shape, generator=torch.Generator().manual_seed(0)))


@pytest.fixture
def kernel_possible(monkeypatch):
    """``kernel_possible(True)``: a compiler and mode "on"; ``(False, mode)``: none to be had,
    by mode "off" or (mode "on") by a compiler probe that found none after the lookup."""
    from fscan._engines.cpp import _kernel_builder, _kernel_registry, cpu_kernel

    def pin(possible, mode="on"):
        warm = threading.Event()
        warm.set()
        problem = None if possible else "no compiler (test)"
        monkeypatch.setattr(_kernel_builder, "warm", warm)
        monkeypatch.setattr(_kernel_registry, "compiler_problem", lambda: problem)
        monkeypatch.setattr(fscan.config, "cpu_kernel", mode)
        assert cpu_kernel.kernel_possible() is possible

    return pin


@pytest.mark.parametrize(("op", "layout", "shape", "dim", "reverse", "route"), ROUTES)
def test_routing_table(op, layout, shape, dim, reverse, route, kernel_possible):
    """Each cell of the router's table; the fast path takes torch's op exactly where the
    table says native, or, with no kernel to be had, where it says no parallel scan;
    and its result is torch's."""
    x = routed(layout, shape)
    assert x.is_contiguous() == (layout == "contiguous")
    if torch.get_num_threads() == 1:  # the rows that read the count: tests/test_route_threads.py
        pytest.skip("the table as on several threads")
    assert router.route(op, x, dim, reverse) == route
    assert router.route(op, x, dim, reverse)[0] == route[0]
    for possible, mode in ((True, "on"), (False, "off"), (False, "on")):
        kernel_possible(possible, mode)
        for backwards in (False, True):  # the fast path reads the cells of its direction
            kernel, parallel = router.route(op, x, dim, backwards)
            fast = router.native_first(op, x, dim, backwards)
            native = not parallel and (not kernel or not possible)
            assert (fast is not None) == native, (possible, mode, backwards)
            if fast is not None and x.numel() < 2**22:
                assert_same(fast, reference(op.__name__, x, dim, backwards))
    if not route[0]:
        assert router.path(op, x, dim, reverse) == ("blocked" if route[1] else "native")


@parametrize(name=OPS, dtype=[torch.float32, torch.int32, torch.bool], possible=[True, False])
def test_fast_path_only_where_the_table_says_native(name, dtype, possible, kernel_possible):
    """Over layouts, dims, grad and dtypes, ``native_first`` answers only for calls that
    ``route`` sends to torch's op (or, with no kernel to be had, to the kernel), and with
    torch's result (int and bool sums in int64)."""
    kernel_possible(possible, "on" if possible else "off")
    op = getattr(torch, name)
    base = sample((2, 64, 512), dtype, specials=False)
    if name == "logcumsumexp" and not dtype.is_floating_point:
        with pytest.raises(RuntimeError, match="not implemented"):  # torch's refusal, as before
            fscan.logcumsumexp(base, -1)
        return
    layouts = [
        base,
        base.transpose(0, 2),
        base[:, :, ::2],
        base[:, :, :1],
        base[:1].expand(4, -1, -1),
    ]
    for x in layouts:
        for dim in range(-x.ndim, x.ndim):
            for grad, reverse in itertools.product(
                (False, True) if dtype.is_floating_point else (False,), (False, True)
            ):
                x = x.detach().requires_grad_(grad)
                fast = router.native_first(op, x, dim, reverse)
                if fast is None:
                    continue
                kernel, parallel = router.route(op, x, dim % x.ndim, reverse)
                assert not parallel and (not kernel or not possible)
                assert_same(fast, getattr(fscan, name)(x, dim, reverse=reverse))
                with torch.no_grad():
                    assert_same(fast, reference(name, x, dim, reverse))


def test_fast_path_leaves_checks_and_tracing_to_the_checked_path(monkeypatch):
    x = torch.ones(8)
    for reverse in (False, True):
        assert router.native_first(torch.cumsum, x, 1, reverse) is None  # fscan's error
        assert router.native_first(torch.cumsum, x, True, reverse) is None  # a bool: no dim
        assert router.native_first(torch.cumsum, [1.0], 0, reverse) is None
    with pytest.raises(fscan.ScanIndexError, match=re.escape("fscan.cumsum: `dim` 1 is out")):
        fscan.cumsum(x, 1, reverse=True)
    with pytest.raises(fscan.ScanTypeError, match="`reverse` must be a bool"):
        fscan.cummax(x, 0, reverse=1)  # 1 == True, but no bool: the checks refuse it
    monkeypatch.setattr(router, "_is_compiling", lambda: True)
    assert router.native_first(torch.cumsum, x, 0) is None
    assert router.native_first(torch.cumsum, x, 0, True) is None


def kernel_or_skip(op, x, dim, reverse=False):
    """The drop-in's kernel route, built now; skip where this machine cannot build it."""
    from fscan._engines.cpp._cpp_build import compiler_problem

    if compiler_problem() is not None:
        pytest.skip(f"no C++ kernel here: {compiler_problem()}")
    assert router.route(op, x, dim, reverse)[0]
    with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):  # the suite runs "off"
        out = getattr(fscan, op.__name__)(x, dim, reverse=reverse)
        assert router.path(op, x, dim, reverse) == "cpp"
    return out


@parametrize(
    case=[
        (torch.float32, (2**20,), 0),
        (torch.float32, (1, 2**20), 1),
        (torch.float16, (2**20,), 0),
        (torch.int64, (2**20,), 0),
    ]
)
def test_one_lane_kernel_route_of_cumsum_matches_a_float64_oracle(case):
    """The one-lane kernel route: no less accurate than torch's op (the kernel sums
    float32 in float64 and rounds once), exact for integers, forward and reversed (forward
    in float32 and float64 only: other dtypes' forward calls are torch's,
    ``CHAIN_SUM_DTYPES``)."""
    dtype, shape, dim = case
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) if dtype.is_floating_point else None
    x = x.to(dtype) if x is not None else torch.randint(-9, 9, shape, generator=gen)
    if dtype not in CHAIN_SUM_DTYPES:
        assert not router.route(torch.cumsum, x, dim, False)[0]
    for reverse in (False, True) if dtype in CHAIN_SUM_DTYPES else (True,):
        out = kernel_or_skip(torch.cumsum, x, dim, reverse)
        flip = (lambda t: t.flip(dim)) if reverse else (lambda t: t)
        exact, theirs = flip(flip(x).double().cumsum(dim)), flip(torch.cumsum(flip(x), dim))
        assert out.dtype == theirs.dtype
        if not dtype.is_floating_point:
            assert torch.equal(out, theirs)
            continue
        assert rms_error(out, exact) <= 2 * rms_error(theirs, exact)


def test_innermost_kernel_routes_of_cumprod_and_logcumsumexp_match_torch():
    gen = torch.Generator().manual_seed(0)
    x = 1 + (torch.rand(2**20, generator=gen, dtype=torch.float64) - 0.5) * 1e-3
    torch.testing.assert_close(kernel_or_skip(torch.cumprod, x, 0), torch.cumprod(x, 0))
    y = torch.randn(4, 8192, generator=gen)
    exact = torch.logcumsumexp(y.double(), 1)
    torch.testing.assert_close(kernel_or_skip(torch.logcumsumexp, y, 1).double(), exact)
    ours = kernel_or_skip(torch.logcumsumexp, y, 1, reverse=True).double()
    torch.testing.assert_close(ours, torch.logcumsumexp(y.double().flip(1), 1).flip(1))


def rms_error(values, exact):
    return (values.double() - exact).pow(2).mean().sqrt().item()


@parametrize(dtype=[torch.float32, torch.float16, torch.bfloat16], shape=[(2**22,), (2**16, 64)])
def test_cumsum_precision_against_torch(dtype, shape, force):
    """No worse than 2x torch's error (it accumulates in float64 / float32) at n = 2**22
    elements: 1-D runs torch's kernel, (2**16, 64) over dim 0 the parallel scan (forced:
    by speed, torch's kernel takes it on this layout)."""
    force("parallel" if len(shape) == 2 else "native")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    exact = x.double().cumsum(0)
    torch_error = rms_error(torch.cumsum(x, 0), exact)
    assert rms_error(fscan.cumsum(x, 0), exact) <= 2 * torch_error
    assert rms_error(fscan.cumsum(x, 0, reverse=True), x.double().flip(0).cumsum(0).flip(0)) <= (
        2 * torch_error
    )


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(0, 40), min_size=1, max_size=3),
    data=st.data(),
    name=st.sampled_from(OPS),
    path=st.sampled_from(PATHS),
    reverse=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_random_shapes(shape, data, name, path, reverse, seed):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = sample(shape, torch.float64, generator=torch.Generator().manual_seed(seed))
    with pytest.MonkeyPatch.context() as patch:
        wins = path == "parallel"
        patch.setattr(router, "route", pinned(False, wins))
        patch.setattr(_ops, "native_first", lambda *args: None)
        assert_same(*run_both(name, x, dim, reverse))


# ---- errors --------------------------------------------------------------------


def test_errors():
    with raises(fscan.ScanTypeError, "fscan.cumsum: `input` must be a torch.Tensor, got list."):
        fscan.cumsum([1, 2], 0)
    with raises(fscan.ScanTypeError, "fscan.cummax: `reverse` must be a bool, got int 1."):
        fscan.cummax(torch.ones(3), 0, reverse=1)
    with raises(
        fscan.ScanValueError,
        "fscan.logcumsumexp: `dim` 1 is out of range for `input` with 1 dimension(s), "
        "expected a value in [-1, 0].",
    ):
        fscan.logcumsumexp(torch.ones(()), 1)
    with raises(fscan.ScanTypeError, "fscan.cumprod: `dtype` must be a torch.dtype or None"):
        fscan.cumprod(torch.ones(3), 0, dtype="float32")
    # The calls the fast path would take to torch's op still fail in fscan's words.
    with raises(fscan.ScanIndexError, "fscan.cumsum: `dim` 1 is out of range for `input`"):
        fscan.cumsum(torch.ones(3), 1)
    with raises(fscan.ScanIndexError, "fscan.cummax: `dim` -3 is out of range for `input`"):
        fscan.cummax(torch.ones(3, 2), -3)
    with raises(fscan.ScanTypeError, "fscan.cummin: `input` must be a torch.Tensor, got list."):
        fscan.cummin([1, 2], 0)
    with raises(fscan.ScanTypeError, "fscan.logcumsumexp: `dim` must be an int, got bool True."):
        fscan.logcumsumexp(torch.ones(3), True)


def test_drop_ins_take_numpy_dims_and_raise_index_error_like_torch():
    x = torch.rand(3, 4)
    torch.testing.assert_close(fscan.cumsum(x, np.int64(1)), torch.cumsum(x, 1))
    torch.testing.assert_close(fscan.associative_scan(torch.add, x, np.int32(-1)), x.cumsum(1))
    with pytest.raises(IndexError):
        torch.cumsum(x, 5)
    with pytest.raises(IndexError, match="out of range"):
        fscan.cumsum(x, 5)
