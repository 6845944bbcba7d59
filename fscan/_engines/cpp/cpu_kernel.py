"""The generated C++ scan kernel for pointwise ``combine_fn``s on CPU.

:func:`kernel_scan` serves a pointwise scan on CPU with a kernel generated from
``combine_fn`` (see :mod:`._cpp_codegen` and :mod:`._cpp_source`) and compiled
with Inductor's C++ code cache (:mod:`._cpp_build`), or returns None, and the
caller runs fscan's torch engine with the same results. One kernel serves
every length, ``dim``, ``reverse`` and thread count; it is compiled once per
:class:`fscan._knowledge.store.Knowledge` entry (the key of :func:`fscan._knowledge.store.reach`:
the code of ``combine_fn`` and the values of the numbers it reaches, which become
constants of the kernel; the pytree structure; each leaf's dtype, device, ndim
and requires_grad) and per pattern of which captured tensors are the same object.
Captured tensors are inputs of the kernel, read at every call. Leaves (and, in the
backward, saved inputs, outputs and cotangents) are read through their strides where
:func:`strided_view` can describe them, without a copy; outputs are fresh and
contiguous, as torch's scans return them, or written in place into a caller's
memory of any strides (``out=``: see :func:`kernel_scan`); outputs a caller drops (``keep=``)
are neither allocated nor stored (a kernel per pattern of kept outputs, in the
slot key), and a carry-in (``head=``: the first element in scan order, replaced)
is a runtime argument of every forward kernel. The exclusive drop-ins run a variant of
the forward kernel of their own (:func:`exclusive_ready`: it compiles only the exclusive
scan's paths, as the ordinary kernel only the inclusive ones), in the slot key too. The entries live
in ``Knowledge.kernels``: bounded with the knowledge cache, cleared by
``fscan.clear_caches()``.

Latency. Compiling costs seconds (about 1-3 s warm, 5-13 s cold on a loaded
2-core machine), so by default (``fscan.config.cpu_kernel == "on"``) a key is
compiled in a background thread from its second call, or its first one that
scans at least ``MIN_ELEMENTS`` elements; fscan's torch engine answers until
the kernel is ready. ``"eager"`` compiles on the first call and waits;
``"off"`` never uses the kernel. Compiled kernels persist in Inductor's disk
cache, so a new process only loads them. :func:`precompile` builds one ahead.

Fallbacks: not CPU, a dtype or op the kernel lacks, leaves of different shapes,
gradients wanted, a ``torch.func`` transform, no C++ compiler: None, with one
debug log per reason (logger ``fscan``). A failed compile warns once per key.
Never an error of the user's call, never a different result beyond rounding.

This module is the engine's face: it holds :func:`kernel_scan` and
:func:`combine_step` and re-exports what the rest of fscan uses. Behind it, by
concern: :mod:`._kernel_entry` (what a kernel entry is, where entries are kept),
:mod:`._kernel_registry` (lookup, verdicts, when to build), :mod:`._kernel_builder`
(trace and translate here, compile in the background), :mod:`._kernel_run`
(calling a kernel), :mod:`._kernel_layout` (strides, ``out=`` checks),
:mod:`._kernel_grad` (the autograd Function); and for the C++ itself
:mod:`._cpp_codegen` (trace), :mod:`._cpp_translator` and :mod:`._cpp_ops`
(translate), :mod:`._cpp_source` and :mod:`._cpp_structs` (assemble the source
from the files in ``csrc/``), :mod:`._cpp_build` (compile and load).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from optree import PyTreeSpec

from ..._config import config
from ..._errors import ScanValueError
from ..._knowledge.store import Knowledge, Reach, reach
from ..._pytree import flatten
from ._cpp_build import compiler_problem as compiler_problem
from ._cpp_build import load_kernel
from ._cpp_codegen import TraceInput, translate_combine
from ._cpp_source import WALK_FROM, step_argtypes, step_source
from ._kernel_entry import (
    BuildCall,
    is_ready,
    kernel_entries,
    kernel_slots,
    slot_key,
)
from ._kernel_entry import Entry as Entry
from ._kernel_entry import State as State
from ._kernel_entry import log_once as log_once
from ._kernel_grad import KernelScan, kernel_grad_scan
from ._kernel_layout import (
    Counters,
    check_disjoint,
    check_out,
    checked_heads,
    counters,
    dropped_leaves,
    element_shape,
    reads_in_place,
    strided_layout,
    strided_view,
)
from ._kernel_registry import (
    MIN_CALLS,
    MIN_ELEMENTS,
    kernel_possible,
    kernel_ready,
    lookup_kernels,
    precompile,
    ready_entry,
    serving_lookup,
)
from ._kernel_registry import captured_occurrences as captured_occurrences
from ._kernel_registry import leaf_refusal as leaf_refusal
from ._kernel_run import (
    PreparedRun,
    exclusive_run,
    fresh_outputs,
    kernel_params,
    needed_layout,
    prepare_run,
    run_exclusive_prepared,
    run_kernel,
    run_prepared,
)
from ._kernel_vjp import kernel_vjp

__all__ = [
    "KERNEL_MIN_NUMEL",
    "MIN_CALLS",
    "MIN_ELEMENTS",
    "WALK_FROM",
    "Counters",
    "KernelScan",
    "PreparedRun",
    "counters",
    "exclusive_ready",
    "exclusive_run",
    "fresh_outputs",
    "kernel_entries",
    "kernel_grad_scan",
    "kernel_possible",
    "kernel_ready",
    "kernel_scan",
    "kernel_vjp",
    "precompile",
    "prepare_run",
    "reads_in_place",
    "run_exclusive_prepared",
    "run_prepared",
    "slot_key",
    "strided_layout",
    "strided_view",
]

# Below this many elements torch's own ops (2-30 us) beat the kernel's fixed cost of a
# call: the drop-ins leave smaller calls to torch (measured on a 2-core AMD EPYC, 1 and
# 2 threads, float32, December 2026). The recurrences' own bar is in fscan._routing.
KERNEL_MIN_NUMEL = 2**15

# Names that callers outside the engine have used (the benchmarks read entries by them).
_lookup = lookup_kernels
_slots = kernel_slots


def kernel_scan(
    api: str,
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    found: Reach | None = None,
    entry: Knowledge | None = None,
    positions: tuple[int, ...] = (),
    threads: int | None = None,
    keep: Sequence[bool] | None = None,
    head: Sequence[torch.Tensor] | None = None,
    out: Sequence[torch.Tensor] | None = None,
    first_position: int = 0,
) -> list[torch.Tensor | None] | None:
    """The scan of ``leaves`` along ``dim`` by the compiled kernel, or None (module doc).

    ``found``/``entry``: this call's :func:`~fscan._knowledge.store.reach` and knowledge
    entry if the caller has them (the routing does), else computed here.
    ``positions``: leaves whose values are not read but are each element's index along
    ``dim`` (int64; pass any tensor of the right shape and dtype, e.g. an expanded
    scalar): the kernel makes them on the fly, as ``cummax`` needs for its indices.
    ``first_position``: their value at the first step along ``dim`` (index order), 0 by
    default: the leaves of a view that starts that many steps into a larger input get
    positions in that input (a runtime argument: the same kernel serves).
    ``threads``: at most this many threads (default ``torch.get_num_threads()``).
    ``keep``: which outputs the caller keeps, one bool per leaf (default all); the
    others are None, neither allocated nor written (their values are still computed
    where kept ones depend on them). It is compiled in: a kernel per pattern.
    ``head``: a carry-in, one element per leaf (each leaf's shape without ``dim``, its
    dtype) that replaces the scan's first element in scan order (the last for
    ``reverse``), as ``combine_fn(initial, xs[first])`` folded by the caller; read
    in place, the leaves are not copied (a runtime argument: the same kernel serves).
    Not with ``positions``.
    ``out``: memory for the results, one tensor per kept output (each its leaf's shape
    and dtype, on CPU, any strides: narrowed, step-sliced or transposed views), written
    in place by the kernel through runtime strides (no dense buffer, no new kernel) and
    returned in the results' places. It must not overlap the inputs (leaves, ``head``,
    captured tensors) or another output: a :class:`~fscan.ScanValueError` names it.
    A layout the kernel cannot describe (see :func:`strided_layout`) is served by a
    dense result copied into it (``counters.out_copies``). None (no kernel) leaves
    ``out`` unwritten.

    Example:
        >>> import fscan, optree
        >>> _, spec = optree.tree_flatten(0)
        >>> x = torch.arange(1.0, 5.0)
        >>> with fscan.config.override(cpu_kernel="off"):
        ...     kernel_scan("demo", torch.add, spec, [x], 0, False) is None
        True
    """
    if config.cpu_kernel == "off":
        return None
    dropped = dropped_leaves(keep, len(leaves)) if keep is not None else ()
    outs = None if out is None else check_out(out, leaves, dropped, positions, head)
    lookup = serving_lookup(combine_fn, spec, leaves, found, entry, gradients=False)
    if lookup is None:
        return None
    captured = lookup[2]
    element = element_shape(leaves, dim)
    layout = needed_layout(leaves, dim, positions, dropped, outs)
    gather = layout is not None and layout.gather and leaves[0].numel() > 0
    kernel = _forward_entry(
        lookup, combine_fn, spec, leaves, element, positions, dropped, gather=gather
    )
    if kernel is None:
        return None
    heads = None if head is None else checked_heads(head, leaves, element, positions)
    if outs is not None and captured:
        check_disjoint(outs, [(f"captured tensor {i}", t) for i, t in enumerate(captured)])
    return run_kernel(
        kernel,
        leaves,
        dim,
        reverse,
        captured,
        positions,
        threads,
        dropped,
        heads,
        outs,
        first_position,
        layout,
    )


def exclusive_ready(
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    dim: int,
    positions: tuple[int, ...] = (),
) -> bool:
    """Whether the kernel's exclusive variant for scans like this one is READY (then
    :func:`prepare_run` with ``exclusive=True`` finds it), after counting this call and,
    per ``fscan.config.cpu_kernel``, building the variant now (``"eager"``) or queueing its
    build, as :func:`kernel_scan` does for the ordinary kernel; False also where no kernel
    can serve the leaves (one debug log why). For a drop-in's combine (fscan's own: one
    read leaf, no params, nothing captured; see
    :func:`~._cpp_source.compiles_exclusive`): the variant compiles only the exclusive
    scan's paths (see ``scan`` in csrc/forward.h), so an exclusive call never pays for the
    inclusive ones, nor an inclusive call for these."""
    if config.cpu_kernel == "off":
        return False
    lookup = serving_lookup(combine_fn, spec, leaves, None, None, gradients=False)
    if lookup is None:
        return False
    element = element_shape(leaves, dim)
    variant = _forward_entry(lookup, combine_fn, spec, leaves, element, positions, (), True)
    return variant is not None


def _forward_entry(
    lookup: tuple[Knowledge, Hashable, tuple[torch.Tensor, ...]],
    combine_fn: Callable[[Any, Any], Any],
    spec: PyTreeSpec,
    leaves: Sequence[torch.Tensor],
    element: tuple[int, ...],
    positions: tuple[int, ...],
    dropped: tuple[int, ...],
    exclusive: bool = False,
    gather: bool = False,
) -> Entry | None:
    """The READY forward kernel entry (``exclusive``, ``gather``: its exclusive or gather
    variant) of a :func:`serving_lookup`, or None after counting the call and building or
    queueing it (:func:`ready_entry`); a READY one is found without making the build's
    record."""
    holder, aliases, captured = lookup
    slot = slot_key(aliases, element, positions, dropped, False, False, exclusive, gather)
    kernel = kernel_slots(holder).get(slot)
    if is_ready(kernel):
        return kernel
    dtypes = tuple([x.dtype for x in leaves])
    call = BuildCall(combine_fn, spec, dtypes, element, captured, positions, dropped)
    numel = leaves[0].numel()
    return ready_entry(holder, aliases, call, numel, False, exclusive=exclusive, gather=gather)


def combine_step(
    combine_fn: Callable[[Any, Any], Any], left: Any, right: Any, *, vectorized: bool = True
) -> Any:
    """``combine_fn(left, right)`` computed by its C++ translation, one element position
    at a time, as the forward kernel computes a step: for checking the translation of
    each op against eager torch (special values, every dtype) at the cost of one small
    build, where a scan kernel inlines ``combine`` in a dozen places.

    ``left``, ``right``: pytrees of 1-D CPU tensors of one length ``n`` and of dtypes the
    kernel takes; the result has their structure. ``vectorized``: the lane path's vector
    loop, else a scalar call per position (the chain path's code). Raises
    :class:`~fscan._engines.cpp._cpp_codegen.Unsupported` where the translator refuses
    ``combine_fn`` (the scan then runs on the torch engine), and the compiler's error
    where the build fails.

    Example:
        >>> import fscan
        >>> left, right = torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])
        >>> if compiler_problem() is None:  # a build: seconds, cached on disk
        ...     assert combine_step(torch.maximum, left, right).tolist() == [3.0, 5.0]
    """
    lefts, spec = flatten(left)
    rights, right_spec = flatten(right)
    n = lefts[0].shape[0] if lefts else 0
    if right_spec != spec or any(
        x.ndim != 1 or x.shape[0] != n or x.dtype != y.dtype or not x.is_cpu
        for x, y in zip(lefts, rights)
    ):
        raise ScanValueError(
            "combine_step: left and right must be pytrees of one structure whose leaves are "
            "1-D CPU tensors of one length, leaf by leaf of one dtype."
        )
    dtypes = tuple(x.dtype for x in lefts)
    captured = reach(combine_fn).tensors
    program = translate_combine(TraceInput(combine_fn, spec, dtypes, (n,), captured))
    kernel = load_kernel(step_source(dtypes, program), step_argtypes(dtypes, program))
    xs = [torch.stack([x, y]).contiguous() for x, y in zip(lefts, rights)]
    ys = [torch.empty(n, dtype=d) for d in dtypes]
    params = kernel_params(program, captured, (n,))
    if params is None:
        raise ScanValueError("combine_step: the captured tensors do not broadcast to one element")
    kernel(*xs, *ys, *params, n, int(vectorized))
    return spec.unflatten(ys)
