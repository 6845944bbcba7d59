"""The C++ kernel inside ``torch.compile`` on CPU (fscan._engines.cpp.traced_kernel).

Every case compiles with Inductor, the default backend, and compares with the
sequential oracle (float64 where gradients are checked).
"""

from __future__ import annotations

import uuid

import optree
import pytest
import torch
from helpers import add, assert_trees_close, linear_recurrence, maximum, sequential_scan

import fscan
from fscan._engines import traced as _traced
from fscan._engines.cpp import traced_kernel, traced_kernel_grad

F64 = torch.float64

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Inductor's imports


@pytest.fixture(scope="module", autouse=True)
def kernel_on():
    with fscan.config.override(cpu_kernel="eager"):
        yield


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled_scan(op, dim=0, reverse=False, **options):
    fn = lambda xs: fscan.associative_scan(op, xs, dim, reverse)
    return torch.compile(fn, fullgraph=True, **options)


def kernel_calls(fn, *args):
    """``fn(*args)`` and how many times the kernel's ops ran in it (forward and backward)."""
    calls = []
    forward, backward = traced_kernel._scan_on_kernel, traced_kernel_grad._by_kernel

    def spy_forward(*args):
        calls.append("forward")
        return forward(*args)

    def spy_backward(*args):
        calls.append("backward")
        return backward(*args)

    traced_kernel._scan_on_kernel = spy_forward
    traced_kernel_grad._by_kernel = spy_backward
    try:
        return fn(*args), len(calls)
    finally:
        traced_kernel._scan_on_kernel = forward
        traced_kernel_grad._by_kernel = backward


def test_the_route():
    with torch.no_grad():
        assert _traced.traced_route(add, [torch.ones(3)], "pointwise") == "hop"
        with fscan.config.override(cpu_kernel="off"):
            assert _traced.traced_route(add, [torch.ones(3)], "pointwise") == "blocked"
    with torch.enable_grad():  # the kernel's backward: float leaves of one dtype and shape
        assert _traced.traced_route(add, [torch.ones(3)], "pointwise") == "hop"
        mixed = [torch.ones(3), torch.ones(3, dtype=F64)]
        assert _traced.traced_route(add, mixed, "pointwise") == "blocked"
        assert _traced.traced_route(add, [torch.ones(3, dtype=torch.int64)], "pointwise") == (
            "blocked"
        )


@pytest.mark.parametrize(
    ("op", "dim", "reverse"),
    [(add, 0, False), (linear_recurrence, 1, True), (maximum, 2, True)],
)
def test_forward_against_the_oracle(op, dim, reverse):
    shape = (37, 5, 6)  # dims 1 and 2: the op's input is a transposed view
    xs = (
        (torch.rand(shape) + 0.5, torch.randn(shape))
        if op is linear_recurrence
        else torch.randn(shape)
    )
    with torch.no_grad():
        got, calls = kernel_calls(compiled_scan(op, dim, reverse), xs)
    assert calls == 1
    assert_trees_close(got, sequential_scan(op, xs, dim, reverse, "pointwise"))


def test_linear_recurrence_and_reset_scans_with_dynamic_lengths():
    fn = torch.compile(
        lambda a, b, r: (
            fscan.linear_recurrence(a, b, dim=1),
            fscan.associative_scan(add, b, 1, reset=r),
        ),
        fullgraph=True,
        dynamic=True,
    )
    with torch.no_grad():
        for n in (7, 40):
            a, b = torch.rand(3, n, 4), torch.randn(3, n, 4)
            r = torch.rand(3, n, 4) < 0.2
            h, s = fn(a, b, r)
            assert_trees_close(
                h, sequential_scan(linear_recurrence, (a, b), 1, False, "pointwise")[1]
            )
            assert_trees_close(s, fscan.associative_scan(add, b, 1, reset=r))


def gradients(fn, xs, g):
    """The cotangents of the leaves of ``xs`` for ``fn(xs)`` weighted by ``g``."""
    leaves = optree.tree_leaves(xs)
    outs = optree.tree_leaves(fn(xs))
    return torch.autograd.grad(outs, leaves, optree.tree_leaves(g))


