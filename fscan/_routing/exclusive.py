"""The exclusive drop-ins: ``fscan.cumsum(..., exclusive=True)`` & co. on the drop-ins' router.

The shift is :func:`fscan._exclusive.exclusive`'s (the same for every door): the
inclusive drop-in of the first ``n - 1`` steps in scan order, on the engine
:mod:`fscan._routing.cumulative` picks for them (torch's op, the C++ kernel, the
blocked scan, or the segmented scan with ``reset=``), lands one step later; the first
step and the resets get the op's identity: 0 for cumsum, 1 for cumprod, ``-inf`` for
logcumsumexp, and for cummax (cummin) the lowest (highest) value of the dtype
(``-inf``/``inf`` for floating types, ``False``/``True`` for bool) with index -1. Where
nothing is recorded, the kernel and torch's op (forward) write their results in place
into the output's later steps, and reversed on torch's op, the flipped input's forward
exclusive scan is flipped back (:func:`_native_exclusive`), so an exclusive drop-in
costs what the inclusive one does. As for the inclusive drop-ins, the calls the table
certainly sends to torch's op are served before the drop-in's checks
(:func:`native_first_exclusive`), and a call the kernel served is stored for
:mod:`fscan._routing.repeat_drop_ins`, whose exclusive route repeats it for an
identical call before the checks: one pass of the kernel's exclusive variant, which
writes the exclusive scan itself (a kernel of its own, built for exclusive calls only:
:func:`~fscan._engines.cpp.cpu_kernel.exclusive_ready`; mode ``"eager"`` builds it on
the first call and runs it). The shift serves the rest: ``reset=``, recorded, traced or
non-contiguous calls (those on the ordinary kernel, where the table picks it), and calls
while the variant is still to be built (mode ``"on"``: counted, or building in the
background), there on the engine the table passes over to unless the ordinary kernel is
READY already, so that exclusive calls alone never build it.

cummax/cummin's indices are positions in the whole input: reversed, the narrowed input
starts one step later, so its indices are moved by one (by the kernel as it writes them,
a runtime argument of its position leaf; after the scan on the other engines).
"""

from __future__ import annotations

from typing import Any

import torch

from .._context import under_transform
from .._engines.cpp.cpu_kernel import kernel_ready
from .._exclusive import Shift, Steps, exclusive, recorded
from .._route_log import ran
from .._segmented import check_reset
from .cumulative import engine, kernel_call, kernel_threads, route, segmented
from .cumulative_table import NATIVE_BELOW, SUMS, torch_serves
from .repeat_drop_ins import remember_exclusive, run_exclusive

__all__ = ["exclusive_cumulative", "identity", "native_first_exclusive"]

_is_compiling = torch.compiler.is_compiling  # bound once: Dynamo folds it by identity
_STRIDED = torch.strided
_EXTREMA = {torch.cummax: torch.return_types.cummax, torch.cummin: torch.return_types.cummin}


