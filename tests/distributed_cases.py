"""The checks that tests/test_distributed.py runs inside every rank of a gloo group.

One spawn per world size runs every case here (starting ranks costs seconds;
a case costs milliseconds) and sends back, per case, "ok" or what differed.
Each case builds the same float64 global sequence on every rank, gives each
rank its piece, and compares the distributed result and its gradients with
``fscan`` run in one process on the whole sequence (rtol = atol = 1e-9):
values, gradients through ``torch.autograd.grad(inputs=pieces)``, through
``autograd.grad(inputs=params)`` (the closure's tensors; summed over ranks
with an all_reduce, as DDP would) and through ``.backward()``. The last case
makes one rank raise before the collective: every rank must see an error.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import optree
import torch
import torch.distributed as dist

import fscan
import fscan.distributed as fd

TOL = 1e-9
# pieces per rank: uneven ones with an empty piece (not the first rank's)
UNEVEN = {1: [5], 2: [6, 0], 3: [4, 0, 3], 4: [3, 0, 5, 1]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, port: int, queue: Any, timeout_s: float) -> None:
    """Join the group, run every case, put ``(rank, {case: verdict})`` on ``queue``."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    results: dict[str, str] = {}
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
        )
        failed = None
        for name, case in CASES.items():
            if failed is not None:  # the ranks may be out of step: stop, do not wait
                results[name] = f"not run: this rank stopped after case {failed!r} failed"
                continue
            try:
                case(rank, world)
                results[name] = "ok"
            except Exception:
                results[name] = traceback.format_exc(limit=-4)
                failed = name
    except Exception:
        results["<setup>"] = traceback.format_exc()
    queue.put((rank, results))
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- comparing one case ------------------------------------------------------------


@dataclass
class Case:
    """A global problem: ``make()`` gives the leaves (float64), their scan dims and the
    closure params; ``local(pieces, params)`` runs the distributed call on this rank's
    pieces; ``whole(leaves, params)`` is the one-process reference."""

    make: Callable[[], tuple[list[torch.Tensor], list[int], list[torch.Tensor]]]
    local: Callable[[list[torch.Tensor], list[torch.Tensor]], Any]
    whole: Callable[[list[torch.Tensor], list[torch.Tensor]], Any]
    lengths: list[int] = field(default_factory=list)
    # each rank's pieces as (start, length) slices of the global sequence, concatenated
    slices: list[list[tuple[int, int]]] | None = None


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.shape != want.shape or not torch.allclose(got, want, rtol=TOL, atol=TOL):
        raise AssertionError(f"{what}: got {got}, expected {want}")


