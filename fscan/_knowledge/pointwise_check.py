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
  ``*_like`` factories, which are elementwise but untagged) and views pass,
  as long as they keep the batch of elements as the leading dimension of every
  tensor computed from the operands (views within an element, such as
  ``a[..., :1]``, are fine; ``b[0]``, ``b[1:]`` or ``b.T`` index the batch);
* operations on tensors not computed from the operands (closed-over tensors,
  constants such as ``torch.ones(4, 1)`` made inside) pass, whatever they are:
  they are the same for every element;
* a random operation raises :class:`~fscan.ImpureCombineError` before it draws;
* anything else raises :class:`~fscan.NotElementwiseError` naming the operation and
  pointing to ``combine_mode="generic"``, before it runs.

This is the rule ``torch.compile`` applies to the ``combine_fn`` of torch's own
``associative_scan`` (its ``is_pointwise_use`` check), run eagerly, early and
with an fscan message. Watching a call the scan makes anyway costs no extra
``combine_fn`` call, nor ``make_fx``'s fake-tensor start-up (seconds).

On a batch of one element the batch dimension cannot be told apart from the
element's own (a nested scan along dimension 0 would scan the batch of one and
look elementwise), so a first call on one element (a scan of 2 to 4 steps runs
one element per call, as does a reduction of 2 or 3) is checked on a batch of
two copies of its operands instead, and then runs as it came: the verdict never
depends on how many elements the first call happened to hold. A scan of one
step calls ``combine_fn`` not at all and needs no verdict (its output is its
input, as in the sequential loop).

The verdict is stored in the call's :class:`~fscan._knowledge.store.Knowledge` entry;
until it is, the compiled kernels are not used, so the first call per key runs
fscan's own engine. Nothing is watched under
``torch.compile``/``torch.export`` tracing (``fscan._engines.traced`` handles those), a
``torch.func`` transform or forward-mode AD; the check runs on the next plain call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._combine import FlatCombine
from .._errors import ImpureCombineError, NotElementwiseError
from .purity import _random_message, probeable, run_higher_order
from .store import Knowledge

__all__ = ["checked_on_first_call", "is_elementwise"]

