"""linear_recurrence and linear_recurrence_matrix against a sequential loop."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import parametrize, raises
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan
from fscan._engines.chunked import chunk_size

# 0-31: the tree alone; 32+: chunked walks, with and without a tail, and (257,
# 1000) with a chunk-level recurrence that is itself chunked.
LENGTHS = [0, 1, 2, 3, 5, 31, 32, 33, 100, 257, 1000]


def loop(a, b, dim, initial=None, reverse=False, reset=None, step=None):
    """The reference: one step at a time, ``h = a h + b`` (or ``A @ h + b``)."""
    step = step or (lambda a_t, h: a_t * h)
    n = b.shape[dim]
    h, out = initial, [None] * n
    for t in range(n - 1, -1, -1) if reverse else range(n):
        b_t = b.select(dim, t)
        restart = h is None or (reset is not None and bool(reset[t]))
        h = b_t if restart else step(a.select(dim, t), h) + b_t
        out[t] = h.expand_as(b_t)
    return torch.stack(out, dim) if n else b.clone()


def full(a, b):
    return a.reshape((1,) * (b.ndim - a.ndim) + tuple(a.shape)).expand(b.shape)


def test_chunk_sizes():
    assert [chunk_size(n) for n in (31, 32, 100, 256, 257, 4096)] == [None, 8, 16, 64, 64, 64]


@parametrize(length=LENGTHS, reverse=[False, True], initial=[False, True])
def test_full_gate(length, reverse, initial):
    a = torch.rand(3, length, 4, dtype=torch.float64) + 0.2
    b = torch.randn(3, length, 4, dtype=torch.float64)
    h0 = torch.randn(3, 4, dtype=torch.float64) if initial else None
    out = fscan.linear_recurrence(a, b, 1, initial=h0, reverse=reverse)
    torch.testing.assert_close(out, loop(a, b, 1, h0, reverse))


@parametrize(gate=["number", "0-d", "per-channel", "per-step"], reverse=[False, True])
def test_broadcast_gates(gate, reverse):
    b = torch.randn(100, 5, dtype=torch.float64)
    a = {
        "number": 0.9,
        "0-d": torch.tensor(0.9, dtype=torch.float64),
        "per-channel": torch.rand(5, dtype=torch.float64),
        "per-step": torch.rand(100, 1, dtype=torch.float64),
    }[gate]
    out = fscan.linear_recurrence(a, b, 0, reverse=reverse)
    dense = full(torch.as_tensor(a, dtype=torch.float64), b)
    torch.testing.assert_close(out, loop(dense, b, 0, reverse=reverse))


@parametrize(dim=[0, 1, 2, -1, -3], length=[7, 70])
def test_dims(dim, length):
    shape = [3, 4, 2]
    shape[dim] = length
    a, b = torch.rand(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    torch.testing.assert_close(fscan.linear_recurrence(a, b, dim), loop(a, b, dim % 3))


@parametrize(length=[1, 20, 150], reverse=[False, True], initial=[False, True])
def test_reset(length, reverse, initial):
    a = torch.rand(length, 3, dtype=torch.float64) + 0.5
    b = torch.randn(length, 3, dtype=torch.float64)
    reset = torch.rand(length) < 0.2
    reset[0] = length == 20  # a reset at the start drops `initial`
    h0 = torch.randn(3, dtype=torch.float64) if initial else None
    out = fscan.linear_recurrence(a, b, 0, initial=h0, reverse=reverse, reset=reset)
    torch.testing.assert_close(out, loop(a, b, 0, h0, reverse, reset))


def test_per_row_reset():
    a, b = torch.rand(80, 4, 3, dtype=torch.float64), torch.randn(80, 4, 3, dtype=torch.float64)
    reset = torch.rand(80, 4, 1) < 0.1
    out = fscan.linear_recurrence(a, b, 0, reset=reset)
    for row in range(4):
        expected = loop(a[:, row], b[:, row], 0, reset=reset[:, row, 0])
        torch.testing.assert_close(out[:, row], expected)


@parametrize(length=[9, 100], reverse=[False, True])
def test_complex(length, reverse):
    a = torch.randn(length, 3, dtype=torch.complex128) * 0.6
    b = torch.randn(length, 3, dtype=torch.complex128)
    h0 = torch.randn(3, dtype=torch.complex128)
    out = fscan.linear_recurrence(a, b, 0, initial=h0, reverse=reverse)
    torch.testing.assert_close(out, loop(a, b, 0, h0, reverse))


def test_dtype_promotion_and_float32_accuracy():
    a, b = torch.rand(300, 8), torch.randn(300, 8, dtype=torch.float64)
    assert fscan.linear_recurrence(a, b, 0).dtype == torch.float64
    assert (
        fscan.linear_recurrence(0.5, torch.ones(4, dtype=torch.float16), 0).dtype == torch.float16
    )
    b32 = b.float()
    expected = loop(a.double(), b32.double(), 0)
    torch.testing.assert_close(
        fscan.linear_recurrence(a, b32, 0).double(), expected, atol=1e-5, rtol=1e-5
    )


def test_inputs_untouched():
    a, b, h0 = torch.rand(64, 2), torch.randn(64, 2), torch.randn(2)
    copies = [t.clone() for t in (a, b, h0)]
    out = fscan.linear_recurrence(a, b, 0, initial=h0)
    assert all(torch.equal(t, c) for t, c in zip((a, b, h0), copies))
    assert out.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()


@parametrize(length=[12, 41], reverse=[False, True], gate=["full", "per-channel"])
def test_gradcheck(length, reverse, gate):
    """12 steps: the tree; 41: chunks of 8 and a tail."""
    shape = (length, 2) if gate == "full" else (2,)
    a = (torch.rand(shape, dtype=torch.float64) * 0.9).requires_grad_()
    b = torch.randn(length, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, dtype=torch.float64, requires_grad=True)
    reset = torch.rand(length) < 0.1

    def run(a, b, h0):
        return fscan.linear_recurrence(a, b, 0, initial=h0, reverse=reverse, reset=reset)

    assert torch.autograd.gradcheck(run, (a, b, h0))


def test_gradcheck_complex():
    a = (torch.randn(40, 2, dtype=torch.complex128) * 0.5).requires_grad_()
    b = torch.randn(40, 2, dtype=torch.complex128, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: fscan.linear_recurrence(a, b, 0), (a, b))


def test_vmap():
    a, b = torch.rand(5, 100, 3), torch.randn(5, 100, 3)
    h0 = torch.randn(5, 3)
    batched = torch.func.vmap(lambda a, b, h: fscan.linear_recurrence(a, b, 0, initial=h))
    torch.testing.assert_close(batched(a, b, h0), fscan.linear_recurrence(a, b, 1, initial=h0))


@settings(max_examples=30, deadline=None)
@given(
    length=st.integers(0, 300),
    reverse=st.booleans(),
    width=st.integers(1, 3),
    with_initial=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_loop(length, reverse, width, with_initial, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.rand(length, width, dtype=torch.float64, generator=gen) * 1.2
    b = torch.randn(length, width, dtype=torch.float64, generator=gen)
    h0 = torch.randn(width, dtype=torch.float64, generator=gen) if with_initial else None
    out = fscan.linear_recurrence(a, b, 0, initial=h0, reverse=reverse)
    torch.testing.assert_close(out, loop(a, b, 0, h0, reverse))


# ---- the matrix-valued recurrence ------------------------------------------


def matvec(A_t, h):
    return (A_t @ h.unsqueeze(-1)).squeeze(-1)


@parametrize(length=[0, 1, 2, 9, 40], reverse=[False, True], initial=[False, True])
def test_matrix(length, reverse, initial):
    A = torch.randn(length, 2, 3, 3, dtype=torch.float64) / 2
    b = torch.randn(length, 2, 3, dtype=torch.float64)
    h0 = torch.randn(2, 3, dtype=torch.float64) if initial else None
    out = fscan.linear_recurrence_matrix(A, b, 0, initial=h0, reverse=reverse)
    torch.testing.assert_close(out, loop(A, b, 0, h0, reverse, step=matvec))


def test_matrix_shared_gates_dim_and_reset():
    A = torch.randn(1, 30, 3, 3, dtype=torch.float64) / 2  # shared over the batch of 4
    b = torch.randn(4, 30, 3, dtype=torch.float64)
    reset = torch.rand(30) < 0.2
    out = fscan.linear_recurrence_matrix(A, b, -2, reset=reset)
    expected = loop(A.expand(4, 30, 3, 3), b, 1, reset=reset, step=matvec)
    torch.testing.assert_close(out, expected)


@parametrize(reverse=[False, True])
def test_matrix_gradcheck(reverse):
    A = (torch.randn(15, 2, 2, dtype=torch.float64) / 2).requires_grad_()
    b = torch.randn(15, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, dtype=torch.float64, requires_grad=True)

    def run(A, b, h0):
        return fscan.linear_recurrence_matrix(A, b, 0, initial=h0, reverse=reverse)

    assert torch.autograd.gradcheck(run, (A, b, h0))


@parametrize(reverse=[False, True], per_row=[False, True])
def test_matrix_nan_inf_do_not_cross_a_reset(reverse, per_row):
    """Issue 10, case 6: values and gradients as the loop's, NaN and inf included."""
    A = torch.randn(12, 2, 2, 2, dtype=torch.float64) / 2
    b = torch.randn(12, 2, 2, dtype=torch.float64)
    b[3, 0, 1] = float("nan")
    h0 = torch.tensor([float("inf"), 1.0], dtype=torch.float64)
    reset = torch.zeros(12, dtype=torch.bool)
    reset[[-1 if reverse else 0, 6]] = True
    mask = reset[:, None, None].expand(12, 2, 1) if per_row else reset
    A_, b_, h0_ = (t.clone().requires_grad_() for t in (A, b, h0))
    out = fscan.linear_recurrence_matrix(A_, b_, 0, initial=h0_, reverse=reverse, reset=mask)
    cot = torch.randn_like(out)
    got = torch.autograd.grad(out, (A_, b_, h0_), cot)
    A_, b_, h0_ = (t.clone().requires_grad_() for t in (A, b, h0))
    want = loop(A_, b_, 0, h0_.expand(2, 2), reverse, reset, step=matvec)
    torch.testing.assert_close(out, want, equal_nan=True)
    assert torch.isnan(out).any() and not torch.isinf(out).any()
    ref = torch.autograd.grad(want, (A_, b_, h0_), cot, allow_unused=True)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, torch.zeros_like(g) if r is None else r, equal_nan=True)


