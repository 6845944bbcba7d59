"""Where fscan faults in a large fresh output's huge pages, A/B in one process.

``python scripts/huge_page_order.py [--dim D] [--combine add|max] [--threads N]``
scans a (16384, 1024) float32 input forward and reversed with the kernel, alternating
call by call between fscan's rule (``fscan._memory.advise_huge_pages``: each huge page
faulted in at its last byte, unless the kernel reaches each page's end first) and the
rule before it (advice only; on more than one thread, faulted in at each page's first
byte), and prints the medians. Alternating in one process keeps both rules under the
same system state: whole bench runs moved 2x on these rows with the huge pages the
system had to give (see docs/performance.md, "Where a huge page is first written").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fscan
import fscan._engines.cpp._kernel_run as kernel_run
from fscan import _memory
from fscan.bench._allocator import pin_allocator


def first_byte_rule(out: torch.Tensor, ends_first: bool = False) -> torch.Tensor:
    """The rule before: advise the aligned interior; on more than one thread, write a
    zero at the start of each huge page."""
    size = out.untyped_storage().nbytes()
    if _memory._madvise is None or size < _memory.HUGE_MIN_BYTES:
        return out
    page = _memory._HUGE_PAGE
    start = out.untyped_storage().data_ptr()
    lo, hi = (start + page - 1) & ~(page - 1), (start + size) & ~(page - 1)
    if hi > lo:
        _memory._madvise(lo, hi - lo, _memory._MADV_HUGEPAGE)
        if torch.get_num_threads() > 1:
            data = torch.empty(0, dtype=torch.uint8).set_(out.untyped_storage())
            data[lo - start : hi - start : page].zero_()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=0)
    parser.add_argument("--combine", choices=["add", "max"], default="add")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(pin_allocator())
    fscan.config.cpu_kernel = "eager"
    combine = torch.add if args.combine == "add" else torch.maximum
    x = torch.randn(16384, 1024)
    calls = {
        "forward": lambda: fscan.associative_scan(combine, x, args.dim),
        "reverse": lambda: fscan.associative_scan(combine, x, args.dim, reverse=True),
    }
    rules = {"before (first byte)": first_byte_rule, "now (last byte)": _memory.advise_huge_pages}
    for call in calls.values():  # builds and warm-up
        call()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for rule, advise in rules.items():
            kernel_run.advise_huge_pages = advise
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times.setdefault((rule, name), []).append(time.perf_counter() - start)
    kernel_run.advise_huge_pages = rules["now (last byte)"]
    print(f"{args.combine} over (16384, 1024) dim {args.dim}, {args.threads} thread(s), ms:")
    for (rule, name), ts in times.items():
        print(f"  {rule:20s} {name:8s} {statistics.median(ts) * 1e3:7.2f}")


if __name__ == "__main__":
    main()
