"""Handing torch tensors to the CuPy kernels: DLPack, torch's current stream, device tables.

One policy for every launch of the package: the kernel goes on torch's **current stream** of the
tensors' device, so it is ordered with the surrounding torch work without any extra
synchronisation; tensors cross to CuPy through DLPack (no copy); geometry tables are uploaded
once per (table, device) and cached.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..core.caches import LRU

__all__ = ["kernel_arg", "TorchStream", "device_table", "device_index"]

_TABLES = LRU("fallback_kernels.device_tables", 256)


def device_index(device) -> int:
    """The CUDA ordinal of ``device`` (torch's current device when it has none)."""
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def kernel_arg(t: Optional[torch.Tensor]):
    """A kernel pointer argument: the tensor as a CuPy array via DLPack, or a null pointer for
    ``None``. DLPack refuses tensors that require grad, so a detached view (same memory) crosses;
    CuPy has no bfloat16, so 16-bit tensors cross as int16 (the kernels only see a pointer)."""
    import cupy
    import numpy as np

    if t is None:
        return np.uint64(0)
    t = t.detach()
    if t.element_size() == 2:
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


def _cupy_stream(cupy, torch_stream, index: int):
    # CuPy 14 deprecates ExternalStream for the CUDA stream protocol, which torch streams speak.
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
        return from_external(torch_stream)
    return cupy.cuda.ExternalStream(torch_stream.cuda_stream, index)


class TorchStream:
    """Context: CuPy's current device and stream set to torch's current stream of ``device``,
    so DLPack exchange and launches are ordered with the surrounding torch work. ``index`` is the
    device ordinal, ``stream`` the CuPy stream to launch on."""

    def __init__(self, device):
        import cupy

        self.index = device_index(device)
        self._device = cupy.cuda.Device(self.index)
        self.stream = _cupy_stream(cupy, torch.cuda.current_stream(self.index), self.index)

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
    """``table`` as int32 on ``device``, uploaded once per (table, device)."""
    table, device = tuple(int(x) for x in table), torch.device(device)
    return _TABLES.get_or_create((table, str(device)), lambda: _upload(table, device))