def exclusive_cumulative(
    api: str,
    op: Any,
    x: torch.Tensor,
    dim: int,
    reverse: bool,
    reset: Any = None,
    out: list[torch.Tensor] | None = None,
) -> Any:
    """The exclusive drop-in ``api`` of torch's ``op`` on ``x`` (checked, in the dtype
    torch computes in, ``dim`` non-negative), restarted where ``reset`` is True, written
    into ``out`` where given (a drop-in's ``out=``, checked by
    :func:`fscan._ops_out.direct_out`: the result is then ``out``'s memory, except
    reversed on torch's op, whose flipped result the caller copies in).

    Example:
        >>> exclusive_cumulative("fscan.cumsum", torch.cumsum, torch.tensor([1, 2, 3]), 0, False)
        tensor([0, 1, 3])
    """
    if x.ndim == 0:  # one step, as torch scans 0-d tensors
        out = exclusive_cumulative(api, op, x[None], 0, reverse, reset)
        return _EXTREMA[op]((out[0][0], out[1][0])) if op in _EXTREMA else out[0]
    if reset is not None:  # checked on the whole input, so that errors name its shape
        check_reset(api, reset, x, [x], dim)
    shift = Shift(dim, x.shape[dim], reverse)
    extremum = op in _EXTREMA
    cells = route(op, x, dim, reverse)  # as the inclusive drop-in on `x` is routed
    on_torch = cells == (False, False) and reset is None and shift.n > 1
    if on_torch and not torch.compiler.is_compiling() and not recorded([x]):
        return _native_exclusive(op, x, dim, reverse, into=out)

    def inclusive(steps: Steps, outs: list[torch.Tensor] | None) -> list[torch.Tensor]:
        part = steps(x)
        later = int(reverse and steps.narrow)  # where `part` starts in `x`, for the indices
        if reset is None:
            found = engine(api, op, part, dim, reverse, outs, cells, later)
        else:
            found = segmented(api, op, part, dim, reverse, steps.mask(reset))
            if extremum and later:
                found = (found[0], found[1].add_(later))
        return list(found) if extremum else [found]

    outputs = [(x.shape, x.dtype)]
    starts: list[Any] = [identity(op, x.dtype)]
    if extremum:
        outputs.append((x.shape, torch.int64))
        starts.append(-1)
    if cells[0] and reset is None:  # the kernel's exclusive variant, where it is READY
        call = kernel_call(op, x)
        found = remember_exclusive(op, call, dim, reverse, kernel_threads(x, dim, op), starts)
        if found is not None:  # (an identical call repeats it, before the checks)
            found = run_exclusive(found, x, out)
            ran("cpp")
            return _EXTREMA[op](found) if extremum else found[0]
        combine, spec, leaves, positions = call
        variant = x.is_contiguous() and not _is_compiling()  # a call the variant would take
        if variant and not kernel_ready(combine, spec, leaves, dim, positions):
            # The variant is counted or being built for this call: meanwhile the shift runs
            # on the engine the table passes over to (the route of a kernel still to be
            # built), so that no inclusive kernel is built for exclusive calls alone.
            cells = (False, cells[1])
    found = exclusive(shift, inclusive, outputs, x.device, starts, [x], reset, into=out)
    return _EXTREMA[op](found) if extremum else found[0]


def native_first_exclusive(op: Any, x: Any, dim: Any, reverse: bool) -> Any:
    """The exclusive drop-in of torch's ``op`` for a call with unchecked arguments where
    the table certainly picks torch's op for the inclusive drop-in on ``x`` (as
    :func:`~fscan._routing.cumulative.native_first` reads it) and nothing records, on
    :func:`_native_exclusive`; else None (the checked path). Under 2 steps, or a tensor
    the checks would refuse or that torch's op cannot take (its error), None too: the
    checked path answers in fscan's words. (The checked path costs ~25-40 µs a call in
    Python, (64,) float32 one thread: 5-10x torch's op.)"""
    if type(dim) is not int or type(x) is not torch.Tensor or _is_compiling():
        return None
    if x.layout is not _STRIDED or x.is_nested or x.is_quantized:  # check_dense's refusals
        return None
    if (x.requires_grad and torch.is_grad_enabled()) or under_transform():  # recorded()
        return None
    try:
        if x.shape[dim] < 2:  # IndexError where dim is out of range: the checks say so
            return None
        if x.numel() < NATIVE_BELOW or torch_serves(op, x, dim, reverse):
            dtype = x.dtype
            if op in SUMS and not (x.is_floating_point() or x.is_complex()):
                dtype = torch.int64  # torch's promotion of integers and bool
            return _native_exclusive(op, x, dim, reverse, dtype)
        return None
    except (IndexError, RuntimeError, NotImplementedError):  # torch's refusals: the checks
        return None


