"""The argument rules of the varlen and KV-cache calls, in one place.

``attention_varlen`` / ``attention_with_kvcache`` (``varlen.py``), FlashAttention's varlen surface
and ``graphs.describe`` (which cannot import the entry points: they sit above the engines) check
their arguments here, so every surface raises the same errors:

* ``check_packed(q, k, v)`` — ``[total, H, D]`` tensors that agree on tokens, heads and dims;
* ``cu_lengths(name, cu, total, tensor_name, device)`` — checked ``cu_seqlens`` -> lengths;
* ``varlen_lengths(q, k, cu_q, cu_k)`` — both sides' lengths, one batch;
* ``check_maxima(max_q, max_k, lens_q, lens_k)`` — ``max_seqlen`` ints at least the longest;
* ``check_cache(q, k_cache, v_cache, block_table)`` — a dense or paged KV cache and its capacity;
* ``cache_lengths(cache_seqlens, batch, capacity, device, where)`` — checked cache lengths;
* ``check_user_mask(mask, where)`` / ``check_bias(bias, full, dims)`` — what these calls accept;
* ``index_tensor(name, t, rank, device)`` — an int32/int64 tensor on q's device or the CPU.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..model import checks
from ..model.masks import Alibi, Mask, Neighborhood, Padding, mask_parts

__all__ = ["index_tensor", "check_packed", "cu_lengths", "varlen_lengths", "check_maxima",
           "CacheArgs", "check_cache", "cache_lengths", "check_user_mask", "check_bias"]


def index_tensor(name: str, t, rank: int, device: torch.device) -> torch.Tensor:
    """``checks.index_tensor`` (int32/int64, ``rank`` dims) on q's ``device`` or the CPU, with the
    device named as q's (the wording the varlen/kvcache errors have always had)."""
    return checks.index_tensor(name, t, ndim=rank, device=device, device_name="q's device")


def check_user_mask(mask, where: str) -> None:
    """Causal/SlidingWindow only: lengths come from the call, and a spatial shape cannot be ragged."""
    if mask is None:
        return
    if not isinstance(mask, Mask):
        raise TypeError(f"mask must be a cudnn_attn mask (Causal, SlidingWindow or their & "
                        f"combination), got {type(mask).__name__}")
    for part in mask_parts(mask):
        if isinstance(part, Padding):
            raise ValueError(f"mask must not contain Padding in {where}: the valid lengths come "
                             f"from its length arguments")
        if isinstance(part, Neighborhood):
            raise ValueError(f"mask must not contain Neighborhood in {where}: a neighborhood needs "
                             f"one fixed spatial shape, and sequences here have their own lengths")


def check_bias(bias, full: tuple, dims: str) -> None:
    """``bias`` is None, an ``Alibi`` or a tensor broadcastable to ``full`` (named by ``dims``)."""
    if bias is None or isinstance(bias, Alibi):
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be None, an Alibi or a torch.Tensor, got {type(bias).__name__}")
    ok = bias.dim() <= 4 and all(b in (1, f) for b, f in zip(reversed(bias.shape), reversed(full)))
    if not ok:
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to {dims} = "
                         f"{list(full)}")


# ---------------------------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------------------------

