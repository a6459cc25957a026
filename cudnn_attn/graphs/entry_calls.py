"""The cuDNN graph of a varlen or KV-cache call: from the arguments of ``attention_varlen`` /
``attention_with_kvcache`` to the problem and builder options of its native graph.

* varlen (``cu_seqlens_q/k``, ``max_seqlen_q/k``): packed ``[total, H, D]`` tensors are cuDNN's
  ragged (THD) layout, logical ``(B, H, max_seqlen, D)`` with token-major strides, ragged offsets
  on Q/K/V/O/Stats and the lengths as the padding mask's ``seq_len_q/kv``.
* KV cache (``cache_seqlens``, optional ``block_table``): queries ``[B, S_q, H_q, D]`` against the
  cache's whole capacity, ``seq_len_kv`` = the cache lengths; a paged cache is cuDNN's page tables
  over its ``[num_blocks, page_size, H_kv, D]`` containers.

Lengths, offsets and page tables are graph inputs, so the graph depends on the batch size, the
maxima, shapes, dtypes and flags only: one graph serves every batch of lengths. Lengths given as
``meta`` tensors are never read (full lengths stand in: the graph is the same); readable ones are
checked as the entry points check them (``cudnn_attn.varlen_args``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import varlen_args
from ..errors import NotSupportedError
from ..masks import Padding
from ..problem import AttnProblem
from ._spec import GraphOptions, PagedKV

__all__ = ["CALL_ARGS", "call_problem"]

CALL_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "cache_seqlens",
             "block_table")


def _readable(t) -> bool:
    return not (isinstance(t, torch.Tensor) and t.is_meta)


def _lengths_tensor(name: str, t, batch: Optional[int], device) -> torch.Tensor:
    """A checked 1-D integer length tensor whose values are not read (``meta``)."""
    t = varlen_args.index_tensor(name, t, 1, device)
    if batch is not None and t.shape[0] != batch:
        raise ValueError(f"{name} must have one entry per batch ({batch}), got shape "
                         f"{tuple(t.shape)}")
    return t


def _as_batched(x: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Packed ``[total, H, D]`` as the ``[B, seq, H, D]`` (bshd) view cuDNN's ragged descriptor
    has: token-major strides, the batch stride a whole ``seq`` of tokens (offsets override it)."""
    t0, t1, t2 = x.stride()
    return torch.empty_strided((batch, seq, x.shape[1], x.shape[2]), (seq * t0, t0, t1, t2),
                               dtype=x.dtype, device="meta", requires_grad=x.requires_grad)


def _with(mask, padding: Padding):
    return padding if mask is None else mask & padding


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, kwargs):
    q, k, v = varlen_args.check_packed(q, k, v)
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        raise ValueError("a varlen call needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q and "
                         "max_seqlen_k")
    if _readable(cu_q) and _readable(cu_k):
        lens_q, lens_k = varlen_args.varlen_lengths(q, k, cu_q, cu_k)
        padding = Padding(lens_q, lens_k)
    else:  # lengths stay runtime tensors, as the graph takes them
        cu_q = _lengths_tensor("cu_seqlens_q", cu_q, None, q.device)
        cu_k = _lengths_tensor("cu_seqlens_k", cu_k, cu_q.shape[0], q.device)
        if cu_q.shape[0] < 2:
            raise ValueError(f"cu_seqlens_q must have B + 1 >= 2 entries, got shape "
                             f"{tuple(cu_q.shape)}")
        lens_q = lens_k = padding = None
    batch = (cu_q.shape[0] - 1) if lens_q is None else len(lens_q)
    max_q, max_k = varlen_args.check_maxima(max_q, max_k, lens_q, lens_k)
    if padding is None:  # the graph is the same for any lengths: full ones stand in
        padding = Padding([max_q] * batch, [max_k] * batch)
    varlen_args.check_user_mask(mask, "attention_varlen")
    varlen_args.check_bias(bias, (batch, q.shape[1], max_q, max_k),
                           "[B, H_q, max_seqlen_q, max_seqlen_k]")
    problem = AttnProblem.from_tensors(_as_batched(q, batch, max_q), _as_batched(k, batch, max_k),
                                       _as_batched(v, batch, max_k), mask=_with(mask, padding),
                                       bias=bias, layout="bshd", **kwargs)
    return problem, {"ragged": True}


