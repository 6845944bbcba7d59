"""``initial=`` and ``exclusive=`` across ranks: one step of the sequence moved to the next
piece, then the inclusive sharded scan (any of its algorithms) as it is.

The exclusive output at step ``t`` is the carry into ``t`` (see :mod:`fscan._exclusive`).
On one device the door scans the first ``n - 1`` steps and places them one step later;
across ranks the step that moves sits on another rank. So the scan's inputs move
instead (:func:`shift_across`): each piece takes the last step (in scan order) of the
nearest non-empty piece before it, the first piece takes ``initial``, and the
inclusive scan of the moved sequence, restarted one step after each reset, is the
exclusive scan; where ``reset`` is True the start value is selected. The moved step is
one element per piece, gathered with one more ``all_gather`` (its backward one
``reduce_scatter``), so the values are exactly the inclusive algorithm's on other
inputs: ``deterministic=True`` stays bitwise independent of the split.

``initial=`` on the inclusive scan is then one ``combine_fn`` call per step:
``out[t] = combine_fn(exclusive[t], xs[t])`` (``xs[t]`` where a reset starts a segment).
The recurrences need no ``combine_fn``: their exclusive output is their inclusive
output moved one step the same way, the initial state (zero by default) at the first
step and zero at resets.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._call import ScanCall
from .._carry import check_initial
from .._combine import check_combine_output
from .._pytree import flatten, unflatten
from .._segmented import check_reset
from .exchange import exchange, tie
from .layout import Layout

__all__ = ["combine_steps", "exclusive_recurrence", "scan_with_start", "shift_across"]


def _last(x: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    """The last step of ``x`` in scan order, or zeros standing in for an empty piece's
    (computed from it, so that it stays in the graph: see ``_piece_total``)."""
    n = x.shape[dim]
    if n:
        return x.select(dim, 0 if reverse else n - 1)
    if x.is_floating_point() or x.is_complex():
        return x.sum(dim)
    return x.new_zeros(x.shape[:dim] + x.shape[dim + 1 :])


def _moved(x: torch.Tensor, dim: int, reverse: bool, boundary: torch.Tensor) -> torch.Tensor:
    """``x`` one step later in scan order, ``boundary`` entering at its first step."""
    n = x.shape[dim]
    if n == 0:
        return x
    head = boundary.unsqueeze(dim).to(x.dtype)
    if reverse:
        return torch.cat([x.narrow(dim, 1, n - 1), head], dim)
    return torch.cat([head, x.narrow(dim, 0, n - 1)], dim)


def shift_across(
    tensors: Sequence[torch.Tensor],
    dims: Sequence[int],
    starts: Sequence[torch.Tensor],
    reverse: bool,
    group: Any,
    layout: Layout | None,
    lengths: Sequence[int],
) -> list[torch.Tensor]:
    """Each of ``tensors`` (this rank's pieces, concatenated along its ``dims[i]``, of
    ``lengths``) moved one step later in the scan order of the whole sequence: a piece's
    first step is the last step of the nearest non-empty piece before it, on any rank,
    or ``starts[i]`` (one element) for the first piece of the sequence."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layout = layout or Layout.contiguous(world)
    bounds = [sum(lengths[:p]) for p in range(len(lengths))]
    pieces = [[x.narrow(d, s, n) for s, n in zip(bounds, lengths)] for x, d in zip(tensors, dims)]
    keys = layout.order
    # per local piece, the pieces before it in scan order (nearest last)
    mine = [
        sorted(
            (
                (keys[r][q], r, q)
                for r in range(world)
                for q in range(len(keys[r]))
                if (keys[r][q] > keys[rank][p] if reverse else keys[r][q] < keys[rank][p])
            ),
            reverse=reverse,
        )
        for p in range(len(lengths))
    ]
    if world == 1 and len(lengths) == 1:  # nothing before the only piece
        return [_moved(x, d, reverse, s) for x, d, s in zip(tensors, dims, starts)]
    lasts = [
        torch.stack([_last(piece, d, reverse) for piece in column])
        for column, d in zip(pieces, dims)
    ]
    device = tensors[0].device
    flags = torch.tensor([n > 0 for n in lengths], dtype=torch.bool, device=device)
    # `starts` are inputs of the gather, so that on every rank it leads to `initial`
    # (under autograd.grad(inputs=...), a rank whose pieces do not read `initial`
    # would prune it: see fscan._sharded.scan)
    anchors = [s for s in starts if s.requires_grad]
    gathered, anchor = exchange([*lasts, flags], group, anchors)
    nonempty = gathered.pop()
    outs = []
    for column, d, start, ends in zip(pieces, dims, starts, gathered):
        moved = []
        for p, piece in enumerate(column):
            boundary = start
            for _, r, q in mine[p]:  # in scan order: the nearest non-empty piece wins
                boundary = torch.where(nonempty[r, q], ends[r, q], boundary)
            moved.append(_moved(piece, d, reverse, boundary))
        outs.append(moved[0] if len(moved) == 1 else torch.cat(moved, d))
    # every rank runs the gather's backward: also the first piece and empty ones,
    # which do not read it
    return tie(anchor, outs)


