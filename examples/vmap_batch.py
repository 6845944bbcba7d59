"""vmap over a batch of scans: one scan for the whole batch, per-example gradients.

Each example is a path of 2-D rigid motions (a rotation and a translation per
step, as a 3x3 homogeneous matrix); its poses are the prefix products of those
matrices, a generic-mode scan. ``torch.func.vmap`` runs it over a batch of paths
as one scan, and ``vmap(grad(...))`` gives every path its own gradient.

Run: python examples/vmap_batch.py
"""

import torch
from torch.func import grad, vmap

import fscan

torch.manual_seed(0)
batch, steps = 32, 200


def motions(turn: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(steps,) angles and (steps, 2) moves -> (steps, 3, 3) homogeneous matrices."""
    c, s = torch.cos(turn), torch.sin(turn)
    zero, one = torch.zeros_like(turn), torch.ones_like(turn)
    rows = [[c, -s, step[:, 0]], [s, c, step[:, 1]], [zero, zero, one]]
    return torch.stack([torch.stack(row, -1) for row in rows], -2)


def poses(turn: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Pose after every step of one path: M_0 @ M_1 @ ... @ M_t."""
    return fscan.associative_scan(torch.matmul, motions(turn, step), 0, combine_mode="generic")


def final_distance(turn: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    return poses(turn, step)[-1, :2, 2].norm()


turns = 0.1 * torch.randn(batch, steps, dtype=torch.float64)
moves = torch.rand(batch, steps, 2, dtype=torch.float64)

# The whole batch in one call.
batched = vmap(poses)(turns, moves)
for i in range(batch):  # the same as one path at a time, and as a sequential product
    torch.testing.assert_close(batched[i], poses(turns[i], moves[i]))
product = torch.linalg.multi_dot(list(motions(turns[7], moves[7])))
torch.testing.assert_close(batched[7, -1], product)

# One scan, not a loop over examples: as many combine calls for 32 paths as for 2.
calls = []


def counted(x, y):
    calls.append(1)
    return x @ y


def counted_poses(turn, step):
    return fscan.associative_scan(counted, motions(turn, step), 0, combine_mode="generic")


counts = []
for size in (2, 2, batch):  # the first call also runs fscan's one-time purity probe
    calls.clear()
    vmap(counted_poses)(turns[:size], moves[:size])
    counts.append(len(calls))
assert counts[1] == counts[2], counts
print(f"{counts[2]} combine calls for a batch of {batch} paths of {steps} steps")

# Per-example gradients: how each path's final distance depends on its turns.
per_path = vmap(grad(final_distance))(turns, moves)
for i in (0, 13, 31):
    torch.testing.assert_close(per_path[i], grad(final_distance)(turns[i], moves[i]))
sequential = lambda turn, step: torch.linalg.multi_dot(list(motions(turn, step)))[:2, 2].norm()
torch.testing.assert_close(per_path[13], grad(sequential)(turns[13], moves[13]))
print("per-path gradients:", tuple(per_path.shape))
print("ok")
