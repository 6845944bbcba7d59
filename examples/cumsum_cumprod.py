"""The contract's first examples: a cumulative sum and a cumulative product, in both modes.

Run: python examples/cumsum_cumprod.py
"""

import torch

import fscan


def add(x, y):
    return x + y


def mul(x, y):
    return x * y


xs = torch.arange(1, 5, dtype=torch.float32)  # [1, 2, 3, 4]
for mode in ("generic", "pointwise"):
    cumsum = fscan.associative_scan(add, xs, dim=0, combine_mode=mode)
    cumprod = fscan.associative_scan(mul, xs, dim=0, combine_mode=mode)
    assert cumsum.tolist() == [1.0, 3.0, 6.0, 10.0], cumsum
    assert cumprod.tolist() == [1.0, 2.0, 6.0, 24.0], cumprod
    print(f"{mode:>9}: cumsum {cumsum.tolist()}, cumprod {cumprod.tolist()}")

# The same in reverse, and along another dimension of a 2-D tensor.
assert fscan.associative_scan(add, xs, 0, reverse=True).tolist() == [10.0, 9.0, 7.0, 4.0]
grid = torch.arange(1.0, 7.0).reshape(2, 3)
torch.testing.assert_close(fscan.associative_scan(mul, grid, dim=1), grid.cumprod(1))
print("ok")
