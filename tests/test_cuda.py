"""The compiled pointwise engine (fscan._engines.triton).

Its dispatch, cache and fallbacks are tested everywhere by letting it treat CPU
as a codegen device, with torch.compile's "aot_eager" backend (the HOP's eager
implementation stands in for Inductor's Triton kernel). The tests marked
``cuda`` run the real kernels and are skipped without a CUDA device;
``scripts/gpu_check.sh`` runs them on a GPU machine.
"""

from __future__ import annotations

import re
import warnings

import optree
import pytest
import torch
from helpers import (
    add,
    affine_compose,
    assert_trees_close,
    linear_recurrence,
    maximum,
    parametrize,
    sequential_scan,
)
from torch._dynamo.testing import CompileCounterWithBackend

import fscan
from fscan._engines import triton as _compiled
from fscan._knowledge.store import entries, knowledge, reach

HAS_CUDA = torch.cuda.is_available()


def on_cuda(test):
    """Mark ``test`` as a CUDA test, skipped without a CUDA device."""
    return pytest.mark.cuda(pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")(test))


@pytest.fixture(autouse=True)
def fresh_caches():
    torch._dynamo.reset()
    fscan.clear_caches()
    yield
    fscan.clear_caches()
    torch._dynamo.reset()


@pytest.fixture
def cpu_codegen(monkeypatch):
    """Let the engine serve CPU tensors through aot_eager; returns the compile counter.
    The C++ kernel is off: on CPU it would take these calls (and their backward) first."""
    counter = CompileCounterWithBackend("aot_eager")
    monkeypatch.setattr(fscan.config, "cpu_kernel", "off")
    monkeypatch.setattr(_compiled, "CODEGEN_DEVICES", ("cpu",))
    monkeypatch.setattr(_compiled, "BACKEND", counter)
    monkeypatch.setattr(_compiled, "_has_triton", lambda: True)
    return counter


def scan_twice(op, xs, dim=0, **kwargs):
    """The first call per key checks combine_fn on the generic engine; the second compiles."""
    fscan.associative_scan(op, xs, dim, **kwargs)
    return fscan.associative_scan(op, xs, dim, **kwargs)


def served(op, xs, dim=0, reverse=False) -> bool:
    """Whether a compiled entry served (and did not fail) for such a call."""
    leaves, spec = fscan._pytree.flatten(xs)
    entry = knowledge(reach(op), spec, "pointwise", leaves)
    compiled = entry.compiled.get((dim % leaves[0].ndim, reverse))
    return compiled is not None and not compiled.failed


def compiled_entries() -> int:
    """How many compiled functions the knowledge entries hold."""
    return sum(len(entry.compiled) for entry in entries.values())


# --- dispatch, cache and fallbacks, simulated on CPU --------------------------------


@parametrize(op=[add, maximum, linear_recurrence], dim=[0, 1], reverse=[False, True])
def test_the_compiled_engine_matches_the_oracle(cpu_codegen, op, dim, reverse):
    # Length >= 5 along every dim: the elementwise verdict needs a batch of two elements.
    xs = (
        torch.randn(6, 9, 3)
        if op is not linear_recurrence
        else (torch.rand(6, 9), torch.randn(6, 9))
    )
    out = scan_twice(op, xs, dim, reverse=reverse)
    assert served(op, xs, dim, reverse)
    assert_trees_close(out, sequential_scan(op, xs, dim, reverse, "pointwise"))


def test_dict_pytrees(cpu_codegen):
    xs = {"w": torch.rand(10, 2), "c": torch.randn(10, 2)}
    out = scan_twice(affine_compose, xs)
    assert served(affine_compose, xs)
    assert_trees_close(out, sequential_scan(affine_compose, xs, 0, False, "pointwise"))


def test_compiled_once_per_key_and_not_for_fresh_lambdas(cpu_codegen):
    for _ in range(3):
        scan_twice(lambda a, b: a * b, torch.rand(8, 3))
    assert cpu_codegen.frame_count == 1


def test_a_new_length_recompiles_at_most_once(cpu_codegen):
    for n in (8, 9, 33, 100):
        scan_twice(add, torch.randn(n, 3))
    assert cpu_codegen.frame_count <= 2


def test_captured_numbers_are_guarded_not_reused(cpu_codegen):
    make = lambda k: lambda a, b: a + b + k  # associative: adds k once per combine
    x = torch.rand(6)
    for k in (1.0, 2.0):
        out = scan_twice(make(k), x)
        assert served(make(k), x)
        assert_trees_close(out, sequential_scan(make(k), x, 0, False, "pointwise"))


def test_closures_over_tensors_fall_back_to_the_generic_engine(cpu_codegen):
    w = torch.rand(3) + 0.5
    op = lambda a, b: a * w / w + b
    x = torch.randn(7, 3)
    assert_trees_close(scan_twice(op, x), x.cumsum(0))
    assert compiled_entries() == 0
    assert "closes over tensors" in _compiled.codegen_unavailable([x], reach(op))


def test_gradients_take_the_autograd_engine(cpu_codegen):
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    out = scan_twice(add, x)
    assert compiled_entries() == 0
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert_trees_close(grad, torch.arange(6.0, 0.0, -1.0, dtype=torch.float64))


@parametrize(
    op=[add, linear_recurrence, lambda a, b: (a[0] * b[0], a[0] * b[1] + a[1] * b[0])],
    reverse=[False, True],
)
def test_the_backward_recurrence_runs_on_the_compiled_engine(cpu_codegen, op, reverse):
    """The adjoint of a pointwise scan is a pointwise scan: it takes the kernel too."""
    xs = (torch.rand(9, 3, dtype=torch.float64) + 0.5, torch.randn(9, 3, dtype=torch.float64))
    xs = xs[0] if op is add else xs
    leaves = [x.clone().requires_grad_() for x in optree.tree_leaves(xs)]
    got = fscan.associative_scan(
        op, optree.tree_unflatten(optree.tree_structure(xs), leaves), 0, reverse
    )
    want = sequential_scan(op, xs, 0, reverse, "pointwise")
    cot = [torch.randn_like(w) for w in optree.tree_leaves(want)]
    frames = cpu_codegen.frame_count
    grads = torch.autograd.grad(optree.tree_leaves(got), leaves, cot)
    assert cpu_codegen.frame_count == frames + 1
    oracle = [x.clone().requires_grad_() for x in optree.tree_leaves(xs)]
    want = sequential_scan(
        op, optree.tree_unflatten(optree.tree_structure(xs), oracle), 0, reverse, "pointwise"
    )
    assert_trees_close(grads, torch.autograd.grad(optree.tree_leaves(want), oracle, cot))


def test_the_backward_recurrence_compiles_once_for_many_leaves(cpu_codegen):
    # Products of upper triangular 2 x 2 matrices [[p, q], [0, r]]: three leaves that
    # mix, a block pattern of several entries, a fresh backward combine per call.
    mix = lambda a, b: (a[0] * b[0], a[0] * b[1] + a[1] * b[2], a[2] * b[2])
    frames = []
    for _ in range(2):
        xs = [(torch.rand(8, 2, dtype=torch.float64) + 0.5).requires_grad_() for _ in range(3)]
        out = fscan.associative_scan(mix, tuple(xs), 0)
        torch.autograd.grad(out, xs, [torch.ones_like(o) for o in out])
        frames.append(cpu_codegen.frame_count)
    assert frames[0] >= 1 and frames[1] == frames[0]


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.uint8])
def test_dtypes_without_scan_codegen_fall_back(cpu_codegen, dtype):
    x = torch.ones(5, dtype=dtype)
    assert "has no scan codegen" in _compiled.codegen_unavailable([x], reach(torch.add))


