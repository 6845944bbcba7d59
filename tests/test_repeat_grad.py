"""The router's repeat route for calls that want gradients (fscan._routing.repeat): a call
identical, in everything the route depends on, to one the C++ kernels served on the
``adjoint`` route runs those kernels' autograd Function again without the checks and
lookups. Any change a verdict depends on (dtype, shape, requires_grad, dim, reverse,
reset=/initial=, config, a captured value, a swapped ``__code__``, grad mode) takes the
full path; values and gradients (float64 gradcheck) are a sequential reference's."""

from __future__ import annotations

import logging

import pytest
import torch

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._routing import repeat

pytestmark = [
    pytest.mark.skipif(
        compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
    ),
    pytest.mark.usefixtures("fresh_eager_kernel"),
]


@pytest.fixture
def served(runs_of):
    """The grad runs the repeat route served, as they happen."""
    return runs_of("run_grad_prepared", repeat, kept=lambda out: out is not None)


add = lambda a, b: a + b
pair = lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1])


def sequential(fn, xs, dim, reverse):
    """The scan step by step (differentiable: torch ops on slices), as a list of leaves."""
    leaves = list(xs) if isinstance(xs, tuple) else [xs]
    unpack = (lambda t: tuple(t)) if isinstance(xs, tuple) else (lambda t: t[0])
    steps = [[x.select(dim, t) for x in leaves] for t in range(leaves[0].shape[dim])]
    order = range(len(steps) - 1, -1, -1) if reverse else range(len(steps))
    out, carry = [None] * len(steps), None
    for t in order:
        carry = steps[t] if carry is None else _as_list(fn(unpack(carry), unpack(steps[t])))
        out[t] = carry
    return [torch.stack([o[k] for o in out], dim) for k in range(len(leaves))]


def _as_list(y):
    return list(y) if isinstance(y, tuple) else [y]


