"""The fused neighborhood kernels' build catalogue: what ``fused_attention.cu`` is compiled into.

The kernels (names, template instances, head-dim buckets), the builds of the one source (plain;
the sm_80+ pipelined one; its sm_90+ wide kernels; the opt-in sm_90a wgmma forwards), which
build a launch of a dtype on a device uses, the rings' steps and stages, and each variant's
dynamic shared memory, mirroring the carve-ups in the .cu. ``fused`` launches; the kernel
modules (``fused_pipelined``, ``fused_wide``, ``fused_hopper``) list these variants for
``compile_all``.
"""

from __future__ import annotations

import torch

from . import _loader
from .limits import MAX_HEAD_DIM
from .tile_shapes import FUSED_KEY_TILE, FUSED_QUERY_TILE, WIDE_KEY_TILE, WIDE_QUERY_TILE

__all__ = ["SOURCE", "DEFINES", "KERNELS", "CTYPES", "HEAD_DIMS", "THREADS", "PIPELINED_DEFINES",
           "PIPELINED_MIN_ARCH", "PIPELINED_DTYPES", "WIDE_FORWARD", "WIDE_DQ", "WIDE_DKDV",
           "WIDE_DKDV_HEAD_DIMS", "WIDE_KERNELS", "NARROW_OF", "WIDE_MIN_ARCH",
           "HOPPER_TWINS", "HOPPER_DEFINES", "HOPPER_TARGETS", "HOPPER_HEAD_DIMS",
           "HOPPER_ENV", "expression", "variants", "pipelined_variants", "wide_variants",
           "hopper_variants", "hopper", "hopper_twin", "wide", "pipelined", "head_dim_bucket",
           "forward_stages", "dkdv_steps", "wide_steps", "smem_bytes"]

SOURCE = "fused_attention.cu"
DEFINES = {"QUERY_TILE": FUSED_QUERY_TILE, "KEY_TILE": FUSED_KEY_TILE}
KERNELS = ("na_fused_forward", "na_fused_backward_dq", "na_fused_backward_dkdv",
           "na_fused_backward_delta")
CTYPES = {torch.float32: "float", torch.float16: "na_half", torch.bfloat16: "na_bf16"}
HEAD_DIMS = (32, 64, 128)
THREADS = 128
# Other-side rows staged per step (NaChunk in the .cu): keys (forward, dQ) or queries (dK/dV).
_CHUNK = {"na_fused_forward": (64, 32), "na_fused_backward_dq": (64, 16),
          "na_fused_backward_dkdv": (32, 16)}  # (16-bit, fp32)
_OWN_ROWS = {"na_fused_forward": 1, "na_fused_backward_dq": 2, "na_fused_backward_dkdv": 2}
_META_BYTES = {"na_fused_forward": 896 * 4, "na_fused_backward_dq": 704 * 4,
               "na_fused_backward_dkdv": 832 * 4}
_SMEM_LIMIT = 99 * 1024

# The sm_80+ build of the same source (NA_PIPELINED in the .cu): every kernel keeps its geometry in
# each thread's registers and streams the other side through a ring of cp.async stages, ldmatrix
# fragment loads, one barrier per step. The query-major kernels (forward, dQ) ring K/V tiles
# (``forward_stages``); dK/dV rings (query tile, head, chunk) steps of Q, dO, query slots, lse
# and delta (``dkdv_steps``). fp16/bf16 only (fp32 keeps its exact FMA path); chosen by
# ``pipelined``.
PIPELINED_DEFINES = {**DEFINES, "NA_PIPELINED": 1}
PIPELINED_MIN_ARCH = 80
PIPELINED_DTYPES = (torch.float16, torch.bfloat16)
_QUERY_MAJOR = ("na_fused_forward", "na_fused_backward_dq")
# The pipelined build's query-major kernels over 128-query boxes (4 warps of 32 rows: every K/V
# fragment feeds two mma): the forward and dQ, launched when their query box holds
# WIDE_QUERY_TILE slots (``tile_model.forward_tiles``, one rule for both).
WIDE_FORWARD = "na_fused_forward_wide"
WIDE_DQ = "na_fused_backward_dq_wide"
# dK/dV over 128-key boxes (4 warps of 32 key rows: every Q/dO fragment feeds two mma), the
# template instance ``na_fused_backward_dkdv<T, HD, 128>``; head dims up to 64 (at 128 the dK and
# dV accumulators of 32 rows alone would fill the register file). ``tile_model.dkdv_tiles``.
WIDE_DKDV = "na_fused_backward_dkdv_wide"
WIDE_DKDV_HEAD_DIMS = (32, 64)
WIDE_KERNELS = (WIDE_FORWARD, WIDE_DQ, WIDE_DKDV)
NARROW_OF = {WIDE_FORWARD: "na_fused_forward", WIDE_DQ: "na_fused_backward_dq",
           WIDE_DKDV: "na_fused_backward_dkdv"}
