"""Argument checks at the public boundary, run once per call before any work.

Each check raises a :mod:`fscan._errors` exception whose message names the
function, the argument (and leaf path), what was given and what was expected.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._errors import ScanIndexError, ScanTypeError, ScanValueError
from ._pytree import describe, leaf_paths

__all__ = ["COMBINE_MODES", "check_dense", "check_scan_args", "normalize_dim", "refuse_reverse"]

COMBINE_MODES = ("pointwise", "generic")


def refuse_reverse(api: str, reverse: Any) -> NoReturn:
    """Raise the error for a ``reverse`` that is not a bool (every door's wording)."""
    raise ScanTypeError(
        f"{api}: `reverse` must be a bool, got {type(reverse).__name__} {reverse!r}."
    )


def check_scan_args(
    api: str,
    combine_fn: Callable[..., Any],
    xs: Any,
    leaves: list[Any],
    dim: Any,
    reverse: Any,
    combine_mode: Any,
) -> int:
    """Check every argument of an associative scan; return ``dim`` made non-negative."""
    if not callable(combine_fn):
        raise ScanTypeError(
            f"{api}: `combine_fn` must be callable, got {type(combine_fn).__name__}."
        )
    if not isinstance(reverse, bool):  # the test inline: it runs on every call
        refuse_reverse(api, reverse)
    if combine_mode not in COMBINE_MODES:
        raise ScanValueError(
            f"{api}: `combine_mode` must be 'pointwise' or 'generic', got {combine_mode!r}."
        )
    check_leaves(api, xs, leaves)
    return check_dim_and_lengths(api, xs, leaves, dim)


def check_leaves(api: str, xs: Any, leaves: list[Any]) -> None:
    """Leaves must be dense tensors on one device, with at least one dimension."""
    if not leaves:
        raise ScanValueError(
            f"{api}: `xs` has no tensor leaves (got {xs!r}); pass a tensor or a pytree of tensors."
        )
    for i, leaf in enumerate(leaves):
        plain = type(leaf) is torch.Tensor  # a plain tensor is no wrapper subclass
        if not plain and not isinstance(leaf, torch.Tensor):
            path = leaf_paths(xs)[i]
            raise ScanTypeError(
                f"{api}: leaf {path} is a {describe(leaf)}, expected a torch.Tensor; "
                "convert it with torch.as_tensor()."
            )
        if leaf.is_nested or leaf.layout != torch.strided or leaf.is_quantized:
            check_dense(api, "leaf " + leaf_paths(xs)[i], leaf)
        if not plain:
            _refuse_subclass(api, xs, i, leaf)
        if leaf.ndim == 0:
            path = leaf_paths(xs)[i]
            raise ScanValueError(
                f"{api}: leaf {path} is 0-dimensional, expected at least one dimension to "
                "scan over; add one with .unsqueeze(0)."
            )
    if len(leaves) == 1:
        return
    device = leaves[0].device
    for i, leaf in enumerate(leaves[1:], start=1):
        if leaf.device != device:
            paths = leaf_paths(xs)
            raise ScanValueError(
                f"{api}: leaf {paths[i]} is on {leaf.device}, expected {device} like "
                f"{paths[0]}; move all leaves to one device."
            )


def check_dense(api: str, name: str, t: torch.Tensor) -> None:
    """``t`` must hold its values as a dense tensor that torch's arithmetic runs on:
    nested tensors, sparse (and other non-strided) layouts and quantized tensors are
    refused with an error naming ``name`` (say "`b`") and the fix. Meta tensors (no
    data, shapes only) and complex ones pass: scans run on them.

    Example:
        >>> check_dense("demo", "`b`", torch.ones(2))  # passes quietly
        >>> try:
        ...     check_dense("demo", "`b`", torch.ones(2).to_sparse())
        ... except ScanTypeError as err:
        ...     print(str(err).split(";")[0])
        demo: `b` has layout torch.sparse_coo, expected a dense (strided) tensor
    """
    if t.is_nested:
        what = "is a nested tensor, which fscan cannot scan"
        fix = "scan each component (`.unbind()`) or pad it"
    elif t.layout != torch.strided:
        what = f"has layout {t.layout}, expected a dense (strided) tensor"
        fix = "convert it with .to_dense()"
    elif t.is_quantized:
        what = (
            f"is a quantized tensor (dtype {t.dtype}), which fscan cannot scan: torch's "
            "arithmetic does not run on quantized values"
        )
        fix = "dequantize it first with .dequantize() (and quantize the result again if need be)"
    else:
        return
    raise ScanTypeError(f"{api}: {name} {what}; {fix}.")


def _refuse_subclass(api: str, xs: Any, i: int, leaf: torch.Tensor) -> None:
    """Tensor subclasses whose storage is not their data (DTensor shards and other
    wrapper tensors) would be scanned as if it were: refuse them (not while tracing,
    where torch's own fake and functional wrappers stand in for plain tensors)."""
    if is_traceable_wrapper_subclass(leaf) and not torch.compiler.is_compiling():
        what = f"a {type(leaf).__name__} (a tensor subclass wrapping other tensors)"
        fix = "scan its local data (e.g. `.to_local()`, `.full_tensor()`) instead"
        raise ScanTypeError(
            f"{api}: leaf {leaf_paths(xs)[i]} is {what}, which fscan cannot scan; {fix}."
        )


def normalize_dim(
    api: str, dim: Any, ndim: int, what: Callable[[], str] = lambda: "the input"
) -> int:
    """Make ``dim`` non-negative for a tensor with ``ndim`` dimensions, or raise.

    ``what`` names the tensor in the error; it is a callable so that the name is
    only computed when there is an error to report.
    """
    if type(dim) is int and -ndim <= dim < ndim:  # the common case, checked in one go
        return dim % ndim
    if isinstance(dim, bool) or not hasattr(type(dim), "__index__"):
        raise ScanTypeError(f"{api}: `dim` must be an int, got {type(dim).__name__} {dim!r}.")
    dim = operator.index(dim)  # NumPy and other integer types, as torch accepts them
    if not -ndim <= dim < ndim:
        raise ScanIndexError(
            f"{api}: `dim` {dim} is out of range for {what()} with {ndim} dimension(s), "
            f"expected a value in [{-ndim}, {ndim - 1}]."
        )
    return dim % ndim


def check_dim_and_lengths(api: str, xs: Any, leaves: list[torch.Tensor], dim: Any) -> int:
    """``dim`` is canonicalised against the first leaf (as in torch and JAX); every
    leaf must have that dimension, with the same length."""
    paths = None
    first = leaves[0]
    dim = normalize_dim(api, dim, first.ndim, lambda: "leaf " + leaf_paths(xs)[0])
    if len(leaves) == 1:
        return dim
    length = first.shape[dim]
    for i, leaf in enumerate(leaves[1:], start=1):
        if leaf.ndim <= dim or leaf.shape[dim] != length:
            paths = paths or leaf_paths(xs)
            if leaf.ndim <= dim:
                raise ScanValueError(
                    f"{api}: leaf {paths[i]} has shape {tuple(leaf.shape)} with no dimension "
                    f"{dim} to scan over; every leaf needs the scan dimension."
                )
            raise ScanValueError(
                f"{api}: leaf {paths[i]} has length {leaf.shape[dim]} along dim {dim}, "
                f"expected {length} like {paths[0]}."
            )
    return dim
