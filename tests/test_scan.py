"""fscan.associative_scan against the sequential oracle: sweeps and property tests."""

from __future__ import annotations

import collections

import optree
import pytest
import torch
from helpers import (
    add,
    affine_compose,
    assert_trees_close,
    linear_recurrence,
    logaddexp,
    matmul,
    maximum,
    minimum,
    mul,
    parametrize,
    sequential_scan,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan

MODES = ["pointwise", "generic"]
LENGTHS = [0, 1, 2, 3, 5, 10, 33, 1000]


@parametrize(mode=MODES)
def test_seed_examples(mode):
    xs = torch.arange(1, 5, dtype=torch.float32)
    assert fscan.associative_scan(add, xs, 0, combine_mode=mode).tolist() == [1, 3, 6, 10]
    assert fscan.associative_scan(mul, xs, 0, combine_mode=mode).tolist() == [1, 2, 6, 24]


@parametrize(mode=MODES, reverse=[False, True], length=LENGTHS, dim=[0, 1, 2, -1, -3])
def test_lengths_and_dims(mode, reverse, length, dim):
    shape = [3, 4, 2]
    shape[dim] = length
    xs = torch.randn(shape, dtype=torch.float64)
    out = fscan.associative_scan(add, xs, dim, reverse=reverse, combine_mode=mode)
    assert_trees_close(out, sequential_scan(add, xs, dim, reverse, mode))


@parametrize(op=[add, mul, maximum, minimum, logaddexp], mode=MODES, reverse=[False, True])
def test_elementwise_operators(op, mode, reverse):
    xs = torch.rand(37, 5, dtype=torch.float64) + 0.5
    out = fscan.associative_scan(op, xs, 0, reverse=reverse, combine_mode=mode)
    assert_trees_close(out, sequential_scan(op, xs, 0, reverse, mode))


@parametrize(size=[2, 3], reverse=[False, True], length=[1, 2, 7, 64])
def test_matrix_products_are_ordered(size, reverse, length):
    xs = torch.randn(length, size, size, dtype=torch.float64)
    out = fscan.associative_scan(matmul, xs, 0, reverse=reverse, combine_mode="generic")
    assert_trees_close(out, sequential_scan(matmul, xs, 0, reverse, "generic"))


@parametrize(mode=MODES, reverse=[False, True], dim=[0, 1])
def test_linear_recurrence_pair(mode, reverse, dim):
    a = torch.rand(6, 50, dtype=torch.float64).movedim(1, dim) if dim else torch.rand(50, 6)
    b = torch.randn_like(a, dtype=torch.float64)
    a = a.to(torch.float64)
    out = fscan.associative_scan(linear_recurrence, (a, b), dim, reverse, mode)
    assert_trees_close(out, sequential_scan(linear_recurrence, (a, b), dim, reverse, mode))
    if not reverse:  # h_t = a_t h_{t-1} + b_t from h_{-1} = 0 is the second leaf
        h, hs = torch.zeros_like(b.select(dim, 0)), []
        for t in range(b.shape[dim]):
            h = a.select(dim, t) * h + b.select(dim, t)
            hs.append(h)
        torch.testing.assert_close(out[1], torch.stack(hs, dim))


@parametrize(mode=MODES)
def test_affine_composition_dict_tree(mode):
    xs = {"w": torch.rand(40, 3, dtype=torch.float64), "c": torch.randn(40, 3, dtype=torch.float64)}
    out = fscan.associative_scan(affine_compose, xs, 0, combine_mode=mode)
    assert_trees_close(out, sequential_scan(affine_compose, xs, 0, False, mode))


Point = collections.namedtuple("Point", ["x", "y"])


@parametrize(mode=MODES)
def test_nested_pytree_with_none_and_namedtuple(mode):
    xs = (
        torch.randn(9, 2),
        {"h": [torch.randn(9), None], "p": Point(torch.randn(9, 3), torch.randn(9, 1, 2))},
    )
    out = fscan.associative_scan(
        lambda a, b: optree.tree_map(torch.add, a, b, none_is_leaf=False), xs, 0, combine_mode=mode
    )
    assert isinstance(out[1]["p"], Point) and out[1]["h"][1] is None
    assert_trees_close(out, optree.tree_map(lambda x: x.cumsum(0), xs, none_is_leaf=False))


DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
]


@parametrize(dtype=DTYPES, mode=MODES, reverse=[False, True])
def test_dtypes(dtype, mode, reverse):
    xs = (torch.rand(100, 4) * 4).to(dtype)
    out = fscan.associative_scan(add, xs, 0, reverse=reverse, combine_mode=mode)
    assert out.dtype == dtype
    assert_trees_close(out, sequential_scan(add, xs, 0, reverse, mode))


@parametrize(mode=MODES)
def test_bool_or_scan(mode):
    xs = torch.rand(50, 3) > 0.9
    out = fscan.associative_scan(torch.logical_or, xs, 0, combine_mode=mode)
    assert out.dtype == torch.bool
    assert torch.equal(out, xs.to(torch.int64).cumsum(0) > 0)


@parametrize(mode=MODES, reverse=[False, True])
def test_non_contiguous_and_expanded_inputs(mode, reverse):
    base = torch.randn(6, 40, dtype=torch.float64)
    transposed = base.t()  # (40, 6), non-contiguous
    expanded = torch.randn(1, 6, dtype=torch.float64).expand(40, 6)  # stride 0
    strided = torch.randn(80, 6, dtype=torch.float64)[::2]
    for xs in (transposed, expanded, strided):
        out = fscan.associative_scan(add, xs, 0, reverse=reverse, combine_mode=mode)
        assert_trees_close(out, sequential_scan(add, xs, 0, reverse, mode))


