"""Shared test helpers: the sequential oracle, operators, tolerances, sweeps, gradients
and error checks."""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

import optree
import pytest
import torch

import fscan


def sequential_scan(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool = False,
    combine_mode: str = "generic",
) -> Any:
    """The oracle: a plain loop, one element (or one unit-length slice) at a time.

    In generic mode ``combine_fn`` gets single elements; in pointwise mode it gets
    slices of length 1 along ``dim``, so both modes are checked against the same
    meaning: ``out[i] = combine_fn(out[i - 1], xs[i])``.
    """
    leaves, spec = optree.tree_flatten(xs, none_is_leaf=False)
    dim = dim % leaves[0].ndim
    n = leaves[0].shape[dim]
    if n == 0:
        return optree.tree_map(torch.clone, xs, none_is_leaf=False)

    # The elements, all at once: unbind's backward stacks their gradients in one pass,
    # where a select or narrow per element made a gradient the size of the whole input
    # per element (quadratic: seconds of CPU per backward at a few thousand steps).
    pieces = [x.unbind(dim) for x in leaves]
    if combine_mode != "generic":
        pieces = [[p.unsqueeze(dim) for p in ps] for ps in pieces]

    def element(i: int) -> list[torch.Tensor]:
        return [ps[i] for ps in pieces]

    order = range(n - 1, -1, -1) if reverse else range(n)
    results: dict[int, list[torch.Tensor]] = {}
    acc = None
    for i in order:
        if acc is None:
            acc = element(i)
        else:
            out = combine_fn(
                optree.tree_unflatten(spec, acc), optree.tree_unflatten(spec, element(i))
            )
            acc = optree.tree_leaves(out, none_is_leaf=False)
        results[i] = acc
    stack = torch.stack if combine_mode == "generic" else torch.cat
    out_leaves = [stack([results[i][k] for i in range(n)], dim=dim) for k in range(len(leaves))]
    return optree.tree_unflatten(spec, out_leaves)


def sequential_total(fn: Callable, xs: Any, dim: int, reverse: bool, wide: bool = True) -> Any:
    """The reduce of ``xs`` along ``dim`` by a sequential loop in scan order (floating
    leaves in float64 where ``wide``): the oracle of ``fscan.associative_reduce``."""
    leaves, spec = optree.tree_flatten(xs)
    if wide:
        leaves = [x.double() if x.is_floating_point() else x for x in leaves]
    n = leaves[0].shape[dim]
    acc = None
    for t in range(n - 1, -1, -1) if reverse else range(n):
        x = spec.unflatten([w.select(dim, t) for w in leaves])
        acc = x if acc is None else fn(acc, x)
    return acc


def assert_within_sum_bound(total: torch.Tensor, x: torch.Tensor, dim: int) -> None:
    """A float32 sum's total within the kernel's bound of the exact one (csrc/reduce.h,
    sum_rows and dense_sum: blocks of at most 16 elements summed in float32, the rest in
    double, rounded once): ``15 u sum|x| + u |exact|``, u = 2**-24, per lane, with room
    for the double part's own rounding."""
    exact = x.double().sum(dim)
    u = 2.0**-24
    bound = 15 * u * x.double().abs().sum(dim) + u * exact.abs() + 1e-30
    err = (total.double() - exact).abs()
    assert total.dtype == torch.float32 and total.shape == exact.shape
    assert bool((err <= bound * (1 + 1e-9)).all()), f"max error / bound {(err / bound).max():.3g}"


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Per-dtype tolerances for comparing a parallel scan with the oracle."""
    table = {
        torch.float16: dict(rtol=2e-2, atol=2e-2),
        torch.bfloat16: dict(rtol=5e-2, atol=5e-2),
        torch.float32: dict(rtol=1e-4, atol=1e-4),
        torch.float64: dict(rtol=1e-10, atol=1e-10),
        torch.complex64: dict(rtol=1e-4, atol=1e-4),
        torch.complex128: dict(rtol=1e-10, atol=1e-10),
    }
    return table.get(dtype, dict(rtol=0.0, atol=0.0))


def assert_trees_close(actual: Any, expected: Any, **tol: float) -> None:
    """Same structure, and every leaf close with its dtype's tolerance."""
    a_leaves, a_spec = optree.tree_flatten(actual, none_is_leaf=False)
    e_leaves, e_spec = optree.tree_flatten(expected, none_is_leaf=False)
    assert a_spec == e_spec, f"structure {a_spec} != {e_spec}"
    for a, e in zip(a_leaves, e_leaves):
        assert a.shape == e.shape and a.dtype == e.dtype, (a.shape, a.dtype, e.shape, e.dtype)
        torch.testing.assert_close(a, e, **(tol or tolerance(e.dtype)), equal_nan=True)


