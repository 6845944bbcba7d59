"""The exclusive drop-ins' fast path (``fscan._routing.exclusive.native_first_exclusive``):
torch's op written one step later, before the checks, only where the route table picks
torch's op for the inclusive drop-in and nothing records; its results are the checked
path's, bit for bit, and the oracle's; everything else goes to the checked path."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import parametrize

import fscan
from fscan import _ops
from fscan._engines.cpp.cpu_kernel import kernel_possible
from fscan._routing import exclusive as router
from fscan._routing.cumulative import route

OPS = ["cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"]
EXTREMA = ("cummax", "cummin")


def _sample(shape, dtype, seed=0):
    """Small integers (ties, zeros) as ``dtype``, NaN and +-inf sprinkled in floats."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g).to(torch.float64) / 2
    if dtype.is_complex:
        return torch.complex(x, x.flip(-1)).to(dtype)
    if dtype == torch.bool:
        return x > 0
    if not dtype.is_floating_point:
        return (x * 2).abs().to(dtype)
    if x.numel() > 8:
        flat = x.view(-1)
        flat[torch.randint(0, x.numel(), (6,), generator=g)] = torch.tensor(
            [math.nan, math.inf, -math.inf] * 2, dtype=torch.float64
        )
    return x.to(dtype)


def _checked(name, x, dim, reverse):
    """The drop-in with its fast paths off: the checked path's answer."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_ops, "native_first_exclusive", lambda *args: None)
        patch.setattr(_ops, "repeat_exclusive", lambda *args: None)
        return getattr(fscan, name)(x, dim, reverse=reverse, exclusive=True)


def _shifted(name, x, dim, reverse):
    """The exclusive op by definition: torch's inclusive op (flip, op, flip reversed) of
    the first n - 1 steps in scan order, one step later, the identity first."""
    op = getattr(torch, name)
    source = x.flip(dim) if reverse else x
    n = x.shape[dim]
    found = op(source.narrow(dim, 0, n - 1), dim)
    values = found[0] if name in EXTREMA else found
    start = router.identity(op, values.dtype)
    head = torch.full_like(values.narrow(dim, 0, 1), start)
    values = torch.cat([head, values], dim)
    if name not in EXTREMA:
        return values.flip(dim) if reverse else values
    indices = found[1] if not reverse else n - 1 - found[1]
    indices = torch.cat([torch.full_like(indices.narrow(dim, 0, 1), -1), indices], dim)
    if reverse:
        values, indices = values.flip(dim), indices.flip(dim)
    return op(x, dim).__class__((values, indices))


def _same(got, want):
    """Same type, dtype and shape, equal values (NaN == NaN), indices included."""
    assert type(got) is type(want)
    if not isinstance(want, torch.Tensor):
        assert torch.equal(got.indices, want.indices)
        got, want = got.values, want.values
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@parametrize(
    name=OPS,
    dtype=[torch.float32, torch.float64, torch.int32, torch.uint8, torch.bool, torch.complex64],
)
def test_answers_where_torchs_op_serves_with_the_checked_paths_result(name, dtype):
    base = _sample((2, 36, 460), dtype)  # past NATIVE_BELOW: the table reads every cell
    small = _sample((3, 5, 7), dtype, seed=1)
    layouts = [small, small.transpose(0, 2), base, base.transpose(0, 2), base[:, :, ::2]]
    layouts += [base[:1].expand(3, -1, -1), base[:, :2]]
    op = getattr(torch, name)
    for x in layouts:
        for dim in range(-x.ndim, x.ndim):
            for reverse in (False, True):
                try:
                    want = _shifted(name, x, dim, reverse)
                except RuntimeError:  # torch's op refuses the dtype: so do both paths
                    assert router.native_first_exclusive(op, x, dim, reverse) is None
                    with pytest.raises(RuntimeError):
                        _checked(name, x, dim, reverse)
                    continue
                fast = router.native_first_exclusive(op, x, dim, reverse)
                kernel, parallel = route(op, x, dim % x.ndim, reverse)
                assert (fast is not None) == (not parallel and not (kernel and kernel_possible()))
                if fast is None:
                    continue
                _same(fast, want)
                _same(fast, _checked(name, x, dim, reverse))
                fresh = fast if isinstance(fast, torch.Tensor) else fast.values
                assert fresh.data_ptr() != x.data_ptr()


def test_integers_and_bool_sum_in_int64():
    for dtype in (torch.int8, torch.int32, torch.bool):
        x = _sample((4, 6), dtype)
        for name in ("cumsum", "cumprod"):
            fast = router.native_first_exclusive(getattr(torch, name), x, 1, False)
            assert fast.dtype == torch.int64
            _same(fast, _shifted(name, x, 1, False))


def test_leaves_recorded_short_and_refused_calls_to_the_checked_path(monkeypatch):
    first = router.native_first_exclusive
    x = torch.randn(4, 6)
    grad = x.clone().requires_grad_(True)
    assert first(torch.cumsum, grad, 1, False) is None  # autograd records: the checked path
    with torch.no_grad():
        assert first(torch.cumsum, grad, 1, False) is not None
    inside = []
    torch.func.vmap(lambda row: inside.append(first(torch.cumsum, row, 0, False)) or row)(x)
    assert inside == [None]  # a transform watches
    for short in (torch.tensor(2.0), torch.ones(0), torch.ones(1), torch.ones(3, 1)):
        assert first(torch.cumsum, short, -1, False) is None  # 0-d, or under 2 steps
    assert first(torch.cumsum, x, 2, False) is None  # out of range: fscan's error
    assert first(torch.cumsum, x, True, False) is None  # a bool: no dim
    assert first(torch.cumsum, [1.0, 2.0], 0, False) is None
    assert first(torch.cumsum, x.to_sparse(), 1, False) is None
    assert first(torch.logcumsumexp, torch.ones(3, dtype=torch.int64), 0, False) is None

    class Sub(torch.Tensor):
        pass

    assert first(torch.cumsum, x.as_subclass(Sub), 1, False) is None
    monkeypatch.setattr(router, "_is_compiling", lambda: True)
    assert first(torch.cumsum, x, 1, False) is None


def test_errors_are_the_checked_paths():
    x = torch.ones(3, 4)
    with pytest.raises(fscan.ScanIndexError, match="`dim` 2 is out"):
        fscan.cumsum(x, 2, exclusive=True)
    with pytest.raises(fscan.ScanTypeError, match=r"layout torch\.sparse_coo"):
        fscan.cumsum(x.to_sparse(), 1, exclusive=True)
    with pytest.raises(fscan.ScanTypeError, match="`reverse` must be a bool"):
        fscan.cummax(x, 0, reverse=1, exclusive=True)
    with pytest.raises(fscan.ScanTypeError, match="`exclusive` must be a bool"):
        fscan.cumsum(x, 0, exclusive=1)
    for reverse in (False, True):  # torch's refusal, as the inclusive drop-in's
        with pytest.raises(NotImplementedError, match="not implemented for 'ComplexFloat'"):
            fscan.cummax(x.to(torch.complex64), 0, reverse=reverse, exclusive=True)