# Elementwise in effect, though not tagged pointwise: casts and copies keep every
# value in its position, factories only read their argument's metadata, and
# ``.item()`` reads a scalar.
ELEMENTWISE_UNTAGGED = frozenset(
    {
        # `a | b` and `a & b` on bool tensors: under inference_mode the Python operators
        # reach these composites, which torch (2.13) leaves untagged while `__xor__`
        # is tagged pointwise; they call bitwise_or/and
        "__or__",
        "__and__",
        "__ior__",
        "__iand__",
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


def checked_on_first_call(
    api: str, combine: FlatCombine, entry: Knowledge, leaves: Sequence[torch.Tensor]
) -> FlatCombine:
    """``combine`` (``combine_fn`` on flat leaves), checked on its first call (module doc).

    A first call on a batch of one element is watched on two copies of its operands
    (module doc), so the verdict stored in ``entry`` always comes from a batch that
    can show the batch dimension.

    Example:
        >>> from fscan._knowledge.store import Knowledge
        >>> leaves = [torch.randn(8, 2, 2)]
        >>> flat = lambda a, b: [torch.matmul(a[0], b[0])]
        >>> try:
        ...     checked_on_first_call("demo", flat, Knowledge(), leaves)(leaves, leaves)
        ... except NotElementwiseError as err:
        ...     print(str(err)[:74])
        demo: `combine_fn` is not elementwise: it calls aten.bmm, a matrix product
    """
    if (
        torch.compiler.is_compiling()
        or not probeable(leaves)
        or torch.autograd.forward_ad._current_level >= 0  # dual tensors: tangent ops too
    ):
        return combine
    pending = [True]

    def first_call_checked(
        a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        if not pending:
            return combine(a, b)
        if a[0].shape[0] >= 2:
            out = _watched(api, combine, a, b)
        else:  # one element: watch two of it, then run the call itself
            _watched(api, combine, _twice(a), _twice(b))
            out = combine(a, b)
        pending.clear()
        entry.elementwise = True
        return out

    return first_call_checked


def _watched(
    api: str, combine: FlatCombine, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``combine(a, b)`` under :class:`_ElementwiseWatch` (operands: a batch of >= 2)."""
    with _ElementwiseWatch(api, [*a, *b], a[0].shape[0]) as watch:
        out = combine(a, b)
    watch.returned(out)
    return out


def _twice(batch: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A batch of one element as a batch of two copies of it (fresh, contiguous memory:
    an expanded view's zero stride would hide the batch dimension from the watch)."""
    return [torch.cat([x, x]) for x in batch]


class _ElementwiseWatch(TorchDispatchMode):
    """Raise at the first operation that mixes positions of the batch of elements.

    The operands carry the batch of ``batch`` elements as dimension 0. Every tensor
    computed from them is tracked with the position of that batch dimension:

    * a view must keep it, as one dimension of the same size and stride
      (``a[..., :1]``, ``a.movedim(0, 1)`` do; ``b[0]``, ``b[1:]``, ``b.flatten()``
      and ``b.unbind(0)`` do not);
    * an elementwise op must see it at the same place counted from the right in
      every batched input (broadcasting lines it up), and no other input may
      have a size other than 1 there (``x[:, None] + y`` misaligns the batches);
    * what ``combine_fn`` returns must have it first again.

    Tensors not computed from the operands (closed-over ones, constants made
    inside) are free: they are the same for every element. The batch holds at least
    two elements: on one, its dimension could not be told apart from the element's.
    """

    # torch.cond, map & co. come here too: the ops of their bodies are watched.
    supports_higher_order_operators = True

    @classmethod
    def is_infra_mode(cls) -> bool:
        # A frame Dynamo first meets under a non-infra mode is skipped for good: a
        # torch.cond in combine_fn (whose eager front end compiles a wrapper) would then
        # fail on every later call under vmap, and a torch.compile'd function called in
        # combine_fn would run eagerly ever after. Compiled code still runs its ops
        # through this mode, except those a backend fuses into kernels (Inductor).
        return True

    def __init__(self, api: str, operands: Sequence[torch.Tensor], batch: int) -> None:
        super().__init__()
        self.api, self.batch = api, batch
        # id -> (tensor, position of its batch dimension); the tensor keeps the id unique.
        self.batched: dict[int, tuple[torch.Tensor, int]] = {id(t): (t, 0) for t in operands}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return run_higher_order(self, func, args, kwargs, self._refuse(func))
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise ImpureCombineError(_random_message(self.api, func))
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        batched = [self.batched[id(t)] for t in tensors if id(t) in self.batched]
        if not batched:  # a constant: the same for every element, whatever op makes it
            return func(*args, **kwargs)
        if not is_elementwise(func):
            raise NotElementwiseError(not_elementwise_message(self.api, func))
        constants = [t for t in tensors if id(t) not in self.batched]
        offset = None if func.is_view else self._aligned_offset(func, batched, constants)
        out = func(*args, **kwargs)
        for result in pytree.tree_leaves(out):
            if isinstance(result, torch.Tensor):
                where = self._locate(result, *batched[0]) if offset is None else None
                if offset is not None and result.ndim >= offset:
                    where = result.ndim - offset
                if where is None or result.shape[where] != self.batch:
                    raise NotElementwiseError(_misaligned_message(self.api, func))
                self.batched[id(result)] = (result, where)
        return out

    def _aligned_offset(
        self, func: Any, batched: list[tuple[torch.Tensor, int]], constants: list[torch.Tensor]
    ) -> int:
        """The batch dimension's place counted from the right, the same in every input."""
        offsets = {t.ndim - at for t, at in batched}
        offset = offsets.pop()
        clash = any(t.ndim >= offset and t.shape[t.ndim - offset] != 1 for t in constants)
        if offsets or clash:
            raise NotElementwiseError(_misaligned_message(self.api, func))
        return offset

    def _locate(self, view: torch.Tensor, source: torch.Tensor, at: int) -> int | None:
        """Where a view keeps the source's batch dimension (same size and stride), if it does."""
        size, stride = source.shape[at], source.stride(at)
        same_offset = view.ndim - (source.ndim - at)
        candidates = [
            d for d in range(view.ndim) if (view.shape[d], view.stride(d)) == (size, stride)
        ]
        if same_offset in candidates:
            return same_offset
        return candidates[0] if candidates else None

    def _refuse(self, op: torch._ops.HigherOrderOperator) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            # Its body cannot be watched: elementwise is not shown, so not assumed.
            raise NotElementwiseError(
                f"{self.api}: `combine_fn` calls the higher-order operator {op.name()}, whose "
                "body fscan cannot check for elementwise operations. "
                "Use combine_mode='generic', where combine_fn sees one element at a time."
            )

        return refuse

    def returned(self, out: Sequence[torch.Tensor]) -> None:
        """``combine_fn``'s results must carry the batch first, as the operands did."""
        for result in out:
            tracked = self.batched.get(id(result))
            if tracked is not None and tracked[1] != 0:
                raise NotElementwiseError(_misaligned_message(self.api, "its result"))


def _misaligned_message(api: str, op: Any) -> str:
    name = op if isinstance(op, str) else f"{op.namespace}.{op._opname}"
    return (
        f"{api}: `combine_fn` is not elementwise: {name} moves values "
        "between elements of the batch (indexing, slicing or reshaping the leading dimension, "
        "or broadcasting operands of different ranks against it). combine_mode='pointwise' "
        "calls combine_fn on whole batches of elements, stacked along a leading dimension, "
        "so index from the end instead (`a[..., 0]`, not `a[0]`; `a[..., None]`, not "
        "`a[:, None]`), or use combine_mode='generic', where combine_fn sees one element."
    )


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
