"""Scans over a sequence sharded across the ranks of a ``torch.distributed`` group.

Each rank holds pieces of one long sequence along ``dim`` (by default one
contiguous piece per rank, in rank order) and gets back its pieces of the scan of
the whole sequence. The classic block scan (MPI_Exscan):

1. scan each local piece with fscan; its total is its last element (first, in
   reverse);
2. exchange the totals with one ``all_gather`` of one element per piece
   (:class:`_AllGather`; its backward is one ``reduce_scatter``);
3. fold the totals of the pieces before each local piece (after it, in reverse)
   into its exclusive prefix ``P`` with a scan of at most ``W * K`` elements, and
   combine ``P`` into every local result with one ``combine_fn`` call.

Before step 2 the ranks agree (:func:`_agree`, one 16-byte ``all_gather``): the
same call on every rank, and no rank failed, else every rank raises.
Under ``torch.compile`` every call is refused at the entry.

Only totals cross ranks, so the exchange does not grow with the length.
Gradients come from autograd: the gather's transpose returns to each piece's
total the cotangents of the later ranks' folds.

Every rank must run the backward collective, also ranks whose results do not
depend on the gathered totals (nothing before them, or empty pieces), and also
under ``torch.autograd.grad(..., inputs=...)``, which prunes graph nodes that do
not lead to the requested inputs. :class:`_Tie` puts the gathered tensor into
those ranks' graphs without arithmetic (``0 * total`` would turn an infinite
total into NaN), empty pieces send zeros computed from the piece, and the
tensors ``combine_fn`` closes over are extra inputs of the gather, so the
gather leads to the same requested inputs on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from optree import PyTreeSpec

from ._checks import check_scan_args
from ._combine import check_combine_output
from ._errors import PeerRankError, ScanTypeError, ScanValueError, UnsupportedScanError
from ._knowledge import reach
from ._pytree import describe, flatten, leaf_paths, unflatten

__all__ = [
    "Layout",
    "associative_scan",
    "exchange_bytes",
    "failing_together",
    "linear_recurrence",
    "resolve_group",
    "sharded_recurrence",
    "sharded_scan",
]

_API = "fscan.distributed.associative_scan"
_API_LINEAR = "fscan.distributed.linear_recurrence"


# ---- where the pieces live ----------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Where the pieces of the global sequence live: the same table on every rank.

    ``order[r]`` lists the global positions (any distinct ints; only their order
    matters) of the pieces rank ``r`` holds, concatenated along ``dim`` in that
    order; every rank holds the same number ``K`` of pieces. ``lengths[r][p]`` is
    the length of rank ``r``'s piece ``p``, known statically; it is required
    when ``K > 1``. With ``lengths=None`` (one piece per rank) the lengths are
    exchanged with the totals and read on the host (a device sync on GPUs), so
    that empty pieces can be skipped; give them to avoid that.

    Example:
        >>> Layout.contiguous(3, lengths=[4, 0, 4]).order
        ((0,), (1,), (2,))
        >>> Layout.head_tail(2, local_length=6)  # torch context parallel's order
        Layout(order=((0, 3), (1, 2)), lengths=((3, 3), (3, 3)))
    """

    order: tuple[tuple[int, ...], ...]
    lengths: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        order = tuple(tuple(int(k) for k in row) for row in self.order)
        object.__setattr__(self, "order", order)
        pieces = {len(row) for row in order}
        if not order or len(pieces) != 1 or 0 in pieces:
            raise ScanValueError(
                f"fscan.distributed.Layout: `order` must list the same number (>= 1) of "
                f"pieces for every rank, got {order}."
            )
        keys = [k for row in order for k in row]
        if len(set(keys)) != len(keys):
            raise ScanValueError(
                f"fscan.distributed.Layout: the positions in `order` must be distinct, got {order}."
            )
        if self.lengths is None:
            if pieces != {1}:
                raise ScanValueError(
                    "fscan.distributed.Layout: `lengths` is required with several pieces "
                    "per rank (each rank splits its tensor by them)."
                )
            return
        lengths = tuple(tuple(int(n) for n in row) for row in self.lengths)
        if [len(row) for row in lengths] != [len(row) for row in order] or any(
            n < 0 for row in lengths for n in row
        ):
            raise ScanValueError(
                f"fscan.distributed.Layout: `lengths` {lengths} must give a length >= 0 for "
                f"each piece of `order` {order}."
            )
        object.__setattr__(self, "lengths", lengths)

    @classmethod
    def contiguous(cls, world_size: int, lengths: Sequence[int] | None = None) -> Layout:
        """One piece per rank, in rank order, with static ``lengths`` if given."""
        rows = None if lengths is None else tuple((n,) for n in lengths)
        return cls(tuple((r,) for r in range(world_size)), rows)

    @classmethod
    def head_tail(cls, world_size: int, local_length: int) -> Layout:
        """torch context parallel's load-balanced order: the sequence in ``2 W`` equal
        chunks, rank ``r`` holding chunk ``r`` then chunk ``2 W - 1 - r``."""
        if local_length % 2:
            raise ScanValueError(
                f"fscan.distributed.Layout.head_tail: `local_length` {local_length} must be "
                "even (two equal chunks per rank)."
            )
        half = local_length // 2
        order = tuple((r, 2 * world_size - 1 - r) for r in range(world_size))
        return cls(order, tuple((half, half) for _ in range(world_size)))

    @property
    def pieces(self) -> int:
        return len(self.order[0])


