"""The forward kernel's gather variant (see ``scan`` in csrc/forward.h): only it compiles the
lane path's gathered rows (inputs or outputs of other inner strides than 1), keyed apart
from the ordinary kernel, built where a call's layout needs it (``gathers``); every
other call, dense or walked along its chains, runs the ordinary kernel.
"""

from __future__ import annotations

import optree
import pytest
import torch
from helpers import add, ordinary_and_variant, sequential_scan
from helpers import linear_recurrence as affine

import fscan
from fscan._engines.cpp import cpu_kernel
from fscan._engines.cpp._kernel_layout import gathers
from fscan._engines.cpp._kernel_run import call_layout, run_kernel
from fscan._engines.cpp.cpu_kernel import State, compiler_problem, kernel_entries
from fscan._knowledge.store import knowledge, reach

needs_compiler = pytest.mark.skipif(compiler_problem() is not None, reason="no C++ compiler")


def sequential(combine, xs, dim, reverse):
    """The scan one step at a time (:func:`helpers.sequential_scan`) in float64, in the
    leaves' dtypes after, as a list of outputs."""
    wide = [x.double() for x in xs]
    found = sequential_scan(combine, wide[0] if combine is add else tuple(wide), dim, reverse)
    return [o.to(x.dtype) for o, x in zip([found] if combine is add else found, xs)]


def scan(combine, xs, dim, reverse):
    """``fscan.associative_scan`` of the leaves (its second call: the first runs the
    elementwise check on the torch engine), as a list of outputs."""
    arg = xs[0] if combine is add else tuple(xs)
    for _ in range(2):
        found = fscan.associative_scan(combine, arg, dim, reverse=reverse)
    return [found] if combine is add else list(found)


def entries(combine, xs):
    """The kernel entries of ``combine`` for leaves like ``xs``."""
    arg = xs[0] if combine is add else tuple(xs)
    spec = optree.tree_structure(arg)
    return kernel_entries(knowledge(reach(combine), spec, "pointwise", list(xs)))


