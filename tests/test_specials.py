"""NaN and infinities propagate through fscan's scans, their gradients and resets
exactly as through the sequential loop (and through torch's own cumulative ops).
Gradients are compared in float64 against autograd through the sequential oracle."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_same_grads, fscan_grads, oracle_grads, sequential_scan
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan

F64 = torch.float64


@pytest.fixture(autouse=True)
def fresh_caches():
    fscan.clear_caches()
    yield
    fscan.clear_caches()


@pytest.mark.parametrize("mode", ["pointwise", "generic"])
def test_nan_among_the_first_steps(mode):
    x = torch.tensor([1.0, math.nan, 2.0, 3.0], dtype=F64, requires_grad=True)
    mul = lambda a, b: a * b
    got = fscan.associative_scan(mul, x, 0, combine_mode=mode)
    torch.testing.assert_close(got, sequential_scan(mul, x, 0), equal_nan=True)
    assert_same_grads(fscan_grads(mul, x, x, mode=mode), oracle_grads(mul, x, x, mode=mode))


def test_logcumsumexp_with_a_leading_minus_inf_prefix_matches_torch():
    x = torch.tensor([-math.inf, -math.inf, 1.0, 2.0], dtype=F64, requires_grad=True)
    for reverse in (False, True):
        got = fscan.logcumsumexp(x, 0, reverse=reverse)
        flip = (lambda t: t.flip(0)) if reverse else (lambda t: t)
        want = flip(torch.logcumsumexp(flip(x), 0))
        torch.testing.assert_close(got, want)
        (g,) = torch.autograd.grad(got.sum(), x)
        (w,) = torch.autograd.grad(want.sum(), x)
        torch.testing.assert_close(g, w, equal_nan=True)


def reset_oracle(combine_fn, x, reset):
    """The loop with restarts: out[i] = x[i] where reset[i], else combine(out[i - 1], x[i])."""
    out = [x[0]]
    for i in range(1, x.shape[0]):
        out.append(x[i] if reset[i] else combine_fn(out[-1], x[i]))
    return torch.stack(out)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 10),
    data=st.data(),
    special=st.sampled_from([math.nan, math.inf, -math.inf, 0.0]),
    kind=st.sampled_from(["mul", "add", "max"]),
    mode=st.sampled_from(["pointwise", "generic"]),
)
def test_specials_never_cross_a_reset(n, data, special, kind, mode):
    combine_fn = {"mul": torch.mul, "add": torch.add, "max": torch.maximum}[kind]
    x = torch.rand(n, 2, dtype=F64) + 0.5
    x[data.draw(st.integers(0, n - 1), label="special at"), 0] = special
    reset = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    x.requires_grad_()
    got = fscan.associative_scan(combine_fn, x, 0, combine_mode=mode, reset=reset)
    want = reset_oracle(combine_fn, x, reset)
    torch.testing.assert_close(got, want, equal_nan=True)
    if kind == "max" and math.isnan(special):
        return  # a NaN max routes its gradient by grouping (see the drawn-closure test)
    cot = torch.rand_like(want)
    (g,) = torch.autograd.grad(got, x, cot)
    (w,) = torch.autograd.grad(want, x, cot)
    torch.testing.assert_close(g, w, equal_nan=True)


# A segmented scan written by hand with torch.where: under the Jacobian adjoint, a NaN
# cotangent times a block that is zero by selection would leak NaN before the restart.
SELECTING = {
    "mul": lambda a, b: (a[0] | b[0], torch.where(b[0], b[1], a[1] * b[1])),
    "linrec": lambda a, b: (
        a[0] | b[0],
        torch.where(b[0], b[1], a[1] * b[1]),
        torch.where(b[0], b[2], a[2] * b[1] + b[2]),
    ),
}


@settings(max_examples=30, deadline=None)
@given(
    kind=st.sampled_from(sorted(SELECTING)),
    reverse=st.booleans(),
    resets=st.lists(st.booleans(), min_size=7, max_size=7),
    specials=st.lists(st.sampled_from([None, math.nan, math.inf, 0.0]), min_size=7, max_size=7),
)
def test_hand_written_where_resets_stop_specials_as_the_loop_does(kind, reverse, resets, specials):
    combine_fn = SELECTING[kind]
    n_values = 2 if kind == "linrec" else 1
    values = torch.randn(n_values, 7, 2, dtype=F64)
    for i, special in enumerate(specials):
        if special is not None:
            values[i % n_values, i, 0] = special
    leaves = [v.clone().requires_grad_() for v in values]
    xs = (torch.tensor(resets)[:, None].expand(7, 2), *leaves)
    got = fscan.associative_scan(combine_fn, xs, 0, reverse)[1:]
    want = sequential_scan(combine_fn, xs, 0, reverse, "pointwise")[1:]
    cot = [torch.rand_like(w) for w in want]
    for g, w in zip(torch.autograd.grad(got, leaves, cot), torch.autograd.grad(want, leaves, cot)):
        torch.testing.assert_close(g, w, equal_nan=True)


@pytest.mark.parametrize("reverse", [False, True])
def test_the_stepwise_backward_agrees_with_the_adjoint_and_the_loop(reverse):
    from fscan._engines.adjoint import Backward, ScanPlan, adjoint, stepwise_adjoint

    w = torch.rand(3, dtype=F64, requires_grad=True)
    combine_fn = lambda a, b: (a[0] | b[0], torch.where(b[0], b[1], a[1] * b[1] * w))
    flat = lambda a, b: list(combine_fn(tuple(a), tuple(b)))
    reset, v = torch.rand(2, 7, 3) < 0.3, torch.randn(2, 7, 3, dtype=F64)
    ys = [y.detach() for y in sequential_scan(combine_fn, (reset, v), 1, reverse, "pointwise")]
    plan, grads = ScanPlan(flat, 2, 1, reverse), [None, torch.randn(2, 7, 3, dtype=F64)]
    call = Backward(plan, [reset, v], [w], ys, grads, [False, True, True])
    assert_same_grads(
        [*adjoint(call)[0][1:], *adjoint(call)[1]],
        stepwise_adjoint(call)[0][1:] + stepwise_adjoint(call)[1],
    )
    # With a NaN and an inf inside, the backward takes the walk: the loop's gradients,
    # the closed-over tensor's included, through a scan along dim 1.
    v[0, 3, 1], v[1, 2, 0] = math.nan, math.inf
    v.requires_grad_()
    got = fscan.associative_scan(combine_fn, (reset, v), 1, reverse)[1]
    want = sequential_scan(combine_fn, (reset, v), 1, reverse, "pointwise")[1]
    cot = torch.randn_like(want)
    assert_same_grads(torch.autograd.grad(got, (v, w), cot), torch.autograd.grad(want, (v, w), cot))


@settings(max_examples=20, deadline=None)
@given(
    op=st.sampled_from(["cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"]),
    n=st.integers(1, 40),
    reverse=st.booleans(),
    special=st.sampled_from([None, math.nan, math.inf, -math.inf]),
    at=st.integers(0, 39),
)
def test_drop_ins_propagate_specials_like_torch(op, n, reverse, special, at):
    x = torch.randn(n, 2, dtype=F64)
    if special is not None:
        x[at % n, 0] = special
    x.requires_grad_()
    flip = (lambda t: t.flip(0)) if reverse else (lambda t: t)
    got = getattr(fscan, op)(x, 0, reverse=reverse)
    want = getattr(torch, op)(flip(x), 0)
    got = got[0] if op in ("cummax", "cummin") else got
    want = flip(want[0] if op in ("cummax", "cummin") else want)
    torch.testing.assert_close(got, want, equal_nan=True)
    cot = torch.rand_like(want)
    (g,) = torch.autograd.grad(got, x, cot)
    (w,) = torch.autograd.grad(want, x, cot)
    torch.testing.assert_close(g, w, equal_nan=True)
