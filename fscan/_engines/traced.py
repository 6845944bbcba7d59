"""What ``fscan.associative_scan`` runs while ``torch.compile`` or ``torch.export`` traces it.

Tracing the eager engine would unroll its recursion, whose depth depends on the
scan length: Dynamo would specialise the graph to that length (a recompile for
every new length; and Inductor needs ~2 minutes for the unrolled graph of a
4096-step scan on 2 cores), and ``torch.export`` could not keep the length
symbolic. So a traced scan becomes one length-polymorphic operation instead:

============================================  =====================================
case                                          route
============================================  =====================================
inside ``vmap``, ``grad`` & co. (a nested     ``unrolled``: the out-of-place eager
scan in a generic ``combine_fn``)             engine, traced (no HOP can run there)
export, pointwise                             ``associative_scan`` HOP (*)
export, generic                               sequential ``scan`` HOP
compile, pointwise, CUDA/XPU, grad mode off   ``associative_scan`` HOP: Triton scan
compile, pointwise, CUDA/XPU, grad mode on,  ``adjoint``: the HOP without a tape, and
float leaves of one shape                     the adjoint scan, a HOP too, for the
                                              gradient (:mod:`fscan._engines.traced_adjoint`)
compile, pointwise, CPU with a C++ compiler   ``associative_scan`` HOP: the C++ kernel
and ``cpu_kernel`` not ``"off"``; with grad,  (:mod:`fscan._engines.cpp.traced_kernel`),
float leaves of one dtype and shape           differentiated by its backward kernel
                                              (:mod:`fscan._engines.cpp.traced_kernel_grad`)
compile, anything else                        blocked scan around a ``while_loop``
============================================  =====================================

(*) the seed contract: one node ``associative_scan(combine_graph, [xs], ())``
whose ``combine_graph`` works on one element. When the export is non-strict
and ``combine_fn`` closes over tensors, the blocked scan is used instead: the
non-strict trace of the HOP would bake those tensors in as constants.

Why not the HOP everywhere: Inductor lowers it only where it has scan codegen
(CUDA/XPU; on CPU fscan gives it a lowering to its C++ kernel, which needs a
compiler), and the HOP's autograd treats each leaf
on its own, which is wrong as soon as ``combine_fn`` mixes leaves (for the
linear recurrence ``(a1, b1), (a2, b2) -> (a1 a2, a2 b1 + b2)`` the gradient of
``a`` comes out wrong) and it drops gradients for closed-over tensors: the
``adjoint`` route runs it without a tape and differentiates around it.

The blocked scan is plain tensor code: autograd, closures and both modes work.
It scans blocks of ``TRACED_BLOCK`` steps with a fixed, unrolled loop, scans the block
totals by doubling in a ``while_loop`` (``log2(n / TRACED_BLOCK)`` iterations), then
carries each block's prefix in with one more combine: about ``2n`` combines in
all, which Inductor fuses into a few passes over the data. A plain doubling
scan over all ``n`` steps would be simpler but does ``n log2(n)`` combines: on
CPU it ran 3x slower than the eager engine, the blocked scan 1.6-2x faster.

Generic mode cannot go through the ``associative_scan`` HOP (Dynamo requires
its ``combine_fn`` to be pointwise), and an exported ``while_loop`` cannot run a
``vmap``'ed ``combine_fn`` (``ep.module()`` fails with a functorch error), so
generic exports use torch's sequential ``scan``: ``combine_fn`` on single
elements, one step per element, differentiable.

The ``while_loop`` and ``scan`` front ends start a Dynamo trace of their own when
called outside one, so the functions handed to them get the pytree spec from
:func:`fscan._engines.hop.spec_source` (:mod:`fscan._engines.hop` says why).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

from .._call import ScanCall
from .._combine import FlatCombine, check_combine_output, flat_combine
from .._context import in_functorch_transform
from .._knowledge.store import reach
from .._pytree import unflatten
from .cpp.traced_kernel import install_lowering, kernel_traceable
from .cpp.traced_kernel_grad import install_autograd
from .hop import CODEGEN_DEVICES, SpecSource, hop_scan, spec_source
from .traced_adjoint import adjoint_serves, adjoint_traced_scan
from .traced_workarounds import prepare_loop_backward, quiet_function_contexts
from .tree import scan_along, scan_functional

__all__ = [
    "TRACED_BLOCK",
    "StepGather",
    "block_step",
    "cpu_kernel_lowered",
    "doubling_scan",
    "sequential_scan",
    "traced_blocked_scan",
    "traced_route",
    "traced_scan",
]

# Steps per block of the blocked scan: 8, 16 and 32 ran alike on CPU (within 10%);
# the time to trace and compile grows with it.
TRACED_BLOCK = 8


def traced_scan(call: ScanCall) -> list[torch.Tensor]:
    """Scan a checked call's flat leaves along its ``dim`` as one traceable operation
    (module doc).

    Like torch's front end, it moves ``dim`` to the front and flips for
    ``reverse``, so the operation itself always scans forward along dimension 0.

    Example:
        >>> import fscan
        >>> cumsum = lambda x: fscan.associative_scan(torch.add, x, 0)  # comes here when traced
        >>> torch.compile(cumsum, backend="eager", fullgraph=True)(torch.arange(1.0, 5.0))
        tensor([ 1.,  3.,  6., 10.])
        >>> torch._dynamo.reset()  # Dynamo's clean-up of this example's globals runs now
    """
    api, combine_fn, _, spec, leaves, dim, reverse, combine_mode = call[:8]
    # No movedim for dim 0: it would stay in an exported graph as a no-op node.
    xs = [x.movedim(dim, 0) if dim else x for x in leaves]
    if reverse:
        xs = [x.flip(0) for x in xs]
    route = traced_route(combine_fn, xs, combine_mode)
    spec_of = spec_source(spec)
    make = lambda operands: flat_combine(api, combine_fn, spec_of(operands), combine_mode)
    if route == "hop":
        ys = hop_scan(make, xs)
    elif route == "adjoint":
        if torch.compiler.is_dynamo_compiling():  # it traces an autograd.Function: see there
            quiet_function_contexts()
        ys = adjoint_traced_scan(make, xs, hop_scan)
    elif route == "sequential":
        ys = sequential_scan(api, combine_fn, spec_of, xs)
    elif route == "unrolled":
        ys = scan_functional(flat_combine(api, combine_fn, spec_of(xs), combine_mode), xs)
    else:
        if torch.is_grad_enabled() and torch.compiler.is_dynamo_compiling():
            # torch bugs in the while_loop's backward: see fscan._engines.traced_workarounds
            prepare_loop_backward()
        ys = traced_blocked_scan(make, xs)
    if reverse:
        ys = [y.flip(0) for y in ys]
    return [y.movedim(0, dim) if dim else y for y in ys]


def traced_route(
    combine_fn: Callable[[Any, Any], Any], xs: Sequence[torch.Tensor], combine_mode: str
) -> str:
    """``"hop"``, ``"adjoint"``, ``"sequential"``, ``"unrolled"`` or ``"blocked"``: the module
    doc's table."""
    if in_functorch_transform():
        return "unrolled"
    if torch.compiler.is_exporting():
        if combine_mode == "generic":
            return "sequential"
        # Strict export runs under Dynamo, which lifts closed-over tensors into
        # HOP inputs itself (and cannot trace the introspection below).
        if torch.compiler.is_dynamo_compiling() or not reach(combine_fn).tensors:
            # On CPU the op's autograd rule is the kernel's backward once installed, and
            # a strict export of a closure over a parameter differentiates through it:
            # install it here too, so that export does not depend on an earlier compile.
            if xs[0].device.type == "cpu":
                cpu_kernel_lowered()
            return "hop"
        return "blocked"
    if combine_mode == "generic":
        return "blocked"
    device, grad = xs[0].device.type, torch.is_grad_enabled()
    if device in CODEGEN_DEVICES:
        if not grad:
            return "hop"
        return "adjoint" if adjoint_serves(xs) else "blocked"
    if device != "cpu" or not cpu_kernel_lowered():
        return "blocked"
    # With grad, the kernel's backward: float leaves of one dtype and shape, as KernelScan's.
    return "hop" if not grad or _kernel_differentiates(xs) else "blocked"


