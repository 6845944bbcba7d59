"""Where the pieces of a sharded sequence lie (:class:`Layout`) and which ranks share it
(:func:`resolve_group`), for ``fscan.distributed`` and DTensor inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .._errors import ScanTypeError, ScanValueError

__all__ = ["Layout", "resolve_group"]

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
