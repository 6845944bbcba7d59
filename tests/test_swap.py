"""``fscan.swap_cumulative_ops()`` against torch side by side: each spelling of torch's
cumulative ops runs fscan's drop-in under the mode and returns torch's values, indices,
dtypes and gradients; everything else, and every call the drop-ins do not take as
given, runs torch's own op untouched."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from helpers import parametrize
from torch._dynamo.testing import CompileCounterWithBackend
from torch.overrides import TorchFunctionMode

import fscan
from fscan import _ops, _swap
from fscan._routing import cumulative as cumulative_router

OPS = ["cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"]
# How a model spells the call: the function, keywords, the Tensor method.
SPELLINGS = {
    "function": lambda op, x, dim: getattr(torch, op)(x, dim),
    "keywords": lambda op, x, dim: getattr(torch, op)(input=x, dim=dim),
    "method": lambda op, x, dim: getattr(x, op)(dim),
    "method dim=": lambda op, x, dim: getattr(x, op)(dim=dim),
}
DTYPES = [torch.float64, torch.float32, torch.float16, torch.int32, torch.int64, torch.bool]


class Calls:
    """The public fscan functions that ran (the ``"fscan"`` log's ``fscan_api``)."""

    def __init__(self) -> None:
        self.apis: list[str] = []

    def __contains__(self, api: str) -> bool:
        return api in self.apis


@pytest.fixture
def fscan_calls():
    """Collects the ``"fscan"`` log's DEBUG records while the test runs."""
    calls = Calls()

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if hasattr(record, "fscan_api"):  # one record per public call; others are notes
                calls.apis.append(record.fscan_api)

    logger = logging.getLogger("fscan")
    handler, level = Collect(logging.DEBUG), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield calls
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def parallel_path(monkeypatch):
    """The drop-ins take fscan's parallel scan (not torch's op) for every call, on
    fscan's torch engine: the swap is under test, not a C++ build (seconds each)."""

    def route(op, x, dim, reverse):  # the blocked scan wherever its dtype rules allow it
        _, blocked_bar = cumulative_router.dtype_refusals(op, x.dtype)
        return False, x.ndim > 0 and blocked_bar is None

    monkeypatch.setattr(cumulative_router, "route", route)
    monkeypatch.setattr(_ops, "native_first", lambda *args: None)
    with fscan.config.override(cpu_kernel="off"):
        yield


def sample(shape, dtype):
    """Small integers (ties, zeros) as ``dtype``."""
    return torch.randint(-3, 4, shape).to(dtype)


def assert_same(got, want, exact=True):
    tol = {} if not exact else dict(rtol=0.0, atol=0.0)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, equal_nan=True, **tol)
    else:  # (values, indices)
        assert type(got) is type(want)
        assert_same(got.values, want.values, exact)
        assert torch.equal(got.indices, want.indices)


def raised(fn):
    try:
        fn()
    except Exception as err:  # the type is what is compared
        return type(err)
    return None


# ---- values, dtypes, spellings -------------------------------------------------------


@parametrize(op=OPS, spelling=list(SPELLINGS), dtype=DTYPES)
def test_each_spelling_runs_fscan_with_torch_s_results(op, spelling, dtype, fscan_calls):
    x = sample((5, 7), dtype)
    call = SPELLINGS[spelling]
    refused = raised(lambda: call(op, x, 1))
    if refused is not None:  # logcumsumexp of integers and bool: torch refuses
        with fscan.swap_cumulative_ops():
            assert raised(lambda: call(op, x, 1)) is refused
        return
    want = call(op, x, 1)
    with fscan.swap_cumulative_ops():
        got = call(op, x, 1)
    assert_same(got, want)
    assert f"fscan.{op}" in fscan_calls


@parametrize(op=["cumsum", "cumprod"], dtype=[torch.int32, torch.bool, torch.float32])
def test_dtype_keyword_casts_first_as_in_torch(op, dtype, fscan_calls):
    x = sample((4, 6), dtype)
    for cast in (torch.float64, torch.int16, None):
        want = getattr(torch, op)(x, -1, dtype=cast)
        with fscan.swap_cumulative_ops():
            got = getattr(torch, op)(x, -1, dtype=cast)
            method = getattr(x, op)(-1, dtype=cast)
        assert_same(got, want)
        assert_same(method, want)
    assert fscan_calls.apis.count(f"fscan.{op}") == 6