@pytest.mark.parametrize("op", [add, linear_recurrence])
@pytest.mark.parametrize(("dim", "reverse"), [(0, False), (1, True), (0, True), (1, False)])
def test_gradients_run_the_kernel_forward_and_backward(op, dim, reverse):
    """With gradients the forward and the backward are the kernel's ops (one call each),
    with the sequential oracle's values and gradients."""
    shape = (23, 4) if dim == 0 else (4, 23)
    a = (torch.rand(shape, dtype=F64) + 0.5).requires_grad_()
    b = torch.randn(shape, dtype=F64, requires_grad=True)
    xs = (a, b) if op is linear_recurrence else b
    g = optree.tree_map(torch.randn_like, xs)
    fn = compiled_scan(op, dim, reverse)
    got, calls = kernel_calls(lambda: (fn(xs), gradients(fn, xs, g)))
    oracle = lambda xs: sequential_scan(op, xs, dim, reverse, "pointwise")
    assert calls == 3  # a forward; for the gradients, a forward and the backward
    assert_trees_close(got, (oracle(xs), gradients(oracle, xs, g)))


def test_inductor_calls_the_ops_kernels_directly():
    """After AOTAutograd, the forward and backward graphs call the Python kernels of the
    twin ops that have no custom_op autograd wrapper (its Python costs ~15 µs a call),
    directly: not through the dispatcher, whose trip to Python costs as much again."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(17, 4, dtype=F64, requires_grad=True)
    fn = compiled_scan(add)
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(lambda: fn(x).sum().backward())
    code = "\n".join(codes)
    assert "fscan_traced_kernel._scan_on_kernel(" in code
    assert "fscan_traced_kernel_grad._cotangents(" in code
    for op in ("kernel_scan_run", "kernel_scan_backward_run", "kernel_scan_hop"):
        assert f"{op}.default(" not in code  # (named in comments, never called)
    assert "kernel_scan_hop_backward.default(" not in code
    assert_trees_close(x.grad, torch.arange(17.0, 0, -1, dtype=F64)[:, None].expand(17, 4))


def test_gradcheck_through_the_compiled_kernel():
    fn = compiled_scan(linear_recurrence, dim=1, reverse=True)
    a = (torch.rand(3, 9, dtype=F64) + 0.5).requires_grad_()
    b = torch.randn(3, 9, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: fn((a, b)), (a, b))


def test_gradients_of_a_closed_over_tensor():
    """A lifted tensor that requires grad gets its gradient from the backward op (the
    backward kernel sums it over the steps)."""
    w = (torch.rand(5, dtype=F64) + 0.5).requires_grad_()
    x = (torch.rand(17, 5, dtype=F64) + 0.5).requires_grad_()
    g = torch.randn(17, 5, dtype=F64)
    scale = lambda left, right: left * right * w  # associative: w once per combine
    fn = torch.compile(lambda x: fscan.associative_scan(scale, x, 0), fullgraph=True)
    got = torch.autograd.grad(fn(x), (x, w), g)
    want = torch.autograd.grad(sequential_scan(scale, x, 0, False, "pointwise"), (x, w), g)
    assert_trees_close(got, want)


def test_an_identical_backward_runs_the_kernel_it_ran_before(monkeypatch):
    """The backward op runs the backward kernel an identical call ran without looking it
    up, reading the lifted tensor anew; its gradient too."""
    w = (torch.rand(5, dtype=F64) + 0.5).requires_grad_()
    x = (torch.rand(17, 5, dtype=F64) + 0.5).requires_grad_()
    g = torch.randn(17, 5, dtype=F64)
    scale = lambda left, right: left * right * w
    fn = torch.compile(lambda x: fscan.associative_scan(scale, x, 0), fullgraph=True)
    torch.autograd.grad(fn(x), (x, w), g)  # looked up, remembered
    looked_up = []
    original = traced_kernel_grad.serving_lookup
    spy = lambda *args, **kwargs: looked_up.append(1) or original(*args, **kwargs)
    monkeypatch.setattr(traced_kernel_grad, "serving_lookup", spy)
    for _ in range(2):
        got = torch.autograd.grad(fn(x), (x, w), g)
        want = torch.autograd.grad(sequential_scan(scale, x, 0, False, "pointwise"), (x, w), g)
        assert_trees_close(got, want)
        with torch.no_grad():
            w.mul_(1.25)
    assert looked_up == []
    fscan.clear_caches()
    torch.autograd.grad(fn(x), (x, w), g)
    assert looked_up == [1]


def test_a_backward_kernel_not_ready_runs_the_adjoint(monkeypatch):
    """Where the backward kernel cannot serve (still building, params that do not fit),
    fscan's adjoint scan answers inside the backward op, which lets autograd back in."""
    from fscan._engines.cpp import traced_kernel_grad

    monkeypatch.setattr(traced_kernel_grad, "_by_kernel", lambda *args: None)
    w = (torch.rand(5, dtype=F64) + 0.5).requires_grad_()
    x = (torch.rand(17, 5, dtype=F64) + 0.5).requires_grad_()
    g = torch.randn(17, 5, dtype=F64)
    scale = lambda left, right: left * right * w
    fn = torch.compile(lambda x: fscan.associative_scan(scale, x, 0, True), fullgraph=True)
    got = torch.autograd.grad(fn(x), (x, w), g)
    want = torch.autograd.grad(sequential_scan(scale, x, 0, True, "pointwise"), (x, w), g)
    assert_trees_close(got, want)


