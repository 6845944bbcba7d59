"""The exchange of piece totals across ranks, with its autograd (:func:`exchange`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._pytree import flatten
from .agree import CURRENT_CALL, agree
from .layout import Layout

__all__ = ["exchange", "exchange_bytes", "tie"]

# ---- the exchange --------------------------------------------------------------


_C10D = torch.ops._c10d_functional


def _gathered(flat: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """The ranks' ``flat`` buffers one after the other: the functional ``all_gather``."""
    return _C10D.wait_tensor(_C10D.all_gather_into_tensor(flat.contiguous(), world, group_name))


class _AllGather(torch.autograd.Function):
    """``flat`` (k,) from every rank -> (W * k,); backward: :class:`_ReduceScatter`.

    Both call torch's functional (out-of-place) collective ops
    (``torch.ops._c10d_functional``) with the group by name, so ``torch.func``
    transforms see ordinary ops; the ``vmap`` rules fold the batch into the one
    collective (``jacrev`` vmaps the backward). ``anchors`` (the differentiable
    tensors ``combine_fn`` closes over) are inputs only so that the gather leads to
    them in every rank's graph: a rank whose totals do not depend on them (a
    one-element piece) would otherwise prune the backward collective under
    ``autograd.grad(inputs=...)`` while the others run it. No gradient goes to them.
    """

    @staticmethod
    def forward(
        flat: torch.Tensor, group_name: str, world: int, *anchors: torch.Tensor
    ) -> torch.Tensor:
        return _gathered(flat, group_name, world)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.group_name, ctx.world = inputs[1], inputs[2]
        ctx.anchors = len(inputs) - 3
        ctx.like = (inputs[0].shape, inputs[0].dtype, inputs[0].device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        mine = _ReduceScatter.apply(grad, ctx.group_name, ctx.world)
        return (mine, None, None, *([None] * ctx.anchors))

    @staticmethod
    def vmap(
        info: Any,
        in_dims: tuple,
        flat: torch.Tensor,
        group_name: str,
        world: int,
        *anchors: torch.Tensor,
    ) -> tuple[torch.Tensor, int]:
        rows = _batch_first(flat, in_dims[0], info.batch_size)  # (B, k)
        out = _AllGather.apply(rows.reshape(-1), group_name, world)  # (W * B * k,)
        batch, k = rows.shape
        return out.view(world, batch, k).transpose(0, 1).reshape(batch, world * k), 0


class _AllGatherJvp(_AllGather):
    """:class:`_AllGather` with a forward-mode rule, for eager calls: Dynamo refuses to
    trace a Function that defines ``jvp``, so traced calls use the plain one."""

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor | None, *rest: Any) -> torch.Tensor:
        """The gather is linear, so the tangents are gathered too (zeros from a rank
        whose totals have none: every rank runs the collective)."""
        if tangent is None:
            shape, dtype, device = ctx.like
            tangent = torch.zeros(shape, dtype=dtype, device=device)
        return _AllGather.apply(tangent, ctx.group_name, ctx.world)


