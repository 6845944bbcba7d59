"""The standalone loops of scripts/roofline.py: built with the kernel's own compiler flags
(Inductor's for this CPU plus ``fscan._engines.cpp._cpp_build.EXTRA_FLAGS``, including the
kernel's csrc/prelude.h and csrc/logaddexp.h) from ``scripts/roofline/*.cpp``, and each
checked against a plain sequential reference before any is timed: a floor is only a floor
of the work if the loop does it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "fscan" / "_engines" / "cpp" / "csrc"
ADD, MUL, MAX, AFFINE, LAE = range(5)
F32, F64, F64_RANGE = range(3)
ACC_NAMES = {F32: "float32 acc", F64: "double acc", F64_RANGE: "double acc + range check"}


def _flags() -> tuple[list[str], list[str]]:
    """The kernel's compile flags (Inductor's, without a vector ISA's, as the kernels are
    built, then fscan's EXTRA_FLAGS), minus what a Python extension sets itself."""
    from torch._inductor import cpp_builder
    from torch._inductor.cpu_vec_isa import invalid_vec_isa

    from fscan._engines.cpp._cpp_build import EXTRA_FLAGS

    opts = cpp_builder.CppTorchOptions(vec_isa=invalid_vec_isa, include_pytorch=False)
    skip = {"shared", "fPIC", "pedantic", "Wall"}
    cflags = [f"-{f}" for f in opts.get_cflags() if f not in skip]
    cflags += [a for a in " ".join(opts.get_passthrough_args()).split() if a]
    cflags += [f for f in EXTRA_FLAGS if not f.startswith("-l")]
    ldflags = ["-fopenmp", *(f for f in EXTRA_FLAGS if f.startswith("-l"))]
    return cflags, ldflags


def build():
    from torch.utils.cpp_extension import load

    cflags, ldflags = _flags()
    start = time.perf_counter()
    module = load(
        name="fscan_roofline",
        sources=[str(HERE / "roofline" / "loops.cpp")],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        extra_include_paths=[str(CSRC)],
    )
    print(
        f"loops built or loaded in {time.perf_counter() - start:.1f} s; flags: {' '.join(cflags)}"
    )
    return module


def build_reduce():
    """The reduce section's block loops (scripts/roofline/reduce_loops.cpp), same flags."""
    from torch.utils.cpp_extension import load

    cflags, ldflags = _flags()
    return load(
        name="fscan_roofline_reduce",
        sources=[str(HERE / "roofline" / "reduce_loops.cpp")],
        extra_cflags=cflags,
        extra_ldflags=ldflags,
    )


def address(t: torch.Tensor | None) -> int:
    """The data pointer a loop takes (0 for a leaf the row does not have)."""
    return 0 if t is None else t.data_ptr()


def _affine_reference(a: torch.Tensor, b: torch.Tensor, dim: int):
    """The affine pair's inclusive scan, one step at a time, in double."""
    a, b = a.double().movedim(dim, 0), b.double().movedim(dim, 0)
    pa, pb = a.clone(), b.clone()
    for t in range(1, a.shape[0]):
        pa[t] = pa[t - 1] * a[t]
        pb[t] = a[t] * pb[t - 1] + b[t]
    return pa.movedim(0, dim).float(), pb.movedim(0, dim).float()


