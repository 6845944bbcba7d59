"""The public front end: ``fscan.associative_scan``, a door to :func:`fscan._entry.run_scan`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._call import SCAN_API, ScanCall
from ._entry import checked_call, run_scan
from ._exclusive import refuse_sharded_exclusive
from ._pytree import flatten
from ._route_log import logs_route, quiet
from ._routing.repeat import repeat_scan
from ._sharded.dtensor import any_dtensor, dtensor_scan

__all__ = ["associative_scan"]

_API = SCAN_API


def associative_scan(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool = False,
    combine_mode: str = "pointwise",
    *,
    validate: bool | None = None,
    reset: torch.Tensor | None = None,
    initial: Any = None,
    exclusive: bool = False,
) -> Any:
    """Inclusive (or exclusive) scan of ``xs`` along ``dim`` with an associative ``combine_fn``.

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
        validate (bool or None, default None): how much to check ``combine_fn``
            before scanning. None (with ``fscan.config.validate``, environment
            variable ``FSCAN_VALIDATE``, False): on the first call per
            ``combine_fn`` key (its code and what it captures, the leaves' dtypes;
            then cached, until ``fscan.clear_caches()``) a purity probe and a quick
            associativity check on a few elements of this call's data, in float64
            for floating data, which warns once with ``fscan.NotAssociativeWarning``
            if ``f(f(a, b), c)`` and ``f(a, f(b, c))`` differ beyond roundoff. True
            (or None with ``fscan.config.validate`` True): on every call, an
            uncached purity probe and the full randomized check of
            ``fscan.check_associative``, which raises ``fscan.NotAssociativeError``.
            False: the cached purity probe only.
        reset (bool tensor or None, default None): restart the scan wherever it is
            True (a segmented scan): ``out[i] = xs[i]`` there. A 1-D mask of length
            ``n``, or a mask with the leaves' dimensions that broadcasts to each
            leaf (e.g. ``(T, B, 1)`` for ``(T, B, d)`` leaves); see ``fscan._segmented``.
        initial (pytree or None, default None): a carry-in, one element (each leaf of
            ``xs`` with ``dim`` removed, or a shape broadcasting to it) combined in
            front: ``out[0] = combine_fn(initial, xs[0])`` (``out[n-1]`` for
            ``reverse``); gradients flow to it. A reset at the first step drops it.
        exclusive (bool, default False): return the carry *into* each step instead:
            ``out[0] = initial`` and ``out[i]`` the inclusive ``out[i - 1]`` (``out[i +
            1]`` for ``reverse``), same length; ``initial`` (required) also where
            ``reset`` is True. See ``fscan._exclusive``.

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
        >>> fscan.associative_scan(torch.add, torch.ones(3), 0, initial=torch.tensor(10.0))
        tensor([11., 12., 13.])
        >>> fscan.associative_scan(torch.add, torch.ones(3), 0, initial=10.0, exclusive=True)
        tensor([10., 11., 12.])
    """
    # A repeat the kernel served, ahead of the route log's wrapper where it gathers no
    # record (it would only call through); else in the wrapper, which notes its route.
    if reset is None and initial is None and exclusive is False and quiet():
        out = repeat_scan(combine_fn, xs, dim, reverse, combine_mode, validate)
        if out is not None:
            return out
    return _logged_scan(
        combine_fn,
        xs,
        dim,
        reverse,
        combine_mode,
        validate=validate,
        reset=reset,
        initial=initial,
        exclusive=exclusive,
    )


@logs_route(_API)
def _logged_scan(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: int,
    reverse: bool = False,
    combine_mode: str = "pointwise",
    *,
    validate: bool | None = None,
    reset: torch.Tensor | None = None,
    initial: Any = None,
    exclusive: bool = False,
) -> Any:
    """:func:`associative_scan` under the route log's wrapper (its record, where one is
    gathered); the repeat is tried here where the door did not try it (not quiet())."""
    if reset is None and initial is None and exclusive is False and not quiet():
        out = repeat_scan(combine_fn, xs, dim, reverse, combine_mode, validate)
        if out is not None:
            return out
    leaves, spec = flatten(xs)
    if any_dtensor(leaves):  # sharded across ranks: see fscan._sharded.dtensor
        if exclusive is not False:
            refuse_sharded_exclusive(_API)
        return dtensor_scan(
            combine_fn,
            xs,
            dim,
            reverse,
            combine_mode,
            validate=validate,
            reset=reset,
            initial=initial,
        )
    args = (combine_fn, xs, spec, leaves, dim, reverse, combine_mode, validate, reset, initial)
    return run_scan(checked_call(ScanCall(_API, *args, exclusive)))
