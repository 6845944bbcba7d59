"""Values at the edges of float range on every kernel path, against a plain sequential
reference in the semantics the kernel promises: float32 sums and products accumulated in
double (as ``torch.cumsum``/``cumprod`` on CPU), max/min exact with NaN propagating (as
``torch.cummax``), logaddexp as ``torch.logcumsumexp`` in double, and the affine pair's
``a * h`` brought into float32's range at every step (inf above it, 0 below it; see
``fscan_range_f32`` in csrc/prelude.h) with the gate product kept in double.

Planted: 0, -0.0, +-inf, NaN, the largest finite value, a subnormal, and pairs whose sum
or product leaves float32, at the first and last step, at the chunk boundaries of 2 and 3
threads, at a tile edge (steps 7/8, 15/16), and after a reset. Paths: the lane path (one
column: chunked across threads), the chain path (three lanes, and the 1-D scan: chunked),
the last dim (tiled chains); the forward, the reduce, ``reset=``, ``initial=`` and
``exclusive=``, and the backward against the torch engine."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import fscan
from fscan._engines.cpp._cpp_build import compiler_problem
from tests.helpers import torch_threads

pytestmark = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)

F32_MAX = torch.finfo(torch.float32).max
SUBNORMAL = 1e-40
OVER, UNDER = float.fromhex("0x1.ffffffp127"), 2.0**-150


def affine(x, y):
    return (x[0] * y[0], y[0] * x[1] + y[1])


def _range32(v: float) -> float:
    m = abs(v)
    return math.copysign(math.inf, v) if m >= OVER else (math.copysign(0.0, v) if m <= UNDER else v)


def ref_affine(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The affine pair's scan along dim 0 (float32 leaves) step by step, in double, with
    ``a * h`` in float32's range."""
    with torch_threads(1):
        return _ref_affine(a, b)


