"""``initial=`` and ``exclusive=`` on ``fscan.distributed``: the step that moves to the next
piece (fscan._sharded.shift), on a group of one rank holding several pieces (a
``Layout`` with many pieces per rank runs the same exchanges as pieces on other
ranks, so splits are cheap to sweep here); gloo groups of 1 to 4 ranks run the
``_start_case`` cases of tests/distributed_cases.py.

The reference is ``fscan.associative_scan`` / ``fscan.linear_recurrence`` on the whole
sequence (their own exclusive forms are tested against sequential loops), and with
``deterministic=True`` the same call on one piece, bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from deterministic_cases import assert_bitwise
from helpers import parametrize

import fscan
import fscan.distributed as fd
from fscan.distributed import Layout

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

SPLITS = ([23], [10, 13], [0, 23], [23, 0], [1, 0, 1, 21], [5, 0, 9, 9], [3, 1, 1, 0, 18])
ORDERS = ([0, 1], [1, 0], [2, 0, 3, 1], [3, 2, 1, 0])


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _affine(p, q):
    return p[0] * q[0], q[0] * p[1] + q[1]


def _add(p, q):
    return p + q


def _held(x: torch.Tensor, dim: int, lengths: list[int], order: list[int]) -> torch.Tensor:
    """This rank's tensor for ``Layout((order,), (lengths,))``: piece ``p`` is the
    ``order[p]``-th stretch of the sequence, the stretches in sequence order."""
    by_position = sorted(range(len(order)), key=lambda p: order[p])
    starts, at = {}, 0
    for p in by_position:
        starts[p] = at
        at += lengths[p]
    return torch.cat([x.narrow(dim, starts[p], lengths[p]) for p in range(len(order))], dim)


def _data(n: int, dim: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = [[n, 3], [2, n, 3], [2, 3, n]][dim]
    a = torch.rand(shape, generator=gen, dtype=dtype) * 0.5 + 0.5
    b = torch.randn(shape, generator=gen, dtype=dtype)
    init = (
        torch.rand(3, generator=gen, dtype=dtype) + 0.5,
        torch.randn(3, dtype=dtype),
    )
    flags = torch.rand(n, generator=gen) < 0.25
    return (a, b), init, flags


def _distributed(fn, xs, dim, lengths, order=None, *, reset=None, **kw):
    order = order or list(range(len(lengths)))
    layout = Layout((tuple(order),), (tuple(lengths),))
    leaves = xs if isinstance(xs, tuple) else (xs,)
    local = tuple(_held(x, dim, lengths, order) for x in leaves)
    mask = None if reset is None else _held(reset, 0, lengths, order)
    local = local if isinstance(xs, tuple) else local[0]
    return fd.associative_scan(fn, local, dim, layout=layout, reset=mask, **kw)


def _pieces_of(result, dim, lengths, order):
    leaves = result if isinstance(result, tuple) else (result,)
    out = tuple(_held(x, dim, lengths, order) for x in leaves)
    return out if isinstance(result, tuple) else out[0]


def _close(got, want):
    for g, w in zip(
        got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)
    ):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@parametrize(exclusive=[False, True], reverse=[False, True], reset=[False, True], dim=[0, 1])
def test_scan_matches_one_device_for_any_split(exclusive, reverse, reset, dim):
    xs, init, flags = _data(23, dim)
    init = tuple(i.expand(xs[0].shape[:dim] + xs[0].shape[dim + 1 :]) for i in init)
    mask = flags if reset else None
    want = fscan.associative_scan(
        _affine, xs, dim, reverse, reset=mask, initial=init, exclusive=exclusive
    )
    for lengths in SPLITS:
        order = list(range(len(lengths)))
        got = _distributed(
            _affine,
            xs,
            dim,
            lengths,
            reset=mask,
            reverse=reverse,
            initial=init,
            exclusive=exclusive,
        )
        _close(got, _pieces_of(want, dim, lengths, order))


@parametrize(exclusive=[False, True], reverse=[False, True])
def test_pieces_out_of_order(exclusive, reverse):
    xs, init, flags = _data(20, 0)
    want = fscan.associative_scan(
        _affine, xs, 0, reverse, initial=init, exclusive=exclusive, reset=flags
    )
    for order in ORDERS:
        lengths = [20 // len(order)] * len(order)
        if len(order) > 2:  # an empty piece held first
            lengths[0] = 0
        lengths[-1] += 20 - sum(lengths)
        got = _distributed(
            _affine,
            xs,
            0,
            lengths,
            order,
            reset=flags,
            reverse=reverse,
            initial=init,
            exclusive=exclusive,
        )
        _close(got, _pieces_of(want, 0, lengths, order))


@parametrize(exclusive=[False, True], reverse=[False, True], reset=[False, True])
def test_deterministic_bitwise_for_any_split(exclusive, reverse, reset):
    """The moved step is a copy: the deterministic algorithm stays bitwise independent
    of the split (float32, where rounding would show)."""
    xs, init, flags = _data(23, 0, torch.float32, seed=1)
    mask = flags if reset else None
    kw = dict(reverse=reverse, initial=init, exclusive=exclusive, deterministic=True)
    whole = _distributed(_affine, xs, 0, [23], reset=mask, **kw)
    want = fscan.associative_scan(
        _affine, xs, 0, reverse, reset=mask, initial=init, exclusive=exclusive
    )
    for g, w in zip(whole, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for lengths in SPLITS[1:]:
        got = _distributed(_affine, xs, 0, lengths, reset=mask, **kw)
        assert_bitwise(got, whole, f"pieces {lengths}")


def test_integer_add_exclusive():
    x = torch.randint(-5, 5, (17, 2))
    want = fscan.associative_scan(_add, x, 0, initial=3, exclusive=True)
    for lengths in SPLITS[:4]:
        lengths = [min(n, 17) for n in lengths]
        lengths[-1] += 17 - sum(lengths)
        if min(lengths) < 0:
            continue
        got = _distributed(_add, x, 0, lengths, initial=3, exclusive=True)
        assert torch.equal(got, _pieces_of(want, 0, lengths, list(range(len(lengths)))))


@parametrize(exclusive=[False, True], reverse=[False, True], reset=[False, True])
def test_gradcheck_float64(exclusive, reverse, reset):
    xs, init, flags = _data(7, 0)
    mask = flags if reset else None
    lengths = [3, 0, 4]

    def f(a, b, i0, i1):
        return _distributed(
            _affine,
            (a, b),
            0,
            lengths,
            reset=mask,
            reverse=reverse,
            initial=(i0, i1),
            exclusive=exclusive,
        )

    args = [t.clone().requires_grad_() for t in (*xs, *init)]
    assert torch.autograd.gradcheck(f, args)


@parametrize(reverse=[False, True], reset=[False, True], initial=[False, True])
def test_linear_recurrence_exclusive(reverse, reset, initial):
    (a, b), init, flags = _data(9, 0)
    kw = dict(
        initial=init[1] if initial else None,
        reverse=reverse,
        reset=flags[:9] if reset else None,
        exclusive=True,
    )
    want = fscan.linear_recurrence(a, b, 0, **kw)
    for deterministic in (False, True):
        got = fd.linear_recurrence(a, b, 0, deterministic=deterministic, **kw)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_inputs_unchanged_and_results_new():
    xs, init, flags = _data(11, 0)
    before = [t.clone() for t in (*xs, *init, flags)]
    out = _distributed(_affine, xs, 0, [4, 0, 7], reset=flags, initial=init, exclusive=True)
    for t, was in zip((*xs, *init, flags), before):
        assert torch.equal(t, was)
    for o in out:
        for t in (*xs, *init):
            assert o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def test_errors():
    x = torch.randn(5, 3)
    with pytest.raises(fscan.ScanValueError, match="initial"):
        fd.associative_scan(_add, x, 0, exclusive=True)
    with pytest.raises(fscan.ScanTypeError, match="exclusive"):
        fd.associative_scan(_add, x, 0, initial=0.0, exclusive="yes")
    with pytest.raises(fscan.ScanValueError, match=r"leaf initial.*shape \(4,\)"):
        fd.associative_scan(_add, x, 0, initial=torch.zeros(4), exclusive=True)
    with pytest.raises(fscan.ScanTypeError, match="exclusive"):
        fd.linear_recurrence(0.5, x, 0, exclusive=1)


def test_compiled_with_reset():
    """With reset=, the moved step traces into the graph (fullgraph=True): values and
    gradients as eager."""
    xs, init, flags = _data(9, 0)
    xs = tuple(x.requires_grad_() for x in xs)
    want = fd.associative_scan(_affine, xs, 0, reset=flags, initial=init, exclusive=True)
    scan = lambda a, b: fd.associative_scan(
        _affine, (a, b), 0, reset=flags, initial=init, exclusive=True
    )
    torch._dynamo.reset()
    got = torch.compile(scan, backend="aot_eager", fullgraph=True)(*xs)
    _close(got, want)
    cot = [torch.randn_like(w) for w in want]
    grad = lambda out: torch.autograd.grad(out, xs, cot)
    _close(grad(got), grad(want))
