"""The C++ kernel writing into caller-given memory (``kernel_scan(..., out=)``): any
strides, both directions, against the float64 oracle; the checks on ``out``; and the
linear recurrence's backward, whose adjoint now lands in place (no copy).

The combines are test_cpu_kernel's, so one test run compiles each once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import optree
import pytest
import torch
from test_cpu_kernel import add, linrec, needs_compiler, num_threads, oracle

import fscan
from fscan._engines.cpp import cpu_kernel
from fscan._engines.cpp.cpu_kernel import kernel_scan
from fscan._routing.recurrence import KernelBar

F64 = torch.float64


@pytest.fixture(scope="module", autouse=True)
def eager_kernel():
    with fscan.config.override(cpu_kernel="eager"):
        yield


def _counts() -> tuple[int, int, int]:
    c = cpu_kernel.counters
    return c.in_place, c.out_copies, c.copies


# --- out memory of many layouts ----------------------------------------------------------
#
# Each layout makes (base, view): `view` has the scan's shape and is the out= memory,
# `base` the tensor it is a view of (filled with a sentinel, so that a write outside
# the view shows). `how` maps a tensor of base's shape to the view.


def _layout(name: str, shape: tuple[int, ...], dim: int):
    nd, dim = len(shape), dim % len(shape)
    lane = next((d for d in range(nd - 1, -1, -1) if d != dim), dim)  # a non-scan dim
    grown = list(shape)
    how: Callable[[torch.Tensor], torch.Tensor]
    if name == "dense":
        how = lambda t: t
    elif name == "narrowed along dim":  # as _linear_solve.adjoint_grads's earlier(lam)
        grown[dim] += 3
        how = lambda t: t.narrow(dim, 1, shape[dim])
    elif name == "narrowed lanes":
        grown[lane] += 2
        how = lambda t: t.narrow(lane, 2, shape[lane])
    elif name == "transposed":  # every dim reversed: the scan dim's stride is no more 1
        grown = grown[::-1]
        how = lambda t: t.permute(*range(nd - 1, -1, -1))
    elif name == "step slice":  # inner stride 2 (T stride 2 for 1-D or a last dim)
        grown[-1] *= 2
        how = lambda t: t[..., ::2]
    elif name == "last two swapped":  # (B, T, C) memory for a (B, C, T) result
        if nd > 1:
            grown[-2], grown[-1] = grown[-1], grown[-2]
        how = lambda t: t.transpose(-1, -2) if nd > 1 else t
    else:
        raise AssertionError(name)
    base = torch.full(grown, float("nan"), dtype=F64)
    return base, how


LAYOUTS = [
    "dense",
    "narrowed along dim",
    "narrowed lanes",
    "transposed",
    "step slice",
    "last two swapped",
]
CASES = [
    ((50, 12), 0),  # the lane path
    ((3, 40, 9), 1),  # lanes, outer 3
    ((3, 9, 40), -1),  # a scan over the last dim: chains
    ((5000,), 0),  # 1-D: chains, split in chunks on 2 threads
    ((4113, 17), 0),  # lanes, chunked on 2 threads
]


def _make_out(name, shape, dim, n):
    """``n`` out= views of layout ``name`` and a check that nothing outside them changed."""
    made = [_layout(name, shape, dim) for _ in range(n)]
    views = [how(base) for base, how in made]
    for v in views:
        assert v.shape == shape

    def untouched_outside() -> None:
        for base, how in made:
            inside = torch.zeros(base.shape, dtype=torch.bool)
            how(inside).fill_(True)
            assert base[~inside].isnan().all(), f"{name}: written outside the out= view"

    return views, untouched_outside


# The oracle's results per (shape, dim, reverse, call): the same inputs in every layout and
# on 1 and 2 threads (12 runs), and the loop over 5000 steps cost more than the kernel's.
# A few MB, kept for the module.
_REFS: dict[tuple, list[torch.Tensor]] = {}


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("shape", "dim"), CASES, ids=[f"{s}@{d}" for s, d in CASES])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_out_of_any_layout_is_written_in_place(layout, shape, dim, threads):
    """add, the (a, h) pair and h alone (keep=) into out= views: the results are the
    out tensors themselves, equal the oracle's, both directions; nothing outside the
    views and nothing of the inputs changes; no dense buffer is copied (counters)."""
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[0])
    x = torch.randn(shape, generator=gen, dtype=F64)
    a = torch.rand(shape, generator=gen, dtype=F64) * 0.5 + 0.5
    before = [x.clone(), a.clone()]
    calls = [(add, [x], None), (linrec, [a, x], None), (linrec, [a, x], (False, True))]
    with num_threads(threads), torch.no_grad():
        for reverse in (False, True):
            for call, (fn, leaves, keep) in enumerate(calls):
                kept = [k for k in range(len(leaves)) if keep is None or keep[k]]
                views, untouched_outside = _make_out(layout, shape, dim, len(kept))
                spec = optree.tree_structure(tuple(leaves) if len(leaves) > 1 else 0)
                counts = _counts()
                got = kernel_scan("t", fn, spec, leaves, dim, reverse, keep=keep, out=views)
                assert got is not None
                in_place, out_copies, copies = _counts()
                assert (in_place - counts[0], out_copies, copies) == (len(kept), *counts[1:])
                key = (shape, dim, reverse, call)
                if key not in _REFS:
                    xs = tuple(leaves) if len(leaves) > 1 else leaves[0]
                    _REFS[key] = oracle(fn, xs, dim, reverse)
                ref = _REFS[key]
                for k, view in zip(kept, views):
                    assert got[k] is view
                    torch.testing.assert_close(view, ref[k])
                assert all(got[k] is None for k in range(len(leaves)) if k not in kept)
                untouched_outside()
    assert torch.equal(x, before[0]) and torch.equal(a, before[1])


@needs_compiler
def test_out_the_kernel_cannot_describe_gets_a_copy():
    """An out= view whose lanes do not merge (two inner groups) is served by a dense
    result copied into it: counted in ``counters.out_copies``, the same values."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(50, 2, 3, generator=gen, dtype=F64)
    out = torch.empty(50, 3, 2, dtype=F64).transpose(1, 2)
    assert cpu_kernel.strided_layout([x, out], 0, fixed=1) is None
    counts = _counts()
    with torch.no_grad():
        got = kernel_scan("t", add, optree.tree_structure(0), [x], 0, False, out=[out])
    assert got is not None and got[0] is out
    assert _counts() == (counts[0], counts[1] + 1, counts[2])
    torch.testing.assert_close(out, x.cumsum(0))


