"""The ``adjoint`` traced route: compile with grad on CUDA/XPU (fscan._engines.traced_adjoint).

On CUDA the forward and the backward are each torch's ``associative_scan`` HOP,
lowered by Inductor to a Triton scan. Here CPU stands in for a codegen device and
torch.compile's ``aot_eager`` backend runs the HOP's eager implementation: the
whole route runs (trace, autograd.Function, vector-Jacobian blocks, the adjoint
HOP), all but Inductor's Triton lowering, which ``tests/test_cuda.py`` checks on a
GPU. The same route with the blocked scan as its primitive also goes through
Inductor on CPU, to check Inductor takes the structure.
"""

from __future__ import annotations

import optree
import pytest
import torch
from helpers import add, assert_trees_close, linear_recurrence, logaddexp, sequential_scan

import fscan
from fscan._combine import flat_combine
from fscan._engines import traced as _traced
from fscan._engines.traced_adjoint import adjoint_traced_scan

F64 = torch.float64


@pytest.fixture(autouse=True)
def cpu_is_a_codegen_device(monkeypatch):
    monkeypatch.setattr(_traced, "CODEGEN_DEVICES", ("cpu",))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def grads_against_the_loop(op, xs, dim, reverse, extra=()):
    """Outputs and gradients of the compiled scan and of autograd through the oracle."""
    leaves = optree.tree_leaves(xs)
    spec = optree.tree_structure(xs)
    inputs = [t for t in (*leaves, *extra) if t.is_floating_point()]
    cotangents = [torch.randn_like(t) if t.is_floating_point() else None for t in leaves]
    results = []
    for fn in (
        compiled(lambda xs: fscan.associative_scan(op, xs, dim, reverse)),
        lambda xs: sequential_scan(op, xs, dim, reverse, "pointwise"),
    ):
        out = optree.tree_leaves(fn(optree.tree_unflatten(spec, leaves)))
        loss = sum((o * c).sum() for o, c in zip(out, cotangents) if o.is_floating_point())
        results.append((out, torch.autograd.grad(loss, inputs)))
    return results


def test_the_route_table():
    leaf = torch.ones(3)
    with torch.enable_grad():
        assert _traced.traced_route(add, [leaf], "pointwise") == "adjoint"
        assert _traced.traced_route(add, [leaf], "generic") == "blocked"
    with torch.no_grad():
        assert _traced.traced_route(add, [leaf], "pointwise") == "hop"


def test_leaves_of_other_shapes_take_the_blocked_scan():
    """A (T, 1) gate broadcast against (T, D) values: no per-position block."""
    a = (torch.rand(9, 1, dtype=F64) + 0.5).requires_grad_()
    b = torch.randn(9, 4, dtype=F64, requires_grad=True)
    with torch.enable_grad():
        assert _traced.traced_route(linear_recurrence, [a, b], "pointwise") == "blocked"
    (got, got_grads), (want, want_grads) = grads_against_the_loop(
        linear_recurrence, (a, b), 0, False
    )
    assert_trees_close(got, want)
    assert_trees_close(got_grads, want_grads)


def test_mixed_float_dtypes():
    a = (torch.rand(7, 3) + 0.5).requires_grad_()
    b = torch.randn(7, 3, dtype=F64, requires_grad=True)
    (got, got_grads), (want, want_grads) = grads_against_the_loop(
        linear_recurrence, (a, b), 0, True
    )
    assert [t.dtype for t in got] == [torch.float32, F64]
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_grads, want_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("dim", "reverse"), [(0, False), (1, True)])
def test_leaves_that_mix(dim, reverse):
    """Where torch's own HOP autograd is wrong (test_compile's canary)."""
    a = (torch.rand(9, 5, dtype=F64) + 0.5).requires_grad_()
    b = torch.randn(9, 5, dtype=F64, requires_grad=True)
    (got, got_grads), (want, want_grads) = grads_against_the_loop(
        linear_recurrence, (a, b), dim, reverse
    )
    assert_trees_close(got, want)
    assert_trees_close(got_grads, want_grads)


