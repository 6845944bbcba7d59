"""Measure the extra peak memory of one scan, in a fresh process.

Run as ``python -m fscan.bench._memprobe WORKLOAD LENGTH MODE``; prints the
high-water mark of the resident set size (``ru_maxrss``) gained while running
the workload, in bytes: Linux's ``VmHWM``, reset just before the run through
``/proc/self/clear_refs``. Large tensors are mmap-backed, so RSS follows live
tensor memory closely; a fresh process keeps other work out of the number.
"""

from __future__ import annotations

import gc
import sys

import torch

import fscan


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    # Writing 5 resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def forward_add(length: int, mode: str) -> None:
    # A small call first: the first call per combine_fn runs one-time checks
    # (purity, elementwise ops) that are cached and not part of a scan's cost.
    fscan.associative_scan(torch.add, torch.randn(64), 0, combine_mode=mode)
    x = torch.randn(length)
    _measure(lambda: fscan.associative_scan(torch.add, x, 0, combine_mode=mode), x.nbytes)


def _measure(run, input_bytes: int) -> None:
    gc.collect()
    _reset_peak()
    baseline = _status_bytes("VmRSS")
    out = run()
    del out
    extra = _status_bytes("VmHWM") - baseline
    print(extra, input_bytes)


def fwd_bwd_linrec(length: int, mode: str) -> None:
    """Forward+backward of the linear recurrence over ``(length, 256)``; ``mode`` names
    a contender of :mod:`fscan.bench.autograd`."""
    from .autograd import RUNNERS, fwd_bwd, linrec_inputs

    # A small run first, so that lazily loaded code and one-time caches are not counted.
    fwd_bwd(RUNNERS[mode], *linrec_inputs(64))
    a, b, cot_a, cot_b = linrec_inputs(length)
    _measure(lambda: fwd_bwd(RUNNERS[mode], a, b, cot_a, cot_b), a.nbytes + b.nbytes)


WORKLOADS = {"forward_add": forward_add, "fwd_bwd_linrec": fwd_bwd_linrec}

if __name__ == "__main__":
    name, length, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(torch.get_num_threads())
    WORKLOADS[name](length, mode)
