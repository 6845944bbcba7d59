"""log_linear_recurrence against a sequential float64 loop in log space."""

from __future__ import annotations

import pytest
import torch
from helpers import parametrize, raises
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan

NEG_INF = float("-inf")
# 0-31: the tree alone; 32+: chunked walks, with and without a tail.
LENGTHS = [0, 1, 3, 31, 32, 45, 300]


def loop(la, lb, dim, initial=None, reverse=False, reset=None):
    """The reference, one step at a time: ``logaddexp(log a_t + log h_{t-1}, log b_t)``."""
    la = la.expand_as(lb)
    n = lb.shape[dim]
    h, out = initial, [None] * n
    for t in range(n - 1, -1, -1) if reverse else range(n):
        lb_t = lb.select(dim, t)
        restart = h is None or (reset is not None and bool(reset[t]))
        h = lb_t if restart else torch.logaddexp(la.select(dim, t) + h, lb_t)
        out[t] = h.expand_as(lb_t)
    return torch.stack(out, dim) if n else lb.clone()


def heinsen(la, lb, dim):
    """The two-prefix-sum formulation (Heinsen 2023, minGRU): the accuracy baseline."""
    a_star = torch.cumsum(la.expand_as(lb), dim)
    return a_star + torch.logcumsumexp(lb - a_star, dim)