def inputs(fn, shape, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    if fn is add:
        return torch.randn(shape, generator=g, dtype=dtype).requires_grad_()
    a = torch.rand(shape, generator=g, dtype=dtype) * 0.5 + 0.5
    return a.requires_grad_(), torch.randn(shape, generator=g, dtype=dtype).requires_grad_()


def leaves_of(xs):
    return list(xs) if isinstance(xs, tuple) else [xs]


def warm(fn, xs, dim=0, **kw):
    """Calls that make ``fn`` known and its kernels built (the full path), each with a
    backward (the backward kernel serves), then one the repeat route must serve."""
    for _ in range(3):
        out = fscan.associative_scan(fn, xs, dim, **kw)
        torch.autograd.backward([o.sum() for o in leaves_of(out)])


def stored(fn, xs, served, dim=0, **kw):
    """Warm ``fn`` up and see that an identical call is served: a negative test then
    shows that only its change missed the key."""
    warm(fn, xs, dim, **kw)
    served.clear()
    fscan.associative_scan(fn, xs, dim, **kw)
    assert len(served) == 1
    served.clear()


def check_against_reference(fn, xs, dim, reverse, **kw):
    out = leaves_of(fscan.associative_scan(fn, xs, dim, reverse=reverse, **kw))
    want = sequential(fn, xs, dim, reverse)
    cots = [torch.randn_like(o) for o in out]
    got = torch.autograd.grad(out, leaves_of(xs), cots)
    expect = torch.autograd.grad(want, leaves_of(xs), cots)
    for o, w in zip(out, want):
        torch.testing.assert_close(o, w)
    for g, e in zip(got, expect):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("fn", [add, pair], ids=["add", "pair"])
@pytest.mark.parametrize(("shape", "dim", "reverse"), [((64,), 0, False), ((5, 7, 3), -2, True)])
def test_a_repeated_grad_call_is_served_and_right(served, fn, shape, dim, reverse):
    xs = inputs(fn, shape)
    before = [x.detach().clone() for x in leaves_of(xs)]
    warm(fn, xs, dim, reverse=reverse)
    served.clear()
    check_against_reference(fn, xs, dim, reverse)
    assert len(served) == 1
    assert all(torch.equal(x, b) for x, b in zip(leaves_of(xs), before))
    served.clear()
    scan = lambda *ts: fscan.associative_scan(
        fn, ts if len(ts) > 1 else ts[0], dim, reverse=reverse
    )
    assert torch.autograd.gradcheck(scan, tuple(leaves_of(xs)))
    assert served  # gradcheck's calls with gradients took the repeat route


def test_an_output_without_a_cotangent_is_served(served):
    """The linear RNN as the pair, only ``h`` used: the backward picks the kernel without
    the gate products' cotangent, as on the full route."""
    a, b = inputs(pair, (32, 4))
    warm(pair, (a, b))
    served.clear()
    _, h = fscan.associative_scan(pair, (a, b), 0)
    ga, gb = torch.autograd.grad(h.sum(), (a, b))
    assert len(served) == 1
    want = sequential(pair, (a, b), 0, False)[1]
    ea, eb = torch.autograd.grad(want.sum(), (a, b))
    torch.testing.assert_close(ga, ea)
    torch.testing.assert_close(gb, eb)


def test_double_backward_through_a_served_call():
    """``create_graph=True`` runs the adjoint fallback with this call's combine_fn."""
    x = inputs(add, (16, 3))
    warm(add, x)
    y = fscan.associative_scan(add, x, 0)
    (g,) = torch.autograd.grad((y**2).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    want = sequential(add, x, 0, False)[0]
    (eg,) = torch.autograd.grad((want**2).sum(), x, create_graph=True)
    (egg,) = torch.autograd.grad(eg.sum(), x)
    torch.testing.assert_close(g, eg)
    torch.testing.assert_close(gg, egg)


def test_captured_tensors_are_this_calls(served):
    """A new closure each call over a new tensor (same key): the forward reads this call's
    tensor and its gradient goes to it, not to the first call's."""
    x = torch.randn(32, 4, dtype=torch.float64, requires_grad=True)

    def make(w):
        return lambda p, q: p + q + w  # associative, and w gets a gradient

    w0 = torch.full((4,), 0.5, dtype=torch.float64, requires_grad=True)
    warm(make(w0), x)
    before = w0.grad.clone()
    served.clear()
    w1 = torch.full((4,), 0.9, dtype=torch.float64, requires_grad=True)
    fn = make(w1)
    out = fscan.associative_scan(fn, x, 0)
    gx, gw = torch.autograd.grad(out.sum(), (x, w1))
    assert len(served) == 1
    want = sequential(fn, x, 0, False)[0]
    ex, ew = torch.autograd.grad(want.sum(), (x, w1))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gw, ew)
    assert torch.equal(w0.grad, before)  # the first calls' tensor: untouched
    served.clear()
    assert torch.autograd.gradcheck(lambda t, v: fscan.associative_scan(make(v), t, 0), (x, w1))
    assert served


def test_a_captured_tensors_requires_grad_is_part_of_the_key(served):
    x = torch.randn(32, 4, dtype=torch.float64, requires_grad=True)
    make = lambda w: lambda p, q: p + q + w
    stored(make(torch.full((4,), 0.5, dtype=torch.float64, requires_grad=True)), x, served)
    check_against_reference(make(torch.full((4,), 0.5, dtype=torch.float64)), x, 0, False)
    assert served == []
    frozen = torch.full((4,), 0.5, dtype=torch.float64, requires_grad=True)
    x.requires_grad_(False)  # only the captured tensor wants a gradient: still the adjoint
    warm(make(frozen), x)
    served.clear()
    out = fscan.associative_scan(make(frozen), x, 0)
    (gw,) = torch.autograd.grad(out.sum(), frozen)
    assert len(served) == 1
    (ew,) = torch.autograd.grad(sequential(make(frozen), x, 0, False)[0].sum(), frozen)
    torch.testing.assert_close(gw, ew)


# Each variant changes one thing the route depends on: its first call must take the
# full path (no stored run fits it) and still give the reference's values and gradients.
def _variants():
    return {
        "dtype": lambda x: (add, x.detach().float().requires_grad_(), 0, False, {}),
        "shape": lambda x: (
            add,
            torch.randn(65, 4, dtype=torch.float64).requires_grad_(),
            0,
            False,
            {},
        ),
        "dim": lambda x: (add, x, 1, False, {}),
        "reverse": lambda x: (add, x, 0, True, {}),
        "requires_grad": lambda x: (add, x.detach(), 0, False, {}),
        "initial": lambda x: (add, x, 0, False, {"initial": torch.ones(4, dtype=torch.float64)}),
        "reset": lambda x: (add, x, 0, False, {"reset": torch.arange(64) % 5 == 0}),
        "validate": lambda x: (add, x, 0, False, {"validate": True}),
    }


VARIANTS = _variants()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_changed_grad_call_is_not_repeated(served, variant):
    x = torch.randn(64, 4, dtype=torch.float64, requires_grad=True)
    stored(add, x, served)
    fn, y, dim, reverse, kw = VARIANTS[variant](x)
    out = fscan.associative_scan(fn, y, dim, reverse=reverse, **kw)
    assert served == []
    if "reset" in kw or "initial" in kw:
        return  # their reference values are the segmented and carry tests'
    torch.testing.assert_close(out, sequential(fn, y, dim, reverse)[0])
    if y.requires_grad:
        (g,) = torch.autograd.grad(out.sum(), y)
        (e,) = torch.autograd.grad(sequential(fn, y, dim, reverse)[0].sum(), y)
        torch.testing.assert_close(g, e)


def test_a_changed_captured_value_or_code_is_not_repeated(served):
    make = lambda flag: lambda a, b: a + b if flag else a * b
    x = torch.rand(32, dtype=torch.float64).add(0.5).requires_grad_()
    stored(make(True), x, served)
    check_against_reference(make(False), x, 0, False)
    assert served == []
    mul = lambda a, b: a * b
    swapped = lambda a, b: a + b
    stored(swapped, x, served)
    swapped.__code__ = mul.__code__  # same function object, other code: not served
    served.clear()
    check_against_reference(swapped, x, 0, False)
    assert served == []


@pytest.mark.parametrize("setting", [{"validate": True}, {"cpu_kernel": "off"}])
def test_config_is_part_of_the_grad_key(served, setting):
    x = inputs(add, (64,))
    stored(add, x, served)
    with fscan.config.override(**setting):
        check_against_reference(add, x, 0, False)
    assert served == []


def test_grad_mode_is_part_of_the_key(served):
    x = inputs(add, (64,))
    stored(add, x, served)
    with torch.no_grad():
        out = fscan.associative_scan(add, x, 0)
    assert served == [] and not out.requires_grad
    torch.testing.assert_close(out, x.detach().cumsum(0))


def test_transforms_take_the_full_path(served):
    x = inputs(add, (64,))
    stored(add, x, served)
    g = torch.func.grad(lambda t: fscan.associative_scan(add, t, 0).sum())(x.detach())
    torch.testing.assert_close(g, torch.arange(64.0, 0.0, -1.0, dtype=torch.float64))
    assert served == []


def test_the_grad_repeat_logs_the_engine(served, caplog):
    x = inputs(add, (64,))
    warm(add, x)
    before = fscan.explain(add, x, 0)
    caplog.set_level(logging.DEBUG, logger="fscan")
    served.clear()
    fscan.associative_scan(add, x, 0)
    assert len(served) == 1
    [record] = [r for r in caplog.records if hasattr(r, "fscan_engine")]
    assert record.fscan_engine == "cpp" == before.engine


def test_clear_caches_forgets_the_grad_runs(served):
    x = inputs(add, (64,))
    stored(add, x, served)
    fscan.clear_caches()
    served.clear()
    fscan.associative_scan(add, x, 0)
    assert served == []
