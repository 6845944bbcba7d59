"""Running a READY kernel entry: sizes, params, outputs and the call into C++.

:func:`run_kernel` calls a forward kernel on a call's leaves (read through their
strides, see :mod:`._kernel_layout`) into fresh outputs or a caller's ``out=``
memory; :func:`kernel_params` evaluates the prologue of the translated combine
(the values it reads from the captured tensors) for one call's element shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import torch

from ..._knowledge.store import Knowledge
from ..._memory import HUGE_MIN_BYTES, advise_huge_pages
from ._cpp_codegen import Program
from ._cpp_source import param_dtype
from ._kernel_entry import Entry, is_ready, slot_key
from ._kernel_layout import counters, gathers, read_leaves, strided_layout, strided_view

__all__ = [
    "CallLayout",
    "PreparedRun",
    "advise_outputs",
    "call_layout",
    "contiguous_strides",
    "ends_first",
    "exclusive_run",
    "fresh_outputs",
    "gathered",
    "kernel_params",
    "needed_layout",
    "prepare_run",
    "run_exclusive_prepared",
    "run_kernel",
    "run_prepared",
]


def run_kernel(
    entry: Entry,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    captured: Sequence[torch.Tensor],
    positions: tuple[int, ...] = (),
    threads: int | None = None,
    dropped: tuple[int, ...] = (),
    heads: Sequence[torch.Tensor] | None = None,
    outs: Sequence[torch.Tensor] | None = None,
    first: int = 0,
    layout: CallLayout | None = None,
) -> list[torch.Tensor | None] | None:
    """Run a READY entry's kernel into fresh outputs, or None where its params do not fit
    or the call's layout needs the gather variant and the entry is not it (see
    :func:`call_layout`: the caller then takes its full route, which picks the variant);
    on ``threads`` threads at most (default ``torch.get_num_threads()``). ``dropped``: the
    leaves the entry was built not to store (its ``BuildCall.dropped``): None in their place.
    ``heads``: contiguous carry-in elements, one per leaf (see :func:`~.cpu_kernel.kernel_scan`).
    ``outs``: checked ``out=`` memory (see :func:`~.cpu_kernel.kernel_scan`), one per kept output,
    written in place instead of fresh outputs where :func:`~._kernel_layout.strided_layout` fits it.
    ``first``: the position leaves' value at the first step along ``dim`` (see
    :func:`~.cpu_kernel.kernel_scan`). ``layout``: :func:`call_layout` of these arguments,
    where the caller worked it out (to pick the entry).

    Inputs are read in place through their strides where :func:`~._kernel_layout.strided_view` can
    describe them (no copy); fresh outputs are contiguous, as torch's own scans
    (``torch.cumsum`` of a transposed tensor is contiguous) and the torch engine give."""
    program, kernel = entry.program, entry.kernel
    assert program is not None and kernel is not None
    shape = leaves[0].shape
    dim = dim % len(shape)
    if len(shape) == 1:  # the cheap common case of the sizes below (torch.Size slices)
        outer, steps, inner = 1, shape[0], 1
    else:
        outer, steps, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    # empty_like is ~1 us cheaper per leaf than torch.empty(torch.Size): it matters at (64,).
    ys: list[torch.Tensor | None]
    if outs is not None:
        it = iter(outs)
        ys = [None if k in dropped else next(it) for k in range(len(leaves))]
    elif dropped:  # not allocated: a fresh tensor costs its page faults when written
        ys = [None if k in dropped else _fresh(x) for k, x in enumerate(leaves)]
    else:  # inline: ~1 us less per leaf than the call, which matters at (64,)
        ys = [torch.empty_like(x) if x.is_contiguous() else _empty(x) for x in leaves]
    if outer * steps * inner == 0:
        return ys
    if outs is None and outer * steps * inner >= _HUGE_GATE:  # inline: the small calls' path
        _advise(ys, ends_first(reverse, inner))
    params = (
        kernel_params(program, captured, shape[:dim] + shape[dim + 1 :]) if program.params else []
    )
    if params is None:
        return None
    read = read_leaves(leaves, positions)
    written = [y for y in ys if y is not None] if dropped else ys
    if layout is None and outs is None:
        for x in read:  # all contiguous (the common case) inline: ~1 us less than the call
            if not x.is_contiguous():
                layout = call_layout(leaves, dim, positions, dropped)
                break
        else:  # fresh outputs: dense, and nothing to gather
            xs, nb = read, 1
            strides = contiguous_strides(steps, inner, len(read))
            strides += _dense_strides(nb, steps, inner, len(written))
    elif layout is None:
        layout = call_layout(leaves, dim, positions, dropped, outs)
    # Each kernel serves the layouts its variant compiles and no other: the ordinary one's
    # lane path reads dense rows only (a strided row read as dense is a wrong answer), the
    # gather variant has no chain path. A mismatch (never made by the callers, which pick
    # the entry by call_layout) takes the caller's full route.
    if (layout is not None and layout.gather) != entry.gather:
        return None
    if layout is not None:
        if outs is not None and not layout.in_place:  # an out= layout the kernel cannot
            # describe: a dense result, copied
            args = (entry, leaves, dim, reverse, captured, positions, threads, dropped, heads)
            return _copied_out(run_kernel(*args, first=first, layout=layout), ys)
        xs, nb, strides = layout.xs, layout.nb, layout.strides
        if layout.in_place:
            counters.wrote(len(written))
    threads = torch.get_num_threads() if threads is None else min(threads, torch.get_num_threads())
    if heads is None:
        at = _NO_HEADS[len(read)] if len(read) < len(_NO_HEADS) else (0,) * len(read)
    else:  # the tensors stay alive in `heads` while the kernel reads them
        at = tuple([h.data_ptr() for k, h in enumerate(heads) if k not in positions])
    if positions:  # their first position: the kernel's last argument
        at = (*at, first)
    kernel(*xs, *written, *params, outer, steps, inner, int(reverse), threads, nb, *strides, *at)
    return ys


class CallLayout(NamedTuple):
    """How a forward kernel call reads and writes its tensors: see :func:`call_layout`."""

    xs: list[torch.Tensor]  # the tensors read, as the kernel reads them (some maybe copied)
    nb: int  # the outer index's second group (see strided_view)
    strides: list[int]  # those read, then those written
    in_place: bool  # out= memory written through its strides (else fresh dense outputs)
    gather: bool  # the kernel's gather variant serves it (see gathers)


def call_layout(
    leaves: Sequence[torch.Tensor],
    dim: int,
    positions: tuple[int, ...] = (),
    dropped: tuple[int, ...] = (),
    outs: Sequence[torch.Tensor] | None = None,
) -> CallLayout:
    """The :class:`CallLayout` of a forward kernel call of :func:`run_kernel`'s arguments:
    the inputs read in place where :func:`~._kernel_layout.strided_view` can describe them,
    ``outs`` written in place where :func:`~._kernel_layout.strided_layout` fits them (else a
    dense result is copied into them), and whether it needs the kernel's gather variant
    (:func:`~._kernel_layout.gathers`), so that the caller picks the entry by it: the
    ordinary kernel compiles no gather.

    Example:
        >>> x = torch.zeros(8, 32)
        >>> call_layout([x], 0).gather, call_layout([x[:, ::2]], 0).gather
        (False, True)
    """
    shape = leaves[0].shape
    dim = dim % max(1, len(shape))
    steps, inner = (shape[dim], math.prod(shape[dim + 1 :])) if shape else (1, 1)
    read = read_leaves(leaves, positions)
    if outs is not None:
        found = strided_layout([*read, *outs], dim, fixed=len(outs))
        if found is not None:
            xs, nb, strides = found
            return CallLayout(xs[: len(read)], nb, strides, True, gathers(strides, inner))
    xs, nb, strides = strided_view(read, dim)
    strides = strides + _dense_strides(nb, steps, inner, len(leaves) - len(dropped))
    return CallLayout(xs, nb, strides, False, gathers(strides, inner))


def needed_layout(
    leaves: Sequence[torch.Tensor],
    dim: int,
    positions: tuple[int, ...] = (),
    dropped: tuple[int, ...] = (),
    outs: Sequence[torch.Tensor] | None = None,
) -> CallLayout | None:
    """:func:`call_layout` of a call that needs one, or None for leaves that are all
    contiguous into fresh outputs (:func:`run_kernel` lays those out itself, more cheaply,
    and they never gather)."""
    if outs is None and all(x.is_contiguous() for x in read_leaves(leaves, positions)):
        return None
    return call_layout(leaves, dim, positions, dropped, outs)


def gathered(
    leaves: Sequence[torch.Tensor],
    dim: int,
    positions: tuple[int, ...] = (),
    dropped: tuple[int, ...] = (),
) -> bool:
    """Whether a forward kernel run of ``leaves`` into fresh outputs needs the kernel's
    gather variant (:func:`call_layout`'s ``gather``; an empty call never does), for the
    callers that pick the entry without running it (the autograd path, ``fscan.explain``,
    which engine served) and :func:`~.cpu_kernel.kernel_scan`'s rule alike."""
    if leaves[0].numel() == 0:
        return False
    with torch.no_grad():  # a layout strided_view copies: no graph for the copy
        layout = needed_layout(leaves, dim, positions, dropped)
    return layout is not None and layout.gather


def contiguous_strides(steps: int, inner: int, n: int) -> list[int]:
    """The kernel's (block, row in block, step, lane) strides of ``n`` contiguous tensors
    read as one block."""
    return [steps * inner, 0, inner, 1] * n


def _dense_strides(nb: int, steps: int, inner: int, n: int) -> list[int]:
    """Those of ``n`` fresh outputs: dense in the (outer // nb, nb, T, inner) view the
    inputs' strides use."""
    return [nb * steps * inner, steps * inner, inner, 1] * n


_NO_HEADS = [(0,) * n for n in range(9)]  # null carry-in addresses (made once: ~0.1 us)


class PreparedRun(NamedTuple):
    """A READY forward kernel with the arguments :func:`run_kernel` would work out for
    contiguous leaves of one shape, ``dim`` and ``reverse`` (no ``keep``, ``head`` or
    ``out``): what the router's repeat route calls (:func:`run_prepared`)."""

    kernel: Callable[..., None]
    program: Program
    element: tuple[int, ...]  # the leaves' shape without dim: what the params broadcast to
    sizes: tuple[int, ...]  # outer, steps, inner, reverse
    tail: tuple[int, ...]  # blocks, strides, null carry-in addresses (, the first position)
    threads: int | None = None  # at most this many (None: torch.get_num_threads())
    positions: tuple[int, ...] = ()  # position leaves: not read, their outputs int64
    exclusive: bool = False  # the kernel's exclusive variant: run it by exclusive_run only


def prepare_run(
    holder: Knowledge,
    aliases: Hashable,
    leaves: Sequence[torch.Tensor],
    dim: int,
    reverse: bool,
    threads: int | None = None,
    positions: tuple[int, ...] = (),
    first_position: int = 0,
    exclusive: bool = False,
) -> PreparedRun | None:
    """The :class:`PreparedRun` of the READY forward kernel in ``holder`` for non-empty
    ``leaves`` of one shape scanned along ``dim`` (non-negative), those not in
    ``positions`` contiguous (see :func:`~.cpu_kernel.kernel_scan` for ``positions`` and
    ``first_position``), on ``threads`` threads at most (as :func:`run_kernel`'s), else None.
    ``exclusive``: of the kernel's exclusive variant (READY: see
    :func:`~.cpu_kernel.exclusive_ready`), for :func:`exclusive_run`."""
    shape = leaves[0].shape
    element = tuple(shape[:dim] + shape[dim + 1 :])
    entry = holder.kernels.get("cpp")
    slot = slot_key(aliases, element, positions, (), False, False, exclusive)
    entry = None if entry is None else entry.peek(slot)
    read = read_leaves(leaves, positions)
    if not is_ready(entry) or not all(x.is_contiguous() and x.shape == shape for x in read):
        return None
    assert entry.program is not None and entry.kernel is not None
    outer, steps, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    if outer * steps * inner == 0:
        return None
    n, n_read = len(leaves), len(read)
    # As run_kernel passes them for contiguous inputs into fresh outputs: one block.
    strides = contiguous_strides(steps, inner, n_read) + _dense_strides(1, steps, inner, n)
    tail = (1, *strides, *(0,) * n_read, *(first_position,) * bool(positions))
    sizes = (outer, steps, inner, int(reverse))
    return PreparedRun(
        entry.kernel, entry.program, element, sizes, tail, threads, positions, exclusive
    )


def run_prepared(
    run: PreparedRun,
    leaves: Sequence[torch.Tensor],
    captured: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] | None = None,
    outs: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor] | None:
    """:func:`run_kernel` of a :class:`PreparedRun` on leaves of the shape, layout and dtypes
    it was prepared for (those read: none for ``run.positions``, whose outputs are int64),
    on ``torch.get_num_threads()`` threads (at most ``run.threads``); None where the
    captured tensors do not broadcast to one element (the caller's full route then decides).
    ``params``: :func:`kernel_params` of ``captured``, where the caller worked them out.
    ``outs``: the outputs' memory (contiguous, the leaves' shape and the outputs' dtypes,
    sharing memory with no leaf or each other: a drop-in's checked ``out=``), else fresh."""
    # Written for the small call (a 64-element scan runs ~0.5 µs in the kernel and ~1.1 µs
    # allocating its output): no min(), no empty params unpacked (each ~0.05 µs).
    if params is None:
        if run.program.params:
            params = kernel_params(run.program, captured, run.element)
            if params is None:
                return None
        else:
            params = ()
    threads = _get_num_threads()
    if run.threads is not None and run.threads < threads:
        threads = run.threads
    if outs is not None:
        run.kernel(*leaves, *outs, *params, *run.sizes, threads, *run.tail)
        counters.wrote(len(outs))
        return list(outs)
    if len(leaves) == 1 and not run.positions:  # no lists to build: ~0.3 µs of a 5 µs scan of 64
        x = leaves[0]
        y = _empty_like(x)
        if y.numel() >= _HUGE_GATE:
            advise_huge_pages(y, _ends_first(run.sizes))
        if params:
            run.kernel(x, y, *params, *run.sizes, threads, *run.tail)
        else:
            run.kernel(x, y, *run.sizes, threads, *run.tail)
        return [y]
    ys = fresh_outputs(leaves, run.positions)
    if ys[0].numel() >= _HUGE_GATE:  # inline: the small calls' path
        _advise(ys, _ends_first(run.sizes))
    run.kernel(*leaves, *ys, *params, *run.sizes, threads, *run.tail)
    return ys