# ---- errors --------------------------------------------------------------------


def test_gate_must_broadcast():
    with raises(
        fscan.ScanValueError,
        "fscan.linear_recurrence: `a` of shape (4,) does not broadcast to `b` of shape (5, 3)",
    ):
        fscan.linear_recurrence(torch.ones(4), torch.ones(5, 3), 0)


def test_broadcasts_to_agrees_with_torch():
    """The check's own comparison of int sizes says what torch.broadcast_shapes says, on
    every pair of shapes of up to 3 dims of sizes 0-3 (sizes 0 and 1 included)."""
    import itertools

    from fscan._recurrences.args import broadcasts_to

    def torchs(shape, target):
        try:
            return torch.broadcast_shapes(shape, target) == target
        except RuntimeError:
            return False

    sizes = (0, 1, 2, 3)
    shapes = [torch.Size(p) for n in range(4) for p in itertools.product(sizes, repeat=n)]
    for shape, target in itertools.product(shapes, shapes):
        assert broadcasts_to(shape, target) == torchs(shape, target), (shape, target)


def test_initial_must_fit_one_step():
    with raises(
        fscan.ScanValueError,
        "`initial` of shape (5,) does not broadcast to one step of `b`, shape (3,)",
    ):
        fscan.linear_recurrence(0.5, torch.ones(5, 3), 0, initial=torch.ones(5))


