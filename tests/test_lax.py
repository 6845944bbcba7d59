"""fscan.lax.associative_scan against jax.lax.associative_scan on the same pytrees."""

from __future__ import annotations

import numpy as np
import optree
import pytest
import torch
from helpers import parametrize, raises

import fscan
from fscan import lax

LENGTHS = [0, 1, 5, 33]


@pytest.fixture(scope="module")
def jax():
    """JAX on CPU, or the test is skipped."""
    return pytest.importorskip("jax")


def affine(x, y):
    """Compose ``h -> w h + c`` maps held in dicts; works on torch and JAX arrays alike."""
    return {"w": x["w"] * y["w"], "c": y["w"] * x["c"] + y["c"]}


def compare(jax, fn_torch, fn_jax, elems, **kw):
    """Run both on the same float32 data; every leaf must agree."""
    ours = lax.associative_scan(fn_torch, elems, **kw)
    theirs = jax.lax.associative_scan(
        fn_jax, optree.tree_map(lambda t: jax.numpy.asarray(t.numpy()), elems), **kw
    )
    ours_leaves, ours_spec = optree.tree_flatten(ours)
    theirs_leaves = jax.tree_util.tree_leaves(theirs)
    assert ours_spec == optree.tree_structure(elems)
    assert len(ours_leaves) == len(theirs_leaves)
    for a, b in zip(ours_leaves, theirs_leaves):
        np.testing.assert_allclose(a.numpy(), np.asarray(b), rtol=2e-5, atol=2e-5)


# JAX 0.10 raises for reverse=True with a negative axis (it flips before it
# normalizes the axis), so reverse is compared on non-negative axes only.
AXES = [(0, False), (1, False), (-1, False), (-3, False), (0, True), (2, True)]


@parametrize(length=LENGTHS, axis_reverse=AXES)
def test_add(jax, length, axis_reverse):
    axis, reverse = axis_reverse
    shape = [3, 4, 2]
    shape[axis] = length
    compare(jax, torch.add, jax.numpy.add, torch.randn(shape), axis=axis, reverse=reverse)


@parametrize(length=[7, 33], axis_reverse=AXES[::2] + AXES[-1:])
def test_affine_composition_dict(jax, length, axis_reverse):
    axis, reverse = axis_reverse
    shape = [3, 4, 2]
    shape[axis] = length
    # Keys out of order: both sides flatten dicts in sorted key order.
    elems = {"w": torch.rand(shape) + 0.5, "c": torch.randn(shape)}
    compare(jax, affine, affine, elems, axis=axis, reverse=reverse)


@parametrize(length=[1, 2, 16], reverse=[False, True])
def test_matmul_through_a_vmapped_fn(jax, length, reverse):
    mats = torch.randn(length, 3, 3) / 2
    fn_jax = jax.vmap(jax.numpy.matmul)
    compare(jax, torch.vmap(torch.matmul), fn_jax, mats, reverse=reverse)


@parametrize(reverse=[False, True])
def test_matmul_along_a_middle_axis(jax, reverse):
    """fn sees slices with the scanned axis still at ``axis``: (2, k, 3, 3) here."""
    mats = torch.randn(2, 9, 3, 3) / 2
    fn_torch = torch.vmap(torch.vmap(torch.matmul))
    fn_jax = jax.vmap(jax.vmap(jax.numpy.matmul))
    compare(jax, fn_torch, fn_jax, mats, axis=1, reverse=reverse)


def nested(x, y):
    """Sum, product and maximum over a nested tuple/list/dict; framework-agnostic."""
    (x0, [x1, xd]), (y0, [y1, yd]) = x, y
    top = (xd["a"] + yd["a"] + abs(xd["a"] - yd["a"])) / 2
    return (x0 + y0, [x1 * y1, {"b": xd["b"] + yd["b"], "a": top}])


@parametrize(reverse=[False, True])
def test_nested_pytree_with_tuples_lists_and_dicts(jax, reverse):
    elems = (
        torch.randn(6, 2),
        [torch.rand(6) + 0.5, {"b": torch.randn(6, 3), "a": torch.randn(6)}],
    )
    compare(jax, nested, nested, elems, reverse=reverse)


# ---- without JAX ------------------------------------------------------------------


def test_fn_sees_the_axis_in_place():
    seen = []

    def record(x, y):
        seen.append(tuple(x.shape))
        return x + y

    out = lax.associative_scan(record, torch.ones(4, 20, 3), axis=1)
    assert torch.equal(out, torch.ones(4, 20, 3).cumsum(1))
    assert seen and all(s[0] == 4 and s[2] == 3 for s in seen)


def test_reverse_order_is_jaxs():
    """``[..., fn(fn(z, y), x), fn(z, y), z]``: with "keep the left operand", all is z."""
    out = lax.associative_scan(lambda x, y: x, torch.arange(5.0), reverse=True)
    assert out.tolist() == [4.0] * 5
    out = lax.associative_scan(lambda x, y: x, torch.arange(5.0))
    assert out.tolist() == [0.0] * 5


def test_gradients_flow():
    x = torch.randn(12, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: lax.associative_scan(torch.mul, t, axis=0), (x,))


def test_errors_use_jax_names():
    with raises(fscan.ScanTypeError, "fscan.lax.associative_scan: `fn` must be callable"):
        lax.associative_scan(None, torch.ones(3))
    with raises(
        fscan.ScanValueError,
        "fscan.lax.associative_scan: `axis` 2 is out of range for leaf elems with 2 "
        "dimension(s), expected a value in [-2, 1].",
    ):
        lax.associative_scan(torch.add, torch.ones(3, 2), axis=2)
    with raises(
        fscan.ScanValueError, "leaf elems[1] has shape (4,), expected length 3 along axis 0"
    ):
        lax.associative_scan(torch.add, (torch.ones(3), torch.ones(4)))
    with raises(fscan.CombineFnError, "fscan.lax.associative_scan: `fn` returned"):
        lax.associative_scan(lambda x, y: x.sum(), torch.ones(5))
