"""The fused neighborhood-attention kernels (``fused_attention.cu``): geometry, tiles and launches.

One kernel family serves every mask the CuPy backend runs: up to three axes, each either a NATTEN
0.21 neighborhood (kernel, stride, dilation, causal) or a 1-D band (dense, causal, sliding window;
``S_q != S_kv`` allowed). The mask travels as a *geometry table* (``cudnn_attn.model.geometry``: 3 axes x
10 int32 in ``NaAxis`` field order). Tiles are boxes of ``FUSED_QUERY_TILE`` queries /
``FUSED_KEY_TILE`` keys inside one dilation group per axis (on sm_90+ the wide kernels' 128-query
or 128-key boxes); ``tile_walk`` mirrors the kernels' tile walk in Python (re-exported here), which
is what the CPU tests check the skipping rule with. Launches go through ``launch``.

Tensors are token-major views ``[B, S, H, D]`` with any strides (last dim contiguous), so both
heads-last (NATTEN, ``bshd``) and heads-first (``bhsd``) inputs run without copies. What the
source is compiled into (kernels, builds, which build a launch uses, shared memory per variant)
is ``fused_build``'s, re-exported here.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch

from ..core import roofline
from ..core.caches import memoize
from ..model.geometry import neighborhood_table
from . import _loader, launch
from .fused_build import (CTYPES, DEFINES, HEAD_DIMS, HOPPER_DEFINES, HOPPER_ENV, HOPPER_TWINS,
                          HOPPER_HEAD_DIMS, HOPPER_TARGETS, KERNELS, NARROW_OF, PIPELINED_DEFINES,
                          PIPELINED_DTYPES, PIPELINED_MIN_ARCH, SOURCE, THREADS, WIDE_DKDV,
                          WIDE_DKDV_HEAD_DIMS, WIDE_DQ, WIDE_FORWARD, WIDE_KERNELS,
                          WIDE_MIN_ARCH, dkdv_steps, expression, forward_stages, head_dim_bucket,
                          hopper, hopper_twin, hopper_variants, pipelined, pipelined_variants,
                          smem_bytes, variants, wide, wide_steps, wide_variants)
from .tile_model import choose_tiles, key_major_tiles, query_major_tiles
from .tile_shapes import FUSED_QUERY_TILE, WIDE_KEY_TILE, WIDE_QUERY_TILE, check_tile_sizes
from .tile_walk import (axis_tile_list, axis_tiles, forward_tokens, group_key_range,
                        group_query_range, launch_grid, pad3)

__all__ = ["SOURCE", "DEFINES", "variants", "na_forward", "na_backward", "run_forward",
           "run_backward", "choose_tiles", "launch_grid", "head_dim_bucket", "smem_bytes",
           "forward_tokens", "pipelined", "pipelined_variants", "PIPELINED_DEFINES",
           "backward_delta", "forward_boxes", "dkdv_boxes", "WIDE_FORWARD", "WIDE_DQ", "WIDE_DKDV",
           "WIDE_KERNELS", "WIDE_DKDV_HEAD_DIMS", "wide", "wide_variants", "wide_steps",
           "group_key_range", "group_query_range", "axis_tiles", "axis_tile_list", "pad3",
           # the build catalogue (``fused_build``), re-exported beside the launches
           "KERNELS", "CTYPES", "HEAD_DIMS", "THREADS", "PIPELINED_DTYPES", "PIPELINED_MIN_ARCH",
           "WIDE_MIN_ARCH", "NARROW_OF", "HOPPER_TWINS", "HOPPER_DEFINES", "HOPPER_TARGETS",
           "HOPPER_HEAD_DIMS", "HOPPER_ENV", "expression", "hopper", "hopper_twin",
           "hopper_variants", "forward_stages", "dkdv_steps"]

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
    if kernel in HOPPER_TWINS:
        defines, arch = HOPPER_DEFINES, HOPPER_TARGETS["sm_90"]
    fn = _loader.get_function(SOURCE, defines, expression(kernel, dtype, head_dim), device_index,
                              arch)
    driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            smem_bytes(kernel, dtype, head_dim, use_pipelined))
    return fn


@memoize("fallback_kernels.fused.capability", maxsize=16)
def _capability(device_index: int) -> tuple[int, int]:
    """CUDA device ``device_index``'s compute capability, read once: a call's launches ask for
    it about ten times, and each read costs a device-count check (the H200 profile of
    2026-11-30: about a fifth of a small call's host time)."""
    return roofline.capability_for(torch.device("cuda", device_index))


def _strides(*tensors: torch.Tensor) -> tuple:
    """Element strides (batch, token, head) of each [B, S, H, ...] view, one after another."""
    return tuple(s for t in tensors for s in t.stride()[:3])


@memoize("fallback_kernels.fused.value_args", maxsize=1024)
def _value_args(strides: tuple, sizes: tuple, factors: tuple = (), flags: tuple = ()) -> tuple:
    """A launch's value arguments as the kernels declare them: int64 element strides, int32
    sizes, float32 factors, int32 flags, in that order. Made once per distinct set: a numpy
    scalar costs the host about a third of a microsecond, and a backward passes about 70."""
    import numpy as np

    return (*map(np.int64, strides), *map(np.int32, sizes), *map(np.float32, factors),
            *map(np.int32, flags))


@memoize("fallback_kernels.fused.grids", maxsize=1024)
def _grid(table: tuple, box: tuple, heads: int, batch: int, own_queries: bool) -> tuple:
    """``tile_walk.launch_grid``, once per distinct launch shape."""
    return launch_grid(table, box, heads, batch, own_queries)


def _aligned(tensors, dtype) -> int:
    per = 16 // (2 if dtype != torch.float32 else 4)
    return int(all(t.data_ptr() % 16 == 0 and all(s % per == 0 for s in t.stride()[:3])
                   for t in tensors))


def _launch(kernel, dtype, head_dim, grid, tensors, scalars, ctx: "launch.TorchStream"):
    use_pipelined = pipelined(dtype, _capability(ctx.index))
    fn = _function(kernel, dtype, head_dim, ctx.index, use_pipelined)
    args = [launch.kernel_arg(t) for t in tensors]
    args += scalars
    fn(grid, (THREADS, 1, 1), args, shared_mem=smem_bytes(kernel, dtype, head_dim, use_pipelined),
       stream=ctx.stream)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def run_forward(q, k, v, out, lse, table, boxes, scale, softcap=0.0, rpb=None) -> None:
    """Launch the forward on token-major views: q/k/v/out ``[B, S, H, D]``, lse ``[B, S, H]``
    fp32 (any strides, last dim contiguous). ``table``: the geometry table (``geometry``);
    ``boxes`` = (query box, key box); a query box of ``WIDE_QUERY_TILE`` slots runs the wide
    forward (the pipelined build only)."""
    B, _, Hq, Dqk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    hd = head_dim_bucket(Dqk, Dv)
    qb, kb = pad3(boxes[0]), pad3(boxes[1])
    table = tuple(table)
    grid = _grid(table, qb, Hq, B, True)
    table_dev = launch.device_table(table, q.device)
    with launch.TorchStream(q.device) as ctx:
        tensors = [q, k, v, out, lse, table_dev, rpb]
        scalars = _value_args(_strides(q, k, v, out, lse), (Hq, Hkv, Dqk, Dv, *qb, *kb),
                              (scale, softcap or 0.0), (_aligned((q, k, v, out), q.dtype),))
        kernel = _on_wgmma(_query_major(WIDE_FORWARD, qb, q.dtype, ctx), q.dtype, hd, ctx)
        _launch(kernel, q.dtype, hd, grid, tensors, scalars, ctx)


def _on_wgmma(kernel: str, dtype: torch.dtype, head_dim: int, ctx: "launch.TorchStream") -> str:
    """``kernel``'s wgmma twin where ``hopper`` allows it and the device has read the wgmma
    operand layouts as the kernels write them (:func:`_wgmma_layouts_read_right`), else
    ``kernel``."""
    if not hopper(dtype, _capability(ctx.index), head_dim):
        return kernel
    from ..graphs._runtime import capturing

    # The probe reads its results back, which a CUDA graph capture forbids: a call captured
    # before any eager one keeps the mma.sync kernels (and asks again next time).
    if capturing() or not _wgmma_layouts_read_right(ctx.index):
        return kernel
    return hopper_twin(kernel)


@memoize("fallback_kernels.fused.wgmma_layouts")
def _wgmma_layouts_read_right(device_index: int) -> bool:
    """Whether the wgmma layout probe (``wgmma_probe``) gives exact results on the device, once
    per device and process; if not, a warning and the mma.sync kernels (no silent garbage from a
    path no GPU had run when it was written)."""
    from . import wgmma_probe

    found = wgmma_probe.check(torch.device("cuda", device_index))
    if found:
        wrong = {case: {out: m["count"] for out, m in outputs.items()}
                 for case, outputs in found.items()}
        warnings.warn(f"CUDNN_ATTN_NA_WGMMA=1 ignored on cuda:{device_index}: the wgmma layout "
                      f"probe differs from its exact results (wrong elements: {wrong}); the "
                      f"fused kernels run on mma.sync", RuntimeWarning, stacklevel=2)
    return not found


def _query_major(wide_kernel: str, own_box: Sequence[int], dtype: torch.dtype,
                 ctx: "launch.TorchStream", wide_volume: int = WIDE_QUERY_TILE) -> str:
    """The kernel the block's own box names: ``wide_kernel`` for ``wide_volume`` slots
    (fp16/bf16, sm_90+, the pipelined build), its 64-slot kernel otherwise."""
    if math.prod(own_box) != wide_volume:
        return NARROW_OF[wide_kernel]
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
                _value_args(_strides(out, dout, delta) + (_strides(dlse) if dlse is not None
                                                          else (0, 0, 0)), (S, H, Dv)), ctx)
    return delta


