"""Regression tests for issue 10: no silent wrong answer, dropped gradient, corrupted input,
hang or crash, whatever fscan has cached. Gradients are compared in float64 against
autograd through the sequential oracle."""

from __future__ import annotations

import math
import re

import numpy as np
import optree
import pytest
import torch
from helpers import sequential_scan
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan
from fscan import _adjoint

F64 = torch.float64


@pytest.fixture(autouse=True)
def fresh_caches():
    fscan.clear_caches()
    yield
    fscan.clear_caches()


def oracle_grads(combine_fn, xs, wrt, reverse=False, mode="pointwise", cot=None):
    ref = sequential_scan(combine_fn, xs, 0, reverse, mode)
    leaves = optree.tree_leaves(ref)
    cot = cot or [torch.ones_like(r) for r in leaves]
    return torch.autograd.grad(leaves, wrt, cot, allow_unused=True)


def fscan_grads(combine_fn, xs, wrt, reverse=False, mode="pointwise", cot=None):
    out = fscan.associative_scan(combine_fn, xs, 0, reverse, mode)
    leaves = optree.tree_leaves(out)
    cot = cot or [torch.ones_like(r) for r in leaves]
    return torch.autograd.grad(leaves, wrt, cot, allow_unused=True)


def assert_same_grads(got, want):
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, equal_nan=True)


# --- case 1: two closures of one lambda must not share a verdict -------------------


def test_closures_of_one_lambda_with_different_flags_get_their_own_gradients():
    make = lambda mix: lambda a, b: torch.maximum(a[..., :1] if mix else a, b)
    x = torch.randn(6, 3, dtype=F64, requires_grad=True)
    fscan_grads(make(False), x, x)
    assert_same_grads(fscan_grads(make(True), x, x), oracle_grads(make(True), x, x))


def test_mixing_that_the_first_steps_values_hide_still_takes_the_exact_gradient():
    # Column 0 of the first rows loses every maximum, so the Jacobian at the adjoint
    # probe's steps is diagonal; later rows win and spread column 0 over the row.
    fn = lambda a, b: torch.maximum(a[..., :1], b)
    x = torch.randn(8, 3, dtype=F64).abs() + 1.0
    x[:3, 0] = -10.0
    x[4, 0] = 10.0
    x.requires_grad_(True)
    assert_same_grads(fscan_grads(fn, x, x), oracle_grads(fn, x, x))


def test_within_element_views_are_elementwise_in_pointwise_mode():
    # `a[..., :1]` keeps the batch of elements in place: allowed, and exact.
    fn = lambda a, b: a[..., :1] + b
    x = torch.randn(9, 3, dtype=F64)
    torch.testing.assert_close(fscan.associative_scan(fn, x, 0), sequential_scan(fn, x, 0))


# --- case 2: a tensor reached through a class attribute ----------------------------


def test_a_class_attribute_tensor_that_starts_requiring_grad_gets_its_gradient():
    class H:
        w = torch.tensor(2.0, dtype=F64)

    comb = lambda a, b: a * b * H.w
    x = torch.rand(5, dtype=F64, requires_grad=True) + 0.5
    fscan_grads(comb, x, x)
    H.w = torch.tensor(2.0, dtype=F64, requires_grad=True)
    assert_same_grads(fscan_grads(comb, x, [x, H.w]), oracle_grads(comb, x, [x, H.w]))


# --- case 3: gradients of captured tensors are summed over chunks, never dropped ---


def test_captured_gradient_survives_a_chunk_that_does_not_use_it(monkeypatch):
    monkeypatch.setattr(_adjoint, "CHUNK_ELEMENTS", 2)  # one row per chunk
    w = torch.tensor(1.5, dtype=F64, requires_grad=True)
    # Data-dependent use of w: rows whose first value is negative skip it.
    comb = lambda a, b: torch.where(b < 0, a + b, a + b * w)
    x = torch.randn(12, 2, dtype=F64, requires_grad=True)
    x.data[-1] = -1.0  # the last chunk does not use w
    assert_same_grads(fscan_grads(comb, x, [x, w]), oracle_grads(comb, x, [x, w]))