def _segmented_reference(op: int, x: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """A step loop in double along dim 0: each lane restarts at its element where flagged."""
    acc, out = x[0].double(), [x[0]]
    for t in range(1, x.shape[0]):
        u = x[t].double()
        acc = torch.where(flags[t], u, acc + u if op == ADD else acc * u)
        out.append(acc.float())
    return torch.stack(out)


def check(m) -> None:
    """Every loop against a plain sequential reference (torch's cumulative ops, or a step
    loop in double), on small shapes: a floor is only a floor of the work if it does it."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(300, 32, generator=gen)
    a = torch.rand(300, 32, generator=gen) * 0.5 + 0.5
    b = torch.randn(300, 32, generator=gen)
    close = lambda got, want: torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    refs = {
        ADD: lambda t, dim: torch.cumsum(t.double(), dim).float(),
        MUL: lambda t, dim: torch.cumprod(t.double(), dim).float(),
        MAX: lambda t, dim: torch.cummax(t, dim).values,
        LAE: lambda t, dim: torch.logcumsumexp(t.double(), dim).float(),
    }
    for op, ref in refs.items():
        data = a if op == MUL else x
        for acc in (F32, F64, F64_RANGE):
            y = torch.empty_like(data)
            m.lane_scan(op, acc, address(data), 0, address(y), 0, *data.shape, True)
            close(y, ref(data, 0))
            m.lane_two(op, acc, address(data), 0, address(y), 0, *data.shape, False)
            close(y, ref(data, 0))
            m.lane_scan(op, acc, address(data), 0, address(y), 0, *data.shape, False)
            close(y[0], ref(data, 0)[-1])
            rows = data.t().contiguous()  # 32 chains of 300 steps: 288 of them in tiles
            rows = rows[:, :288].contiguous()
            yc = torch.empty_like(rows)
            m.chain_scan(op, acc, address(rows), 0, address(yc), 0, 32, 288, 1)
            close(yc, ref(rows, 1))
            m.chain_scan(op, acc, address(rows), 0, address(yc), 0, 32, 288, 2)
            close(yc.flatten(), ref(rows.flatten(), 0))
            m.chain_scan(op, acc, address(rows), 0, address(yc), 0, 32, 288, 0)
            close(yc, rows)
    want = _affine_reference(a, b, 0)
    for acc in (F32, F64, F64_RANGE):
        ya, yb = torch.empty_like(a), torch.empty_like(b)
        m.lane_scan(AFFINE, acc, address(a), address(b), address(ya), address(yb), 300, 32, True)
        close((ya, yb), want)
        m.lane_two(AFFINE, acc, address(a), address(b), address(ya), address(yb), 300, 32, False)
        close((ya, yb), want)
        m.lane_scan(AFFINE, acc, address(a), address(b), address(ya), address(yb), 300, 32, False)
        close((ya[0], yb[0]), (want[0][-1], want[1][-1]))
        ra, rb = (t.t()[:, :288].contiguous() for t in (a, b))
        ca, cb = torch.empty_like(ra), torch.empty_like(rb)
        m.chain_scan(AFFINE, acc, address(ra), address(rb), address(ca), address(cb), 32, 288, 1)
        close((ca, cb), _affine_reference(ra, rb, 1))
        m.chain_scan(AFFINE, acc, address(ra), address(rb), address(ca), address(cb), 32, 288, 2)
        flat = _affine_reference(ra.flatten(), rb.flatten(), 0)
        close((ca.flatten(), cb.flatten()), flat)
    rows = x.t().contiguous()[:, :288].contiguous()  # 32 rows of 288 steps
    for dbl in (False, True):
        yc = torch.empty_like(rows)
        m.prefix_add(dbl, address(rows), address(yc), 32, 288, 1)
        close(yc, torch.cumsum(rows.double(), 1).float())
        m.prefix_add(dbl, address(rows), address(yc), 4, 32 * 288 // 4, 2)
        close(yc.flatten(), torch.cumsum(rows.flatten().double(), 0).float())
        for checked in (False, True):
            m.prefix_max(checked, address(rows), address(yc), 32, 288)
            torch.testing.assert_close(yc, torch.cummax(rows, 1).values, rtol=0, atol=0)
    flags = torch.rand(300, 32, generator=gen) < 0.05
    for op, ref in ((ADD, torch.cumsum), (MUL, torch.cumprod)):
        data = a if op == MUL else x
        ys = torch.empty_like(data)
        m.seg_lane_scan(op, True, address(data), address(flags), address(ys), *data.shape)
        close(ys, _segmented_reference(op, data, flags))
        m.seg_lane_scan(op, False, address(data), address(flags), address(ys), *data.shape)
        close(ys, ref(data.double(), 0).float())
    y = torch.empty_like(x)
    m.select(address(y), address(x), address(flags), x.numel())
    close(y, torch.where(flags, x, -x))
    m.copy(address(y), address(x), x.numel())
    close(y, x)
    m.log1p_exp(address(y), address(x), x.numel())
    close(y, torch.log1p(torch.exp(-x.abs())))
    m.logaddexp(address(y), address(x), address(b), x.numel())
    close(y, torch.logaddexp(x, b))
    print("every loop matches its sequential reference\n")
