"""Drop-in cumulative ops: ``torch.cumsum`` & co. with ``reverse=`` and ``reset=`` (segmented),
each a scan underneath.

``fscan.cumsum``, ``cumprod``, ``cummax``, ``cummin`` and ``logcumsumexp`` take
torch's arguments in torch's order (extras keyword-only) and return what torch
returns: the same dtypes (integers and bool sum and multiply in int64, ``dtype=``
casts first), shapes (0-d inputs, empty dimensions), ``(values, indices)``
structs with torch's tie-breaking and NaN rules, and the same precision
(accumulation in float64 for float32, in float32 for half types).

Each op checks its arguments (a call that torch's op serves, forward or reversed, is
handed to it first, unchecked, and torch's errors send it back to the checks) and makes one
call into :mod:`fscan._routing.cumulative`, which picks the engine: torch's own
op, the generated C++ kernel or fscan's blocked parallel scan (its docstring has
the table; ``path`` says which a call takes).

``out=`` follows torch's rules for the same op: torch's op applies them itself where
it serves the call, else they are checked before the call and applied after it
(:mod:`fscan._ops_out`): cumsum/cumprod compute in
``out``'s dtype (``dtype=``, if given, must equal it), the others want ``out`` in
the input's dtype and cummax/cummin's indices in int64; no ``out=`` while autograd
records a tensor that requires grad; an ``out`` of another shape is resized (with
torch's warning unless it is empty); ``out`` itself is returned.
"""

from __future__ import annotations

from typing import Any

import torch

from ._checks import check_dense, normalize_dim, refuse_reverse
from ._errors import ScanTypeError
from ._exclusive import check_exclusive
from ._ops_out import OUT_TYPES, check_extremum_out, check_out, direct_out, write_out, written
from ._route_log import logs_route
from ._routing.cumulative import (
    cumulative,
    native_first,
    native_first_into,
    repeat_cumulative,
    repeat_exclusive,
    repeat_segmented,
)
from ._routing.exclusive import exclusive_cumulative, native_first_exclusive
from ._sharded.dtensor_ops import is_dtensor, on_dtensor, refuse_dtensor_reset

__all__ = ["cummax", "cummin", "cumprod", "cumsum", "logcumsumexp"]


@logs_route("fscan.cumsum")
def cumsum(
    input: torch.Tensor,
    dim: int,
    *,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    exclusive: bool = False,
) -> torch.Tensor:
    """``torch.cumsum`` with ``reverse=``: ``out[i] = input[0] + ... + input[i]`` along ``dim``.

    Args:
        input (Tensor): the input; 0-d is allowed (``dim`` 0 or -1).
        dim (int): the dimension to sum along.
        dtype (torch.dtype, optional): cast ``input`` to this dtype first.
        out (Tensor, optional): write the result here and return it, as torch does:
            ``input`` is cast to ``out``'s dtype first (``dtype``, if given, must be
            ``out``'s, else ``RuntimeError``); an ``out`` of another shape is resized
            (with torch's ``UserWarning`` unless it has no elements); ``RuntimeError``
            while autograd records a tensor that requires grad.
        reverse (bool, default False): sum from the end, ``out[i] = input[i] + ...
            + input[n - 1]``.
        reset (Tensor, optional): a bool mask where the sum restarts (``out[i] =
            input[i]`` where it is True), as ``fscan.associative_scan``'s ``reset=``: 1-D
            of length ``n`` along ``dim``, or with ``input``'s dimensions, size ``n``
            along ``dim`` and 1 or ``input``'s size elsewhere. The same as summing each
            segment on its own; with ``reverse=True`` a True marks a segment's last
            element in index order.

    Returns:
        Tensor: ``input``'s shape; dtype ``dtype``, else int64 for integer and bool
        inputs, else ``input``'s; ``out`` itself if given.

    Example:
        >>> import fscan, torch
        >>> x = torch.tensor([1, 2, 3])
        >>> fscan.cumsum(x, 0), fscan.cumsum(x, 0, reverse=True)
        (tensor([1, 3, 6]), tensor([6, 5, 3]))
        >>> buffer = torch.empty(3)
        >>> fscan.cumsum(input=x, dim=0, out=buffer) is buffer, buffer
        (True, tensor([1., 3., 6.]))
        >>> fscan.cumsum(torch.ones(5), 0, reset=torch.tensor([0, 0, 1, 0, 1]) > 0)
        tensor([1., 2., 1., 2., 1.])
    """
    if type(input) is not torch.Tensor and is_dtensor(input):  # see fscan._sharded.dtensor_ops
        return on_dtensor(torch.cumsum, cumsum, input, dim, dtype, out, reverse, reset, exclusive)
    if dtype is None:
        result = _unchecked(torch.cumsum, input, dim, out, reverse, exclusive, reset)
        if result is not None:
            return result  # torch promotes integers and bool to int64 itself
    args = (input, dim, dtype, out, reverse, reset, exclusive)
    return _sum_or_product("fscan.cumsum", torch.cumsum, *args)