# Bound once: a module attribute read costs ~40 ns of the small call's 6 µs.
_get_num_threads, _empty_like = torch.get_num_threads, torch.empty_like


def exclusive_run(run: PreparedRun, start: torch.Tensor, fold: bool = True) -> PreparedRun:
    """``run`` (a drop-in's :class:`PreparedRun` of one read leaf, of the kernel's
    exclusive variant: ``prepare_run(..., exclusive=True)``) with what the exclusive scan
    the kernel writes in one pass reads at run time (see ``scan`` in csrc/forward.h):
    output step ``t`` is the running value before step ``t``'s input is combined,
    ``start`` (one element, the start value of every lane; kept alive by the caller while
    the run is) at the first step in scan order, and a position leaf (cummax/cummin's
    index) -1 there, in both directions. ``fold``: ``start`` is combined with the first
    step (a carry-in); else the first step's input alone starts the running value (the
    same values for a start ``e`` with ``combine(e, x) == x`` exactly, without that
    combine). ValueError for a run of an ordinary kernel (it would scan inclusively)."""
    if not run.exclusive:
        raise ValueError("exclusive_run: the run is not of the kernel's exclusive variant")
    tail = list(run.tail)
    at = len(tail) - 1 - bool(run.positions)  # the read leaf's carry-in address
    tail[at] = start.data_ptr()  # (a position leaf's first position: 0, as prepared)
    outer, steps, inner, reverse = run.sizes
    sizes = (outer, steps, inner, (reverse & 1) | (0 if fold else _UNFOLDED))
    return run._replace(sizes=sizes, tail=tuple(tail))


