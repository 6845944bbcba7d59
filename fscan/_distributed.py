"""The public functions of ``fscan.distributed``: their arguments checked inside the
ranks' agreement (:func:`fscan._sharded.agree.agreeing`), then the sharded engines of
:mod:`fscan._sharded.scan` (where the algorithm is described).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._call import RecurrenceCall, ScanCall
from ._entry import checked_call
from ._errors import ScanTypeError
from ._exclusive import check_exclusive
from ._pytree import describe, flatten
from ._recurrences.args import check_recurrence_args, reset_mask
from ._sharded.agree import agreeing, scan_facts
from ._sharded.deterministic import NOT_TRACED, deterministic_recurrence, deterministic_scan
from ._sharded.layout import Layout
from ._sharded.scan import check_layout, sharded_recurrence, sharded_scan
from ._sharded.shift import exclusive_recurrence, scan_with_start

__all__ = ["associative_scan", "linear_recurrence"]

_API = "fscan.distributed.associative_scan"
_API_LINEAR = "fscan.distributed.linear_recurrence"


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
    deterministic: bool = False,
    initial: Any = None,
    exclusive: bool = False,
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
    it raises its own error and the others ``fscan.PeerRankError``. It runs under
    ``torch.compile`` (``fullgraph=True`` too), values and gradients, without that
    check (every rank must compile the same call). Tensors that ``combine_fn``
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
        deterministic (bool, default False): values bitwise the same for any number
            of ranks and any split (``layout``), equal to this call on one rank
            holding the whole sequence: a combine order fixed by global position
            (blocks of ``ceil(sqrt(n))`` steps folded left to right, then their
            totals one by one), in batched calls of a fixed width. Slower (about
            ``2 sqrt(n)`` sequential ``combine_fn`` calls, three ``all_gather``s);
            gradients equal up to rounding; not under ``torch.compile``. See the
            distributed page of the docs.
        initial (pytree or None): a carry-in before the whole sequence (after it, for
            ``reverse``), the same on every rank, as in ``fscan.associative_scan``.
        exclusive (bool, default False): the carry into each step, as in
            ``fscan.associative_scan`` (``initial`` required); the step that moves
            to the next rank costs one more ``all_gather`` of one element per piece.

    Returns:
        This rank's piece of the scan, the structure and shapes of ``xs``.

    Example:
        >>> import torch, torch.distributed as dist, fscan.distributed
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> fscan.distributed.associative_scan(torch.add, torch.arange(1.0, 5.0), 0)
        tensor([ 1.,  3.,  6., 10.])
        >>> dist.destroy_process_group()
    """
    args = (combine_fn, xs, dim, reverse, combine_mode, group, layout, reset, validate)
    if deterministic is True and torch.compiler.is_compiling():  # see NOT_TRACED
        return _scan_eagerly(*args, deterministic, initial, exclusive)
    return _scan(*args, deterministic, initial, exclusive)


def _scan(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool,
    combine_mode: str,
    group: Any,
    layout: Layout | None,
    reset: torch.Tensor | None,
    validate: bool | None,
    deterministic: bool,
    initial: Any = None,
    exclusive: bool = False,
) -> Any:
    """The body of :func:`associative_scan`."""
    with agreeing(_API, group) as agreement:  # a rank's error reaches every rank
        leaves, spec = flatten(xs)
        args = (combine_fn, xs, spec, leaves, dim, reverse, combine_mode, validate, reset)
        call = checked_call(ScanCall(_API, *args, initial, exclusive))
        if layout is not None and not isinstance(layout, Layout):
            raise ScanTypeError(
                f"{_API}: `layout` must be a fscan.distributed.Layout or None, "
                f"got {describe(layout)}."
            )
        inclusive = deterministic_scan if _checked_flag(_API, deterministic) else sharded_scan
        if call.initial is None and not call.exclusive:
            return inclusive(call, agreement, layout)
        # the step that moves to the next rank: see fscan._sharded.shift
        agreement.describe = lambda: scan_facts(call, layout, deterministic)
        n = leaves[0].shape[call.dim]
        lengths = (n,) if layout is None else check_layout(_API, layout, agreement.group, n)
        return scan_with_start(
            call,
            agreement.group,
            layout,
            lengths,
            lambda inner: inclusive(inner, agreement, layout),
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
    deterministic: bool = False,
    exclusive: bool = False,
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
        deterministic (bool, default False): as in :func:`associative_scan`: the scan
            of the ``(a, b)`` pairs (``h -> a2 (a1 h + b1) + b2``) in that fixed
            order, ``initial`` folded into the first step (``a[0] initial + b[0]``).
        exclusive (bool, default False): the state entering each step, as in
            ``fscan.linear_recurrence`` (``initial``, zero by default, at the first
            step; zero where ``reset`` is True): the inclusive result moved one step,
            across ranks with one more ``all_gather`` of one element.

    Returns:
        Tensor: this rank's piece of ``h``.

    Example:
        >>> import torch, torch.distributed as dist, fscan.distributed
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> fscan.distributed.linear_recurrence(0.5, torch.ones(3), 0)
        tensor([1.0000, 1.5000, 1.7500])
        >>> dist.destroy_process_group()
    """
    call = RecurrenceCall(_API_LINEAR, a, b, dim, initial, reverse, reset, acc_dtype)
    if deterministic is True and torch.compiler.is_compiling():  # see NOT_TRACED
        return _recurrence_eagerly(call, group, deterministic, exclusive)
    return _recurrence(call, group, deterministic, exclusive)


def _recurrence(
    call: RecurrenceCall, group: Any, deterministic: bool, exclusive: bool = False
) -> torch.Tensor:
    """The body of :func:`linear_recurrence`."""
    with agreeing(_API_LINEAR, group) as agreement:
        check_exclusive(_API_LINEAR, exclusive)
        agreement.options = [("`exclusive`", None, str(exclusive))]
        if _checked_flag(_API_LINEAR, deterministic):
            h = deterministic_recurrence(call, agreement)
        else:
            h = sharded_recurrence(call, agreement)
        if not exclusive:
            return h
        api, a, b, dim, initial, reverse, reset = call[:7]
        _, b, initial, dim = check_recurrence_args(api, a, b, dim, initial, reverse, matrix=False)
        mask = None if reset is None else reset_mask(reset, b, dim, api=api)
        return exclusive_recurrence(h, dim, reverse, initial, mask, agreement.group)


# Dynamo does not trace these: it calls them (a graph break; fullgraph=True refuses).
# Eager calls go around them: the wrapper costs milliseconds per call.
_scan_eagerly = torch.compiler.disable(_scan, reason=NOT_TRACED)
_recurrence_eagerly = torch.compiler.disable(_recurrence, reason=NOT_TRACED)


def _checked_flag(api: str, deterministic: Any) -> bool:
    if not isinstance(deterministic, bool):
        raise ScanTypeError(
            f"{api}: `deterministic` must be a bool, got {describe(deterministic)}."
        )
    return deterministic
