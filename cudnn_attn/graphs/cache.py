"""GraphCache: the bounded, thread-safe LRU of built graphs, and its on-disk persistence.

Building a cuDNN SDPA plan costs tens to hundreds of milliseconds, so every graph the engine
builds goes through ``graph_cache.get_or_build(key, build_fn)``. Keys are hashable tuples
(``make_key(problem_key, device)`` adds the device and the cuDNN versions); values are whatever
``build_fn`` returns.

Persistence (``save(dir)`` / ``load(dir)``) writes one file per entry whose value can serialize
itself (``serialize() -> bytes`` plus a ``serial_kind`` naming a deserializer registered with
``register_deserializer``). A file is: magic, format version, a JSON header (the environment:
GPU name, compute capability, SM count, cuDNN backend and frontend versions; the deserializer
kind; the key as canonical JSON), the payload and an HMAC-SHA256 of all of it keyed with a
per-user secret kept outside the directory. Nothing is pickled. A corrupt, truncated, foreign or
unkeyed file is logged, counted (``info()["rejected_files"]``) and skipped, so that entry is
rebuilt rather than trusted; ``cache_dir`` holds the trust model (owner and mode checks,
exclusive temporary files, no links or special files). Loaded payloads are deserialized lazily, on the
first lookup of their key.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
import os
from typing import Any, TypeVar

import torch

from ..core.caches import LRU

# Re-exported: the names users of the cache need come from this module.
from .cache_dir import (
    MAX_FILE_BYTES,
    UnsafeCacheDir,
    clear_dir,
    graph_files,
    open_dir,
    open_graph_file,
    secret_key,
    secret_key_path,
    write_graph_file,
)
from .cache_files import (
    FORMAT_VERSION,
    MAGIC,
    SUFFIX,
    Rejected,
    cudnn_versions,
    current_environment,
    decode_file,
    default_cache_dir,
    deserializer,
    encode_file,
    encode_key,
    read_file,
    register_deserializer,
)

__all__ = ["FORMAT_VERSION", "MAGIC", "SUFFIX", "GraphCache", "UnsafeCacheDir", "clear_dir",
           "cudnn_versions", "current_environment", "decode_file", "default_cache_dir",
           "encode_file", "encode_key", "graph_cache", "make_key", "register_deserializer",
           "secret_key", "secret_key_path"]

# What a cache entry's builder returns (and get_or_build hands back).
T = TypeVar("T")

logger = logging.getLogger("cudnn_attn")

_MISSING = object()
_SERIAL = itertools.count()


# --------------------------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------------------------


def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # "cuda" and "cuda:0" must give one key on a one-GPU process.
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        device = torch.device("cuda", index)
    return device


def make_key(problem_key: Hashable, device, versions: tuple | None = None) -> tuple:
    """The cache key of one graph: ``(problem_key, torch.device, (backend, frontend))``.

    ``problem_key`` is the normalized problem (e.g. ``AttnProblem.plan_key`` plus a direction
    tag); ``versions`` defaults to ``cudnn_versions()``.
    """
    try:
        hash(problem_key)
    except TypeError:
        raise TypeError(f"problem_key must be hashable, got {type(problem_key).__name__}") from None
    return (problem_key, _device(device), tuple(cudnn_versions() if versions is None else versions))


# --------------------------------------------------------------------------------------------
# the cache
# --------------------------------------------------------------------------------------------


class _Build:
    """One in-flight build; threads missing the same key wait on ``done``."""

    __slots__ = ("done", "error", "thread", "value")

    def __init__(self):
        self.thread = threading.get_ident()  # the building thread: it must not wait on itself
        self.done = threading.Event()
        self.value = None
        self.error: BaseException | None = None


def _check_size(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    return n


class GraphCache:
    """Bounded LRU ``key -> built value``; thread-safe, builds outside the lock.

    * ``get_or_build(key, build_fn)``: a hit returns the stored value (and makes it most
      recent); a miss calls ``build_fn()`` once per key even when many threads miss together
      (the others wait for that build); other keys are served meanwhile. A build that raises
      stores nothing and its exception reaches every thread waiting on it. A ``build_fn`` that
      asks for its own key raises ``RuntimeError`` instead of waiting for itself forever.
    * ``maxsize`` counts entries; 0 disables storing. ``resize(n)`` evicts the least recently
      used entries when shrinking.
    * ``environment`` (a callable returning a JSON-able dict; default ``current_environment``)
      is written into saved files and must match on load.

    * Entries (and loaded, not yet used file entries) live in registered ``caches.LRU`` maps
      named ``name`` and ``name + ".stored"``, so ``cudnn_attn.clear_caches()`` empties them.

    Equivalent (single-threaded) Python: a ``maxsize``-bounded LRU memo keyed by ``key``.
    """

    def __init__(self, maxsize: int = 256, *, environment: Callable[[], dict] | None = None,
                 name: str | None = None):
        self._maxsize = _check_size("maxsize", maxsize)
        self._environment = environment or current_environment
        self._lock = threading.Lock()
        name = name or f"graph_cache.{next(_SERIAL)}"
        self._entries = LRU(name, max(self._maxsize, 1))
        self._building: dict = {}
        # key text -> (kind, payload): loaded from disk, not yet used
        self._stored = LRU(name + ".stored", None)
        self.reset_stats()

    # -- lookups ------------------------------------------------------------------------------
    def get_or_build(self, key: Hashable, build_fn: Callable[[], T]) -> T:
        """The value cached under ``key``, building it with ``build_fn()`` on a miss."""
        with self._lock:
            try:
                value = self._entries.get(key, _MISSING)
            except TypeError:
                raise TypeError(f"key must be hashable, got {type(key).__name__}") from None
            if value is not _MISSING:
                self._hits += 1
                return value
            build = self._building.get(key)
            owner = build is None
            if build is None:
                build = self._building[key] = _Build()
                self._misses += 1
            elif build.thread == threading.get_ident():
                # Waiting here would wait forever: this thread is the one building ``key``.
                raise RuntimeError(f"graph cache: the build function for {key!r} asked the "
                                   f"cache for its own key (a recursive build)")
            else:
                self._waits += 1
        if not owner:
            build.done.wait()
            if build.error is not None:
                raise build.error
            return build.value
        return self._build(key, build, build_fn)

    def _build(self, key, build: _Build, build_fn):
        start = time.perf_counter()
        try:  # whatever happens, waiters must be released: the except below resolves the build
            value, loaded = self._restore(key), True
            if value is _MISSING:
                start = time.perf_counter()
                loaded = False
                value = build_fn()
        except BaseException as exc:
            with self._lock:
                del self._building[key]
                self._builds += 1
                self._build_errors += 1
                self._build_seconds += time.perf_counter() - start
            build.error = exc
            build.done.set()
            raise
        with self._lock:
            del self._building[key]
            if loaded:
                self._loads += 1
            else:
                self._builds += 1
                self._build_seconds += time.perf_counter() - start
            self._insert(key, value)
        build.value = value
        build.done.set()
        return value

    def _insert(self, key, value) -> None:
        if self._maxsize == 0:
            return
        before = len(self._entries) + (key not in self._entries)
        self._entries.put(key, value)
        self._evictions += before - len(self._entries)

    def peek(self, key: Hashable, default: object = None) -> Any:
        """The value cached under ``key``, or ``default``: never builds or loads, and leaves the
        counters alone (for reports such as ``explain()``)."""
        with self._lock:
            try:
                value = self._entries.get(key, _MISSING)
            except TypeError:
                return default
        return default if value is _MISSING else value

    def available(self, key: Hashable) -> bool:
        """Whether a get of ``key`` would build nothing: cached, or in a loaded file."""
        with self._lock:
            if key in self._entries:
                return True
            if not self._stored:
                return False
        try:
            key_text = encode_key(key)
        except TypeError:
            return False
        with self._lock:
            return key_text in self._stored

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list:
        """The cached keys, least recently used first."""
        return self._entries.keys()

    # -- management ---------------------------------------------------------------------------
    @property
    def maxsize(self) -> int:
        return self._maxsize

    def resize(self, maxsize: int) -> None:
        """Change the bound; shrinking evicts least recently used entries now."""
        maxsize = _check_size("maxsize", maxsize)
        with self._lock:
            self._maxsize = maxsize
            before = len(self._entries)
            if maxsize == 0:
                self._entries.clear()
            else:
                self._entries.resize(maxsize)
            self._evictions += before - len(self._entries)

    def clear(self) -> None:
        """Drop every entry (and every loaded, not yet used file entry). Counters are kept."""
        with self._lock:
            self._entries.clear()
            self._stored.clear()

    def reset_stats(self) -> None:
        """Zero the counters reported by ``info()``."""
        with self._lock:
            self._zero()

    def _zero(self) -> None:
        self._hits = self._misses = self._waits = self._builds = self._loads = 0
        self._evictions = self._build_errors = self._rejected = 0
        self._build_seconds = 0.0

    def info(self) -> dict:
        """Counters and sizes.

        ``hits``: lookups served from memory; ``misses``: lookups that had to build or load
        (``builds`` + ``loads``, plus builds still running); ``waits``: lookups that waited for
        another thread's build of the same key; ``build_errors``; ``evictions``; ``size`` /
        ``maxsize``; ``build_seconds`` spent in ``build_fn``; ``stored``: file entries loaded
        and not yet used; ``rejected_files``: files refused by ``load`` or at first use.
        """
        with self._lock:
            return {"hits": self._hits, "misses": self._misses, "evictions": self._evictions,
                    "size": len(self._entries), "maxsize": self._maxsize,
                    "build_seconds": self._build_seconds, "builds": self._builds,
                    "loads": self._loads, "waits": self._waits,
                    "build_errors": self._build_errors, "building": len(self._building),
                    "stored": len(self._stored), "rejected_files": self._rejected}

    # -- persistence --------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str]) -> int:
        """Write every serializable entry to ``directory`` (created if needed); returns the count.

        Entries whose value has no ``serial_kind``/``serialize``, whose ``serialize()`` raises
        (a cuDNN plan without a GPU) or whose key cannot be encoded are skipped. Raises
        ``UnsafeCacheDir`` for a directory others can write or another user owns (see
        ``cache_dir`` for the trust model).
        """
        with self._lock:
            items = [(key, self._entries.get(key, _MISSING)) for key in self._entries.keys()]
            items = [(key, value) for key, value in items if value is not _MISSING]
            stored = {key: self._stored.get(key) for key in self._stored.keys()}
        records = dict(stored)
        for key, value in items:
            kind = getattr(value, "serial_kind", None)
            if not isinstance(kind, str) or not callable(getattr(value, "serialize", None)):
                continue
            try:
                key_text = encode_key(key)
                payload = value.serialize()
            except Exception as exc:
                logger.debug("graph cache: not saving %r: %s", key, exc)
                continue
            if not isinstance(payload, (bytes, bytearray, memoryview)):
                logger.warning("graph cache: %s.serialize() returned %s, not bytes; not saved",
                               type(value).__name__, type(payload).__name__)
                continue
            records[key_text] = (kind, bytes(payload))
        if not records:
            return 0
        env, secret = self._environment(), secret_key()
        with open_dir(directory, create=True) as dir_fd:
            for key_text, (kind, payload) in records.items():
                name = hashlib.sha256(key_text.encode()).hexdigest()[:40] + SUFFIX
                write_graph_file(dir_fd, name, encode_file(env, kind, key_text, payload, secret))
        return len(records)

    def load(self, directory: str | os.PathLike[str]) -> int:
        """Read the graph files in ``directory``; returns how many were accepted.

        Only regular files whose HMAC verifies with this user's key (``secret_key_path()``) are
        accepted; their payloads are deserialized at the first lookup of their key (instead of
        calling ``build_fn``). Anything else (links, FIFOs, devices, oversized, malformed or
        foreign files) is logged, counted in ``info()["rejected_files"]`` and skipped; an unsafe
        directory (``UnsafeCacheDir``) is logged and nothing is loaded. Never raises for what
        the directory holds.
        """
        env = self._environment()
        accepted: dict = {}
        try:
            secret = secret_key()
            with open_dir(directory, create=False) as dir_fd:
                for entry in graph_files(dir_fd):
                    record = self._read_one(dir_fd, entry.name, env, secret)
                    if record is not None:
                        accepted[record[1]] = (record[0], record[2])
        except FileNotFoundError:
            return 0
        except OSError as exc:  # UnsafeCacheDir, not a directory, unreadable: nothing is trusted
            logger.warning("graph cache: not loading %s: %s", directory, exc)
            return 0
        with self._lock:
            for key_text, record in accepted.items():
                self._stored.pop(key_text)
                self._stored.put(key_text, record)
        return len(accepted)

    def _read_one(self, dir_fd: int, name: str, env: dict, secret: bytes):
        """``(kind, key_text, payload)`` of one verified file, or None after reporting it."""
        try:
            with open_graph_file(dir_fd, name, MAX_FILE_BYTES) as (read, size):
                return read_file(read, size, env, secret, MAX_FILE_BYTES)
        except (Rejected, OSError) as exc:
            self._reject(name, exc)
            return None

    def _reject(self, what, why) -> None:
        logger.warning("graph cache: ignoring %s: %s; the graph will be rebuilt", what, why)
        with self._lock:
            self._rejected += 1

    def _restore(self, key):
        """The deserialized value of a loaded file entry for ``key``, else ``_MISSING``."""
        if not self._stored:
            return _MISSING
        try:
            key_text = encode_key(key)
        except TypeError:
            return _MISSING
        with self._lock:
            record = self._stored.pop(key_text, None)
        if record is None:
            return _MISSING
        kind, payload = record
        from_bytes = deserializer(kind)
        if from_bytes is None:
            self._reject(f"the stored entry for {key!r}", f"no deserializer registered for {kind!r}")
            return _MISSING
        try:
            return from_bytes(payload)
        except Exception as exc:
            self._reject(f"the stored entry for {key!r}", f"{kind} deserializer failed: {exc}")
            return _MISSING


graph_cache = GraphCache(name="cudnn.graph_cache")
"""The process-wide cache of built graphs (re-exported as ``cudnn_attn.graph_cache``)."""