# --- case 4: captured ints are keyed by value; inputs never change -----------------


def test_an_impure_closure_is_caught_after_a_pure_one_of_the_same_code():
    mk = lambda k: lambda a, b: a.add_(b) if k else a + b
    x = torch.ones(6)
    fscan.associative_scan(mk(0), x, 0)
    with pytest.raises(fscan.ImpureCombineError):
        fscan.associative_scan(mk(1), x, 0)
    assert x.tolist() == [1.0] * 6


def test_a_value_dependent_write_into_the_input_is_reported():
    # The probe sees batches of at most two elements; a write that only larger batches
    # trigger is caught afterwards by the input's version counter, loudly.
    sneaky = lambda a, b: a.add_(b) if a.shape[0] > 2 else a + b
    x = torch.ones(16)
    with pytest.raises(fscan.ImpureCombineError, match="Your input has been changed"):
        fscan.associative_scan(sneaky, x, 0)


# --- case 5: second-order gradients terminate and are right ------------------------


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


def test_gradgradcheck_through_a_closure():
    w = torch.rand(3, dtype=F64, requires_grad=True)
    x = torch.rand(6, 3, dtype=F64, requires_grad=True)
    f = lambda x, w: fscan.associative_scan(lambda a, b: a * b + w, x, 0)
    assert torch.autograd.gradgradcheck(f, (x, w))


# --- case 6: NaN and inf propagate exactly as the sequential loop's ----------------


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
    from fscan._adjoint import ScanPlan, adjoint, stepwise_adjoint

    w = torch.rand(3, dtype=F64, requires_grad=True)
    combine_fn = lambda a, b: (a[0] | b[0], torch.where(b[0], b[1], a[1] * b[1] * w))
    flat = lambda a, b: list(combine_fn(tuple(a), tuple(b)))
    reset, v = torch.rand(2, 7, 3) < 0.3, torch.randn(2, 7, 3, dtype=F64)
    ys = [y.detach() for y in sequential_scan(combine_fn, (reset, v), 1, reverse, "pointwise")]
    plan, grads = ScanPlan(flat, 2, 1, reverse), [None, torch.randn(2, 7, 3, dtype=F64)]
    args = (plan, [reset, v], ys, grads, [w], [False, True, True])
    assert_same_grads(
        [*adjoint(*args)[0][1:], *adjoint(*args)[1]],
        stepwise_adjoint(*args)[0][1:] + stepwise_adjoint(*args)[1],
    )
    # With a NaN and an inf inside, the backward takes the walk: the loop's gradients,
    # the closed-over tensor's included, through a scan along dim 1.
    v[0, 3, 1], v[1, 2, 0] = math.nan, math.inf
    v.requires_grad_()
    got = fscan.associative_scan(combine_fn, (reset, v), 1, reverse)[1]
    want = sequential_scan(combine_fn, (reset, v), 1, reverse, "pointwise")[1]
    cot = torch.randn_like(want)
    assert_same_grads(torch.autograd.grad(got, (v, w), cot), torch.autograd.grad(want, (v, w), cot))


# --- case 7: empty non-scan dimensions with gradients ------------------------------


@pytest.mark.parametrize("route", ["pointwise", "generic", "lax", "reset"])
def test_empty_element_dims_with_gradients(route):
    x = torch.randn(7, 0, 3, requires_grad=True)
    mul = lambda a, b: a * b
    if route == "lax":
        y = fscan.lax.associative_scan(mul, x, axis=0)
    elif route == "reset":
        y = fscan.associative_scan(mul, x, 0, reset=torch.zeros(7, dtype=torch.bool))
    else:
        y = fscan.associative_scan(mul, x, 0, combine_mode=route)
    assert y.shape == (7, 0, 3)
    y.sum().backward()
    assert x.grad.shape == (7, 0, 3)


