"""The router's repeat shortcut (fscan._routing.repeat): a call identical, in all the route
depends on, to one the kernel served runs that kernel again without the checks; any
change a verdict depends on (dtype, shape, dim, reverse, a captured value, grad mode,
config, layout, a transform) takes the full path; results are the reference's, and the
log names the engine as for any route."""

from __future__ import annotations

import logging
import math
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._knowledge.store import reach
from fscan._pytree import LEAF, flatten
from fscan._routing import repeat, repeat_drop_ins, repeat_key
from fscan._routing.cumulative import path

pytestmark = [
    pytest.mark.skipif(
        compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
    ),
    pytest.mark.usefixtures("fresh_eager_kernel"),
]


@pytest.fixture
def served(runs_of):
    """The runs the repeat shortcut served, as they happen: the scan's and the drop-ins'."""
    return runs_of("run_prepared", repeat, repeat_drop_ins)


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


def test_a_lone_tensor_and_a_tree_of_one_have_keys_of_their_own(served):
    # A lone tensor's structure is keyed by a token (not LEAF: optree hashes a spec
    # afresh on every lookup); a one-leaf tree is another structure, with its own key.
    x = torch.randn(64)
    warm(add, x)
    served.clear()
    out = fscan.associative_scan(lambda p, q: [p[0] + q[0]], [x], 0)
    assert served == [] and isinstance(out, list)
    close(out[0], reference(x, 0, False))
    key = repeat_key.call_parts(flatten([x])[1], [x], 0, False, "pointwise", None)
    assert key is not None and key[0] == flatten([x])[1]
    assert repeat_key.call_parts(LEAF, [x], 0, False, "pointwise", None)[0] == repeat_key.ONE_LEAF


def _rebuilt(code, module="tests.test_repeat_route", **kwargs):
    """A fresh function of ``code`` (capturing nothing) in ``module``."""
    fn = types.FunctionType(code, {"__name__": module}, "fn")
    fn.__module__ = module
    for name, value in kwargs.items():
        setattr(fn, name, value)
    return fn


def test_a_function_that_reaches_nothing_keys_as_the_walk_does(served):
    # The memo of such functions' reach (repeat_key.memo_reach): by code and module, and only
    # where the walk's own key is the code; what qualifies a function is read each call.
    mul = lambda a, b: a * b
    for fn in (add, mul, _rebuilt(add.__code__), _rebuilt(add.__code__, "torch.fake")):
        assert repeat_key.memo_reach(fn) == reach(fn)
        assert repeat_key.memo_reach(fn) == reach(fn)  # served from the memo where kept
    x = torch.rand(64) + 0.5
    warm(add, x)
    served.clear()
    swapped = lambda a, b: a + b
    swapped.__code__ = mul.__code__  # same function object, other code: not served
    torch.testing.assert_close(fscan.associative_scan(swapped, x, 0), x.cumprod(0))
    assert served == []
    with_default = _rebuilt(mul.__code__, __defaults__=(1.0,))  # a default: walked
    assert repeat_key.memo_reach(with_default) == reach(with_default)


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


# ---- the small call's fast path (a lone tensor, ahead of the log's wrapper) ---------


def _two_keys(x, dim=0, reverse=False, grads=True):
    """A lone tensor's key by its own function and by call_parts: one recipe."""
    lone = repeat_key.lone_parts(repeat_key.ONE_LEAF, x, dim, reverse, "pointwise", None, grads)
    return lone, repeat_key.call_parts(LEAF, [x], dim, reverse, "pointwise", None, grads)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(64),
        lambda: torch.randn(5, 7, 3, dtype=torch.float64),
        lambda: torch.randn(64, requires_grad=True),
        lambda: torch.randn(128)[::2],  # strided: refused by both
        lambda: torch._neg_view(torch.randn(64)),  # the negative bit: refused by both
        lambda: torch.randn(64, device="meta"),  # another device: refused by both
        lambda: torch.randint(0, 9, (4, 16)),
    ],
    ids=["f32", "f64-3d", "requires-grad", "strided", "neg-bit", "meta", "int64"],
)
def test_a_lone_tensor_keys_as_call_parts_does(make):
    x = make()
    for dim, reverse in [(0, False), (-1, True)]:
        for grads in (True, False):
            lone, parts = _two_keys(x, dim, reverse, grads)
            assert lone == parts
            with torch.no_grad():
                assert _two_keys(x, dim, reverse, grads)[0] == _two_keys(x, dim, reverse, grads)[1]
    refused = not x.is_contiguous() or x.is_neg() or not x.is_cpu
    assert (_two_keys(x)[0] is None) == refused


