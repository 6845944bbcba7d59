"""torch.export of fscan scans with a dynamic scan length (fscan._engines.traced)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
from helpers import assert_trees_close, linear_recurrence, sequential_scan

import fscan
from fscan._engines.cpp.traced_kernel import kernel_traceable

LENGTHS = (2, 3, 7, 64, 1000)
SEQ = torch.export.Dim("seq", min=2)


class AssociativeScanModule(torch.nn.Module):
    """The contract's example, on CPU."""

    def forward(self, xs):
        def combine_fn(x, y):
            return x + y

        return fscan.associative_scan(combine_fn, xs, dim=0, combine_mode="pointwise")


class MatrixProducts(torch.nn.Module):
    def forward(self, xs):
        return fscan.associative_scan(torch.matmul, xs, 0, combine_mode="generic")


class ReversedPairs(torch.nn.Module):
    def forward(self, a, b):
        return fscan.associative_scan(linear_recurrence, (a, b), 1, reverse=True)


class ClosesOverTensors(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, xs):
        shift = xs.mean(0)
        return fscan.associative_scan(
            lambda x, y: torch.maximum(x * self.w / self.w, y + shift - shift), xs, 0
        )


def scan_nodes(ep):
    return [
        node for node in ep.graph.nodes if node.op == "call_function" and node.target in SCAN_HOPS
    ]


SCAN_HOPS = {
    torch.ops.higher_order.associative_scan,
    torch.ops.higher_order.scan,
    torch.ops.higher_order.while_loop,
}


@pytest.mark.parametrize("strict", [False, True])
def test_the_contract_example_exports_as_one_scan_node(strict):
    ep = torch.export.export(
        AssociativeScanModule(),
        (torch.randn(5, 3),),
        dynamic_shapes={"xs": {0: SEQ}},
        strict=strict,
    )
    (node,) = scan_nodes(ep)
    assert node.target is torch.ops.higher_order.associative_scan
    combine_graph, xs, additional = node.args  # associative_scan(combine_graph, [xs], ())
    assert [x.op for x in xs] == ["placeholder"] and additional == ()
    element = [p for p in ep.graph_module.get_submodule(combine_graph.target).graph.nodes]
    assert [tuple(p.meta["val"].shape) for p in element if p.op == "placeholder"] == [(3,), (3,)]
    (out,) = node.meta["val"]
    assert isinstance(out.shape[0], torch.SymInt) and out.shape[1] == 3  # f32[s, 3]
    for n in LENGTHS:
        x = torch.randn(n, 3)
        assert_trees_close(ep.module()(x), x.cumsum(0))


def test_matrix_products_export_with_a_dynamic_length():
    ep = torch.export.export(
        MatrixProducts(), (torch.randn(5, 2, 2),), dynamic_shapes={"xs": {0: SEQ}}
    )
    assert [node.target for node in scan_nodes(ep)] == [torch.ops.higher_order.scan]
    for n in LENGTHS:
        m = torch.randn(n, 2, 2) / 2
        assert_trees_close(ep.module()(m), sequential_scan(torch.matmul, m, 0))


class WeightedProducts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.eye(2) + 0.1)

    def forward(self, xs):
        return fscan.associative_scan(lambda a, b: a @ self.w @ b, xs, 0, combine_mode="generic")


# torch's scan autograd warns from inside torch: it imports jit (deprecated) and, under
# strict export, calls torch.compile (ignored there).
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore:torch.compile is ignored when called inside torch.export")
@pytest.mark.parametrize("strict", [False, True])
def test_generic_closures_over_parameters_export(strict):
    module = WeightedProducts()
    ep = torch.export.export(
        module, (torch.randn(5, 2, 2),), dynamic_shapes={"xs": {0: SEQ}}, strict=strict
    )
    assert [node.target for node in scan_nodes(ep)] == [torch.ops.higher_order.scan]
    for n in (2, 7, 64):
        m = torch.randn(n, 2, 2) / 2
        with torch.no_grad():
            assert_trees_close(ep.module()(m), module(m))


