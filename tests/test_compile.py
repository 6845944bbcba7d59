"""fscan under torch.compile(fullgraph=True) on CPU: no graph break, eager results, at most one
recompile when the length changes, correct gradients (fscan._traced)."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import affine_compose, assert_trees_close, linear_recurrence, sequential_scan
from torch._dynamo.testing import CompileCounterWithBackend

import fscan
from fscan import _traced

# Dynamo and AOT autograd without Inductor's codegen: the same graphs, compiled in
# seconds. One test below runs the default backend, Inductor, and the broadest one
# Dynamo alone ("eager"), which is what decides about graph breaks and recompiles.
BACKEND = "aot_eager"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


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


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from Inductor's own imports
def test_the_default_backend_inductor():
    def fn(a, b):
        _, h = fscan.associative_scan(
            lambda x, y: (x[0] * y[0], y[0] * x[1] * W / W + y[1]), (a, b), 1, reverse=True
        )
        return h

    compiled, counter = compile_counted(fn, backend="inductor", dynamic=True)
    for n in (6, 50, 51):
        a, b = torch.rand(2, n, 3), torch.randn(2, n, 3)
        assert_trees_close(compiled(a, b), fn(a, b))
    assert counter.frame_count == 1


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
    return types.SimpleNamespace(device=torch.device(device))


@pytest.mark.parametrize(
    ("device", "grad", "mode", "route"),
    [
        ("cuda", False, "pointwise", "hop"),  # Inductor's Triton scan
        ("xpu", False, "pointwise", "hop"),
        ("cuda", True, "pointwise", "blocked"),  # the HOP's autograd is wrong
        ("cuda", False, "generic", "blocked"),
        ("cpu", False, "pointwise", "blocked"),  # no scan codegen on CPU
        ("cpu", True, "generic", "blocked"),
    ],
)
def test_compile_routes(device, grad, mode, route):
    with torch.set_grad_enabled(grad):
        assert _traced.traced_route(torch.add, [fake_leaf(device)], mode) == route


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
@pytest.mark.parametrize("scan", ["blocked_scan", "doubling_scan"])
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
    """Why differentiable traced calls avoid torch's associative_scan HOP. If this
    starts failing, torch fixed the HOP's autograd, and fscan._traced.traced_route
    could send differentiable CUDA calls to the Triton kernel too."""
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


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from Inductor's own imports
def test_inductor_gradients_at_the_last_step_of_each_block():
    """Issue 10 case 0: a while_loop backward reused a donated buffer (fscan._inductor_fix)."""
    compiled = torch.compile(lambda x: fscan.associative_scan(torch.add, x, 0), fullgraph=True)
    x = torch.randn(16, 4, dtype=torch.float64, requires_grad=True)
    (got,) = torch.autograd.grad(compiled(x).sum(), x)
    expected = torch.arange(16, 0, -1, dtype=torch.float64)[:, None].expand(16, 4)
    assert_trees_close(got, expected)  # row 7 was 11, row 15 was 3
