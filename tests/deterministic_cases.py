"""The checks tests/test_distributed_deterministic.py runs in every rank of a gloo group:
``deterministic=True`` gives each rank, for every split of the sequence, bitwise its
piece of the same call on a group of one rank holding the whole sequence; values
and float64 gradients match one process (``distributed_cases.check``).

The ranks run different thread counts (1 and 2 alternately), so a result that
depended on torch's split of work among threads would differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gloo_ranks
import torch
import torch.distributed as dist
from distributed_cases import Case, check

import fscan
import fscan.distributed as fd

# per world size, several splits of a sequence of 23 steps (blocks of 5): uneven, empty
# pieces, one-step pieces (a block over three ranks), everything on one rank
SPLITS = {
    1: [[23]],
    2: [[10, 13], [0, 23], [23, 0], [4, 19]],
    3: [[7, 0, 16], [1, 1, 21], [8, 8, 7], [0, 23, 0]],
    4: [[5, 0, 9, 9], [3, 1, 1, 18], [0, 0, 0, 23], [6, 6, 6, 5]],
}


def worker(rank: int, world: int, port: int, results: Any) -> None:
    """A rank of tests/test_distributed_deterministic.py: every case of :data:`CASES`
    (gloo_ranks), on 1 or 2 threads by rank (module doc)."""
    gloo_ranks.run_cases(CASES, rank, world, port, results, threads=1 + rank % 2)


# ---- comparing bits ------------------------------------------------------------------


def bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s bit patterns (NaN payloads and the sign of zero included)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.contiguous().view(ints[x.element_size()]) if x.is_floating_point() else x


def assert_bitwise(got: Any, want: Any, what: str = "") -> None:
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    want = list(want) if isinstance(want, (tuple, list)) else [want]
    for g, w in zip(got, want):
        if g.dtype != w.dtype or g.shape != w.shape:
            raise AssertionError(
                f"{what}: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}"
            )
        if not torch.equal(bits(g), bits(w)):
            raise AssertionError(f"{what}: not bitwise equal, max diff {(g - w).abs().max()}")


_ALONE: list[Any] = []


def _alone() -> Any:
    """A group of this rank alone (``new_subgroups`` is a collective: made once, in the
    first case, by every rank)."""
    if not _ALONE:
        _ALONE.append(dist.new_subgroups(group_size=1)[0])
    return _ALONE[0]


def _mine(x: torch.Tensor, dim: int, lengths: list[int], rank: int) -> torch.Tensor:
    return x.narrow(dim, sum(lengths[:rank]), lengths[rank])


# ---- bitwise, every split ------------------------------------------------------------


def _affine(x: tuple, y: tuple) -> tuple:
    return x[0] * y[0], y[0] * x[1] + y[1]


def _bitwise_scan(fn: Callable, dim: int, pair: bool = False, reset: bool = False):
    def run(rank: int, world: int) -> None:
        group = _alone()
        for lengths in SPLITS[world]:
            n = sum(lengths)
            gen = torch.Generator().manual_seed(n)  # the same sequence on every rank
            shape = [n, 3] if dim == 0 else [2, n, 3]
            leaves = [torch.randn(shape, generator=gen) for _ in range(2 if pair else 1)]
            if pair:
                leaves[0] = leaves[0].sigmoid()
            flags = torch.rand(n, generator=gen) < 0.2 if reset else None
            for reverse in (False, True):

                def scan(xs, mask, **kw):
                    tree = tuple(xs) if pair else xs[0]
                    return fd.associative_scan(
                        fn, tree, dim, reverse, reset=mask, deterministic=True, **kw
                    )

                got = scan(
                    [_mine(x, dim, lengths, rank) for x in leaves],
                    None if flags is None else _mine(flags, 0, lengths, rank),
                )
                whole = scan(leaves, flags, group=group)
                if pair:
                    whole = [_mine(x, dim, lengths, rank) for x in whole]
                else:
                    whole = _mine(whole, dim, lengths, rank)
                assert_bitwise(got, whole, f"pieces {lengths} reverse={reverse}")

    return run


def _bitwise_recurrence(rank: int, world: int) -> None:
    """linear_recurrence: full gates with ``initial`` and resets; a channel gate in
    bfloat16 accumulated in float32."""
    group = _alone()
    for lengths in SPLITS[world]:
        n = sum(lengths)
        gen = torch.Generator().manual_seed(n)
        a, b = torch.rand(n, 4, generator=gen), torch.randn(n, 4, generator=gen)
        h0, flags = torch.randn(4, generator=gen), torch.arange(n) % 7 == 3
        for reverse in (False, True):
            kw = dict(reverse=reverse, deterministic=True)
            got = fd.linear_recurrence(
                _mine(a, 0, lengths, rank),
                _mine(b, 0, lengths, rank),
                0,
                initial=h0,
                reset=_mine(flags, 0, lengths, rank),
                **kw,
            )
            whole = fd.linear_recurrence(a, b, 0, initial=h0, reset=flags, group=group, **kw)
            assert_bitwise(got, _mine(whole, 0, lengths, rank), f"pieces {lengths}")
            gate, low = a[0].bfloat16(), b.bfloat16()
            got = fd.linear_recurrence(
                gate, _mine(low, 0, lengths, rank), 0, acc_dtype=torch.float32, **kw
            )
            whole = fd.linear_recurrence(gate, low, 0, acc_dtype=torch.float32, group=group, **kw)
            assert_bitwise(got, _mine(whole, 0, lengths, rank), f"acc_dtype, pieces {lengths}")


def _bitwise_head_tail(rank: int, world: int) -> None:
    """torch context parallel's layout: rank r holds chunks r and 2W-1-r."""
    chunk = 3
    layout = fd.Layout.head_tail(world, 2 * chunk)
    x = torch.randn(2 * world * chunk, 3, generator=torch.Generator().manual_seed(1))
    mine = torch.cat([x[k * chunk : (k + 1) * chunk] for k in layout.order[rank]])
    got = fd.associative_scan(torch.logaddexp, mine, 0, layout=layout, deterministic=True)
    whole = fd.associative_scan(torch.logaddexp, x, 0, group=_alone(), deterministic=True)
    want = torch.cat([whole[k * chunk : (k + 1) * chunk] for k in layout.order[rank]])
    assert_bitwise(got, want, "head-tail")


