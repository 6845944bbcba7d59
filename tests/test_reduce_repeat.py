"""The reduce router's repeat route (fscan._routing.reduce): a reduce identical, in all the
route depends on, to one the reduce kernel served runs that kernel again without the
checks; any change a verdict depends on (dtype, shape, dim, reverse, a captured value,
grad mode, config, validate, layout, a transform, ``initial``) takes the full path;
results are a sequential float64 oracle's, in new memory, and the log names the engine
as for any route."""

from __future__ import annotations

import logging

import optree
import pytest
import torch

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._routing import reduce as router

pytestmark = [
    pytest.mark.skipif(
        compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
    ),
    pytest.mark.usefixtures("fresh_eager_kernel"),
]


@pytest.fixture
def served(runs_of):
    """The runs the repeat route served, as they happen."""
    return runs_of("run_reduce", router)


def oracle(fn, xs, dim: int, reverse: bool):
    """The total by a sequential loop, floats in float64."""
    leaves, spec = optree.tree_flatten(xs)
    wide = [x.double() for x in leaves]
    n = wide[0].shape[dim]
    acc = None
    for t in range(n - 1, -1, -1) if reverse else range(n):
        x = spec.unflatten([w.select(dim, t) for w in wide])
        acc = x if acc is None else fn(acc, x)
    return acc


def close(out, want) -> None:
    """``out`` against the float64 oracle, at ``out``'s precision."""
    optree.tree_map(lambda o, w: torch.testing.assert_close(o, w.to(o.dtype)), out, want)


def warm(fn, xs, dim=0, **kw):
    """The calls that make ``fn`` known and its kernels built (the full path)."""
    for _ in range(3):
        fscan.associative_reduce(fn, xs, dim, **kw)


add = lambda a, b: a + b
pair = lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1])  # does not commute


@pytest.mark.parametrize("fn", [torch.add, add], ids=["builtin", "lambda"])
@pytest.mark.parametrize(
    ("shape", "dim", "reverse"),
    [((64,), 0, False), ((5, 37, 3), -2, True), ((300, 40), 0, True), ((6, 9), 1, False)],
)
def test_a_repeated_call_is_served_and_right(served, fn, shape, dim, reverse):
    x = torch.randn(shape)
    before = x.clone()
    warm(fn, x, dim, reverse=reverse)
    served.clear()
    out = fscan.associative_reduce(fn, x, dim, reverse=reverse)
    assert len(served) == 1
    close(out, oracle(torch.add, x, dim, reverse))
    assert out.shape == x.sum(dim).shape
    assert torch.equal(x, before)
    out2 = fscan.associative_reduce(fn, x, dim, reverse=reverse)
    assert out2.data_ptr() != out.data_ptr() and torch.equal(out, out2)


@pytest.mark.parametrize("reverse", [False, True])
def test_a_pytree_call_keeps_the_order(served, reverse):
    a, b = torch.rand(33, 20) * 0.5 + 0.5, torch.randn(33, 20)
    warm(pair, (a, b), reverse=reverse)
    served.clear()
    got = fscan.associative_reduce(pair, (a, b), 0, reverse=reverse)
    assert len(served) == 1
    close(got, oracle(pair, (a, b), 0, reverse))
    xs = {"a": a, "b": b}
    fn = lambda p, q: {"a": p["a"] * q["a"], "b": q["a"] * p["b"] + q["b"]}
    warm(fn, xs, reverse=reverse)
    served.clear()
    got = fscan.associative_reduce(fn, xs, 0, reverse=reverse)
    assert len(served) == 1 and set(got) == {"a", "b"}
    close(got, oracle(fn, xs, 0, reverse))


@pytest.mark.parametrize("length", [1, 2])
def test_a_short_total_is_new_memory(served, length):
    """Length 1 never reaches the kernel (no combine ever runs, so it is never checked
    elementwise): the full path's copy; length 2 is served."""
    x = torch.randn(length, 16)
    warm(add, x)
    served.clear()
    out = fscan.associative_reduce(add, x, 0)
    assert len(served) == length - 1
    close(out, oracle(torch.add, x, 0, False))
    before = x.clone()
    out.add_(1.0)  # the result is the caller's to write: the input stays as it was
    assert torch.equal(x, before)


