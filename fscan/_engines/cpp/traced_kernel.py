"""The C++ kernel inside ``torch.compile`` on CPU: a lowering for torch's scan op.

Under ``torch.compile`` a scan is traced as one length-polymorphic operation
(:mod:`fscan._engines.traced`). On CUDA/XPU that is torch's ``associative_scan``
higher-order op, which Inductor lowers to a Triton scan; on CPU Inductor has no
scan codegen and fails, so CPU traces took fscan's blocked scan: plain tensor
ops around a ``while_loop``, 10-25x slower than the eager C++ kernel.

Here the op gets a CPU lowering too. Dynamo traces ``combine_fn`` into the op's
combine graph, with its guards (closed-over Python numbers, globals) and with
closed-over tensors lifted into inputs; Inductor hands that graph, now in core
aten ops, to :func:`_lower_on_cpu`, which registers it under a key naming its
code and emits one call of the custom op ``fscan::kernel_scan_hop``. At run
time that op builds (once per key, structure, dtypes and element shape, as for
eager calls) and runs the generated C++ kernel for the graph, with the lifted
tensors as its broadcast inputs. Where no kernel can serve (no compiler,
``cpu_kernel="off"``, an op the translation lacks) the kernel declines, and the op
runs the scan that whoever installed the lowering handed :func:`install_lowering`
for that case (:mod:`fscan._engines.traced` hands it the tree engine): the same
results, and the choice of that engine is not made here.

Compiled code calls the op with the same key, lifted tensors and numbers on every call.
The kernel that served a call is remembered (:func:`_scan_on_kernel`) under all that
its lookup read: the key, the numbers, each lifted tensor's type, dtype, device, ndim,
requires_grad and which places share one, each leaf's dtype, element shape and
requires_grad, grad mode and ``fscan.config.cpu_kernel``. A call identical in those
runs it again without rebuilding the combine and walking it (about 20 µs of a (64,)
call); the leaves' and the context's refusals (:func:`leaf_refusal`) are asked on
every call. After AOTAutograd the graph Inductor lowers needs no autograd rule, so the
lowering emits ``fscan::kernel_scan_run``, the same scan on an op without one: a
``custom_op``'s Python autograd wrapper costs ~15 µs a call even where no gradient is
wanted. Inductor's Python wrapper then calls that op's kernel, :func:`_scan_on_kernel`,
itself (:func:`~fscan._engines.cpp.inductor_calls.call_directly`, through Inductor's
table of custom fallback codegen):
through the dispatcher, an op whose kernel is Python boxes its arguments, unboxes them
back into Python objects and runs the autograd fallback: on a (64,) add the op took
28.5 µs of thread CPU time a call where the function took 15.2 (a loaded 2-core
machine; minima 19.7 and 9.2). Inductor's C++ wrapper (``cpp_wrapper``) still calls the op.

The registry lives in this process. torch's scan op is not cacheable, so
Inductor's and AOTAutograd's on-disk graph caches bypass every graph holding
one (``test_the_scan_op_is_not_cacheable`` checks this torch still says so), and
every graph holding fscan's ops was traced from one in this process, which
registered its key: no compiled graph outlives the registry it names. The key is
the graph's code and its input layout, so equal graphs share one entry, and the
code of the modules that lower fscan's ops (:data:`LOWERING`): after the autograd
rule (:mod:`.traced_kernel_grad`) the graph Inductor compiles holds fscan's ops, not
torch's, and Inductor's disk cache keeps it under a key that knows nothing of
fscan's lowerings. Without the salt, a graph compiled by an older fscan (calling
``fscan::kernel_scan_hop`` itself, through its ~15 µs autograd wrapper, before the
twin ops) was loaded in its place: a compiled (64,) add call took ~40 µs where
the graph this fscan lowers takes ~30.
"""

from __future__ import annotations

import hashlib
import threading
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import optree
import torch
from torch._higher_order_ops.associative_scan import associative_scan_op

from ..._cache import BoundedCache
from ..._combine import FlatCombine
from ..._config import config
from ..._knowledge.store import on_clear
from ._cpp_build import compiler_problem
from ._kernel_entry import Entry, is_ready, slot_key
from ._kernel_layout import element_shape
from ._kernel_registry import leaf_refusal, lookup_kernels
from ._kernel_run import PreparedRun, gathered, prepare_run, run_kernel, run_prepared
from .cpu_kernel import kernel_scan, precompile
from .inductor_calls import call_directly

__all__ = [
    "LOWERING",
    "OP",
    "RUN",
    "DeclinedScan",
    "combine_of",
    "install_lowering",
    "kernel_traceable",
    "listed",
    "registered",
    "served_key",
]

