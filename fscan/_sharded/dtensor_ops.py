"""The drop-ins (``fscan.cumsum``, ``cumprod``, ``cummax``, ``cummin``, ``logcumsumexp``)
on DTensors: :func:`on_dtensor`.

A DTensor sharded along the scanned dimension (``Shard(dim)`` on one mesh dimension)
gives back a DTensor sharded the same way, without gathering the axis (torch's own
DTensor ops all-gather it, pytorch#151071). On each rank of that mesh dimension's
group, with the shards in rank order (torch's ``torch.chunk`` rule, uneven and empty
shards included):

1. the drop-in on the local shard, inclusive, with ``reverse=``, ``dtype=`` and the
   local ``reset=`` as on any tensor; cummax/cummin's indices moved by the shard's
   offset, so that they are positions in the whole axis;
2. one ``all_gather`` (:func:`fscan._sharded.exchange.exchange`, its backward a
   ``reduce_scatter``) of each lane's carry out of the shard: its last result in scan
   order (value and index), and with ``reset=`` whether the shard lets the carry
   through (no reset in that lane);
3. the carries of the non-empty shards before this one in scan order folded into the
   prefix ``P`` (restarting after a shard that does not let it through), and ``P``
   combined into the results before the shard's first reset: ``P + y``, ``P * y``,
   ``logaddexp(P, y)``; for cummax (cummin) the later element in scan order wins ties
   and a NaN, once met, stays (a later NaN takes over the index), torch's rule;
4. ``exclusive=True``: the result shifted one step in scan order, ``P`` (the op's
   identity on the first shard) at the shard's first step and the identity at resets,
   as :mod:`fscan._routing.exclusive` defines it.

Only the carries cross ranks (one element per lane), so the exchange does not grow
with the length. Every other placement is independent of the scan: ``Replicate()``
and ``Shard`` of another dimension run the drop-in on the local tensor (no
communication), and ``Partial()`` is reduced to ``Replicate()`` first, as torch's own
op does (an all-reduce), so that mesh dimension comes back replicated. ``reset=`` is a
bool DTensor on the same mesh placed like ``input``: ``Shard(0)`` (1-D) or the
input's ``Shard(d)`` where it has the input's size along ``d``, ``Replicate()`` where
it has size 1 or no such dimension. ``out=`` is refused, as torch's DTensor refuses
it (no sharding rule for ``aten.cumsum.out``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from .._checks import normalize_dim
from .._errors import ScanTypeError, ScanValueError, UnsupportedScanError
from .._exclusive import recorded
from .._routing.exclusive import identity
from .._segmented import check_reset
from .dtensor import _checked_lengths, _sequence_mesh_dim, _wrap, any_dtensor

__all__ = ["is_dtensor", "on_dtensor", "refuse_dtensor_reset"]

_EXTREMA = {torch.cummax: torch.return_types.cummax, torch.cummin: torch.return_types.cummin}
_COMBINES: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    torch.cumsum: torch.add,
    torch.cumprod: torch.mul,
    torch.logcumsumexp: torch.logaddexp,
}


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a DTensor (the drop-ins test ``type(x) is torch.Tensor`` first).

    Example:
        >>> is_dtensor(torch.ones(2)), is_dtensor(None)
        (False, False)
    """
    return any_dtensor((x,))


def on_dtensor(
    op: Any,
    drop_in: Callable[..., Any],
    input: Any,
    dim: Any,
    dtype: torch.dtype | None,
    out: Any,
    reverse: bool,
    reset: Any,
    exclusive: bool,
) -> Any:
    """The drop-in ``drop_in`` (fscan's, of torch's ``op``) on the DTensor ``input`` (see
    the module docstring); ``drop_in`` runs on the local tensors and checks the rest."""
    # torch.distributed is optional and slow to import: only DTensor calls import it
    # (the sharded modules import it at their top, so they are deferred too).
    from torch.distributed.tensor import Partial, Replicate

    from .agree import agreeing

    api = f"fscan.{op.__name__}"
    if out is not None:
        raise UnsupportedScanError(
            f"{api}: `out=` does not take a DTensor `input` (torch's DTensor has no rule "
            f"for aten.{op.__name__}.out either); use the result: y = {api}(x, dim)."
        )
    placements = tuple(Replicate() if isinstance(p, Partial) else p for p in input.placements)
    if placements != input.placements:  # pending sums: reduced first, as torch's op does
        input = input.redistribute(input.device_mesh, placements)
    dim = normalize_dim(api, dim, max(input.ndim, 1), lambda: "`input`")
    mesh_dim = _sequence_mesh_dim(api, "`input`", placements, dim)
    kwargs: dict[str, Any] = {"reverse": reverse}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if mesh_dim is None:  # the scanned dimension is whole on every rank
        kwargs["reset"] = None if reset is None else _local_reset(api, reset, input, dim)
        return _wrapped(op, drop_in(input.to_local(), dim, exclusive=exclusive, **kwargs), input)
    mesh = input.device_mesh
    with agreeing(api, mesh.get_group(mesh_dim)) as agreement:
        lengths = _checked_lengths(api, input, mesh_dim, dim)
        kwargs["reset"] = None if reset is None else _local_reset(api, reset, input, dim)
        if op is torch.logcumsumexp and input.is_complex():
            raise ScanTypeError(
                f"{api}: a complex DTensor sharded along dim {dim} is not supported: the "
                "imaginary part of a complex log depends on the order of combination; "
                "redistribute it to Replicate() along that dimension first."
            )
        local = drop_in(input.to_local(), dim, **kwargs)
        piece = _Piece(op, dim, reverse, lengths, mesh.get_local_rank(mesh_dim))
        result = piece.across(local, kwargs["reset"], exclusive, agreement)
    return _wrapped(op, result, input)


