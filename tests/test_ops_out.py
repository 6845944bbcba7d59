"""``out=`` and torch's argument names on the drop-ins, side by side with torch's own op.

Every case runs torch's op and fscan's drop-in on fresh copies of the same arguments and
compares what each did: the error type, or the values, dtype, shape and strides written
into ``out``, the object returned, and the warnings. Both of fscan's paths: torch's op
(``native``) and fscan's parallel scan (``parallel``), which writes into ``out`` after.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import parametrize
from test_cpu_kernel import needs_compiler

import fscan
from fscan import _ops
from fscan._engines.cpp import cpu_kernel
from fscan._routing import cumulative as router

SUMS = ["cumsum", "cumprod"]
EXTREMA = ["cummax", "cummin"]
OPS = [*SUMS, "logcumsumexp", *EXTREMA]
PATHS = ["native", "parallel", "first"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Pin the drop-ins' route: torch's op after fscan's checks, or fscan's parallel scan
    where its dtype rules allow it (the call then writes into ``out`` after the scan);
    ``"first"``: as routed, torch's op served before the checks where it can."""
    if request.param == "first":
        return request.param
    wins = request.param == "parallel"

    def route(op, x, dim, reverse):
        _, parallel_bar = router.dtype_refusals(op, x.dtype)
        return False, wins and x.ndim > 0 and parallel_bar is None

    monkeypatch.setattr(router, "route", route)
    monkeypatch.setattr(_ops, "native_first", lambda *args: None)
    monkeypatch.setattr(_ops, "native_first_into", lambda op, x, dim, out: None)
    return request.param


def pin_route(monkeypatch, kernel=True, *routers):
    """Send the drop-ins (and ``routers``' own reads of the table) to the kernel, or to
    torch's op, past the checks: no call served by torch's op before them."""
    table = lambda op, x, d, r: (kernel, False)
    for module in (router, *routers):
        monkeypatch.setattr(module, "route", table)
    monkeypatch.setattr(_ops, "native_first", lambda *args: None)
    monkeypatch.setattr(_ops, "native_first_into", lambda op, x, d, out: None)


def _fresh(value):
    """A copy of a call's argument with its layout kept (its memory copied: strides,
    expanded dims and requires_grad as they were)."""
    if isinstance(value, torch.Tensor):
        copy = torch.empty(0, dtype=value.dtype)
        copy.set_(
            value.untyped_storage().clone(), value.storage_offset(), value.shape, value.stride()
        )
        return copy.requires_grad_(value.requires_grad)
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(v) for v in value)
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    return value