def test_each_key_part_misses_on_the_fast_path(served):
    """A lone tensor's call that differs from a served one in one part of the key (dtype,
    shape, strides, dim, reverse, grad mode, requires_grad, combine_fn, a captured value,
    validate) is not served by its run; the same call again is."""
    x = torch.randn(8, 8)
    warm(add, x, 0)
    mul = lambda a, b: a * b
    flag = True
    captures = lambda a, b: a + b if flag else a * b
    calls = {
        "dtype": lambda: fscan.associative_scan(add, x.double(), 0),
        "shape": lambda: fscan.associative_scan(add, torch.randn(8, 9), 0),
        "strides": lambda: fscan.associative_scan(add, x.t(), 0),
        "dim": lambda: fscan.associative_scan(add, x, 1),
        "reverse": lambda: fscan.associative_scan(add, x, 0, reverse=True),
        "grad-mode": lambda: _no_grad(lambda: fscan.associative_scan(add, x, 0)),
        "requires-grad": lambda: fscan.associative_scan(add, x.clone().requires_grad_(), 0),
        "combine-fn": lambda: fscan.associative_scan(mul, x, 0),
        "captured": lambda: fscan.associative_scan(captures, x, 0),
        "validate": lambda: fscan.associative_scan(add, x, 0, validate=False),
    }
    for part, call in calls.items():
        served.clear()
        call()
        assert served == [], part
    served.clear()
    close(fscan.associative_scan(add, x, 0), reference(x, 0, False))
    assert len(served) == 1
    warm(captures, x)
    flag = False  # a captured value changed: the key (the walk's) is another
    served.clear()
    torch.testing.assert_close(fscan.associative_scan(captures, x, 0), x.cumprod(0))
    assert served == []


def _no_grad(call):
    with torch.no_grad():
        return call()


def test_threads_are_read_on_every_call_not_keyed(served):
    """The scan's route does not depend on the thread count: the kernel reads it on each
    call (at most the run's cap), as the full path's kernel call does."""
    x = torch.randn(4, 4096)
    threads = torch.get_num_threads()
    warm(add, x, 1)
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            served.clear()
            close(fscan.associative_scan(add, x, 1), reference(x, 1, False))
            assert len(served) == 1
    finally:
        torch.set_num_threads(threads)


def test_the_fast_path_logs_like_any_route(served, caplog):
    """With DEBUG on, every repeat is served inside the log's wrapper and gives a record
    naming the kernel; with it off, no record, and the same run serves the call."""
    from fscan._route_log import quiet

    x = torch.randn(64)
    warm(add, x)
    caplog.set_level(logging.DEBUG, logger="fscan")
    for _ in range(2):
        served.clear()
        close(fscan.associative_scan(add, x, 0), reference(x, 0, False))
        assert len(served) == 1
    records = [r for r in caplog.records if hasattr(r, "fscan_engine")]
    assert [r.fscan_engine for r in records] == ["cpp", "cpp"]
    assert not quiet()
    caplog.clear()
    caplog.set_level(logging.INFO, logger="fscan")  # logging's memo emptied: quiet() asks
    served.clear()
    close(fscan.associative_scan(add, x, 0), reference(x, 0, False))
    assert len(served) == 1 and not [r for r in caplog.records if hasattr(r, "fscan_engine")]
    assert quiet()


def test_the_fast_path_under_torch_compile_takes_the_traced_path(served):
    x = torch.randn(64)
    warm(add, x)
    served.clear()
    scan = lambda t: fscan.associative_scan(add, t, 0)
    compiled = torch.compile(scan, backend="eager", fullgraph=True)  # no break at quiet()
    close(compiled(x), reference(x, 0, False))
    assert served == []


