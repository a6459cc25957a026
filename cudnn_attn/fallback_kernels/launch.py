"""Handing torch tensors to the CuPy kernels: pointers, torch's current stream, device tables.

One policy for every launch of the package: the kernel goes on torch's **current stream** of the
tensors' device, so it is ordered with the surrounding torch work without any extra
synchronisation; tensors cross as their device addresses (no copy, no DLPack capsule: the
kernels only see pointers), and the caller keeps each tensor alive until its launch is enqueued
(torch's allocator orders any later reuse of that memory on the same stream); geometry tables
are uploaded once per (table, device) and cached.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..core.caches import LRU
from ..core.probe import raw_stream

__all__ = ["kernel_arg", "TorchStream", "device_table", "device_index"]

_TABLES = LRU("fallback_kernels.device_tables", 256)
# (device ordinal, raw CUDA stream) -> the CuPy stream wrapping that torch stream
_STREAMS = LRU("fallback_kernels.cupy_streams", 64)


def device_index(device) -> int:
    """The CUDA ordinal of ``device`` (torch's current device when it has none)."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def kernel_arg(t: Optional[torch.Tensor]):
    """A kernel pointer argument: the tensor's device address as a 64-bit integer (``None``: a
    null pointer). Why not a CuPy array through DLPack: a launch of the fused backward passes
    about 25 tensors, and each crossing built a capsule and an array on the host (issue 37's
    H200 run: small neighborhood calls spent 2-5x their kernels' time on the host), where
    the kernels read nothing but the address. The tensor must outlive the launch call."""
    import numpy as np

    return np.uint64(0 if t is None else t.data_ptr())


def _cupy_stream(cupy, torch_stream, index: int):
    # CuPy 14 deprecates ExternalStream for the CUDA stream protocol, which torch streams speak.
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
        return from_external(torch_stream)
    return cupy.cuda.ExternalStream(torch_stream.cuda_stream, index)


class TorchStream:
    """Context: CuPy's current device and stream set to torch's current stream of ``device``,
    so launches are ordered with the surrounding torch work. ``index`` is the device ordinal,
    ``stream`` the CuPy stream to launch on: one CuPy object per torch stream, kept (its
    context is per thread in CuPy); the device context is made per call (a CuPy ``Device``
    keeps one stack of previous devices per object, which two threads must not share)."""

    def __init__(self, device):
        import cupy

        self.index = index = device_index(device)
        self._device = cupy.cuda.Device(index)
        key = (index, raw_stream(index))  # torch's Stream object only on a miss
        self.stream = _STREAMS.get_or_create(
            key, lambda: _cupy_stream(cupy, torch.cuda.current_stream(index), index))

    def __enter__(self) -> "TorchStream":
        self._device.__enter__()
        self.stream.__enter__()
        return self

    def __exit__(self, *exc):
        self.stream.__exit__(*exc)
        self._device.__exit__(*exc)
        return False


def _upload(table: tuple, device: torch.device) -> torch.Tensor:
    # A blocking host-to-device copy: the table is on the device when this returns, visible to
    # kernels on any stream.
    return torch.tensor(table, dtype=torch.int32, device=device)


def device_table(table: Sequence[int], device) -> torch.Tensor:
    """``table`` as int32 on ``device``, uploaded once per (table, device) (a plan's own table,
    a tuple, is its key as it stands: no conversion per call)."""
    key = (table if isinstance(table, tuple) else tuple(int(x) for x in table), device)
    return _TABLES.get_or_create(key, lambda: _upload(tuple(int(x) for x in key[0]),
                                                      torch.device(device)))
