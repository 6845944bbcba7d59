"""The backward kernel without the cotangents autograd leaves out (None), and the linear
recurrence's one-pass backward on it (fscan/_engines/cpp/_kernel_grad.py)."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from helpers import sequential_scan

import fscan
import fscan._recurrences.solve as recurrence_solve
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._engines.cpp.cpu_kernel import kernel_entries, kernel_vjp, lookup_kernels
from fscan._routing.recurrence import PAIR_SPEC, compose

needs_compiler = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)


def affine(x, y):  # h -> a h + b, composed left to right: (A, h)
    return (x[0] * y[0], y[0] * x[1] + y[1])


def affine_left(x, y):  # the other order: y's map first; its b output reads x's a
    return (x[0] * y[0], x[0] * y[1] + x[1])


def triple(x, y):  # three leaves that never meet
    return (x[0] + y[0], torch.maximum(x[1], y[1]), x[2] * y[2])


def _inputs(fn, shape, dtype, gen):
    n = 3 if fn is triple else 2
    gates = [0] if fn is not triple else [2]
    return [
        (torch.rand(shape, generator=gen, dtype=dtype) * 0.5 + 0.5)
        if k in gates
        else torch.randn(shape, generator=gen, dtype=dtype)
        for k in range(n)
    ]


def _backward_entries(fn, leaves):
    holder, _, _ = lookup_kernels(fn, optree.tree_structure(tuple(leaves)), leaves, None, None)
    return [e for e in kernel_entries(holder) if e.backward and e.state.value == "ready"]


def _grads(fn, xs, dim, reverse, used, cots):
    outs = fscan.associative_scan(fn, tuple(xs), dim, reverse)
    assert type(outs[0].grad_fn).__name__ == "KernelScanBackward"
    return torch.autograd.grad([outs[k] for k in used], xs, [cots[k] for k in used])


def _oracle(fn, xs, dim, reverse, used, cots):
    """The float64 sequential loop's gradients (autograd through it)."""
    wide = [x.detach().double().requires_grad_() for x in xs]
    outs = sequential_scan(fn, tuple(wide), dim, reverse, combine_mode="pointwise")
    found = torch.autograd.grad(
        [outs[k] for k in used], wide, [cots[k].double() for k in used], allow_unused=True
    )
    return [torch.zeros_like(w) if g is None else g for g, w in zip(found, wide)]


# The oracle's gradients of test_missing_cotangents_match_the_oracle, per case: its inputs
# come from a generator seeded by the shape and dim, so the runs on 1 and 2 threads compare
# with the same loop, run once (on (4200, 16) the loop takes seconds); the inputs are kept
# and compared, so a cached verdict only serves the inputs it was computed for.
_ORACLE_GRADS: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

CASES = [
    (affine, (1,), (0,)),  # a linear RNN: only h is used; the gate products' cotangent dies
    (affine, (0,), (1,)),
    (affine, (0, 1), ()),
    (affine_left, (1,), ()),  # A has none, but b's output reads a: carried, read as zeros
    (triple, (0,), (1, 2)),
    (triple, (1, 2), (0,)),
]


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize(
    ("shape", "dim"),
    [((37, 5, 16), 0), ((5, 37, 16), 1), ((5, 16, 37), 2), ((5000,), 0), ((4200, 16), 0)],
    ids=["dim0", "middle", "last", "chain", "split-lanes"],
)
@pytest.mark.parametrize(
    ("fn", "used", "dead"), CASES, ids=[f"{f.__name__}-{u}" for f, u, _ in CASES]
)
def test_missing_cotangents_match_the_oracle(fn, used, dead, shape, dim, reverse, threads):
    # float32 against a float64 sequential oracle; (5000,) splits its chain into chunks
    # (transfer maps with the dead column skipped), (4200, 16) on 2 threads splits its
    # one column of lanes.
    gen = torch.Generator().manual_seed(len(shape) * 7 + dim)
    xs = [x.requires_grad_() for x in _inputs(fn, shape, torch.float32, gen)]
    cots = [torch.randn(shape, generator=gen) for _ in xs]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _grads(fn, xs, dim, reverse, used, cots)
    finally:
        torch.set_num_threads(before)
    key = (fn.__name__, used, shape, dim, reverse)
    if key not in _ORACLE_GRADS:
        data = [x.detach().clone() for x in (*xs, *cots)]
        _ORACLE_GRADS[key] = data, _oracle(fn, xs, dim, reverse, used, cots)
    data, want = _ORACLE_GRADS[key]
    assert all(torch.equal(d, x) for d, x in zip(data, (*xs, *cots)))  # the same inputs
    scale = max(1.0, *(float(w.abs().max()) for w in want))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5 * scale)
    deads = {e.dead for e in _backward_entries(fn, xs)}
    assert tuple(dead) in deads


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize(
    ("fn", "used"), [(f, u) for f, u, _ in CASES], ids=[f"{f.__name__}-{u}" for f, u, _ in CASES]
)
def test_missing_cotangents_gradcheck(fn, used, reverse):
    gen = torch.Generator().manual_seed(11)
    xs = [x.requires_grad_() for x in _inputs(fn, (9, 3, 8), torch.float64, gen)]
    f = lambda *leaves: [fscan.associative_scan(fn, leaves, 1, reverse)[k] for k in used]
    f(*xs)  # the pointwise check runs on the first call
    assert type(f(*xs)[0].grad_fn).__name__ == "KernelScanBackward"
    assert torch.autograd.gradcheck(f, tuple(xs))