def check_packed(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed ``q [total_q, H_q, D_qk]``, ``k [total_k, H_kv, D_qk]``, ``v [total_k, H_kv, D_v]``."""
    q = checks.tensor("q", q, ndim=3, what="[total_q, H_q, D_qk]")
    k = checks.tensor("k", k, ndim=3, what="[total_k, H_kv, D_qk]")
    v = checks.tensor("v", v, ndim=3, what="[total_k, H_kv, D_v]")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same tokens and heads, got k={tuple(k.shape)}, "
                         f"v={tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k head dim must equal q head dim, got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}")
    if q.shape[1] % max(k.shape[1], 1):
        raise ValueError(f"query heads must be a multiple of kv heads (GQA/MQA), got "
                         f"H_q={q.shape[1]}, H_kv={k.shape[1]}")
    return q, k, v


def cu_lengths(name: str, cu, total: int, tensor_name: str, device) -> list[int]:
    """The lengths of a checked ``cu_seqlens`` (read on the host)."""
    cu = offsets_tensor(name, cu, device)
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {offsets[0]}")
    lens = [b - a for a, b in zip(offsets, offsets[1:])]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {offsets[i]} > "
                             f"{name}[{i + 1}] = {offsets[i + 1]}")
    if offsets[-1] != total:
        raise ValueError(f"{name}[-1] must equal the number of packed tokens in {tensor_name} "
                         f"({total}), got {offsets[-1]}")
    return lens


def offsets_tensor(name: str, cu, device) -> torch.Tensor:
    """A checked ``cu_seqlens`` tensor (1-D, int32/int64, ``B + 1 >= 2`` entries); its values
    are not read."""
    cu = index_tensor(name, cu, 1, device)
    if cu.numel() < 2:
        raise ValueError(f"{name} must have B + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    return cu


def check_same_batch(batch_q: int, batch_k: int) -> None:
    if batch_q != batch_k:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got "
                         f"{batch_q} and {batch_k} sequences")


def varlen_lengths(q, k, cu_seqlens_q, cu_seqlens_k) -> tuple[list[int], list[int]]:
    """Both sides' lengths; they describe one batch."""
    lens_q = cu_lengths("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q", q.device)
    lens_k = cu_lengths("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k", q.device)
    check_same_batch(len(lens_q), len(lens_k))
    return lens_q, lens_k


def check_maxima(max_seqlen_q, max_seqlen_k, lens_q: Optional[list],
                 lens_k: Optional[list]) -> tuple[int, int]:
    """``max_seqlen_q/k`` as ints, each at least its side's longest sequence (``lens`` None:
    lengths unknown on the host, only the ints are checked)."""
    max_q, max_k = (checks.integer(name, value, tensors=True, maximum=checks.MAX_POSITION)
                    for name, value in (("max_seqlen_q", max_seqlen_q),
                                        ("max_seqlen_k", max_seqlen_k)))
    for name, value, lens, cu_name in (("max_seqlen_q", max_q, lens_q, "cu_seqlens_q"),
                                       ("max_seqlen_k", max_k, lens_k, "cu_seqlens_k")):
        if lens is not None and value < max(lens):
            raise ValueError(f"{name} must be >= the longest sequence in {cu_name} "
                             f"({max(lens)}), got {value}")
    return max_q, max_k


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------

class CacheArgs(NamedTuple):
    """Checked KV-cache arguments: ``capacity`` keys per sequence, described by ``where``."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: Optional[torch.Tensor]
    capacity: int
    where: str


def check_cache(q, k_cache, v_cache, block_table) -> CacheArgs:
    """``q [B, S_q, H_q, D]`` against a dense ``[B, S_max, H_kv, D]`` cache or a paged
    ``[num_blocks, page_size, H_kv, D]`` one with ``block_table [B, max_blocks_per_seq]``."""
    q = checks.tensor("q", q, ndim=4, what="[B, S_q, H_q, D_qk] (bshd)")
    paged = block_table is not None
    leading = "num_blocks, page_size, H_kv" if paged else "B, S_max, H_kv"
    shape = f"[{leading}, D]"
    k_cache = checks.tensor("k_cache", k_cache, ndim=4, what=shape)
    v_cache = checks.tensor("v_cache", v_cache, ndim=4, what=shape)
    batch = q.shape[0]
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must agree on [{leading}], got "
                         f"k_cache={tuple(k_cache.shape)}, v_cache={tuple(v_cache.shape)}")
    if k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"k_cache head dim must equal q head dim, got q={tuple(q.shape)}, "
                         f"k_cache={tuple(k_cache.shape)}")
    if paged:
        block_table = index_tensor("block_table", block_table, 2, q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have one row per batch ({batch}), got shape "
                             f"{tuple(block_table.shape)}")
        capacity = block_table.shape[1] * k_cache.shape[1]
        where = f"block_table holds {block_table.shape[1]} pages of {k_cache.shape[1]} tokens"
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache must have q's batch size {batch}, got "
                             f"k_cache={tuple(k_cache.shape)} (pass block_table for a paged cache)")
        capacity, where = k_cache.shape[1], f"S_max = {k_cache.shape[1]}"
    return CacheArgs(q, k_cache, v_cache, block_table, capacity, where)


def cache_lengths(cache_seqlens, batch: int, capacity: int, device, where: str) -> list[int]:
    """``cache_seqlens`` (an int, ``B`` ints or a ``[B]`` tensor) as ``B`` ints in
    ``[0, capacity]`` (read on the host)."""
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() != 0:
        lens = index_tensor("cache_seqlens", cache_seqlens, 1, device).tolist()
    elif isinstance(cache_seqlens, (list, tuple)):
        lens = [checks.integer("cache_seqlens", n, tensors=True) for n in cache_seqlens]
    else:
        lens = [checks.integer("cache_seqlens", cache_seqlens, tensors=True)] * batch
    if len(lens) != batch:
        raise ValueError(f"cache_seqlens must have one entry per batch ({batch}), got {len(lens)}")
    for b, n in enumerate(lens):
        if not 0 <= n <= capacity:
            raise ValueError(f"cache_seqlens[{b}] = {n} is outside [0, {capacity}] ({where})")
    return lens
