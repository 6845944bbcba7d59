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

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import gloo_ranks
import optree
import torch
import torch.distributed as dist

import fscan
import fscan.distributed as fd

TOL = 1e-9
# pieces per rank: uneven ones with an empty piece (not the first rank's)
UNEVEN = {1: [5], 2: [6, 0], 3: [4, 0, 3], 4: [3, 0, 5, 1]}


def worker(rank: int, world: int, port: int, results: Any) -> None:
    """A rank of tests/test_distributed.py: every case of :data:`CASES` (gloo_ranks)."""
    gloo_ranks.run_cases(CASES, rank, world, port, results)


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
    compiled: bool = False,
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
        group = _group(compiled)
        local = lambda p, _: fd.associative_scan(
            combine, tree(p), dim, reverse, mode, layout=layout, group=group
        )
        check(
            Case(
                make,
                _compile(local) if compiled else local,
                lambda x, _: fscan.associative_scan(combine, tree(x), dim, reverse, mode),
                ls,
            ),
            rank,
            world,
        )

    return run


def _dict_tree(p: list) -> dict:
    return {"a": p[0], "h": p[1]}


# Every rank compiles its own graph before its first collective; on a loaded machine
# that can take longer than TIMEOUT_S, so compiled calls run on a group with more time.
_COMPILE_TIMEOUT_S = 600.0
_SLOW_GROUP: list[Any] = []


def _group(compiled: bool) -> Any:
    """The default group (None), or for compiled calls one with a long timeout (made by
    every rank in the same case: ``new_group`` is a collective)."""
    if not compiled:
        return None
    if not _SLOW_GROUP:
        _SLOW_GROUP.append(dist.new_group(timeout=timedelta(seconds=_COMPILE_TIMEOUT_S)))
    return _SLOW_GROUP[0]


def _at(world_size: int, case: Callable[[int, int], None]) -> Callable[[int, int], None]:
    """``case``, run at ``world_size`` only."""

    def run(rank: int, world: int) -> None:
        if world == world_size:
            case(rank, world)

    return run


