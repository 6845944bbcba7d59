"""Drop-in cumulative ops: ``torch.cumsum`` & co. with ``reverse=``, each a scan underneath.

``fscan.cumsum``, ``cumprod``, ``cummax``, ``cummin`` and ``logcumsumexp`` take
torch's arguments in torch's order (extras keyword-only) and return what torch
returns: the same dtypes (integers and bool sum and multiply in int64, ``dtype=``
casts first), shapes (0-d inputs, empty dimensions), ``(values, indices)``
structs with torch's tie-breaking and NaN rules, and the same precision
(accumulation in float64 for float32, in float32 for half types).

Each op checks its arguments (a forward call that torch's op serves is handed to
it first, unchecked, and torch's errors send it back to the checks) and makes one
call into :mod:`fscan._routing.cumulative`, which picks the engine: torch's own
op, the generated C++ kernel or fscan's blocked parallel scan (its docstring has
the table; ``path`` says which a call takes).
"""

from __future__ import annotations

from typing import Any

import torch

from ._checks import check_dense, normalize_dim
from ._errors import ScanTypeError
from ._route_log import logs_route
from ._routing.cumulative import cumulative, native_first

__all__ = ["cummax", "cummin", "cumprod", "cumsum", "logcumsumexp"]


@logs_route("fscan.cumsum")
def cumsum(
    input: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None, reverse: bool = False
) -> torch.Tensor:
    """``torch.cumsum`` with ``reverse=``: ``out[i] = input[0] + ... + input[i]`` along ``dim``.

    Args:
        input (Tensor): the input; 0-d is allowed (``dim`` 0 or -1).
        dim (int): the dimension to sum along.
        dtype (torch.dtype, optional): cast ``input`` to this dtype first.
        reverse (bool, default False): sum from the end, ``out[i] = input[i] + ...
            + input[n - 1]``.

    Returns:
        Tensor: ``input``'s shape; dtype ``dtype``, else int64 for integer and bool
        inputs, else ``input``'s.

    Example:
        >>> import fscan, torch
        >>> x = torch.tensor([1, 2, 3])
        >>> fscan.cumsum(x, 0), fscan.cumsum(x, 0, reverse=True)
        (tensor([1, 3, 6]), tensor([6, 5, 3]))
    """
    if (
        dtype is None
        and reverse is False
        and (out := native_first(torch.cumsum, input, dim)) is not None
    ):
        return out  # torch promotes integers and bool to int64 itself
    x, dim = _prepare("fscan.cumsum", input, dim, reverse, dtype, promote_integers=True)
    return cumulative("fscan.cumsum", torch.cumsum, x, dim, reverse)


@logs_route("fscan.cumprod")
def cumprod(
    input: torch.Tensor, dim: int, *, dtype: torch.dtype | None = None, reverse: bool = False
) -> torch.Tensor:
    """``torch.cumprod`` with ``reverse=``: ``out[i] = input[0] * ... * input[i]`` along ``dim``.

    Arguments and result dtype as in :func:`cumsum`. Gradients are exact with zeros.

    Example:
        >>> import fscan, torch
        >>> fscan.cumprod(torch.tensor([1.0, 2.0, 3.0]), 0, reverse=True)
        tensor([6., 6., 3.])
    """
    if (
        dtype is None
        and reverse is False
        and (out := native_first(torch.cumprod, input, dim)) is not None
    ):
        return out
    x, dim = _prepare("fscan.cumprod", input, dim, reverse, dtype, promote_integers=True)
    return cumulative("fscan.cumprod", torch.cumprod, x, dim, reverse)


@logs_route("fscan.logcumsumexp")
def logcumsumexp(input: torch.Tensor, dim: int, *, reverse: bool = False) -> torch.Tensor:
    """``torch.logcumsumexp`` with ``reverse=``: ``out[i] = log(sum(exp(input[:i + 1])))``.

    ``-inf`` entries add nothing, ``+inf`` and NaN propagate, as in torch. Complex
    inputs always use torch's kernel: the imaginary part of a complex log is only
    defined up to multiples of 2 pi, and which one torch returns depends on its
    sequential order of combination.

    Example:
        >>> import fscan, torch
        >>> fscan.logcumsumexp(torch.tensor([0.0, float("-inf"), 0.0]), 0)
        tensor([0.0000, 0.0000, 0.6931])
    """
    if reverse is False and (out := native_first(torch.logcumsumexp, input, dim)) is not None:
        return out
    x, dim = _prepare("fscan.logcumsumexp", input, dim, reverse)
    return cumulative("fscan.logcumsumexp", torch.logcumsumexp, x, dim, reverse)


@logs_route("fscan.cummax")
def cummax(input: torch.Tensor, dim: int, *, reverse: bool = False) -> Any:
    """``torch.cummax`` with ``reverse=``: running maxima and the index of each.

    Returns ``torch.return_types.cummax(values, indices)``, like torch. Ties go to
    the later index; a NaN, once met, is the maximum from there on, and a later
    NaN takes over the index. With ``reverse=True`` (flip, cummax, flip) the
    indices are positions in ``input`` and ties go to the smaller index.

    Example:
        >>> import fscan, torch
        >>> fscan.cummax(torch.tensor([1.0, 3.0, 3.0, 2.0]), 0)
        torch.return_types.cummax(
        values=tensor([1., 3., 3., 3.]),
        indices=tensor([0, 1, 2, 2]))
    """
    return _extremum("fscan.cummax", torch.cummax, input, dim, reverse)


@logs_route("fscan.cummin")
def cummin(input: torch.Tensor, dim: int, *, reverse: bool = False) -> Any:
    """``torch.cummin`` with ``reverse=``: running minima and their indices (see ``cummax``).

    Example:
        >>> import fscan, torch
        >>> fscan.cummin(torch.tensor([3, 1, 2, 1]), 0, reverse=True).indices
        tensor([1, 1, 3, 3])
    """
    return _extremum("fscan.cummin", torch.cummin, input, dim, reverse)


# ---- shared pieces -----------------------------------------------------------


def _prepare(
    api: str,
    input: Any,
    dim: Any,
    reverse: Any,
    dtype: torch.dtype | None = None,
    promote_integers: bool = False,
) -> tuple[torch.Tensor, int]:
    """Check the arguments; return the input in the dtype torch computes in, and ``dim``."""
    if not isinstance(input, torch.Tensor):
        raise ScanTypeError(f"{api}: `input` must be a torch.Tensor, got {type(input).__name__}.")
    check_dense(api, "`input`", input)
    if not isinstance(reverse, bool):
        raise ScanTypeError(
            f"{api}: `reverse` must be a bool, got {type(reverse).__name__} {reverse!r}."
        )
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


def _extremum(api: str, op: Any, input: Any, dim: Any, reverse: Any) -> Any:
    if reverse is False and (out := native_first(op, input, dim)) is not None:
        return out
    x, dim = _prepare(api, input, dim, reverse)
    return cumulative(api, op, x, dim, reverse)