def _wrapped(op: Any, result: Any, like: Any) -> Any:
    """The local ``result`` (one tensor, or cummax/cummin's pair) as DTensors like ``like``."""
    if op in _EXTREMA:
        return _EXTREMA[op]((_wrap(result[0], like), _wrap(result[1], like)))
    return _wrap(result, like)


# ---- reset= -------------------------------------------------------------------------------


def _local_reset(api: str, reset: Any, input: Any, dim: int) -> torch.Tensor:
    """``reset`` checked against ``input`` (global shapes, then placements); its local mask."""
    from torch.distributed.tensor import DTensor

    # The global shapes, checked as for a plain tensor (meta tensors: no data moves).
    meta = torch.empty(input.shape if input.ndim else (1,), device="meta")
    if isinstance(reset, torch.Tensor):
        check_reset(
            api, torch.empty(reset.shape, dtype=reset.dtype, device="meta"), meta, [meta], dim
        )
    else:
        check_reset(api, reset, meta, [meta], dim)  # raises: not a tensor
    expected = _reset_placements(reset, input, dim)
    if not isinstance(reset, DTensor):
        raise ScanTypeError(
            f"{api}: `reset` is a torch.Tensor while `input` is a DTensor; make it a DTensor "
            f"placed like `input`: distribute_tensor(reset, mesh, {list(expected)})."
        )
    if reset.device_mesh != input.device_mesh or reset.placements != expected:
        raise ScanValueError(
            f"{api}: `reset` has placements {reset.placements}, expected {expected} on "
            "`input`'s DeviceMesh: placed like `input`, replicated where it has size 1 or "
            f"no such dimension; redistribute it: reset.redistribute(mesh, {list(expected)})."
        )
    return reset.to_local()


def refuse_dtensor_reset(api: str) -> NoReturn:
    """Raise the error for a DTensor ``reset`` next to a plain ``input``."""
    raise ScanTypeError(
        f"{api}: `reset` is a DTensor while `input` is a torch.Tensor; make `input` a "
        "DTensor on `reset`'s mesh (e.g. distribute_tensor(input, mesh, placements)), or "
        "pass the mask as a tensor (`reset.full_tensor()`)."
    )


def _reset_placements(reset: Any, input: Any, dim: int) -> tuple:
    """The placements a ``reset`` mask (1-D, or with ``input``'s dimensions) needs so that
    each rank's local mask fits its local piece of ``input``."""
    from torch.distributed.tensor import Replicate, Shard

    wanted = []
    for p in input.placements:
        if not isinstance(p, Shard):
            wanted.append(Replicate())
        elif reset.ndim == 1:
            wanted.append(Shard(0) if p.dim == dim else Replicate())
        else:
            wanted.append(p if reset.shape[p.dim] == input.shape[p.dim] else Replicate())
    return tuple(wanted)


# ---- across the ranks ------------------------------------------------------------------


