"""The one cache type of the package: a bounded, locked LRU that registers itself by name.

Every cache (plans, declines, graphs, compiled kernels, device tables, memoized pure functions)
is an ``LRU`` or goes through ``memoize``, so ``clear_caches()`` empties them all and
``cache_sizes()`` shows where state lives.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Hashable

__all__ = ["LRU", "memoize", "clear_caches", "cache_sizes", "user_path"]

# Every live LRU (two instances may share a name; both are reached).
_REGISTRY: "weakref.WeakSet[LRU]" = weakref.WeakSet()
_MISSING = object()


class LRU:
    """A thread-safe least-recently-used map of at most ``maxsize`` entries (``None``: unbounded).

    ``get`` refreshes an entry; ``put`` inserts and evicts the least recently used. Entries are
    kept in use order (an ``OrderedDict``): a hit is a lookup and a move to the end (no lock:
    the per-call hot path), and an insertion into a full cache drops the first entry, O(1)
    either way, so a workload that inserts on every call (a decode loop whose key length grows
    by one per step) pays no more than one that hits. ``get_or_create`` runs the factory
    outside the lock, so a slow build never blocks lookups of other keys (two threads missing
    the same key may both build; the first result is kept).
    """

    def __init__(self, name: str, maxsize: int | None = 128):
        _check_maxsize(maxsize)
        self.name = name
        self.maxsize = maxsize
        self._data: OrderedDict = OrderedDict()  # key -> value, least recently used first
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        _REGISTRY.add(self)

    def get(self, key: Hashable, default: Any = None) -> Any:
        value = self._data.get(key, _MISSING)
        if value is _MISSING:
            self.misses += 1
            return default
        self.hits += 1
        try:
            self._data.move_to_end(key)
        except KeyError:  # evicted by another thread since the lookup: the value stands
            pass
        return value

    def put(self, key: Hashable, value: Any) -> Any:
        """Insert ``value`` unless ``key`` is present; return the value now stored."""
        with self._lock:
            found = self._data.get(key, _MISSING)
            if found is _MISSING:
                self._data[key] = found = value
                self._evict_to(self.maxsize)
            else:
                self._data.move_to_end(key)
            return found

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
        _check_maxsize(maxsize)
        with self._lock:
            self.maxsize = maxsize
            self._evict_to(maxsize)

    def _evict_to(self, maxsize: int | None) -> None:
        """Drop the least recently used entries beyond ``maxsize`` (caller holds the lock)."""
        if maxsize is not None:
            while len(self._data) > maxsize:
                self._data.popitem(last=False)

    def keys(self) -> list:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"LRU({self.name!r}, {len(self)}/{self.maxsize})"


def _check_maxsize(maxsize) -> None:
    if maxsize is not None and (isinstance(maxsize, bool) or not isinstance(maxsize, int)
                                or maxsize < 1):
        raise ValueError(f"maxsize must be None or an int >= 1, got {maxsize!r}")


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


def clear_caches(*names: str) -> None:
    """Empty every registered cache: plans, declines, graphs, compiled kernels, tables; or, given
    ``names`` (as ``cache_sizes()`` lists them, e.g. ``"api.calls"``), only the caches so named."""
    for cache in list(_REGISTRY):
        if not names or cache.name in names:
            cache.clear()


def cache_sizes() -> dict[str, int]:
    """Entries per registered cache, by name (instances sharing a name are added up)."""
    sizes: dict[str, int] = {}
    for cache in list(_REGISTRY):
        sizes[cache.name] = sizes.get(cache.name, 0) + len(cache)
    return dict(sorted(sizes.items()))


def user_path(override_env: str, xdg_env: str, home_default: str, *parts: str):
    """Where a per-user file of ours lives: ``$override_env`` if set, else
    ``$xdg_env/cudnn_attn/<parts>`` with ``~/<home_default>`` when ``xdg_env`` is unset (the XDG
    base-directory rule: ``XDG_CACHE_HOME``/``.cache``, ``XDG_CONFIG_HOME``/``.config``)."""
    explicit = os.environ.get(override_env)
    if explicit:
        return Path(explicit)
    base = os.environ.get(xdg_env) or os.path.join(os.path.expanduser("~"), home_default)
    return Path(base, "cudnn_attn", *parts)
