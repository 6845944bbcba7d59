"""The routes that tests/test_compile.py and tests/test_compile_inductor.py compile and
compare with eager, values and gradients, with the inputs they take: core_routes through
Inductor (Dynamo and AOT autograd included), other_routes without its codegen."""

from __future__ import annotations

import torch
from helpers import assert_trees_close, linear_recurrence

import fscan

F64 = torch.float64


def core_routes(a, b, m, r, w):
    """The routes whose loops Inductor lowers, once each: pointwise pytrees mixing leaves,
    issue 10's product along dim 1, forward and reverse (reverse met an Inductor bug with
    symbolic lengths: fscan._engines.traced_workarounds), reverse with a closure over a tensor
    requiring grad, generic mode in reverse, and reset= (all blocked scans around a while_loop)."""
    _, h = fscan.associative_scan(linear_recurrence, (a, b), 0)
    prod = fscan.associative_scan(lambda x, y: x * y, a.T, 1)
    prod_rev = fscan.associative_scan(lambda x, y: x * y, a.T, 1, reverse=True)
    decayed = fscan.associative_scan(lambda x, y: x * y * w, a, 0, reverse=True)
    mats = fscan.associative_scan(torch.matmul, m, 0, reverse=True, combine_mode="generic")
    segments = fscan.associative_scan(torch.add, b, 0, reset=r)
    return h, prod, prod_rev, decayed, mats, segments


def other_routes(a, b, m, r, w):
    """The routes core_routes leaves out: per-row and generic reset=, the drop-in ops (torch's
    own ops when traced) and linear_recurrence (``w`` is core_routes' closure: unused here)."""
    rows = fscan.associative_scan(torch.maximum, b, 0, reverse=True, reset=b > 1)
    mats_reset = fscan.associative_scan(torch.matmul, m, 0, combine_mode="generic", reset=r)
    ops = (
        fscan.cumsum(b, 0),
        fscan.cumprod(a, 0, reverse=True),
        fscan.cummax(b, 0).values,
        fscan.logcumsumexp(b, 0, reverse=True),
    )
    linear = fscan.linear_recurrence(a * 0.9, b, 0, reset=r)
    return rows, mats_reset, *ops, linear


def every_route(a, b, m, r, w):
    """core_routes and other_routes in one graph (scripts/inductor_every_route.py)."""
    return *core_routes(a, b, m, r, w), *other_routes(a, b, m, r, w)


def route_inputs(n, requires_grad=True):
    g = torch.Generator().manual_seed(n)
    a = torch.rand(n, 3, dtype=F64, generator=g) + 0.5
    b = torch.randn(n, 3, dtype=F64, generator=g)
    m = torch.randn(n, 2, 2, dtype=F64, generator=g) / 2
    r = torch.rand(n, generator=g) < 0.3
    w = torch.tensor(0.9, dtype=F64)
    for t in (a, b, m, w):
        t.requires_grad_(requires_grad)
    return a, b, m, r, w


def outputs_and_gradients(fn, args):
    outs = fn(*args)
    wrt = [t for t in args if t.requires_grad]
    cot = [torch.linspace(-1, 1, o.numel(), dtype=F64).reshape(o.shape) for o in outs]
    # Zeros for an input a route set leaves unused (other_routes' w).
    grads = torch.autograd.grad(outs, wrt, cot, materialize_grads=True)
    return [o.detach() for o in outs], grads


def assert_matches_eager(compiled, routes, lengths):
    for n in lengths:
        args = route_inputs(n)
        expected = outputs_and_gradients(routes, args)
        assert_trees_close(outputs_and_gradients(compiled, args), expected)