def test_b_must_be_a_tensor():
    with raises(fscan.ScanTypeError, "fscan.linear_recurrence: `b` must be a torch.Tensor"):
        fscan.linear_recurrence(0.5, [1.0, 2.0], 0)


def test_dim_out_of_range():
    with raises(fscan.ScanValueError, "`dim` 2 is out of range for `b` with 2 dimension(s)"):
        fscan.linear_recurrence(0.5, torch.ones(5, 3), 2)


def test_reset_checked():
    with raises(fscan.ScanValueError, "fscan.linear_recurrence: `reset` has length 3, expected 5"):
        fscan.linear_recurrence(0.5, torch.ones(5, 3), 0, reset=torch.ones(3, dtype=torch.bool))


def test_matrix_shapes():
    with raises(
        fscan.ScanValueError,
        "fscan.linear_recurrence_matrix: `A` of shape (5, 3, 2) does not fit `b` of shape (5, 3)",
    ):
        fscan.linear_recurrence_matrix(torch.ones(5, 3, 2), torch.ones(5, 3), 0)
    with raises(fscan.ScanValueError, "`dim` 1 is the state dimension of `b`"):
        fscan.linear_recurrence_matrix(torch.ones(5, 3, 3), torch.ones(5, 3), 1)


# ---- the custom backward ----------------------------------------------------------


def grads_of(fn, inputs, cot):
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, cot, allow_unused=True)


def assert_same_grads(fn, inputs, cot=None):
    """``fn`` through fscan and through the sequential loop: same values and gradients."""
    if cot is None:
        with torch.no_grad():
            cot = torch.randn_like(fn(fscan.linear_recurrence, *inputs))
    out, got = grads_of(lambda *x: fn(fscan.linear_recurrence, *x), inputs, cot)
    ref, want = grads_of(lambda *x: fn(reference, *x), inputs, cot)
    torch.testing.assert_close(out, ref, equal_nan=True)
    for g, w in zip(got, want):
        if g is None:  # an input neither uses
            assert w is None
            continue
        w = torch.zeros_like(g) if w is None else w  # the loop may not touch an input
        torch.testing.assert_close(g, w, equal_nan=True)


def reference(a, b, dim, initial=None, reverse=False, reset=None):
    """``fscan.linear_recurrence``'s signature (1-D ``reset``) over the loop."""
    a = torch.as_tensor(a, dtype=b.dtype)
    step = None if initial is None else initial.expand(b.select(dim, 0).shape)
    return loop(full(a, b), b, dim, step, reverse, reset)


@parametrize(
    length=[5, 40, 130],
    gate=["number", "0-d", "per-channel", "per-step", "full"],
    reverse=[False, True],
)
def test_backward_matches_loop(length, gate, reverse):
    """Broadcast gates get gradients summed over the dims they broadcast over."""
    a = {
        "number": 0.9,
        "0-d": torch.tensor(0.9, dtype=torch.float64),
        "per-channel": torch.rand(3, dtype=torch.float64),
        "per-step": torch.rand(length, 1, dtype=torch.float64),
        "full": torch.rand(2, length, 3, dtype=torch.float64),
    }[gate]
    b = torch.randn(2, length, 3, dtype=torch.float64)
    h0 = torch.randn(3, dtype=torch.float64)  # lower rank than a step: broadcast
    reset = torch.rand(length) < 0.1
    tensors = [b, h0] if gate == "number" else [a, b, h0]

    def fn(rec, *xs):
        gate_, b_, h0_ = (a, *xs) if gate == "number" else xs
        return rec(gate_, b_, 1, initial=h0_, reverse=reverse, reset=reset)

    assert_same_grads(fn, tensors)


