"""The router's repeat shortcut (fscan._routing.repeat): a call identical, in all the route
depends on, to one the kernel served runs that kernel again without the checks; any
change a verdict depends on (dtype, shape, dim, reverse, a captured value, grad mode,
config, layout, a transform) takes the full path; results are the reference's, and the
log names the engine as for any route."""

from __future__ import annotations

import logging

import pytest
import torch

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._routing import repeat

pytestmark = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)


@pytest.fixture(autouse=True)
def fresh():
    fscan.clear_caches()
    with fscan.config.override(cpu_kernel="eager"):
        yield
    fscan.clear_caches()


@pytest.fixture
def served(monkeypatch):
    """The runs the repeat shortcut served, as they happen."""
    runs: list[object] = []
    run_prepared = repeat.run_prepared

    def counted(run, leaves, captured):
        out = run_prepared(run, leaves, captured)
        runs.append(run)
        return out

    monkeypatch.setattr(repeat, "run_prepared", counted)
    return runs


def reference(x: torch.Tensor, dim: int, reverse: bool, op=torch.add) -> torch.Tensor:
    """A sequential float64 scan along ``dim``."""
    x64 = x.double().movedim(dim, 0)
    steps = list(x64.flip(0) if reverse else x64)
    out = [steps[0]]
    for step in steps[1:]:
        out.append(op(out[-1], step))
    y = torch.stack(out)
    return (y.flip(0) if reverse else y).movedim(0, dim)


def close(out: torch.Tensor, want: torch.Tensor) -> None:
    """``out`` against a float64 reference, at ``out``'s precision."""
    torch.testing.assert_close(out, want.to(out.dtype))


def warm(fn, xs, dim=0, **kw):
    """The calls that make ``fn`` known and its kernel built (the full path), then one
    the shortcut must serve."""
    for _ in range(3):
        fscan.associative_scan(fn, xs, dim, **kw)


add = lambda a, b: a + b


@pytest.mark.parametrize("fn", [torch.add, add], ids=["builtin", "lambda"])
@pytest.mark.parametrize(("shape", "dim", "reverse"), [((64,), 0, False), ((5, 7, 3), -2, True)])
def test_a_repeated_call_is_served_and_right(served, fn, shape, dim, reverse):
    x = torch.randn(shape)
    before = x.clone()
    warm(fn, x, dim, reverse=reverse)
    served.clear()
    out = fscan.associative_scan(fn, x, dim, reverse=reverse)
    assert len(served) == 1
    close(out, reference(x, dim, reverse))
    assert torch.equal(x, before) and out.data_ptr() != x.data_ptr()
    out2 = fscan.associative_scan(fn, x, dim, reverse=reverse)
    assert out2.data_ptr() != out.data_ptr() and torch.equal(out, out2)


def test_a_pytree_call_is_served(served):
    pair = lambda p, q: (p[0] * q[0], q[0] * p[1] + q[1])
    a, b = torch.rand(32, 4) * 0.5 + 0.5, torch.randn(32, 4)
    warm(pair, (a, b))
    served.clear()
    ga, gb = fscan.associative_scan(pair, (a, b), 0)
    assert len(served) == 1
    h, want = torch.zeros(4, dtype=torch.float64), []
    for t in range(32):
        h = a[t].double() * h + b[t].double()
        want.append(h)
    close(gb, torch.stack(want))
    close(ga, a.double().cumprod(0))