def test_a_closed_over_tensor_is_an_input():
    w = torch.tensor([0.9, 1.1, 1.05], dtype=F64)
    op = lambda x, y: x * y * w  # associative: w once per combine
    x = torch.rand(9, 3, dtype=F64) + 0.5
    fn = compiled_scan(op)
    with torch.no_grad():
        got, calls = kernel_calls(fn, x)
        assert calls == 1
        assert_trees_close(got, sequential_scan(op, x, 0, False, "pointwise"))
        w.mul_(1.5)  # new values of the closed-over tensor, the same graph
        assert_trees_close(fn(x), sequential_scan(op, x, 0, False, "pointwise"))


def lookups(fn, *args):
    """``fn(*args)`` and how many of the kernel op's calls in it looked their kernel up
    (built the combine and walked it) instead of running the one an identical call ran."""
    calls = []
    original = traced_kernel.combine_of

    def spy(*args):
        calls.append(args)
        return original(*args)

    traced_kernel.combine_of = spy
    try:
        return fn(*args), len(calls)
    finally:
        traced_kernel.combine_of = original


def graph_key_of(compile_and_run):
    """The key of the one combine graph the kernel op runs in ``compile_and_run()``."""
    keys, original = set(), traced_kernel._scan_on_kernel

    def spy(key, *args):
        keys.add(key)
        return original(key, *args)

    traced_kernel._scan_on_kernel = spy
    try:
        compile_and_run()
    finally:
        traced_kernel._scan_on_kernel = original
    (key,) = keys
    return key


def test_an_identical_call_runs_the_kernel_it_ran_before():
    """The compiled op runs the kernel an identical call ran (no lookup), reading the
    lifted tensor's values anew on each call."""
    w = torch.tensor([0.9, 1.1, 1.05], dtype=F64)
    op = lambda x, y: x * y * w
    x = torch.rand(9, 3, dtype=F64) + 0.5
    fn = compiled_scan(op)
    with torch.no_grad():
        fn(x)
        for _ in range(2):
            got, looked_up = lookups(fn, x)
            assert looked_up == 0
            assert_trees_close(got, sequential_scan(op, x, 0, False, "pointwise"))
            w.mul_(1.5)
        fscan.clear_caches()
        assert lookups(fn, x)[1] == 1


