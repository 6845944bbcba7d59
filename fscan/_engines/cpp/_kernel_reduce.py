"""The generated reduce kernel: the total of a pointwise scan, reading the leaves once.

:func:`kernel_reduce` serves ``fscan.associative_reduce`` on CPU where the scan kernel
would serve the scan (the same lookup, refusals and build policy: the forward entry
of the same key is built, or counted towards its build, first). The reduce kernel is
made from that entry's translation (``csrc/reduce.h`` around the same generated
structs and ``combine``): no second trace; it is compiled as the forward is (now for
``cpu_kernel="eager"``, else in the background) and kept beside it in the knowledge
entry's kernel slots. Until it is ready, or where it cannot serve, None: the caller
runs the tree reduction, with the same results up to rounding (the kernel combines
in scan order within a lane's chunks, the tree in pairs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from optree import PyTreeSpec

from ..._config import config
from ..._knowledge.store import Knowledge, Reach
from ._cpp_source import reduce_argtypes, reduce_source
from ._kernel_entry import BuildCall, is_ready, kernel_slots, slot_key
from ._kernel_layout import element_shape, strided_view
from ._kernel_registry import ready_derived, serving_lookup
from ._kernel_run import kernel_params

__all__ = ["kernel_reduce"]


def kernel_reduce(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    found: Reach | None = None,
    entry: Knowledge | None = None,
) -> list[torch.Tensor] | None:
    """The totals of ``leaves`` along ``dim`` (length >= 1), each a batch of one element
    (``(1, *element)``, as the tree reduction gives), in new memory, by the reduce
    kernel; or None (module doc).

    Example:
        >>> import fscan, optree
        >>> _, spec = optree.tree_flatten(0)
        >>> with fscan.config.override(cpu_kernel="off"):
        ...     kernel_reduce(torch.add, spec, [torch.arange(4.0)], 0, False) is None
        True
    """
    if config.cpu_kernel == "off":
        return None
    lookup = serving_lookup(combine_fn, spec, leaves, found, entry, gradients=False)
    if lookup is None:
        return None
    holder, aliases, captured = lookup
    element = element_shape(leaves, dim)
    key = ("reduce", slot_key(aliases, element, (), (), False, False))
    reducer = kernel_slots(holder).get(key)
    if not is_ready(reducer):
        dtypes = tuple([x.dtype for x in leaves])
        call = BuildCall(combine_fn, spec, dtypes, element, captured)
        written = lambda program: (
            reduce_source(dtypes, program),
            tuple(reduce_argtypes(dtypes, program)),
        )
        numel = leaves[0].numel()
        reducer = ready_derived(holder, aliases, call, numel, key, written, "the reduce kernel")
        if reducer is None:
            return None
    assert reducer.program is not None and reducer.kernel is not None
    params = kernel_params(reducer.program, captured, element)
    if params is None:  # captured tensors that do not broadcast: the torch engine decides
        return None
    shape = leaves[0].shape
    dim = dim % len(shape)
    outer, steps, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    totals = [torch.empty((1, *element), dtype=x.dtype) for x in leaves]
    args, nb, strides = strided_view(leaves, dim)
    reducer.kernel(
        *args, *totals, *params, outer, steps, inner, int(reverse), torch.get_num_threads(),
        nb, *strides,
    )  # fmt: skip
    return totals
