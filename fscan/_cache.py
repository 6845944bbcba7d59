"""Bounded, thread-safe caches keyed by what a function *is*, not by which object it is.

A ``combine_fn`` is often a lambda or closure created afresh on every call (inside
a training step). Keying a per-function cache (validation verdicts, traced
graphs, compiled kernels) by the function object would miss every time and
either grow without bound or, with weak references, redo the work on every call.
So :func:`function_key` keys a function by its *code object* plus the *kinds* of
the values it captures (closure cells, defaults): every lambda made by one
``lambda`` expression shares one key as long as it captures the same kinds of
values, while the key holds no reference to the function, its closure or any
captured tensor. :class:`BoundedCache` then bounds how many keys are kept
(entries not used lately go first) and is safe to use from several threads.

"Kind" means: tensors by type, dtype, device and number of dims (not values or
sizes); ``bool``, ``None``, ``str``, enums, dtypes and devices by value; ints,
floats and complex numbers by type only (a captured step counter or learning
rate must not make every call a miss); classes by identity; captured functions
recursively, other callables (modules, ops) by identity through a weak
reference; any other object by type. A cache whose entries depend on more than that (say a graph
that bakes in a captured float) adds it to its own key.

Example:
    >>> import torch
    >>> cache = BoundedCache(maxsize=128)
    >>> def verdict(fn):
    ...     return cache.get_or_compute(function_key(fn), lambda: fn(torch.ones(2)).sum().item())
    >>> w = torch.ones(2)
    >>> [verdict(lambda x: x * w + k) for k in range(3)]  # computed once, then cached
    [2.0, 2.0, 2.0]
    >>> len(cache)
    1
"""

from __future__ import annotations

import enum
import functools
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import torch

from ._errors import ScanValueError

__all__ = ["BoundedCache", "function_key", "leaf_signature", "value_kind"]

V = TypeVar("V")
_MISSING: Any = object()
# How deep to follow functions captured by functions (and containers in containers);
# deeper ones are keyed by type, which also stops cycles of mutually captured closures.
_MAX_DEPTH = 3
_MAX_CONTAINER = 8
_BY_VALUE = (bool, str, type(None), enum.Enum, torch.dtype, torch.device)
_BY_TYPE = (int, float, complex)