def _run(fn, args, kwargs):
    """(error type or None, result, the out= argument, warning categories)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn(*args, **kwargs)
        except Exception as error:  # the type is compared with torch's
            return type(error), None, kwargs.get("out"), []
    return None, result, kwargs.get("out"), [w.category for w in caught]


def _tensors(value):
    return list(value) if isinstance(value, (tuple, list)) else [value]


def side_by_side(name, args, kwargs):
    """Run torch's op and fscan's drop-in on fresh copies; assert they behaved alike."""
    torch_call, fscan_call = _fresh((args, kwargs)), _fresh((args, kwargs))
    want = _run(getattr(torch, name), *torch_call)
    got = _run(getattr(fscan, name), *fscan_call)
    want_error, want_result, want_out, want_warnings = want
    got_error, got_result, got_out, got_warnings = got
    if want_error is not None:
        assert got_error is not None and issubclass(got_error, want_error), (got_error, want)
        return
    assert got_error is None, got_error
    assert got_warnings == want_warnings
    assert type(got_result) is type(want_result)
    if want_out is not None:  # the out tensors themselves are returned
        assert all(g is o for g, o in zip(_tensors(got_result), _tensors(got_out)))
    for g, w in zip(_tensors(got_result), _tensors(want_result)):
        assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride())
        torch.testing.assert_close(g, w, equal_nan=True, atol=1e-5, rtol=1e-5)


def _x(dtype=torch.float32):
    return (torch.arange(12.0).reshape(3, 4) / 3 - 1.5).to(dtype)


def _out_like(name, shape, dtype=torch.float32, index_dtype=torch.int64):
    if name in EXTREMA:
        return (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=index_dtype))
    return torch.zeros(shape, dtype=dtype)


@parametrize(name=OPS, shape=[(3, 4), (0,), (5,), (2, 6), ()])
def test_out_of_any_shape_is_resized_as_torch_does(name, shape, path):
    # right shape: written in place; empty: resized silently; otherwise: resized, warned
    side_by_side(name, (_x(), 0), {"out": _out_like(name, shape)})


@parametrize(name=OPS)
def test_a_non_contiguous_out_is_written_through_its_strides(name, path):
    def transposed(dtype):
        return torch.zeros(4, 3, dtype=dtype).t()

    out = (
        (transposed(torch.float32), transposed(torch.int64))
        if name in EXTREMA
        else transposed(torch.float32)
    )
    side_by_side(name, (_x(), 1), {"out": out})


@parametrize(
    name=OPS,
    dtypes=[
        (torch.float32, torch.float64),
        (torch.float64, torch.float32),
        (torch.float32, torch.int64),
        (torch.int64, torch.float32),
        (torch.int8, torch.int8),  # wraps in int8, as torch does
        (torch.int8, torch.int16),
        (torch.bool, torch.int32),
        (torch.bool, torch.bool),
        (torch.float32, torch.complex64),
    ],
)
def test_out_dtype_rules_are_torch_s(name, dtypes, path):
    # cumsum/cumprod compute in out's dtype; the others want out in input's dtype
    x_dtype, out_dtype = dtypes
    x = torch.tensor([[100, 100, 100], [1, 0, -1]]).to(x_dtype)
    if x_dtype.is_floating_point:
        x = x / 3
    side_by_side(name, (x, 1), {"out": _out_like(name, (2, 3), out_dtype)})


@parametrize(name=SUMS, dtypes=[(None, torch.float64), (torch.float64, torch.float64)])
def test_dtype_with_out(name, dtypes, path):
    dtype, out_dtype = dtypes
    side_by_side(name, (_x(), 0), {"dtype": dtype, "out": torch.zeros(3, 4, dtype=out_dtype)})


@parametrize(name=SUMS, dtypes=[(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_a_dtype_other_than_out_s_is_refused(name, dtypes):
    dtype, out_dtype = dtypes
    side_by_side(name, (_x(), 0), {"dtype": dtype, "out": torch.zeros(3, 4, dtype=out_dtype)})
    with pytest.raises(RuntimeError, match="dtype"):
        getattr(fscan, name)(_x(), 0, dtype=dtype, out=torch.zeros(3, 4, dtype=out_dtype))


@parametrize(name=EXTREMA, index_dtype=[torch.int32, torch.float32])
def test_indices_out_must_be_int64(name, index_dtype, path):
    side_by_side(name, (_x(), 0), {"out": _out_like(name, (3, 4), index_dtype=index_dtype)})
    with pytest.raises(RuntimeError, match="int64"):
        getattr(fscan, name)(_x(), 0, out=_out_like(name, (3, 4), index_dtype=index_dtype))


@parametrize(name=EXTREMA)
def test_extremum_out_is_a_pair(name):
    values, indices = _out_like(name, (3, 4))
    for out in ([values, indices], values, (values, indices, indices), (values, None)):
        side_by_side(name, (_x(), 0), {"out": out})
    got = getattr(fscan, name)(_x(), 0, out=(values, indices))
    assert type(got) is getattr(torch.return_types, f"{name}_out")
    assert got.values is values and got.indices is indices


@parametrize(name=OPS, which=["input", "out"])
def test_out_refuses_autograd_as_torch_does(name, which, path):
    x = _x().requires_grad_(which == "input")
    out = _out_like(name, (3, 4))
    if which == "out":
        out = tuple(o.requires_grad_() for o in out[:1]) + out[1:] if name in EXTREMA else out
        if name not in EXTREMA:
            out.requires_grad_()
    side_by_side(name, (x, 0), {"out": out})
    with pytest.raises(RuntimeError, match="automatic differentiation"):
        getattr(fscan, name)(x, 0, out=out)
    with torch.no_grad():  # no graph recorded: allowed
        side_by_side(name, (x, 0), {"out": out})


@parametrize(name=OPS)
def test_torch_s_argument_names(name, path):
    side_by_side(name, (), {"input": _x(), "dim": 1})
    side_by_side(name, (_x(),), {"dim": -1, "out": _out_like(name, (3, 4))})
    side_by_side(name, (), {"input": _x(), "dim": 0, "out": None})


@parametrize(name=OPS)
def test_out_aliasing_the_input(name, path):
    x = _x()
    want = getattr(torch, name)(x, 0)
    got_x = x.clone()
    out = (got_x, torch.zeros(3, 4, dtype=torch.int64)) if name in EXTREMA else got_x
    getattr(fscan, name)(got_x, 0, out=out)
    torch.testing.assert_close(got_x, want if name not in EXTREMA else want.values)
    if path == "first":
        return  # torch's op itself ran: over a partial overlap it reads what it wrote
    # a partial overlap: fscan's engines compute the result before out is written
    x = _x()
    want = getattr(torch, name)(x[:, :3], 1)
    out = x[:, 1:]
    out = (out, torch.zeros(3, 3, dtype=torch.int64)) if name in EXTREMA else out
    getattr(fscan, name)(x[:, :3], 1, out=out)
    torch.testing.assert_close(x[:, 1:], want if name not in EXTREMA else want.values)


@parametrize(name=OPS)
def test_out_that_is_not_a_tensor(name):
    for out in (3, [torch.zeros(3, 4)]) if name not in EXTREMA else (3,):
        side_by_side(name, (_x(), 0), {"out": out})


@parametrize(name=OPS)
def test_an_overlapping_out_is_refused(name, path):
    out = torch.zeros(1, 4).expand(3, 4)  # three rows in one
    if name not in EXTREMA or path == "first":
        pair = (out, torch.zeros(3, 4, dtype=torch.int64))
        side_by_side(name, (_x(), 0), {"out": pair if name in EXTREMA else out})
        return
    # torch's cummax/cummin write each row over the one before (no overlap check); where
    # fscan's engines ran, fscan refuses, as torch's other ops do
    with pytest.raises(RuntimeError, match="single memory location"):
        getattr(fscan, name)(_x(), 0, out=(out, torch.zeros(3, 4, dtype=torch.int64)))


@parametrize(name=OPS)
def test_reverse_with_out(name, path):
    x = _x()
    out = _out_like(name, (0,))
    got = getattr(fscan, name)(x, 0, reverse=True, out=out)
    want = getattr(fscan, name)(x, 0, reverse=True)
    for g, o, w in zip(_tensors(got), _tensors(out), _tensors(want)):
        assert g is o
        torch.testing.assert_close(g, w)


def test_the_resize_warning_points_at_the_caller():
    with pytest.warns(UserWarning, match="resized") as caught:
        fscan.cumsum(_x(), 0, out=torch.zeros(5))
    assert caught[0].filename == __file__
    with pytest.warns(UserWarning, match="resized") as caught:
        fscan.cummax(_x(), 0, out=(torch.zeros(5), torch.zeros(0, dtype=torch.int64)))
    assert caught[0].filename == __file__


@parametrize(name=OPS)
def test_torch_s_op_serves_a_small_call_with_an_out_of_the_right_shape(name):
    op, x = getattr(torch, name), _x()
    out = _out_like(name, (3, 4))
    got = router.native_first_into(op, x, 0, out)
    assert got is not None and all(g is o for g, o in zip(_tensors(got), _tensors(out)))
    # a resize takes the checked path (its warning names the caller), and so do errors
    assert router.native_first_into(op, x, 0, _out_like(name, (0,))) is None
    assert router.native_first_into(op, x.requires_grad_(), 0, out) is None
    assert router.native_first_into(op, x, 0, 3) is None


def test_out_under_torch_compile():
    def both(x, out, values, indices):
        return fscan.cumsum(x, 0, out=out), fscan.cummax(x, 0, out=(values, indices))

    x = _x()
    out, values, indices = (
        torch.empty(3, 4),
        torch.empty(3, 4),
        torch.empty(3, 4, dtype=torch.int64),
    )
    torch._dynamo.reset()
    summed, extremum = torch.compile(both, fullgraph=True, backend="eager")(x, out, values, indices)
    assert summed is out and extremum.indices is indices
    torch.testing.assert_close(out, torch.cumsum(x, 0))
    assert torch.equal(indices, torch.cummax(x, 0).indices)
    torch.testing.assert_close(values, torch.cummax(x, 0).values)


@needs_compiler
@parametrize(name=OPS, dim=[0, 1], reverse=[False, True])
def test_the_kernel_writes_out_directly(name, dim, reverse, monkeypatch, runs_of):
    """Where the kernel serves the call, it writes ``out`` itself (no result copied in);
    an ``out`` that shares the input's storage, or is strided, still gets the copy."""
    pin_route(monkeypatch)
    x = torch.randn(40, 24)
    want = getattr(fscan, name)(x, dim, reverse=reverse)
    with fscan.config.override(cpu_kernel="eager"):
        copies = runs_of("write_out", _ops)
        in_place = cpu_kernel.counters.in_place
        out = _out_like(name, x.shape)
        got = getattr(fscan, name)(x, dim, reverse=reverse, out=out)
        assert all(g is o for g, o in zip(_tensors(got), _tensors(out)))
        assert cpu_kernel.counters.in_place == in_place + len(_tensors(out)) and not copies
        for g, w in zip(_tensors(got), _tensors(want)):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        # the input's own memory, and a transposed out: scanned first, then copied in
        both = torch.cat([x, torch.zeros_like(x)])
        shared = both[40:] if name not in EXTREMA else (both[40:], _out_like(name, x.shape)[1])
        strided = _out_like(name, (24, 40))
        strided = tuple(t.t() for t in strided) if name in EXTREMA else strided.t()
        for out in (shared, strided):
            got = getattr(fscan, name)(both[:40], dim, reverse=reverse, out=out)
            for g, o, w in zip(_tensors(got), _tensors(out), _tensors(want)):
                assert g is o
                torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        assert len(copies) == 2 * (2 if name in EXTREMA else 1)


