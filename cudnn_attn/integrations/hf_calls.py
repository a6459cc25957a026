"""The engine call for one of transformers' masks kept structured
(:class:`~cudnn_attn.integrations.hf_masks.StructuredMask`): which ``Causal`` /
``SlidingWindow`` / ``Padding`` / per-sequence lengths give exactly what transformers' "sdpa"
gives at every real token, or None when only transformers' dense mask does.

Query/key tensors arrive as transformers hands them to an attention function: ``[B, H, S, D]``;
results are ``[B, S_q, H_q, D_v]``. The routes:

* packed sequences (``segments``): ``attention_varlen`` with ``cu_seqlens`` from the sequence
  ids, as transformers' FlashAttention-2 integration does (``cu_seqlens`` is read on the host,
  as there);
* host-free (a static cache's tensor ``q_offset``, or any step under ``torch.compile``; keys are
  every slot the mask covers): causal without a 2-D mask is ``Padding(S_q, start + S_q)`` (slots
  past the last query are not filled yet) with a bottom-right band; one query with a 2-D mask
  (decoding) gathers its visible keys (real, not after it, inside the window) to the front with a
  stable sort on the device and runs ``Padding(1, count)``, exact for any mask, holes included;
  bidirectional attention gathers the real keys (every query sees the same ones). A multi-token
  causal step with a 2-D mask, or a bidirectional window with one, is served here only when
  eager (the offset is then read on the host and the rules below apply); compiled, it keeps the
  dense mask, since checking the mask's layout would need a host synchronisation;
* no padding: the band alone, aligned top-left or bottom-right;
* padding: right padding (each row's tokens a prefix) as ``Padding(S_q, lengths)``; otherwise the
  real tokens packed into ``attention_varlen`` when that keeps every query's keys (left padding;
  holes in causal, window-free attention; cached steps), else one query's keys gathered as
  above. A multi-token window with holes in the padding stays dense: a window counts
  positions, packing closes the holes, and no mask hides a key inside a row.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from ..api import attention
from ..model.masks import Causal, Padding, SlidingWindow
from ..rewrites.sinks import merge_sinks
from ..varlen import attention_varlen
from .hf_masks import StructuredMask

__all__ = ["structured_call", "band_mask", "segment_bounds"]


def band_mask(struct: StructuredMask, alignment: str):
    """Causal / SlidingWindow / None for the structure, with ``alignment``: transformers'
    causal ``sliding_window = w`` is ``SlidingWindow(w - 1, 0)``, its bidirectional one
    (``|q - k| <= w``) ``SlidingWindow(w, w)``."""
    if struct.causal:
        return Causal(alignment) if struct.window is None else \
            SlidingWindow(struct.window - 1, 0, alignment)
    return None if struct.window is None else SlidingWindow(struct.window, struct.window, alignment)


def _alignment(struct: StructuredMask):
    """How query ``i`` lines up with key ``j`` (absolute positions ``q_offset + i`` and
    ``kv_offset + j``): ``"bottom_right"`` when the queries are the last keys, ``"top_left"``
    when both start together, else None (no mask of ours aligns them)."""
    shift = struct.q_offset - struct.kv_offset
    if shift == struct.kv_length - struct.q_length:
        return "bottom_right"
    return "top_left" if shift == 0 else None


def _one_run(valid: torch.Tensor) -> bool:
    """Every row's True entries are contiguous (left or right padding, no holes)."""
    starts = valid[:, 1:] & ~valid[:, :-1]
    return bool((starts.sum(1) + valid[:, 0].to(starts.dtype) <= 1).all())


def _is_prefix(valid: torch.Tensor, lens: torch.Tensor) -> bool:
    """Each row's True entries are its first ``lens[b]`` (right padding)."""
    return bool((valid == (torch.arange(valid.shape[1], device=valid.device) < lens[:, None])).all())