# ---- values and gradients against one process (float64) ----------------------------------


def _against_one_process(combine: Callable, dim: int, reverse: bool, leaves: int = 1):
    def run(rank: int, world: int) -> None:
        n = sum(SPLITS[world][0])
        shape = (n, 3) if dim == 0 else (2, n, 3)

        def make():
            xs = [torch.rand(shape, dtype=torch.float64) + 0.5 for _ in range(leaves)]
            return xs, [dim] * leaves, []

        tree = (lambda p: tuple(p)) if leaves > 1 else (lambda p: p[0])

        def local(p, _):
            return fd.associative_scan(combine, tree(p), dim, reverse, deterministic=True)

        def whole(x, _):
            return fscan.associative_scan(combine, tree(x), dim, reverse)

        check(Case(make, local, whole, SPLITS[world][0]), rank, world)

    return run


def _closure_and_reset(rank: int, world: int) -> None:
    """A closed-over tensor's gradient (summed over ranks) and resets across pieces."""
    lengths = SPLITS[world][-1]
    n = sum(lengths)
    flags = torch.arange(n) % 4 == 1
    mine = _mine(flags, 0, lengths, rank)

    def shifted(w):  # x + y + w is associative: addition conjugated by a shift
        return lambda x, y: x + y + w

    def make():
        return [torch.rand(n, 3, dtype=torch.float64)], [0], [torch.rand(3, dtype=torch.float64)]

    def local(p, w):
        return fd.associative_scan(shifted(w[0]), p[0], 0, True, reset=mine, deterministic=True)

    def whole(x, w):
        return fscan.associative_scan(shifted(w[0]), x[0], 0, True, reset=flags)

    check(Case(make, local, whole, lengths), rank, world)