# Each variant changes one thing the route depends on: its first call must take the
# full path (no stored run fits it) and still give the reference's result.
VARIANTS = {
    "dtype": lambda x: (x.double(), 0, False),
    "shape": lambda x: (torch.randn(65), 0, False),
    "dim": lambda x: (x.reshape(8, 8), 1, False),
    "reverse": lambda x: (x, 0, True),
    "layout": lambda x: (torch.randn(128)[::2], 0, False),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_a_changed_call_is_not_repeated(served, variant):
    x = torch.randn(64)
    warm(add, x)
    y, dim, reverse = VARIANTS[variant](x)
    served.clear()
    out = fscan.associative_scan(add, y, dim, reverse=reverse)
    assert served == []
    close(out, reference(y, dim, reverse))


def test_another_dim_of_one_shape_is_not_repeated(served):
    x = torch.randn(8, 8)
    warm(add, x, 0)
    served.clear()
    close(fscan.associative_scan(add, x, 1), reference(x, 1, False))
    close(fscan.associative_scan(add, x, -2), reference(x, 0, False))  # dim 0 again
    assert len(served) == 1


def test_a_changed_captured_value_is_not_repeated(served):
    make = lambda flag: lambda a, b: a + b if flag else torch.maximum(a, b)
    x = torch.randn(64)
    warm(make(True), x)
    served.clear()
    out = fscan.associative_scan(make(False), x, 0)
    assert served == []
    close(out, reference(x, 0, False, torch.maximum))
    warm(make(False), x)
    served.clear()
    torch.testing.assert_close(fscan.associative_scan(make(True), x, 0), x.cumsum(0))
    assert len(served) == 1  # both verdicts stored, each under its own key


def test_a_captured_tensor_is_read_on_every_call(served):
    w = torch.full((), -1.0)
    fn = lambda a, b: torch.maximum(torch.maximum(a, b), w)
    x = torch.randn(64)
    warm(fn, x)
    w.fill_(0.5)  # in place: same key, new value
    served.clear()
    out = fscan.associative_scan(fn, x, 0)
    assert len(served) == 1
    want = torch.maximum(x.cummax(0).values, w)
    want[0] = x[0]  # the first element is never combined
    torch.testing.assert_close(out, want)


def test_grad_mode_and_requires_grad_are_not_repeated(served):
    x = torch.randn(64)
    warm(add, x)
    served.clear()
    xg = x.clone().requires_grad_()
    out = fscan.associative_scan(add, xg, 0)
    out.sum().backward()
    assert served == [] and out.requires_grad
    torch.testing.assert_close(xg.grad, torch.arange(64.0, 0.0, -1.0))
    with torch.no_grad():
        fscan.associative_scan(add, x, 0)  # grad mode is part of the key
    assert served == []


@pytest.mark.parametrize("setting", [{"validate": True}, {"cpu_kernel": "off"}])
def test_config_is_part_of_the_key(served, setting):
    x = torch.randn(64)
    warm(add, x)
    served.clear()
    with fscan.config.override(**setting):
        out = fscan.associative_scan(add, x, 0)
    assert served == []
    torch.testing.assert_close(out, x.cumsum(0))


def test_validate_is_part_of_the_key(served):
    x = torch.randn(64)
    warm(add, x)
    served.clear()
    fscan.associative_scan(add, x, 0, validate=True)  # checks on every call: never stored
    fscan.associative_scan(add, x, 0, validate=True)
    fscan.associative_scan(add, x, 0, validate=False)  # a key of its own
    assert served == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"reverse": 0}, "`reverse` must be a bool"),
        ({"dim": False}, "`dim` must be an int"),
        ({"validate": 0}, "`validate` must be a bool or None"),
    ],
)
def test_values_equal_in_a_key_still_raise(kwargs, match):
    x = torch.randn(64)
    warm(add, x, validate=False)
    args = {"dim": 0, **kwargs}
    with pytest.raises(fscan.ScanTypeError, match=match):
        fscan.associative_scan(add, x, **args)


def test_transforms_and_carries_take_the_full_path(served):
    x = torch.randn(64)
    warm(add, x)
    served.clear()
    batched = torch.func.vmap(lambda v: fscan.associative_scan(add, v, 0))(x[None])
    torch.testing.assert_close(batched[0], x.cumsum(0))
    got = fscan.associative_scan(add, x, 0, initial=torch.tensor(1.0))
    torch.testing.assert_close(got, x.cumsum(0) + 1)
    assert served == []


def test_clear_caches_forgets_the_runs(served):
    x = torch.randn(64)
    warm(add, x)
    assert len(repeat.repeats) >= 1
    fscan.clear_caches()
    assert len(repeat.repeats) == 0
    served.clear()
    fscan.associative_scan(add, x, 0)
    assert served == []


def test_the_log_names_the_engine(served, caplog):
    x = torch.randn(64)
    warm(add, x)
    before = fscan.explain(add, x, 0)
    caplog.set_level(logging.DEBUG, logger="fscan")
    served.clear()
    fscan.associative_scan(add, x, 0)
    assert len(served) == 1
    [record] = [r for r in caplog.records if hasattr(r, "fscan_engine")]
    assert record.fscan_engine == "cpp" == before.engine
    assert record.fscan_refused == dict(before.refused)
