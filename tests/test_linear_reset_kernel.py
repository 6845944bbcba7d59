"""``fscan.linear_recurrence(reset=)`` on the segmented C++ kernel (the router's
``inplace`` route, :func:`fscan._routing.recurrence.reset_solve`), against a sequential
float64 loop: masks 1-D, full and broadcast; gates a number, a broadcast tensor or
full; ``initial`` (dropped by a reset at the first step); both directions; dims 0, 1,
-1; float32, float64, bfloat16; inf and NaN before a reset; ``exclusive=`` and
``acc_dtype=``. Calls that want gradients keep the chunked walk (gradcheck there), and
the ``"fscan"`` log names the engine that ran and why the kernel was passed over."""

from __future__ import annotations

import itertools
import logging
import zlib

import pytest
import torch

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem

pytestmark = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)

SHAPE = (37, 9, 40)  # steps along dims 0, 1, -1: 37, 9 and 40 (9 >= the carried bar, 8)
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    # Each step's state rounds to bfloat16 (as the chunked walk's do): states up to ~10
    # differ from the float64 loop by up to ~0.05 there, on either route.
    torch.bfloat16: dict(rtol=2e-2, atol=1e-1),
}


def loop(a, b, dim, reset, initial=None, reverse=False):
    """``h_t = b_t if reset_t else a_t h_{t-1} + b_t`` step by step, in float64."""
    b64 = b.double().movedim(dim, 0)
    gate = torch.as_tensor(a, dtype=b.dtype)  # a number in b's dtype, as fscan takes it
    a64 = torch.broadcast_to(gate.double(), b.shape).movedim(dim, 0)
    if reset.ndim == 1:
        mask = reset.reshape([-1] + [1] * (b.ndim - 1)).expand(b64.shape)
    else:
        mask = reset.expand(b.shape).movedim(dim, 0)
    h = torch.zeros(b64.shape[1:], dtype=torch.float64)
    if initial is not None:
        h = initial.double().expand(b64.shape[1:])
    out = torch.empty_like(b64)
    order = range(b64.shape[0] - 1, -1, -1) if reverse else range(b64.shape[0])
    for t in order:
        h = torch.where(mask[t], b64[t], a64[t] * h + b64[t])
        out[t] = h
    return out.movedim(0, dim)


