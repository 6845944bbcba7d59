"""fscan under torch.compile on CPU: no graph break, eager results, at most one recompile when
the length changes, correct gradients (fscan._engines.traced), with Inductor and without it."""

from __future__ import annotations

import types

import pytest
import torch
from compile_routes import assert_matches_eager, other_routes
from functorch.experimental import control_flow
from helpers import affine_compose, assert_trees_close, linear_recurrence, sequential_scan
from torch._dynamo.testing import CompileCounterWithBackend

import fscan
from fscan._engines import traced as _traced
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._engines.cpp.traced_kernel import kernel_traceable

# Dynamo and AOT autograd without Inductor's codegen: the same graphs, compiled in
# seconds. The default backend, Inductor, compiles every route at once in a shared
# fixture below (a compile takes about a minute on 2 cores), and the broadest tests
# run Dynamo alone ("eager"), which is what decides about graph breaks and recompiles.
BACKEND = "aot_eager"
F64 = torch.float64


@pytest.fixture
def fresh_dynamo(request):
    shared = "inductor_routes" in request.fixturenames  # keeps the shared compiled code
    if not shared:
        torch._dynamo.reset()
    yield
    if not shared:
        torch._dynamo.reset()


# Every test but those sharing the module's Inductor compile starts from a fresh Dynamo.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def compile_counted(fn, backend=BACKEND, **options):
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True, **options), counter


W = torch.rand(3) + 0.5


def many_scans(a, b, m):
    """Both modes, pytrees, reverse, dims and closures over tensors in one function."""
    s = a.mean()
    _, h = fscan.associative_scan(linear_recurrence, (a, b), 0)
    _, h_rev = fscan.associative_scan(
        lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1] + 0 * s), (a, b), 0, reverse=True
    )
    d = fscan.associative_scan(affine_compose, {"w": a.T, "c": b.T * W[:, None]}, 1)
    p_rev = fscan.associative_scan(
        lambda x, y: x @ y * s / s, m, 0, reverse=True, combine_mode="generic"
    )
    return h, h_rev, d, p_rev


def inputs(n):
    return torch.rand(n, 3), torch.randn(n, 3), torch.randn(n, 2, 2) / 2


def test_fullgraph_matches_eager_at_every_length_with_one_compile():
    compiled, counter = compile_counted(many_scans, backend="eager", dynamic=True)
    # Not 2 first: Dynamo would equate the length with the matrices' size 2 (duck sizing).
    for n in (5, 2, 33, 100):
        args = inputs(n)
        assert_trees_close(compiled(*args), many_scans(*args))
    assert counter.frame_count == 1


def test_a_new_length_recompiles_at_most_once():
    compiled, counter = compile_counted(lambda x: fscan.associative_scan(torch.add, x, 0))
    for n in (8, 9, 17, 100, 1000):
        x = torch.randn(n, 4)
        assert_trees_close(compiled(x), x.cumsum(0))
    assert counter.frame_count <= 2


