"""The C++ kernel's forward and backward inside ``torch.compile`` with gradients on CPU.

:mod:`fscan._engines.cpp.traced_kernel` lowers torch's ``associative_scan`` op to
the kernel once Inductor sees it; with gradients, AOTAutograd differentiates the
op first, and torch's own autograd for it is quadratic in the length, treats each
leaf on its own (wrong once ``combine_fn`` mixes leaves) and refuses lifted
tensors. So once fscan traced a CPU scan, the op's autograd rule for CPU leaves and
a traced combine graph is replaced here (torch's stays for every other call): it
registers the graph under its key, as the lowering does, and emits
``fscan::kernel_scan_hop`` itself, which now has an autograd formula: its backward
is the custom op ``fscan::kernel_scan_hop_backward``, the backward kernel of the
eager :class:`~fscan._engines.cpp._kernel_grad.KernelScan` on the saved inputs and
outputs (fscan's adjoint scan where that kernel cannot serve yet); a call identical,
in all the forward op's served calls are keyed on and which lifted tensors want a
gradient, to one the backward kernel served runs that kernel without the lookup.
Both ops name the graph by its key, a string in the compiled graph, so AOTAutograd
keeps both.
The graph Dynamo hands AOTAutograd still holds torch's scan op, which is not
cacheable, so no compiled graph is loaded from disk without this rule running
first and registering the key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch._C import DispatchKey
from torch._higher_order_ops.associative_scan import associative_scan_op

from ..._cache import BoundedCache
from ..._knowledge.store import on_clear
from ..adjoint import Backward, ScanPlan, adjoint, all_finite, stepwise_adjoint
from ._kernel_entry import BuildCall, Entry
from ._kernel_grad import _GradInfo, run_backward
from ._kernel_layout import element_shape
from ._kernel_registry import ready_entry, serving_lookup
from .inductor_calls import call_directly
from .traced_kernel import OP, combine_of, listed, registered, served_key

__all__ = ["install_autograd"]

_installed = False


# flexible_layout: the backward kernel reads any strides in place (as the forward's op).
@torch.library.custom_op(
    "fscan::kernel_scan_hop_backward", mutates_args=(), tags=(torch.Tag.flexible_layout,)
)
def _kernel_scan_hop_backward(
    key: str,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    grads: list[torch.Tensor],
    tensors: list[torch.Tensor],
    numbers: list[int],
    needs: list[bool],
) -> list[torch.Tensor]:
    """The cotangents of ``xs``, then of ``tensors`` (zeros where ``needs`` says none is
    wanted), for the scan ``fscan::kernel_scan_hop`` ran with the same arguments."""
    return _cotangents(key, xs, ys, grads, tensors, numbers, needs)


def _cotangents(
    key: str,
    xs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    tensors: Sequence[torch.Tensor],
    numbers: Sequence[int],
    needs: Sequence[bool],
) -> list[torch.Tensor]:
    """The body of both backward ops (module doc)."""
    # The lifted tensors that want a gradient, marked so (the kernel's param sums and the
    # adjoint find them as the combine's captured tensors that require grad).
    marked = [t.detach().requires_grad_(need) for t, need in zip(tensors, needs)]
    combine = combine_of(key, marked, numbers)
    needing = tuple([t for t in marked if t.requires_grad])
    plan = ScanPlan(listed(combine), len(xs), 0, False)
    call = Backward(plan, xs, needing, ys, grads, [True] * (len(xs) + len(needing)))
    served_key = _served_key(key, xs, tensors, numbers, needs)
    with _autograd_let_in(), torch.no_grad():
        found = _by_kernel(combine, call, marked, needing, served_key)
        if found is None:
            found = adjoint(call)
            if needing and not all_finite([*found[0], *found[1]]):
                found = stepwise_adjoint(call)
    xbar, capbar = found
    wanted = iter(capbar)
    bars = [*xbar, *(next(wanted) if need else None for need in needs)]
    # Fresh and contiguous, as the fake implementation promises Inductor.
    return [_contiguous(bar, like) for bar, like in zip(bars, (*xs, *tensors))]


def _autograd_let_in() -> Any:
    """A custom op's kernel runs below autograd (its dispatch keys excluded), and the
    adjoint and the captured tensors' pull-back differentiate the combine: let it in."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (DispatchKey.AutogradCPU, DispatchKey.AutogradOther, DispatchKey.ADInplaceOrView):
        excluded = excluded.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def _contiguous(bar: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if bar is None:
        return torch.zeros(like.shape, dtype=like.dtype)
    return bar.contiguous()


@_kernel_scan_hop_backward.register_fake
def _fake_backward(
    key: str,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    grads: list[torch.Tensor],
    tensors: list[torch.Tensor],
    numbers: list[int],
    needs: list[bool],
) -> list[torch.Tensor]:
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (*xs, *tensors)]


# Calls the backward kernel served, by _served_key: the READY backward entry and where its
# captured tensors are among the call's lifted ones. A call identical in all the lookup
# read skips the lookup: the combine is a new closure on every call, so its reach was
# walked anew each time (about 40% of the backward op's time in a cProfile of a (64,) add).
_served: BoundedCache[tuple[Entry, tuple[int, ...]]] = BoundedCache(maxsize=256)
on_clear(_served.clear)


def _served_key(
    key: str,
    xs: Sequence[torch.Tensor],
    tensors: Sequence[torch.Tensor],
    numbers: Sequence[int],
    needs: Sequence[bool],
) -> tuple[Any, ...] | None:
    """The forward op's key of a call (:func:`~.traced_kernel.served_key`), with which
    lifted tensors want a gradient (the backward kernel's param sums); None where the
    kernel may not serve it."""
    found = served_key(key, xs, tensors, numbers)
    return None if found is None else (*found, *needs)