@needs_compiler
@parametrize(name=OPS, dim=[0, 1], reverse=[False, True], mask=["row", "element"])
def test_the_segmented_kernel_writes_out_directly(name, dim, reverse, mask, runs_of):
    """With ``reset=`` too, the segmented kernel writes ``out`` itself (copying its result
    in cost cummax's pair 2-2.5x the call without ``out=``); an ``out`` that shares the
    mask's storage (the kernel reads the mask as it writes) gets the copy."""
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    if mask == "row":
        reset = torch.rand(x.shape[dim], generator=gen) < 0.2
    else:
        reset = torch.rand(x.shape, generator=gen) < 0.2
    with fscan.config.override(cpu_kernel="eager"):
        want = getattr(fscan, name)(x, dim, reverse=reverse, reset=reset)
        copies = runs_of("write_out", _ops)
        out = _out_like(name, x.shape)
        got = getattr(fscan, name)(x, dim, reverse=reverse, reset=reset, out=out)
        assert all(g is o for g, o in zip(_tensors(got), _tensors(out)))
        assert not copies
        for g, w in zip(_tensors(got), _tensors(want)):
            torch.testing.assert_close(g, w, atol=0, rtol=0)
        # the mask's bytes and the values' out in one storage: scanned first, copied in
        memory = torch.zeros(reset.numel() + x.numel(), dtype=torch.float32)
        in_memory = memory[: reset.numel()].view(torch.uint8)[: reset.numel()]
        shared_mask = in_memory.view(torch.bool).view(reset.shape).copy_(reset)
        values = memory[reset.numel() :].view(x.shape)
        out = (values, _out_like(name, x.shape)[1]) if name in EXTREMA else values
        got = getattr(fscan, name)(x, dim, reverse=reverse, reset=shared_mask, out=out)
        assert len(copies) == len(_tensors(out))
        for g, w in zip(_tensors(got), _tensors(want)):
            torch.testing.assert_close(g, w, atol=0, rtol=0)


