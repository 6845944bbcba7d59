"""Fresh output memory: huge pages for large outputs on Linux.

A scan writes every element of a fresh output, and on Linux the first write to each 4 KiB
page of fresh memory is a page fault that the kernel answers by zeroing the page. glibc's
malloc serves every allocation of 32 MiB or more (and, depending on what the process freed
before, smaller ones too) from a fresh ``mmap``, and returns it to the system when it is
freed, so a scan producing a (16384, 1024) float32 output faulted 16384 times on every call:
33 ms to fill 64 MiB fresh against 4-8 ms to copy into memory already mapped (1 thread,
this project's 2-core CPU). ``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned interior of the
region, before the first write, turns those faults into one per 2 MiB: 8-11 ms.

The advice is what torch does for every CPU allocation with ``THP_MEM_ALLOC_ENABLE=1``, applied
here to outputs of at least :data:`HUGE_MIN_BYTES` only. It changes nothing but the page size:
the kernel ignores it when transparent huge pages are ``never``, and memory that is already
mapped (a reused heap block) keeps its pages. Only the interior is advised, so no page is
shared with a neighbouring allocation.

Where the kernels will run on more than one thread, the advised pages are also faulted in
here, one write per huge page, before the threads start: threads faulting in huge pages of
one process concurrently waited on each other in the kernel, and a 2-thread scan of
(16384, 1024) ran at 12.7-22 ms a call (10-20 ms of it system time) against 7-9 ms on one
thread; faulted in first, 8-9 ms on two threads (system time 4 ms, as on one).

Where a huge page is first written decides how fast Linux clears it: ``clear_huge_page``
clears the written 4 KiB subpage last and the others from the far end of the page towards
it, so a first write at a page's start clears its 512 subpages from the top down, and one
at its end from the bottom up, which the CPU's stores stream at. A forward scan along
dim 0 of (16384, 1024) float32 (one thread, AVX-512 machine) first writes each page at
its start: 12.1-12.7 ms a call, its reverse (first writes at each page's end) 8.4-8.7;
faulted in here at each page's first byte, both 13.4-14.6 ms; at its last byte, 9.4-10.4.
So pages are faulted in here at their last byte, on one thread too, unless the caller
says its kernel writes each page's end first (``ends_first``): those fault in as written,
which leaves the cleared lines in cache for the writes that follow (8.4-8.7 ms against
9.1-10.1 faulted in here).
"""

from __future__ import annotations

import ctypes
import sys

import torch

__all__ = ["HUGE_MIN_BYTES", "advise_huge_pages"]

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
# Below this an output holds at most one aligned huge page and faults in well under a
# millisecond; above it the advice costs one system call (about a microsecond).
HUGE_MIN_BYTES = 8 << 20


def _load_madvise():
    """libc's madvise, or None off Linux (the advice is a Linux transparent-huge-page hint)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def advise_huge_pages(out: torch.Tensor, ends_first: bool = False) -> torch.Tensor:
    """Ask for huge pages under ``out`` (a fresh CPU tensor not yet written) and fault them
    in, unless ``ends_first`` (the kernel about to write ``out`` on one thread reaches each
    page's end before its start: a reverse scan along lanes, a forward scan's backward);
    returns ``out``. See the module's note."""
    if _madvise is None or out.device.type != "cpu":
        return out
    size = out.untyped_storage().nbytes()
    if size < HUGE_MIN_BYTES:
        return out
    start = out.untyped_storage().data_ptr()
    lo = (start + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    hi = (start + size) & ~(_HUGE_PAGE - 1)
    if hi > lo:
        # Advisory: a refusal (EINVAL on a kernel without THP) leaves the 4 KiB pages.
        _madvise(lo, hi - lo, _MADV_HUGEPAGE)
        if not ends_first or torch.get_num_threads() > 1:
            _fault_in(out, lo - start, hi - start)
    return out


def _fault_in(out: torch.Tensor, lo: int, hi: int) -> None:
    """Write one zero byte at the end of each huge page of bytes ``[lo, hi)`` (``lo`` and
    ``hi`` on huge-page boundaries) of ``out``'s fresh, unwritten storage, from this thread:
    see the module's notes on threads and on where a page is first written."""
    data = torch.empty(0, dtype=torch.uint8).set_(out.untyped_storage())
    data[lo + _HUGE_PAGE - 1 : hi : _HUGE_PAGE].zero_()