def resolve_group(api: str, group: Any) -> Any:
    """A ProcessGroup from ``group``: None (the default group), a ProcessGroup, a 1-D
    DeviceMesh, or ``(mesh, mesh_dim)``."""
    if not dist.is_available() or not dist.is_initialized():
        raise ScanValueError(
            f"{api}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() on every rank first."
        )
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    mesh_type = _device_mesh_type()
    if isinstance(group, mesh_type):
        if group.ndim != 1:
            raise ScanValueError(
                f"{api}: `group` is a {group.ndim}-D DeviceMesh; pass (mesh, mesh_dim) to name "
                "the dimension that shards the sequence."
            )
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], mesh_type):
        return group[0].get_group(group[1])
    raise ScanTypeError(
        f"{api}: `group` must be None, a ProcessGroup, a 1-D DeviceMesh or (mesh, mesh_dim), "
        f"got {type(group).__name__}."
    )


def _device_mesh_type() -> type:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh


# ---- agreeing on the call: the SPMD checks --------------------------------------
#
# A collective only works when every rank enters it with buffers of one size: a rank
# that raises before it (a wrong argument, an error inside combine_fn on its data)
# leaves the others waiting until the group's timeout, and ranks whose leaves differ
# in element shape or dtype make gloo abort the process (or, where the sizes happen
# to match, mix up bytes silently). So every call with peers first all-gathers a
# fixed-size digest, two int64 words per rank: a status (0: ready, 1: raised) and a
# hash of the facts the exchange depends on. Only when the words differ do the ranks
# gather the facts themselves (all_gather_object) to say who differs in what; every
# rank sees the same words, so every rank takes the same path and raises.


Facts = list[tuple[str, int | None, str]]  # (what, leaf index or None, value)


@dataclass
class _Call:
    """One distributed call in progress on this rank: its group, and how to describe it.

    ``describe()`` gives the facts of the call and a function that names its leaves
    (for error messages); the exchange adds ``more`` (what it sends, whether its
    backward runs). Run only when the exchange is reached, after this rank's own
    checks passed.
    """

    api: str
    group: Any
    describe: Callable[[], tuple[Facts, Callable[[], list[str]]]]
    more: Facts = field(default_factory=list)
    agreed: bool = False


_CALL: ContextVar[_Call | None] = ContextVar("fscan_distributed_call", default=None)

_FAILED, _READY = 1, 0


def _hash64(text: str) -> int:
    """A 64-bit hash of ``text``, the same in every process (``hash()`` is salted)."""
    return int.from_bytes(
        hashlib.blake2b(text.encode(), digest_size=8).digest(), "big", signed=True
    )


def _collective_device(group: Any) -> torch.device:
    """The device the group's backend gathers host objects on (CPU for gloo)."""
    pick = getattr(dist.distributed_c10d, "_get_object_coll_device", None)
    return torch.device(pick(group) if pick is not None else "cpu")


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _agree(call: _Call, error: Exception | None = None) -> None:
    """Check that every rank of ``call.group`` is ready with the same facts; else raise.

    ``error``: what this rank raised before the exchange (it is re-raised here, after
    the peers have heard of it). Every other rank raises :class:`PeerRankError` when
    a peer failed, and every rank raises the same ``ScanValueError`` when the facts
    differ.
    """
    call.agreed = True
    world = dist.get_world_size(call.group)
    if world == 1:
        if error is not None:
            raise error
        return
    facts, paths = None, None
    if error is None:
        try:
            facts, paths = call.describe()
        except Exception as err:  # whatever this rank cannot describe, it must not hide
            error = err
    word = 0 if facts is None else _hash64(repr(facts + call.more))
    device = _collective_device(call.group)
    mine = torch.tensor([_READY if error is None else _FAILED, word], device=device)
    rows = torch.empty(world * 2, dtype=torch.int64, device=device)
    _gather_into(rows, mine, group=call.group)
    words = rows.tolist()  # one host read: compared in Python
    if words[0] == _READY and words == words[:2] * world:
        return
    # The slow path, taken by every rank alike (they all see the same rows).
    report = None if error is None else (type(error).__name__, str(error))
    names = None
    if facts is not None:
        facts = facts + call.more
        try:
            names = paths()
        except Exception:  # a message without leaf paths; the peers must hear from us
            names = None
    got: list[Any] = [None] * world
    dist.all_gather_object(got, (report, facts, names), group=call.group)
    failed = [r for r, (rep, _, _) in enumerate(got) if rep is not None]
    if error is not None:
        raise error
    if failed:
        raise PeerRankError(_peer_message(call.api, got, failed, world))
    raise ScanValueError(_mismatch_message(call.api, got))


