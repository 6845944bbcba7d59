"""Reverse-mode gradients of fscan.associative_scan against the sequential oracle."""

from __future__ import annotations

import functools

import optree
import pytest
import torch
from helpers import (
    add,
    affine_compose,
    assert_same_grads,
    assert_trees_close,
    cached_verdicts,
    fscan_grads,
    linear_recurrence,
    logaddexp,
    matmul,
    mul,
    oracle_grads,
    parametrize,
    sequential_scan,
)
from torch.autograd import gradcheck, gradgradcheck

import fscan
from fscan._call import ScanCall
from fscan._knowledge.store import Knowledge, reach
from fscan._pytree import flatten
from fscan._routing.scan import scan_flat

MODES = ["pointwise", "generic"]
F64 = torch.float64

# The adjoint route's Functions: fscan's adjoint scan, or (on CPU, once compiled in the
# background) the C++ forward and backward kernels of fscan._engines.cpp.cpu_kernel.
ADJOINT = ("PointwiseScanBackward", "KernelScanBackward")


def max_argmax(x, y):
    """Running maximum with the position it came from; differentiable in the values."""
    take = y[0] > x[0]
    return torch.where(take, y[0], x[0]), torch.where(take, y[1], x[1])


def scan(combine_fn, xs, dim=0, reverse=False, mode="pointwise"):
    return fscan.associative_scan(combine_fn, xs, dim, reverse=reverse, combine_mode=mode)


def assert_grads_match_oracle(combine_fn, xs, dim, reverse, mode, extra=()):
    """Gradients w.r.t. every float leaf (and ``extra`` tensors) match the sequential loop's."""
    leaves = [x for x in optree.tree_leaves(xs) if x.is_floating_point()]
    wrt = [t for t in [*leaves, *extra] if t.requires_grad]
    out = scan(combine_fn, xs, dim, reverse, mode)
    ref = sequential_scan(combine_fn, xs, dim, reverse, mode)
    assert_trees_close(out, ref)
    outs = [o for o in optree.tree_leaves(out) if o.is_floating_point()]
    refs = [r for r in optree.tree_leaves(ref) if r.is_floating_point()]
    cotangents = [torch.randn_like(r) for r in refs]
    got = torch.autograd.grad(outs, wrt, cotangents, allow_unused=True)
    want = torch.autograd.grad(refs, wrt, cotangents, allow_unused=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def positive(*shape):
    return (torch.rand(*shape, dtype=F64) + 0.5).requires_grad_()


def normal(*shape):
    return torch.randn(*shape, dtype=F64, requires_grad=True)


@parametrize(mode=MODES, reverse=[False, True], length=[1, 2, 3, 5, 17])
def test_gradcheck_linear_recurrence(mode, reverse, length):
    a, b = positive(length, 3), normal(length, 3)
    f = lambda a, b: scan(linear_recurrence, (a, b), 0, reverse, mode)
    assert gradcheck(f, (a, b))


@parametrize(mode=MODES, reverse=[False, True], dim=[0, 1, -1])
def test_gradcheck_affine_dict_over_dims(mode, reverse, dim):
    w, c = positive(4, 6, 5), normal(4, 6, 5)
    f = lambda w, c: tuple(scan(affine_compose, {"w": w, "c": c}, dim, reverse, mode).values())
    assert gradcheck(f, (w, c))


@parametrize(op=[add, mul, logaddexp], mode=MODES, reverse=[False, True])
def test_elementwise_operators_match_oracle(op, mode, reverse):
    assert_grads_match_oracle(op, positive(23, 4), 0, reverse, mode)


@parametrize(mode=MODES, reverse=[False, True], dim=[0, 1, 2])
def test_linear_recurrence_matches_oracle(mode, reverse, dim):
    shape = [3, 4, 5]
    shape[dim] = 19
    xs = (positive(*shape), normal(*shape))
    assert_grads_match_oracle(linear_recurrence, xs, dim, reverse, mode)


@parametrize(reverse=[False, True], size=[2, 3])
def test_matrix_products_generic(reverse, size):
    mats = normal(11, size, size)
    f = lambda m: scan(matmul, m, 0, reverse, "generic")
    assert gradcheck(f, (mats,))
    assert_grads_match_oracle(matmul, mats, 0, reverse, "generic")


def matrix_entries(x, y):
    """2x2 matrix products with the four entries as leaves: every block entry is mixed."""
    a1, b1, c1, d1 = x
    a2, b2, c2, d2 = y
    return a1 * a2 + b1 * c2, a1 * b2 + b1 * d2, c1 * a2 + d1 * c2, c1 * b2 + d1 * d2


@parametrize(mode=MODES, reverse=[False, True])
def test_matrix_entries_as_leaves(mode, reverse):
    entries = tuple(normal(7, 2) for _ in range(4))
    f = lambda *xs: scan(matrix_entries, xs, 0, reverse, mode)
    assert gradcheck(f, entries)
    assert_grads_match_oracle(matrix_entries, entries, 0, reverse, mode)
    if mode == "pointwise":
        assert gradgradcheck(f, entries)


@parametrize(mode=MODES, reverse=[False, True])
def test_max_argmax_pair(mode, reverse):
    values = normal(29, 3)
    index = torch.arange(29).unsqueeze(1).expand(29, 3).contiguous()
    assert_grads_match_oracle(max_argmax, (values, index), 0, reverse, mode)
    assert gradcheck(lambda v: scan(max_argmax, (v, index), 0, reverse, mode)[0], (values,))


@parametrize(mode=MODES)
def test_gradgradcheck(mode):
    a, b = positive(9, 2), normal(9, 2)
    f = lambda a, b: scan(linear_recurrence, (a, b), 0, False, mode)
    assert gradgradcheck(f, (a, b))
    mats = normal(6, 2, 2)
    assert gradgradcheck(lambda m: scan(matmul, m, 0, True, "generic"), (mats,))


@parametrize(mode=MODES)
def test_unused_output_and_partial_requires_grad(mode):
    a, b = torch.rand(13, 2, dtype=F64) + 0.5, normal(13, 2)
    (grad_b,) = torch.autograd.grad(scan(linear_recurrence, (a, b), 0, False, mode)[1].sum(), b)
    (want,) = torch.autograd.grad(sequential_scan(linear_recurrence, (a, b), 0)[1].sum(), b)
    torch.testing.assert_close(grad_b, want)


@parametrize(mode=MODES, dim=[0, 1])
def test_empty_scan_dim_gives_empty_gradient(mode, dim):
    shape = [3, 4]
    shape[dim] = 0
    x = normal(*shape)
    (grad,) = torch.autograd.grad(scan(mul, x, dim, False, mode).sum(), x)
    assert grad.shape == x.shape


# --- closures -------------------------------------------------------------------

SHIFT = torch.randn(3, dtype=F64, requires_grad=True)


class _Slots:
    __slots__ = ("w",)


HIDDEN = _Slots()
HIDDEN.w = torch.randn(3, dtype=F64, requires_grad=True)


class Shift(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, dtype=F64))

    def forward(self, a, b):
        return a + b + self.w


