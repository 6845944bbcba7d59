"""fscan under torch.compile with Inductor, the default backend, on CPU: every compiled
route against eager, values and gradients, and the Inductor bugs fscan works around
(fscan._engines.traced_workarounds). A file of its own: these compiles take minutes on 2
cores, and the test runner spreads whole files over its workers."""

from __future__ import annotations

import inspect

import pytest
import torch
from compile_routes import (
    F64,
    assert_matches_eager,
    core_routes,
    outputs_and_gradients,
    route_inputs,
)
from helpers import assert_trees_close
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import fscan


@pytest.fixture
def fresh_dynamo(request):
    shared = "inductor_routes" in request.fixturenames  # keeps the shared compiled code
    if not shared:
        torch._dynamo.reset()
    yield
    if not shared:
        torch._dynamo.reset()


# Every test but those sharing the module's Inductor compile starts from a fresh Dynamo.
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


# Inductor's C++ backend as on a multi-core machine (it takes its parallel atomic_add
# path: bug 3 of fscan._engines.traced_workarounds shows only there), whatever this machine has.
TWO_THREADS = {"cpp.threads": 2}


@pytest.fixture(scope="module")
def inductor_routes():
    """core_routes compiled once by Inductor with symbolic lengths (about a minute on 2
    cores), for every length a test calls it with. Without fullgraph, on purpose: that, with
    gradients, crashed (issue 10); the counter shows no graph break."""
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("inductor")
    with torch._inductor.config.patch(TWO_THREADS):
        yield torch.compile(core_routes, backend=counter, dynamic=True), counter
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from Inductor's own imports
def test_inductor_forward_and_gradients_match_eager(inductor_routes):
    """Issue 10 case 0: Inductor's while_loop backward reused a donated buffer, so the
    gradient at the last step of every 8-step block was wrong (rows 7 and 15 at length
    16); reverse scans along dim 1 got wrong gradients from Inductor's 2-D tiled scatter
    (fscan._engines.traced_workarounds); without fullgraph the backward crashed."""
    compiled, counter = inductor_routes
    assert_matches_eager(compiled, core_routes, (11,))  # rows 7: the last of a block
    frames = counter.frame_count
    assert_matches_eager(compiled, core_routes, (21,))
    assert counter.frame_count == frames  # the graphs serve every length
    assert not counters["graph_break"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_inductor_without_gradients_matches_eager():
    # A compile of its own, from a fresh Dynamo: the no-grad graph is another compile anyway,
    # and recompiling the frame above under no_grad failed in Inductor (torch 2.13: "For
    # ((s22//8)) + 2, expected [s22] to have been codegen-ed", a while_loop condition).
    compiled = torch.compile(core_routes, dynamic=True)
    args = route_inputs(13, requires_grad=False)
    with torch.no_grad(), torch._inductor.config.patch(TWO_THREADS):
        assert_trees_close(compiled(*args), core_routes(*args))


def several_scans_of_x(x):
    """Three scans of x: the smallest function found to meet the Inductor bug below."""
    total = fscan.associative_scan(lambda a, b: a + b, x, 0)
    prod = fscan.associative_scan(lambda a, b: a * b, x, 0)
    prod_rev = fscan.associative_scan(lambda a, b: a * b, x.T, 1, reverse=True)
    return total, prod, prod_rev


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_inductor_several_scans_of_one_input():
    """With several blocked scans of one input in one backward graph, Inductor (torch 2.13)
    fused the sum of that input's gradient into a kernel that ran before the scatter-adds
    of one scan's step gradients, and read their buffers zero-filled (grad off by 4.44).
    fscan._engines.traced.StepGather's backward gathers instead: no scatter to misorder."""
    x = (torch.rand(16, 4, dtype=F64) + 0.5).requires_grad_()  # static shapes
    with torch._inductor.config.patch(TWO_THREADS):
        got = outputs_and_gradients(torch.compile(several_scans_of_x, fullgraph=True), (x,))
    assert_trees_close(got, outputs_and_gradients(several_scans_of_x, (x,)))


def reversed_product(x):
    return (fscan.associative_scan(lambda a, b: a * b, x.T, 1, reverse=True),)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_inductor_with_static_shapes():
    """Issue 10 with static shapes: the last step of every 8-step block (rows 7 and 15 at
    length 16) got a wrong gradient, whatever the scan."""
    x = (torch.rand(16, 4, dtype=F64) + 0.5).requires_grad_()
    with torch._inductor.config.patch(TWO_THREADS):
        got = outputs_and_gradients(torch.compile(reversed_product, fullgraph=True), (x,))
    assert_trees_close(got, outputs_and_gradients(reversed_product, (x,)))


@pytest.fixture
def torchs_tile_indices(monkeypatch):
    """Inductor's C++ codegen as torch ships it: without fscan's fix of its 2-D tiles (bug 3
    of fscan._engines.traced_workarounds), with two threads and without the compile caches
    (which could hand back code generated with the fix)."""
    from torch._inductor.codegen.cpp import CppTile2DKernel

    shift = inspect.unwrap(CppTile2DKernel.transform_indexing)
    monkeypatch.setattr(CppTile2DKernel, "transform_indexing", shift)
    with (
        torch._inductor.config.patch({**TWO_THREADS, "fx_graph_cache": False}),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        yield


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.xfail(
    strict=True,
    reason="torch 2.13: Inductor's 2-D tiled C++ kernels shift a parallel scatter's index "
    "twice (pytorch/pytorch#191837); fscan._engines.traced_workarounds fixes it, this test "
    "undoes the fix",
)
def test_canary_inductor_gradient_of_a_transposed_result_with_symbolic_lengths(
    torchs_tile_indices,
):
    """No fscan in it: the within-block part of the blocked scan on ``a.T`` along dim 1,
    moved to the front and back as fscan does, compiled with dynamic=True. In the backward,
    the scatter of the last gather reads the flipped, transposed cotangent, so Inductor
    tiles it in 2-D and writes column j of each tile to column 2j (``x0 + 2*x0_inner``):
    a wrong gradient (and out-of-bounds writes where no padding follows, a crash).
    When this passes, torch fixed it: drop shift_tile_indices_once from
    fscan._engines.traced_workarounds."""

    def within_blocks(a):  # running products within blocks of 8 steps, flipped, dim 0 -> 1
        a = a.T.movedim(1, 0)  # fscan moves dim 1 of a.T to the front
        n = a.shape[0]
        first = torch.arange(n // 8 + 2) * 8
        steps = [a.index_select(0, (first + j).clamp(max=n - 1)) for j in range(8)]
        running, outs = steps[0], [steps[0]]
        for step in steps[1:]:
            running = running * step
            outs.append(running)
        flat = torch.stack(outs, 1).reshape(-1, a.shape[1])
        return flat.index_select(0, torch.arange(n)).flip(0).movedim(0, 1)

    compiled = torch.compile(within_blocks, dynamic=True)
    a = (torch.rand(16, 3, dtype=F64) + 0.5).requires_grad_()
    cot = torch.linspace(-1, 1, 48, dtype=F64).reshape(3, 16)
    (got,) = torch.autograd.grad(compiled(a), a, cot)
    (expected,) = torch.autograd.grad(within_blocks(a), a, cot)
    assert_trees_close(got, expected)
