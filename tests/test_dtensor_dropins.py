"""The drop-ins (``fscan.cumsum`` & co.) on DTensors, on gloo at world sizes 1 to 4.

A DTensor sharded along the scanned dimension must come back sharded the same way,
with the values of the op on the whole tensor: against torch's op (forward,
inclusive: cummax/cummin's indices bitwise) and against a sequential float64 loop
(both directions, ``exclusive=``, ``reset=``, ``dtype=``), values and gradients,
over even, uneven and empty shards. Other placements scan locally; ``Partial()`` is
reduced first, as torch does; the refusals name the argument and the fix.

Each world size is started once (module-scoped fixture, ``gloo_ranks.spawn``) and
runs every case of ``CASES`` in its ranks; each test reads one case's verdict on
every rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import gloo_ranks
import pytest
import torch
import torch.distributed as dist

import fscan

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo"
)

WORLD_SIZES = (1, 2, 3, 4)
# Global lengths: even and uneven shards, at W = 4 an empty one (13: 4, 4, 4, 1;
# 3: 1, 1, 1, 0; 5 at W = 3 and 4: 2, 2, 1 (, 0)), and no element at all.
LENGTHS = (13, 5, 3, 0)
OPS = {
    "cumsum": torch.cumsum,
    "cumprod": torch.cumprod,
    "cummax": torch.cummax,
    "cummin": torch.cummin,
    "logcumsumexp": torch.logcumsumexp,
}
EXTREMA = ("cummax", "cummin")


# ---- the sequential reference -------------------------------------------------------


def loop(name: str, x: torch.Tensor, dim: int, reverse=False, reset=None, exclusive=False):
    """``name``'s drop-in on ``x`` step by step along ``dim`` (float64 for floating
    inputs, int64 for the others): ``(values, indices)`` for cummax/cummin, else values.
    Differentiable: autograd through it gives the reference gradients."""
    wide = torch.float64 if x.is_floating_point() else torch.int64
    xs = x.to(wide).movedim(dim, 0)
    n = xs.shape[0]
    if reset is not None:
        shape = [n] + [1] * (x.ndim - 1) if reset.ndim == 1 else None
        reset = (reset.reshape(shape) if shape else reset.movedim(dim, 0)).expand(xs.shape)
    lane = xs.shape[1:]
    start_value = _identity(name, wide)
    value = torch.full(lane, start_value, dtype=wide)
    index = torch.full(lane, -1, dtype=torch.int64)
    values, indices = [None] * n, [None] * n
    for t in range(n - 1, -1, -1) if reverse else range(n):
        if reset is not None:  # a segment starts here: from the identity
            value = torch.where(reset[t], torch.full_like(value, start_value), value)
            index = torch.where(reset[t], -1, index)
        if exclusive:
            values[t], indices[t] = value, index
        step = xs[t]
        if name in EXTREMA:
            wins = (step >= value if name == "cummax" else step <= value) | step.isnan()
            value, index = torch.where(wins, step, value), torch.where(wins, t, index)
        else:
            combine = {"cumsum": torch.add, "cumprod": torch.mul, "logcumsumexp": torch.logaddexp}
            value = combine[name](value, step)
        if not exclusive:
            values[t], indices[t] = value, index
    if n == 0:
        empty = xs.new_empty(x.shape), xs.new_empty(x.shape, dtype=torch.int64)
        return empty if name in EXTREMA else empty[0]
    out = torch.stack(values).movedim(0, dim)
    return (out, torch.stack(indices).movedim(0, dim)) if name in EXTREMA else out


def _identity(name: str, dtype: torch.dtype) -> float:
    if name in EXTREMA:
        if dtype.is_floating_point:
            return float("-inf") if name == "cummax" else float("inf")
        info = torch.iinfo(dtype)
        return info.min if name == "cummax" else info.max
    return {"cumsum": 0, "cumprod": 1, "logcumsumexp": float("-inf")}[name]


def _torch_whole(name: str, x: torch.Tensor, dim: int, reverse: bool) -> Any:
    """torch's op on the whole tensor; reversed: flip, op, flip (indices mapped back)."""
    op = OPS[name]
    if not reverse:
        return op(x, dim)
    out = op(x.flip(dim), dim)
    if name not in EXTREMA:
        return out.flip(dim)
    return out.values.flip(dim), (x.shape[dim] - 1 - out.indices).flip(dim)


