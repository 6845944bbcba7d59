"""How single values that a ``combine_fn`` reaches enter its key (the leaves of the walk).

:mod:`fscan._knowledge.reach` walks what a ``combine_fn`` can reach; this module holds
what that walk and its fast path for plain closures share: which values are
library code (keyed by identity, never entered), which are plain scalars,
how a tensor, an identity or an opaque object is keyed, and the names a code
object loads. :class:`Uncacheable` is raised where a value cannot be keyed
safely; the walk then gives up keying (the call still runs, uncached).

Example:
    >>> import torch
    >>> tensor_kind(torch.ones(2, 3))
    (<class 'torch.Tensor'>, torch.float32, device(type='cpu'), 2, False)
    >>> is_library(torch.add), code_names((lambda a, b: torch.add(a, b)).__code__)
    (True, ('torch', 'add'))
"""

from __future__ import annotations

import enum
import functools
import sys
import types
import weakref
from collections.abc import Hashable
from typing import Any

import torch

__all__ = [
    "BUILTIN_CALLABLES",
    "LIBRARIES",
    "SCALARS",
    "Uncacheable",
    "cell_contents",
    "code_names",
    "identity_key",
    "is_library",
    "opaque_key",
    "tensor_kind",
    "unbound",
]

# How many code objects' loaded names are remembered (as many as knowledge entries).
CODE_ENTRIES = 1024

SCALARS = (bool, int, float, complex, str, bytes, type(None), enum.Enum, torch.dtype)
SCALARS += (torch.device, torch.Size, slice, type(Ellipsis), torch.layout, torch.memory_format)
# Top-level packages whose modules, classes and functions are library code: keyed
# by identity and never entered (their state is not what a combine_fn varies).
LIBRARIES = frozenset({"torch", "numpy", "optree", "jax", "functorch", "einops"})
LIBRARIES |= frozenset(sys.stdlib_module_names)
BUILTIN_CALLABLES = (
    types.BuiltinFunctionType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.MethodDescriptorType,
    torch._ops.OpOverload,
    torch._ops.OpOverloadPacket,
)


class Uncacheable(Exception):
    """Raised inside the walk when something reached cannot be keyed safely."""


def unbound(fn: types.BuiltinFunctionType) -> bool:
    """A builtin function of a module or class (``torch.add``), not one bound to an object."""
    owner = fn.__self__
    return owner is None or isinstance(owner, (types.ModuleType, type))


def tensor_kind(t: torch.Tensor) -> Hashable:
    """A tensor's part of a key: its type, dtype, device, ndim and requires_grad."""
    return (type(t), t.dtype, t.device, t.ndim, t.requires_grad)


def cell_contents(cell: Any) -> Any:
    """What a closure cell holds, or a marker for a cell not yet bound."""
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet bound (a closure over a later assignment)
        return "<empty cell>"


def is_library(value: Any) -> bool:
    """Whether ``value`` (a module, class, function or object) belongs to library code."""
    if isinstance(value, types.ModuleType):
        name = value.__name__
    elif isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        name = getattr(value, "__module__", None) or ""
    else:
        name = type(value).__module__ or ""
    return name.partition(".")[0] in LIBRARIES


def identity_key(value: Any) -> Hashable:
    """Key by identity through a weak reference where possible, so the cache keeps nothing alive.

    A dead weak reference compares equal only to itself, so a new object at a
    dead one's address gets a fresh entry.
    """
    try:
        ref = weakref.ref(value)
        hash(ref)  # computed while alive: a weak reference remembers it
        return (type(value), ref)
    except TypeError:
        pass
    try:
        hash(value)
    except TypeError:
        raise Uncacheable from None
    return (type(value), value)


def opaque_key(value: Any) -> Hashable:
    """An object without ``__dict__`` whose state fscan cannot read: hashable by value
    (a NumPy scalar, a frozen C type) or uncacheable."""
    try:
        hash(value)
    except TypeError:
        raise Uncacheable from None
    if type(value).__hash__ is object.__hash__:  # hashed by identity: its state is unknown
        raise Uncacheable
    return (type(value), value)


@functools.lru_cache(maxsize=CODE_ENTRIES)
def code_names(code: types.CodeType) -> tuple[str, ...]:
    """Names a code object (and the code nested in it) loads: globals and attributes."""
    nested = (c for c in code.co_consts if isinstance(c, types.CodeType))
    return tuple(dict.fromkeys([*code.co_names, *(n for c in nested for n in code_names(c))]))
