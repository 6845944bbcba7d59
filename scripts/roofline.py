"""Measured floors under the speed bars that fscan's C++ kernel does not meet (issue 21).

Standalone loops (``scripts/roofline/loops.cpp``, built with the kernel's own compiler
flags: Inductor's for this CPU plus ``fscan._engines.cpp._cpp_build.EXTRA_FLAGS``; built
and checked against sequential references by ``scripts/roofline_loops.py``) do the
least work each kind of row needs, on the bench's shapes, into preallocated memory. Each
section times its loops, a copy of the same leaves into preallocated memory (the bench's
limit) and fscan's own bar row side by side (``fscan.bench._timing.interleaved``: turns,
medians, torch's Timer with the thread count set), and prints every time as a ratio to
that copy. A loop's ratio is the floor of the rows of its kind on this machine: a row
above its bar whose floor is above the bar too cannot meet it here.

Sections: copies (and the fresh-output clone of a 32 MiB output); the lane loop (dim 0)
with float32, double and double + range-checked running values; logaddexp's
elementwise cost and its scans; the chain path (last dim, 1-D) as the kernel's register
transposes alone (``fscan_tile_in``/``fscan_tile_out`` of csrc/prelude.h), with a float32
and with a double scan, an add by in-register prefix sums without transposes and a max
by in-register prefix scans, a row at a time (the kernel's prefix chains); the
reduce; 2 threads; and the segmented lane loop with a flag per element (``reset=`` with
a mask of x's shape) against the same loop without flags and a pass that only moves x,
its flags and y.

Run (about 2-3 minutes; the first run also builds the loops and fscan's kernels):
    PYTHONPATH=. python scripts/roofline.py [--quick] [--section TEXT]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import torch
from roofline_loops import (
    ACC_NAMES,
    ADD,
    AFFINE,
    F32,
    F64,
    F64_RANGE,
    LAE,
    MAX,
    MUL,
    address,
    build,
    build_reduce,
    check,
)

import fscan
from fscan._memory import advise_huge_pages
from fscan.bench import bars
from fscan.bench._allocator import pin_allocator
from fscan.bench._timing import Table, interleaved

ROUNDS = 5  # turns per runner: each section's runners alternate, medians of all turns


class Section:
    """Runners timed together; each row printed as a ratio to the copy of its leaves."""

    def __init__(self, title: str, threads: int = 1) -> None:
        self.title, self.threads = title, threads
        self.runners: dict[str, object] = {}
        self.base: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        self.keep: list[torch.Tensor | None] = []  # what the loops' raw pointers point into

    def add(self, name: str, fn, base: str, note: str = "") -> None:
        self.runners[name], self.base[name], self.notes[name] = fn, base, note

    def run(self, budget_per_runner: float) -> dict[str, float]:
        # One thread: the calling thread's CPU time, which a shared machine's other
        # processes do not inflate by descheduling it (they still share caches and memory
        # bandwidth). Two threads: the wall clock (the other thread's time is not this
        # thread's), so those rows want a quiet machine.
        clock = time.thread_time if self.threads == 1 else None
        times = interleaved(
            self.runners,
            budget_s=budget_per_runner * len(self.runners),
            threads=self.threads,
            clock=clock,
            rounds=ROUNDS,
        )
        med = {k: m.median for k, m in times.items()}
        table = Table(
            f"{self.title} ({self.threads} thread{'s' * (self.threads > 1)}, "
            f"{'thread CPU time' if self.threads == 1 else 'wall clock'}; medians; "
            "ratio = time / the copy named)",
            ["time", "ratio", "to", "what"],
        )
        for name in self.runners:
            base = self.base[name]
            ratio = f"{med[name] / med[base]:.2f}" if base else "-"
            table.add(name, [_time(med[name]), ratio, base or "-", self.notes[name]])
        print(table.render(), flush=True)
        return med


def _time(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.3f} ms"


def _copy(*xs: torch.Tensor):
    outs = [torch.empty_like(x) for x in xs]
    return lambda: [o.copy_(x) for o, x in zip(outs, xs)]


def _fscan_row(name: str, shape: tuple[int, ...], dim: int):
    """fscan's bar row itself: ``associative_scan`` as fscan.bench.bars times it."""
    return bars._scan(name, bars._data(name, shape), dim, False)