# ---- comparing ----------------------------------------------------------------------


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _same(got: Any, want: Any, what: str, rtol: float = 1e-6) -> None:
    """Values within ``rtol`` (NaN where NaN), indices and integers bitwise."""
    got, want = _full(got), want.detach()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if want.is_floating_point():
        ok = torch.allclose(got.to(want.dtype), want, rtol=rtol, atol=rtol, equal_nan=True)
    else:
        ok = got.dtype == want.dtype and torch.equal(got, want)
    if not ok:
        raise AssertionError(f"{what}: got {got}, expected {want}")


def _check_result(name, got, want, what, placements, rtol=1e-6) -> None:
    """``got`` (a DTensor or cummax's pair) against ``want``, placed like the input."""
    parts = (got.values, got.indices) if name in EXTREMA else (got,)
    wants = want if name in EXTREMA else (want,)
    for part, w, label in zip(parts, wants, ("values", "indices")):
        if part.placements != placements:
            raise AssertionError(f"{what} {label}: placements {part.placements}, {placements}")
        _same(part, w, f"{what} {label}", rtol)


def _data(name: str, shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values with ties (small integers) for the extrema, near 1 for products."""
    g = torch.Generator().manual_seed(seed)
    if name in EXTREMA or not dtype.is_floating_point:
        return torch.randint(0, 4, shape, generator=g).to(dtype)
    if name == "cumprod":
        return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _layouts(n: int) -> list[tuple[tuple, int]]:
    """(global shape, scanned dim): the scanned dim first, in the middle and last."""
    return [((n, 3), 0), ((2, n, 3), 1), ((2, n), -1)]


# ---- the cases ------------------------------------------------------------------------


def _values(rank: int, world: int) -> None:
    """Every op, both directions, inclusive and exclusive, every layout and length:
    Shard(dim) in, Shard(dim) out, equal to torch (forward) and to the loop."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    for name, n, (shape, dim), reverse, exclusive in itertools.product(
        OPS, LENGTHS, _layouts(5), (False, True), (False, True)
    ):
        shape = tuple(n if s == 5 else s for s in shape)
        for dtype in (torch.float32, torch.float64):
            x = _data(name, shape, dtype, seed=n)
            placements = (Shard(dim % len(shape)),)
            dx = distribute_tensor(x, mesh, list(placements))
            drop_in = getattr(fscan, name)
            got = drop_in(dx, dim, reverse=reverse, exclusive=exclusive)
            what = f"{name} {tuple(shape)} dim={dim} reverse={reverse} excl={exclusive} {dtype}"
            want = loop(name, x, dim, reverse, exclusive=exclusive)
            _check_result(name, got, want, what, placements, 1e-5)
            if not exclusive:  # torch's own op on the whole tensor: indices bitwise
                _check_result(name, got, _torch_whole(name, x, dim, reverse), what, placements)