# ---- the drop-ins' kernel path ------------------------------------------------------

DROP_INS = {  # name: (the float64 reference of one call, positive inputs?)
    "cumsum": (lambda x, dim: torch.cumsum(x, dim), False),
    "cumprod": (lambda x, dim: torch.cumprod(x, dim), True),
    "logcumsumexp": (lambda x, dim: torch.logcumsumexp(x, dim), False),
}


def drop_in_input(name, shape, dtype=torch.float32):
    x = torch.randn(shape, dtype=dtype)
    return x.abs() * 0.5 + 0.75 if DROP_INS[name][1] else x  # products that stay finite


def drop_in_reference(name, x, dim, reverse):
    flip = lambda t: t.flip(dim) if reverse else t
    return flip(DROP_INS[name][0](flip(x.double()), dim))


def drop_in(name, x, dim, reverse=False, **kw):
    return getattr(fscan, name)(x, dim, reverse=reverse, **kw)


@pytest.mark.parametrize("name", sorted(DROP_INS))
@pytest.mark.parametrize(
    ("shape", "dim", "reverse"),
    [((256, 128), 0, False), ((4, 256, 32), -2, True), ((2**15,), 0, True)],
    ids=["lanes", "middle-reversed", "one-lane-reversed"],
)
def test_a_repeated_drop_in_is_served_and_right(served, name, shape, dim, reverse):
    """A drop-in the route table sends to the kernel, called again with the same input
    kind, runs the stored kernel run (before the checks), with the reference's values."""
    x = drop_in_input(name, shape)
    before = x.clone()
    for _ in range(2):
        drop_in(name, x, dim, reverse)
    served.clear()
    out = drop_in(name, x, dim, reverse)
    assert len(served) == 1
    close(out, drop_in_reference(name, x, dim, reverse))
    assert torch.equal(x, before) and out.data_ptr() != x.data_ptr()
    if x.ndim == 1 and served:  # one lane: the kernel's one thread, as on the full path
        assert served[0].threads == 1


# Each changes one thing the drop-in's route depends on: no stored run serves it.
DROP_IN_VARIANTS = {
    "dtype": lambda x: (x.double(), 0, False, {}),
    "shape": lambda x: (torch.randn(256, 136), 0, False, {}),
    "dim": lambda x: (x, 1, False, {}),
    "reverse": lambda x: (x, 0, True, {}),
    "layout": lambda x: (torch.randn(128, 256).t(), 0, False, {}),
    "requires_grad": lambda x: (x.clone().requires_grad_(), 0, False, {}),
    "dtype=": lambda x: (x, 0, False, {"dtype": torch.float32}),
}


@pytest.mark.parametrize("variant", sorted(DROP_IN_VARIANTS))
def test_a_changed_drop_in_is_not_repeated(served, variant):
    x = torch.randn(256, 128)
    for _ in range(2):
        fscan.cumsum(x, 0)
    y, dim, reverse, kw = DROP_IN_VARIANTS[variant](x)
    served.clear()
    out = fscan.cumsum(y, dim, reverse=reverse, **kw)
    assert served == []
    close(out, drop_in_reference("cumsum", y.detach(), dim, reverse))


def test_a_drop_in_repeats_only_its_own_op_mode_and_grad_mode(served):
    x = drop_in_input("cumprod", (256, 128))
    for _ in range(2):
        fscan.cumsum(x, 0)
    served.clear()
    close(fscan.cumprod(x, 0), drop_in_reference("cumprod", x, 0, False))  # another op
    assert served == []
    with fscan.config.override(cpu_kernel="off"):
        close(fscan.cumsum(x, 0), drop_in_reference("cumsum", x, 0, False))
    assert served == []
    with torch.no_grad():  # grad mode is in the key: a run stored with it on misses
        fscan.cumsum(x, 0)
    assert served == []
    out = torch.empty_like(x)
    # out= takes the checked path (torch's out= rules first), then the stored run into out
    assert fscan.cumsum(x, 0, out=out) is out
    assert len(served) == 1
    close(out, drop_in_reference("cumsum", x, 0, False))
    served.clear()
    fscan.cummax(x, 0)  # another op: its own key, stored by its first call
    assert served == []
    fscan.cumsum(x, 0)
    assert len(served) == 1


