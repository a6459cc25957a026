"""Packed variable-length attention and decoding against a (paged) KV cache.

Both entry points run on every engine through :func:`cudnn_attn.attention`, so each engine sees an
ordinary problem and autograd flows through the (index) ops that pack and unpack. Varlen calls the
torch engine runs become one dense batch per distinct ``(len_q, len_k)``: each sequence costs what
its own length costs. Others (GPU engines, dropout) become one ``bshd`` batch padded to the longest
sequence with a ``Padding`` mask. A KV-cache call is one padded batch.

* ``attention_varlen`` — FlashAttention's ``flash_attn_varlen_func`` layout: ``[total, H, D]``
  tensors with ``cu_seqlens``. Each sequence ``b`` (tokens ``cu_seqlens[b]:cu_seqlens[b+1]``) is an
  independent attention problem; masks and positions are local to it.
* ``attention_with_kvcache`` — FlashAttention's ``flash_attn_with_kvcache`` without the in-place
  append: queries ``[B, S_q, H, D]`` against the first ``cache_seqlens[b]`` keys of a dense
  ``[B, S_max, H_kv, D]`` cache or a paged ``[num_blocks, page_size, H_kv, D]`` one.

Helpers for surfaces (public, shared with ``compat.flash_attn``; validators come from
``cudnn_attn._checks``):

* ``cu_lengths(name, cu, total, tensor_name, device)`` — checked ``cu_seqlens`` -> lengths;
* ``token_slots(lens, seq, device)`` — padded-buffer row of each packed token;
* ``pad_tokens(x, lens, seq, slots)`` — ``[total, ...]`` -> ``[B, seq, ...]``, zeros past lengths;
* ``gather_pages(k_cache, v_cache, block_table, lens)`` — dense ``[B, S, H_kv, D]`` from a paged cache;
* ``with_padding(mask, lens_q, lens_kv, seq_q, seq_kv)`` — ``mask & Padding(...)`` when needed;
* ``index_tensor(name, t, rank, device)`` — an int32/int64 tensor on q's device or the CPU.

Grouping packed sequences by length (the torch engine's varlen path) is ``varlen_groups``.
"""

from __future__ import annotations

import torch

from . import _checks, call_spec, entry_ops
from .api import attention
from .sinks import check_sinks, merge_sinks
from .varlen_groups import by_length_groups, grouped_varlen
from .custom_ops import SEED_BOUND
from .problem import accumulator_dtype
from .masks import Alibi, Mask, Neighborhood, Padding, mask_parts

__all__ = ["attention_varlen", "attention_with_kvcache", "cu_lengths", "token_slots", "pad_tokens",
           "gather_pages", "with_padding", "index_tensor"]

# ---------------------------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------------------------

def index_tensor(name: str, t, rank: int, device: torch.device) -> torch.Tensor:
    """``_checks.index_tensor`` (int32/int64, ``rank`` dims) on q's ``device`` or the CPU, with the
    device named as q's (the wording the varlen/kvcache errors have always had)."""
    return _checks.index_tensor(name, t, ndim=rank, device=device, device_name="q's device")


def _check_user_mask(mask, where: str) -> None:
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


def _check_bias(bias, full: tuple, dims: str):
    """``bias`` is None, an ``Alibi`` or a tensor broadcastable to ``full`` (named by ``dims``)."""
    if bias is None or isinstance(bias, Alibi):
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be None, an Alibi or a torch.Tensor, got {type(bias).__name__}")
    ok = bias.dim() <= 4 and all(b in (1, f) for b, f in zip(reversed(bias.shape), reversed(full)))
    if not ok:
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to {dims} = "
                         f"{list(full)}")


def with_padding(mask, lens_q, lens_kv, seq_q: int, seq_kv: int):
    """``mask & Padding(...)``; the padding is left out when every sequence fills the batch."""
    if all(n == seq_q for n in lens_q) and all(n == seq_kv for n in lens_kv):
        return mask
    padding = Padding(lens_q, lens_kv)
    return padding if mask is None else mask & padding


# ---------------------------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------------------------

def cu_lengths(name: str, cu, total: int, tensor_name: str, device) -> list[int]:
    cu = index_tensor(name, cu, 1, device)
    if cu.numel() < 2:
        raise ValueError(f"{name} must have B + 1 >= 2 entries, got shape {tuple(cu.shape)}")
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


