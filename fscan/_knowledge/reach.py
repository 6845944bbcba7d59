"""What a ``combine_fn`` reaches without being passed it: its key and the tensors it closes over.

A scan's first call checks its ``combine_fn`` (purity, elementwise ops in
pointwise mode, whether the pointwise adjoint serves its gradients) and
compiles kernels for it. Those verdicts are worth caching (in
:mod:`fscan._knowledge.store`), because a ``combine_fn`` is often a lambda made afresh
on every training step, but a verdict may only be reused for a call it provably
fits. So one walk over what ``combine_fn`` can reach without being passed it
produces both

* the tensors it closes over (autograd must route gradients to them), and
* a key covering everything a verdict can depend on.

The walk follows closure cells, defaults, ``functools.partial`` arguments,
bound ``self``, ``nn.Module`` parameters, buffers and submodules, the globals
its code (and the code of functions it reaches) names, and the attributes of
classes, modules and objects that the code names (``H.w``, ``cfg.flag``).
What it reaches enters the key as:

=======================================  ==========================================
value                                    in the key
=======================================  ==========================================
code objects, builtins, classes          identity
``bool``/``int``/``float``/``str``/enum  type and value (``mk(0)`` and ``mk(1)``
                                         differ)
tensors                                  type, dtype, device, ndim, requires_grad
functions, partials, bound methods       their code and what they reach, recursively
``nn.Module``                            identity (weakly) and ``training``, plus
                                         its tensors and attributes
library modules (torch, math, ...)       identity, not entered
other objects                            type and the attributes reached
=======================================  ==========================================

Anything the walk cannot key safely (too many objects, an object whose state
it cannot read) makes the key ``None``: every verdict is then recomputed on
each call, never cached. How single values are keyed, and what counts as
library code, lives in :mod:`fscan._knowledge.reach_keys`. The leaves enter the key in
:func:`fscan._knowledge.store.knowledge` (pytree structure, mode, and each leaf's
dtype, device, ndim and requires_grad); a verdict that depends on more
(element shapes, ``dim``) keys a dict inside the entry.

Example:
    >>> import torch
    >>> make = lambda k: (lambda a, b: a + b * k)
    >>> reach(make(1)).key == reach(make(1)).key, reach(make(1)).key == reach(make(2)).key
    (True, False)
    >>> w = torch.ones(2, requires_grad=True)
    >>> [t is w for t in reach(lambda a, b: a * w).tensors]
    [True]
"""

from __future__ import annotations

import functools
import types
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from .reach_keys import (
    BUILTIN_CALLABLES,
    LIBRARIES,
    SCALARS,
    Uncacheable,
    cell_contents,
    code_names,
    identity_key,
    is_library,
    opaque_key,
    tensor_kind,
    unbound,
)

__all__ = ["Reach", "reach", "references"]

# How many objects one walk may visit before it gives up keying (the call still
# runs; its verdicts are just not cached).
MAX_VISITS = 2000
# Containers longer than this are not keyed element by element: uncacheable.
MAX_CONTAINER = 64


class Reach(NamedTuple):
    """What a walk over ``combine_fn`` found: its key (None if uncacheable) and tensors.

    ``tensors`` are distinct, in walk order. ``aliases``, where known (the plain walk),
    numbers each place a tensor is reached from by the first of ``tensors`` it holds:
    the pattern of which places share a tensor, for keys that depend on it.
    """

    key: Hashable | None
    tensors: tuple[torch.Tensor, ...]
    aliases: tuple[int, ...] | None = None

    def needing_grad(self) -> list[torch.Tensor]:
        """The captured tensors that require grad, the extra inputs of a custom Function."""
        return [t for t in self.tensors if t.requires_grad]


def reach(fn: Any) -> Reach:
    """Walk what ``fn`` can reach without being passed it (module doc): its key and tensors.

    Example:
        >>> class H:
        ...     w = torch.tensor(2.0)
        >>> [t is H.w for t in reach(lambda a, b: a * b * H.w).tensors]
        [True]
    """
    if type(fn) is types.FunctionType:
        found = _plain_closure(fn)
        if found is not None:
            return found
    walk = _Walk()
    try:
        key = walk.key_of(fn)
    except (Uncacheable, RecursionError):
        key = None
        walk.drain(fn)
    return Reach(key, tuple(walk.tensors.values()))


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLAIN_SCALARS = (int, float, bool, str, type(None))
_ABSENT = object()