def _take(x: torch.Tensor, dim: int, slices: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([x.narrow(dim, s, n) for s, n in slices], dim)


def check(case: Case, rank: int, world: int) -> None:
    torch.manual_seed(0)
    leaves, dims, params = case.make()
    lengths = case.lengths or UNEVEN[world]
    if case.slices is None:
        starts = [sum(lengths[:r]) for r in range(world)]
        slices = [[(starts[r], lengths[r])] for r in range(world)]
    else:
        slices = case.slices
    mine = slices[rank]
    leaves = [x.requires_grad_() for x in leaves]
    params = [p.requires_grad_() for p in params]
    want = optree.tree_leaves(case.whole(leaves, params))
    # the output's scan dim is the first leaf's dim, as in every case here
    out_dim = dims[0]
    cotangents = [torch.randn_like(w) for w in want]
    want_loss = sum((w * c).sum() for w, c in zip(want, cotangents))
    want_grads = torch.autograd.grad(want_loss, leaves + params)

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        pieces = [_take(x.detach(), d, mine).requires_grad_() for x, d in zip(leaves, dims)]
        got = optree.tree_leaves(case.local(pieces, params))
        loss = sum((g * _take(c, out_dim, mine)).sum() for g, c in zip(got, cotangents))
        return pieces, got, loss

    pieces, got, loss = run()
    for i, (g, w) in enumerate(zip(got, want)):
        _close(g, _take(w, out_dim, mine), f"value of leaf {i}")
    grads = torch.autograd.grad(loss, pieces, allow_unused=True)
    for i, (g, w, d) in enumerate(zip(grads, want_grads, dims)):
        _close(_zero_if_none(g, pieces[i]), _take(w, d, mine), f"grad(inputs=pieces)[{i}]")
    if params:
        pieces, got, loss = run()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for i, (g, w) in enumerate(zip(grads, want_grads[len(leaves) :])):
            g = _zero_if_none(g, params[i]).clone()
            dist.all_reduce(g)  # each rank holds its share of a shared tensor's gradient
            _close(g, w, f"grad(inputs=params)[{i}] summed over ranks")
    for p in params:
        p.grad = None
    pieces, got, loss = run()
    loss.backward()
    for i, (p, w, d) in enumerate(zip(pieces, want_grads, dims)):
        _close(_zero_if_none(p.grad, p), _take(w, d, mine), f".backward() grad of piece {i}")
    for i, (p, w) in enumerate(zip(params, want_grads[len(leaves) :])):
        g = _zero_if_none(p.grad, p).clone()
        dist.all_reduce(g)
        _close(g, w, f".backward() grad of param {i} summed over ranks")


def _zero_if_none(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


# ---- the cases -----------------------------------------------------------------------


def _affine(x: tuple, y: tuple) -> tuple:
    return x[0] * y[0], y[0] * x[1] + y[1]


def _affine_dict(x: dict, y: dict) -> dict:
    return {"a": x["a"] * y["a"], "h": y["a"] * x["h"] + y["h"]}


def _scan_case(
    combine: Callable,
    shapes: list[tuple[int, ...]],
    dim: int,
    *,
    reverse: bool = False,
    mode: str = "pointwise",
    tree: Callable = lambda p: p[0],
    static: bool = False,
    lengths: list[int] | None = None,
) -> Callable[[int, int], None]:
    def run(rank: int, world: int) -> None:
        ls = lengths[:world] if lengths else UNEVEN[world]
        n = sum(ls)

        def make():
            leaves = [
                torch.rand(*(n if s == -1 else s for s in shape), dtype=torch.float64) + 0.5
                for shape in shapes
            ]
            return leaves, [dim] * len(shapes), []

        layout = fd.Layout.contiguous(world, ls) if static else None
        check(
            Case(
                make,
                lambda p, _: fd.associative_scan(
                    combine, tree(p), dim, reverse, mode, layout=layout
                ),
                lambda x, _: fscan.associative_scan(combine, tree(x), dim, reverse, mode),
                ls,
            ),
            rank,
            world,
        )

    return run


def _dict_tree(p: list) -> dict:
    return {"a": p[0], "h": p[1]}


def _reset_case(reverse: bool) -> Callable[[int, int], None]:
    def run(rank: int, world: int) -> None:
        ls = UNEVEN[world]
        n = sum(ls)
        flags = torch.zeros(n, dtype=torch.bool)
        flags[::3] = True  # resets inside pieces and at piece starts
        starts = [sum(ls[:r]) for r in range(world)]
        mine = flags.narrow(0, starts[rank], ls[rank])
        check(
            Case(
                lambda: ([torch.rand(n, 2, dtype=torch.float64)], [0], []),
                lambda p, _: fd.associative_scan(torch.add, p[0], 0, reverse, reset=mine),
                lambda x, _: fscan.associative_scan(torch.add, x[0], 0, reverse, reset=flags),
                ls,
            ),
            rank,
            world,
        )

    return run


def _closure_pointwise(rank: int, world: int) -> None:
    ls = UNEVEN[world]
    n = sum(ls)

    def make():
        return [torch.rand(n, 3, dtype=torch.float64)], [0], [torch.rand(3, dtype=torch.float64)]

    def shifted(w):  # x + y + w is associative: addition conjugated by a shift
        return lambda x, y: x + y + w

    check(
        Case(
            make,
            lambda p, w: fd.associative_scan(shifted(w[0]), p[0], 0),
            lambda x, w: fscan.associative_scan(shifted(w[0]), x[0], 0),
            ls,
        ),
        rank,
        world,
    )


def _closure_generic(rank: int, world: int) -> None:
    # one element per rank on some ranks: their totals do not depend on W, so only
    # the gather's anchor on W keeps grad(inputs=params) from pruning their collective
    ls = [1] * world if world > 1 else [4]
    n = sum(ls)

    def make():
        mats = torch.randn(n, 2, 2, dtype=torch.float64) * 0.5
        return [mats], [0], [torch.randn(2, 2, dtype=torch.float64) * 0.5]

    def sandwich(w):  # A W B is associative: (A W B) W C = A W (B W C)
        return lambda x, y: x @ w @ y

    check(
        Case(
            make,
            lambda p, w: fd.associative_scan(
                sandwich(w[0]), p[0], 0, reverse=True, combine_mode="generic"
            ),
            lambda x, w: fscan.associative_scan(
                sandwich(w[0]), x[0], 0, reverse=True, combine_mode="generic"
            ),
            ls,
        ),
        rank,
        world,
    )


def _head_tail(rank: int, world: int) -> None:
    chunk = 2
    n = 2 * world * chunk
    layout = fd.Layout.head_tail(world, 2 * chunk)
    slices = [[(k * chunk, chunk) for k in row] for row in layout.order]
    check(
        Case(
            lambda: ([torch.rand(n, 3, dtype=torch.float64)], [0], []),
            lambda p, _: fd.associative_scan(torch.mul, p[0], 0, layout=layout),
            lambda x, _: fscan.associative_scan(torch.mul, x[0], 0),
            [2 * chunk] * world,
            slices,
        ),
        rank,
        world,
    )


def _linear_case(*, gate: str, reverse: bool, initial: bool, reset: bool):
    def run(rank: int, world: int) -> None:
        ls = UNEVEN[world]
        n = sum(ls)
        starts = [sum(ls[:r]) for r in range(world)]
        flags = (torch.arange(n) % 4 == 1) if reset else None
        mine = None if flags is None else flags.narrow(0, starts[rank], ls[rank])

        def make():
            b = torch.randn(n, 3, dtype=torch.float64)
            params = [torch.randn(3, dtype=torch.float64)] if initial else []
            if gate == "full":
                return [b, torch.rand(n, 3, dtype=torch.float64)], [0, 0], params
            return [b], [0], [torch.rand(3, dtype=torch.float64), *params]

        def split(leaves, params):
            if gate == "full":
                (b, a), init = leaves, (params[0] if initial else None)
            else:
                (b,), a, init = leaves, params[0], (params[1] if initial else None)
            return a, b, init

        def local(p, params):
            a, b, init = split(p, params)
            return fd.linear_recurrence(a, b, 0, initial=init, reverse=reverse, reset=mine)

        def whole(x, params):
            a, b, init = split(x, params)
            return fscan.linear_recurrence(a, b, 0, initial=init, reverse=reverse, reset=flags)

        check(Case(make, local, whole, ls), rank, world)

    return run


def _torch_func(rank: int, world: int) -> None:
    """torch.func.grad with uneven pieces; vmap and jacrev (a vmap over the backward)
    with equal pieces: the batch folds into the one collective, so every rank must
    map over the same batch size, and batch element b on one rank meets batch
    element b on the others. jvp has no rule (forward mode through a collective)."""
    torch.manual_seed(1)
    ls = UNEVEN[world]
    start = sum(ls[:rank])
    whole = torch.rand(sum(ls), 2, dtype=torch.float64) + 0.5
    piece = whole.narrow(0, start, ls[rank])
    layout = fd.Layout.contiguous(world, ls)

    def loss(x, scan):
        return (scan(x) ** 2).sum()

    want = torch.func.grad(loss)(whole, lambda x: fscan.associative_scan(torch.mul, x, 0))
    got = torch.func.grad(loss)(
        piece, lambda x: fd.associative_scan(torch.mul, x, 0, layout=layout)
    )
    _close(got, want.narrow(0, start, ls[rank]), "torch.func.grad")
    m = 2  # equal pieces from here on
    whole = torch.rand(m * world, 2, dtype=torch.float64) + 0.5
    piece = whole.narrow(0, m * rank, m)
    jac = torch.func.jacrev(lambda x: fd.linear_recurrence(0.5, x, 0))(piece)
    want_jac = torch.func.jacrev(lambda x: fscan.linear_recurrence(0.5, x, 0))(whole)
    # vmap runs in lockstep over ranks: basis vector b of jacrev is the cotangent e_b on
    # every rank at once, so row b is the sum over ranks r of global row r * m + b
    lockstep = want_jac.reshape(world, m, 2, m * world, 2).sum(0)
    _close(jac, lockstep.narrow(2, m * rank, m), "jacrev")
    batch = torch.stack([whole, whole.flip(0)])  # vmap over dim 0 of (2, n, 2)
    even = fd.Layout.contiguous(world, [m] * world)  # static lengths: no host read in vmap
    mapped = torch.func.vmap(lambda x: fd.associative_scan(torch.mul, x, 0, layout=even))(
        batch.narrow(1, m * rank, m)
    )
    want_mapped = torch.func.vmap(lambda x: fscan.associative_scan(torch.mul, x, 0))(batch)
    _close(mapped, want_mapped.narrow(1, m * rank, m), "vmap")


# ---- DTensor --------------------------------------------------------------------------


def _dtensor_shard(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for n in (12, 10, 3):  # even, uneven, and (W = 4) an empty shard
        torch.manual_seed(n)
        x = torch.rand(2, n, 3, dtype=torch.float64)
        gates = torch.rand(2, n, 3, dtype=torch.float64)
        dx = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
        dg = distribute_tensor(gates, mesh, [Shard(1)])
        out = fscan.associative_scan(_affine, (dg, dx), 1)[1]
        assert isinstance(out, DTensor) and out.placements == (Shard(1),), out
        assert out.shape == x.shape, (out.shape, x.shape)
        want = fscan.associative_scan(_affine, (gates, x.requires_grad_()), 1)[1]
        _close(out.full_tensor(), want.detach(), f"DTensor Shard(1) n={n}")
        (out.to_local() ** 2).sum().backward()
        (want**2).sum().backward()
        _close(dx.grad.full_tensor(), x.grad, f"DTensor Shard(1) grad n={n}")
        h = fscan.linear_recurrence(dg, dx.detach(), 1, reverse=True)
        assert isinstance(h, DTensor) and h.placements == (Shard(1),)
        want_h = fscan.linear_recurrence(gates, x.detach(), 1, reverse=True)
        _close(h.full_tensor(), want_h, f"DTensor linear_recurrence n={n}")
    # the scan dimension whole on every rank: a local scan, no communication
    for placement in (Replicate(), Shard(0)):
        d = distribute_tensor(torch.ones(4, 5), mesh, [placement])
        got = fscan.associative_scan(torch.add, d, 1)
        assert got.placements == (placement,)
        _close(got.full_tensor(), torch.ones(4, 5).cumsum(1), f"DTensor {placement}")


def _dtensor_refused(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    for call in (
        lambda: fscan.associative_scan(torch.add, partial, 0),
        lambda: fscan.associative_scan(
            _affine, (distribute_tensor(torch.ones(4), mesh, [Shard(0)]), torch.ones(4)), 0
        ),
        lambda: fscan.linear_recurrence(
            torch.ones(4), distribute_tensor(torch.ones(4), mesh, [Replicate()]), 0
        ),
    ):
        try:
            call()
        except fscan.ScanTypeError:
            continue
        raise AssertionError("expected fscan.ScanTypeError")
    sharded = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    try:
        fscan.associative_scan(torch.add, sharded, 0, initial=1.0)
    except fscan.UnsupportedScanError:
        pass
    else:
        raise AssertionError("expected fscan.UnsupportedScanError for initial= on Shard(dim)")
    replicated = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    got = fscan.associative_scan(torch.add, replicated, 0, initial=1.0)
    _close(got.full_tensor(), torch.arange(2.0, 6.0), "initial= on a Replicate() DTensor")


def _dtensor_2d(rank: int, world: int) -> None:
    if world != 4:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    x = torch.rand(4, 7, 3, dtype=torch.float64)
    dx = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    out = fscan.associative_scan(torch.add, dx, 1, reverse=True)
    assert out.placements == (Shard(0), Shard(1))
    _close(out.full_tensor(), x.flip(1).cumsum(1).flip(1), "DTensor dp x cp")


def _a_rank_raises(rank: int, world: int) -> None:
    """The last rank passes a bad argument (raises before the collective); every other
    rank must get an error (gloo: the peer left) instead of waiting forever."""
    x = torch.ones(3 if rank == world - 1 else 2, 2)
    bad = 5 if rank == world - 1 else 0  # dim out of range on the last rank only
    try:
        fd.associative_scan(torch.add, x, bad)
    except fscan.ScanValueError:
        if rank == world - 1:
            dist.destroy_process_group()  # leave: the peers' collective fails at once
            return
        raise
    except RuntimeError:
        return  # a peer left the collective: an error, not a hang
    if world > 1:
        raise AssertionError("rank finished a collective its peer never entered")


CASES: dict[str, Callable[[int, int], None]] = {
    "add": _scan_case(torch.add, [(-1, 3)], 0),
    "add reverse static lengths": _scan_case(torch.add, [(2, -1)], 1, reverse=True, static=True),
    "add one element per rank": _scan_case(torch.add, [(-1,)], 0, lengths=[1] * 4),
    "pair": _scan_case(_affine, [(-1, 3), (-1, 3)], 0, tree=tuple),
    "pair dict reverse dim 1": _scan_case(
        _affine_dict, [(2, -1, 3), (2, -1, 3)], 1, reverse=True, tree=_dict_tree
    ),
    "matmul generic": _scan_case(torch.matmul, [(-1, 2, 2)], 0, mode="generic"),
    "matmul generic reverse": _scan_case(
        torch.matmul, [(-1, 2, 2)], 0, reverse=True, mode="generic"
    ),
    "reset": _reset_case(False),
    "reset reverse": _reset_case(True),
    "closure pointwise": _closure_pointwise,
    "closure generic": _closure_generic,
    "head-tail layout": _head_tail,
    "linear full gates": _linear_case(gate="full", reverse=False, initial=False, reset=False),
    "linear channel gate initial reverse": _linear_case(
        gate="channel", reverse=True, initial=True, reset=False
    ),
    "linear reset initial": _linear_case(gate="full", reverse=False, initial=True, reset=True),
    "torch.func grad, jacrev, vmap": _torch_func,
    "dtensor shard": _dtensor_shard,
    "dtensor refused": _dtensor_refused,
    "dtensor 2-D mesh": _dtensor_2d,
    "a rank raises": _a_rank_raises,  # last: it leaves the group
}