def _kernel_differentiates(xs: Sequence[torch.Tensor]) -> bool:
    dtype, shape = xs[0].dtype, xs[0].shape
    for x in xs:
        if not x.dtype.is_floating_point or x.dtype != dtype or x.shape != shape:
            return False
    return True


def cpu_kernel_lowered() -> bool:
    """Whether CPU scans traced now take the C++ kernel's lowering of the HOP, installed
    here with the tree engine for the calls the kernel declines at run time (a graph
    compiled for the kernel, run where no kernel builds: the same results)."""
    return kernel_traceable() and install_lowering(_declined_by_kernel) and install_autograd()


# Dynamo cannot trace the config read and the compiler probe: it calls this while it
# traces and keeps the result as a constant (torch.compiler.assume_constant_result).
cpu_kernel_lowered._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _declined_by_kernel(combine: FlatCombine, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return scan_along(combine, xs, 0)  # fresh and contiguous, as the kernel's op promises


def traced_blocked_scan(
    make_combine: Callable[[Sequence[torch.Tensor]], FlatCombine], xs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Inclusive scan along dimension 0 in blocks of ``TRACED_BLOCK`` steps (module doc).

    The length is padded to whole blocks (and more) by repeating the last element:
    padding only follows the real elements, so it changes no real output. Every shape is
    an expression in the symbolic length and nothing branches on it.
    ``make_combine(operands)`` gives the flat combine in the current trace.

    Example:
        >>> add = lambda operands: lambda a, b: [a[0] + b[0]]
        >>> traced_blocked_scan(add, [torch.arange(1.0, 20.0)])[0]
        tensor([  1.,   3.,   6.,  10.,  15.,  21.,  28.,  36.,  45.,  55.,  66.,  78.,
                 91., 105., 120., 136., 153., 171., 190.])
    """
    combine = make_combine(xs)
    n, device = xs[0].shape[0], xs[0].device
    # At least two blocks and one spare step, provably (n // TRACED_BLOCK is exact for
    # Dynamo and export): a derived size of 1 would be specialised. The tail is
    # padded by gathering with clamped indices, not with sizes to prove >= 0.
    m = n // TRACED_BLOCK + 2
    # Step j of block i is element i * TRACED_BLOCK + j, gathered: splitting a symbolic
    # dimension with a view asks export to prove divisibility, which it cannot. One
    # gather per step, not views of one gather: combine_fn's operands must not share
    # memory where it calls torch.cond & co. (Dynamo refuses aliased HOP inputs).
    step_j = lambda j: [block_step(x, j) for x in xs]
    # 1. Within each block, step by step: TRACED_BLOCK - 1 combines over all blocks at once.
    running = step_j(0)
    steps = [running]
    for j in range(1, TRACED_BLOCK):
        running = combine(running, step_j(j))
        steps.append(running)
    # 2. The block totals (the last step), scanned: the prefix up to each block.
    totals = doubling_scan(make_combine, running)
    # 3. Each block but the first gets the prefix of the blocks before it.
    flat = lambda t: t.reshape(m * TRACED_BLOCK, *t.shape[2:])
    within = [flat(torch.stack([s[k] for s in steps], 1)) for k in range(len(xs))]
    previous = (torch.arange(m, device=device) - 1).clamp(min=0)  # block 0: a placeholder
    before = [t.index_select(0, previous) for t in totals]
    before = [flat(t.unsqueeze(1).expand(m, TRACED_BLOCK, *t.shape[1:])) for t in before]
    carried = combine(before, within)
    first_block = torch.arange(m * TRACED_BLOCK, device=device) < TRACED_BLOCK
    real = torch.arange(n, device=device)
    return [
        torch.where(first_block.view(-1, *[1] * (w.ndim - 1)), w, c).index_select(0, real)
        for w, c in zip(within, carried)
    ]


def block_step(x: torch.Tensor, j: int) -> torch.Tensor:
    """Step ``j`` of every block of ``x`` (element ``i * TRACED_BLOCK + j`` of block ``i``; past the
    end, the last element): ``x.index_select(0, (arange(m) * TRACED_BLOCK + j).clamp(max=n - 1))``.

    Where a backward is traced (compile with grad), it is ``StepGather``, whose backward
    gathers instead of scattering (its docstring says why).

    Example:
        >>> block_step(torch.arange(10.0), 3)
        tensor([3., 9., 9.])
    """
    if torch.is_grad_enabled() and torch.compiler.is_dynamo_compiling():
        return StepGather.apply(x, j)
    n = x.shape[0]
    first = torch.arange(n // TRACED_BLOCK + 2, device=x.device) * TRACED_BLOCK
    return x.index_select(0, (first + j).clamp(max=n - 1))


class StepGather(torch.autograd.Function):
    """``block_step`` whose backward is a gather and a masked sum, never a scatter.

    The backward of ``index_select`` is a scatter-add (``index_put`` accumulate). With
    several blocked scans of one tensor in one compiled backward, Inductor (torch 2.13)
    fused the sum of that tensor's gradient with the zero-fill of one scan's scatter
    targets into a kernel that ran before the scatters (after the ``while_loop`` they
    wait for): the gradient read zeros. Here the gradient of element ``r`` is read
    from its block, ``g[r // TRACED_BLOCK]`` where ``r % TRACED_BLOCK == j``, and the last element
    also gets the steps clamped onto it: the same sums, with nothing to order.

    Example:
        >>> x = torch.arange(10.0, requires_grad=True)
        >>> StepGather.apply(x, 3).backward(torch.tensor([1.0, 2.0, 4.0]))
        >>> x.grad
        tensor([0., 0., 0., 1., 0., 0., 0., 0., 0., 6.])
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, j: int) -> torch.Tensor:
        n = x.shape[0]
        ctx.n, ctx.j = n, j
        first = torch.arange(n // TRACED_BLOCK + 2, device=x.device) * TRACED_BLOCK
        return x.index_select(0, (first + j).clamp(max=n - 1))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        n, j = ctx.n, ctx.j
        column = lambda mask: mask.view(-1, *[1] * (g.ndim - 1))
        rows = torch.arange(n, device=g.device)
        own = torch.where(
            column(rows % TRACED_BLOCK == j), g.index_select(0, rows // TRACED_BLOCK), 0
        )
        past = torch.arange(g.shape[0], device=g.device) * TRACED_BLOCK + j > n - 1
        clamped = torch.where(column(past), g, 0).sum(0)
        return own + torch.where(column(rows == n - 1), clamped, 0), None


def doubling_scan(
    make_combine: Callable[[Sequence[torch.Tensor]], FlatCombine], xs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Inclusive scan along dimension 0 by doubling (Hillis and Steele), in one ``while_loop``.

    Step ``k`` combines every position ``i >= 2**k`` with position ``i - 2**k``, the
    earlier one on the left, so after ``ceil(log2(n))`` steps position ``i`` holds
    the combination of ``xs[0..i]``. Shapes never change, so the length stays
    symbolic; positions ``i < 2**k`` are computed on a clamped index and discarded.
    ``make_combine(operands)`` is called inside the loop body, in its trace.

    Example:
        >>> doubling_scan(lambda operands: lambda a, b: [a[0] + b[0]], [torch.arange(1.0, 7.0)])
        [tensor([ 1.,  3.,  6., 10., 15., 21.])]
    """
    n = xs[0].shape[0]
    positions = torch.arange(n, device=xs[0].device)

    def unfinished(offset: torch.Tensor, *ys: torch.Tensor) -> torch.Tensor:
        return offset < n

    def step(offset: torch.Tensor, *ys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        earlier = (positions - offset).clamp(min=0)
        combined = make_combine(ys)([y.index_select(0, earlier) for y in ys], list(ys))
        reached = positions >= offset
        kept = [
            torch.where(reached.view(-1, *[1] * (y.ndim - 1)), c, y) for c, y in zip(combined, ys)
        ]
        return (offset * 2, *kept)

    # The loop carries must keep their strides from step to step: start contiguous.
    start = [x.clone(memory_format=torch.contiguous_format) for x in xs]
    offset = torch.ones((), dtype=torch.int64, device=xs[0].device)
    if torch.compiler.is_dynamo_compiling():
        return list(while_loop(unfinished, step, (offset, *start))[1:])
    # Outside Dynamo, while_loop compiles itself, and Dynamo reads `.grad` of carries
    # that are results of autograd (a non-leaf warning the user could do nothing about).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not")
        return list(while_loop(unfinished, step, (offset, *start))[1:])


def sequential_scan(
    api: str, combine_fn: Callable[[Any, Any], Any], spec_of: SpecSource, xs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Inclusive scan along dimension 0 with torch's sequential ``scan`` HOP, one element a step.

    ``combine_fn`` sees single elements (generic mode). The carry holds a flag
    that makes the first step output ``xs[0]`` itself: the scan runs over all
    ``n`` elements (not ``xs[1:]``, whose length export would have to assume is
    not 1), so the combine of that step is computed and discarded.

    Example:
        >>> import optree
        >>> one = spec_source(optree.tree_structure(0))
        >>> sequential_scan("demo", torch.mul, one, [torch.arange(1.0, 5.0)])
        [tensor([ 1.,  2.,  6., 24.])]
    """

    def step(carry: list[torch.Tensor], x: list[torch.Tensor]) -> tuple[list, list]:
        *acc, first = carry
        spec = spec_of(x)
        out = combine_fn(unflatten(spec, acc), unflatten(spec, x))
        combined = check_combine_output(api, out, spec, x, "generic")
        ys = [torch.where(first > 0, e, c) for e, c in zip(x, combined)]
        return [*ys, first * 0], [y.clone() for y in ys]

    # A float flag: torch's scan autograd rejects a non-differentiable bool carry.
    first = torch.ones((), dtype=torch.float32, device=xs[0].device)
    _, ys = scan(step, [*(x[0].clone() for x in xs), first], list(xs))
    return list(ys)
