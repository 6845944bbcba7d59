"""A model-wide swap: torch's cumulative ops run fscan's drop-ins inside a ``with`` block.

``swap_cumulative_ops()`` is a ``torch.overrides.TorchFunctionMode``. While it is
active, every call of ``torch.cumsum``, ``torch.cumprod``, ``torch.cummax``,
``torch.cummin``, ``torch.logcumsumexp``, of the ``Tensor`` methods of the same
names and of the in-place ``Tensor.cumsum_`` and ``Tensor.cumprod_`` goes to
``fscan.cumsum`` & co. instead, so a model whose code cannot be edited gets
fscan's paths (``out=`` included: the drop-ins follow torch's ``out=`` rules).
Every other call passes through untouched, and so does a cumulative call that
fscan's drop-in does not take as given (a named ``dim``, a Tensor subclass other
than DTensor, a sparse, nested or quantized input, an in-place call that torch
refuses): torch's own op runs it and raises its own errors. A DTensor goes to the
drop-ins, which scan one sharded along the scanned dimension without gathering it
(:mod:`fscan._sharded.dtensor_ops`).

torch runs a mode's handler with the mode taken off the stack, so the drop-ins'
own calls to torch (their native path calls ``torch.cumsum``) reach the modes
below this one, not this one again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._ops import cummax, cummin, cumprod, cumsum, logcumsumexp
from ._sharded.dtensor_ops import is_dtensor

__all__ = ["swap_cumulative_ops"]

# torch's function -> (fscan's drop-in, the keywords the drop-in takes besides ``dim``).
# ``out=`` is among them: the drop-ins apply torch's out= rules themselves.
_OUT_OF_PLACE: dict[Any, tuple[Callable[..., Any], frozenset[str]]] = {}
for _torch_op, _fscan_op, _keywords in (
    ("cumsum", cumsum, frozenset({"dtype", "out"})),
    ("cumprod", cumprod, frozenset({"dtype", "out"})),
    ("cummax", cummax, frozenset({"out"})),
    ("cummin", cummin, frozenset({"out"})),
    ("logcumsumexp", logcumsumexp, frozenset({"out"})),
):
    _OUT_OF_PLACE[getattr(torch, _torch_op)] = (_fscan_op, _keywords)
    _OUT_OF_PLACE[getattr(torch.Tensor, _torch_op)] = (_fscan_op, _keywords)

# The in-place methods: ``x.cumsum_(dim, *, dtype=None)`` writes into ``x``.
_IN_PLACE: dict[Any, Callable[..., Any]] = {
    torch.Tensor.cumsum_: cumsum,
    torch.Tensor.cumprod_: cumprod,
}

# Tensor types the drop-ins take as torch does; a subclass keeps its own override.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _bind(args: tuple, kwargs: dict, keywords: frozenset[str]) -> tuple[Any, int, dict] | None:
    """``(input, dim, extra keywords)`` of a call with torch's signature
    ``(input, dim, *, keywords...)``, or None where the drop-in cannot take it as
    given: more positional arguments than two, an unknown keyword (``out=`` in
    place), a ``dim`` that is not an int, an input that is not a plain dense tensor
    or a DTensor."""
    if len(args) == 2 and not kwargs:  # the common spelling, bound without copies
        (input, dim), extra = args, {}
    else:
        if len(args) > 2:
            return None
        extra = dict(kwargs)
        bound = list(args)
        for name in ("input", "dim")[len(args) :]:
            if name not in extra:
                return None
            bound.append(extra.pop(name))
        input, dim = bound
        if not keywords.issuperset(extra):
            return None
    taken = type(input) in _PLAIN_TENSORS or is_dtensor(input)  # DTensors: scanned across ranks
    if type(dim) is not int or not taken or not _dense(input):
        return None
    return input, dim, extra


def _dense(x: torch.Tensor) -> bool:
    return x.layout == torch.strided and not x.is_nested and not x.is_quantized


def _in_place(drop_in: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``x.cumsum_(dim, *, dtype=None)`` with fscan's values written into ``x``; ``x``
    returned. None where torch's in-place op should run instead: torch refuses a
    ``dtype`` other than ``x``'s and bool tensors (its error is the one to see)."""
    call = _bind(args, kwargs, frozenset({"dtype"}))
    if call is None:
        return None
    x, dim, extra = call
    if x.dtype == torch.bool or extra.get("dtype") not in (None, x.dtype):
        return None
    # The drop-in's graph may save its input for backward (cumprod's does): give it a
    # copy, since x is about to be overwritten.
    source = x.clone() if x.requires_grad and torch.is_grad_enabled() else x
    # Integer inputs are summed in int64 and wrap back to x's dtype, as torch's do.
    return x.copy_(drop_in(source, dim, **extra))


class _SwapCumulativeOps(TorchFunctionMode):
    """The mode behind :func:`swap_cumulative_ops`."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        swap = _OUT_OF_PLACE.get(func)
        if swap is not None:
            drop_in, keywords = swap
            call = _bind(args, kwargs, keywords)
            if call is not None:
                input, dim, extra = call
                return drop_in(input, dim, **extra)
        elif (drop_in := _IN_PLACE.get(func)) is not None:
            out = _in_place(drop_in, args, kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def swap_cumulative_ops() -> TorchFunctionMode:
    """A context manager under which torch's cumulative ops run fscan's drop-ins.

    Inside ``with fscan.swap_cumulative_ops():``, ``torch.cumsum``,
    ``torch.cumprod``, ``torch.cummax``, ``torch.cummin``, ``torch.logcumsumexp``,
    the ``Tensor`` methods of the same names and ``Tensor.cumsum_`` /
    ``Tensor.cumprod_`` run :func:`fscan.cumsum` & co., for code you cannot edit
    (a model's ``forward``). It is a ``torch.overrides.TorchFunctionMode``, so it
    nests with other modes and works under autograd, ``torch.compile`` and vmap.
    Results, dtypes, gradients and ``out=`` are torch's (the drop-ins' contract);
    a call the drop-ins do not take as given (a named ``dim``, a Tensor
    subclass, a non-dense input, an in-place call with another ``dtype``) runs
    torch's own op, and every other function passes through untouched::

        for every call torch.cumsum(input, dim, dtype=dtype, out=out) inside the block:
            return fscan.cumsum(input, dim, dtype=dtype, out=out)

    Returns:
        TorchFunctionMode: enter it with ``with``; each call makes a new one.

    Example:
        >>> import fscan, torch
        >>> x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
        >>> with fscan.swap_cumulative_ops():
        ...     y = x.cumsum(-1)  # fscan.cumsum ran
        ...     z = x.clone().cumprod_(0)
        >>> y, z
        (tensor([[ 1.,  3.,  6.],
                [ 4.,  9., 15.]]), tensor([[ 1.,  2.,  3.],
                [ 4., 10., 18.]]))
    """
    return _SwapCumulativeOps()