def _plain_closure(fn: types.FunctionType) -> Reach | None:
    """The hot case, without a walk: a function that captures only tensors and plain
    scalars and names only library modules, builtins, tensors, scalars and other such
    functions as globals (``lambda a, b: torch.maximum(a, b) * w``); else None.

    Its tensors are distinct (one captured by two cells is one input of autograd), and
    ``aliases`` says which of the places they are reached from hold the same one."""
    occurrences: list[torch.Tensor] = []
    key = _plain_key(fn, occurrences, 0)
    if key is None:
        return None
    if not occurrences:
        return Reach(key, ())
    first: dict[int, int] = {}
    aliases = tuple([first.setdefault(id(t), len(first)) for t in occurrences])
    distinct = tuple({id(t): t for t in occurrences}.values())
    return Reach(key, distinct, aliases)


def _plain_key(fn: types.FunctionType, occurrences: list[torch.Tensor], depth: int) -> Any:
    """``fn``'s key, appending each tensor it reaches (once per place) to ``occurrences``;
    None if ``fn`` is not plain."""
    if fn.__kwdefaults__ or depth > 2:
        return None
    if (fn.__module__ or "").partition(".")[0] in LIBRARIES:  # is_library, inlined
        return None
    code = fn.__code__
    parts: list[Hashable] = []
    for cell in fn.__closure__ or ():
        if not _plain_part(cell_contents(cell), parts, occurrences, depth):
            return None
    for value in fn.__defaults__ or ():
        if not _plain_part(value, parts, occurrences, depth):
            return None
    names = code_names(code)
    if names:
        scope = fn.__globals__
        for name in names:
            value = scope.get(name, _ABSENT)
            if value is _ABSENT:  # an attribute name, or a builtin
                continue
            parts.append(name)
            if type(value) is types.ModuleType and is_library(value):
                parts.append(value)
            elif not _plain_part(value, parts, occurrences, depth):
                return None
    if not parts:
        return code
    return ("plain", code, tuple(parts))


def _plain_part(
    value: Any, parts: list[Hashable], occurrences: list[torch.Tensor], depth: int
) -> bool:
    """Append ``value``'s key part (and tensors) if it is plain; False if it needs a walk."""
    kind = type(value)
    if kind in _PLAIN_TENSORS:
        occurrences.append(value)
        parts.append(tensor_kind(value))
    elif kind in _PLAIN_SCALARS:
        parts.append((kind, value))
    elif kind is types.BuiltinFunctionType and unbound(value):
        parts.append(value)
    elif kind is types.FunctionType:
        inner = _plain_key(value, occurrences, depth + 1)
        if inner is None:
            return False
        parts.append(inner)
    else:
        return False
    return True