@logs_route("fscan.cumprod")
def cumprod(
    input: torch.Tensor,
    dim: int,
    *,
    dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    exclusive: bool = False,
) -> torch.Tensor:
    """``torch.cumprod`` with ``reverse=``: ``out[i] = input[0] * ... * input[i]`` along ``dim``.

    Arguments (``out=`` and ``reset=`` included) and result dtype as in :func:`cumsum`.
    Gradients are exact with zeros.

    Example:
        >>> import fscan, torch
        >>> fscan.cumprod(torch.tensor([1.0, 2.0, 3.0]), 0, reverse=True)
        tensor([6., 6., 3.])
    """
    if type(input) is not torch.Tensor and is_dtensor(input):  # see fscan._sharded.dtensor_ops
        return on_dtensor(torch.cumprod, cumprod, input, dim, dtype, out, reverse, reset, exclusive)
    if dtype is None:
        result = _unchecked(torch.cumprod, input, dim, out, reverse, exclusive, reset)
        if result is not None:
            return result
    args = (input, dim, dtype, out, reverse, reset, exclusive)
    return _sum_or_product("fscan.cumprod", torch.cumprod, *args)


@logs_route("fscan.logcumsumexp")
def logcumsumexp(
    input: torch.Tensor,
    dim: int,
    *,
    out: torch.Tensor | None = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    exclusive: bool = False,
) -> torch.Tensor:
    """``torch.logcumsumexp`` with ``reverse=``: ``out[i] = log(sum(exp(input[:i + 1])))``.

    ``-inf`` entries add nothing, ``+inf`` and NaN propagate, as in torch. Complex
    inputs always use torch's kernel: the imaginary part of a complex log is only
    defined up to multiples of 2 pi, and which one torch returns depends on its
    sequential order of combination (``reset=``, as in :func:`cumsum`, takes float
    inputs only). ``out=`` as in torch: in ``input``'s dtype (else ``RuntimeError``),
    resized and returned as in :func:`cumsum`.

    Example:
        >>> import fscan, torch
        >>> fscan.logcumsumexp(torch.tensor([0.0, float("-inf"), 0.0]), 0)
        tensor([0.0000, 0.0000, 0.6931])
    """
    if type(input) is not torch.Tensor and is_dtensor(input):
        return on_dtensor(
            torch.logcumsumexp, logcumsumexp, input, dim, None, out, reverse, reset, exclusive
        )
    result = _unchecked(torch.logcumsumexp, input, dim, out, reverse, exclusive, reset)
    if result is not None:
        return result
    if out is not None:
        check_out("fscan.logcumsumexp", input, out)
    x, dim = _prepare("fscan.logcumsumexp", input, dim, reverse, exclusive)
    api, op = "fscan.logcumsumexp", torch.logcumsumexp
    return _run_out(api, op, x, dim, reverse, reset, exclusive, out, 5)