def shifted_add(a, b, w):
    return a + b + w


def add_global_shift(a, b):
    return a + b + SHIFT


def add_hidden_shift(a, b):
    return a + b + HIDDEN.w


def closures():
    w = torch.randn(3, dtype=F64, requires_grad=True)
    module = Shift()
    return {
        "lambda": (lambda a, b: a + b + w, w),
        "partial": (functools.partial(shifted_add, w=w), w),
        "module": (module, module.w),
        "bound method": (module.forward, module.w),
        "global": (add_global_shift, SHIFT),
        "attribute of slotted global": (add_hidden_shift, HIDDEN.w),
    }


@parametrize(kind=list(closures()), mode=MODES, reverse=[False, True])
def test_closed_over_tensors_get_gradients(kind, mode, reverse):
    combine_fn, w = closures()[kind]
    x = normal(9, 3)
    assert_grads_match_oracle(combine_fn, x, 0, reverse, mode, extra=(w,))
    # also when the scanned input itself needs no gradient
    assert_grads_match_oracle(combine_fn, x.detach(), 0, reverse, mode, extra=(w,))


@parametrize(mode=MODES, reverse=[False, True])
def test_closure_gradcheck(mode, reverse):
    x, s = positive(7, 3), positive(3)
    f = lambda x, s: scan(lambda a, b: a * b * s, x, 0, reverse, mode)  # associative for any s
    assert gradcheck(f, (x, s))


