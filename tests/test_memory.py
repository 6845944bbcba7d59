"""Huge-page advice for large fresh outputs (fscan._memory) and the kernel's use of it."""

from __future__ import annotations

import pytest
import torch

import fscan
from fscan import _memory

HUGE = 2 << 20


@pytest.fixture
def advised(monkeypatch):
    calls: list[tuple[int, int, int]] = []

    def record(addr, length, advice):
        calls.append((addr, length, advice))
        return 0

    monkeypatch.setattr(_memory, "_madvise", record)
    return calls


def test_advice_covers_the_aligned_interior_only(advised):
    out = torch.empty(5 * HUGE + 4096, dtype=torch.uint8)
    assert _memory.advise_huge_pages(out) is out
    ((addr, length, advice),) = advised
    start = out.untyped_storage().data_ptr()
    end = start + out.untyped_storage().nbytes()
    assert advice == 14  # MADV_HUGEPAGE
    assert addr % HUGE == 0 and length % HUGE == 0 and length > 0
    assert start <= addr and addr + length <= end  # never a page of a neighbour
    assert addr - start < HUGE and end - (addr + length) < HUGE  # the whole interior


def test_small_outputs_are_not_advised(advised):
    _memory.advise_huge_pages(torch.empty(_memory.HUGE_MIN_BYTES - 1, dtype=torch.uint8))
    _memory.advise_huge_pages(torch.empty(16, 16))
    assert advised == []


def test_advice_changes_no_value(monkeypatch):
    # The real system call (a no-op where THP is off): the tensor keeps its memory.
    out = torch.empty(_memory.HUGE_MIN_BYTES // 4)
    ptr = out.data_ptr()
    _memory.advise_huge_pages(out).fill_(3.0)
    assert out.data_ptr() == ptr and bool((out == 3.0).all())


def test_large_kernel_outputs_are_advised_and_exact(advised):
    x = torch.randn(_memory.HUGE_MIN_BYTES // 4 // 64, 64, dtype=torch.float32)
    pair = (torch.rand_like(x) * 0.5 + 0.5, x)

    def affine(p, q):
        return (p[0] * q[0], q[0] * p[1] + q[1])

    with fscan.config.override(cpu_kernel="eager"):
        fscan.associative_scan(affine, pair, 0)  # the first call checks combine_fn on the tree
        advised.clear()
        ys = fscan.associative_scan(affine, pair, 0)
        small = fscan.associative_scan(torch.add, x[:8], 0)
    outs = {y.untyped_storage().data_ptr() for y in ys}
    assert {a & ~(HUGE - 1) for a, _, _ in advised} >= {(p + HUGE - 1) & ~(HUGE - 1) for p in outs}
    assert small.untyped_storage().data_ptr() not in {a for a, _, _ in advised}
    a, b = pair[0].double(), pair[1].double()
    h = torch.zeros(64, dtype=torch.float64)
    expect = torch.empty_like(b)
    for t in range(b.shape[0]):
        h = a[t] * h + b[t]
        expect[t] = h
    torch.testing.assert_close(ys[1].double(), expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ends_first", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_pages_are_faulted_in_at_their_ends(threads, ends_first):
    # The advised pages are written (one zero byte at the end of each huge page, so that
    # Linux clears each from its start up) before the kernel runs: on one thread unless
    # the caller's kernel writes each page's end first (``ends_first``), always on more
    # (before the threads start). The output is fresh, so nothing the caller holds
    # changes, and the values are the kernel's own.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.full((_memory.HUGE_MIN_BYTES,), 171, dtype=torch.uint8)
        start = out.untyped_storage().data_ptr()
        _memory.advise_huge_pages(out, ends_first)
        first = ((start + HUGE - 1) & ~(HUGE - 1)) - start  # the interior: [first, last)
        last = ((start + out.numel()) & ~(HUGE - 1)) - start
        assert last - first >= 2 * HUGE
        ends = out[first + HUGE - 1 : last : HUGE]
        faulted = (threads > 1 or not ends_first) and _memory._madvise is not None
        assert bool((ends == 0).all()) == faulted
        untouched = out[first:last].view(-1, HUGE)[:, :-1]
        assert bool((untouched == 171).all()) and bool((out[:first] == 171).all())
        x = torch.randn(_memory.HUGE_MIN_BYTES // 4 // 256, 256)
        with fscan.config.override(cpu_kernel="eager"):
            y = fscan.associative_scan(torch.add, x, 0)
            z = fscan.associative_scan(torch.add, x, 0, reverse=True)
        torch.testing.assert_close(y.double(), x.double().cumsum(0), rtol=1e-5, atol=1e-4)
        flipped = x.double().flip(0).cumsum(0).flip(0)
        torch.testing.assert_close(z.double(), flipped, rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("reverse", [False, True])
def test_segmented_outputs_are_faulted_in_as_the_forward_scans_are(monkeypatch, reverse):
    # The segmented kernel (reset=) writes its outputs in the order the forward kernel
    # does: a reverse scan along lanes writes each page's end first, so on one thread its
    # pages fault in as written (ends_first), on the first call and on the repeat route's.
    calls: list[bool] = []
    monkeypatch.setattr(_memory, "_madvise", lambda addr, length, advice: 0)
    monkeypatch.setattr(_memory, "_fault_in", lambda out, lo, hi: calls.append(True))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(_memory.HUGE_MIN_BYTES // 4 // 256, 256)
        reset = torch.arange(x.shape[0]) % 97 == 13
        with fscan.config.override(cpu_kernel="eager"):
            for _ in range(3):
                calls.clear()
                y = fscan.cumsum(x, 0, reverse=reverse, reset=reset)
                assert calls == ([] if reverse else [True])
    finally:
        torch.set_num_threads(before)
    xd, expect = x.double(), torch.empty(x.shape, dtype=torch.float64)
    h = torch.zeros(x.shape[1], dtype=torch.float64)
    for t in reversed(range(x.shape[0])) if reverse else range(x.shape[0]):
        h = xd[t] if bool(reset[t]) else h + xd[t]
        expect[t] = h
    torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-4)