def _ref_affine(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    A = torch.cumprod(a.double(), 0)
    if a.dim() == 1:  # one lane: Python floats, faster than a torch op a step
        an, bl = a.double().tolist(), b.double().tolist()
        out = [bl[0]]
        for t in range(1, len(bl)):
            out.append(_range32(an[t] * out[-1]) + bl[t])
        return A.float(), torch.tensor(out, dtype=torch.float64).float()
    ad, bd = a.double(), b.double()
    out = torch.empty_like(bd)
    out[0] = bd[0]
    inf = torch.tensor(math.inf, dtype=torch.float64)
    for t in range(1, bd.shape[0]):
        v = ad[t] * out[t - 1]
        m = v.abs()
        v = torch.where(m >= OVER, inf.copysign(v), torch.where(m <= UNDER, v * 0.0, v))
        out[t] = v + bd[t]
    return A.float(), out.float()


OPS = {
    "add": (torch.add, lambda x: torch.cumsum(x.double(), 0).float()),
    "mul": (torch.mul, lambda x: torch.cumprod(x.double(), 0).float()),
    "max": (torch.maximum, lambda x: torch.cummax(x, 0).values),
    "min": (torch.minimum, lambda x: torch.cummin(x, 0).values),
    "logaddexp": (torch.logaddexp, lambda x: torch.logcumsumexp(x.double(), 0).float()),
}

SPECIALS = {
    "zero": [0.0],
    "-zero": [-0.0],
    "inf": [math.inf],
    "-inf": [-math.inf],
    "nan": [math.nan],
    "max": [F32_MAX],
    "subnormal": [SUBNORMAL],
    "overflow": [F32_MAX, F32_MAX],  # a sum (a product) that leaves float32
    "inf,-inf": [math.inf, -math.inf],
}


def positions(T: int, path: str, threads: int) -> list[int]:
    """The first steps, a tile edge, the last steps, and the last step of the first chunk
    where ``threads`` split the scan (csrc/tuning.h: a lane column into threads chunks for
    the reduce, threads + 1 for the forward; chains into about 8 * threads / lanes)."""
    chunks = {
        "lanes": (threads, threads + 1),
        "chains": (-(-8 * threads // 3),),
        "last": (-(-8 * threads // 3),),
        "1d": (8 * threads,),
    }[path]
    cuts = {0, 15, T - 2} | {-(-T // C) - 1 for C in chunks}
    return sorted(cuts)


# (shape, dim): the lane path (one column of 16 lanes), chains (3 lanes), the 1-D scan
# (one chain), the last dim (tiled chains). Long enough for 2 and 3 threads to chunk.
PATHS = {
    "lanes": ((8192, 16), 0),
    "chains": ((20000, 3), 0),
    "1d": ((50000,), 0),
    "last": ((3, 20000), 1),
}


@pytest.fixture
def engines(caplog: pytest.LogCaptureFixture):
    caplog.set_level(logging.DEBUG, logger="fscan")
    return lambda: [r.fscan_engine for r in caplog.records if hasattr(r, "fscan_engine")]


def base(op: str, shape, gen) -> torch.Tensor:
    """Moderate values: products near 1, sums and maxima that do not round away."""
    x = torch.rand(shape, generator=gen)
    return x * 0.02 + 0.99 if op in ("mul",) else x * 2 - 1


def plant(x: torch.Tensor, dim: int, at: int, values: list[float], reverse: bool) -> torch.Tensor:
    """``values`` at scan-order steps ``at``, ``at + 1``... of every lane."""
    x = x.clone()
    T = x.shape[dim]
    for k, v in enumerate(values):
        s = at + k
        x.select(dim, T - 1 - s if reverse else s).fill_(v)
    return x


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The same NaNs and infinities (with sign); close finite values. One thread: the
    calls under test run on 2 or 3, and small ops on a shared machine's threads wait."""
    with torch_threads(1):
        _same(got, want, what)


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, what
    for check in (torch.isnan, torch.isposinf, torch.isneginf):
        bad = (check(got) != check(want)).nonzero()
        assert bad.numel() == 0, f"{what}: {check.__name__} differs at {bad[:4].tolist()}"
    # (torch.testing.assert_close's report costs 0.1 s a call on these sizes)
    fin = got.isfinite() & want.isfinite()
    g, w = got[fin].double(), want[fin].double()
    excess = (g - w).abs() - (1e-5 + 2e-5 * w.abs())
    assert excess.numel() == 0 or excess.max() <= 0, f"{what}: off by {excess.max():.3g}"


def in_order(x: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    """``x`` in scan order along dim 0 (the references scan dim 0 forwards)."""
    x = x.movedim(dim, 0)
    return x.flip(0) if reverse else x


def from_order(y: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    return (y.flip(0) if reverse else y).movedim(0, dim)


# op, path, threads, reverse: each op on two paths, every path chunked by 2 or 3 threads
# by some op, both directions (the file's time: pick the cases, not the full product).
CASES = [
    ("add", "lanes", 2, False),
    ("add", "1d", 3, True),
    ("mul", "chains", 2, True),
    ("mul", "last", 2, False),
    ("max", "lanes", 3, True),
    ("max", "1d", 2, False),
    ("min", "chains", 3, False),
    ("min", "lanes", 2, True),
    ("logaddexp", "lanes", 3, False),
    ("logaddexp", "last", 2, True),
]


@pytest.mark.parametrize("name", list(SPECIALS))
@pytest.mark.parametrize(("op", "path", "threads", "reverse"), CASES)
def test_forward_and_reduce_at_the_edges(op, path, threads, reverse, name, engines):
    fn, ref = OPS[op]
    shape, dim = PATHS[path]
    gen = torch.Generator().manual_seed(7)
    x0 = base(op, shape, gen)
    T = shape[dim]
    with torch_threads(threads):
        for _ in range(2):  # the first call checks the combine on the tree
            fscan.associative_scan(fn, x0, dim, reverse=reverse)
            fscan.associative_reduce(fn, x0, dim, reverse=reverse)
        assert engines()[-2:] == ["cpp", "cpp"]
        values = SPECIALS[name]
        if True:
            for at in positions(T, path, threads):
                x = plant(x0, dim, at, values, reverse)
                want = from_order(ref(in_order(x, dim, reverse)), dim, reverse)
                what = f"{op} {path} {name} at step {at}"
                same(fscan.associative_scan(fn, x, dim, reverse=reverse), want, what)
                total = fscan.associative_reduce(fn, x, dim, reverse=reverse)
                same(total, want.select(dim, 0 if reverse else T - 1), f"reduce {what}")
        assert set(engines()[-4:]) == {"cpp"}


AFFINE_SPECIALS = {
    # (gate values, state values) planted from a step on
    "inf state": ([1.0], [math.inf]),
    "nan state": ([1.0], [math.nan]),
    "zero gate": ([0.0], [0.0]),
    "-zero gate on inf": ([-0.0], [math.inf]),
    "max state, gate 4": ([1.0, 4.0], [F32_MAX, 0.0]),  # a * h overflows float32
    "tiny state, tiny gate": ([1.0, 1e-30], [1e-30, 0.0]),  # a * h underflows to 0
    "subnormal state": ([1.0], [SUBNORMAL]),
    "inf gate": ([math.inf], [0.0]),
}


# Where the state is F32_MAX on the last step of a chunk and the gate 4 on the next (the
# first of the next chunk): the steps overflow a * h to inf there, and inf stays; the
# chunk join composes the next chunk's total (A, B) with the carry h as A * h + B, with A
# (the product of about 2700-4000 gates in [0.9, 1.1]) below 1: finite, from finite
# operands, so suspect() does not walk the chunk. Wrong on the reduce's lane join (2
# threads: chunk boundary at 4096) and the forward's chain join (3 threads, chunks of
# 2500: outputs from step 5000 on finite). A fix needs the join to know that walking would
# have left the range (e.g. each chunk's largest prefix gate product, |h| times it >=
# float32's max: walk), not only the composed output.
LOST_OVERFLOW = {("lanes", 2, False), ("chains", 3, False)}
LOST_OVERFLOW_WHY = (
    "a * h overflows float32 at a chunk's first step and later gates bring A below 1: the "
    "composed chunk join is finite where the steps give inf (suspect() sees finite from finite)"
)


@pytest.mark.parametrize("name", list(AFFINE_SPECIALS))
@pytest.mark.parametrize(
    ("path", "threads", "reverse"),
    [("lanes", 2, False), ("lanes", 3, True), ("chains", 3, False), ("1d", 2, True)],
)
def test_affine_at_the_edges(path, threads, reverse, name, engines, request):
    if name == "max state, gate 4" and (path, threads, reverse) in LOST_OVERFLOW:
        request.applymarker(pytest.mark.xfail(strict=True, reason=LOST_OVERFLOW_WHY))
    shape, dim = PATHS[path]
    if path == "1d":
        shape = (50000,)
    gen = torch.Generator().manual_seed(11)
    a0 = torch.rand(shape, generator=gen) * 0.2 + 0.9
    b0 = torch.randn(shape, generator=gen)
    T = shape[dim]
    with torch_threads(threads):
        for _ in range(2):
            fscan.associative_scan(affine, (a0, b0), dim, reverse=reverse)
            fscan.associative_reduce(affine, (a0, b0), dim, reverse=reverse)
        assert engines()[-2:] == ["cpp", "cpp"]
        gates, states = AFFINE_SPECIALS[name]
        if True:  # the first step and the chunk boundaries (the reference is a step loop)
            for at in [p for p in positions(T, path, threads) if p not in (15, T - 2)]:
                a = plant(a0, dim, at, gates, reverse)
                b = plant(b0, dim, at, states, reverse)
                want = ref_affine(in_order(a, dim, reverse), in_order(b, dim, reverse))
                want = [from_order(w, dim, reverse) for w in want]
                what = f"affine {path} {name} at step {at}"
                got = fscan.associative_scan(affine, (a, b), dim, reverse=reverse)
                total = fscan.associative_reduce(affine, (a, b), dim, reverse=reverse)
                for k in (0, 1):
                    same(got[k], want[k], f"{what} leaf {k}")
                    same(total[k], want[k].select(dim, 0 if reverse else T - 1), f"reduce {what}")


DROP_INS = {  # fscan's drop-in, and torch's op run on each segment
    "cumsum": (fscan.cumsum, lambda x: torch.cumsum(x.double(), 0).float()),
    "cumprod": (fscan.cumprod, lambda x: torch.cumprod(x.double(), 0).float()),
    "cummax": (
        lambda x, d, **k: fscan.cummax(x, d, **k).values,
        lambda x: torch.cummax(x, 0).values,
    ),
    "logcumsumexp": (fscan.logcumsumexp, lambda x: torch.logcumsumexp(x.double(), 0).float()),
}
IDENTITY = {"cumsum": 0.0, "cumprod": 1.0, "cummax": -math.inf, "logcumsumexp": -math.inf}


@pytest.mark.parametrize("name", ["inf", "nan", "overflow", "inf,-inf"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("op", list(DROP_INS))
def test_reset_and_exclusive_at_the_edges(op, reverse, name, engines):
    """``reset=`` (the segmented kernel) with a special value on the step before a reset,
    on the reset step and after it; ``exclusive=``: the inclusive output one step later."""
    fn, ref = DROP_INS[op]
    T, W = 4096, 16
    gen = torch.Generator().manual_seed(3)
    x0 = torch.rand(T, W, generator=gen) * 0.02 + 0.99
    cut = 2048  # a reset at this step (in scan order)
    reset = torch.zeros(T, dtype=torch.bool)
    reset[T - 1 - cut if reverse else cut] = True
    with torch_threads(2):
        for _ in range(2):
            fn(x0, 0, reverse=reverse, reset=reset)
        for at in (cut - 1, cut, cut + 1, 0, T - 2):
            x = plant(x0, 0, at, SPECIALS[name], reverse)
            xo = in_order(x, 0, reverse)
            want = torch.cat([ref(xo[:cut]), ref(xo[cut:])])
            want = from_order(want, 0, reverse)
            same(fn(x, 0, reverse=reverse, reset=reset), want, f"{op} reset {name} at {at}")
            inclusive = from_order(ref(xo), 0, reverse)
            ident = torch.full((1, W), IDENTITY[op])
            shifted = torch.cat([ident, in_order(inclusive, 0, reverse)[:-1]])
            got = fn(x, 0, reverse=reverse, exclusive=True)
            same(got, from_order(shifted, 0, reverse), f"{op} exclusive {name} at {at}")


def sequential_grads(fn, leaves, g, dim, reverse):
    """Gradients through a plain sequential loop in float64, as float32."""
    xs = [in_order(v, dim, reverse).double().requires_grad_() for v in leaves]
    outs, acc = [], None
    for t in range(xs[0].shape[0]):
        e = xs[0][t] if len(xs) == 1 else tuple(x[t] for x in xs)
        acc = e if acc is None else fn(acc, e)
        outs.append(acc)
    ys = (
        [torch.stack(outs)]
        if len(xs) == 1
        else [torch.stack([o[k] for o in outs]) for k in range(len(xs))]
    )
    gs = [in_order(v, dim, reverse).double() for v in g]
    return [from_order(r, dim, reverse).float() for r in torch.autograd.grad(ys, xs, gs)]


# Not "max" (F32_MAX planted): where a gradient's exact value leaves float32, the kernel
# (double accumulation), the torch engine (float32 autograd) and the float64 loop cast to
# float32 each put inf in different places (mul: 132 and 632 of 4800 differ from the loop).
@pytest.mark.parametrize("name", ["zero", "inf", "nan"])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    ("fn", "shape", "dim"),
    [
        (torch.add, (300, 16), 0),
        (torch.mul, (300, 16), 0),
        (torch.maximum, (5, 300), 1),
        (affine, (300, 16), 0),
    ],
)
def test_backward_at_the_edges(fn, shape, dim, name, reverse):
    """Gradients through the kernel's backward against autograd through a sequential
    float64 loop (the torch engine's float32 tree is further from it: up to 4e-2 relative
    on the affine pair with an inf state), a special value planted at the first, a middle
    and the last step."""
    gen = torch.Generator().manual_seed(5)
    T = shape[dim]
    n = 2 if fn is affine else 1
    base_leaves = [torch.rand(shape, generator=gen) * 0.2 + 0.9 for _ in range(n)]
    g = [torch.randn(shape, generator=gen) for _ in range(n)]
    for at in (0, T // 2, T - 1):
        leaves = list(base_leaves)
        leaves[-1] = plant(base_leaves[-1], dim, at, SPECIALS[name], reverse)
        xs = [v.clone().requires_grad_() for v in leaves]
        for _ in range(2):  # the first call checks the combine on the tree
            out = fscan.associative_scan(fn, xs[0] if n == 1 else tuple(xs), dim, reverse=reverse)
            got = torch.autograd.grad([out] if n == 1 else list(out), xs, g)
        want = sequential_grads(fn, leaves, g, dim, reverse)
        for k in range(n):
            what = f"grad {getattr(fn, '__name__', 'affine')} {name} at {at} leaf {k}"
            for check in (torch.isnan, torch.isposinf, torch.isneginf):
                assert torch.equal(check(got[k]), check(want[k])), f"{what}: {check.__name__}"
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4, equal_nan=True)
