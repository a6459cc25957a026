"""The fused neighborhood-attention kernels (``fused_attention.cu``): geometry, tiles and launches.

One kernel family serves every mask the CuPy backend runs: up to three axes, each either a NATTEN
0.21 neighborhood (kernel, stride, dilation, causal) or a 1-D band (dense, causal, sliding window;
``S_q != S_kv`` allowed). The mask travels as a *geometry table* (``cudnn_attn.model.geometry``: 3 axes x
10 int32 in ``NaAxis`` field order). Tiles are boxes of ``FUSED_QUERY_TILE`` queries /
``FUSED_KEY_TILE`` keys inside one dilation group per axis (on sm_90+ the wide kernels' 128-query
or 128-key boxes); ``tile_walk`` mirrors the kernels' tile walk in Python (re-exported here), which
is what the CPU tests check the skipping rule with. Launches go through ``launch``.

Tensors are token-major views ``[B, S, H, D]`` with any strides (last dim contiguous), so both
heads-last (NATTEN, ``bshd``) and heads-first (``bhsd``) inputs run without copies.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..core.caches import memoize
from ..model.geometry import neighborhood_table
from . import _loader, launch
from .limits import MAX_HEAD_DIM
from .tile_model import choose_tiles, dkdv_tiles, forward_tiles
from .tile_shapes import (FUSED_KEY_TILE, FUSED_QUERY_TILE, WIDE_KEY_TILE, WIDE_QUERY_TILE,
                          check_tile_sizes)
from .tile_walk import (axis_tile_list, axis_tiles, forward_tokens, group_key_range,
                        group_query_range, launch_grid, pad3)

__all__ = ["SOURCE", "DEFINES", "variants", "na_forward", "na_backward", "run_forward",
           "run_backward", "choose_tiles", "launch_grid", "head_dim_bucket", "smem_bytes",
           "forward_tokens", "pipelined", "pipelined_variants", "PIPELINED_DEFINES",
           "backward_delta", "forward_boxes", "dkdv_boxes", "WIDE_FORWARD", "WIDE_DQ", "WIDE_DKDV",
           "WIDE_KERNELS", "WIDE_DKDV_HEAD_DIMS", "wide", "wide_variants", "wide_steps",
           "group_key_range", "group_query_range", "axis_tiles", "axis_tile_list", "pad3"]

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
_NARROW = {WIDE_FORWARD: "na_fused_forward", WIDE_DQ: "na_fused_backward_dq",
           WIDE_DKDV: "na_fused_backward_dkdv"}
WIDE_MIN_ARCH = 90
# The forwards on Hopper's wgmma (``fused_hopper``, opt-in) -> the kernel each replaces.
HOPPER_FORWARDS = {"na_fused_forward_wgmma": "na_fused_forward",
                   "na_fused_forward_wide_wgmma": WIDE_FORWARD}
_QUERY_SLOT_BYTES = 32  # NaQuerySlot
_DKDV_STEP_SLOT_BYTES = 32 + 8  # NaQuerySlot, lse, delta


def _expression(kernel: str, dtype: torch.dtype, head_dim: int) -> str:
    if kernel in HOPPER_FORWARDS:
        return f"{HOPPER_FORWARDS[kernel]}<{CTYPES[dtype]}, {head_dim}, true>"
    if kernel == WIDE_DKDV:
        return f"na_fused_backward_dkdv<{CTYPES[dtype]}, {head_dim}, {WIDE_KEY_TILE}>"
    return f"{kernel}<{CTYPES[dtype]}, {head_dim}>"


def variants() -> list:
    """Every template instance this module can launch."""
    return [_loader.KernelVariant(SOURCE, _expression(k, dt, hd), f"{k}<{CTYPES[dt]},{hd}>",
                                  THREADS, smem_bytes(k, dt, hd))
            for k in KERNELS for dt in CTYPES for hd in HEAD_DIMS]


def pipelined_variants() -> list:
    """The instances of the sm_80+ pipelined build (``PIPELINED_DEFINES``)."""
    return [_loader.KernelVariant(SOURCE, _expression(k, dt, hd),
                                  f"{k}<{CTYPES[dt]},{hd}>/pipelined", THREADS,
                                  smem_bytes(k, dt, hd, pipelined=True))
            for k in KERNELS for dt in PIPELINED_DTYPES for hd in HEAD_DIMS]


def wide_variants() -> list:
    """The wide kernels' instances (forward and dQ; the pipelined build's text, sm_90+: at 32
    rows per warp their accumulators fit sm_90's register allocation but spill on sm_80's)."""
    return [_loader.KernelVariant(SOURCE, _expression(k, dt, hd),
                                  f"{k}<{CTYPES[dt]},{hd}>/pipelined", THREADS,
                                  smem_bytes(k, dt, hd, pipelined=True))
            for k in WIDE_KERNELS for dt in PIPELINED_DTYPES
            for hd in (WIDE_DKDV_HEAD_DIMS if k == WIDE_DKDV else HEAD_DIMS)]


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
    if kernel in HOPPER_FORWARDS:
        from . import fused_hopper
        return fused_hopper.smem_bytes(kernel, head_dim)
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


# ---------------------------------------------------------------------------------------------
# Launching
# ---------------------------------------------------------------------------------------------

@memoize("fallback_kernels.fused.functions")
def _function(kernel: str, dtype: torch.dtype, head_dim: int, device_index: int,
              use_pipelined: bool = False):
    """The loaded kernel, opted in to its dynamic shared memory (needed above 48 KB)."""
    from cupy.cuda import driver

    # Only this variant is compiled (its own NVRTC program): a first call pays for one kernel.
    defines, arch = PIPELINED_DEFINES if use_pipelined else DEFINES, None
    if kernel in HOPPER_FORWARDS:
        from . import fused_hopper
        defines, arch = fused_hopper.DEFINES, fused_hopper.TARGETS["sm_90"]
    fn = _loader.get_function(SOURCE, defines, _expression(kernel, dtype, head_dim), device_index,
                              arch)
    driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            smem_bytes(kernel, dtype, head_dim, use_pipelined))
    return fn


@memoize("fallback_kernels.fused.capability")
def _capability(device_index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(device_index))


def _strides(t: torch.Tensor) -> list:
    """Element strides (batch, token, head) of a [B, S, H, ...] view."""
    import numpy as np

    return [np.int64(t.stride(0)), np.int64(t.stride(1)), np.int64(t.stride(2))]


def _aligned(tensors, dtype) -> int:
    per = 16 // (2 if dtype != torch.float32 else 4)
    return int(all(t.data_ptr() % 16 == 0 and all(s % per == 0 for s in t.stride()[:3])
                   for t in tensors))


def _launch(kernel, dtype, head_dim, grid, tensors, scalars, ctx: "launch.TorchStream"):
    use_pipelined = pipelined(dtype, _capability(ctx.index))
    fn = _function(kernel, dtype, head_dim, ctx.index, use_pipelined)
    args = [launch.kernel_arg(t) for t in tensors] + list(scalars)
    fn(grid, (THREADS, 1, 1), args, shared_mem=smem_bytes(kernel, dtype, head_dim, use_pipelined),
       stream=ctx.stream)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def run_forward(q, k, v, out, lse, table, boxes, scale, softcap=0.0, rpb=None) -> None:
    """Launch the forward on token-major views: q/k/v/out ``[B, S, H, D]``, lse ``[B, S, H]``
    fp32 (any strides, last dim contiguous). ``table``: the geometry table (``geometry``);
    ``boxes`` = (query box, key box); a query box of ``WIDE_QUERY_TILE`` slots runs the wide
    forward (the pipelined build only)."""
    import numpy as np

    B, _, Hq, Dqk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    hd = head_dim_bucket(Dqk, Dv)
    qb, kb = pad3(boxes[0]), pad3(boxes[1])
    grid = launch_grid(table, qb, Hq, B, True)
    table_dev = launch.device_table(table, q.device)
    with launch.TorchStream(q.device) as ctx:
        tensors = [q, k, v, out, lse, table_dev, rpb]
        scalars = [*_strides(q), *_strides(k), *_strides(v), *_strides(out), *_strides(lse),
                np.int32(Hq), np.int32(Hkv), np.int32(Dqk), np.int32(Dv),
                *(np.int32(x) for x in qb), *(np.int32(x) for x in kb),
                np.float32(scale), np.float32(softcap or 0.0),
                np.int32(_aligned((q, k, v, out), q.dtype))]
        kernel = _query_major(WIDE_FORWARD, qb, q.dtype, ctx)
        from . import fused_hopper
        if fused_hopper.enabled(q.dtype, _capability(ctx.index), hd):
            kernel = fused_hopper.replacing(kernel)
        _launch(kernel, q.dtype, hd, grid, tensors, scalars, ctx)


def _query_major(wide_kernel: str, own_box: Sequence[int], dtype: torch.dtype,
                 ctx: "launch.TorchStream", wide_volume: int = WIDE_QUERY_TILE) -> str:
    """The kernel the block's own box names: ``wide_kernel`` for ``wide_volume`` slots
    (fp16/bf16, sm_90+, the pipelined build), its 64-slot kernel otherwise."""
    if math.prod(own_box) != wide_volume:
        return _NARROW[wide_kernel]
    if not wide(dtype, _capability(ctx.index)):
        raise ValueError(f"a {wide_volume}-slot box {tuple(own_box)} runs {wide_kernel} "
                         f"(fp16/bf16, sm_90+, the pipelined build); this launch is {dtype} on "
                         f"sm_{''.join(map(str, _capability(ctx.index)))}")
    return wide_kernel


def _key_major(key_box: Sequence[int], dtype: torch.dtype, head_dim: int,
               ctx: "launch.TorchStream") -> str:
    """dK/dV's kernel for a key box: the wide one for ``WIDE_KEY_TILE`` slots (fp16/bf16, sm_90+,
    head dims up to 64), the 64-key one otherwise."""
    if math.prod(key_box) == WIDE_KEY_TILE and head_dim not in WIDE_DKDV_HEAD_DIMS:
        raise ValueError(f"a {WIDE_KEY_TILE}-key box {tuple(key_box)} runs {WIDE_DKDV}, whose "
                         f"head dims are {WIDE_DKDV_HEAD_DIMS}; this launch has {head_dim}")
    return _query_major(WIDE_DKDV, key_box, dtype, ctx, WIDE_KEY_TILE)


def backward_delta(out: torch.Tensor, dout: torch.Tensor, like: torch.Tensor,
                   dlse: torch.Tensor | None = None) -> torch.Tensor:
    """``delta = rowsum(dout * out) - dlse`` for the backward kernels, computed on the device by
    ``na_fused_backward_delta`` (no fp32 copies of ``out``/``dout``). ``out``/``dout``:
    token-major ``[B, S, H, D_v]`` views; ``like``: the lse view ``[B, S, H]`` whose strides the
    result takes; ``dlse``: ``None`` or a ``[B, S, H]`` view of any strides. Equivalent
    PyTorch::

        delta = (dout.float() * out.float()).sum(-1) - dlse
    """
    import numpy as np

    B, S, H, Dv = out.shape
    delta = torch.empty_like(like, dtype=torch.float32)
    if delta.numel() == 0:
        return delta  # no row: no launch (a grid of 0 blocks is an error)
    if dlse is not None:
        dlse = dlse.to(torch.float32)
    rows_per_block = THREADS // 32  # one warp per (token, head) row
    grid = (-(-S * H // rows_per_block), B, 1)
    with launch.TorchStream(out.device) as ctx:
        _launch("na_fused_backward_delta", out.dtype, head_dim_bucket(Dv, Dv), grid,
                [out, dout, dlse, delta],
                [*_strides(out), *_strides(dout), *_strides(delta),
                 *(_strides(dlse) if dlse is not None else [np.int64(0)] * 3),
                 np.int32(S), np.int32(H), np.int32(Dv)], ctx)
    return delta


def run_backward(q, k, v, dout, lse, delta, dq, dk, dv, table, boxes, scale,
                 softcap=0.0, dq_boxes=None) -> None:
    """Launch dQ and dK/dV on token-major views (see ``run_forward``); ``delta`` like ``lse``.
    ``boxes``: dK/dV's (query box, key box), 64-query boxes, where a key box of
    ``WIDE_KEY_TILE`` slots runs the wide dK/dV (``dkdv_boxes``); ``dq_boxes``: dQ's (default
    ``boxes``), where a query box of ``WIDE_QUERY_TILE`` slots runs the wide dQ (the forward's
    boxes, ``forward_boxes``). Every gradient row is written by one block: no atomics."""
    import numpy as np

    B, _, Hq, Dqk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    hd = head_dim_bucket(Dqk, Dv)
    if math.prod(boxes[0]) != FUSED_QUERY_TILE:
        raise ValueError(f"dK/dV walks {FUSED_QUERY_TILE}-query boxes, got {tuple(boxes[0])}")
    dq_boxes = boxes if dq_boxes is None else dq_boxes

    def tail(pair):
        return [np.int32(Hq), np.int32(Hkv), np.int32(Dqk), np.int32(Dv),
                *(np.int32(x) for x in pad3(pair[0])), *(np.int32(x) for x in pad3(pair[1])),
                np.float32(scale), np.float32(softcap or 0.0),
                np.int32(_aligned((q, k, v, dout, dq, dk, dv), q.dtype))]

    common = [*_strides(q), *_strides(k), *_strides(v), *_strides(dout)]
    table_dev = launch.device_table(table, q.device)
    # Only dimensions longer than 1 are indexed, so only their strides must agree (torch keeps
    # any stride on a size-1 dimension, e.g. one query head).
    if any(a != b for a, b, n in zip(delta.stride(), lse.stride(), lse.shape) if n > 1):
        raise ValueError("delta must have lse's strides")
    with launch.TorchStream(q.device) as ctx:
        grid = launch_grid(table, pad3(dq_boxes[0]), Hq, B, True)
        _launch(_query_major(WIDE_DQ, dq_boxes[0], q.dtype, ctx), q.dtype, hd, grid,
                [q, k, v, dout, lse, delta, dq, table_dev],
                [*common, *_strides(dq), *_strides(lse), *tail(dq_boxes)], ctx)
        grid = launch_grid(table, pad3(boxes[1]), Hkv, B, False)
        _launch(_key_major(boxes[1], q.dtype, hd, ctx), q.dtype, hd, grid,
                [q, k, v, dout, lse, delta, dk, dv, table_dev],
                [*common, *_strides(dk), *_strides(dv), *_strides(lse), *tail(boxes)], ctx)


# ---------------------------------------------------------------------------------------------
# NATTEN-style entry points (heads-last), used by the op layer and the neighborhood API
# ---------------------------------------------------------------------------------------------

def _table_for(shape, kernel_size, stride, dilation, is_causal) -> tuple[int, ...]:
    return tuple(neighborhood_table(shape, kernel_size, stride, dilation,
                                    tuple(bool(c) for c in is_causal)))


def _tokens(t: torch.Tensor, rank: int, name: str) -> torch.Tensor:
    """[B, *spatial, H, D] -> [B, S, H, D] view (a copy only if spatial dims do not flatten)."""
    if not isinstance(t, torch.Tensor) or t.dim() != rank + 3:
        raise ValueError(f"{name} must be a [B, *spatial ({rank} dims), H, D] tensor, got "
                         f"{getattr(t, 'shape', t)}")
    if not t.is_cuda:
        raise ValueError(f"{name} must be a CUDA tensor for the fused kernels, got {t.device}")
    flat = t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1])
    return _last_contiguous(flat)


def forward_boxes(table: Sequence[int], rank: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The query-major kernels' (forward and dQ) default boxes on ``device``:
    ``tile_model.forward_tiles`` (which may name the wide kernels) where they can run
    (``wide``), else :func:`choose_tiles`."""
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else 0)
    if wide(dtype, _capability(index)):
        return forward_tiles(tuple(table), rank)
    return choose_tiles(tuple(table), rank)