def leaves_of(combine, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    if combine is add:
        return [x]
    return [torch.rand(shape, dtype=dtype) * 0.5 + 0.5, x]


def check(combine, xs, dim, reverse):
    found = scan(combine, xs, dim, reverse)
    want = sequential(combine, xs, dim, reverse)
    tol = dict(rtol=1e-5, atol=1e-5) if xs[0].dtype == torch.float32 else {}
    for f, w in zip(found, want):
        torch.testing.assert_close(f, w, **tol)


@needs_compiler
@pytest.mark.parametrize("combine", [add, affine], ids=["add", "affine"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strided_first", [False, True], ids=["dense-first", "strided-first"])
def test_dense_and_strided_calls_use_different_kernels(
    fresh_eager_kernel, combine, dtype, strided_first
):
    """One combine, dtype and element shape: a dense call builds the ordinary kernel, a call
    with step-sliced lanes (inner stride 2) the gather variant, in either order; neither
    reuses the other's kernel, and each matches the sequential scan in both directions (a
    strided call run by the ordinary kernel would read the lanes as dense: wrong values)."""
    base = leaves_of(combine, dtype, (300, 96))
    dense = [x[:, :48].contiguous() for x in base]
    strided = [x[:, ::2] for x in base]
    assert not call_layout(dense, 0).gather and call_layout(strided, 0).gather
    first, second = (strided, dense) if strided_first else (dense, strided)
    for reverse in (False, True):
        check(combine, first, 0, reverse)
    [built] = entries(combine, first)
    assert built.gather is strided_first and built.state is State.READY
    for reverse in (False, True):
        check(combine, second, 0, reverse)
    ordinary_and_variant(entries(combine, first), "gather", "GATHER_MODE")
    for reverse in (False, True):  # each served by its own kernel again: nothing new built
        check(combine, dense, 0, reverse)
        check(combine, strided, 0, reverse)
    assert len(entries(combine, first)) == 2


LAYOUTS = {
    # name: (make the leaves' view from a contiguous (200, 64) base, dim, needs the variant)
    "step slice of lanes": (lambda x: x[:, ::2], 0, True),
    "broadcast lanes": (lambda x: x[:, :1].expand(200, 40), 0, True),
    "narrowed lanes": (lambda x: x[:, 8:48], 0, False),
    "step slice along T": (lambda x: x[::3], 0, False),
    "transpose (chain path)": (lambda x: x.t(), 1, False),
    "permuted (B, C, T) of (B, T, C), over C (chain path)": (
        lambda x: x.reshape(20, 10, 64).permute(0, 2, 1),
        1,
        False,
    ),
    "3-D, lanes step-sliced, over dim 1": (lambda x: x.reshape(20, 10, 64)[:, :, ::2], 1, True),
    "few lanes (chain path)": (lambda x: x[:, :12:2], 0, False),
}


@needs_compiler
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
def test_layouts_pick_the_kernel_their_lane_path_needs(fresh_eager_kernel, layout, reverse):
    """Each layout runs the variant ``gathers`` names (the lane path with a non-unit inner
    stride: the gather variant; dense lanes or the chain path: the ordinary kernel only),
    with the sequential scan's values."""
    make, dim, needs = LAYOUTS[layout]
    xs = [make(torch.randn(200, 64, dtype=torch.float64))]
    assert call_layout(xs, dim).gather is needs
    check(add, xs, dim, reverse)
    [built] = entries(add, xs)
    assert built.gather is needs and built.state is State.READY


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed"])
def test_strided_out_memory_runs_the_gather_variant(fresh_eager_kernel, reverse):
    """Contiguous leaves written into ``out=`` memory whose lanes are step-sliced: the
    outputs are scattered from row buffers, by the gather variant only."""
    x = torch.randn(150, 32, dtype=torch.float64)
    spec = optree.tree_structure(0)
    out = torch.full((150, 64), 7.0, dtype=torch.float64)
    view = out[:, ::2]
    assert call_layout([x], 0, outs=[view]).gather
    for _ in range(2):
        got = cpu_kernel.kernel_scan("test", add, spec, [x], 0, reverse, out=[view])
    assert got is not None and got[0] is view
    torch.testing.assert_close(view, sequential(add, [x], 0, reverse)[0])
    assert (out[:, 1::2] == 7.0).all()  # the other lanes untouched
    [built] = entries(add, [x])
    assert built.gather and built.state is State.READY


@needs_compiler
def test_ordinary_kernel_declines_a_gathered_layout(fresh_eager_kernel):
    """run_kernel of the ordinary kernel on a layout that needs the gather variant returns
    None (its caller's full route then picks the variant), never a wrong scan."""
    x = torch.randn(100, 32, dtype=torch.float64)
    check(add, [x], 0, False)
    [ordinary] = entries(add, [x])
    assert not ordinary.gather
    assert run_kernel(ordinary, [x], 0, False, ()) is not None
    strided = torch.randn(100, 64, dtype=torch.float64)[:, ::2]
    assert run_kernel(ordinary, [strided], 0, False, ()) is None


@needs_compiler
def test_gather_variant_declines_the_other_layouts(fresh_eager_kernel):
    """...and the gather variant (no chain path in it) declines every layout it was not
    built for: contiguous leaves, dense ``out=`` memory, a transpose."""
    strided = torch.randn(100, 64, dtype=torch.float64)[:, ::2]
    check(add, [strided], 0, False)
    [variant] = entries(add, [strided])
    assert variant.gather
    assert run_kernel(variant, [strided], 0, False, ()) is not None
    x = torch.randn(100, 32, dtype=torch.float64)
    assert run_kernel(variant, [x], 0, False, ()) is None
    assert run_kernel(variant, [x], 0, False, (), outs=[torch.empty_like(x)]) is None
    assert (
        run_kernel(variant, [torch.randn(32, 100, dtype=torch.float64).t()], 0, False, ()) is None
    )


@needs_compiler
def test_gradients_of_strided_leaves_run_the_gather_variant(fresh_eager_kernel):
    """The kernel's autograd path: step-sliced leaves that require grad run the forward's
    gather variant; values and gradients match the sequential scan's."""
    base = torch.randn(120, 64, dtype=torch.float64, requires_grad=True)
    x = base[:, ::2]
    for _ in range(2):
        y = fscan.associative_scan(add, x, 0, reverse=True)
        (g,) = torch.autograd.grad((y * y).sum(), base)
    want = sequential(add, [x.detach()], 0, True)[0]
    torch.testing.assert_close(y.detach(), want)
    ref = x.detach().clone().requires_grad_(True)
    w = ref.flip(0).cumsum(0).flip(0)
    (gr,) = torch.autograd.grad((w * w).sum(), ref)
    torch.testing.assert_close(g[:, ::2], gr)
    assert (g[:, 1::2] == 0).all()
    forwards = [e for e in entries(add, [x]) if not e.backward]
    assert [e.gather for e in forwards] == [True]


def test_gathers_mirrors_the_lane_path_test():
    """gathers: the lane path (VEC_MIN lanes or more, nothing laid out along T) with some
    inner stride not 1; strides are ``sa, sb, st, si`` per tensor, read then written."""
    dense = [4096, 0, 64, 1]
    assert not gathers(dense * 2, 64)
    assert gathers([8192, 0, 128, 2, *dense], 64)
    assert gathers([*dense, 8192, 0, 128, 2], 64)  # an output's lanes strided
    assert gathers([0, 0, 0, 0, *dense], 64)  # a broadcast input
    assert not gathers([8192, 0, 128, 2, *dense], 7)  # too few lanes: the chain path
    assert not gathers([0, 0, 1, 64, *dense], 64)  # laid out along T: the chain path
