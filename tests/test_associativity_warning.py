"""The first-call associativity check: a NotAssociativeWarning, once per combine_fn key.

No false alarms on the associative combines fscan's docs, examples, tests and
benchmarks use, in every dtype; one warning for a combine that is not
associative, and none after; skipped with ``validate=False``, under transforms
and while tracing; forgotten by ``fscan.clear_caches``.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from helpers import (
    add,
    affine_compose,
    cached_verdicts,
    linear_recurrence,
    logaddexp,
    matmul,
    maximum,
    minimum,
    mul,
    parametrize,
    raises,
)

import fscan
from fscan._knowledge.associativity import QUICK_CANDIDATES, QUICK_ELEMENTS

MODES = ["pointwise", "generic"]
FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.int32, torch.int64]
SEEDS = range(4)


@pytest.fixture(autouse=True)
def fresh_verdicts():
    fscan.clear_caches()
    yield
    fscan.clear_caches()


@contextlib.contextmanager
def quiet():
    """A block in which a NotAssociativeWarning fails the test (as pytest's config does,
    stated here so the tests say what they check)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", fscan.NotAssociativeWarning)
        yield


def caught(fn, *args, **kwargs) -> list[warnings.WarningMessage]:
    """The NotAssociativeWarnings ``fn(*args, **kwargs)`` emits, every one recorded."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", fscan.NotAssociativeWarning)
        fn(*args, **kwargs)
    return [w for w in got if issubclass(w.category, fscan.NotAssociativeWarning)]


# --- associative combines: never a warning --------------------------------------------


def log_affine(x, y):  # docs/porting.md: h -> a h + b in log space
    return x[0] + y[0], torch.logaddexp(y[0] + x[1], y[1])


def online_softmax(x, y):  # a running (max, sum of exp) pair
    m = torch.maximum(x[0], y[0])
    return m, x[1] * torch.exp(x[0] - m) + y[1] * torch.exp(y[0] - m)


def log_matmul(x, y):  # docs/porting.md, docs/reduce.md: x @ y in the log semiring
    return torch.logsumexp(x.unsqueeze(-1) + y.unsqueeze(-3), dim=-2)


def last(x, y):  # docs/contract.md: the "last value" operator, aliasing its input
    return y


def first_value(x, y):
    return x


def randn(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def positive(shape, dtype, gen):  # near 1, so products stay in range in float16
    return (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5).to(dtype)


def ints(shape, dtype, gen):
    return torch.randint(-50, 50, shape, generator=gen).to(dtype)


# (combine, mode, make xs(dtype, gen)); modes None means both.
FLOAT_CASES = {
    "add": (add, None, lambda d, g: randn((40, 3), d, g)),
    "mul": (mul, None, lambda d, g: positive((40, 3), d, g)),
    "maximum": (maximum, None, lambda d, g: randn((40, 3), d, g)),
    "minimum": (minimum, None, lambda d, g: randn((40, 3), d, g)),
    "logaddexp": (logaddexp, None, lambda d, g: randn((40, 3), d, g)),
    "last": (last, None, lambda d, g: randn((40, 3), d, g)),
    "first": (first_value, None, lambda d, g: randn((40, 3), d, g)),
    "linear_recurrence": (
        linear_recurrence,
        None,
        lambda d, g: (positive((40, 3), d, g), randn((40, 3), d, g)),
    ),
    "affine_dict": (
        affine_compose,
        None,
        lambda d, g: {"w": positive((40, 3), d, g), "c": randn((40, 3), d, g)},
    ),
    "log_affine": (log_affine, None, lambda d, g: (randn((40, 3), d, g), randn((40, 3), d, g))),
    "online_softmax": (
        online_softmax,
        None,
        lambda d, g: (randn((40, 3), d, g), positive((40, 3), d, g)),
    ),
    "matmul": (matmul, "generic", lambda d, g: randn((40, 3, 3), d, g) / 2),
    "log_matmul": (log_matmul, "generic", lambda d, g: randn((40, 4, 4), d, g)),
}
INT_CASES = {
    "add": add,
    "mul": mul,
    "maximum": maximum,
    "minimum": minimum,
    "bitwise_xor": torch.bitwise_xor,
    "last": last,
    "linear_recurrence": linear_recurrence,
}


def float_cases():
    for name, (fn, only, make) in FLOAT_CASES.items():
        for mode in [only] if only else MODES:
            yield pytest.param(fn, mode, make, id=f"{name}-{mode}")


@pytest.mark.parametrize(("combine", "mode", "make"), list(float_cases()))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_no_false_alarm_on_associative_float_combines(combine, mode, make, dtype):
    for seed in SEEDS:
        fscan.clear_caches()
        xs = make(dtype, torch.Generator().manual_seed(seed))
        with quiet():
            fscan.associative_scan(combine, xs, 0, combine_mode=mode)
        assert cached_verdicts("associativity_checked") == 1


@parametrize(name=list(INT_CASES), mode=MODES, dtype=INTS)
def test_no_false_alarm_on_associative_int_combines(name, mode, dtype):
    combine = INT_CASES[name]
    for seed in SEEDS:
        fscan.clear_caches()
        gen = torch.Generator().manual_seed(seed)
        x = ints((40, 3), dtype, gen)
        xs = (ints((40, 3), dtype, gen), x) if combine is linear_recurrence else x
        with quiet():
            fscan.associative_scan(combine, xs, 0, combine_mode=mode)
        assert cached_verdicts("associativity_checked") == 1


def test_no_false_alarm_on_bool_combines():
    x = torch.rand(30, 2, generator=torch.Generator().manual_seed(0)) > 0.5
    with quiet():
        for combine in (torch.logical_or, torch.logical_and, torch.logical_xor):
            fscan.associative_scan(combine, x, 0)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128], ids=str)
def test_no_false_alarm_on_complex_combines(dtype):
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(30, 2, generator=gen, dtype=dtype)
    with quiet():
        fscan.associative_scan(mul, z, 0)
        fscan.associative_scan(add, z, 0, combine_mode="generic")


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_no_false_alarm_in_the_drop_ins_and_recurrences(dtype):
    gen = torch.Generator().manual_seed(0)
    x = ints((300, 4), dtype, gen) if dtype in INTS else randn((300, 4), dtype, gen)
    with quiet():
        for op in (fscan.cumsum, fscan.cummax, fscan.cummin):
            op(x, 0)
        if dtype.is_floating_point:
            fscan.cumprod(positive((300, 4), dtype, gen), 0)
            fscan.logcumsumexp(x, 0)
            fscan.linear_recurrence(positive((300, 4), dtype, gen), x, 0)
            fscan.linear_recurrence(positive((300, 4), dtype, gen), x, 0, reset=x > 1)


def test_no_false_alarm_on_matrix_chains_of_rotations():
    # examples/vmap_batch.py: products of homogeneous 3x3 motion matrices.
    turn = 0.1 * torch.randn(200, dtype=torch.float64)
    c, s, o, z = torch.cos(turn), torch.sin(turn), torch.ones(200), torch.zeros(200)
    m = torch.stack([torch.stack(r, -1) for r in [[c, -s, o], [s, c, o], [z, z, o]]], -2)
    with quiet():
        fscan.associative_scan(torch.matmul, m.float(), 0, combine_mode="generic")


# --- combines that are not associative: one warning --------------------------------


NOT_ASSOCIATIVE = {
    "half_p_plus_q": lambda p, q: p * 0.5 + q,
    "sub": torch.sub,
    "mean": lambda a, b: (a + b) / 2,
    "mul_plus_one": lambda a, b: a * b + 1,
}


# The warning comes from the front end's first-call check, before an engine is chosen
# (fscan/_knowledge/validate.py), and the scan's result is not compared here. So the C++
# kernel runs these combines in one dtype (one kernel per combine: the warning's plumbing
# on the kernel route), the other dtypes on the torch engine: a kernel of a combine that is
# not associative checks nothing more, and each cost ~6-8 s of CPU on a cold cache (12 of
# them: ~85 s of the suite's CPU).
KERNEL_DTYPE = torch.float32


@parametrize(name=list(NOT_ASSOCIATIVE), mode=MODES, dtype=FLOATS)
def test_a_non_associative_combine_warns_once(name, mode, dtype):
    combine = NOT_ASSOCIATIVE[name]
    xs = randn((64, 3), dtype, torch.Generator().manual_seed(0))
    engine = (
        contextlib.nullcontext()
        if dtype == KERNEL_DTYPE
        else fscan.config.override(cpu_kernel="off")
    )
    with engine:
        first = caught(fscan.associative_scan, combine, xs, 0, combine_mode=mode)
        assert len(first) == 1
        assert "`combine_fn` is not associative: for leaf xs" in str(first[0].message)
        assert "they differ by" in str(first[0].message)
        assert first[0].filename == __file__  # points at the caller's line
        assert caught(fscan.associative_scan, combine, xs, 0, combine_mode=mode) == []


@parametrize(mode=MODES, dtype=INTS)
def test_integer_subtraction_warns_with_the_exact_difference(mode, dtype):
    xs = torch.arange(1, 20).to(dtype)
    (w,) = caught(fscan.associative_scan, torch.sub, xs, 0, combine_mode=mode)
    assert "they differ by " in str(w.message) and "tolerance" not in str(w.message)


def test_the_warning_is_a_scan_warning_and_names_the_leaf():
    assert issubclass(fscan.NotAssociativeWarning, fscan.ScanWarning)

    def combine(x, y):  # the first leaf composes fine, the second does not
        return x[0] + y[0], {"h": x[1]["h"] * 0.5 + y[1]["h"]}

    xs = (torch.randn(20, 2), {"h": torch.randn(20, 2)})
    (w,) = caught(fscan.associative_scan, combine, xs, 0)
    text = str(w.message)
    assert text.startswith("fscan.associative_scan: `combine_fn` is not associative: for leaf ")
    assert "for leaf xs[1]['h']" in text
    assert "validate=True raises instead, validate=False skips the check" in text


def test_the_warning_names_positions_of_the_data():
    xs = torch.arange(1000)
    (w,) = caught(fscan.associative_scan, torch.sub, xs, 0)
    text = str(w.message)
    # The check drew from elements spread over the data (0, 32, ..., 999), not from 0..7.
    drawn = text.split("with a = ")[1].split(" along dim 0")[0]
    numbers = [int(t) for t in drawn.replace(".", " ").replace(",", " ").split() if t.isdigit()]
    assert numbers and set(numbers) <= {i * 999 // (QUICK_CANDIDATES - 1) for i in range(32)}
    assert max(numbers) > QUICK_ELEMENTS


# Counts the torch engine's combine_fn calls (the C++ kernel traces combine_fn instead).
@pytest.mark.torch_engine
def test_the_check_runs_on_the_first_call_only():
    class CountingSub:
        def __init__(self) -> None:
            self.calls = torch.zeros((), dtype=torch.int64)

        def __call__(self, a, b):
            self.calls.add_(1)
            return a - b

    fn, xs = CountingSub(), torch.randn(32)
    counts = []
    for _ in range(3):
        before = int(fn.calls)
        got = caught(fscan.associative_scan, fn, xs, 0)
        counts.append((int(fn.calls) - before, len(got)))
    (first, warned), (second, again), (third, _) = counts
    assert warned == 1 and again == 0
    assert second == third < first <= second + 20  # the check: a few calls, once


def test_validate_false_skips_the_check_and_validate_true_raises():
    xs = torch.randn(30)
    assert caught(fscan.associative_scan, torch.sub, xs, 0, validate=False) == []
    assert cached_verdicts("associativity_checked") == 0
    with raises(fscan.NotAssociativeError, "`combine_fn` is not associative"):
        fscan.associative_scan(torch.sub, xs, 0, validate=True)
    assert len(caught(fscan.associative_scan, torch.sub, xs, 0)) == 1


def test_clear_caches_forgets_the_verdict():
    xs = torch.randn(30)
    assert len(caught(fscan.associative_scan, torch.sub, xs, 0)) == 1
    assert caught(fscan.associative_scan, torch.sub, xs, 0) == []
    fscan.clear_caches()
    assert len(caught(fscan.associative_scan, torch.sub, xs, 0)) == 1


def test_captured_values_are_part_of_the_key():
    def make(k):
        return lambda a, b: a * k + b

    xs = torch.randn(30)
    assert caught(fscan.associative_scan, make(1.0), xs, 0) == []  # a + b
    assert len(caught(fscan.associative_scan, make(0.5), xs, 0)) == 1
    assert caught(fscan.associative_scan, make(0.5), xs, 0) == []
    assert caught(fscan.associative_scan, make(1.0), xs, 0) == []


def test_dtype_is_part_of_the_key():
    x = torch.randn(30)
    assert len(caught(fscan.associative_scan, torch.sub, x, 0)) == 1
    assert len(caught(fscan.associative_scan, torch.sub, x.double(), 0)) == 1
    assert caught(fscan.associative_scan, torch.sub, x.double(), 0) == []


@pytest.mark.parametrize("mode", MODES)
def test_generic_mode_checks_on_single_elements(mode):
    shapes = set()

    def sub(a, b):
        shapes.add(tuple(a.shape))
        return a - b

    xs = torch.randn(30, 4, 5)
    assert len(caught(fscan.associative_scan, sub, xs, 0, combine_mode=mode)) == 1
    if mode == "generic":
        assert shapes == {(4, 5)}


def test_other_doors_warn_too():
    x = torch.randn(30, 2)
    half = lambda p, q: p * 0.5 + q
    assert len(caught(fscan.associative_scan, half, x, 0, reset=x[:, 0] > 1)) == 1
    fscan.clear_caches()
    assert len(caught(fscan.associative_scan, half, x, 1, initial=torch.zeros(30))) == 1
    fscan.clear_caches()
    assert len(caught(fscan.lax.associative_scan, half, x)) == 1
    fscan.clear_caches()
    assert len(caught(fscan.associative_reduce, half, x, 0)) == 1


# --- where it cannot run, or need not --------------------------------------------------


def test_float64_when_it_runs_there_else_the_data_dtype():
    w = torch.randn(3, 3)  # float32: a float64 operand cannot multiply it

    def affine_not_associative(a, b):
        return a @ w + b

    xs = torch.randn(20, 3)
    (got,) = caught(fscan.associative_scan, affine_not_associative, xs, 0, combine_mode="generic")
    assert "is not associative" in str(got.message)
    fscan.clear_caches()
    with quiet():  # associative, but returns float32 whatever it gets
        fscan.associative_scan(lambda a, b: (a + b).float(), xs, 0)


def test_a_combine_that_fails_on_the_check_gets_the_scan_s_own_error():
    def picky(a, b):
        if a.dtype != torch.float32:
            raise RuntimeError("float32 only")
        return a + b

    with quiet():
        out = fscan.associative_scan(picky, torch.ones(5), 0)
    torch.testing.assert_close(out, torch.arange(1.0, 6.0))


def test_non_finite_elements_are_left_out():
    x = torch.randn(64)
    x[::3] = float("nan")
    x[1::7] = float("inf")
    with quiet():
        fscan.associative_scan(add, x, 0)
        fscan.associative_scan(logaddexp, x, 0)
    fscan.clear_caches()
    assert len(caught(fscan.associative_scan, lambda p, q: p * 0.5 + q, x, 0)) == 1


def test_short_and_empty_scans():
    with quiet():
        for n in range(1, QUICK_ELEMENTS + 2):
            fscan.clear_caches()
            fscan.associative_scan(add, torch.randn(n, 2), 0)
            fscan.associative_scan(add, torch.randn(n, 2), 0, combine_mode="generic")
    fscan.clear_caches()
    assert caught(fscan.associative_scan, torch.sub, torch.ones(0, 2), 0) == []
    assert cached_verdicts("associativity_checked") == 0  # the first non-empty call checks
    assert len(caught(fscan.associative_scan, torch.sub, torch.randn(2, 2), 0)) == 1


def test_skipped_under_torch_func_transforms_then_checked_on_a_plain_call():
    xs = torch.randn(3, 20)
    half = lambda p, q: p * 0.5 + q
    run = lambda x: fscan.associative_scan(half, x, 0)
    assert caught(torch.func.vmap(run), xs) == []
    assert caught(torch.func.grad(lambda x: run(x).sum()), xs[0]) == []
    assert cached_verdicts("associativity_checked") == 0
    assert len(caught(run, xs[0])) == 1


# torch's forward-mode AD scripts its decompositions on first use, which warns.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_skipped_under_forward_ad():
    x, t = torch.randn(20, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, t)
        got = caught(fscan.associative_scan, lambda p, q: p * 0.5 + q, dual, 0)
    assert got == []
    assert cached_verdicts("associativity_checked") == 0


def test_skipped_while_torch_compile_traces():
    half = lambda p, q: p * 0.5 + q
    compiled = torch.compile(lambda x: fscan.associative_scan(half, x, 0), backend="eager")
    torch._dynamo.reset()
    assert caught(compiled, torch.randn(20)) == []
    assert cached_verdicts("associativity_checked") == 0
