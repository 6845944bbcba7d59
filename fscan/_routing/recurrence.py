"""Which engine solves a linear recurrence: the one place that picks, for every call.

``fscan.linear_recurrence`` and ``fscan.log_linear_recurrence`` reach :func:`route`
through their entry (:mod:`fscan._recurrences`), which hands over the
:class:`Recurrence` it solves: the chunked walk's operations, its tree scan of
pairs and its autograd Function. Every route, in the order they are tried:

=============  ===================================================================
route          when, and what runs
=============  ===================================================================
``empty``      ``b`` has no element: one step on the empty tensors, still
               connected to every input (zero gradients of their shapes)
``tree``       ``torch.compile``/``torch.export`` traces: ``Recurrence.tree``,
               the pairs ``(a_t, b_t)`` as one length-polymorphic associative
               scan (through the internal entry, which autograd traces too)
``functional`` a ``torch.func`` transform or forward-mode AD is active:
               :func:`solve` out of place, plain differentiable torch ops that
               functorch differentiates and batches
``autograd``   eager, a gradient wanted: ``Recurrence.with_grad``, the
               recurrence's autograd Function, whose forward and backward (one
               more recurrence, the other way) are :func:`solve` in place
``inplace``    eager, no gradient wanted: :func:`solve` writing into
               preallocated memory; with ``reset=``, first the segmented C++
               kernel (:func:`reset_solve`) where :func:`reset_refused` finds no
               reason against it and it is built
=============  ===================================================================

:func:`solve` then picks the engine of each walk (the forward, the backward's
adjoint, the recurrence over chunk ends):

=============  ===================================================================
engine         when, and what runs
=============  ===================================================================
``cpp``        the kind has a kernel, :func:`kernel_refused` finds no reason
               against it (under 32 steps, :class:`KernelBar`: where the loop is
               not faster) and the C++ kernel (:mod:`fscan._engines.cpp`) is built:
               the pairs scanned keeping only ``h``, ``initial`` its carry-in
``blocked``    32 steps or more: the chunked walk (:mod:`fscan._engines.chunked`),
               with :func:`solve` passed in for the recurrence over chunk ends;
               under 32 steps the loop itself (``Recurrence.short == "loop"``)
``tree``       under 32 steps where the kind says so (``short == "tree"``, log
               space): ``Recurrence.tree``
=============  ===================================================================

The backward's adjoint, where the gradient of the gates is wanted and
:func:`kernel_refused` finds no reason against the kernel, is
:func:`kernel_adjoint`: the C++ backward kernel of the pairs' scan with ``h``'s
cotangent alone, one pass for both gradients; elsewhere (or not built yet) one more
walk through :func:`solve`, then a product for the gates' gradient.

``fscan.linear_recurrence_matrix`` reaches :func:`route_matrix` with its maps laid
out time first (:mod:`fscan._recurrences.matrix`):

=============  ===================================================================
engine         when, and what runs
=============  ===================================================================
``empty``      length 0: a copy of the (empty) inputs
``traced``     ``torch.compile``/``torch.export`` traces: the scan the entry hands
               over (the maps through the internal entry, one length-polymorphic
               op; the tree's recursion would unroll per length)
``tree``       otherwise: the odd/even tree of :mod:`fscan._engines.matrix_tree`;
               where its result is not finite (a product of gates may have left
               the range and met a state, ``0 * inf``) the loop instead, unless a
               ``vmap`` hides the values (:func:`fscan._context.values_hidden`)
=============  ===================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Literal, NamedTuple

import optree
import torch

from .._context import Where, values_hidden, where
from .._engines.chunked import Algebra, Operands, chunk_size, chunked_solve, sequential
from .._engines.cpp.cpu_kernel import kernel_scan, kernel_vjp
from .._engines.matrix_tree import MatrixMaps, matrix_scan, matrix_walk
from .._route_log import ran
from .segmented import run_segmented, segmented_route

__all__ = [
    "ADJOINT_MIN_LANES",
    "KERNEL_BAR",
    "PAIR_SPEC",
    "KernelBar",
    "Recurrence",
    "compose",
    "kernel_adjoint",
    "kernel_refused",
    "kernel_solve",
    "pick_route",
    "reset_refused",
    "reset_solve",
    "route",
    "route_matrix",
    "solve",
]

_API = "fscan.linear_recurrence"
PAIR_SPEC = optree.tree_structure((0, 0))
_KEEP_H = (False, True)  # of the pair (a, b) scanned by the kernel: only h


class Recurrence(NamedTuple):
    """One kind of elementwise linear recurrence, as its entry hands it to the router."""

    walk: Algebra  # the chunked walk's operations
    tree: Callable[[Operands], torch.Tensor]  # the pairs as one associative scan
    with_grad: Callable[..., torch.Tensor]  # the autograd Function's apply(*operands)
    short: Literal["loop", "tree"]  # what solves fewer than 32 steps
    kernel: KernelBar | None = None  # where the C++ kernel serves; None: no kernel


class KernelBar(NamedTuple):
    """Where the C++ kernel beats the loop that solves fewer than 32 steps (from 32 steps
    the kernel beats the chunked walk at every size measured, and serves).

    The loop costs a few torch ops per step, each over a whole step's elements; the
    kernel a fixed cost per call (more with a carry-in, more again writing into ``out=``
    memory) and then every element. So the loop is faster for very few steps, and for
    steps of many elements, where torch's vectorized ops outrun the kernel's chains.
    Measured against each other, float32, 1 thread, 2-core AMD EPYC, December 2026:
    :data:`KERNEL_BAR`.
    """

    steps: int  # the fewest steps the kernel serves
    carried_steps: int  # ... with a carry-in (``initial=``)
    into_steps: int  # ... with a carry-in, written into ``out=`` (the backward's adjoint)
    widest: int  # the most elements per step it serves


# Walk over kernel time: 1 step 0.66x, 2 steps 0.95-1.2x, 4 steps 1.1-1.75x and 16
# steps 1.5-3x (256-4096 elements per step); with a carry-in 0.8x at 4 steps, 1.0-1.35x
# at 8; with one into out= 0.5-0.75x at 8, 1.15x at 16 (256-1024 per step); at 16384
# elements per step 0.8-1.0x, at 65536 0.45-0.7x.
KERNEL_BAR = KernelBar(steps=2, carried_steps=8, into_steps=16, widest=8192)


def pick_route(ops: Operands) -> str:
    """The route of a call (table in the module doc), read without side effects."""
    b = ops.b
    if b.numel() == 0:
        return "empty"
    at = where([b])
    if at.tracing:
        return "tree"
    if at.transform:
        return "functional"
    if at.grad and any(t is not None and t.requires_grad for t in (ops.a, b, ops.initial)):
        return "autograd"
    return "inplace"


def route(kind: Recurrence, ops: Operands, out: torch.Tensor | None = None) -> torch.Tensor:
    """The states of the recurrence ``kind`` on the route :func:`pick_route` picks; each
    route computes the same states, differentiably. ``out``: memory the ``inplace``
    route writes into (an exclusive recurrence's view, see :mod:`fscan._exclusive`);
    the others return new memory."""
    chosen = pick_route(ops)
    if chosen == "inplace":
        if ops.mask is not None and reset_refused(kind, ops, where([ops.b])) is None:
            h = reset_solve(ops)
            if h is not None:
                return h  # new memory: an exclusive recurrence's caller copies it into `out`
        return solve(kind, ops, fast=True, out=out)
    if chosen == "autograd":
        return kind.with_grad(*ops)
    if chosen == "functional":
        return solve(kind, ops, fast=False)
    if chosen == "tree":
        return kind.tree(ops)
    ran("empty")
    h = kind.walk.step(ops.a, ops.b, None, torch.zeros_like(ops.b), None)
    return h if ops.initial is None else h + ops.initial.unsqueeze(ops.dim) * 0


_RESET = "reset= in a walk of a gradient or a transform: the chunked walk"
_TRANSFORM = "a torch.func transform is active: the torch engine runs"
_DTYPES = "the gates and inputs differ in dtype"
_INITIAL = "initial requires grad: the chunked walk carries it"


def kernel_refused(
    kind: Recurrence, ops: Operands, transform: bool, into: bool = False
) -> str | None:
    """Why :func:`solve` does not offer this walk (written into ``out=`` memory where
    ``into``) to the C++ kernel, or None where it does (the kernel may still decline:
    not built yet, see ``fscan.explain``). Reads nothing but its arguments: the
    ``"fscan"`` log's reasons ask it too."""
    bar = kind.kernel
    if bar is None:
        return "no kernel serves this recurrence"
    a, b, _, initial, _, mask = ops
    if mask is not None:
        return _RESET
    if transform:
        return _TRANSFORM
    if not b.is_floating_point():
        return f"dtype {b.dtype}: the kernel takes floating point"
    if a.dtype != b.dtype:
        return _DTYPES
    if initial is not None and initial.requires_grad and torch.is_grad_enabled():
        return _INITIAL  # the walk's ops carry it
    return _loop_faster(bar, b.shape[ops.dim], b.numel(), initial is not None, into)


def reset_refused(kind: Recurrence, ops: Operands, at: Where) -> str | None:
    """Why the ``inplace`` route does not offer this ``reset=`` call to the segmented
    kernel, or None where it does (the kernel may still decline: not built yet). Reads
    nothing but its arguments and fscan's config: the ``"fscan"`` log's reasons ask it too.
    The bar against the loop is the plain kernel's (:data:`KERNEL_BAR`); with a mask
    (a reset every ~3 steps), kernel over loop: 2 steps 1.06x, 4 steps 0.89x, 16
    steps 0.44x at 256 elements a step; with ``initial`` 0.85x at (8, 256), 0.6x at
    (16, 1024); 0.88x at (4, 4096) (float32, 1 thread, December 2026)."""
    bar = kind.kernel
    if bar is None:
        return "no kernel serves this recurrence"
    a, b, initial = ops.a, ops.b, ops.initial
    given = [t for t in (a, b, initial) if t is not None]
    if at.tracing or at.transform:
        return "traced or under a torch.func transform: the route's torch ops run"
    if at.grad and any(t.requires_grad for t in given):
        return "gradients wanted: the recurrence's autograd Function runs the chunked walk"
    why = segmented_route(at, given)  # the segmented kernel's own limits
    if why is not None:
        return why
    if not b.is_floating_point():
        return f"dtype {b.dtype}: the kernel takes floating point"
    if a.dtype != b.dtype:
        return _DTYPES
    return _loop_faster(bar, b.shape[ops.dim], b.numel(), initial is not None, False)


def reset_solve(ops: Operands) -> torch.Tensor | None:
    """A ``reset=`` recurrence by the segmented kernel (:func:`run_segmented`, logged as
    ``cpp``) in new memory, or None while it is not built: the affine pairs' segmented
    scan is the recurrence with a restart, ``h = b`` at a reset (a selection: nothing
    before it reaches ``h``, not a NaN, not ``0 * inf``). The mask is read in place, a
    byte a step where it is 1-D. ``initial`` is folded into the first step of a copy of
    ``b`` unless a reset is there (the kernel takes no carry-in with flags)."""
    a, b, dim, initial, reverse, mask = ops
    assert mask is not None
    n = b.shape[dim]
    a = a.expand(b.shape)  # a view: a broadcast gate is read with stride 0
    if initial is not None:
        first = n - 1 if reverse else 0
        a0, b0 = a.select(dim, first), b.select(dim, first)
        head = torch.where(mask.select(dim, first), b0, torch.addcmul(b0, a0, initial))
        b = b.clone()
        b.select(dim, first).copy_(head)
    flags = mask.reshape(n) if mask.numel() == n else mask  # 1-D: one flag a step
    found = run_segmented(compose, PAIR_SPEC, [a, b], dim, reverse, flags)
    return None if found is None else found[1]


def _loop_faster(bar: KernelBar, steps: int, numel: int, carried: bool, into: bool) -> str | None:
    """Why the loop beats the kernel on ``steps`` steps of ``numel`` elements in all
    (:class:`KernelBar`), or None where the kernel is faster."""
    if chunk_size(steps) is not None:
        return None  # the chunked walk: the kernel is faster
    least = bar.into_steps if into and carried else bar.carried_steps if carried else bar.steps
    if steps < least:
        carry = " with a carry-in" if carried else ""
        return f"fewer than {least} steps{carry}: the loop is faster"
    if numel >= bar.widest * steps:
        return f"fewer than 32 steps of {bar.widest} or more elements: the loop is faster"
    return None


def solve(
    kind: Recurrence, ops: Operands, fast: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """One walk of the recurrence on the engine the second table picks (module doc).

    ``fast`` writes the states into preallocated memory (``out=``, or ``out`` if
    given): only where no autograd or functorch transform watches the ops; out of
    place (``fast=False``) is the ``functional`` route's, under a transform.
    """
    a, b, dim = ops.a, ops.b, ops.dim
    n = b.shape[dim]
    a = a.expand(*(n if i == dim else s for i, s in enumerate(a.shape)))  # stride 0 if constant
    ops = Operands(a, b, dim, ops.initial, ops.reverse, ops.mask)
    if kernel_refused(kind, ops, not fast, out is not None) is None:
        h = kernel_solve(a, b, dim, ops.reverse, ops.initial, out)
        if h is not None:
            ran("cpp")
            return h  # `out` itself if given: the kernel wrote it in place
    chunk = chunk_size(n)
    if chunk is not None:
        ran("blocked")
        return chunked_solve(ops, chunk, fast, out, kind.walk, partial(solve, kind))
    if kind.short == "tree":
        ran("tree")
        return kind.tree(ops)
    # Under 32 steps, the loop itself: no product of gates is formed, so none can
    # under/overflow into 0 * inf or inf * 0 (the tree multiplies them).
    ran("blocked")
    return sequential(kind.walk.step, ops, fast, out)


def kernel_solve(
    a: torch.Tensor,
    b: torch.Tensor,
    dim: int,
    reverse: bool,
    initial: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The recurrence by fscan's compiled C++ kernel (fscan._engines.cpp.cpu_kernel), or
    None where it does not serve (not built, or inputs it cannot take): what
    :func:`kernel_refused` lets through. A broadcast gate is expanded to ``b``'s shape
    (a view: stride 0) and read in place, at any size: with only ``h`` stored, the
    kernel beat the chunked walk at (16384, 512) for (T, 1) and (1, C) gates
    (docs/linear.md). ``initial`` enters as the kernel's carry-in: the first step's pair
    becomes ``(a_0, a_0 initial + b_0)``, read in place of the leaves' (no copy of them).
    ``out``: written in place through its strides (the backward's narrowed view of
    ``lam``) and returned; unwritten where the kernel does not serve (None)."""
    if a.shape != b.shape:
        a = a.expand(b.shape)  # `a` broadcasts to `b` (checked on entry)
    head = None
    if initial is not None:
        first = b.shape[dim] - 1 if reverse else 0
        a0, b0 = a.select(dim, first), b.select(dim, first)
        head = [a0, torch.addcmul(b0, a0, initial).expand(b0.shape)]
    # Only h is kept: the gate products are neither allocated nor stored (half the
    # writes, and the page faults of a fresh output).
    into = None if out is None else [out]
    found = kernel_scan(
        _API, compose, PAIR_SPEC, [a, b], dim, reverse, keep=_KEEP_H, head=head, out=into
    )
    return None if found is None else found[1]


# Elements after the scan dim from which the one-pass backward serves: there the kernel
# walks columns of lanes with vector loops. Below (1-D, a scan over the last dim) its chain
# path walks each lane alone, twice where it splits it into chunks, and one more walk
# (the forward kernel's tiled chains) plus a product was faster: float32, 1 thread,
# backward alone, 2-core AMD EPYC, December 2026, fastest of 30 on a loaded machine:
# (1048576,) 6.1-8.7 ms one pass against 5.0-5.3 ms; (65536, 8) 0.54 against 0.77 ms,
# (4096, 16) 0.09 against 0.15 ms, (4096, 256) 0.63-0.68 against 0.78-0.89 ms.
ADJOINT_MIN_LANES = 8


def kernel_adjoint(
    kind: Recurrence,
    a: torch.Tensor,
    h: torch.Tensor,
    grad_h: torch.Tensor,
    dim: int,
    reverse: bool,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The backward of ``h = kind(a, b)`` in one pass of the C++ backward kernel of the
    pairs' scan (:func:`~fscan._engines.cpp.cpu_kernel.kernel_vjp`, built without the gate
    products' cotangent, which no output has): ``(dL/db, dL/da)`` of ``h``'s shape, read
    from ``a``, ``h`` and ``grad_h`` alone, the adjoint state ``lam_t = grad_h_t + a_{t+1}
    lam_{t+1}`` and ``lam_t h_{t-1}`` written as it goes. ``dL/da`` at the scan's first
    step is 0 (the state before it is the caller's: ``initial``, or none). None where
    :func:`kernel_refused` refuses the walk ``(a, grad_h)``, where fewer than
    :data:`ADJOINT_MIN_LANES` elements follow ``dim`` (the kernel's chain path), or
    where the kernel is not ready."""
    shape = h.shape
    if math.prod(shape[dim % len(shape) + 1 :]) < ADJOINT_MIN_LANES:
        return None
    a = a.expand(shape)
    if kernel_refused(kind, Operands(a, grad_h, dim, None, not reverse, mask), False) is not None:
        return None
    found = kernel_vjp(compose, PAIR_SPEC, [a, None], [None, h], [None, grad_h], dim, reverse)
    if found is None or found[0] is None or found[1] is None:
        return None
    ran("cpp")
    return found[1], found[0]


def compose(x: tuple[torch.Tensor, torch.Tensor], y: tuple[torch.Tensor, torch.Tensor]):
    """``(a1, b1) then (a2, b2) = (a1 a2, a2 b1 + b2)``: ``h -> a2 (a1 h + b1) + b2``."""
    return x[0] * y[0], torch.addcmul(y[1], y[0], x[1])


def route_matrix(maps: MatrixMaps, traced: Callable[[MatrixMaps], torch.Tensor]) -> torch.Tensor:
    """The states of the matrix recurrence's maps, time first, on the engine the third
    table picks (module doc); ``traced`` is the entry's scan for a trace."""
    if maps.z.shape[0] == 0:
        ran("empty")
        return maps.z.clone()
    if torch.compiler.is_compiling():  # nothing is logged while Dynamo traces
        return traced(maps)
    ran("tree")
    h = matrix_scan(maps)
    if not values_hidden(h) and not bool(torch.isfinite(h).all()):
        # A product of gates may have left the range and met a state (0 * inf, inf
        # * 0), where the loop never forms it: the loop's answer, step by step.
        h = matrix_walk(maps)
    return h
