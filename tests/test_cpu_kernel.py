"""The generated C++ scan kernel (fscan._engines.cpp.cpu_kernel) against fscan's torch engine
and a float64 sequential oracle; its fallbacks, key, cache and threads.

Each combine below compiles once per test run (module-level cache, warm on reruns
through Inductor's disk cache). Without a C++ compiler the kernel tests skip and the
fallback tests still run.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
from collections.abc import Iterator

import optree
import pytest
import torch
from helpers import sequential_scan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fscan
from fscan._engines.cpp import (
    _cpp_source,
    _kernel_builder,
    _kernel_entry,
    _kernel_registry,
    cpu_kernel,
    traced_kernel,
)
from fscan._engines.cpp._cpp_build import compiler_problem
from fscan._engines.cpp.cpu_kernel import State, kernel_scan

# The first-call associativity check warns here, as expected: some combines are not
# associative on purpose (a * 0.5 + b), since the kernel must match the torch engine's
# grouping whatever the combine.
pytestmark = pytest.mark.filterwarnings("ignore::fscan.NotAssociativeWarning")

needs_compiler = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"no C++ kernel here: {compiler_problem()}"
)


def add(a, b):
    return a + b


def linrec(x, y):
    return (x[0] * y[0], y[0] * x[1] + y[1])


def cmax(a, b):
    return torch.maximum(a, b)


def seg(x, y):  # (reset flag, value): restart where the right flag is set
    return (x[0] | y[0], torch.where(y[0], y[1], x[1] + y[1]))


def lse(a, b):
    return torch.logaddexp(a, b)


def mixed(x, y):  # int count, half sum, bf16 max, over a dict
    return {
        "n": x["n"] + y["n"],
        "h": x["h"] + y["h"],
        "b": torch.maximum(x["b"], y["b"]),
    }


def small_ints(x, y):  # int8 wraps, bool or, uint8 max
    return (x[0] + y[0], x[1] | y[1], torch.maximum(x[2], y[2]))


def _leaves(name: str, shape: tuple[int, ...], gen: torch.Generator):
    def f32():
        return torch.randn(shape, generator=gen)

    if name == "add":
        return f32().double()
    if name == "linrec":
        return (torch.rand(shape, generator=gen) * 0.5 + 0.5, f32())
    if name == "max":
        x = f32()
        if x.numel() > 4:
            x.view(-1)[1] = float("nan")
            x.view(-1)[3] = float("inf")
        return x
    if name == "seg":
        return (torch.rand(shape, generator=gen) < 0.1, f32())
    if name == "lse":
        return f32()
    if name == "mixed":
        return {
            "n": torch.randint(-5, 5, shape, generator=gen),
            "h": (torch.rand(shape, generator=gen) * 0.01).half(),
            "b": f32().bfloat16(),
        }
    if name == "small_ints":
        return (
            torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8),
            torch.rand(shape, generator=gen) < 0.01,
            torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8),
        )
    raise AssertionError(name)


COMBINES = {
    "add": (add, 3),
    "linrec": (linrec, 2),
    "max": (cmax, 2),
    "seg": (seg, 1),
    "lse": (lse, 2),
    "mixed": (mixed, 2),
    "small_ints": (small_ints, 2),
}


@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n`` inside the block, restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def oracle(fn, xs, dim: int, reverse: bool):
    """Sequential scan, floats in float64 (ints and bools as they are)."""
    leaves, spec = optree.tree_flatten(xs)
    wide = [x.double() if x.is_floating_point() else x for x in leaves]
    moved = [x.movedim(dim, 0) for x in wide]
    n = moved[0].shape[0]
    out = [torch.empty_like(x) for x in moved]
    order = range(n - 1, -1, -1) if reverse else range(n)
    acc = None
    for t in order:
        cur = [x[t] for x in moved]
        if acc is None:
            acc = cur
        else:
            acc = optree.tree_leaves(
                fn(optree.tree_unflatten(spec, acc), optree.tree_unflatten(spec, cur))
            )
            acc = [a.to(c.dtype) for a, c in zip(acc, cur)]
        for o, a in zip(out, acc):
            o[t] = a
    return [o.movedim(0, dim).to(x.dtype) for o, x in zip(out, leaves)]


def assert_close_to(out, ref, name: str) -> None:
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        if not o.is_floating_point():
            assert torch.equal(o, r), name
            continue
        tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}.get(o.dtype, 1e-5)
        torch.testing.assert_close(o.double(), r.double(), rtol=tol, atol=tol, equal_nan=True)


@pytest.fixture(scope="module", autouse=True)
def eager_kernel():
    with fscan.config.override(cpu_kernel="eager"):
        yield


def run_kernel(name: str, xs, dim: int, reverse: bool):
    fn = COMBINES[name][0]
    leaves, spec = optree.tree_flatten(xs)
    with torch.no_grad():
        out = kernel_scan("test", fn, spec, leaves, dim, reverse)
    assert out is not None, f"the kernel did not serve {name}"
    return out


@needs_compiler
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    name=st.sampled_from(sorted(COMBINES)),
    length=st.one_of(st.integers(0, 40), st.sampled_from([2047, 2048, 2049, 4113, 5000])),
    other=st.sampled_from([1, 3, 8, 17]),
    dim_pick=st.integers(0, 2),
    reverse=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_oracle(name, length, other, dim_pick, reverse, threads, seed):
    fn, ndim = COMBINES[name]
    dim = dim_pick % ndim
    shape = [other, 2, other][:ndim]
    shape[dim] = length
    if length * other > 20000 and name in ("mixed", "small_ints"):
        shape[dim] = 40  # the oracle loop is slow; lengths near chunk edges come from others
    xs = _leaves(name, tuple(shape), torch.Generator().manual_seed(seed))
    with num_threads(threads):
        out = run_kernel(name, xs, dim, reverse)
    assert_close_to(out, oracle(fn, xs, dim, reverse), name)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape,dim", [((70001,), 0), ((3, 9001), 1), ((9001, 3), 0)])
def test_long_chunked_scans_match_torch(shape, dim, threads):
    x = torch.randn(shape, dtype=torch.float64)
    with num_threads(threads):
        for reverse in (False, True):
            (out,) = run_kernel("add", x, dim, reverse)
            ref = x.flip(dim).cumsum(dim).flip(dim) if reverse else x.cumsum(dim)
            torch.testing.assert_close(out, ref)


@needs_compiler
def test_front_end_uses_the_kernel_and_matches_the_torch_engine():
    x = (torch.rand(300, 4, 9), torch.randn(300, 4, 9))
    with torch.no_grad():
        with fscan.config.override(cpu_kernel="off"):
            ref = fscan.associative_scan(linrec, x, 1, reverse=True)
        for _ in range(2):  # the first call runs the pointwise check on the torch engine
            out = fscan.associative_scan(linrec, x, 1, reverse=True)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    assert State.READY in {e.state for e in _all_kernel_entries()}


@needs_compiler
def test_float32_sum_accumulates_in_double():
    x = torch.rand(2**22)
    (out,) = kernel_scan("test", add, optree.tree_flatten(0)[1], [x], 0, False) or [None]
    assert out is not None
    exact = x.double().cumsum(0)
    err = ((out.double() - exact).abs() / exact).max().item()
    torch_err = ((x.cumsum(0).double() - exact).abs() / exact).max().item()
    assert err <= 2 * max(torch_err, 1e-7)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("reverse", [False, True])
def test_chunk_totals_summed_keep_special_values_and_zero_signs(threads, reverse):
    """A 1-D float32 add is chunked, and its chunks' totals are plain double sums
    (chunk_totals in csrc/chunk_totals.h): chunk lengths that are no multiple of the
    sums' 32 lanes, an inf and a -inf in different chunks (NaN from there on), a NaN,
    a run of -0.0 (a sum of -0.0 stays -0.0 across chunks), against the walk in float64
    rounded once."""
    n = 70001
    x = torch.randn(n, generator=torch.Generator().manual_seed(threads))
    for values in (x, torch.full((n,), -0.0)):
        for special in ({}, {10007: float("inf"), 50003: float("-inf")}, {30011: float("nan")}):
            data = values.clone()
            for i, v in special.items():
                data[i] = v
            (out,) = kernel_scan(
                "test", add, optree.tree_flatten(0)[1], [data], 0, reverse, threads=threads
            )
            # Python's floats add as the walk does (torch's cumsum starts from +0.0)
            steps = data.double().tolist()[:: -1 if reverse else 1]
            walked = torch.tensor(list(itertools.accumulate(steps))[:: -1 if reverse else 1])
            torch.testing.assert_close(out, walked.float(), rtol=0, atol=0, equal_nan=True)
            assert torch.equal(out.signbit(), walked.float().signbit())


def mul(a, b):
    return a * b


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
def test_float32_products_below_doubles_range_are_flushed(reverse):
    # Gates above 0.5: the float32 product, held in double, would sink into double's
    # subnormals and stay at the least one; it is flushed to 0 there instead, which
    # rounds to the same float32 outputs (0) as the float64 oracle's.
    gen = torch.Generator().manual_seed(3)
    xs = (torch.rand(5000, 3, generator=gen) * 0.5 + 0.5, torch.randn(5000, 3, generator=gen))
    out = run_kernel("linrec", xs, 0, reverse)
    ref = oracle(linrec, xs, 0, reverse)
    assert out[0].abs().min() == 0  # the products did underflow
    assert_close_to(out, tuple(r.float() for r in ref), "linrec")


@needs_compiler
def test_float32_products_keep_doubles_range_as_torch_cumprod():
    # Beyond float32's range a running product is kept in double as torch.cumprod keeps
    # it (an overflow comes back); only a pair's, below double's normal range
    # (2**-1022), is 0.
    x = torch.tensor([1e30, 1e30, 1e-30, 1e-30, 2.0])
    (out,) = kernel_scan("test", mul, optree.tree_flatten(0)[1], [x], 0, False) or [None]
    assert out is not None
    torch.testing.assert_close(out, x.cumprod(0))
    # A pair's: 1e-314 (a double subnormal) is 0 from there on.
    sunk = torch.tensor([1e-38] * 8 + [1e-10] + [1e38] * 8)
    out = run_kernel("linrec", (sunk, torch.zeros(17)), 0, False)
    assert sunk.cumprod(0)[-1] > 0 and (out[0][8:] == 0).all()


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shape,dim", [((17, 16384), 1), ((1, 2, 40000), 2), ((80000,), 0)])
def test_long_chains_walked_apart_match_the_oracle(shape, dim, reverse):
    # Chains long enough to be walked SKEW steps apart (csrc/forward_chains.h: chains), power-of-
    # two lengths (lanes 4 KiB apart) and a group of fewer than G lanes among them.
    gen = torch.Generator().manual_seed(4)
    xs = (torch.rand(shape, generator=gen, dtype=torch.float64) * 0.1 + 0.9,)
    xs += (torch.randn(shape, generator=gen, dtype=torch.float64),)
    assert_close_to(run_kernel("linrec", xs, dim, reverse), oracle(linrec, xs, dim, reverse), "")
    (x,) = xs[1:]
    (out,) = run_kernel("add", x, dim, reverse)
    ref = x.flip(dim).cumsum(dim).flip(dim) if reverse else x.cumsum(dim)
    torch.testing.assert_close(out, ref)


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("shape,dim", [((40, 37), 1), ((70001,), 0), ((3, 5, 1000), 2)])
def test_float32_chains_in_tiles_match_the_oracle(shape, dim, reverse):
    # Float32 pairs go 16 chains side by side in transposed tiles (csrc/forward_chains.h:
    # tile_chains; a single leaf is walked):
    # whole groups and a group of fewer, tails shorter than a tile, chunks of one lane.
    gen = torch.Generator().manual_seed(5)
    xs = (torch.rand(shape, generator=gen) * 0.5 + 0.5, torch.randn(shape, generator=gen))
    ref = oracle(linrec, xs, dim, reverse)
    assert_close_to(run_kernel("linrec", xs, dim, reverse), tuple(r.float() for r in ref), "")
    (out,) = run_kernel("add", xs[1], dim, reverse)
    (ref,) = oracle(add, xs[1], dim, reverse)
    torch.testing.assert_close(out, ref.float(), rtol=1e-5, atol=1e-5)


@needs_compiler
def test_captured_tensors_are_inputs_read_at_each_call():
    def make(w, k):
        return lambda a, b: torch.maximum(a * w, b) + k

    x = torch.randn(64, 3, 5)
    _, spec = optree.tree_flatten(0)
    for w in (torch.rand(3, 5), torch.rand(5), torch.rand(()), torch.rand(1, 3, 1)):
        fn = make(w, 0.25)
        with torch.no_grad():
            (out,) = kernel_scan("test", fn, spec, [x], 0, False)
        assert_close_to([out], oracle(fn, x, 0, False), "captured")


@needs_compiler
def test_captured_numbers_key_the_kernel():
    _, spec = optree.tree_flatten(0)
    x = torch.randn(50, 8)
    outs = []
    for k in (1.0, 2.0):
        fn = lambda a, b, k=k: a * 0.5 + b * k
        with torch.no_grad():
            outs.append(kernel_scan("test", fn, spec, [x], 0, False)[0])
        assert_close_to([outs[-1]], oracle(fn, x, 0, False), "numbers")
    assert not torch.allclose(outs[0], outs[1])


@needs_compiler
def test_concurrent_threads_with_fresh_closures():
    x = torch.randn(500, 16, dtype=torch.float64)
    make = lambda w: lambda a, b: a + b * w
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(5):
                w = torch.full((16,), float(i))
                fn = make(w)
                with torch.no_grad():
                    out = fscan.associative_scan(fn, x, 0)
                torch.testing.assert_close(out, (x * float(i)).cumsum(0) + x[:1] * (1 - i))
        except BaseException as err:  # reported in the main thread
            errors.append(err)

    # One call first, so that the threads exercise the kernel: the first call of a key
    # runs the pointwise check on the torch engine.
    with torch.no_grad():
        fscan.associative_scan(make(torch.ones(16)), x, 0)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


# --- fallbacks: these run with or without a compiler --------------------------------


def _front_end(fn, xs, dim=0):
    with torch.no_grad():
        return [fscan.associative_scan(fn, xs, dim) for _ in range(2)][-1]


def _off(fn, xs, dim=0):
    with fscan.config.override(cpu_kernel="off"), torch.no_grad():
        return fscan.associative_scan(fn, xs, dim)


def test_no_compiler_falls_back_with_identical_results(monkeypatch):
    monkeypatch.setattr(_kernel_registry, "compiler_problem", lambda: "no compiler (test)")
    x = torch.randn(40, 3)
    fn = lambda a, b: a * 0.5 + b
    assert torch.equal(_front_end(fn, x), _off(fn, x))
    _, spec = optree.tree_flatten(0)
    assert kernel_scan("test", fn, spec, [x], 0, False) is None


def test_unsupported_op_falls_back_silently(monkeypatch):
    monkeypatch.setattr(_kernel_registry, "compiler_problem", lambda: None)
    x = torch.randn(40, 3)
    fn = lambda a, b: torch.remainder(a + b, 3.0)  # no C++ translation
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _front_end(fn, x)
    assert torch.equal(out, _off(fn, x))


def test_compile_failure_warns_once_and_falls_back(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("compiler exploded (test)")

    monkeypatch.setattr(_kernel_registry, "compiler_problem", lambda: None)
    monkeypatch.setattr(_kernel_builder, "load_kernel", broken)
    x = torch.randn(40, 3)
    fn = lambda a, b: a * 0.25 + b  # a code object no other test compiled
    with pytest.warns(UserWarning, match="building the C\\+\\+ scan kernel failed"):
        out = _front_end(fn, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _front_end(fn, x)
    assert torch.equal(out, _off(fn, x)) and torch.equal(again, out)


def test_derived_kernel_compile_failure_warns_once_and_falls_back(monkeypatch):
    # The segmented kernel (reset=) is written from the forward's translation: its own
    # compile failing warns as the forward's does, and the call falls back.
    real = _kernel_builder.load_kernel

    def segmented_broken(source, argtypes):
        if "segmented(" in source:
            raise RuntimeError("compiler exploded on the segmented kernel (test)")
        return real(source, argtypes)

    monkeypatch.setattr(_kernel_registry, "compiler_problem", lambda: None)
    monkeypatch.setattr(_kernel_builder, "load_kernel", segmented_broken)
    x = torch.randn(40, 3, dtype=torch.float64)
    reset = torch.arange(40) % 7 == 3
    fn = lambda a, b: a * 0.375 + b  # a code object no other test compiled

    def call():
        with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
            return fscan.associative_scan(fn, x, 0, reset=reset)

    with pytest.warns(UserWarning, match="building the C\\+\\+ scan kernel failed"):
        out = call()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = call()
    with fscan.config.override(cpu_kernel="off"), torch.no_grad():
        expected = fscan.associative_scan(fn, x, 0, reset=reset)
    torch.testing.assert_close(out, expected)
    assert torch.equal(again, out)


def test_gradients_take_the_autograd_engine():
    x = torch.randn(30, 4, requires_grad=True)
    fn = lambda a, b: a * 0.5 + b
    _, spec = optree.tree_flatten(0)
    assert kernel_scan("test", fn, spec, [x], 0, False) is None
    y = fscan.associative_scan(fn, x, 0)
    y.sum().backward()
    assert x.grad is not None and y.requires_grad


def _all_kernel_entries() -> list[cpu_kernel.Entry]:
    from fscan._knowledge import store as _knowledge

    holders = map(_knowledge.entries.get, list(_knowledge.entries._data))
    return [e for h in holders if h is not None for e in cpu_kernel.kernel_entries(h)]


def test_entry_cache_is_bounded(monkeypatch):
    from fscan._cache import BoundedCache
    from fscan._knowledge import store as _knowledge

    monkeypatch.setattr(_kernel_registry, "compiler_problem", lambda: None)
    monkeypatch.setattr(_knowledge, "entries", BoundedCache(maxsize=2))
    monkeypatch.setattr(_kernel_registry, "MIN_CALLS", 10**9)
    monkeypatch.setattr(_kernel_registry, "MIN_ELEMENTS", 10**18)
    _kernel_builder.warm_up()  # what the background thread does first: imports, compiler lookup
    _, spec = optree.tree_flatten(0)
    with fscan.config.override(cpu_kernel="on"):
        for k in range(5):  # five keys: captured numbers are part of the key
            fn = lambda a, b, k=k: a + b * k
            assert kernel_scan("test", fn, spec, [torch.ones(4)], 0, False) is None
    assert len(_knowledge.entries) == 2 and len(_all_kernel_entries()) == 2


def test_config_and_environment_modes(monkeypatch):
    from fscan._config import Config

    monkeypatch.setenv("FSCAN_CPU_KERNEL", "off")
    assert Config().cpu_kernel == "off"
    monkeypatch.setenv("FSCAN_CPU_KERNEL", "sometimes")
    with pytest.raises(fscan.ScanValueError, match="FSCAN_CPU_KERNEL"):
        Config()
    with pytest.raises(fscan.ScanValueError, match="cpu_kernel"):
        fscan.config.cpu_kernel = "always"
    with fscan.config.override(cpu_kernel="off"):
        assert fscan.config.cpu_kernel == "off"
    assert fscan.config.cpu_kernel == "eager"  # this module's fixture


# --- gradients ------------------------------------------------------------------------


def _scan_fn(name: str, dim: int, reverse: bool):
    fn = COMBINES[name][0]
    return lambda *xs: fscan.associative_scan(fn, xs if len(xs) > 1 else xs[0], dim, reverse)


@needs_compiler
@pytest.mark.parametrize("name", ["linrec", "lse", "max"])
def test_gradcheck_through_the_backward_kernel(name):
    nd = COMBINES[name][1]
    gen = torch.Generator().manual_seed(1)
    xs = _leaves(name, (6, 5)[:nd], gen) if name != "max" else torch.randn(6, 5, generator=gen)
    xs = tuple(x.double().requires_grad_() for x in optree.tree_leaves(xs))
    for dim in range(nd):
        for reverse in (False, True):
            f = _scan_fn(name, dim, reverse)
            f(*xs)  # the pointwise check runs on this first call
            out = optree.tree_leaves(f(*xs))
            assert type(out[0].grad_fn).__name__ == "KernelScanBackward"
            assert torch.autograd.gradcheck(f, xs)
    assert torch.autograd.gradgradcheck(_scan_fn(name, 0, False), xs)  # the adjoint scan


@needs_compiler
@pytest.mark.parametrize("shape,dim", [((5000,), 0), ((300, 3, 20), 1), ((7, 2100), 1)])
def test_backward_kernel_matches_the_torch_engine(shape, dim):
    a = (torch.rand(shape) * 0.5 + 0.5).requires_grad_()
    b = torch.randn(shape, requires_grad=True)
    g = [torch.randn(shape), torch.randn(shape)]
    grads = []
    for mode in ("eager", "off"):
        with fscan.config.override(cpu_kernel=mode):
            outs = [fscan.associative_scan(linrec, (a, b), dim, reverse=True) for _ in range(2)]
            grads.append(torch.autograd.grad(outs[-1], (a, b), g))
    for k, r in zip(*grads):
        torch.testing.assert_close(k, r, rtol=1e-4, atol=1e-4)


def _through_kernel(fn, xs, dim: int, reverse: bool):
    """``fscan.associative_scan`` of ``xs``, asserting the backward kernel serves it."""
    scan = lambda: fscan.associative_scan(fn, xs, dim, reverse)
    scan()  # the pointwise check runs on this first call
    out = optree.tree_leaves(scan())
    assert type(out[0].grad_fn).__name__ == "KernelScanBackward"
    return out


def _oracle_grads(fn, xs, dim: int, reverse: bool, inputs, cots):
    """Autograd through the sequential float64 oracle (its cotangents ``cots``)."""
    out = oracle(fn, xs, dim, reverse)
    return torch.autograd.grad(out, inputs, cots, allow_unused=True)


@needs_compiler
@pytest.mark.parametrize("wshape", [(), (4,), (3, 4)], ids=["scalar", "channel", "element"])
def test_captured_gradients_gradcheck_through_the_kernel(wshape):
    # (T, 3, 4) along dim 0 and (3, T, 4) along dim 1 share the element (3, 4): one kernel.
    gen = torch.Generator().manual_seed(3)
    w = (torch.rand(wshape, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    fn = lambda a, b: a * b * w  # associative: w * a * b scales a product
    for dim, shape in ((0, (6, 3, 4)), (1, (3, 6, 4))):
        x = (torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
        for reverse in (False, True):
            _through_kernel(fn, x, dim, reverse)
            f = lambda x, w: fscan.associative_scan(fn, x, dim, reverse)
            assert torch.autograd.gradcheck(f, (x, w))
            g = torch.randn(shape, generator=gen, dtype=torch.float64)
            got = torch.autograd.grad(f(x, w), (x, w), g)
            want = _oracle_grads(fn, x, dim, reverse, (x, w), g)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def make_gate(w, u):
    """A decay gate scaled by ``w`` beside a sum offset by ``u`` (both associative)."""
    return lambda a, b: (a[0] * b[0] * w, a[1] * b[0] * w + b[1], a[2] + b[2] + u)


def _gate_inputs(shape, gen, dtype):
    gates = 1 - 1e-3 * torch.rand(shape, generator=gen, dtype=dtype)  # carries travel far
    xs = (gates, torch.randn(shape, generator=gen, dtype=dtype))
    xs += (torch.randn(shape, generator=gen, dtype=dtype),)
    return tuple(x.requires_grad_() for x in xs)


def _gate_grads(xs, w, u, dim: int, reverse: bool, cots, threads: int):
    with num_threads(threads):
        out = _through_kernel(make_gate(w, u), xs, dim, reverse)
        return torch.autograd.grad(out, (*xs, w, u), cots)


def _assert_gate_matches_oracle(got, xs, w, u, dim, reverse, cots, tol):
    wide = tuple(t.detach().double().requires_grad_() for t in (*xs, w, u))
    gate = make_gate(*wide[3:])
    want = _oracle_grads(gate, wide[:3], dim, reverse, wide, [c.double() for c in cots])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * b.abs().max().item())


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_two_captured_tensors_match_the_oracle_and_threads_agree(threads):
    # 96000 elements: 2-3 threads split the lanes (each lane's sums stay in one thread).
    gen = torch.Generator().manual_seed(4)
    shape = (300, 8, 40)
    w = (torch.rand(40, generator=gen) * 0.01 + 1).requires_grad_()
    u = torch.tensor(0.3, requires_grad=True)
    xs = _gate_inputs(shape, gen, torch.float32)
    cots = [torch.randn(shape, generator=gen) for _ in range(3)]
    got = _gate_grads(xs, w, u, 1, True, cots, threads)
    one = _gate_grads(xs, w, u, 1, True, cots, 1)
    for a, b in zip(got, one):
        assert torch.equal(a, b)  # deterministic whatever the thread count
    _assert_gate_matches_oracle(got, xs, w, u, 1, True, cots, 1e-5)


def _gate_adjoint(xs, w: float, u: float, cots, reverse: bool):
    """The gate's gradients along one lane, by its hand-derived adjoint in Python floats
    (float64): a sequential oracle fast enough for 10**5 steps."""
    x0, x1 = xs[0].tolist(), xs[1].tolist()
    g0, g1, g2 = (c.tolist() for c in cots)
    n = len(x0)
    order = list(range(n - 1, -1, -1)) if reverse else list(range(n))
    y0, y1 = [0.0] * n, [0.0] * n
    prev = None
    for t in order:
        if prev is None:
            y0[t], y1[t] = x0[t], x1[t]
        else:
            y0[t], y1[t] = y0[prev] * x0[t] * w, y1[prev] * x0[t] * w + x1[t]
        prev = t
    bars = [[0.0] * n for _ in range(3)]
    last = order[-1]
    lam = [g0[last], g1[last], g2[last]]
    wbar = ubar = 0.0
    for s in range(n - 1, 0, -1):
        t, p = order[s], order[s - 1]
        bars[0][t] = (lam[0] * y0[p] + lam[1] * y1[p]) * w
        bars[1][t], bars[2][t] = lam[1], lam[2]
        wbar += (lam[0] * y0[p] + lam[1] * y1[p]) * x0[t]
        ubar += lam[2]
        lam = [g0[p] + lam[0] * x0[t] * w, g1[p] + lam[1] * x0[t] * w, g2[p] + lam[2]]
    for k in range(3):
        bars[k][order[0]] = lam[k]
    return [torch.tensor(b, dtype=torch.float64) for b in bars], wbar, ubar


FEW_LANE_THREADS = (1, 2, 3)
# The oracle's gradients of a (shape, dim, reverse) case, kept until every thread count has
# taken them: each scans the same inputs, and the loop over every lane (up to 400000 steps
# of Python floats) cost more than the kernel's runs.
_FEW_LANE_ORACLES: dict[tuple, list] = {}


def _few_lane_oracle(xs, w, u, cots, dim: int, reverse: bool):
    """Per lane of ``xs`` along ``dim``: the adjoint's gradients; then w's and u's sums."""
    key = (tuple(xs[0].shape), dim, reverse)
    found = _FEW_LANE_ORACLES.setdefault(key, [None, 0])
    if found[0] is None:
        T = xs[0].shape[dim]
        rows = [x.detach().movedim(dim, 0).reshape(T, -1) for x in xs]
        crows = [c.movedim(dim, 0).reshape(T, -1) for c in cots]
        lanes, wbar, ubar = [], 0.0, 0.0
        for lane in range(rows[0].shape[1]):
            pick = lambda ts: [t[:, lane] for t in ts]
            bars, wb, ub = _gate_adjoint(pick(rows), w.item(), u.item(), pick(crows), reverse)
            lanes.append(bars)
            wbar, ubar = wbar + wb, ubar + ub
        found[0] = (lanes, wbar, ubar)
    found[1] += 1
    if found[1] == len(FEW_LANE_THREADS):
        del _FEW_LANE_ORACLES[key]
    return found[0]


