"""FlashAttention's ``flash_attn_with_kvcache``: decoding against a dense or paged KV cache, with
the in-place append of new keys/values, rotary embedding, ``cache_batch_idx`` and
``cache_leftpad``. The call becomes a padded ``bshd`` batch of each sequence's keys with a
``Padding`` mask and runs through ``_core.forward`` like every FlashAttention entry point.

FlashAttention's rules, for sequence ``b`` (``n = cache_seqlens[b]``, ``l = cache_leftpad[b]``,
``S_new`` the new tokens, ``row = cache_batch_idx[b]``):

* new ``k``/``v`` are written at cache positions ``n .. n + S_new - 1`` of ``row``; ``k`` is
  rotated first, token ``i`` at position ``n + i`` (absolute cache positions: ``l`` is not
  subtracted). ``v`` is not rotated.
* ``q`` is rotated at positions ``n + i`` when the call is causal or local (a window that stays
  bounded after FlashAttention's normalization), otherwise every query at position ``n``.
* the keys are cache positions ``l .. n + S_new - 1``; masks, windows and ALiBi treat them as a
  sequence of ``n + S_new - l`` keys aligned bottom-right with the ``S_q`` queries. A window
  ``>= S_cache`` (the cache's length, ``max_blocks * page_size`` when paged) is unbounded.
"""

from __future__ import annotations

from typing import Any

import torch

from ...model import checks
from ...varlen import gather_pages, index_tensor, with_padding
from . import _core, native
from ._args import Options, alibi_arg, runtime_errors
from .functions import WindowSize, window_pair
from .rotary import apply_rotary

__all__ = ["flash_attn_with_kvcache"]


def _lengths(name: str, value, batch: int, device, default: int) -> list[int]:
    """An int, a 0-d or ``[B]`` integer tensor (or None: ``default`` for all) -> B ints."""
    if value is None:
        return [default] * batch
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        values = index_tensor(name, value, 1, device).tolist()
        if len(values) != batch:
            raise ValueError(f"{name} must have one entry per batch ({batch}), got shape "
                             f"{tuple(value.shape)}")
        return values
    return [checks.integer(name, value, tensors=True)] * batch


def _check_range(name: str, values: list[int], low, high, why: str) -> None:
    for b, n in enumerate(values):
        lo, hi = (low[b] if isinstance(low, list) else low), (high[b] if isinstance(high, list)
                                                             else high)
        if not lo <= n <= hi:
            raise ValueError(f"{name}[{b}] = {n} is outside [{lo}, {hi}] ({why})")