@parametrize(op=OPS, shape=[(), (0,), (3, 0, 2)])
def test_zero_d_and_empty_inputs(op, shape):
    x = torch.randn(shape)
    want = getattr(torch, op)(x, -1)
    with fscan.swap_cumulative_ops():
        got = getattr(torch, op)(x, -1)
    assert_same(got, want)


@parametrize(op=OPS)
def test_the_parallel_path_runs_under_the_swap(op, parallel_path, fscan_calls):
    x = torch.randn(33, 4, dtype=torch.float64)
    want = getattr(torch, op)(x, 0)
    with fscan.swap_cumulative_ops():
        got = getattr(x, op)(0)
    assert_same(got, want, exact=False)  # another order of additions
    assert f"fscan.{op}" in fscan_calls


@parametrize(op=OPS)
def test_a_bad_dim_raises_what_torch_raises(op):
    x = torch.randn(3, 4)
    with pytest.raises(IndexError):
        getattr(torch, op)(x, 2)
    with fscan.swap_cumulative_ops(), pytest.raises(IndexError):
        getattr(torch, op)(x, 2)


def test_torch_special_has_no_logcumsumexp_to_swap():
    # The issue names `torch.special.logcumsumexp`; torch 2.13 has no such function
    # (torch.special has logsumexp only). If torch adds it, add it to fscan._swap's table.
    assert not hasattr(torch.special, "logcumsumexp")


@parametrize(op=OPS, spelling=["tuple", "list"])
def test_out_runs_fscan_s_drop_in(op, spelling, fscan_calls):
    x = torch.randn(4, 5)
    want = getattr(torch, op)(x, 1)
    extremum = not isinstance(want, torch.Tensor)
    out = (torch.empty(0), torch.empty(0, dtype=torch.int64)) if extremum else torch.empty(0)
    if extremum and spelling == "list":  # torch takes a list of two tensors too
        out = list(out)
    with fscan.swap_cumulative_ops():
        got = getattr(torch, op)(x, 1, out=out)
    if extremum:  # torch returns a `cummax_out` struct of the `out` tensors
        assert type(got) is getattr(torch.return_types, f"{op}_out")
        assert got.values is out[0] and got.indices is out[1]
        assert_same(out[0], want.values)
        assert torch.equal(out[1], want.indices)
    else:
        assert got is out
        assert_same(out, want)
    assert f"fscan.{op}" in fscan_calls


@parametrize(op=OPS)
def test_out_errors_under_the_swap_are_torch_s_types(op, fscan_calls):
    x = torch.randn(4, 5, requires_grad=True)
    extremum = op in ("cummax", "cummin")
    out = (torch.empty(0), torch.empty(0, dtype=torch.int64)) if extremum else torch.empty(0)
    want = raised(lambda: getattr(torch, op)(x, 1, out=out))
    assert want is RuntimeError  # out= with an input that requires grad
    with fscan.swap_cumulative_ops():
        got = raised(lambda: getattr(torch, op)(x, 1, out=out))
    assert issubclass(got, want)


def test_out_none_is_no_out(fscan_calls):
    x = torch.randn(4, 5)
    with fscan.swap_cumulative_ops():
        got = torch.cumsum(x, 0, out=None)
    assert_same(got, torch.cumsum(x, 0))
    assert "fscan.cumsum" in fscan_calls


# ---- calls torch's op keeps ------------------------------------------------------------


class Tagged(torch.Tensor):
    """A Tensor subclass: the swap leaves its calls to torch (and the subclass)."""


def test_tensor_subclasses_and_sparse_inputs_run_torch_s_op(fscan_calls):
    tagged = torch.randn(3, 4).as_subclass(Tagged)
    with fscan.swap_cumulative_ops():
        got = torch.cumsum(tagged, 1)
    assert type(got) is Tagged
    assert torch.equal(
        got.as_subclass(torch.Tensor), torch.cumsum(tagged, 1).as_subclass(torch.Tensor)
    )
    sparse = torch.eye(3).to_sparse()
    assert raised(lambda: torch.cumsum(sparse, 0)) is not None  # torch refuses it
    with fscan.swap_cumulative_ops():
        assert raised(lambda: torch.cumsum(sparse, 0)) is raised(lambda: torch.cumsum(sparse, 0))
    assert fscan_calls.apis == []