def _packed_queries(struct: StructuredMask):
    """``(queries [B, S_q] bool, alignment)`` for the packed form, or None when it would not
    keep each query's keys.

    Bidirectional: every query, every real key; with a window (it counts positions) only when
    each row's tokens are contiguous and queries and keys start together. Causal, queries and
    keys starting together (prefill) with each row's tokens contiguous (left or right padding):
    the queries from the row's first token on, top-left aligned, so trailing padding queries see
    what "sdpa" shows them. Otherwise (a cache, holes): the real queries, bottom-right aligned,
    which needs each query's own slot among the keys, no real key after the last query, and,
    for a window, contiguous tokens.
    """
    padding: Any = struct.padding
    shift = struct.q_offset - struct.kv_offset
    contiguous = _one_run(padding)
    if not struct.causal:
        if struct.window is None:
            return torch.ones(padding.shape[0], struct.q_length, dtype=torch.bool,
                              device=padding.device), "top_left"
        if shift != 0 or struct.q_length != struct.kv_length or not contiguous:
            return None
        return padding, "top_left"
    if shift == 0 and contiguous:
        first = padding.to(torch.int8).argmax(1)
        return torch.arange(struct.q_length, device=padding.device) >= first[:, None], "top_left"
    if shift < 0 or shift + struct.q_length > struct.kv_length:
        return None
    if bool(padding[:, shift + struct.q_length:].any()):
        return None
    if struct.window is not None and not contiguous:
        return None
    return padding[:, shift:shift + struct.q_length], "bottom_right"


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, mask, kw):
    """``attention_varlen`` on packed ``[total, H, D]`` tokens, sinks merged after it."""
    kw = dict(kw)
    sinks = kw.pop("sinks")
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, mask=mask,
                           return_lse=sinks is not None, **kw)
    if sinks is not None:
        out, lse = out
        out = merge_sinks(out[None], lse[None], sinks, "bshd")[0][0]
    return out


def _cu(lens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)


def _padded_call(struct, real_q, alignment, query, key, value, kw):
    """``[B, S_q, H, D_v]`` through ``attention_varlen`` on the real tokens (zeros elsewhere)."""
    padding = struct.padding
    lens_q, lens_k = real_q.sum(1), padding.sum(1)
    q = query.transpose(1, 2)[real_q]                  # [total_q, H, D]
    k, v = (t.transpose(1, 2)[padding] for t in (key, value))
    out = _varlen(q, k, v, _cu(lens_q), _cu(lens_k), int(lens_q.max()), int(lens_k.max()),
                  band_mask(struct, alignment), kw)
    batch, seq_q = real_q.shape
    full = out.new_zeros(batch, seq_q, *out.shape[1:])
    return full.index_put(tuple(real_q.nonzero().t()), out)


