"""The matrix recurrence ``h_t = A_t @ h_{t-1} + B_t`` by the odd/even tree.

The odd/even scan of :mod:`fscan._engines.tree` (combine neighbouring pairs, scan
the pairs, fill in the rest), specialised to the affine maps ``h -> A h + B``
(:func:`matrix_scan`; ``fscan._linear_matrix`` says what it does with shared
gates, resets and ``initial``), and the sequential loop (:func:`matrix_walk`),
for short levels and where the tree's products of gates left the floats' range.
The router (:mod:`fscan._routing.recurrence`) picks between them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MatrixMaps", "matrix_scan", "matrix_walk"]

# Up to this many elements a level walks sequentially: the recursion's two
# batched calls per level buy nothing on a handful of steps.
_SEQUENTIAL_CUTOFF = 4


class MatrixMaps(NamedTuple):
    """The maps ``h -> gate_i @ h + z_i``, time first, and the state ``carry`` (or None:
    0) before them. ``gates`` is one gate for every element (``shared``) or one per
    element; ``flags[i]`` says element ``i`` drops what comes before it."""

    z: torch.Tensor
    gates: torch.Tensor
    flags: torch.Tensor | None
    carry: torch.Tensor | None
    shared: bool


def matrix_scan(maps: MatrixMaps) -> torch.Tensor:
    """All prefixes of the maps applied to their ``carry``, time first."""
    z, gates, flags, carry, shared = maps
    m = z.shape[0]
    if m <= _SEQUENTIAL_CUTOFF:
        return matrix_walk(maps)
    p = m // 2
    left, right = slice(0, 2 * p, 2), slice(1, 2 * p, 2)
    f_right = None if flags is None else flags[right]
    g_left, g_right = (gates, gates) if shared else (gates[left], gates[right])
    # Step 1: compose neighbouring pairs, the later one masking the earlier where it resets.
    pair_z = _apply(g_right, _drop(z[left], f_right), shared) + z[right]
    pair_gates = gates @ gates if shared else g_right @ _drop(g_left, f_right)
    pair_flags = None if flags is None else flags[left] | f_right
    # Step 2: their prefixes are the states at the odd positions.
    odd = matrix_scan(MatrixMaps(pair_z, pair_gates, pair_flags, carry, shared))
    # Step 3: the even positions, each from the state just before it.
    f_even = None if flags is None else flags[2::2]
    g_even = gates if shared else gates[2::2]
    rest = _apply(g_even, _drop(odd[: (m - 1) // 2], f_even), shared) + z[2::2]
    first = z[:1]
    if carry is not None:
        g_first = gates if shared else gates[:1]
        f_first = None if flags is None else flags[:1]
        first = _apply(g_first, _drop(carry.unsqueeze(0), f_first), shared) + first
    even = torch.cat([first, rest])
    woven = torch.stack([even[:p], odd], 1).flatten(0, 1)
    return woven if m == 2 * p else torch.cat([woven, even[p:]])


def matrix_walk(maps: MatrixMaps) -> torch.Tensor:
    """The sequential loop, for short levels."""
    z, gates, flags, carry, shared = maps
    states, h = [], carry
    for t in range(z.shape[0]):
        if h is None:
            h = z[t]
        else:
            gate = gates if shared else gates[t]
            h = _apply(gate, _drop(h, None if flags is None else flags[t]), shared, 0) + z[t]
        states.append(h)
    return torch.stack(states)


def _apply(gate: torch.Tensor, h: torch.Tensor, shared: bool, time: int = 1) -> torch.Tensor:
    """``gate @ h`` for states ``h`` (with ``time`` leading dimensions), as one einsum.

    ``torch.matmul`` would broadcast a shared ``(d, d)`` gate to every step (a
    ``(steps, d, d)`` copy, d times the states' size for vector states) before its
    batched product; einsum folds the steps into the product instead.
    """
    if shared and time:
        return torch.einsum("...ij,t...jk->t...ik", gate, h)
    return torch.einsum("...ij,...jk->...ik", gate, h)


def _drop(h: torch.Tensor, flag: torch.Tensor | None) -> torch.Tensor:
    """``h`` with zeros where ``flag`` is set: a where, not a product, so inf stays out."""
    return h if flag is None else torch.where(flag, 0, h)
