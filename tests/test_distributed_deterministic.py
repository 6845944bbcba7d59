"""``deterministic=True`` on ``fscan.distributed``: values bitwise the same for any split
of the sequence and any number of ranks, equal to one rank holding it all; values and
float64 gradients against a sequential loop.

Most checks run in this process on a group of one rank holding several pieces (a
``Layout`` with many pieces per rank): the deterministic algorithm treats a rank's
pieces exactly as it treats other ranks' (the same exchanges, on a group of one), so
splits are cheap to sweep here. ``test_on_gloo_ranks`` then runs the cases of
``deterministic_cases.py`` in real gloo groups of 1 to 4 ranks.
"""

from __future__ import annotations

import random

import gloo_ranks
import pytest
import torch
import torch.distributed as dist
from deterministic_cases import CASES, assert_bitwise, worker
from helpers import add, linear_recurrence, logaddexp, matmul, maximum, parametrize, sequential_scan

import fscan
import fscan._sharded.fixed_batch as fixed_batch
import fscan.distributed as fd
from fscan.distributed import Layout

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    """A group of one rank (this process) for the whole module."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _splits(n: int, seed: int) -> list[list[int]]:
    """Piece lengths summing to ``n``: one piece, and random cuts into 2 to 6 pieces
    with empty and one-step pieces among them."""
    rng = random.Random(seed)
    out = [[n]]
    for pieces in (2, 3, 4, 6, 6):
        cuts = sorted(rng.randint(0, n) for _ in range(pieces - 1))
        out.append([b - a for a, b in zip([0, *cuts], [*cuts, n])])
    if n >= 3:
        out.append([1, 0, 1, n - 2])
    return out


def _pieces(x: torch.Tensor, dim: int, lengths: list[int], order: list[int]) -> torch.Tensor:
    """This rank's tensor for ``Layout(((*order,),), ((*lengths,),))``: the pieces at the
    global positions ``order`` (piece ``p`` holds the ``order[p]``-th stretch of the
    sequence, the stretches' lengths in sequence order being ``sorted by order``)."""
    by_position = sorted(range(len(order)), key=lambda p: order[p])
    starts, at = {}, 0
    for p in by_position:
        starts[p] = at
        at += lengths[p]
    return torch.cat([x.narrow(dim, starts[p], lengths[p]) for p in range(len(order))], dim)


def _scan(fn, xs, dim, reverse=False, mode="pointwise", lengths=None, order=None, **kw):
    """The deterministic scan of ``xs`` held as pieces of ``lengths`` on this rank, in
    global ``order`` (default: in order); the result in the pieces' order."""
    if lengths is None:
        return fd.associative_scan(fn, xs, dim, reverse, mode, deterministic=True, **kw)
    order = order or list(range(len(lengths)))
    local = [_pieces(x, dim, lengths, order) for x in _leaves(xs)]
    layout = Layout((tuple(order),), (tuple(lengths),))
    return fd.associative_scan(
        fn, _like(xs, local), dim, reverse, mode, layout=layout, deterministic=True, **kw
    )


def _leaves(xs):
    return list(xs) if isinstance(xs, tuple) else [xs]


def _like(xs, leaves):
    return tuple(leaves) if isinstance(xs, tuple) else leaves[0]


def _data(fn, n: int, dim: int, dtype: torch.dtype):
    shape = [[n, 3], [2, n, 3], [2, 3, n]][dim if dim >= 0 else 2]
    if fn is linear_recurrence:
        return (torch.rand(shape, dtype=dtype) * 0.5 + 0.5, torch.randn(shape, dtype=dtype))
    return torch.randn(shape, dtype=dtype)


TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2}


@parametrize(
    fn=[add, linear_recurrence, logaddexp, maximum],
    dim=[0, 1, -1],
    reverse=[False, True],
    dtype=[torch.float32, torch.float64],
)
def test_bitwise_for_any_split(fn, dim, reverse, dtype):
    for n in (0, 1, 2, 5, 23, 130):
        xs = _data(fn, n, dim, dtype)
        whole = _scan(fn, xs, dim, reverse)
        want = sequential_scan(fn, _like(xs, [x.double() for x in _leaves(xs)]), dim, reverse)
        for g, w in zip(_leaves(whole), _leaves(want)):
            torch.testing.assert_close(g.double(), w, rtol=TOL[dtype], atol=TOL[dtype])
        for lengths in _splits(n, seed=n):
            got = _scan(fn, xs, dim, reverse, lengths=lengths)
            assert_bitwise(got, whole, f"n={n} pieces {lengths}")


@pytest.mark.parametrize("reverse", [False, True])
def test_bitwise_for_pieces_in_any_order(reverse):
    """Pieces held out of sequence order (torch context parallel's head-tail layout and
    others): each piece's results are the whole scan's at its place."""
    x = torch.randn(40, 5)
    whole = _scan(logaddexp, x, 0, reverse)
    for lengths, order in (([10, 10, 10, 10], [0, 3, 1, 2]), ([7, 0, 20, 13], [2, 0, 3, 1])):
        got = _scan(logaddexp, x, 0, reverse, lengths=lengths, order=order)
        assert_bitwise(got, _pieces(whole, 0, lengths, order), f"order {order}")