# What runs a scan along dimension 0 the kernel declines at run time: ``(combine, xs)``
# to fresh contiguous tensors, as the op's fake implementation promises Inductor.
DeclinedScan = Callable[[FlatCombine, Sequence[torch.Tensor]], list[torch.Tensor]]

# The code that decides what Inductor emits for fscan's ops (this module's and the autograd
# rule's): part of every graph key, so that Inductor's disk cache never serves a graph
# lowered by other code (module doc).
_LOWERING_FILES = ("traced_kernel.py", "traced_kernel_grad.py", "inductor_calls.py")
LOWERING = hashlib.sha256(
    b"".join((Path(__file__).parent / name).read_bytes() for name in _LOWERING_FILES)
).hexdigest()[:16]

# What each extra input of a combine graph is: a lifted tensor, a number the graph
# computes with (a closed-over int the trace made symbolic), or one it never reads
# (a size the trace lifted), for which any number stands in: passing the real one
# would make a kernel per length.
_TENSOR, _NUMBER, _UNREAD = "tensor", "number", "unread"


class _Graph(NamedTuple):
    """A combine graph from Inductor: ``forward(self, *lhs, *rhs, *extra)``."""

    forward: types.FunctionType
    extra: tuple[str, ...]  # each extra input's kind


# The combine graphs compiled code refers to by key. Not a cache that fscan.clear_caches()
# empties: a compiled function still alive would find its key gone and fail (the hop
# cannot rebuild a graph from its key). Bounded all the same, so that a process that
# compiles ever new combines does not grow without end; a graph in use is hit on each
# call, so the least recently used go first, and a program that compiled more than
# GRAPHS distinct combines and calls an evicted one is told to compile again.
GRAPHS = 4096
_graphs: BoundedCache[_Graph] = BoundedCache(maxsize=GRAPHS)
_lock = threading.Lock()  # installing the lowering
# Set by install_lowering, which every graph holding the op went through first.
_declined: DeclinedScan | None = None


# flexible_layout: the kernel reads any strides in place, so Inductor need not pin or
# copy the inputs' layout (with dynamic shapes it asserted one traced layout).
@torch.library.custom_op(
    "fscan::kernel_scan_hop", mutates_args=(), tags=(torch.Tag.flexible_layout,)
)
def _kernel_scan_hop(
    key: str, xs: list[torch.Tensor], tensors: list[torch.Tensor], numbers: list[int]
) -> list[torch.Tensor]:
    """Inclusive scan of ``xs`` along dimension 0 by the combine graph ``key`` names."""
    return _scan_on_kernel(key, xs, tensors, numbers)


def _scan_on_kernel(
    key: str, xs: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], numbers: Sequence[int]
) -> list[torch.Tensor]:
    """The scan of both ops: by the kernel that served an identical call (module doc), else
    by the kernel looked up for ``key``'s combine, else by the installer's scan."""
    identical = served_key(key, xs, tensors, numbers)
    served = None if identical is None else _served.get(identical)
    if served is not None:
        captured = [tensors[i] for i in served.captured] if served.captured else ()
        run, out = served.run, None
        if run is not None and xs[0].shape[0] == run.sizes[1] and _contiguous(xs):
            out = run_prepared(run, xs, captured)  # the length it was prepared for
        else:
            out = run_kernel(served.entry, xs, 0, False, captured)  # type: ignore[assignment]
        if out is not None:  # params that do not broadcast: the full path says why
            return out  # no leaf dropped: all tensors
    combine = combine_of(key, tensors, numbers)
    spec = optree.tree_structure(list(xs))
    # Contiguous, as the fake implementation promises Inductor, whatever the inputs' layout.
    ys = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]
    run = lambda: kernel_scan("torch.compile", combine, spec, xs, 0, False, out=ys)
    out = run()
    if out is None and config.cpu_kernel != "off" and precompile(combine, list(xs)):
        out = run()
    if out is None:  # the kernel declines: the scan the installer handed in
        assert _declined is not None  # the op is only in graphs install_lowering lowered
        return _declined(listed(combine), xs)
    if identical is not None:
        _remember(identical, combine, spec, xs, tensors)
    return ys


class _Served(NamedTuple):
    """The READY forward kernel that served a call, where its captured tensors (in the
    kernel's order) are among the call's lifted ``tensors``, and its arguments worked out
    for contiguous leaves of that call's length (None where they were not contiguous):
    run_kernel works them out on every call, ~1.5 µs of a compiled (64,) call's ~30."""

    entry: Entry
    captured: tuple[int, ...]
    run: PreparedRun | None