def test_gradients_through_the_compiled_scan():
    decay = torch.tensor(0.9, dtype=torch.float64, requires_grad=True)

    def decayed(x, y):  # h -> a * decay * h + b, composed
        return x[0] * y[0] * decay, y[0] * decay * x[1] + y[1]

    def fn(a, b):
        return fscan.associative_scan(decayed, (a, b), 0)[1]

    compiled, _ = compile_counted(fn)
    a = torch.rand(9, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(
        sequential_scan(decayed, (a, b), 0, combine_mode="pointwise")[1].sum(), (a, b, decay)
    )
    got = torch.autograd.grad(compiled(a, b).sum(), (a, b, decay))
    assert_trees_close(got, expected)


def test_generic_mode_gradients_through_the_compiled_scan():
    fn = lambda m: fscan.associative_scan(torch.matmul, m, 0, combine_mode="generic")
    compiled, _ = compile_counted(fn)
    m = torch.randn(6, 2, 2, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(sequential_scan(torch.matmul, m, 0).sum(), m)
    assert_trees_close(torch.autograd.grad(compiled(m).sum(), m), expected)


def test_segmented_scan_compiles():
    fn = lambda x, r: fscan.associative_scan(torch.add, x, 0, reset=r)
    compiled, _ = compile_counted(fn)
    x, r = torch.randn(12, 2), torch.rand(12) < 0.3
    assert_trees_close(compiled(x, r), fn(x, r))


DROP_IN = {
    "cumsum": lambda x: fscan.cumsum(x, 0),
    "cumprod": lambda x: fscan.cumprod(x, 1, reverse=True),
    "cummax": lambda x: tuple(fscan.cummax(x, 0)),
    "logcumsumexp": lambda x: fscan.logcumsumexp(x, 0),
}


@pytest.mark.parametrize("name", list(DROP_IN))
def test_drop_in_ops_compile_fullgraph(name):
    compiled, _ = compile_counted(DROP_IN[name], dynamic=True)
    for n in (40, 300):  # through the parallel scan when the scan dimension is strided
        x = torch.rand(n, 70)
        assert_trees_close(compiled(x), DROP_IN[name](x))


def test_drop_in_ops_recompile_at_most_once():
    compiled, counter = compile_counted(lambda x: fscan.cumsum(x, 0), backend="eager")
    for n in (40, 300, 1000, 5000):
        x = torch.rand(n, 70)
        assert_trees_close(compiled(x), torch.cumsum(x, 0))
    assert counter.frame_count <= 2


# --- the route each traced call takes ---------------------------------------------


def fake_leaf(device):
    return types.SimpleNamespace(
        device=torch.device(device), shape=(3,), is_floating_point=lambda: True
    )


@pytest.mark.parametrize(
    ("device", "grad", "mode", "route"),
    [
        ("cuda", False, "pointwise", "hop"),  # Inductor's Triton scan
        ("xpu", False, "pointwise", "hop"),
        ("cuda", True, "pointwise", "adjoint"),  # the HOP without a tape, and its adjoint
        ("xpu", True, "pointwise", "adjoint"),
        ("cuda", False, "generic", "blocked"),
        ("cpu", True, "generic", "blocked"),
    ],
)
def test_compile_routes(device, grad, mode, route):
    with torch.set_grad_enabled(grad):
        assert _traced.traced_route(torch.add, [fake_leaf(device)], mode) == route


@pytest.mark.parametrize("cpu_kernel", ["off", "eager"])
def test_compile_route_on_cpu_follows_the_kernel_mode(cpu_kernel):
    """Inductor has no scan codegen on CPU: the HOP goes to fscan's C++ kernel where one is
    to be had, else the blocked scan runs."""
    kernel = cpu_kernel != "off" and compiler_problem() is None
    with fscan.config.override(cpu_kernel=cpu_kernel), torch.no_grad():
        route = _traced.traced_route(torch.add, [fake_leaf("cpu")], "pointwise")
    assert route == ("hop" if kernel else "blocked")


@pytest.mark.parametrize(
    ("mode", "captures", "route"),
    [
        ("pointwise", False, "hop"),
        ("pointwise", True, "blocked"),
        ("generic", False, "sequential"),
    ],
)
def test_export_routes(monkeypatch, mode, captures, route):
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    combine = (lambda a, b: a + b * W) if captures else torch.add
    assert _traced.traced_route(combine, [fake_leaf("cpu")], mode) == route


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 100])
@pytest.mark.parametrize("scan", ["traced_blocked_scan", "doubling_scan"])
def test_the_traced_algorithms_run_eagerly_too(scan, n):
    # Outside a trace, while_loop starts a Dynamo trace of its own: the spec goes in
    # through spec_source.
    xs = (torch.rand(n, 2), torch.randn(n, 2))
    spec_of = _traced.spec_source(fscan._pytree.flatten(xs)[1])
    make = lambda ops: fscan._combine.flat_combine(
        "test", linear_recurrence, spec_of(ops), "pointwise"
    )
    out = getattr(_traced, scan)(make, list(xs))
    assert_trees_close(tuple(out), sequential_scan(linear_recurrence, xs, 0))