WIDE_MIN_ARCH = 90
# The kernels on Hopper's wgmma (``fused_hopper``, opt-in) -> the kernel each replaces: the
# forwards and dQ (64-query and wide) and the 64-key dK/dV.
HOPPER_TWINS = {"na_fused_forward_wgmma": "na_fused_forward",
                "na_fused_forward_wide_wgmma": WIDE_FORWARD,
                "na_fused_backward_dq_wgmma": "na_fused_backward_dq",
                "na_fused_backward_dq_wide_wgmma": WIDE_DQ,
                "na_fused_backward_dkdv_wgmma": "na_fused_backward_dkdv"}
HOPPER_DEFINES = {**PIPELINED_DEFINES, "NA_WGMMA": 1}
HOPPER_TARGETS = {"sm_90": "sm_90a"}  # device arch -> compile target (wgmma is arch-specific)
HOPPER_HEAD_DIMS = (64, 128)
HOPPER_ENV = "CUDNN_ATTN_NA_WGMMA"
_ALIGN_SLACK = 1024  # the swizzled atoms are 1024-byte aligned inside the dynamic buffer
_QUERY_SLOT_BYTES = 32  # NaQuerySlot
_DKDV_STEP_SLOT_BYTES = 32 + 8  # NaQuerySlot, lse, delta


def expression(kernel: str, dtype: torch.dtype, head_dim: int) -> str:
    if kernel in HOPPER_TWINS:
        keys = f", {FUSED_KEY_TILE}" if HOPPER_TWINS[kernel] == "na_fused_backward_dkdv" else ""
        return f"{HOPPER_TWINS[kernel]}<{CTYPES[dtype]}, {head_dim}{keys}, true>"
    if kernel == WIDE_DKDV:
        return f"na_fused_backward_dkdv<{CTYPES[dtype]}, {head_dim}, {WIDE_KEY_TILE}>"
    return f"{kernel}<{CTYPES[dtype]}, {head_dim}>"


def variants() -> list:
    """Every template instance this module can launch."""
    return [_loader.KernelVariant(SOURCE, expression(k, dt, hd), f"{k}<{CTYPES[dt]},{hd}>",
                                  THREADS, smem_bytes(k, dt, hd))
            for k in KERNELS for dt in CTYPES for hd in HEAD_DIMS]


def pipelined_variants() -> list:
    """The instances of the sm_80+ pipelined build (``PIPELINED_DEFINES``)."""
    return [_loader.KernelVariant(SOURCE, expression(k, dt, hd),
                                  f"{k}<{CTYPES[dt]},{hd}>/pipelined", THREADS,
                                  smem_bytes(k, dt, hd, pipelined=True))
            for k in KERNELS for dt in PIPELINED_DTYPES for hd in HEAD_DIMS]


def wide_variants() -> list:
    """The wide kernels' instances (forward and dQ; the pipelined build's text, sm_90+: at 32
    rows per warp their accumulators fit sm_90's register allocation but spill on sm_80's)."""
    return [_loader.KernelVariant(SOURCE, expression(k, dt, hd),
                                  f"{k}<{CTYPES[dt]},{hd}>/pipelined", THREADS,
                                  smem_bytes(k, dt, hd, pipelined=True))
            for k in WIDE_KERNELS for dt in PIPELINED_DTYPES
            for hd in (WIDE_DKDV_HEAD_DIMS if k == WIDE_DKDV else HEAD_DIMS)]


def hopper_variants() -> list:
    """The wgmma kernels' instances (``HOPPER_DEFINES``, compiled for sm_90a)."""
    return [_loader.KernelVariant(SOURCE, expression(k, dt, hd), f"{k}<{CTYPES[dt]},{hd}>",
                                  THREADS, smem_bytes(k, dt, hd, pipelined=True))
            for k in HOPPER_TWINS for dt in PIPELINED_DTYPES for hd in HOPPER_HEAD_DIMS]