@needs_compiler
@pytest.mark.parametrize("threads", FEW_LANE_THREADS)
@pytest.mark.parametrize(
    ("shape", "dim"), [((70001,), 0), ((3, 20001), 1), ((9001, 16), 0), ((2, 8193, 24), 1)]
)
def test_few_lane_backward_is_chunked_and_matches_the_oracle(shape, dim, threads):
    # Chunks of >= 2048 steps, carries fixed up: float64 vs a sequential oracle, both
    # directions, captured scalars' gradients summed per chunk. Chains (8 interleaved per
    # thread), and the lane path where its columns are fewer than the threads.
    gen = torch.Generator().manual_seed(5)
    w = torch.tensor(0.9999, dtype=torch.float64, requires_grad=True)
    u = torch.tensor(0.25, dtype=torch.float64, requires_grad=True)
    xs = _gate_inputs(shape, gen, torch.float64)
    for reverse in (False, True):
        cots = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3)]
        got = _gate_grads(xs, w, u, dim, reverse, cots, threads)
        lanes, wbar, ubar = _few_lane_oracle(xs, w, u, cots, dim, reverse)
        for lane, bars in enumerate(lanes):
            for k in range(3):
                lane_got = got[k].movedim(dim, 0).reshape(shape[dim], -1)[:, lane]
                torch.testing.assert_close(lane_got, bars[k], rtol=1e-10, atol=1e-9)
        torch.testing.assert_close(got[3].item(), wbar, rtol=1e-10, atol=1e-9)
        torch.testing.assert_close(got[4].item(), ubar, rtol=1e-10, atol=1e-9)


