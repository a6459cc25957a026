"""The Hopper build of the fused forwards (wgmma), as a kernel module for ``compile_all``.

``na_fused_forward<T, HD, true>`` and ``na_fused_forward_wide<T, HD, true>``: the 64-query and the
128-query (wide) forwards with both products, Q K^T and P V, on ``wgmma.mma_async`` (warpgroup
MMA) instead of mma.sync. K and V stream through the cp.async ring in the 128-byte-swizzled
layout the tensor cores read through descriptors (no ldmatrix); P comes from the accumulator
registers; Q from the warps' A fragments (64-query forward: one m64 product per block) or from
swizzled shared memory (wide: two m64 halves). The text is the pipelined build's with
``NA_WGMMA=1``, compiled for ``sm_90a`` (wgmma exists on sm_90 only: the cubins run on H100/H200,
not on Blackwell); fp16/bf16 at head dims 64 and 128.

Opt-in (``CUDNN_ATTN_NA_WGMMA=1``) until a GPU run has proven it: the host emulation checks it
against the oracle (``tests/host_cuda``: the wgmma descriptors and swizzle as the PTX ISA
describes them), but no H100/H200 has executed it yet. ``fused.run_forward`` launches the wgmma
twin of the forward the tile model chose when ``enabled``; the backward is unchanged (it reads
the same lse).
"""

from __future__ import annotations

import os

import torch

from . import _loader
from .fused import (CTYPES, HOPPER_FORWARDS, PIPELINED_DEFINES, PIPELINED_DTYPES, SOURCE, THREADS,
                    WIDE_FORWARD, _expression, forward_stages, pipelined, wide_steps)
from .tile_shapes import FUSED_KEY_TILE, FUSED_QUERY_TILE, WIDE_QUERY_TILE

__all__ = ["SOURCE", "DEFINES", "MIN_ARCH", "TARGETS", "HEAD_DIMS", "ENV", "variants", "enabled",
           "replacing", "smem_bytes"]

DEFINES = {**PIPELINED_DEFINES, "NA_WGMMA": 1}
MIN_ARCH = 90
# Device arch -> the arch this module is compiled for (wgmma needs the arch-specific target).
TARGETS = {"sm_90": "sm_90a"}
HEAD_DIMS = (64, 128)
ENV = "CUDNN_ATTN_NA_WGMMA"
_QUERY_SLOT_BYTES = 32  # NaQuerySlot
_ALIGN_SLACK = 1024  # the swizzled atoms are 1024-byte aligned inside the dynamic buffer
_WGMMA_TWIN = {replaced: kernel for kernel, replaced in HOPPER_FORWARDS.items()}


def replacing(kernel: str) -> str:
    """The wgmma twin of the forward ``kernel`` (64-query or wide)."""
    return _WGMMA_TWIN[kernel]


def smem_bytes(kernel: str, head_dim: int) -> int:
    """Dynamic shared memory of a wgmma forward: its Q tile (the 64-query kernel keeps Q's padded
    rows, ldmatrix reads them; the wide one swizzles them), the (K, V) ring unpadded (the swizzle
    spreads the banks), the query slots, and the alignment slack."""
    if HOPPER_FORWARDS[kernel] == WIDE_FORWARD:
        key_step, stages = wide_steps(WIDE_FORWARD, head_dim)
        return ((WIDE_QUERY_TILE + 2 * stages * key_step) * head_dim * 2
                + _QUERY_SLOT_BYTES * WIDE_QUERY_TILE + _ALIGN_SLACK)
    return ((FUSED_QUERY_TILE * (head_dim + 8) + 2 * forward_stages(head_dim) * FUSED_KEY_TILE
             * head_dim) * 2 + _QUERY_SLOT_BYTES * FUSED_QUERY_TILE + _ALIGN_SLACK)


def variants() -> list:
    return [_loader.KernelVariant(SOURCE, _expression(k, dt, hd), f"{k}<{CTYPES[dt]},{hd}>",
                                  THREADS, smem_bytes(k, hd))
            for k in HOPPER_FORWARDS for dt in PIPELINED_DTYPES for hd in HEAD_DIMS]


def enabled(dtype: torch.dtype, capability: tuple[int, int], head_dim: int) -> bool:
    """Whether a forward of ``dtype`` at the compiled ``head_dim`` runs on wgmma: opted in with
    ``CUDNN_ATTN_NA_WGMMA=1``, an sm_90 device, the pipelined build (fp16/bf16), head dim 64 or
    128."""
    return (os.environ.get(ENV, "0").strip() == "1" and tuple(capability) == (9, 0)
            and pipelined(dtype, capability) and head_dim in HEAD_DIMS)