def test_parameters_are_swapped(fscan_calls):
    weight = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
    with fscan.swap_cumulative_ops():
        got = weight.cumsum(0)
    assert_same(got, torch.cumsum(weight, 0))
    assert "fscan.cumsum" in fscan_calls


def test_wrong_arguments_raise_torch_s_errors():
    x = torch.randn(3, 4)
    bad = [
        lambda: torch.cumsum(x),  # no dim
        lambda: x.cumsum(0, torch.float64),  # dtype is keyword-only
        lambda: torch.cumsum(x, 0, reverse=True),  # fscan's keyword, not torch's
        lambda: torch.cummax(x, 0, dtype=torch.float64),
    ]
    for call in bad:
        want = raised(call)
        assert want is not None
        with fscan.swap_cumulative_ops():
            assert raised(call) is want


def test_other_functions_pass_through_untouched(fscan_calls):
    x = torch.randn(4, 5)

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(func)
            return func(*args, **(kwargs or {}))

    with Seen() as seen, fscan.swap_cumulative_ops():
        total = torch.add(x, 1).sum(dim=0)
        flipped = x.flip(0)
    assert torch.equal(total, torch.add(x, 1).sum(dim=0))
    assert torch.equal(flipped, x.flip(0))
    assert seen.funcs == [torch.add, torch.Tensor.sum, torch.Tensor.flip]
    assert fscan_calls.apis == []


# ---- in-place --------------------------------------------------------------------------


@parametrize(
    op=["cumsum", "cumprod"], dtype=[torch.float32, torch.float64, torch.int32, torch.int8]
)
def test_in_place_writes_fscan_s_values_into_x(op, dtype, fscan_calls):
    x = sample((4, 5), dtype) if op == "cumsum" else sample((4, 5), dtype).clamp(-1, 2)
    want = getattr(x.clone(), op + "_")(1)
    y = x.clone()
    pointer = y.data_ptr()
    with fscan.swap_cumulative_ops():
        got = getattr(y, op + "_")(dim=1)
    assert got is y and y.data_ptr() == pointer
    assert_same(y, want)
    assert f"fscan.{op}" in fscan_calls


def test_in_place_with_its_own_dtype_or_none(fscan_calls):
    x = torch.randn(5, dtype=torch.float64)
    with fscan.swap_cumulative_ops():
        same = x.clone().cumsum_(0, dtype=torch.float64)
        none = x.clone().cumprod_(0, dtype=None)
    assert_same(same, torch.cumsum(x, 0))
    assert_same(none, torch.cumprod(x, 0))
    assert fscan_calls.apis == ["fscan.cumsum", "fscan.cumprod"]


def test_in_place_integers_wrap_as_torch_s_do():
    x = torch.full((3,), 2**30, dtype=torch.int32)
    want = x.clone().cumsum_(0)
    with fscan.swap_cumulative_ops():
        got = x.clone().cumsum_(0)
    assert_same(got, want)


def test_in_place_on_a_view_writes_through():
    base = torch.randn(4, 6)
    want = base.clone()
    want[:, 1::2].cumsum_(0)
    got = base.clone()
    with fscan.swap_cumulative_ops():
        got[:, 1::2].cumsum_(0)
    torch.testing.assert_close(got, want)


def test_in_place_calls_torch_refuses_raise_torch_s_errors(fscan_calls):
    bad = [
        lambda: torch.randn(3).cumsum_(0, dtype=torch.float64),  # another dtype
        lambda: torch.ones(3, dtype=torch.bool).cumsum_(0),  # bool
        lambda: torch.ones(3, dtype=torch.bool).cumprod_(0),
        lambda: torch.randn(3, requires_grad=True).cumsum_(0),  # a leaf that wants grad
        lambda: torch.ones(2).expand(3, 2).cumsum_(0),  # overlapping memory
        lambda: torch.randn(3).cumsum_(0, out=torch.empty(3)),  # no out= in place
    ]
    for call in bad:
        want = raised(call)
        assert want is not None
        with fscan.swap_cumulative_ops():
            assert raised(call) is want