def _contiguous(xs: Sequence[torch.Tensor]) -> bool:
    # A loop, not all() of a generator: ~0.3 µs less, on every call.
    for x in xs:  # noqa: SIM110
        if not x.is_contiguous():
            return False
    return True


# Calls the kernel served, by served_key (a few combines of a few element shapes each).
_served: BoundedCache[_Served] = BoundedCache(maxsize=256)
on_clear(_served.clear)


def served_key(
    key: str, xs: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], numbers: Sequence[int]
) -> tuple[Any, ...] | None:
    """What the kernel lookup of a call reads (module doc), or None where the kernel may
    not serve it (the full path then says why)."""
    mode = config._cpu_kernel
    if mode == "off" or not xs or leaf_refusal(xs) is not None:
        return None
    places: dict[int, int] = {}
    lifted = []
    for t in tensors:
        lifted.append((places.setdefault(id(t), len(places)), type(t), t.dtype, t.device))
        lifted.append((t.ndim, t.requires_grad))
    leaves = [(x.dtype, x.shape[1:], x.requires_grad) for x in xs]
    return (key, tuple(numbers), *lifted, *leaves, torch.is_grad_enabled(), mode)


def _remember(
    identical: tuple[Any, ...],
    combine: Callable[..., list],
    spec: Any,
    xs: Sequence[torch.Tensor],
    tensors: Sequence[torch.Tensor],
) -> None:
    """Store the READY kernel that just served ``identical``'s call (found by the lookup
    that chose it), unless one of its captured tensors is not a lifted one."""
    lookup = lookup_kernels(combine, spec, xs, None, None)
    if lookup is None:
        return
    holder, aliases, captured = lookup
    slots = holder.kernels.get("cpp")
    gather = gathered(xs, 0)  # the variant that served
    key = slot_key(aliases, element_shape(xs, 0), (), (), False, False, False, gather)
    entry = None if slots is None else slots.peek(key)
    where = {id(t): i for i, t in enumerate(tensors)}
    if is_ready(entry) and all(id(t) in where for t in captured):
        run = prepare_run(holder, aliases, xs, 0, False) if _contiguous(xs) else None
        places = tuple([where[id(t)] for t in captured])
        _served.put(identical, _Served(entry, places, run))  # type: ignore[arg-type]


def combine_of(
    key: str, tensors: Sequence[torch.Tensor], numbers: Sequence[int]
) -> Callable[..., list]:
    """The combine of the graph ``key`` names, with this call's extra inputs."""
    graph = _graphs.get(key)
    if graph is None:  # only after GRAPHS newer graphs, or from a disk cache (the scan
        # op keeps graphs out of those)
        raise RuntimeError(
            f"fscan: a compiled graph refers to combine graph {key[:12]}, unknown in this "
            f"process (or evicted after {GRAPHS} newer ones); compile again "
            "(torch._dynamo.reset(), and clear Inductor's cache: TORCHINDUCTOR_CACHE_DIR)"
        )
    return _combine_of(graph, tensors, numbers)


def listed(combine: Callable[..., list]) -> Callable[..., list]:
    return lambda a, b: combine(list(a), list(b))


@_kernel_scan_hop.register_fake
def _(
    key: str, xs: list[torch.Tensor], tensors: list[torch.Tensor], numbers: list[int]
) -> list[torch.Tensor]:
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]


OP = torch.ops.fscan.kernel_scan_hop.default

# The same scan without an autograd rule, for the graphs Inductor lowers (module doc):
# the autograd key then takes the dispatcher's C++ fallback instead of a Python wrapper.
_LIBRARY = torch.library.Library("fscan", "FRAGMENT")
_LIBRARY.define(
    "kernel_scan_run(str key, Tensor[] xs, Tensor[] tensors, SymInt[] numbers) -> Tensor[]",
    tags=(torch.Tag.flexible_layout,),
)


def _kernel_scan_run(
    key: str, xs: list[torch.Tensor], tensors: list[torch.Tensor], numbers: list[int]
) -> list[torch.Tensor]:
    return _scan_on_kernel(key, xs, tensors, numbers)


_LIBRARY.impl("kernel_scan_run", _kernel_scan_run, "CPU")


@torch.library.register_fake("fscan::kernel_scan_run", lib=_LIBRARY)
def _(
    key: str, xs: list[torch.Tensor], tensors: list[torch.Tensor], numbers: list[int]
) -> list[torch.Tensor]:
    return [torch.empty_like(x, memory_format=torch.contiguous_format) for x in xs]


RUN = torch.ops.fscan.kernel_scan_run.default


