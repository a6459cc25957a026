"""Described devices: the GPUs cuDNN can plan for on a machine without one.

A ``DeviceTarget`` is a device description in the JSON the cuDNN frontend's
``create_device_properties`` reads (``CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION``: SM count,
shared memory, registers, clocks, ``deviceVer`` = 100 * major + 10 * minor, ``deviceName``, ...).
Four ship with the package (``devices/*.json``), from the cards' published ``cudaDeviceProp``:

=========  =========================  =====  ====
name       ``deviceName``             sm     SMs
=========  =========================  =====  ====
``a100``   NVIDIA A100-SXM4-80GB      sm_80  108
``h100``   NVIDIA H100 80GB HBM3      sm_90  132
``h200``   NVIDIA H200                sm_90  132
``b200``   NVIDIA B200                sm_100 148
=========  =========================  =====  ====

Any other card: ``cudnn.create_device_properties(<ordinal>).serialize()`` on that card writes its
description; ``target(path)`` reads it. Nothing here imports ``cudnn`` until ``properties()``.

    h100 = target("h100")
    h100.sm, h100.sm_count, h100.environment()   # 90, 132, {"gpu_name": ..., ...}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from ..core.caches import memoize

__all__ = ["DeviceTarget", "SHIPPED_TARGETS", "REQUIRED_KEYS", "target", "shipped_targets"]

DEVICES_DIR = Path(__file__).resolve().parent / "devices"
SHIPPED_TARGETS = ("a100", "h100", "h200", "b200")
# The keys cuDNN 9.28 reads from a description (it rejects one that lacks any of them).
REQUIRED_KEYS = frozenset({
    "maxGridSize", "maxBlockSize", "regsPerBlock", "multiProcessorCount", "smCountOrigin",
    "warpSize", "maxSharedMemoryPerBlock", "maxSharedMemoryPerBlockOptin",
    "oversizedSharedMemoryPerBlock", "reservedSharedMemoryPerBlock", "maxRegistersPerSM",
    "maxCtasPerSM", "maxThreadsPerBlock", "maxThreadsPerSM", "pciDeviceId", "isTccDriver",
    "supportCoopLaunch", "totalGlobalMem", "smClockRateKHz", "memClockRateKHz", "memoryBusWidth",
    "l2CacheSize", "cudaDeviceId", "deviceVer", "driverVer", "deviceName"})


@dataclass(frozen=True)
class DeviceTarget:
    """One described device. ``description`` is the JSON text handed to cuDNN; ``name`` a short
    label (the shipped name or the file's stem); the rest is read from the description."""

    name: str
    description: str = field(repr=False)
    device_name: str = ""
    sm: int = 0
    sm_count: int = 0

    @classmethod
    def from_json(cls, text: str, name: str = "custom") -> "DeviceTarget":
        """A target from a description's JSON text; ``ValueError`` naming what is wrong."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"device description {name!r} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"device description {name!r} must be a JSON object, got "
                             f"{type(data).__name__}")
        missing = sorted(REQUIRED_KEYS - set(data))
        if missing:
            raise ValueError(f"device description {name!r} lacks the keys cuDNN reads: {missing}")
        version, sms = data["deviceVer"], data["multiProcessorCount"]
        if not (isinstance(version, int) and version >= 100 and isinstance(sms, int) and sms > 0):
            raise ValueError(f"device description {name!r}: deviceVer (100 * major + 10 * minor) "
                             f"and multiProcessorCount must be positive ints, got {version!r}, "
                             f"{sms!r}")
        if data["smCountOrigin"] != 0:
            raise ValueError(f"device description {name!r}: smCountOrigin must be 0 (the full "
                             f"device), got {data['smCountOrigin']!r}")
        return cls(name=name, description=text, device_name=str(data["deviceName"]),
                   sm=version // 10, sm_count=sms)

    @property
    def compute_capability(self) -> str:
        """``"major.minor"``, as ``graph_cache``'s environment writes it."""
        return f"{self.sm // 10}.{self.sm % 10}"

    def environment(self) -> dict:
        """``graph_cache``'s environment of this device with this machine's cuDNN: the header a
        cache file warmed for it carries, and what a GPU must match to use that file."""
        from .cache_files import cudnn_versions

        backend, frontend = cudnn_versions()
        return {"gpu_name": self.device_name, "compute_capability": self.compute_capability,
                "sm_count": self.sm_count, "cudnn_backend": backend, "cudnn_frontend": frontend}

    def properties(self):
        """cuDNN's ``device_properties`` object of the description (needs the driver, or its
        stand-in: see ``driver_standin``)."""
        return _properties(self.description)


@memoize("cudnn.device_properties", 16)
def _properties(description: str):
    import cudnn

    return cudnn.create_device_properties(description)


def shipped_targets() -> dict[str, DeviceTarget]:
    """The shipped descriptions by name."""
    return {name: target(name) for name in SHIPPED_TARGETS}


@memoize("cudnn.device_targets", 32)
def _load(path: str, name: str) -> DeviceTarget:
    with open(path, encoding="utf-8") as fh:
        return DeviceTarget.from_json(fh.read(), name)


def target(spec: Union[str, os.PathLike, DeviceTarget]) -> DeviceTarget:
    """A ``DeviceTarget`` from a shipped name (``"a100"``, ``"h100"``, ``"h200"``, ``"b200"``;
    any case), the path of a description JSON, or a target (returned as is)."""
    if isinstance(spec, DeviceTarget):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"target must be a device name, a JSON path or a DeviceTarget, got "
                        f"{type(spec).__name__}")
    text = os.fspath(spec)
    if text.lower() in SHIPPED_TARGETS:
        return _load(str(DEVICES_DIR / f"{text.lower()}.json"), text.lower())
    if not os.path.isfile(text):
        raise ValueError(f"target {text!r} is neither a shipped device ({', '.join(SHIPPED_TARGETS)})"
                         f" nor a device description file")
    return _load(os.path.abspath(text), Path(text).stem)