def test_backward_saves_only_a_and_h():
    a = torch.rand(200, 4, requires_grad=True)
    b = torch.randn(200, 4, requires_grad=True)
    h = fscan.linear_recurrence(a, b, 0)
    saved = [t for t in h.grad_fn.saved_tensors if t is not None]
    assert [t.data_ptr() for t in saved] == [a.data_ptr(), h.data_ptr()]


@parametrize(length=[9, 34], reverse=[False, True])
def test_second_order(length, reverse):
    a = (torch.rand(length, 2, dtype=torch.float64) * 0.9).requires_grad_()
    b = torch.randn(length, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, dtype=torch.float64, requires_grad=True)
    reset = torch.rand(length) < 0.15

    def run(a, b, h0):
        return fscan.linear_recurrence(a, b, 0, initial=h0, reverse=reverse, reset=reset)

    assert torch.autograd.gradgradcheck(run, (a, b, h0))


def test_second_order_complex_per_channel():
    a = (torch.randn(2, dtype=torch.complex128) * 0.5).requires_grad_()
    b = torch.randn(33, 2, dtype=torch.complex128, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda a, b: fscan.linear_recurrence(a, b, 0), (a, b))


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")  # torch's jvp decomps
def test_torch_func_transforms():
    a = torch.rand(60, 3, dtype=torch.float64)
    b = torch.randn(60, 3, dtype=torch.float64)
    loss = lambda a, b: fscan.linear_recurrence(a, b, 0).pow(2).sum()
    ref = lambda a, b: loop(a, b, 0).pow(2).sum()
    for fn in (torch.func.grad(loss, argnums=(0, 1)), torch.func.jacrev(loss, argnums=(0, 1))):
        got, want = fn(a, b), torch.func.grad(ref, argnums=(0, 1))(a, b)
        torch.testing.assert_close(got, want)
    tangent = torch.randn_like(a)
    _, jvp = torch.func.jvp(lambda a: fscan.linear_recurrence(a, b, 0), (a,), (tangent,))
    _, want = torch.func.jvp(lambda a: loop(a, b, 0), (a,), (tangent,))
    torch.testing.assert_close(jvp, want)
    _, vjp_fn = torch.func.vjp(lambda a: fscan.linear_recurrence(a, b, 0), a)
    _, want_fn = torch.func.vjp(lambda a: loop(a, b, 0), a)
    torch.testing.assert_close(vjp_fn(tangent), want_fn(tangent))
    batched = torch.func.vmap(torch.func.grad(loss), in_dims=(0, None))(a.expand(2, 60, 3), b)
    torch.testing.assert_close(batched[1], torch.func.grad(ref)(a, b))


