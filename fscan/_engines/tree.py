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

``scan_functional`` is the same recursion out of place, for autograd and
``torch.func``: writing into views of one shared output would invalidate the
tensors a combine saved for backward and make every write a ``CopySlices``
node that clones the whole output in backward (O(n log n)); instead each level
returns a fresh tensor woven from its two halves with one ``stack``, so the
tape holds O(n) and its backward only splits and concatenates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._combine import FlatCombine

__all__ = [
    "SEQUENTIAL_CUTOFF",
    "scan_along",
    "scan_functional",
    "scan_functional_along",
    "scan_into",
]

SEQUENTIAL_CUTOFF = 4


def scan_along(
    combine: FlatCombine, leaves: Sequence[torch.Tensor], dim: int, reverse: bool = False
) -> list[torch.Tensor]:
    """Inclusive scan of ``leaves`` along ``dim`` into fresh contiguous tensors.

    ``out[0] = xs[0]``, ``out[i] = combine(out[i - 1], xs[i])``; with ``reverse``,
    ``out[-1] = xs[-1]``, ``out[i] = combine(out[i + 1], xs[i])`` (along ``dim``).

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
    del paired  # scanned into `out` already: free it before step 3 allocates
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


def scan_functional_along(
    combine: FlatCombine, leaves: Sequence[torch.Tensor], dim: int, reverse: bool = False
) -> list[torch.Tensor]:
    """:func:`scan_along` out of place: differentiable with autograd and ``torch.func``.

    Example:
        >>> add = lambda a, b: [a[0] + b[0]]
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> scan_functional_along(add, [x], dim=1)[0].sum().backward()
        >>> x.grad
        tensor([[3., 2., 1.],
                [3., 2., 1.]])
    """
    moved = scan_functional(combine, [x.movedim(dim, 0) for x in leaves], reverse)
    return [o.movedim(0, dim) for o in moved]


def scan_functional(
    combine: FlatCombine, xs: Sequence[torch.Tensor], reverse: bool = False
) -> list[torch.Tensor]:
    """:func:`scan_into` without in-place writes: the same pairs, recursion and fill-in.

    Operands are cut out with ``split`` and ``unbind`` rather than slices: their
    backward only concatenates, where a slice's backward zero-fills a tensor
    the size of the whole input for every use.
    """
    n = xs[0].shape[0]
    if n <= SEQUENTIAL_CUTOFF:
        return _sequential_functional(combine, xs, reverse)
    pairs, odd = n // 2, n % 2
    # The unpaired element (last, or first when reversed) is split off; the rest
    # is viewed as pairs.
    if reverse:
        heads, blocks = _split_each(xs, [odd, 2 * pairs])
    else:
        blocks, tails = _split_each(xs, [2 * pairs, odd])
    earlier, later = (list(t) for t in zip(*(b.unflatten(0, (pairs, 2)).unbind(1) for b in blocks)))
    # Step 1: one combine over all neighbouring pairs.
    paired = combine(later, earlier) if reverse else combine(earlier, later)
    # Step 2: their scan is the output at every second position.
    sub = scan_functional(combine, paired, reverse)
    # Step 3: the other positions, from the prefix next to each; the edge element
    # (first, or last when reversed) is the input itself.
    if reverse:
        sub_first, sub_rest = _split_each(sub, [1, pairs - 1])
        later_init, later_last = _split_each(later, [pairs - 1, 1])
        pieces = [combine(sub_rest, later_init), later_last]
        if odd:
            pieces.insert(0, combine(sub_first, heads))
    else:
        sub_init, sub_last = _split_each(sub, [pairs - 1, 1])
        earlier_first, earlier_rest = _split_each(earlier, [1, pairs - 1])
        pieces = [earlier_first, combine(sub_init, earlier_rest)]
        if odd:
            pieces.append(combine(sub_last, tails))
    others = [torch.cat(leaf_pieces) for leaf_pieces in zip(*pieces)]
    # Even positions hold `sub` when the pairs start at 0 in reverse, `others` otherwise.
    if reverse and not odd:
        return [_interleave(s, o) for s, o in zip(sub, others)]
    return [_interleave(o, s) for s, o in zip(sub, others)]


def _split_each(xs: Sequence[torch.Tensor], sizes: list[int]) -> list[list[torch.Tensor]]:
    """Split every leaf along dim 0 into ``sizes``; one list of leaves per piece."""
    return [list(piece) for piece in zip(*(x.split(sizes) for x in xs))]


def _interleave(evens: torch.Tensor, odds: torch.Tensor) -> torch.Tensor:
    """``[e0, o0, e1, o1, ...]`` along dim 0; ``evens`` may be one longer than ``odds``."""
    m = odds.shape[0]
    if evens.shape[0] == m:
        return torch.stack([evens, odds], dim=1).flatten(0, 1)
    paired, last = evens.split([m, 1])
    return torch.cat([torch.stack([paired, odds], dim=1).flatten(0, 1), last])


def _sequential_functional(
    combine: FlatCombine, xs: Sequence[torch.Tensor], reverse: bool
) -> list[torch.Tensor]:
    steps = [x.split(1) for x in xs]
    n = len(steps[0])
    order = range(n - 1, -1, -1) if reverse else range(n)
    rows: dict[int, list[torch.Tensor]] = {}
    acc: list[torch.Tensor] | None = None
    for i in order:
        step = [s[i] for s in steps]
        acc = step if acc is None else combine(acc, step)
        rows[i] = acc
    return [torch.cat([rows[i][k] for i in range(n)]) for k in range(len(xs))]