def combine_steps(
    call: ScanCall, left: list[torch.Tensor], right: list[torch.Tensor], left_dim: int | None
) -> list[torch.Tensor]:
    """``combine_fn(left[t], right[t])`` at every step ``t`` along ``call.dim``, in one
    batched call; ``left_dim`` None: ``left`` is one element, combined into every step."""
    api, combine_fn, spec, dim = call.api, call.combine_fn, call.spec, call.dim
    if call.combine_mode == "pointwise":
        if left_dim is None:
            left = [p.unsqueeze(dim).expand_as(x) for p, x in zip(left, right)]
        out = combine_fn(unflatten(spec, left), unflatten(spec, right))
        if torch.compiler.is_compiling():
            # dynamo rebuilds pytree specs (namespace=''), so they never compare equal;
            # the local scans before this already checked combine_fn's output.
            return flatten(out)[0]
        return check_combine_output(api, out, spec, right, "pointwise")
    half = len(right)

    def one(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        left, right = list(flat[:half]), list(flat[half:])
        out = combine_fn(unflatten(spec, left), unflatten(spec, right))
        return tuple(check_combine_output(api, out, spec, right, "generic"))

    in_dims = (left_dim,) * half + (dim,) * half
    return list(torch.func.vmap(one, in_dims=in_dims, out_dims=dim)(*left, *right))


def _reset_along(reset: torch.Tensor, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """A checked ``reset=`` mask with its full length along its scan dimension, and
    that dimension (0 for a 1-D mask)."""
    if reset.ndim == 1:
        return reset, 0
    if reset.shape[dim] != x.shape[dim]:  # broadcast along the scan: expand it
        shape = list(reset.shape)
        shape[dim] = x.shape[dim]
        reset = reset.expand(shape)
    return reset, dim


def _select_at_resets(
    reset: torch.Tensor | None, chosen: list[torch.Tensor], outs: list, dim: int
) -> list[torch.Tensor]:
    """``outs`` with ``chosen`` (leaves like them, or one element each) where ``reset``
    is True."""
    if reset is None:
        return outs
    picked = []
    for c, y in zip(chosen, outs):
        flag = reset if reset.ndim == y.ndim else _as_leaf_mask(reset, y, dim)
        picked.append(torch.where(flag, c if c.ndim == y.ndim else c.unsqueeze(dim), y))
    return picked


def _as_leaf_mask(reset: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """A 1-D mask viewed along ``dim`` of ``y``."""
    return reset.reshape([y.shape[dim] if i == dim else 1 for i in range(y.ndim)])


def scan_with_start(
    call: ScanCall,
    group: Any,
    layout: Layout | None,
    lengths: Sequence[int],
    inclusive: Callable[[ScanCall], Any],
) -> Any:
    """``call`` (checked, with ``initial`` or ``exclusive``) across the ranks: the
    inclusive sharded scan (``inclusive``, any algorithm) of the moved sequence (module
    doc). ``lengths``: this rank's piece lengths."""
    api, leaves, dim, reverse, reset = call.api, call.leaves, call.dim, call.reverse, call.reset
    starts = check_initial(api, call.initial, call.xs, leaves, call.spec, dim)
    tensors, dims, begin = list(leaves), [dim] * len(leaves), list(starts)
    reset_dim = dim
    if reset is not None:
        check_reset(api, reset, call.xs, leaves, dim)
        reset, reset_dim = _reset_along(reset, leaves[0], dim)
        tensors.append(reset)
        dims.append(reset_dim)
        begin.append(
            torch.zeros((), dtype=torch.bool, device=reset.device).expand(
                reset.shape[:reset_dim] + reset.shape[reset_dim + 1 :]
            )
        )
    moved = shift_across(tensors, dims, begin, reverse, group, layout, lengths)
    inner = call._replace(
        xs=unflatten(call.spec, moved[: len(leaves)]),
        leaves=moved[: len(leaves)],
        reset=moved[len(leaves)] if reset is not None else None,
        initial=None,
        exclusive=False,
    )
    carried = _select_at_resets(reset, starts, flatten(inclusive(inner))[0], dim)
    if call.exclusive:
        return unflatten(call.spec, carried)
    out = combine_steps(call, carried, list(leaves), dim)
    if reset is not None:  # a segment's first step is its input
        out = _select_at_resets(reset, list(leaves), out, dim)
    return unflatten(call.spec, out)


def exclusive_recurrence(
    h: torch.Tensor,
    dim: int,
    reverse: bool,
    initial: torch.Tensor | None,
    reset: torch.Tensor | None,
    group: Any,
) -> torch.Tensor:
    """The exclusive form of a sharded recurrence's inclusive output ``h`` (one piece per
    rank): the state entering each step, ``initial`` (zero if None) at the first step
    of the sequence and zero where ``reset`` (broadcast to ``h``) is True."""
    element = h.shape[:dim] + h.shape[dim + 1 :]
    start = h.new_zeros(element) if initial is None else initial.to(h.dtype).expand(element)
    (moved,) = shift_across([h], [dim], [start], reverse, group, None, [h.shape[dim]])
    if reset is None:
        return moved
    return torch.where(reset, torch.zeros((), dtype=h.dtype, device=h.device), moved)