def dkdv_boxes(table: Sequence[int], rank: int, dtype: torch.dtype, head_dim: int,
               device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """dK/dV's default boxes on ``device``: ``tile_model.dkdv_tiles`` (which may name the wide
    dK/dV) where it can run (``wide`` and a head dim bucket in ``WIDE_DKDV_HEAD_DIMS``), else
    :func:`choose_tiles`."""
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else 0)
    if wide(dtype, _capability(index)) and head_dim in WIDE_DKDV_HEAD_DIMS:
        return dkdv_tiles(tuple(table), rank)
    return choose_tiles(tuple(table), rank)


def _boxes_for(rank, head_dim, dtype, table, query_tile, key_tile, device=None):
    if query_tile is None and key_tile is None:
        if device is not None:
            return forward_boxes(table, rank, dtype, device)
        return choose_tiles(tuple(table), rank)
    default = choose_tiles(tuple(table), rank)
    return check_tile_sizes(rank, head_dim, dtype,
                            default[0] if query_tile is None else query_tile,
                            default[1] if key_tile is None else key_tile)


def na_forward(query, key, value, *, kernel_size, stride, dilation, is_causal, scale, rpb=None,
               query_tile=None, key_tile=None, out=None, lse=None, softcap=None):
    """Fused neighborhood attention forward on CUDA, heads-last.

    ``query [B, *spatial, H, D]``, ``key [B, *spatial, H_kv, D]``, ``value [B, *spatial, H_kv,
    D_v]`` -> ``(out [B, *spatial, H, D_v], lse [B, *spatial, H] fp32)``; tuples are rank-sized.
    ``rpb``: fp32 ``[H, 2k0-1, ...]`` added after scaling (odd kernels, non-causal). ``out`` /
    ``lse`` are written in place when given. Equivalent PyTorch (1-D)::

        s = scale * q @ k^T  (+ rpb[h, j - i + k - 1]); s[~neighborhood] = -inf
        lse = s.logsumexp(-1); out = softmax(s) @ v
    """
    rank = len(kernel_size)
    spatial = tuple(query.shape[1:1 + rank])
    q, k, v = (_tokens(t, rank, n) for t, n in ((query, "query"), (key, "key"), (value, "value")))
    if q.dtype not in CTYPES or not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query/key/value must share a dtype among float32/float16/bfloat16, got "
                        f"{query.dtype}, {key.dtype}, {value.dtype}")
    table = _table_for(spatial, kernel_size, stride, dilation, is_causal)
    boxes = _boxes_for(rank, max(q.shape[-1], v.shape[-1]), q.dtype, table, query_tile,
                       key_tile, q.device)
    B, _, H, _ = q.shape
    out_shape = (*query.shape[:-1], value.shape[-1])
    if out is None:
        out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
    elif tuple(out.shape) != out_shape or out.dtype != query.dtype:
        raise ValueError(f"out must be a {query.dtype} tensor of shape {out_shape}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if lse is None:
        lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
    elif tuple(lse.shape) != tuple(query.shape[:-1]) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be a float32 tensor of shape {tuple(query.shape[:-1])}, got "
                         f"{lse.dtype} {tuple(lse.shape)}")
    o4 = out.view(B, -1, H, out.shape[-1])
    l3 = lse.view(B, -1, H)
    if rpb is not None:
        rpb = rpb.detach().to(torch.float32).contiguous()
    run_forward(q, k, v, o4, l3, table, boxes, scale, softcap or 0.0, rpb)
    return out, lse