def _by_kernel(
    combine: Callable[..., list],
    call: Backward,
    captured_inputs: Sequence[torch.Tensor],
    needing: tuple[torch.Tensor, ...],
    key: tuple[Any, ...] | None = None,
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None:
    """:func:`run_backward` where the backward kernel is ready, else None; by the kernel
    that served the call ``key`` names, if any, without looking it up."""
    served = None if key is None else _served.get(key)
    if served is not None:
        entry, places = served
        captured = tuple([captured_inputs[i] for i in places])
        found = run_backward(_GradInfo(entry, entry, call.plan, captured, needing), call)
        if found is not None:  # params that do not broadcast: the lookup says why
            return found
    xs = list(call.xs)
    spec = optree.tree_structure(xs)
    lookup = serving_lookup(combine, spec, xs, None, None, gradients=True)
    if lookup is None:
        return None
    holder, aliases, captured = lookup
    element = element_shape(xs, 0)
    build = BuildCall(combine, spec, tuple([x.dtype for x in xs]), element, captured)
    numel = math.prod(xs[0].shape)
    entry = ready_entry(holder, aliases, build, numel, backward=True, param_grads=bool(needing))
    if entry is None:
        return None
    where = {id(t): i for i, t in enumerate(captured_inputs)}
    if key is not None and all(id(t) in where for t in captured):
        _served.put(key, (entry, tuple([where[id(t)] for t in captured])))
    return run_backward(_GradInfo(entry, entry, call.plan, captured, needing), call)


BACKWARD = torch.ops.fscan.kernel_scan_hop_backward.default

# The same backward without a custom_op's Python autograd wrapper (~15 µs a call), for the
# backward graphs Inductor lowers, which no autograd runs through (as traced_kernel's RUN).
_LIBRARY = torch.library.Library("fscan", "FRAGMENT")
_LIBRARY.define(
    "kernel_scan_backward_run(str key, Tensor[] xs, Tensor[] ys, Tensor[] grads, "
    "Tensor[] tensors, SymInt[] numbers, bool[] needs) -> Tensor[]",
    tags=(torch.Tag.flexible_layout,),
)


def _kernel_scan_backward_run(
    key: str,
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    grads: list[torch.Tensor],
    tensors: list[torch.Tensor],
    numbers: list[int],
    needs: list[bool],
) -> list[torch.Tensor]:
    return _cotangents(key, xs, ys, grads, tensors, numbers, needs)


_LIBRARY.impl("kernel_scan_backward_run", _kernel_scan_backward_run, "CPU")
torch.library.register_fake("fscan::kernel_scan_backward_run", lib=_LIBRARY)(_fake_backward)
BACKWARD_RUN = torch.ops.fscan.kernel_scan_backward_run.default


def _lower_backward(*args: Any) -> Any:
    """``fscan::kernel_scan_hop_backward`` in a graph Inductor lowers: BACKWARD_RUN."""
    from torch._inductor.lowering import fallback_handler  # Inductor: only where it lowers

    key, xs, ys, grads, tensors, numbers, needs = args
    lists = (list(xs), list(ys), list(grads), list(tensors))
    return fallback_handler(BACKWARD_RUN, add_to_fallback_set=False)(key, *lists, numbers, needs)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    key, xs, tensors, numbers = inputs
    ctx.key, ctx.numbers, ctx.n = key, numbers, len(xs)
    ctx.needs = [t.requires_grad for t in tensors]
    ctx.save_for_backward(*xs, *tensors, *output)


def _backward(ctx: Any, grads: list[torch.Tensor]) -> tuple[Any, ...]:
    saved, n = ctx.saved_tensors, ctx.n
    xs, tensors, ys = saved[:n], saved[n:-n], saved[-n:]
    bars = _kernel_scan_hop_backward(
        ctx.key, list(xs), list(ys), list(grads), list(tensors), ctx.numbers, ctx.needs
    )
    return None, bars[:n], bars[n:], [None] * len(ctx.numbers)


torch.library.register_autograd("fscan::kernel_scan_hop", _backward, setup_context=_setup_context)


def install_autograd() -> bool:
    """Give torch's scan op the autograd rule of the module doc for CPU leaves, once; True."""
    global _installed
    if _installed:
        return True
    original = associative_scan_op.py_kernels[DispatchKey.Autograd]

    def autograd_rule(combine_fn: Any, xs: Sequence[Any], additional_inputs: Sequence[Any]) -> Any:
        # A traced combine graph (eager calls of the op with a function keep torch's rule).
        if xs[0].device.type != "cpu" or not isinstance(combine_fn, torch.fx.GraphModule):
            return original(combine_fn, xs, additional_inputs)
        is_tensor = lambda value: isinstance(value, torch.Tensor)
        key, tensors, numbers = registered(combine_fn, len(xs), additional_inputs, is_tensor)
        return tuple(OP(key, list(xs), tensors, numbers))

    # Inductor: imported here, as the lowering, only once graphs are traced for it.
    from torch._inductor import lowering

    lowering.lowerings[BACKWARD] = _lower_backward
    call_directly(BACKWARD_RUN, __name__, _cotangents.__name__)
    associative_scan_op.py_kernels[DispatchKey.Autograd] = autograd_rule
    associative_scan_op._dispatch_cache.clear()
    _installed = True
    return True