def run_backward(q, k, v, dout, lse, delta, dq, dk, dv, table, boxes, scale,
                 softcap=0.0, dq_boxes=None) -> None:
    """Launch dQ and dK/dV on token-major views (see ``run_forward``); ``delta`` like ``lse``.
    ``boxes``: dK/dV's (query box, key box), 64-query boxes, where a key box of
    ``WIDE_KEY_TILE`` slots runs the wide dK/dV (``dkdv_boxes``); ``dq_boxes``: dQ's (default
    ``boxes``), where a query box of ``WIDE_QUERY_TILE`` slots runs the wide dQ (the forward's
    boxes, ``forward_boxes``). Every gradient row is written by one block: no atomics."""
    B, _, Hq, Dqk = q.shape
    Hkv, Dv = k.shape[2], v.shape[3]
    hd = head_dim_bucket(Dqk, Dv)
    if math.prod(boxes[0]) != FUSED_QUERY_TILE:
        raise ValueError(f"dK/dV walks {FUSED_QUERY_TILE}-query boxes, got {tuple(boxes[0])}")
    dq_boxes = boxes if dq_boxes is None else dq_boxes

    aligned = _aligned((q, k, v, dout, dq, dk, dv), q.dtype)

    def values(strides, pair):
        return _value_args(strides, (Hq, Hkv, Dqk, Dv, *pad3(pair[0]), *pad3(pair[1])),
                           (scale, softcap or 0.0), (aligned,))

    table = tuple(table)
    common = _strides(q, k, v, dout)
    table_dev = launch.device_table(table, q.device)
    # Only dimensions longer than 1 are indexed, so only their strides must agree (torch keeps
    # any stride on a size-1 dimension, e.g. one query head).
    if any(a != b for a, b, n in zip(delta.stride(), lse.stride(), lse.shape) if n > 1):
        raise ValueError("delta must have lse's strides")
    with launch.TorchStream(q.device) as ctx:
        grid = _grid(table, pad3(dq_boxes[0]), Hq, B, True)
        dq_kernel = _on_wgmma(_query_major(WIDE_DQ, dq_boxes[0], q.dtype, ctx), q.dtype, hd, ctx)
        _launch(dq_kernel, q.dtype, hd, grid,
                [q, k, v, dout, lse, delta, dq, table_dev],
                values(common + _strides(dq, lse), dq_boxes), ctx)
        grid = _grid(table, pad3(boxes[1]), Hkv, B, False)
        dkdv_kernel = _on_wgmma(_key_major(boxes[1], q.dtype, hd, ctx), q.dtype, hd, ctx)
        _launch(dkdv_kernel, q.dtype, hd, grid,
                [q, k, v, dout, lse, delta, dk, dv, table_dev],
                values(common + _strides(dk, dv, lse), boxes), ctx)


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
    """The query-major kernels' (forward and dQ) default boxes on ``device``
    (``tile_model.query_major_tiles``: the wide kernels' where they can run)."""
    return query_major_tiles(table, rank, dtype, _capability(_index(device)))


def dkdv_boxes(table: Sequence[int], rank: int, dtype: torch.dtype, head_dim: int,
               device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """dK/dV's default boxes on ``device`` (``tile_model.key_major_tiles``: the wide dK/dV's
    where it can run)."""
    return key_major_tiles(table, rank, dtype, head_dim, _capability(_index(device)))


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


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