def na_backward(query, key, value, out, lse, dout, *, kernel_size, stride, dilation, is_causal,
                scale, query_tile=None, key_tile=None, softcap=None):
    """Gradients ``(dq, dk, dv)`` of :func:`na_forward` (same layouts) from its saved ``lse``.

    Deterministic (no atomics). Equivalent PyTorch: autograd through the forward's formula.
    """
    rank = len(kernel_size)
    spatial = tuple(query.shape[1:1 + rank])
    q, k, v = (_tokens(t, rank, n) for t, n in ((query, "query"), (key, "key"), (value, "value")))
    o4, do4 = _tokens(out, rank, "out"), _tokens(dout, rank, "dout")
    table = _table_for(spatial, kernel_size, stride, dilation, is_causal)
    head_dim = max(q.shape[-1], v.shape[-1])
    # dQ takes the forward's boxes, dK/dV its own (either maybe a wide kernel's).
    dq_boxes = _boxes_for(rank, head_dim, q.dtype, table, query_tile, key_tile, q.device)
    boxes = (dkdv_boxes(table, rank, q.dtype, head_dim_bucket(q.shape[-1], v.shape[-1]), q.device)
             if query_tile is None and key_tile is None else dq_boxes)
    B, _, H, _ = q.shape
    l3 = lse.reshape(B, -1, H).to(torch.float32).contiguous()
    delta = backward_delta(o4, do4, l3)
    dq = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    dk = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    dv = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    run_backward(q, k, v, do4, l3, delta, dq.view(q.shape), dk.view(k.shape), dv.view(v.shape),
                 table, boxes, scale, softcap or 0.0, dq_boxes)
    return dq, dk, dv
