"""The problems of varlen and KV-cache calls over packed or paged storage (``cudnn_attn.model.storage``).

``attention_varlen`` / ``attention_with_kvcache`` try these first on an accelerator, and
``graphs.describe`` shows their graphs:

* varlen (``cu_seqlens_q/k``, ``max_seqlen_q/k``): packed ``[total, H, D]`` tensors are a ``bshd``
  problem of logical shape ``(B, max_seqlen, H, D)`` with token-major strides, ``Ragged`` storage
  (the cumulative lengths) and a ``Padding`` of the lengths — cuDNN's ragged (THD) layout.
* KV cache (``cache_seqlens``, optional ``block_table``): queries ``[B, S_q, H_q, D]`` against the
  cache's whole capacity with a ``Padding`` of the cache lengths; a paged cache has ``Paged``
  storage over its ``[num_blocks, page_size, H_kv, D]`` pools (cuDNN's page tables).

Lengths, offsets and page tables stay runtime tensors, so the problem (hence the graph) depends on
the batch size, the (bucketed) maxima, shapes, dtypes and flags only. Lengths given as ``meta``
tensors are never read (full lengths stand in: the graph is the same); readable ones are checked
as the entry points check them (``cudnn_attn.packed.args``) unless the caller keeps them on the
device (``read=False``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import args
from ..errors import NotSupportedError
from ..model.inputs import full_lengths
from ..model.masks import Padding
from ..model.problem import AttnProblem
from ..model.storage import Paged, Ragged

__all__ = ["varlen_problem", "varlen_runtime", "kvcache_problem", "kvcache_padding",
           "paged_storage", "bucket_seqlen", "meta_like", "on_accelerator"]


def _readable(t) -> bool:
    return not (isinstance(t, torch.Tensor) and t.is_meta)


def _lengths_tensor(name: str, t, batch: Optional[int], device) -> torch.Tensor:
    """A checked 1-D integer length tensor whose values are not read."""
    t = args.index_tensor(name, t, 1, device)
    if batch is not None and t.shape[0] != batch:
        raise ValueError(f"{name} must have one entry per batch ({batch}), got shape "
                         f"{tuple(t.shape)}")
    return t


def bucket_seqlen(n: int) -> int:
    """The graph's sequence bound for a call's ``max_seqlen``: the next power of two (at least
    64), so calls with other maxima share a graph (lengths are runtime inputs)."""
    return max(64, 1 << (n - 1).bit_length())


def _as_batched(x: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Packed ``[total, H, D]`` as the ``[B, seq, H, D]`` (bshd) view cuDNN's ragged descriptor
    has: token-major strides, the batch stride a whole ``seq`` of tokens (offsets override it)."""
    t0, t1, t2 = x.stride()
    return torch.empty_strided((batch, seq, x.shape[1], x.shape[2]), (seq * t0, t0, t1, t2),
                               dtype=x.dtype, device="meta", requires_grad=x.requires_grad)


def on_accelerator(t) -> bool:
    """Whether the surfaces try the engines that read packed/paged storage as it lies for a call
    on ``t``'s device: reading lengths there would synchronise the host (on the CPU the engines
    that run are the dense ones, and reading is free)."""
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


