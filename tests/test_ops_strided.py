"""The drop-ins on non-contiguous inputs: the C++ kernel reads them in place (forced on,
built once per op and dtype in this module), and with no kernel to be had (mode "off", no
compiler) they are torch's op; against torch's op either way (values, dtypes, indices,
gradients), inputs untouched, outputs fresh."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import parametrize
from test_ops import assert_same, pinned, reference, sample

import fscan
from fscan import _ops
from fscan._engines.cpp import _kernel_builder, _kernel_registry, cpu_kernel
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._routing import cumulative as router

OPS = ["cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"]

# Views of logical shape (24, 40) (one element shape per dim, so one trace per op, dtype
# and dim), a (B, T, C) view of (B, C, T) memory, channels-last, a 1-D step slice:
# (name, memory shape, the view, dims scanned).
LAYOUTS = [
    ("transpose", (40, 24), lambda x: x.t(), (0, 1)),
    ("step slice", (24, 80), lambda x: x[:, ::2], (0, 1)),
    ("row slice", (48, 40), lambda x: x[::2], (0, -1)),
    ("offset slice", (27, 45), lambda x: x[3:, 5:], (0, 1)),
    ("expand lanes", (24, 1), lambda x: x.expand(24, 40), (0, 1)),
    ("expand steps", (1, 40), lambda x: x.expand(24, 40), (0, 1)),
    ("(B, T, C) of (B, C, T)", (3, 16, 20), lambda x: x.transpose(1, 2), (1, 2)),
    (
        "channels last",
        (2, 6, 5, 4),
        lambda x: x.contiguous(memory_format=torch.channels_last),
        (1, 2, 3),
    ),
    ("1-D step", (200,), lambda x: x[::2], (0,)),
]
CASES = [(name, dim) for name, _, _, dims in LAYOUTS for dim in dims]
BY_NAME = {name: (shape, view, dims) for name, shape, view, dims in LAYOUTS}


def strided(name, dtype, specials=True):
    shape, view, _ = BY_NAME[name]
    x = view(sample(shape, dtype, specials=specials))
    assert not x.is_contiguous()
    return x


needs_compiler = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)


@pytest.fixture(scope="module")
def eager():
    """Kernels built on first use and kept for the module: each op's kernel per dtype is
    compiled (or loaded from the disk cache) once per run."""
    with fscan.config.override(cpu_kernel="eager"):
        yield


@pytest.fixture
def kernel_route(monkeypatch, eager):
    """Every call routed to the kernel (small shapes included); the list of the kernel's
    answers (False where it declined) for the test to check."""
    served = []
    kernel = router._kernel

    def record(*args):
        out = kernel(*args)
        served.append(out is not None)
        return out

    monkeypatch.setattr(router, "route", pinned(True, False))
    monkeypatch.setattr(_ops, "native_first", lambda *args: None)
    monkeypatch.setattr(router, "_kernel", record)
    return served


def check(name, x, dim, reverse):
    """fscan's result is torch's; the input is untouched; the output is new memory."""
    before = x.clone()
    got = getattr(fscan, name)(x, dim, reverse=reverse)
    assert_same(got, reference(name, x, dim, reverse))
    torch.testing.assert_close(x, before, rtol=0, atol=0, equal_nan=True)
    values = got if isinstance(got, torch.Tensor) else got.values
    assert values.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


@needs_compiler
@parametrize(name=OPS, case=CASES, dtype=[torch.float64, torch.float32, torch.int32])
def test_kernel_reads_views_as_torch_does(kernel_route, name, case, dtype):
    """Ties, NaN and infinities included; both directions; on the kernel, read in place
    where the view collapses to its strides (all but channels-last over W)."""
    if name == "logcumsumexp" and not dtype.is_floating_point:
        pytest.skip("torch has no integer logcumsumexp")
    layout, dim = case
    x = strided(layout, dtype)
    copies = cpu_kernel.counters.copies
    for reverse in (False, True):
        check(name, x, dim, reverse)
    assert kernel_route == [True, True]
    copied = layout == "channels last" and dim % x.ndim == 3
    assert cpu_kernel.counters.copies - copies == (2 if copied else 0)


@needs_compiler
@parametrize(name=OPS, layout=["transpose", "step slice", "expand lanes", "(B, T, C) of (B, C, T)"])
def test_gradients_of_views_match_torch(kernel_route, name, layout):
    """With grad wanted the kernel declines, and autograd through the route's fallback
    gives torch's gradients, through the view."""
    shape, view, dims = BY_NAME[layout]
    base = sample(shape, torch.float64, specials=False)
    for dim in dims:
        for reverse in (False, True):
            cot = torch.randn(view(base).shape, dtype=torch.float64)

            def gradient(fn):
                leaf = base.clone().requires_grad_()
                out = fn(view(leaf))
                out = out if isinstance(out, torch.Tensor) else out.values
                return torch.autograd.grad(out, leaf, cot)[0]

            got = gradient(lambda t: getattr(fscan, name)(t, dim, reverse=reverse))
            torch.testing.assert_close(got, gradient(lambda t: reference(name, t, dim, reverse)))
    assert kernel_route and not any(kernel_route)  # declined: gradients wanted


