"""On-disk cache of compiled NVRTC programs, so a machine compiles each kernel program once.

One file per program (a kernel source with its defines, the name expressions it instantiates,
the target arch): the cubin, the lowered (mangled) names and the ``ptxas -v`` log that
``compile_all`` reads registers and spills from. The file name is a hash of everything the cubin
depends on: the exact text NVRTC compiles (``_loader.source_text``: defines, common.cu, the
kernel), the name expressions, the arch, the compiler options and the NVRTC version.

Where: ``$CUDNN_ATTN_CUBIN_CACHE`` (``off`` disables the cache), else
``$XDG_CACHE_HOME/cudnn_attn/cubins`` (``~/.cache`` when unset). Files are written atomically
(an exclusive ``mkstemp`` file renamed into place), never through a symbolic link: a link in
place of the directory disables the cache and a link in place of an entry is neither read nor
followed (a write replaces the link itself). A directory owned by another user is not used. An
entry that does not parse, fails its checksum or names another key is ignored and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..caches import user_path

logger = logging.getLogger("cudnn_attn")

__all__ = ["cache_dir", "clear", "info", "load", "program_key", "store"]

MAGIC = b"cudnn_attn cubin\n"
FORMAT_VERSION = 1
SUFFIX = ".cubin"
_PREFIX = struct.Struct(">II")  # format version, header length
_DIGEST = 32  # sha256 of everything before it
_ENV = "CUDNN_ATTN_CUBIN_CACHE"

_lock = threading.Lock()
_stats = {"hits": 0, "misses": 0, "stored": 0, "rejected": 0}


def cache_dir() -> Path | None:
    """The cache directory (created on first store), or None when disabled."""
    explicit = os.environ.get(_ENV)
    if explicit is not None and explicit.strip().lower() in ("", "0", "off", "none", "false"):
        return None
    return user_path(_ENV, "XDG_CACHE_HOME", ".cache", "cubins")


def nvrtc_version() -> str:
    from cupy.cuda import nvrtc

    return ".".join(map(str, nvrtc.getVersion()))


def program_key(text: str, expressions: Sequence[str], arch: str, options: Sequence[str],
                version: str) -> str:
    """Hex digest naming one program: its exact source text, name expressions, arch, compiler
    options and NVRTC version."""
    spec = json.dumps({"format": FORMAT_VERSION, "text": text, "expressions": list(expressions),
                       "arch": arch, "options": list(options), "nvrtc": version},
                      sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()


def _usable_dir(directory: Path, create: bool) -> bool:
    """The directory exists (or was created), is a real directory (not a link) and is ours."""
    try:
        if create:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        logger.warning("cubin cache: %s is not a directory (a symbolic link?); not used",
                       directory)
        return False
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        logger.warning("cubin cache: %s belongs to another user; not used", directory)
        return False
    return True


def _encode(key: str, cubin: bytes, lowered: Mapping[str, str], log: str) -> bytes:
    header = json.dumps({"key": key, "lowered": dict(lowered), "log": log,
                         "cubin_bytes": len(cubin)}, sort_keys=True).encode()
    body = MAGIC + _PREFIX.pack(FORMAT_VERSION, len(header)) + header + bytes(cubin)
    return body + hashlib.sha256(body).digest()


def _decode(data: bytes, key: str):
    """(cubin, lowered, log), or a string saying why the entry is rejected."""
    start = len(MAGIC) + _PREFIX.size
    if not data.startswith(MAGIC) or len(data) < start + _DIGEST:
        return "not a cubin cache entry (bad magic or truncated)"
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        return "checksum mismatch"
    version, header_len = _PREFIX.unpack_from(data, len(MAGIC))
    if version != FORMAT_VERSION:
        return f"format version {version}"
    try:
        header = json.loads(body[start:start + header_len])
        cubin = body[start + header_len:]
        ok = (header["key"] == key and header["cubin_bytes"] == len(cubin)
              and isinstance(header["lowered"], dict) and isinstance(header["log"], str))
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable header ({exc})"
    if not ok:
        return "inconsistent header (another key?)"
    return bytes(cubin), header["lowered"], header["log"]


def _count(what: str) -> None:
    with _lock:
        _stats[what] += 1


def load(key: str, expressions: Sequence[str], directory: Path | None = None):
    """``(cubin, lowered, log)`` of a stored program, or None (absent, disabled or rejected)."""
    directory = cache_dir() if directory is None else Path(directory)
    if directory is None or not _usable_dir(directory, create=False):
        _count("misses")
        return None
    path = directory / (key + SUFFIX)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # absent, or a symbolic link (O_NOFOLLOW)
        _count("misses")
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                found = "not a regular file"
            else:
                found = _decode(f.read(), key)
    except OSError as exc:
        found = f"unreadable ({exc})"
    if isinstance(found, tuple) and set(found[1]) != set(expressions):
        found = "lowered names do not match the expressions"
    if isinstance(found, str):
        logger.info("cubin cache: ignoring %s: %s; recompiling", path, found)
        _count("rejected")
        _count("misses")
        return None
    _count("hits")
    return found


def store(key: str, cubin: bytes, lowered: Mapping[str, str], log: str,
          directory: Path | None = None) -> bool:
    """Write one program atomically; False (and a debug log) if the cache is unusable."""
    directory = cache_dir() if directory is None else Path(directory)
    if directory is None or not _usable_dir(directory, create=True):
        return False
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=key[:16] + ".", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(_encode(key, cubin, lowered, log))
        os.replace(tmp, directory / (key + SUFFIX))  # replaces a link itself, never its target
        tmp = None
    except OSError as exc:
        logger.debug("cubin cache: could not store %s: %s", key, exc)
        return False
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    _count("stored")
    return True


def clear(directory: Path | None = None) -> int:
    """Delete the cache entries (and stale temp files); returns how many entries were removed."""
    directory = cache_dir() if directory is None else Path(directory)
    if directory is None or not _usable_dir(directory, create=False):
        return 0
    removed = 0
    for path in directory.iterdir():
        if path.name.endswith(SUFFIX) or path.name.endswith(".tmp"):
            path.unlink(missing_ok=True)
            removed += path.name.endswith(SUFFIX)
    return removed


def info() -> dict:
    """This process's counts: hits, misses, stored, rejected; and the directory."""
    with _lock:
        out = dict(_stats)
    directory = cache_dir()
    out["directory"] = str(directory) if directory is not None else None
    return out
