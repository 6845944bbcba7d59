"""Every op the C++ kernel's translator computes, against eager torch, on every dtype
the kernel takes, with special values.

The op table below runs each op on all pairs of a dtype's special values (NaN, +-inf,
+-0, subnormals, the largest finite, integer min and max, shifts of the bit width,
products that wrap or overflow...), as ``combine_fn(left, right)``, through
:func:`fscan._engines.cpp.cpu_kernel.combine_step`: the forward kernel's own translation
of the combine, loads, stores and compute types, applied once per position, in its
lane path's vector loop and as its chain path's scalar call. One combine computes
every op of a dtype family as a leaf of a pytree, so each family costs one build
(a scan kernel inlines its combine in a dozen places: one build of this size takes
minutes). Integer and bool results must be identical; float results must agree in
NaN, infinities and the sign of zero, and in value exactly, but for the functions
whose last bit libm and torch's SLEEF round apart (``ULPS``).

The scan-level tests run the same translation inside real scan kernels (the issue
that started this: ``~`` of a bool was ``~true == -2`` in C++), and check that the
ops the translator refuses (integer division, whose zero divisor raises in torch)
leave the scan to the torch engine with its results and errors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import optree
import pytest
import torch
from helpers import sequential_scan

import fscan
from fscan._engines.cpp import cpu_kernel
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._engines.cpp._cpp_codegen import COMPUTING_OPS, _make_fx
from fscan._engines.cpp._cpp_ops import op_name

# The first-call associativity check warns here, as expected: the combines are single
# ops, most of them not associative (a - b, a / b, ...), and the kernel must match the
# torch engine on them all.
pytestmark = pytest.mark.filterwarnings("ignore::fscan.NotAssociativeWarning")

needs_compiler = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)

INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """The values whose pairs each op sees, for ``dtype``."""
    if dtype == torch.bool:
        return torch.tensor([False, True])
    if dtype.is_floating_point:
        f = torch.finfo(dtype)
        values = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5]
        values += [2.5, -2.5, 3.0, -7.0, 0.1, 1e-3, 100.0, 255.75, -300.5, f.eps, 1 + f.eps]
        values += [f.max, -f.max, f.tiny, -f.tiny, f.tiny / 4]  # f.tiny / 4: subnormal
        values += [math.sqrt(f.max) * 2, 1 / math.sqrt(f.max) / 2]  # squares over/underflow
        return torch.tensor(values, dtype=torch.float64).to(dtype)
    i = torch.iinfo(dtype)
    bits = i.bits
    values = {i.min, i.min + 1, -bits - 1, -bits, -9, -8, -3, -2, -1, 0, 1, 2, 3, 7, 8, 9}
    values |= {bits - 1, bits, bits + 1, 100, i.max - 1, i.max}
    if bits == 64:  # beyond float64's integers; 3**39 fits, 3**40 wraps
        values |= {2**53 + 1, -(2**53) - 1, 2**31, 3**39}
    if bits == 32:
        values |= {2**24 + 1, 46341}  # beyond float32's integers; 46341**2 wraps
    return torch.tensor(sorted(v for v in values if i.min <= v <= i.max), dtype=dtype)


@dataclass(frozen=True)
class Op:
    """One case: ``fn(a, b)`` elementwise; ``ulps``: the distance from eager allowed for
    float results, in units in the last place of the result's dtype; ``ties``: whether
    the sign of a zero result is compared (not where torch's own scalar and vector paths
    pick different zeros of a tie, as max(0.0, -0.0))."""

    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ulps: float = 0
    ties: bool = True


def _finite_small(a: torch.Tensor, bound: float) -> torch.Tensor:
    """``a`` where it is finite and within ``bound`` (else 0): float to integer
    conversions of other values are undefined in C++ and torch alike."""
    return torch.where(a.abs() < bound, a, 0)


LIBM = "exp exp2 expm1 log log1p log2 log10 sqrt tanh sin cos tan erf erfc sinh cosh"
LIBM += " asin acos atan asinh acosh atanh lgamma"
# libm (glibc, libmvec) and torch (SLEEF) round these apart by an ulp or three.
ULPS = 4

OPS: dict[str, Op] = {
    "add": Op(lambda a, b: a + b),
    "sub": Op(lambda a, b: a - b),
    "mul": Op(lambda a, b: a * b),
    "div": Op(lambda a, b: a / b),
    "add alpha": Op(
        lambda a, b: torch.add(_finite_small(a, 1e4), _finite_small(b, 1e4), alpha=3), 1
    ),
    "sub alpha": Op(
        lambda a, b: torch.sub(_finite_small(a, 1e4), _finite_small(b, 1e4), alpha=2), 1
    ),
    "add 3": Op(lambda a, b: a + 3),
    "times -2": Op(lambda a, b: a * -2),
    "1 - a": Op(lambda a, b: 1 - a),
    "add 0.1": Op(lambda a, b: a + 0.1),
    "sub 0.1": Op(lambda a, b: a - 0.1),
    "times 0.1": Op(lambda a, b: a * 0.1),
    "over 0.1": Op(lambda a, b: a / 0.1),
    "half": Op(lambda a, b: a / 2),
    "third": Op(lambda a, b: a / 3),
    "times 0.5": Op(lambda a, b: a * 0.5),
    "maximum": Op(torch.maximum, ties=False),
    "minimum": Op(torch.minimum, ties=False),
    "fmax": Op(torch.fmax, ties=False),
    "fmin": Op(torch.fmin, ties=False),
    "atan2": Op(torch.atan2, ULPS),
    "pow": Op(torch.pow, ULPS),
    "pow 0": Op(lambda a, b: a**0),
    "pow 1": Op(lambda a, b: a**1),
    "pow 2": Op(lambda a, b: a**2),
    "pow 3": Op(lambda a, b: a**3),
    "pow 0.5": Op(lambda a, b: a**0.5, ULPS),
    "pow -0.5": Op(lambda a, b: a**-0.5, ULPS),
    "pow -1": Op(lambda a, b: a**-1),
    "pow -2": Op(lambda a, b: a**-2),
    # x**y grows the error of y log x: float32 pow of 2**63 differs by 8 ulps
    "pow 0.3": Op(lambda a, b: a**0.3, 4 * ULPS),
    "2 pow": Op(lambda a, b: 2**a, ULPS),
    "and": Op(lambda a, b: a & b),
    "or": Op(lambda a, b: a | b),
    "xor": Op(lambda a, b: a ^ b),
    "and 3": Op(lambda a, b: a & 3),
    "not": Op(lambda a, b: ~a),
    "not xor": Op(lambda a, b: ~(a ^ b)),
    "eq": Op(torch.eq),
    "ne": Op(torch.ne),
    "lt": Op(torch.lt),
    "le": Op(torch.le),
    "gt": Op(torch.gt),
    "ge": Op(torch.ge),
    "lt 2.5": Op(lambda a, b: a < 2.5),
    "gt -1": Op(lambda a, b: a > -1),
    "gt 0.1": Op(lambda a, b: a > 0.1),
    "logical and": Op(torch.logical_and),
    "logical or": Op(torch.logical_or),
    "logical xor": Op(torch.logical_xor),
    "logical not": Op(lambda a, b: torch.logical_not(a)),
    "where": Op(lambda a, b: torch.where(a > b, a, b)),
    "where 7": Op(lambda a, b: torch.where(a == b, a, 7)),
    "where 0.1": Op(lambda a, b: torch.where(a > b, a, 0.1)),
    "clamp": Op(lambda a, b: torch.clamp(a, -3, 5)),
    "clamp 0 1": Op(lambda a, b: torch.clamp(a, 0, 1)),
    "clamp -1 -0": Op(lambda a, b: torch.clamp(a, -1, -0.0)),
    "clamp float": Op(lambda a, b: torch.clamp(a, -0.5, 2.5)),
    "clamp min b": Op(lambda a, b: torch.clamp(a, min=b), ties=False),
    "clamp max b": Op(lambda a, b: torch.clamp(a, max=b), ties=False),
    "clamp b a": Op(lambda a, b: torch.clamp(a, b, a), ties=False),
    "clamp_min 1": Op(lambda a, b: torch.clamp_min(a, 1)),
    "clamp_max 1": Op(lambda a, b: torch.clamp_max(a, 1)),
    "clamp_min 0": Op(lambda a, b: torch.clamp_min(a, 0)),
    "neg": Op(lambda a, b: -a),
    "abs": Op(lambda a, b: torch.abs(a)),
    "-abs": Op(lambda a, b: -torch.abs(a)),
    "sign": Op(lambda a, b: torch.sign(a)),
    "sign times b": Op(lambda a, b: torch.sign(a) * b),
    "relu": Op(lambda a, b: torch.relu(a)),
    "reciprocal": Op(lambda a, b: torch.reciprocal(a)),
    "rsqrt": Op(lambda a, b: torch.rsqrt(a), ULPS),
    "sigmoid": Op(lambda a, b: torch.sigmoid(a), ULPS),
    "isnan": Op(lambda a, b: torch.isnan(a)),
    "isinf": Op(lambda a, b: torch.isinf(a)),
    "round": Op(lambda a, b: torch.round(a)),
    "floor": Op(lambda a, b: torch.floor(a)),
    "ceil": Op(lambda a, b: torch.ceil(a)),
    "trunc": Op(lambda a, b: torch.trunc(a)),
    "logaddexp": Op(torch.logaddexp, ULPS),
    # Values that overflow or round inside one combine: eager rounds every op's result
    "a b 0": Op(lambda a, b: a * b * 0),
    "a b / b a": Op(lambda a, b: (a * b) / (b * a)),
    "a b - b a": Op(lambda a, b: a * b - b * a),
    "isinf a b": Op(lambda a, b: torch.isinf(a * b)),
    "floor a / b": Op(lambda a, b: torch.floor(a / b)),
    "a b > 1": Op(lambda a, b: a * b > 1),
    "float a b": Op(lambda a, b: a.float() * b.float()),
    "double sum": Op(lambda a, b: (a.double() + b.double()).to(a.dtype)),
    "to float32": Op(lambda a, b: a.to(torch.float32)),
    "to float64": Op(lambda a, b: a.to(torch.float64)),
    "to float16": Op(lambda a, b: a.to(torch.float16)),
    "to bfloat16": Op(lambda a, b: a.to(torch.bfloat16)),
    "to bool": Op(lambda a, b: a.to(torch.bool)),
    "to int64": Op(lambda a, b: a.to(torch.int64)),
    "to int32": Op(lambda a, b: a.to(torch.int32)),
    "to int8": Op(lambda a, b: a.to(torch.int8)),
    "to uint8": Op(lambda a, b: a.to(torch.uint8)),
    "small to int8": Op(lambda a, b: _finite_small(a, 100).to(torch.int8)),
    "small to uint8": Op(lambda a, b: _finite_small(a, 100).to(torch.uint8)),
    "small to int64": Op(lambda a, b: _finite_small(a, 1e15).to(torch.int64)),
}


def _of_left(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    fn = getattr(torch, name)
    return lambda a, b: fn(a)


OPS.update({name: Op(_of_left(name), ULPS) for name in LIBM.split()})

# Ops whose result is undefined for some operands in torch itself: the cases below are
# not compared (the kernel's value there is as undefined).
UNDEFINED = {"to int64", "to int32", "to int8", "to uint8"}  # NaN, inf or out of range


def _cases(dtypes: tuple[torch.dtype, ...]):
    """(dtype, name, op, a, b, eager result) for every op eager torch computes on dtype."""
    cases = []
    for dtype in dtypes:
        values = special_values(dtype)
        a, b = values.repeat_interleave(len(values)), values.repeat(len(values))
        for name, op in OPS.items():
            if name in UNDEFINED and dtype.is_floating_point:
                continue
            try:
                ref = op.fn(a, b)
            except (RuntimeError, TypeError):  # not an op of this dtype in torch
                continue
            cases.append((dtype, name, op, a, b, ref))
    return cases


def _family_combine(cases):
    """One combine computing every case: leaf ``f"in {dtype}"`` holds the operands of a
    dtype, leaf ``k`` the result of case k."""
    plan = tuple((f"{k}", f"in {dtype}", op.fn) for k, (dtype, _, op, *_) in enumerate(cases))
    # Nested tuples of at most 32: the kernel's key walks containers up to 64 long.
    plan = tuple(plan[j : j + 32] for j in range(0, len(plan), 32))

    def combine(left, right):
        out = dict(left)
        for chunk in plan:
            for key, operands, fn in chunk:
                out[key] = fn(left[operands], right[operands])
        return out

    return combine


def _operands(cases, n: int):
    """The left and right pytrees: each dtype's pairs, repeated to length ``n``."""
    left, right = {}, {}
    for dtype, _, _, a, b, _ in cases:
        reps = -(-n // len(a))
        left[f"in {dtype}"], right[f"in {dtype}"] = a.repeat(reps)[:n], b.repeat(reps)[:n]
    for k, (*_, ref) in enumerate(cases):
        left[f"{k}"] = right[f"{k}"] = torch.zeros(n, dtype=ref.dtype)
    return left, right


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at float64 values ``x`` (subnormal spacing near 0)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(x.abs())
    spacing = torch.ldexp(torch.ones_like(x), exponent - 1) * info.eps
    return spacing.clamp_min(info.tiny * info.eps)


def mismatches(ref: torch.Tensor, got: torch.Tensor, op: Op) -> torch.Tensor:
    """Where ``got`` differs from eager's ``ref`` beyond what ``op`` allows."""
    assert got.dtype == ref.dtype
    if not ref.is_floating_point():
        return ref != got
    nan = ref.isnan() | got.isnan()
    bad = ref.isnan() != got.isnan()
    bad |= ~nan & (torch.isinf(ref) | torch.isinf(got)) & (ref != got)
    if op.ties:
        bad |= (ref == 0) & (got == 0) & (torch.signbit(ref) != torch.signbit(got))
    finite = ~nan & torch.isfinite(ref) & torch.isfinite(got)
    r, g = ref.double(), got.double()
    far = (r - g).abs() > op.ulps * _ulp(r, ref.dtype)
    return bad | (finite & far)


FAMILIES = {"bool and integers": (torch.bool, *INTS), "floats": FLOATS}


@pytest.fixture(scope="module")
def family_results():
    """Per family: its cases and the kernel's results, vector and scalar (one build each)."""
    found = {}
    for family, dtypes in FAMILIES.items():
        cases = _cases(dtypes)
        n = max(len(a) for _, _, _, a, _, _ in cases)
        combine = _family_combine(cases)
        left, right = _operands(cases, n)
        outs = [cpu_kernel.combine_step(combine, left, right, vectorized=v) for v in (True, False)]
        found[family] = (cases, outs)
    return found


@needs_compiler
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_op_matches_eager_torch(family, family_results):
    cases, outs = family_results[family]
    failures = []
    for k, (dtype, name, op, a, b, ref) in enumerate(cases):
        for path, out in zip(("vector", "scalar"), outs):
            got = out[f"{k}"][: len(ref)]
            bad = mismatches(ref, got, op)
            if bad.any():
                i = bad.nonzero().flatten()[:3].tolist()
                seen = [(a[j].item(), b[j].item(), ref[j].item(), got[j].item()) for j in i]
                failures.append(f"{dtype} {name} ({path}): {int(bad.sum())} x, e.g. {seen}")
    assert not failures, "\n".join(failures)


@needs_compiler
def test_the_table_covers_every_computing_op_and_dtype(family_results):
    """Each op the translator computes appears in a traced case, and every dtype the
    kernel takes has cases (a new op in the translator needs a row here)."""
    seen: set[str] = set()
    dtypes = set()
    for cases, _ in family_results.values():
        dtypes |= {dtype for dtype, *_ in cases}
        # One trace of the family's combine holds every case's ops: a trace per case
        # cost about 0.3 s each, minutes for the table.
        graph = _make_fx(_family_combine(cases), _operands(cases, 2)).graph
        seen |= {op_name(n.target) for n in graph.nodes if n.op == "call_function"}
    assert COMPUTING_OPS - seen == set()
    assert dtypes == {torch.bool, *INTS, *FLOATS}


def test_mismatches_sees_nan_inf_and_zero_signs():
    op = Op(lambda a, b: a)
    ref = torch.tensor([math.nan, math.inf, 0.0, 1.0, 2.0])
    got = torch.tensor([0.0, -math.inf, -0.0, 1.0, 2.0000002])
    assert mismatches(ref, got, op).tolist() == [True, True, True, False, True]
    assert (
        mismatches(ref, got, Op(op.fn, ulps=1, ties=False)).tolist() == [True, True] + [False] * 3
    )


# --- inside real scan kernels ------------------------------------------------------


def _scan(fn, xs, dim=0, mode="eager"):
    with fscan.config.override(cpu_kernel=mode):
        return fscan.associative_scan(fn, xs, dim)


@needs_compiler
def test_bool_not_in_a_scan_matches_the_torch_engine():
    x = torch.rand(4096, 16, generator=torch.Generator().manual_seed(0)) > 0.5
    fn = lambda a, b: ~(a ^ b)
    want = _scan(fn, x, mode="off")
    for _ in range(3):  # the kernel is built on the first call: every call agrees
        assert torch.equal(_scan(fn, x), want)
    leaves, spec = optree.tree_flatten(x)
    with fscan.config.override(cpu_kernel="eager"):
        assert cpu_kernel.kernel_ready(fn, spec, leaves, 0)


def _integer_scan(x, y):  # wrapping sums, exact int64 fmax, bool xor: associative
    return {
        "sum": x["sum"] + y["sum"],
        "top": torch.fmax(x["top"], y["top"]),
        "odd": x["odd"] ^ y["odd"],
        "bits": x["bits"] | ~(~y["bits"]),
    }


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
def test_integer_scans_match_a_sequential_loop_exactly(reverse):
    gen = torch.Generator().manual_seed(1)
    n = 3000  # chunked on the 1-D chain path
    big = torch.randint(2**62, 2**63 - 1, (n,), generator=gen)
    xs = {
        "sum": torch.randint(-128, 128, (n,), generator=gen, dtype=torch.int8),
        "top": big - torch.randint(0, 3, (n,), generator=gen),  # differ beyond 2**53
        "odd": torch.rand(n, generator=gen) < 0.5,
        "bits": torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
    }
    want = sequential_scan(_integer_scan, xs, 0, reverse)
    leaves, spec = optree.tree_flatten(xs)
    with fscan.config.override(cpu_kernel="eager"):
        for _ in range(2):  # a first call checks combine_fn on the torch engine
            got = fscan.associative_scan(_integer_scan, xs, 0, reverse=reverse)
            for key in xs:
                assert torch.equal(got[key], want[key]), key
        assert cpu_kernel.kernel_ready(_integer_scan, spec, leaves, 0)


def _last_overflowing(x, y):  # the last element whose square overflows float32: associative
    return torch.where(torch.isinf(y * y), y, x)


@needs_compiler
def test_float32_intermediates_overflow_as_in_eager():
    """Computed in double, ``y * y`` of 1e20 is finite: the kernel rounds every op's
    result to float32 as eager does, so the selection sees the overflow."""
    x = torch.ones(2000, 16)
    x[700, 3] = 1e20
    x[1500, 5] = -3e19
    x[5, :] = torch.finfo(torch.float32).max
    want = _scan(_last_overflowing, x, mode="off")
    assert want[800, 3] == 1e20 and want[1999, 5] == -3e19 and want[4, 0] == 1
    for _ in range(2):  # a first call checks combine_fn on the torch engine
        assert torch.equal(_scan(_last_overflowing, x), want)
    leaves, spec = optree.tree_flatten(x)
    with fscan.config.override(cpu_kernel="eager"):
        assert cpu_kernel.kernel_ready(_last_overflowing, spec, leaves, 0)


# --- what the translator refuses --------------------------------------------------


REFUSED = {
    "floor divide": lambda a, b: a // b,
    "remainder": lambda a, b: a % b,
    "fmod": torch.fmod,
    "trunc divide": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "shift left": lambda a, b: a << (b & 7),
    "shift right": lambda a, b: a >> (b & 7),
    "copysign": torch.copysign,
    "gcd": torch.gcd,
    "negative power": lambda a, b: a ** (-2),
}


@needs_compiler
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_ops_leave_the_scan_to_the_torch_engine(name):
    x = torch.tensor([7, -7, 3, -2, 5, 9, 1, -1])
    leaves, spec = optree.tree_flatten(x)
    with fscan.config.override(cpu_kernel="eager"):
        assert cpu_kernel.kernel_scan("test", REFUSED[name], spec, leaves, 0, False) is None


DIVIDES = {  # associative (a sum), with a division whose divisor is the right operand
    "floor": lambda a, b: a + b + torch.div(a, b, rounding_mode="floor") * 0,
    "trunc": lambda a, b: a + b + torch.div(a, b, rounding_mode="trunc") * 0,
    "remainder": lambda a, b: a + b + torch.remainder(a, b) * 0,
    "fmod": lambda a, b: a + b + torch.fmod(a, b) * 0,
}


@needs_compiler
@pytest.mark.parametrize("name", sorted(DIVIDES))
def test_integer_division_by_zero_raises_as_the_torch_engine_does(name):
    """Where a divisor is 0 torch raises: the kernel route must not trap (SIGFPE) nor
    return garbage, but leave the call to the torch engine, which raises the same."""
    fn = DIVIDES[name]
    zeros = torch.tensor([5, 0, 0, 0, 0, 0, 0], dtype=torch.int32)  # every right operand 0
    for mode in ("off", "eager", "eager"):
        with pytest.raises(RuntimeError, match="ZeroDivisionError"):
            _scan(fn, zeros, mode=mode)
    ok = torch.tensor([7, 1, 3, 2, 5, 9, 4], dtype=torch.int32)
    want = torch.cumsum(ok, 0, dtype=torch.int32)
    for mode in ("off", "eager", "eager"):
        assert torch.equal(_scan(fn, ok, mode=mode), want)


@needs_compiler
def test_integer_negative_powers_raise_as_the_torch_engine_does():
    x = torch.tensor([2, 3, 4])
    fn = REFUSED["negative power"]
    with pytest.raises(RuntimeError, match="negative integer powers") as off:
        _scan(fn, x, mode="off")
    with pytest.raises(RuntimeError, match="negative integer powers") as eager:
        _scan(fn, x)
    assert str(off.value) == str(eager.value)


@pytest.mark.skipif(compiler_problem() is not None, reason="no C++ kernel here")
@pytest.mark.parametrize("dim", [0, 1])  # 0: the lane loops (bit arithmetic); 1: a walk
def test_float16_loads_and_stores_every_bit_pattern_as_torch(dim):
    """float16 converts in the kernel by bit arithmetic in the lane loops and by F16C where
    chains are walked (fscan_f16_load / fscan_f16_walk in csrc/prelude.h): every one of
    the 65536 bit patterns read and written back unchanged (NaN as a NaN), and float
    running values rounded to float16 as torch rounds them (to nearest even, subnormals,
    overflow to inf), bit for bit."""
    from fscan._engines.cpp.cpu_kernel import kernel_scan

    every = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = every.reshape(256, 256)
    x = x.contiguous() if dim == 0 else x.t().contiguous()  # each pattern once either way
    last = lambda a, b: b
    leaves, spec = optree.tree_flatten(x)
    with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
        (out,) = kernel_scan("test", last, spec, leaves, dim, False)
    nan = x.isnan()
    assert torch.equal(out.view(torch.int16)[~nan], x.view(torch.int16)[~nan])
    assert out[nan].isnan().all()
    # Products of two float16 values are exact in float: each rounded once to float16,
    # as torch rounds them (ties to even, subnormal results, overflow to inf).
    finite = every[every.isfinite()]
    gen = torch.Generator().manual_seed(dim)
    pairs = finite[torch.randint(len(finite), (2, 32768), generator=gen)]
    y = pairs.contiguous() if dim == 0 else pairs.t().contiguous()
    leaves, spec = optree.tree_flatten(y)
    with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
        (got,) = kernel_scan("test", lambda a, b: a * b, spec, leaves, dim, False)
    want = torch.stack([pairs[0], (pairs[0].float() * pairs[1].float()).half()])
    want = want if dim == 0 else want.t()
    assert torch.equal(
        got.nan_to_num(0.5).view(torch.int16), want.nan_to_num(0.5).view(torch.int16)
    )
