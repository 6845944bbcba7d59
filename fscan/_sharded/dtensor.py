"""DTensor inputs to ``fscan.associative_scan`` and ``fscan.linear_recurrence``.

A DTensor sharded along the scan dimension (``Shard(dim)`` on one mesh
dimension) runs the sequence-parallel scan of :mod:`fscan._sharded.scan` on that
mesh dimension's process group; the result is a DTensor with the input's mesh,
placements and global shape. Every other placement is independent of the scan:
``Replicate()`` and ``Shard`` of another dimension scan the local tensor
(no communication). ``Partial()`` (pending sums) is refused, as is a scan
dimension sharded over two mesh dimensions.

The shard lengths come from the DTensor's metadata (torch's ``torch.chunk``
rule, uneven and empty shards included), so no lengths are exchanged and the
global shape given back is the input's, not one guessed per rank (``local_map``
gets that wrong for uneven shards). Only ``torch.distributed.tensor`` and
``DTensor.to_local`` / ``from_local`` are used: torch >= 2.4 (tested with 2.13).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._call import SCAN_API, RecurrenceCall, ScanCall
from .._checks import normalize_dim
from .._entry import checked_call, run_scan
from .._errors import ScanTypeError, ScanValueError, UnsupportedScanError
from .._pytree import flatten, leaf_paths, unflatten
from .._recurrences.solve import run_linear_recurrence

__all__ = ["any_dtensor", "dtensor_linear_recurrence", "dtensor_scan"]


def any_dtensor(values: Iterable[Any]) -> bool:
    """Whether any value is a DTensor. Plain tensors and non-tensors are none: only a
    tensor subclass looks the class up (:func:`dtensor_class`).

    Example:
        >>> any_dtensor([torch.ones(2), None, 0.5])
        False
    """
    # A loop, not any() of a generator: this runs on every scan.
    for v in values:
        if type(v) is not torch.Tensor and isinstance(v, torch.Tensor):
            dtensor = dtensor_class()
            if dtensor is not None and isinstance(v, dtensor):
                return True
    return False


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` if that module was imported (else no DTensor
    can exist), without importing it.

    It reads ``sys.modules``, which other threads change as they import (a kernel
    build in the background does): Dynamo, tracing it, would iterate that dict and
    fail with "dictionary changed size during iteration". So Dynamo calls it instead
    of tracing it (below) and keeps the class as a constant of the graph; a DTensor
    input is a new input type, which recompiles and calls it again.

    Example:
        >>> dtensor_class() is None or dtensor_class().__name__ == "DTensor"
        True
    """
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