def _peer_message(api: str, got: list[Any], failed: list[int], world: int) -> str:
    name, text = got[failed[0]][0]
    others = f" (ranks {', '.join(map(str, failed[1:]))} failed too)" if failed[1:] else ""
    return (
        f"{api}: rank {failed[0]} of the {world} ranks in the group raised {name}{others} "
        f"before the exchange, so this rank stopped too instead of waiting for it: {text}"
    )


def _ranks(values: list[str]) -> str:
    """``"a on ranks 0, 2; b on rank 1"``: which rank gave which value."""
    by_value: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by_value.setdefault(v, []).append(r)
    parts = []
    for v, ranks in by_value.items():
        word = "rank" if len(ranks) == 1 else "ranks"
        parts.append(f"{v} on {word} {', '.join(map(str, ranks))}")
    return "; ".join(parts)


def _mismatch_message(api: str, got: list[Any]) -> str:
    """What differs between the ranks' facts, leaf by leaf where the structures agree."""
    tables = [{(label, leaf): value for label, leaf, value in facts} for _, facts, _ in got]
    paths = got[0][2]
    same_leaves = len({t.get(("tree structure", None)) for t in tables}) == 1
    keys = list(dict.fromkeys(key for t in tables for key in t))
    if len({t.get(("function", None)) for t in tables}) > 1:  # the rest cannot compare
        keys = [("function", None)]
    lines = []
    for label, leaf in keys:
        if leaf is not None and not same_leaves:
            continue  # leaf by leaf means nothing when the trees differ
        values = [t.get((label, leaf), "absent") for t in tables]
        if len(set(values)) > 1:
            if leaf is None:
                where = ""
            else:
                where = f" of leaf {f'#{leaf}' if paths is None else paths[leaf]}"
            lines.append(f"{label}{where}: {_ranks(values)}")
    what = "`b`" if tables[0].get(("function", None)) == "linear_recurrence" else "leaves"
    return (
        f"{api}: the ranks of the group made different calls, so their pieces cannot "
        f"be exchanged: {'; '.join(lines)}. Every rank must make the same call (SPMD, as "
        f"with DDP): {what} of the same structure, dtypes, device type and shapes but "
        "for the length along `dim`, the same options, requires_grad set alike."
    )


@contextlib.contextmanager
def failing_together(api: str, group: Any) -> Iterator[None]:
    """Checks that a caller makes before a distributed call's body (a DTensor's shard
    metadata): an error raised inside reaches the peers, who hear of it where they
    agree before their first exchange, and then propagates here."""
    try:
        yield
    except Exception as err:
        _agree(_Call(api, group, _no_facts), err)  # raises err
        raise


def _no_facts() -> tuple[Facts, Callable[[], list[str]]]:
    return [], list


@torch.compiler.disable(
    reason="fscan.distributed calls do not run under torch.compile yet: call them "
    "outside the compiled region"
)
def _refuse_compiled(api: str) -> None:
    """Raise fscan's error for a distributed call met while compiling.

    Out of the graph (``disable``): without ``fullgraph`` Dynamo breaks the graph here
    and runs this eagerly, so the error is fscan's, on every rank before any
    collective (a raise traced inside the graph would make Dynamo fall back to
    running the whole frame eagerly, refusing nothing). With ``fullgraph=True``,
    Dynamo's own error names the reason above, at trace time.
    """
    raise UnsupportedScanError(
        f"{api}: a scan across ranks (fscan.distributed, or a DTensor sharded along "
        "the scan dimension) does not run under torch.compile yet: its collectives "
        "need eager piece lengths and the same path on every rank, which tracing does "
        "not give (a rank with an empty piece traces differently). Call it outside the "
        "compiled region, e.g. in a function decorated with torch.compiler.disable."
    )