def test_a_repeated_drop_in_logs_the_kernel(served, caplog):
    x = torch.randn(256, 128)
    for _ in range(2):
        fscan.logcumsumexp(x, 0)
    caplog.set_level(logging.DEBUG, logger="fscan")
    served.clear()
    fscan.logcumsumexp(x, 0)
    assert len(served) == 1
    [record] = [r for r in caplog.records if hasattr(r, "fscan_engine")]
    assert record.fscan_engine == "cpp" and record.fscan_refused == {}


# ---- the exclusive drop-ins' kernel path ----------------------------------------------

IDENTITY = {"cumsum": 0.0, "cumprod": 1.0, "logcumsumexp": -math.inf}
STEP = {"cumsum": torch.add, "cumprod": torch.mul, "logcumsumexp": torch.logaddexp}
EXTREMA = {"cummax": (-math.inf, torch.ge), "cummin": (math.inf, torch.le)}


def exclusive_reference(name, x, dim, reverse):
    """The exclusive drop-in step by step in float64: the carry into each step."""
    xs = x.double().movedim(dim, 0)
    n = xs.shape[0]
    carry = torch.full(xs.shape[1:], IDENTITY[name], dtype=torch.float64)
    out = [None] * n
    for t in range(n - 1, -1, -1) if reverse else range(n):
        out[t] = carry
        carry = STEP[name](carry, xs[t])
    return torch.stack(out).movedim(0, dim)


def extremum_reference(name, x, dim, reverse, exclusive):
    """cummax/cummin step by step in float64: (values, indices), positions in ``x``, the
    later element in scan order winning ties; exclusive: the carry into each step."""
    start, better = EXTREMA[name]
    xs = x.double().movedim(dim, 0)
    n = xs.shape[0]
    best = torch.full(xs.shape[1:], start, dtype=torch.float64)
    at = torch.full(xs.shape[1:], -1, dtype=torch.int64)
    values, indices = [None] * n, [None] * n
    for t in range(n - 1, -1, -1) if reverse else range(n):
        if exclusive:
            values[t], indices[t] = best, at
        take = better(xs[t], best)
        best, at = torch.where(take, xs[t], best), torch.where(take, t, at)
        if not exclusive:
            values[t], indices[t] = best, at
    return torch.stack(values).movedim(0, dim), torch.stack(indices).movedim(0, dim)


def extremum_input(shape):
    """Distinct values: ties cannot hide an index off by one."""
    return torch.randperm(math.prod(shape)).reshape(shape).float()


def assert_extremum(out, want):
    torch.testing.assert_close(out.values, want[0].float(), rtol=0, atol=0)
    assert torch.equal(out.indices, want[1])


def exclusive(name, x, dim, reverse=False, **kw):
    return getattr(fscan, name)(x, dim, reverse=reverse, exclusive=True, **kw)


def served_twice(name, x, dim, reverse=False):
    """Two exclusive calls: the first runs the checked path and stores the kernel's run."""
    for _ in range(2):
        exclusive(name, x, dim, reverse)


@pytest.mark.parametrize("name", sorted(DROP_INS))
@pytest.mark.parametrize(
    ("shape", "dim", "reverse"),
    [
        ((256, 128), 0, False),
        ((256, 128), 0, True),
        ((4, 256, 32), -2, False),
        ((4, 256, 32), 1, True),
        ((2**15,), 0, False),
        ((2**15,), 0, True),
    ],
    ids=["lanes", "lanes-reversed", "middle", "middle-reversed", "one-lane", "one-lane-reversed"],
)
def test_a_repeated_exclusive_drop_in_is_served_and_right(
    served_exclusive, name, shape, dim, reverse
):
    """An exclusive drop-in the route table sends to the kernel, called again with the same
    input kind, runs the stored run before the checks: the reference's values (the
    identity at the first step in scan order), a fresh output, the input untouched."""
    x = drop_in_input(name, shape)
    before = x.clone()
    served_twice(name, x, dim, reverse)
    served_exclusive.clear()
    out = exclusive(name, x, dim, reverse)
    # cumsum/cumprod forward over one lane of 2**15: torch's op (the table's), never stored
    on_kernel = path(getattr(torch, name), x, dim % x.ndim, reverse, exclusive=True) == "cpp"
    assert on_kernel == (x.ndim > 1 or reverse or name == "logcumsumexp")
    assert len(served_exclusive) == on_kernel
    close(out, exclusive_reference(name, x, dim, reverse))
    assert torch.equal(x, before) and out.is_contiguous()
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    if x.ndim == 1 and on_kernel:  # one lane: the kernel's one thread, as on the full path
        assert served_exclusive[0].run.threads == 1


