"""The repeat routes' key: when a call is identical, in everything a route's verdict
depends on, to one the router already served on the C++ kernel.

The repeat routes (:mod:`fscan._routing.repeat` for ``fscan.associative_scan``,
:mod:`fscan._routing.repeat_drop_ins` for the drop-ins, :mod:`fscan._routing.reduce`'s for
``fscan.associative_reduce``) store what the kernel ran under this key and answer an
identical later call with it, before the checks. The key holds everything the full
path's verdict depends on:

* ``combine_fn``: its :func:`~fscan._knowledge.store.reach` key (its code and the
  values it captures, each captured tensor's type, dtype, device, ndim and
  requires_grad) and which captured places share a tensor; the captured tensors
  themselves are read on every call, as the kernel's parameters;
* the pytree structure, and per leaf its dtype, shape and requires_grad; ``dim``
  (made non-negative), ``reverse``, ``combine_mode``, ``validate``;
* grad mode, ``fscan.config.validate`` (``fscan.config.cpu_kernel`` "off": no lookup).

And a call is only looked up (or stored) where the full path cannot differ for
reasons outside the key: not while tracing, no ``torch.func`` transform or dual
level, no ``TorchDispatchMode``, every leaf a plain contiguous dense CPU tensor
without the negative bit, ``dim`` an int in range and ``reverse`` a bool (``0``
equals ``False`` in a key but is an error), ``validate`` None or False; a leaf that
requires grad in grad mode only where the caller serves gradients (``grads=True``:
the scan's grad route). (``reset=``/``initial=`` are the callers' to refuse, or to key.)

:func:`call_parts` is the key but for ``combine_fn``'s part, :func:`memo_reach` that
part (``reach``, remembered where it cannot change), :func:`stored_run` the lookup of
both, :func:`mask_kind` the part a ``reset=`` mask adds.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from optree import PyTreeSpec

from .._config import config
from .._knowledge.reach_keys import code_names, unbound
from .._knowledge.store import Reach, on_clear, reach
from .._pytree import LEAF, flatten

__all__ = ["ONE_LEAF", "call_parts", "lone_parts", "mask_kind", "memo_reach", "stored_run"]

_is_compiling = torch.compiler.is_compiling
_STRIDED = torch.strided
# reach() of module builtins (torch.add): keyed by identity, capturing nothing, so one
# walk serves every call (the walk itself costs ~3 µs, a fifth of a small scan).
_builtin_reach: dict[Any, Reach] = {}
# reach() of functions that reach nothing but their code (see memo_reach): (code, module) -> Reach.
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
    grads: bool = False,
) -> tuple[Any, list[torch.Tensor], Any, Reach] | None:
    """The run ``table`` stored for a call with this one's key (module doc), with the
    call's leaves, their spec and ``combine_fn``'s reach; None where there is none (the
    scan's and the reduce's repeat routes share it; ``grads`` as for :func:`call_parts`)."""
    if type(xs) is torch.Tensor:
        leaves, spec = [xs], LEAF
    else:
        leaves, spec = flatten(xs)
    parts = call_parts(spec, leaves, dim, reverse, combine_mode, validate, grads)
    if parts is None:
        return None
    found = memo_reach(combine_fn)
    key, tensors, aliases = found
    if key is None or (tensors and aliases is None):
        return None
    run = table.get((key, aliases, *parts))
    return None if run is None else (run, leaves, spec, found)


def call_parts(
    spec: PyTreeSpec,
    leaves: Sequence[Any],
    dim: Any,
    reverse: Any,
    combine_mode: Any,
    validate: Any,
    grads: bool = False,
) -> tuple[Hashable, ...] | None:
    """The key of a call (module doc) but for ``combine_fn``'s part, or None where the call
    may not be repeated (cheapest tests first: a call that fails them pays no walk).
    ``grads``: the caller serves calls that want gradients (a leaf requiring grad in grad
    mode; its requires_grad and grad mode are in the key either way)."""
    if len(leaves) == 1:  # one leaf: its own function, the small call's (see lone_parts)
        # A lone tensor's structure keyed by a token: optree hashes a PyTreeSpec afresh on
        # every lookup (~0.7 µs of a 64-element scan); the token equals no spec, so a key
        # holding it fits exactly the calls whose structure is LEAF (a lone plain tensor).
        tree = ONE_LEAF if spec is LEAF else spec
        return lone_parts(tree, leaves[0], dim, reverse, combine_mode, validate, grads)
    if not leaves or not _repeatable(dim, reverse, combine_mode, validate):
        return None
    ndim = leaves[0].ndim
    if not -ndim <= dim < ndim:
        return None
    grad = torch.is_grad_enabled()
    refused = grad and not grads  # a leaf requiring grad: only where gradients are served
    for x in leaves:  # a loop, not a generator: ~0.5 µs less per call
        if (
            type(x) is not torch.Tensor
            or not x.is_cpu
            or x.layout is not _STRIDED
            or x.is_nested
            or not x.is_contiguous()
            or x.is_neg()
            or (refused and x.requires_grad)
            or _is_wrapped(x)
            or _is_batched(x)
        ):
            return None
    kinds = [(x.dtype, x.shape, x.requires_grad) for x in leaves]
    return (spec, dim % ndim, reverse, validate, config._validate, grad, *kinds)


def lone_parts(
    tree: Hashable,
    x: Any,
    dim: Any,
    reverse: Any,
    combine_mode: Any,
    validate: Any,
    grads: bool = False,
) -> tuple[Hashable, ...] | None:
    """:func:`call_parts` of a call with one leaf ``x`` whose structure ``tree`` stands for
    (:data:`ONE_LEAF` for a lone tensor): the same tests and the same key, written out in
    one function (no list, no generator, no helper calls: each Python call costs ~0.1 µs of
    a 6 µs scan of 64 elements), so the repeat route of a lone tensor asks it directly.
    Keep the two in step (test_repeat_route checks they give one key)."""
    if type(dim) is not int or (reverse is not False and reverse is not True):
        return None
    if (validate is not None and validate is not False) or combine_mode != "pointwise":
        return None
    if config._cpu_kernel == "off" or _is_compiling():
        return None  # ("on" and "eager" serve a READY kernel alike)
    # under_transform() or under_dispatch_mode() (fscan._context), asked inline: the two
    # calls cost ~0.3 µs of a 7 µs scan of 64 elements (test_repeat_route checks they agree)
    if _peek_transform() is not None or _forward_ad._current_level >= 0 or _dispatch_modes():
        return None
    if type(x) is not torch.Tensor:
        return None
    ndim = x.ndim
    if not -ndim <= dim < ndim:
        return None
    grad = torch.is_grad_enabled()
    wants = x.requires_grad
    if (
        not x.is_cpu
        or x.layout is not _STRIDED
        or x.is_nested
        or not x.is_contiguous()
        or x.is_neg()
        or (wants and grad and not grads)  # requiring grad: only where gradients are served
        or _is_wrapped(x)
        or _is_batched(x)
    ):
        return None
    # Its kind (dtype, shape, requires_grad) unnested: the tuple cost ~0.1 µs a call.
    return (tree, dim % ndim, reverse, validate, config._validate, grad, x.dtype, x.shape, wants)


def _repeatable(dim: Any, reverse: Any, combine_mode: Any, validate: Any) -> bool:
    """:func:`call_parts`'s tests of the arguments and of the context (not of the leaves)."""
    if type(dim) is not int or (reverse is not False and reverse is not True):
        return False
    if (validate is not None and validate is not False) or combine_mode != "pointwise":
        return False
    if config._cpu_kernel == "off" or _is_compiling():
        return False  # ("on" and "eager" serve a READY kernel alike)
    return not (
        _peek_transform() is not None or _forward_ad._current_level >= 0 or _dispatch_modes()
    )


