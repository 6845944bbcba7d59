"""``fscan.lax.associative_scan``: JAX's ``jax.lax.associative_scan``, on torch tensors.

The same call as JAX (``fn``, ``elems``, ``reverse``, ``axis``), with JAX's
semantics:

* ``fn`` is applied to *batched slices* of ``elems``, the scanned axis kept where
  it is (JAX slices along ``axis``, it does not move it): no vmap is added, so
  ``fn`` must already work on batches, e.g. ``jax.vmap(jnp.matmul)`` becomes
  ``torch.vmap(torch.matmul)`` (or plain ``torch.matmul`` along axis 0). An
  elementwise ``fn`` runs on fscan's pointwise engine; one that fscan's pointwise
  mode refuses (a matrix product) runs in generic mode on batches of one element;
* ``reverse=True`` flips ``elems`` along ``axis``, scans and flips back:
  ``[..., fn(fn(z, y), x), fn(z, y), z]`` for ``elems = [..., x, y, z]``;
* pytrees flatten as in JAX (dict keys in sorted order, ``None`` an empty node);
* ``reverse`` may be any truthy value, as in JAX, but one that is not a bool
  warns once (:class:`fscan.ReverseNotBoolWarning`): it usually means an axis
  passed in ``reverse``'s place by a port of a ``(fn, elems, axis, reverse)`` helper.

It runs on fscan's pointwise engine, so autograd, vmap and every device work.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch

from ._call import ScanCall
from ._carry import check_initial
from ._checks import check_leaves
from ._entry import run_scan
from ._errors import (
    CombineFnError,
    NotElementwiseError,
    ReverseNotBoolWarning,
    ScanTypeError,
    ScanValueError,
)
from ._pytree import flatten, leaf_paths

__all__ = ["associative_scan"]

_API = "fscan.lax.associative_scan"


def associative_scan(
    fn: Callable[[Any, Any], Any],
    elems: Any,
    reverse: bool = False,
    axis: int = 0,
    *,
    initial: Any = None,
) -> Any:
    """Inclusive scan of ``elems`` along ``axis`` with the associative ``fn`` (JAX's API).

    Semantics, for one array ``elems = [a, b, c]`` along ``axis``::

        [a, fn(a, b), fn(fn(a, b), c)]          # reverse=False
        [fn(fn(c, b), a), fn(c, b), c]          # reverse=True

    Args:
        fn: ``(pytree, pytree) -> pytree``, associative, applied to batched slices
            of ``elems`` (arrays with ``axis`` still in place, of equal lengths).
        elems: a tensor or pytree of tensors, all of one length along ``axis``.
        reverse (bool, default False): scan from the end; truthy values work, as in
            JAX, but a non-bool warns once (:class:`fscan.ReverseNotBoolWarning`):
            JAX's order is ``(fn, elems, reverse, axis)``, so ``(fn, elems, 1)``
            scans axis 0 backwards, not axis 1. Pass ``axis=`` by keyword.
        axis (int, default 0): the axis to scan; negative counts from the end
            (of the first leaf, as in JAX).
        initial (pytree or None, default None): an fscan extension, not in JAX: one
            element (``elems``' leaves with ``axis`` removed) combined in front,
            ``out[0] = fn(initial, elems[0])`` (behind for ``reverse``).

    Returns:
        A pytree of the structure and shapes of ``elems``.

    Examples:
        >>> import torch
        >>> from fscan import lax
        >>> lax.associative_scan(torch.add, torch.arange(1.0, 5.0))
        tensor([ 1.,  3.,  6., 10.])
        >>> lax.associative_scan(torch.add, torch.arange(1.0, 5.0), reverse=True)
        tensor([10.,  9.,  7.,  4.])
        >>> shear = torch.tensor([[1.0, 1.0], [0.0, 1.0]]).expand(3, 2, 2)
        >>> lax.associative_scan(torch.vmap(torch.matmul), shear)[-1]
        tensor([[1., 3.],
                [0., 1.]])
    """
    if not callable(fn):
        raise ScanTypeError(f"{_API}: `fn` must be callable, got {type(fn).__name__}.")
    if not isinstance(reverse, bool):
        _warn_reverse(reverse)
    leaves, spec = flatten(elems)
    check_leaves(_API, elems, leaves)
    axis = _check_axis(elems, leaves, axis)
    if initial is not None:  # checked here so that errors name this API
        check_initial(_API, initial, elems, leaves, spec, axis)
    reverse, at = bool(reverse), {"initial": initial}
    try:
        batched = _batched(fn, axis)
        return run_scan(
            ScanCall(_API, batched, elems, spec, leaves, axis, reverse, "pointwise", **at)
        )
    except NotElementwiseError:
        # fscan's pointwise mode refused fn: an operation that is not elementwise (a
        # vmapped matmul). Generic mode takes any fn; give it batches of one element,
        # the axis in place, so fn still sees what JAX shows it.
        pass
    except CombineFnError as err:  # fn returned, but the wrong structure or shapes
        raise _in_jax_words(err) from err
    single = _on_single_elements(fn, axis)
    try:
        return run_scan(ScanCall(_API, single, elems, spec, leaves, axis, reverse, "generic", **at))
    except CombineFnError as err:
        raise _in_jax_words(err) from err


_warned_reverse = False


def _warn_reverse(reverse: Any) -> None:
    """Warn once per process that ``reverse`` is not a bool (the argument-order trap)."""
    global _warned_reverse
    if _warned_reverse:
        return
    _warned_reverse = True
    warnings.warn(
        f"{_API}: `reverse` is {type(reverse).__name__} {reverse!r}, not a bool; it is "
        f"used as {bool(reverse)} (truthy, as in JAX). The argument order is "
        "(fn, elems, reverse, axis): if you meant the axis, pass `axis=` by keyword. "
        "This warning is shown once.",
        ReverseNotBoolWarning,
        stacklevel=3,
    )


def _batched(fn: Callable[[Any, Any], Any], axis: int) -> Callable:
    """``fn`` as fscan's pointwise engine calls it: on batched slices with the scanned
    dimension first, moved back to ``axis`` for ``fn``.

    A closure rather than an object: fscan caches its checks by function code."""

    def combine(a: Any, b: Any) -> Any:
        if axis:
            a, b = _move(a, 0, axis), _move(b, 0, axis)
        out = fn(a, b)
        return _move(out, axis, 0) if axis else out

    return combine


def _on_single_elements(fn: Callable[[Any, Any], Any], axis: int) -> Callable[[Any, Any], Any]:
    """``fn`` for generic mode, which hands over single elements: as a batch of one."""

    def combine(a: Any, b: Any) -> Any:
        out = fn(_map(lambda x: x.unsqueeze(axis), a), _map(lambda x: x.unsqueeze(axis), b))
        return _map(lambda x: x.squeeze(axis) if _has(x, axis) else x, out)

    return combine


def _move(tree: Any, source: int, destination: int) -> Any:
    return _map(lambda x: x.movedim(source, destination) if _has(x, source) else x, tree)


def _map(f: Callable[[Any], Any], tree: Any) -> Any:
    return optree.tree_map(f, tree, none_is_leaf=False)


def _has(x: Any, axis: int) -> bool:
    return isinstance(x, torch.Tensor) and x.ndim > axis


def _in_jax_words(err: CombineFnError) -> CombineFnError:
    """The checks name ``combine_fn``, fscan's name for the argument; JAX calls it ``fn``."""
    return type(err)(str(err).replace("`combine_fn`", "`fn`"))


def _check_axis(elems: Any, leaves: list[torch.Tensor], axis: Any) -> int:
    """``axis`` made non-negative against the first leaf; every leaf has that length."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ScanTypeError(f"{_API}: `axis` must be an int, got {type(axis).__name__} {axis!r}.")
    ndim = leaves[0].ndim
    if not -ndim <= axis < ndim:
        raise ScanValueError(
            f"{_API}: `axis` {axis} is out of range for leaf {leaf_paths(elems, 'elems')[0]} "
            f"with {ndim} dimension(s), expected a value in [{-ndim}, {ndim - 1}]."
        )
    axis %= ndim
    length = leaves[0].shape[axis]
    for i, leaf in enumerate(leaves):
        if leaf.ndim <= axis or leaf.shape[axis] != length:
            paths = leaf_paths(elems, "elems")
            raise ScanValueError(
                f"{_API}: leaf {paths[i]} has shape {tuple(leaf.shape)}, expected length "
                f"{length} along axis {axis} like {paths[0]}; every leaf needs the scanned axis."
            )
    return axis