def _leaves(name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    data = bars._data(name, shape)
    return (data[0], data[1]) if isinstance(data, tuple) else (data, None)


def _outs(x0, x1):
    return torch.empty_like(x0), None if x1 is None else torch.empty_like(x1)


def section_copies(m, budget: float) -> None:
    x = bars._data("add", (4096, 256))
    y = torch.empty_like(x)
    s = Section("copies, float32 (4096, 256)")
    s.add(
        "copy (torch copy_ into preallocated)",
        _copy(x),
        "copy (torch copy_ into preallocated)",
        "the bench's limit",
    )
    s.add(
        "copy (native loop)",
        lambda: m.copy(address(y), address(x), x.numel()),
        "copy (torch copy_ into preallocated)",
        "the same, the kernel's flags",
    )
    s.run(budget)
    big = bars._data("add", (16384, 1024))
    s = Section("copies, float32 (16384, 1024): 64 MiB, above glibc's mmap ceiling")
    s.add("copy into preallocated", _copy(big), "copy into preallocated", "the judged limit")
    s.add(
        "clone (fresh output)",
        lambda: big.clone(),
        "copy into preallocated",
        "what every out-of-place op pays",
    )
    s.add(
        "fresh output, huge pages, then copy",
        lambda: advise_huge_pages(torch.empty_like(big)).copy_(big),
        "copy into preallocated",
        "fscan's outputs (fscan._memory)",
    )
    s.add(
        "fscan add dim 0", _fscan_row("add", (16384, 1024), 0), "copy into preallocated", "bar row"
    )
    s.run(budget)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        big.clone()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp.read_text().strip() if thp.exists() else "n/a"
    print(f"a clone of (16384, 1024) float32 faulted {faults:.0f} pages per call (THP: {mode})\n")


def section_lanes(m, budget: float, shape: tuple[int, int]) -> None:
    T, N = shape
    s = Section(f"lane loop: dim 0 of {shape}, float32 leaves, one row at a time")
    for name, op, accs in (
        ("add", ADD, (F32, F64)),
        ("mul", MUL, (F32, F64)),
        ("max", MAX, (F32,)),
        ("affine", AFFINE, (F32, F64, F64_RANGE)),
    ):
        x0, x1 = _leaves(name, shape)
        y0, y1 = _outs(x0, x1)
        base = f"copy of {name}'s leaves"
        s.add(base, _copy(*[t for t in (x0, x1) if t is not None]), base, "")
        for acc in accs:
            run = lambda op=op, acc=acc, x0=x0, x1=x1, y0=y0, y1=y1: m.lane_scan(
                op, acc, address(x0), address(x1), address(y0), address(y1), T, N, True
            )
            s.add(
                f"{name} lane loop, {ACC_NAMES[acc]}",
                run,
                base,
                "floor" if acc != F32 or op == MAX else "",
            )
        s.add(f"fscan {name} dim 0", _fscan_row(name, shape, 0), base, "bar row")
    s.run(budget)


def section_logaddexp(m, budget: float) -> None:
    shape = (4096, 256)
    T, N = shape
    a = bars._data("logaddexp", shape)
    b = torch.roll(a, 1, 0)
    o = torch.empty_like(a)
    n = a.numel()
    s = Section(f"logaddexp, float32 {shape}")
    base = "copy"
    s.add(base, _copy(a), base, "")
    s.add(
        "fscan_log1p_exp per element",
        lambda: m.log1p_exp(address(o), address(a), n),
        base,
        "csrc/logaddexp.h",
    )
    s.add(
        "fscan_logaddexp per element",
        lambda: m.logaddexp(address(o), address(a), address(b), n),
        base,
        "csrc/logaddexp.h",
    )
    s.add("torch.logaddexp(a, b, out=o)", lambda: torch.logaddexp(a, b, out=o), base, "SLEEF")
    s.add(
        "lane scan (dim 0), double acc",
        lambda: m.lane_scan(LAE, F64, address(a), 0, address(o), 0, T, N, True),
        base,
        "floor of the lane rows",
    )
    s.add("fscan logaddexp dim 0", _fscan_row("logaddexp", shape, 0), base, "bar row")
    s.add(
        "chain scan (last dim), tiles, double acc",
        lambda: m.chain_scan(LAE, F64, address(a), 0, address(o), 0, T, N, 1),
        base,
        "no floor: the kernel is faster",
    )
    s.add("fscan logaddexp dim 1 (last)", _fscan_row("logaddexp", shape, 1), base, "bar row")
    s.run(budget)
    one = bars._data("logaddexp", (2**20,))
    o1 = torch.empty_like(one)
    s = Section("logaddexp, float32 (1048576,): cut into 2048 chains of 512")
    s.add(base, _copy(one), base, "")
    s.add(
        "chain totals + scan, tiles, double acc",
        lambda: m.chain_scan(LAE, F64, address(one), 0, address(o1), 0, 2048, 512, 2),
        base,
        "no floor: the kernel is faster",
    )
    s.add("fscan logaddexp (1048576,)", _fscan_row("logaddexp", (2**20,), 0), base, "bar row")
    s.run(budget)


def section_chains(m, budget: float) -> None:
    shape = (4096, 256)
    N, L = shape
    s = Section(
        f"chain path: last dim of {shape}, 32 chains side by side, "
        "16-step tiles (the kernel's transposes)"
    )
    for name, op in (("add", ADD), ("affine", AFFINE)):
        x0, x1 = _leaves(name, shape)
        y0, y1 = _outs(x0, x1)
        base = f"copy of {name}'s leaves"
        s.add(base, _copy(*[t for t in (x0, x1) if t is not None]), base, "")
        s.keep += [x0, x1, y0, y1]
        args = (address(x0), address(x1), address(y0), address(y1), N, L)
        s.add(
            f"{name}: transposes alone",
            lambda op=op, args=args: m.chain_scan(op, F32, *args, 0),
            base,
            "tile in + tile out",
        )
        if op == ADD:
            for dbl in (False, True):
                s.add(
                    f"add: in-register prefix, no transposes, {'double' if dbl else 'float32'}",
                    lambda dbl=dbl, x0=x0, y0=y0: m.prefix_add(
                        dbl, address(x0), address(y0), N, L, 1
                    ),
                    base,
                    "floor" if dbl else "",
                )
            s.add(
                f"{name}: + float32 scan",
                lambda args=args: m.chain_scan(ADD, F32, *args, 1),
                base,
                "",
            )
            s.add(
                f"{name}: + double scan",
                lambda args=args: m.chain_scan(ADD, F64, *args, 1),
                base,
                "floor",
            )
        else:
            s.add(
                f"{name}: + double scan, range check",
                lambda args=args: m.chain_scan(AFFINE, F64_RANGE, *args, 1),
                base,
                "floor",
            )
        s.add(f"fscan {name} dim 1 (last)", _fscan_row(name, shape, 1), base, "bar row")
    _prefix_max(m, s, shape)
    s.run(budget)
    s = Section(
        "chain path: (1048576,) cut into 2048 chains of 512 (totals, carries, scan), "
        "or for add 4 segments"
    )
    for name, op, acc in (("add", ADD, F64), ("affine", AFFINE, F64_RANGE)):
        x0, x1 = _leaves(name, (2**20,))
        y0, y1 = _outs(x0, x1)
        base = f"copy of {name}'s leaves"
        s.add(base, _copy(*[t for t in (x0, x1) if t is not None]), base, "")
        s.keep += [x0, x1, y0, y1]
        args = (address(x0), address(x1), address(y0), address(y1), 2048, 512)
        s.add(
            f"{name}: totals + scan, {ACC_NAMES[acc]}",
            lambda op=op, acc=acc, args=args: m.chain_scan(op, acc, *args, 2),
            base,
            "floor" if op == AFFINE else "",
        )
        if op == ADD:
            s.add(
                "add: 4 segments, sums, in-register prefix, double",
                lambda x0=x0, y0=y0: m.prefix_add(True, address(x0), address(y0), 4, 2**18, 2),
                base,
                "floor",
            )
        s.add(f"fscan {name} (1048576,)", _fscan_row(name, (2**20,), 0), base, "bar row")
    _prefix_max(m, s, (2**20,))
    s.run(budget)


def _prefix_max(m, s: Section, shape: tuple[int, ...]) -> None:
    """max (float32, exact) by in-register prefix scans, a row at a time (the kernel's
    prefix chains, csrc/forward_prefix.h), bare and with the NaN check, and fscan's row."""
    x, _ = _leaves("max", shape)
    y = torch.empty_like(x)
    base = "copy of max's leaves"
    s.add(base, _copy(x), base, "")
    s.keep += [x, y]
    rows, L = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
    for checked in (False, True):
        s.add(
            f"max: in-register prefix, float32{', NaN check (pairs)' if checked else ''}",
            lambda checked=checked: m.prefix_max(checked, address(x), address(y), rows, L),
            base,
            "floor" if checked else "",
        )
    dim = len(shape) - 1
    s.add(f"fscan max {shape} dim {dim}", _fscan_row("max", shape, dim), base, "bar row")


def section_chains_large(m, budget: float) -> None:
    shape = (16384, 1024)
    N, L = shape
    s = Section(f"chain path: last dim of {shape} (rows 4 KiB apart), add")
    x, y = bars._data("add", shape), torch.empty(shape)
    base = "copy of add's leaves"
    s.add(base, _copy(x), base, "")
    s.add(
        "add: transposes alone",
        lambda: m.chain_scan(ADD, F32, address(x), 0, address(y), 0, N, L, 0),
        base,
        "tile in + tile out",
    )
    s.add(
        "add: + double scan",
        lambda: m.chain_scan(ADD, F64, address(x), 0, address(y), 0, N, L, 1),
        base,
        "",
    )
    s.add(
        "add: in-register prefix, no transposes, double",
        lambda: m.prefix_add(True, address(x), address(y), N, L, 1),
        base,
        "floor",
    )
    s.add("fscan add dim 1 (last)", _fscan_row("add", shape, 1), base, "bar row")
    s.run(budget)


def section_reduce(m, budget: float) -> None:
    shape = (4096, 256)
    T, N = shape
    x = bars._data("add", shape)
    a, b = bars._data("affine", shape)
    za, zb = torch.empty(N), torch.empty(N)
    s = Section(f"associative_reduce: dim 0 of {shape}")
    s.add("torch.sum of x", lambda: torch.sum(x, 0), "torch.sum of x", "the add row's rival")
    s.add(
        "add reduce loop, double acc",
        lambda: m.lane_scan(ADD, F64, address(x), 0, address(za), 0, T, N, False),
        "torch.sum of x",
        "row by row",
    )
    blocks = build_reduce()
    blocks.add_blocks(
        True, 8, address(x), address(za), T, N
    )  # the sequential double sum, rounded once
    assert torch.equal(za, torch.cumsum(x.double(), 0)[-1].float()), "block loop: wrong totals"
    for dbl in (True, False):
        s.add(
            f"add reduce, 8 rows x 4 lanes a block, {'double' if dbl else 'float32'} acc",
            lambda dbl=dbl: blocks.add_blocks(dbl, 8, address(x), address(za), T, N),
            "torch.sum of x",
            "floor (the kernel's blocks, AVX2 intrinsics)" if dbl else "",
        )
    s.add(
        "fscan add reduce",
        lambda: fscan.associative_reduce(bars.COMBINES["add"], x, 0),
        "torch.sum of x",
        "bar row",
    )
    read = "read (sum) of a and b"
    s.add(read, lambda: (torch.sum(a, 0), torch.sum(b, 0)), read, "the affine row's limit")
    for acc in (F32, F64, F64_RANGE):
        s.add(
            f"affine reduce loop, {ACC_NAMES[acc]}",
            lambda acc=acc: m.lane_scan(
                AFFINE, acc, address(a), address(b), address(za), address(zb), T, N, False
            ),
            read,
            "floor" if acc == F64_RANGE else "",
        )
    s.add(
        "fscan affine reduce",
        lambda: fscan.associative_reduce(bars._affine, (a, b), 0),
        read,
        "bar row",
    )
    s.run(budget)


def section_flags(m, budget: float) -> None:
    """The per-lane segmented rows (`reset=` with a mask of x's shape) against the same
    scan without flags: what the flags' bytes and their selects cost in the loop itself."""
    for shape in ((4096, 256), (16384, 1024)):
        T, N = shape
        x = bars._data("add", shape)
        flags = torch.rand(shape, generator=torch.Generator().manual_seed(97)) < 1 / 97
        y = torch.empty_like(x)
        s = Section(f"segmented lane loop: dim 0 of {shape}, float32, a flag per element")
        base = "copy of x"
        s.add(base, _copy(x), base, "the bench's limit for the inclusive row")
        s.add(
            "x and its flags read, y written",
            lambda x=x, y=y, f=flags: m.select(address(y), address(x), address(f), x.numel()),
            base,
            "the memory a flagged row moves",
        )
        for name, op in (("cumsum", ADD), ("cumprod", MUL)):
            for flagged in (False, True):
                s.add(
                    f"{name} lane loop, double acc{', flags' if flagged else ''}",
                    lambda op=op, fl=flagged, x=x, y=y, f=flags, T=T, N=N: m.seg_lane_scan(
                        op, fl, address(x), address(f), address(y), T, N
                    ),
                    base,
                    "floor" if flagged else "",
                )
            fn = getattr(fscan, name)
            s.add(f"fscan.{name} dim 0", lambda fn=fn, x=x: fn(x, 0), base, "inclusive row")
            s.add(
                f"fscan.{name} dim 0, reset per lane",
                lambda fn=fn, x=x, f=flags: fn(x, 0, reset=f),
                base,
                "bar row",
            )
        s.run(budget)


def section_threads(m, budget: float) -> None:
    shape = (16384, 1024)
    T, N = shape
    for threads in (1, 2):
        s = Section(f"threads: dim 0 of {shape}, one column of 1024 lanes", threads)
        for name, op, acc in (("add", ADD, F64), ("affine", AFFINE, F64_RANGE)):
            x0, x1 = _leaves(name, shape)
            y0, y1 = _outs(x0, x1)
            base = f"copy of {name}'s leaves"
            s.add(
                base, _copy(*[t for t in (x0, x1) if t is not None]), base, f"{threads}-thread copy"
            )
            s.keep += [x0, x1, y0, y1]
            args = (address(x0), address(x1), address(y0), address(y1), T, N)
            if threads == 2 and op == ADD:  # the same copy on one thread, in the same turns
                s.add(
                    "copy of add's leaves, 1 thread (native loop)",
                    lambda x0=x0, y0=y0: m.copy(address(y0), address(x0), x0.numel()),
                    base,
                    "what a second thread adds",
                )
            if threads == 1:
                s.add(
                    f"{name} lane loop, {ACC_NAMES[acc]}",
                    lambda op=op, acc=acc, args=args: m.lane_scan(op, acc, *args, True),
                    base,
                    "1 thread",
                )
            else:
                s.add(
                    f"{name} halves on 2 threads",
                    lambda op=op, acc=acc, args=args: m.lane_two(op, acc, *args, True),
                    base,
                    "ideal: no carries",
                )
                s.add(
                    f"{name} split as lane_path (3 chunks)",
                    lambda op=op, acc=acc, args=args: m.lane_two(op, acc, *args, False),
                    base,
                    "floor",
                )
            s.add(f"fscan {name} dim 0", _fscan_row(name, shape, 0), base, "bar row")
        s.run(budget)


SECTIONS = {
    "copies": section_copies,
    "lanes": lambda m, b: section_lanes(m, b, (4096, 256)),
    "lanes-large": lambda m, b: section_lanes(m, b, (16384, 1024)),
    "logaddexp": section_logaddexp,
    "chains": section_chains,
    "chains-large": section_chains_large,
    "reduce": section_reduce,
    "threads": section_threads,
    "flags": section_flags,
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    parser.add_argument("--section", default="", help="only the sections whose name contains this")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(pin_allocator())
    print(f"load: {os.getloadavg()}; torch {torch.__version__}; fscan from {fscan.__file__}")
    m = build()
    print(f"tiles: {m.tiles}")
    check(m)
    budget = 0.06 if args.quick else 0.15
    with fscan.config.override(cpu_kernel="eager"):
        for name, section in SECTIONS.items():
            if args.section in name:
                start = time.perf_counter()
                section(m, budget)
                print(
                    f"({name}: {time.perf_counter() - start:.1f} s)\n", file=sys.stderr, flush=True
                )


if __name__ == "__main__":
    main()