# Each variant changes one thing the route depends on: its first call must take the
# full path (no stored run fits it) and still give the oracle's result.
VARIANTS = {
    "dtype": lambda x: (x.double(), 0, False),
    "shape": lambda x: (torch.randn(65, 8), 0, False),
    "dim": lambda x: (x, 1, False),
    "reverse": lambda x: (x, 0, True),
    "layout": lambda x: (torch.randn(64, 16)[:, ::2], 0, False),
    "transpose": lambda x: (torch.randn(8, 64).t(), 0, False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_changed_call_is_not_repeated(served, variant):
    x = torch.randn(64, 8)
    warm(add, x)
    y, dim, reverse = VARIANTS[variant](x)
    served.clear()
    out = fscan.associative_reduce(add, y, dim, reverse=reverse)
    assert served == []
    close(out, oracle(torch.add, y, dim, reverse))


def test_a_scan_and_a_reduce_keep_their_own_runs(served):
    x = torch.randn(64, 8)
    for _ in range(3):
        fscan.associative_scan(add, x, 0)  # the scan's repeat route stores its own run
    served.clear()
    close(fscan.associative_reduce(add, x, 0), oracle(torch.add, x, 0, False))
    assert served == []
    warm(add, x)
    served.clear()
    close(fscan.associative_scan(add, x, 0)[-1], oracle(torch.add, x, 0, False))
    assert served == []


def test_a_changed_captured_value_is_not_repeated(served):
    make = lambda flag: lambda a, b: a + b if flag else torch.maximum(a, b)
    x = torch.randn(64, 8)
    warm(make(True), x)
    served.clear()
    out = fscan.associative_reduce(make(False), x, 0)
    assert served == []
    torch.testing.assert_close(out, x.amax(0))
    warm(make(False), x)
    served.clear()
    close(fscan.associative_reduce(make(True), x, 0), oracle(torch.add, x, 0, False))
    assert len(served) == 1  # both verdicts stored, each under its own key


def test_a_captured_tensor_is_read_on_every_call(served):
    w = torch.full((), -1.0)
    fn = lambda a, b: torch.maximum(torch.maximum(a, b), w)
    x = torch.randn(64, 8)
    warm(fn, x)
    w.fill_(5.0)  # in place: same key, new value
    served.clear()
    out = fscan.associative_reduce(fn, x, 0)
    assert len(served) == 1
    assert torch.equal(out, torch.full((8,), 5.0))


def test_grad_mode_and_requires_grad_are_not_repeated(served):
    x = torch.randn(64, 8)
    warm(add, x)
    served.clear()
    xg = x.clone().requires_grad_()
    out = fscan.associative_reduce(add, xg, 0)
    out.sum().backward()
    assert served == [] and out.requires_grad
    torch.testing.assert_close(xg.grad, torch.ones(64, 8))
    with torch.no_grad():
        fscan.associative_reduce(add, x, 0)  # grad mode is part of the key
    assert served == []


@pytest.mark.parametrize("setting", [{"validate": True}, {"cpu_kernel": "off"}])
def test_config_is_part_of_the_key(served, setting):
    x = torch.randn(64, 8)
    warm(add, x)
    served.clear()
    with fscan.config.override(**setting):
        out = fscan.associative_reduce(add, x, 0)
    assert served == []
    close(out, oracle(torch.add, x, 0, False))


def test_validate_is_part_of_the_key(served):
    x = torch.randn(64, 8)
    warm(add, x)
    served.clear()
    fscan.associative_reduce(add, x, 0, validate=True)  # checks on every call: never stored
    fscan.associative_reduce(add, x, 0, validate=True)
    fscan.associative_reduce(add, x, 0, validate=False)  # a key of its own
    assert served == []


def test_an_impure_combine_fn_still_raises():
    x = torch.randn(64, 8)
    warm(add, x)

    def writes(a, b):
        a.add_(0.0)
        return a + b

    with pytest.raises(fscan.ScanError, match="modif"):
        fscan.associative_reduce(writes, x, 0)
    with pytest.raises(fscan.ScanError, match="modif"):
        fscan.associative_reduce(writes, x, 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reverse": 0}, "`reverse` must be a bool"),
        ({"dim": False}, "`dim` must be an int"),
        ({"validate": 0}, "`validate` must be a bool or None"),
        ({"dim": 2}, "dim"),
    ],
)
def test_values_equal_in_a_key_still_raise(kwargs, match):
    x = torch.randn(64, 8)
    warm(add, x, validate=False)
    args = {"dim": 0, "validate": False, **kwargs}
    with pytest.raises(fscan.ScanError, match=match):
        fscan.associative_reduce(add, x, **args)


def test_transforms_and_carries_take_the_full_path(served):
    x = torch.randn(64, 8)
    warm(add, x)
    served.clear()
    batched = torch.func.vmap(lambda v: fscan.associative_reduce(add, v, 0))(x[None])
    close(batched[0], oracle(torch.add, x, 0, False))
    got = fscan.associative_reduce(add, x, 0, initial=torch.ones(8))
    close(got, oracle(torch.add, x, 0, False) + 1)
    assert served == []


def test_clear_caches_forgets_the_runs(served):
    x = torch.randn(64, 8)
    warm(add, x)
    assert len(router.repeated_reduces) >= 1
    fscan.clear_caches()
    assert len(router.repeated_reduces) == 0
    served.clear()
    fscan.associative_reduce(add, x, 0)
    assert served == []


def test_the_log_names_the_engine(served, caplog):
    x = torch.randn(64, 8)
    warm(add, x)
    caplog.set_level(logging.DEBUG, logger="fscan")
    served.clear()
    fscan.associative_reduce(add, x, 0)
    assert len(served) == 1
    [record] = [r for r in caplog.records if hasattr(r, "fscan_engine")]
    assert record.fscan_engine == "cpp"