def _compile(fn: Callable) -> Callable:
    """``fn`` under ``torch.compile(fullgraph=True)``: the collectives trace (aot_eager:
    the joint forward and backward graphs, without the time of a C++ build)."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def _reset_case(reverse: bool, compiled: bool = False) -> Callable[[int, int], None]:
    def run(rank: int, world: int) -> None:
        ls = UNEVEN[world]
        n = sum(ls)
        flags = torch.zeros(n, dtype=torch.bool)
        flags[::3] = True  # resets inside pieces and at piece starts
        starts = [sum(ls[:r]) for r in range(world)]
        mine = flags.narrow(0, starts[rank], ls[rank])
        group = _group(compiled)
        local = lambda p, _: fd.associative_scan(
            torch.add, p[0], 0, reverse, reset=mine, group=group
        )
        check(
            Case(
                lambda: ([torch.rand(n, 2, dtype=torch.float64)], [0], []),
                _compile(local) if compiled else local,
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

    local = lambda p, w: fd.associative_scan(shifted(w[0]), p[0], 0)

    check(
        Case(
            make,
            local,
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


def _linear_case(*, gate: str, reverse: bool, initial: bool, reset: bool, compiled: bool = False):
    def run(rank: int, world: int) -> None:
        ls = UNEVEN[world]
        n = sum(ls)
        starts = [sum(ls[:r]) for r in range(world)]
        flags = (torch.arange(n) % 4 == 1) if reset else None
        mine = None if flags is None else flags.narrow(0, starts[rank], ls[rank])
        group = _group(compiled)

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
            return fd.linear_recurrence(
                a, b, 0, initial=init, reverse=reverse, reset=mine, group=group
            )

        def whole(x, params):
            a, b, init = split(x, params)
            return fscan.linear_recurrence(a, b, 0, initial=init, reverse=reverse, reset=flags)

        check(Case(make, _compile(local) if compiled else local, whole, ls), rank, world)

    return run


def _torch_func(rank: int, world: int) -> None:
    """torch.func.grad with uneven pieces; vmap and jacrev (a vmap over the backward)
    with equal pieces: the batch folds into the one collective, so every rank must
    map over the same batch size, and batch element b on one rank meets batch
    element b on the others (forward mode: :func:`_jvp`)."""
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


def _jvp(rank: int, world: int) -> None:
    """torch.func.jvp: the tangents are gathered with the totals (uneven and empty
    pieces, lengths unknown; a recurrence with ``initial`` and resets)."""
    torch.manual_seed(2)
    ls = UNEVEN[world]
    n, start = sum(ls), sum(ls[:rank])
    whole, tangent = torch.rand(n, 2, dtype=torch.float64) + 0.5, torch.randn(n, 2).double()
    flags = torch.arange(n) % 3 == 2
    initial = torch.rand(2, dtype=torch.float64)
    mine = lambda t: t.narrow(0, start, ls[rank])
    for name, local, whole_fn in (
        (
            "scan reverse",
            lambda x: fd.associative_scan(torch.mul, x, 0, reverse=True),
            lambda x: fscan.associative_scan(torch.mul, x, 0, reverse=True),
        ),
        (
            "linear_recurrence",
            lambda x: fd.linear_recurrence(0.5, x, 0, initial=initial, reset=mine(flags)),
            lambda x: fscan.linear_recurrence(0.5, x, 0, initial=initial, reset=flags),
        ),
    ):
        got, got_t = torch.func.jvp(local, (mine(whole),), (mine(tangent),))
        want, want_t = torch.func.jvp(whole_fn, (whole,), (tangent,))
        _close(got, mine(want), f"jvp {name}: value")
        _close(got_t, mine(want_t), f"jvp {name}: tangent")


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


def _start_case(
    exclusive: bool,
    *,
    reverse: bool = False,
    reset: bool = False,
    deterministic: bool = False,
    compiled: bool = False,
    recurrence: bool = False,
) -> Callable[[int, int], None]:
    """``initial=`` / ``exclusive=`` across ranks (the step that moves to the next rank:
    fscan._sharded.shift): the affine pair's scan, or the linear recurrence, against
    the same call in one process; the gradient of ``initial`` summed over ranks."""

    def run(rank: int, world: int) -> None:
        ls = UNEVEN[world]
        n = sum(ls)
        flags = torch.zeros(n, dtype=torch.bool)
        flags[1::4] = True  # resets inside pieces and at piece starts
        flags = flags if reset else None
        start = sum(ls[:rank])
        mine = None if flags is None else flags.narrow(0, start, ls[rank])
        group = _group(compiled)

        def make():
            a = torch.rand(n, 3, dtype=torch.float64) + 0.5
            b = torch.randn(n, 3, dtype=torch.float64)
            init = [torch.rand(3, dtype=torch.float64) + 0.5, torch.randn(3, dtype=torch.float64)]
            return [a, b], [0, 0], init[1:] if recurrence else init

        opts = dict(reverse=reverse, exclusive=exclusive)
        if recurrence:
            local = lambda p, q: fd.linear_recurrence(
                p[0],
                p[1],
                0,
                initial=q[0],
                reset=mine,
                group=group,
                deterministic=deterministic,
                **opts,
            )
            whole = lambda x, q: fscan.linear_recurrence(
                x[0], x[1], 0, initial=q[0], reset=flags, **opts
            )
        else:
            local = lambda p, q: fd.associative_scan(
                _affine,
                tuple(p),
                0,
                initial=tuple(q),
                reset=mine,
                group=group,
                deterministic=deterministic,
                **opts,
            )
            whole = lambda x, q: fscan.associative_scan(
                _affine, tuple(x), 0, initial=tuple(q), reset=flags, **opts
            )
        check(Case(make, _compile(local) if compiled else local, whole, ls), rank, world)

    return run


def _compiled_without_grad(rank: int, world: int) -> None:
    """A compiled call that records no gradient (inputs without requires_grad, and under
    no_grad): the exchange is the bare functional collective (Dynamo called the
    autograd Function with its context in place of the buffer)."""
    ls = UNEVEN[world]
    n = sum(ls)
    torch.manual_seed(0)
    x = torch.rand(n, 3, dtype=torch.float64)
    mine = x.narrow(0, sum(ls[:rank]), ls[rank])
    group = _group(True)
    scan = _compile(lambda p: fd.associative_scan(torch.add, p, 0, group=group))
    _close(scan(mine), x.cumsum(0).narrow(0, sum(ls[:rank]), ls[rank]), "value")
    with torch.no_grad():
        _close(
            scan(mine.requires_grad_()), x.cumsum(0).narrow(0, sum(ls[:rank]), ls[rank]), "no_grad"
        )


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
    # torch.compile(fullgraph=True): values and gradients, empty pieces included. Each
    # rank compiles each case (tens of seconds on 2 shared cores), so each runs at one
    # world size: 3 (an empty piece between two others) and 2 (an empty last piece).
    "compile: add, lengths unknown": _at(3, _scan_case(torch.add, [(-1, 3)], 0, compiled=True)),
    "compile: reset reverse": _at(3, _reset_case(True, compiled=True)),
    "compile: linear reset initial": _at(
        2, _linear_case(gate="full", reverse=False, initial=True, reset=True, compiled=True)
    ),
    "exclusive pair": _start_case(True),
    "exclusive pair reverse reset": _start_case(True, reverse=True, reset=True),
    "exclusive pair deterministic reset": _start_case(True, reset=True, deterministic=True),
    "initial pair inclusive reset": _start_case(False, reset=True),
    "initial pair inclusive reverse deterministic": _start_case(
        False, reverse=True, deterministic=True
    ),
    "exclusive linear reset": _start_case(True, reset=True, recurrence=True),
    "exclusive linear reverse deterministic": _start_case(
        True, reverse=True, deterministic=True, recurrence=True
    ),
    "compile: exclusive pair": _at(3, _start_case(True, compiled=True)),
    # the moved step with reset=: the first rank's results read nothing gathered, and
    # its gathers must stay in its compiled forward (fscan._sharded.exchange.tie)
    "compile: exclusive pair reset": _at(2, _start_case(True, reset=True, compiled=True)),
    "compile: initial pair inclusive reverse reset": _at(
        3, _start_case(False, reverse=True, reset=True, compiled=True)
    ),
    "compile: no gradient recorded": _at(2, _compiled_without_grad),
    "torch.func grad, jacrev, vmap": _torch_func,
    "torch.func.jvp": _jvp,
    "dtensor shard": _dtensor_shard,
    "dtensor refused": _dtensor_refused,
    "dtensor 2-D mesh": _dtensor_2d,
    "a rank raises": _a_rank_raises,  # last: it leaves the group
}


# ---- linear recurrences: inf, NaN, resets and gate products across ranks -------------
#
# Against a float64 sequential loop (values equal, NaN and inf included): a reset
# must stop an inf or NaN carried from another rank (a selection, never a zero gate),
# and a rank whose gate product under- or overflows must still pass on the loop's
# state (0 * inf, inf * 0). Both directions, uneven and empty pieces, DTensors too.

NAN, INF = float("nan"), float("inf")
# per world size: uneven pieces, and pieces with empty ones
PIECES = {1: [[9]], 2: [[6, 3], [0, 9]], 3: [[3, 4, 2], [4, 0, 5]], 4: [[3, 0, 4, 2], [2, 3, 0, 4]]}


def _loop(a, b, initial=None, reverse=False, reset=None):
    """h[t] = b[t] at a reset (or the first step without `initial`), else a[t] h + b[t]."""
    a = a.expand_as(b)
    h, out = initial, [None] * b.shape[0]
    for t in range(b.shape[0] - 1, -1, -1) if reverse else range(b.shape[0]):
        restart = h is None or (reset is not None and bool(reset[t]))
        h = b[t] if restart else a[t] * h + b[t]
        out[t] = h.expand_as(b[t])
    return torch.stack(out)


def _same(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = TOL) -> None:
    """Equal up to rtol, with NaN and inf where the reference has them."""
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol, equal_nan=True)
    except AssertionError as err:
        raise AssertionError(f"{what}: got {got}, expected {want}\n{err}") from None


def _my_piece(x: torch.Tensor, lengths: list[int], rank: int) -> torch.Tensor:
    return x.narrow(0, sum(lengths[:rank]), lengths[rank])


def _linear_poison(reverse: bool):
    """inf/NaN at the last step of every piece (the first, reversed) and a reset at the
    first step of the next one; or inf/NaN early in a piece and a reset in its middle
    (the later pieces must get the state after the reset); `initial` inf dropped by a
    reset at the first step."""

    def run(rank: int, world: int) -> None:
        for lengths, within in ((p, w) for p in PIECES[world] for w in (False, True)):
            n = sum(lengths)
            b = torch.rand(n, 3, dtype=torch.float64)
            a = torch.rand(n, 3, dtype=torch.float64)
            reset = torch.zeros(n, dtype=torch.bool)
            for k, length in enumerate(lengths):
                start, poison = sum(lengths[:k]), [NAN, INF, -INF][k % 3]
                if within and length >= 3:
                    at = start + length - 2 if reverse else start + 1
                    cut = start + (length - 2) // 2 if reverse else start + length // 2 + 1
                elif not within and length and start + length < n:  # a later piece
                    end = start + length
                    at, cut = (end, end - 1) if reverse else (end - 1, end)
                else:
                    continue
                b[at, k % 3] = poison
                reset[cut] = True
            reset[n - 1 if reverse else 0] = True  # drops the inf `initial`
            initial = torch.tensor([INF, 1.0, -INF], dtype=torch.float64)
            want = _loop(a, b, initial, reverse, reset)
            pa, pb = (_my_piece(x, lengths, rank) for x in (a, b))
            pb = pb.clone().requires_grad_()
            got = fd.linear_recurrence(
                pa, pb, 0, initial=initial, reverse=reverse, reset=_my_piece(reset, lengths, rank)
            )
            what = f"pieces {lengths}, {'within pieces' if within else 'at boundaries'}"
            _same(got, _my_piece(want, lengths, rank), f"values, {what}")
            # gradients of b: the adjoint recurrence, cut by the same resets
            bw = b.clone().requires_grad_()
            cot = torch.rand(n, 3, dtype=torch.float64)
            (gw,) = torch.autograd.grad(_loop(a, bw, initial, reverse, reset), bw, cot)
            (g,) = torch.autograd.grad(got, pb, _my_piece(cot, lengths, rank))
            _same(g, _my_piece(gw, lengths, rank), f"grad of b, {what}")

    return run


def _linear_products(dtype: torch.dtype, reverse: bool):
    """Gates whose product over a piece underflows (meeting an inf state) or
    overflows (meeting a zero state): the loop's states, not 0 * inf or inf * 0."""

    def run(rank: int, world: int) -> None:
        tol = 1e-5 if dtype == torch.float32 else TOL
        gate = 1e-3 if dtype == torch.float32 else 1e-30  # 20 steps: below the range
        for lengths in ([20] * world, [30, 0, 25, 12][:world]):
            n = sum(lengths)
            ahead = (lambda t: n - 1 - t) if reverse else (lambda t: t)  # scan order
            small = torch.full((n, 2), gate, dtype=dtype)
            b = torch.ones(n, 2, dtype=dtype)
            b[ahead(0), 0] = float("inf")  # carried as inf: gate * inf = inf each step
            big = torch.full((n, 2), 1 / gate, dtype=dtype)
            zeros = torch.zeros(n, 2, dtype=dtype)
            zeros[ahead(n - 2), 1] = 1.0  # 0 until the last steps: gate * 0 = 0 before
            inf, zero = torch.full((2,), float("inf"), dtype=dtype), torch.zeros(2, dtype=dtype)
            for a, x, h0 in (
                (small, b, None),
                (small, b, inf),
                (big, zeros, None),
                (big, zeros, zero),
            ):
                want = _loop(a.double(), x.double(), h0, reverse).to(dtype)
                pa, px = (_my_piece(t, lengths, rank) for t in (a, x))
                got = fd.linear_recurrence(pa, px, 0, reverse=reverse, initial=h0)
                what = f"gates {a[0, 0]} {lengths} initial {h0}"
                _same(got, _my_piece(want, lengths, rank), what, tol)
                if reverse and h0 is None:  # a DTensor sharded along time: the same path
                    _dtensor_same(a, x, reverse, want, tol, world)

    return run