def test_strided_layout_never_copies_the_outputs():
    """Inputs whose outer groups disagree with a fixed output's are copied (counted);
    outputs whose groups disagree with each other, or have two cuts, give None."""
    x = torch.zeros(2, 3, 4, 6)  # scanned over the last dim: outer dims (2, 3, 4)
    cut0 = torch.zeros(2, 5, 4, 6)[:, :3]  # outer groups (2) x (3 4)
    cut1 = torch.zeros(2, 3, 5, 6)[:, :, :4]  # outer groups (2 3) x (4)
    both = torch.zeros(2, 5, 5, 6)[:, :3, :4]  # three groups
    copies = cpu_kernel.counters.copies
    found = cpu_kernel.strided_layout([cut0, cut1], 3, fixed=1)
    assert found is not None
    xs, nb, _ = found
    assert xs[0] is not cut0 and xs[0].is_contiguous() and xs[1] is cut1 and nb == 4
    assert cpu_kernel.counters.copies == copies + 1
    same = torch.zeros(2, 6, 4, 6)[:, 1:4]  # an input cut where the output is: kept
    found = cpu_kernel.strided_layout([same, x, cut0], 3, fixed=1)
    assert found is not None and found[0][0] is same and found[1] == 12
    assert cpu_kernel.strided_layout([x, cut0, cut1], 3, fixed=2) is None
    assert cpu_kernel.strided_layout([x, both], 3, fixed=1) is None
    found = cpu_kernel.strided_layout([x, cut0], 3, fixed=1)
    assert found is not None and found[0][1] is cut0 and found[1] == 12
    assert cpu_kernel.counters.copies == copies + 1


# --- checks on out= ------------------------------------------------------------------------


def _pair_call(out, keep=None, head=None, leaves=None):
    gen = torch.Generator().manual_seed(1)
    leaves = leaves or [torch.rand(30, 8, generator=gen, dtype=F64), torch.randn(30, 8, dtype=F64)]
    spec = optree.tree_structure((0, 0))
    with torch.no_grad():
        return kernel_scan("t", linrec, spec, leaves, 0, False, keep=keep, head=head, out=out)


