"""Segmented scans: the ``reset=`` option, a transform of ``combine_fn`` and ``xs``.

A segmented scan restarts wherever a bool flag is set. It is an ordinary scan
over ``(flag, value)`` pairs with the standard segmented operator (Blelloch 1990)::

    (f1, x1), (f2, x2) -> (f1 | f2, x2 if f2 else combine_fn(x1, x2))

which is associative whenever ``combine_fn`` is, so the parallel engines run it
unchanged. The choice is made with ``torch.where`` rather than indexing, so it
works on batched slices (pointwise mode), on single elements under vmap
(generic mode) and under autograd.

The mask ``reset`` is a bool tensor that is either

* 1-D of length ``n`` (the length of ``dim``): one flag per step, shared by
  every other index; or
* of the same number of dimensions as every leaf, size ``n`` along ``dim`` and
  broadcastable to each leaf (its other sizes are 1 or the leaf's): per-row
  boundaries, e.g. ``(T, B, 1)`` for leaves ``(T, B, d)`` scanned over ``T``.

``reverse=True`` is flip, scan, flip with the mask flipped along: ``reset[i]``
means ``out[i] = xs[i]``, so in a reverse scan a flag marks the *last* element
of a segment in index order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._call import ScanCall
from ._checks import check_dense
from ._combine import check_combine_output
from ._errors import ScanTypeError, ScanValueError
from ._pytree import describe, flatten, leaf_paths, unflatten

__all__ = ["check_reset", "segmented_scan"]

_API = "fscan.associative_scan"


def segmented_scan(run: Callable[[ScanCall], Any], call: ScanCall) -> Any:
    """Run ``call`` (``dim`` non-negative, checked), restarting where ``call.reset`` is True.

    ``run`` is the internal entry (:func:`fscan._entry.run_scan`, or the distributed
    scan), passed in to keep the import graph acyclic; the pairs are scanned through
    it (with ``call.validate``), so autograd, validation and every engine apply here too.
    ``call.initial`` must be folded in already.

    Example:
        >>> import fscan
        >>> x = torch.ones(6)
        >>> reset = torch.tensor([False, False, True, False, True, False])
        >>> fscan.associative_scan(torch.add, x, 0, reset=reset)
        tensor([1., 2., 1., 2., 1., 2.])
    """
    combine_fn, xs, dim, combine_mode = call.combine_fn, call.xs, call.dim, call.combine_mode
    leaves = call.leaves
    flag = check_reset(_API, call.reset, xs, leaves, dim)

    def segmented(x: tuple[torch.Tensor, Any], y: tuple[torch.Tensor, Any]) -> tuple:
        (fx, vx), (fy, vy) = x, y
        # The structure of vy, not `spec`: when torch.export traces this inside a HOP,
        # the spec must be made in that trace (see fscan._engines.traced).
        y_leaves, y_spec = flatten(vy)
        x_leaves = flatten(vx)[0]
        flags = [_align(fy, leaf) for leaf in y_leaves]
        # Where y restarts, combine_fn's result is discarded; it runs on ones there, so
        # that neither a NaN/inf before the reset nor a zero cotangent times an infinite
        # partial (0 * inf = nan) reaches the values or gradients the loop would give.
        masked = [_masked(y_spec, leaves, flags) for leaves in (x_leaves, y_leaves)]
        merged = check_combine_output(_API, combine_fn(*masked), y_spec, y_leaves, combine_mode)
        chosen = [torch.where(f, yl, m) for f, m, yl in zip(flags, merged, y_leaves)]
        return fx | fy, unflatten(y_spec, chosen)

    def _masked(tree_spec: Any, leaves: list[torch.Tensor], flags: list[torch.Tensor]) -> Any:
        one = lambda t: torch.ones((), dtype=t.dtype, device=t.device)
        ones = [torch.where(f, one(t), t) for f, t in zip(flags, leaves)]
        return unflatten(tree_spec, ones)

    segmented.selects_by_mask = True  # type: ignore[attr-defined]  # see fscan._routing.scan
    pairs = (flag, xs)
    pair_leaves, pair_spec = flatten(pairs)
    pair_call = call._replace(
        combine_fn=segmented, xs=pairs, spec=pair_spec, leaves=pair_leaves, reset=None
    )
    return run(pair_call)[1]


def check_reset(
    api: str, reset: Any, xs: Any, leaves: list[torch.Tensor], dim: int
) -> torch.Tensor:
    """Check ``reset`` against the leaves; return it shaped as a leaf to scan with them.

    A 1-D mask becomes ``[1] * dim + [n]`` so that ``dim`` is its scan dimension.
    """
    n = leaves[0].shape[dim]
    if not isinstance(reset, torch.Tensor) or reset.dtype != torch.bool:
        raise ScanTypeError(
            f"{api}: `reset` must be a bool tensor, got {describe(reset)}; "
            "build it with a comparison, e.g. `done > 0`."
        )
    check_dense(api, "`reset`", reset)
    if reset.device != leaves[0].device:
        raise ScanValueError(
            f"{api}: `reset` is on {reset.device}, expected {leaves[0].device} like the "
            "leaves; move it with .to()."
        )
    if reset.ndim == 1:
        if reset.shape[0] != n:
            raise ScanValueError(
                f"{api}: `reset` has length {reset.shape[0]}, expected {n}, the length of "
                f"dim {dim}."
            )
        return reset.reshape([1] * dim + [n])
    paths = leaf_paths(xs)
    for path, leaf in zip(paths, leaves):
        fits = reset.ndim == leaf.ndim and all(r in (1, s) for r, s in zip(reset.shape, leaf.shape))
        if not fits or reset.shape[dim] != n:
            raise ScanValueError(
                f"{api}: `reset` of shape {tuple(reset.shape)} does not fit leaf {path} of "
                f"shape {tuple(leaf.shape)}: expected a 1-D mask of length {n}, or a mask "
                f"with the leaf's {leaf.ndim} dimensions, size {n} along dim {dim} and "
                "sizes 1 or the leaf's elsewhere."
            )
    return reset


def _align(flag: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View ``flag`` (a batch of flags, or one element's) so it broadcasts against ``like``.

    A mask with the leaves' dimensions already lines up; a 1-D mask's slice has
    size 1 everywhere but the batch dimension, so it gets trailing unit dimensions.
    """
    if flag.ndim == like.ndim:
        return flag
    # Trailing unit dimensions counted from the end, not a reshape to sizes: traced on
    # single elements, the exported combine graph of torch's associative_scan HOP is
    # run on batches of them, where sizes or positions recorded for one would not fit.
    for _ in range(like.ndim - flag.ndim):
        flag = flag.unsqueeze(-1)
    return flag
