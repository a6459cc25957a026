"""On-disk cache of compiled NVRTC programs, so a machine compiles each kernel once.

One file per program: the loader makes each kernel variant its own program (a kernel source
with its defines, the one name expression it instantiates, the target arch), so there is one
entry per variant and arch, and a call reads or writes only the kernels it launches. An entry
holds the cubin, the lowered (mangled) names and the ``ptxas -v`` log that ``compile_all`` reads
registers and spills from. The file name is a hash of everything the cubin depends on: the exact
text NVRTC compiles (``_loader.source_text``: defines, common.cu, the kernel), the name
expressions, the arch, the compiler options and the NVRTC version.

Where: ``$CUDNN_ATTN_CUBIN_CACHE`` (``off`` disables the cache), else
``$XDG_CACHE_HOME/cudnn_attn/cubins`` (``~/.cache`` when unset).

A cubin is executable GPU code, so the cache follows the graph cache's trust model
(``cudnn_attn.core.trusted_files``): a directory that is a link, belongs to another user or that group
or others may write is not used; an entry is read only if it is a regular file of this user (no
link, FIFO or device: opened non-blocking), under ``MAX_ENTRY_BYTES``, and its HMAC verifies with
this user's cache key (``trusted_files.secret_key_path()``). Entries are written atomically (an
exclusive temporary file renamed into place, replacing a link itself). An entry that fails any
check (or does not parse, nests its header too deep, or names another key) is ignored and
rebuilt. Nothing here raises into the compile path: an unusable cache only costs a compile.
Cubins carried from another machine verify only where the same key file is used
(``$CUDNN_ATTN_CACHE_KEY_FILE``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..core.caches import user_path
from ..core.trusted_files import (SIGNATURE_BYTES,
    Rejected,
    clear_files,
    json_depth_ok,
    open_dir,
    open_regular_file,
    secret_key,
    sign,
    signature_ok,
    write_atomic,
)

logger = logging.getLogger("cudnn_attn")

__all__ = ["adopt", "cache_dir", "clear", "info", "load", "program_key", "store"]

MAGIC = b"cudnn_attn cubin\n"
FORMAT_VERSION = 2  # 2: signed with the user's cache key (1 had a plain sha256)
SUFFIX = ".cubin"
_PREFIX = struct.Struct(">II")  # format version, header length
MAX_ENTRY_BYTES = 64 << 20  # one variant is ~100 KiB; a program of every fused instance a few MiB
MAX_HEADER_BYTES = 1 << 20  # lowered names and a ptxas log: kilobytes
MAX_JSON_DEPTH = 4  # ours nests 2 deep
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


def _encode(key: str, cubin: bytes, lowered: Mapping[str, str], log: str, secret: bytes) -> bytes:
    header = json.dumps({"key": key, "lowered": dict(lowered), "log": log,
                         "cubin_bytes": len(cubin)}, sort_keys=True).encode()
    body = MAGIC + _PREFIX.pack(FORMAT_VERSION, len(header)) + header + bytes(cubin)
    return body + sign(secret, body)


def _decode(data: bytes, key: str, secret: bytes | None):
    """(cubin, lowered, log), or a string saying why the entry is rejected. ``secret=None``
    checks everything but the signature (``adopt``: the caller vouches for the file)."""
    start = len(MAGIC) + _PREFIX.size
    if not data.startswith(MAGIC) or len(data) < start + SIGNATURE_BYTES:
        return "not a cubin cache entry (bad magic or truncated)"
    body, signature = data[:-SIGNATURE_BYTES], data[-SIGNATURE_BYTES:]
    if secret is not None and not signature_ok(secret, body, signature):
        return "signature mismatch (corrupt, or not written with this user's cache key)"
    version, header_len = _PREFIX.unpack_from(data, len(MAGIC))
    if version != FORMAT_VERSION:
        return f"format version {version}"
    raw = body[start:start + header_len]
    if header_len > MAX_HEADER_BYTES or not json_depth_ok(raw, MAX_JSON_DEPTH):
        return "header too large or too deeply nested"
    try:
        header = json.loads(raw)
        cubin = body[start + header_len:]
        ok = (header["key"] == key and header["cubin_bytes"] == len(cubin)
              and isinstance(header["lowered"], dict) and isinstance(header["log"], str)
              and all(isinstance(v, str) for v in header["lowered"].values()))
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
    if directory is None:
        _count("misses")
        return None
    name = key + SUFFIX
    try:
        with open_dir(directory, create=False, follow_link=False) as dir_fd:
            secret = secret_key()
            try:
                with open_regular_file(dir_fd, name, MAX_ENTRY_BYTES) as (read, size):
                    found = _decode(read(size), key, secret)
            except Rejected as exc:  # a link, FIFO, another user's file, too large
                found = str(exc)
    except (FileNotFoundError, NotADirectoryError):  # no directory or no entry: a plain miss
        found = None
    except OSError as exc:  # UnsafeCacheDir (its message says why), unreadable
        logger.warning("cubin cache: %s; not used", exc)
        found = None
    if isinstance(found, tuple) and set(found[1]) != set(expressions):
        found = "lowered names do not match the expressions"
    if isinstance(found, str):
        logger.info("cubin cache: ignoring %s: %s; recompiling", directory / name, found)
        _count("rejected")
    if not isinstance(found, tuple):
        _count("misses")
        return None
    _count("hits")
    return found


def store(key: str, cubin: bytes, lowered: Mapping[str, str], log: str,
          directory: Path | None = None) -> bool:
    """Write one program atomically; False (and a log line) if the cache is unusable."""
    directory = cache_dir() if directory is None else Path(directory)
    if directory is None:
        return False
    try:
        with open_dir(directory, create=True, follow_link=False) as dir_fd:
            write_atomic(dir_fd, key + SUFFIX, _encode(key, cubin, lowered, log, secret_key()))
    except OSError as exc:  # UnsafeCacheDir, a file in the way, a full disk
        logger.debug("cubin cache: could not store %s: %s", key, exc)
        return False
    _count("stored")
    return True


def adopt(source: Path, directory: Path | None = None) -> int:
    """Store the entries of ``source`` (cubins built elsewhere, e.g. ahead of time on another
    machine, signed with another key, copied in by any user) in this user's cache, signed with
    this user's key: the caller vouches for the folder, as for a program it compiled. Each is
    still read as the cache reads (a regular file, no link, at most ``MAX_ENTRY_BYTES``, a
    well-formed entry of the key its name says); anything else is skipped. Returns how many
    were stored."""
    source, adopted = Path(source), 0
    src_fd = os.open(source, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        names = sorted(e.name for e in os.scandir(src_fd) if e.name.endswith(SUFFIX))
        for name in names:
            key = name[:-len(SUFFIX)]
            try:
                with open_regular_file(src_fd, name, MAX_ENTRY_BYTES, owned=False) as (read, size):
                    found = _decode(read(size), key, None)
            except (Rejected, OSError) as exc:
                found = str(exc)
            if isinstance(found, str):
                logger.warning("cubin cache: not adopting %s: %s", source / name, found)
                continue
            adopted += store(key, *found, directory=directory)
    finally:
        os.close(src_fd)
    return adopted


def clear(directory: Path | None = None) -> int:
    """Delete the cache entries (and stale temp files); returns how many entries were removed.
    Directories named like entries are left alone; links are removed, never followed."""
    directory = cache_dir() if directory is None else Path(directory)
    if directory is None:
        return 0
    try:
        with open_dir(directory, create=False, follow_link=False):
            pass
    except OSError:  # missing, not ours, writable by others: not touched
        return 0
    return clear_files(directory, SUFFIX)


def info() -> dict:
    """This process's counts: hits, misses, stored, rejected; and the directory."""
    with _lock:
        out = dict(_stats)
    directory = cache_dir()
    out["directory"] = str(directory) if directory is not None else None
    return out