def inputs(shape, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    gate = torch.randn(shape, generator=gen, dtype=torch.float64)
    la = -torch.nn.functional.softplus(gate)  # log sigmoid(-gate): minGRU's 1 - z
    lb = -torch.nn.functional.softplus(-gate) + 0.5 * torch.randn(shape, generator=gen)
    return la.to(dtype), lb.to(dtype)


@parametrize(length=LENGTHS, reverse=[False, True], initial=[False, True])
def test_matches_loop(length, reverse, initial):
    la, lb = inputs((2, length, 3))
    h0 = torch.randn(3, dtype=torch.float64) if initial else None
    out = fscan.log_linear_recurrence(la, lb, 1, initial=h0, reverse=reverse)
    want = loop(la, lb, 1, None if h0 is None else h0.expand(2, 3), reverse)
    torch.testing.assert_close(out, want)


def test_matches_linear_recurrence():
    la, lb = inputs((100, 4))
    torch.testing.assert_close(
        fscan.log_linear_recurrence(la, lb, 0).exp(),
        fscan.linear_recurrence(la.exp(), lb.exp(), 0),
    )


@parametrize(gate=["number", "per-channel", "per-step"], length=[10, 100])
def test_broadcast_gates(gate, length):
    _, lb = inputs((length, 3))
    la = {
        "number": -0.1,
        "per-channel": -torch.rand(3, dtype=torch.float64),
        "per-step": -torch.rand(length, 1, dtype=torch.float64),
    }[gate]
    out = fscan.log_linear_recurrence(la, lb, 0)
    torch.testing.assert_close(out, loop(torch.as_tensor(la, dtype=torch.float64), lb, 0))


@parametrize(length=[12, 41, 100], reverse=[False, True])
def test_gradcheck(length, reverse):
    la, lb = inputs((length, 2))
    h0 = torch.randn(2, dtype=torch.float64)
    reset = torch.rand(length) < 0.1

    def run(la, lb, h0):
        return fscan.log_linear_recurrence(la, lb, 0, initial=h0, reverse=reverse, reset=reset)

    args = (la.requires_grad_(), lb.requires_grad_(), h0.requires_grad_())
    assert torch.autograd.gradcheck(run, args)


@parametrize(length=[9, 34])
def test_second_order(length):
    la, lb = inputs((length, 2))

    def run(la, lb):
        return fscan.log_linear_recurrence(la, lb, 0)

    assert torch.autograd.gradgradcheck(run, (la.requires_grad_(), lb.requires_grad_()))


def test_per_channel_gate_gradient_is_summed():
    la = -torch.rand(3, dtype=torch.float64, requires_grad=True)
    _, lb = inputs((60, 3))
    assert torch.autograd.gradcheck(lambda la: fscan.log_linear_recurrence(la, lb, 0), (la,))


@parametrize(length=[20, 200], reverse=[False, True])
def test_minus_inf_forward_and_gradients(length, reverse):
    """Zero inputs and gates (log -inf): the values of the loop, finite gradients where
    the loop's gradients are finite, and none at all where the loop's are NaN."""
    la, lb = inputs((length, 3), seed=length)
    lb[: length // 2, 0] = NEG_INF  # h = 0 for the first half of channel 0 (reverse: second)
    lb[::3, 1] = NEG_INF
    la[length // 3, 2] = NEG_INF  # a zero gate: forgets the past
    out = fscan.log_linear_recurrence(la, lb, 0, reverse=reverse)
    want = loop(la, lb, 0, reverse=reverse)
    torch.testing.assert_close(out, want)
    la, lb = la.requires_grad_(), lb.requires_grad_()
    finite = torch.isfinite(want)
    cot = torch.randn_like(want) * finite  # a loss that uses only the finite states
    out = fscan.log_linear_recurrence(la, lb, 0, reverse=reverse)
    grads = torch.autograd.grad(out, (la, lb), cot)
    assert all(torch.isfinite(g).all() for g in grads)
    # Against the loop where its gradients are defined (it returns NaN at 0/0).
    ref = torch.autograd.grad(loop(la, lb, 0, reverse=reverse), (la, lb), cot)
    for g, r in zip(grads, ref):
        defined = ~torch.isnan(r)
        torch.testing.assert_close(g[defined], r[defined])


def test_reset_drops_everything_before():
    lb = torch.tensor([float("nan"), 0.0, 0.0])
    out = fscan.log_linear_recurrence(0.5, lb, 0, reset=torch.tensor([False, True, False]))
    torch.testing.assert_close(
        out[1:], torch.tensor([0.0, torch.logaddexp(torch.tensor(0.5), torch.tensor(0.0)).item()])
    )
    assert out[0].isnan()


@parametrize(dim=[0, 1])
def test_empty(dim):
    lb = (
        torch.randn(7, 0, 3, requires_grad=True)
        if dim == 0
        else torch.randn(3, 0, requires_grad=True)
    )
    la = torch.zeros(lb.shape[-1], requires_grad=True)
    out = fscan.log_linear_recurrence(la, lb, dim)
    assert out.shape == lb.shape
    (ga,) = torch.autograd.grad(out.sum(), (la,))
    assert torch.equal(ga, torch.zeros_like(la))


def test_float32_accuracy_vs_heinsen():
    """In float32 the error stays that of a sequential float32 loop; the two-prefix-sum
    formulation's grows with the length."""
    la, lb = inputs((2, 2048, 16))
    exact = loop(la, lb, 1)
    la32, lb32 = la.float(), lb.float()
    err = lambda x: (x.double() - exact).abs().max().item()
    ours, seq = err(fscan.log_linear_recurrence(la32, lb32, 1)), err(loop(la32, lb32, 1))
    assert ours <= 2 * seq
    assert err(heinsen(la32, lb32, 1)) > 20 * ours


def test_torch_func_and_vmap():
    la, lb = inputs((50, 3))
    loss = lambda la, lb: fscan.log_linear_recurrence(la, lb, 0).sum()
    got = torch.func.grad(loss, argnums=(0, 1))(la, lb)
    want = torch.func.grad(lambda la, lb: loop(la, lb, 0).sum(), argnums=(0, 1))(la, lb)
    torch.testing.assert_close(got, want)
    batched = torch.func.vmap(lambda la, lb: fscan.log_linear_recurrence(la, lb, 0))
    stacked = batched(la.expand(2, 50, 3), lb.expand(2, 50, 3))
    torch.testing.assert_close(stacked[1], loop(la, lb, 0))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_export_with_a_dynamic_length(fresh_dynamo):
    class LogScan(torch.nn.Module):
        def forward(self, la, lb, h0):
            return fscan.log_linear_recurrence(la, lb, 0, initial=h0)

    n = torch.export.Dim("n", min=2)
    la, lb = inputs((40, 3))
    h0 = torch.zeros(3, dtype=torch.float64)
    program = torch.export.export(LogScan(), (la, lb, h0), dynamic_shapes=({0: n}, {0: n}, None))
    for length in (40, 9):
        la, lb = inputs((length, 3), seed=length)
        torch.testing.assert_close(program.module()(la, lb, h0), loop(la, lb, 0, h0.expand(3)))


@settings(max_examples=25, deadline=None)
@given(
    length=st.integers(0, 200),
    reverse=st.booleans(),
    with_initial=st.booleans(),
    zeros=st.floats(0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_property_matches_loop(length, reverse, with_initial, zeros, seed):
    la, lb = inputs((length, 2), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    lb[torch.rand(length, 2, generator=gen) < zeros] = NEG_INF
    h0 = torch.randn(2, dtype=torch.float64, generator=gen) if with_initial else None
    out = fscan.log_linear_recurrence(la, lb, 0, initial=h0, reverse=reverse)
    torch.testing.assert_close(out, loop(la, lb, 0, h0, reverse))


def test_errors():
    with raises(
        fscan.ScanTypeError, "fscan.log_linear_recurrence: `log_b` has dtype torch.complex64"
    ):
        fscan.log_linear_recurrence(0.0, torch.ones(3, dtype=torch.complex64), 0)
    with raises(fscan.ScanValueError, "`log_a` of shape (4,) does not broadcast to `log_b`"):
        fscan.log_linear_recurrence(torch.zeros(4), torch.zeros(5, 3), 0)
    with raises(fscan.ScanTypeError, "`log_b` must be a torch.Tensor"):
        fscan.log_linear_recurrence(0.0, [1.0], 0)


def _compiled_against_eager(fn, tensors):
    """Values and gradients of ``torch.compile(fn)`` (Inductor) against eager ``fn``."""
    compiled = torch.compile(fn, fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = compiled(*leaves)
    cots = [torch.randn_like(o) for o in out]
    got = torch.autograd.grad(out, leaves, cots)
    leaves = [t.clone().requires_grad_() for t in tensors]
    want_out = fn(*leaves)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(got, torch.autograd.grad(want_out, leaves, cots))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from Inductor's own imports
def test_compile_inductor_matches_eager(fresh_dynamo):
    def fn(la, lb):
        return (fscan.log_linear_recurrence(la, lb, 0),)

    _compiled_against_eager(fn, inputs((40, 3)))