def test_pointwise_uses_the_adjoint_backward():
    a, b = positive(8, 2), normal(8, 2)
    out = scan(linear_recurrence, (a, b))
    assert type(out[0].grad_fn).__name__ in ADJOINT
    # A tensor in a __slots__ attribute of a global is found too: the adjoint serves it.
    hidden = scan(add_hidden_shift, normal(8, 3))
    assert type(hidden.grad_fn).__name__ in ADJOINT


def routed_unchecked(combine_fn, xs, reverse):
    """fscan's routing in pointwise mode, with the elementwise check skipped (it would
    refuse these combine_fns before the adjoint probe could be tested)."""
    leaves, spec = flatten(xs)
    entry = Knowledge(pure=True, elementwise=True)
    call = ScanCall("test", combine_fn, xs, spec, leaves, 0, reverse, "pointwise")
    return scan_flat(call, reach(combine_fn), entry)


def test_position_mixing_combine_falls_back_to_autograd():
    # Matrix products batch along the scan dim but mix positions within an element:
    # the per-position adjoint would be wrong, so the probe sends this to autograd.
    mats = normal(10, 2, 2)
    (out,) = routed_unchecked(matmul, mats, reverse=False)
    assert type(out.grad_fn).__name__ not in ADJOINT
    cot = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, mats, cot)
    (want,) = torch.autograd.grad(sequential_scan(matmul, mats, 0), mats, cot)
    torch.testing.assert_close(got, want)


def test_probe_verdicts_are_cached_per_key():
    fscan.clear_caches()
    x = positive(5, 2)
    for _ in range(3):  # fresh lambdas of one code object share one verdict
        scan(lambda a, b: a * b, x)
    assert cached_verdicts("adjoint") == 1
    for i in range(5):
        scan(eval(f"lambda a, b{i}: a * b{i}"), x)  # distinct code objects
    assert cached_verdicts("adjoint") == 6


def test_no_grad_and_integer_inputs_take_the_fast_path():
    x = positive(6, 2)
    with torch.no_grad():
        assert not scan(mul, x).requires_grad
    ints = torch.arange(12).reshape(6, 2)
    assert scan(add, ints).tolist() == torch.cumsum(ints, 0).tolist()


@pytest.mark.parametrize("mode", MODES)
def test_inputs_are_not_modified_and_outputs_do_not_alias(mode):
    a, b = positive(9, 2), normal(9, 2)
    copies = (a.detach().clone(), b.detach().clone())
    out = scan(linear_recurrence, (a, b), 0, False, mode)
    torch.autograd.grad([o.sum() for o in out], (a, b))
    assert torch.equal(a, copies[0]) and torch.equal(b, copies[1])
    for o in out:
        assert o.untyped_storage().data_ptr() not in {
            a.untyped_storage().data_ptr(),
            b.untyped_storage().data_ptr(),
        }


@parametrize(reverse=[False, True], dim=[0, 1])
def test_pointwise_adjoint_matches_autograd_through_generic_engine(reverse, dim):
    shape = [33, 4] if dim == 0 else [4, 33]
    xs = {"w": positive(*shape), "c": normal(*shape)}
    pointwise = scan(affine_compose, xs, dim, reverse, "pointwise")
    generic = scan(affine_compose, xs, dim, reverse, "generic")
    assert type(pointwise["c"].grad_fn).__name__ in ADJOINT
    cot = [torch.randn_like(xs["w"]), torch.randn_like(xs["c"])]
    inputs = [xs["w"], xs["c"]]
    got = torch.autograd.grad([pointwise["w"], pointwise["c"]], inputs, cot)
    want = torch.autograd.grad([generic["w"], generic["c"]], inputs, cot)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@parametrize(mode=MODES)
def test_batched_cotangents(mode):
    # autograd.functional.jacobian(vectorize=True) vmaps the backward itself
    a, b = torch.rand(6, 2, dtype=F64) + 0.5, torch.randn(6, 2, dtype=F64)
    f = lambda a, b: scan(linear_recurrence, (a, b), 0, False, mode)
    got = torch.autograd.functional.jacobian(f, (a, b), vectorize=True)
    want = torch.autograd.functional.jacobian(
        lambda a, b: sequential_scan(linear_recurrence, (a, b), 0), (a, b)
    )
    torch.testing.assert_close(got, want)