# The kernel's reverse argument: bit 0 reversed, this (the exclusive variant) its start
# value not combined with the first step.
_UNFOLDED = 4


def run_exclusive_prepared(
    run: PreparedRun, x: torch.Tensor, outs: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The exclusive drop-in of a contiguous ``x`` (of the shape it was prepared for) by
    an :func:`exclusive_run`: one pass of the kernel's exclusive variant reads every step
    of ``x`` and writes every step of fresh outputs laid out as the inclusive call's, or
    of ``outs`` (a drop-in's ``out=``, checked by :func:`fscan._ops_out.direct_out`:
    contiguous, ``x``'s shape and the outputs' dtypes, no memory shared).
    (Before the kernel wrote the exclusive scan itself this route read the input one step
    behind the output, or scanned ``n - 1`` steps into the outputs' later steps and filled
    the first after: a second, strided pass over the outputs that cost 1.15-1.4x the
    inclusive call on (1024, 8, 64) dim 1.)"""
    if outs is not None:
        ys = list(outs)
    else:
        ys = fresh_outputs([x], run.positions)
        if x.numel() >= _HUGE_GATE:
            _advise(ys, _ends_first(run.sizes))
    threads = torch.get_num_threads()
    if run.threads is not None:
        threads = min(run.threads, threads)
    run.kernel(x, *ys, *run.sizes, threads, *run.tail)
    return ys


def fresh_outputs(leaves: Sequence[torch.Tensor], positions: tuple[int, ...]) -> list[torch.Tensor]:
    """New outputs like the leaves read, with int64 ones (of their shape) at ``positions``."""
    if not positions:
        return [torch.empty_like(x) for x in leaves]
    read, like = iter(leaves), leaves[0]
    index = lambda: torch.empty_like(like, dtype=torch.int64)
    n = len(leaves) + len(positions)
    return [index() if k in positions else torch.empty_like(next(read)) for k in range(n)]


def _copied_out(
    found: list[torch.Tensor | None] | None, ys: list[torch.Tensor | None]
) -> list[torch.Tensor | None] | None:
    """The kernel's dense results ``found`` copied into the ``out=`` memory ``ys``."""
    if found is None:
        return None
    n = 0
    for y, f in zip(ys, found):
        if y is not None and f is not None:
            y.copy_(f)
            n += 1
    counters.copied_out(n)
    return ys


# Fewer elements than this cannot reach HUGE_MIN_BYTES in any dtype: one integer compare
# keeps the advice off the small calls' path.
_HUGE_GATE = HUGE_MIN_BYTES // 16


def _advise(ys: Sequence[torch.Tensor | None], ends_first: bool) -> None:
    for y in ys:
        if y is not None:
            advise_huge_pages(y, ends_first)


def advise_outputs(ys: Sequence[torch.Tensor | None], sizes: tuple[int, ...]) -> None:
    """Huge-page advice for a kernel's fresh outputs ``ys`` (None: not allocated) of a
    call of ``sizes`` (outer, steps, inner, reverse bits), where they are large enough,
    each page faulted in where the kernel will not write its end first (:func:`ends_first`).
    The forward's call paths inline the same gate (a call less on a small call's path)."""
    outer, steps, inner, _ = sizes
    if outer * steps * inner >= _HUGE_GATE:
        _advise(ys, _ends_first(sizes))


def ends_first(descending: bool, inner: int) -> bool:
    """Whether a kernel writes each page of a fresh output's end first (see fscan._memory
    on where a page is first written): rows of lanes (inner > 1) walked down in memory, as
    a reverse scan walks them, and the backward of a forward one."""
    return descending and inner > 1


def _ends_first(sizes: tuple[int, ...]) -> bool:
    """:func:`ends_first` of a prepared run's (outer, steps, inner, reverse bits)."""
    _, _, inner, reverse = sizes
    return ends_first(bool(reverse & 1), inner)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x) if x.is_contiguous() else _empty(x)


def _empty(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(x.shape), dtype=x.dtype)


def kernel_params(
    program: Program, captured: Sequence[torch.Tensor], element: Sequence[int]
) -> list[torch.Tensor] | None:
    """The prologue's values, broadcast to one element (scan dim first, as combine_fn sees it)."""
    if not program.params:
        return []
    try:
        if torch.is_grad_enabled():  # no_grad only where it changes something (~1 us)
            with torch.no_grad():
                return _param_values(program, captured, element)
        return _param_values(program, captured, element)
    except RuntimeError:  # the captured tensors do not broadcast to this call's elements
        return None


def _param_values(
    program: Program, captured: Sequence[torch.Tensor], element: Sequence[int]
) -> list[torch.Tensor] | None:
    out = []
    for value, param in zip(program.prologue(captured), program.params):
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if value.ndim > len(element) + 1:
            return None
        if value.ndim or element:  # one number is one element already: no view needed
            value = torch.broadcast_to(value, (1, *element))
        out.append(value.to(param_dtype(param.dtype)).contiguous())
    return out