def _ties_and_nans(rank: int, world: int) -> None:
    """cummax/cummin across shard boundaries: equal values (the later index wins, in
    scan order) and NaNs (a NaN stays; a later NaN takes over the index), as torch."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    nan = float("nan")
    for x in (
        torch.tensor([2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]),
        torch.tensor([1.0, 3.0, nan, 3.0, 5.0, nan, 0.0, 4.0]),
        torch.tensor([nan, 1.0, 1.0, nan, 1.0, 1.0, 1.0, nan]),
        torch.tensor([float("-inf")] * 4 + [1.0] * 4),
        torch.tensor([True, False, True, True, False, False, True, False]),
        torch.tensor([3, 1, 3, 0, 3, 2, 1, 3], dtype=torch.int32),
    ):
        dx = distribute_tensor(x, mesh, [Shard(0)])
        for name, reverse in itertools.product(EXTREMA, (False, True)):
            drop_in = getattr(fscan, name)
            got = drop_in(dx, 0, reverse=reverse)
            want = _torch_whole(name, x, 0, reverse)
            _check_result(name, got, want, f"{name} {x} reverse={reverse}", (Shard(0),), 0.0)
            # exclusive: a carry equal to the identity (-inf) keeps its index, not -1
            got = drop_in(dx, 0, reverse=reverse, exclusive=True)
            want = drop_in(x, 0, reverse=reverse, exclusive=True)  # one process: the oracle
            what = f"exclusive {name} {x} reverse={reverse}"
            _check_result(name, got, want, what, (Shard(0),), 0.0)


def _resets(rank: int, world: int) -> None:
    """``reset=`` a DTensor sharded like ``input`` (1-D and full-shape masks, a segment
    crossing shards, a reset at a shard's first step), inclusive and exclusive."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    for name, n, reverse, exclusive, full in itertools.product(
        OPS, (13, 3), (False, True), (False, True), (False, True)
    ):
        x = _data(name, (2, n, 3), torch.float64, seed=n)
        g = torch.Generator().manual_seed(n + 1)
        if full:
            reset = torch.rand(2, n, 1, generator=g) < 0.25
            dreset = distribute_tensor(reset, mesh, [Shard(1)])
        else:
            reset = torch.zeros(n, dtype=torch.bool)
            reset[::4] = True  # segment starts at 0, 4, 8, 12: shard starts at W = 4
            dreset = distribute_tensor(reset, mesh, [Shard(0)])
        dx = distribute_tensor(x, mesh, [Shard(1)])
        got = getattr(fscan, name)(dx, 1, reverse=reverse, reset=dreset, exclusive=exclusive)
        want = loop(name, x, 1, reverse, reset, exclusive)
        what = f"{name} n={n} reset({'full' if full else '1-D'}) reverse={reverse} excl={exclusive}"
        _check_result(name, got, want, what, (Shard(1),), 1e-9)


