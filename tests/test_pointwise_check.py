"""combine_mode="pointwise" accepts elementwise combine_fns only.

The check: fscan._knowledge.pointwise_check.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import (
    add,
    affine_compose,
    assert_trees_close,
    cached_verdicts,
    linear_recurrence,
    logaddexp,
    maximum,
    parametrize,
    sequential_scan,
)

import fscan
from fscan._knowledge import pointwise_check as _pointwise_check
from fscan._knowledge.store import Knowledge


@pytest.fixture(autouse=True)
def fresh_verdicts():
    fscan.clear_caches()
    yield
    fscan.clear_caches()


def _where_max(a, b):
    return torch.where(a > b, a, b)


def _with_casts(a, b):
    return (a.double() + b.double()).to(a.dtype) * torch.ones_like(a)


F64 = torch.float64
W = torch.rand(3) + 0.5


def _closure_and_constant(a, b):
    return a * W / W + b * torch.tensor(1.0)


def _broadcast_first_component(a, b):  # a view re-indexing inside the element
    return a + b[..., :1] - b[..., :1] + b


@parametrize(
    op=[add, maximum, logaddexp, _where_max, _with_casts, _closure_and_constant],
    reverse=[False, True],
)
def test_elementwise_combine_fns_pass(op, reverse):
    xs = torch.randn(17, 4, 3)
    out = fscan.associative_scan(op, xs, 0, reverse=reverse)
    assert_trees_close(out, sequential_scan(op, xs, 0, reverse, "pointwise"))


def test_views_inside_the_element_pass():
    xs = torch.randn(9, 3)
    out = fscan.associative_scan(_broadcast_first_component, xs, 0)
    assert_trees_close(out, sequential_scan(_broadcast_first_component, xs, 0, False, "pointwise"))


@parametrize(op=[linear_recurrence, affine_compose])
def test_pytree_combine_fns_pass(op):
    xs = (torch.rand(12, 2), torch.randn(12, 2))
    if op is affine_compose:
        xs = {"w": xs[0], "c": xs[1]}
    out = fscan.associative_scan(op, xs, 0)
    assert_trees_close(out, sequential_scan(op, xs, 0, False, "pointwise"))


MESSAGE = (
    "combine_mode='pointwise' calls combine_fn on whole batches of elements and compiles it as "
    "an elementwise kernel on GPUs, so it may use elementwise operations only. Use "
    "combine_mode='generic', where combine_fn sees one element at a time."
)
CASES = {
    "matmul": (torch.matmul, "aten.bmm, a matrix product"),
    "sum": (lambda a, b: a + b.sum(-1, keepdim=True), "aten.sum, a reduction"),
    "amax": (lambda a, b: a + b.amax(-1, keepdim=True), "aten.amax, a reduction"),
    "index": (lambda a, b: a + b[..., [1, 0]], "aten.index, which is not elementwise"),
    "flip": (lambda a, b: a + b.flip(-1), "aten.flip, which is not elementwise"),
    "cumsum": (lambda a, b: a + b.cumsum(-1), "aten.cumsum, which is not elementwise"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_non_elementwise_ops_are_named_with_the_fix(name):
    op, what = CASES[name]
    expected = f"fscan.associative_scan: `combine_fn` is not elementwise: it calls {what}"
    with pytest.raises(fscan.CombineFnError, match=re.escape(expected)) as info:
        fscan.associative_scan(op, torch.randn(6, 2, 2), 0)
    assert MESSAGE in str(info.value)


def test_the_error_is_a_value_error_and_a_scan_error():
    with pytest.raises(fscan.CombineFnError) as info:
        fscan.associative_scan(torch.matmul, torch.randn(6, 2, 2), 0)
    assert isinstance(info.value, ValueError) and isinstance(info.value, fscan.ScanError)


def test_randomness_is_an_impurity():
    noisy = lambda a, b: a + b + 0 * torch.rand_like(b)
    with pytest.raises(fscan.ImpureCombineError, match="random operation"):
        fscan.associative_scan(noisy, torch.randn(8), 0)


def test_the_random_check_stops_before_drawing():
    # Run the watch directly: the purity probe would otherwise stop the draw first.
    flat = lambda a, b: [a[0] + torch.rand_like(b[0])]
    _, leaves = _flat(torch.randn(8))
    generator_state = torch.get_rng_state()
    watched = _pointwise_check.checked_on_first_call("api", flat, Knowledge(), leaves)
    with pytest.raises(fscan.ImpureCombineError):
        watched(leaves, leaves)
    assert torch.equal(torch.get_rng_state(), generator_state)


def test_generic_mode_allows_what_pointwise_rejects():
    xs = torch.randn(7, 2, 2) / 2
    out = fscan.associative_scan(torch.matmul, xs, 0, combine_mode="generic")
    assert_trees_close(out, sequential_scan(torch.matmul, xs, 0, False, "generic"))


@pytest.fixture
def watches(monkeypatch):
    """Counts the combine calls the elementwise check watches. (The first-call
    associativity check watches a call of its own, with a verdict it throws away: the
    tests that count pass validate=False, which skips it.)"""
    count = [0]
    init = _pointwise_check._ElementwiseWatch.__init__

    def counting_init(self, *args):
        count[0] += 1
        init(self, *args)

    monkeypatch.setattr(_pointwise_check._ElementwiseWatch, "__init__", counting_init)
    return count


def test_the_check_watches_one_call_then_the_verdict_is_cached(watches):
    for _ in range(3):
        fscan.associative_scan(lambda a, b: a * b, torch.randn(16), 0, validate=False)
    assert watches[0] == 1
    assert cached_verdicts("elementwise") == 1


def test_a_new_leaf_layout_is_checked_again(watches):
    fn = lambda a, b: a * b
    fscan.associative_scan(fn, torch.randn(16), 0, validate=False)
    fscan.associative_scan(fn, torch.randn(16, 2), 0, validate=False)
    fscan.associative_scan(fn, torch.randn(16, dtype=torch.float64), 0, validate=False)
    assert watches[0] == 3


def test_nothing_is_cached_when_combine_fn_never_runs():
    fscan.associative_scan(lambda a, b: a * b, torch.randn(1, 3), 0)
    assert cached_verdicts("elementwise") == 0


def test_a_failed_check_is_not_cached():
    for _ in range(2):
        with pytest.raises(fscan.CombineFnError):
            fscan.associative_scan(torch.matmul, torch.randn(6, 2, 2), 0)
    assert cached_verdicts("elementwise") == 0


def test_no_check_inside_torch_func_transforms():
    # vmap'ed calls are not watched (wrapped tensors) and cache nothing.
    xs = torch.randn(3, 8)
    out = torch.func.vmap(lambda x: fscan.associative_scan(add, x, 0))(xs)
    assert_trees_close(out, xs.cumsum(1))
    assert cached_verdicts("elementwise") == 0


def _flat(x):
    leaves, spec = fscan._pytree.flatten(x)
    return spec, leaves


# A batch of one element cannot show the batch axis: these look elementwise on it and
# give another answer than the sequential loop over single elements.
def _nested_scan(x, y):
    return x + fscan.associative_scan(lambda p, q: p * q, y, 0, reverse=True)


def _first_of_batch(x, y):
    return x + y[0]


def _slice_of_batch(x, y):
    return x + y[:1]


BATCH_BLIND = {
    "nested_scan": _nested_scan,
    "first_of_batch": _first_of_batch,
    "slice_of_batch": _slice_of_batch,
}


@parametrize(name=list(BATCH_BLIND), n=[2, 3, 4, 5, 8], reverse=[False, True])
def test_batch_mixing_is_refused_at_every_length(name, n, reverse):
    with pytest.raises(fscan.CombineFnError, match="moves values between elements"):
        fscan.associative_scan(BATCH_BLIND[name], torch.randn(n, 10, 2), 0, reverse=reverse)


@parametrize(name=list(BATCH_BLIND), n=[2, 3, 5])
def test_batch_mixing_is_refused_by_the_reduction_at_every_length(name, n):
    with pytest.raises(fscan.CombineFnError, match="moves values between elements"):
        fscan.associative_reduce(BATCH_BLIND[name], torch.randn(n, 10, 2), 0)


@parametrize(name=list(BATCH_BLIND), reverse=[False, True])
def test_the_carry_in_of_a_one_step_scan_is_checked(name, reverse):
    # The fold of `initial` is the only combine_fn call of a one-step scan.
    fn = BATCH_BLIND[name]
    xs, initial = torch.randn(1, 10, 2), torch.randn(10, 2)
    for reset in (None, torch.zeros(1, dtype=torch.bool)):
        with pytest.raises(fscan.CombineFnError, match="moves values between elements"):
            fscan.associative_scan(fn, xs, 0, reverse=reverse, initial=initial, reset=reset)
    with pytest.raises(fscan.CombineFnError, match="moves values between elements"):
        fscan.associative_reduce(fn, xs, 0, initial=initial)


def test_a_refusal_on_a_long_scan_stands_for_short_ones():
    with pytest.raises(fscan.CombineFnError):
        fscan.associative_scan(_nested_scan, torch.randn(9, 10, 2), 0)
    for n in (4, 3, 2):
        with pytest.raises(fscan.CombineFnError):
            fscan.associative_scan(_nested_scan, torch.randn(n, 10, 2), 0)


def test_a_one_step_scan_needs_no_verdict():
    # No combine_fn call, as in the loop: the output is the input.
    xs = torch.randn(1, 10, 2)
    torch.testing.assert_close(fscan.associative_scan(_nested_scan, xs, 0), xs, rtol=0, atol=0)
    assert cached_verdicts("elementwise") == 0


@parametrize(op=[add, logaddexp, _broadcast_first_component], n=[2, 3, 4], reverse=[False, True])
def test_short_elementwise_scans_pass_and_cache_the_verdict(op, n, reverse, watches):
    xs = torch.randn(n, 4, 3, dtype=torch.float64)
    for _ in range(2):
        out = fscan.associative_scan(op, xs, 0, reverse=reverse, validate=False)
        assert_trees_close(out, sequential_scan(op, xs, 0, reverse, "generic"))
    assert watches[0] == 1 and cached_verdicts("elementwise") == 1


@parametrize(n=[2, 3])
def test_short_scans_keep_their_gradients(n):
    a = (torch.rand(n, 3, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
    scan = lambda a, b: fscan.associative_scan(linear_recurrence, (a, b), 0)[1]
    assert torch.autograd.gradcheck(scan, (a, b))
    loop = sequential_scan(linear_recurrence, (a.detach(), b.detach()), 0, False, "generic")[1]
    torch.testing.assert_close(scan(a, b), loop)


def test_within_element_views_are_elementwise_in_pointwise_mode():
    # `a[..., :1]` keeps the batch of elements in place: allowed, and exact.
    fn = lambda a, b: a[..., :1] + b
    x = torch.randn(9, 3, dtype=F64)
    torch.testing.assert_close(fscan.associative_scan(fn, x, 0), sequential_scan(fn, x, 0))


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