def _native_exclusive(
    op: Any,
    x: torch.Tensor,
    dim: int,
    reverse: bool,
    dtype: torch.dtype | None = None,
    into: list[torch.Tensor] | None = None,
) -> Any:
    """The exclusive drop-in on torch's ``op`` where nothing records, written directly
    (in ``dtype``, default ``x``'s; cumsum/cumprod compute in it; forward, into ``into``
    where given, a checked ``out=``): torch's op writes the
    first ``n - 1`` steps of ``x`` one step later into a fresh buffer, and the identity
    fills its first step. Reversed, the exclusive scan of ``x`` is the forward one of
    ``x.flip(dim)``, flipped back: a flip, the op and a flip, as the inclusive drop-in
    reversed. (The route through :func:`exclusive`'s shift flipped the narrowed input,
    flipped the op's result back and then copied it into the output's later steps:
    1.3-1.5x the inclusive call, (4096, 256) float32 dim 1, one thread.) Each view and
    fill is a torch call of ~1.5-2 µs: along dim 0 the views are slices (~0.6 µs less
    than ``narrow``), and small outputs start filled (``_FILLED_WHOLE``)."""
    n = x.shape[dim]
    if dtype is None:
        dtype = x.dtype
    source = x.flip(dim) if reverse else x
    start = _identities.get((op, dtype))
    if start is None:
        start = _identities[op, dtype] = identity(op, dtype)
    first = dim == 0 or dim == -x.ndim
    small = x.numel() <= _FILLED_WHOLE
    if reverse:  # flipped after: the caller copies the flipped result into its out=
        into = None
    if into is not None:
        values = into[0]
        values.select(dim, 0).fill_(start)
    elif small:  # the start value written everywhere, the op's steps over it
        values = _filled(source, start, dtype)
    else:
        values = torch.empty_like(source, dtype=dtype)
        values.select(dim, 0).fill_(start)
    if first:
        part, later = source[: n - 1], values[1:]
    else:
        part, later = source.narrow(dim, 0, n - 1), values.narrow(dim, 1, n - 1)
    if op not in _EXTREMA:
        op(part, dim, dtype=dtype, out=later) if op in SUMS else op(part, dim, out=later)
        return values.flip(dim) if reverse else values
    if into is not None:
        indices = into[1]
        indices.select(dim, 0).fill_(-1)
    elif small:
        indices = torch.full_like(source, -1, dtype=torch.int64)
    else:
        indices = torch.empty_like(source, dtype=torch.int64)
        indices.select(dim, 0).fill_(-1)
    later_indices = indices[1:] if first else indices.narrow(dim, 1, n - 1)
    op(part, dim, out=(later, later_indices))
    if not reverse:
        return _EXTREMA[op]((values, indices))
    # positions in the flipped input back to positions in `x`, in place (one pass)
    later_indices.neg_().add_(n - 1)
    return _EXTREMA[op]((values.flip(dim), indices.flip(dim)))


def _filled(like: torch.Tensor, start: Any, dtype: torch.dtype) -> torch.Tensor:
    """A fresh tensor like ``like`` in ``dtype``, filled with ``start`` (the cheapest of
    torch's calls for it: ~0.6 µs apart at (64,))."""
    if dtype is not like.dtype:
        return torch.full_like(like, start, dtype=dtype)
    return torch.zeros_like(like) if start == 0 else torch.full_like(like, start)


# Up to this many elements the first step's start value is written by filling the whole
# fresh output (`full_like`, ~1 µs over `empty_like` at (64,)) rather than through a view
# of the first step (a select and a fill: ~3 µs); past it, the extra pass over memory
# would cost more than the view.
_FILLED_WHOLE = 4096
# identity() per (op, dtype): its chain of tests cost ~1 µs of a small exclusive call
_identities: dict[tuple[Any, torch.dtype], Any] = {}


def identity(op: Any, dtype: torch.dtype) -> Any:
    """The start value of the exclusive drop-in of ``op`` in ``dtype``.

    Example:
        >>> identity(torch.cummax, torch.int8), identity(torch.cummin, torch.bool)
        (-128, True)
    """
    if op is torch.cumsum:
        return 0
    if op is torch.cumprod:
        return 1
    if op is torch.logcumsumexp:
        return float("-inf")
    largest = op is torch.cummax
    if dtype == torch.bool:
        return not largest
    if dtype.is_floating_point or dtype.is_complex:  # complex: torch's op refuses it after
        return float("-inf") if largest else float("inf")
    info = torch.iinfo(dtype)
    return info.min if largest else info.max