def test_out_is_checked_before_anything_runs():
    """Wrong count, shape, dtype, device-less subclass, overlapping elements, grad:
    a ScanError naming ``out``, raised whether a kernel is built or not."""
    good = torch.empty(30, 8, dtype=F64)
    cases = [
        ([good], None, "one tensor per kept output"),
        (good, None, "got a tensor"),
        ([good, good.clone()], (False, True), "one tensor per kept output"),
        ([good, torch.empty(30, 9, dtype=F64)], None, r"out\[1\] .* expected torch.float64"),
        ([good, torch.empty(30, 8)], None, r"out\[1\] \(the output of leaf 1\) is torch.float32"),
        ([torch.empty(8, dtype=F64).expand(30, 8), good], None, r"out\[0\] has strides"),
    ]
    for out, keep, match in cases:
        with pytest.raises(fscan.ScanError, match=match):
            _pair_call(out, keep)
    wants_grad = torch.empty(30, 8, dtype=F64, requires_grad=True)
    leaves = [torch.rand(30, 8, dtype=F64), torch.randn(30, 8, dtype=F64)]
    with pytest.raises(fscan.ScanValueError, match=r"out\[1\] requires grad"):
        kernel_scan(
            "t", linrec, optree.tree_structure((0, 0)), leaves, 0, False, out=[good, wants_grad]
        )
    with pytest.raises(fscan.ScanTypeError, match=r"out\[0\] must be a plain torch.Tensor"):
        _pair_call([torch.nn.Parameter(good, requires_grad=False), good.clone()])
    on = fscan.config.override(cpu_kernel="on")  # checked before any build is counted
    with on, pytest.raises(fscan.ScanValueError, match="one tensor per kept output"):
        _pair_call([good])


def test_out_must_not_alias_an_input_or_another_output():
    gen = torch.Generator().manual_seed(2)
    a, b = torch.rand(30, 8, generator=gen, dtype=F64), torch.randn(31, 8, generator=gen, dtype=F64)
    b_view = b[1:]
    fresh = torch.empty(30, 8, dtype=F64)
    both = torch.empty(60, 8, dtype=F64)
    head = [torch.ones(8, dtype=F64), torch.zeros(8, dtype=F64)]
    cases = [
        ([fresh, a], r"out\[1\] overlaps leaf 0"),
        ([b_view, fresh], r"out\[0\] overlaps leaf 1"),
        ([b[:30], fresh], r"out\[0\] overlaps leaf 1"),  # shifted by one step: still overlaps
        ([both[:30], both[29:59]], r"out\[1\] overlaps out\[0\]"),
        ([fresh, fresh], r"out\[1\] overlaps out\[0\]"),
    ]
    for out, match in cases:
        with pytest.raises(fscan.ScanValueError, match=match):
            _pair_call(out, leaves=[a, b_view])
    store = torch.empty(30, 8, dtype=F64)  # a head element inside the out= memory
    with pytest.raises(fscan.ScanValueError, match=r"out\[0\] overlaps head leaf 1"):
        _pair_call([store, fresh], head=[head[0], store[5]], leaves=[a, b_view])
    # Disjoint halves of one tensor are fine (and written in place).
    if cpu_kernel.compiler_problem() is None:
        got = _pair_call([both[:30], both[30:]], leaves=[a, b_view])
        assert got is not None and got[1] is not None
        torch.testing.assert_close(both[30:], oracle(linrec, (a, b_view), 0, False)[1])


@needs_compiler
def test_out_must_not_alias_a_captured_tensor():
    w = torch.rand(8, dtype=F64)

    def scaled(x, y):
        return x * w + y

    x = torch.randn(30, 8, dtype=F64)
    with torch.no_grad():
        fresh = torch.empty(30, 8, dtype=F64)
        got = kernel_scan("t", scaled, optree.tree_structure(0), [x], 0, False, out=[fresh])
        assert got is not None and got[0] is fresh
        big = torch.empty(40, 8, dtype=F64)
        w2 = big[0]

        def over(x, y):
            return x * w2 + y

        with pytest.raises(fscan.ScanValueError, match=r"out\[0\] overlaps captured tensor 0"):
            kernel_scan("t", over, optree.tree_structure(0), [x], 0, False, out=[big[:30]])