# Views big enough for the kernel's route on their own merits (no forcing): (memory shape,
# view, dim).
ROUTED = [
    ((64, 1024), lambda x: x.t(), 0),  # 64 lanes after dim, read in place
    ((64, 4096), lambda x: x.t(), 1),  # innermost, 4096 apart, its lanes side by side
    ((64, 2048), lambda x: x[:, ::2], 0),
    ((64, 1), lambda x: x.expand(64, 1024), 0),
    ((4, 64, 256), lambda x: x.transpose(1, 2), 1),
]
# Innermost, 4096 apart, lanes not side by side (2 apart): cummax/cummin stay torch's.
INNERMOST_FAR = len(ROUTED)
ROUTED.append(((64, 4096, 2), lambda x: x[..., 0].t(), 1))


@needs_compiler
@parametrize(name=OPS, case=range(len(ROUTED)))
def test_routed_views_take_the_kernel(eager, name, case):
    shape, view, dim = ROUTED[case]
    x = view(torch.randn(shape, generator=torch.Generator().manual_seed(case)))
    op = getattr(torch, name)
    if case == INNERMOST_FAR and name in ("cummax", "cummin"):
        assert not router.route(op, x, dim, False)[0]
        return
    assert not x.is_contiguous() and router.route(op, x, dim, False)[0]
    with torch.no_grad():
        check(name, x, dim, False)
    assert router.path(op, x, dim) == "cpp"


@pytest.fixture(params=["off", "no compiler"])
def no_kernel(request, monkeypatch):
    """No kernel to be had: mode "off", or mode "on" after a toolchain lookup that found
    no compiler. The kernel must then never be built or run."""
    if request.param == "off":
        monkeypatch.setattr(fscan.config, "cpu_kernel", "off")
    else:
        warm = threading.Event()
        warm.set()
        monkeypatch.setattr(_kernel_builder, "warm", warm)
        monkeypatch.setattr(_kernel_registry, "compiler_problem", lambda: "no compiler (test)")
        monkeypatch.setattr(fscan.config, "cpu_kernel", "on")

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel was asked to build")

    monkeypatch.setattr(_kernel_registry, "build", refuse)
    monkeypatch.setattr(_kernel_registry, "submit", refuse)
    assert not cpu_kernel.kernel_possible()
    return request.param


@parametrize(name=OPS, case=range(len(ROUTED)))
def test_without_a_kernel_routed_views_are_torchs_op(no_kernel, name, case):
    """The kernel's cells go straight to torch's op (the fast path answers: no checked
    path) with torch's exact result where the parallel scan does not win, forward;
    reversed through the checked path."""
    shape, view, dim = ROUTED[case]
    x = view(sample(shape, torch.float32))
    op = getattr(torch, name)
    fast = router.native_first(op, x, dim)
    assert (fast is None) == router.route(op, x, dim, False)[1]
    if fast is not None:
        assert_same(fast, op(x, dim))
    check(name, x, dim, False)
    check(name, x, dim, True)


@parametrize(name=OPS, case=CASES)
def test_without_a_kernel_forced_routes_fall_back(no_kernel, monkeypatch, name, case):
    """The kernel's route forced on small views: the fallback is torch's op (or the
    parallel scan), same results, no build."""
    monkeypatch.setattr(router, "route", pinned(True, False))
    monkeypatch.setattr(_ops, "native_first", lambda *args: None)
    layout, dim = case
    x = strided(layout, torch.float64)
    for reverse in (False, True):
        check(name, x, dim, reverse)


@parametrize(case=CASES)
def test_reads_in_place_says_what_strided_view_copies(case):
    """The routing's cheap question agrees with what the kernel's reader does (no compiler
    needed): a view is copied exactly where ``reads_in_place`` says no."""
    layout, dim = case
    x = strided(layout, torch.float32)
    dim %= x.ndim
    before = cpu_kernel.counters.copies
    cpu_kernel.strided_view([x], dim)
    copied = cpu_kernel.counters.copies - before
    assert cpu_kernel.reads_in_place(x, dim) == (copied == 0)
    assert copied == (layout == "channels last" and dim == 3)
    y = torch.zeros(2, 2, 8, 16).permute(3, 1, 0, 2)  # over dim 3, three outer groups
    for dim in range(4):
        before = cpu_kernel.counters.copies
        cpu_kernel.strided_view([y], dim)
        copied = cpu_kernel.counters.copies - before
        assert cpu_kernel.reads_in_place(y, dim) == (copied == 0)
    assert not cpu_kernel.reads_in_place(y, 3)