@needs_compiler
def test_dead_cotangent_meets_no_inf():
    # The gate products overflow to inf (from step 31) where h and its cotangent stay
    # finite: with A's cotangent absent nothing multiplies them, as autograd through the
    # loop never reaches them (a zero cotangent read for A would make 0 * inf = NaN in da).
    a = torch.full((40, 8), 1e10, dtype=torch.float64, requires_grad=True)
    b = torch.randn(40, 8, dtype=torch.float64).mul(1e-300).requires_grad_()
    cot = torch.zeros(40, 8, dtype=torch.float64)
    cot[:3] = 1.0
    with torch.no_grad():
        assert torch.isinf(fscan.associative_scan(affine, (a, b), 0)[0]).any()
    got = _grads(affine, [a, b], 0, False, (1,), [cot, cot])
    want = _oracle(affine, [a, b], 0, False, (1,), [cot, cot])
    for g, w in zip(got, want):
        assert w.isfinite().all()
        torch.testing.assert_close(g, w)


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("initial", [False, True], ids=["none", "initial"])
@pytest.mark.parametrize(
    ("shape", "dim", "gate"),
    [
        ((40, 9), 0, "full"),
        ((2, 40, 9), 1, "full"),  # 2 rows (was 5): one thread either way, 6x less gradcheck
        ((6, 40), 1, "full"),
        ((3000,), 0, "full"),
        ((40, 9), 0, "per-step"),
        ((40, 9), 0, "per-channel"),
    ],
    ids=["dim0", "middle", "last", "chain", "per-step", "per-channel"],
)
def test_linear_recurrence_backward_against_the_oracle(
    shape, dim, gate, initial, reverse, monkeypatch
):
    served = []
    fused = recurrence_solve.kernel_adjoint
    monkeypatch.setattr(
        recurrence_solve,
        "kernel_adjoint",
        lambda *args: served.append(fused(*args)) or served[-1],
    )
    gen = torch.Generator().manual_seed(2)
    ashape = list(shape)
    if gate == "per-step":
        ashape = [s if i == dim else 1 for i, s in enumerate(shape)]
    elif gate == "per-channel":
        ashape[dim] = 1
    a = (torch.rand(ashape, generator=gen, dtype=torch.float64) * 0.5 + 0.5).requires_grad_()
    b = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    rest = [s for i, s in enumerate(shape) if i != dim]
    h0 = torch.randn(rest, generator=gen, dtype=torch.float64, requires_grad=True)
    inputs = (a, b, h0) if initial else (a, b)

    def f(a, b, h0=None):
        return fscan.linear_recurrence(a, b, dim, initial=h0, reverse=reverse)

    # The chain's full Jacobian is 6000 forward and 3000 backward calls, about 10 s a case
    # on 2 cores; fast mode checks a random projection of it, on the same inputs and path.
    assert torch.autograd.gradcheck(f, inputs, fast_mode=b.numel() >= 3000)
    # The one pass serves the lane path (8 elements or more after dim); chains walk.
    lanes = math.prod(shape[dim + 1 :])
    assert served and all((found is not None) == (lanes >= 8) for found in served)


@needs_compiler
def test_linear_recurrence_float32_backward_against_the_oracle():
    gen = torch.Generator().manual_seed(4)
    a = (torch.rand(3000, 40, generator=gen) * 0.5 + 0.5).requires_grad_()
    b = torch.randn(3000, 40, generator=gen, requires_grad=True)
    cot = torch.randn(3000, 40, generator=gen)
    got = torch.autograd.grad(fscan.linear_recurrence(a, b, 0), (a, b), cot)
    wide = [a.detach().double().requires_grad_(), b.detach().double().requires_grad_()]
    out = sequential_scan(affine, tuple(wide), 0, combine_mode="pointwise")[1]
    want = torch.autograd.grad(out, wide, cot.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-4)