def test_one_empty_leaf_beside_a_full_one():
    a = torch.rand(5, 0, dtype=F64, requires_grad=True)
    b = torch.rand(5, 2, dtype=F64, requires_grad=True)
    pair = lambda x, y: (x[0] * 1.0, x[1] + y[1])
    out = fscan.associative_scan(pair, (a, b), 0)
    torch.testing.assert_close(out[1], b.cumsum(0))
    (g,) = torch.autograd.grad(out[1].sum(), b)
    torch.testing.assert_close(g, torch.arange(5, 0, -1, dtype=F64)[:, None].expand(5, 2))


# --- case 10: validation under vmap ------------------------------------------------


def test_validate_on_under_vmap():
    xs = torch.randn(3, 5)
    with fscan.config.override(validate=True):
        out = torch.func.vmap(lambda x: fscan.associative_scan(torch.add, x, 0))(xs)
    torch.testing.assert_close(out, xs.cumsum(1))


# --- case 11: indexing the batch of elements is refused in pointwise mode ----------


@pytest.mark.parametrize(
    "combine_fn",
    [
        lambda a, b: a + b[0],
        lambda a, b: a + b[1:2],
        lambda a, b: a + b[:1],
        lambda a, b: a + b.narrow(0, 0, 1),
        lambda a, b: a + b.index_select(0, torch.tensor([0])),
        lambda a, b: a + b[torch.tensor([0])],
        lambda a, b: a + b.unbind(0)[0],
        lambda a, b: a + b.sum(0),
        lambda a, b: a + b.flip(0),
        lambda a, b: a + b.roll(1, 0),
        lambda a, b: a + b.T.T.contiguous().view(-1).view(b.shape).flip(0),
        lambda a, b: (a[:, None] + b)[:, 0],
        lambda a, b: a + b.reshape(-1)[: b.numel()].reshape(b.shape).flip(0),
    ],
    ids=[
        "select",
        "slice",
        "slice-head",
        "narrow",
        "index_select",
        "advanced",
        "unbind",
        "reduction",
        "flip",
        "roll",
        "reshape-flip",
        "misaligned-broadcast",
        "flatten",
    ],
)
def test_indexing_the_batch_is_refused_in_pointwise_mode(combine_fn):
    x = torch.randn(8, 3)
    with pytest.raises(fscan.CombineFnError, match="not elementwise"):
        fscan.associative_scan(combine_fn, x, 0)


def test_select_on_scalar_elements_is_refused():
    with pytest.raises(fscan.CombineFnError, match=re.escape("aten.select")):
        fscan.associative_scan(lambda a, b: a + b[0], torch.randn(8), 0)


def test_constants_made_inside_and_views_within_an_element_pass():
    x = torch.randn(8, 4, 1)
    for fn in (
        lambda a, b: a + b * torch.ones(4, 1),
        lambda a, b: a + b[..., 0:1],
        lambda a, b: a + b.unsqueeze(-1)[..., 0],
    ):
        got = fscan.associative_scan(fn, x, 0)
        torch.testing.assert_close(got, sequential_scan(fn, x, 0, combine_mode="pointwise"))


# --- case 12: tensors fscan cannot scan are refused ---------------------------------


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_refused():
    nested = torch.nested.nested_tensor([torch.ones(3), torch.ones(2)])
    with pytest.raises(fscan.ScanTypeError, match="nested tensor"):
        fscan.associative_scan(torch.add, nested, 0)


# --- case 13: messages and types ---------------------------------------------------


def test_python_control_flow_in_generic_mode_names_the_fix():
    branchy = lambda a, b: a if a[0] >= b[0] else b
    with pytest.raises(fscan.CombineFnError, match=re.escape("torch.where")):
        fscan.associative_scan(branchy, torch.randn(8, 2), 0, combine_mode="generic")


def test_drop_ins_take_numpy_dims_and_raise_index_error_like_torch():
    x = torch.rand(3, 4)
    torch.testing.assert_close(fscan.cumsum(x, np.int64(1)), torch.cumsum(x, 1))
    torch.testing.assert_close(fscan.associative_scan(torch.add, x, np.int32(-1)), x.cumsum(1))
    with pytest.raises(IndexError):
        torch.cumsum(x, 5)
    with pytest.raises(IndexError, match="out of range"):
        fscan.cumsum(x, 5)


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