@needs_compiler
def test_captured_tensor_not_needing_grad_beside_one_that_does():
    w = torch.rand(4, dtype=torch.float64, requires_grad=True)
    v = torch.rand(4, dtype=torch.float64)  # read, not differentiated
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    fn = lambda a, b: a * w + b * v
    _through_kernel(fn, x, 0, False)
    f = lambda x, w: fscan.associative_scan(fn, x, 0)
    assert torch.autograd.gradcheck(f, (x, w))
    # Only the captured tensor needs grad (the leaves do not): still the kernel.
    y = _through_kernel(fn, x.detach(), 0, False)[0]
    (gw,) = torch.autograd.grad(y.sum(), w)
    (rw,) = _oracle_grads(fn, x.detach(), 0, False, (w,), torch.ones(7, 4, dtype=torch.float64))
    torch.testing.assert_close(gw, rw)


@needs_compiler
def test_captured_gradients_second_order_take_the_adjoint_scan():
    w = torch.rand(4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    fn = lambda a, b: a * w + b
    _through_kernel(fn, x, 0, False)
    f = lambda x, w: fscan.associative_scan(fn, x, 0)
    assert torch.autograd.gradgradcheck(f, (x, w))


# --- drop-ins -------------------------------------------------------------------------


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    ("op", "torch_op", "dtype"),
    [
        (fscan.cumsum, torch.cumsum, torch.float32),
        (fscan.cumsum, torch.cumsum, torch.int64),
        (fscan.cumprod, torch.cumprod, torch.float64),
        (fscan.logcumsumexp, torch.logcumsumexp, torch.float32),
        (fscan.cummax, torch.cummax, torch.float32),
        (fscan.cummin, torch.cummin, torch.int32),
    ],
)
def test_drop_ins_ride_on_the_kernel(op, torch_op, dtype, reverse):
    from fscan._routing import cumulative as router

    x = torch.randn(300, 128) if dtype.is_floating_point else torch.randint(-9, 9, (300, 128))
    x = x.to(dtype) if dtype != torch.float64 else (1 + torch.rand(300, 128) * 1e-3).double()
    assert router.route(torch_op, x, 0, reverse)[0]
    with torch.no_grad():
        out = op(x, 0, reverse=reverse)
    assert router.path(torch_op, x, 0, reverse) == "cpp"
    if torch_op in (torch.cummax, torch.cummin):
        assert type(out) is type(torch_op(x, 0))
        values, indices = router.native(torch_op, x, 0, reverse)
        assert torch.equal(out.values, values) and torch.equal(out.indices, indices)
        return
    flip = (lambda t: t.flip(0)) if reverse else (lambda t: t)
    ref = flip(torch_op(flip(x), 0))
    if dtype.is_floating_point:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(out, ref)