def token_slots(lens: list[int], seq: int, device) -> torch.Tensor:
    """Row ``b * seq + i`` of the padded ``[B * seq, ...]`` buffer for each packed token."""
    counts = torch.tensor(lens, dtype=torch.int64)
    batch = torch.repeat_interleave(torch.arange(len(lens)), counts)
    starts = torch.cumsum(counts, 0) - counts
    slots = batch * seq + torch.arange(int(counts.sum())) - starts[batch]
    return slots.to(device)


def pad_tokens(x: torch.Tensor, lens: list[int], seq: int, slots: torch.Tensor) -> torch.Tensor:
    """``[total, H, D]`` -> ``[B, seq, H, D]`` with zeros past each length (differentiable)."""
    batch = len(lens)
    if all(n == seq for n in lens):
        return x.reshape(batch, seq, *x.shape[1:])
    buf = x.new_zeros(batch * seq, *x.shape[1:])
    return buf.index_copy(0, slots, x).view(batch, seq, *x.shape[1:])


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     mask=None, bias=None, scale=None, dropout_p=0.0, softcap=None,
                     return_lse=False, backend="auto", generator=None):
    """Attention over packed variable-length sequences (FlashAttention's varlen layout).

    Args:
        q: ``[total_q, H_q, D_qk]``, the queries of all sequences back to back.
        k: ``[total_k, H_kv, D_qk]``; ``H_q % H_kv == 0`` (GQA/MQA as in ``attention``).
        v: ``[total_k, H_kv, D_v]``.
        cu_seqlens_q, cu_seqlens_k: int32/int64 ``[B + 1]`` cumulative lengths on q's device (or
            the CPU): ``0``, non-decreasing, ending at ``total_q`` / ``total_k``. Sequence ``b`` owns queries
            ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and keys ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``.
            Empty sequences are allowed (an empty key set gives ``out = 0``, ``lse = -inf``).
        max_seqlen_q, max_seqlen_k: ints at least the longest sequence (bounds only: the cost
            follows the sequences' own lengths).
        mask: ``Causal``, ``SlidingWindow`` or their ``&``, applied inside each sequence with its own
            lengths: ``"bottom_right"`` aligns each sequence's last query with its last key
            (``i' = i + len_k[b] - len_q[b]``). ``Padding`` and ``Neighborhood`` raise ``ValueError``.
        bias: ``Alibi`` (positions local to each sequence, aligned like the mask), or a tensor
            broadcastable to ``[B, H_q, max_seqlen_q, max_seqlen_k]`` whose ``[b, h, i, j]`` entry is
            added to the score of query ``i`` and key ``j`` *of sequence b* (local positions).
        scale, dropout_p, softcap, backend, generator: as in ``attention``.
        return_lse: also return the log-sum-exp, packed as FlashAttention 2's varlen
            ``softmax_lse``: ``[H_q, total_q]``, float32 (float64 for float64 inputs).

    Returns:
        ``out`` ``[total_q, H_q, D_v]`` in q's dtype, or ``(out, lse)``.

    Equivalent PyTorch (``attention`` on each sequence alone)::

        outs = [attention(q[None, a:b], k[None, c:d], v[None, c:d], layout="bshd", mask=mask)[0]
                for (a, b), (c, d) in zip(pairs(cu_seqlens_q), pairs(cu_seqlens_k))]
        out = torch.cat(outs)
    """
    if torch.compiler.is_compiling():  # lengths are read on the host: one op in the graph
        return _traced("varlen", [q, k, v, cu_seqlens_q, cu_seqlens_k], [max_seqlen_q, max_seqlen_k],
                       mask, bias, scale, dropout_p, softcap, return_lse, backend, generator)
    q = _checks.tensor("q", q, ndim=3, what="[total_q, H_q, D_qk]")
    k = _checks.tensor("k", k, ndim=3, what="[total_k, H_kv, D_qk]")
    v = _checks.tensor("v", v, ndim=3, what="[total_k, H_kv, D_v]")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same tokens and heads, got k={tuple(k.shape)}, "
                         f"v={tuple(v.shape)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"k head dim must equal q head dim, got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}")
    if q.shape[1] % max(k.shape[1], 1):
        raise ValueError(f"query heads must be a multiple of kv heads (GQA/MQA), got "
                         f"H_q={q.shape[1]}, H_kv={k.shape[1]}")
    lens_q = cu_lengths("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q", q.device)
    lens_k = cu_lengths("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k", q.device)
    if len(lens_q) != len(lens_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got "
                         f"{len(lens_q)} and {len(lens_k)} sequences")
    max_q, max_k = (_checks.integer(name, value, tensors=True, maximum=_checks.MAX_POSITION)
                    for name, value in (("max_seqlen_q", max_seqlen_q),
                                        ("max_seqlen_k", max_seqlen_k)))
    for name, value, lens, cu_name in (("max_seqlen_q", max_q, lens_q, "cu_seqlens_q"),
                                       ("max_seqlen_k", max_k, lens_k, "cu_seqlens_k")):
        if value < max(lens):
            raise ValueError(f"{name} must be >= the longest sequence in {cu_name} "
                             f"({max(lens)}), got {value}")
    _check_user_mask(mask, "attention_varlen")
    batch = len(lens_q)
    _check_bias(bias, (batch, q.shape[1], max_q, max_k), "[B, H_q, max_seqlen_q, max_seqlen_k]")
    if by_length_groups(q, backend, dropout_p):
        return grouped_varlen(q, k, v, lens_q, lens_k, mask, bias, scale, softcap, return_lse,
                        backend)
    # The batch pads to the longest sequence, not to max_seqlen (a generous bound costs
    # nothing); the engines need non-empty axes: an all-empty side pads to one slot Padding hides.
    seq_q, seq_k = max(max(lens_q), 1), max(max(lens_k), 1)
    if isinstance(bias, torch.Tensor):
        if max(lens_q) == 0 or max(lens_k) == 0:
            bias = None  # no query or no key anywhere: the bias touches no score
        else:
            # Local positions past every sequence are unused: crop the (S_q, S_k) axes it has.
            bias = bias[..., :seq_q, :seq_k] if bias.dim() >= 2 else bias[..., :seq_k]

    slots_q = token_slots(lens_q, seq_q, q.device)
    slots_k = slots_q if lens_k == lens_q and seq_k == seq_q else token_slots(lens_k, seq_k, q.device)
    res = attention(pad_tokens(q, lens_q, seq_q, slots_q), pad_tokens(k, lens_k, seq_k, slots_k),
                    pad_tokens(v, lens_k, seq_k, slots_k),
                    mask=with_padding(mask, lens_q, lens_k, seq_q, seq_k), bias=bias,
                    scale=scale, dropout_p=dropout_p, softcap=softcap, layout="bshd",
                    return_lse=return_lse, backend=backend, generator=generator)
    out, lse = res if return_lse else (res, None)
    out = out.reshape(batch * seq_q, *out.shape[2:]).index_select(0, slots_q)
    if not return_lse:
        return out
    # [B, H, S] -> [H, B*S] -> the packed tokens: FlashAttention 2's varlen [H, total_q].
    lse = lse.permute(1, 0, 2).reshape(lse.shape[1], batch * seq_q).index_select(1, slots_q)
    return out, lse


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------

