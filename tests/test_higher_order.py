"""Higher-order ops (torch.cond, control_flow.map) inside combine_fn, run eagerly: the purity
probe and the pointwise check watch their bodies (issue 10 case 0; compiled: test_compile)."""

from __future__ import annotations

import pytest
import torch
from functorch.experimental import control_flow
from helpers import assert_trees_close

import fscan
from fscan._knowledge.pointwise_check import checked_on_first_call
from fscan._knowledge.store import Knowledge

F64 = torch.float64
ON = torch.tensor(True)


@pytest.fixture(autouse=True)
def fresh_caches():
    fscan.clear_caches()
    yield
    fscan.clear_caches()


def by_sign(a, b):
    return torch.cond(a.sum() > 0, lambda a, b: a + b, lambda a, b: b + a, (a, b))


# torch.cond's eager front end compiles itself, and Dynamo reads `.grad` of non-leaf inputs.
@pytest.mark.filterwarnings(r"ignore:The \.grad attribute of a Tensor that is not a leaf")
def test_cond_in_a_generic_combine_fn_scans_and_differentiates():
    """The first-call purity probe crashed ("no rule registered for HigherOrderOperator
    cond"); and a first torch.cond seen under fscan's watch broke later calls under vmap."""
    x = torch.randn(9, 3, dtype=F64, requires_grad=True)
    for _ in range(2):  # the probe's call, then the cached route
        out = fscan.associative_scan(by_sign, x, 0, combine_mode="generic")
        assert_trees_close(out, x.cumsum(0))
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert_trees_close(grad, torch.arange(9, 0, -1, dtype=F64)[:, None].expand(9, 3))


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (lambda a, b: a + b * torch.rand(()), "random operation aten.rand"),
        (lambda a, b: a.add_(b), "modified its first argument in place"),
    ],
)
def test_the_purity_probe_sees_inside_cond(body, error):
    combine = lambda a, b: torch.cond(ON, body, lambda a, b: a + b, (a, b))
    with pytest.raises(fscan.ImpureCombineError, match=error):
        fscan.associative_scan(combine, torch.randn(6, 3), 0, combine_mode="generic")


def test_the_pointwise_check_sees_inside_cond_and_map():
    a, b = [torch.randn(4, 3)], [torch.randn(4, 3)]
    for combine_fn in (
        lambda a, b: torch.cond(ON, lambda a, b: a + b.sum(), lambda a, b: a + b, (a, b)),
        # map slices the batch of elements apart (conservatively refused), then sums it
        lambda a, b: control_flow.map(lambda ab: ab[0] + ab[1].sum(0), (a.T, b.T)),
    ):
        flat = lambda x, y, fn=combine_fn: [fn(x[0], y[0])]
        with pytest.raises(fscan.CombineFnError, match="not elementwise"):
            checked_on_first_call("demo", flat, Knowledge(), a)(a, b)
    elementwise = lambda x, y: [torch.cond(ON, torch.add, torch.sub, (x[0], y[0]))]
    checked = checked_on_first_call("demo", elementwise, Knowledge(), a)
    assert_trees_close(checked(a, b), [a[0] + b[0]])