def _ties_and_nans(shape, dtype, gen):
    """Few distinct values (many ties); NaN and +-inf sprinkled into floats."""
    x = torch.randint(-3, 4, shape, generator=gen)
    if dtype == torch.bool:
        return x > 0
    x = x.to(dtype)
    if dtype.is_floating_point and x.numel():
        special = torch.rand(shape, generator=gen)
        x[special < 0.02] = float("nan")
        x[(special > 0.02) & (special < 0.04)] = float("inf")
        x[(special > 0.04) & (special < 0.06)] = float("-inf")
    return x


@needs_compiler
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    op=st.sampled_from([torch.cummax, torch.cummin]),
    dtype=st.sampled_from([torch.float32, torch.int32, torch.bool]),
    length=st.one_of(st.integers(1, 40), st.sampled_from([2047, 2049, 4113, 5000])),
    other=st.sampled_from([1, 3, 8, 17]),
    dim=st.integers(0, 1),
    reverse=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
    seed=st.integers(0, 2**16),
)
def test_cummax_cummin_kernel_indices_and_ties_match_torch(
    op, dtype, length, other, dim, reverse, threads, seed
):
    """The kernel's (value, index) scan, indices made from positions: torch's ties (the
    later index; the earlier one in reverse), NaN sticking, over chunked 1-D scans too."""
    from fscan._routing import cumulative as router

    shape = [other, other]
    shape[dim] = length
    x = _ties_and_nans(tuple(shape), dtype, torch.Generator().manual_seed(seed))
    combine, spec, leaves, positions = router.kernel_call(op, x)
    with num_threads(threads), torch.no_grad():
        out = kernel_scan("test", combine, spec, leaves, dim, reverse, positions=positions)
    assert out is not None
    values, indices = router.native(op, x, dim, reverse)
    torch.testing.assert_close(out[0], values, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(out[1], indices)


@needs_compiler
def test_position_leaves_key_their_own_kernel():
    """The same combine over the same leaves, with and without a position leaf: two
    kernels (the slot key holds the positions), each with its own result."""
    from fscan._routing import cumulative as router

    x = torch.tensor([1.0, 3.0, 3.0, 2.0])
    given = torch.tensor([7, 8, 9, 10])
    combine, spec, _, _ = router.kernel_call(torch.cummax, x)
    with torch.no_grad():
        made = kernel_scan("t", combine, spec, [x, given], 0, False, positions=(1,))
        read = kernel_scan("t", combine, spec, [x, given], 0, False)
    assert made[1].tolist() == [0, 1, 2, 2] and read[1].tolist() == [7, 8, 9, 9]


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
def test_linear_recurrence_rides_on_the_kernel(reverse, monkeypatch):
    from fscan._routing import recurrence as _router

    a, b = torch.rand(600, 64, dtype=torch.float64), torch.randn(600, 64, dtype=torch.float64)
    reset = torch.rand(600) < 0.05
    with torch.no_grad():
        assert _router.kernel_solve(a, b, 0, reverse) is not None
        out = fscan.linear_recurrence(a, b, 0, reverse=reverse)
        out_reset = fscan.linear_recurrence(a, b, 0, reverse=reverse, reset=reset)
        monkeypatch.setattr(_router, "kernel_solve", lambda *args: None)
        ref = fscan.linear_recurrence(a, b, 0, reverse=reverse)
        ref_reset = fscan.linear_recurrence(a, b, 0, reverse=reverse, reset=reset)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(out_reset, ref_reset)


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize(
    "gate", [(600, 1), (1, 64), (64,), ()], ids=["(T,1)", "(1,C)", "(C,)", "0-d"]
)
def test_linear_recurrence_reads_broadcast_gates_in_place(gate, reverse, monkeypatch):
    """A gate that broadcasts to b rides on the kernel as a stride-0 view (no size
    limit, no copy) and equals the walk's result; its inputs are left as they were."""
    from fscan._routing import recurrence as _router

    a = torch.rand(gate, dtype=torch.float64) * 0.5 + 0.5
    b = torch.randn(600, 64, dtype=torch.float64)
    before_a, before_b = a.clone(), b.clone()
    served = []
    solve = _router.kernel_solve
    monkeypatch.setattr(
        _router, "kernel_solve", lambda *args: served.append(solve(*args)) or served[-1]
    )
    copies = _copies()
    with torch.no_grad():
        out = fscan.linear_recurrence(a, b, 0, reverse=reverse)
    assert served and served[-1] is not None and _copies() == copies
    monkeypatch.setattr(_router, "kernel_solve", lambda *args: None)
    with torch.no_grad():
        ref = fscan.linear_recurrence(a, b, 0, reverse=reverse)
    torch.testing.assert_close(out, ref)
    _assert_fresh([out], [a, b])
    assert torch.equal(a, before_a) and torch.equal(b, before_b)


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("gate", [(600, 64), (1, 64)], ids=["dense", "(1,C)"])
def test_linear_recurrence_initial_is_the_kernels_carry_in(gate, reverse, monkeypatch):
    """initial= rides on the kernel (its carry-in: no copy of the leaves) and equals the
    walk's result; with gradients wanted it takes the walk, which carries them."""
    from fscan._routing import recurrence as _router

    a = torch.rand(gate, dtype=torch.float64) * 0.5 + 0.5
    b = torch.randn(600, 64, dtype=torch.float64)
    h0 = torch.randn(64, dtype=torch.float64)
    served = []
    solve = _router.kernel_solve
    monkeypatch.setattr(
        _router, "kernel_solve", lambda *args: served.append(solve(*args)) or served[-1]
    )
    with torch.no_grad():
        out = fscan.linear_recurrence(a, b, 0, reverse=reverse, initial=h0)
    assert served[-1] is not None
    grad_h0 = h0.clone().requires_grad_()
    fscan.linear_recurrence(a, b, 0, reverse=reverse, initial=grad_h0).sum().backward()
    monkeypatch.setattr(_router, "kernel_solve", lambda *args: None)
    walk_h0 = h0.clone().requires_grad_()
    ref = fscan.linear_recurrence(a, b, 0, reverse=reverse, initial=walk_h0)
    ref.sum().backward()
    torch.testing.assert_close(out, ref.detach())
    torch.testing.assert_close(grad_h0.grad, walk_h0.grad)


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
def test_linear_recurrence_backward_adjoint_rides_on_the_carry_in(reverse, monkeypatch):
    """The backward's adjoint recurrence starts from a carried-in state (the last
    cotangent): it now runs on the kernel's carry-in, with the walk's gradients. (Only
    ``b`` wants a gradient here: with the gates' too, the one-pass backward kernel
    serves instead, see tests/test_kernel_grad.py.)"""
    from fscan._routing import recurrence as _router

    def grads(kernel: bool):
        gen, d = torch.Generator().manual_seed(1), torch.float64
        a = torch.rand(600, 64, generator=gen, dtype=d) * 0.5 + 0.5
        b = torch.randn(600, 64, generator=gen, dtype=d).requires_grad_()
        w = torch.randn(600, 64, generator=gen, dtype=d)
        served.clear()
        if not kernel:
            monkeypatch.setattr(_router, "kernel_solve", lambda *args: None)
        (fscan.linear_recurrence(a, b, 0, reverse=reverse) * w).sum().backward()
        return b.grad

    served: list[bool] = []
    solve = _router.kernel_solve

    def spy(a, b, dim, reverse, initial=None, out=None):
        h = solve(a, b, dim, reverse, initial, out)
        served.append(initial is not None and h is not None)  # a carried-in adjoint
        return h

    monkeypatch.setattr(_router, "kernel_solve", spy)
    got = grads(True)
    assert any(served), "the adjoint did not run on the kernel's carry-in"
    ref = grads(False)
    torch.testing.assert_close(got, ref)


# --- latency machinery ------------------------------------------------------------------


@needs_compiler
def test_background_build_then_switch(monkeypatch):
    import time

    monkeypatch.setattr(_kernel_registry, "MIN_CALLS", 1)
    _, spec = optree.tree_flatten(0)
    x = torch.randn(40, 8, dtype=torch.float64)
    fn = lambda a, b: a - b * 0.5  # a key no other test built
    with fscan.config.override(cpu_kernel="on"), torch.no_grad():
        # Queued: torch answers. (With a warm disk cache the worker may load the kernel
        # before this call returns, on a loaded machine: then it serves at once.)
        out = kernel_scan("test", fn, spec, [x], 0, False)
        deadline = time.monotonic() + 300
        while out is None and time.monotonic() < deadline:
            time.sleep(0.05)
            out = kernel_scan("test", fn, spec, [x], 0, False)
    assert out is not None, "the background build never finished"
    assert_close_to(out, oracle(fn, x, 0, False), "background")


@needs_compiler
def test_mode_on_switches_public_scans_to_the_kernel_once_built(monkeypatch):
    """The default mode as users meet it, through ``fscan.associative_scan``: fscan's
    torch engine answers while the kernel builds in the background, then the kernel
    does, with the same results on both sides of the switch (gradients too)."""
    import time

    runs = []
    run_kernel = cpu_kernel.run_kernel
    monkeypatch.setattr(cpu_kernel, "run_kernel", lambda *args: runs.append(1) or run_kernel(*args))
    fscan.clear_caches()  # a fresh kernel entry: its build starts in this test
    a = torch.rand(40, 8, dtype=torch.float64) * 0.5 + 0.5
    b = torch.randn(40, 8, dtype=torch.float64)
    leaves, spec = optree.tree_flatten((a, b))
    want = oracle(linrec, (a, b), 0, False)
    answers = {"torch": 0, "kernel": 0}
    with fscan.config.override(cpu_kernel="on"), torch.no_grad():
        deadline = time.monotonic() + 300
        while not answers["kernel"] and time.monotonic() < deadline:
            before = len(runs)
            assert_close_to(fscan.associative_scan(linrec, (a, b), 0), want, "on")
            answers["kernel" if len(runs) > before else "torch"] += 1
            time.sleep(0.02)
        assert cpu_kernel.kernel_ready(linrec, spec, leaves, 0)
    assert answers["kernel"], "the background build never finished"
    assert answers["torch"], "the first call waited for a build"
    # A call with gradients meets a backward kernel not built yet: the torch engine answers.
    with fscan.config.override(cpu_kernel="on"):
        x = a.clone().requires_grad_()
        (g,) = torch.autograd.grad(fscan.associative_scan(linrec, (x, b), 0)[1].sum(), x)
    (w,) = torch.autograd.grad(sequential_scan(linrec, (x, b), 0)[1].sum(), x)
    torch.testing.assert_close(g, w)


def test_fork_hook_requeues_pending_builds():
    from fscan._knowledge import store as _knowledge

    holder = _knowledge.Knowledge()
    pending = cpu_kernel.Entry(state=State.PENDING)
    cpu_kernel.kernel_slots(holder).put(((), (), False), pending)
    _knowledge.entries.put(("fork test",), holder)
    old_worker = _kernel_builder.worker
    _kernel_builder._after_fork_in_child()
    assert pending.state is State.NEW and _kernel_builder.worker is not old_worker


@needs_compiler
def test_within_element_indexing_is_traced_per_element_shape():
    _, spec = optree.tree_flatten(0)
    for fn in (lambda a, b: torch.maximum(a[..., :1], b), lambda a, b: a[..., -1:] + b):
        for width in (1, 3):  # [..., -1:] covers all of 1 (traced as an alias), not of 3
            x = torch.randn(20, width, dtype=torch.float64)
            with torch.no_grad():
                out = kernel_scan("test", fn, spec, [x], 0, False)
            ref = oracle(fn, x, 0, False)
            assert out is None or torch.allclose(out[0], ref[0]), (fn, width)


@needs_compiler
@pytest.mark.parametrize("fn", [cmax, add], ids=["max", "add"])
def test_float32_backward_sums_cotangents_in_double(fn):
    """The gradient of the first element of a constant-max (or sum) chain is the sum of
    all cotangents: the backward kernel accumulates it in double (float32 summation of
    2**18 terms is ~1e-5 off), even where the VJP itself computes in float (max)."""
    x = torch.full((2**18,), -1.0)
    x[0] = 5.0
    x.requires_grad_()
    g = torch.rand(2**18, generator=torch.Generator().manual_seed(0))
    y = fscan.associative_scan(fn, x, 0)
    assert type(y.grad_fn).__name__ == "KernelScanBackward"
    (gx,) = torch.autograd.grad(y, x, g)
    exact = g.double().sum().item()
    assert abs(gx[0].item() - exact) <= 1e-6 * exact


@needs_compiler
@pytest.mark.parametrize("element", [(3,), ()])
def test_aliasing_of_captured_tensors_keys_the_kernel(element):
    # Two cells holding one tensor, then two tensors: a kernel traced for the first must
    # not serve the second (it would read one tensor for both).
    make = lambda v, u: lambda a, b: a + b + (v - u)  # associative: adds i * (v - u)
    x = torch.randn(40, *element, dtype=torch.float64)
    w, other = torch.rand(element, dtype=torch.float64), torch.rand(element, dtype=torch.float64)
    with torch.no_grad():
        for v, u in ((w, w), (w, other), (w, w)):
            fn = make(v, u)
            for _ in range(2):  # the second call is the cached one
                out = fscan.associative_scan(fn, x, 0)
            assert_close_to([out], oracle(fn, x, 0, False), "aliasing")


@needs_compiler
def test_cached_calls_notice_what_changed():
    make = lambda k, w: lambda a, b: a + b + k * w  # associative: adds i * k * w
    w = torch.rand(5)
    x = torch.randn(30, 5)
    with torch.no_grad():
        for k in (0.25, 0.5):  # a number in a closure cell: part of the kernel's key
            fn = make(k, w)
            for _ in range(2):
                out = fscan.associative_scan(fn, x, 0)
            assert_close_to([out], oracle(fn, x, 0, False), "cell")
        w.mul_(2.0)  # a captured tensor changed in place: read at every call
        out = fscan.associative_scan(fn, x, 0)
        assert_close_to([out], oracle(fn, x, 0, False), "captured in place")
        x64 = x.double()  # another dtype: another kernel
        out = fscan.associative_scan(fn, x64, 0)
        assert out.dtype == torch.float64
        assert_close_to([out], oracle(fn, x64, 0, False), "dtype")
    leaf = x.clone().requires_grad_()  # gradients wanted: the differentiable route
    out = fscan.associative_scan(fn, leaf, 0)
    assert out.requires_grad
    (g,) = torch.autograd.grad(out.sum(), [leaf])
    (ref,) = torch.autograd.grad(oracle(fn, leaf, 0, False)[0].sum(), [leaf])
    torch.testing.assert_close(g, ref.float())


def test_a_plain_tensor_is_still_checked_like_a_pytree():
    import numpy as np

    x = torch.randn(8)
    torch.testing.assert_close(fscan.associative_scan(add, x, np.int64(-1)), x.cumsum(0))
    with pytest.raises(fscan.ScanTypeError, match="`dim` must be an int, got bool True"):
        fscan.associative_scan(add, x, True)
    with pytest.raises(fscan.ScanIndexError, match="`dim` 1 is out of range for leaf xs"):
        fscan.associative_scan(add, x, 1)
    out = fscan.associative_scan(add, x, 0)
    assert out is not x and out.data_ptr() != x.data_ptr()


def test_a_waiting_build_leaves_the_toolchain_warm(monkeypatch):
    """An eager build finishes the toolchain warm-up itself: the next call in mode "on"
    runs the kernel, rather than restart the warm-up in the background and answer with
    the torch engine meanwhile (which made benchmarks time a busy core)."""
    monkeypatch.setattr(_kernel_builder, "warm", threading.Event())  # as in a fresh process
    leaves, spec = optree.tree_flatten(torch.arange(64.0))
    with torch.no_grad():
        with fscan.config.override(cpu_kernel="eager"):
            assert kernel_scan("t", torch.add, spec, leaves, 0, False) is not None
        assert _kernel_builder.warm.is_set()
        with fscan.config.override(cpu_kernel="on"):
            assert kernel_scan("t", torch.add, spec, leaves, 0, False) is not None


@needs_compiler
def test_threads_caps_the_kernel_threads():
    """``threads=1`` runs the scan as a one-thread process does, bit for bit (the chunking
    of a 1-D scan, and so its float64 rounding, follows the thread count)."""
    x = torch.randn(2**17, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    leaves, spec = optree.tree_flatten(x)
    with torch.no_grad():
        with num_threads(1):
            (alone,) = kernel_scan("t", torch.add, spec, leaves, 0, False)
        with num_threads(2):
            (capped,) = kernel_scan("t", torch.add, spec, leaves, 0, False, threads=1)
            (two,) = kernel_scan("t", torch.add, spec, leaves, 0, False)
    assert torch.equal(capped, alone)
    assert not torch.equal(two, alone)  # the thread count shows: the check above can fail


# --- strided inputs: read in place ------------------------------------------------------


def _layouts(gen: torch.Generator) -> dict[str, tuple[torch.Tensor, int]]:
    """Views of float64 memory and the dim to scan: each fits the kernels' strided view."""
    d = torch.float64

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=d)

    return {
        "transpose": (rand(12, 50).t(), 0),  # T stride 1: the chain path
        "step slice": (rand(50, 24)[:, ::2], 0),  # inner stride 2: gathered rows
        "slice along T": (rand(100, 12)[1::2], 0),  # T stride 24, storage offset
        "broadcast lanes": (rand(50, 1).expand(50, 12), 0),  # inner stride 0
        "broadcast steps": (rand(1, 12).expand(50, 12), 0),  # T stride 0
        "scalar broadcast": (rand(()).expand(50, 12), 0),
        "(B, C, T) of (B, T, C)": (rand(3, 50, 4).transpose(1, 2), -1),  # outer in 2 groups
        "channels_last, C": (rand(2, 5, 3, 4).to(memory_format=torch.channels_last), 1),
        "channels_last, H": (rand(2, 5, 3, 4).to(memory_format=torch.channels_last), -2),
        "1-D step": (rand(150)[::3], 0),
        "offset 2-D": (rand(60, 20)[5:55, 3:15], 0),
    }


def _copies() -> int:
    return cpu_kernel.counters.copies


def _assert_fresh(outs, inputs) -> None:
    """Outputs are contiguous and share no memory with the inputs."""
    mine = {x.untyped_storage().data_ptr() for x in inputs}
    for out in outs:
        assert out.is_contiguous() and out.untyped_storage().data_ptr() not in mine


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "layout",
    list(_layouts(torch.Generator())),
)
def test_strided_leaves_are_read_in_place(layout, threads):
    """A view the kernel can describe runs without a copy (the counter says so), with
    the oracle's and the torch engine's results, both directions; and as the gate of a
    linear recurrence beside a contiguous leaf in one pytree."""
    gen = torch.Generator().manual_seed(7)
    x, dim = _layouts(gen)[layout]
    b = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    before_x, before_b = x.clone(), b.clone()
    with num_threads(threads):
        for reverse in (False, True):
            copies = _copies()
            (out,) = run_kernel("add", x, dim, reverse)
            with torch.no_grad():
                pair = kernel_scan("t", linrec, *_flat((x, b)), dim, reverse)
            assert _copies() == copies, f"{layout}: a leaf was copied"
            assert_close_to([out], oracle(add, x, dim, reverse), layout)
            assert_close_to(pair, oracle(linrec, (x, b), dim, reverse), layout)
            with fscan.config.override(cpu_kernel="off"), torch.no_grad():
                ref = fscan.associative_scan(add, x, dim, reverse=reverse)
            torch.testing.assert_close(out, ref)
            _assert_fresh([out, *pair], [x, b])
    assert torch.equal(x, before_x) and torch.equal(b, before_b)