def test_bfloat16_bitwise_and_close():
    x = torch.randn(300, 4, dtype=torch.bfloat16)
    whole = _scan(add, x, 0)
    torch.testing.assert_close(whole.double(), x.double().cumsum(0), rtol=0.1, atol=0.5)
    for lengths in _splits(300, seed=3):
        assert_bitwise(_scan(add, x, 0, lengths=lengths), whole, f"pieces {lengths}")


def test_generic_matmul():
    """Generic mode: the same fixed order, ``combine_fn`` vmapped over each batch."""
    mats = torch.randn(30, 2, 2, dtype=torch.float64) * 0.7
    whole = _scan(matmul, mats, 0, True, "generic")
    want = sequential_scan(matmul, mats, 0, True)
    torch.testing.assert_close(whole, want, rtol=1e-10, atol=1e-10)
    for lengths in _splits(30, seed=1):
        assert_bitwise(_scan(matmul, mats, 0, True, "generic", lengths=lengths), whole)


def _segmented_loop(fn, x: torch.Tensor, flags: torch.Tensor, reverse: bool) -> torch.Tensor:
    """The oracle with ``reset``: a loop that restarts where a flag is set."""
    order = range(x.shape[0] - 1, -1, -1) if reverse else range(x.shape[0])
    out, acc = [None] * x.shape[0], None
    for t in order:
        acc = x[t] if acc is None or bool(flags[t]) else fn(acc, x[t])
        out[t] = acc
    return torch.stack(out)


@parametrize(reverse=[False, True], fn=[add, logaddexp])
def test_reset(reverse, fn):
    n = 57
    x = torch.randn(n, 3, dtype=torch.float64)
    flags = torch.rand(n) < 0.15
    flags[0] = flags[-1] = False
    whole = _scan(fn, x, 0, reverse, reset=flags)
    torch.testing.assert_close(whole, _segmented_loop(fn, x, flags, reverse))
    for lengths in _splits(n, seed=5):
        local = _pieces(flags, 0, lengths, list(range(len(lengths))))
        got = _scan(fn, x, 0, reverse, lengths=lengths, reset=local)
        assert_bitwise(got, whole, f"pieces {lengths}")


@parametrize(fn=[add, logaddexp, linear_recurrence], reverse=[False, True])
def test_gradcheck_float64(fn, reverse):
    xs = _data(fn, 11, 0, torch.float64)
    leaves = [x.requires_grad_() for x in _leaves(xs)]

    def run(*leaves):
        return _leaves(_scan(fn, _like(xs, list(leaves)), 0, reverse, lengths=[4, 0, 1, 6]))

    assert torch.autograd.gradcheck(run, leaves, fast_mode=True)
    got = torch.autograd.grad(sum(o.sum() for o in run(*leaves)), leaves)
    want = sequential_scan(fn, _like(xs, leaves), 0, reverse)
    expected = torch.autograd.grad(sum(w.sum() for w in _leaves(want)), leaves)
    for g, w in zip(got, expected):
        torch.testing.assert_close(g, w)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")  # torch's jvp decompositions
def test_jvp():
    x, t = torch.randn(23, 3, dtype=torch.float64), torch.randn(23, 3, dtype=torch.float64)
    got = torch.func.jvp(lambda v: _scan(logaddexp, v, 0, lengths=[5, 0, 18]), (x,), (t,))
    want = torch.func.jvp(lambda v: sequential_scan(logaddexp, v, 0), (x,), (t,))
    for g, w in zip(got, want):
        torch.testing.assert_close(_pieces(w, 0, [5, 0, 18], [0, 1, 2]), g)