@parametrize(op=["cumsum", "cumprod"])
def test_in_place_gradients_equal_torch_s(op, parallel_path):
    a = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)

    def f(a):
        y = a * 2  # a non-leaf: in place is allowed
        getattr(y, op + "_")(0)
        return y * a

    cotangent = torch.randn(7, 3, dtype=torch.float64)
    want = torch.autograd.grad(f(a), a, cotangent)
    with fscan.swap_cumulative_ops():
        got = torch.autograd.grad(f(a), a, cotangent)
        assert torch.autograd.gradcheck(f, (a,))
    torch.testing.assert_close(got, want)


# ---- autograd --------------------------------------------------------------------------


@parametrize(op=OPS, path=["native", "parallel"])
def test_gradients_equal_torch_s(op, path, request, fscan_calls):
    if path == "parallel":
        request.getfixturevalue("parallel_path")
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)

    def f(x):
        out = getattr(x, op)(0)
        return out if isinstance(out, torch.Tensor) else out.values

    cotangent = torch.randn(6, 4, dtype=torch.float64)
    want = torch.autograd.grad(f(x), x, cotangent)
    with fscan.swap_cumulative_ops():
        got = torch.autograd.grad(f(x), x, cotangent)
        assert torch.autograd.gradcheck(f, (x,))
    torch.testing.assert_close(got, want)
    assert f"fscan.{op}" in fscan_calls


# ---- nesting ---------------------------------------------------------------------------