def _flat(xs):
    leaves, spec = optree.tree_flatten(xs)
    return spec, leaves


@needs_compiler
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(
    ("make", "dim"),
    [
        (lambda g: torch.randn(3, 9001, generator=g, dtype=torch.float64).t(), 0),
        (lambda g: torch.randn(5000, 32, generator=g, dtype=torch.float64)[:, ::2], 0),
        (lambda g: torch.randn(9001, 1, generator=g, dtype=torch.float64).expand(9001, 16), 0),
    ],
    ids=["transpose chained", "step slice chunked", "broadcast chunked"],
)
def test_long_strided_scans_split_steps_without_a_copy(make, dim, threads):
    """Strided leaves through the reduce-then-scan paths (chunks of >= 2048 steps)."""
    x = make(torch.Generator().manual_seed(8))
    with num_threads(threads):
        for reverse in (False, True):
            copies = _copies()
            (out,) = run_kernel("add", x, dim, reverse)
            assert _copies() == copies
            ref = x.flip(dim).cumsum(dim).flip(dim) if reverse else x.cumsum(dim)
            torch.testing.assert_close(out, ref)


@needs_compiler
def test_views_that_do_not_collapse_are_copied():
    """Three outer groups (channels_last scanned over W) or two inner ones: copied (and
    counted), with the same results; a contiguous leaf beside them is not copied."""
    gen = torch.Generator().manual_seed(9)
    cl = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    cl = cl.to(memory_format=torch.channels_last)
    inner2 = torch.randn(6, 5, 4, generator=gen, dtype=torch.float64).transpose(1, 2)
    for x, dim, copied in ((cl, 3, 1), (inner2, 0, 1)):
        copies = _copies()
        (out,) = run_kernel("add", x, dim, False)
        assert _copies() - copies == copied
        assert_close_to([out], oracle(add, x, dim, False), "copied")
        with torch.no_grad():
            pair = kernel_scan("t", linrec, *_flat((x, x.contiguous())), dim, False)
        assert _copies() - copies == 2 * copied
        assert_close_to(pair, oracle(linrec, (x, x.contiguous()), dim, False), "copied")


