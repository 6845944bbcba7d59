"""torch's ``associative_scan`` higher-order op as fscan's engines call it.

The traced engine (:mod:`fscan._engines.traced`) puts the op in the graphs of
``torch.compile`` and ``torch.export``; the Triton engine (:mod:`fscan._engines.triton`)
compiles a function holding it for eager calls on CUDA/XPU. Both hand it ``combine_fn``
in the op's calling convention, ``(*lhs, *rhs) -> [leaves]``, with the pytree spec got
inside the op's own trace.

The ``while_loop`` and ``scan`` front ends, and ``torch.compile`` of a function
holding the op, start a Dynamo trace of their own when called outside one
(non-strict export, eager calls), and Dynamo's optree support only accepts tree
specs made inside its trace (and mishandles unflattening constants into a dict).
So outside a trace, the functions handed to them get the structure as a
*template*, the pytree with leaf numbers for leaves, and rebuild the spec inside by
mapping the template onto their operands (:func:`spec_source`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from optree import PyTreeSpec
from torch._higher_order_ops.associative_scan import associative_scan_op

from .._combine import FlatCombine, flat_combine
from .._pytree import unflatten

__all__ = ["CODEGEN_DEVICES", "SpecSource", "hop_combine", "hop_scan", "spec_source"]

# Devices where Inductor lowers the associative_scan HOP to a scan kernel.
CODEGEN_DEVICES = ("cuda", "xpu")

# The pytree spec of ``xs``, got inside a trace from the leaves of one operand.
SpecSource = Callable[[Sequence[torch.Tensor]], PyTreeSpec]


def spec_source(spec: PyTreeSpec) -> SpecSource:
    """A way to get ``spec`` inside a trace that may start after this call (module doc).

    Example:
        >>> spec = optree.tree_structure((0, {"h": 0, "c": 0}))
        >>> spec_source(spec)([torch.ones(1)] * 3) == spec
        True
    """
    if torch.compiler.is_dynamo_compiling():  # already in a trace: its spec serves nested ones
        return lambda operands: spec
    template = unflatten(spec, list(range(spec.num_leaves)))

    def rebuilt(operands: Sequence[torch.Tensor]) -> PyTreeSpec:
        tree = optree.tree_map(lambda i: operands[i], template, none_is_leaf=False)
        return optree.tree_structure(tree, none_is_leaf=False)

    return rebuilt


def hop_scan(
    make_combine: Callable[[Sequence[torch.Tensor]], FlatCombine], xs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """torch's ``associative_scan`` higher-order op over ``xs`` along dimension 0;
    ``make_combine(operands)`` gives the flat combine in the op's trace (the convention
    of :func:`fscan._engines.traced.traced_blocked_scan`).

    Example:
        >>> hop_scan(lambda operands: lambda a, b: [a[0] * b[0]], [torch.arange(1.0, 5.0)])
        [tensor([ 1.,  2.,  6., 24.])]
    """
    return list(associative_scan_op(_hop_convention(make_combine), list(xs), ()))


def hop_combine(
    api: str, combine_fn: Callable[[Any, Any], Any], spec_of: SpecSource
) -> Callable[..., list[torch.Tensor]]:
    """``combine_fn`` in the HOP's calling convention, ``(*lhs, *rhs) -> [leaves]``.

    Example:
        >>> pair = spec_source(optree.tree_structure((0, 0)))
        >>> hop_combine("demo", lambda a, b: (a[0] * b[0], a[1] + b[1]), pair)(*torch.ones(4))
        [tensor(1.), tensor(2.)]
    """
    return _hop_convention(
        lambda operands: flat_combine(api, combine_fn, spec_of(operands), "pointwise")
    )


def _hop_convention(
    make_combine: Callable[[Sequence[torch.Tensor]], FlatCombine],
) -> Callable[..., list[torch.Tensor]]:
    def flat(*operands: torch.Tensor) -> list[torch.Tensor]:
        half = len(operands) // 2
        return list(make_combine(operands[:half])(operands[:half], operands[half:]))

    return flat