@logs_route("fscan.cummax")
def cummax(
    input: torch.Tensor,
    dim: int,
    *,
    out: Any = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    exclusive: bool = False,
) -> Any:
    """``torch.cummax`` with ``reverse=``: running maxima and the index of each.

    Returns ``torch.return_types.cummax(values, indices)``, like torch. Ties go to
    the later index; a NaN, once met, is the maximum from there on, and a later
    NaN takes over the index. With ``reverse=True`` (flip, cummax, flip) the
    indices are positions in ``input`` and ties go to the smaller index.

    ``out=(values, indices)`` (a tuple or list of two tensors: ``values`` in
    ``input``'s dtype, ``indices`` int64, else ``RuntimeError``) is written, resized
    as in :func:`cumsum`, and returned as ``torch.return_types.cummax_out``, like torch.

    ``reset=`` (as in :func:`cumsum`) restarts the running maximum where it is True;
    the indices stay positions in the whole ``input``.

    Example:
        >>> import fscan, torch
        >>> fscan.cummax(torch.tensor([1.0, 3.0, 3.0, 2.0]), 0)
        torch.return_types.cummax(
        values=tensor([1., 3., 3., 3.]),
        indices=tensor([0, 1, 2, 2]))
    """
    return _extremum("fscan.cummax", torch.cummax, input, dim, out, reverse, reset, exclusive)


@logs_route("fscan.cummin")
def cummin(
    input: torch.Tensor,
    dim: int,
    *,
    out: Any = None,
    reverse: bool = False,
    reset: torch.Tensor | None = None,
    exclusive: bool = False,
) -> Any:
    """``torch.cummin`` with ``reverse=``: running minima and their indices (see ``cummax``,
    ``out=`` and ``reset=`` included).

    Example:
        >>> import fscan, torch
        >>> fscan.cummin(torch.tensor([3, 1, 2, 1]), 0, reverse=True).indices
        tensor([1, 1, 3, 3])
    """
    return _extremum("fscan.cummin", torch.cummin, input, dim, out, reverse, reset, exclusive)


# ---- shared pieces -----------------------------------------------------------


def _unchecked(
    op: Any, input: Any, dim: Any, out: Any, reverse: Any, exclusive: Any, reset: Any = None
) -> Any:
    """The call on the unchecked arguments where it can skip the checks, else None (the
    checked path): torch's ``op`` where the drop-ins' route table certainly picks it
    (forward or reversed; ``out=`` forward only; exclusive, on torch's op written one step
    later), or the kernel run of an identical call (the router's repeat route: inclusive,
    exclusive, or inclusive with ``reset=``)."""
    if reset is not None:  # torch's op has no reset=: an identical call's segmented run
        plain = exclusive is False and out is None and (reverse is False or reverse is True)
        return repeat_segmented(op, input, dim, reverse, reset) if plain else None
    if exclusive is not False:  # True: torch's op, an identical call's kernel run, or the checks
        if exclusive is not True or out is not None or not (reverse is False or reverse is True):
            return None
        found = native_first_exclusive(op, input, dim, reverse)
        if found is None:
            found = repeat_exclusive(op, input, dim, reverse)
        return found
    if out is None:
        if reverse is False or reverse is True:  # else fscan's error, from the checks
            found = native_first(op, input, dim, reverse)
            if found is None:
                found = repeat_cumulative(op, input, dim, reverse)
            return found
        return None
    return native_first_into(op, input, dim, out) if reverse is False else None