class _Piece:
    """This rank's shard of a sequence along ``dim``: ``lengths`` of every rank's
    shard, ``rank`` this one's position on the sequence's mesh dimension."""

    def __init__(self, op: Any, dim: int, reverse: bool, lengths: tuple, rank: int) -> None:
        self.op, self.dim, self.reverse = op, dim, reverse
        self.lengths, self.rank = lengths, rank
        self.extremum = op in _EXTREMA

    def across(self, local: Any, reset: Any, exclusive: bool, agreement: Any) -> Any:
        """The local inclusive result ``local`` with the carries of the earlier shards
        folded in (steps 1-4 of the module docstring)."""
        from .exchange import exchange, tie

        dim, n = self.dim, self.lengths[self.rank]
        # cummax/cummin's indices: positions in the whole axis
        outs = [local[0], local[1] + sum(self.lengths[: self.rank])] if self.extremum else [local]
        mask = None if reset is None else _along(reset, outs[0].ndim, dim)
        agreement.describe = lambda: self._facts(outs[0], mask, exclusive)
        prefix = anchor = None
        if len(self.lengths) > 1:  # one rank holds the whole axis: nothing to exchange
            carry = [self._last(o) for o in outs]
            if mask is not None:  # whether each lane's carry passes through this shard
                carry.append(~mask.expand(outs[0].shape).any(dim))
            gathered, anchor = exchange(carry, agreement.group)
            prefix = self._prefix(gathered, mask is not None)
        if prefix is not None and n:
            before = [p.unsqueeze(dim) for p in prefix]
            if mask is None and not self.extremum and not recorded(outs):
                # into the drop-in's fresh result: no second buffer of the shard's size
                _COMBINES[self.op](before[0], outs[0], out=outs[0])
                fixed = outs
            else:
                fixed = self._combine(before, outs)
            if mask is None:
                outs = fixed
            else:
                still = _before_first_reset(mask, dim, self.reverse)
                outs = [torch.where(still, f, o) for f, o in zip(fixed, outs)]
        if exclusive:
            outs = self._shifted(outs, prefix, mask)
        if anchor is not None and (prefix is None or not n):
            outs = tie(anchor, outs)  # nothing gathered was used: tie it in (see scan.py)
        return tuple(outs) if self.extremum else outs[0]

    def _last(self, out: torch.Tensor) -> torch.Tensor:
        """``out``'s last step in scan order; zeros computed from it when it is empty, so
        that it stays in the graph (see ``fscan._sharded.scan._piece_total``)."""
        dim, n = self.dim, out.shape[self.dim]
        if n:
            return out.select(dim, 0 if self.reverse else n - 1)
        if out.is_floating_point() or out.is_complex():
            return out.sum(dim)
        return out.new_zeros(out.shape[:dim] + out.shape[dim + 1 :])

    def _prefix(self, gathered: list[torch.Tensor], masked: bool) -> list[torch.Tensor] | None:
        """The fold of the carries of the non-empty shards before this one in scan
        order (None: there is none), restarted after a shard whose lane holds a reset."""
        world = len(self.lengths)
        order = list(range(world - 1, -1, -1) if self.reverse else range(world))
        through = gathered.pop() if masked else None
        prefix = None
        for r in order[: order.index(self.rank)]:
            if not self.lengths[r]:
                continue
            carry = [g[r] for g in gathered]
            if prefix is None:
                prefix = carry
                continue
            folded = self._combine(prefix, carry)
            if through is not None:
                folded = [torch.where(through[r], f, c) for f, c in zip(folded, carry)]
            prefix = folded
        return prefix

    def _combine(self, before: list[torch.Tensor], after: list[torch.Tensor]) -> list:
        """The op's combine of an earlier result ``before`` with a later one ``after``."""
        if not self.extremum:
            return [_COMBINES[self.op](before[0], after[0])]
        (value, index), (later, later_index) = before, after
        wins = later >= value if self.op is torch.cummax else later <= value
        if later.is_floating_point():
            wins = wins | later.isnan()
        return [torch.where(wins, later, value), torch.where(wins, later_index, index)]

    def _shifted(
        self, outs: list[torch.Tensor], prefix: list[torch.Tensor] | None, mask: Any
    ) -> list[torch.Tensor]:
        """The exclusive results: ``outs`` one step later in scan order, ``prefix`` (or
        the identity) at the first step, the identity at resets."""
        dim, reverse, n = self.dim, self.reverse, outs[0].shape[self.dim]
        if not n:
            return outs
        starts = [identity(self.op, outs[0].dtype)] + ([-1] if self.extremum else [])
        shifted = []
        for i, (out, start) in enumerate(zip(outs, starts)):
            lane = out.select(dim, 0).unsqueeze(dim)
            head = torch.full_like(lane, start) if prefix is None else prefix[i].unsqueeze(dim)
            body = out.narrow(dim, 1 if reverse else 0, n - 1)
            joined = torch.cat([body, head] if reverse else [head, body], dim)
            if mask is not None:
                joined = torch.where(mask, torch.full_like(lane, start), joined)
            shifted.append(joined)
        return shifted

    def _facts(self, out: torch.Tensor, mask: Any, exclusive: bool) -> tuple[list, Callable]:
        """What the exchange depends on, for the ranks' agreement (``fscan._sharded.agree``)."""
        dim = self.dim
        shape = tuple("n" if i == dim else s for i, s in enumerate(out.shape))
        facts = [
            ("function", None, self.op.__name__),
            ("`dim`", None, str(dim)),
            ("`reverse`", None, str(self.reverse)),
            ("`exclusive`", None, str(exclusive)),
            ("`reset`", None, "None" if mask is None else f"a mask of {mask.ndim} dims"),
            ("dtype", 0, str(out.dtype)),
            ("device type", 0, out.device.type),
            ("shape (n: the scan dimension)", 0, str(shape).replace("'", "")),
        ]
        return facts, lambda: ["`input`"]


def _along(reset: torch.Tensor, ndim: int, dim: int) -> torch.Tensor:
    """A local ``reset`` mask (1-D, or with the input's dimensions) broadcasting against
    the results."""
    if reset.ndim == 1 and ndim != 1:
        return reset.reshape([reset.shape[0] if i == dim else 1 for i in range(ndim)])
    return reset


def _before_first_reset(mask: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    """Where no reset comes at or before a step in scan order: the steps the carry
    from the earlier shards reaches."""
    counts = mask.to(torch.int32)
    counts = counts.flip(dim).cumsum(dim).flip(dim) if reverse else counts.cumsum(dim)
    return counts == 0