def meta_like(t):
    """A tensor's shape, strides, dtype and ``requires_grad`` on the meta device (others as is)."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta",
                               requires_grad=t.requires_grad)


def _with(mask, padding: Padding):
    return padding if mask is None else mask & padding


def varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k, *, mask=None, bias=None, read=True,
                   seqused_k=None, **kwargs) -> AttnProblem:
    """The problem of ``attention_varlen``'s native (ragged) graph, with ``Ragged`` storage.

    ``read=True`` checks the ``cu_seqlens`` values on the host (``describe``); ``read=False``
    keeps accelerator tensors unread (the lengths become a runtime ``Padding`` computed on the
    device; CPU ones are still checked) and buckets the sequence bounds (``bucket_seqlen``)
    unless a bias tensor fixes them.
    ``seqused_k`` (``read=False`` only; FlashAttention's) limits sequence ``b`` to its first
    ``seqused_k[b]`` keys, which still start at ``cu_seqlens_k[b]``.
    """
    q, k, v = args.check_packed(q, k, v)
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        raise ValueError("a varlen call needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and "
                         "max_seqlen_k")
    padding = None
    # Values are checked on the host where reading them is free: always for describe, and for
    # CPU tensors otherwise; accelerator (and meta) tensors stay unread.
    host = _readable(cu_q) and _readable(cu_k) and (read or (
        seqused_k is None and not (on_accelerator(cu_q) or on_accelerator(cu_k))))
    if host:
        lens_q, lens_k = args.varlen_lengths(q, k, cu_q, cu_k)
        padding = Padding(lens_q, lens_k)
    else:  # lengths stay runtime tensors, as the graph takes them
        cu_q = args.offsets_tensor("cu_seqlens_q", cu_q, q.device)  # the host route's checks
        cu_k = args.offsets_tensor("cu_seqlens_k", cu_k, q.device)  # of what a shape tells
        args.check_same_batch(cu_q.shape[0] - 1, cu_k.shape[0] - 1)
        lens_q = lens_k = None
    if not read and padding is None:
        padding, offsets = varlen_runtime(q, cu_q, cu_k, seqused_k)
        cu_q, cu_k = offsets.cu_seqlens_q, offsets.cu_seqlens_k
    elif not read:  # offsets are read where the graph runs: on q's device
        cu_q, cu_k = (t.to(q.device, non_blocking=True) for t in (cu_q, cu_k))
    batch = (cu_q.shape[0] - 1) if lens_q is None else len(lens_q)
    max_q, max_k = args.check_maxima(max_q, max_k, lens_q, lens_k)
    if not read and not isinstance(bias, torch.Tensor):
        max_q, max_k = bucket_seqlen(max_q), bucket_seqlen(max_k)
    if padding is None:  # meta lengths: the graph is the same for any lengths, full ones stand in
        padding = Padding([max_q] * batch, [max_k] * batch)
    args.check_user_mask(mask, "attention_varlen")
    args.check_bias(bias, (batch, q.shape[1], max_q, max_k),
                           "[B, H_q, max_seqlen_q, max_seqlen_k]")
    problem = AttnProblem.from_tensors(_as_batched(q, batch, max_q), _as_batched(k, batch, max_k),
                                       _as_batched(v, batch, max_k), mask=_with(mask, padding),
                                       bias=meta_like(bias), layout="bshd", **kwargs)
    return dataclasses.replace(problem, device=q.device, storage=Ragged(cu_q, cu_k))


def varlen_runtime(q: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                   seqused_k: Optional[torch.Tensor] = None) -> tuple[Padding, Ragged]:
    """The runtime ``Padding`` and ``Ragged`` storage of a varlen call whose offsets stay on the
    device (moved to q's device, never read): the lengths are the offsets' differences (the
    keys' ``seqused_k`` when given). One offsets tensor for both sides (self-attention) makes
    one lengths tensor for both: one op, and the rows without keys take one comparison less."""
    same = cu_k is cu_q
    cu_q, cu_k = (t.to(q.device, non_blocking=True) for t in (cu_q, cu_k))
    lens_q = cu_q[1:] - cu_q[:-1]
    if seqused_k is not None:
        used_k = _lengths_tensor("seqused_k", seqused_k, cu_q.shape[0] - 1, q.device)
    else:
        used_k = lens_q if same else cu_k[1:] - cu_k[:-1]
    return Padding(lens_q, used_k), Ragged(cu_q, cu_k)


def kvcache_problem(q, k_cache, v_cache, cache_seqlens, block_table, *, mask=None, bias=None,
                    read=True, **kwargs) -> AttnProblem:
    """The problem of ``attention_with_kvcache``'s native graph: queries against the cache's
    whole capacity with ``seq_len_kv`` = the cache lengths; a paged cache has ``Paged`` storage
    (cuDNN's page tables over its ``[num_blocks, page_size, H_kv, D]`` pools).

    ``read=False`` keeps an accelerator ``cache_seqlens`` tensor on the device (a runtime
    ``Padding``); CPU lengths are checked on the host."""
    q, k_cache, v_cache, block_table, capacity, where = args.check_cache(
        q, k_cache, v_cache, block_table)
    batch, seq_q, heads_q, _ = q.shape
    if isinstance(cache_seqlens, torch.Tensor) and not _readable(cache_seqlens):
        # never read: the graph is the same for any lengths, full ones stand in
        _cache_lengths(q, cache_seqlens)
        padding = Padding([seq_q] * batch, [capacity] * batch)
    elif isinstance(cache_seqlens, torch.Tensor) and not read and on_accelerator(cache_seqlens):
        padding = kvcache_padding(q, cache_seqlens)
    else:  # checked on the host, where reading is free
        lens = args.cache_lengths(cache_seqlens, batch, capacity, q.device, where)
        padding = Padding([seq_q] * batch, lens)
    args.check_user_mask(mask, "attention_with_kvcache")
    args.check_bias(bias, (batch, heads_q, seq_q, capacity),
                           "[B, H_q, S_q, max_blocks_per_seq * page_size]" if block_table is not None
                           else "[B, H_q, S_q, S_max]")
    if block_table is None:
        return AttnProblem.from_tensors(q, k_cache, v_cache, mask=_with(mask, padding), bias=bias,
                                        layout="bshd", **kwargs)
    # The problem's keys are the logical [B, capacity, H_kv, D] each page table spells out
    # (described, never allocated: the problem is built on meta tensors, then put on q's device).
    k, v = (torch.empty(batch, capacity, *c.shape[2:], dtype=c.dtype, device="meta",
                        requires_grad=c.requires_grad) for c in (k_cache, v_cache))
    problem = AttnProblem.from_tensors(meta_like(q), k, v, mask=_with(mask, padding), bias=meta_like(bias),
                                       layout="bshd", **kwargs)
    problem = dataclasses.replace(problem, device=q.device)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():  # the graph's containers are whole contiguous pages
            raise NotSupportedError(problem, {"cudnn": [
                f"cuDNN's paged {name} must be a contiguous [num_blocks, page_size, H_kv, D] "
                f"container, got strides {tuple(cache.stride())}"]}, forced="cudnn")
    return dataclasses.replace(problem, storage=paged_storage(q, k_cache, block_table, read))


def kvcache_padding(q: torch.Tensor, cache_seqlens: torch.Tensor) -> Padding:
    """The runtime ``Padding`` of a KV-cache call whose lengths stay on the device: every query
    row, and the first ``cache_seqlens[b]`` keys of each sequence (moved to q's device, never
    read)."""
    batch, seq_q = q.shape[:2]
    lens = _cache_lengths(q, cache_seqlens)
    return Padding(full_lengths(batch, seq_q, q.device), lens.to(q.device, non_blocking=True))


def _cache_lengths(q: torch.Tensor, cache_seqlens: torch.Tensor) -> torch.Tensor:
    """``cache_seqlens`` as checked ``[B]`` lengths, never read: a 0-d tensor (one length for
    every sequence, as an int is) expanded over the batch (a view)."""
    if cache_seqlens.dim() == 0:
        cache_seqlens = args.index_tensor("cache_seqlens", cache_seqlens, 0, q.device) \
            .expand(q.shape[0])
    return _lengths_tensor("cache_seqlens", cache_seqlens, q.shape[0], q.device)


def paged_storage(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                  read: bool = False) -> Paged:
    """``Paged`` storage of ``k_cache``'s pools through ``block_table``, moved to q's device
    unless ``read`` (the page tables are read where the graph runs)."""
    if not read:
        block_table = block_table.to(q.device, non_blocking=True)
    return Paged(k_cache.shape[0], k_cache.shape[1], block_table)