@needs_compiler
def test_kernel_vjp_refuses_where_it_would_read_a_missing_operand():
    a = torch.rand(50, 8, dtype=torch.float64) + 0.5
    b = torch.randn(50, 8, dtype=torch.float64)
    with torch.no_grad():
        A, h = fscan.associative_scan(compose, (a, b), 0)
    g = torch.randn(50, 8, dtype=torch.float64)
    # With A's cotangent given, the VJP reads the gate products (left operand 0).
    assert kernel_vjp(compose, PAIR_SPEC, [a, None], [None, h], [g, g], 0, False) is None
    found = kernel_vjp(compose, PAIR_SPEC, [a, None], [None, h], [None, g], 0, False)
    want = kernel_vjp(compose, PAIR_SPEC, [a, b], [A, h], [None, g], 0, False)
    assert found is not None and want is not None
    for x, y in zip(found, want):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_large_gradients_and_strided_cotangents_match_the_reverse_cumsum(reverse):
    # (2049, 1056) float32: gradient outputs over 8 MiB (huge-page advice), and the
    # cotangent read both contiguous (the inline path) and transposed (through strides).
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2049, 1056, generator=gen, requires_grad=True)
    cot = torch.randn(2049, 1056, generator=gen)
    strided = cot.t().contiguous().t()
    assert not strided.is_contiguous()
    want = cot.double().flip(0).cumsum(0).flip(0) if not reverse else cot.double().cumsum(0)
    with fscan.config.override(cpu_kernel="eager"):
        for c in (cot, strided):
            out = fscan.associative_scan(lambda a, b: a + b, x, 0, reverse)
            assert type(out.grad_fn).__name__ == "KernelScanBackward"
            (got,) = torch.autograd.grad(out, x, c)
            assert got.is_contiguous() and got.data_ptr() != c.data_ptr()
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-3)


@needs_compiler
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("name", ["add", "affine", "linear_recurrence"])
def test_split_column_backward_matches_the_oracle(name, reverse, threads, monkeypatch):
    # (6000, 16) float64 on 2 or 3 threads: one column of lanes split into threads + 1
    # chunks (csrc/tuning.h lane_columns), the top one scanned while the transfer maps of
    # the middle ones are found, its carry composed down through them (3 threads: two).
    served = []
    fused = recurrence_solve.kernel_adjoint
    monkeypatch.setattr(
        recurrence_solve, "kernel_adjoint", lambda *args: served.append(fused(*args)) or served[-1]
    )
    gen = torch.Generator().manual_seed(5)
    a = (torch.rand(6000, 16, generator=gen, dtype=torch.float64) * 0.5 + 0.5).requires_grad_()
    b = torch.randn(6000, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    cot = torch.randn(6000, 16, generator=gen, dtype=torch.float64)
    add = lambda x, y: x + y
    calls = {
        "add": lambda a, b: fscan.associative_scan(add, b, 0, reverse),
        "affine": lambda a, b: fscan.associative_scan(affine, (a, b), 0, reverse)[1],
        "linear_recurrence": lambda a, b: fscan.linear_recurrence(a, b, 0, reverse=reverse),
    }
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = calls[name](a, b)
        got = torch.autograd.grad(out, (a, b), cot, allow_unused=True)
    finally:
        torch.set_num_threads(before)
    if name == "linear_recurrence":
        assert served and served[-1] is not None
    else:
        assert type(out.grad_fn).__name__ == "KernelScanBackward"
    wide = [a.detach().requires_grad_(), b.detach().requires_grad_()]
    if name == "add":
        want_out = sequential_scan(add, wide[1], 0, reverse, combine_mode="pointwise")
    else:
        want_out = sequential_scan(affine, tuple(wide), 0, reverse, combine_mode="pointwise")[1]
    want = torch.autograd.grad(want_out, wide, cot, allow_unused=True)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@needs_compiler
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_split_column_backward_with_every_cotangent_matches_the_oracle(reverse, threads):
    # The affine pair with both outputs' cotangents: its transfer maps carry two unit
    # cotangents, and its split column's chunks are equal (csrc/backward.h; with one, the
    # top chunk is twice as long: the other split-column test). 256 lanes: chunks of 64
    # steps at least (csrc/tuning.h), so 400 steps split in threads + 1 chunks, 150 in 2.
    gen = torch.Generator().manual_seed(7)
    for steps in (400, 150):
        a = torch.rand(steps, 256, generator=gen, dtype=torch.float64) * 0.5 + 0.5
        b = torch.randn(steps, 256, generator=gen, dtype=torch.float64)
        cots = [torch.randn(steps, 256, generator=gen, dtype=torch.float64) for _ in range(2)]
        xs = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = fscan.associative_scan(affine, tuple(xs), 0, reverse)
            got = torch.autograd.grad(out, xs, cots)
        finally:
            torch.set_num_threads(before)
        assert type(out[0].grad_fn).__name__ == "KernelScanBackward"
        wide = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        want_out = sequential_scan(affine, tuple(wide), 0, reverse, combine_mode="pointwise")
        want = torch.autograd.grad(want_out, wide, cots)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
