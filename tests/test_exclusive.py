"""``exclusive=True`` on every door: the carry into each step, against a sequential oracle.

The oracle walks the steps in scan order with the carry, as the definition says: the
output at a step is the carry into it (the start value at the first step and wherever
``reset=`` starts a segment), then the step is combined in. It runs in float64 (int64
for integers) with differentiable torch ops, so it gives the gradients too.
"""

from __future__ import annotations

import math
import re

import optree
import pytest
import torch
from helpers import parametrize

import fscan
from fscan import ScanTypeError, ScanValueError
from fscan._engines.cpp.cpu_kernel import compiler_problem, counters
from fscan._routing.cumulative import path

OPS = ["cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"]
EXTREMA = ("cummax", "cummin")


# ---- the oracles ------------------------------------------------------------------------


def _order(n: int, reverse: bool) -> range:
    return range(n - 1, -1, -1) if reverse else range(n)


def _mask_at(reset, x: torch.Tensor, dim: int) -> torch.Tensor | None:
    """``reset`` (1-D or with ``x``'s dimensions) broadcast to ``x`` with ``dim`` first."""
    if reset is None:
        return None
    dim = dim % x.ndim
    if reset.ndim == 1 and x.ndim != 1:
        reset = reset.reshape([-1 if i == dim else 1 for i in range(x.ndim)])
    return reset.expand(x.shape).movedim(dim, 0)


def _identity(name: str, dtype: torch.dtype):
    if name == "cumsum":
        return 0
    if name == "cumprod":
        return 1
    if name == "logcumsumexp":
        return -math.inf
    largest = name == "cummax"
    if dtype == torch.bool:
        return not largest
    if dtype.is_floating_point:
        return -math.inf if largest else math.inf
    return torch.iinfo(dtype).min if largest else torch.iinfo(dtype).max


def drop_in_oracle(name, x, dim, reverse=False, reset=None):
    """The exclusive drop-in, step by step: (values,) or (values, indices)."""
    if name in ("cumsum", "cumprod") and not x.is_floating_point():
        x = x.to(torch.int64)
    dim = dim % x.ndim
    wide = x.to(torch.float64) if x.is_floating_point() else x
    xs, mask = wide.movedim(dim, 0), _mask_at(reset, x, dim)
    n = xs.shape[0]
    if n == 0:
        empty = wide.clone()
        return (empty, empty.to(torch.int64)) if name in EXTREMA else (empty,)
    start = torch.full(xs.shape[1:], _identity(name, x.dtype), dtype=wide.dtype)
    start_index = torch.full(xs.shape[1:], -1, dtype=torch.int64)
    carry, index = start, start_index
    values, indices = [None] * n, [None] * n
    for t in _order(n, reverse):
        if mask is not None:
            carry = torch.where(mask[t], start, carry)
            index = torch.where(mask[t], start_index, index)
        values[t], indices[t] = carry, index
        v = xs[t]
        if name == "cumsum":
            carry = carry + v
        elif name == "cumprod":
            carry = carry * v
        elif name == "logcumsumexp":
            carry = torch.logaddexp(carry, v)
        else:  # the later element in scan order wins ties; a NaN stays until a later one
            better = v >= carry if name == "cummax" else v <= carry
            if v.is_floating_point():
                better = better | torch.isnan(v)
            carry = torch.where(better, v, carry)
            index = torch.where(better, torch.full_like(index, t), index)
    out = torch.stack(values).movedim(0, dim)
    if name in EXTREMA:
        return out, torch.stack(indices).movedim(0, dim)
    return (out,)


