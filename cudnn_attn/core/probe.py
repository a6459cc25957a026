"""Cheap, cached facts about the machine that backends turn into availability reasons."""

from __future__ import annotations

import importlib.util

import torch

from .caches import memoize


def module_missing(module: str, extra_hint: str) -> list[str]:
    """A reason if ``module`` cannot be imported (checked without importing it); a new list
    on each call (the look-up itself is memoized)."""
    return list(_module_missing(module, extra_hint))


@memoize("probe.module_missing")
def _module_missing(module: str, extra_hint: str) -> tuple:
    if importlib.util.find_spec(module) is None:
        return (f"{module} is not installed (pip install 'cudnn-attn[{extra_hint}]')",)
    return ()


def cuda_missing() -> list[str]:
    if not torch.cuda.is_available():
        return ["no CUDA device is available to torch"]
    return []


_CUDA_BUILT = torch.backends.cuda.is_built()


def capturing() -> bool:
    """Whether torch's current CUDA stream is being captured into a CUDA graph (the C function
    behind ``torch.cuda.is_current_stream_capturing``: one Python frame less per call)."""
    if not _CUDA_BUILT:  # a torch built without CUDA captures nothing (and its C stub raises)
        return False
    try:
        return torch._C._cuda_isCurrentStreamCapturing()
    except (AttributeError, RuntimeError):
        return False


# What a CUDA-graph capture read from the package's caches (device constants, lengths): the
# captured graph reads the same memory on every replay, so it must outlive a cache's eviction,
# which would hand it back to the allocator. Kept for the process's life; few and small.
_CAPTURED: dict = {}


def kept_if_captured(value):
    """``value``, kept alive for the process's life (its tensors with it) when torch's current
    stream is being captured; returned as is."""
    if capturing():
        _CAPTURED[id(value)] = value
    return value


def raw_stream(index: int) -> int:
    """The raw ``cudaStream_t`` of torch's current stream on CUDA device ``index``, without
    building a ``torch.cuda.Stream`` object (the hot paths key their per-stream state by it)."""
    try:
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:
        return torch.cuda.current_stream(index).cuda_stream