def test_strided_view_groups_and_copies():
    """The (outer // nb, nb, T, inner) strides of a few layouts; where the leaves' outer
    groups disagree in more than one place, the split ones are copied."""
    x = torch.zeros(2, 3, 4, 5)
    xs, nb, strides = cpu_kernel.strided_view([x], 2)
    assert (nb, strides) == (1, [20, 0, 5, 1]) and xs[0] is x
    t = torch.zeros(4, 3, 5).permute(1, 0, 2)  # (3, 4, 5), strides (5, 15, 1)
    xs, nb, strides = cpu_kernel.strided_view([t, torch.zeros(3, 4, 5)], 2)
    assert nb == 4 and strides == [5, 15, 1, 1, 20, 5, 1, 1] and xs[0] is t
    e = torch.zeros(4, 1).expand(4, 6)
    assert cpu_kernel.strided_view([e], 0)[1:] == (1, [0, 0, 1, 0])
    copies = _copies()
    wild = torch.zeros(2, 3, 4, 5).permute(1, 0, 3, 2)  # outer (3, 2, 5): two splits
    xs, nb, strides = cpu_kernel.strided_view([wild], 3)
    assert _copies() == copies + 1 and xs[0].is_contiguous() and nb == 1
    assert torch.equal(xs[0], wild)


