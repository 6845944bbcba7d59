"""logaddexp in the C++ kernel (csrc/logaddexp.h): its float32 exp and log1p against a
float64 reference over a sweep (d near 0, very negative d, subnormal results), torch's
special cases, and logaddexp scans (dims, directions, dtypes, the tiled chain path and
the chunked 1-D path) against a sequential float64 loop, values and gradients."""

from __future__ import annotations

import logging
import math

import optree
import pytest
import torch
from helpers import torch_threads

import fscan
from fscan._engines.cpp import cpu_kernel
from fscan._engines.cpp._cpp_build import compiler_problem

pytestmark = [
    pytest.mark.skipif(
        compiler_problem() is not None, reason=f"no C++ kernel: {compiler_problem()}"
    ),
    pytest.mark.filterwarnings("ignore::fscan.NotAssociativeWarning"),
]

INF, NAN = math.inf, math.nan


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in float32 ulps at ref (float64), the subnormal spacing near 0."""
    _, exponent = torch.frexp(ref.abs())
    spacing = torch.ldexp(torch.ones_like(ref), exponent - 24).clamp_min(2.0**-149)
    return (got.double() - ref).abs() / spacing


def _sweep() -> torch.Tensor:
    """d <= 0: near 0, around the reductions' switches, giving subnormal exp(d), and beyond."""
    gen = torch.Generator().manual_seed(0)
    parts = [
        -torch.rand(20000, generator=gen, dtype=torch.float64) * 110,
        -torch.rand(5000, generator=gen, dtype=torch.float64) * 2.0**-20,
        -torch.logspace(-45, 0, 2000, dtype=torch.float64),
        -87.0 - torch.rand(5000, generator=gen, dtype=torch.float64) * 17,  # subnormal exp
        -math.log(2) + (torch.rand(2000, generator=gen, dtype=torch.float64) - 0.5) * 1e-3,
        torch.tensor([0.0, -0.0, -1e-45, -0.5, -103.9, -104.0, -200.0, -3.0e38]),
    ]
    return torch.cat(parts).float()


@pytest.mark.parametrize("vectorized", [True, False], ids=["vector", "scalar"])
def test_float32_log1p_exp_within_two_ulps_of_float64(vectorized):
    d = _sweep()
    zeros = torch.zeros_like(d)
    got = cpu_kernel.combine_step(torch.logaddexp, zeros, d, vectorized=vectorized)
    ref = torch.log1p(torch.exp(d.double()))
    worst = _ulps(got, ref).max().item()
    assert worst <= 2.0, worst
    # beside a nonzero maximum: the sum in double, rounded once to float32
    m = torch.full_like(d, 3.25)
    got = cpu_kernel.combine_step(torch.logaddexp, d + m, m, vectorized=vectorized)
    ref = torch.logaddexp((d + m).double(), m.double())
    assert _ulps(got, ref).max().item() <= 2.0