def test_a_closed_over_tensor_gets_its_gradient():
    """torch's HOP drops it; the re-evaluated step hands it to autograd."""
    w = torch.tensor([0.9, 1.1, 1.05], dtype=F64, requires_grad=True)
    op = lambda x, y: x * y * w  # associative: w once per combine
    x = (torch.rand(7, 3, dtype=F64) + 0.5).requires_grad_()
    (got, got_grads), (want, want_grads) = grads_against_the_loop(op, x, 0, False, [w])
    assert_trees_close(got, want)
    assert_trees_close(got_grads, want_grads)
    assert got_grads[1].abs().sum() > 0


def test_int_leaves_ride_along():
    op = lambda x, y: (x[0] + y[0], x[1] + y[1])  # (sum, count)
    xs = (torch.randn(8, 2, dtype=F64, requires_grad=True), torch.ones(8, 2, dtype=torch.int64))
    (got, got_grads), (want, want_grads) = grads_against_the_loop(op, xs, 0, True)
    assert_trees_close(got, want)
    assert_trees_close(got_grads, want_grads)


@pytest.mark.parametrize("n", [1, 37])
def test_lengths_and_float32(n):
    a = torch.rand(n, 4, requires_grad=True)
    b = torch.randn(n, 4, requires_grad=True)
    (got, got_grads), (want, want_grads) = grads_against_the_loop(
        linear_recurrence, (a, b), 0, False
    )
    assert_trees_close(got, want)
    assert_trees_close(got_grads, want_grads, rtol=1e-4, atol=1e-5)


def test_an_unused_output_has_no_gradient():
    a = (torch.rand(6, 2, dtype=F64) + 0.5).requires_grad_()
    b = torch.randn(6, 2, dtype=F64, requires_grad=True)
    fn = compiled(lambda a, b: fscan.associative_scan(linear_recurrence, (a, b), 0)[1])
    got = torch.autograd.grad(fn(a, b).sum(), (a, b))
    want = torch.autograd.grad(sequential_scan(linear_recurrence, (a, b), 0)[1].sum(), (a, b))
    assert_trees_close(got, want)


def test_an_infinite_cotangent_stops_at_a_zero_block():
    """A restart (``reset=``) zeroes the block: ``0 * inf`` must not turn into NaN before it,
    as autograd through the sequential loop gives."""
    x = torch.randn(8, 3, dtype=F64, requires_grad=True)
    reset = torch.zeros(8, 3, dtype=torch.bool)
    reset[4] = True
    scan = lambda x: fscan.associative_scan(add, x, 0, reset=reset)
    g = torch.ones(8, 3, dtype=F64)
    g[6] = float("inf")
    got = torch.autograd.grad(compiled(scan)(x), x, g)[0]
    want = torch.autograd.grad(scan(x), x, g)[0]
    assert torch.isnan(got).sum() == torch.isnan(want).sum() == 0
    assert_trees_close(got, want)


def test_logaddexp_gradients_in_gradcheck():
    x = torch.randn(6, 3, dtype=F64, requires_grad=True)
    fn = compiled(lambda x: fscan.associative_scan(logaddexp, x, 0))
    assert torch.autograd.gradcheck(fn, (x,))


def blocked(make, leaves):
    return _traced.traced_blocked_scan(make, leaves)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from Inductor's own imports
def test_the_structure_goes_through_inductor():
    """The route's autograd.Function, VJP blocks and reverse scan compiled by Inductor,
    with the blocked scan as the primitive (Inductor has no CPU lowering for the HOP)."""
    spec_of = _traced.spec_source(optree.tree_structure((0, 0)))  # the spec made in the trace
    make = lambda ops: flat_combine("test", linear_recurrence, spec_of(ops), "pointwise")
    fn = torch.compile(lambda a, b: adjoint_traced_scan(make, [a, b], blocked), fullgraph=True)
    a = (torch.rand(21, 3, dtype=F64) + 0.5).requires_grad_()
    b = torch.randn(21, 3, dtype=F64, requires_grad=True)
    g = torch.randn(21, 3, dtype=F64)
    got = fn(a, b)
    want = sequential_scan(linear_recurrence, (a, b), 0)
    assert_trees_close(got, list(want))
    assert_trees_close(
        torch.autograd.grad((got[1] * g).sum(), (a, b)),
        torch.autograd.grad((want[1] * g).sum(), (a, b)),
    )
