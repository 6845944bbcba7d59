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


def advise_huge_pages(out: torch.Tensor) -> torch.Tensor:
    """Ask for huge pages under ``out`` (a fresh CPU tensor not yet written); returns ``out``."""
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
        if torch.get_num_threads() > 1:
            _fault_in(out, lo - start, hi - start)
    return out


def _fault_in(out: torch.Tensor, lo: int, hi: int) -> None:
    """Write one zero byte in each huge page of bytes ``[lo, hi)`` of ``out``'s (fresh,
    unwritten) storage, from this thread: see the module's note on threads."""
    data = torch.empty(0, dtype=torch.uint8).set_(out.untyped_storage())
    data[lo:hi:_HUGE_PAGE].zero_()
