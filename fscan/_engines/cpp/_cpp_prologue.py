"""The prologue of a traced ``combine_fn``: what does not depend on the leaves.

A combine's graph may read tensors it closes over (captured at each call) and
scalars it makes itself. :func:`classify_constant` classifies each such ``get_attr`` node,
:class:`Prologue` evaluates the leaf-independent nodes with torch at each call (on
that call's captured tensors: the kernel's params), and :func:`release_constants`
drops the graph's references to the user's tensors once the kernel is cached.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._cpp_ops import Unsupported, op_name

__all__ = ["Prologue", "classify_constant", "release_constants"]


def classify_constant(
    gm: torch.fx.GraphModule, node: torch.fx.Node, captured_ids: Mapping[int, int]
) -> Any:
    """``("captured", k)`` for the k-th captured tensor, ``("value", t)`` for a scalar
    tensor made inside ``combine_fn``; anything else is :class:`Unsupported`."""
    value = getattr(gm, node.target)
    if isinstance(value, torch.Tensor) and id(value) in captured_ids:
        return ("captured", captured_ids[id(value)])
    made_inside = all(op_name(user.target) == "lift_fresh_copy" for user in node.users)
    if (
        made_inside
        and isinstance(value, torch.Tensor)
        and value.numel() <= 1
        and value.device.type == "cpu"
    ):
        # torch.tensor(...) inside combine_fn, from its code and captured numbers
        # (which key the kernel): fixed for this key. A tensor reached some other way
        # (a module attribute, say) may change between calls: not baked in.
        return ("value", value.detach().clone())
    raise Unsupported("combine_fn uses a tensor that is neither captured nor a scalar")


def release_constants(gm: torch.fx.GraphModule, constants: dict[torch.fx.Node, Any]) -> None:
    """Unset ``gm``'s attributes that hold the user's captured tensors (``constants``, as
    :func:`classify_constant` found them): the graph must not keep them alive once the
    kernel is cached."""
    for node, kind in constants.items():
        if kind[0] == "captured":
            setattr(gm, node.target, None)


class Prologue:
    """Evaluate the leaf-independent nodes on one call's captured tensors (torch ops)."""

    def __init__(
        self,
        static: list[torch.fx.Node],
        params: list[torch.fx.Node],
        constants: dict[torch.fx.Node, Any],
    ) -> None:
        needed = set(params)
        for node in reversed(static):  # keep only what the params depend on
            if node in needed:
                needed.update(node.all_input_nodes)
        self.steps = [
            (node, constants.get(node), node.target, node.args, node.kwargs)
            for node in static
            if node in needed
        ]
        self.params = params

    def __call__(self, captured: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        env: dict[torch.fx.Node, Any] = {}
        for node, constant, target, args, kwargs in self.steps:
            if constant is not None:
                kind, value = constant
                env[node] = captured[value] if kind == "captured" else value
                continue
            load = lambda a: env[a] if isinstance(a, torch.fx.Node) else a
            env[node] = target(*torch.fx.node.map_aggregate(args, load), **kwargs)
        return [env[p] for p in self.params]