# Each changes one thing the exclusive drop-in's route depends on: no stored run serves it.
EXCLUSIVE_VARIANTS = {
    "dtype": lambda x: (x.double(), 0, False, {}),
    "shape": lambda x: (torch.randn(256, 136), 0, False, {}),
    "steps": lambda x: (torch.randn(257, 128), 0, False, {}),
    "dim": lambda x: (x, 1, False, {}),
    "reverse": lambda x: (x, 0, True, {}),
    "strides": lambda x: (torch.randn(128, 256).t(), 0, False, {}),
    "requires_grad": lambda x: (x.clone().requires_grad_(), 0, False, {}),
    "dtype=": lambda x: (x, 0, False, {"dtype": torch.float32}),
    "out=": lambda x: (x, 0, False, {"out": torch.empty_like(x)}),
    "reset=": lambda x: (x, 0, False, {"reset": torch.arange(256) % 5 == 0}),
}


@pytest.mark.parametrize("variant", sorted(EXCLUSIVE_VARIANTS))
def test_a_changed_exclusive_drop_in_is_not_repeated(served_exclusive, variant):
    x = torch.randn(256, 128)
    served_twice("cumsum", x, 0)
    assert served_exclusive  # the key is stored: only the change misses it
    y, dim, reverse, kw = EXCLUSIVE_VARIANTS[variant](x)
    served_exclusive.clear()
    out = exclusive("cumsum", y, dim, reverse, **kw)
    assert served_exclusive == []
    want = exclusive_reference("cumsum", y.detach(), dim, reverse)
    if "reset" in kw:
        want = _segmented_exclusive_sum(y, kw["reset"])
    close(out.detach(), want)
    if "out" in kw:
        assert out is kw["out"]


def test_a_contiguous_view_fits_an_exclusive_key(served_exclusive):
    """A contiguous view with a storage offset has the layout the key holds: it is served,
    read from its own first element, and the tensor it views is left alone."""
    x = torch.randn(256, 128)
    served_twice("cumsum", x, 0, reverse=True)
    base = torch.randn(257, 128)
    before = base.clone()
    served_exclusive.clear()
    out = exclusive("cumsum", base[1:], 0, reverse=True)
    assert len(served_exclusive) == 1
    close(out, exclusive_reference("cumsum", base[1:], 0, True))
    assert torch.equal(base, before)


def _segmented_exclusive_sum(x, reset):
    """The exclusive sum along dim 0 restarting at 0 where ``reset`` is True."""
    carry = torch.zeros(x.shape[1:], dtype=torch.float64)
    out = []
    for t in range(x.shape[0]):
        if reset[t]:
            carry = torch.zeros_like(carry)
        out.append(carry)
        carry = carry + x[t].double()
    return torch.stack(out)


def test_an_exclusive_drop_in_repeats_only_its_own_op_mode_and_grad_mode(served_exclusive):
    x = drop_in_input("cumprod", (256, 128))
    served_twice("cumsum", x, 0)
    served_exclusive.clear()
    close(exclusive("cumprod", x, 0), exclusive_reference("cumprod", x, 0, False))
    assert served_exclusive == []  # another op
    close(fscan.cumsum(x, 0), drop_in_reference("cumsum", x, 0, False))  # inclusive
    close(fscan.cumsum(x, 0), drop_in_reference("cumsum", x, 0, False))
    assert served_exclusive == []
    with fscan.config.override(cpu_kernel="off"):
        close(exclusive("cumsum", x, 0), exclusive_reference("cumsum", x, 0, False))
    assert served_exclusive == []
    with torch.no_grad():  # grad mode is in the key: a run stored with it on misses
        exclusive("cumsum", x, 0)
    assert served_exclusive == []
    exclusive("cumsum", x, 0)
    assert len(served_exclusive) == 1


