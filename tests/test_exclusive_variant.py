"""The kernel's exclusive variant (see ``scan`` in csrc/forward.h): the exclusive drop-ins
run a kernel of their own, built with the exclusive scan's paths only, keyed apart from
the ordinary kernel (inclusive paths only), built where an exclusive call asks for it;
until then the shift serves, on the engine a kernel still to be built leaves the call to.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import ordinary_and_variant
from test_exclusive_one_pass import check, data

import fscan
from fscan._engines.cpp import _kernel_builder
from fscan._engines.cpp.cpu_kernel import State, compiler_problem, kernel_entries
from fscan._knowledge.store import knowledge
from fscan._routing import exclusive as router
from fscan._routing.cumulative import kernel_call, route
from fscan._routing.repeat_key import memo_reach

needs_compiler = pytest.mark.skipif(compiler_problem() is not None, reason="no C++ compiler")

SHAPE, DIM = (512, 64), 0  # 2**15 elements: the table's kernel, a build from the first call


def entries(name, x):
    """The kernel entries of ``name``'s drop-in combine for leaves like ``x``."""
    combine, spec, leaves, _ = kernel_call(getattr(torch, name), x)
    return kernel_entries(knowledge(memo_reach(combine), spec, "pointwise", leaves))


@pytest.fixture
def variant_runs(runs_of):
    """The exclusive router's runs of the variant, as they happen."""
    return runs_of("run_exclusive", router)


@needs_compiler
@pytest.mark.parametrize("name", ["cumsum", "cummax"])
@pytest.mark.parametrize("inclusive_first", [True, False], ids=["inclusive", "exclusive"])
def test_inclusive_and_exclusive_calls_use_different_kernels(
    fresh_eager_kernel, variant_runs, name, inclusive_first
):
    """One combine and dtype: the inclusive call builds the ordinary kernel, the exclusive
    one its variant, in either order; neither call reuses the other's kernel (their slot
    keys differ in the variant's field, and so do their sources and libraries)."""
    x = data(name, SHAPE)
    op = getattr(fscan, name)
    calls = [lambda: op(x, DIM), lambda: op(x, DIM, exclusive=True)]
    first, second = calls if inclusive_first else calls[::-1]
    first()
    [built] = entries(name, x)
    assert built.exclusive is not inclusive_first and built.state is State.READY
    second()
    ordinary_and_variant(entries(name, x), "exclusive", "EXCLUSIVE_MODE")
    assert len(variant_runs) == 1  # the exclusive call ran the variant, built for it
    check(name, x, DIM, False, op(x, DIM, exclusive=True))
    torch.testing.assert_close(op(x, DIM), getattr(torch, name)(x, DIM))


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize("name", ["cumsum", "logcumsumexp", "cummin"])
def test_exclusive_calls_before_the_variant_is_built(monkeypatch, variant_runs, name, reverse):
    """Mode "on": the first exclusive calls queue the variant's build and are served by
    the shift on the engine the table passes over to (no inclusive kernel is built for
    them), with the oracle's values; once the build ran, the variant serves."""
    fscan.clear_caches()
    _kernel_builder.warm_up()  # the toolchain looked up: the first call queues the build
    jobs = []
    monkeypatch.setattr(_kernel_builder.worker, "submit", jobs.append)
    x = data(name, SHAPE, seed=5)
    assert route(getattr(torch, name), x, DIM, reverse)[0]
    op = getattr(fscan, name)
    try:
        with fscan.config.override(cpu_kernel="on"):
            for _ in range(2):
                check(name, x, DIM, reverse, op(x, DIM, reverse=reverse, exclusive=True))
            [queued] = entries(name, x)  # the variant alone, queued once
            assert queued.exclusive and queued.state is State.PENDING
            # (the blocked scan's inner scans queue kernels of their own ops: run them too)
            assert [job.args[0] for job in jobs].count(queued) == 1
            assert not variant_runs
            while jobs:  # the background compiles, run here
                jobs.pop()()
            assert queued.state is State.READY
            check(name, x, DIM, reverse, op(x, DIM, reverse=reverse, exclusive=True))
            assert len(variant_runs) == 1
    finally:
        fscan.clear_caches()


@needs_compiler
def test_route_log_names_the_variant(monkeypatch, caplog):
    """The "fscan" record of an exclusive drop-in: while the variant is queued, the shift's
    engine, the kernel passed over because its exclusive variant is being built (what the
    record names); once it is built, engine "cpp"."""
    caplog.set_level(logging.DEBUG, logger="fscan")
    records = lambda: [r for r in caplog.records if hasattr(r, "fscan_engine")]
    fscan.clear_caches()
    _kernel_builder.warm_up()
    jobs = []
    monkeypatch.setattr(_kernel_builder.worker, "submit", jobs.append)
    x = data("cumsum", SHAPE, seed=6)
    try:
        with fscan.config.override(cpu_kernel="on"):
            fscan.cumsum(x, DIM, exclusive=True)
            [waiting] = records()
            assert waiting.fscan_engine in ("native", "blocked")
            assert "exclusive variant is being built" in waiting.fscan_refused["cpp"]
            while jobs:
                jobs.pop()()
            caplog.clear()
            fscan.cumsum(x, DIM, exclusive=True)
            [served] = records()
            assert served.fscan_engine == "cpp" and not served.fscan_refused
    finally:
        fscan.clear_caches()