@parametrize(mode=MODES)
def test_complex_and_mixed_dtype_leaves(mode):
    z = torch.randn(9, 2, dtype=torch.complex128, requires_grad=True)
    assert gradcheck(lambda z: scan(mul, z, 0, False, mode), (z,))
    pair = (normal(9, 2), torch.rand(9, 2, requires_grad=True))  # float64 and float32
    both = lambda x, y: (x[0] + y[0], x[1] * y[1])
    assert_grads_match_oracle(both, pair, 0, False, mode)


def entry_appears_midway(x, y):
    """Adds a structurally new (numerically zero) block entry only for some steps.

    Branching on values is not elementwise, so this runs below the front end's check.
    """
    extra = x[0] * 0 if bool((y[1] > 0.5).all()) else 0
    return x[0] + y[0], x[1] * y[1] + extra


def scalar_until_midway(length):
    """Diagonal blocks (y0, y1) equal for the first steps only: `a * I` breaks midway."""
    y0 = torch.rand(length, 3, dtype=F64) + 0.5
    y1 = torch.cat([y0[: length // 2], torch.rand(length - length // 2, 3, dtype=F64) + 0.5])
    return y0.requires_grad_(), y1.requires_grad_()


@parametrize(reverse=[False, True])
def test_chunked_backward(monkeypatch, reverse):
    monkeypatch.setattr(fscan._engines.adjoint, "CHUNK_ELEMENTS", 5)  # two steps of 3 per chunk
    pair = lambda x, y: (x[0] * y[0], x[1] * y[1])
    cases = [
        (linear_recurrence, (positive(9, 3), normal(9, 3))),
        (matrix_entries, tuple(normal(9, 3) for _ in range(4))),
        (pair, scalar_until_midway(9)),
    ]
    for combine_fn, xs in cases:
        assert type(scan(combine_fn, xs, 0, reverse)[0].grad_fn).__name__ in ADJOINT
        assert_grads_match_oracle(combine_fn, xs, 0, reverse, "pointwise")
    xs = [normal(9, 3), torch.rand(9, 3, dtype=F64, requires_grad=True)]
    out = routed_unchecked(entry_appears_midway, tuple(xs), reverse)
    ref = sequential_scan(entry_appears_midway, tuple(xs), 0, reverse, "pointwise")
    cot = [torch.randn_like(o) for o in out]
    got, want = torch.autograd.grad(out, xs, cot), torch.autograd.grad(ref, xs, cot)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    w = normal(3)
    assert_grads_match_oracle(lambda a, b: a + b + w, normal(9, 3), 0, reverse, "pointwise", (w,))


def test_mixing_that_the_first_steps_values_hide_still_takes_the_exact_gradient():
    # Column 0 of the first rows loses every maximum, so the Jacobian at the adjoint
    # probe's steps is diagonal; later rows win and spread column 0 over the row.
    fn = lambda a, b: torch.maximum(a[..., :1], b)
    x = torch.randn(8, 3, dtype=F64).abs() + 1.0
    x[:3, 0] = -10.0
    x[4, 0] = 10.0
    x.requires_grad_(True)
    assert_same_grads(fscan_grads(fn, x, x), oracle_grads(fn, x, x))


@pytest.mark.parametrize("route", ["pointwise", "generic", "lax", "reset"])
def test_empty_element_dims_with_gradients(route):
    x = torch.randn(7, 0, 3, requires_grad=True)
    mul = lambda a, b: a * b
    if route == "lax":
        y = fscan.lax.associative_scan(mul, x, axis=0)
    elif route == "reset":
        y = fscan.associative_scan(mul, x, 0, reset=torch.zeros(7, dtype=torch.bool))
    else:
        y = fscan.associative_scan(mul, x, 0, combine_mode=route)
    assert y.shape == (7, 0, 3)
    y.sum().backward()
    assert x.grad.shape == (7, 0, 3)


def test_one_empty_leaf_beside_a_full_one():
    a = torch.rand(5, 0, dtype=F64, requires_grad=True)
    b = torch.rand(5, 2, dtype=F64, requires_grad=True)
    pair = lambda x, y: (x[0] * 1.0, x[1] + y[1])
    out = fscan.associative_scan(pair, (a, b), 0)
    torch.testing.assert_close(out[1], b.cumsum(0))
    (g,) = torch.autograd.grad(out[1].sum(), b)
    torch.testing.assert_close(g, torch.arange(5, 0, -1, dtype=F64)[:, None].expand(5, 2))
