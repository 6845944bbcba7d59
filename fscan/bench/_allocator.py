"""The benchmark's allocator state: glibc malloc pinned so that freed outputs are reused.

Every out-of-place op (fscan's scans, ``torch.cumsum``, a ``clone``) writes a fresh output.
With glibc's default, dynamic thresholds, whether a freed 2-32 MiB output goes back to the
system (``munmap``, or a trim of the heap's top) depends on what the process allocated and
freed before; when it does, the next call's output is fresh memory and faults on every 4 KiB
page it writes. The same (1024, 8, 64) affine-pair row then measured ~0.25 ms in one process
and ~2 ms in the next (1000 page faults a call against 50), with the same engine and path.
The bench fixes both thresholds, as ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``
would, so a row measures the op, not the process's history. Set
``FSCAN_BENCH_SYSTEM_MALLOC=1`` to time with the default. Outputs of 32 MiB or more are
still fresh ``mmap`` memory whatever the settings (glibc's ceiling); fscan asks for huge pages
under them (``fscan._memory``).
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["pin_allocator"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_MAX = 32 << 20  # glibc's largest mmap threshold on 64-bit
_TRIM = 1 << 30
_state: list[str] = []


def pin_allocator() -> str:
    """Pin glibc malloc's thresholds (once per process); returns a line saying what was done."""
    if _state:
        return _state[0]
    line = _pin()
    _state.append(line)
    return line


def _pin() -> str:
    if os.environ.get("FSCAN_BENCH_SYSTEM_MALLOC", "").strip() not in ("", "0"):
        return "allocator: the system's default (FSCAN_BENCH_SYSTEM_MALLOC is set)"
    if not sys.platform.startswith("linux"):
        return "allocator: the system's default (not Linux)"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "allocator: the system's default (no glibc mallopt)"
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX) and mallopt(_M_TRIM_THRESHOLD, _TRIM)):
        return "allocator: the system's default (mallopt refused)"
    return (
        "allocator: glibc malloc with fixed thresholds (mmap 32 MiB, trim 1 GiB) so freed "
        "outputs are reused, not faulted in again; FSCAN_BENCH_SYSTEM_MALLOC=1 times the default"
    )