def test_canary_torch_hop_autograd_is_wrong_when_leaves_mix():
    """Why differentiable traced calls never let torch's associative_scan HOP record a
    tape (fscan._engines.traced_adjoint differentiates around it). If this starts failing,
    torch fixed the HOP's autograd for leaves that mix (closures are still dropped)."""
    from torch._higher_order_ops.associative_scan import associative_scan_op

    a = torch.rand(6, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    flat = lambda a1, b1, a2, b2: list(linear_recurrence((a1, b1), (a2, b2)))
    (_, h) = associative_scan_op(flat, [a, b], ())
    expected = sequential_scan(linear_recurrence, (a, b), 0)[1]
    assert_trees_close(h, expected)  # the forward is right
    got = torch.autograd.grad(h.sum(), a)[0]
    want = torch.autograd.grad(expected.sum(), a)[0]
    assert not torch.allclose(got, want)


# --- the other routes, without Inductor's codegen (core_routes: tests/test_compile_inductor.py) ---


@pytest.mark.slow  # a large graph: a minute on 2 busy cores, even without Inductor
def test_the_other_routes_match_eager():
    """The routes test_compile_inductor.py does not compile, without Inductor's codegen:
    Dynamo and AOT autograd with fullgraph=True. core_routes joined them here once; that
    file traces them through the same two (no graph break, values and gradients), and
    tracing them again here cost about 30 s of CPU."""
    compiled = torch.compile(other_routes, backend=BACKEND, dynamic=True, fullgraph=True)
    assert_matches_eager(compiled, other_routes, (12,))


# --- issue 10 case 0: the other crashes under compile ------------------------------------


@pytest.mark.parametrize("dynamic", [False, True])
def test_gradients_without_fullgraph(dynamic):
    """The while_loop backward's .item() needs scalar outputs, which Dynamo allows only with
    fullgraph=True: it crashed, then raised a spurious CombineFnError
    (fscan._engines.traced_workarounds)."""
    counter = CompileCounterWithBackend(BACKEND)
    fn = lambda x: fscan.associative_scan(lambda a, b: a * b, x, 0)
    compiled = torch.compile(fn, backend=counter, dynamic=dynamic)
    x = torch.randn(10, 2, dtype=F64, requires_grad=True)
    (got,) = torch.autograd.grad(compiled(x).sum(), x)
    (expected,) = torch.autograd.grad(sequential_scan(torch.mul, x, 0).sum(), x)
    assert_trees_close(got, expected)
    assert counter.frame_count == 1


def test_a_graph_break_inside_combine_fn_is_torchs_error_not_a_spurious_one():
    def combine(a, b):
        torch._dynamo.graph_break()
        return a + b

    compiled = torch.compile(lambda x: fscan.associative_scan(combine, x, 0), backend=BACKEND)
    with pytest.raises(torch._dynamo.exc.UncapturedHigherOrderOpError, match="graph_break"):
        compiled(torch.randn(10, 2))


def nested(a, b):
    """A generic combine_fn that itself scans: composes cumulative sums of its elements."""
    return fscan.associative_scan(torch.add, a, 0) * 0 + a + b


@pytest.mark.parametrize("grad", [False, True])
def test_a_nested_scan_compiles(grad):
    """It failed on every backend: the inner scan's while_loop cannot run under the outer
    scan's vmap ("Cannot access storage of BatchedTensorImpl"); it unrolls there now."""
    fn = lambda x: fscan.associative_scan(nested, x, 0, combine_mode="generic")
    compiled, _ = compile_counted(fn)
    x = torch.randn(9, 3, dtype=F64, requires_grad=grad)
    assert_trees_close(compiled(x), x.cumsum(0))
    if grad:
        (got,) = torch.autograd.grad(compiled(x).sum(), x)
        assert_trees_close(got, torch.arange(9, 0, -1, dtype=F64)[:, None].expand(9, 3))


def test_vmap_of_a_compiled_scan():
    scan = lambda x: fscan.associative_scan(torch.add, x, 0)
    fn = torch.compile(torch.func.vmap(scan), backend=BACKEND, fullgraph=True)
    x = torch.randn(4, 7, 2)
    assert_trees_close(fn(x), x.cumsum(1))


W1 = torch.tensor(1.0, dtype=F64)


def by_sign(a, b):  # data-dependent: generic mode
    return torch.cond(a.sum() > 0, lambda a, b: a + b, lambda a, b: b + a, (a, b))


def by_flag(a, b):
    return torch.cond(W1 > 0, lambda a, b: a + b, lambda a, b: b - a, (a, b))


def mapped(a, b):
    return control_flow.map(lambda ab: ab[0] + ab[1], (a, b))


@pytest.mark.parametrize(
    ("combine", "mode"),
    [(by_sign, "generic"), (by_flag, "generic"), (by_flag, "pointwise"), (mapped, "pointwise")],
)
def test_higher_order_ops_in_combine_fn_compile(combine, mode):
    """torch.cond and control_flow.map in combine_fn: Dynamo refused them, since the
    blocked scan handed combine_fn views of one tensor (aliased HOP inputs)."""
    fn = lambda x: fscan.associative_scan(combine, x, 0, combine_mode=mode)
    compiled, _ = compile_counted(fn)
    x = torch.randn(10, 3, dtype=F64, requires_grad=True)
    if mode == "pointwise" and kernel_traceable():
        # On CPU with a compiler the scan op runs (the kernel, with or without gradients),
        # and Dynamo refuses HOPs in its pointwise combine: combine_mode="generic" runs them.
        with pytest.raises(Exception, match="combine_fn needs to be pointwise"):
            compiled(x)
        return
    out = compiled(x)
    assert_trees_close(out, x.cumsum(0))
    (got,) = torch.autograd.grad(out.sum(), x)
    assert_trees_close(got, torch.arange(10, 0, -1, dtype=F64)[:, None].expand(10, 3))
