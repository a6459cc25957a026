"""The graph cache's building blocks: canonical keys, serializable values, cache files.

* ``encode_key(key)``: canonical JSON of a key (tuples, scalars, dtypes, devices, enums, frozen
  dataclasses); how a key is written to and matched in a file. Nothing is pickled.
* ``register_deserializer(kind, from_bytes)``: the value protocol
  (``serialize() -> bytes`` and a ``serial_kind`` naming the registered ``from_bytes``).
* ``current_environment()``: GPU name, compute capability, SM count, cuDNN versions.
* The file format: ``MAGIC`` | u32 format version | u32 header length | JSON header
  (``format``, ``environment``, ``kind``, ``key``, ``payload_bytes``) | payload | HMAC-SHA256,
  keyed with the user's cache key (``cache_dir.secret_key``), of all that precedes it.
  ``read_file`` checks the magic and the header before it reads the payload, and raises
  ``Rejected`` (with the reason) for anything corrupt, truncated, oversized, unkeyed or foreign.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import struct
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from ..caches import memoize, user_path
from ..trusted_files import Rejected, json_depth_ok, sign, signature_ok

__all__ = ["FORMAT_VERSION", "MAGIC", "MAX_HEADER_BYTES", "MAX_JSON_DEPTH", "SUFFIX", "Rejected",
           "cudnn_versions", "current_environment", "decode_file", "default_cache_dir",
           "deserializer", "encode_file", "encode_key", "read_file", "register_deserializer"]

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
    return user_path("CUDNN_ATTN_CACHE_DIR", "XDG_CACHE_HOME", ".cache", "graphs")


MAX_HEADER_BYTES = 64 << 10  # a header is a few hundred bytes: anything larger is not ours
MAX_JSON_DEPTH = 16  # ours nest 3 deep; bounded so hostile JSON cannot exhaust the stack
_SCALAR = (str, int, float, bool, type(None))


def _header_prefix(env: dict, kind: str, key_text: str, payload_len: int) -> bytes:
    header = json.dumps({"format": FORMAT_VERSION, "environment": env, "kind": kind,
                         "key": key_text, "payload_bytes": payload_len}, sort_keys=True).encode()
    return MAGIC + _PREFIX.pack(FORMAT_VERSION, len(header)) + header


def encode_file(env: dict, kind: str, key_text: str, payload: bytes, secret: bytes) -> bytes:
    """A cache file's bytes; its last 32 bytes are HMAC-SHA256(``secret``) of all before them."""
    body = _header_prefix(env, kind, key_text, len(payload)) + payload
    return body + sign(secret, body)


def _parse_header(raw: bytes) -> tuple[dict, str, str, int]:
    """``(environment, kind, key_text, payload_bytes)`` of a header, each type-checked."""
    if not json_depth_ok(raw, MAX_JSON_DEPTH):
        raise Rejected(f"header nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise Rejected(f"unreadable header ({exc})") from None
    if not isinstance(header, dict):
        raise Rejected(f"header is a {type(header).__name__}, not an object")
    env, kind, key_text = header.get("environment"), header.get("kind"), header.get("key")
    size = header.get("payload_bytes")
    if not (isinstance(env, dict) and all(isinstance(v, _SCALAR) for v in env.values())):
        raise Rejected(f"header 'environment' must be an object of scalars, got "
                       f"{type(env).__name__}")
    if not (isinstance(kind, str) and isinstance(key_text, str)):
        raise Rejected("header 'kind' and 'key' must be strings")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise Rejected(f"header 'payload_bytes' must be an int >= 0, got {size!r}")
    if header.get("format") != FORMAT_VERSION:
        raise Rejected("inconsistent header (format)")
    return env, kind, key_text, size


def _environment_mismatch(file_env: dict, env: dict) -> str | None:
    if file_env == env:
        return None
    diff = sorted(k for k in set(env) | set(file_env) if file_env.get(k) != env.get(k))
    return "built for another environment: " + ", ".join(
        f"{k}={file_env.get(k)!r} (here {env.get(k)!r})" for k in diff)


def read_file(read: Callable[[int], bytes], total: int, env: dict, secret: bytes,
              max_bytes: int) -> tuple[str, str, bytes]:
    """``(kind, key_text, payload)`` of a cache file of ``total`` bytes, read in stages.

    ``read(n)`` returns the next (up to) ``n`` bytes. The magic, version and header are checked
    before the payload is read; ``total`` must match the header exactly and stay under
    ``max_bytes``; the HMAC must verify. Anything else raises ``Rejected`` with the reason.
    """
    start = len(MAGIC) + _PREFIX.size
    if total > max_bytes:
        raise Rejected(f"{total} bytes, over the {max_bytes}-byte limit")
    prefix = read(start)
    if not prefix.startswith(MAGIC[:len(prefix)]) or not prefix:
        raise Rejected("not a cudnn_attn graph file (bad magic)")
    if len(prefix) < start or total < start + _DIGEST:
        raise Rejected(f"truncated ({total} bytes)")
    version, header_len = _PREFIX.unpack_from(prefix, len(MAGIC))
    if version != FORMAT_VERSION:
        raise Rejected(f"format version {version}, this build reads {FORMAT_VERSION}")
    if header_len > min(MAX_HEADER_BYTES, total - start - _DIGEST):
        raise Rejected(f"header length {header_len} does not fit the file ({total} bytes)")
    raw = read(header_len)
    if len(raw) != header_len:
        raise Rejected(f"truncated ({total} bytes)")
    file_env, kind, key_text, size = _parse_header(raw)
    if start + header_len + size + _DIGEST != total:
        raise Rejected(f"truncated or padded: the header promises {size} payload bytes, the file "
                       f"has {total - start - header_len - _DIGEST}; checksum mismatch")
    mismatch = _environment_mismatch(file_env, env)
    if mismatch:
        raise Rejected(mismatch)
    payload, digest = read(size), read(_DIGEST)
    if len(payload) != size or len(digest) != _DIGEST or read(1):
        raise Rejected("the file changed while it was read; checksum mismatch")
    if not signature_ok(secret, prefix + raw + payload, digest):
        raise Rejected("checksum mismatch (corrupt, truncated, or not written with this user's "
                       "cache key)")
    return kind, key_text, payload


def decode_file(data: bytes, env: dict, secret: bytes,
                max_bytes: int = 1 << 62) -> tuple[str, str, bytes]:
    """``read_file`` over bytes in memory."""
    return read_file(io.BytesIO(data).read, len(data), env, secret, max_bytes)


def deserializer(kind: str) -> Callable[[bytes], Any] | None:
    """The ``from_bytes`` registered for ``kind``, or None."""
    return _DESERIALIZERS.get(kind)
