"""combine_fns that close over tensors and numbers: each closure gets its own verdicts
and exact gradients, for its captured tensors too, whatever fscan has cached.
Gradients are compared in float64 against autograd through the sequential oracle."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from helpers import assert_same_grads, fscan_grads, oracle_grads, sequential_scan
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan
from fscan._engines import adjoint as _adjoint

F64 = torch.float64


@pytest.fixture(autouse=True)
def fresh_caches():
    fscan.clear_caches()
    yield
    fscan.clear_caches()


def test_closures_of_one_lambda_with_different_flags_get_their_own_gradients():
    make = lambda mix: lambda a, b: torch.maximum(a[..., :1] if mix else a, b)
    x = torch.randn(6, 3, dtype=F64, requires_grad=True)
    fscan_grads(make(False), x, x)
    assert_same_grads(fscan_grads(make(True), x, x), oracle_grads(make(True), x, x))


def test_a_class_attribute_tensor_that_starts_requiring_grad_gets_its_gradient():
    class H:
        w = torch.tensor(2.0, dtype=F64)

    comb = lambda a, b: a * b * H.w
    x = torch.rand(5, dtype=F64, requires_grad=True) + 0.5
    fscan_grads(comb, x, x)
    H.w = torch.tensor(2.0, dtype=F64, requires_grad=True)
    assert_same_grads(fscan_grads(comb, x, [x, H.w]), oracle_grads(comb, x, [x, H.w]))


# The combine is not associative (the test is about the gradient's route, on data whose
# grouping happens not to matter): its first-call warning is expected.
@pytest.mark.filterwarnings("ignore::fscan.NotAssociativeWarning")
def test_captured_gradient_survives_a_chunk_that_does_not_use_it(monkeypatch):
    monkeypatch.setattr(_adjoint, "CHUNK_ELEMENTS", 2)  # one row per chunk
    w = torch.tensor(1.5, dtype=F64, requires_grad=True)
    # Data-dependent use of w: rows whose first value is negative skip it.
    comb = lambda a, b: torch.where(b < 0, a + b, a + b * w)
    x = torch.randn(12, 2, dtype=F64, requires_grad=True)
    x.data[-1] = -1.0  # the last chunk does not use w
    assert_same_grads(fscan_grads(comb, x, [x, w]), oracle_grads(comb, x, [x, w]))


def test_an_impure_closure_is_caught_after_a_pure_one_of_the_same_code():
    mk = lambda k: lambda a, b: a.add_(b) if k else a + b
    x = torch.ones(6)
    fscan.associative_scan(mk(0), x, 0)
    with pytest.raises(fscan.ImpureCombineError):
        fscan.associative_scan(mk(1), x, 0)
    assert x.tolist() == [1.0] * 6


@pytest.mark.parametrize("wrt_xs", [False, True], ids=["wrt-w", "wrt-xs"])
def test_second_order_gradient_with_a_captured_tensor(wrt_xs):
    w = torch.tensor(0.9, dtype=F64, requires_grad=True)
    x = torch.rand(7, dtype=F64, requires_grad=True) + 0.5
    comb = lambda p, q: p * q * w
    target = x if wrt_xs else w

    def second(scan):
        (g,) = torch.autograd.grad(scan(comb, x, 0).sum(), target, create_graph=True)
        return torch.autograd.grad(g.sum(), [x, w])

    assert_same_grads(second(fscan.associative_scan), second(sequential_scan))


# a * b + w is not associative; gradgradcheck compares the scan with itself.
@pytest.mark.filterwarnings("ignore::fscan.NotAssociativeWarning")
def test_gradgradcheck_through_a_closure():
    w = torch.rand(3, dtype=F64, requires_grad=True)
    x = torch.rand(6, 3, dtype=F64, requires_grad=True)
    f = lambda x, w: fscan.associative_scan(lambda a, b: a * b + w, x, 0)
    assert torch.autograd.gradgradcheck(f, (x, w))


# --- the sweep: drawn closures, requires_grad patterns and NaN/inf positions -------


def _draw_closure(data):
    """A combine_fn drawn with captured scalars and tensors, and its grad-requiring captures."""
    k = data.draw(st.sampled_from([0, 1, 2]), label="captured int")
    scale = data.draw(st.sampled_from([0.5, 1.0, 2.0]), label="captured float")
    w_grad = data.draw(st.booleans(), label="w requires grad")
    w = (torch.rand(3, dtype=F64) + 0.5).requires_grad_(w_grad)
    kind = data.draw(st.sampled_from(["add", "mul", "max", "linrec"]), label="combine")
    # Each is associative for every captured value: a + b + c, a * b * c, max/min, affine maps.
    if kind == "add":
        fn = lambda a, b: a + b + w * scale if k else a + b
    elif kind == "mul":
        fn = lambda a, b: a * b * (w if k == 1 else scale)
    elif kind == "max":
        fn = lambda a, b: torch.maximum(a, b) if k else torch.minimum(a, b)
    else:
        fn = lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1])
    return kind, fn, w


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_drawn_closures_match_the_sequential_oracle(data):
    kind, fn, w = _draw_closure(data)
    n = data.draw(st.integers(1, 12), label="length")
    mode = data.draw(st.sampled_from(["pointwise", "generic"]), label="mode")
    reverse = data.draw(st.booleans(), label="reverse")
    shape = (n, 3)
    leaves = [torch.rand(shape, dtype=F64) + 0.5 for _ in range(2 if kind == "linrec" else 1)]
    special = data.draw(st.sampled_from([None, math.nan, math.inf, -math.inf]), label="special")
    if special is not None:
        at = data.draw(st.integers(0, n - 1), label="special at")
        leaves[-1][at, data.draw(st.integers(0, 2), label="column")] = special
    grads = [data.draw(st.booleans(), label=f"leaf {i} requires grad") for i in range(len(leaves))]
    for leaf, g in zip(leaves, grads):
        leaf.requires_grad_(g)
    xs = tuple(leaves) if kind == "linrec" else leaves[0]
    got = fscan.associative_scan(fn, xs, 0, reverse, mode)
    want = sequential_scan(fn, xs, 0, reverse, mode)
    for g_leaf, w_leaf in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        torch.testing.assert_close(g_leaf, w_leaf, equal_nan=True)
    if kind == "max" and special is not None and math.isnan(special):
        return  # which operand a NaN max/min routes its gradient to depends on the grouping
    wrt = [t for t in [*leaves, w] if t.requires_grad]
    pairs = [
        (g_leaf, w_leaf)
        for g_leaf, w_leaf in zip(optree.tree_leaves(got), optree.tree_leaves(want))
        if w_leaf.requires_grad
    ]
    if not pairs:
        return
    cot = [torch.rand_like(w_leaf) for _, w_leaf in pairs]
    assert_same_grads(
        torch.autograd.grad([g for g, _ in pairs], wrt, cot, allow_unused=True),
        torch.autograd.grad([w for _, w in pairs], wrt, cot, allow_unused=True),
    )