class _Cache:
    """Where each sequence's tokens live: dense rows (``cache_batch_idx``) or pages."""

    def __init__(self, q, k_cache, v_cache, cache_batch_idx, block_table):
        batch = q.shape[0]
        self.k_cache, self.v_cache = k_cache, v_cache
        if k_cache.shape[:3] != v_cache.shape[:3]:
            raise ValueError(f"k_cache and v_cache must agree on their first 3 dims, got "
                             f"k_cache={tuple(k_cache.shape)}, v_cache={tuple(v_cache.shape)}")
        if k_cache.shape[3] != q.shape[3]:
            raise ValueError(f"k_cache head size must equal q's, got q={tuple(q.shape)}, "
                             f"k_cache={tuple(k_cache.shape)}")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if t.dtype != q.dtype:
                raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
            if t.device != q.device:
                raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
        if q.shape[2] % max(k_cache.shape[2], 1):
            raise ValueError(f"the number of heads in k_cache ({k_cache.shape[2]}) must divide "
                             f"the number of heads in q ({q.shape[2]})")
        self.paged = block_table is not None
        if self.paged:
            if cache_batch_idx is not None:
                raise ValueError("cache_batch_idx must be None with a paged KV cache "
                                 "(block_table), as in FlashAttention")
            self.table = index_tensor("block_table", block_table, 2, q.device)
            if self.table.shape[0] != batch:
                raise ValueError(f"block_table must have one row per batch ({batch}), got "
                                 f"shape {tuple(self.table.shape)}")
            self.page = k_cache.shape[1]
            self.capacity = self.table.shape[1] * self.page
        else:
            self.capacity = k_cache.shape[1]
            rows = k_cache.shape[0]
            if cache_batch_idx is None:
                if rows < batch:
                    raise ValueError(f"k_cache has {rows} sequences but q has batch {batch} "
                                     f"(pass cache_batch_idx to pick cache rows)")
                self.rows = None  # the first ``batch`` rows: made when an append needs them
            else:
                idx = index_tensor("cache_batch_idx", cache_batch_idx, 1, q.device)
                values = idx.tolist()
                if len(values) != batch:
                    raise ValueError(f"cache_batch_idx must have one entry per batch ({batch}), "
                                     f"got shape {tuple(idx.shape)}")
                _check_range("cache_batch_idx", values, 0, rows - 1, "rows of k_cache")
                self.rows = idx.to(device=k_cache.device, dtype=torch.int64)

    def _slots(self, positions: torch.Tensor, check: bool = True):
        """Index tuple of cache positions ``[B, S]`` (every one inside the cache); ``check``
        reads the pages on the host to name a bad block table entry."""
        if not self.paged:
            rows = torch.arange(positions.shape[0], device=self.k_cache.device) \
                if self.rows is None else self.rows
            return rows[:, None].expand_as(positions), positions
        table = self.table.to(device=positions.device, dtype=torch.int64)
        pages = table.gather(1, positions // self.page)
        bad = (pages < 0) | (pages >= self.k_cache.shape[0])
        if check and bool(bad.any()):
            b, s = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"block_table[{b}, {int(positions[b, s]) // self.page}] = "
                             f"{int(pages[b, s])} is not a page of k_cache (num_blocks = "
                             f"{self.k_cache.shape[0]})")
        return pages, positions % self.page

    def append(self, k, v, starts, check: bool = True) -> None:
        """Write ``k``/``v`` ``[B, S_new, ...]`` at positions ``starts[b] ..`` (host ints, or a
        ``[B, 1]`` device tensor)."""
        if not isinstance(starts, torch.Tensor):
            starts = torch.tensor(starts, device=k.device)[:, None]
        positions = starts + torch.arange(k.shape[1], device=k.device)
        where = self._slots(positions, check)
        self.k_cache.index_put_(where, k)
        self.v_cache.index_put_(where, v)

    def keys(self, lefts: list[int], ends: list[int]):
        """Each sequence's cache positions ``lefts[b] .. ends[b] - 1`` as a padded batch (slots
        past a length may hold anything, NaN included) and the lengths."""
        lens = [e - s for s, e in zip(lefts, ends)]
        width = max(1, max(lens))
        if self.capacity == 0:  # an empty cache: one slot that Padding hides
            shape = (len(lens), 1, *self.k_cache.shape[2:])
            return self.k_cache.new_zeros(shape), \
                self.v_cache.new_zeros(*shape[:3], self.v_cache.shape[3]), lens
        if self.paged:  # no leftpad with pages (FlashAttention's rule, checked by the caller)
            k, v = gather_pages(self.k_cache, self.v_cache, self.table, ends)
            k, v = k[:, :width], v[:, :width]
        else:
            device = self.k_cache.device
            positions = (torch.tensor(lefts, device=device)[:, None] +
                         torch.arange(width, device=device)).clamp(max=self.capacity - 1)
            where = self._slots(positions)
            k, v = self.k_cache[where], self.v_cache[where]
        return k, v, lens  # the call's Padding hides what lies past each length (execution)