SPECIAL = [
    (-INF, -INF, -INF),
    (INF, INF, INF),
    (INF, -INF, INF),
    (-INF, INF, INF),
    (-INF, 3.0, 3.0),
    (2.0, -INF, 2.0),
    (INF, 7.0, INF),
    (NAN, 1.0, NAN),
    (1.0, NAN, NAN),
    (NAN, -INF, NAN),
    (NAN, INF, NAN),
    (5.0, 5.0, 5.0 + math.log(2)),
    (0.0, -0.0, math.log(2)),
    (3.0e38, 3.0e38, 3.0e38 + math.log(2)),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("vectorized", [True, False], ids=["vector", "scalar"])
def test_special_values_as_torch(dtype, vectorized):
    if dtype in (torch.float16, torch.bfloat16):
        cases = [c for c in SPECIAL if abs(c[0]) != 3.0e38]
    else:
        cases = SPECIAL
    a = torch.tensor([c[0] for c in cases], dtype=dtype)
    b = torch.tensor([c[1] for c in cases], dtype=dtype)
    want = torch.tensor([c[2] for c in cases], dtype=torch.float64).to(dtype)
    got = cpu_kernel.combine_step(torch.logaddexp, a, b, vectorized=vectorized)
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(got, torch.logaddexp(a, b), equal_nan=True)


def _sequential(x: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    """The scan as a plain float64 loop: y[t] = logaddexp(y[t - 1], x[t])."""
    v = x.double().movedim(dim, 0)
    if reverse:
        v = v.flip(0)
    out = torch.empty_like(v)
    acc = v[0]
    out[0] = acc
    for t in range(1, v.shape[0]):
        acc = torch.logaddexp(acc, v[t])
        out[t] = acc
    if reverse:
        out = out.flip(0)
    return out.movedim(0, dim)


# (shape, dim): the lane path, the chain path tiled (the last dim, 16 chains and more),
# the chain path's leftover chains, and one lane, chunked (T > 2 * 2048)
SCANS = [((300, 40), 0), ((40, 300), 1), ((7, 5, 33), 1), ((33, 5, 7), 2), ((9000,), 0)]


@pytest.mark.parametrize("shape,dim", SCANS, ids=[f"{s}-{d}" for s, d in SCANS])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_scans_match_a_sequential_float64_loop(shape, dim, reverse, dtype):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    x.view(-1)[5] = -INF  # a step that adds nothing
    ref = _sequential(x, dim, reverse)
    with fscan.config.override(cpu_kernel="eager"), torch.no_grad():
        for _ in range(2):  # the first call checks combine_fn on the torch engine
            got = fscan.associative_scan(torch.logaddexp, x, dim, reverse=reverse)
        leaves, spec = optree.tree_flatten(x)
        assert cpu_kernel.kernel_ready(torch.logaddexp, spec, leaves, dim)
    assert got.dtype == dtype and got.shape == x.shape
    tol = {torch.bfloat16: 1e-2, torch.float32: 2e-6, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol)
    if dtype == torch.float32:  # as accurate as torch.logcumsumexp (which sums in double)
        theirs = torch.logcumsumexp(x.flip(dim) if reverse else x, dim)
        theirs = theirs.flip(dim) if reverse else theirs
        finite = ref.isfinite()
        ours_err = (got.double() - ref)[finite].abs().max().item()
        theirs_err = (theirs.double() - ref)[finite].abs().max().item()
        scale = ref[finite].abs().max().item()
        assert ours_err <= theirs_err + 4 * torch.finfo(torch.float32).eps * scale


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("reverse", [False, True])
def test_gradients_in_float64(dim, reverse):
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)

    def f(v):
        return fscan.associative_scan(torch.logaddexp, v, dim, reverse=reverse)

    with fscan.config.override(cpu_kernel="eager"):
        f(x)  # the pointwise check runs on this first call
        assert torch.autograd.gradcheck(f, (x,))


def test_logcumsumexp_rides_on_the_kernel_and_matches_torch(caplog):
    x = torch.randn(4096, 16, generator=torch.Generator().manual_seed(5))
    with fscan.config.override(cpu_kernel="eager"):
        fscan.logcumsumexp(x, 0)  # built on a first call
        with caplog.at_level(logging.DEBUG, logger="fscan"):
            got = fscan.logcumsumexp(x, 0)
    assert [r.fscan_engine for r in caplog.records] == ["cpp"]
    torch.testing.assert_close(got, torch.logcumsumexp(x, 0), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("reverse", [False, True])
def test_chunk_totals_as_logsumexp_keep_the_steps_special_values(threads, reverse):
    """A 1-D float32 logaddexp scan is chunked, and its chunks' totals are each a
    logsumexp over the chunk's maximum (chunk_totals in csrc/chunk_totals.h): chunks
    all -inf (their total -inf, adding nothing), a +inf (+inf from there on), a NaN,
    large and small magnitudes (the maximum's shift), against the float64 walk."""
    n = 70001
    base = torch.randn(n, generator=torch.Generator().manual_seed(threads)) * 30
    cases = [{}, {"neg": 40000}, {10007: INF}, {30011: NAN}, {"neg": 40000, 50003: INF}]
    for case in cases:
        x = base.clone()
        for where, value in case.items():
            if where == "neg":
                x[:value] = -INF  # several whole chunks, from either end's view
            else:
                x[where] = value
        ref = _sequential(x, 0, reverse)
        with fscan.config.override(cpu_kernel="eager"), torch.no_grad():
            (got,) = cpu_kernel.kernel_scan(
                "test",
                torch.logaddexp,
                optree.tree_flatten(0)[1],
                [x],
                0,
                reverse,
                threads=threads,
            )
        torch.testing.assert_close(got.double(), ref, rtol=2e-6, atol=2e-6, equal_nan=True)
        assert torch.equal(got.isposinf(), ref.isposinf())
        assert torch.equal(got.isneginf(), ref.isneginf())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", ["cumsum", "logcumsumexp"])
@pytest.mark.parametrize("start", [None, 5.0], ids=["drop-in", "initial"])
def test_exclusive_chunk_totals_fold_the_start_value(caplog, threads, reverse, name, start):
    """The exclusive variant's chunked 1-D path takes its chunks' totals as the inclusive
    one does (chunk_totals), its start value combined with each lane's first total: the
    drop-ins' exclusive calls (the op's identity) and associative_scan's with initial=5
    on the kernel, against the float64 walk from the start value shifted a step; a +inf
    and a -inf in the middle (NaN after them) or none."""
    n = 2**20 + 3
    gen = torch.Generator().manual_seed(threads)
    combine = torch.add if name == "cumsum" else torch.logaddexp
    first = start if start is not None else (0.0 if name == "cumsum" else -INF)
    for special in ({}, {300007: INF, 700001: -INF}):
        x = torch.randn(n, generator=gen) * 4
        for where, value in special.items():
            x[where] = value
        steps = torch.cat(
            [
                torch.tensor([first], dtype=torch.float64),
                x.double().flip(0) if reverse else x.double(),
            ]
        )
        walked = steps.cumsum(0) if name == "cumsum" else torch.logcumsumexp(steps, 0)
        ref = walked[:-1].flip(0) if reverse else walked[:-1]

        def call():
            if start is None:
                return getattr(fscan, name)(x, 0, reverse=reverse, exclusive=True)
            initial = torch.tensor(start)
            return fscan.associative_scan(
                combine, x, 0, reverse=reverse, initial=initial, exclusive=True
            )

        with fscan.config.override(cpu_kernel="eager"), torch_threads(threads):
            call()  # built on a first call
            with caplog.at_level(logging.DEBUG, logger="fscan"):
                caplog.clear()
                got = call()
        assert [r.fscan_engine for r in caplog.records] == ["cpp"]
        # cumsum: the float64 sum rounded once, but reversed from an initial (one float32
        # unit of the running magnitude there, before chunk_totals too)
        finite = ref[ref.isfinite()].abs().max().item()
        tol = 2 * torch.finfo(torch.float32).eps * finite if name == "cumsum" else 2e-6
        torch.testing.assert_close(
            got.double(), ref.float().double(), rtol=0, atol=tol, equal_nan=True
        )
