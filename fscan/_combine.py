"""Turn a user's pytree ``combine_fn`` into a function over flat leaf lists.

The engines work on flat lists of tensors with the scan dimension first. This
module adapts ``combine_fn`` to that form for both modes:

* ``"pointwise"``: ``combine_fn`` is called directly on batched slices (the scan
  dimension first, so closed-over tensors shaped like one element broadcast).
* ``"generic"``: ``combine_fn`` sees single elements; ``torch.func.vmap`` maps
  it over the batch of elements.

Every result is checked against the structure, shape, dtype and device of the
operands, so a wrong ``combine_fn`` fails with a message naming the leaf rather
than corrupting the output through a silent broadcast or cast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from optree import PyTreeSpec

from ._errors import CombineFnError
from ._pytree import describe, unflatten

__all__ = ["FlatCombine", "flat_combine"]

FlatCombine = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], list[torch.Tensor]]


def flat_combine(
    api: str, combine_fn: Callable[[Any, Any], Any], spec: PyTreeSpec, combine_mode: str
) -> FlatCombine:
    """Adapt ``combine_fn`` to flat leaf lists, batched along dimension 0.

    Example:
        >>> import optree
        >>> _, spec = optree.tree_flatten((0, 0))
        >>> f = flat_combine("demo", lambda a, b: (a[0] + b[0], a[1] * b[1]), spec, "pointwise")
        >>> f([torch.ones(2), torch.ones(2)], [torch.ones(2), torch.ones(2)])
        [tensor([2., 2.]), tensor([1., 1.])]
    """
    if combine_mode == "pointwise":
        return _pointwise_combine(api, combine_fn, spec)
    return _vmapped_combine(api, combine_fn, spec)


def _pointwise_combine(
    api: str, combine_fn: Callable[[Any, Any], Any], spec: PyTreeSpec
) -> FlatCombine:
    def combine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = combine_fn(unflatten(spec, list(a)), unflatten(spec, list(b)))
        return check_combine_output(api, out, spec, a, "pointwise")

    return combine


def _vmapped_combine(
    api: str, combine_fn: Callable[[Any, Any], Any], spec: PyTreeSpec
) -> FlatCombine:
    def on_elements(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        half = len(flat) // 2
        a, b = list(flat[:half]), list(flat[half:])
        out = combine_fn(unflatten(spec, a), unflatten(spec, b))
        return tuple(check_combine_output(api, out, spec, a, "generic"))

    batched = torch.func.vmap(on_elements, in_dims=0, out_dims=0)

    def combine(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        try:
            return list(batched(*a, *b))
        except RuntimeError as err:
            if "data-dependent control flow" not in str(err):
                raise
            raise CombineFnError(_control_flow_message(api)) from err

    return combine


def _control_flow_message(api: str) -> str:
    return (
        f"{api}: `combine_fn` branches in Python on a tensor's value (`if`, `and`/`or`, "
        "`max()` or `bool()` of a tensor), which generic mode cannot batch: it calls "
        "combine_fn on a whole batch of elements at once through torch.func.vmap. Select "
        "with tensor ops instead, e.g. `torch.where(a[0] >= b[0], a, b)` for "
        "`a if a[0] >= b[0] else b`."
    )


def check_combine_output(
    api: str, out: Any, spec: PyTreeSpec, like: Sequence[torch.Tensor], combine_mode: str
) -> list[torch.Tensor]:
    """Flatten ``combine_fn``'s result and check it leaf by leaf against ``like``."""
    leaves, out_spec = optree.tree_flatten(out, none_is_leaf=False)
    if out_spec != spec and not _same_structure(out_spec, spec):
        raise CombineFnError(
            f"{api}: `combine_fn` returned a pytree of structure {out_spec}, expected "
            f"{spec}, the structure of `xs`."
        )
    for i, (leaf, ref) in enumerate(zip(leaves, like)):
        if (
            not isinstance(leaf, torch.Tensor)
            or leaf.shape != ref.shape
            or leaf.dtype != ref.dtype
            or leaf.device != ref.device
        ):
            raise CombineFnError(_mismatch_message(api, spec, i, leaf, ref, combine_mode))
    return leaves


def _same_structure(out_spec: PyTreeSpec, spec: PyTreeSpec) -> bool:
    """Whether two specs that compare unequal still describe one structure.

    That happens when one of them was made by Dynamo's optree polyfill, which
    leaks out of frames Dynamo compiles one by one after a graph break inside
    ``combine_fn`` (``torch.compile`` without ``fullgraph``): rebuilt here, both
    come from the same implementation.
    """
    if out_spec.num_leaves != spec.num_leaves:
        return False
    rebuilt = optree.tree_structure(
        optree.tree_unflatten(spec, [0] * spec.num_leaves), none_is_leaf=False
    )
    return rebuilt == out_spec


def _mismatch_message(
    api: str, spec: PyTreeSpec, i: int, leaf: Any, ref: torch.Tensor, combine_mode: str
) -> str:
    path = spec.accessors()[i].codify("xs")
    if combine_mode == "pointwise":
        what = "a batch of elements of the same shape as its operands (pointwise mode)"
    else:
        what = "one element, i.e. a slice with the scan dimension removed (generic mode)"
    got = describe(leaf)
    if isinstance(leaf, torch.Tensor) and leaf.device != ref.device:
        got += f" on {leaf.device}"
    return (
        f"{api}: `combine_fn` returned a {got} for leaf {path}, expected a tensor of shape "
        f"{tuple(ref.shape)} and dtype {ref.dtype} on {ref.device}: {what}. "
        "combine_fn must return the same structure, shapes and dtypes it receives."
    )
