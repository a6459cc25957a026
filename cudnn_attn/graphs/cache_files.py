"""The graph cache's building blocks: canonical keys, serializable values, cache files.

* ``encode_key(key)``: canonical JSON of a key (tuples, scalars, dtypes, devices, enums, frozen
  dataclasses); how a key is written to and matched in a file. Nothing is pickled.
* ``register_deserializer(kind, from_bytes)``: the value protocol
  (``serialize() -> bytes`` and a ``serial_kind`` naming the registered ``from_bytes``).
* ``current_environment()``: GPU name, compute capability, SM count, cuDNN versions.
* The file format: ``MAGIC`` | u32 format version | u32 header length | JSON header
  (``format``, ``environment``, ``kind``, ``key``, ``payload_bytes``) | payload | SHA-256 of all
  that precedes it. ``decode_file`` raises ``Rejected`` (with the reason) for anything corrupt,
  truncated or foreign.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import struct
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from ..caches import memoize

__all__ = ["FORMAT_VERSION", "MAGIC", "SUFFIX", "Rejected", "clear_dir", "cudnn_versions",
           "current_environment", "decode_file", "default_cache_dir", "deserializer",
           "encode_file", "encode_key", "register_deserializer"]

FORMAT_VERSION = 1
MAGIC = b"CUDNN_ATTN_GRAPH"  # 16 bytes
SUFFIX = ".cagraph"
_PREFIX = struct.Struct("<II")  # format version, header length
_DIGEST = 32  # sha256


@memoize("cudnn.versions", 1)
def cudnn_versions() -> tuple[int | None, str | None]:
    """``(cudnn backend version, cudnn frontend version)``; ``None`` for what is not installed.

    Read once, lazily: importing ``cudnn`` is deferred to the first key that needs it.
    """
    try:
        import cudnn
    except Exception:  # not installed, or its shared libraries cannot load
        return None, None
    try:
        backend = int(cudnn.backend_version())
    except Exception:
        backend = None
    return backend, getattr(cudnn, "__version__", None)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _normalize(x) -> Any:
    # Order matters: bool and IntEnum are ints, torch.Size is a tuple.
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, enum.Enum):
        return {"enum": _qualname(type(x)), "name": x.name}
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return {"float": x.hex()}  # exact, and nan/inf survive JSON
    if isinstance(x, tuple):
        return [_normalize(item) for item in x]
    if isinstance(x, frozenset):
        return {"frozenset": sorted(json.dumps(_normalize(i), sort_keys=True) for i in x)}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x)}
    if isinstance(x, torch.device):
        return {"device": str(x)}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: _normalize(getattr(x, f.name)) for f in dataclasses.fields(x) if f.compare}
        return {"dataclass": _qualname(type(x)), "fields": fields}
    raise TypeError(f"cannot encode a {type(x).__name__} in a graph cache key: {x!r}")


def encode_key(key: Hashable) -> str:
    """Canonical JSON of ``key`` (tuples, scalars, dtypes, devices, enums, frozen dataclasses).

    Equal keys give equal strings; it is how a key is written to and matched in a cache file.
    Raises TypeError for a component it cannot encode.
    """
    return json.dumps(_normalize(key), sort_keys=True, separators=(",", ":"))



# --------------------------------------------------------------------------------------------
# serializable values and the environment a file belongs to
# --------------------------------------------------------------------------------------------

_DESERIALIZERS: dict[str, Callable[[bytes], Any]] = {}


def register_deserializer(kind: str, from_bytes: Callable[[bytes], Any]) -> None:
    """Make payloads written by values with ``serial_kind == kind`` loadable via ``from_bytes``."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"kind must be a non-empty string, got {kind!r}")
    if not callable(from_bytes):
        raise TypeError(f"from_bytes must be callable, got {type(from_bytes).__name__}")
    _DESERIALIZERS[kind] = from_bytes


def current_environment() -> dict:
    """What a persisted plan depends on: GPU name, compute capability, SM count, cuDNN versions."""
    env = {"gpu_name": None, "compute_capability": None, "sm_count": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(gpu_name=props.name, compute_capability=f"{props.major}.{props.minor}",
                   sm_count=props.multi_processor_count)
    backend, frontend = cudnn_versions()
    env.update(cudnn_backend=backend, cudnn_frontend=frontend)
    return env


def default_cache_dir() -> Path:
    """``$CUDNN_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cudnn_attn/graphs`` (``~/.cache``)."""
    explicit = os.environ.get("CUDNN_ATTN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cudnn_attn" / "graphs"


def clear_dir(directory) -> int:
    """Delete the graph files (``*.cagraph``) in ``directory``; returns how many were removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    removed = 0
    for path in directory.iterdir():
        if path.name.endswith(SUFFIX) or ".cagraph.tmp" in path.name:
            path.unlink(missing_ok=True)
            removed += path.name.endswith(SUFFIX)
    return removed


class Rejected(Exception):
    """A cache file that must not be trusted; the message says why."""


def encode_file(env: dict, kind: str, key_text: str, payload: bytes) -> bytes:
    header = json.dumps({"format": FORMAT_VERSION, "environment": env, "kind": kind,
                         "key": key_text, "payload_bytes": len(payload)},
                        sort_keys=True).encode()
    body = MAGIC + _PREFIX.pack(FORMAT_VERSION, len(header)) + header + payload
    return body + hashlib.sha256(body).digest()


def decode_file(data: bytes, env: dict) -> tuple[str, str, bytes]:
    """``(kind, key_text, payload)`` of a cache file, or ``Rejected`` with the reason."""
    start = len(MAGIC) + _PREFIX.size
    if not data.startswith(MAGIC):
        raise Rejected("not a cudnn_attn graph file (bad magic)")
    if len(data) < start + _DIGEST:
        raise Rejected(f"truncated ({len(data)} bytes)")
    version, header_len = _PREFIX.unpack_from(data, len(MAGIC))
    if version != FORMAT_VERSION:
        raise Rejected(f"format version {version}, this build reads {FORMAT_VERSION}")
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise Rejected("checksum mismatch (corrupt or truncated)")
    try:
        header = json.loads(body[start:start + header_len])
        kind, key_text, size = header["kind"], header["key"], header["payload_bytes"]
        file_env = header["environment"]
    except (ValueError, KeyError, TypeError) as exc:
        raise Rejected(f"unreadable header ({exc})") from None
    payload = body[start + header_len:]
    if not (isinstance(kind, str) and isinstance(key_text, str)) or size != len(payload):
        raise Rejected("inconsistent header")
    if file_env != env:
        diff = sorted(k for k in set(env) | set(file_env or {})
                      if (file_env or {}).get(k) != env.get(k))
        raise Rejected("built for another environment: " + ", ".join(
            f"{k}={(file_env or {}).get(k)!r} (here {env.get(k)!r})" for k in diff))
    return kind, key_text, payload


def deserializer(kind: str) -> Callable[[bytes], Any] | None:
    """The ``from_bytes`` registered for ``kind``, or None."""
    return _DESERIALIZERS.get(kind)