class _Walk:
    """One traversal: builds a key and collects tensors, visiting each object once."""

    def __init__(self) -> None:
        self.tensors: dict[int, torch.Tensor] = {}
        self.seen: dict[int, int] = {}
        self.names: set[str] = set()

    def key_of(self, value: Any) -> Hashable:
        if isinstance(value, SCALARS):
            if isinstance(value, (torch.Size, slice)):
                return (type(value), repr(value))
            return (type(value), value)
        if isinstance(value, torch.Tensor):
            self.tensors[id(value)] = value
            return tensor_kind(value)
        if id(value) in self.seen:  # a cycle or a shared object: refer back to it
            return ("<seen>", self.seen[id(value)])
        if len(self.seen) >= MAX_VISITS:
            raise Uncacheable
        self.seen[id(value)] = len(self.seen)
        return self._compound_key(value)

    def _compound_key(self, value: Any) -> Hashable:
        if isinstance(value, types.FunctionType):
            return self._function_key(value)
        if isinstance(value, types.MethodType):
            return (types.MethodType, self.key_of(value.__func__), self.key_of(value.__self__))
        if isinstance(value, functools.partial):
            keywords = tuple(sorted((k, self.key_of(v)) for k, v in value.keywords.items()))
            return (functools.partial, self.key_of(value.func), self._items(value.args), keywords)
        if isinstance(value, (tuple, list, set, frozenset)):
            items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
            return (type(value), self._items(items))
        if isinstance(value, dict):
            if len(value) > MAX_CONTAINER:
                raise Uncacheable
            return (dict, tuple((self.key_of(k), self.key_of(v)) for k, v in value.items()))
        if isinstance(value, types.ModuleType):
            return (value, self._named_attributes(value, vars(value)))
        if isinstance(value, type):
            return (value, self._class_attributes(value))
        if isinstance(value, torch.nn.Module):
            return self._module_key(value)
        if isinstance(value, types.BuiltinFunctionType) and not unbound(value):
            # A bound builtin such as `tensor.add`: key (and collect) what it is bound to.
            return (types.BuiltinFunctionType, value.__name__, self.key_of(value.__self__))
        if isinstance(value, BUILTIN_CALLABLES):
            return identity_key(value)
        if hasattr(value, "__dict__"):
            return self._object_key(value)
        return opaque_key(value)

    def _items(self, values: Sequence[Any]) -> tuple[Hashable, ...]:
        if len(values) > MAX_CONTAINER:
            raise Uncacheable
        return tuple(self.key_of(v) for v in values)

    def _function_key(self, fn: types.FunctionType) -> Hashable:
        code = fn.__code__
        names = code_names(code)
        self.names.update(names)
        cells = tuple(self.key_of(cell_contents(c)) for c in fn.__closure__ or ())
        defaults = self._items(fn.__defaults__ or ())
        kwdefaults = tuple(
            sorted((k, self.key_of(v)) for k, v in (fn.__kwdefaults__ or {}).items())
        )
        if is_library(fn):  # torch's own Python functions: their globals are torch's
            return (code, cells, defaults, kwdefaults)
        scope = fn.__globals__
        globals_ = tuple((n, self.key_of(scope[n])) for n in names if n in scope)
        return (code, cells, defaults, kwdefaults, globals_)

    def _named_attributes(self, owner: Any, namespace: dict[str, Any]) -> Hashable:
        """The attributes of a user module or class that some code reached so far names."""
        if is_library(owner):
            return ()
        return tuple((n, self.key_of(namespace[n])) for n in sorted(self.names) if n in namespace)

    def _class_attributes(self, cls: type) -> Hashable:
        return tuple(
            self._named_attributes(klass, vars(klass))
            for klass in cls.__mro__
            if klass is not object
        )

    def _module_key(self, module: torch.nn.Module) -> Hashable:
        parts: list[Hashable] = [identity_key(module), module.training]
        parts += [self.key_of(t) for t in module.parameters()]
        parts += [self.key_of(t) for t in module.buffers()]
        for sub in module.modules():
            parts.append(self.key_of(type(sub).forward))
            public = {k: v for k, v in vars(sub).items() if not k.startswith("_")}
            parts.append(tuple((k, self.key_of(v)) for k, v in public.items()))
        return tuple(parts)

    def _object_key(self, obj: Any) -> Hashable:
        attrs = vars(obj)
        if len(attrs) > MAX_CONTAINER:
            raise Uncacheable
        state = tuple((k, self.key_of(v)) for k, v in attrs.items())
        call = type(obj).__call__ if callable(obj) else None
        method = self.key_of(call) if isinstance(call, types.FunctionType) else None
        return (type(obj), self._class_attributes(type(obj)), state, method)

    def drain(self, fn: Any) -> None:
        """After giving up on the key: still collect every tensor reachable (uncapped)."""
        todo, seen = [fn], set()
        while todo:
            obj = todo.pop()
            if id(obj) in seen or isinstance(obj, SCALARS):
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                self.tensors[id(obj)] = obj
            else:
                todo.extend(references(obj, self.names))


def references(obj: Any, names: set[str]) -> Iterator[Any]:
    """What ``obj`` holds (for :meth:`_Walk.drain`): the same edges as the key walk."""
    if isinstance(obj, types.FunctionType):
        yield from (cell_contents(c) for c in obj.__closure__ or ())
        yield from obj.__defaults__ or ()
        yield from (obj.__kwdefaults__ or {}).values()
        names.update(code_names(obj.__code__))
        if not is_library(obj):
            yield from (
                obj.__globals__[n] for n in code_names(obj.__code__) if n in obj.__globals__
            )
    elif isinstance(obj, types.MethodType):
        yield from (obj.__func__, obj.__self__)
    elif isinstance(obj, functools.partial):
        yield from (obj.func, *obj.args, *obj.keywords.values())
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
        for sub in obj.modules():
            yield type(sub).forward
            yield from (v for k, v in vars(sub).items() if not k.startswith("_"))
    elif isinstance(obj, (list, tuple, set, frozenset)):
        yield from obj
    elif isinstance(obj, dict):
        yield from obj.values()
    elif isinstance(obj, types.BuiltinFunctionType) and not unbound(obj):
        yield obj.__self__
    elif isinstance(obj, (types.ModuleType, type)):
        if not is_library(obj):
            for klass in obj.__mro__ if isinstance(obj, type) else (obj,):
                yield from (v for n, v in vars(klass).items() if n in names)
    elif hasattr(obj, "__dict__") and not isinstance(obj, BUILTIN_CALLABLES):
        yield from vars(obj).values()
        yield type(obj)
    else:  # __slots__ hold state outside any __dict__
        for klass in type(obj).__mro__:
            for slot in getattr(klass, "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    yield getattr(obj, slot)
