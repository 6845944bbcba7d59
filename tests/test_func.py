"""torch.func transforms and forward-mode AD through fscan.associative_scan."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from helpers import affine_compose, linear_recurrence, matmul, parametrize, sequential_scan
from torch.func import grad, jacfwd, jacrev, jvp, vjp, vmap

import fscan

# torch's forward-mode AD scripts its decompositions on first use, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")

MODES = ["pointwise", "generic"]
F64 = torch.float64


def scan_fn(combine_fn, dim=0, reverse=False, mode="pointwise"):
    return lambda *xs: fscan.associative_scan(
        combine_fn, xs if len(xs) > 1 else xs[0], dim, reverse=reverse, combine_mode=mode
    )


def oracle_fn(combine_fn, dim=0, reverse=False, mode="pointwise"):
    return lambda *xs: sequential_scan(combine_fn, xs if len(xs) > 1 else xs[0], dim, reverse, mode)


def linrec_inputs(*shape):
    return torch.rand(*shape, dtype=F64) + 0.5, torch.randn(*shape, dtype=F64)


@parametrize(mode=MODES, reverse=[False, True], transform=[jacrev, jacfwd])
def test_jacobians(mode, reverse, transform):
    a, b = linrec_inputs(7, 2)
    got = transform(scan_fn(linear_recurrence, 0, reverse, mode), argnums=(0, 1))(a, b)
    want = transform(oracle_fn(linear_recurrence, 0, reverse, mode), argnums=(0, 1))(a, b)
    torch.testing.assert_close(got, want)


@parametrize(mode=MODES, dim=[0, 1])
def test_grad_vjp_jvp(mode, dim):
    a, b = linrec_inputs(6, 9) if dim == 1 else linrec_inputs(9, 6)
    f, ref = (
        scan_fn(linear_recurrence, dim, True, mode),
        oracle_fn(linear_recurrence, dim, True, mode),
    )
    loss = lambda fn: lambda a, b: (fn(a, b)[1] ** 2).sum()
    torch.testing.assert_close(grad(loss(f), (0, 1))(a, b), grad(loss(ref), (0, 1))(a, b))
    cot = (torch.randn_like(a), torch.randn_like(b))
    torch.testing.assert_close(vjp(f, a, b)[1](cot), vjp(ref, a, b)[1](cot))
    torch.testing.assert_close(jvp(f, (a, b), cot), jvp(ref, (a, b), cot))


@parametrize(mode=MODES)
def test_matrix_products_jacrev_generic(mode):
    mats = torch.randn(6, 2, 2, dtype=F64)
    got = jacrev(scan_fn(matmul, 0, False, "generic"))(mats)
    torch.testing.assert_close(got, jacrev(oracle_fn(matmul, 0, False, "generic"))(mats))


@parametrize(mode=MODES, batch_dim=[0, 1, 2], reverse=[False, True])
def test_vmap_batch_dim_before_at_after_scan_dim(mode, batch_dim, reverse):
    # the scan runs over logical dim 0 of a (9, 3) element; the batch of 4 sits at batch_dim
    a, b = (t.movedim(0, batch_dim) for t in linrec_inputs(4, 9, 3))
    got = vmap(scan_fn(linear_recurrence, 0, reverse, mode), in_dims=batch_dim)(a, b)
    want = vmap(oracle_fn(linear_recurrence, 0, reverse, mode), in_dims=batch_dim)(a, b)
    torch.testing.assert_close(got, want)


@parametrize(mode=MODES)
def test_nested_vmap_and_vmap_of_grad(mode):
    a, b = linrec_inputs(2, 3, 8, 2)
    nested = lambda fn: vmap(vmap(fn, in_dims=(0, 0)), in_dims=(1, 1))
    f, ref = (
        scan_fn(linear_recurrence, 0, False, mode),
        oracle_fn(linear_recurrence, 0, False, mode),
    )
    torch.testing.assert_close(nested(f)(a, b), nested(ref)(a, b))
    loss = lambda fn: lambda a, b: fn(a, b)[1].sum()
    per_example = lambda fn: vmap(grad(loss(fn), argnums=(0, 1)))(a[0], b[0])
    torch.testing.assert_close(per_example(f), per_example(ref))


@parametrize(mode=MODES)
def test_vmap_runs_one_scan_over_the_batch(mode):
    calls = []

    def counted(x, y):
        calls.append(1)
        return affine_compose(x, y)

    xs = {"w": torch.rand(40, 3, dtype=F64), "c": torch.randn(40, 3, dtype=F64)}
    scan = vmap(lambda t: fscan.associative_scan(counted, t, 0, combine_mode=mode))
    counts = []
    for batch in (2, 2, 16):  # the first call also runs one-time checks
        calls.clear()
        out = scan({k: v.expand(batch, 40, 3) for k, v in xs.items()})
        counts.append(len(calls))
    # as many combine calls for 16 examples as for 2, and O(log n) of them
    assert counts[1] == counts[2] <= 3 * 6
    torch.testing.assert_close(out["c"][5], sequential_scan(affine_compose, xs, 0)["c"])


@parametrize(mode=MODES)
def test_grad_of_closed_over_tensor(mode):
    x = torch.rand(7, 3, dtype=F64) + 0.5
    s = torch.rand(3, dtype=F64) + 0.5

    def loss(fn):
        return lambda s: fn(lambda a, b: a * b * s, 0, False, mode)(x).sum()

    torch.testing.assert_close(grad(loss(scan_fn))(s), grad(loss(oracle_fn))(s))


@parametrize(mode=MODES)
def test_forward_mode_dual_tensors(mode):
    a, b = linrec_inputs(10, 2)
    ta, tb = torch.randn_like(a), torch.randn_like(b)
    with fwAD.dual_level():
        out = scan_fn(linear_recurrence, 0, False, mode)(
            fwAD.make_dual(a, ta), fwAD.make_dual(b, tb)
        )
        tangents = [fwAD.unpack_dual(o).tangent for o in out]
    _, want = jvp(oracle_fn(linear_recurrence, 0, False, mode), (a, b), (ta, tb))
    torch.testing.assert_close(tuple(tangents), want)


@parametrize(mode=MODES)
def test_empty_scan_dim_under_transforms(mode):
    x = torch.randn(0, 3, dtype=F64)
    g = grad(lambda x: scan_fn(torch.mul, 0, False, mode)(x).sum())(x)
    assert g.shape == (0, 3)
    assert vmap(scan_fn(torch.mul, 0, False, mode), in_dims=1)(x).shape == (3, 0)
