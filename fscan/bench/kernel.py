"""``python -m fscan.bench.kernel``: the generated C++ CPU kernel (``fscan._engines.cpp``).

Forward rows (float32, scan over dim 0, median times): per combine, shape and
thread count, the engine ``fscan.associative_scan`` used, and ratios to
``copy`` (``out.copy_(x)`` of every leaf into preallocated memory, the
physical floor of a scan) and to ``clone()`` of the leaves (one read, one
write into fresh memory, as any out-of-place op pays):

* ``kernel/copy``: the bare kernel call into preallocated outputs;
* ``fscan/copy`` and ``fscan/clone``: ``fscan.associative_scan`` end to end
  (front end, cached checks, fresh outputs);
* ``torch eng/copy``: the same call with ``fscan.config.cpu_kernel = "off"``;
* ``native/copy``: ``torch.cumsum``/``cummax``/``logcumsumexp`` where one exists.

Then the backward (the C++ forward and backward kernels against the torch
engine's adjoint scan), the
first-call latency in fresh processes (cold and warm disk cache) and the cost
of a cached call (with and without gradients wanted). Times on a shared machine
vary by 2x between runs: compare columns within a row, not across runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.utils.benchmark.utils.common import set_torch_threads

import fscan
from fscan._engines.cpp import cpu_kernel

from ._timing import Table, engine_of, interleaved_medians, median_time

__all__ = ["kernel_table", "latency_table"]


def _add(a, b):
    return a + b


def _linrec(x, y):
    return (x[0] * y[0], y[0] * x[1] + y[1])


def _max(a, b):
    return torch.maximum(a, b)


def _seg(x, y):
    return (x[0] | y[0], torch.where(y[0], y[1], x[1] + y[1]))


def _lse(a, b):
    return torch.logaddexp(a, b)


def _inputs(name: str, shape: tuple[int, ...]) -> Any:
    if name == "linrec":
        return (torch.rand(shape) * 0.5 + 0.5, torch.randn(shape))
    if name == "seg":
        return (torch.rand(shape) < 0.05, torch.randn(shape))
    return torch.randn(shape)


COMBINES: dict[str, tuple[Callable[[Any, Any], Any], Callable[..., Any] | None]] = {
    "add": (_add, lambda x: torch.cumsum(x, 0)),
    "linrec": (_linrec, None),
    "max": (_max, lambda x: torch.cummax(x, 0)),
    "seg": (_seg, None),
    "logaddexp": (_lse, lambda x: torch.logcumsumexp(x, 0)),
}
SHAPES = [(16384, 1024), (4096, 256), (1024, 8, 64), (2**20,), (64,)]


def _bare_kernel(fn, xs) -> Callable[[], list[torch.Tensor]] | None:
    """The READY kernel's own call into preallocated outputs (which it returns), or None if
    it does not serve."""
    leaves, spec = optree.tree_flatten(xs)
    with torch.no_grad():
        if cpu_kernel.kernel_scan("bench", fn, spec, leaves, 0, False) is None:
            return None
    lookup = cpu_kernel._lookup(fn, spec, leaves, None, None)
    assert lookup is not None
    holder, aliases, _ = lookup
    key = cpu_kernel.slot_key(aliases, tuple(leaves[0].shape[1:]), (), (), False, False)
    entry = cpu_kernel._slots(holder).get(key)
    shape = leaves[0].shape
    outer, steps, inner = 1, shape[0], int(torch.tensor(shape[1:]).prod().item())
    ys = [torch.empty_like(x) for x in leaves]
    xs, nb, strides = cpu_kernel.strided_view(leaves, 0)
    strides = strides + [nb * steps * inner, steps * inner, inner, 1] * len(ys)  # dense outputs
    threads = torch.get_num_threads()
    heads = (0,) * len(xs)  # no carry-in

    def run() -> list[torch.Tensor]:
        entry.kernel(*xs, *ys, outer, steps, inner, 0, threads, nb, *strides, *heads)
        return ys

    return run


def _ratio(t: float | None, base: float) -> str:
    return "-" if t is None else f"{t / base:.2f}"


def kernel_table(quick: bool = False, threads: tuple[int, ...] = (1, 2)) -> Table:
    """Forward scans: the kernel, fscan end to end and the torch engine, as ratios to copy."""
    table = Table(
        "C++ kernel, forward, float32, dim 0 (medians; ratios to copy of the leaves)",
        [
            *("threads", "engine", "copy ms", "kernel/copy", "fscan/copy", "fscan/clone"),
            *("torch eng/copy", "native/copy"),
        ],
    )
    shapes = SHAPES[1:] if quick else SHAPES
    names = ["add", "linrec"] if quick else list(COMBINES)
    previous = torch.get_num_threads()
    try:
        for count in (1,) if quick else threads:
            torch.set_num_threads(count)
            for shape in shapes:
                for name in names:
                    table.add(f"{name} {shape}", [str(count), *_row(name, shape)])
    finally:
        torch.set_num_threads(previous)
    return table


def _row(name: str, shape: tuple[int, ...]) -> list[str]:
    fn, native = COMBINES[name]
    xs = _inputs(name, shape)
    leaves = optree.tree_leaves(xs)
    outs = [torch.empty_like(x) for x in leaves]
    copy = median_time(lambda: [o.copy_(x) for o, x in zip(outs, leaves)])
    clone = median_time(lambda: [x.clone() for x in leaves])
    with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
        bare = _bare_kernel(fn, xs)
        engine = engine_of(lambda: fscan.associative_scan(fn, xs, 0))
        scan = median_time(lambda: fscan.associative_scan(fn, xs, 0))
        kernel = median_time(bare) if bare is not None else None
    with torch.no_grad(), fscan.config.override(cpu_kernel="off"):
        slow = median_time(lambda: fscan.associative_scan(fn, xs, 0))
        nat = median_time(lambda: native(xs)) if native is not None else None
    return [
        engine,
        f"{copy * 1e3:.3f}",
        _ratio(kernel, copy),
        _ratio(scan, copy),
        _ratio(scan, clone),
        _ratio(slow, copy),
        _ratio(nat, copy),
    ]


def backward_table() -> Table:
    """Forward + backward through autograd: the C++ kernels (``KernelScan``) where they
    serve, against the torch engine's adjoint scan (``cpu_kernel="off"``).

    ``copy``, the forward alone (no grad) and forward + backward (``torch.autograd.grad``
    with fresh cotangents ``ones_like(y)``) take turns, so that each runs with the caches
    as the others leave them (a copy timed alone at (4096, 256) stays in cache and runs
    4x faster than beside the scans)."""
    table = Table(
        "backward, float32, dim 0, 1 thread (medians of turns; ratios to copy of the leaves)",
        ["engine", "copy ms", "fwd/copy", "fwd+bwd/copy", "fwd+bwd/fwd", "torch eng fwd+bwd/copy"],
    )
    with set_torch_threads(1):
        for shape in ((4096, 256), (16384, 256)):
            for name in ("add", "linrec", "max", "seg", "logaddexp", "scaled", "gate"):
                table.add(f"{name} {shape}", _backward_row(name, shape))
    return table


def _captured_combine(name: str, channels: int) -> tuple[Callable[[Any, Any], Any], list[Any]]:
    """Combines closing over a per-channel weight that requires grad (its gradient is
    summed over the steps by the backward kernel): a scaled sum and a decay gate."""
    w = (torch.rand(channels) + 0.5).requires_grad_()
    if name == "scaled":
        return (lambda a, b: a * w + b), [w]
    # (g, b) stands for the map h -> g * w * h + b; combining composes two of them, so the
    # gate's product carries one factor w (a gate of a[0] * b[0] with w on a[1] alone
    # applied w twice to a[1] in one grouping and once in the other: not associative).
    return (lambda a, b: (a[0] * b[0] * w, a[1] * b[0] * w + b[1])), [w]


def _backward_row(name: str, shape: tuple[int, ...]) -> list[str]:
    """Rows ``scaled`` and ``gate`` close over a per-channel weight needing grad: its
    gradient is computed too (and is the only extra input of the gradient)."""
    if name in ("scaled", "gate"):
        fn, extra = _captured_combine(name, shape[-1])
        xs = _inputs("linrec" if name == "gate" else "add", shape)
    else:
        (fn, _), extra = COMBINES[name], []
        xs = _inputs(name, shape)
    xs = optree.tree_map(lambda x: x.requires_grad_() if x.is_floating_point() else x, xs)
    leaves = optree.tree_leaves(xs)
    floats = [x for x in leaves if x.requires_grad] + extra
    outs = [torch.empty_like(x) for x in leaves]

    def copy() -> None:
        for o, x in zip(outs, leaves):
            o.copy_(x.detach())

    def both() -> None:
        ys = [y for y in optree.tree_leaves(fscan.associative_scan(fn, xs, 0)) if y.requires_grad]
        torch.autograd.grad(ys, floats, [torch.ones_like(y) for y in ys])

    def forward() -> None:
        with torch.no_grad():
            fscan.associative_scan(fn, xs, 0)

    with fscan.config.override(cpu_kernel="eager"):
        both()
        out = optree.tree_leaves(fscan.associative_scan(fn, xs, 0))[-1]
        engine = engine_of(forward) + f", bwd: {type(out.grad_fn).__name__}"
        t = interleaved_medians({"copy": copy, "fwd": forward, "both": both}, budget_s=1.0)
    with fscan.config.override(cpu_kernel="off"):
        slow = interleaved_medians({"copy": copy, "both": both}, budget_s=0.5)
    ratios = [f"{t['fwd'] / t['copy']:.1f}", f"{t['both'] / t['copy']:.1f}"]
    ratios += [f"{t['both'] / t['fwd']:.1f}", f"{slow['both'] / slow['copy']:.1f}"]
    return [engine, f"{t['copy'] * 1e3:.3f}", *ratios]


_LATENCY = """
import time, torch, fscan
x = torch.randn(4096, 256)
t = time.perf_counter()
ok = fscan.precompile(lambda a, b: (a[0] * b[0], b[0] * a[1] + b[1]), (x, x))
print(ok, time.perf_counter() - t)
"""


def latency_table() -> Table:
    """First call in a fresh process (cold and warm disk cache), and a cached call's cost."""
    table = Table("C++ kernel latency (linear recurrence, float32)", ["seconds / us", "note"])
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        for label in ("cold disk cache", "warm disk cache"):
            out = subprocess.run(
                [sys.executable, "-c", _LATENCY], env=env, capture_output=True, text=True
            )
            ok, seconds = [*out.stdout.split(), "False", "nan"][:2]
            note = "built" if ok == "True" else f"no kernel: {out.stderr.strip()[-80:]}"
            table.add(f"first call, {label}", [f"{float(seconds):.2f} s", note])
    x = torch.randn(64)
    with torch.no_grad(), fscan.config.override(cpu_kernel="eager"):
        bare = _bare_kernel(_add, x)
        call = median_time(lambda: fscan.associative_scan(_add, x, 0))
    table.add("cached call, (64,) add, end to end", [f"{call * 1e6:.1f} us", "front end + kernel"])
    xg = torch.randn(64, requires_grad=True)
    with fscan.config.override(cpu_kernel="eager"):
        grad_call = median_time(lambda: fscan.associative_scan(_add, xg, 0))
    table.add(
        "cached call, (64,) add requiring grad",
        [f"{grad_call * 1e6:.1f} us", "forward only: front end + KernelScan"],
    )
    if bare is not None:
        table.add("bare kernel call, (64,) add", [f"{median_time(bare) * 1e6:.1f} us", ""])
    start = time.perf_counter()
    cpu_kernel.captured_occurrences(_add)
    table.add("captured-tensor walk", [f"{(time.perf_counter() - start) * 1e6:.1f} us", ""])
    return table


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fscan.bench.kernel", description=__doc__)
    parser.add_argument("--threads", default="1,2", help="thread counts of the forward table")
    parser.add_argument("--forward-only", action="store_true", help="skip backward and latency")
    args = parser.parse_args(argv)
    threads = tuple(int(t) for t in args.threads.split(","))
    print(kernel_table(threads=threads).render(), flush=True)
    if args.forward_only:
        return
    print()
    print(backward_table().render(), flush=True)
    print()
    print(latency_table().render(), flush=True)


if __name__ == "__main__":
    main()
