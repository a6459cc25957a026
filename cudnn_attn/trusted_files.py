"""Files only this user could have written: the trust model of every on-disk cache.

The graph cache (``graphs/``: serialized cuDNN plans, read by cuDNN's native deserializer) and the
cubin cache (``fallback_kernels/cubin_cache.py``: GPU code loaded as a kernel) both hand what they
read to native code, so both follow one rule (as ssh treats ``~/.ssh``):

* The directory must be owned by this user (or root) and not writable by group or others
  (unless sticky, like ``/tmp``, where nobody can replace another user's file): ``open_dir``
  raises ``UnsafeCacheDir`` otherwise.
* Every file carries an HMAC-SHA256 (``sign``/``signature_ok``) keyed with a per-user secret kept
  *outside* the cache directories (``$CUDNN_ATTN_CACHE_KEY_FILE``, else
  ``$XDG_CONFIG_HOME/cudnn_attn/graph-cache.key``, ``~/.config`` by default), created ``0600`` on
  first use. Whoever can write a cache directory but not read the key cannot make a file that
  verifies.
* All access goes through a descriptor of the directory: temporary files are created exclusively
  (``O_EXCL | O_NOFOLLOW``, random names) and renamed into place; files are opened with
  ``O_NOFOLLOW | O_NONBLOCK`` and must be regular files (no links, FIFOs, devices) owned by this
  user (or root) and under a size limit, so no read blocks or grows without bound.
* JSON read from such a file is depth-checked before parsing (``json_depth_ok``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from .caches import memoize, user_path

__all__ = ["KEY_BYTES", "Rejected", "UnsafeCacheDir", "clear_files", "json_depth_ok", "open_dir",
           "open_regular_file", "read_exact", "read_regular_path", "secret_key", "secret_key_path",
           "sign", "signature_ok", "write_atomic"]

KEY_BYTES = 32
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_CREATE_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0))


class UnsafeCacheDir(PermissionError):
    """A cache directory or key file others could write (or that another user owns)."""


class Rejected(Exception):
    """A cache file that must not be trusted; the message says why."""


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
def open_dir(directory, *, create: bool, follow_link: bool = True) -> Iterator[int]:
    """A descriptor of ``directory`` after checking its owner and mode (``UnsafeCacheDir``).

    ``create``: make it (``0700``) if missing. Raises ``FileNotFoundError`` if it is missing
    and ``create`` is false, ``NotADirectoryError`` if it is something else (or, without
    ``follow_link``, a symbolic link: ``OSError`` ELOOP).
    """
    if create:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
                 | (0 if follow_link else _NOFOLLOW))
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{directory} is not a directory")
        _check_owner_and_mode("cache directory", directory, st, private=False)
        yield fd
    finally:
        os.close(fd)


def read_exact(fd: int, n: int) -> bytes:
    """Up to ``n`` bytes of ``fd`` (fewer only at its end), in bounded chunks."""
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _regular(fd: int, max_bytes: int, owned: bool) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Rejected("not a regular file (FIFO, device, socket or directory)")
    if owned and st.st_uid not in (_euid(), 0):
        raise Rejected(f"owned by uid {st.st_uid}, not by this user (uid {_euid()})")
    if st.st_size > max_bytes:
        raise Rejected(f"{st.st_size} bytes, over the {max_bytes}-byte limit")
    return st


@contextlib.contextmanager
def open_regular_file(dir_fd: int, name: str, max_bytes: int, *, owned: bool = True):
    """``(read, size)`` of a regular file of this user (of anyone without ``owned``) in the
    directory; ``Rejected`` for anything else. Never follows a link and never blocks (a FIFO is refused after a non-blocking
    open); ``read(n)`` reads at most ``n`` more bytes. ``FileNotFoundError`` when absent."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise  # absent: nothing to reject
    except OSError as exc:  # ELOOP: a symbolic link; others: gone, unreadable
        kind = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise Rejected(f"cannot open it ({kind}); only regular files are read") from None
    try:
        st = _regular(fd, max_bytes, owned)
        yield (lambda n: read_exact(fd, n)), st.st_size
    finally:
        os.close(fd)


def read_regular_path(path, max_bytes: int) -> bytes:
    """The bytes of the regular file at ``path`` (a link to one is followed: the user named it),
    at most ``max_bytes`` of them; ``Rejected`` for a FIFO, device or directory (``/dev/zero``
    would never end) or a larger file, ``OSError`` when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        size = _regular(fd, max_bytes, owned=False).st_size
        data = read_exact(fd, size + 1)  # one more: a file that grew since fstat is refused too
        if len(data) > max_bytes:
            raise Rejected(f"over the {max_bytes}-byte limit")
        return data
    finally:
        os.close(fd)


def write_atomic(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``data`` to ``name`` atomically: an exclusive random temporary file, then rename
    (which replaces a link itself, never its target)."""
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


def clear_files(directory, suffix: str) -> int:
    """Delete the files named ``*suffix`` (and stale temporary files: ``*suffix.tmp*`` as
    ``write_atomic`` names them, or ending in ``.tmp``) in ``directory``.

    Returns how many ``*suffix`` files were removed. Links are removed, never followed;
    directories (whatever their name) are left alone. A missing directory removes nothing.
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
            entry = name.endswith(suffix)
            if is_dir or not (entry or suffix + ".tmp" in name or name.endswith(".tmp")):
                continue
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(name, dir_fd=fd)
                removed += entry
    finally:
        os.close(fd)
    return removed


def json_depth_ok(text: bytes, limit: int) -> bool:
    """Whether the brackets of ``text`` (outside strings) nest at most ``limit`` deep: checked
    before ``json.loads``, whose recursion a hostile file could otherwise exhaust."""
    depth, in_string, escaped = 0, False, False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return False
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return True


# --------------------------------------------------------------------------------------------
# the per-user key and the signature it makes
# --------------------------------------------------------------------------------------------

SIGNATURE_BYTES = 32  # HMAC-SHA256


def sign(secret: bytes, body: bytes) -> bytes:
    """HMAC-SHA256 of ``body`` under ``secret`` (``SIGNATURE_BYTES`` long)."""
    return hmac.new(secret, body, hashlib.sha256).digest()


def signature_ok(secret: bytes, body: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``sign(secret, body)`` (compared in constant time)."""
    return hmac.compare_digest(sign(secret, body), signature)


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
        return read_exact(fd, KEY_BYTES)
    finally:
        os.close(fd)