@needs_compiler
@parametrize(
    name=OPS, dim=[0, 1], reverse=[False, True], mask=[None, "row", "element"], on=["cpp", "torch"]
)
def test_exclusive_writes_out_directly(name, dim, reverse, mask, on, monkeypatch, runs_of):
    """``exclusive=True`` with ``out=``: the kernel's exclusive variant, the shift's scan
    into the out's later steps and torch's op forward write ``out`` itself (the result
    scanned into new memory and copied in cost cummax's pair 2.3-2.9x the call without
    ``out=``); reversed, torch's op writes a flipped result, copied in."""
    from fscan._routing import exclusive as exclusive_router

    pin_route(monkeypatch, on == "cpp", exclusive_router)
    monkeypatch.setattr(_ops, "native_first_exclusive", lambda *args: None)
    monkeypatch.setattr(_ops, "repeat_exclusive", lambda *args: None)  # an earlier case's run
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(5))
    gen = torch.Generator().manual_seed(6)
    reset = None
    if mask == "row":
        reset = torch.rand(x.shape[dim], generator=gen) < 0.2
    elif mask == "element":
        reset = torch.rand(x.shape, generator=gen) < 0.2
    kw = {"reverse": reverse, "reset": reset, "exclusive": True}
    with fscan.config.override(cpu_kernel="eager"):
        for _ in range(2):  # the first call builds (or counts) the exclusive variant
            want = getattr(fscan, name)(x, dim, **kw)
        copies = runs_of("write_out", _ops)
        out = _out_like(name, x.shape)
        got = getattr(fscan, name)(x, dim, out=out, **kw)
    assert all(g is o for g, o in zip(_tensors(got), _tensors(out)))
    assert bool(copies) == (on == "torch" and reverse and reset is None)
    for g, w in zip(_tensors(got), _tensors(want)):
        torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True)


