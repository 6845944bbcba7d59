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
costs what the inclusive one does; a call the kernel served that way is stored for
:mod:`fscan._routing.repeat_drop_ins`, whose exclusive route repeats it for an
identical call before the drop-in's checks.

cummax/cummin's indices are positions in the whole input: reversed, the narrowed input
starts one step later, so its indices are moved by one (by the kernel as it writes them,
a runtime argument of its position leaf; after the scan on the other engines).
"""

from __future__ import annotations

from typing import Any

import torch

from .._exclusive import Shift, Steps, exclusive, recorded
from .._segmented import check_reset
from .cumulative import engine, kernel_call, kernel_threads, route, segmented
from .cumulative_table import SUMS
from .repeat_drop_ins import remember_exclusive

__all__ = ["exclusive_cumulative", "identity"]

_EXTREMA = {torch.cummax: torch.return_types.cummax, torch.cummin: torch.return_types.cummin}


def exclusive_cumulative(
    api: str, op: Any, x: torch.Tensor, dim: int, reverse: bool, reset: Any = None
) -> Any:
    """The exclusive drop-in ``api`` of torch's ``op`` on ``x`` (checked, in the dtype
    torch computes in, ``dim`` non-negative), restarted where ``reset`` is True.

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
        return _native_exclusive(op, x, dim, reverse)

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
    out = exclusive(shift, inclusive, outputs, x.device, starts, [x], reset)
    if cells[0] and reset is None:  # the kernel's: an identical call repeats it
        remember_exclusive(op, kernel_call(op, x), dim, reverse, kernel_threads(x, dim), starts)
    return _EXTREMA[op](out) if extremum else out[0]


def _native_exclusive(op: Any, x: torch.Tensor, dim: int, reverse: bool) -> Any:
    """The exclusive drop-in on torch's ``op`` where nothing records, written directly:
    torch's op writes the first ``n - 1`` steps of ``x`` one step later into a fresh
    buffer, and the identity fills its first step. Reversed, the exclusive scan of ``x``
    is the forward one of ``x.flip(dim)``, flipped back: a flip, the op and a flip, as
    the inclusive drop-in reversed. (The route through :func:`exclusive`'s shift flipped
    the narrowed input, flipped the op's result back and then copied it into the
    output's later steps: 1.3-1.5x the inclusive call, (4096, 256) float32 dim 1, one
    thread. Forward, its steps in Python cost ~70 us a call over torch's op, 4 us for
    the inclusive drop-in: 6% of a (1048576,) cummax.)"""
    n = x.shape[dim]
    source = x.flip(dim) if reverse else x
    part = source.narrow(dim, 0, n - 1)
    values = torch.empty_like(source)
    later = values.narrow(dim, 1, n - 1)
    values.narrow(dim, 0, 1).fill_(identity(op, x.dtype))
    if op not in _EXTREMA:
        op(part, dim, dtype=x.dtype, out=later) if op in SUMS else op(part, dim, out=later)
        return values.flip(dim) if reverse else values
    indices = torch.empty(x.shape, dtype=torch.int64, device=x.device)
    later_indices = indices.narrow(dim, 1, n - 1)
    op(part, dim, out=(later, later_indices))
    indices.narrow(dim, 0, 1).fill_(-1)
    if not reverse:
        return _EXTREMA[op]((values, indices))
    # positions in the flipped input back to positions in `x`, in place (one pass)
    torch.sub(torch.tensor(n - 1), later_indices, out=later_indices)
    return _EXTREMA[op]((values.flip(dim), indices.flip(dim)))


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
    if dtype.is_floating_point:
        return float("-inf") if largest else float("inf")
    info = torch.iinfo(dtype)
    return info.min if largest else info.max
