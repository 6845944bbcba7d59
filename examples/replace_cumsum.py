"""Replacing torch.cumsum in existing code with fscan.cumsum.

``fscan.cumsum(input, dim, *, dtype=None, reverse=False)`` has torch's signature
and results, so the change is one word, and a flip/cumsum/flip becomes
``reverse=True``. On CPU it scans a strided dimension (dim 0 of a (T, B) tensor)
with fscan's parallel scan when that is faster than torch's kernel, and calls
torch's kernel otherwise.

Run: python examples/replace_cumsum.py
"""

import time

import torch

import fscan


# ---- existing code, written against torch ------------------------------------
def rewards_to_go(rewards: torch.Tensor) -> torch.Tensor:
    """(T, B) rewards -> the sum of each step's reward and all later ones."""
    return torch.cumsum(rewards.flip(0), 0).flip(0)


def running_mean(x: torch.Tensor) -> torch.Tensor:
    """(T, B) -> the mean of x[0..t] at every t."""
    counts = torch.arange(1, x.shape[0] + 1, dtype=x.dtype).unsqueeze(1)
    return torch.cumsum(x, 0) / counts


# ---- the same with fscan ------------------------------------------------------
def rewards_to_go_fscan(rewards: torch.Tensor) -> torch.Tensor:
    return fscan.cumsum(rewards, 0, reverse=True)  # no flipped copies


def running_mean_fscan(x: torch.Tensor) -> torch.Tensor:
    counts = torch.arange(1, x.shape[0] + 1, dtype=x.dtype).unsqueeze(1)
    return fscan.cumsum(x, 0) / counts


def median_ms(fn, *args, reps: int = 5) -> float:
    fn(*args)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


x = torch.randn(4096, 256, requires_grad=True)
for before, after in ((rewards_to_go, rewards_to_go_fscan), (running_mean, running_mean_fscan)):
    torch.testing.assert_close(after(x), before(x))
    cotangent = torch.randn(4096, 256)
    grad_before = torch.autograd.grad(before(x), x, cotangent)
    grad_after = torch.autograd.grad(after(x), x, cotangent)
    # sums of 4096 float32 values in another order: roundoff-level differences
    torch.testing.assert_close(grad_after, grad_before, rtol=1e-5, atol=1e-4)
    with torch.no_grad():
        ms_before, ms_after = median_ms(before, x), median_ms(after, x)
    print(f"{before.__name__:>13}: torch {ms_before:6.2f} ms, fscan {ms_after:6.2f} ms (forward)")

# Integer and bool inputs sum in int64, and dtype= casts first, as in torch.
counts = torch.tensor([[True, False], [True, True]])
assert torch.equal(fscan.cumsum(counts, 0), torch.cumsum(counts, 0))
assert fscan.cumsum(counts, 1, dtype=torch.float16).dtype == torch.float16
print("ok")
