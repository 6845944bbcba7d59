"""The generated reduce kernel: the total of a pointwise scan, reading the leaves once.

:func:`kernel_reduce` serves ``fscan.associative_reduce`` on CPU where the scan kernel
would serve the scan (the same lookup, refusals and build policy: the forward entry
of the same key is built, or counted towards its build, first). The reduce kernel is
made from that entry's translation (``csrc/reduce*.h`` around the same generated
structs and ``combine``): no second trace; it is compiled as the forward is (now for
``cpu_kernel="eager"``, else in the background) and kept beside it in the knowledge
entry's kernel slots. Until it is ready, or where it cannot serve, None: the caller
runs the tree reduction, with the same results up to rounding (the kernel combines
in scan order within a lane's chunks, the tree in pairs).

:func:`prepare_reduce` keeps the kernel and its arguments for contiguous leaves of one
shape (:class:`PreparedReduce`), and :func:`run_reduce` runs it on other leaves of that
shape: the reduce router's repeat route (:mod:`fscan._routing.reduce`) answers a call
identical to one the kernel served that way, without the lookups above.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from ..._config import config
from ..._knowledge.store import Knowledge, Reach
from ._cpp_codegen import Program
from ._cpp_source import reduce_argtypes, reduce_source
from ._kernel_entry import BuildCall, Entry, is_ready, kernel_slots, slot_key
from ._kernel_layout import element_shape, strided_view
from ._kernel_registry import ready_derived, serving_lookup
from ._kernel_run import kernel_params

__all__ = ["PreparedReduce", "kernel_reduce", "prepare_reduce", "run_reduce"]


class PreparedReduce(NamedTuple):
    """A READY reduce kernel with the arguments :func:`kernel_reduce` works out for leaves
    of one shape and layout along one ``dim`` (:func:`run_reduce` runs it)."""

    kernel: Callable[..., None]
    program: Program
    element: tuple[int, ...]  # the leaves' shape without dim: the totals' shape
    sizes: tuple[int, ...]  # outer, steps, inner, reverse
    layout: tuple[int, ...]  # nb and each leaf's strides, as strided_view gives them


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
    args, nb, strides = strided_view(leaves, dim)
    totals = run_reduce(
        _prepared(reducer, element, leaves[0].shape, dim, reverse, nb, strides), args, captured
    )
    return None if totals is None else [t.unsqueeze(0) for t in totals]


def prepare_reduce(
    holder: Knowledge,
    aliases: Hashable,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
) -> PreparedReduce | None:
    """The :class:`PreparedReduce` of the READY reduce kernel in ``holder`` (for the
    captured tensors' pattern ``aliases``) for contiguous leaves like ``leaves`` (one
    shape, length >= 1 along ``dim``, non-negative), else None."""
    element = element_shape(leaves, dim)
    reducer = kernel_slots(holder).peek(
        ("reduce", slot_key(aliases, element, (), (), False, False))
    )
    if not is_ready(reducer) or not all(x.is_contiguous() for x in leaves):
        return None
    _, nb, strides = strided_view(leaves, dim)
    return _prepared(reducer, element, leaves[0].shape, dim, reverse, nb, strides)


def run_reduce(
    run: PreparedReduce, leaves: Sequence[torch.Tensor], captured: Sequence[torch.Tensor]
) -> list[torch.Tensor] | None:
    """The totals of ``leaves`` (of the shape and layout ``run`` was prepared for), each of
    ``run.element``'s shape, in new memory; None where the captured tensors do not
    broadcast to one element (the torch engine then decides)."""
    program = run.program
    params = kernel_params(program, captured, run.element) if program.params else ()
    if params is None:
        return None
    threads = torch.get_num_threads()
    if len(leaves) == 1:  # no lists to build: ~0.5 µs of a 6 µs reduce of 64 elements
        total = leaves[0].new_empty(run.element)
        run.kernel(leaves[0], total, *params, *run.sizes, threads, *run.layout)
        return [total]
    totals = [x.new_empty(run.element) for x in leaves]
    run.kernel(*leaves, *totals, *params, *run.sizes, threads, *run.layout)
    return totals


def _prepared(
    reducer: Entry,
    element: tuple[int, ...],
    shape: Sequence[int],
    dim: int,
    reverse: bool,
    nb: int,
    strides: Sequence[int],
) -> PreparedReduce:
    assert reducer.program is not None and reducer.kernel is not None
    dim = dim % len(shape)
    outer, steps, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    sizes = (outer, steps, inner, int(reverse))
    return PreparedReduce(reducer.kernel, reducer.program, element, sizes, (nb, *strides))