def _kvcache(q, k_cache, v_cache, cache_seqlens, block_table, mask, bias, kwargs):
    q, k_cache, v_cache, block_table, capacity, where = varlen_args.check_cache(
        q, k_cache, v_cache, block_table)
    batch, seq_q, heads_q, _ = q.shape
    if _readable(cache_seqlens):
        lens = varlen_args.cache_lengths(cache_seqlens, batch, capacity, q.device, where)
        padding = Padding([seq_q] * batch, lens)
    else:  # never read: the graph is the same for any lengths, full ones stand in
        _lengths_tensor("cache_seqlens", cache_seqlens, batch, q.device)
        padding = Padding([seq_q] * batch, [capacity] * batch)
    varlen_args.check_user_mask(mask, "attention_with_kvcache")
    varlen_args.check_bias(bias, (batch, heads_q, seq_q, capacity),
                           "[B, H_q, S_q, max_blocks_per_seq * page_size]" if block_table is not None
                           else "[B, H_q, S_q, S_max]")
    if block_table is None:
        return AttnProblem.from_tensors(q, k_cache, v_cache, mask=_with(mask, padding), bias=bias,
                                        layout="bshd", **kwargs), {}
    # The problem's keys are the logical [B, capacity, H_kv, D] each page table spells out.
    k, v = (torch.empty(batch, capacity, *c.shape[2:], dtype=c.dtype, device="meta",
                        requires_grad=c.requires_grad) for c in (k_cache, v_cache))
    problem = AttnProblem.from_tensors(q, k, v, mask=_with(mask, padding), bias=bias,
                                       layout="bshd", **kwargs)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():  # the graph's containers are whole contiguous pages
            raise NotSupportedError(problem, {"cudnn": [
                f"cuDNN's paged {name} must be a contiguous [num_blocks, page_size, H_kv, D] "
                f"container, got strides {tuple(cache.stride())}"]}, forced="cudnn")
    num_blocks, page_size = k_cache.shape[:2]
    return problem, {"paged": PagedKV(num_blocks=num_blocks, page_size=page_size, layout="bshd")}


def call_problem(q, k, v, *, options: Optional[GraphOptions] = None, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, cache_seqlens=None,
                 block_table=None, mask=None, bias=None, **attention_kwargs):
    """``(problem, options)`` of the graph cuDNN builds for a varlen call (``cu_seqlens_*``) or a
    KV-cache call (``cache_seqlens``; ``k``/``v`` are the caches), or ``None`` for neither.

    ``options`` (other builder options, e.g. ``deterministic``) is merged with the call's ragged
    layout or page tables. The problem is a ``bshd`` one with a ``Padding`` mask of the call's
    lengths (full lengths when they are ``meta``).
    """
    varlen = any(a is not None for a in (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    kvcache = cache_seqlens is not None or block_table is not None
    if not (varlen or kvcache):
        return None
    if varlen and kvcache:
        raise ValueError("pass the varlen arguments (cu_seqlens_q/k, max_seqlen_q/k) or the "
                         "KV-cache ones (cache_seqlens, block_table), not both")
    layout = attention_kwargs.pop("layout", "bshd")
    if layout != "bshd":
        raise ValueError(f"varlen and KV-cache calls are token-major: layout must be 'bshd', "
                         f"got {layout!r}")
    if varlen:
        problem, extra = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, mask, bias, attention_kwargs)
    else:
        if cache_seqlens is None:
            raise ValueError("a KV-cache call needs cache_seqlens")
        problem, extra = _kvcache(q, k, v, cache_seqlens, block_table, mask, bias,
                                  attention_kwargs)
    return problem, dataclasses.replace(options or GraphOptions(), **extra)