def _dtensor_same(a, x, reverse, want, tol, world) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    da, dx = (distribute_tensor(t, mesh, [Shard(0)]) for t in (a, x))
    got = fscan.linear_recurrence(da, dx, 0, reverse=reverse)
    _same(got.full_tensor(), want, "DTensor Shard(0)", tol)


def _linear_dtensor_reset(rank: int, world: int) -> None:
    """DTensor Shard(0) inputs to fscan.linear_recurrence: an inf and a NaN stopped by
    resets at the shard boundaries (torch.chunk's shards: 3, 3, 3 for W = 3)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for reverse in (False, True):
        b = torch.ones(9, dtype=torch.float64)
        b[1], b[7] = float("inf"), float("nan")
        reset = torch.zeros(9, dtype=torch.bool)
        reset[2 if reverse else 3] = True
        reset[6 if reverse else 8] = True
        db, dr = (distribute_tensor(t, mesh, [Shard(0)]) for t in (b, reset))
        got = fscan.linear_recurrence(0.5, db, 0, reverse=reverse, reset=dr)
        half = torch.tensor(0.5, dtype=torch.float64)
        _same(got.full_tensor(), _loop(half, b, None, reverse, reset), f"reverse={reverse}")


def _linear_acc_dtype(rank: int, world: int) -> None:
    """acc_dtype reaches the local walks and the exchanged maps: bfloat16 gates in
    [0.95, 1] over 2000 steps are as accurate sharded as in one process."""
    gen = torch.Generator().manual_seed(0)
    n = 2000
    a = (torch.rand(n, 4, generator=gen) * 0.05 + 0.95).to(torch.bfloat16)
    b = torch.randn(n, 4, generator=gen).to(torch.bfloat16)
    exact = _loop(a.double(), b.double())
    lengths = [n // world] * (world - 1) + [n - (world - 1) * (n // world)]
    got = fd.linear_recurrence(
        _my_piece(a, lengths, rank), _my_piece(b, lengths, rank), 0, acc_dtype=torch.float32
    )
    assert got.dtype == torch.bfloat16, got.dtype
    mine = _my_piece(exact, lengths, rank)
    floor = (mine.to(torch.bfloat16).double() - mine).abs().max()
    error = (got.double() - mine).abs().max()
    assert error <= 2 * floor, f"error {error} against the rounding of the result {floor}"


CASES.update(
    {
        "linear inf/NaN stopped by resets across ranks": _linear_poison(False),
        "linear inf/NaN stopped by resets across ranks, reverse": _linear_poison(True),
        "linear gate products under/overflow, float64": _linear_products(torch.float64, False),
        "linear gate products under/overflow, float32 reverse": _linear_products(
            torch.float32, True
        ),
        "linear DTensor Shard(0) reset stops inf/NaN": _linear_dtensor_reset,
        "linear acc_dtype across ranks": _linear_acc_dtype,
    }
)
# "a rank raises" leaves the group: it stays the last case
CASES["a rank raises"] = CASES.pop("a rank raises")
