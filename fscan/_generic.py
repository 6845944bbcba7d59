"""The generic engine: a work-efficient parallel prefix scan in plain torch ops.

Summary of the algorithm (Blelloch 1990; the odd/even recursion of JAX's
``lax.associative_scan``), for leaves whose scan dimension is dimension 0:

1. Combine neighbouring elements pairwise: ``n // 2`` combines in one call.
2. Scan the pairs recursively. Their prefixes are the outputs at every second
   position, so the recursion writes them straight into strided views of the
   preallocated output.
3. Fill in the remaining positions with one more call, combining each with the
   prefix one step before it (which step 2 already wrote).

That is O(n) combine work in O(log n) sequential calls. ``reverse=True`` is
handled by aligning the pairs at the end of the sequence and letting the
accumulator sit on the right, instead of flipping copies of the data.
Lengths up to ``SEQUENTIAL_CUTOFF`` use a plain loop: for a handful of steps
the recursion would make as many calls for no gain.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._combine import FlatCombine

__all__ = ["SEQUENTIAL_CUTOFF", "generic_scan", "scan_along", "scan_into"]

SEQUENTIAL_CUTOFF = 4


def generic_scan(
    combine: FlatCombine, xs: Sequence[torch.Tensor], reverse: bool = False
) -> list[torch.Tensor]:
    """Inclusive scan of the flat leaves ``xs`` along dimension 0 into fresh tensors.

    ``out[0] = xs[0]``, ``out[i] = combine(out[i - 1], xs[i])``; with ``reverse``,
    ``out[-1] = xs[-1]``, ``out[i] = combine(out[i + 1], xs[i])``.

    Example:
        >>> add = lambda a, b: [a[0] + b[0]]
        >>> generic_scan(add, [torch.arange(1.0, 6.0)])
        [tensor([ 1.,  3.,  6., 10., 15.])]
    """
    out = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]
    scan_into(combine, xs, out, reverse)
    return out


def scan_along(
    combine: FlatCombine, leaves: Sequence[torch.Tensor], dim: int, reverse: bool = False
) -> list[torch.Tensor]:
    """Inclusive scan of ``leaves`` along ``dim`` into fresh contiguous tensors.

    The outputs are allocated in the layout of the inputs and the engine writes
    through ``movedim`` views of them, so neither ``dim`` nor ``reverse`` costs a copy.

    Example:
        >>> add = lambda a, b: [a[0] + b[0]]
        >>> scan_along(add, [torch.ones(2, 3)], dim=1)
        [tensor([[1., 2., 3.],
                [1., 2., 3.]])]
    """
    out = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in leaves]
    moved_in = [x.movedim(dim, 0) for x in leaves]
    scan_into(combine, moved_in, [o.movedim(dim, 0) for o in out], reverse)
    return out


def scan_into(
    combine: FlatCombine,
    xs: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
    reverse: bool,
) -> None:
    """Write the inclusive scan of ``xs`` into the (possibly strided) views ``out``."""
    n = xs[0].shape[0]
    if n <= SEQUENTIAL_CUTOFF:
        _sequential_into(combine, xs, out, reverse)
        return
    pairs = n // 2
    if reverse:
        # Pairs end at the last element; each pair's prefix lands on its first
        # element. The later element is the accumulator, so it goes on the left.
        start = n % 2
        earlier, later = slice(start, n, 2), slice(start + 1, n, 2)
        pair_dest = earlier
        rest, prev = slice(1 - start, n - 1, 2), slice(2 - start, n, 2)
        edge = n - 1
        left, right = later, earlier
    else:
        earlier, later = slice(0, 2 * pairs, 2), slice(1, 2 * pairs, 2)
        pair_dest = later
        rest, prev = slice(2, n, 2), slice(1, n - 1, 2)
        edge = 0
        left, right = earlier, later
    # Step 1: one combine over all neighbouring pairs.
    paired = combine([x[left] for x in xs], [x[right] for x in xs])
    # Step 2: their scan is the output at every second position.
    scan_into(combine, paired, [o[pair_dest] for o in out], reverse)
    # Step 3: the remaining positions, from the prefix next to each.
    filled = combine([o[prev] for o in out], [x[rest] for x in xs])
    for o, x, f in zip(out, xs, filled):
        o[edge].copy_(x[edge])
        o[rest].copy_(f)


def _sequential_into(
    combine: FlatCombine,
    xs: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
    reverse: bool,
) -> None:
    n = xs[0].shape[0]
    order = range(n - 1, -1, -1) if reverse else range(n)
    previous = None
    for i in order:
        step = slice(i, i + 1)
        if previous is None:
            for o, x in zip(out, xs):
                o[step].copy_(x[step])
        else:
            value = combine([o[previous] for o in out], [x[step] for x in xs])
            for o, v in zip(out, value):
                o[step].copy_(v)
        previous = step