ONE_LEAF = "<one leaf>"  # the structure part of a lone tensor's key (call_parts)


# fscan._context's questions (see call_parts), bound once.
_peek_transform = torch._C._functorch.peek_interpreter_stack
_forward_ad = torch.autograd.forward_ad  # its _current_level: -1 outside a dual level
_dispatch_modes = torch._C._len_torch_dispatch_stack

# A torch.func wrapper (or the old vmap's batched tensor) that escaped its transform:
# its storage is not its data (fscan._knowledge.purity.probeable refuses it too).
_is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_is_batched = torch._C._functorch.is_legacy_batchedtensor


_FUNCTION, _BUILTIN = types.FunctionType, types.BuiltinFunctionType


def memo_reach(combine_fn: Any) -> Reach:
    """:func:`~fscan._knowledge.store.reach`, remembered for builtins of modules and for
    functions that reach nothing (module doc of :mod:`fscan._knowledge.reach`)."""
    kind = type(combine_fn)
    if kind is _FUNCTION:
        # No cells, defaults or names loaded (``lambda a, b: a + b``): nothing the walk
        # follows, so its reach is a function of the code and of whether the module is a
        # library's (which keys it by identity instead), and the memo is keyed on both.
        # What makes a function qualify is read on every call (``__closure__`` and the
        # rest can be reassigned), but for the names its code loads (code_names, the
        # walk's own cached reading of the code): only codes that load none are stored,
        # and a code object cannot change, so a hit needs no code_names (~0.1 µs a call).
        if (
            combine_fn.__closure__ is None
            and combine_fn.__defaults__ is None
            and not combine_fn.__kwdefaults__
        ):
            code = combine_fn.__code__
            memo = (code, combine_fn.__module__)
            found = _closed_reach.get(memo)
            if found is not None:
                return found
            found = reach(combine_fn)
            # the walk's own key for such a function: keep it
            if not code_names(code) and found.key is code:
                if len(_closed_reach) >= 64:
                    _closed_reach.clear()
                _closed_reach[memo] = found
            return found
        return reach(combine_fn)
    if kind is _BUILTIN:
        found = _builtin_reach.get(combine_fn)  # only unbound builtins are ever stored
        if found is not None:
            return found
        found = reach(combine_fn)
        if unbound(combine_fn) and not found.tensors:
            if len(_builtin_reach) >= 64:
                _builtin_reach.clear()
            _builtin_reach[combine_fn] = found
        return found
    return reach(combine_fn)


def mask_kind(reset: torch.Tensor) -> tuple[Hashable, ...] | None:
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
