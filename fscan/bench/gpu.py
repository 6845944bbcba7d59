"""GPU benchmark: fscan's compiled pointwise scan (eager, and inside ``torch.compile``) against
torch.cumsum, torch's own compiled ``associative_scan`` and fscan generic, forward and
forward+backward, with effective bandwidth.

Run as ``python -m fscan.bench.gpu`` (``scripts/gpu_check.sh`` does) on a machine with
a CUDA device. Times are medians of ``torch.utils.benchmark.Timer`` blocks (which
synchronise the device around each block) after a warm-up call (which also pays
for compiling). Effective bandwidth is the forward's minimal traffic
(every input read once, every output written once) over its time, next to a
device-to-device copy of the same bytes: the ceiling a scan can approach.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import fscan

from ._timing import Table, median_time

__all__ = ["gpu_table"]

# (name, shape, dim): the workloads of the issue.
WORKLOADS = [("add", (2**24,), 0), ("add", (64, 4096, 256), 1), ("linrec", (8, 4096, 1024), 1)]
CONTENDERS = [
    "fscan pointwise",
    "fscan in torch.compile",
    "torch.cumsum",
    "torch compiled assoc_scan",
    "fscan generic",
]


def _linrec(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]


def _inputs(name: str, shape: tuple[int, ...], grad: bool) -> list[torch.Tensor]:
    make = [torch.randn] if name == "add" else [torch.rand, torch.randn]
    return [f(shape, device="cuda").requires_grad_(grad) for f in make]


def _forward(name: str, contender: str, dim: int) -> Callable[[list[torch.Tensor]], list] | None:
    """A function of the input leaves returning the output leaves, or None if not applicable."""
    combine = torch.add if name == "add" else _linrec
    as_xs = (lambda leaves: leaves[0]) if name == "add" else tuple
    as_list = (lambda out: [out]) if name == "add" else list
    if contender == "fscan pointwise":
        return lambda leaves: as_list(fscan.associative_scan(combine, as_xs(leaves), dim))
    if contender == "fscan generic":
        return lambda leaves: as_list(
            fscan.associative_scan(combine, as_xs(leaves), dim, combine_mode="generic")
        )
    if contender == "fscan in torch.compile":  # the HOP; with grad, its adjoint too
        inside = torch.compile(lambda xs: fscan.associative_scan(combine, xs, dim), fullgraph=True)
        return lambda leaves: as_list(inside(as_xs(leaves)))
    if contender == "torch.cumsum":
        return (lambda leaves: [torch.cumsum(leaves[0], dim)]) if name == "add" else None
    from torch._higher_order_ops.associative_scan import associative_scan

    compiled = torch.compile(lambda xs: associative_scan(combine, xs, dim), fullgraph=True)
    return lambda leaves: as_list(compiled(as_xs(leaves)))


def _time_or_none(fn: Callable[[], object]) -> float | None:
    try:
        return median_time(fn)
    except Exception as err:  # a contender that cannot run this workload: say why, keep going
        print(f"  ({type(err).__name__}: {str(err).splitlines()[0][:100]})", flush=True)
        return None


def _cell(seconds: float | None, reference: float | None) -> str:
    if seconds is None:
        return "n/a"
    ratio = f" ({seconds / reference:.2f}x)" if reference else ""
    return f"{seconds * 1e3:.3f} ms{ratio}"


def _row(name: str, shape: tuple[int, ...], dim: int, backward: bool) -> list[str]:
    leaves = _inputs(name, shape, grad=backward)
    grads = [torch.randn_like(x) for x in leaves]
    times: dict[str, float | None] = {}
    for contender in CONTENDERS:
        forward = _forward(name, contender, dim)
        # torch's associative_scan autograd materialises an n x n matrix per
        # element (and is wrong when combine_fn mixes leaves): not timed.
        if forward is None or (backward and contender == "torch compiled assoc_scan"):
            times[contender] = None
            continue
        if backward:
            run = lambda f=forward: torch.autograd.grad(f(leaves), leaves, grads)
        else:
            run = lambda f=forward: f(leaves)
        with torch.no_grad() if not backward else torch.enable_grad():
            times[contender] = _time_or_none(run)
    base = times["fscan pointwise"]
    cells = [_cell(times[c], base) for c in CONTENDERS]
    if backward:
        return [*cells, "", ""]
    nbytes = 2 * sum(x.nbytes for x in leaves)  # read the inputs, write the outputs
    copies = [torch.empty_like(x) for x in leaves]
    copy = median_time(lambda: [c.copy_(x) for c, x in zip(copies, leaves)])
    gbps = lambda t: "n/a" if t is None else f"{nbytes / t / 1e9:.0f}"
    return [*cells, gbps(base), gbps(copy)]


def gpu_table() -> Table | str:
    """Forward and forward+backward times per workload; ratio = time / fscan pointwise."""
    if not torch.cuda.is_available():
        return "GPU benchmark: skipped, no CUDA device."
    table = Table(
        f"GPU scans on {torch.cuda.get_device_name()}, float32 (median of Timer blocks; "
        "ratio = time / fscan pointwise; GB/s = 2 x input bytes / forward time)",
        [*CONTENDERS, "fscan pw GB/s", "d2d copy GB/s"],
    )
    for name, shape, dim in WORKLOADS:
        for backward in (False, True):
            label = f"{name} {shape} dim {dim} {'fwd+bwd' if backward else 'fwd'}"
            print(f"{label} ...", flush=True)
            table.add(label, _row(name, shape, dim, backward))
    return table


if __name__ == "__main__":
    result = gpu_table()
    print(result if isinstance(result, str) else result.render())
