"""Seeing the route: the ``"fscan"`` logger's records and ``fscan.explain``."""

from __future__ import annotations

import logging
import pathlib

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fscan
from fscan._engines.cpp import cpu_kernel
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._knowledge.store import entries
from fscan._route_log import ENGINES
from fscan._routing import repeat

# Written against the torch engine's routes (the session's default is the kernel); the
# tests of the kernel's route pick cpu_kernel="eager" themselves.
pytestmark = pytest.mark.torch_engine

needs_compiler = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)

x8 = torch.arange(1.0, 9.0)
# One eager call of every public function: (api, call on a tensor of shape (8,)).
PUBLIC_CALLS = {
    "fscan.associative_scan": lambda x: fscan.associative_scan(torch.add, x, 0),
    "fscan.cumsum": lambda x: fscan.cumsum(x, 0),
    "fscan.cumprod": lambda x: fscan.cumprod(x, 0),
    "fscan.logcumsumexp": lambda x: fscan.logcumsumexp(x, 0),
    "fscan.cummax": lambda x: fscan.cummax(x, 0).values,
    "fscan.cummin": lambda x: fscan.cummin(x, 0).values,
    "fscan.linear_recurrence": lambda x: fscan.linear_recurrence(0.5, x, 0),
    "fscan.log_linear_recurrence": lambda x: fscan.log_linear_recurrence(-0.5, x, 0),
    "fscan.linear_recurrence_matrix": lambda x: fscan.linear_recurrence_matrix(
        0.5 * torch.eye(2), x.reshape(4, 2), 0
    ),
    "fscan.associative_reduce": lambda x: fscan.associative_reduce(torch.add, x, 0),
}


@pytest.fixture
def records(caplog: pytest.LogCaptureFixture):
    """The route records the ``"fscan"`` logger emits in the test (DEBUG on)."""
    caplog.set_level(logging.DEBUG, logger="fscan")
    return lambda: [r for r in caplog.records if hasattr(r, "fscan_engine")]


def check_record(record: logging.LogRecord, api: str) -> None:
    assert record.levelno == logging.DEBUG and record.name == "fscan"
    assert record.fscan_api == api
    assert record.fscan_engine in ENGINES
    assert isinstance(record.fscan_refused, dict)
    assert set(record.fscan_refused) <= ENGINES - {record.fscan_engine}
    message = record.getMessage()
    assert api in message and f"engine {record.fscan_engine}" in message
    for engine in record.fscan_refused:
        assert engine in message


@pytest.mark.parametrize("api", sorted(PUBLIC_CALLS))
def test_one_record_per_public_call(records, api):
    PUBLIC_CALLS[api](x8)
    [record] = records()
    check_record(record, api)


@pytest.mark.parametrize("api", sorted(PUBLIC_CALLS))
def test_one_record_per_call_under_vmap(records, api):
    torch.func.vmap(PUBLIC_CALLS[api])(torch.rand(3, 8) + 1)
    [record] = records()
    check_record(record, api)


@pytest.mark.parametrize("api", sorted(PUBLIC_CALLS))
def test_one_record_per_call_under_grad(records, api):
    torch.func.grad(lambda x: PUBLIC_CALLS[api](x).sum())(torch.rand(8) + 1)
    [record] = records()
    check_record(record, api)


def test_no_record_or_graph_break_while_compiling(records):
    def f(x):
        return fscan.associative_scan(torch.add, x, 0) + fscan.cumsum(x, 0)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    torch.testing.assert_close(compiled(x8), f(x8))
    assert [r.fscan_api for r in records()] == ["fscan.associative_scan", "fscan.cumsum"]
    logging.getLogger("fscan").setLevel(logging.INFO)  # a level read while off: no recompile
    f(x8)
    compiled(x8)
    assert counter.frame_count == 1


def test_nothing_gathered_with_debug_off(caplog):
    caplog.set_level(logging.INFO, logger="fscan")
    fscan.associative_scan(torch.add, x8, 0)
    assert not [r for r in caplog.records if hasattr(r, "fscan_engine")]