def scan_oracle(combine_fn, xs, dim, initial, reverse=False, reset=None, generic=False):
    """``fscan.associative_scan(..., exclusive=True)``, step by step (``initial`` at the
    first step and at the resets; the inclusive carry, which a reset restarts at the
    step's element, otherwise)."""
    leaves, spec = optree.tree_flatten(xs)
    n = leaves[0].shape[dim]
    first_leaf = leaves[0]
    mask = _mask_at(reset, first_leaf, dim)
    init = optree.tree_leaves(initial)

    def element(i):
        if generic:
            return [x.select(dim, i) for x in leaves]
        return [x.narrow(dim, i, 1) for x in leaves]

    def start_like(like):
        out = []
        for s, e in zip(init, like):
            if not isinstance(s, torch.Tensor):
                out.append(torch.full(e.shape, s, dtype=e.dtype))
            else:
                out.append((s if generic else s.unsqueeze(dim)).to(e.dtype).expand(e.shape))
        return out

    def where(flag, a, b):
        if flag is None:
            return b
        f = flag if generic else flag.unsqueeze(dim)
        return [torch.where(f, p, q) for p, q in zip(a, b)]

    out, carry = [None] * n, None
    for t in _order(n, reverse):
        e = element(t)
        start = start_like(e)
        flag = None if mask is None else mask[t]
        into = start if carry is None else where(flag, start, carry)
        out[t] = into
        combined = optree.tree_leaves(
            combine_fn(optree.tree_unflatten(spec, into), optree.tree_unflatten(spec, e))
        )
        carry = where(flag, e, combined)
    join = torch.stack if generic else torch.cat
    return optree.tree_unflatten(spec, [join([o[i] for o in out], dim) for i in range(len(leaves))])


def recurrence_oracle(kind, a, b, dim, initial=None, reverse=False, reset=None):
    """The state entering each step of ``kind`` ("linear" or "log")."""
    zero = -math.inf if kind == "log" else 0.0
    step = b.shape[:dim] + b.shape[dim + 1 :]
    h = torch.full(step, zero, dtype=b.dtype) if initial is None else initial.expand(step)
    n = b.shape[dim]
    mask = _mask_at(reset, b, dim)
    a = torch.as_tensor(a, dtype=b.dtype).expand(b.shape).movedim(dim, 0)
    bs = b.movedim(dim, 0)
    out = [None] * n
    for t in _order(n, reverse):
        if mask is not None:
            h = torch.where(mask[t], zero, h)
        out[t] = h
        h = a[t] * h + bs[t] if kind == "linear" else torch.logaddexp(a[t] + h, bs[t])
    return torch.stack(out).movedim(0, dim)


def _close(got, want, dtype):
    if dtype.is_floating_point:
        tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 1e-2)
        torch.testing.assert_close(
            got.to(torch.float64), want.to(torch.float64), rtol=tol, atol=tol
        )
    else:
        assert torch.equal(got, want.to(got.dtype)), (got, want)


# ---- the drop-ins -------------------------------------------------------------------------

SHAPES = [((7,), 0), ((5, 4), 0), ((5, 4), 1), ((5, 4), -1), ((3, 6, 2), 1)]