def parametrize(**axes: list[Any]):
    """Cartesian product of named axes, as one ``pytest.mark.parametrize`` with readable ids."""
    names = list(axes)
    combos = list(itertools.product(*axes.values()))
    ids = ["-".join(f"{k}={_short(v)}" for k, v in zip(names, c)) for c in combos]
    if len(names) == 1:
        combos = [c[0] for c in combos]
    return pytest.mark.parametrize(",".join(names), combos, ids=ids)


def _short(value: Any) -> str:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if callable(value):
        return getattr(value, "__name__", "fn")
    return str(value)


# Operators used across tests. Pairs are associative and mostly non-commutative.
def add(a, b):
    return a + b


def mul(a, b):
    return a * b


def maximum(a, b):
    return torch.maximum(a, b)


def minimum(a, b):
    return torch.minimum(a, b)


def logaddexp(a, b):
    return torch.logaddexp(a, b)


def linear_recurrence(x, y):
    """``(a1, b1), (a2, b2) -> (a1 a2, a2 b1 + b2)``: composes ``h -> a h + b``."""
    a1, b1 = x
    a2, b2 = y
    return a1 * a2, a2 * b1 + b2


def affine_compose(x, y):
    """Compose affine maps given as dicts ``{"w": scale, "c": shift}``; non-commutative."""
    return {"w": x["w"] * y["w"], "c": y["w"] * x["c"] + y["c"]}


def matmul(a, b):
    return a @ b


def cached_verdicts(name: str) -> int:
    """How many fscan knowledge entries hold a ``name`` verdict (``pure``, ``elementwise``,
    ``adjoint``): what the first-call checks cached."""
    from fscan._knowledge.store import entries

    return sum(1 for entry in entries.values() if getattr(entry, name))


def raises(exc: type[BaseException], text: str):
    """``pytest.raises`` for an error whose message contains ``text`` verbatim (no regex)."""
    return pytest.raises(exc, match=re.escape(text))


def oracle_grads(combine_fn, xs, wrt, reverse=False, mode="pointwise", cot=None):
    """Gradients of the sequential oracle's scan along dim 0 with respect to ``wrt``
    (cotangents ``cot``, else ones)."""
    ref = sequential_scan(combine_fn, xs, 0, reverse, mode)
    leaves = optree.tree_leaves(ref)
    cot = cot or [torch.ones_like(r) for r in leaves]
    return torch.autograd.grad(leaves, wrt, cot, allow_unused=True)


def fscan_grads(combine_fn, xs, wrt, reverse=False, mode="pointwise", cot=None):
    """The same gradients as :func:`oracle_grads`, through ``fscan.associative_scan``."""
    out = fscan.associative_scan(combine_fn, xs, 0, reverse, mode)
    leaves = optree.tree_leaves(out)
    cot = cot or [torch.ones_like(r) for r in leaves]
    return torch.autograd.grad(leaves, wrt, cot, allow_unused=True)


def assert_same_grads(got, want):
    """Both None, or close (NaN where the other is NaN), gradient by gradient."""
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, equal_nan=True)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch (and so fscan's kernels) on ``n`` threads inside the block, the count before
    it restored after, also when the block raises."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def ordinary_and_variant(found: list[Any], flag: str, mode: str) -> tuple[Any, Any]:
    """The two READY kernel entries of one key that differ in the variant field ``flag``
    (``"exclusive"``, ``"gather"``), checked to be two kernels whose sources set ``mode``
    (``EXCLUSIVE_MODE``, ``GATHER_MODE``) false and true: (the ordinary one, the variant)."""
    assert sorted(getattr(e, flag) for e in found) == [False, True]
    assert all(e.state.name == "READY" for e in found)
    ordinary, variant = sorted(found, key=lambda e: getattr(e, flag))
    assert ordinary.kernel is not variant.kernel
    assert f"{mode} = false" in ordinary.source
    assert f"{mode} = true" in variant.source
    return ordinary, variant
