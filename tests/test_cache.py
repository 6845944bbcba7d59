"""Caches that cannot leak or race: BoundedCache, function_key, and the probe's cache
under 10,000 fresh lambdas and under concurrent scans from several threads."""

from __future__ import annotations

import gc
import os
import re
import sys
import threading
import weakref

import pytest
import torch
from helpers import cached_verdicts

import fscan
from fscan._cache import BoundedCache
from fscan._knowledge.store import entries


@pytest.fixture(autouse=True)
def fresh_verdicts():
    fscan.clear_caches()
    yield
    fscan.clear_caches()


# --- BoundedCache ------------------------------------------------------------------


def test_entry_not_used_lately_goes_first():
    cache = BoundedCache(maxsize=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "a" is now the most recent
    cache.put("c", 3)
    assert "b" not in cache and cache.get("a") == 1 and cache.get("c") == 3
    assert len(cache) == 2


def test_get_or_compute_computes_once():
    cache = BoundedCache(maxsize=4)
    calls = []
    compute = lambda: calls.append(1) or len(calls)
    assert [cache.get_or_compute("k", compute) for _ in range(3)] == [1, 1, 1]
    cache.clear()
    assert len(cache) == 0 and cache.get("k", "missing") == "missing"


def test_maxsize_must_be_positive():
    with pytest.raises(fscan.ScanValueError, match=re.escape("`maxsize` must be >= 1, got 0")):
        BoundedCache(maxsize=0)


def test_concurrent_get_or_compute_is_consistent_and_bounded():
    cache = BoundedCache(maxsize=16)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for i in range(2000):
                key = (seed * 7 + i) % 40
                assert cache.get_or_compute(key, lambda: key * key) == key * key
                assert len(cache) <= 16
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(cache) <= 16


# --- the probe's cache under fresh lambdas and threads ------------------------------


def test_ten_thousand_fresh_lambdas_keep_memory_flat():
    xs = torch.randn(2)  # one combine call per scan keeps 11,000 scans fast
    expected = torch.cumsum(xs, 0)

    def step(i: int) -> None:
        w = torch.zeros(1)  # a fresh capture each step, as inside a training step
        out = fscan.associative_scan(lambda a, b: a + b + w, xs, 0)
        if i % 1000 == 0:
            torch.testing.assert_close(out, expected)

    for i in range(500):  # warm up: first-call allocations, interned objects
        step(i)
    gc.collect()
    blocks, rss = sys.getallocatedblocks(), resident_bytes()
    for i in range(10_000):
        step(i)
    gc.collect()
    # A leak of one closure, cell, key or tensor per step would be >= 10,000 blocks.
    assert sys.getallocatedblocks() - blocks < 1000
    assert resident_bytes() - rss < 16 * 2**20
    assert cached_verdicts("pure") == 1


def resident_bytes() -> int:
    """The resident set size (Linux), or 0 where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def make_scaled(k):
    return lambda a, b: a + b * k


def test_captured_tensors_and_closures_are_freed():
    xs = torch.randn(6)
    refs = []

    def scan_with_fresh_closure() -> None:
        w = torch.zeros(())
        fn = make_scaled(w)
        fscan.associative_scan(fn, xs, 0)
        refs.extend([weakref.ref(w), weakref.ref(fn)])

    # eager: the C++ kernel (if any) is built within the call, so no background build
    # holds a closure when this looks; its cache entry must not hold one either.
    with fscan.config.override(cpu_kernel="eager"):
        for _ in range(50):
            scan_with_fresh_closure()
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_distinct_code_objects_stay_within_the_bound(monkeypatch):
    monkeypatch.setattr(entries, "maxsize", 8)
    xs = torch.randn(4)
    for i in range(40):
        fscan.associative_scan(eval(f"lambda a, b: a + b + {i}"), xs, 0)
        assert len(entries) <= 8


def test_concurrent_scans_with_fresh_closures_are_correct():
    n_threads, steps = 6, 60
    errors: list[BaseException] = []
    barrier = threading.Barrier(n_threads)

    def worker(t: int) -> None:
        gen = torch.Generator().manual_seed(t)
        try:
            barrier.wait()
            for i in range(steps):
                xs = torch.randn(17, 3, generator=gen)
                shift = torch.full((3,), float(t))
                if i % 3 == 0:
                    # Distinct code per thread and step: forces concurrent probes...
                    fn = eval(f"lambda a, b: a + b + 0 * {t}")
                else:
                    fn = lambda a, b: a + b + 0 * shift
                torch.randn(8)  # ...while other threads draw from the global RNG.
                mode = "generic" if i % 2 else "pointwise"
                out = fscan.associative_scan(fn, xs, 0, reverse=bool(t % 2), combine_mode=mode)
                ref = xs.flip(0).cumsum(0).flip(0) if t % 2 else xs.cumsum(0)
                torch.testing.assert_close(out, ref)
                with pytest.raises(fscan.ImpureCombineError):
                    fscan.associative_scan(lambda a, b: a.add_(b), xs, 0)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