@pytest.mark.parametrize(
    "change",
    [
        "dtype",
        "element shape",
        "length",
        "tensor dtype",
        "tensor requires grad",
        "aliasing",
        "number",
        "grad mode",
        "kernel off",
        "transposed",
    ],
)
def test_a_call_that_differs_looks_its_kernel_up(change):
    """Each thing the lookup read, changed, sends the call to the lookup again (the op
    called directly, with its graph's key; a compiled graph passes the same arguments).
    Only the length is not part of the key: the kernel takes any."""
    w, v = torch.rand(3, dtype=F64) + 0.5, torch.rand(3, dtype=F64) + 0.5
    op = lambda x, y: x * y * w * v
    x = torch.rand(9, 3, dtype=F64) + 0.5
    with torch.no_grad():
        key = graph_key_of(lambda: compiled_scan(op)(x))
    run = lambda x, tensors, numbers=(): traced_kernel.RUN(key, [x], tensors, list(numbers))
    x, tensors, numbers, grad, mode = x, [w, v], (), False, "eager"
    with torch.no_grad():
        run(x, tensors)
        assert lookups(run, x, tensors)[1] == 0
    if change == "dtype":
        x = x.float()
    elif change == "element shape":
        x, tensors = torch.rand(9, 1, dtype=F64), [w[:1], v[:1]]
    elif change == "length":
        x = torch.rand(20, 3, dtype=F64)
    elif change == "tensor dtype":
        tensors = [w.float(), v]
    elif change == "tensor requires grad":
        tensors, grad = [w.clone().requires_grad_(), v], True
    elif change == "aliasing":
        tensors = [w, w]
    elif change == "number":
        numbers = (3,)
    elif change == "grad mode":
        grad = True
    elif change == "kernel off":
        mode = "off"
    elif change == "transposed":
        x = torch.rand(3, 9, dtype=F64).t()
    with torch.set_grad_enabled(grad), fscan.config.override(cpu_kernel=mode):
        (got,), looked_up = lookups(run, x, tensors, numbers)
    assert looked_up == (0 if change in ("length", "transposed") else 1)
    w_now, v_now = (t.detach() for t in tensors)
    want = sequential_scan(lambda a, b: a * b * w_now * v_now, x, 0, False, "pointwise")
    assert_trees_close(got, want.to(x.dtype))  # a graph's result has its leaves' dtype


@pytest.mark.parametrize("leaves", ["same length", "other length", "transposed"])
def test_a_served_call_of_the_same_length_runs_the_prepared_kernel(monkeypatch, leaves):
    """The kernel's arguments are worked out once for contiguous leaves of the served
    call's length; another length or layout works them out again, with the same values."""
    w = torch.rand(3, dtype=F64) + 0.5
    op = lambda x, y: x * y * w
    with torch.no_grad():
        key = graph_key_of(lambda: compiled_scan(op)(torch.rand(9, 3, dtype=F64)))
        traced_kernel.RUN(key, [torch.rand(9, 3, dtype=F64)], [w], [])  # served, prepared
    x = {
        "same length": torch.rand(9, 3, dtype=F64),
        "other length": torch.rand(20, 3, dtype=F64),
        "transposed": torch.rand(3, 9, dtype=F64).t(),
    }[leaves]
    ran = []
    for name in ("run_prepared", "run_kernel"):
        original = getattr(traced_kernel, name)
        spy = lambda *args, original=original, name=name: ran.append(name) or original(*args)
        monkeypatch.setattr(traced_kernel, name, spy)
    with torch.no_grad():
        (got,) = traced_kernel.RUN(key, [x], [w], [])
    assert ran == ["run_prepared" if leaves == "same length" else "run_kernel"]
    assert got.is_contiguous()
    assert_trees_close(got, sequential_scan(op, x, 0, False, "pointwise"))


def compile_twice(numbers):
    """Compile one scan site once per number, closing over each in turn."""
    make = lambda k: lambda a, b: a + b + k  # associative: adds k once per combine
    x = torch.randn(11, 2)
    with torch.no_grad():
        for k in numbers:
            op = make(k)
            got = torch.compile(lambda x: fscan.associative_scan(op, x, 0), fullgraph=True)(x)
            assert_trees_close(got, sequential_scan(op, x, 0, False, "pointwise"))