def test_an_inclusive_run_never_answers_an_exclusive_call(served, served_exclusive):
    x = torch.randn(256, 128)
    for _ in range(2):
        fscan.cumsum(x, 0)
    served.clear()
    close(exclusive("cumsum", x, 0), exclusive_reference("cumsum", x, 0, False))
    assert served == [] and served_exclusive == []
    served_twice("cumsum", x, 0, reverse=True)
    served_exclusive.clear()
    close(fscan.cumsum(x, 0, reverse=True), drop_in_reference("cumsum", x, 0, True))
    assert served_exclusive == []


def test_exclusive_repeats_take_no_gradient_transform_or_dispatch_mode(served_exclusive):
    """Calls a stored run's key would match but whose full path records, is batched or is
    watched take the full path, with the reference's values (and gradients)."""
    x = torch.randn(256, 128)
    served_twice("cumsum", x, 0)
    served_exclusive.clear()
    leaf = x.clone().requires_grad_()
    out = exclusive("cumsum", leaf, 0)
    (grad,) = torch.autograd.grad(out.sum(), leaf)
    close(grad, torch.arange(255, -1, -1, dtype=torch.float64)[:, None].expand(256, 128))
    batched = torch.func.vmap(lambda row: exclusive("cumsum", row, 0), in_dims=1, out_dims=1)(x)
    close(batched, exclusive_reference("cumsum", x, 0, False))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    with Seen() as seen:
        close(exclusive("cumsum", x, 0), exclusive_reference("cumsum", x, 0, False))
    assert seen.ops > 0
    assert served_exclusive == []


def test_exclusive_repeats_under_torch_compile_take_the_traced_path(served_exclusive):
    x = torch.randn(256, 128)
    served_twice("cumsum", x, 0)
    served_exclusive.clear()
    compiled = torch.compile(lambda t: exclusive("cumsum", t, 0), backend="eager", fullgraph=True)
    close(compiled(x), exclusive_reference("cumsum", x, 0, False))
    assert served_exclusive == []


def test_exclusive_repeats_in_inference_mode_match_the_full_path(served_exclusive):
    """Grad mode is off in inference mode: a run stored under no_grad serves it, with the
    full path's values and inference flag; an inference tensor outside it is read as is."""
    x = torch.randn(256, 128)
    with torch.no_grad():
        served_twice("cumsum", x, 0)
    with torch.inference_mode():
        served_exclusive.clear()
        out = exclusive("cumsum", x, 0)
        assert len(served_exclusive) == 1
        with fscan.config.override(cpu_kernel="off"):
            full = exclusive("cumsum", x, 0)
        frozen = torch.randn(256, 128)
    assert out.is_inference() == full.is_inference()
    close(out, exclusive_reference("cumsum", x, 0, False))
    with torch.no_grad():
        served_exclusive.clear()
        out = exclusive("cumsum", frozen, 0)
    assert len(served_exclusive) == 1 and not out.is_inference()
    close(out, exclusive_reference("cumsum", frozen, 0, False))


def test_exclusive_repeats_are_forgotten_with_the_caches(served_exclusive):
    x = torch.randn(256, 128)
    served_twice("logcumsumexp", x, 0, reverse=True)
    fscan.clear_caches()
    served_exclusive.clear()
    exclusive("logcumsumexp", x, 0, reverse=True)
    assert served_exclusive == []


def test_a_repeated_exclusive_drop_in_logs_the_kernel(served_exclusive, caplog):
    x = torch.randn(256, 128)
    served_twice("cumsum", x, 0)
    caplog.set_level(logging.DEBUG, logger="fscan")
    served_exclusive.clear()
    exclusive("cumsum", x, 0)
    assert len(served_exclusive) == 1
    [record] = [r for r in caplog.records if hasattr(r, "fscan_engine")]
    assert record.fscan_engine == "cpp"


