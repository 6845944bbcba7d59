"""A bounded, thread-safe cache: the store behind :mod:`fscan._knowledge.store` and the kernels.

Keys are built elsewhere (:func:`fscan._knowledge.store.reach` keys a ``combine_fn``
on everything a verdict depends on); this module only bounds how many entries
are kept (entries not used lately go first) and makes hits cheap and safe
from several threads.

Example:
    >>> cache = BoundedCache(maxsize=128)
    >>> cache.get_or_compute("key", lambda: 42), cache.get_or_compute("key", lambda: 0)
    (42, 42)
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from ._errors import ScanValueError

__all__ = ["BoundedCache"]

V = TypeVar("V")
_MISSING: Any = object()


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

    def peek(self, key: Hashable, default: Any = None) -> Any:
        """The value stored for ``key``, else ``default``, leaving eviction order alone
        (for reports that must change nothing: ``fscan.explain``)."""
        entry = self._data.get(key)
        return default if entry is None else entry[0]

    def put(self, key: Hashable, value: V) -> None:
        """Store ``value`` for ``key``, evicting an entry not hit lately when full."""
        with self._lock:
            self._store(key, value)

    def get_or_compute(self, key: Hashable, compute: Callable[[], V]) -> V:
        """The value for ``key``, calling ``compute()`` (unlocked) and storing it on a miss."""
        entry = self._data.get(key)  # get(), inlined: this is the scan's hot path
        if entry is not None:
            entry[1] = True
            return entry[0]
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

    def values(self) -> list[Any]:
        """A snapshot of the stored values."""
        return [entry[0] for entry in list(self._data.values())]

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __repr__(self) -> str:
        return f"BoundedCache({len(self)}/{self.maxsize} entries)"