def test_reverse_pytrees_along_dim_1_export():
    dims = {"a": {1: SEQ}, "b": {1: SEQ}}
    ep = torch.export.export(
        ReversedPairs(), (torch.rand(4, 5), torch.randn(4, 5)), dynamic_shapes=dims
    )
    assert len(scan_nodes(ep)) == 1
    for n in LENGTHS:
        a, b = torch.rand(4, n), torch.randn(4, n)
        assert_trees_close(
            ep.module()(a, b), sequential_scan(linear_recurrence, (a, b), 1, reverse=True)
        )


def test_closures_over_tensors_export_as_a_while_loop():
    # The non-strict trace of the associative_scan HOP would bake the closed-over
    # tensors in as constants; the blocked scan's while_loop lifts them.
    module = ClosesOverTensors()
    ep = torch.export.export(module, (torch.randn(5, 3),), dynamic_shapes={"xs": {0: SEQ}})
    assert [node.target for node in scan_nodes(ep)] == [torch.ops.higher_order.while_loop]
    for n in LENGTHS:
        x = torch.randn(n, 3)
        assert_trees_close(ep.module()(x), x.cummax(0).values)


def test_strict_export_of_a_closure_over_a_parameter():
    # Under Dynamo (strict=True) fscan cannot see the closure: the HOP gets the
    # parameter as a lifted input. torch's own autograd rule for the op refuses lifted
    # inputs; on CPU with the C++ kernel, fscan's rule (the kernel's backward) serves
    # them, in a fresh process as after a compile (the route installs it either way).
    module = ClosesOverTensors()
    export = lambda: torch.export.export(
        module, (torch.randn(5, 3),), dynamic_shapes={"xs": {0: SEQ}}, strict=True
    )
    if not kernel_traceable():
        with pytest.raises(Exception, match="lifted parameters"):
            export()
        return
    ep = export()
    for n in LENGTHS:
        x = torch.randn(n, 3, requires_grad=True)
        out = ep.module()(x)
        assert_trees_close(out, x.cummax(0).values)
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert_trees_close(grad, torch.autograd.grad(x.cummax(0).values.sum(), x)[0])


_FRESH_STRICT_EXPORT = """
import sys, torch
sys.path.insert(0, "tests")
from test_export import SEQ, ClosesOverTensors
shapes = {"xs": {0: SEQ}}
torch.export.export(ClosesOverTensors(), (torch.randn(5, 3),), dynamic_shapes=shapes, strict=True)
"""


@pytest.mark.skipif(not kernel_traceable(), reason="no C++ kernel lowering here")
def test_strict_export_of_a_closure_over_a_parameter_in_a_fresh_process():
    # Whether it exports must not depend on an earlier compile in the process.
    root = pathlib.Path(__file__).resolve().parent.parent
    run = subprocess.run(
        [sys.executable, "-c", _FRESH_STRICT_EXPORT], cwd=root, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]


class Segmented(torch.nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def forward(self, xs, reset):
        combine = torch.add if self.mode == "pointwise" else torch.matmul
        return fscan.associative_scan(combine, xs, 0, combine_mode=self.mode, reset=reset)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch's scan autograd imports jit
@pytest.mark.parametrize(
    ("mode", "element", "mask"),
    [
        ("pointwise", (3,), ()),  # a 1-D mask
        ("pointwise", (2, 3), (2, 1)),  # one per row
        ("generic", (2, 2), ()),
    ],
)
def test_reset_exports_with_a_dynamic_length(mode, element, mask):
    """Issue 10 case 8: the 1-D mask's flags were reshaped to sizes traced on one element,
    wrong for the batches torch's HOP runs the combine on (every length but the traced one
    failed); generic mode compared a tree spec made outside the scan HOP's trace."""
    module = Segmented(mode)
    ep = torch.export.export(
        module,
        (torch.randn(5, *element), torch.rand(5, *mask) < 0.4),
        dynamic_shapes={"xs": {0: SEQ}, "reset": {0: SEQ}},
    )
    for n in LENGTHS[:4]:
        x, r = torch.randn(n, *element) / 2, torch.rand(n, *mask) < 0.4
        assert_trees_close(ep.module()(x, r), module(x, r))