def test_inner_calls_join_the_outer_record(records):
    reset = torch.tensor([0, 0, 1, 0, 0, 1, 0, 0]) > 0
    fscan.associative_scan(torch.add, x8, 0, reset=reset)  # scans the pairs re-entering
    x = torch.rand(4096, 256)
    out = fscan.logcumsumexp(x, 0)  # the parallel scan, itself made of scans
    torch.testing.assert_close(out, torch.logcumsumexp(x, 0))
    first, second = records()
    check_record(first, "fscan.associative_scan")
    assert first.fscan_engine == "tree"
    check_record(second, "fscan.logcumsumexp")
    assert second.fscan_engine == "blocked"
    assert second.fscan_refused["cpp"] == "fscan.config.cpu_kernel is 'off'"


def test_routes_of_the_drop_ins_and_recurrences(records):
    fscan.cumsum(x8, 0)
    fscan.cummax(x8, 0, reverse=True)  # torch's op before the checks, reversed
    fscan.linear_recurrence(0.5, torch.ones(0), 0)
    native, reversed_native, empty = records()
    for record in (native, reversed_native):
        assert record.fscan_engine == "native"
        assert "fewer than" in record.fscan_refused["cpp"]
    assert empty.fscan_engine == "empty"


@needs_compiler
@pytest.mark.parametrize(
    ("shape", "carried", "engine", "why"),
    [
        ((64,), False, "cpp", None),
        ((2, 3), False, "cpp", None),
        ((1, 5), False, "blocked", "fewer than 2 steps: the loop is faster"),
        ((4, 64), True, "blocked", "fewer than 8 steps with a carry-in: the loop is faster"),
        ((8, 64), True, "cpp", None),
        ((4, 8192), False, "blocked", "fewer than 32 steps of 8192 or more elements"),
        ((32, 8192), False, "cpp", None),
    ],
)
def test_linear_recurrence_kernel_bar_as_logged(records, shape, carried, engine, why):
    """Where the loop beats the kernel (fscan._routing.recurrence.KERNEL_BAR) the log
    says so; elsewhere the kernel runs, at every size (it beat the walk at 64 elements)."""
    a, b = torch.rand(shape), torch.randn(shape)
    initial = torch.randn(shape[1:]) if carried else None
    with fscan.config.override(cpu_kernel="eager"):
        h = fscan.linear_recurrence(a, b, 0, initial=initial)
    [record] = records()
    assert record.fscan_engine == engine
    assert record.fscan_refused.get("cpp") == why or why in record.fscan_refused["cpp"]
    expected = torch.zeros(shape[1:], dtype=torch.float64) if initial is None else initial.double()
    for t in range(shape[0]):
        expected = a[t].double() * expected + b[t].double()
        torch.testing.assert_close(h[t], expected.float())


def test_explain_empty_and_printable():
    report = fscan.explain(torch.add, torch.ones(0, 3), 0)
    assert (report.engine, dict(report.refused), report.grad) == ("empty", {}, None)
    assert "fscan.associative_scan runs on engine 'empty'" in str(report)
    with pytest.raises(AttributeError):
        report.engine = "cpp"  # frozen


def test_explain_kernel_off_and_triton_on_cpu():
    report = fscan.explain(lambda a, b: a + b, x8, 0)  # the session runs with cpu_kernel="off"
    assert report.engine == "tree"
    assert report.refused["cpp"] == "fscan.config.cpu_kernel is 'off'"
    assert report.refused["triton"] == "no scan codegen on cpu"
    assert "passed over 'cpp': fscan.config.cpu_kernel is 'off'" in str(report)


