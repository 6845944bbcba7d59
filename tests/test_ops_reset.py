"""``reset=`` on the drop-ins: segmented cumsum/cumprod/cummax/cummin/logcumsumexp.

The oracle is a loop over segments calling torch's own op on each (flip, op, flip for
``reverse=True``, where a True marks a segment's last element in index order), with
cummax/cummin's indices shifted to positions in the whole input. Values, dtypes,
indices and float64 gradients are compared.
"""

from __future__ import annotations

import pytest
import torch

import fscan
from fscan import ScanTypeError, ScanValueError

SUMS = ["cumsum", "cumprod", "logcumsumexp"]
EXTREMA = ["cummax", "cummin"]
OPS = [*SUMS, *EXTREMA]


def _segments(flags: list[bool], reverse: bool) -> list[tuple[int, int]]:
    """(start, stop) of each segment of one row: a True starts one (ends one, reversed)."""
    n, bounds = len(flags), []
    if reverse:
        start = 0
        for i, f in enumerate(flags):
            if f or i == n - 1:
                bounds.append((start, i + 1))
                start = i + 1
        return bounds
    starts = [0] + [i for i in range(1, n) if flags[i]]
    return list(zip(starts, [*starts[1:], n]))


def _torch_op(name, seg, reverse, start):
    op = getattr(torch, name)
    if name in EXTREMA:
        if reverse:
            values, indices = op(seg.flip(0), 0)
            return values.flip(0), (seg.shape[0] - 1 - indices).flip(0) + start
        values, indices = op(seg, 0)
        return values, indices + start
    promote = name != "logcumsumexp" and not seg.is_floating_point()
    kw = {"dtype": torch.int64} if promote else {}
    return op(seg.flip(0), 0, **kw).flip(0) if reverse else op(seg, 0, **kw)