class _ReduceScatter(torch.autograd.Function):
    """(W * k,) from every rank -> this rank's (k,) block of their sum; backward: gather."""

    @staticmethod
    def forward(grad: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
        out = _C10D.reduce_scatter_tensor(grad.contiguous(), "sum", world, group_name)
        return _C10D.wait_tensor(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.group_name, ctx.world = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return _AllGather.apply(grad, ctx.group_name, ctx.world), None, None

    @staticmethod
    def jvp(ctx: Any, tangent: torch.Tensor, *rest: Any) -> torch.Tensor:
        return _ReduceScatter.apply(tangent, ctx.group_name, ctx.world)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple, grad: torch.Tensor, group_name: str, world: int
    ) -> tuple[torch.Tensor, int]:
        rows = _batch_first(grad, in_dims[0], info.batch_size)  # (B, W * k)
        batch = rows.shape[0]
        blocks = rows.reshape(batch, world, -1).transpose(0, 1).reshape(-1)  # (W, B, k)
        return _ReduceScatter.apply(blocks, group_name, world).view(batch, -1), 0


def _batch_first(x: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """``x`` with its vmap batch dimension first (expanded if it has none)."""
    return x.unsqueeze(0).expand(size, *x.shape) if dim is None else x.movedim(dim, 0)


class _Tie(torch.autograd.Function):
    """``outs`` unchanged, with ``anchor`` (the gathered buffer) in their graph: see the
    module docstring. Its backward hands ``anchor`` zeros without arithmetic on values
    (``0 * g`` is NaN where ``g`` is infinite), made from ``zeros_like`` of a cotangent
    so that under ``vmap`` (``jacrev``) they carry the batch like every other rank's."""

    @staticmethod
    def forward(anchor: torch.Tensor, *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.like = (inputs[0].shape, inputs[0].dtype)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        shape, dtype = ctx.like
        zero = torch.zeros_like(grads[0], dtype=dtype).sum()
        return (zero.expand(shape), *grads)

    @staticmethod
    def jvp(ctx: Any, anchor: torch.Tensor | None, *tangents: torch.Tensor) -> tuple:
        return tuple(t.view_as(t) for t in tangents)


# Traced, each rank's collectives must run in the same order as every other rank's, and
# all of them. The functional collectives count as pure ops, so a compiler may drop or
# move a gather whose result nothing on that rank reads (the first rank in scan order,
# an empty piece): AOTAutograd's partitioners left it out of the forward graph while the
# backward still ran its reduce_scatter (the ranks' calls no longer paired up: a hang),
# and placed two reduce_scatters that no data ordered in either order (paired with the
# wrong peers: wrong gradients). Two opaque ops put the gather in those ranks' data flow
# both ways: `fscan::tied` reads the gathered buffer and returns copies of the results
# (so the gather runs before anything that uses them), and its backward's zeros for the
# buffer come from `fscan::tied_zeros`, which reads the results' cotangents (so the
# reduce_scatter runs after everything that produced them), as on the ranks whose
# results read the buffer. The copies cost one pass over those ranks' results, under
# torch.compile only.
@torch.library.custom_op("fscan::tied", mutates_args=())
def _tied(anchor: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [o.clone() for o in outs]


@_tied.register_fake
def _(anchor: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(o) for o in outs]


@torch.library.custom_op("fscan::tied_zeros", mutates_args=())
def _tied_zeros(anchor: torch.Tensor, after: list[torch.Tensor]) -> torch.Tensor:
    """Zeros like ``anchor``, once ``after`` exist (no arithmetic on their values:
    ``0 * g`` is NaN where ``g`` is infinite)."""
    return torch.zeros_like(anchor)


@_tied_zeros.register_fake
def _(anchor: torch.Tensor, after: list[torch.Tensor]) -> torch.Tensor:
    return torch.empty_like(anchor)


def _tied_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(inputs[0])


def _tied_backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple:
    (anchor,) = ctx.saved_tensors
    after = [g for g in grads if g is not None]
    return _tied_zeros(anchor, after), list(grads)


_tied.register_autograd(_tied_backward, setup_context=_tied_setup)


def tie(anchor: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``outs``, with ``anchor`` (the gathered buffer) in their graph (module docstring)."""
    if torch.compiler.is_compiling():
        return list(_tied(anchor, list(outs)))
    if not anchor.requires_grad or not torch.is_grad_enabled():
        return outs
    return list(_Tie.apply(anchor, *outs))


@dataclass(frozen=True)
class _Slot:
    """Where one leaf's totals sit in the packed row of one rank."""

    start: int
    stop: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    as_bytes: bool


def _carrier_dtype(totals: Sequence[torch.Tensor]) -> torch.dtype:
    """One dtype for the whole exchange: the promoted real type of the floating leaves
    (exact for every floating leaf), else bytes."""
    carrier = None
    for t in totals:
        if t.is_floating_point() or t.is_complex():
            real = t.real.dtype if t.is_complex() else t.dtype
            carrier = real if carrier is None else torch.promote_types(carrier, real)
    return torch.uint8 if carrier is None else carrier


def _pack(totals: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[_Slot]]:
    """Flatten every leaf's totals into one 1-D tensor of the carrier dtype.

    Floating leaves are cast (exactly, to a wider or equal type) so gradients flow;
    integer and bool leaves are bit-copied (they carry no gradient), so one
    collective moves every dtype.
    """
    carrier = _carrier_dtype(totals)
    size = carrier.itemsize
    parts, slots, start = [], [], 0
    for t in totals:
        shape = tuple(t.shape)
        if t.is_floating_point() or t.is_complex():
            part = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1).to(carrier)
            as_bytes = False
        else:
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
            pad = -raw.numel() % size
            raw = torch.cat([raw, raw.new_zeros(pad)]) if pad else raw
            part = raw.view(carrier) if carrier != torch.uint8 else raw
            as_bytes = True
        parts.append(part)
        slots.append(_Slot(start, start + part.numel(), t.dtype, shape, as_bytes))
        start += part.numel()
    return torch.cat(parts) if len(parts) > 1 else parts[0], slots


def _unpack(rows: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """One leaf's totals from every rank, shape ``(W, *slot.shape)``, from the (W, k) rows."""
    cols = rows[:, slot.start : slot.stop]
    world = rows.shape[0]
    if slot.as_bytes:
        # a copy: the slice of one rank's row keeps its storage offset, which a view
        # as another dtype may not accept (one rank: `contiguous()` would not copy)
        raw = cols.clone(memory_format=torch.contiguous_format).view(torch.uint8)
        count = 1
        for s in slot.shape:
            count *= s
        size = slot.dtype.itemsize
        return raw[:, : count * size].contiguous().view(slot.dtype).reshape(world, *slot.shape)
    if slot.dtype.is_complex:
        real = cols.to(slot.dtype.to_real())
        return torch.view_as_complex(real.reshape(world, *slot.shape, 2))
    return cols.to(slot.dtype).reshape(world, *slot.shape)


def exchange(
    totals: Sequence[torch.Tensor], group: Any, anchors: Sequence[torch.Tensor] = ()
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """All-gather ``totals`` (tensors of any dtypes) in one collective.

    Returns each leaf gathered, ``(W, *shape)``, and the gathered flat buffer (the
    anchor that :func:`tie` puts into results that do not depend on it).
    """
    flat, slots = _pack(totals)
    world = dist.get_world_size(group)
    needs_grad = torch.is_grad_enabled() and (
        flat.requires_grad or any(a.requires_grad for a in anchors)
    )
    state = None if torch.compiler.is_compiling() else CURRENT_CALL.get()
    if state is not None and not state.agreed:  # the first exchange of a call: agree first
        state.more = [
            ("elements exchanged", None, f"{flat.numel()} of {flat.dtype}"),
            ("a backward exchange (grad mode, requires_grad)", None, str(needs_grad)),
        ]
        agree(state)
    if torch.compiler.is_compiling() and not needs_grad:
        # the functional collective alone: Dynamo calls a setup_context Function that
        # no input requires grad of with its context as the first input (`flat` came
        # in as the Function: "'Function' object has no attribute 'contiguous'")
        gathered = _gathered(flat, group.group_name, world)
    else:
        live = [a for a in anchors if a.requires_grad] if needs_grad else []
        gather = _AllGather if torch.compiler.is_compiling() else _AllGatherJvp
        gathered = gather.apply(flat, group.group_name, world, *live)
    rows = gathered.view(world, flat.numel())
    return [_unpack(rows, slot) for slot in slots], gathered


def exchange_bytes(
    xs: Any, dim: int, world_size: int, layout: Layout | None = None
) -> dict[str, int]:
    """Bytes one rank sends and receives per forward call of
    ``fscan.distributed.associative_scan`` (the backward moves as much again): one
    element per piece, plus the piece lengths when ``layout`` does not give them;
    independent of the length.

    Example:
        >>> exchange_bytes(torch.zeros(1000, 256), 0, 4, Layout.contiguous(4, [1000] * 4))
        {'send': 1024, 'recv': 4096}
        >>> exchange_bytes(torch.zeros(1000, 256), 0, 4)  # + one int64 length
        {'send': 1032, 'recv': 4128}
    """
    leaves, _ = flatten(xs)
    pieces = 1 if layout is None else layout.pieces
    totals = [
        (x.select(dim, 0) if x.shape[dim] else x.sum(dim))
        .unsqueeze(0)
        .expand(pieces, *x.shape[:dim], *x.shape[dim + 1 :])
        for x in leaves
    ]
    if layout is None or layout.lengths is None:
        totals.append(torch.zeros(pieces, dtype=torch.int64, device=leaves[0].device))
    flat, _ = _pack(totals)
    send = flat.numel() * flat.element_size()
    return {"send": send, "recv": world_size * send}
