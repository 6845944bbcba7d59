"""The public front end: ``fscan.associative_scan``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from optree import PyTreeSpec

from ._autograd import differentiable_scan, gradients_possible
from ._checks import check_scan_args
from ._combine import flat_combine
from ._compiled import codegen_scan
from ._generic import scan_along
from ._pointwise_check import checked_on_first_call, pointwise_checked
from ._pytree import flatten, unflatten
from ._segmented import segmented_scan
from ._traced import traced_scan
from ._validate import validate_combine_fn

__all__ = ["associative_scan", "scan_flat"]

_API = "fscan.associative_scan"


def associative_scan(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool = False,
    combine_mode: str = "pointwise",
    *,
    validate: bool | None = None,
    reset: torch.Tensor | None = None,
) -> Any:
    """Inclusive scan of ``xs`` along ``dim`` with an associative ``combine_fn``.

    Semantics, for a single tensor (pytrees scan every leaf together)::

        out[0] = xs[0]
        for i in range(1, n):
            out[i] = combine_fn(out[i - 1], xs[i])  # along `dim`

    i.e. ``[a, f(a, b), f(f(a, b), c)]`` for ``xs = [a, b, c]``. With
    ``reverse=True`` the scan runs from the end, ``out[i] = f(out[i + 1], xs[i])``,
    i.e. ``[f(f(c, b), a), f(c, b), c]``: the same as flip, scan, flip.

    Args:
        combine_fn: ``(pytree, pytree) -> pytree``, associative, pure, returning the
            structure, shapes and dtypes of its inputs. It may close over tensors.
        xs: a tensor or a pytree (tuples, lists, dicts, namedtuples, ``None``) of
            tensors on one device, all of the same length along ``dim``.
        dim (int): the dimension to scan over; negative values count from the end
            of the first leaf.
        reverse (bool, default False): scan from the end of ``dim`` backwards.
        combine_mode (str, default "pointwise"): ``"pointwise"`` when ``combine_fn``
            is made of elementwise operations only; it is then called on batches
            of elements. ``"generic"`` for anything else (matrix products,
            reductions, indexing): ``combine_fn`` then sees single elements, i.e.
            slices with ``dim`` removed.
        validate (bool or None, default None): before scanning, check ``combine_fn``
            in full on this call's data: an uncached purity probe and the randomized
            associativity check of ``fscan.check_associative``. None means
            ``fscan.config.validate`` (environment variable ``FSCAN_VALIDATE``).
            Without it, purity is still probed on the first call per ``combine_fn``
            code and leaf dtypes (then cached).
        reset (bool tensor or None, default None): restart the scan wherever it is
            True (a segmented scan): ``out[i] = xs[i]`` there. A 1-D mask of length
            ``n``, or a mask with the leaves' dimensions that broadcasts to each
            leaf (e.g. ``(T, B, 1)`` for ``(T, B, d)`` leaves); see ``fscan._segmented``.

    Returns:
        A pytree of the structure and shapes of ``xs``, in new memory.

    Examples:
        >>> import fscan, torch
        >>> fscan.associative_scan(lambda x, y: x + y, torch.arange(1.0, 5.0), dim=0)
        tensor([ 1.,  3.,  6., 10.])
        >>> fscan.associative_scan(lambda x, y: x + y, torch.arange(1.0, 5.0), 0, reverse=True)
        tensor([10.,  9.,  7.,  4.])
        >>> mats = torch.tensor([[[1.0, 1.0], [0.0, 1.0]]]).expand(3, 2, 2)
        >>> fscan.associative_scan(torch.matmul, mats, 0, combine_mode="generic")[-1]
        tensor([[1., 3.],
                [0., 1.]])
    """
    leaves, spec = flatten(xs)
    dim = check_scan_args(_API, combine_fn, xs, leaves, dim, reverse, combine_mode)
    if reset is not None:  # a scan over (flag, value) pairs: see fscan._segmented
        args = (combine_fn, xs, dim, reverse, combine_mode)
        return segmented_scan(associative_scan, *args, reset=reset, validate=validate)
    validate_combine_fn(_API, combine_fn, spec, leaves, dim, combine_mode, validate)
    return unflatten(spec, scan_flat(combine_fn, spec, leaves, dim, reverse, combine_mode))


def scan_flat(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: list[torch.Tensor],
    dim: int,
    reverse: bool,
    combine_mode: str,
) -> list[torch.Tensor]:
    """Scan already-checked flat ``leaves`` along ``dim``: the dispatch point to the engines."""
    if leaves[0].shape[dim] == 0:
        return [x.clone() for x in leaves]
    if torch.compiler.is_compiling():  # one length-polymorphic op: see fscan._traced
        return traced_scan(_API, combine_fn, spec, leaves, dim, reverse, combine_mode)
    combine = flat_combine(_API, combine_fn, spec, combine_mode)
    if combine_mode == "pointwise" and not pointwise_checked(combine_fn, spec, leaves):
        # elementwise ops only, checked on the first call: see fscan._pointwise_check
        combine = checked_on_first_call(_API, combine, combine_fn, spec, leaves)
    elif combine_mode == "pointwise":  # a Triton kernel on CUDA/XPU: see fscan._compiled
        out = codegen_scan(_API, combine_fn, spec, leaves, dim, reverse)
        if out is not None:
            return out
    if gradients_possible():
        return differentiable_scan(combine_fn, combine, leaves, dim, reverse, combine_mode)
    return scan_along(combine, leaves, dim, reverse)