def test_a_closed_over_number_is_a_constant_of_the_graph():
    compile_twice((2.5,))


def test_a_closed_over_int_that_changes_is_an_input():
    """The second compile makes it symbolic: the graph passes its value, the kernel's key
    holds it."""
    compile_twice((1, 2, 3))


def test_canary_a_closed_over_float_that_changes_fails_in_dynamo():
    """torch 2.13: a float that changes between compiles of one site becomes symbolic, and
    Dynamo then refuses both traced routes: its check of the scan op's combine graph calls
    it not pointwise (CPU kernel, CUDA/XPU), and ``while_loop`` takes no float input
    (the blocked scan). docs/compile.md says so; when this starts failing, torch fixed it."""
    with pytest.raises(Exception, match="needs to be pointwise"):
        compile_twice((1.0, 2.0))
    with fscan.config.override(cpu_kernel="off"), pytest.raises(Exception, match="SymFloat"):
        torch._dynamo.reset()
        compile_twice((1.0, 2.0))


def test_dynamic_lengths_and_int_leaves():
    op = lambda x, y: (x[0] + y[0], x[1] + y[1])  # (sum, count)
    fn = compiled_scan(op, dynamic=True)
    with torch.no_grad():
        for n in (5, 64, 1000):
            xs = (torch.randn(n, 3), torch.ones(n, 3, dtype=torch.int64))
            assert_trees_close(fn(xs), sequential_scan(op, xs, 0, False, "pointwise"))


def test_without_a_kernel_the_torch_engine_answers(monkeypatch):
    """The graph was compiled for the kernel; at run time it cannot build one."""
    x = torch.randn(17, 3)
    fn = compiled_scan(add)
    with torch.no_grad():
        fn(x)
        with fscan.config.override(cpu_kernel="off"):
            fscan.clear_caches()
            assert_trees_close(fn(x), torch.cumsum(x, 0))


def test_an_unknown_graph_key_says_what_to_do():
    with pytest.raises(RuntimeError, match="clear Inductor's cache"):
        traced_kernel.OP("no such graph", [torch.ones(3)], [], [])


def test_the_scan_op_is_not_cacheable():
    """Inductor's and AOTAutograd's disk caches bypass graphs holding torch's scan op, so
    a compiled graph never outlives this process's registry of combine graphs."""
    from torch._higher_order_ops.associative_scan import associative_scan_op

    assert not associative_scan_op.cacheable()


def test_inductors_disk_cache_keys_graphs_by_the_lowering(monkeypatch):
    """With gradients the graph Inductor compiles holds fscan's ops, which its disk cache
    keeps: a graph lowered by other code (another fscan's LOWERING) is never loaded."""
    from torch._dynamo.utils import counters

    x = torch.randn(9, 3, dtype=F64, requires_grad=True)

    def cache_hits():
        counters.clear()
        torch._dynamo.reset()
        assert_trees_close(compiled_scan(add)(x), x.cumsum(0))
        return counters["inductor"]["fxgraph_cache_hit"]

    with torch._inductor.config.patch(fx_graph_cache=True):
        monkeypatch.setattr(traced_kernel, "LOWERING", uuid.uuid4().hex)
        assert cache_hits() == 0  # compiled, and stored
        assert cache_hits() == 1  # the same lowering: loaded
        monkeypatch.setattr(traced_kernel, "LOWERING", uuid.uuid4().hex)
        assert cache_hits() == 0


def test_the_scan_op_spec_of_a_pytree():
    xs = {"w": torch.rand(10, 2), "c": torch.randn(10, 2)}
    op = lambda x, y: {"w": x["w"] * y["w"], "c": y["w"] * x["c"] + y["c"]}
    with torch.no_grad():
        got = compiled_scan(op)(xs)
    assert optree.tree_structure(got) == optree.tree_structure(xs)
    assert_trees_close(got, sequential_scan(op, xs, 0, False, "pointwise"))