class Recorder(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.funcs = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_a_mode_inside_the_swap_sees_torch_s_call_first(fscan_calls):
    x = torch.randn(5, 3)
    with fscan.swap_cumulative_ops(), Recorder() as inner:
        got = x.cumsum(0)
    assert inner.funcs == [torch.Tensor.cumsum]  # then the swap took it
    assert_same(got, torch.cumsum(x, 0))
    assert "fscan.cumsum" in fscan_calls


def test_a_mode_outside_the_swap_sees_fscan_s_own_calls(parallel_path):
    x = torch.randn(5, 3)
    with Recorder() as outer, fscan.swap_cumulative_ops():
        got = x.cumsum(0)
    # fscan's parallel scan ran below the swap: the outer mode saw its torch calls,
    # not Tensor.cumsum itself (the swap answered that one).
    assert torch.Tensor.cumsum not in outer.funcs and outer.funcs
    torch.testing.assert_close(got, torch.cumsum(x, 0))


def test_nested_swaps_give_torch_s_results(fscan_calls):
    x = torch.randn(5, 3, dtype=torch.float64)
    with fscan.swap_cumulative_ops(), fscan.swap_cumulative_ops():
        got = torch.cummax(x, 0)
        inner = x.clone().cumprod_(1)
    assert_same(got, torch.cummax(x, 0))
    assert_same(inner, torch.cumprod(x, 1))
    assert "fscan.cummax" in fscan_calls and "fscan.cumprod" in fscan_calls


def test_the_swap_holds_in_the_thread_that_entered_it(fscan_calls):
    other = threading.Thread(target=lambda: torch.cumsum(torch.ones(3), 0))
    with fscan.swap_cumulative_ops():
        torch.cumsum(torch.ones(3), 0)
        other.start()
        other.join()
    assert fscan_calls.apis == ["fscan.cumsum"]  # torch keeps its modes per thread


def test_the_swap_ends_with_its_block(fscan_calls):
    x = torch.randn(4)
    with fscan.swap_cumulative_ops():
        pass
    x.cumsum(0)
    assert fscan_calls.apis == []


# ---- vmap and torch.compile ------------------------------------------------------------


def _model(x):
    """Model-shaped: position ids from a mask, a running max, a log-normaliser."""
    mask = (x > 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return positions, torch.cummax(x, -1).indices, x.logcumsumexp(-1)


def test_vmap_inside_and_outside_the_swap():
    x = torch.randn(3, 4, 6)
    want = torch.vmap(_model)(x)

    def swapped(x):
        with fscan.swap_cumulative_ops():
            return _model(x)

    with fscan.swap_cumulative_ops():
        outside = torch.vmap(_model)(x)
    inside = torch.vmap(swapped)(x)
    for got in (outside, inside):
        for g, w in zip(got, want):
            assert_same(g, w)


def test_vmap_of_an_in_place_call():
    def f(t):
        y = t * 2
        y.cumsum_(0)  # torch's own warns under vmap: no batching rule for cumsum_
        return y

    x = torch.randn(3, 5)
    with fscan.swap_cumulative_ops():
        got = torch.vmap(f)(x)
    assert_same(got, torch.cumsum(x * 2, 1))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiled_function_called_inside_the_swap(fresh_dynamo, monkeypatch):
    # Traced, the drop-ins take torch's op (Inductor lowers it itself), so the graph is
    # torch's; a spy on the swap's table shows that Dynamo went through it into fscan.
    dims = []

    def spy(input, dim):
        dims.append(dim)
        return fscan.logcumsumexp(input, dim)

    monkeypatch.setitem(_swap._OUT_OF_PLACE, torch.logcumsumexp, (spy, frozenset()))
    x = torch.randn(33, 4)
    f = lambda x: torch.logcumsumexp(x, 0) + x.cumsum(1)
    counter = CompileCounterWithBackend("eager")
    with fscan.swap_cumulative_ops():
        got = torch.compile(f, backend=counter, fullgraph=True)(x)
    torch.testing.assert_close(got, f(x))
    assert dims == [0] and counter.frame_count == 1


def test_one_graph_with_the_swap_and_one_without_at_any_length(fresh_dynamo):
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(_model, backend=counter, fullgraph=True, dynamic=True)
    for n in (5, 7, 9):
        x = torch.randn(3, n)
        compiled(x)
        with fscan.swap_cumulative_ops():
            got = compiled(x)
        for g, w in zip(got, _model(x)):
            assert_same(g, w)
    assert counter.frame_count == 2  # Dynamo guards on the active modes


def test_the_swap_entered_inside_a_compiled_function(fresh_dynamo):
    x = torch.randn(4, 6)

    def f(x):
        with fscan.swap_cumulative_ops():
            y = x * 2
            y.cumprod_(1)  # in place
            return (*_model(x), y)

    counter = CompileCounterWithBackend("eager")
    got = torch.compile(f, backend=counter, fullgraph=True)(x)
    for g, w in zip(got, (*_model(x), torch.cumprod(x * 2, 1))):
        assert_same(g, w)
    assert counter.frame_count == 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from Inductor's own imports
def test_inductor_compiles_a_function_inside_the_swap(fresh_dynamo):
    x = torch.randn(4, 6)
    with fscan.swap_cumulative_ops():
        got = torch.compile(_model, fullgraph=True)(x)
    for g, w in zip(got, _model(x)):
        assert_same(g, w, exact=False)


def test_gradients_through_a_compiled_function_inside_the_swap(fresh_dynamo):
    x = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    f = lambda x: (x.cumprod(0) * torch.cummax(x, 0).values).logcumsumexp(1)
    want = torch.autograd.grad(f(x).sum(), x)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with fscan.swap_cumulative_ops():
        got = torch.autograd.grad(compiled(x).sum(), x)
    torch.testing.assert_close(got, want)


def test_export_inside_the_swap_gives_torch_s_graph(fresh_dynamo):
    class Positions(torch.nn.Module):
        def forward(self, mask):
            return (mask.cumsum(-1) - 1).clamp(min=0), torch.cummax(mask, 0).indices

    mask = (torch.randn(4, 6) > 0).long()
    with fscan.swap_cumulative_ops():
        program = torch.export.export(Positions(), (mask,))
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    assert {torch.ops.aten.cumsum.default, torch.ops.aten.cummax.default} <= targets
    for g, w in zip(program.module()(mask), Positions()(mask)):
        assert_same(g, w)


# torch's forward-mode AD scripts its decompositions on first use, which warns.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_forward_mode_gradients_under_the_swap():
    x, tangent = torch.randn(2, 6, 7, dtype=torch.float64).unbind()
    f = lambda a: (torch.logcumsumexp(a, 0), a.cumprod(0), torch.cummin(a, 0).values)
    want = torch.func.jvp(f, (x,), (tangent,))
    with fscan.swap_cumulative_ops():
        got = torch.func.jvp(f, (x,), (tangent,))
    torch.testing.assert_close(got, want)