def _new_kv(k, v, q, cache: _Cache):
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (the new keys and values to append)")
    if k is None:
        return None, None
    for name, t, dim in (("k", k, cache.k_cache.shape[3]), ("v", v, cache.v_cache.shape[3])):
        checks.tensor(name, t, ndim=4, what="[batch_size, seqlen_new, nheads_k, headdim]")
        expected = (q.shape[0], k.shape[1], cache.k_cache.shape[2], dim)
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must have shape {expected} (batch, seqlen_new, the cache's "
                             f"heads and head size), got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    return k, v


def _rotary_tables(rotary_cos, rotary_sin, head_dim: int, need: int):
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin must be given together")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        checks.tensor(name, t, ndim=2, what="[seqlen_ro, rotary_dim / 2]", floating=True)
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos and rotary_sin must have the same shape, got "
                         f"{tuple(rotary_cos.shape)} and {tuple(rotary_sin.shape)}")
    if 2 * rotary_cos.shape[1] > head_dim:
        raise ValueError(f"rotary_dim = 2 * rotary_cos.shape[1] = {2 * rotary_cos.shape[1]} "
                         f"must be <= headdim ({head_dim})")
    if rotary_cos.shape[0] < need:
        raise ValueError(f"rotary_cos/rotary_sin have {rotary_cos.shape[0]} positions, but "
                         f"positions up to {need - 1} are rotated")
    return rotary_cos, rotary_sin