@needs_compiler
@pytest.mark.parametrize("layout", ["transpose", "broadcast gate", "step slice"])
def test_strided_leaves_gradcheck_through_the_kernel(layout):
    """float64 gradcheck with leaves that reach both kernels as views (no copies), and the
    cotangent of ``.sum()`` (an expanded scalar) read in place against the oracle."""
    gen = torch.Generator().manual_seed(10)
    d = torch.float64
    if layout == "transpose":
        params = (torch.rand(5, 7, generator=gen, dtype=d) + 0.5, torch.randn(5, 7, dtype=d))
        views = lambda a, b: (a.t(), b.t())
    elif layout == "broadcast gate":
        params = (torch.rand(7, 1, generator=gen, dtype=d) + 0.5, torch.randn(7, 5, dtype=d))
        views = lambda a, b: (a.expand(7, 5), b)
    else:
        params = (torch.rand(7, 10, generator=gen, dtype=d) + 0.5, torch.randn(7, 10, dtype=d))
        views = lambda a, b: (a[:, ::2], b[:, 1::2])
    params = tuple(p.requires_grad_() for p in params)
    for reverse in (False, True):
        f = lambda *ps: fscan.associative_scan(linrec, views(*ps), 0, reverse)
        _through_kernel(linrec, views(*params), 0, reverse)
        assert torch.autograd.gradcheck(f, params)
        copies = _copies()
        got = torch.autograd.grad(f(*params)[1].sum(), params)
        assert _copies() == copies
        wide = oracle(linrec, views(*params), 0, reverse)[1].sum()
        want = torch.autograd.grad(wide, params)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@needs_compiler
@pytest.mark.parametrize("shape,dim", [((300, 24), 0), ((5000,), 0), ((4, 2100), 1)])
def test_expanded_cotangents_are_read_in_place(shape, dim):
    """``y.sum()`` gives a stride-0 cotangent (and ``(y * w).sum()`` a dense one): no
    copy, the torch engine's gradients (lane path, chunked chains, and a scan over the
    last dim)."""
    a = (torch.rand(shape) * 0.5 + 0.5).requires_grad_()
    b = torch.randn(shape, requires_grad=True)
    w = torch.linspace(0, 1, shape[-1])
    losses = {"sum": lambda y: y.sum(), "weighted": lambda y: (y * w).sum()}
    for name, loss in losses.items():
        grads, engines = [], []
        for mode in ("eager", "off"):
            with fscan.config.override(cpu_kernel=mode):
                out = [fscan.associative_scan(linrec, (a, b), dim, True) for _ in range(2)][-1]
                engines.append(type(out[0].grad_fn).__name__)
                copies = _copies()
                grads.append(torch.autograd.grad(loss(out[1]), (a, b)))
                assert mode == "off" or _copies() == copies, name
        assert engines == ["KernelScanBackward", "PointwiseScanBackward"]
        for k, r in zip(*grads):
            torch.testing.assert_close(k, r, rtol=1e-4, atol=1e-4)


@needs_compiler
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    data=st.data(),
    reverse=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
)
def test_random_views_match_the_oracle(sizes, data, reverse, threads):
    """Random permutations, step slices and broadcasts of float64 memory, any dim (negative
    too): the oracle's results, inputs untouched, fresh outputs (copied or not)."""
    ndim = len(sizes)
    steps = data.draw(st.lists(st.integers(1, 3), min_size=ndim, max_size=ndim))
    base = torch.randn([n * s for n, s in zip(sizes, steps)], dtype=torch.float64)
    x = base[tuple(slice(None, None, s) for s in steps)]
    x = x.permute(data.draw(st.permutations(range(ndim))))
    grow = data.draw(st.integers(-1, ndim - 1))  # a size-1 dim to broadcast, or none
    if grow >= 0 and x.shape[grow] == 1:
        x = x.expand(*[9 if d == grow else n for d, n in enumerate(x.shape)])
    dim = data.draw(st.integers(-ndim, ndim - 1))
    before = x.clone()
    with num_threads(threads):
        (out,) = run_kernel("add", x, dim, reverse)
        with torch.no_grad():
            pair = kernel_scan("t", linrec, *_flat((x, x.flip(dim))), dim, reverse)
    assert_close_to([out], oracle(add, x, dim, reverse), "view")
    assert_close_to(pair, oracle(linrec, (x, x.flip(dim)), dim, reverse), "view pair")
    assert torch.equal(x, before)
    _assert_fresh([out, *pair], [x])


@needs_compiler
@pytest.mark.parametrize("reverse", [False, True])
def test_position_leaves_beside_strided_values(reverse):
    """cummax's (value, index) scan with the values a view (the chain path for a
    transpose, gathered rows for a step slice): indices are positions along dim."""
    from fscan._routing import cumulative as router

    gen = torch.Generator().manual_seed(11)
    for x in (
        torch.randint(-3, 4, (12, 2100), generator=gen).float().t(),
        torch.randint(-3, 4, (60, 40), generator=gen).float()[:, ::2],
    ):
        combine, spec, leaves, positions = router.kernel_call(torch.cummax, x)
        copies = _copies()
        with torch.no_grad():
            out = kernel_scan("t", combine, spec, leaves, 0, reverse, positions=positions)
        assert out is not None and _copies() == copies
        values, indices = router.native(torch.cummax, x, 0, reverse)
        assert torch.equal(out[0], values) and torch.equal(out[1], indices)


# --- outputs the caller drops (keep=) -----------------------------------------------------


def argmax(x, y):  # (value, its index): the kept index reads the dropped values' left side
    return torch.maximum(x[0], y[0]), torch.where(y[0] > x[0], y[1], x[1])


# Combines with a dropped output each, compiled once per run: the pair keeps h only (as
# fscan.linear_recurrence does: the gate products are dead), the mixed dict drops its
# middle leaf ("h", float16: dead), argmax keeps the index (the values stay live).
KEEPS = {"linrec": (False, True), "mixed": (True, False, True), "argmax": (False, True)}


def _keep_fn(name: str):
    return argmax if name == "argmax" else COMBINES[name][0]


