"""SPMD preconditions of ``fscan.distributed`` on gloo at world sizes 2 and 3: ranks that
make different calls, a rank that raises before the exchange.

Every rank must end each case with a clear error (the same one wherever the ranks
disagree), never hang in a collective or abort inside gloo, and the group must stay
usable afterwards. Each world size is started once and runs every case in its ranks;
a rank checks its own outcome against the case's expectation and sends back a
verdict and its error message. Collectives time out after ``TIMEOUT_S`` (short: a
case whose peers never enter the collective waits that long) and a hang or a crash
fails the test, with the silent rank's stacks (``gloo_ranks``), instead of stalling
the run.

Pieces are uneven with an empty piece (rank 1's), and the rank that differs is
sometimes the empty one, sometimes one with data. Matching calls in between are
checked against a sequential float64 loop, values and gradients.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gloo_ranks
import optree
import pytest
import torch
import torch.distributed as dist

import fscan
import fscan.distributed as fd

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

WORLD_SIZES = (2, 3)
TIMEOUT_S = 15.0
# each rank's piece length: uneven, rank 1's piece empty
LENGTHS = {1: [5], 2: [4, 0], 3: [3, 0, 2]}


# ---- what each rank runs ----------------------------------------------------------------


def _piece(rank: int, world: int, cols: int = 2, dtype: torch.dtype = torch.float64):
    """This rank's piece of a global (n, cols) sequence with values in [0.5, 1.5)."""
    n = sum(LENGTHS[world])
    whole = torch.rand(n, cols, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    start = sum(LENGTHS[world][:rank])
    return (whole.narrow(0, start, LENGTHS[world][rank]) + 0.5).to(dtype)


def _tree_add(x: Any, y: Any) -> Any:
    return optree.tree_map(torch.add, x, y)


class CombineFailed(Exception):
    """What the test's combine_fn raises on negative data (an error of the user's own)."""


def _add_nonnegative(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if bool((y < 0).any()):
        raise CombineFailed("negative input")
    return x + y


def _add_failing_on_rank_0(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # A data-dependent test (`(y < 0).any()`) is not elementwise: the pointwise check would
    # refuse it with its own error on every rank with data, not only on rank 0.
    if dist.get_rank() == 0:
        raise CombineFailed("rank 0")
    return x + y


def _scan(rank: int, world: int, **changes: Any) -> None:
    """One ``fscan.distributed.associative_scan`` of ``_piece`` by ``torch.add``; keyword
    arguments replace the call's parts (``xs``, ``dim``, ``fn`` or an option)."""
    call = dict(fn=torch.add, xs=_piece(rank, world), dim=0)
    call.update(changes)
    fd.associative_scan(call.pop("fn"), call.pop("xs"), call.pop("dim"), **call)


def _recurrence(rank: int, world: int, **changes: Any) -> None:
    call = dict(a=0.5, b=_piece(rank, world), dim=0)
    call.update(changes)
    fd.linear_recurrence(call.pop("a"), call.pop("b"), call.pop("dim"), **call)


def _on(rank: int, which: int, changed: dict, same: dict | None = None) -> dict:
    """``changed`` on rank ``which``, ``same`` (or nothing) on the others."""
    return changed if rank == which else (same or {})


def _last(world: int) -> int:
    return world - 1


def _mask(rank: int, world: int) -> torch.Tensor:
    flags = torch.zeros(LENGTHS[world][rank], dtype=torch.bool)
    flags[::2] = True
    return flags


# ---- the oracle for matching calls ------------------------------------------------------


def _loop_scan(x: torch.Tensor, reverse: bool) -> torch.Tensor:
    steps = list(x.unbind(0))
    order = range(len(steps) - 1, -1, -1) if reverse else range(len(steps))
    out, acc = [None] * len(steps), None
    for t in order:
        acc = steps[t] if acc is None else acc * steps[t]
        out[t] = acc
    return torch.stack(out) if steps else x.clone()


def _loop_recurrence(a: float, b: torch.Tensor, reverse: bool) -> torch.Tensor:
    steps = list(b.unbind(0))
    order = range(len(steps) - 1, -1, -1) if reverse else range(len(steps))
    out, h = [None] * len(steps), torch.zeros_like(steps[0])
    for t in order:
        h = a * h + steps[t]
        out[t] = h
    return torch.stack(out)


def _matching_calls(rank: int, world: int) -> None:
    """Matching calls still give the loop's values and gradients, both directions, after
    the errors before (the group is in step)."""
    n = sum(LENGTHS[world])
    start, length = sum(LENGTHS[world][:rank]), LENGTHS[world][rank]
    whole = torch.rand(n, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    whole = whole + 0.5
    cot = torch.randn(n, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    for reverse in (False, True):
        for name, dist_call, loop in (
            ("scan", lambda x, r: fd.associative_scan(torch.mul, x, 0, r), _loop_scan),
            (
                "recurrence",
                lambda x, r: fd.linear_recurrence(0.5, x, 0, reverse=r),
                lambda x, r: _loop_recurrence(0.5, x, r),
            ),
        ):
            ref_in = whole.clone().requires_grad_()
            want = loop(ref_in, reverse)
            (want_grad,) = torch.autograd.grad((want * cot).sum(), ref_in)
            piece = whole.narrow(0, start, length).clone().requires_grad_()
            got = dist_call(piece, reverse)
            mine = cot.narrow(0, start, length)
            (grad,) = torch.autograd.grad((got * mine).sum(), piece)
            where = f"{name} reverse={reverse}"
            torch.testing.assert_close(got, want.narrow(0, start, length), msg=where)
            torch.testing.assert_close(grad, want_grad.narrow(0, start, length), msg=where)


def _dtensor(rank: int, world: int, *, wrong_on: int | None = None):
    """``fscan.associative_scan`` on a DTensor sharded along the scan dimension; rank
    ``wrong_on`` builds its shard one step too long (metadata it disagrees with)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.ones(2 * world, 2), mesh, [Shard(0)])
    local = x.to_local()
    if rank == wrong_on:
        local = torch.ones(local.shape[0] + 1, 2)
    x = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=x.shape, stride=x.stride()
    )
    fscan.associative_scan(torch.add, x, 0)


# ---- the cases --------------------------------------------------------------------------


@dataclass
class Case:
    """``run(rank, world)``; ``expect(rank, world)`` gives the error class this rank must
    raise and substrings of its message; ``same_message``: every rank raises the same."""

    run: Callable[[int, int], None]
    expect: Callable[[int, int], tuple[type | None, list[str]]]
    same_message: bool = False


def _mismatch(run: Callable[[int, int], None], *words: str, same: bool = True) -> Case:
    """Every rank raises the same ``ScanValueError`` naming what differs (``same=False``:
    each names the function it was called as)."""
    return Case(run, lambda r, w: (fscan.ScanValueError, ["made different calls", *words]), same)


def _peer_fails(run: Callable[[int, int], None], bad: Callable[[int], int], error) -> Case:
    """Rank ``bad(world)`` raises ``error()`` (its own); the others ``PeerRankError``."""

    def expect(rank: int, world: int) -> tuple[type, list[str]]:
        if rank == bad(world):
            return error(), []
        return fscan.PeerRankError, [f"rank {bad(world)} of the {world} ranks", error().__name__]

    return Case(run, expect)


def _refused(run: Callable[[int, int], None], error: Callable[[], type], *words: str) -> Case:
    return Case(run, lambda r, w: (error(), list(words)))


def _ok(run: Callable[[int, int], None]) -> Case:
    return Case(run, lambda r, w: (None, []))


CASES: dict[str, Case] = {
    "matching calls": _ok(_matching_calls),
    # the ranks disagree: one small fixed-size gather finds it, before the pieces move
    "scan: element shape": _mismatch(
        lambda r, w: _scan(r, w, **_on(r, _last(w), {"xs": _piece(r, w, cols=3)})),
        "shape (n: the scan dimension) of leaf xs: (n, 2) on rank",
        "(n, 3) on rank",
    ),
    "scan: dtype": _mismatch(
        lambda r, w: _scan(r, w, **_on(r, 0, {"xs": _piece(r, w, dtype=torch.float32)})),
        "dtype of leaf xs: torch.float32 on rank 0; torch.float64 on rank",
    ),
    # 4 float32 and 2 float64 are 16 bytes alike: gloo moved them and mixed up values
    "scan: dtype and shape of the same size": _mismatch(
        lambda r, w: _scan(
            r, w, **_on(r, _last(w), {"xs": _piece(r, w, cols=4, dtype=torch.float32)})
        ),
        "dtype of leaf xs",
        "shape (n: the scan dimension) of leaf xs",
    ),
    "scan: tree structure": _mismatch(
        lambda r, w: _scan(r, w, fn=_tree_add, **_on(r, 0, {"xs": (_piece(r, w), _piece(r, w))})),
        "tree structure",
    ),
    "scan: dim": _mismatch(
        lambda r, w: _scan(r, w, **_on(r, _last(w), {"xs": _piece(r, w).T, "dim": 1})),
        "`dim`: 0 on rank",
        "1 on rank",
    ),
    "scan: reverse": _mismatch(
        lambda r, w: _scan(r, w, **_on(r, 1, {"reverse": True})), "`reverse`: False on rank"
    ),
    "scan: combine_mode": _mismatch(
        lambda r, w: _scan(r, w, **_on(r, 0, {"combine_mode": "generic"})), "`combine_mode`"
    ),
    "scan: layout": _mismatch(
        lambda r, w: _scan(
            r,
            w,
            **_on(r, 0, {"layout": fd.Layout.contiguous(w, LENGTHS[w])}),
        ),
        "`layout`",
    ),
    "scan: reset on some ranks": _mismatch(
        lambda r, w: _scan(r, w, **_on(r, _last(w), {"reset": _mask(r, w)})), "`reset`: None"
    ),
    "scan: requires_grad on some ranks": _mismatch(
        lambda r, w: _scan(r, w, **_on(r, 0, {"xs": _piece(r, w).requires_grad_()})),
        "a backward exchange (grad mode, requires_grad): True on rank 0; False on rank",
    ),
    "scan: grad mode off on one rank": _mismatch(
        lambda r, w: _grad_mode(r == 1, _scan, r, w, xs=_piece(r, w).requires_grad_()),
        "a backward exchange (grad mode, requires_grad): True on rank",
    ),
    "scan on some ranks, recurrence on others": _mismatch(
        lambda r, w: (_recurrence if r == _last(w) else _scan)(r, w),
        "function: associative_scan on rank",
        "linear_recurrence on rank",
        same=False,
    ),
    "recurrence: dtype of b": _mismatch(
        lambda r, w: _recurrence(r, w, **_on(r, 1, {"b": _piece(r, w, dtype=torch.float32)})),
        "dtype of `b`: torch.float64 on rank",
    ),
    "recurrence: element shape": _mismatch(
        lambda r, w: _recurrence(r, w, **_on(r, _last(w), {"b": _piece(r, w, cols=3)})),
        "shape of `b` (n: the scan dimension): (n, 2) on rank",
    ),
    "recurrence: initial on some ranks": _mismatch(
        lambda r, w: _recurrence(
            r, w, **_on(r, 0, {"initial": torch.ones(2, dtype=torch.float64)})
        ),
        "`initial`",
    ),
    "recurrence: acc_dtype": _mismatch(
        lambda r, w: fd.linear_recurrence(
            0.5,
            _piece(r, w, dtype=torch.float32),
            0,
            **_on(r, _last(w), {"acc_dtype": torch.float64}),
        ),
        "`acc_dtype`: None on rank",
    ),
    "recurrence: reset on some ranks": _mismatch(
        lambda r, w: _recurrence(r, w, **_on(r, 0, {"reset": _mask(r, w)})), "`reset`"
    ),
    "recurrence: reverse": _mismatch(
        lambda r, w: _recurrence(r, w, **_on(r, _last(w), {"reverse": True})), "`reverse`"
    ),
    # one rank raises before the exchange: it raises its own error, the others hear of it
    "scan: dim out of range on the last rank": _peer_fails(
        lambda r, w: _scan(r, w, **_on(r, _last(w), {"dim": 5})),
        _last,
        lambda: fscan.ScanIndexError,
    ),
    "scan: bad layout on the empty rank": _peer_fails(
        lambda r, w: _scan(r, w, **_on(r, 1, {"layout": "contiguous"})),
        lambda w: 1,
        lambda: fscan.ScanTypeError,
    ),
    "scan: reset of the wrong length on rank 0": _peer_fails(
        lambda r, w: _scan(
            r,
            w,
            reset=torch.zeros(LENGTHS[w][r] + (r == 0), dtype=torch.bool),
        ),
        lambda w: 0,
        lambda: fscan.ScanValueError,
    ),
    "scan: combine_fn raises on rank 0": _peer_fails(
        lambda r, w: _scan(r, w, fn=_add_failing_on_rank_0),
        lambda w: 0,
        lambda: CombineFailed,
    ),
    "recurrence: gate of the wrong shape on the last rank": _peer_fails(
        lambda r, w: _recurrence(r, w, **_on(r, _last(w), {"a": torch.ones(7)})),
        _last,
        lambda: fscan.ScanValueError,
    ),
    "dtensor: a shard of the wrong length on rank 1": _peer_fails(
        lambda r, w: _dtensor(r, w, wrong_on=1), lambda w: 1, lambda: fscan.ScanValueError
    ),
    "matching calls after the errors": _ok(_matching_calls),
}


def _grad_mode(off: bool, call: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    with torch.set_grad_enabled(not off):
        call(*args, **kwargs)


# ---- the harness ------------------------------------------------------------------------


def _verdict(case: Case, rank: int, world: int) -> tuple[str, str]:
    """("ok" or what went wrong, the error message or "")."""
    want, words = case.expect(rank, world)
    try:
        case.run(rank, world)
    except Exception as err:
        got, text = type(err), str(err)
        exact = want is not None and want.__module__.startswith("fscan")  # not a subclass
        if want is None or not issubclass(got, want) or (exact and got is not want):
            return f"expected {want}, got {got.__name__}:\n{traceback.format_exc(limit=-6)}", text
        missing = [w for w in words if w not in text]
        return (f"message lacks {missing}: {text}" if missing else "ok"), text
    return ("ok" if want is None else f"expected {want.__name__}, the call returned"), ""


def worker(rank: int, world: int, port: int, results: Any) -> None:
    """Join the group, run every case, put ``(rank, {case: (verdict, message)})``."""
    gloo_ranks.run_cases(
        CASES,
        rank,
        world,
        port,
        results,
        timeout_s=TIMEOUT_S,
        verdict=_verdict,
        ok=_ok_verdict,
        # no background builds in the ranks
        setting=lambda: fscan.config.override(cpu_kernel="off"),
    )


def _ok_verdict(verdict: tuple[str, str] | str) -> bool:
    return verdict[0] == "ok" if isinstance(verdict, tuple) else verdict == "ok"


def _verdict_text(verdict: tuple[str, str] | str) -> str:
    return verdict[0] if isinstance(verdict, tuple) else verdict


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def ranks(request):
    return gloo_ranks.spawn(request.param, ["test_distributed_spmd"], worker)


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_expected_error(ranks, name):
    gloo_ranks.assert_case(ranks, name, ok=_ok_verdict, text=_verdict_text)
    if CASES[name].same_message:
        messages = {v[name][1] for v in ranks.got.values()}
        assert len(messages) == 1, messages


# ---- one rank: no peers to agree with ---------------------------------------------------


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_one_rank_raises_its_own_errors_unchanged(one_rank):
    with pytest.raises(fscan.ScanIndexError, match=r"^fscan.distributed.associative_scan: `dim`"):
        fd.associative_scan(torch.add, torch.ones(3, 2), 5)
    # two pieces on one rank: the exchange runs, with nobody else to agree with
    layout = fd.Layout.head_tail(1, local_length=4)
    with pytest.raises(CombineFailed):
        fd.associative_scan(_add_nonnegative, -torch.ones(4), 0, layout=layout)
    out = fd.associative_scan(torch.mul, torch.full((4,), 2.0), 0, layout=layout)
    assert out.tolist() == [2.0, 4.0, 8.0, 16.0]


@pytest.mark.parametrize("what", ["scan", "recurrence", "dtensor"])
def test_one_rank_compiles(one_rank, what):
    """torch.compile(fullgraph=True) of a distributed call on a group of one: the values
    and gradients of the one-process call (several ranks: tests/test_distributed.py)."""
    torch._dynamo.reset()
    if what == "scan":
        fn = lambda x: fd.associative_scan(torch.mul, x, 0, reverse=True)
        want_fn = lambda x: fscan.associative_scan(torch.mul, x, 0, reverse=True)
    elif what == "recurrence":
        fn = lambda x: fd.linear_recurrence(0.5, x, 0, reverse=True)
        want_fn = lambda x: fscan.linear_recurrence(0.5, x, 0, reverse=True)
    else:  # a DTensor sharded along the scan dimension, on a mesh of one
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (1,))
        fn = want_fn = lambda x: fscan.associative_scan(torch.mul, x, 0, reverse=True)
    x = _piece(0, 1).requires_grad_()
    if what == "dtensor":
        sharded = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(sharded)
        assert got.placements == (Shard(0),), got.placements
        (grad,) = torch.autograd.grad(got.to_local().sum(), sharded)
        got, grad = got.to_local(), grad.to_local()
    else:
        got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
        (grad,) = torch.autograd.grad(got.sum(), x)
    x = x.detach().requires_grad_()
    want = want_fn(x)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, want_grad)