# torch.compiler.assume_constant_result, without importing Dynamo here.
dtensor_class._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _sequence_mesh_dim(api: str, name: str, placements: tuple, dim: int) -> int | None:
    """The mesh dimension that shards tensor dimension ``dim`` (None: whole on every rank)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    found = []
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ScanTypeError(
                f"{api}: {name} has placement Partial() on mesh dimension {i} (pending "
                "sums); a scan needs the values: redistribute to Replicate() or Shard() first."
            )
        if isinstance(p, Shard) and p.dim == dim:
            if type(p) is not Shard:  # e.g. _StridedShard: not one contiguous piece per rank
                raise ScanTypeError(
                    f"{api}: {name} is sharded along the scan dimension {dim} by {p!r}, not "
                    "one contiguous piece per rank; redistribute to Shard(dim) first."
                )
            found.append(i)
        elif not isinstance(p, (Shard, Replicate)):
            raise ScanTypeError(
                f"{api}: {name} has placement {p!r} on mesh dimension {i}; fscan scans "
                "DTensors placed with Shard() and Replicate() only."
            )
    if len(found) > 1:
        raise UnsupportedScanError(
            f"{api}: {name} shards the scan dimension {dim} over mesh dimensions {found}; "
            "shard it over one mesh dimension."
        )
    return found[0] if found else None


def _shard_lengths(length: int, parts: int) -> tuple[int, ...]:
    """Every shard's length along a ``Shard`` dimension of global ``length``: torch's
    ``torch.chunk`` rule (``Shard._local_shard_size_and_offset``), written out so that
    Dynamo traces it; :func:`_checked_lengths` compares it with the local shard.

    Example:
        >>> _shard_lengths(10, 4), _shard_lengths(3, 4)
        ((3, 3, 3, 1), (1, 1, 1, 0))
    """
    chunk = -(-length // parts)
    return tuple(max(0, min(length, (r + 1) * chunk) - r * chunk) for r in range(parts))


def _checked_lengths(api: str, first: Any, mesh_dim: int, dim: int) -> tuple[int, ...]:
    """Every rank's length along ``dim``, this rank's checked against its shard.

    Run inside the agreement: one rank's wrong shard, and every rank hears of it."""
    mesh = first.device_mesh
    lengths = _shard_lengths(first.shape[dim], mesh.size(mesh_dim))
    coordinate = mesh.get_local_rank(mesh_dim)
    local = first.to_local().shape[dim]
    if local != lengths[coordinate]:
        raise ScanValueError(
            f"{api}: the local shard has length {local} along dim {dim}, but a DTensor "
            f"of global length {first.shape[dim]} over {mesh.size(mesh_dim)} ranks "
            f"holds {lengths[coordinate]} here; build it with DTensor.from_local(..., "
            "shape=, stride=) or distribute_tensor."
        )
    return lengths