class BoundedCache(Generic[V]):
    """A thread-safe mapping holding at most ``maxsize`` entries.

    Eviction approximates least-recently-used with the CLOCK ("second chance")
    rule: a hit only sets a flag on its entry, and when the cache is full the
    oldest entry goes unless it was hit since it last came round, in which case
    it moves to the back. So a hit is one lock-free dictionary lookup (atomic in
    CPython), which matters on the scan's hot path; writes take a lock.

    Values are computed outside the lock, so a slow or re-entrant ``compute``
    (one that scans, and so consults this cache again) never blocks other threads
    or deadlocks; two threads missing the same key at once may both compute it,
    and the first result stored wins.

    Example:
        >>> cache = BoundedCache(maxsize=2)
        >>> cache.put("a", 1); cache.put("b", 2)
        >>> cache.get("a")  # a hit: "a" gets a second chance
        1
        >>> cache.put("c", 3)  # full: "b" goes, not "a"
        >>> cache.get("b") is None, cache.get("a"), cache.get("c"), len(cache)
        (True, 1, 3, 2)
    """

    def __init__(self, maxsize: int = 1024) -> None:
        if maxsize < 1:
            raise ScanValueError(f"BoundedCache: `maxsize` must be >= 1, got {maxsize}.")
        self.maxsize = maxsize
        # key -> [value, hit since last eviction round]
        self._data: OrderedDict[Hashable, list[Any]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value stored for ``key``, else ``default``."""
        entry = self._data.get(key)
        if entry is None:
            return default
        entry[1] = True
        return entry[0]

    def put(self, key: Hashable, value: V) -> None:
        """Store ``value`` for ``key``, evicting an entry not hit lately when full."""
        with self._lock:
            self._store(key, value)

    def get_or_compute(self, key: Hashable, compute: Callable[[], V]) -> V:
        """The value for ``key``, calling ``compute()`` (unlocked) and storing it on a miss."""
        value = self.get(key, _MISSING)
        if value is not _MISSING:
            return value
        value = compute()
        with self._lock:
            # Another thread may have stored it meanwhile: keep the first, like a setdefault.
            entry = self._data.get(key)
            if entry is not None:
                return entry[0]
            self._store(key, value)
        return value

    def _store(self, key: Hashable, value: V) -> None:
        self._data[key] = [value, False]
        # Terminates: each round evicts, or moves an entry back clearing its flag.
        while len(self._data) > self.maxsize:
            oldest, entry = self._data.popitem(last=False)
            if oldest == key or entry[1]:  # never evict what was just stored
                entry[1] = False
                self._data[oldest] = entry

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __repr__(self) -> str:
        return f"BoundedCache({len(self)}/{self.maxsize} entries)"


def function_key(fn: Callable[..., Any], _depth: int = 0) -> Hashable:
    """A hashable key for ``fn`` that is equal for functions of the same code and
    captured kinds, and holds no strong reference to ``fn`` or what it captures.

    Example:
        >>> make = lambda k: (lambda a, b: a + b * k)
        >>> function_key(make(1)) == function_key(make(2))  # same code, both ints
        True
        >>> function_key(make(1)) == function_key(make("1"))  # a str is keyed by value
        False
    """
    if isinstance(fn, types.FunctionType):
        return _python_function_key(fn, _depth)
    if isinstance(fn, types.MethodType):
        return (types.MethodType, function_key(fn.__func__, _depth + 1), value_kind(fn.__self__))
    if isinstance(fn, functools.partial):
        return (
            functools.partial,
            function_key(fn.func, _depth + 1),
            _kinds(fn.args, _depth + 1),
            tuple(sorted((k, value_kind(v, _depth + 1)) for k, v in fn.keywords.items())),
        )
    if isinstance(fn, types.BuiltinFunctionType):
        owner = fn.__self__
        if owner is None or isinstance(owner, (types.ModuleType, type)):
            return fn  # a builtin such as torch.add: lives as long as its module or class
        # A bound builtin such as `tensor.add` would keep its tensor alive.
        return (types.BuiltinFunctionType, fn.__name__, value_kind(owner, _depth + 1))
    return _object_key(fn)


def _python_function_key(fn: types.FunctionType, depth: int) -> Hashable:
    closure, defaults, kwdefaults = fn.__closure__, fn.__defaults__, fn.__kwdefaults__
    if closure is None and defaults is None and kwdefaults is None:
        return fn.__code__  # the hot case: one attribute read
    cells = tuple(_cell_kind(cell, depth) for cell in closure) if closure else ()
    kw = sorted((k, value_kind(v, depth + 1)) for k, v in (kwdefaults or {}).items())
    return (fn.__code__, cells, _kinds(defaults or (), depth + 1), tuple(kw))


def _cell_kind(cell: Any, depth: int) -> Hashable:
    try:
        contents = cell.cell_contents
    except ValueError:  # a cell not yet bound (e.g. a closure over a later assignment)
        return "<empty cell>"
    return value_kind(contents, depth + 1)


def _kinds(values: Sequence[Any], depth: int) -> tuple[Hashable, ...]:
    return tuple(value_kind(v, depth) for v in values)


def value_kind(value: Any, _depth: int = 0) -> Hashable:
    """The part of a captured ``value`` that a function's key depends on (see module doc).

    Example:
        >>> value_kind(torch.ones(2, 3))
        (<class 'torch.Tensor'>, torch.float32, device(type='cpu'), 2)
        >>> value_kind(0.5), value_kind("max")
        (<class 'float'>, (<class 'str'>, 'max'))
    """
    if isinstance(value, torch.Tensor):
        return (type(value), value.dtype, value.device, value.ndim)
    if isinstance(value, _BY_VALUE):
        return (type(value), value)
    if isinstance(value, _BY_TYPE):
        return type(value)
    if _depth >= _MAX_DEPTH:
        return type(value)
    if isinstance(value, (tuple, list)):
        if len(value) > _MAX_CONTAINER:
            return (type(value), len(value))
        return (type(value), _kinds(value, _depth + 1))
    if isinstance(value, type):
        return value
    if callable(value):
        return function_key(value, _depth + 1)
    return type(value)


def _object_key(fn: Any) -> Hashable:
    """Any other callable (a module, an op overload, an object with ``__call__``): by
    identity, through a weak reference where possible so the cache does not keep it alive.

    A dead weak reference compares equal only to itself, so a new object that
    reuses a dead one's address gets a fresh entry.
    """
    try:
        hash(fn)
    except TypeError:
        return type(fn)
    try:
        ref = weakref.ref(fn)
    except TypeError:  # not weak-referenceable: hashable objects of this sort are long-lived
        return (type(fn), fn)
    hash(ref)  # computed now, while alive: a weak reference remembers it after its object dies
    return (type(fn), ref)


def leaf_signature(leaves: Sequence[torch.Tensor]) -> tuple[Hashable, ...]:
    """Dtype, device and number of dims of each leaf: the leaf metadata part of a key.

    Sizes are left out on purpose, so a scan over batches of varying length
    does not miss the cache; add them to the key where an entry depends on them.

    Example:
        >>> leaf_signature([torch.ones(4, 2), torch.zeros(4, dtype=torch.int64)])
        (torch.float32, device(type='cpu'), 2, torch.int64, device(type='cpu'), 1)
    """
    signature: list[Hashable] = []
    for leaf in leaves:
        signature += (leaf.dtype, leaf.device, leaf.ndim)
    return tuple(signature)