def test_no_triton_falls_back(cpu_codegen, monkeypatch):
    monkeypatch.setattr(_compiled, "_has_triton", lambda: False)
    assert "Triton" in _compiled.codegen_unavailable([torch.ones(3)], reach(torch.add))


def test_other_devices_fall_back_silently():
    assert (
        _compiled.codegen_unavailable([torch.ones(3)], reach(torch.add)) == "no scan codegen on cpu"
    )


def test_a_compile_failure_warns_once_and_falls_back(cpu_codegen, monkeypatch):
    def broken_backend(gm, example_inputs):
        raise RuntimeError("Unable to generate code for associative_scan op")

    monkeypatch.setattr(_compiled, "BACKEND", broken_backend)
    x = torch.randn(9, 2)
    fscan.associative_scan(add, x, 0)
    expected = (
        "fscan.associative_scan: compiling the pointwise scan kernel failed (BackendCompilerFailed:"
    )
    with pytest.warns(UserWarning, match=re.escape(expected)):
        out = fscan.associative_scan(add, x, 0)
    assert_trees_close(out, x.cumsum(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_trees_close(fscan.associative_scan(add, x, 0), x.cumsum(0))  # no second warning


def test_a_non_elementwise_combine_fn_is_rejected_before_compiling(cpu_codegen):
    with pytest.raises(fscan.CombineFnError, match=re.escape("aten.bmm, a matrix product")):
        fscan.associative_scan(torch.matmul, torch.randn(5, 2, 2), 0)
    assert cpu_codegen.frame_count == 0


# --- on a CUDA device ---------------------------------------------------------------


# Each case compiles a kernel (seconds): a few cases cover shapes, dims, directions, dtypes.
KERNEL_CASES = [
    ((2**16,), 0, False, torch.float32),
    ((4, 1000, 8), 1, True, torch.float64),
    ((3, 5, 257), -1, False, torch.int64),
    ((3, 5, 257), -1, True, torch.float32),
    ((64, 33, 16), 0, True, torch.int32),
]


@on_cuda
@pytest.mark.parametrize(("shape", "dim", "reverse", "dtype"), KERNEL_CASES)
def test_cuda_kernels_match_the_oracle(shape, dim, reverse, dtype):
    x = torch.randint(-3, 4, shape, device="cuda").to(dtype)
    out = scan_twice(add, x, dim, reverse=reverse)
    assert served(add, x, dim, reverse)
    expected = (x.flip(dim).cumsum(dim).flip(dim) if reverse else x.cumsum(dim)).to(dtype)
    assert_trees_close(out, expected)


@on_cuda
@parametrize(n=[1, 3, 1000], reverse=[False, True])
def test_cuda_linear_recurrence(n, reverse):
    xs = (torch.rand(n, 64, device="cuda"), torch.randn(n, 64, device="cuda"))
    out = scan_twice(linear_recurrence, xs, 0, reverse=reverse)
    assert n < 2 or served(linear_recurrence, xs, 0, reverse)
    expected = sequential_scan(linear_recurrence, tuple(x.cpu() for x in xs), 0, reverse)
    assert_trees_close(tuple(o.cpu() for o in out), expected, rtol=1e-4, atol=1e-4)


@on_cuda
def test_cuda_half_precision():
    x = torch.randn(4096, 16, device="cuda", dtype=torch.float16)
    out = scan_twice(maximum, x)
    assert served(maximum, x)
    assert_trees_close(out, x.cummax(0).values)


@on_cuda
def test_cuda_compiles_once_per_key():
    counter = CompileCounterWithBackend("inductor")
    _compiled.BACKEND, backend = counter, _compiled.BACKEND
    try:
        for n in (1024, 1024, 2048, 3000, 4096):
            scan_twice(lambda a, b: a + b, torch.randn(n, 8, device="cuda"))
    finally:
        _compiled.BACKEND = backend
    assert counter.frame_count <= 2


@on_cuda
def test_cuda_fallbacks_give_the_same_results():
    w = torch.rand(8, device="cuda") + 0.5
    x = torch.randn(300, 8, device="cuda")
    assert_trees_close(scan_twice(lambda a, b: a * w / w + b, x), x.cumsum(0))
    z = torch.randn(300, 8, device="cuda", dtype=torch.complex64)
    assert_trees_close(scan_twice(add, z), z.cumsum(0))
    assert compiled_entries() == 0


@on_cuda
def test_cuda_gradients():
    a = torch.rand(50, 4, device="cuda", dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, 4, device="cuda", dtype=torch.float64, requires_grad=True)
    fn = lambda a, b: fscan.associative_scan(linear_recurrence, (a, b), 0)[1]
    assert torch.autograd.gradcheck(fn, (a, b))


@on_cuda
@pytest.mark.parametrize("reverse", [False, True])
def test_cuda_backward_recurrence_on_triton(reverse):
    a = torch.rand(3000, 64, device="cuda") * 0.5 + 0.25
    b = torch.randn(3000, 64, device="cuda")
    a_, b_ = a.clone().requires_grad_(), b.clone().requires_grad_()
    h = fscan.associative_scan(linear_recurrence, (a_, b_), 0, reverse)[1]
    (gb,) = torch.autograd.grad(h.sum(), b_)
    # d(sum h)/db is the reverse scan of a's shifted products: the same recurrence.
    backward_entries = [e for e in entries.values() if e.compiled]
    assert backward_entries, "the adjoint recurrence did not take the compiled engine"
    gate = torch.cat([a[1:], a[:1]]) if not reverse else torch.cat([a[-1:], a[:-1]])
    want = fscan.associative_scan(
        linear_recurrence, (gate.double(), torch.ones_like(b).double()), 0, not reverse
    )[1]
    assert_trees_close(gb.double(), want, rtol=1e-3, atol=1e-3)


@on_cuda
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from Inductor's own imports
@pytest.mark.parametrize("grad", [False, True])
def test_cuda_torch_compile_fullgraph(grad):
    # Without grad the traced scan is the HOP (a Triton kernel); with it, the HOP without a
    # tape and the adjoint scan, a HOP too, for the backward (fscan._engines.traced_adjoint).
    fn = lambda a, b: fscan.associative_scan(linear_recurrence, (a, b), 1, reverse=True)[1]
    compiled = torch.compile(fn, fullgraph=True)
    for n in (100, 1000):
        a, b = torch.rand(4, n, device="cuda"), torch.randn(4, n, device="cuda")
        with torch.set_grad_enabled(grad):
            assert_trees_close(compiled(a, b), fn(a, b), rtol=1e-4, atol=1e-4)


@on_cuda
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # from Inductor's own imports
def test_cuda_torch_compile_gradients_run_on_triton_scans():
    """Compile with grad: forward and backward are Triton scans, no ``while_loop``; the
    gradients of leaves that mix match eager. (Inductor's scan lowering takes no tensor
    that ``combine_fn`` closes over: tests/test_traced_adjoint.py covers closures with
    the HOP's eager implementation.)"""
    fn = lambda a, b: fscan.associative_scan(linear_recurrence, (a, b), 1, reverse=True)[1]
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return torch._inductor.compile_fx.compile_fx(gm, inputs)

    # dynamic=True and two lengths: the backward graph must not fix a layout to the first.
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)
    for n in (300, 1000):
        a = torch.rand(4, n, device="cuda", dtype=torch.float64, requires_grad=True)
        b = torch.randn(4, n, device="cuda", dtype=torch.float64, requires_grad=True)
        g = torch.randn(4, n, device="cuda", dtype=torch.float64)
        got = torch.autograd.grad((compiled(a, b) * g).sum(), (a, b))
        want = torch.autograd.grad((fn(a, b) * g).sum(), (a, b))
        assert_trees_close(got, want, rtol=1e-6, atol=1e-6)
    code = "".join(str(gm.graph) for gm in graphs)
    assert "associative_scan" in code and "while_loop" not in code


@on_cuda
def test_cuda_export_of_the_contract_example():
    class AssociativeScanModule(torch.nn.Module):
        def forward(self, xs):
            return fscan.associative_scan(lambda x, y: x + y, xs, dim=0, combine_mode="pointwise")

    seq = torch.export.Dim("seq", min=2)
    ep = torch.export.export(
        AssociativeScanModule(),
        (torch.randn(5, 3, device="cuda"),),
        dynamic_shapes={"xs": {0: seq}},
    )
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.higher_order.associative_scan) == 1
    for n in (2, 3, 7, 64, 1000):
        x = torch.randn(n, 3, device="cuda")
        assert_trees_close(ep.module()(x), x.cumsum(0))