def segment_bounds(segments: torch.Tensor) -> torch.Tensor:
    """int32 ``cu_seqlens`` of the packed sequences in ``segments`` ``[B, S]`` (a new sequence
    where the id changes, and at each row's start), for the ``B * S`` tokens back to back."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    firsts = starts.reshape(-1).nonzero().reshape(-1)
    return torch.cat([firsts, firsts.new_full((1,), starts.numel())]).to(torch.int32)


def _packed_sequences_call(struct, query, key, value, kw):
    """Packed sequences: each one alone (its band top-left), through ``attention_varlen``."""
    segments = struct.segments
    batch, seq = segments.shape
    if query.shape[2] != seq or key.shape[2] != seq:
        return None
    cu = segment_bounds(segments)
    q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[3])
               for t in (query, key, value))
    out = _varlen(q, k, v, cu, cu, seq, seq, band_mask(struct, "top_left"), kw)
    return out.view(batch, seq, *out.shape[1:])


def _gathered_call(query, key, value, visible, lens_q, kw):
    """Each row's ``visible`` keys (``[B, S_k]``, the same for all its queries) gathered to the
    front in order (a stable sort on the device), then ``Padding(lens_q, count)``."""
    order = torch.sort((~visible).to(torch.int8), dim=1, stable=True).indices
    k, v = (t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
            for t in (key, value))
    count = visible.sum(1)
    mask = Padding(torch.full_like(count, lens_q), count)
    return attention(query, k, v, mask=mask, **kw).transpose(1, 2)


def _bidirectional_host_free(struct, query, key, value, kw):
    """Bidirectional attention without reading anything on the host: every query sees every
    real key (gathered when a 2-D mask is given); a window only without padding and with queries
    and keys starting together."""
    if struct.window is None:
        if struct.padding is None:
            return attention(query, key, value, **kw).transpose(1, 2)
        return _gathered_call(query, key, value, struct.padding.to(query.device), struct.q_length,
                              kw)
    aligned = isinstance(struct.q_offset, int) and struct.q_offset == struct.kv_offset and \
        struct.q_length == struct.kv_length
    if struct.padding is not None or not aligned:
        return None
    return attention(query, key, value, mask=band_mask(struct, "top_left"),
                     **kw).transpose(1, 2)


def _host_free_call(struct, query, key, value, kw):
    """The call with nothing read on the host (a static cache's tensor offset, a compiled
    step): keys are every slot of the cache (or the layer's keys), ``q_offset`` a tensor or an
    int. None when the structure cannot serve it without reading the mask's layout."""
    if key.shape[2] != struct.kv_length:
        return None
    if not struct.causal:
        return _bidirectional_host_free(struct, query, key, value, kw)
    batch, device = query.shape[0], query.device
    start = struct.q_offset - struct.kv_offset   # the first query's key slot (int or tensor)
    start = start.to(device) if isinstance(start, torch.Tensor) else start
    band = band_mask(struct, "bottom_right")
    if struct.padding is None:
        if isinstance(start, int) and start + struct.q_length == struct.kv_length:
            return attention(query, key, value, mask=band, **kw).transpose(1, 2)
        # Slots past the last query are not filled yet; per batch, i' = i + start (bottom-right).
        lens_q = torch.full((batch,), struct.q_length, dtype=torch.int64, device=device)
        mask = band & Padding(lens_q, lens_q + start)
        return attention(query, key, value, mask=mask, **kw).transpose(1, 2)
    if struct.q_length != 1:
        return None
    # One query (decoding): its visible keys (real, not after it, inside the window), gathered.
    # Exact for any 2-D mask, holes included.
    slots = torch.arange(struct.kv_length, device=device)
    visible = struct.padding.to(device) & (slots <= start)
    if struct.window is not None:
        visible = visible & (slots > start - struct.window)
    return _gathered_call(query, key, value, visible, 1, kw)


def structured_call(struct: StructuredMask, query, key, value, **kw) -> Optional[torch.Tensor]:
    """``[B, S_q, H, D_v]`` for a structured mask, or None when only the dense mask serves.
    ``kw``: ``attention``'s ``scale``, ``dropout_p``, ``softcap`` and ``sinks``."""
    if struct.segments is not None:
        return _packed_sequences_call(struct, query, key, value, kw)
    compiling = torch.compiler.is_compiling()
    if isinstance(struct.q_offset, torch.Tensor) or compiling:
        out = _host_free_call(struct, query, key, value, kw)
        if out is not None or compiling:
            return out
        # Eager, a multi-token step with a 2-D mask: read the offset, then the rules below.
        struct = dataclasses.replace(struct, q_offset=int(struct.q_offset))
    alignment = _alignment(struct)
    if struct.padding is None or bool(struct.padding.all()):
        if alignment is None:  # e.g. a sliding cache not full yet: Padding of its filled slots
            return _host_free_call(struct, query, key, value, kw)
        return attention(query, key, value, mask=band_mask(struct, alignment),
                         **kw).transpose(1, 2)
    lens_k = struct.padding.sum(1)
    if alignment == "top_left" and _is_prefix(struct.padding, lens_k):
        # Right padding: Padding hides the keys past each length and keeps every query row, so
        # padding queries get what "sdpa" gives them too (generate() reads the last one).
        full_q = torch.full_like(lens_k, struct.q_length)
        band = band_mask(struct, "top_left")
        padding = Padding(full_q, lens_k)
        return attention(query, key, value, mask=padding if band is None else band & padding,
                         **kw).transpose(1, 2)
    packed = _packed_queries(struct)
    if packed is None:  # one query (decoding) still has an exact form: its keys gathered
        return _host_free_call(struct, query, key, value, kw)
    real_q, alignment = packed
    return _padded_call(struct, real_q, alignment, query, key, value, kw)