@runtime_errors
def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | int | None = None,
                            cache_batch_idx: torch.Tensor | None = None,
                            cache_leftpad: torch.Tensor | None = None,
                            block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: WindowSize = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
                            num_splits: int = 0, return_softmax_lse: bool = False) -> Any:
    """FlashAttention's ``flash_attn_with_kvcache`` (inference: no autograd).

    Args:
        q: ``[B, S_q, H, D]``.
        k_cache, v_cache: dense ``[B_cache, S_cache, H_k, D]`` (``D_v`` for v), or paged
            ``[num_blocks, page_size, H_k, D]`` with ``block_table`` (any page size).
        k, v: optional new tokens ``[B, S_new, H_k, D]``, written into the caches *in place* at
            positions ``cache_seqlens[b] ..`` before attending (the caches must hold them).
        rotary_cos, rotary_sin: optional ``[S_ro, rotary_dim / 2]``: rotary embedding of ``q``
            and the new ``k`` (needs ``k``); see the module docstring for the positions.
        cache_seqlens: int or int32 ``[B]``: tokens already in the cache (None: ``S_cache``).
        cache_batch_idx: int32 ``[B]``: cache row of each sequence (dense caches only).
        cache_leftpad: int32 ``[B]``: first valid cache position of each sequence (dense only).
        block_table: int32 ``[B, max_blocks]``: token ``t`` is row ``t % page_size`` of page
            ``block_table[b, t // page_size]``.
        softmax_scale, causal, window_size, softcap, alibi_slopes: as ``flash_attn_func`` over
            each sequence's ``cache_seqlens[b] + S_new - cache_leftpad[b]`` keys.
        rotary_interleaved: pairs ``(0, 1), (2, 3)...`` (True) or ``(i, i + rotary_dim / 2)``.
        num_splits: accepted for compatibility; results do not depend on it.
        return_softmax_lse: also return ``softmax_lse`` ``[B, H, S_q]``.

    Returns:
        ``out`` ``[B, S_q, H, D_v]``, or ``(out, softmax_lse)``.

    Equivalent PyTorch (dense, no leftpad, no rotary; ``n = cache_seqlens[b]``)::

        k_cache[b, n:n + S_new] = k[b]; v_cache[b, n:n + S_new] = v[b]
        out[b] = flash_attn_func(q[b:b+1], k_cache[b:b+1, :n + S_new],
                                 v_cache[b:b+1, :n + S_new], causal=causal)[0]
    """
    q = checks.tensor("q", q, ndim=4, what="[batch_size, seqlen_q, nheads, headdim]")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        checks.tensor(name, t, ndim=4, what="[batch_size_cache, seqlen_cache, nheads_k, headdim] "
                       "(or [num_blocks, page_block_size, nheads_k, headdim] with block_table)")
    cache = _Cache(q, k_cache, v_cache, cache_batch_idx, block_table)
    k, v = _new_kv(k, v, q, cache)
    batch, seq_q, heads, head_dim = q.shape
    seq_new = 0 if k is None else k.shape[1]
    if k is not None and cache_seqlens is None:
        raise ValueError("cache_seqlens must be given with new k/v (where to append them)")
    if native.takes_kvcache(q, cache_seqlens, cache_batch_idx, cache_leftpad, alibi_slopes):
        left, right = window_pair(window_size)
        opts = Options.of(head_dim, 0.0, softmax_scale, causal, left, right, softcap)
        checks.flag("rotary_interleaved", rotary_interleaved)
        checks.integer("num_splits", num_splits, tensors=True)
        checks.flag("return_softmax_lse", return_softmax_lse)
        rotary = _rotary_tables(rotary_cos, rotary_sin, head_dim, 0)
        if rotary is not None and k is None:
            raise ValueError("rotary_cos/rotary_sin need new k/v (rotary embedding is applied "
                             "to q and to the appended keys)")
        res = native.kvcache(q, cache, k, v, cache_seqlens, block_table, rotary,
                             rotary_interleaved, opts)
        if res is not None:
            out, lse = res
            out = out.contiguous()
            return (out, lse.contiguous()) if return_softmax_lse else out
    lens = _lengths("cache_seqlens", cache_seqlens, batch, q.device, cache.capacity)
    # A paged sequence is bounded by its block_table row, so the message names it (as
    # attention_with_kvcache's does).
    holder = (f"block_table holds {cache.table.shape[1]} pages of {cache.page} tokens"
              if cache.paged else f"the cache holds {cache.capacity} tokens")
    _check_range("cache_seqlens", lens, 0, cache.capacity - seq_new,
                 f"{holder} and {seq_new} are appended")
    if cache_leftpad is not None and cache.paged:
        raise ValueError("cache_leftpad must be None with a paged KV cache (block_table), as in "
                         "FlashAttention")
    lefts = [0] * batch
    if cache_leftpad is not None:
        lefts = _lengths("cache_leftpad", index_tensor("cache_leftpad", cache_leftpad, 1,
                                                        q.device), batch, q.device, 0)
        _check_range("cache_leftpad", lefts, 0, lens, "0 <= cache_leftpad <= cache_seqlens")
    left, right = window_pair(window_size)
    opts = Options.of(head_dim, 0.0, softmax_scale, causal, left, right, softcap)
    checks.flag("rotary_interleaved", rotary_interleaved)
    checks.integer("num_splits", num_splits, tensors=True)
    checks.flag("return_softmax_lse", return_softmax_lse)
    alibi = alibi_arg(alibi_slopes, batch, heads, q.device)
    per_token = _core.fa_positions_per_token(opts, cache.capacity)
    need = max(n + max(seq_new, seq_q if per_token else 1) for n in lens)
    rotary = _rotary_tables(rotary_cos, rotary_sin, head_dim, need)
    if rotary is not None and k is None:
        raise ValueError("rotary_cos/rotary_sin need new k/v (rotary embedding is applied to "
                         "q and to the appended keys)")

    with torch.no_grad():
        starts = torch.tensor(lens, device=q.device)[:, None]
        if rotary is not None:
            step = torch.arange(seq_q, device=q.device) if per_token else \
                torch.zeros(seq_q, dtype=torch.int64, device=q.device)
            positions = starts + torch.arange(seq_new, device=q.device)
            q = apply_rotary(q, *rotary, starts + step, rotary_interleaved)  # type: ignore[call-arg]
            k = apply_rotary(k, *rotary, positions,  # type: ignore[call-arg]
                             rotary_interleaved)
        if k is not None:
            cache.append(k, v, lens)
        keys, values, lens_k = cache.keys(lefts, [n + seq_new for n in lens])
        mask = with_padding(_core.fa_mask(opts, cache.capacity, all(n == seq_q for n in lens_k),
                                           alibi is not None),
                            [seq_q] * batch, lens_k, seq_q, keys.shape[1])
        out, lse, *_ = _core.forward(q, keys, values, mask, alibi, opts, False, None)
    out = out.contiguous()
    return (out, lse.contiguous()) if return_softmax_lse else out
