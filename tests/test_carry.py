"""``initial=`` on fscan.associative_scan and fscan.lax.associative_scan (fscan._carry)."""

from __future__ import annotations

import optree
import pytest
import torch
from helpers import (
    affine_compose,
    assert_trees_close,
    linear_recurrence,
    matmul,
    parametrize,
    raises,
    sequential_scan,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan
from fscan import _lax

F64 = dict(dtype=torch.float64)


def oracle(combine_fn, xs, dim, initial, reverse=False, mode="generic", reset=None):
    """The sequential loop over ``[initial, xs[0], ...]`` (behind for reverse), the
    carried element dropped; a reset at the first step in scan order drops ``initial``."""
    leaves, spec = optree.tree_flatten(xs, none_is_leaf=False)
    init_leaves = optree.tree_leaves(initial, none_is_leaf=False)
    elem = [
        torch.as_tensor(i, dtype=x.dtype).expand(x.shape[:dim] + x.shape[dim + 1 :])
        for i, x in zip(init_leaves, leaves)
    ]
    n = leaves[0].shape[dim]
    first = n - 1 if reverse else 0
    if reset is not None and bool(reset.reshape(-1)[first] if reset.ndim == 1 else False):
        return sequential_scan(combine_fn, xs, dim, reverse, mode)
    pieces = [e.unsqueeze(dim) for e in elem]
    ext = [torch.cat([x, p] if reverse else [p, x], dim) for x, p in zip(leaves, pieces)]
    out = sequential_scan(combine_fn, optree.tree_unflatten(spec, ext), dim, reverse, mode)
    keep = slice(0, n) if reverse else slice(1, n + 1)
    return optree.tree_map(lambda o: o.narrow(dim, keep.start, n), out, none_is_leaf=False)


def rand(*shape):
    return torch.randn(*shape, **F64)


CASES = {
    "add": (lambda x, y: x + y, lambda: rand(9, 3), lambda: rand(3)),
    "affine": (
        linear_recurrence,
        lambda: (torch.rand(9, 3, **F64) + 0.5, rand(9, 3)),
        lambda: (torch.rand(3, **F64) + 0.5, rand(3)),
    ),
    "dict": (
        affine_compose,
        lambda: {"w": torch.rand(9, 2, **F64) + 0.5, "c": rand(9, 2)},
        lambda: {"w": torch.rand(2, **F64) + 0.5, "c": rand(2)},
    ),
}


@parametrize(case=list(CASES), mode=["pointwise", "generic"], reverse=[False, True])
def test_matches_the_oracle(case, mode, reverse):
    fn, make_xs, make_init = CASES[case]
    xs, init = make_xs(), make_init()
    out = fscan.associative_scan(fn, xs, 0, reverse, mode, initial=init)
    assert_trees_close(out, oracle(fn, xs, 0, init, reverse))


@parametrize(reverse=[False, True], length=[1, 2, 5, 33])
def test_matrix_products_generic_any_dim(reverse, length):
    m = rand(2, length, 3, 3) / 2
    init = rand(2, 3, 3)
    out = fscan.associative_scan(matmul, m, 1, reverse, "generic", initial=init)
    assert_trees_close(out, oracle(matmul, m, 1, init, reverse))


def test_chunked_inference_is_one_argument():
    """Scanning in chunks, carrying the last state, equals one scan over everything."""
    a, b = torch.rand(40, 4, **F64) + 0.5, rand(40, 4)
    whole = fscan.associative_scan(linear_recurrence, (a, b), 0)
    carry, parts = None, []
    for chunk in zip(a.split(7), b.split(7)):
        out = fscan.associative_scan(linear_recurrence, chunk, 0, initial=carry)
        carry = tuple(o[-1] for o in out)
        parts.append(out[1])
    torch.testing.assert_close(torch.cat(parts), whole[1])


def test_broadcast_and_number_leaves():
    xs = (torch.rand(6, 2, 3, **F64) + 0.5, rand(6, 2, 3))
    init = (1.0, rand(3))  # a number, and a state shared over the batch of 2
    out = fscan.associative_scan(linear_recurrence, xs, 0, initial=init)
    assert_trees_close(out, oracle(linear_recurrence, xs, 0, init))


def test_empty_scan_dimension():
    x = rand(0, 3)
    out = fscan.associative_scan(torch.add, x, 0, initial=rand(3))
    assert out.shape == (0, 3)


def test_inputs_untouched_and_not_aliased():
    x, init = rand(5, 2), rand(2)
    x0, i0 = x.clone(), init.clone()
    out = fscan.associative_scan(torch.add, x, 0, initial=init)
    assert torch.equal(x, x0) and torch.equal(init, i0)
    assert out.data_ptr() != x.data_ptr()


# ---- reset= ---------------------------------------------------------------------


@parametrize(mode=["pointwise", "generic"], reverse=[False, True])
def test_reset_drops_initial_only_at_the_first_step(mode, reverse):
    x = rand(8, 2)
    init = rand(2)
    for first_reset in (False, True):
        reset = torch.tensor([0, 0, 1, 0, 0, 1, 0, 0]) > 0
        reset[7 if reverse else 0] = first_reset
        out = fscan.associative_scan(torch.add, x, 0, reverse, mode, reset=reset, initial=init)
        # the oracle: initial enters the first segment unless that step resets
        seq = x.clone()
        first = 7 if reverse else 0
        if not first_reset:
            seq[first] = seq[first] + init
        expected = fscan.associative_scan(torch.add, seq, 0, reverse, mode, reset=reset)
        torch.testing.assert_close(out, expected)


def test_reset_per_row_mask():
    x, init = rand(6, 3), rand(3)
    reset = torch.zeros(6, 3, dtype=torch.bool)
    reset[0, 1] = True  # only column 1 drops initial
    out = fscan.associative_scan(torch.add, x, 0, reset=reset, initial=init)
    expected = x.cumsum(0) + init * torch.tensor([1.0, 0.0, 1.0], **F64)
    torch.testing.assert_close(out, expected)


def test_reset_drops_an_infinite_initial():
    x = torch.ones(3, **F64)
    reset = torch.tensor([True, False, False])
    out = fscan.associative_scan(torch.mul, x, 0, reset=reset, initial=torch.tensor(float("inf")))
    torch.testing.assert_close(out, torch.ones(3, **F64))


# ---- gradients and transforms -----------------------------------------------------


@parametrize(mode=["pointwise", "generic"], reverse=[False, True])
def test_gradcheck(mode, reverse):
    a = (torch.rand(7, 2, **F64) + 0.5).requires_grad_()
    b = rand(7, 2).requires_grad_()
    ia = (torch.rand(2, **F64) + 0.5).requires_grad_()
    ib = rand(2).requires_grad_()

    def run(a, b, ia, ib):
        return fscan.associative_scan(linear_recurrence, (a, b), 0, reverse, mode, initial=(ia, ib))

    assert torch.autograd.gradcheck(run, (a, b, ia, ib))


def test_gradcheck_with_reset_and_broadcast_initial():
    x = rand(6, 3).requires_grad_()
    init = rand(1).requires_grad_()  # broadcasts to the element shape (3,)
    reset = torch.tensor([0, 0, 0, 1, 0, 0]) > 0

    def run(x, init):
        return fscan.associative_scan(torch.mul, x, 0, reset=reset, initial=init)

    assert torch.autograd.gradcheck(run, (x, init))


def test_torch_func_grad_and_vmap_over_initial():
    x = rand(5, 3)
    inits = rand(4, 3)

    def total(init):
        return fscan.associative_scan(torch.add, x, 0, initial=init).sum()

    grads = torch.func.vmap(torch.func.grad(total))(inits)
    torch.testing.assert_close(grads, torch.full((4, 3), 5.0, **F64))
    scans = torch.func.vmap(lambda i: fscan.associative_scan(torch.add, x, 0, initial=i))(inits)
    torch.testing.assert_close(scans, x.cumsum(0) + inits[:, None])


def test_vmap_over_xs_and_initial_generic():
    m, init = rand(3, 6, 2, 2) / 2, rand(3, 2, 2)
    scan = lambda m, i: fscan.associative_scan(matmul, m, 0, combine_mode="generic", initial=i)
    out = torch.func.vmap(scan)(m, init)
    for k in range(3):
        torch.testing.assert_close(out[k], oracle(matmul, m[k], 0, init[k]))


@pytest.fixture(scope="module")
def compiled_inductor():
    torch._dynamo.reset()

    def fn(a, b, ia, ib):
        return fscan.associative_scan(linear_recurrence, (a, b), 0, initial=(ia, ib))[1]

    yield fn, torch.compile(fn, backend="inductor", fullgraph=True)
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from Inductor's own imports
def test_compile_with_inductor_forward_and_gradients(compiled_inductor):
    fn, compiled = compiled_inductor
    args = [torch.rand(12, 3) + 0.5, torch.randn(12, 3), torch.rand(3) + 0.5, torch.randn(3)]
    args = [x.requires_grad_() for x in args]
    torch.testing.assert_close(compiled(*args), fn(*args))
    got = torch.autograd.grad(compiled(*args).sum(), args)
    expected = torch.autograd.grad(fn(*args).sum(), args)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


# ---- fscan.lax --------------------------------------------------------------------


@parametrize(reverse=[False, True])
def test_lax_initial_pointwise_and_matrix_fallback(reverse):
    x, init = rand(3, 5), rand(3)
    out = fscan.lax.associative_scan(torch.add, x, reverse, axis=1, initial=init)
    torch.testing.assert_close(out, oracle(torch.add, x, 1, init, reverse))
    m, mi = rand(6, 2, 2) / 2, rand(2, 2)
    out = fscan.lax.associative_scan(torch.vmap(torch.matmul), m, reverse, initial=mi)
    torch.testing.assert_close(out, oracle(matmul, m, 0, mi, reverse))


def test_lax_reverse_not_bool_warns_once(monkeypatch):
    monkeypatch.setattr(_lax, "_warned_reverse", False)
    x = torch.arange(6.0).reshape(3, 2)
    with pytest.warns(fscan.ReverseNotBoolWarning, match="pass `axis=` by keyword"):
        out = fscan.lax.associative_scan(torch.add, x, 1)  # the trap: 1 is `reverse`
    torch.testing.assert_close(out, x.flip(0).cumsum(0).flip(0))  # truthy, as in JAX
    assert issubclass(fscan.ReverseNotBoolWarning, fscan.ScanWarning)
    assert issubclass(fscan.ScanWarning, UserWarning)
    fscan.lax.associative_scan(torch.add, x, 1)  # once: no second warning (errors in pytest)


# ---- errors -------------------------------------------------------------------------


def test_wrong_structure():
    with raises(fscan.ScanValueError, "fscan.associative_scan: `initial` has structure"):
        fscan.associative_scan(linear_recurrence, (rand(4), rand(4)), 0, initial=rand(()))


def test_wrong_shape_names_the_leaf():
    with raises(
        fscan.ScanValueError,
        "fscan.associative_scan: leaf initial[1] has shape (4,), expected one element's shape "
        "(3,) (the leaf of `xs` of shape (5, 3) with dim 0 removed)",
    ):
        fscan.associative_scan(
            linear_recurrence, (rand(5, 3), rand(5, 3)), 0, initial=(1.0, rand(4))
        )


def test_wrong_dtype_names_the_leaf():
    with raises(
        fscan.ScanTypeError,
        "fscan.associative_scan: leaf initial['c'] has dtype torch.float64, which does not "
        "promote to torch.float32",
    ):
        xs = {"w": torch.ones(4, 2), "c": torch.ones(4, 2)}
        fscan.associative_scan(affine_compose, xs, 0, initial={"w": 1.0, "c": rand(2)})
    with raises(fscan.ScanTypeError, "leaf initial is float 0.5, which does not fit"):
        fscan.associative_scan(torch.add, torch.ones(3, dtype=torch.int64), 0, initial=0.5)
    with raises(fscan.ScanTypeError, "leaf initial is a str 'a', expected a torch.Tensor"):
        fscan.associative_scan(torch.add, torch.ones(3), 0, initial="a")


def test_lax_errors_use_its_name():
    with raises(fscan.ScanValueError, "fscan.lax.associative_scan: leaf initial has shape (4,)"):
        fscan.lax.associative_scan(torch.add, torch.ones(3, 2), initial=torch.ones(4))


class CarriedScan(torch.nn.Module):
    def forward(self, xs, h0):
        return fscan.associative_scan(linear_recurrence, xs, 0, True, initial=h0)


def test_export_with_a_dynamic_length():
    seq = torch.export.Dim("seq", min=2)
    xs = (torch.rand(5, 3) + 0.5, torch.randn(5, 3))
    h0 = (torch.rand(3) + 0.5, torch.randn(3))
    dims = {"xs": ({0: seq}, {0: seq}), "h0": (None, None)}
    ep = torch.export.export(CarriedScan(), (xs, h0), dynamic_shapes=dims)
    for n in (2, 3, 17):
        xs = (torch.rand(n, 3) + 0.5, torch.randn(n, 3))
        assert_trees_close(ep.module()(xs, h0), CarriedScan()(xs, h0))


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(1, 70),
    reverse=st.booleans(),
    mode=st.sampled_from(["pointwise", "generic"]),
    dim=st.integers(0, 1),
    reset_rate=st.sampled_from([0.0, 0.2, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_property_affine_with_initial_and_reset(length, reverse, mode, dim, reset_rate, seed):
    gen = torch.Generator().manual_seed(seed)
    shape = (length, 2) if dim == 0 else (2, length)
    xs = (torch.rand(shape, generator=gen, **F64) + 0.5, torch.randn(shape, generator=gen, **F64))
    init = (torch.rand(2, generator=gen, **F64) + 0.5, torch.randn(2, generator=gen, **F64))
    reset = torch.rand(length, generator=gen) < reset_rate
    out = fscan.associative_scan(
        linear_recurrence, xs, dim, reverse, mode, reset=reset, initial=init
    )
    # the oracle: a loop from `initial`, restarting where reset is set
    a, b = (x.movedim(dim, 0) for x in xs)
    h, expected = None, [None] * length
    for t in range(length - 1, -1, -1) if reverse else range(length):
        if h is None:  # the first step in scan order: initial enters unless it resets
            h = (a[t], b[t]) if reset[t] else linear_recurrence(init, (a[t], b[t]))
        else:
            h = (a[t], b[t]) if reset[t] else linear_recurrence(h, (a[t], b[t]))
        expected[t] = h
    for k in range(2):
        got = out[k].movedim(dim, 0)
        torch.testing.assert_close(got, torch.stack([e[k] for e in expected]))


def test_an_impure_combine_never_touches_the_callers_tensors():
    x, init = torch.ones(5), torch.ones(())
    with pytest.raises(fscan.ImpureCombineError):
        fscan.associative_scan(lambda a, b: a.add_(b), x, 0, initial=init)
    assert torch.equal(x, torch.ones(5)) and torch.equal(init, torch.ones(()))


@parametrize(mode=["pointwise", "generic"], reverse=[False, True])
def test_a_dropped_infinite_initial_leaves_gradients_finite(mode, reverse):
    x = rand(5, 2).requires_grad_()
    init = torch.full((2,), float("inf"), **F64, requires_grad=True)
    reset = torch.zeros(5, dtype=torch.bool)
    reset[4 if reverse else 0] = True
    out = fscan.associative_scan(torch.mul, x, 0, reverse, mode, reset=reset, initial=init)
    expected = fscan.associative_scan(torch.mul, x, 0, reverse, mode, reset=reset)
    torch.testing.assert_close(out, expected)
    gx, gi = torch.autograd.grad(out.sum(), (x, init))
    (ex,) = torch.autograd.grad(expected.sum(), x)
    torch.testing.assert_close(gx, ex)
    assert (gi == 0).all()


# ---- the C++ kernel's carry-in (no copy of the leaves) -------------------------------

needs_compiler = pytest.mark.skipif(
    __import__("fscan._engines.cpp._cpp_build", fromlist=["x"]).compiler_problem() is not None,
    reason="no C++ compiler: the kernel's carry-in is not built here",
)


def add(x, y):
    return x + y


def mixed_pair(x, y):  # a float32 gate and a float64 state: leaves of two dtypes
    return {"w": x["w"] * y["w"], "c": y["w"].double() * x["c"] + y["c"]}


@pytest.fixture
def kernel(monkeypatch):
    """The C++ kernel, built on first use (each combine compiles once per run, then
    Inductor's disk cache); the fold's copy is counted: the carry-in must not take it."""
    from fscan import _entry
    from fscan._routing import scan as _routing

    folds = []
    for module in (_routing, _entry):
        real = module.swap_heads
        monkeypatch.setattr(
            module, "swap_heads", lambda *a, _real=real: folds.append(1) or _real(*a)
        )
    with fscan.config.override(cpu_kernel="eager"):
        yield folds


def _carry_case(name: str, shape: tuple[int, ...], dim: int, dtype: torch.dtype, gen):
    def r(*s, d=dtype):
        return torch.randn(s, generator=gen, dtype=d)

    element = shape[:dim] + shape[dim + 1 :]
    if name == "add":
        if not dtype.is_floating_point:
            return add, torch.randint(-9, 9, shape, generator=gen), torch.randint(-9, 9, element)
        return add, r(*shape), r(*element)
    if name == "affine":
        gate = torch.rand(shape, generator=gen, dtype=dtype) * 0.5 + 0.5
        return linear_recurrence, (gate, r(*shape)), (torch.rand(element, dtype=dtype), r(*element))
    if name == "mixed":
        f32 = torch.float32
        xs = {"w": torch.rand(shape, generator=gen) * 0.5 + 0.5, "c": r(*shape, d=torch.float64)}
        return (
            mixed_pair,
            xs,
            {"w": torch.rand(element, dtype=f32), "c": r(*element, d=torch.float64)},
        )
    raise AssertionError(name)


def _warm(name, shape, dim, dtype):
    """A plain scan of the same key first: the pointwise route opens once combine_fn
    passed the elementwise check, on a call that combines (length 1 does not)."""
    warm = list(shape)
    warm[dim] = 64
    fn, xs, _ = _carry_case(name, tuple(warm), dim, dtype, torch.Generator().manual_seed(0))
    with torch.no_grad():
        fscan.associative_scan(fn, xs, dim)


def _check_carry_in(kernel, name, shape, dim, reverse, dtype, threads=1, seed=0):
    """The kernel's carry-in against the fold (fscan's torch engine) and the oracle;
    no copy of the leaves; inputs untouched, outputs in new memory."""
    fn, xs, init = _carry_case(name, shape, dim, dtype, torch.Generator().manual_seed(seed))
    _warm(name, shape, dim, dtype)
    leaves = optree.tree_leaves(xs) + optree.tree_leaves(init)
    before = [t.clone() for t in leaves]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            out = fscan.associative_scan(fn, xs, dim, reverse, initial=init)
    finally:
        torch.set_num_threads(previous)
    assert not kernel, f"{name}: the leaves were copied (the fold ran)"
    with fscan.config.override(cpu_kernel="off"), torch.no_grad():
        fold = fscan.associative_scan(fn, xs, dim, reverse, initial=init)
    # float32 (and the float32 gates of "mixed"): the kernel multiplies in double and
    # rounds once; the torch engine rounds every step.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 or name == "mixed" else {}
    assert_trees_close(out, fold, **tol)
    if shape[dim] <= 600:  # the oracle loops in Python
        assert_trees_close(out, oracle(fn, xs, dim, init, reverse, "pointwise"), **tol)
    assert all(torch.equal(t, b) for t, b in zip(leaves, before))
    mine = {t.untyped_storage().data_ptr() for t in leaves}
    assert all(o.untyped_storage().data_ptr() not in mine for o in optree.tree_leaves(out))


@needs_compiler
@parametrize(
    name=["add", "affine", "mixed"],
    reverse=[False, True],
    case=[((1,), 0), ((7, 40), 0), ((40, 3), 0), ((3, 40, 9), 1), ((3, 9, 40), -1), ((2, 33), 1)],
)
def test_kernel_carry_in_matches_the_fold(kernel, name, reverse, case):
    shape, dim = case
    _check_carry_in(kernel, name, shape, dim % len(shape), reverse, torch.float64)


@needs_compiler
@parametrize(
    length=[2047, 2048, 2049, 4113, 5000], reverse=[False, True], threads=[1, 2], other=[1, 3, 17]
)
def test_kernel_carry_in_over_chunk_boundaries(kernel, length, reverse, threads, other):
    """Long scans split in chunks across threads (lane and chain paths): only the
    first chunk in scan order reads the carry-in."""
    _check_carry_in(kernel, "affine", (length, other), 0, reverse, torch.float64, threads)


@needs_compiler
@parametrize(dtype=[torch.float32, torch.int64, torch.bfloat16], reverse=[False, True])
def test_kernel_carry_in_dtypes(kernel, dtype, reverse):
    if dtype == torch.bfloat16:  # rounding differs from the torch engine's: the oracle decides
        fn, xs, init = _carry_case("add", (50, 9), 0, dtype, torch.Generator().manual_seed(1))
        _warm("add", (50, 9), 0, dtype)
        with torch.no_grad():
            out = fscan.associative_scan(fn, xs, 0, reverse, initial=init)
        assert not kernel
        ref = oracle(fn, xs.double(), 0, init.double(), reverse, "pointwise")
        torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=5e-2)
        return
    _check_carry_in(kernel, "add", (50, 9), 0, reverse, dtype)


@needs_compiler
def test_kernel_carry_in_strided_leaves(kernel):
    """Views read in place, with the carry-in: a transpose (chain path), a step slice."""
    gen = torch.Generator().manual_seed(5)
    _warm("add", (64, 9), 0, torch.float64)
    for x in [torch.randn(9, 60, generator=gen, **F64).t(), torch.randn(60, 18, **F64)[:, ::2]]:
        init = rand(x.shape[1])
        for reverse in (False, True):
            with torch.no_grad():
                out = fscan.associative_scan(add, x, 0, reverse, initial=init)
            assert_trees_close(out, oracle(add, x, 0, init, reverse, "pointwise"))
    assert not kernel


@needs_compiler
def test_gradients_to_initial_take_the_fold(kernel):
    """A carry-in that needs gradients is folded (its backward is autograd's over the
    fold's torch ops), with the kernel on: gradcheck in float64."""
    xs = (torch.rand(12, 3, **F64) + 0.5, rand(12, 3))
    init = (torch.rand(3, **F64) + 0.5, rand(3).requires_grad_())

    def f(h0):
        return fscan.associative_scan(linear_recurrence, xs, 0, initial=(init[0], h0))[1]

    assert torch.autograd.gradcheck(f, (init[1],))
    assert kernel, "the fold ran"


@needs_compiler
@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(["add", "affine", "mixed"]),
    length=st.one_of(st.integers(1, 40), st.sampled_from([2048, 2049, 5000])),
    other=st.sampled_from([1, 2, 9]),
    dim=st.integers(0, 1),
    reverse=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_property_kernel_carry_in(name, length, other, dim, reverse, threads, seed):
    shape = [other, other]
    shape[dim] = length
    from fscan import _entry
    from fscan._routing import scan as _routing

    folds = []
    real = (_routing.swap_heads, _entry.swap_heads)
    try:
        _routing.swap_heads = _entry.swap_heads = lambda *a: folds.append(1) or real[0](*a)
        with fscan.config.override(cpu_kernel="eager"):
            _check_carry_in(folds, name, tuple(shape), dim, reverse, torch.float64, threads, seed)
    finally:
        _routing.swap_heads, _entry.swap_heads = real
