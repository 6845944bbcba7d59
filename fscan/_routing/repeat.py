"""The ``repeat`` shortcut: a scan identical, in everything the route depends on, to one
the router already sent to the C++ kernel runs that kernel again, without the checks.

A small scan (64 elements) spends most of its time above the kernel: the argument
checks, the walk over ``combine_fn``, the knowledge lookups, the route and the kernel
lookup cost ~10 µs around ~2 µs of allocation and kernel. Once :func:`scan_flat
<fscan._routing.scan.scan_flat>` served a call on the kernel, :func:`remember` stores
a :class:`~fscan._engines.cpp._kernel_run.PreparedRun` under the call's key (:func:`call_parts`);
``fscan.associative_scan`` asks :func:`repeat_scan` first, which answers from the
store or returns None (the full path then runs). The engine is the kernel, noted as
``cpp`` like any route (the ``"fscan"`` log and ``fscan.explain`` read the same state
the full route would have read, and name the same engine).

The key holds everything the full path's verdict depends on:

* ``combine_fn``: its :func:`~fscan._knowledge.store.reach` key (its code and the
  values it captures, each captured tensor's type, dtype, device, ndim and
  requires_grad) and which captured places share a tensor; the captured tensors
  themselves are read on every call, as the kernel's parameters;
* the pytree structure, and per leaf its dtype, shape and requires_grad; ``dim``
  (made non-negative), ``reverse``, ``combine_mode``, ``validate``;
* grad mode, ``fscan.config.validate`` (``fscan.config.cpu_kernel`` "off": no lookup).

And a call is only looked up (or stored) where the full path cannot differ for
reasons outside the key: not while tracing, no ``torch.func`` transform or dual
level, no ``TorchDispatchMode``, no ``reset=``/``initial=``, every leaf a plain
contiguous dense CPU tensor without the negative bit, ``dim`` an int in range and
``reverse`` a bool (``0`` equals ``False`` in a key but is an error), ``validate``
None or False. It is stored only once the checks ``validate`` asks for ran for the
key (the purity probe, and for ``validate=None`` the once-per-key associativity
check), and never where ``validate`` asks for checks on every call. The store is
bounded and cleared by ``fscan.clear_caches()``.

The drop-ins' kernel path (``fscan.cumsum``, ``cumprod``, ``logcumsumexp``, and
``cummax``/``cummin``, whose index leaf the kernel makes: int64 outputs) is served the
same way: :func:`remember_cumulative` stores the run the
drop-ins' router (:mod:`fscan._routing.cumulative`) just made on the kernel, under the
op (its combine is fscan's own, capturing nothing) and :func:`call_parts` of its input
(which holds all the route table reads: dtype, shape, a contiguous layout, ``dim``,
``reverse``, requires_grad and grad mode; the kernel's thread cap follows from the
shape), and :func:`repeat_cumulative` answers an identical call with it before the
drop-in's checks. Only calls the router ran without ``dtype=``, ``out=``, ``reset=``
or ``exclusive=`` and without promoting the input (a float input) are stored.

Their exclusive form (``exclusive=True``, no ``dtype=``, ``out=`` or ``reset=``) is
served the same way, under its own key (the same :func:`call_parts`, marked
exclusive): :func:`remember_exclusive` stores an :class:`ExclusiveRun`, the kernel run
of the first ``n - 1`` steps in scan order (the same compiled kernel: its element
shape is the input's), once the exclusive router (:mod:`fscan._routing.exclusive`)
served a call on the kernel writing in place (nothing recorded), and
:func:`repeat_exclusive` repeats it: the kernel reads the narrowed input and writes
the output's later ``n - 1`` steps in place (reversed cummax/cummin's indices made
positions in the whole input by the kernel), and the first step is filled with the
op's identity (and index -1), as the router's path does. A checked call whose input was promoted
or cast is stored under the dtype the kernel scanned, which an identical later call
in that dtype takes as it is, so the key fits it too.

Their segmented form (``reset=``, inclusive, no ``dtype=`` or ``out=``) likewise:
:func:`remember_segmented` stores the segmented kernel's prepared run
(:class:`~fscan._engines.cpp._kernel_segmented.PreparedSegmentedRun`) once the drop-in's
own call ran on it, under the inclusive key plus the mask's shape and strides (with the
input's shape they fix the mask's check, the kernel's flag mode and where it reads the
flags; only a plain dense bool CPU mask); :func:`repeat_segmented` runs it on the new
input and mask, whose values are read on every call. (The exclusive ``reset=`` path
scans into new memory, then shifts: not repeated.)
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import torch
from optree import PyTreeSpec

from .._cache import BoundedCache
from .._call import ScanCall
from .._config import config
from .._context import under_dispatch_mode, under_transform
from .._engines.cpp._kernel_segmented import (
    PreparedSegmentedRun,
    prepare_segmented,
    run_segmented_prepared,
)
from .._engines.cpp.cpu_kernel import PreparedRun, fresh_outputs, prepare_run, run_prepared
from .._knowledge.reach_keys import code_names, unbound
from .._knowledge.store import Knowledge, Reach, knowledge, on_clear, reach
from .._memory import advise_huge_pages
from .._pytree import LEAF, flatten, unflatten
from .._route_log import ran
from .cumulative_table import EXTREMA

__all__ = [
    "ExclusiveRun",
    "call_parts",
    "remember",
    "remember_cumulative",
    "remember_exclusive",
    "remember_segmented",
    "repeat_cumulative",
    "repeat_exclusive",
    "repeat_scan",
    "repeat_segmented",
    "repeats",
    "run_exclusive",
    "stored_run",
]


class ExclusiveRun(NamedTuple):
    """An exclusive drop-in's kernel run: ``run`` scans the first ``n - 1`` steps in scan
    order (its sizes' steps) of a contiguous input along ``dim``, into the outputs' later
    ``n - 1`` steps; ``starts`` (the op's identity, and index -1 for cummax/cummin) fill
    the first step."""

    run: PreparedRun
    dim: int
    starts: tuple[Any, ...]


# Keys of calls served on the kernel (each a few shapes of a few combine_fns, typically).
repeats: BoundedCache[PreparedRun | ExclusiveRun | PreparedSegmentedRun] = BoundedCache(maxsize=256)
on_clear(repeats.clear)

_is_compiling = torch.compiler.is_compiling
_STRIDED = torch.strided
# reach() of module builtins (torch.add): keyed by identity, capturing nothing, so one
# walk serves every call (the walk itself costs ~3 µs, a fifth of a small scan).
_builtin_reach: dict[Any, Reach] = {}
# reach() of functions that reach nothing but their code (see _reach): (code, module) -> Reach.
_closed_reach: dict[tuple[types.CodeType, Any], Reach] = {}
# Both go with fscan.clear_caches(), as every cache of the package does.
on_clear(_builtin_reach.clear)
on_clear(_closed_reach.clear)


def stored_run(
    table: Any,
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: Any,
    reverse: Any,
    combine_mode: Any,
    validate: Any,
) -> tuple[Any, list[torch.Tensor], Any, Reach] | None:
    """The run ``table`` stored for a call with this one's key (module doc), with the
    call's leaves, their spec and ``combine_fn``'s reach; None where there is none (the
    scan's and the reduce's repeat routes share it)."""
    if type(xs) is torch.Tensor:
        leaves, spec = [xs], LEAF
    else:
        leaves, spec = flatten(xs)
    parts = call_parts(spec, leaves, dim, reverse, combine_mode, validate)
    if parts is None:
        return None
    found = _reach(combine_fn)
    if found.key is None or (found.tensors and found.aliases is None):
        return None
    run = table.get((found.key, found.aliases, *parts))
    return None if run is None else (run, leaves, spec, found)


def repeat_scan(
    combine_fn: Callable[[Any, Any], Any],
    xs: Any,
    dim: Any,
    reverse: Any,
    combine_mode: Any,
    validate: Any,
) -> Any:
    """The scan of ``xs`` by the kernel a call with the same key ran on (module doc), as
    a pytree of ``xs``'s structure; None where no such call was stored (or the captured
    tensors no longer broadcast): the caller then takes the full path."""
    stored = stored_run(repeats, combine_fn, xs, dim, reverse, combine_mode, validate)
    if stored is None:
        return None
    run, leaves, spec, found = stored
    out = run_prepared(run, leaves, found.tensors)
    if out is None:
        return None
    ran("cpp")
    return out[0] if spec is LEAF else unflatten(spec, out)


def remember(call: ScanCall, found: Reach, entry: Knowledge) -> None:
    """Store the kernel that just served ``call`` on the full route (with no carry-in)
    for the calls :func:`repeat_scan` finds identical to it."""
    validate = call.validate
    if call.reset is not None or call.initial is not None or not entry.pure:
        return
    if validate is None:  # the full path checks on every call, or once: checked?
        if config._validate or not entry.associativity_checked:
            return
    elif validate is not False:
        return
    if found.key is None or (found.tensors and found.aliases is None):
        return
    leaves, dim, reverse = call.leaves, call.dim, call.reverse
    parts = call_parts(call.spec, leaves, dim, reverse, call.combine_mode, validate)
    if parts is None:
        return
    key = (found.key, found.aliases, *parts)
    if key not in repeats:
        run = prepare_run(entry, found.aliases if found.tensors else (), leaves, dim, reverse)
        if run is not None:
            repeats.put(key, run)


def repeat_cumulative(op: Any, x: Any, dim: Any, reverse: Any) -> Any:
    """The drop-in of torch's ``op`` on ``x`` by the kernel run an identical call made
    (module doc), or None: the drop-in's checked path then runs."""
    if type(x) is not torch.Tensor:
        return None
    parts = call_parts(LEAF, [x], dim, reverse, "pointwise", False)
    if parts is None:
        return None
    run = repeats.get((_CUMULATIVE, op, *parts))
    if run is None:
        return None
    out = run_prepared(run, [x], ())
    if out is None:  # no params to broadcast: never; the full path would say why
        return None
    ran("cpp")
    return EXTREMA[op]((out[0], out[1])) if run.positions else out[0]


def remember_cumulative(
    op: Any,
    call: KernelCall,
    dim: int,
    reverse: bool,
    threads: int | None,
) -> None:
    """Store the kernel run the drop-ins' router just made for ``op`` (``call``: the
    combine, fscan's own, capturing nothing, the spec, the leaves of a checked input and
    the position leaves the kernel scanned; ``dim`` non-negative; on ``threads`` threads
    at most) for :func:`repeat_cumulative`."""
    combine, spec, leaves, positions = call
    parts = call_parts(LEAF, leaves[:1], dim, reverse, "pointwise", False)
    if parts is None:
        return
    key = (_CUMULATIVE, op, *parts)
    if key not in repeats:  # the lookup the kernel's run made, once per key
        holder = knowledge(_reach(combine), spec, "pointwise", leaves)
        run = prepare_run(holder, (), leaves, dim, reverse, threads, positions)
        if run is not None:
            repeats.put(key, run)


_CUMULATIVE = "cumulative"  # the drop-ins' keys: (this, torch's op, *call_parts)
_EXCLUSIVE = "exclusive"  # their exclusive form's: (this, torch's op, *call_parts)
# A drop-in's kernel call: combine, spec, leaves (the input, then any position leaf), positions
KernelCall = tuple[Callable[[Any, Any], Any], PyTreeSpec, Sequence[torch.Tensor], tuple[int, ...]]


def repeat_exclusive(op: Any, x: Any, dim: Any, reverse: Any) -> Any:
    """The exclusive drop-in of torch's ``op`` on ``x`` by the kernel run an identical
    call made (module doc), or None: the drop-in's checked path then runs."""
    if type(x) is not torch.Tensor:
        return None
    parts = call_parts(LEAF, [x], dim, reverse, "pointwise", False)
    if parts is None:
        return None
    found = repeats.get((_EXCLUSIVE, op, *parts))
    if found is None:
        return None
    out = run_exclusive(found, x)
    ran("cpp")
    return EXTREMA[op]((out[0], out[1])) if len(out) == 2 else out[0]


def run_exclusive(found: ExclusiveRun, x: torch.Tensor) -> list[torch.Tensor]:
    """``found`` on ``x`` (of the dtype, shape and layout it was stored for): fresh outputs
    whose later ``n - 1`` steps in scan order the kernel writes, the first the start values."""
    run, dim, starts = found
    kernel, _, _, sizes, tail, cap, positions = run
    steps, reverse = sizes[1], sizes[3]
    ys = fresh_outputs([x], positions)
    for y in ys:
        advise_huge_pages(y)
    threads = torch.get_num_threads() if cap is None else min(cap, torch.get_num_threads())
    # The first n - 1 steps in scan order, one step later (as fscan._exclusive.Shift): the
    # kernel reads and writes n - 1 steps from where it is pointed, so only the tensors
    # that start one step in are narrowed (a view costs ~1.4 µs).
    if reverse:  # the kernel gives x[1:]'s indices as positions in x (the run's tail)
        kernel(x.narrow(dim, 1, steps), *ys, *sizes, threads, *tail)
    else:
        kernel(x, *[y.narrow(dim, 1, steps) for y in ys], *sizes, threads, *tail)
    at = steps if reverse else 0
    for y, start in zip(ys, starts):
        y.select(dim, at).fill_(start)
    return ys


def remember_exclusive(
    op: Any,
    call: KernelCall,
    dim: int,
    reverse: bool,
    threads: int | None,
    starts: Sequence[Any],
) -> None:
    """Store, for :func:`repeat_exclusive`, the kernel run the exclusive router just made
    for ``op`` (``call`` as for :func:`remember_cumulative`, of the whole input) on its
    first ``n - 1`` steps in scan order, into the outputs' later steps, on ``threads``
    threads at most, ``starts`` (one per output) at the first step. A kernel not READY
    (the call ran elsewhere) stores nothing."""
    combine, spec, leaves, positions = call
    x = leaves[0]
    parts = call_parts(LEAF, [x], dim, reverse, "pointwise", False)
    if parts is None or x.shape[dim] < 2:
        return
    key = (_EXCLUSIVE, op, *parts)
    if key not in repeats:
        holder = knowledge(_reach(combine), spec, "pointwise", leaves)
        # Reversed, the kernel reads x[1:]: its positions start at 1 (those in x).
        first = int(reverse)
        run = prepare_run(holder, (), leaves, dim, reverse, threads, positions, first)
        if run is not None and not run.program.params:
            # The run of all n steps: the narrowed views keep x's strides, one step fewer.
            outer, n, inner, backwards = run.sizes
            narrowed = run._replace(sizes=(outer, n - 1, inner, backwards))
            repeats.put(key, ExclusiveRun(narrowed, dim, tuple(starts)))


def repeat_segmented(op: Any, x: Any, dim: Any, reverse: Any, reset: Any) -> Any:
    """The drop-in of torch's ``op`` on ``x`` restarted where ``reset`` is True, by the
    segmented kernel run an identical call made (module doc), or None: the drop-in's
    checked path then runs. The mask's values are read on every call."""
    if type(x) is not torch.Tensor or type(reset) is not torch.Tensor:
        return None
    parts = call_parts(LEAF, [x], dim, reverse, "pointwise", False)  # first: not traced
    mask = None if parts is None else _mask_kind(reset)
    if mask is None:
        return None
    run = repeats.get((_SEGMENTED, op, *parts, *mask))
    if run is None:
        return None
    out = run_segmented_prepared(run, x, reset)
    ran("cpp")
    return EXTREMA[op]((out[0], out[1])) if run.positions else out[0]


def remember_segmented(
    op: Any,
    call: KernelCall,
    dim: int,
    reverse: bool,
    threads: int | None,
    reset: torch.Tensor,
) -> None:
    """Store the segmented kernel run the drop-ins' router just made for ``op`` (``call``
    as for :func:`remember_cumulative`; ``reset`` the checked mask) for
    :func:`repeat_segmented`."""
    combine, spec, leaves, positions = call
    parts = call_parts(LEAF, leaves[:1], dim, reverse, "pointwise", False)
    mask = None if parts is None else _mask_kind(reset)
    if mask is None:
        return
    key = (_SEGMENTED, op, *parts, *mask)
    if key not in repeats:
        run = prepare_segmented(combine, spec, leaves, dim, reverse, reset, positions, threads)
        if run is not None:
            repeats.put(key, run)


_SEGMENTED = "segmented"  # the reset= drop-ins': (this, torch's op, *call_parts, mask kind)


def _mask_kind(reset: torch.Tensor) -> tuple[Hashable, ...] | None:
    """The key's part for a ``reset=`` mask: its shape and strides (the kernel's flag mode,
    one flag a step or one an element, and where it reads them), or None where the
    checked path must see it (not a plain dense bool CPU tensor)."""
    if (
        reset.dtype is not torch.bool
        or not reset.is_cpu
        or reset.layout is not _STRIDED
        or reset.is_nested
        or _is_wrapped(reset)
        or _is_batched(reset)
    ):
        return None
    return reset.shape, reset.stride()


def call_parts(
    spec: PyTreeSpec,
    leaves: Sequence[Any],
    dim: Any,
    reverse: Any,
    combine_mode: Any,
    validate: Any,
) -> tuple[Hashable, ...] | None:
    """The key of a call (module doc) but for ``combine_fn``'s part, or None where the call
    may not be repeated (cheapest tests first: a call that fails them pays no walk)."""
    if type(dim) is not int or (reverse is not False and reverse is not True):
        return None
    if (validate is not None and validate is not False) or combine_mode != "pointwise":
        return None
    if config._cpu_kernel == "off" or not leaves or _is_compiling():
        return None  # ("on" and "eager" serve a READY kernel alike)
    if under_transform() or under_dispatch_mode():
        return None
    ndim = leaves[0].ndim
    if not -ndim <= dim < ndim:
        return None
    grad = torch.is_grad_enabled()
    for x in leaves:  # a loop, not a generator: ~0.5 µs less per call
        if (
            type(x) is not torch.Tensor
            or not x.is_cpu
            or x.layout is not _STRIDED
            or x.is_nested
            or not x.is_contiguous()
            or x.is_neg()
            or (grad and x.requires_grad)  # the kernel serves no gradient: never stored
            or _is_wrapped(x)
            or _is_batched(x)
        ):
            return None
    if len(leaves) == 1:  # the key below, without a list to build and unpack
        x = leaves[0]
        # A lone tensor's structure keyed by a token: optree hashes a PyTreeSpec afresh on
        # every lookup (~0.7 µs of a 64-element scan); the token equals no spec, so a key
        # holding it fits exactly the calls whose structure is LEAF (a lone plain tensor).
        tree = _ONE_LEAF if spec is LEAF else spec
        kind = (x.dtype, x.shape, x.requires_grad)
        return (tree, dim % ndim, reverse, validate, config._validate, grad, kind)
    kinds = [(x.dtype, x.shape, x.requires_grad) for x in leaves]
    return (spec, dim % ndim, reverse, validate, config._validate, grad, *kinds)


_ONE_LEAF = "<one leaf>"


# A torch.func wrapper (or the old vmap's batched tensor) that escaped its transform:
# its storage is not its data (fscan._knowledge.purity.probeable refuses it too).
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_is_batched = torch._C._functorch.is_legacy_batchedtensor


def _reach(combine_fn: Any) -> Reach:
    """:func:`~fscan._knowledge.store.reach`, remembered for builtins of modules and for
    functions that reach nothing (module doc of :mod:`fscan._knowledge.reach`)."""
    kind = type(combine_fn)
    if kind is types.FunctionType:
        # No cells, defaults or names loaded (``lambda a, b: a + b``): nothing the walk
        # follows, so its reach is a function of the code and of whether the module is a
        # library's (which keys it by identity instead), and the memo is keyed on both.
        # What makes a function qualify is read on every call (``__code__`` and the rest
        # can be reassigned); code_names is the walk's own (cached) reading of the code.
        code = combine_fn.__code__
        if (
            combine_fn.__closure__ is None
            and combine_fn.__defaults__ is None
            and not combine_fn.__kwdefaults__
            and not code_names(code)
        ):
            memo = (code, combine_fn.__module__)
            found = _closed_reach.get(memo)
            if found is None:
                found = reach(combine_fn)
                if found.key is code:  # the walk's own key for such a function: keep it
                    if len(_closed_reach) >= 64:
                        _closed_reach.clear()
                    _closed_reach[memo] = found
            return found
        return reach(combine_fn)
    if kind is types.BuiltinFunctionType and unbound(combine_fn):
        found = _builtin_reach.get(combine_fn)
        if found is None:
            found = reach(combine_fn)
            if not found.tensors:
                if len(_builtin_reach) >= 64:
                    _builtin_reach.clear()
                _builtin_reach[combine_fn] = found
        return found
    return reach(combine_fn)
