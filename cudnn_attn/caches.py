"""The one cache type of the package: a bounded, locked LRU that registers itself by name.

Every cache (plans, declines, graphs, compiled kernels, device tables, memoized pure functions)
is an ``LRU`` or goes through ``memoize``, so ``clear_caches()`` empties them all and
``cache_sizes()`` shows where state lives.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

__all__ = ["LRU", "memoize", "clear_caches", "cache_sizes"]

# Every live LRU (two instances may share a name; both are reached).
_REGISTRY: "weakref.WeakSet[LRU]" = weakref.WeakSet()
_MISSING = object()


class LRU:
    """A thread-safe least-recently-used map of at most ``maxsize`` entries (``None``: unbounded).

    ``get`` refreshes an entry; ``put`` inserts and evicts the oldest. ``get_or_create`` runs the
    factory outside the lock, so a slow build never blocks lookups of other keys (two threads
    missing the same key may both build; the first result is kept).
    """

    def __init__(self, name: str, maxsize: int | None = 128):
        if maxsize is not None and maxsize < 1:
            raise ValueError(f"maxsize must be None or >= 1, got {maxsize!r}")
        self.name = name
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        _REGISTRY.add(self)

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            value = self._data.get(key, _MISSING)
            if value is _MISSING:
                self.misses += 1
                return default
            self.hits += 1
            self._data.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> Any:
        """Insert ``value`` unless ``key`` is present; return the value now stored."""
        with self._lock:
            stored = self._data.setdefault(key, value)
            self._data.move_to_end(key)
            if self.maxsize is not None:
                while len(self._data) > self.maxsize:
                    self._data.popitem(last=False)
            return stored

    def get_or_create(self, key: Hashable, factory: Callable[[], Any]) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            value = self.put(key, factory())
        return value

    def pop(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            return self._data.pop(key, default)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.hits = self.misses = 0

    def resize(self, maxsize: int | None) -> None:
        if maxsize is not None and maxsize < 1:
            raise ValueError(f"maxsize must be None or >= 1, got {maxsize!r}")
        with self._lock:
            self.maxsize = maxsize
            while maxsize is not None and len(self._data) > maxsize:
                self._data.popitem(last=False)

    def keys(self) -> list:
        with self._lock:
            return list(self._data)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def __repr__(self) -> str:
        return f"LRU({self.name!r}, {len(self)}/{self.maxsize})"


def memoize(name: str, maxsize: int | None = None):
    """Decorator: cache a pure function's results (hashable arguments) in a registered ``LRU``."""
    def wrap(fn: Callable) -> Callable:
        cache = LRU(name, maxsize)

        @functools.wraps(fn)
        def cached(*args, **kwargs):
            key = (args, tuple(sorted(kwargs.items()))) if kwargs else args
            return cache.get_or_create(key, lambda: fn(*args, **kwargs))

        cached.cache = cache
        cached.cache_clear = cache.clear
        return cached
    return wrap


def clear_caches() -> None:
    """Empty every registered cache: plans, declines, graphs, compiled kernels, tables."""
    for cache in list(_REGISTRY):
        cache.clear()


def cache_sizes() -> dict[str, int]:
    """Entries per registered cache, by name (instances sharing a name are added up)."""
    sizes: dict[str, int] = {}
    for cache in list(_REGISTRY):
        sizes[cache.name] = sizes.get(cache.name, 0) + len(cache)
    return dict(sorted(sizes.items()))