def test_closure_gradients():
    """Tensors ``combine_fn`` closes over get their gradient (this rank's share)."""
    w = torch.rand(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(17, 3, dtype=torch.float64)
    shifted = lambda p, q: p + q + w
    (got,) = torch.autograd.grad(_scan(shifted, x, 0, lengths=[6, 11]).sum(), w)
    (want,) = torch.autograd.grad(sequential_scan(shifted, x, 0).sum(), w)
    torch.testing.assert_close(got, want)


def _recurrence_loop(a, b, initial, reverse, reset):
    a = a.expand_as(b)
    h, out = initial, [None] * b.shape[0]
    for t in range(b.shape[0] - 1, -1, -1) if reverse else range(b.shape[0]):
        restart = h is None or (reset is not None and bool(reset[t]))
        h = b[t] if restart else a[t] * h + b[t]
        out[t] = h
    return torch.stack(out)


@parametrize(reverse=[False, True], initial=[False, True], reset=[False, True])
def test_linear_recurrence(reverse, initial, reset):
    """On one rank (its splits run on gloo: ``test_on_gloo_ranks``): values and float64
    gradients of ``a``, ``b`` and ``initial`` against the loop."""
    n = 20
    a = (torch.rand(n, 3, dtype=torch.float64) + 0.5).requires_grad_()
    b = torch.randn(n, 3, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(3, dtype=torch.float64, requires_grad=True) if initial else None
    flags = (torch.arange(n) % 6 == 2) | (torch.arange(n) == (n - 1 if reverse else 0))
    flags = flags if reset else None
    inputs = [a, b] + ([h0] if initial else [])

    def run(*args):
        start = args[2] if initial else None
        kw = dict(initial=start, reverse=reverse, reset=flags, deterministic=True)
        return fd.linear_recurrence(args[0], args[1], 0, **kw)

    want = _recurrence_loop(a, b, h0, reverse, flags)
    torch.testing.assert_close(run(*inputs), want)
    assert torch.autograd.gradcheck(run, inputs, fast_mode=True)


def test_linear_recurrence_acc_dtype():
    """``acc_dtype``: bfloat16 inputs accumulated in float32, rounded once."""
    gen = torch.Generator().manual_seed(0)
    a = (torch.rand(500, 4, generator=gen) * 0.05 + 0.95).to(torch.bfloat16)
    b = torch.randn(500, 4, generator=gen).to(torch.bfloat16)
    got = fd.linear_recurrence(a, b, 0, acc_dtype=torch.float32, deterministic=True)
    exact = _recurrence_loop(a.double(), b.double(), None, False, None)
    assert got.dtype == torch.bfloat16
    floor = (exact.to(torch.bfloat16).double() - exact).abs().max()
    assert (got.double() - exact).abs().max() <= 2 * floor


def test_inputs_unchanged_and_results_new():
    x = torch.randn(30, 3)
    before = x.clone()
    out = _scan(add, x, 0, lengths=[30])
    assert torch.equal(x, before)
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    one = torch.randn(1, 3)
    assert _scan(add, one, 0).untyped_storage().data_ptr() != one.untyped_storage().data_ptr()


def test_fixed_batch_width_is_what_keeps_transcendental_combines_bitwise(monkeypatch):
    """The hazard the fixed width removes: with calls as wide as each rank's batch,
    torch rounds ``logaddexp`` in a batch's scalar tail unlike its vector body, and
    some split differs in the last bit (on CPUs where torch vectorises)."""
    a, b = torch.randn(4096), torch.randn(4096)
    alone = torch.cat([torch.logaddexp(a[i : i + 1], b[i : i + 1]) for i in range(4096)])
    if torch.equal(alone, torch.logaddexp(a, b)):
        pytest.skip("torch rounds logaddexp alike in any batch here: no hazard to witness")
    monkeypatch.setattr(fixed_batch, "rows_per_call", lambda leaves, count=None: count or 1 << 20)
    x = torch.randn(2000, 3)
    whole = _scan(logaddexp, x, 0)
    differs = sum(
        not torch.equal(_scan(logaddexp, x, 0, lengths=lengths), whole)
        for seed in range(8)
        for lengths in _splits(2000, seed)
    )
    assert differs, "no split differed: the fixed width would be untested"


def test_errors():
    x = torch.ones(4)
    with pytest.raises(fscan.ScanTypeError, match="`deterministic` must be a bool, got"):
        fd.associative_scan(torch.add, x, 0, deterministic=1)
    with pytest.raises(fscan.ScanTypeError, match="`deterministic` must be a bool, got"):
        fd.linear_recurrence(0.5, x, 0, deterministic="yes")


# Dynamo itself reads .grad of a non-leaf input where it breaks the graph (a warning)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("what", ["associative_scan", "linear_recurrence"])
def test_compile(what):
    """torch.compile(fullgraph=True) refuses, with fscan's reason; without fullgraph
    the call is a graph break and runs eagerly, bitwise as outside the compiled
    function, gradients included."""
    if what == "associative_scan":
        fn = lambda x: fd.associative_scan(torch.logaddexp, x * 2, 0, deterministic=True)
    else:
        fn = lambda x: fd.linear_recurrence(0.5, x * 2, 0, deterministic=True)
    x = torch.randn(37, 3)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="`deterministic=True` runs eagerly, outside the graph"):
        torch.compile(fn, fullgraph=True, backend="eager")(x)
    torch._dynamo.reset()
    x.requires_grad_()
    got, want = torch.compile(fn, backend="aot_eager")(x), fn(x)
    assert_bitwise(got, want)
    (g,), (w,) = (torch.autograd.grad(y.sum(), x) for y in (got, want))
    torch.testing.assert_close(g, w)


# ---- gloo groups of 1 to 4 ranks ----------------------------------------------------

WORLD_SIZES = (1, 2, 3, 4)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def ranks(request):
    return gloo_ranks.spawn(request.param, ["deterministic_cases"], worker)


@pytest.mark.parametrize("case", list(CASES))
def test_on_gloo_ranks(ranks, case):
    gloo_ranks.assert_case(ranks, case)