@parametrize(mode=MODES, length=[0, 1, 17])
def test_inputs_untouched_and_outputs_fresh(mode, length):
    xs = (torch.randn(length, 3), torch.randn(length, 3))
    before = [x.clone() for x in xs]
    out = fscan.associative_scan(lambda a, b: b, xs, 0, combine_mode=mode)
    for x, x0, o in zip(xs, before, out):
        assert torch.equal(x, x0)
        assert o.untyped_storage().data_ptr() != x.untyped_storage().data_ptr() or length == 0
        assert torch.equal(o, x)  # "last value" operator returns its input unchanged
    o = out[0]
    if length:
        o.add_(1)
        assert torch.equal(xs[0], before[0])


def test_output_is_contiguous_in_input_layout():
    xs = torch.randn(5, 64, 7)
    out = fscan.associative_scan(add, xs, 1)
    assert out.is_contiguous() and out.shape == xs.shape


def test_closure_over_tensor_broadcasts_over_elements():
    w = torch.rand(6, dtype=torch.float64) + 0.5  # shaped like one element
    xs = torch.rand(3, 30, 6, dtype=torch.float64).movedim(1, 1)
    for mode in MODES:
        out = fscan.associative_scan(lambda a, b: a * b * w / w, xs, 1, combine_mode=mode)
        assert_trees_close(out, xs.cumprod(1))


# ---- property tests ---------------------------------------------------------


@st.composite
def scan_problems(draw):
    """A random pytree of 1 to 4 float64 leaves, sharing a scan dimension."""
    ndim = draw(st.integers(1, 4))
    length = draw(st.integers(0, 300))
    dim = draw(st.integers(-ndim, ndim - 1))
    n_leaves = draw(st.integers(1, 4))
    leaves = []
    for _ in range(n_leaves):
        shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
        shape[dim] = length
        leaves.append(torch.randn(shape, dtype=torch.float64))
    layout = draw(st.sampled_from(["tuple", "list", "dict", "nested"]))
    if layout == "tuple":
        tree = tuple(leaves)
    elif layout == "list":
        tree = list(leaves)
    elif layout == "dict":
        tree = {f"k{i}": leaf for i, leaf in enumerate(leaves)}
    else:
        tree = (leaves[0], {"rest": leaves[1:], "none": None})
    return tree, dim, draw(st.booleans()), draw(st.sampled_from(MODES))


def _tree_add(a, b):
    return optree.tree_map(torch.add, a, b, none_is_leaf=False)


def _tree_max(a, b):
    return optree.tree_map(torch.maximum, a, b, none_is_leaf=False)


@settings(max_examples=60, deadline=None)
@given(problem=scan_problems(), op=st.sampled_from([_tree_add, _tree_max]))
def test_property_random_pytrees(problem, op):
    xs, dim, reverse, mode = problem
    out = fscan.associative_scan(op, xs, dim, reverse=reverse, combine_mode=mode)
    assert_trees_close(out, sequential_scan(op, xs, dim, reverse, mode))


@settings(max_examples=40, deadline=None)
@given(
    length=st.integers(0, 300),
    reverse=st.booleans(),
    mode=st.sampled_from(MODES),
    width=st.integers(1, 4),
)
def test_property_linear_recurrence(length, reverse, mode, width):
    a = torch.rand(length, width, dtype=torch.float64) + 0.5
    b = torch.randn(length, width, dtype=torch.float64)
    out = fscan.associative_scan(linear_recurrence, (a, b), 0, reverse, mode)
    assert_trees_close(out, sequential_scan(linear_recurrence, (a, b), 0, reverse, mode))


@settings(max_examples=40, deadline=None)
@given(length=st.integers(0, 200), reverse=st.booleans(), size=st.sampled_from([2, 3]))
def test_property_matrix_products(length, reverse, size):
    xs = torch.randn(length, size, size, dtype=torch.float64) / size**0.5
    out = fscan.associative_scan(matmul, xs, 0, reverse=reverse, combine_mode="generic")
    assert_trees_close(
        out, sequential_scan(matmul, xs, 0, reverse, "generic"), rtol=1e-8, atol=1e-8
    )


@pytest.mark.parametrize("mode", MODES)
def test_generic_mode_sees_single_elements(mode):
    seen = []

    def record(a, b):
        seen.append(a.shape)
        return a + b

    fscan.associative_scan(record, torch.randn(20, 3, 4), 0, combine_mode=mode)
    if mode == "generic":
        assert set(seen) == {torch.Size([3, 4])}
    else:
        assert all(s[1:] == (3, 4) and len(s) == 3 for s in seen)


def test_generic_mode_allows_non_elementwise_functions():
    xs = torch.rand(25, 3, dtype=torch.float64) + 0.5

    def per_component(a, b):  # indexing a single element: sum, max, product
        return torch.stack([a[0] + b[0], torch.maximum(a[1], b[1]), a[2] * b[2]])

    out = fscan.associative_scan(per_component, xs, 0, combine_mode="generic")
    expected = torch.stack([xs[:, 0].cumsum(0), xs[:, 1].cummax(0).values, xs[:, 2].cumprod(0)], 1)
    assert_trees_close(out, expected)