def _keep_leaves(name: str, shape: tuple[int, ...], gen: torch.Generator):
    if name == "argmax":
        return (torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
    return _leaves(name, shape, gen)


def test_dead_leaves_are_those_no_kept_output_needs():
    from fscan._engines.cpp._cpp_codegen import TraceInput, translate_combine
    from fscan._engines.cpp._cpp_structs import needed

    f32 = [torch.float32] * 2
    spec = optree.tree_structure((0, 0))
    pair = translate_combine(TraceInput(linrec, spec, f32, (), ()))
    arg = translate_combine(TraceInput(argmax, spec, f32, (), ()))
    assert needed(pair, 2, (0,)) == [1] and needed(pair, 2, (1,)) == [0]
    assert needed(arg, 2, (0,)) == [0, 1] and needed(arg, 2, (1,)) == [0]
    assert needed(pair, 2, ()) == [0, 1]


def _kept_scan(name: str, xs, dim: int, reverse: bool, threads: int | None = None):
    fn = _keep_fn(name)
    spec, leaves = _flat(xs)
    with torch.no_grad():
        out = kernel_scan("test", fn, spec, leaves, dim, reverse, threads=threads, keep=KEEPS[name])
    assert out is not None, f"the kernel did not serve {name} with keep="
    return out


def _check_kept(name: str, xs, dim: int, reverse: bool, threads: int) -> None:
    """Dropped outputs are None; kept ones equal the oracle's and the torch engine's,
    fresh and contiguous; the inputs are left as they were."""
    leaves = optree.tree_leaves(xs)
    before = [x.clone() for x in leaves]
    out = _kept_scan(name, xs, dim, reverse, threads)
    ref = oracle(_keep_fn(name), xs, dim, reverse)
    with fscan.config.override(cpu_kernel="off"), torch.no_grad():
        engine = optree.tree_leaves(
            fscan.associative_scan(_keep_fn(name), xs, dim, reverse=reverse)
        )
    kept = [k for k, keep in enumerate(KEEPS[name]) if keep]
    assert [k for k, o in enumerate(out) if o is not None] == kept
    assert_close_to([out[k] for k in kept], [ref[k] for k in kept], name)
    assert_close_to([out[k] for k in kept], [engine[k] for k in kept], name)
    _assert_fresh([out[k] for k in kept], leaves)
    assert all(torch.equal(x, b) for x, b in zip(leaves, before))


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", sorted(KEEPS))
@pytest.mark.parametrize(
    ("shape", "dim"),
    [
        ((1,), 0),
        ((5000,), 0),  # the chain path, split in chunks (2 threads)
        ((2049, 3), 0),  # chains over few lanes, chunk boundary
        ((7, 40), 0),  # the lane path
        ((4113, 17), 0),  # lanes, chunked on 2 threads
        ((3, 40, 9), 1),
        ((3, 9, 40), -1),  # a scan over the last dim: chains
    ],
)
def test_kept_outputs_match_the_oracle(name, shape, dim, reverse, threads):
    xs = _keep_leaves(name, shape, torch.Generator().manual_seed(len(shape) * 1000 + shape[0]))
    _check_kept(name, xs, dim, reverse, threads)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "layout", ["transpose", "step slice", "broadcast lanes", "(B, C, T) of (B, T, C)"]
)
def test_kept_outputs_of_strided_leaves(layout, threads):
    """Strided inputs (the chain path for the transpose, gathered rows for the others)
    with a dropped output: the gate a view, h kept."""
    gen = torch.Generator().manual_seed(11)
    gate, dim = _layouts(gen)[layout]
    b = torch.randn(gate.shape, generator=gen, dtype=torch.float64)
    for reverse in (False, True):
        copies = _copies()
        _check_kept("linrec", (gate, b), dim, reverse, threads)
        assert _copies() == copies, f"{layout}: a leaf was copied"


@needs_compiler
def test_keep_is_part_of_the_kernel_key():
    """A kernel built to drop the gate products is not reused for a call that keeps
    both outputs (nor the other way): each pattern has its own entry and result."""
    gen = torch.Generator().manual_seed(3)
    d = torch.float64
    xs = (torch.rand(30, 5, generator=gen, dtype=d), torch.randn(30, 5, generator=gen, dtype=d))
    spec, leaves = _flat(xs)
    ref = oracle(linrec, xs, 0, False)
    with torch.no_grad():
        dropped = kernel_scan("t", linrec, spec, leaves, 0, False, keep=(False, True))
        both = kernel_scan("t", linrec, spec, leaves, 0, False)
        again = kernel_scan("t", linrec, spec, leaves, 0, False, keep=(False, True))
        explicit = kernel_scan("t", linrec, spec, leaves, 0, False, keep=(True, True))
    assert dropped is not None and both is not None and again is not None
    assert dropped[0] is None and again[0] is None
    assert both[0] is not None and explicit[0] is not None
    assert_close_to(both, ref, "both")
    assert_close_to(explicit, ref, "keep all")
    assert_close_to([dropped[1], again[1]], [ref[1], ref[1]], "dropped")
    holder = _holder_of(linrec, spec, leaves)
    # (the ordinary kernels: earlier tests of this combine may have built gather variants)
    kernels = cpu_kernel.kernel_entries(holder)
    sources = {e.source for e in kernels if not e.backward and not e.gather}
    assert len(sources) == 2  # keep=(True, True) is the default's kernel


def _holder_of(fn, spec, leaves):
    from fscan._knowledge.store import knowledge, reach

    return knowledge(reach(fn), spec, "pointwise", leaves)


def test_keep_must_name_each_leaf_and_keep_one():
    spec, leaves = _flat((torch.ones(4), torch.ones(4)))
    for keep in [(True,), (False, False), (True, True, True)]:
        with pytest.raises(ValueError, match="keep must hold one bool per leaf"):
            kernel_scan("t", linrec, spec, leaves, 0, False, keep=keep)


def test_the_benchmark_calls_the_bare_kernel_with_its_current_signature():
    """``python -m fscan`` and ``fscan.bench.kernel`` time the READY kernel through its own
    argument list; a kernel signature change must not break the main job."""
    from fscan.bench.kernel import _add, _bare_kernel, _linrec

    a, x = torch.rand(300, 8), torch.randn(300, 8)
    run = _bare_kernel(_add, x)
    assert run is not None
    torch.testing.assert_close(run()[0], x.cumsum(0))
    run = _bare_kernel(_linrec, (a, x))
    assert run is not None
    expected = oracle(_linrec, (a, x), 0, False)
    for got, want in zip(run(), optree.tree_leaves(expected)):
        torch.testing.assert_close(got, want.float())


def test_kernel_possible_is_keyed_on_mode_probe_and_lookup(monkeypatch):
    """The cached verdict follows each thing it depends on: the mode, the compiler probe
    and whether the toolchain lookup ran; an unknown answer (lookup to come) is not kept."""
    monkeypatch.setattr(_kernel_registry, "_verdicts", {})
    monkeypatch.setattr(_kernel_builder, "warm", threading.Event())  # as in a fresh process
    monkeypatch.setattr(_kernel_registry, "compiler_problem", lambda: "no compiler (test)")
    with fscan.config.override(cpu_kernel="on"):
        assert cpu_kernel.kernel_possible()  # not looked up yet: the checked path will
        assert not _kernel_registry._verdicts
        _kernel_builder.warm.set()
        assert not cpu_kernel.kernel_possible()
        monkeypatch.setattr(_kernel_registry, "compiler_problem", lambda: None)  # another probe
        assert cpu_kernel.kernel_possible()
        with fscan.config.override(cpu_kernel="off"):
            assert not cpu_kernel.kernel_possible()
        with fscan.config.override(cpu_kernel="eager"):
            assert cpu_kernel.kernel_possible()
        assert cpu_kernel.kernel_possible()
    assert len(_kernel_registry._verdicts) == 4  # (on, no compiler), (on), (off), (eager)


def test_clear_caches_clears_every_store_of_the_engine(monkeypatch):
    """fscan.clear_caches() empties the engine's process-level stores: the kernel entries
    (inside the knowledge entries), the kernel_possible verdicts, the reasons logged once
    and the C++ files read; the traced graphs compiled code refers to stay, bounded."""
    from fscan._knowledge import store as _knowledge

    monkeypatch.setattr(_kernel_registry, "_verdicts", {})
    monkeypatch.setattr(_kernel_entry, "_logged", set())
    with fscan.config.override(cpu_kernel="off"):
        cpu_kernel.kernel_possible()
    cpu_kernel.log_once("a reason (test)")
    _cpp_source.csrc("tuning.h")
    fscan.associative_scan(add, torch.ones(4), 0)
    assert _kernel_registry._verdicts and _kernel_entry._logged
    assert _cpp_source.csrc.cache_info().currsize and len(_knowledge.entries)
    fscan.clear_caches()
    assert not _kernel_registry._verdicts and not _kernel_entry._logged
    assert not _cpp_source.csrc.cache_info().currsize and not len(_knowledge.entries)
    assert traced_kernel._graphs.maxsize == traced_kernel.GRAPHS


def test_the_fixed_cpp_files_are_part_of_every_kernel_source():
    """The disk cache is keyed by the source text: it must hold the csrc files' text, so
    that editing one builds every kernel again."""
    from fscan._engines.cpp._cpp_codegen import TraceInput, translate_combine

    spec = optree.tree_structure(0)
    program = translate_combine(TraceInput(add, spec, [torch.float32], (), ()))
    forward = _cpp_source.forward_source([torch.float32], program)
    step = _cpp_source.step_source([torch.float32], program)
    names = ("prelude.h", "tuning.h", "forward_lanes.h", "chain_tiles.h", "forward_chains.h")
    for name in (*names, "forward.h"):
        assert _cpp_source.csrc(name) in forward
    assert _cpp_source.csrc("prelude.h") in step
    assert "$" not in forward + step  # every hole filled
