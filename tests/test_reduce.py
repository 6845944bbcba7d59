"""fscan.associative_reduce against the sequential oracle's total (fscan._reduce)."""

from __future__ import annotations

import re

import optree
import pytest
import torch
from helpers import (
    affine_compose,
    assert_trees_close,
    linear_recurrence,
    matmul,
    parametrize,
    sequential_scan,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan

F64 = dict(dtype=torch.float64)


def rand(*shape):
    return torch.randn(*shape, **F64)


def oracle_total(fn, xs, dim, reverse=False, initial=None):
    """The sequential scan's last output (first for reverse), ``initial`` combined in front."""
    out = sequential_scan(fn, xs, dim, reverse, "generic")
    total = optree.tree_map(lambda o: o.select(dim, 0 if reverse else -1), out)
    if initial is None:
        return total
    return fn(initial, total)


CASES = {
    "add": (torch.add, lambda n: rand(n, 3)),
    "logaddexp": (torch.logaddexp, lambda n: rand(n, 2, 3)),
    "affine": (linear_recurrence, lambda n: (torch.rand(n, 3, **F64) + 0.5, rand(n, 3))),
    "dict": (affine_compose, lambda n: {"w": torch.rand(n, 2, **F64) + 0.5, "c": rand(n, 2)}),
}


@parametrize(case=list(CASES), mode=["pointwise", "generic"], reverse=[False, True])
def test_matches_the_oracle(case, mode, reverse):
    fn, make = CASES[case]
    for n in (1, 2, 3, 7, 16, 37):
        xs = make(n)
        out = fscan.associative_reduce(fn, xs, 0, combine_mode=mode, reverse=reverse)
        assert_trees_close(out, oracle_total(fn, xs, 0, reverse))


@parametrize(reverse=[False, True], length=[1, 2, 5, 6, 13, 64])
def test_matrix_products_keep_their_order(reverse, length):
    m = rand(2, length, 3, 3) / 2
    out = fscan.associative_reduce(matmul, m, 1, combine_mode="generic", reverse=reverse)
    assert_trees_close(out, oracle_total(matmul, m, 1, reverse))


@parametrize(mode=["pointwise", "generic"], reverse=[False, True])
def test_initial(mode, reverse):
    xs = (torch.rand(9, 3, **F64) + 0.5, rand(9, 3))
    init = (torch.rand(3, **F64) + 0.5, rand(3))
    out = fscan.associative_reduce(
        linear_recurrence, xs, 0, combine_mode=mode, initial=init, reverse=reverse
    )
    scanned = fscan.associative_scan(linear_recurrence, xs, 0, reverse, mode, initial=init)
    expected = tuple(s[0 if reverse else -1] for s in scanned)
    assert_trees_close(out, expected)


def test_empty_returns_initial_or_raises():
    out = fscan.associative_reduce(torch.add, torch.zeros(0, 3), 0, initial=0.0)
    torch.testing.assert_close(out, torch.zeros(3))
    with pytest.raises(fscan.ScanValueError, match="has length 0 along dim 0"):
        fscan.associative_reduce(torch.add, torch.zeros(0, 3), 0)


# Counts the torch engine's combine_fn calls (the C++ kernel calls it once, to trace).
@pytest.mark.torch_engine
def test_half_the_scans_work():
    """n - 1 elements combined, against about 2 n for the scan."""
    seen = []

    def counting_add(a, b):
        seen.append(a.shape[0])
        return a + b

    n = 1000
    fscan.associative_reduce(counting_add, torch.ones(n, 4), 0)  # first call: probed too
    seen.clear()
    fscan.associative_reduce(counting_add, torch.ones(n, 4), 0)
    assert sum(seen) == n - 1
    seen.clear()
    fscan.associative_scan(counting_add, torch.ones(n, 4), 0)
    assert sum(seen) >= 1.9 * n


def test_output_is_new_memory_and_inputs_untouched():
    x = rand(1, 3)
    out = fscan.associative_reduce(torch.add, x, 0)
    assert out.data_ptr() != x.data_ptr()
    y = rand(5, 3)
    y0 = y.clone()
    last = fscan.associative_reduce(lambda a, b: b, y, 0)
    torch.testing.assert_close(last, y[-1])
    assert last.data_ptr() != y[-1].data_ptr() and torch.equal(y, y0)


# ---- gradients and transforms ------------------------------------------------------


@parametrize(mode=["pointwise", "generic"], reverse=[False, True])
def test_gradcheck(mode, reverse):
    a = (torch.rand(11, 2, **F64) + 0.5).requires_grad_()
    b = rand(11, 2).requires_grad_()
    ib = rand(2).requires_grad_()

    def run(a, b, ib):
        return fscan.associative_reduce(
            linear_recurrence, (a, b), 0, combine_mode=mode, reverse=reverse, initial=(1.0, ib)
        )

    assert torch.autograd.gradcheck(run, (a, b, ib))


def test_gradcheck_matrix_products():
    m = (rand(6, 2, 2) / 2).requires_grad_()
    run = lambda m: fscan.associative_reduce(matmul, m, 0, combine_mode="generic")
    assert torch.autograd.gradcheck(run, (m,))


@parametrize(mode=["pointwise", "generic"])
def test_vmap_and_grad(mode):
    x = rand(4, 9, 3)
    out = torch.func.vmap(lambda x: fscan.associative_reduce(torch.add, x, 0, combine_mode=mode))(x)
    torch.testing.assert_close(out, x.sum(1))
    g = torch.func.grad(lambda x: fscan.associative_reduce(torch.logaddexp, x, 0).sum())(x[0])
    torch.testing.assert_close(g, torch.softmax(x[0], 0))


@pytest.fixture(scope="module")
def compiled_reduce():
    torch._dynamo.reset()

    def fn(a, b):
        return fscan.associative_reduce(linear_recurrence, (a, b), 1, reverse=True)[1]

    yield fn, torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()


def test_compile_fullgraph_with_gradients(compiled_reduce):
    fn, compiled = compiled_reduce
    for n in (5, 12):
        args = [(torch.rand(2, n, 3) + 0.5).requires_grad_(), torch.randn(2, n, 3).requires_grad_()]
        torch.testing.assert_close(compiled(*args), fn(*args))
        got = torch.autograd.grad(compiled(*args).sum(), args)
        for g, e in zip(got, torch.autograd.grad(fn(*args).sum(), args)):
            torch.testing.assert_close(g, e)


# ---- the use case: a CRF/HMM partition function in the log semiring ------------------


def log_matmul(x, y):
    """The log-semiring matrix product: ``logsumexp_j x[i, j] + y[j, k]``."""
    return torch.logsumexp(x.unsqueeze(-1) + y.unsqueeze(-3), dim=-2)


def crf_log_partition(emissions, transitions, start, end):
    """log Z of a linear-chain CRF for a batch, (B, T, K) emissions, with one reduce."""
    steps = transitions + emissions[:, 1:, None, :]  # (B, T-1, K, K): i -> j, then emit j
    alpha0 = start + emissions[:, 0]  # (B, K)
    total = fscan.associative_reduce(log_matmul, steps, 1, combine_mode="generic")
    return torch.logsumexp(alpha0[:, :, None] + total + end[None, None, :], dim=(1, 2))


def forward_algorithm(emissions, transitions, start, end):
    """The sequential oracle: the forward algorithm, one step at a time."""
    alpha = start + emissions[:, 0]
    for t in range(1, emissions.shape[1]):
        alpha = torch.logsumexp(alpha[:, :, None] + transitions, dim=1) + emissions[:, t]
    return torch.logsumexp(alpha + end, dim=1)


def test_crf_partition_function_matches_the_forward_algorithm():
    B, T, K = 3, 25, 4
    emissions = rand(B, T, K).requires_grad_()
    transitions = rand(K, K).requires_grad_()
    start, end = rand(K), rand(K)
    got = crf_log_partition(emissions, transitions, start, end)
    expected = forward_algorithm(emissions, transitions, start, end)
    torch.testing.assert_close(got, expected)
    g = torch.autograd.grad(got.sum(), (emissions, transitions))
    e = torch.autograd.grad(expected.sum(), (emissions, transitions))
    for x, y in zip(g, e):
        torch.testing.assert_close(x, y)
    small = (emissions[:1, :6].detach().requires_grad_(), transitions, start, end)
    assert torch.autograd.gradcheck(crf_log_partition, small)


# ---- errors ---------------------------------------------------------------------------


def test_errors_name_this_function():
    with pytest.raises(fscan.ScanTypeError, match=re.escape("fscan.associative_reduce: `reverse`")):
        fscan.associative_reduce(torch.add, torch.ones(3), 0, reverse=1)
    with pytest.raises(TypeError, match="positional"):
        fscan.associative_reduce(torch.add, torch.ones(3), 0, "pointwise")
    with pytest.raises(fscan.ScanValueError, match=re.escape("leaf initial has shape (2,)")):
        fscan.associative_reduce(torch.add, torch.ones(3, 3), 0, initial=torch.ones(2))
    with pytest.raises(fscan.CombineFnError, match="not elementwise"):
        fscan.associative_reduce(torch.matmul, torch.ones(4, 2, 2), 0)


def test_compile_generic_mode_fullgraph():
    torch._dynamo.reset()
    fn = lambda m: fscan.associative_reduce(matmul, m, 0, combine_mode="generic")
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    m = torch.randn(9, 3, 3) / 2
    torch.testing.assert_close(compiled(m), fn(m))
    torch._dynamo.reset()


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(1, 90),
    reverse=st.booleans(),
    mode=st.sampled_from(["pointwise", "generic"]),
    with_initial=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_matches_the_scans_end(length, reverse, mode, with_initial, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = {"w": torch.rand(length, 3, generator=gen, **F64) + 0.5}
    xs["c"] = torch.randn(length, 3, generator=gen, **F64)
    init = {
        "w": torch.rand(3, generator=gen, **F64) + 0.5,
        "c": torch.randn(3, generator=gen, **F64),
    }
    init = init if with_initial else None
    out = fscan.associative_reduce(
        affine_compose, xs, 0, combine_mode=mode, reverse=reverse, initial=init
    )
    assert_trees_close(out, oracle_total(affine_compose, xs, 0, reverse, init))


def test_an_impure_combine_is_caught():
    x = torch.ones(6)
    with pytest.raises(fscan.ImpureCombineError):
        fscan.associative_reduce(lambda a, b: a.add_(b), x, 0)
    assert torch.equal(x, torch.ones(6))


# ---- compile and export: one graph for every length -----------------------------------

LENGTHS = (5, 2, 13, 33)  # not 3 first: Dynamo would equate the length with the element size


def _special(n):
    """Values with inf, -inf and NaN at the ends and across the middle."""
    x = rand(n, 3)
    x[0, 0], x[-1, 1], x[n // 2, 2] = float("inf"), float("-inf"), float("nan")
    return x


def _maximum(a, b):
    return torch.maximum(a, b)


TRACED = {
    "logaddexp": (torch.logaddexp, _special),
    "maximum": (_maximum, _special),
    "affine": (linear_recurrence, lambda n: (torch.rand(n, 3, **F64) + 0.5, rand(n, 3))),
}


@parametrize(case=list(TRACED), mode=["pointwise", "generic"], reverse=[False, True])
def test_compile_dynamic_reduces_every_length_with_one_graph(case, mode, reverse):
    from torch._dynamo.testing import CompileCounterWithBackend

    fn, make = TRACED[case]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    reduce = lambda xs: fscan.associative_reduce(fn, xs, 0, combine_mode=mode, reverse=reverse)
    compiled = torch.compile(reduce, backend=counter, fullgraph=True, dynamic=True)
    for n in LENGTHS:
        xs = make(n)
        assert_trees_close(compiled(xs), oracle_total(fn, xs, 0, reverse))
    assert counter.frame_count == 1
    torch._dynamo.reset()


@parametrize(reverse=[False, True])
def test_compile_dynamic_gradients_at_every_length(reverse):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def fn(a, b, h0):
        total = fscan.associative_reduce(
            linear_recurrence, (a, b), 1, reverse=reverse, initial=(torch.ones_like(h0), h0)
        )
        return total[1]

    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
    for n in LENGTHS:
        args = [torch.rand(2, n, 3, **F64) + 0.5, rand(2, n, 3), rand(2, 3)]
        args = [t.requires_grad_() for t in args]
        got = compiled(*args)
        want = oracle_total(linear_recurrence, tuple(args[:2]), 1, reverse)
        want = linear_recurrence((torch.ones_like(args[2]), args[2]), want)[1]
        torch.testing.assert_close(got, want)
        cot = rand(2, 3)
        for g, w in zip(torch.autograd.grad(got, args, cot), torch.autograd.grad(want, args, cot)):
            torch.testing.assert_close(g, w)
    assert counter.frame_count == 1
    torch._dynamo.reset()


class _Reduce(torch.nn.Module):
    def __init__(self, fn, mode, reverse):
        super().__init__()
        self.fn, self.mode, self.reverse = fn, mode, reverse

    def forward(self, xs):
        return fscan.associative_reduce(
            self.fn, xs, 0, combine_mode=self.mode, reverse=self.reverse
        )


# torch's scan HOP (generic mode's export) imports jit, which warns that it is deprecated.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@parametrize(case=["maximum", "affine"], mode=["pointwise", "generic"], reverse=[False, True])
def test_export_with_a_dynamic_length(case, mode, reverse):
    fn, make = TRACED[case]
    seq = torch.export.Dim("seq", min=2)
    example = make(5)
    dims = {"xs": optree.tree_map(lambda _: {0: seq}, example)}
    ep = torch.export.export(_Reduce(fn, mode, reverse), (example,), dynamic_shapes=dims)
    for n in (2, 3, 4, 7, 64):
        xs = make(n)
        assert_trees_close(ep.module()(xs), oracle_total(fn, xs, 0, reverse))
