"""The pointwise check: a ``combine_fn`` run in ``"pointwise"`` mode must be elementwise.

``"pointwise"`` mode calls ``combine_fn`` on whole batches of elements, and on
CUDA/XPU (or under ``torch.compile``) hands it to Inductor, whose scan codegen
only handles elementwise operations. A matrix product, a reduction, indexing
that gathers across the element or a random draw would either compute
something else on a batch than on one element, or fail deep inside Inductor.
So the first time a pointwise scan runs a given ``combine_fn``, its first
combine call (on real batches of elements, scan dimension first) runs under a
dispatch mode that sees every aten operation it runs, i.e. a trace of it:

* elementwise operations (``torch.Tag.pointwise``, and casts, copies and
  ``*_like`` factories, which are elementwise but untagged) and views (which
  only broadcast or re-index within an element) pass;
* a random operation raises :class:`~fscan.ImpureCombineError` before it draws;
* anything else raises :class:`~fscan.CombineFnError` naming the operation and
  pointing to ``combine_mode="generic"``, before it runs.

This is the rule ``torch.compile`` applies to the ``combine_fn`` of torch's own
``associative_scan`` (its ``is_pointwise_use`` check), run eagerly, early and
with an fscan message. Watching a call the scan makes anyway costs no extra
``combine_fn`` call, nor ``make_fx``'s fake-tensor start-up (seconds).

The verdict is cached per (code of ``combine_fn`` and kinds of what it captures,
pytree structure, dtype/device/ndim of each leaf), see :mod:`fscan._cache`;
until it is, the compiled kernel of :mod:`fscan._compiled` is not used, so the
first call per key runs fscan's own engine. Nothing is watched under
``torch.compile``/``torch.export`` tracing (``fscan._traced`` handles those), a
``torch.func`` transform or forward-mode AD; the check runs on the next plain call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from optree import PyTreeSpec
from torch.utils._python_dispatch import TorchDispatchMode

from ._cache import BoundedCache, function_key, leaf_signature
from ._combine import FlatCombine
from ._errors import CombineFnError, ImpureCombineError
from ._purity import _random_message, probeable

__all__ = ["checked_on_first_call", "is_elementwise", "pointwise_checked", "verdicts"]

verdicts: BoundedCache[bool] = BoundedCache(maxsize=1024)

# Elementwise in effect, though not tagged pointwise: casts and copies keep every
# value in its position, factories only read their argument's metadata, and
# ``.item()`` reads a scalar.
ELEMENTWISE_UNTAGGED = frozenset(
    {
        "_to_copy",
        "copy",
        "copy_",
        "clone",
        "detach",
        "alias",
        "lift_fresh",
        "lift_fresh_copy",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "scalar_tensor",
        "_local_scalar_dense",
        "resolve_conj",
        "resolve_neg",
        "fill",
        "fill_",
    }
)
_MATRIX_PRODUCTS = frozenset(
    {
        "mm",
        "bmm",
        "addmm",
        "addbmm",
        "baddbmm",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "matmul",
        "_addmm_activation",
    }
)


def pointwise_checked(
    combine_fn: Callable[[Any, Any], Any], spec: PyTreeSpec, leaves: Sequence[torch.Tensor]
) -> bool:
    """Whether ``combine_fn`` passed the check before, for leaves like these."""
    return verdicts.get(_key(combine_fn, spec, leaves)) is not None


def checked_on_first_call(
    api: str,
    combine: FlatCombine,
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
) -> FlatCombine:
    """``combine`` (``combine_fn`` on flat leaves), checked on its first call (module doc).

    Example:
        >>> import optree
        >>> leaves, spec = optree.tree_flatten(torch.randn(8, 2, 2))
        >>> flat = lambda a, b: [torch.matmul(a[0], b[0])]
        >>> try:
        ...     checked_on_first_call("demo", flat, torch.matmul, spec, leaves)(leaves, leaves)
        ... except CombineFnError as err:
        ...     print(str(err)[:74])
        demo: `combine_fn` is not elementwise: it calls aten.bmm, a matrix product
    """
    if (
        torch.compiler.is_compiling()
        or not probeable(leaves)
        or torch.autograd.forward_ad._current_level >= 0  # dual tensors: tangent ops too
    ):
        return combine
    key = _key(combine_fn, spec, leaves)
    if verdicts.get(key) is not None:
        return combine
    pending = [True]

    def first_call_checked(
        a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        if not pending:
            return combine(a, b)
        with _ElementwiseWatch(api):
            out = combine(a, b)
        pending.clear()
        verdicts.put(key, True)
        return out

    return first_call_checked


def _key(combine_fn: Callable[[Any, Any], Any], spec: PyTreeSpec, leaves: Sequence[torch.Tensor]):
    return (function_key(combine_fn), spec, leaf_signature(leaves))


class _ElementwiseWatch(TorchDispatchMode):
    """Raise at the first operation that is neither elementwise nor a view."""

    def __init__(self, api: str) -> None:
        super().__init__()
        self.api = api

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise ImpureCombineError(_random_message(self.api, func))
        if not is_elementwise(func):
            raise CombineFnError(not_elementwise_message(self.api, func))
        return func(*args, **(kwargs or {}))


def is_elementwise(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` keeps every value of an element in its position (or only views it).

    Example:
        >>> is_elementwise(torch.ops.aten.add.Tensor), is_elementwise(torch.ops.aten.sum.default)
        (True, False)
    """
    if torch.Tag.pointwise in op.tags or op.is_view or op._opname in ELEMENTWISE_UNTAGGED:
        return True
    # Queries of metadata (``is_same_size``, ``sym_size``...) return no tensor.
    return not any(_holds_tensors(r.type) for r in op._schema.returns)


def _holds_tensors(kind: torch._C.JitType) -> bool:
    if isinstance(kind, torch.TensorType):
        return True
    if isinstance(kind, (torch.ListType, torch.OptionalType)):
        return _holds_tensors(kind.getElementType())
    return False


def not_elementwise_message(api: str, op: torch._ops.OpOverload) -> str:
    """The error for a non-elementwise ``op`` in a pointwise ``combine_fn``: the op and the fix."""
    name = f"{op.namespace}.{op._opname}"
    if op._opname in _MATRIX_PRODUCTS:
        what = "a matrix product, which combines values across positions of an element"
    elif torch.Tag.reduction in op.tags:
        what = "a reduction, which combines values across positions of an element"
    else:
        what = "which is not elementwise (it gathers, rearranges or combines across positions)"
    return (
        f"{api}: `combine_fn` is not elementwise: it calls {name}, {what}. "
        "combine_mode='pointwise' calls combine_fn on whole batches of elements and compiles "
        "it as an elementwise kernel on GPUs, so it may use elementwise operations only. "
        "Use combine_mode='generic', where combine_fn sees one element at a time."
    )
