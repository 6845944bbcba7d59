"""Segmented scans (``reset=``) against a sequential per-segment reference."""

from __future__ import annotations

import optree
import torch
from helpers import (
    add,
    affine_compose,
    assert_trees_close,
    linear_recurrence,
    matmul,
    maximum,
    mul,
    parametrize,
    raises,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import fscan

MODES = ["pointwise", "generic"]


def segmented_reference(combine_fn, xs, dim, reverse, reset):
    """A plain loop over single elements: restart at every flagged step."""
    leaves, spec = optree.tree_flatten(xs, none_is_leaf=False)
    n = leaves[0].shape[dim]
    if n == 0:
        return optree.tree_map(torch.clone, xs, none_is_leaf=False)
    order = range(n - 1, -1, -1) if reverse else range(n)
    results, acc = {}, None
    for i in order:
        element = [x.select(dim, i) for x in leaves]
        if acc is None or bool(reset[i]):
            acc = element
        else:
            out = combine_fn(optree.tree_unflatten(spec, acc), optree.tree_unflatten(spec, element))
            acc = optree.tree_leaves(out, none_is_leaf=False)
        results[i] = acc
    out = [torch.stack([results[i][k] for i in range(n)], dim) for k in range(len(leaves))]
    return optree.tree_unflatten(spec, out)


def random_reset(n, p=0.3, generator=None):
    return torch.rand(n, generator=generator) < p


@parametrize(
    op=[add, mul, maximum], mode=MODES, reverse=[False, True], length=[0, 1, 2, 5, 33, 200]
)
def test_elementwise_operators(op, mode, reverse, length):
    xs = torch.rand(length, 3, dtype=torch.float64) + 0.5
    reset = random_reset(length)
    out = fscan.associative_scan(op, xs, 0, reverse, mode, reset=reset)
    assert_trees_close(out, segmented_reference(op, xs, 0, reverse, reset))


@parametrize(mode=MODES, reverse=[False, True], dim=[0, 1, 2, -1])
def test_dims_and_pytrees(mode, reverse, dim):
    shape = [4, 5, 3]
    shape[dim] = 40
    xs = {
        "w": torch.rand(shape, dtype=torch.float64),
        "c": torch.randn(shape, dtype=torch.float64),
    }
    reset = random_reset(40)
    out = fscan.associative_scan(affine_compose, xs, dim, reverse, mode, reset=reset)
    assert_trees_close(out, segmented_reference(affine_compose, xs, dim, reverse, reset))


@parametrize(reverse=[False, True])
def test_generic_mode_matrix_products(reverse):
    xs = torch.randn(30, 3, 3, dtype=torch.float64) / 2
    reset = random_reset(30)
    out = fscan.associative_scan(matmul, xs, 0, reverse, "generic", reset=reset)
    assert_trees_close(out, segmented_reference(matmul, xs, 0, reverse, reset))


def test_every_step_reset_returns_the_input_and_none_is_a_plain_scan():
    xs = torch.randn(50, 2, dtype=torch.float64)
    everywhere = torch.ones(50, dtype=torch.bool)
    assert torch.equal(fscan.associative_scan(add, xs, 0, reset=everywhere), xs)
    nowhere = torch.zeros(50, dtype=torch.bool)
    assert_trees_close(fscan.associative_scan(add, xs, 0, reset=nowhere), xs.cumsum(0))


@parametrize(mode=MODES, reverse=[False, True])
def test_per_row_mask(mode, reverse):
    """A (T, B, 1) mask: every batch row has its own segments (episode boundaries)."""
    xs = (torch.rand(60, 4, 3, dtype=torch.float64), torch.randn(60, 4, 3, dtype=torch.float64))
    reset = torch.rand(60, 4, 1) < 0.2
    out = fscan.associative_scan(linear_recurrence, xs, 0, reverse, mode, reset=reset)
    for row in range(4):
        row_xs = (xs[0][:, row], xs[1][:, row])
        expected = segmented_reference(linear_recurrence, row_xs, 0, reverse, reset[:, row, 0])
        assert_trees_close((out[0][:, row], out[1][:, row]), expected)


@parametrize(mode=MODES, reverse=[False, True])
def test_gradients(mode, reverse):
    a = (torch.rand(25, 2, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(25, 2, dtype=torch.float64, requires_grad=True)
    reset = random_reset(25)

    def scan(a, b):
        return fscan.associative_scan(linear_recurrence, (a, b), 0, reverse, mode, reset=reset)

    assert torch.autograd.gradcheck(scan, (a, b))


def test_packed_sequences_match_separate_scans():
    lengths = [7, 1, 12, 5]
    xs = torch.randn(sum(lengths), 3, dtype=torch.float64)
    starts = torch.zeros(sum(lengths), dtype=torch.bool)
    starts[torch.tensor([0, 7, 8, 20])] = True
    out = fscan.associative_scan(add, xs, 0, reset=starts)
    expected = torch.cat([part.cumsum(0) for part in xs.split(lengths)])
    assert_trees_close(out, expected)


@settings(max_examples=30, deadline=None)
@given(
    length=st.integers(0, 120),
    p=st.floats(0.0, 1.0),
    reverse=st.booleans(),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 2**16),
)
def test_property_random_masks(length, p, reverse, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = torch.randn(length, 2, dtype=torch.float64, generator=gen)
    reset = random_reset(length, p, gen)
    out = fscan.associative_scan(add, xs, 0, reverse, mode, reset=reset)
    assert_trees_close(out, segmented_reference(add, xs, 0, reverse, reset))


# ---- errors --------------------------------------------------------------------


def test_mask_must_be_bool():
    with raises(fscan.ScanTypeError, "`reset` must be a bool tensor, got tensor of shape (5,)"):
        fscan.associative_scan(add, torch.ones(5), 0, reset=torch.ones(5))


def test_mask_length():
    with raises(fscan.ScanValueError, "`reset` has length 4, expected 5, the length of dim 0."):
        fscan.associative_scan(add, torch.ones(5, 2), 0, reset=torch.ones(4, dtype=torch.bool))


def test_mask_shape():
    with raises(
        fscan.ScanValueError,
        "fscan.associative_scan: `reset` of shape (5, 3) does not fit leaf xs of shape (5, 2)",
    ):
        fscan.associative_scan(add, torch.ones(5, 2), 0, reset=torch.ones(5, 3, dtype=torch.bool))


def test_combine_fn_errors_name_the_users_leaves():
    with raises(fscan.CombineFnError, "for leaf xs[1]"):
        fscan.associative_scan(
            lambda x, y: (x[0] + y[0], (x[1] + y[1])[:1]),
            (torch.ones(6, 2), torch.ones(6, 2)),
            0,
            reset=torch.zeros(6, dtype=torch.bool),
        )