def _input(name, shape, dtype, generator_seed=0):
    g = torch.Generator().manual_seed(generator_seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point:
        return torch.randint(-3, 4, shape, generator=g).to(dtype)
    if name in EXTREMA:  # ties
        return torch.randint(-3, 4, shape, generator=g).to(dtype)
    if name == "cumprod":
        return (torch.rand(shape, generator=g) + 0.5).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _reset_for(kind, shape, dim):
    n = shape[dim]
    g = torch.Generator().manual_seed(1)
    if kind is None:
        return None
    if kind == "steps":
        return torch.rand(n, generator=g) < 0.35
    rows = [n if i == dim % len(shape) else s for i, s in enumerate(shape)]
    rows[-1 if dim % len(shape) != len(shape) - 1 else 0] = 1
    return torch.rand(rows, generator=g) < 0.35


def _drop_in(name, x, dim, **kw):
    out = getattr(fscan, name)(x, dim, exclusive=True, **kw)
    return tuple(out) if name in EXTREMA else (out,)


@parametrize(
    name=OPS,
    shape_dim=SHAPES,
    reverse=[False, True],
    reset=[None, "steps", "rows"],
)
def test_drop_ins_match_the_oracle(name, shape_dim, reverse, reset):
    shape, dim = shape_dim
    if reset == "rows" and len(shape) == 1:
        pytest.skip("a 1-D input has no rows")
    mask = _reset_for(reset, shape, dim)
    for dtype in (torch.float64, torch.float32):
        x = _input(name, shape, dtype)
        got = _drop_in(name, x, dim, reverse=reverse, reset=mask)
        want = drop_in_oracle(name, x, dim, reverse, mask)
        assert got[0].dtype == dtype and got[0].shape == x.shape
        _close(got[0], want[0], dtype)
        if name in EXTREMA:
            assert torch.equal(got[1], want[1])


@parametrize(
    name=["cumsum", "cumprod", "cummax", "cummin"],
    dtype=[torch.int8, torch.int32, torch.int64, torch.bool],
    reverse=[False, True],
    reset=[None, "steps"],
)
def test_drop_ins_on_integers_and_bool(name, dtype, reverse, reset):
    x = _input(name, (6, 3), dtype)
    mask = _reset_for(reset, (6, 3), 0)
    got = _drop_in(name, x, 0, reverse=reverse, reset=mask)
    want = drop_in_oracle(name, x, 0, reverse, mask)
    expected = torch.int64 if name in ("cumsum", "cumprod") else dtype
    assert got[0].dtype == expected
    assert torch.equal(got[0], want[0].to(expected))
    if name in EXTREMA:
        assert torch.equal(got[1], want[1])


def test_extrema_start_from_the_dtype_bounds_with_index_minus_one():
    for dtype in (torch.int16, torch.uint8, torch.float16, torch.bool):
        x = torch.ones(3, dtype=dtype)
        top, low = fscan.cummax(x, 0, exclusive=True), fscan.cummin(x, 0, exclusive=True)
        bound = torch.finfo if dtype.is_floating_point else torch.iinfo
        if dtype == torch.bool:
            assert (top.values[0].item(), low.values[0].item()) == (False, True)
        elif dtype.is_floating_point:
            assert (top.values[0].item(), low.values[0].item()) == (-math.inf, math.inf)
        else:
            assert top.values[0] == bound(dtype).min and low.values[0] == bound(dtype).max
        assert top.indices.tolist() == [-1, 0, 1] and low.indices.tolist() == [-1, 0, 1]


def test_extrema_nan_and_indices_are_positions_in_the_whole_input():
    x = torch.tensor([1.0, math.nan, 3.0, math.nan, 0.0])
    for reverse in (False, True):
        for name in EXTREMA:
            got = _drop_in(name, x, 0, reverse=reverse)
            want = drop_in_oracle(name, x, 0, reverse)
            torch.testing.assert_close(got[0], want[0].float(), equal_nan=True)
            assert torch.equal(got[1], want[1])


@parametrize(name=OPS, reverse=[False, True])
def test_drop_ins_short_and_empty(name, reverse):
    for shape in ((0,), (1,), (2,), (0, 3), (1, 3)):
        x = torch.randn(shape, dtype=torch.float64)
        got = _drop_in(name, x, 0, reverse=reverse)
        want = drop_in_oracle(name, x, 0, reverse)
        for g, w in zip(got, want):
            assert g.shape == x.shape
            torch.testing.assert_close(g, w)
    scalar = _drop_in(name, torch.tensor(2.0), 0, reverse=reverse)  # 0-d: one step
    assert scalar[0].ndim == 0 and scalar[0].item() == _identity(name, torch.float32)
    if name in EXTREMA:
        assert scalar[1].item() == -1


@parametrize(name=OPS, reverse=[False, True], reset=[None, "steps", "rows"])
def test_drop_in_gradients(name, reverse, reset):
    shape = (5, 3)
    mask = _reset_for(reset, shape, 0)
    x = torch.randn(shape, dtype=torch.float64)
    if name in EXTREMA:  # distinct values: the gradient is defined
        x = torch.randperm(15).reshape(shape).to(torch.float64)
    if name == "cumprod":
        x = x.abs() + 0.5
    x.requires_grad_()

    def fscan_fn(x):
        return _drop_in(name, x, 0, reverse=reverse, reset=mask)[0]

    # finite differences of the infinite start values (-inf - -inf) are NaN: zeroed
    torch.autograd.gradcheck(lambda x: fscan_fn(x).nan_to_num(posinf=0, neginf=0), (x,))
    cot = torch.randn(shape, dtype=torch.float64)
    (got,) = torch.autograd.grad(fscan_fn(x), x, cot)
    want_out = drop_in_oracle(name, x, 0, reverse, mask)[0]
    (want,) = torch.autograd.grad(want_out, x, cot)
    torch.testing.assert_close(got, want)


@parametrize(name=["cumsum", "cumprod"], reverse=[False, True])
def test_drop_ins_take_dtype_and_out(name, reverse):
    x = torch.tensor([1, 2, 3, 4])
    out = torch.empty(0)
    got = getattr(fscan, name)(x, 0, out=out, exclusive=True, reverse=reverse)
    assert got is out and out.dtype == torch.float32
    assert torch.equal(out, drop_in_oracle(name, x, 0, reverse)[0].float())
    cast = getattr(fscan, name)(x, 0, dtype=torch.float64, exclusive=True, reverse=reverse)
    assert cast.dtype == torch.float64
    values, indices = torch.empty(4), torch.empty(4, dtype=torch.int64)
    fscan.cummax(x.float(), 0, out=(values, indices), exclusive=True, reverse=reverse)
    want = drop_in_oracle("cummax", x.float(), 0, reverse)
    assert torch.equal(values, want[0].float()) and torch.equal(indices, want[1])


def _kernel_compiled() -> bool:
    return fscan.config.cpu_kernel != "off" and compiler_problem() is None


def _shifted_reference(name, x, dim, reverse):
    """The exclusive op from torch's own inclusive op in float64 and a cat (large inputs)."""
    op = getattr(torch, name)
    wide = x.to(torch.float64)
    source = wide.flip(dim) if reverse else wide
    n = x.shape[dim]
    inclusive = op(source.narrow(dim, 0, n - 1), dim)
    start_shape = [1 if i == dim else s for i, s in enumerate(x.shape)]
    if name in EXTREMA:
        values, indices = inclusive
        if reverse:
            indices = n - 1 - indices
        head = torch.full(start_shape, _identity(name, x.dtype), dtype=torch.float64)
        values = torch.cat([head, values], dim)
        indices = torch.cat([torch.full(start_shape, -1), indices], dim)
        return (values.flip(dim), indices.flip(dim)) if reverse else (values, indices)
    head = torch.full(start_shape, _identity(name, x.dtype), dtype=torch.float64)
    out = torch.cat([head, inclusive], dim)
    return (out.flip(dim) if reverse else out,)


@parametrize(
    name=OPS,
    case=[((257, 128), 0, False), ((257, 128), 0, True), ((64, 520), 1, True)],
)
def test_kernel_writes_the_exclusive_drop_in_in_place(name, case):
    shape, dim, reverse = case
    x = _input(name, shape, torch.float32)
    if name in EXTREMA:  # distinct values, or ties broken as in torch
        x = torch.randperm(math.prod(shape)).reshape(shape).float()
    before = (counters.in_place, counters.copies, counters.out_copies)
    got = _drop_in(name, x, dim, reverse=reverse)
    want = _shifted_reference(name, x, dim, reverse)
    for g, w in zip(got, want):
        _close(g, w, g.dtype)
    if _kernel_compiled() and path(getattr(torch, name), x, dim, reverse, exclusive=True) == "cpp":
        wrote = counters.in_place - before[0]
        # the shift straight into the output's later steps, or (the kernel compiled by an
        # earlier call) the kernel's exclusive mode into fresh outputs: no shift at all
        assert wrote in (0, len(got))
        assert (counters.copies, counters.out_copies) == before[1:]


def test_one_lane_kernel_rows():
    x = torch.randn(2**15 + 3)
    for name in ("cumsum", "cumprod", "cummax"):
        got = _drop_in(name, x, 0, reverse=True)
        for g, w in zip(got, _shifted_reference(name, x, 0, True)):
            _close(g, w, g.dtype)


@parametrize(name=["cumsum", "cumprod", "cummax", "cummin"], dtype=[torch.float32, torch.int32])
def test_reversed_exclusive_on_torchs_op(name, dtype):
    """Reversed, on the rows the table gives torch's op: the flipped input's forward
    exclusive scan, flipped back (ties and indices as torch breaks them)."""
    x = torch.randint(-3, 4, (512, 256)).to(dtype)
    op = getattr(torch, name)
    assert path(op, x, 1, True) == "native"
    got = _drop_in(name, x, 1, reverse=True)
    want = _shifted_reference(name, x, 1, True)
    for g, w in zip(got, want):
        _close(g, w, g.dtype)
        assert g.data_ptr() != x.data_ptr()
    wanted = x.clone().requires_grad_(True) if dtype.is_floating_point else None
    if wanted is not None:  # the recorded form agrees
        recorded = _drop_in(name, wanted, 1, reverse=True)
        assert all(torch.equal(r.detach(), g) for r, g in zip(recorded, got))


def test_exclusive_never_writes_the_input():
    x = torch.randn(257, 128)
    copy = x.clone()
    for name in OPS:
        for reverse in (False, True):
            for reset in (None, torch.arange(257) % 7 == 0):
                out = _drop_in(name, x, 0, reverse=reverse, reset=reset)
                assert all(o.data_ptr() != x.data_ptr() for o in out)
    assert torch.equal(x, copy)


# ---- associative_scan ------------------------------------------------------------------


def _affine(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


@parametrize(
    shape_dim=[((6,), 0), ((5, 3), 0), ((5, 3), 1), ((2, 5, 3), -2)],
    reverse=[False, True],
    reset=[None, "steps", "rows"],
    initial=["tensor", "number"],
)
def test_associative_scan_matches_the_oracle(shape_dim, reverse, reset, initial):
    shape, dim = shape_dim
    if reset == "rows" and len(shape) == 1:
        pytest.skip("a 1-D input has no rows")
    mask = _reset_for(reset, shape, dim)
    x = torch.randn(shape, dtype=torch.float64)
    element = shape[: dim % len(shape)] + shape[dim % len(shape) + 1 :]
    init = torch.randn(element, dtype=torch.float64) if initial == "tensor" else 2.5
    got = fscan.associative_scan(
        torch.add, x, dim, reverse, exclusive=True, initial=init, reset=mask
    )
    want = scan_oracle(torch.add, x, dim % len(shape), init, reverse, mask)
    torch.testing.assert_close(got, want)
    # a pytree: the affine maps of a linear recurrence, carried in by an identity map
    a, b = torch.rand(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    start = (torch.ones(element, dtype=torch.float64), torch.randn(element, dtype=torch.float64))
    got = fscan.associative_scan(
        _affine, (a, b), dim, reverse, exclusive=True, initial=start, reset=mask
    )
    want = scan_oracle(_affine, (a, b), dim % len(shape), start, reverse, mask)
    torch.testing.assert_close(got, want)


@parametrize(reverse=[False, True], reset=[None, "steps"])
def test_associative_scan_generic_mode(reverse, reset):
    mats = torch.randn(6, 2, 2, dtype=torch.float64)
    mask = _reset_for(reset, (6,), 0)
    eye = torch.eye(2, dtype=torch.float64)
    got = fscan.associative_scan(
        torch.matmul, mats, 0, reverse, "generic", exclusive=True, initial=eye, reset=mask
    )
    want = scan_oracle(torch.matmul, mats, 0, eye, reverse, mask, generic=True)
    torch.testing.assert_close(got, want)


@parametrize(reverse=[False, True], reset=[None, "steps", "rows"])
def test_associative_scan_gradients(reverse, reset):
    mask = _reset_for(reset, (5, 3), 0)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    init = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def fn(x, init):
        return fscan.associative_scan(
            torch.mul, x, 0, reverse, exclusive=True, initial=init, reset=mask
        )

    torch.autograd.gradcheck(fn, (x, init))
    cot = torch.randn(5, 3, dtype=torch.float64)
    got = torch.autograd.grad(fn(x, init), (x, init), cot)
    want = torch.autograd.grad(scan_oracle(torch.mul, x, 0, init, reverse, mask), (x, init), cot)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@parametrize(reverse=[False, True], reset=[None, "steps"])
def test_associative_scan_on_the_kernel(reverse, reset):
    x = torch.randn(257, 128)
    mask = _reset_for(reset, (257, 128), 0)
    init = torch.randn(128)
    before = counters.in_place
    got = fscan.associative_scan(torch.add, x, 0, reverse, exclusive=True, initial=init, reset=mask)
    want = scan_oracle(torch.add, x.double(), 0, init.double(), reverse, mask)
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
    if _kernel_compiled() and reset is None:
        assert counters.in_place == before + 1  # the kernel wrote the later steps in place


def test_scan_tree_takes_exclusive():
    from fscan._entry import scan_tree

    got = scan_tree(torch.add, torch.ones(4), 0, exclusive=True, initial=1.0)
    assert got.tolist() == [1.0, 2.0, 3.0, 4.0]


# ---- the recurrences -------------------------------------------------------------------


@parametrize(
    kind=["linear", "log"],
    shape_dim=[((6,), 0), ((40, 3), 0), ((3, 40), 1), ((4, 5, 2), 1)],
    gate=["full", "scalar", "channel"],
    reverse=[False, True],
    reset=[None, "steps", "rows"],
    initial=[False, True],
)
def test_recurrences_match_the_oracle(kind, shape_dim, gate, reverse, reset, initial):
    shape, dim = shape_dim
    if reset == "rows" and len(shape) == 1:
        pytest.skip("a 1-D input has no rows")
    mask = _reset_for(reset, shape, dim)
    g = torch.Generator().manual_seed(3)
    b = torch.randn(shape, dtype=torch.float64, generator=g)
    a = {
        "full": torch.rand(shape, dtype=torch.float64, generator=g),
        "scalar": torch.tensor(0.7, dtype=torch.float64),
        "channel": torch.rand(shape[-1], dtype=torch.float64, generator=g),
    }[gate]
    if kind == "log":
        a = a.log()
    element = shape[:dim] + shape[dim + 1 :]
    init = torch.randn(element, dtype=torch.float64, generator=g) if initial else None
    fn = fscan.linear_recurrence if kind == "linear" else fscan.log_linear_recurrence
    got = fn(a, b, dim, initial=init, reverse=reverse, reset=mask, exclusive=True)
    want = recurrence_oracle(kind, a, b, dim, init, reverse, mask)
    torch.testing.assert_close(got, want)


@parametrize(kind=["linear", "log"], reverse=[False, True], reset=[None, "steps"])
def test_recurrence_gradients(kind, reverse, reset):
    mask = _reset_for(reset, (6, 2), 0)
    a = torch.rand(6, 2, dtype=torch.float64).requires_grad_()
    b = torch.randn(6, 2, dtype=torch.float64).requires_grad_()
    init = torch.randn(2, dtype=torch.float64).requires_grad_()
    fn = fscan.linear_recurrence if kind == "linear" else fscan.log_linear_recurrence

    def run(a, b, init):
        gates = a if kind == "linear" else a.log()
        return fn(gates, b, 0, initial=init, reverse=reverse, reset=mask, exclusive=True)

    # log space restarts from -inf: finite differences there are NaN, zeroed
    torch.autograd.gradcheck(lambda *t: run(*t).nan_to_num(neginf=0), (a, b, init))
    cot = torch.randn(6, 2, dtype=torch.float64)
    got = torch.autograd.grad(run(a, b, init), (a, b, init), cot)
    gates = a if kind == "linear" else a.log()
    want_out = recurrence_oracle(kind, gates, b, 0, init, reverse, mask)
    want = torch.autograd.grad(want_out, (a, b, init), cot)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)


@parametrize(reverse=[False, True])
def test_linear_recurrence_on_the_kernel_and_with_acc_dtype(reverse):
    b = torch.randn(257, 128)
    a = torch.rand(257, 128)
    init = torch.randn(128)
    before = counters.in_place
    got = fscan.linear_recurrence(a, b, 0, initial=init, reverse=reverse, exclusive=True)
    want = recurrence_oracle("linear", a.double(), b.double(), 0, init.double(), reverse)
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4)
    if _kernel_compiled():
        assert counters.in_place == before + 1  # the kernel wrote the later steps in place
    half = fscan.linear_recurrence(
        a.bfloat16(), b.bfloat16(), 0, reverse=reverse, exclusive=True, acc_dtype=torch.float32
    )
    assert half.dtype == torch.bfloat16
    want = recurrence_oracle(
        "linear", a.bfloat16().double(), b.bfloat16().double(), 0, None, reverse
    )
    torch.testing.assert_close(half.double(), want, rtol=2e-2, atol=2e-2)


@parametrize(
    gate=["shared", "per_step"],
    reverse=[False, True],
    reset=[None, "steps"],
    initial=[False, True],
    matrix_state=[False, True],
)
def test_matrix_recurrence(gate, reverse, reset, initial, matrix_state):
    g = torch.Generator().manual_seed(5)
    n, d, k = 7, 3, 2
    b = torch.randn((2, n, d, k) if matrix_state else (2, n, d), dtype=torch.float64, generator=g)
    A = 0.5 * torch.randn(
        (d, d) if gate == "shared" else (2, n, d, d), dtype=torch.float64, generator=g
    )
    mask = _reset_for(reset, (n,), 0)
    step = b.shape[:1] + b.shape[2:]
    init = torch.randn(step, dtype=torch.float64, generator=g) if initial else None
    kw = dict(initial=init, reverse=reverse, reset=mask, matrix_state=matrix_state)
    got = fscan.linear_recurrence_matrix(A, b, 1, exclusive=True, **kw)
    want = _matrix_oracle(A, b, init, reverse, mask, matrix_state)
    torch.testing.assert_close(got, want)
    if initial and gate == "per_step":
        A.requires_grad_()
        b.requires_grad_()

        def run(A, b):
            return fscan.linear_recurrence_matrix(A, b, 1, exclusive=True, **kw)

        torch.autograd.gradcheck(run, (A, b))


def _matrix_oracle(A, b, init, reverse, mask, matrix_state):
    z = b if matrix_state else b.unsqueeze(-1)
    n = z.shape[1]
    h = (
        torch.zeros_like(z[:, 0])
        if init is None
        else (init if matrix_state else init.unsqueeze(-1))
    )
    out = [None] * n
    for t in _order(n, reverse):
        if mask is not None and mask[t]:
            h = torch.zeros_like(h)
        out[t] = h
        gate = A if A.ndim == 2 else A[:, t]
        h = gate @ h + z[:, t]
    out = torch.stack(out, 1)
    return out if matrix_state else out.squeeze(-1)


# ---- transforms, compile, export -------------------------------------------------------


def test_vmap():
    x = torch.randn(4, 6, 3)
    init = torch.randn(4, 3)
    mask = torch.tensor([0, 1, 0, 0, 1, 0]) > 0
    cases = [
        (lambda x: fscan.cumsum(x, 0, exclusive=True, reverse=True), (x,)),
        (lambda x: fscan.cummax(x, 0, exclusive=True, reset=mask).indices, (x,)),
        (
            lambda x, i: fscan.associative_scan(torch.add, x, 0, exclusive=True, initial=i),
            (x, init),
        ),
        (lambda x, i: fscan.linear_recurrence(0.5, x, 0, initial=i, exclusive=True), (x, init)),
    ]
    for fn, args in cases:
        got = torch.func.vmap(fn)(*args)
        want = torch.stack([fn(*(a[j] for a in args)) for j in range(4)])
        torch.testing.assert_close(got, want)
    # gradients under a transform
    grad = torch.func.grad(lambda x: fscan.cumprod(x, 0, exclusive=True).sum())(x[0] + 2)
    torch.testing.assert_close(
        grad,
        torch.autograd.functional.vjp(
            lambda x: drop_in_oracle("cumprod", x, 0)[0],
            (x[0] + 2).double(),
            torch.ones(6, 3, dtype=torch.float64),
        )[1].float(),
    )


def test_compile():
    def fn(x, a, init, mask):
        return (
            fscan.cumsum(x, 0, exclusive=True),
            fscan.cummax(x, 1, exclusive=True, reverse=True),
            fscan.associative_scan(torch.add, x, 0, exclusive=True, initial=init, reset=mask),
            fscan.linear_recurrence(a, x, 0, exclusive=True, reset=mask),
        )

    compiled = torch.compile(fn, backend="aot_eager", dynamic=True, fullgraph=True)
    for n in (5, 9):
        x, a = torch.randn(n, 3, requires_grad=True), torch.rand(n, 3)
        init, mask = torch.randn(3), torch.arange(n) % 3 == 1
        got, want = compiled(x, a, init, mask), fn(x, a, init, mask)
        torch.testing.assert_close(got, want)
        (g1,) = torch.autograd.grad(got[2].sum() + got[3].sum(), x)
        (g2,) = torch.autograd.grad(want[2].sum() + want[3].sum(), x)
        torch.testing.assert_close(g1, g2)


def test_export_with_a_dynamic_length():
    class Exclusive(torch.nn.Module):
        def forward(self, xs):
            return fscan.associative_scan(
                torch.add, xs, 0, exclusive=True, initial=torch.zeros(3)
            ) + fscan.cumsum(xs, 0, exclusive=True, reverse=True)

    seq = torch.export.Dim("seq", min=2)
    ep = torch.export.export(Exclusive(), (torch.randn(5, 3),), dynamic_shapes={"xs": {0: seq}})
    for n in (2, 7):
        x = torch.randn(n, 3)
        torch.testing.assert_close(ep.module()(x), Exclusive()(x))


# ---- errors ----------------------------------------------------------------------------


def test_exclusive_must_be_a_bool():
    x = torch.ones(3)
    calls = {
        "fscan.associative_scan": lambda: fscan.associative_scan(
            torch.add, x, 0, exclusive=1, initial=0.0
        ),
        "fscan.linear_recurrence": lambda: fscan.linear_recurrence(0.5, x, 0, exclusive="yes"),
        "fscan.log_linear_recurrence": lambda: fscan.log_linear_recurrence(
            0.0, x, 0, exclusive=None
        ),
        "fscan.linear_recurrence_matrix": lambda: fscan.linear_recurrence_matrix(
            torch.eye(1), x[:, None], 0, exclusive=1
        ),
    }
    for op in OPS:
        calls[f"fscan.{op}"] = lambda op=op: getattr(fscan, op)(x, 0, exclusive=1)
    for api, call in calls.items():
        with pytest.raises(ScanTypeError, match=re.escape(f"{api}: `exclusive` must be a bool")):
            call()


def test_associative_scan_exclusive_needs_initial():
    with pytest.raises(ScanValueError, match=r"exclusive=True needs `initial`.*pass initial="):
        fscan.associative_scan(torch.add, torch.ones(3), 0, exclusive=True)


def test_reset_errors_name_the_whole_input():
    with pytest.raises(ScanValueError, match="`reset` has length 2, expected 4"):
        fscan.cumsum(torch.ones(4), 0, exclusive=True, reset=torch.tensor([True, False]))
    with pytest.raises(ScanValueError, match="`reset` has length 2, expected 4"):
        fscan.associative_scan(
            torch.add, torch.ones(4), 0, exclusive=True, initial=0.0, reset=torch.ones(2) > 0
        )


def test_a_repeated_inclusive_call_does_not_answer_an_exclusive_one():
    x = torch.randn(257, 128)
    for _ in range(3):  # served by the kernel, then by the repeat route
        fscan.associative_scan(torch.add, x, 0)
    with pytest.raises(ScanValueError, match="exclusive=True needs `initial`"):
        fscan.associative_scan(torch.add, x, 0, exclusive=True)
    with pytest.raises(ScanTypeError, match="`exclusive` must be a bool"):
        fscan.associative_scan(torch.add, x, 0, exclusive=1)
