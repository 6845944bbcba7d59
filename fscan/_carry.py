"""Carry-in: the ``initial=`` option of the scans and of ``fscan.associative_reduce``.

``initial`` is one element (a pytree like ``xs`` whose leaves have ``dim``
removed) combined in front of the sequence, or behind it for ``reverse``::

    out[0] = combine_fn(initial, xs[0])         # reverse: out[n-1] = combine_fn(initial, xs[n-1])

By associativity that is the scan of ``[initial, xs[0], ..., xs[n-1]]`` without
its first output, so it is *folded into the first element*: one ``combine_fn``
call on a single element, then the ordinary scan over ``xs`` with that element
replaced. The alternative, combining ``initial`` into every output after the
scan, costs a full extra pass of ``combine_fn`` over ``n`` elements (an extra
vmapped call in generic mode); the fold costs one call on one element plus one
copy of the leaves (the ``cat`` that swaps the first element), and it leaves
the engines untouched, so every engine (tree, Triton, traced, segmented) sees
an ordinary scan and autograd, ``torch.func``, ``vmap`` and ``torch.compile``
carry gradients to ``initial`` through plain torch ops. Where the scan runs on
the C++ kernel (no gradient wanted, no ``reset=``), the copy is skipped: the
folded element (:func:`carried_heads`) is the kernel's carry-in, read in place
of the first element (``fscan._routing.scan_flat``); every other route gets the
fold (:func:`swap_heads`).

Leaves of ``initial`` may be tensors of one element's shape or of a shape that
broadcasts to it (e.g. ``(d,)`` for elements of shape ``(B, d)``: one state
shared across a batch), or Python numbers. Their dtype must promote to the
leaf's dtype (the scan's output keeps the dtype of ``xs``).

With ``reset=``, a reset at the first step in scan order drops ``initial``
(``out[0] = xs[0]`` there), as in ``fscan.linear_recurrence``; resets elsewhere
start segments that never see ``initial`` anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Number
from typing import Any

import optree
import torch
from optree import PyTreeSpec

from ._call import ScanCall
from ._checks import check_dense
from ._combine import FlatCombine, flat_combine
from ._errors import ScanTypeError, ScanValueError
from ._pytree import describe
from ._segmented import check_reset

__all__ = ["carried_heads", "check_initial", "swap_heads"]


def carried_heads(
    call: ScanCall, check: Callable[[FlatCombine], FlatCombine] | None = None
) -> list[torch.Tensor] | None:
    """The first element in scan order with ``call.initial`` combined in, one tensor per
    leaf of ``xs`` (size 1 along ``dim``); None for an empty scan. :func:`swap_heads` puts
    them in place of the first element (the fold); the C++ kernel reads them in place
    of it instead, without copying the leaves (see ``fscan._routing.scan_flat``).
    ``check`` wraps the flat combine of this one call (the caller's pointwise check:
    with one step, the fold is the scan's only ``combine_fn`` call).

    Example:
        >>> from fscan._call import ScanCall
        >>> xs = torch.tensor([1.0, 2.0, 3.0])
        >>> args = ("demo", torch.add, xs, optree.tree_structure(xs), [xs], 0, True, "pointwise")
        >>> carried_heads(ScanCall(*args, initial=torch.tensor(10.0)))
        [tensor([13.])]
    """
    api, combine_fn, xs, spec, leaves, dim, reverse, combine_mode, _, reset, initial = call[:11]
    init = check_initial(api, initial, xs, leaves, spec, dim)
    n = leaves[0].shape[dim]
    if n == 0:
        return None
    first = n - 1 if reverse else 0
    # The engines' layout: the scan dimension first, a batch of one element. Copies:
    # the scan's purity checks run after this call, so an impure combine_fn must not
    # reach the caller's `xs` or `initial` here.
    heads = [x.movedim(dim, 0).narrow(0, first, 1) for x in leaves]
    left, right = [i.unsqueeze(0).clone() for i in init], [h.clone() for h in heads]
    flags = None
    if reset is not None:  # a reset at the first step drops `initial`
        flag = check_reset(api, reset, xs, leaves, dim).movedim(dim, 0).narrow(0, first, 1)
        flags = [_like(flag, h) for h in heads]
        # Where it drops it, combine_fn's result is discarded and runs on ones (as in
        # fscan._segmented): an inf `initial` never meets a zero cotangent (0 * inf).
        left, right = _ones_where(flags, left), _ones_where(flags, right)
    combine = flat_combine(api, combine_fn, spec, combine_mode)
    carried = (combine if check is None else check(combine))(left, right)
    if flags is not None:
        carried = [torch.where(f, h, c) for f, h, c in zip(flags, heads, carried)]
    return [h.movedim(0, dim) for h in carried]


def swap_heads(
    leaves: list[torch.Tensor], heads: list[torch.Tensor], dim: int, reverse: bool
) -> list[torch.Tensor]:
    """Copies of ``leaves`` with ``heads`` (see :func:`carried_heads`) as their first
    element in scan order: the fold."""
    first = leaves[0].shape[dim] - 1 if reverse else 0
    return [_swap_first(x, h, dim, first) for x, h in zip(leaves, heads)]


def _swap_first(x: torch.Tensor, head: torch.Tensor, dim: int, first: int) -> torch.Tensor:
    """A copy of ``x`` with ``head`` at index ``first`` along ``dim``.

    Eagerly one ``cat``, a plain copy (an in-place write into a clone would fail
    under ``vmap`` when only ``initial`` is batched). While tracing, a ``where``
    on the position instead: the ``cat`` needs a slice of length ``n - 1``, and a
    symbolic length that may be 1 makes ``torch.export`` specialise it.
    """
    n = x.shape[dim]
    if torch.compiler.is_compiling():
        at = torch.arange(n, device=x.device) == first
        return torch.where(at.reshape([n if i == dim else 1 for i in range(x.ndim)]), head, x)
    rest = x.narrow(dim, 0, n - 1) if first else x.narrow(dim, 1, n - 1)
    return torch.cat([rest, head] if first else [head, rest], dim)


def check_initial(
    api: str, initial: Any, xs: Any, leaves: list[torch.Tensor], spec: PyTreeSpec, dim: int
) -> list[torch.Tensor]:
    """``initial``'s leaves as tensors of one element's shape (``expand``ed views) and
    the leaves' dtype and device, or an error naming the leaf."""
    init_leaves, init_spec = optree.tree_flatten(initial, none_is_leaf=False)
    if init_spec != spec:
        raise ScanValueError(
            f"{api}: `initial` has structure {init_spec}, expected {spec}, the structure of "
            "`xs`: one element, i.e. each leaf of `xs` with `dim` removed."
        )
    paths = [a.codify("initial") for a in spec.accessors()]
    out = []
    for path, leaf, x in zip(paths, init_leaves, leaves):
        out.append(_check_leaf(api, path, leaf, x, dim))
    return out


def _check_leaf(api: str, path: str, leaf: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
    element = x.shape[:dim] + x.shape[dim + 1 :]
    if isinstance(leaf, Number) and not isinstance(leaf, bool):
        if torch.result_type(x, leaf) != x.dtype:
            raise ScanTypeError(
                f"{api}: leaf {path} is {type(leaf).__name__} {leaf!r}, which does not fit "
                f"the leaf's dtype {x.dtype}; pass a value of that kind."
            )
        return torch.full(element, leaf, dtype=x.dtype, device=x.device)
    if not isinstance(leaf, torch.Tensor):
        raise ScanTypeError(
            f"{api}: leaf {path} is a {describe(leaf)}, expected a torch.Tensor or a number."
        )
    check_dense(api, f"leaf {path}", leaf)
    if leaf.device != x.device:
        raise ScanValueError(
            f"{api}: leaf {path} is on {leaf.device}, expected {x.device} like `xs`; "
            "move it with .to()."
        )
    if torch.promote_types(leaf.dtype, x.dtype) != x.dtype:
        raise ScanTypeError(
            f"{api}: leaf {path} has dtype {leaf.dtype}, which does not promote to {x.dtype}, "
            f"the dtype of the matching leaf of `xs`; cast it with .to({x.dtype})."
        )
    try:
        fits = torch.broadcast_shapes(leaf.shape, element) == element
    except RuntimeError:
        fits = False
    if not fits:
        raise ScanValueError(
            f"{api}: leaf {path} has shape {tuple(leaf.shape)}, expected one element's shape "
            f"{tuple(element)} (the leaf of `xs` of shape {tuple(x.shape)} with dim {dim} "
            "removed), or a shape that broadcasts to it."
        )
    return leaf.to(x.dtype).expand(element)


def _ones_where(flags: list[torch.Tensor], leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    return [
        torch.where(f, torch.ones((), dtype=t.dtype, device=t.device), t)
        for f, t in zip(flags, leaves)
    ]


def _like(flag: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A reset flag viewed so that it broadcasts against ``like`` (a batch of one element)."""
    if flag.ndim == like.ndim:
        return flag
    return flag.reshape([1] * like.ndim)