def _cache_lengths(cache_seqlens, batch: int, capacity: int, device, where: str) -> list[int]:
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() != 0:
        lens = index_tensor("cache_seqlens", cache_seqlens, 1, device).tolist()
    elif isinstance(cache_seqlens, (list, tuple)):
        lens = [_checks.integer("cache_seqlens", n, tensors=True) for n in cache_seqlens]
    else:
        lens = [_checks.integer("cache_seqlens", cache_seqlens, tensors=True)] * batch
    if len(lens) != batch:
        raise ValueError(f"cache_seqlens must have one entry per batch ({batch}), got {len(lens)}")
    for b, n in enumerate(lens):
        if not 0 <= n <= capacity:
            raise ValueError(f"cache_seqlens[{b}] = {n} is outside [0, {capacity}] ({where})")
    return lens


def gather_pages(k_cache, v_cache, block_table, lens: list[int]):
    """Copy each sequence's pages (only the first ``ceil(max(lens) / page_size)``) in order."""
    num_blocks, page = k_cache.shape[0], k_cache.shape[1]
    n_blocks = max(1, -(-max(lens) // page))
    table = block_table[:, :n_blocks].tolist()
    for b, (row, n) in enumerate(zip(table, lens)):
        need = -(-n // page)
        for j, page_id in enumerate(row[:need]):
            if not 0 <= page_id < num_blocks:
                raise ValueError(f"block_table[{b}, {j}] = {page_id} is not a page of k_cache "
                                 f"(num_blocks = {num_blocks}); sequence {b} needs {need} pages "
                                 f"for cache_seqlens[{b}] = {n}")
        row[need:] = [0] * (n_blocks - need)  # unused entries may hold anything: read page 0
    index = torch.tensor(table, dtype=torch.int64, device=k_cache.device).view(-1)
    batch = len(lens)

    def gather(cache):
        pages = cache.index_select(0, index)
        return pages.view(batch, n_blocks * page, *cache.shape[2:])

    return gather(k_cache), gather(v_cache)


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, *, block_table=None, mask=None,
                           bias=None, scale=None, softcap=None, return_lse=False, backend="auto",
                           sinks=None):
    """Queries against the first ``cache_seqlens[b]`` keys of each sequence's KV cache (inference).

    Args:
        q: ``[B, S_q, H_q, D_qk]`` (bshd): the new tokens, already appended to the cache.
        k_cache, v_cache: dense ``[B, S_max, H_kv, D]`` (``D_qk`` / ``D_v``), or paged
            ``[num_blocks, page_size, H_kv, D]`` with ``block_table`` (any page size).
        cache_seqlens: valid keys per sequence: an int (or 0-d tensor) for all, a sequence of ``B``
            ints or an int32/int64 ``[B]`` tensor; keys past it are masked and their contents never reach
            the result (uninitialised memory is fine). ``0`` gives ``out = 0``, ``lse = -inf``.
        block_table: int32/int64 ``[B, max_blocks_per_seq]``: token ``t`` of sequence ``b`` lives in
            page ``block_table[b, t // page_size]`` at row ``t % page_size``. Only the first
            ``ceil(cache_seqlens[b] / page_size)`` entries of a row are read.
        mask: ``Causal``/``SlidingWindow`` (or their ``&``). ``"bottom_right"`` aligns the query
            block to the end of each sequence's cache, FlashAttention's decode semantics: query
            ``i`` sits at position ``i' = i + cache_seqlens[b] - S_q``, so causal lets it see keys
            ``j <= i'``. ``"top_left"`` uses ``i' = i``. ``Padding``/``Neighborhood``: ``ValueError``.
        bias: ``Alibi`` (aligned like the mask), or a tensor broadcastable to
            ``[B, H_q, S_q, S_max]`` (dense) / ``[B, H_q, S_q, max_blocks_per_seq * page_size]``
            (paged), indexed by logical cache position.
        scale, softcap, backend: as in ``attention``. There is no dropout (inference).
        return_lse: also return the log-sum-exp ``[B, H_q, S_q]`` (as ``attention``).
        sinks: attention sinks, ``[H_q]`` logits (as ``attention``; gpt-oss decoding).

    Returns:
        ``out`` ``[B, S_q, H_q, D_v]``, or ``(out, lse)``.

    Equivalent PyTorch (dense; paged caches are first gathered through ``block_table``)::

        out_b = attention(q[b:b+1], k_cache[b:b+1, :n], v_cache[b:b+1, :n], layout="bshd",
                          mask=mask)        # n = cache_seqlens[b], per sequence
    """
    if sinks is not None:  # a merge over the result without them (cudnn_attn.sinks)
        out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens,
                                          block_table=block_table, mask=mask, bias=bias,
                                          scale=scale, softcap=softcap, return_lse=True,
                                          backend=backend)
        out, lse = merge_sinks(out, lse, check_sinks(sinks, lse.shape[1], q), "bshd")
        return (out, lse) if return_lse else out
    if torch.compiler.is_compiling():  # lengths are read on the host: one op in the graph
        lens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
        ints = [] if lens is not None else [cache_seqlens] if isinstance(cache_seqlens, int) \
            else [-1, *cache_seqlens]
        return _traced("kvcache", [q, k_cache, v_cache, lens, block_table], ints, mask, bias,
                       scale, 0.0, softcap, return_lse, backend, None)
    q = _checks.tensor("q", q, ndim=4, what="[B, S_q, H_q, D_qk] (bshd)")
    paged = block_table is not None
    leading = "num_blocks, page_size, H_kv" if paged else "B, S_max, H_kv"
    shape = f"[{leading}, D]"
    k_cache = _checks.tensor("k_cache", k_cache, ndim=4, what=shape)
    v_cache = _checks.tensor("v_cache", v_cache, ndim=4, what=shape)
    batch, seq_q, heads_q, _ = q.shape
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
    lens = _cache_lengths(cache_seqlens, batch, capacity, q.device, where)
    _check_user_mask(mask, "attention_with_kvcache")
    dims = ("[B, H_q, S_q, max_blocks_per_seq * page_size]" if paged
            else "[B, H_q, S_q, S_max]")
    _check_bias(bias, (batch, heads_q, seq_q, capacity), dims)

    if paged:
        k, v = gather_pages(k_cache, v_cache, block_table, lens)
    else:  # only the prefix some sequence uses; at least one slot (Padding hides it)
        used = max(1, max(lens))
        k, v = k_cache[:, :used], v_cache[:, :used]
    seq_k = k.shape[1]
    if min(lens) < seq_k:
        # Slots past a length may hold anything (uninitialised memory, NaN): a hidden key's
        # weight is 0, but 0 * NaN is not, so zero them.
        hidden = torch.arange(seq_k, device=k.device)[None, :] >= \
            torch.tensor(lens, device=k.device)[:, None]
        hidden = hidden[:, :, None, None]
        k, v = k.masked_fill(hidden, 0), v.masked_fill(hidden, 0)
    if isinstance(bias, torch.Tensor) and bias.dim() >= 1 and bias.shape[-1] != 1:
        bias = bias[..., :seq_k]
    return attention(q, k, v, mask=with_padding(mask, [seq_q] * batch, lens, seq_q, seq_k),
                     bias=bias, scale=scale, softcap=softcap, layout="bshd",
                     return_lse=return_lse, backend=backend)



# ---------------------------------------------------------------------------------------------
# The traced path: both entry points as entry_ops' custom op (forward, and backward by recompute)
# ---------------------------------------------------------------------------------------------

def _traced(name, tensors, ints, mask, bias, scale, dropout_p, softcap, return_lse, backend,
            generator):
    table = bias if isinstance(bias, torch.Tensor) else None
    seed = None
    if dropout_p > 0:
        device = generator.device if generator is not None else "cpu"
        seed = torch.randint(0, SEED_BOUND, (1,), generator=generator, device=device)
    spec = call_spec.encode(mask=mask, bias_kind="none" if table is None else "tensor",
                            alibi=bias if isinstance(bias, Alibi) else None, scale=scale,
                            dropout_p=dropout_p, softcap=softcap, layout="bshd", backend=backend,
                            return_lse=return_lse, requires_grad=False, bias_requires_grad=False)
    out, lse = entry_ops.call(name, [*tensors, table, seed], spec, ints)
    return (out, lse) if return_lse else out


def _bias_of(table, call):
    return table if table is not None else call.alibi


def _run_varlen(tensors, call, ints):
    q, k, v, cu_q, cu_k, table, seed = tensors
    generator = None
    if seed is not None:  # the op's forward and its backward recompute draw the same stream
        generator = torch.Generator(device=seed.device)
        generator.manual_seed(int(seed[0]))
    return attention_varlen(q, k, v, cu_q, cu_k, ints[0], ints[1], mask=call.mask(),
                            bias=_bias_of(table, call), scale=call.scale,
                            dropout_p=call.dropout_p, softcap=call.softcap, return_lse=True,
                            backend=call.backend, generator=generator)


def _varlen_shapes(tensors, call, ints):
    q, v = tensors[0], tensors[2]
    return (((q.shape[0], q.shape[1], v.shape[2]), q.dtype),
            ((q.shape[1], q.shape[0]), accumulator_dtype(q.dtype)))


def _run_kvcache(tensors, call, ints):
    q, k_cache, v_cache, lens, block_table, table, _ = tensors
    if lens is None:
        lens = ints[0] if len(ints) == 1 else list(ints[1:])
    return attention_with_kvcache(q, k_cache, v_cache, lens, block_table=block_table,
                                  mask=call.mask(), bias=_bias_of(table, call), scale=call.scale,
                                  softcap=call.softcap, return_lse=True, backend=call.backend)


def _kvcache_shapes(tensors, call, ints):
    q, v_cache = tensors[0], tensors[2]
    B, S, H = q.shape[:3]
    return ((B, S, H, v_cache.shape[3]), q.dtype), ((B, H, S), accumulator_dtype(q.dtype))


entry_ops.register("varlen", _run_varlen, _varlen_shapes)
entry_ops.register("kvcache", _run_kvcache, _kvcache_shapes)