EXTREMUM_CASES = [
    ((256, 128), 0, False),
    ((256, 128), 0, True),
    ((4, 256, 32), 1, False),
    ((4, 256, 32), -2, True),
    ((2**15,), 0, True),
]
EXTREMUM_IDS = ["lanes", "lanes-reversed", "middle", "middle-reversed", "one-lane-reversed"]


@pytest.mark.parametrize("name", sorted(EXTREMA))
@pytest.mark.parametrize("is_exclusive", [False, True], ids=["inclusive", "exclusive"])
@pytest.mark.parametrize(("shape", "dim", "reverse"), EXTREMUM_CASES, ids=EXTREMUM_IDS)
def test_a_repeated_extremum_is_served_and_right(
    served, served_exclusive, name, is_exclusive, shape, dim, reverse
):
    """cummax/cummin on the kernel, called again alike, run the stored run (the kernel
    makes the index leaf): values and indices as the reference's, indices positions in
    the whole input (reversed and exclusive: the run starts its positions at 1)."""
    x = extremum_input(shape)
    before = x.clone()
    call = lambda: getattr(fscan, name)(x, dim, reverse=reverse, exclusive=is_exclusive)
    call(), call()
    served.clear(), served_exclusive.clear()
    out = call()
    assert isinstance(out, getattr(torch.return_types, name))
    assert (len(served), len(served_exclusive)) == ((0, 1) if is_exclusive else (1, 0))
    assert_extremum(out, extremum_reference(name, x, dim, reverse, is_exclusive))
    assert torch.equal(x, before) and out.values.data_ptr() != x.data_ptr()
    assert out.indices.dtype == torch.int64 and out.indices.is_contiguous()


def test_an_extremum_run_serves_only_its_own_op_direction_and_mode(served, served_exclusive):
    x = extremum_input((256, 128))
    for _ in range(2):
        fscan.cummax(x, 0, reverse=True, exclusive=True)
    served_exclusive.clear()
    assert_extremum(
        fscan.cummin(x, 0, reverse=True, exclusive=True),
        extremum_reference("cummin", x, 0, True, True),
    )
    assert_extremum(
        fscan.cummax(x, 0, exclusive=True), extremum_reference("cummax", x, 0, False, True)
    )
    assert_extremum(
        fscan.cummax(x, 0, reverse=True), extremum_reference("cummax", x, 0, True, False)
    )
    assert served_exclusive == [] and served == []
    values, indices = torch.empty_like(x), torch.empty(x.shape, dtype=torch.int64)
    out = fscan.cummax(x, 0, out=(values, indices))
    assert out.values is values and served == []
    assert_extremum(out, extremum_reference("cummax", x, 0, False, False))


def test_clear_caches_empties_the_reach_memos():
    x = torch.randn(64)
    fscan.associative_scan(lambda a, b: a + b, x, dim=0)
    fscan.associative_scan(torch.add, x, dim=0)
    assert repeat_key._closed_reach and repeat_key._builtin_reach
    fscan.clear_caches()
    assert not repeat_key._closed_reach and not repeat_key._builtin_reach


def test_the_key_asks_fscan_context_where_a_call_runs(served):
    """call_parts asks fscan._context's questions inline (a transform, a dual level, a
    dispatch mode): it refuses exactly where they say the call runs elsewhere, and such
    calls take the full path."""
    from fscan._context import under_dispatch_mode, under_transform

    x = torch.randn(64)
    warm(add, x)
    seen: list[tuple[bool, bool]] = []

    def ask(t: torch.Tensor) -> torch.Tensor:
        refused = repeat_key.call_parts(LEAF, [x], 0, False, "pointwise", None, True) is None
        seen.append((refused, under_transform() or under_dispatch_mode()))
        return t

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    ask(x)
    torch.func.vmap(ask)(x[None])
    torch.func.grad(lambda t: ask(t).sum())(x)
    with torch.autograd.forward_ad.dual_level():
        ask(x)
        served.clear()
        close(fscan.associative_scan(add, x, 0), reference(x, 0, False))
        assert served == []
    with Watching():
        ask(x)
        close(fscan.associative_scan(add, x, 0), reference(x, 0, False))
        assert served == []
    assert seen == [(False, False)] + [(True, True)] * 4