def _agreed_call(
    describe: Callable[..., tuple[Facts, Callable[[], list[str]]]],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap the body of a distributed call: refuse tracing, then make sure the ranks agree
    (:func:`_agree`, run by :func:`exchange`) before the first exchange, also when one of
    them raises before it.

    ``describe`` takes the call's arguments (less ``group`` and ``api``) and gives its
    facts and a function naming its leaves. A nested call (the reset path scans its
    pairs through the same body) shares the outer call's agreement.
    """

    def wrap(body: Callable[..., Any]) -> Callable[..., Any]:
        default_api = inspect.signature(body).parameters["api"].default

        @functools.wraps(body)
        def call(*args: Any, group: Any = None, api: str = default_api, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():  # before anything that depends on the data
                _refuse_compiled(api)
            if _CALL.get() is not None:
                return body(*args, group=group, api=api, **kwargs)
            pg = resolve_group(api, group)
            state = _Call(api, pg, lambda: describe(*args, **kwargs))
            token = _CALL.set(state)
            try:
                return body(*args, group=pg, api=api, **kwargs)
            except Exception as err:
                if state.agreed:  # the peers have moved on: nothing of theirs waits
                    raise
                _agree(state, err)  # raises err, after telling the peers
                raise
            finally:
                _CALL.reset(token)

        return call

    return wrap


def _shape_along(x: torch.Tensor, dim: int) -> str:
    """``x``'s shape with the scan dimension shown as ``n`` (its length may differ by rank)."""
    return str(tuple("n" if i == dim else s for i, s in enumerate(x.shape))).replace("'", "")


def _mask_fact(reset: Any, dim: int) -> str:
    if reset is None:
        return "None"
    return f"a mask of shape {_shape_along(reset, 0 if reset.ndim == 1 else dim)}"


def _scan_facts(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool = False,
    combine_mode: str = "pointwise",
    *,
    layout: Layout | None = None,
    reset: torch.Tensor | None = None,
    **_: Any,
) -> tuple[Facts, Callable[[], list[str]]]:
    """What :func:`sharded_scan`'s exchange depends on (its arguments are checked)."""
    leaves, spec = flatten(xs)
    first = dim % leaves[0].ndim
    facts: Facts = [
        ("function", None, "associative_scan"),
        ("tree structure", None, str(spec)),
        ("`dim`", None, str(first)),
        ("`reverse`", None, str(reverse)),
        ("`combine_mode`", None, str(combine_mode)),
        ("`layout`", None, repr(layout)),
        ("`reset`", None, _mask_fact(reset, first)),
    ]
    for i, x in enumerate(leaves):
        facts.append(("dtype", i, str(x.dtype)))
        facts.append(("device type", i, x.device.type))
        facts.append(("shape (n: the scan dimension)", i, _shape_along(x, dim % x.ndim)))
    return facts, lambda: leaf_paths(xs)


def _recurrence_facts(
    a: Any,
    b: torch.Tensor,
    dim: int,
    *,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    acc_dtype: torch.dtype | None = None,
    **_: Any,
) -> tuple[Facts, Callable[[], list[str]]]:
    """What :func:`sharded_recurrence`'s exchange depends on (its arguments are checked).

    A number ``a`` may differ by rank (it is this rank's gate); ``initial``'s values
    are not compared (that would read them on the host)."""
    d = dim % b.ndim
    gate = f"a tensor of dtype {a.dtype}" if isinstance(a, torch.Tensor) else "a number"
    start = "None" if initial is None else describe(initial)
    facts: Facts = [
        ("function", None, "linear_recurrence"),
        ("dtype of `b`", None, str(b.dtype)),
        ("device type of `b`", None, b.device.type),
        ("shape of `b` (n: the scan dimension)", None, _shape_along(b, d)),
        ("`a`", None, gate),
        ("`initial`", None, start),
        ("`reverse`", None, str(reverse)),
        ("`reset`", None, _mask_fact(reset, d)),
        ("`acc_dtype`", None, str(acc_dtype)),
    ]
    return facts, list


# ---- the exchange --------------------------------------------------------------


_C10D = torch.ops._c10d_functional


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
        out = _C10D.all_gather_into_tensor(flat.contiguous(), world, group_name)
        return _C10D.wait_tensor(out)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        ctx.group_name, ctx.world = inputs[1], inputs[2]
        ctx.anchors = len(inputs) - 3

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


def _tie(anchor: torch.Tensor, outs: list[torch.Tensor]) -> list[torch.Tensor]:
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
        raw = cols.contiguous().view(torch.uint8)
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
    anchor that :func:`_tie` puts into results that do not depend on it).
    """
    flat, slots = _pack(totals)
    world = dist.get_world_size(group)
    needs_grad = torch.is_grad_enabled() and (
        flat.requires_grad or any(a.requires_grad for a in anchors)
    )
    state = _CALL.get()
    if state is not None and not state.agreed:  # the first exchange of a call: agree first
        state.more = [
            ("elements exchanged", None, f"{flat.numel()} of {flat.dtype}"),
            ("a backward exchange (grad mode, requires_grad)", None, str(needs_grad)),
        ]
        _agree(state)
    live = [a for a in anchors if a.requires_grad] if needs_grad else []
    gathered = _AllGather.apply(flat, group.group_name, world, *live)
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


# ---- the public functions ------------------------------------------------------


def associative_scan(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool = False,
    combine_mode: str = "pointwise",
    *,
    group: Any = None,
    layout: Layout | None = None,
    reset: torch.Tensor | None = None,
    validate: bool | None = None,
) -> Any:
    """This rank's piece of the inclusive scan of a sequence sharded along ``dim``.

    Every rank of ``group`` calls this with its piece ``xs`` (by default rank 0
    holds the first piece, rank 1 the next, ...; pieces may have any length,
    0 included) and gets back its piece of ``fscan.associative_scan`` of the
    whole sequence. The contract is ``fscan.associative_scan``'s: pytrees, both
    modes, ``reverse``, ``reset``, autograd. One ``all_gather`` of one element per
    piece crosses ranks (and one ``reduce_scatter`` in backward), whatever the length.

    Every rank must call it, in the same order, with leaves of the same structure,
    dtypes and element shapes, and ``requires_grad`` set alike; in backward, every
    rank must run backward through it (as with DDP). Before its exchange each call
    checks that the ranks agree (one 16-byte ``all_gather``): where they differ,
    every rank raises the same ``fscan.ScanValueError``; a rank that raised before
    it raises its own error and the others ``fscan.PeerRankError``. Under
    ``torch.compile`` it is refused (``fscan.UnsupportedScanError``). Tensors that ``combine_fn``
    closes over get this rank's share of their gradient: sum it over ``group``
    (DDP and FSDP over a mesh that includes the sequence dimension do).

    Args:
        combine_fn: as in ``fscan.associative_scan``: associative, pure.
        xs: this rank's piece: a tensor or pytree of tensors.
        dim (int): the sharded scan dimension.
        reverse (bool, default False): scan from the end of the whole sequence.
        combine_mode (str, default "pointwise"): ``"pointwise"`` or ``"generic"``.
        group: the ranks sharing the sequence: None (the default group), a
            ProcessGroup, a 1-D DeviceMesh or ``(mesh, mesh_dim)``.
        layout (Layout or None): where the pieces lie in the sequence, the same on
            every rank; None is one piece per rank in rank order, lengths unknown
            (then read on the host: a device sync on GPUs). See :class:`Layout`.
        reset (bool tensor or None): restart where True, as in ``fscan.associative_scan``
            (this rank's part of the mask); a reset stops the carry from other ranks.
        validate (bool or None): passed to each local ``fscan.associative_scan``.

    Returns:
        This rank's piece of the scan, the structure and shapes of ``xs``.

    Example:
        >>> import torch, torch.distributed as dist, fscan.distributed
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> fscan.distributed.associative_scan(torch.add, torch.arange(1.0, 5.0), 0)
        tensor([ 1.,  3.,  6., 10.])
        >>> dist.destroy_process_group()
    """
    return sharded_scan(
        combine_fn,
        xs,
        dim,
        reverse,
        combine_mode,
        group=group,
        layout=layout,
        reset=reset,
        validate=validate,
    )


def linear_recurrence(
    a: torch.Tensor | float,
    b: torch.Tensor,
    dim: int,
    *,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    group: Any = None,
    acc_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """This rank's piece of ``h_t = a_t h_{t-1} + b_t`` over a sequence sharded along ``dim``.

    The sharded ``fscan.linear_recurrence``: ``a`` (a number or a tensor
    broadcastable to ``b``) and ``b`` are this rank's pieces in rank order, any
    length, 0 included. Each rank reduces its piece to one affine map (the
    product of its gates and its end state from zero), one ``all_gather`` of
    these maps crosses ranks, and each rank runs the local recurrence once from
    its entering state. The same duties and checks as :func:`associative_scan`; the
    gradients of tensors shared by all ranks (``initial``, a per-channel gate
    parameter) are this rank's share: sum them over ``group``.

    Args:
        a (Tensor or number): this rank's gates, broadcastable to ``b``.
        b (Tensor): this rank's inputs.
        dim (int): the sharded time dimension of ``b``.
        initial (Tensor or None): the state before the whole sequence (after it, for
            ``reverse``), the same on every rank.
        reverse (bool, default False): run from the end of the whole sequence.
        reset (bool tensor or None): restart where True (this rank's part of the mask).
        group: as in :func:`associative_scan`.
        acc_dtype (dtype or None): accumulate in this wider dtype, as in
            ``fscan.linear_recurrence`` (the exchanged maps too).

    Returns:
        Tensor: this rank's piece of ``h``.

    Example:
        >>> import torch, torch.distributed as dist, fscan.distributed
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> fscan.distributed.linear_recurrence(0.5, torch.ones(3), 0)
        tensor([1.0000, 1.5000, 1.7500])
        >>> dist.destroy_process_group()
    """
    return sharded_recurrence(
        a, b, dim, initial=initial, reverse=reverse, reset=reset, group=group, acc_dtype=acc_dtype
    )


# ---- the scan ------------------------------------------------------------------


def _piece_total(piece: list[torch.Tensor], dim: int, reverse: bool) -> list[torch.Tensor]:
    """The total of a scanned piece, or zeros standing in for an empty piece's.

    The zeros are computed from the piece (a sum over an empty dimension is exactly
    0) so that the piece stays in the graph and this rank records the gather like
    every other rank, also under ``autograd.grad(inputs=piece)``.
    """
    n = piece[0].shape[dim]
    if n:
        return [x.select(dim, 0 if reverse else n - 1) for x in piece]
    return [
        x.sum(dim) if x.requires_grad else x.new_zeros(x.shape[:dim] + x.shape[dim + 1 :])
        for x in piece
    ]


def _fixup(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    prefix: list[torch.Tensor],
    piece: list[torch.Tensor],
    dim: int,
    combine_mode: str,
    api: str,
) -> list[torch.Tensor]:
    """``out[i] = combine_fn(prefix, piece[i])`` along ``dim``, in one batched call."""
    if combine_mode == "pointwise":
        left = [p.unsqueeze(dim).expand_as(x) for p, x in zip(prefix, piece)]
        out = combine_fn(unflatten(spec, left), unflatten(spec, piece))
        if torch.compiler.is_compiling():
            # dynamo rebuilds pytree specs (namespace=''), so they never compare equal;
            # the local scans before this already checked combine_fn's output.
            return flatten(out)[0]
        return check_combine_output(api, out, spec, piece, "pointwise")
    half = len(piece)

    def one(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        left, right = list(flat[:half]), list(flat[half:])
        out = combine_fn(unflatten(spec, left), unflatten(spec, right))
        return tuple(check_combine_output(api, out, spec, right, "generic"))

    in_dims = (None,) * half + (dim,) * half
    return list(torch.func.vmap(one, in_dims=in_dims, out_dims=dim)(*prefix, *piece))


def _local_scan(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    piece: list[torch.Tensor],
    dim: int,
    reverse: bool,
    combine_mode: str,
    validate: bool | None,
) -> list[torch.Tensor]:
    from ._scan import associative_scan  # the public scan imports this module's front end

    if piece[0].shape[dim] == 0:
        return [x.clone() for x in piece]
    out = associative_scan(
        combine_fn, unflatten(spec, piece), dim, reverse, combine_mode, validate=validate
    )
    return flatten(out)[0]


def _check_layout(api: str, layout: Layout, group: Any, n: int) -> tuple[int, ...]:
    """This rank's piece lengths under ``layout``, checked against the group and ``n``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(layout.order) != world:
        raise ScanValueError(
            f"{api}: `layout` describes {len(layout.order)} ranks, the group has {world}."
        )
    if layout.lengths is None:
        return (n,)
    mine = layout.lengths[rank]
    if sum(mine) != n:
        raise ScanValueError(
            f"{api}: `layout` gives rank {rank} pieces of lengths {mine} (sum {sum(mine)}), "
            f"but its leaves have length {n} along the scan dimension."
        )
    return mine


@_agreed_call(_scan_facts)
def sharded_scan(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool = False,
    combine_mode: str = "pointwise",
    *,
    group: Any = None,
    layout: Layout | None = None,
    reset: torch.Tensor | None = None,
    validate: bool | None = None,
    api: str = _API,
) -> Any:
    """The body of ``fscan.distributed.associative_scan`` (see its docstring); ``api``
    names the public function in errors."""
    leaves, spec = flatten(xs)
    dim = check_scan_args(api, combine_fn, xs, leaves, dim, reverse, combine_mode)
    if layout is not None and not isinstance(layout, Layout):
        raise ScanTypeError(
            f"{api}: `layout` must be a fscan.distributed.Layout or None, got {describe(layout)}."
        )
    pg = resolve_group(api, group)
    if reset is not None:  # a scan of (flag, value) pairs: see fscan._segmented
        from ._segmented import segmented_scan

        def scan(*args: Any, **options: Any) -> Any:
            return sharded_scan(*args, group=pg, layout=layout, api=api, **options)

        return segmented_scan(
            scan, combine_fn, xs, dim, reverse, combine_mode, reset=reset, validate=validate
        )
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    layout = layout or Layout.contiguous(world)
    lengths = _check_layout(api, layout, pg, leaves[0].shape[dim])
    starts = [sum(lengths[:p]) for p in range(len(lengths))]
    pieces = [[x.narrow(dim, s, n) for x in leaves] for s, n in zip(starts, lengths)]
    scanned = [
        _local_scan(combine_fn, spec, p, dim, reverse, combine_mode, validate) for p in pieces
    ]
    if world == 1 and layout.pieces == 1:
        return unflatten(spec, scanned[0])
    totals = [_piece_total(p, dim, reverse) for p in scanned]
    stacked = [torch.stack([t[i] for t in totals]) for i in range(len(leaves))]
    if layout.lengths is None:  # lengths travel with the totals, read on the host
        stacked.append(torch.tensor(lengths, dtype=torch.int64, device=leaves[0].device))
    anchors = [t for t in reach(combine_fn).tensors if t.requires_grad]
    gathered, anchor = exchange(stacked, pg, anchors)
    if layout.lengths is None:
        all_lengths = [tuple(row) for row in gathered.pop().tolist()]
    else:
        all_lengths = layout.lengths
    # every non-empty piece of the whole sequence, in sequence order
    entries = sorted(
        (layout.order[r][p], r, p)
        for r in range(world)
        for p in range(layout.pieces)
        if all_lengths[r][p]
    )
    prefixes = _prefixes(combine_fn, spec, gathered, entries, reverse, combine_mode, validate)
    outs, tied = [], True
    for p, piece in enumerate(scanned):
        pos = next((i for i, e in enumerate(entries) if e[1:] == (rank, p)), None)
        before = None if pos is None else (pos + 1 if reverse else pos - 1)
        if before is None or not 0 <= before < len(entries):
            outs.append(piece)
            continue
        prefix = [f[before] for f in prefixes]
        outs.append(_fixup(combine_fn, spec, prefix, piece, dim, combine_mode, api))
        tied = False
    out = outs[0] if len(outs) == 1 else [torch.cat(col, dim) for col in zip(*outs)]
    return unflatten(spec, _tie(anchor, out) if tied else out)


def _prefixes(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    gathered: list[torch.Tensor],
    entries: list[tuple[int, int, int]],
    reverse: bool,
    combine_mode: str,
    validate: bool | None,
) -> list[torch.Tensor]:
    """The inclusive scan of the non-empty pieces' totals in sequence order."""
    if len(entries) < 2:
        return []
    device = gathered[0].device
    ranks = torch.tensor([e[1] for e in entries], device=device)
    slots = torch.tensor([e[2] for e in entries], device=device)
    seq = [g[ranks, slots] for g in gathered]
    return _local_scan(combine_fn, spec, seq, 0, reverse, combine_mode, validate)


# ---- linear recurrences --------------------------------------------------------


@_agreed_call(_recurrence_facts)
def sharded_recurrence(
    a: torch.Tensor | float,
    b: torch.Tensor,
    dim: int,
    *,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    group: Any = None,
    acc_dtype: torch.dtype | None = None,
    api: str = _API_LINEAR,
) -> torch.Tensor:
    """The body of ``fscan.distributed.linear_recurrence`` (see its docstring).

    Each rank runs the local recurrence from nothing and reduces its piece to the map
    from its entering to its leaving state (:func:`_piece_map`: the product of its
    gates, its last state, whether it holds a reset), exchanges it, folds the earlier
    ranks' maps and ``initial`` into its entering state (:func:`_fold`), and runs the
    local recurrence again from there with fscan's ``initial=`` (the first rank in
    scan order keeps its first run). An empty piece's map is the identity, so no
    lengths are exchanged. With ``acc_dtype`` all of it runs in the wider dtype,
    the exchanged maps too, and the result is rounded once.
    """
    from ._linear import _accumulation_dtype, _check_args, _mask_for
    from ._linear import linear_recurrence as local_recurrence

    a, b, initial, dim = _check_args(api, a, b, dim, initial, reverse, matrix=False)
    dtype = b.dtype
    if acc_dtype is not None:
        wide = _accumulation_dtype(acc_dtype, dtype, api)
        a, b = a.to(wide), b.to(wide)
        initial = None if initial is None else initial.to(wide)
    pg = resolve_group(api, group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if world == 1:
        h = local_recurrence(a, b, dim, initial=initial, reverse=reverse, reset=reset)
        return h.to(dtype)
    mask = None if reset is None else _mask_for(reset, b, dim, api=api)
    own = local_recurrence(a, b, dim, reverse=reverse, reset=reset)
    (gates, ends, resets), anchor = exchange(_piece_map(a, b, own, mask, dim, reverse), pg)
    order = range(world - 1, -1, -1) if reverse else range(world)

    def walk_from(state: torch.Tensor) -> torch.Tensor:  # this piece's last state from `state`
        h = local_recurrence(a, b, dim, initial=state, reverse=reverse, reset=reset)
        n = b.shape[dim]
        return h.select(dim, 0 if reverse else n - 1) if n else state.expand(ends.shape[1:])

    h_in = _fold(gates, ends, resets, initial, order, rank, pg, walk_from)
    if h_in is None:  # the first rank, without `initial`: its first run is its result
        out = own
    else:
        out = local_recurrence(a, b, dim, initial=h_in, reverse=reverse, reset=reset)
    out = out.to(dtype)  # one rounding, of the result
    # the first rank and empty pieces do not use the gathered maps: tie them in
    return _tie(anchor, [out])[0] if rank == order[0] or b.shape[dim] == 0 else out


def _piece_map(
    a: torch.Tensor,
    b: torch.Tensor,
    own: torch.Tensor,
    mask: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> list[torch.Tensor]:
    """``[A, B, R]``: ``h_out = B if R else A h_in + B`` over this piece, per lane.

    ``B`` is the last state of ``own`` (the local recurrence from nothing: exact, as
    the loop), ``A`` the product of the gates, ``R`` whether a reset drops what enters
    (a selection, never a zero gate: ``0 * inf`` is NaN). An empty piece is the
    identity ``(1, 0, False)``, computed from the piece so that it stays in the graph.
    """
    n = b.shape[dim]
    gate = a.reshape((1,) * (b.ndim - a.ndim) + tuple(a.shape)).expand_as(b)
    lane = b.shape[:dim] + b.shape[dim + 1 :]
    product = gate.prod(dim).expand(lane)
    if n:
        last = own.select(dim, 0 if reverse else n - 1)
    else:
        last = b.sum(dim) if b.requires_grad else b.new_zeros(lane)
    if mask is None:
        drops = torch.zeros(lane, dtype=torch.bool, device=b.device)
    else:
        drops = mask.expand(b.shape).any(dim)
    return [product, last, drops]


class _ValueOf(torch.autograd.Function):
    """``value`` with the gradient of ``like``: a carry walked step by step (exact, but
    across ranks, outside the graph) standing in for the composed one (``A h + B``),
    whose derivatives (``A``, ``h``, 1) are the walk's up to rounding."""

    @staticmethod
    def forward(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return None, grad


def _compose_map(
    gate: torch.Tensor, end: torch.Tensor, drops: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """``end if drops else gate * state + end``, also in the gradients: where the map
    drops the state, the product runs on ``(1, 0)`` (a zero cotangent times an
    infinite ``state`` or ``gate`` would be NaN)."""
    gate = torch.where(drops, 1, gate)
    state = torch.where(drops, 0, state)
    return torch.where(drops, end, torch.addcmul(end, gate, state))


def _fold(
    gates: torch.Tensor,
    ends: torch.Tensor,
    resets: torch.Tensor,
    initial: torch.Tensor | None,
    order: range,
    rank: int,
    group: Any,
    walk_from: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | None:
    """This rank's entering state: the maps of the ranks before it (in ``order``, the
    scan order) applied to ``initial`` (None: this rank comes first, no ``initial``).

    Composing a rank's map is the loop up to rounding except where its gate product
    is not a normal number and the state is infinite, zero or huge (see
    ``fscan._linear._inexact``). Every rank folds the same gathered maps and finds the
    same such carries; each is then walked by the rank that holds the piece, from
    the exact state before it, and shared with one more ``all_gather`` (values only:
    the gradient is the composed map's, see :class:`_ValueOf`).
    """
    from ._linear import _all_normal, _inexact, _values_hidden

    check = (gates.is_floating_point() or gates.is_complex()) and not _values_hidden(gates, ends)
    # the common case: one reduction, one sync (complex: see _inexact)
    check = check and (gates.is_complex() or ends.is_complex() or not _all_normal(gates))
    state = entering = initial
    # Every rank folds every map but the last: the walks are collectives that the
    # ranks after this one need too.
    for r in order[:-1]:
        if r == rank:
            entering = state
        if state is None:
            state = ends[r]
            continue
        composed = _compose_map(gates[r], ends[r], resets[r], state)
        if check:
            flags = _inexact(gates[r], state.detach(), composed.detach(), resets[r])
            if bool(flags.any()):  # the same on every rank: the same maps, the same ops
                with torch.no_grad():
                    mine = walk_from(state.detach()) if rank == r else torch.zeros_like(ends[r])
                    walked = exchange([mine.expand(ends.shape[1:])], group)[0][0][r]
                exact = torch.where(flags, walked, composed.detach())
                composed = _ValueOf.apply(exact, composed)
        state = composed
    return state if rank == order[-1] else entering