def _prepare(
    api: str,
    input: Any,
    dim: Any,
    reverse: Any,
    exclusive: Any,
    dtype: torch.dtype | None = None,
    promote_integers: bool = False,
) -> tuple[torch.Tensor, int]:
    """Check the arguments; return the input in the dtype torch computes in, and ``dim``."""
    if not isinstance(input, torch.Tensor):
        raise ScanTypeError(f"{api}: `input` must be a torch.Tensor, got {type(input).__name__}.")
    check_dense(api, "`input`", input)
    if not isinstance(reverse, bool):  # the test inline: it runs on every call
        refuse_reverse(api, reverse)
    if exclusive is not False:
        check_exclusive(api, exclusive)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ScanTypeError(
            f"{api}: `dtype` must be a torch.dtype or None, got {type(dtype).__name__}."
        )
    # 0-d tensors scan over their one element, as in torch: dim 0 or -1.
    dim = normalize_dim(api, dim, max(input.ndim, 1), lambda: "`input`")
    if dtype is not None:
        input = input.to(dtype)
    elif promote_integers and not (input.is_floating_point() or input.is_complex()):
        input = input.to(torch.int64)
    return input, dim


def _sum_or_product(
    api: str,
    op: Any,
    input: Any,
    dim: Any,
    dtype: Any,
    out: Any,
    reverse: Any,
    reset: Any,
    exclusive: Any,
) -> torch.Tensor:
    """cumsum or cumprod (``op``) past torch's fast path: checked, routed, written to ``out``."""
    if out is not None:
        dtype = check_out(api, input, out, dtype, computes_in_out_dtype=True)
    x, dim = _prepare(api, input, dim, reverse, exclusive, dtype, promote_integers=True)
    return _run_out(api, op, x, dim, reverse, reset, exclusive, out, 6)


def _extremum(
    api: str, op: Any, input: Any, dim: Any, out: Any, reverse: Any, reset: Any, exclusive: Any
) -> Any:
    if type(input) is not torch.Tensor and is_dtensor(input):
        drop_in = cummax if op is torch.cummax else cummin
        return on_dtensor(op, drop_in, input, dim, None, out, reverse, reset, exclusive)
    result = _unchecked(op, input, dim, out, reverse, exclusive, reset)
    if result is not None:
        return result
    if out is not None:
        out = check_extremum_out(api, input, out)
    x, dim = _prepare(api, input, dim, reverse, exclusive)
    return _run_out(api, op, x, dim, reverse, reset, exclusive, out, 6)


def _run_out(
    api: str,
    op: Any,
    x: torch.Tensor,
    dim: int,
    reverse: bool,
    reset: Any,
    exclusive: bool,
    out: Any,
    stacklevel: int,
) -> Any:
    """:func:`_run` with ``out=`` (checked: a tensor, or cummax/cummin's pair) written:
    by the engine itself where :func:`direct_out` allows it (inclusive or exclusive, with
    or without ``reset=``; the exclusive ``reset=`` shift and torch's op reversed write
    new memory), else copied in after (``stacklevel``: :func:`write_out`'s, the caller's
    line). ``out`` itself is returned, as torch does."""
    if out is None:
        return _run(api, op, x, dim, reverse, reset, exclusive)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    into = direct_out(outs, x, [x.dtype, torch.int64][: len(outs)], reset)
    result = _run(api, op, x, dim, reverse, reset, exclusive, into)
    results = [result] if isinstance(out, torch.Tensor) else list(result)
    if into is None or not all(written(r, o) for r, o in zip(results, outs)):
        for r, o in zip(results, outs):  # a loop: a comprehension is a frame of its own before 3.12
            write_out(r, o, stacklevel)
    return outs[0] if isinstance(out, torch.Tensor) else OUT_TYPES[op](tuple(outs))


def _run(
    api: str,
    op: Any,
    x: torch.Tensor,
    dim: int,
    reverse: bool,
    reset: Any,
    exclusive: bool,
    into: list | None = None,
):
    """The checked call on the drop-ins' router, inclusive or exclusive; ``into``: memory
    the call's engine may write its result to (see :func:`_run_out`)."""
    if reset is not None and is_dtensor(reset):
        refuse_dtensor_reset(api)  # with a plain `input`: DTensor inputs never get here
    if exclusive:
        return exclusive_cumulative(api, op, x, dim, reverse, reset, into)
    return cumulative(api, op, x, dim, reverse, reset, into)
