"""The pytree layer: flatten ``xs`` into leaves, name leaves in errors, unflatten.

fscan uses optree with ``None`` as an empty node (like JAX), so ``None`` entries
in ``xs`` are carried through to the output untouched.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from optree import PyTreeSpec

__all__ = ["LEAF", "flatten", "leaf_paths", "unflatten"]

# The structure of a lone leaf, shared: a plain tensor ``xs`` (the common case) skips
# optree's round trip (about 2 us of a 10 us scan of 64 elements).
LEAF = optree.treespec_leaf(none_is_leaf=False)


def flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """Flatten ``tree`` into its leaves and structure.

    Example:
        >>> leaves, spec = flatten((torch.zeros(2), {"h": torch.ones(3)}))
        >>> [tuple(leaf.shape) for leaf in leaves]
        [(2,), (3,)]
        >>> flatten(torch.zeros(2))[1] == optree.tree_flatten(torch.zeros(2))[1]
        True
    """
    # Exactly a tensor (subclasses may be registered pytree nodes), and not while Dynamo
    # traces: there specs come from its optree polyfill, which cannot compare to a C one.
    if type(tree) is torch.Tensor and not torch.compiler.is_compiling():
        return [tree], LEAF
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=False)
    return leaves, spec


def unflatten(spec: PyTreeSpec, leaves: list[Any]) -> Any:
    """Rebuild a pytree of structure ``spec`` from ``leaves`` (inverse of :func:`flatten`)."""
    if spec is LEAF and len(leaves) == 1:
        return leaves[0]
    return optree.tree_unflatten(spec, leaves)


def leaf_paths(tree: Any, root: str = "xs") -> list[str]:
    """Human-readable paths of the leaves of ``tree``, in flatten order.

    Only used to build error messages, so it never runs on the hot path.

    Example:
        >>> leaf_paths((torch.zeros(1), {"h": torch.zeros(1)}))
        ['xs[0]', "xs[1]['h']"]
    """
    accessors, _, _ = optree.tree_flatten_with_accessor(tree, none_is_leaf=False)
    return [accessor.codify(root) for accessor in accessors]


def describe(x: Any) -> str:
    """A short description of a leaf for error messages: shape and dtype, or type."""
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"