def _recurrence_against_one_process(rank: int, world: int) -> None:
    lengths = SPLITS[world][1 if world > 1 else 0]
    n = sum(lengths)
    flags = torch.arange(n) % 5 == 2
    mine = _mine(flags, 0, lengths, rank)

    def make():
        b, a = torch.randn(n, 3, dtype=torch.float64), torch.rand(n, 3, dtype=torch.float64)
        return [b, a], [0, 0], [torch.randn(3, dtype=torch.float64)]

    def local(p, h0):
        return fd.linear_recurrence(p[1], p[0], 0, initial=h0[0], reset=mine, deterministic=True)

    def whole(x, h0):
        return fscan.linear_recurrence(x[1], x[0], 0, initial=h0[0], reset=flags)

    check(Case(make, local, whole, lengths), rank, world)


def _jvp(rank: int, world: int) -> None:
    lengths = SPLITS[world][-1]
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(sum(lengths), 2, dtype=torch.float64, generator=gen) + 0.5
    t = torch.randn(sum(lengths), 2, dtype=torch.float64, generator=gen)
    h0 = torch.ones(2, dtype=torch.float64)
    mine = lambda v: _mine(v, 0, lengths, rank)
    for name, local, one in (
        (
            "scan",
            lambda v: fd.associative_scan(torch.logaddexp, v, 0, True, deterministic=True),
            lambda v: fscan.associative_scan(torch.logaddexp, v, 0, True),
        ),
        (
            "recurrence",
            lambda v: fd.linear_recurrence(0.5, v, 0, initial=h0, deterministic=True),
            lambda v: fscan.linear_recurrence(0.5, v, 0, initial=h0),
        ),
    ):
        got, got_t = torch.func.jvp(local, (mine(x),), (mine(t),))
        want, want_t = torch.func.jvp(one, (x,), (t,))
        torch.testing.assert_close(got, mine(want), msg=f"jvp {name}: value")
        torch.testing.assert_close(got_t, mine(want_t), msg=f"jvp {name}: tangent")


def _ranks_disagree(rank: int, world: int) -> None:
    """``deterministic`` on rank 0 only: every rank raises the same error naming it."""
    if world == 1:
        return
    try:
        fd.associative_scan(torch.add, torch.ones(3, 2), 0, deterministic=rank == 0)
    except fscan.ScanValueError as err:
        if "`deterministic`: True on rank 0; False on rank" not in str(err):
            raise
    else:
        raise AssertionError("the ranks made different calls and no rank raised")
    # the group is still usable
    got = fd.associative_scan(torch.add, torch.ones(2), 0, deterministic=True)
    assert_bitwise(got, torch.arange(1.0, 3.0) + 2 * rank)


def _a_rank_fails(rank: int, world: int) -> None:
    """The last rank's ``combine_fn`` fails on its data before any exchange: it raises its
    own error, every other rank ``fscan.PeerRankError``, and the group stays usable."""
    last = world - 1

    def add_but_not_on_last(x, y):
        if dist.get_rank() == last:
            raise ValueError("rank-local failure")
        return x + y

    try:
        fd.associative_scan(add_but_not_on_last, torch.ones(4, 2), 0, deterministic=True)
    except Exception as err:
        if (rank == last) == isinstance(err, fscan.PeerRankError):
            raise
        if rank == last and "rank-local failure" not in str(err):
            raise
    else:
        raise AssertionError("no rank raised")
    got = fd.associative_scan(torch.add, torch.ones(2), 0, deterministic=True)
    assert_bitwise(got, torch.arange(1.0, 3.0) + 2 * rank)


CASES: dict[str, Callable[[int, int], None]] = {
    "bitwise: add": _bitwise_scan(torch.add, 0),
    "bitwise: logaddexp dim 1": _bitwise_scan(torch.logaddexp, 1),
    "bitwise: affine pair": _bitwise_scan(_affine, 0, pair=True),
    "bitwise: logaddexp reset": _bitwise_scan(torch.logaddexp, 0, reset=True),
    "bitwise: linear_recurrence": _bitwise_recurrence,
    "bitwise: head-tail layout": _bitwise_head_tail,
    "one process: mul": _against_one_process(torch.mul, 0, False),
    "one process: affine pair reverse dim 1": _against_one_process(_affine, 1, True, leaves=2),
    "one process: closure and reset": _closure_and_reset,
    "one process: linear_recurrence": _recurrence_against_one_process,
    "torch.func.jvp": _jvp,
    "ranks disagree": _ranks_disagree,
    "a rank fails before the exchange": _a_rank_fails,
}