def _combine_of(
    graph: _Graph, tensors: Sequence[torch.Tensor], numbers: Sequence[int]
) -> Callable[..., list]:
    """``combine(lhs, rhs)`` on flat leaf lists: the graph with this call's extra inputs
    (the numbers are closed over: the kernel's key holds their values)."""
    given = {_TENSOR: iter(tensors), _NUMBER: iter(numbers)}
    extra = [next(given[kind]) if kind in given else 1 for kind in graph.extra]
    forward = graph.forward

    def combine(lhs: list[torch.Tensor], rhs: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(forward(None, *lhs, *rhs, *extra))

    return combine


def kernel_traceable() -> bool:
    """Whether CPU scans traced now can take the kernel's lowering: a C++ compiler, and
    ``fscan.config.cpu_kernel`` not ``"off"`` (:func:`install_lowering` installs it)."""
    return config.cpu_kernel != "off" and compiler_problem() is None


def install_lowering(declined: DeclinedScan) -> bool:
    """Give torch's scan op :func:`_lower_on_cpu` for CPU tensors, once; True.
    ``declined`` runs the scans the kernel declines at run time (module doc)."""
    # Inductor: imported on first use, as it is only needed where graphs are lowered.
    from torch._inductor import lowering

    global _declined
    _declined = declined
    current = lowering.lowerings[associative_scan_op]
    if getattr(current, "_fscan_cpu", False):
        return True
    with _lock:
        current = lowering.lowerings[associative_scan_op]
        if not getattr(current, "_fscan_cpu", False):
            lowered = _with_cpu_lowering(current)
            lowered._fscan_cpu = True  # type: ignore[attr-defined]
            # The op the autograd rule emits (traced_kernel_grad) runs as RUN once lowered.
            lowering.lowerings[OP] = _lower_op
            call_directly(RUN, __name__, _scan_on_kernel.__name__)
            lowering.lowerings[associative_scan_op] = lowered
    return True


def _with_cpu_lowering(original: Callable[..., Any]) -> Callable[..., Any]:
    def lower(combine_fn: Any, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
        if xs[0].get_device().type != "cpu":
            return original(combine_fn, xs, additional_inputs)
        return _lower_on_cpu(combine_fn, xs, additional_inputs)

    return lower


def _lower_on_cpu(combine_fn: Any, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
    """One ``fscan::kernel_scan_hop`` call for the op (module doc)."""
    from torch._inductor.lowering import fallback_handler

    gm = combine_fn.graph_module
    key, tensors, numbers = registered(gm, len(xs), additional_inputs, _is_ir_tensor)
    return fallback_handler(RUN, add_to_fallback_set=False)(key, list(xs), tensors, numbers)


def _lower_op(key: str, xs: Sequence[Any], tensors: Sequence[Any], numbers: Sequence[Any]) -> Any:
    """``fscan::kernel_scan_hop`` in a graph Inductor lowers: the same call of RUN."""
    from torch._inductor.lowering import fallback_handler

    return fallback_handler(RUN, add_to_fallback_set=False)(key, list(xs), tensors, numbers)


def registered(
    gm: Any, n_leaves: int, additional_inputs: Sequence[Any], is_tensor: Callable[[Any], bool]
) -> tuple[str, list[Any], list[Any]]:
    """Register the combine graph ``gm`` (of ``n_leaves`` leaves a side) under its key:
    the key, and the extra inputs that are tensors and numbers it reads, in order."""
    if any(node.op == "get_attr" for node in gm.graph.nodes):
        # Constants held by the module are not in its code, which keys the registry.
        raise RuntimeError(
            "fscan: combine_fn's traced graph holds tensor constants; the CPU kernel's "
            "lowering keys graphs by their code. Compile with fscan.config.cpu_kernel='off'"
        )
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    extra_nodes = placeholders[2 * n_leaves :]
    kinds = tuple(
        _TENSOR if is_tensor(a) else _NUMBER if node.users else _UNREAD
        for a, node in zip(additional_inputs, extra_nodes)
    )
    key = hashlib.sha256(f"{LOWERING}\n{kinds}\n{gm.code}".encode()).hexdigest()
    _graphs.get_or_compute(key, lambda: _Graph(gm.forward.__func__, kinds))
    tensors = [a for a, k in zip(additional_inputs, kinds) if k == _TENSOR]
    numbers = [a for a, k in zip(additional_inputs, kinds) if k == _NUMBER]
    return key, tensors, numbers


def _is_ir_tensor(value: Any) -> bool:
    return hasattr(value, "get_dtype")  # an IR node: a tensor