@settings(max_examples=20, deadline=None)
@given(
    length=st.integers(1, 150),
    reverse=st.booleans(),
    gate=st.sampled_from(["per-channel", "full"]),
    with_initial=st.booleans(),
    reset_rate=st.sampled_from([0.0, 0.1, 0.5]),
    seed=st.integers(0, 2**16),
)
def test_property_gradients_match_loop(length, reverse, gate, with_initial, reset_rate, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (2,) if gate == "per-channel" else (length, 2)
    a = torch.rand(shape, dtype=torch.float64, generator=gen) * 1.1
    b = torch.randn(length, 2, dtype=torch.float64, generator=gen)
    h0 = torch.randn(2, dtype=torch.float64, generator=gen)
    reset = torch.rand(length, generator=gen) < reset_rate

    def fn(rec, a, b, h0):
        h0 = h0 if with_initial else None
        return rec(a, b, 0, initial=h0, reverse=reverse, reset=reset)

    assert_same_grads(fn, [a, b, h0])


# ---- NaN and inf (issue 10, case 6), empty dims (case 7), initial (case 9) --------


NAN, INF = float("nan"), float("inf")


def test_nan_does_not_cross_a_reset():
    reset = torch.tensor([False, True, False])
    out = fscan.linear_recurrence(0.5, torch.tensor([NAN, 1.0, 1.0]), 0, reset=reset)
    torch.testing.assert_close(out, torch.tensor([NAN, 1.0, 1.5]), equal_nan=True)


@parametrize(length=[3, 40, 300], reverse=[False, True], poison=[NAN, INF, -INF])
def test_nan_inf_propagate_as_the_loop(length, reverse, poison):
    """Values and gradients: NaN/inf reach what the loop reaches, never further."""
    gen = torch.Generator().manual_seed(length)
    a = torch.rand(length, 2, dtype=torch.float64, generator=gen)
    b = torch.randn(length, 2, dtype=torch.float64, generator=gen)
    b[length // 3, 0] = poison
    h0 = torch.tensor([INF, 1.0], dtype=torch.float64)
    reset = torch.rand(length, generator=gen) < 0.2
    reset[-1 if reverse else 0] = True  # drops the inf `initial`
    reset[(2 * length) // 3] = True
    cot = torch.randn(length, 2, dtype=torch.float64, generator=gen)

    def fn(rec, a, b, h0):
        return rec(a, b, 0, initial=h0, reverse=reverse, reset=reset)

    assert_same_grads(fn, [a, b, h0], cot)


def test_inf_initial_dropped_by_a_first_reset():
    reset = torch.tensor([True, False, False])
    for n in (3, 50):
        reset = torch.zeros(n, dtype=torch.bool)
        reset[0] = True
        out = fscan.linear_recurrence(0.5, torch.ones(n), 0, initial=torch.tensor(INF), reset=reset)
        assert torch.isfinite(out).all()


@parametrize(dim=[0, 2], gate=["per-channel", "full"], with_reset=[False, True])
def test_empty_non_scan_dims_with_gradients(dim, gate, with_reset):
    b = torch.randn(7, 0, 3, requires_grad=True) if dim == 0 else torch.randn(3, 0, 7)
    b.requires_grad_()
    a = torch.rand((3,) if gate == "per-channel" else b.shape, requires_grad=True)
    a = a if dim == 0 or gate == "full" else torch.rand(1, 1, 7, requires_grad=True)
    h0 = torch.randn(1, requires_grad=True)
    reset = torch.zeros(7, dtype=torch.bool) if with_reset else None
    out = fscan.linear_recurrence(a, b, dim, initial=h0, reset=reset)
    assert out.shape == b.shape
    ga, gb, gh = torch.autograd.grad(out.sum(), (a, b, h0))
    assert ga.shape == a.shape and gb.shape == b.shape and gh.shape == h0.shape
    assert not ga.any() and not gh.any()


def test_length_zero_gradients_are_zeros():
    a = torch.rand(3, requires_grad=True)
    b = torch.randn(0, 3, requires_grad=True)
    (ga,) = torch.autograd.grad(fscan.linear_recurrence(a, b, 0).sum(), (a,))
    assert torch.equal(ga, torch.zeros(3))


@parametrize(initial=["0-d", "lower rank", "size-1 dims"], length=[10, 100])
def test_initial_broadcasts_on_every_path(initial, length):
    """Time not dim 0 and a chunked length: `initial` as the docstring allows it."""
    b = torch.randn(2, length, 3, dtype=torch.float64)
    a = torch.rand(2, length, 3, dtype=torch.float64)
    h0 = {
        "0-d": torch.tensor(2.0, dtype=torch.float64),
        "lower rank": torch.randn(3, dtype=torch.float64),
        "size-1 dims": torch.randn(2, 1, dtype=torch.float64),
    }[initial]

    def fn(rec, a, b, h0):
        return rec(a, b, 1, initial=h0)

    assert_same_grads(fn, [a, b, h0])


# ---- gate products that under- or overflow, at chunk boundaries -------------------
#
# The chunked walk composes chunks as `A e + B` with `A` a product of gates; the C++
# kernel composes its chunk totals the same way. Where `A` underflows to 0 and meets
# an inf state, or overflows and meets a zero one, the loop's answer must come back
# (0 * inf and inf * 0 are NaN). Oracle: the float64 loop. Lengths: under 32 steps
# (the loop itself), 1000 (chunks of 64, a chunk-level loop), 5000 (a chunk-level
# recurrence that is chunked again); every position in scan order.


def _scan_index(t, n, reverse):
    """The index of the scan's step `t`."""
    return n - 1 - t if reverse else t


def _products_case(name, n, dtype, reverse):
    """(a, b, initial) of `name`: values that make gate products leave the range."""
    at = lambda t: _scan_index(t, n, reverse)
    tiny_gate = 1e-10 if dtype == torch.float32 else 1e-80  # 8 steps: below the range
    b = torch.ones(n, 3, dtype=dtype)
    initial = None
    if name == "inf state, gates underflow":
        a = torch.full((n, 3), tiny_gate, dtype=dtype)
        b[at(0), 0] = INF
        b[at(min(n - 1, 63)), 1] = -INF  # the last step of the first chunk
        initial = torch.tensor([1.0, 1.0, INF], dtype=dtype)
    elif name == "zero state, gates overflow":  # the example
        a = torch.full((n, 3), 2.0 if n > 200 else 1 / tiny_gate, dtype=dtype)
        b.zero_()
        last = 100 if n > 200 else n // 2  # ones over the last steps: up to 2 ** 100
        b[slice(0, last) if reverse else slice(n - last, n)] = 1.0
        initial = torch.zeros(3, dtype=dtype)
    elif name == "huge state, gates underflow":  # the loop keeps its decayed part
        a = torch.full((n, 3), tiny_gate, dtype=dtype)
        b.zero_()
        big = torch.finfo(dtype).max / 4
        for t in (min(n - 1, 63), min(n - 1, 64 * 64 - 1)):
            b[at(t)] = big
    elif name == "zero and inf gates meet inf states":
        a = torch.full((n, 3), 0.5, dtype=dtype)
        b[at(0), :] = INF
        a[at(n // 2), 0] = 0.0  # the loop: 0 * inf = NaN from here on
        a[at(n // 3), 1] = INF  # inf * inf = inf
        a[at(n // 4), 2] = NAN
    else:
        raise AssertionError(name)
    return a, b, initial


PRODUCT_CASES = [
    "inf state, gates underflow",
    "zero state, gates overflow",
    "huge state, gates underflow",
    "zero and inf gates meet inf states",
]


def _assert_loop_answer(got, a, b, initial, reverse):
    want = loop(a.double(), b.double(), 0, None if initial is None else initial.double(), reverse)
    want = want.to(got.dtype)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (got, want)
    tol = dict(rtol=1e-4, atol=1e-30) if got.dtype == torch.float32 else dict(rtol=1e-9, atol=0)
    torch.testing.assert_close(got, want, equal_nan=True, **tol)


@parametrize(
    case=PRODUCT_CASES,
    length=[20, 1000, 5000],
    reverse=[False, True],
    dtype=[torch.float32, torch.float64],
)
def test_gate_products_out_of_range_give_the_loop_answer(case, length, reverse, dtype):
    a, b, initial = _products_case(case, length, dtype, reverse)
    _assert_loop_answer(fscan.linear_recurrence(a, b, 0, reverse=reverse), a, b, None, reverse)
    got = fscan.linear_recurrence(a, b, 0, reverse=reverse, initial=initial)
    _assert_loop_answer(got, a, b, initial, reverse)


@parametrize(case=PRODUCT_CASES, reverse=[False, True])
def test_gate_products_out_of_range_one_lane(case, reverse):
    a, b, initial = _products_case(case, 1000, torch.float64, reverse)
    a, b, initial = a[:, 0], b[:, 0], None if initial is None else initial[0]
    got = fscan.linear_recurrence(a, b, 0, reverse=reverse, initial=initial)
    _assert_loop_answer(got, a, b, initial, reverse)


# complex infinities' NaN parts depend on how a step is fused (a * h + b or addcmul)
@parametrize(case=[c for c in PRODUCT_CASES if "inf" not in c], reverse=[False, True])
def test_gate_products_out_of_range_complex(case, reverse):
    a, b, initial = _products_case(case, 1000, torch.float64, reverse)
    a, b = a * torch.exp(0.1j * torch.ones(())), b.to(torch.complex128)
    initial = None if initial is None else initial.to(torch.complex128)
    got = fscan.linear_recurrence(a, b, 0, reverse=reverse, initial=initial)
    want = loop(a, b, 0, initial, reverse)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-9, atol=0)


@parametrize(case=PRODUCT_CASES, reverse=[False, True])
def test_gate_products_out_of_range_in_the_backward(case, reverse):
    """The adjoint is a linear recurrence too: cotangents carried across chunks."""
    a, b, _ = _products_case(case, 1000, torch.float64, reverse)
    a = a.clone().requires_grad_()
    b = b.clone().requires_grad_()
    cot = torch.rand(b.shape, dtype=b.dtype)
    cot[_scan_index(999, 1000, reverse), 0] = INF  # carried back over every chunk
    got = torch.autograd.grad(fscan.linear_recurrence(a, b, 0, reverse=reverse), (a, b), cot)
    want = torch.autograd.grad(loop(a, b, 0, reverse=reverse), (a, b), cot)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-9, atol=0)


@parametrize(case=PRODUCT_CASES[:2], reverse=[False, True], shape=["one lane", "16 lanes"])
def test_gate_products_out_of_range_on_the_kernel(case, reverse, shape):
    """The C++ kernel's chunk carries (chunks of 2048+ steps: float64 products leave
    the range too): 4 threads, so that 16 lanes are split into chunks as well."""
    n = 40000
    a, b, initial = _products_case(case, n, torch.float64, reverse)
    if case == "inf state, gates underflow":
        a.fill_(0.5)  # 0.5 ** 2048 underflows; 0.5 * inf does not
    if shape == "one lane":
        a, b = a[:, 0].contiguous(), b[:, 0].contiguous()
        initial = None if initial is None else initial[0]
    else:
        a, b = a.repeat(1, 6)[:, :16].contiguous(), b.repeat(1, 6)[:, :16].contiguous()
        initial = None if initial is None else initial.repeat(6)[:16]
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with fscan.config.override(cpu_kernel="eager"):
            got = fscan.linear_recurrence(a, b, 0, reverse=reverse)
            with_initial = fscan.linear_recurrence(a, b, 0, reverse=reverse, initial=initial)
    finally:
        torch.set_num_threads(threads)
    _assert_loop_answer(got, a, b, None, reverse)
    _assert_loop_answer(with_initial, a, b, initial, reverse)


def test_kernel_chunk_carries_keep_the_gates():
    """With few columns per thread the kernel's lane path splits time into chunks; the
    carries composed from their totals need each chunk's gate product, which the
    kernel computes though it does not store it (only `h` is kept)."""
    a, b = torch.ones(40000, 16, dtype=torch.float64), torch.ones(40000, 16, dtype=torch.float64)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with fscan.config.override(cpu_kernel="eager"):
            got = fscan.linear_recurrence(a, b, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, b.cumsum(0))


@parametrize(length=[100, 300, 5000], reverse=[False, True], poison=[NAN, INF, -INF])
def test_resets_stop_inf_nan_at_chunk_boundaries(length, reverse, poison):
    """A poisoned last step of a chunk, a reset at the next chunk's first step (and at
    a chunk-level boundary of 64 chunks): values and gradients as the loop's."""
    gen = torch.Generator().manual_seed(length)
    a = torch.rand(length, 2, dtype=torch.float64, generator=gen)
    b = torch.randn(length, 2, dtype=torch.float64, generator=gen)
    reset = torch.zeros(length, dtype=torch.bool)
    for end in (64, 128, 64 * 64):
        if end < length:
            b[_scan_index(end - 1, length, reverse), 0] = poison
            reset[_scan_index(end, length, reverse)] = True
    cot = torch.randn(length, 2, dtype=torch.float64, generator=gen)

    def fn(rec, a, b):
        return rec(a, b, 0, reverse=reverse, reset=reset)

    assert_same_grads(fn, [a, b], cot)


@parametrize(length=[20, 100], reverse=[False, True])
def test_torch_func_gradients_stop_at_a_reset(length, reverse):
    """Under torch.func the walk is differentiated by autograd: where a reset drops an
    infinite state, the gate's gradient there is 0 (the loop does not use it), and no
    NaN spreads through the product of the chunk holding the reset."""
    a = torch.rand(length, 2, dtype=torch.float64)
    b = torch.ones(length, 2, dtype=torch.float64)
    at = (lambda t: length - 1 - t) if reverse else (lambda t: t)
    b[at(3)] = INF
    reset = torch.zeros(length, dtype=torch.bool)
    reset[at(length // 2)] = True
    later = torch.zeros(length, 2, dtype=torch.float64)  # a loss on the states after it
    later[[at(t) for t in range(length // 2, length)]] = 1.0

    def loss(rec, a):
        return (rec(a, b, 0, reverse=reverse, reset=reset) * later).sum()

    got = torch.func.grad(lambda a: loss(fscan.linear_recurrence, a))(a)
    a_ = a.clone().requires_grad_()
    (want,) = torch.autograd.grad(loss(reference, a_), a_)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert torch.isfinite(got[[at(t) for t in range(length // 2, length)]]).all()


@parametrize(length=[5, 100])
def test_first_state_is_the_first_input(length):
    """Without `initial` no gate multiplies a zero state: an infinite or NaN first gate
    does not reach the first state, on the loop, the tree and the chunked walk alike."""
    b = torch.randn(length, 2, dtype=torch.float64)
    a = torch.rand(length, 2, dtype=torch.float64)
    for reverse in (False, True):
        gates = a.clone()
        gates[-1 if reverse else 0] = torch.tensor([INF, NAN], dtype=torch.float64)
        got = fscan.linear_recurrence(gates, b, 0, reverse=reverse)
        torch.testing.assert_close(got, loop(gates, b, 0, None, reverse))
        assert torch.isfinite(got).all()


def test_out_of_range_products_under_vmap():
    """Under vmap no branch may depend on values: no check, no error."""
    b = torch.randn(3, 300)
    got = torch.func.vmap(lambda x: fscan.linear_recurrence(0.1, x, 0))(b)
    torch.testing.assert_close(got, fscan.linear_recurrence(0.1, b, 1))


# ---- dtypes: acc_dtype and promotion -------------------------------------------------


@parametrize(dtype=[torch.bfloat16, torch.float16])
def test_acc_dtype(dtype):
    gen = torch.Generator().manual_seed(0)
    a = (torch.rand(2000, 16, generator=gen) * 0.1 + 0.9).to(dtype)
    b = torch.randn(2000, 16, generator=gen).to(dtype)
    exact = loop(a.double(), b.double(), 0)
    low = fscan.linear_recurrence(a, b, 0)
    wide = fscan.linear_recurrence(a, b, 0, acc_dtype=torch.float32)
    assert wide.dtype == dtype
    # Accumulating in float32 leaves only the final rounding: half an ulp of the output.
    rounding = (exact.to(dtype).double() - exact).abs().max()
    assert (wide.double() - exact).abs().max() <= rounding * 1.01
    assert (low.double() - exact).abs().max() > 4 * rounding
    a_ = a.clone().requires_grad_()
    fscan.linear_recurrence(a_, b, 0, acc_dtype=torch.float32).sum().backward()
    assert a_.grad.dtype == dtype


def test_acc_dtype_checked():
    with raises(fscan.ScanTypeError, "`acc_dtype` must be a floating or complex torch.dtype"):
        fscan.linear_recurrence(0.5, torch.ones(3), 0, acc_dtype=torch.int32)


def test_result_dtype_matches_torch():
    from fscan._recurrences.args import result_dtype

    dtypes = [torch.bool, torch.int32, torch.int64, torch.float16, torch.float32, torch.float64]
    dtypes += [torch.complex64, torch.complex128]
    for high in dtypes:
        b = torch.zeros(2, dtype=high)
        for low in dtypes:
            for a in (torch.zeros((), dtype=low), torch.zeros(2, dtype=low)):
                assert result_dtype(b, a) == torch.result_type(b, a), (high, a)
        for number in (True, 2, 0.5, 1j):
            assert result_dtype(b, number) == torch.result_type(b, number), (high, number)


# ---- torch.compile and torch.export -------------------------------------------------


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_cases(length):
    gen = torch.Generator().manual_seed(length)
    a = torch.rand(2, length, 3, dtype=torch.float64, generator=gen)
    b = torch.randn(2, length, 3, dtype=torch.float64, generator=gen)
    h0 = torch.randn(3, dtype=torch.float64, generator=gen)
    return a, b, h0, torch.rand(length, generator=gen) < 0.2


def _several(a, b, h0, reset):
    """Gates full and scalar, `initial`, `reverse`, `reset=` and acc_dtype in one graph,
    and issue 10 case 0's computed reverse gate (Inductor once got its gradient wrong:
    a donated buffer reused by the while_loop backward; fscan._engines.traced_workarounds)."""
    return (
        fscan.linear_recurrence(a, b, 1, initial=h0, reset=reset),
        fscan.linear_recurrence(0.9, b, 1, reverse=True, acc_dtype=torch.float64),
        fscan.linear_recurrence(a.exp(), b, 1, reverse=True),
    )


def _assert_matches_eager(fn, args, grad_argnums):
    leaves = [t.clone().requires_grad_() if i in grad_argnums else t for i, t in enumerate(args)]
    got = fn(*leaves)
    want = _several(*[t.detach().requires_grad_() if t.is_floating_point() else t for t in args])
    torch.testing.assert_close(got, want)
    cot = [torch.randn_like(o) for o in got]
    diff = [leaves[i] for i in grad_argnums]
    got_g = torch.autograd.grad(got, diff, cot)
    eager_leaves = [
        t.detach().requires_grad_() if i in grad_argnums else t for i, t in enumerate(args)
    ]
    want_out = _several(*eager_leaves)
    want_g = torch.autograd.grad(want_out, [eager_leaves[i] for i in grad_argnums], cot)
    torch.testing.assert_close(got_g, want_g)


def test_compile_has_no_graph_break(fresh_dynamo):
    """The dtype promotion (torch.result_type once) and the scalar gate trace."""
    explain = torch._dynamo.explain(_several)(*_compiled_cases(40))
    assert explain.graph_break_count == 0, explain.break_reasons


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from Inductor's own imports
def test_compile_inductor_matches_eager(fresh_dynamo):
    compiled = torch.compile(_several, fullgraph=True)  # the default backend: Inductor
    _assert_matches_eager(compiled, _compiled_cases(40), grad_argnums=(0, 1, 2))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_compile_inductor_dynamic_length(fresh_dynamo):
    def fn(a, b, h0, reset):
        return fscan.linear_recurrence(a, b, 1, initial=h0, reverse=True)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for length in (20, 45):
        a, b, h0, _ = _compiled_cases(length)
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = compiled(a_, b_, h0, None)
        torch.testing.assert_close(out, loop(a, b, 1, h0.expand(2, 3), reverse=True))
        cot = torch.randn_like(out)
        got = torch.autograd.grad(out, (a_, b_), cot)
        a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
        want = torch.autograd.grad(loop(a_, b_, 1, h0.expand(2, 3), reverse=True), (a_, b_), cot)
        torch.testing.assert_close(got, want)


def test_export_with_a_dynamic_length(fresh_dynamo):
    class Recurrence(torch.nn.Module):
        def forward(self, a, b, h0, reset):
            return fscan.linear_recurrence(a, b, 1, initial=h0, reverse=True, reset=reset)

    n = torch.export.Dim("n", min=2)
    a, b, h0, _ = _compiled_cases(40)
    reset = torch.rand(2, 40, 1) < 0.2  # per-row boundaries
    shapes = ({1: n}, {1: n}, None, {1: n})
    program = torch.export.export(Recurrence(), (a, b, h0, reset), dynamic_shapes=shapes)
    for length in (40, 7, 100):
        a, b, h0, _ = _compiled_cases(length)
        reset = torch.rand(2, length, 1) < 0.2
        got = program.module()(a, b, h0, reset)
        for row in range(2):
            want = loop(a[row], b[row], 0, h0, reverse=True, reset=reset[row, :, 0])
            torch.testing.assert_close(got[row], want)


def test_benchmark_blelloch_baseline_is_the_recurrence():
    """The benchmark's hand-written pscan computes the same values and gradients."""
    from fscan.bench.linear import BlellochScan, selective_inputs

    a, b, cot = (t.double() for t in selective_inputs((2, 37, 3, 2)))  # padded to 64
    got, got_g = grads_of(BlellochScan.apply, [a, b], cot)
    want, want_g = grads_of(lambda a, b: fscan.linear_recurrence(a, b, 1), [a, b], cot)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_g, want_g)


# Run in a fresh process: compile tests leave torch.fx graphs that torch lets go of later,
# at any time (seen: 466 and 6834 objects, no fscan frame among them, in one warm call).
_CYCLES = """
import collections, gc, sys, torch, fscan
grad = sys.argv[1] == "grad"
a, b = torch.rand(256, 8), torch.randn(256, 8)
if grad:
    a.requires_grad_(), b.requires_grad_()
def call():
    with torch.set_grad_enabled(grad):
        h = fscan.linear_recurrence(a, b, 0)
        if grad:
            h.sum().backward()
with fscan.config.override(cpu_kernel="eager"):
    for _ in range(3):  # built and known: what follows is a warm call
        call()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a cycle held, for the message
    call()
    found = gc.collect()
kinds = collections.Counter(type(o).__name__ for o in gc.garbage).most_common(8)
frames = [f"{o.f_code.co_filename}:{o.f_code.co_name}"
          for o in gc.garbage if type(o).__name__ == "frame"]
print(found, kinds, frames[:8])
"""


@pytest.mark.parametrize("grad", ["no_grad", "grad"])
def test_a_warm_call_leaves_no_reference_cycles(grad):
    # Cycles are freed only by the collector, whose passes cost a loop of calls up to
    # ~9% (a frame or closure kept in a cycle would also keep its tensors alive).
    done = subprocess.run(
        [sys.executable, "-c", _CYCLES, grad], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "0", done.stdout