def oracle(name, x, dim, reset, reverse=False):
    """torch's op run on each segment of each row, the rows put back together."""
    dim %= x.ndim
    mask = reset if reset.ndim == x.ndim else reset.reshape([-1] + [1] * (x.ndim - 1 - dim))
    mask = mask.expand(x.shape).movedim(dim, -1).reshape(-1, x.shape[dim])
    rows = x.movedim(dim, -1).reshape(-1, x.shape[dim])
    outs = []
    for row, flags in zip(rows, mask.tolist()):
        parts = [_torch_op(name, row[a:b], reverse, a) for a, b in _segments(flags, reverse)]
        if name in EXTREMA:
            outs.append((torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
        else:
            outs.append(torch.cat(parts))
    moved = list(x.movedim(dim, -1).shape)

    def back(ts):
        return torch.stack(ts).reshape(moved).movedim(-1, dim)

    if name in EXTREMA:
        return back([o[0] for o in outs]), back([o[1] for o in outs])
    return back(outs)


def check(name, x, dim, reset, reverse=False):
    got = getattr(fscan, name)(x, dim, reset=reset, reverse=reverse)
    want = oracle(name, x, dim, reset, reverse)
    if name in EXTREMA:
        assert type(got) is getattr(torch.return_types, name)
        torch.testing.assert_close(got.values, want[0], equal_nan=True)
        torch.testing.assert_close(got.indices, want[1])
    else:
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, equal_nan=True)
    return got


def _data(name, dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x = x * 0.5 + 1.0 if name == "cumprod" else x
        return x.to(dtype)
    return torch.randint(-3, 4, shape, generator=g, dtype=dtype)


DTYPES = [torch.float32, torch.float64, torch.int64]


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("broadcast", [False, True])
def test_matches_a_loop_over_segments(name, dtype, dim, reverse, broadcast):
    if name == "logcumsumexp" and not dtype.is_floating_point:
        pytest.skip("torch's logcumsumexp takes float inputs")
    x = _data(name, dtype, (7, 3, 5))
    d = dim % x.ndim
    n = x.shape[d]
    g = torch.Generator().manual_seed(1)
    if broadcast:  # per-row boundaries: size 1 on the middle dimension
        shape = [1 if i == 1 and i != d else x.shape[i] for i in range(x.ndim)]
        reset = torch.rand(shape, generator=g) < 0.3
    else:
        reset = torch.rand(n, generator=g) < 0.3
        reset[0] = True  # a reset at the first step
        reset[2:4] = True  # consecutive resets
    check(name, x, dim, reset, reverse)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("reverse", [False, True])
def test_no_resets_is_the_plain_op_and_all_resets_the_input(name, reverse):
    x = _data(name, torch.float64, (6, 4))
    none = torch.zeros(6, dtype=torch.bool)
    got = getattr(fscan, name)(x, 0, reset=none, reverse=reverse)
    plain = getattr(fscan, name)(x, 0, reverse=reverse)
    if name in EXTREMA:
        torch.testing.assert_close(got.values, plain.values)
        torch.testing.assert_close(got.indices, plain.indices)
    else:
        torch.testing.assert_close(got, plain)
    every = torch.ones(6, dtype=torch.bool)
    got = getattr(fscan, name)(x, 0, reset=every, reverse=reverse)
    if name in EXTREMA:
        torch.testing.assert_close(got.values, x)
        torch.testing.assert_close(got.indices, torch.arange(6).unsqueeze(1).expand(6, 4))
    else:
        torch.testing.assert_close(got, x)


def test_integer_and_bool_cumsum_promote_to_int64():
    reset = torch.tensor([False, True, False])
    assert fscan.cumsum(torch.tensor([True, True, True]), 0, reset=reset).tolist() == [1, 1, 2]
    out = fscan.cumprod(torch.tensor([2, 3, 4], dtype=torch.int8), 0, reset=reset)
    assert out.dtype == torch.int64 and out.tolist() == [2, 3, 12]
    out = fscan.cumsum(torch.tensor([1, 2, 3]), 0, reset=reset, dtype=torch.float64)
    assert out.dtype == torch.float64 and out.tolist() == [1.0, 2.0, 5.0]


@pytest.mark.parametrize("name", EXTREMA)
@pytest.mark.parametrize("reverse", [False, True])
def test_ties_and_whole_input_indices(name, reverse):
    x = torch.tensor([2.0, 2.0, 1.0, 5.0, 5.0, 5.0, 0.0, 5.0])
    reset = torch.tensor([False, False, False, True, False, False, True, False])
    got = check(name, x, 0, reset, reverse)
    if not reverse and name == "cummax":
        assert got.indices.tolist() == [0, 1, 1, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("reverse", [False, True])
def test_nan_and_inf_per_segment_as_torch(name, reverse):
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([1.0, nan, 2.0, 3.0, nan, -inf, 4.0, inf, 1.0])
    reset = torch.tensor([False, False, True, False, False, True, False, True, False])
    check(name, x, 0, reset, reverse)


@pytest.mark.parametrize("name", ["cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"])
@pytest.mark.parametrize("reverse", [False, True])
def test_gradients_match_the_loop(name, reverse):
    x = _data(name, torch.float64, (6, 3)).requires_grad_()
    reset = torch.tensor([True, False, True, True, False, False])

    def fscan_values(t):
        out = getattr(fscan, name)(t, 0, reset=reset, reverse=reverse)
        return out.values if name in EXTREMA else out

    def loop_values(t):
        out = oracle(name, t, 0, reset, reverse)
        return out[0] if name in EXTREMA else out

    assert torch.autograd.gradcheck(fscan_values, (x,))
    cotangent = torch.randn(6, 3, dtype=torch.float64)
    (got,) = torch.autograd.grad(fscan_values(x), x, cotangent)
    (want,) = torch.autograd.grad(loop_values(x), x, cotangent)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", OPS)
def test_bad_masks_name_reset(name):
    x = torch.randn(5, 3)
    fn = getattr(fscan, name)
    with pytest.raises(ScanTypeError, match="`reset`"):
        fn(x, 0, reset=torch.zeros(5))
    with pytest.raises(ScanValueError, match=r"`reset`.*length 4"):
        fn(x, 0, reset=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ScanValueError, match="`reset`"):
        fn(x, 0, reset=torch.zeros(5, 2, dtype=torch.bool))
    with pytest.raises(ScanTypeError, match=f"fscan.{name}"):
        fn(x, 0, reset=[True] * 5)


def test_zero_dim_and_empty_inputs():
    got = fscan.cummin(torch.tensor(3.0), 0, reset=torch.tensor([True]))
    assert got.values.item() == 3.0 and got.indices.item() == 0
    empty = torch.ones(2, 0)
    assert fscan.cumsum(empty, 1, reset=torch.zeros(0, dtype=torch.bool)).shape == (2, 0)


def test_out_with_reset():
    out = torch.empty(4)
    reset = torch.tensor([False, False, True, False])
    assert fscan.cumsum(torch.ones(4), 0, reset=reset, out=out) is out
    assert out.tolist() == [1.0, 2.0, 1.0, 2.0]


def test_compiles():
    reset = torch.tensor([False, True, False, False, True, False])

    def f(x):
        return fscan.cumsum(x, 0, reset=reset), fscan.cummax(x, 0, reset=reset).indices

    x = torch.randn(6, 2)
    got = torch.compile(f, backend="eager", fullgraph=True)(x)
    want = f(x)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


def test_the_log_names_the_scan_that_ran(caplog):
    reset = torch.tensor([False, True, False, False])
    with caplog.at_level("DEBUG", logger="fscan"):
        fscan.cummin(torch.ones(4), 0, reset=reset)
    (record,) = [r for r in caplog.records if r.fscan_api == "fscan.cummin"]
    assert record.fscan_engine in ("tree", "cpp")  # the kernel, once another test built it
    assert record.fscan_refused == {"native": "torch's op has no reset="}


def test_no_reset_keeps_torchs_op():
    x = torch.randn(64)
    torch.testing.assert_close(fscan.cumsum(x, 0, reset=None), torch.cumsum(x, 0))


@pytest.mark.parametrize("name", ["cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"])
def test_inference_mode_on_the_pair_scan(name, monkeypatch):
    """Under inference_mode the segmented combine's `|` reaches aten.__or__, which torch
    leaves untagged: it must not be taken for a non-elementwise op (the pair scan, the
    kernel off)."""
    monkeypatch.setattr(fscan.config, "cpu_kernel", "off")
    x = torch.randn(12, 3, dtype=torch.float64)
    mask = torch.zeros(12, dtype=torch.bool)
    mask[[0, 5, 6]] = True
    want = getattr(fscan, name)(x, 0, reset=mask)
    fscan.clear_caches()
    with torch.inference_mode():
        got = getattr(fscan, name)(x, 0, reset=mask)
    for g, w in zip(
        got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)
    ):
        assert torch.equal(g, w)