def make_mask(kind, shape, dim, gen):
    n = shape[dim]
    if kind == "1d":
        mask = torch.rand(n, generator=gen) < 0.15
        mask[(n * 2) // 3] = True
        return mask
    dim %= len(shape)
    sizes = list(shape) if kind == "full" else [s if d == dim else 1 for d, s in enumerate(shape)]
    if kind == "broadcast":  # one more dim of the inputs' (the first or the last), 1 elsewhere
        other = -1 if dim == 0 else 0
        sizes[other] = shape[other]
    return torch.rand(sizes, generator=gen) < 0.15


def make_gates(kind, shape, dim, dtype, gen):
    if kind == "number":
        return 0.9
    if kind == "channel":  # one gate per element of the last dim, broadcast over the rest
        return torch.rand(shape[-1], generator=gen).to(dtype)
    return torch.rand(shape, generator=gen).to(dtype)


@pytest.fixture
def engines(caplog):
    """The engines the ``"fscan"`` log records for the test's linear_recurrence calls."""
    caplog.set_level(logging.DEBUG, logger="fscan")
    return lambda: [
        (r.fscan_engine, r.fscan_refused)
        for r in caplog.records
        if getattr(r, "fscan_api", None) == "fscan.linear_recurrence"
    ]


CASES = list(
    itertools.product(
        [0, 1, -1], [False, True], ["1d", "full", "broadcast"], ["number", "channel", "full"]
    )
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("dim", "reverse", "mask_kind", "gate_kind"), CASES, ids=str)
@pytest.mark.parametrize("carried", [False, True], ids=["no_initial", "initial"])
def test_kernel_matches_the_loop(engines, dtype, dim, reverse, mask_kind, gate_kind, carried):
    # crc32, not hash(): str hashes change per process, and a failure must reproduce.
    gen = torch.Generator().manual_seed(
        zlib.crc32(repr((dim, reverse, mask_kind, gate_kind)).encode())
    )
    b = torch.randn(SHAPE, generator=gen).to(dtype)
    a = make_gates(gate_kind, SHAPE, dim, dtype, gen)
    reset = make_mask(mask_kind, SHAPE, dim, gen)
    step = SHAPE[: dim % 3] + SHAPE[dim % 3 + 1 :]
    initial = torch.randn(step, generator=gen).to(dtype) if carried else None
    copies = [x.clone() for x in (b, reset)]
    with fscan.config.override(cpu_kernel="eager"), torch.no_grad():
        h = fscan.linear_recurrence(a, b, dim, initial=initial, reverse=reverse, reset=reset)
    assert engines()[-1] == ("cpp", {})
    assert h.dtype == dtype and h.shape == b.shape
    expected = loop(a, b, dim, reset, initial, reverse)
    torch.testing.assert_close(h.double(), expected, **TOL[dtype])
    assert torch.equal(b, copies[0]) and torch.equal(reset, copies[1])  # inputs untouched


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("mask_kind", ["1d", "full"])
def test_nothing_before_a_reset_leaks(engines, reverse, mask_kind):
    """inf and NaN before a reset stay before it, a zero gate at the reset too (0 * inf);
    a reset at the first step drops ``initial``, an inf ``initial`` included."""
    n, lanes = 64, 6
    b = torch.randn(n, lanes)
    a = torch.rand(n, lanes)
    at = lambda t: n - 1 - t if reverse else t  # the scan's t-th step
    b[at(10)], b[at(30), :3] = float("inf"), float("nan")
    a[at(11)] = 0.0  # a zero gate on the reset after the inf
    steps = [0, 11, 31]
    reset = torch.zeros(n, dtype=torch.bool)
    reset[[at(t) for t in steps]] = True
    if mask_kind == "full":
        reset = reset[:, None].expand(n, lanes).clone()
    initial = torch.full((lanes,), float("inf"))
    with fscan.config.override(cpu_kernel="eager"), torch.no_grad():
        h = fscan.linear_recurrence(a, b, 0, initial=initial, reverse=reverse, reset=reset)
    assert engines()[-1][0] == "cpp"
    expected = loop(a, b, 0, reset, initial, reverse)
    torch.testing.assert_close(h.double(), expected, equal_nan=True)
    after = slice(0, at(31)) if reverse else slice(31, n)
    assert torch.isfinite(h[after]).all()


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("carried", [False, True])
def test_exclusive_on_the_kernel(engines, reverse, carried):
    """``exclusive=True``: the state entering each step, 0 at the resets; the kernel
    scans the shifted steps and the exclusive shift writes its result in place."""
    gen = torch.Generator().manual_seed(3)
    b, a = torch.randn(50, 7, generator=gen), torch.rand(50, 7, generator=gen)
    reset = torch.rand(50, generator=gen) < 0.2
    initial = torch.randn(7, generator=gen) if carried else None
    with fscan.config.override(cpu_kernel="eager"), torch.no_grad():
        h = fscan.linear_recurrence(
            a, b, 0, initial=initial, reverse=reverse, reset=reset, exclusive=True
        )
    assert engines()[-1][0] == "cpp"
    inclusive = loop(a, b, 0, reset, initial, reverse)
    start = torch.zeros(1, 7, dtype=torch.float64) if initial is None else initial.double()[None]
    shifted = torch.cat([inclusive[1:], start]) if reverse else torch.cat([start, inclusive[:-1]])
    expected = torch.where(reset[:, None], 0.0, shifted)
    torch.testing.assert_close(h.double(), expected, rtol=1e-5, atol=1e-5)


def test_acc_dtype_runs_the_kernel_in_that_dtype(engines):
    gen = torch.Generator().manual_seed(4)
    b = torch.randn(300, 16, generator=gen).bfloat16()
    a = torch.rand(300, 16, generator=gen).bfloat16()
    reset = torch.rand(300, generator=gen) < 0.05
    with fscan.config.override(cpu_kernel="eager"), torch.no_grad():
        h = fscan.linear_recurrence(a, b, 0, reset=reset, acc_dtype=torch.float32)
    assert engines()[-1][0] == "cpp" and h.dtype == torch.bfloat16
    expected = loop(a, b, 0, reset).bfloat16().double()
    torch.testing.assert_close(h.double(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("mask_kind", ["1d", "full"])
def test_gradients_keep_the_chunked_walk(engines, reverse, mask_kind):
    gen = torch.Generator().manual_seed(5)
    shape = (40, 3)
    a = torch.rand(shape, generator=gen, dtype=torch.float64).requires_grad_()
    b = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
    initial = torch.randn(3, generator=gen, dtype=torch.float64).requires_grad_()
    reset = make_mask(mask_kind, shape, 0, gen)
    run = lambda a, b, initial: fscan.linear_recurrence(
        a, b, 0, initial=initial, reverse=reverse, reset=reset
    )
    with fscan.config.override(cpu_kernel="eager"):
        h = run(a, b, initial)
        engine, refused = engines()[-1]
        assert engine == "blocked"
        assert refused["cpp"].startswith("gradients wanted")
        torch.testing.assert_close(h, loop(a.detach(), b.detach(), 0, reset, initial, reverse))
        assert torch.autograd.gradcheck(run, (a, b, initial))


def test_the_log_says_why_the_kernel_was_passed_over(engines):
    b, reset = torch.randn(64, 4), torch.rand(64) < 0.1
    with torch.no_grad():
        with fscan.config.override(cpu_kernel="off"):
            fscan.linear_recurrence(0.5, b, 0, reset=reset)
        with fscan.config.override(cpu_kernel="eager"):
            fscan.linear_recurrence(0.5, b[:1], 0, reset=reset[:1])
            fscan.linear_recurrence(0.5, b, 0, reset=reset)
    off, one_step, served = engines()
    assert off == ("blocked", {"cpp": "fscan.config.cpu_kernel is 'off'"})
    assert one_step == ("blocked", {"cpp": "fewer than 2 steps: the loop is faster"})
    assert served == ("cpp", {})


def test_strided_inputs_and_mask_no_grad_mode_and_complex(engines):
    """Transposed ``b``, gates and mask are read through their strides; tensors that
    require grad under ``torch.no_grad()`` run the kernel; complex stays on the walk."""
    gen = torch.Generator().manual_seed(6)
    b = torch.randn(5, 60, generator=gen).t().requires_grad_()
    a = torch.rand(5, 60, generator=gen).t()
    reset = (torch.rand(5, 60, generator=gen) < 0.1).t()
    with fscan.config.override(cpu_kernel="eager"), torch.no_grad():
        h = fscan.linear_recurrence(a, b, 0, reset=reset)
        assert engines()[-1] == ("cpp", {})
        assert h.data_ptr() != b.data_ptr() and not h.requires_grad
        torch.testing.assert_close(h.double(), loop(a, b.detach(), 0, reset))
        z = torch.randn(60, 5, dtype=torch.complex64, generator=gen)
        fscan.linear_recurrence(a, z, 0, reset=reset)
    engine, refused = engines()[-1]
    assert engine == "blocked"
    assert refused["cpp"] == "dtype torch.complex64: the kernel takes floating point"
