"""``python -m fscan``: run the seed examples, check them, and print a short benchmark."""

from __future__ import annotations

import torch

import fscan


def _show(title: str, value: object, expected: object) -> None:
    ok = "ok" if value == expected else "MISMATCH"
    print(f"  {title:<46} {value}  [{ok}]")
    if value != expected:
        raise SystemExit(f"seed example {title!r} gave {value}, expected {expected}")


def seed_examples() -> None:
    """The contract's examples, in both modes, plus a non-commutative one."""
    xs = torch.arange(1, 5, dtype=torch.float32)
    print("seed examples (fscan.associative_scan over [1, 2, 3, 4]):")
    for mode in ("generic", "pointwise"):
        cumsum = fscan.associative_scan(lambda x, y: x + y, xs, dim=0, combine_mode=mode)
        cumprod = fscan.associative_scan(lambda x, y: x * y, xs, dim=0, combine_mode=mode)
        _show(f"cumsum, combine_mode={mode!r}", cumsum.tolist(), [1.0, 3.0, 6.0, 10.0])
        _show(f"cumprod, combine_mode={mode!r}", cumprod.tolist(), [1.0, 2.0, 6.0, 24.0])
    reverse = fscan.associative_scan(lambda x, y: x + y, xs, dim=0, reverse=True)
    _show("reverse cumsum", reverse.tolist(), [10.0, 9.0, 7.0, 4.0])
    shear = torch.tensor([[1.0, 1.0], [0.0, 1.0]]).expand(4, 2, 2)
    powers = fscan.associative_scan(torch.matmul, shear, 0, combine_mode="generic")
    _show("2x2 matrix products (generic), last", powers[-1].tolist(), [[1.0, 4.0], [0.0, 1.0]])
    a, b = torch.full((4,), 0.5), torch.ones(4)
    _, h = fscan.associative_scan(lambda x, y: (x[0] * y[0], y[0] * x[1] + y[1]), (a, b), 0)
    _show("h_t = 0.5 h_(t-1) + 1 (linear recurrence)", h.tolist(), [1.0, 1.5, 1.75, 1.875])


def main() -> None:
    seed_examples()
    print()
    from .bench.__main__ import main as bench_main

    bench_main(["--quick"])


if __name__ == "__main__":
    main()