def _wrap(out: torch.Tensor, like: Any) -> Any:
    """``out`` (a local result) as a DTensor with ``like``'s mesh, placements and shape."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        out,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _local(api: str, name: str, value: Any, mesh: Any) -> Any:
    """``value.to_local()`` for a DTensor on ``mesh``; refuse plain tensors next to DTensors."""
    from torch.distributed.tensor import DTensor

    if value is None or not isinstance(value, (torch.Tensor, DTensor)):
        return value
    if not isinstance(value, DTensor):
        raise ScanTypeError(
            f"{api}: {name} is a torch.Tensor while the other operands are DTensors; make "
            "it a DTensor on the same mesh (e.g. distribute_tensor(t, mesh, [Replicate()]))."
        )
    if value.device_mesh != mesh:
        raise ScanValueError(f"{api}: {name} is on another DeviceMesh than the other operands.")
    return value.to_local()


def dtensor_scan(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool,
    combine_mode: str,
    *,
    validate: bool | None,
    reset: Any,
    initial: Any = None,
) -> Any:
    """``fscan.associative_scan`` on a pytree of DTensors (see the module docstring)."""
    # torch.distributed is optional and slow to import: only DTensor calls import it
    # (the sharded modules import it at their top, so they are deferred too).
    from torch.distributed.tensor import DTensor

    from .agree import agreeing
    from .layout import Layout
    from .scan import sharded_scan

    api = SCAN_API
    leaves, spec = flatten(xs)
    paths = leaf_paths(xs)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, DTensor):
            raise ScanTypeError(
                f"{api}: leaf {path} is not a DTensor while other leaves are; make every "
                "leaf a DTensor on one mesh with the same placements."
            )
    first = leaves[0]
    for path, leaf in zip(paths, leaves):
        if leaf.device_mesh != first.device_mesh or leaf.placements != first.placements:
            raise ScanValueError(
                f"{api}: leaf {path} has placements {leaf.placements}, expected "
                f"{first.placements} on the same mesh like {paths[0]}."
            )
    dim = normalize_dim(api, dim, first.ndim, lambda: f"leaf {paths[0]}")
    mesh_dim = _sequence_mesh_dim(api, f"leaf {paths[0]}", first.placements, dim)
    local = unflatten(spec, [x.to_local() for x in leaves])
    local_reset = _local(api, "`reset`", reset, first.device_mesh)
    local_initial = None
    if initial is not None:
        initial_leaves, initial_spec = flatten(initial)
        local_initial = unflatten(
            initial_spec, [_local(api, "`initial`", t, first.device_mesh) for t in initial_leaves]
        )
    local_leaves, local_spec = flatten(local)
    call = ScanCall(api, combine_fn, local, local_spec, local_leaves, dim, reverse, combine_mode)
    call = call._replace(validate=validate, reset=local_reset)
    if mesh_dim is None:  # the scan dimension is whole on every rank
        out = run_scan(checked_call(call._replace(initial=local_initial)))
    elif initial is not None:
        raise UnsupportedScanError(
            f"{api}: `initial` with a DTensor sharded along the scan dimension is not "
            "supported yet; combine it into the first element yourself."
        )
    else:
        with agreeing(api, first.device_mesh.get_group(mesh_dim)) as agreement:
            lengths = _checked_lengths(api, first, mesh_dim, dim)
            layout = Layout.contiguous(len(lengths), lengths)
            out = sharded_scan(checked_call(call), agreement, layout)
    return unflatten(spec, [_wrap(o, x) for o, x in zip(flatten(out)[0], leaves)])


def dtensor_linear_recurrence(
    a: Any, b: Any, dim: int, *, initial: Any, reverse: bool, reset: Any, acc_dtype: Any = None
) -> Any:
    """``fscan.linear_recurrence`` with DTensor operands (see the module docstring)."""
    # torch.distributed is optional and slow to import: only DTensor calls import it
    # (the sharded modules import it at their top, so they are deferred too).
    from torch.distributed.tensor import DTensor

    from .agree import agreeing
    from .scan import sharded_recurrence

    api = "fscan.linear_recurrence"
    if not isinstance(b, DTensor):
        raise ScanTypeError(
            f"{api}: `b` is not a DTensor while other operands are; make `b` a DTensor too."
        )
    mesh = b.device_mesh
    dim = normalize_dim(api, dim, b.ndim, lambda: "`b`")
    mesh_dim = _sequence_mesh_dim(api, "`b`", b.placements, dim)
    named = {"`a`": a, "`initial`": initial, "`reset`": reset}
    if mesh_dim is not None:
        for name, value in named.items():
            _check_aligned(api, name, value, b, dim, mesh_dim)
    a_l, initial_l, reset_l = (_local(api, n, v, mesh) for n, v in named.items())
    call = RecurrenceCall(api, a_l, b.to_local(), dim, initial_l, reverse, reset_l, acc_dtype)
    if mesh_dim is None:
        return _wrap(run_linear_recurrence(*call), b)
    with agreeing(api, mesh.get_group(mesh_dim)) as agreement:
        _checked_lengths(api, b, mesh_dim, dim)
        return _wrap(sharded_recurrence(call, agreement), b)


def _check_aligned(api: str, name: str, value: Any, b: Any, dim: int, mesh_dim: int) -> None:
    """An operand with a time axis (size > 1, right-aligned with ``b``'s) must be sharded
    like ``b`` on the sequence mesh dimension; one without must be replicated there."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor):
        return
    own = dim - (b.ndim - value.ndim)
    if name == "`reset`" and value.ndim == 1:
        own = 0  # a 1-D mask is one flag per step
    timed = 0 <= own < value.ndim and value.shape[own] > 1
    placement = value.placements[mesh_dim]
    if timed and placement != Shard(own):
        raise ScanValueError(
            f"{api}: {name} has a time axis (dim {own}) but placement {placement} on mesh "
            f"dimension {mesh_dim}, where `b` is Shard({dim}); shard it the same way."
        )
    if not timed and placement != Replicate():
        raise ScanValueError(
            f"{api}: {name} has no time axis but placement {placement} on mesh dimension "
            f"{mesh_dim}, where `b` is sharded along time; replicate it there."
        )