def _dtypes(rank: int, world: int) -> None:
    """Integer and bool inputs (summed in int64, as torch does) and ``dtype=``."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    x = torch.arange(-5, 8, dtype=torch.int32)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    for name in ("cumsum", "cumprod"):
        op = OPS[name]
        _check_result(name, getattr(fscan, name)(dx, 0), op(x, 0), name, (Shard(0),))
        got = getattr(fscan, name)(dx, 0, dtype=torch.float64)
        _check_result(name, got, op(x, 0, dtype=torch.float64), f"{name} dtype=", (Shard(0),))
    flags = distribute_tensor(x > 0, mesh, [Shard(0)])
    _check_result("cumsum", fscan.cumsum(flags, 0), torch.cumsum(x > 0, 0), "bool", (Shard(0),))
    half = torch.linspace(-2, 2, 13, dtype=torch.bfloat16)
    dh = distribute_tensor(half, mesh, [Shard(0)])
    got = fscan.logcumsumexp(dh, 0)
    _check_result("logcumsumexp", got, torch.logcumsumexp(half, 0), "bf16", (Shard(0),), 2e-2)


def _gradients(rank: int, world: int) -> None:
    """float64 gradients through the DTensor drop-ins against autograd through the loop
    (every op, both directions, exclusive and reset), over uneven and empty shards."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    for name, n, reverse, exclusive, with_reset in itertools.product(
        OPS, (13, 3), (False, True), (False, True), (False, True)
    ):
        x = _data(name, (n, 2), torch.float64, seed=n)
        if name in EXTREMA:  # distinct values: the gradient of a tie is a choice
            x = x + torch.arange(2 * n, dtype=torch.float64).reshape(n, 2) * 1e-3
        reset = (torch.arange(n) % 5 == 2) if with_reset else None
        x.requires_grad_()
        want = loop(name, x, 0, reverse, reset, exclusive)
        want = want[0] if name in EXTREMA else want
        cotangent = torch.randn(want.shape, dtype=torch.float64, generator=_gen(n))
        (want_grad,) = torch.autograd.grad((want * cotangent).sum(), x)
        dx = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        dreset = None if reset is None else distribute_tensor(reset, mesh, [Shard(0)])
        got = getattr(fscan, name)(dx, 0, reverse=reverse, reset=dreset, exclusive=exclusive)
        got = got.values if name in EXTREMA else got
        dcot = distribute_tensor(cotangent, mesh, [Shard(0)])
        (got.to_local() * dcot.to_local()).sum().backward()
        what = f"{name} n={n} reverse={reverse} excl={exclusive} reset={with_reset} grad"
        _same(dx.grad, want_grad, what, 1e-9)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _placements(rank: int, world: int) -> None:
    """Replicate() and Shard of another dim: a local scan, placements kept, nothing
    moved; Partial(): reduced first (as torch), the result replicated; on a 2-D mesh
    (W = 4) a data-parallel Shard(0) with the sequence on the other mesh dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = _mesh(world)
    x = _data("cumsum", (world + 1, 7), torch.float64, seed=3)
    for placement in (Replicate(), Shard(0)):
        dx = distribute_tensor(x, mesh, [placement])
        for name, reverse in itertools.product(OPS, (False, True)):
            with CommDebugMode() as comms:
                got = getattr(fscan, name)(dx, 1, reverse=reverse, exclusive=reverse)
            if comms.get_total_counts():
                raise AssertionError(f"{name} on {placement}: {comms.get_comm_counts()}")
            want = loop(name, x, 1, reverse, exclusive=reverse)
            _check_result(name, got, want, f"{name} {placement}", (placement,), 1e-9)
    partial = DTensor.from_local(x, mesh, [Partial()])
    got = fscan.cumsum(partial, 1)
    _check_result("cumsum", got, torch.cumsum(x * world, 1), "Partial()", (Replicate(),), 1e-9)
    if world == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        y = _data("cumsum", (4, 7, 3), torch.float64, seed=4)
        dy = distribute_tensor(y, mesh2, [Shard(0), Shard(1)])
        got = fscan.cumsum(dy, 1, reverse=True)
        want = loop("cumsum", y, 1, reverse=True)
        _check_result("cumsum", got, want, "2-D mesh dp x cp", (Shard(0), Shard(1)), 1e-9)
        reset = torch.arange(7) % 3 == 1
        dreset = distribute_tensor(reset, mesh2, [Replicate(), Shard(0)])
        got = fscan.cummin(dy, 1, reset=dreset, exclusive=True)
        want = loop("cummin", y, 1, reset=reset, exclusive=True)
        _check_result("cummin", got, want, "2-D mesh reset", (Shard(0), Shard(1)), 1e-9)


def _moves_only_carries(rank: int, world: int) -> None:
    """Across the ranks: the agreement's 16 bytes and one all_gather of one element per
    lane, not the axis (torch's own op on the same DTensor all-gathers it)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = _mesh(world)
    dx = distribute_tensor(torch.ones(64, 2), mesh, [Shard(0)])
    with CommDebugMode() as comms:
        got = fscan.cumsum(dx, 0)
    if got.placements != (Shard(0),):
        raise AssertionError(got.placements)
    counts = {str(k): v for k, v in comms.get_comm_counts().items()}
    expected = {"c10d._allgather_base_": 1, "c10d_functional.all_gather_into_tensor": 1}
    if counts != (expected if world > 1 else {}):
        raise AssertionError(f"expected the agreement's and the carries' gathers, got {counts}")


def _swap(rank: int, world: int) -> None:
    """Under fscan.swap_cumulative_ops() torch's ops and methods on a DTensor run the
    drop-ins: the result stays sharded (torch's own would be Replicate())."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    x = _data("cummax", (13, 2), torch.float64, seed=5)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    with fscan.swap_cumulative_ops():
        summed = torch.cumsum(dx, 0)
        peaks = dx.cummax(0)
        logs = torch.logcumsumexp(dx, 0)
        in_place = dx.clone().cumsum_(0)
    _check_result("cumsum", summed, torch.cumsum(x, 0), "swap cumsum", (Shard(0),))
    _check_result("cummax", peaks, torch.cummax(x, 0), "swap cummax", (Shard(0),))
    _check_result("logcumsumexp", logs, torch.logcumsumexp(x, 0), "swap lse", (Shard(0),))
    _check_result("cumsum", in_place, torch.cumsum(x, 0), "swap cumsum_", (Shard(0),))


def _refusals(rank: int, world: int) -> None:
    """Clear errors, the same on every rank, none of them stuck in a collective."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = _mesh(world)
    dx = distribute_tensor(torch.ones(6, 2), mesh, [Shard(0)])
    flags = torch.ones(6) > 0
    replicated = distribute_tensor(flags, mesh, [Replicate()])
    short = distribute_tensor(flags[:5], mesh, [Shard(0)])
    waves = DTensor.from_local(torch.ones(2, dtype=torch.complex64), mesh, [Shard(0)])
    cases = [
        (lambda: fscan.cumsum(dx, 0, out=torch.empty_like(dx)), fscan.UnsupportedScanError, "out="),
        (lambda: fscan.cumsum(dx, 0, reset=flags), fscan.ScanTypeError, "distribute_tensor"),
        (lambda: fscan.cummax(dx, 0, reset=replicated), fscan.ScanValueError, "Shard(dim=0)"),
        (lambda: fscan.cumsum(dx, 0, reset=short), fscan.ScanValueError, "length 5"),
        (lambda: fscan.cumsum(dx, 0, reset=flags[None]), fscan.ScanValueError, "(1, 6)"),
        (lambda: fscan.cumsum(dx, 0, reset=[True] * 6), fscan.ScanTypeError, "bool tensor"),
        (lambda: fscan.cumsum(dx, 2), fscan.ScanIndexError, "dim"),
        (lambda: fscan.logcumsumexp(waves, 0), fscan.ScanTypeError, "complex"),
        (lambda: fscan.cumsum(torch.ones(6), 0, reset=replicated), fscan.ScanTypeError, "`input`"),
        (lambda: fscan.cummin(torch.ones(6), 0, reset=replicated), fscan.ScanTypeError, "`input`"),
    ]
    for call, error, words in cases:
        try:
            call()
        except error as err:
            if words not in str(err):
                raise AssertionError(f"{error.__name__} without {words!r}: {err}") from err
            continue
        raise AssertionError(f"expected {error.__name__} naming {words!r}")


def _ranks_disagree(rank: int, world: int) -> None:
    """Ranks that make different calls (rank 0 reversed) all get the same clear error
    from the agreement before the exchange, never a hang or mixed-up bytes; the group
    stays usable."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(world)
    x = _data("cummax", (13, 2), torch.float64, seed=6)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    if world > 1:
        try:
            fscan.cummax(dx, 0, reverse=rank == 0)
        except fscan.ScanValueError as err:
            if "`reverse`: True on rank 0; False on rank" not in str(err):
                raise AssertionError(f"the error does not say who differs: {err}") from err
        else:
            raise AssertionError("ranks with different calls went on to the exchange")
    _check_result("cummax", fscan.cummax(dx, 0), torch.cummax(x, 0), "after", (Shard(0),))


CASES: dict[str, Callable[[int, int], None]] = {
    "values": _values,
    "ties and NaNs": _ties_and_nans,
    "reset": _resets,
    "dtypes": _dtypes,
    "gradients": _gradients,
    "placements": _placements,
    "moves only carries": _moves_only_carries,
    "swap_cumulative_ops": _swap,
    "refusals": _refusals,
    "ranks disagree": _ranks_disagree,
}


# ---- running every case in every rank --------------------------------------------------


def _worker(rank: int, world: int, port: int, results: Any) -> None:
    gloo_ranks.run_cases(CASES, rank, world, port, results)


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"W{w}")
def ranks(request):
    return gloo_ranks.spawn(request.param, [__name__], _worker)


@pytest.mark.parametrize("case", list(CASES))
def test_case_on_every_rank(ranks, case):
    gloo_ranks.assert_case(ranks, case)


def test_plain_tensors_keep_their_path():
    """The DTensor test costs plain calls one type check: the same results as before."""
    x = torch.tensor([1.0, 3.0, 2.0])
    assert torch.equal(fscan.cumsum(x, 0), torch.cumsum(x, 0))
    assert torch.equal(fscan.cummax(x, 0).indices, torch.tensor([0, 1, 1]))