def hopper(dtype: torch.dtype, capability: tuple[int, int], head_dim: int) -> bool:
    """Whether a forward, dQ or dK/dV of ``dtype`` at ``head_dim`` runs on wgmma: opted
    in with ``CUDNN_ATTN_NA_WGMMA=1``, an sm_90 device (its sm_90a cubins run nowhere else),
    the pipelined build (fp16/bf16), head dim 64 or 128."""
    import os

    return (os.environ.get(HOPPER_ENV, "0").strip() == "1" and tuple(capability) == (9, 0)
            and pipelined(dtype, capability) and head_dim in HOPPER_HEAD_DIMS)


def hopper_twin(kernel: str) -> str:
    """The wgmma twin of ``kernel`` (the forwards and dQ, 64-query and wide; the 64-key dK/dV);
    ``kernel`` itself when it has none (the wide dK/dV)."""
    return next((twin for twin, replaced in HOPPER_TWINS.items() if replaced == kernel), kernel)


def _hopper_smem_bytes(kernel: str, head_dim: int) -> int:
    """A wgmma kernel's dynamic shared memory: its own tile (the 64-query forward keeps Q's
    padded rows, ldmatrix reads them; the wide forward swizzles Q, the wide dQ dO and Q; dQ
    swizzles dO and keeps Q in the ring's last stage; dK/dV swizzles K and V), the ring unpadded (the swizzle spreads the
    banks), the query slots, and the alignment slack."""
    if HOPPER_TWINS[kernel] in (WIDE_FORWARD, WIDE_DQ):  # forward: Q; dQ: dO and Q
        key_step, stages = wide_steps(HOPPER_TWINS[kernel], head_dim)
        own = 1 if HOPPER_TWINS[kernel] == WIDE_FORWARD else 2
        total = ((own * WIDE_QUERY_TILE + 2 * stages * key_step) * head_dim * 2
                 + _QUERY_SLOT_BYTES * WIDE_QUERY_TILE + _ALIGN_SLACK)
    elif HOPPER_TWINS[kernel] == "na_fused_backward_dkdv":
        # K and V, then stages of Q and dO rows, slots, lse and delta, each stage 1024-aligned.
        qstep, stages = dkdv_steps(head_dim)
        stage = 2 * qstep * head_dim * 2 + _DKDV_STEP_SLOT_BYTES * qstep
        total = (2 * FUSED_KEY_TILE * head_dim * 2 + stages * -(-stage // 1024) * 1024
                 + _ALIGN_SLACK)
    elif HOPPER_TWINS[kernel] == "na_fused_backward_dq":
        total = ((FUSED_QUERY_TILE + 2 * forward_stages(head_dim) * FUSED_KEY_TILE) * head_dim
                 * 2 + _QUERY_SLOT_BYTES * FUSED_QUERY_TILE + _ALIGN_SLACK)
    else:
        total = ((FUSED_QUERY_TILE * (head_dim + 8)
                  + 2 * forward_stages(head_dim) * FUSED_KEY_TILE * head_dim) * 2
                 + _QUERY_SLOT_BYTES * FUSED_QUERY_TILE + _ALIGN_SLACK)
    assert total <= _SMEM_LIMIT, (kernel, head_dim, total)
    return total


def wide(dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Whether launches of ``dtype`` on a device of ``capability`` may use the wide kernels."""
    major, minor = capability
    return pipelined(dtype, capability) and major * 10 + minor >= WIDE_MIN_ARCH


def pipelined(dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Whether launches of ``dtype`` on a device of ``capability`` use the pipelined build
    (``CUDNN_ATTN_FUSED_PIPELINED=0`` keeps the plain build everywhere)."""
    import os

    if os.environ.get("CUDNN_ATTN_FUSED_PIPELINED", "1").strip() == "0":
        return False
    major, minor = capability
    return dtype in PIPELINED_DTYPES and major * 10 + minor >= PIPELINED_MIN_ARCH


def head_dim_bucket(dim_qk: int, dim_v: int) -> int:
    """The compiled head dim serving ``max(dim_qk, dim_v)`` (zero-padded in shared memory)."""
    need = max(dim_qk, dim_v)
    for hd in HEAD_DIMS:
        if need <= hd:
            return hd
    raise ValueError(f"head dims up to {MAX_HEAD_DIM} are supported, got dim_qk={dim_qk}, "
                     f"dim_v={dim_v}")


def forward_stages(head_dim: int) -> int:
    """K/V stages of the pipelined query-major kernels' cp.async ring (``NaForwardStages`` in
    the .cu): three where they fit in the 99 KB every sm_80+ device gives a block, two at head
    dim 128."""
    return 2 if head_dim >= 128 else 3


def dkdv_steps(head_dim: int, keys: int = FUSED_KEY_TILE) -> tuple[int, int]:
    """(queries per step, stages) of the pipelined dK/dV ring (``NaDkdvSteps`` in the .cu): a
    whole 64-query tile per step up to head dim 64, 32-query chunks at 128 so that three stages
    fit beside the block's K and V; two stages at 64. The wide dK/dV (``keys`` = 128): three
    stages of 64 queries at head dim 32, of 32 at 64."""
    if keys == WIDE_KEY_TILE:
        return (16 if head_dim >= 64 else 32), 3
    if head_dim >= 128:
        return 32, 3
    return 64, 2 if head_dim >= 64 else 3


def wide_steps(kernel: str, head_dim: int) -> tuple[int, int]:
    """(keys per step, stages) of a wide kernel's K/V ring (``NaWide`` / ``NaWideDq`` in the
    .cu). The forward: whole 64-key tiles, half tiles at head dim 128 (its two 32-row
    accumulators leave no registers for more). dQ holds two score-sized fragments (S and dP) per
    m16 tile beside its accumulators: 32 keys (64 spill at head dim 32), 16 at 128 (where its
    Q and dO tiles fill most of the 99 KB)."""
    if kernel == WIDE_FORWARD:
        return (32 if head_dim >= 128 else 64), 3
    if kernel == WIDE_DQ:
        return (16 if head_dim >= 128 else 32), 3
    raise ValueError(f"kernel must be one of {WIDE_KERNELS}, got {kernel!r}")


def smem_bytes(kernel: str, dtype: torch.dtype, head_dim: int, pipelined: bool = False) -> int:
    """Dynamic shared memory of one variant (mirrors the carve-up in the .cu); ``pipelined``:
    the sm_80+ build, whose query-major kernels hold a ring of K/V stages."""
    if kernel == "na_fused_backward_delta":
        return 0  # registers and shuffles only
    if kernel in HOPPER_TWINS:
        return _hopper_smem_bytes(kernel, head_dim)
    if kernel == WIDE_DKDV:
        # The 128-key box's K and V, then the ring of query steps (``dkdv_steps``).
        assert pipelined and head_dim in WIDE_DKDV_HEAD_DIMS, (kernel, head_dim)
        qstep, stages = dkdv_steps(head_dim, WIDE_KEY_TILE)
        total = (2 * WIDE_KEY_TILE * (head_dim + 8) * 2
                 + stages * (2 * qstep * (head_dim + 8) * 2 + _DKDV_STEP_SLOT_BYTES * qstep))
        assert total <= _SMEM_LIMIT, (kernel, dtype, head_dim, total)
        return total
    if kernel in WIDE_KERNELS:
        # The 128-query own tiles (forward: Q; dQ: dO and Q), the ring of (K, V) steps
        # (``wide_steps``), one record per query slot. The pipelined build only.
        key_step, stages = wide_steps(kernel, head_dim)
        own = 1 if kernel == WIDE_FORWARD else 2
        total = ((own * WIDE_QUERY_TILE + 2 * stages * key_step) * (head_dim + 8) * 2
                 + _QUERY_SLOT_BYTES * WIDE_QUERY_TILE)
        assert pipelined and total <= _SMEM_LIMIT, (kernel, dtype, head_dim, total)
        return total
    elem = 2 if dtype in (torch.float16, torch.bfloat16) else 4
    ld = head_dim + 8 if elem == 2 else head_dim
    if pipelined and kernel in _QUERY_MAJOR:
        # One own tile (forward: Q; dQ: dO, Q waiting in the last stage), the ring, then one
        # record per query slot.
        total = ((FUSED_QUERY_TILE + 2 * forward_stages(head_dim) * FUSED_KEY_TILE) * ld * elem
                 + _QUERY_SLOT_BYTES * FUSED_QUERY_TILE)
        assert total <= _SMEM_LIMIT, (kernel, dtype, head_dim, total)
        return total
    if pipelined:
        # K and V of the key box, then the ring: Q and dO rows, slots, lse and delta per stage.
        qstep, stages = dkdv_steps(head_dim)
        total = (2 * FUSED_KEY_TILE * ld * elem
                 + stages * (2 * qstep * ld * elem + _DKDV_STEP_SLOT_BYTES * qstep))
        assert total <= _SMEM_LIMIT, (kernel, dtype, head_dim, total)
        return total
    chunk = _CHUNK[kernel][0 if elem == 2 else 1]
    rows = _OWN_ROWS[kernel] * FUSED_QUERY_TILE + 2 * chunk
    total = rows * ld * elem + _META_BYTES[kernel]
    assert total <= _SMEM_LIMIT, (kernel, dtype, head_dim, total)
    return total