@needs_compiler
@parametrize(name=OPS, reverse=[False, True])
def test_out_takes_an_identical_call_s_stored_run(name, reverse, monkeypatch, runs_of):
    """An ``out=`` call on the kernel reuses the run an identical call stored (the checked
    path, then the run into ``out``), on every op; an exclusive drop-in's views of its
    later steps (slices along dim 0: laid out as fresh outputs) take it too, and an out
    of another layout does not (the full kernel path writes it through its strides)."""
    fscan.clear_caches()  # no run stored by an earlier case
    pin_route(monkeypatch)
    runs = runs_of("repeat_into", router)
    x = torch.randn(96, 40, generator=torch.Generator().manual_seed(7))
    op = getattr(torch, name)
    with fscan.config.override(cpu_kernel="eager"):
        want = getattr(fscan, name)(x, 0, reverse=reverse)  # builds and stores the run
        out = _out_like(name, x.shape)
        got = getattr(fscan, name)(x, 0, reverse=reverse, out=out)
        assert all(g is o for g, o in zip(_tensors(got), _tensors(out))) and len(runs) == 1
        for g, w in zip(_tensors(got), _tensors(want)):
            torch.testing.assert_close(g, w, atol=0, rtol=0)
        # the steps after the first of a larger output, as the exclusive shift writes them
        big = _out_like(name, (97, 40))
        views = [b[1:] for b in _tensors(big)]
        found = router.engine("fscan." + name, op, x, 0, reverse, views, (True, False))
        assert len(runs) == 2
        for g, v, w in zip(_tensors(found), views, _tensors(want)):
            assert g.data_ptr() == v.data_ptr()
            torch.testing.assert_close(g, w, atol=0, rtol=0)
        # a transposed out: not the run's layout
        strided = tuple(t.t() for t in _tensors(_out_like(name, (40, 96))))
        strided = strided if name in EXTREMA else strided[0]
        got = getattr(fscan, name)(x, 0, reverse=reverse, out=strided)
        assert len(runs) == 2
        for g, w in zip(_tensors(got), _tensors(want)):  # (logaddexp: another path's rounding)
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
