"""The graph cache's directory and key: who may write them, and how files are read and written.

Trust model (as ssh treats ``~/.ssh``): a graph file reaches cuDNN's native deserializer, so only
files this user wrote are used.

* The directory must be owned by this user (or root) and not writable by group or others
  (unless sticky, like ``/tmp``, where nobody can replace another user's file). Otherwise it is
  refused: ``save`` raises ``UnsafeCacheDir``, ``load`` logs why and loads nothing.
* Every file carries an HMAC-SHA256 keyed with a per-user secret kept *outside* the cache
  directory (``$CUDNN_ATTN_CACHE_KEY_FILE``, else ``$XDG_CONFIG_HOME/cudnn_attn/graph-cache.key``,
  ``~/.config`` by default), created ``0600`` on first use. Whoever can write the cache directory
  but not read the key cannot make a file that verifies.
* All access goes through a descriptor of the directory: temporary files are created exclusively
  (``O_EXCL | O_NOFOLLOW``, random names) and renamed into place; files are opened with
  ``O_NOFOLLOW | O_NONBLOCK`` and must be regular files (no links, FIFOs, devices) under
  ``MAX_FILE_BYTES``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from ..caches import memoize, user_path
from .cache_files import SUFFIX, Rejected

__all__ = ["KEY_BYTES", "MAX_FILE_BYTES", "UnsafeCacheDir", "clear_dir", "graph_files",
           "open_dir", "open_graph_file", "secret_key", "secret_key_path", "write_graph_file"]

MAX_FILE_BYTES = 256 << 20  # serialized SDPA plans are kilobytes to a few megabytes
KEY_BYTES = 32
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_CREATE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0))


class UnsafeCacheDir(PermissionError):
    """A cache directory or key file others could write (or that another user owns)."""


def _euid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else 0


def _check_owner_and_mode(what: str, path, st: os.stat_result, *, private: bool) -> None:
    if st.st_uid not in (_euid(), 0):
        raise UnsafeCacheDir(f"refusing {what} {path}: owned by uid {st.st_uid}, not by this "
                             f"user (uid {_euid()})")
    mode = stat.S_IMODE(st.st_mode)
    if private and mode & 0o077:
        raise UnsafeCacheDir(f"refusing {what} {path}: mode {mode:04o} lets others read or write "
                             f"it; run: chmod 600 {path}")
    if mode & 0o022 and not mode & stat.S_ISVTX:
        raise UnsafeCacheDir(f"refusing {what} {path}: mode {mode:04o} lets others write it; "
                             f"run: chmod go-w {path}")


@contextlib.contextmanager
def open_dir(directory, *, create: bool) -> Iterator[int]:
    """A descriptor of ``directory`` after checking its owner and mode (``UnsafeCacheDir``).

    ``create``: make it (``0700``) if missing. Raises ``FileNotFoundError`` if it is missing
    and ``create`` is false, ``NotADirectoryError`` if it is something else.
    """
    if create:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{directory} is not a directory")
        _check_owner_and_mode("cache directory", directory, st, private=False)
        yield fd
    finally:
        os.close(fd)


def graph_files(dir_fd: int) -> list[os.DirEntry]:
    """Entries named ``*.cagraph`` (whatever they are), sorted by name."""
    with os.scandir(dir_fd) as entries:
        return sorted((e for e in entries if e.name.endswith(SUFFIX)), key=lambda e: e.name)


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def open_graph_file(dir_fd: int, name: str, max_bytes: int = MAX_FILE_BYTES):
    """``(read, size)`` of a regular file in the directory; ``Rejected`` for anything else.

    Never follows a link and never blocks (a FIFO is refused after a non-blocking open).
    """
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:  # ELOOP: a symbolic link; others: gone, unreadable
        kind = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise Rejected(f"cannot open it ({kind}); only regular files are read") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Rejected("not a regular file (FIFO, device, socket or directory)")
        if st.st_size > max_bytes:
            raise Rejected(f"{st.st_size} bytes, over the {max_bytes}-byte limit")
        yield (lambda n: _read_exact(fd, n)), st.st_size
    finally:
        os.close(fd)


def write_graph_file(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``data`` to ``name`` atomically: an exclusive random temporary file, then rename."""
    tmp = f".{name}.tmp{secrets.token_hex(8)}"
    fd = os.open(tmp, _CREATE_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb", closefd=True) as fh:
            fh.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def clear_dir(directory) -> int:
    """Delete the graph files (``*.cagraph``, and stale temporary files) in ``directory``.

    Returns how many graph files were removed. Links are removed, never followed; directories
    are left alone. A missing directory removes nothing.
    """
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    removed = 0
    try:
        with os.scandir(fd) as entries:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for name, is_dir in names:
            graph = name.endswith(SUFFIX)
            if is_dir or not (graph or SUFFIX + ".tmp" in name):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
                removed += graph
    finally:
        os.close(fd)
    return removed


# --------------------------------------------------------------------------------------------
# the per-user key
# --------------------------------------------------------------------------------------------


def secret_key_path() -> Path:
    """``$CUDNN_ATTN_CACHE_KEY_FILE``, else ``$XDG_CONFIG_HOME/cudnn_attn/graph-cache.key``."""
    return user_path("CUDNN_ATTN_CACHE_KEY_FILE", "XDG_CONFIG_HOME", ".config", "graph-cache.key")


def secret_key() -> bytes:
    """This user's cache key (created ``0600`` on first use); ``UnsafeCacheDir`` if others
    could read or replace it."""
    return _key_at(str(secret_key_path()))


@memoize("graph_cache.secret_key", 8)
def _key_at(path: str) -> bytes:
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, mode=0o700, exist_ok=True)
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    # Written under a random name, then linked into place: link() never replaces, so two
    # processes creating the key at once agree on the first one.
    tmp = os.path.join(parent, f".graph-cache.key.{secrets.token_hex(8)}")
    fd = os.open(tmp, _CREATE_FLAGS, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_bytes(KEY_BYTES))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    return _read_key(path)


def _read_key(path: str) -> bytes:
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise UnsafeCacheDir(f"refusing cache key {path}: {exc.strerror} (a link?)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != KEY_BYTES:
            raise UnsafeCacheDir(f"refusing cache key {path}: not a regular {KEY_BYTES}-byte file")
        _check_owner_and_mode("cache key", path, st, private=True)
        return _read_exact(fd, KEY_BYTES)
    finally:
        os.close(fd)