# --- the linear recurrence's backward --------------------------------------------------------


@pytest.fixture
def small_kernel_sizes(monkeypatch):
    """The kernel serves linear_recurrence at any size (gradcheck needs small shapes)."""
    from fscan._recurrences import solve as _linear_solve

    fits_all = _linear_solve.LINEAR._replace(kernel=KernelBar(0, 0, 0, widest=2**62))
    monkeypatch.setattr(_linear_solve, "LINEAR", fits_all)


@needs_compiler
@pytest.mark.usefixtures("small_kernel_sizes")
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    ("shape", "dim", "gate"),
    [((9, 8), 0, (9, 8)), ((7, 5), 1, (7, 5)), ((3, 6, 8), 1, (1, 1, 8)), ((3, 6, 8), 0, ())],
    ids=["lanes", "chains", "3-D, per-channel gate", "3-D, scalar gate"],
)
def test_linear_recurrence_gradcheck_with_the_adjoint_in_place(
    shape, dim, gate, reverse, monkeypatch
):
    """gradcheck (float64) of a, b and initial through the kernel, whose backward writes
    the adjoint without a copy (counters): in one kernel pass where ADJOINT_MIN_LANES
    lanes follow dim (the gates' and inputs' gradients at once), else straight into
    lam's narrowed view."""
    from fscan._recurrences import solve as _linear_solve
    from fscan._routing.recurrence import ADJOINT_MIN_LANES

    one_pass = []
    fused = _linear_solve.kernel_adjoint
    monkeypatch.setattr(
        _linear_solve, "kernel_adjoint", lambda *a, **k: one_pass.append(1) or fused(*a, **k)
    )
    gen = torch.Generator().manual_seed(sum(shape) + dim)
    a = (torch.rand(gate, generator=gen, dtype=F64) * 0.5 + 0.5).requires_grad_()
    b = torch.randn(shape, generator=gen, dtype=F64).requires_grad_()
    step = list(shape)
    del step[dim]
    h0 = torch.randn(step, generator=gen, dtype=F64).requires_grad_()

    def f(a, b, h0):
        return fscan.linear_recurrence(a, b, dim, reverse=reverse, initial=h0)

    counts = _counts()
    (f(a, b, h0) * torch.randn(shape, generator=gen, dtype=F64)).sum().backward()
    in_place, out_copies, _ = _counts()
    assert out_copies == counts[1], "the adjoint was copied"
    if math.prod(shape[dim + 1 :]) >= ADJOINT_MIN_LANES:
        assert one_pass, "the one-pass backward did not run"
    else:
        assert in_place > counts[0], "the adjoint did not land in place"
    torch.autograd.gradcheck(f, (a, b, h0))


@needs_compiler
@pytest.mark.usefixtures("small_kernel_sizes")
def test_solve_returns_its_out_written_in_place(monkeypatch):
    """``_solve(..., out=)`` on the kernel returns ``out`` itself; the kernel's result is
    never copied into it (``Tensor.copy_`` is not called)."""
    from fscan._engines.chunked import Operands
    from fscan._recurrences.solve import LINEAR
    from fscan._routing import recurrence as _router

    gen = torch.Generator().manual_seed(4)
    a = torch.rand(40, 9, generator=gen, dtype=F64)
    b = torch.randn(40, 9, generator=gen, dtype=F64)
    base = torch.full((41, 9), float("nan"), dtype=F64)
    out = base[1:]
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda s, *a, **k: copies.append(1) or real_copy(s, *a, **k)
    )
    with torch.no_grad():
        got = _router.solve(LINEAR, Operands(a, b, 0, None, False, None), True, out)
    monkeypatch.undo()
    assert got is out and not copies
    assert base[0].isnan().all()
    torch.testing.assert_close(out, oracle(linrec, (a, b), 0, False)[1])


@needs_compiler
def test_the_copy_table_reports_the_kernel_backward():
    """``python -m fscan.bench.linear``'s table of issue 11's backward bar runs, on the C++
    kernel both ways, with ratios to the copy of the leaves."""
    from fscan.bench.linear import copy_table

    table = copy_table(quick=True)
    ((label, cells),) = table.rows
    assert label == "(256, 256)" and cells[-1] == "cpp"
    assert all(float(c) > 0 for c in cells[:-1])