def test_explain_gradient_routes():
    x = torch.rand(8, requires_grad=True)
    pointwise = fscan.explain(torch.mul, x, 0)
    assert (pointwise.engine, pointwise.grad) == ("tree", "adjoint")
    mats = torch.rand(5, 2, 2, requires_grad=True)
    generic = fscan.explain(torch.matmul, mats, 0, combine_mode="generic")
    assert (generic.engine, generic.grad) == ("tree", "autograd")
    assert "gradients are wanted" in generic.refused["cpp"]
    with torch.no_grad():
        assert fscan.explain(torch.mul, x, 0).grad is None


# a * b + b is not associative: the test is about the route, and expects the warning.
@pytest.mark.filterwarnings("ignore::fscan.NotAssociativeWarning")
def test_explain_names_the_engine_that_runs(records):
    combine = lambda a, b: a * b + b
    before = fscan.explain(combine, x8, 0)
    fscan.associative_scan(combine, x8, 0)
    [record] = records()
    assert record.fscan_engine == before.engine
    assert record.fscan_refused == dict(before.refused)


def test_a_number_as_initial_has_its_reasons(records):
    """A number (not a tensor) as ``initial``: the record and explain say why, alike (the
    record used to say its reasons could not be worked out: a float has no requires_grad)."""
    before = fscan.explain(torch.add, x8, 0, initial=1.0)
    out = fscan.associative_scan(torch.add, x8, 0, initial=1.0)
    torch.testing.assert_close(out, torch.cumsum(x8, 0) + 1.0)
    [record] = records()
    assert "could not be worked out" not in record.getMessage()
    assert record.fscan_engine == before.engine
    assert record.fscan_refused == dict(before.refused)


def test_explain_changes_nothing():
    seen = []

    def combine(a, b):
        seen.append(1)
        return a + b

    def state():
        kernels = {
            k: [(e.state, e.calls) for e in cpu_kernel.kernel_entries(v[0])]
            for k, v in entries._data.items()
        }
        verdicts = {
            k: (v[0].elementwise, dict(v[0].adjoint), v[1]) for k, v in entries._data.items()
        }
        return list(entries._data), kernels, verdicts, len(seen), cpu_kernel.counters.copies

    with fscan.config.override(cpu_kernel="on"):
        fscan.associative_scan(combine, x8, 0)  # a known combine_fn, one call counted
        before = state()
        for xs in (x8, torch.rand(3, 8), torch.rand(8, requires_grad=True)):
            fscan.explain(combine, xs, -1)
            fscan.explain(lambda a, b: a - b, xs, 0)  # never seen: nothing recorded
        assert state() == before


@needs_compiler
def test_explain_cpp_after_build_matches_the_kernel_run(records, monkeypatch):
    runs = []

    def counting(run):
        def counted(*args, **kwargs):
            runs.append(1)
            return run(*args, **kwargs)

        return counted

    # The kernel runs on the full route, or on the router's repeat of a served call.
    monkeypatch.setattr(cpu_kernel, "run_kernel", counting(cpu_kernel.run_kernel))
    monkeypatch.setattr(repeat, "run_prepared", counting(repeat.run_prepared))
    combine = lambda a, b: a * b
    x = torch.rand(64) + 0.5
    with fscan.config.override(cpu_kernel="eager"):
        first = fscan.explain(combine, x, 0)
        assert first.engine == "tree" and "first call" in first.refused["cpp"]
        fscan.associative_scan(combine, x, 0)  # the elementwise check runs
        assert fscan.explain(combine, x, 0).engine == "cpp"  # "eager": the call builds it
        fscan.associative_scan(combine, x, 0)
        assert runs == [1]
        report = fscan.explain(combine, x, 0)
        fscan.associative_scan(combine, x, 0)
        assert runs == [1, 1]
    assert report.engine == "cpp" and set(report.refused) == {"triton"}
    assert [r.fscan_engine for r in records()] == ["tree", "cpp", "cpp"]


def test_the_docs_name_every_engine():
    page = (pathlib.Path(__file__).parents[1] / "docs" / "routes.md").read_text()
    for engine in ENGINES:
        assert f"`{engine}`" in page
