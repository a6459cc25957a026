"""Packed variable-length attention and decoding against a (paged) KV cache.

On an accelerator (or with ``backend="cudnn"``) both entry points first try the tensors as they
lie (``cudnn_attn.packed.calls``): packed ``[total, H, D]`` tensors as cuDNN's ragged layout, a
cache as its page-table (or whole-cache) graph, the lengths, offsets and block table kept on the
device (no host synchronisation; a decode step can be captured in a CUDA graph). Otherwise, or where
cuDNN declines, they run on every engine through :func:`cudnn_attn.attention`, autograd flowing
through the (index) ops that pack and unpack: varlen calls the torch engine runs become one dense
batch per distinct ``(len_q, len_k)`` (each sequence costs what its own length costs); others
(dropout, a forced GPU engine) one ``bshd`` batch padded to the longest sequence with a ``Padding``
mask. A KV-cache call is then one padded batch of the prefix in use.

* ``attention_varlen`` — FlashAttention's ``flash_attn_varlen_func`` layout: ``[total, H, D]``
  tensors with ``cu_seqlens``. Each sequence ``b`` (tokens ``cu_seqlens[b]:cu_seqlens[b+1]``) is an
  independent attention problem; masks and positions are local to it.
* ``attention_with_kvcache`` — FlashAttention's ``flash_attn_with_kvcache`` without the in-place
  append: queries ``[B, S_q, H, D]`` against the first ``cache_seqlens[b]`` keys of a dense
  ``[B, S_max, H_kv, D]`` cache or a paged ``[num_blocks, page_size, H_kv, D]`` one.

Helpers for surfaces (public, shared with ``compat.flash_attn``; the argument rules are
``varlen_args``, re-exported here where surfaces import them):

* ``cu_lengths(name, cu, total, tensor_name, device)`` — checked ``cu_seqlens`` -> lengths;
* ``token_slots(lens, seq, device)`` — padded-buffer row of each packed token;
* ``pad_tokens(x, lens, seq, slots)`` — ``[total, ...]`` -> ``[B, seq, ...]``, zeros past lengths;
* ``gather_pages(k_cache, v_cache, block_table, lens)`` — dense ``[B, S, H_kv, D]`` from a paged cache;
* ``with_padding(mask, lens_q, lens_kv, seq_q, seq_kv)`` — ``mask & Padding(...)`` when needed;
* ``PaddedBatch(lens_q, lens_k, seq_q, seq_k, device)`` — a packed call as one padded batch and
  back (every surface's dense-batch route; positions past a length are hidden by the run API);
* ``index_tensor(name, t, rank, device)`` — an int32/int64 tensor on q's device or the CPU.

Grouping packed sequences by length (the torch engine's varlen path) is ``packed.groups``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from .tracing import call_spec, entry_ops
from .core import execution
from .packed import calls
from .api import attention
from .model.inputs import DropoutState, Inputs, draw_seed
from .packed.prepared import direct_or_stored_kvcache, direct_or_stored_varlen
from .rewrites.sinks import check_sinks, merge_sinks
from .packed.groups import by_length_groups, grouped_varlen
from .packed.args import (cache_lengths,
    check_bias,
    check_cache,
    check_maxima,
    check_packed,
    check_user_mask,
    cu_lengths,
    index_tensor,
    varlen_lengths,
)
from .model.problem import accumulator_dtype
from .model.masks import Alibi, Mask, Padding, split_bias

__all__ = ["attention_varlen", "attention_with_kvcache", "cu_lengths", "token_slots", "pad_tokens",
           "PaddedBatch", "gather_pages", "with_padding", "index_tensor"]

# ---------------------------------------------------------------------------------------------
# padding helpers
# ---------------------------------------------------------------------------------------------

def with_padding(mask, lens_q, lens_kv, seq_q: int, seq_kv: int):
    """``mask & Padding(...)``; the padding is left out when every sequence fills the batch."""
    if all(n == seq_q for n in lens_q) and all(n == seq_kv for n in lens_kv):
        return mask
    padding = Padding(lens_q, lens_kv)
    return padding if mask is None else mask & padding


# ---------------------------------------------------------------------------------------------
# varlen
# ---------------------------------------------------------------------------------------------

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


class PaddedBatch:
    """Packed sequences (``[total, ...]``, lengths ``lens_q``/``lens_k``) as one ``[B, seq, ...]``
    batch padded to ``seq_q``/``seq_k`` and back: every surface's dense-batch route for a packed
    call (positions past a length are hidden by the ``mask``'s ``Padding``)."""

    def __init__(self, lens_q: list[int], lens_k: list[int], seq_q: int, seq_k: int, device):
        self.lens_q, self.lens_k, self.batch = lens_q, lens_k, len(lens_q)
        self.seq_q, self.seq_k = seq_q, seq_k
        self.slots_q = token_slots(lens_q, seq_q, device)
        self.slots_k = self.slots_q if lens_k == lens_q and seq_k == seq_q else \
            token_slots(lens_k, seq_k, device)

    def mask(self, mask):
        """``mask`` with the ``Padding`` of these lengths (left out when nothing is padded)."""
        return with_padding(mask, self.lens_q, self.lens_k, self.seq_q, self.seq_k)

    def pad_q(self, x: torch.Tensor) -> torch.Tensor:
        return pad_tokens(x, self.lens_q, self.seq_q, self.slots_q)

    def pad_k(self, x: torch.Tensor) -> torch.Tensor:
        return pad_tokens(x, self.lens_k, self.seq_k, self.slots_k)

    @staticmethod
    def unpad(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``[B, seq, ...]`` -> the packed ``[total, ...]`` rows at ``slots``."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, slots)

    def lse_packed(self, lse: torch.Tensor) -> torch.Tensor:
        """``[B, H, seq_q]`` -> FlashAttention 2's varlen ``[H, total_q]``."""
        heads = lse.shape[1]
        return lse.permute(1, 0, 2).reshape(heads, -1).index_select(1, self.slots_q)

    def lse_padded(self, lse: torch.Tensor) -> torch.Tensor:
        """``[H, total_q]`` -> ``[B, H, seq_q]`` with ``-inf`` in the padding rows."""
        heads = lse.shape[0]
        full = lse.new_full((heads, self.batch * self.seq_q), float("-inf"))
        full[:, self.slots_q] = lse
        return full.view(heads, self.batch, self.seq_q).permute(1, 0, 2)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     mask: Mask | None = None, bias: torch.Tensor | Alibi | None = None,
                     scale: float | None = None, dropout_p: float = 0.0,
                     softcap: float | None = None, return_lse: bool = False, backend: str = "auto",
                     generator: torch.Generator | None = None,
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
    q, k, v = check_packed(q, k, v)
    if _native_route(q, backend, bias):  # cuDNN's ragged layout: nothing read on the host
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the offsets' token stride
        out, found = direct_or_stored_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, mask=mask,
            bias=bias, backend=backend, scale=scale, dropout_p=dropout_p, softcap=softcap,
            return_lse=return_lse)
        if out is not None:  # its kept runner ran it
            return out
        if found is not None:
            return _run_stored(found, q, k, v, generator, return_lse)
    lens_q, lens_k = varlen_lengths(q, k, cu_seqlens_q, cu_seqlens_k)
    max_q, max_k = check_maxima(max_seqlen_q, max_seqlen_k, lens_q, lens_k)
    check_user_mask(mask, "attention_varlen")
    batch = len(lens_q)
    check_bias(bias, (batch, q.shape[1], max_q, max_k), "[B, H_q, max_seqlen_q, max_seqlen_k]")
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

    pack = PaddedBatch(lens_q, lens_k, seq_q, seq_k, q.device)
    res = attention(pack.pad_q(q), pack.pad_k(k), pack.pad_k(v), mask=pack.mask(mask), bias=bias,
                    scale=scale, dropout_p=dropout_p, softcap=softcap, layout="bshd",
                    return_lse=return_lse, backend=backend, generator=generator)
    out, lse = cast(Any, res) if return_lse else (cast(torch.Tensor, res), None)
    out = pack.unpad(out, pack.slots_q)
    if not return_lse:
        return out
    assert lse is not None  # return_lse: attention() returned (out, lse)
    return out, pack.lse_packed(lse)


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------

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


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: torch.Tensor | int | Sequence[int], *,
                           block_table: torch.Tensor | None = None, mask: Mask | None = None,
                           bias: torch.Tensor | Alibi | None = None, scale: float | None = None,
                           softcap: float | None = None, return_lse: bool = False,
                           backend: str = "auto", sinks: torch.Tensor | None = None,
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
    if sinks is not None:  # a merge over the result without them (cudnn_attn.rewrites.sinks)
        out, lse = attention_with_kvcache(q, k_cache, v_cache, cache_seqlens,
                                          block_table=block_table, mask=mask, bias=bias,
                                          scale=scale, softcap=softcap, return_lse=True,
                                          backend=backend)
        out, lse = merge_sinks(out, lse, check_sinks(sinks, lse.shape[1], q), "bshd")
        return (out, lse) if return_lse else out
    if torch.compiler.is_compiling():  # lengths are read on the host: one op in the graph
        traced_lens = cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None
        ints: list = [] if traced_lens is not None else [cache_seqlens] \
            if isinstance(cache_seqlens, int) else [-1, *cache_seqlens]
        return _traced("kvcache", [q, k_cache, v_cache, traced_lens, block_table], ints, mask, bias,
                       scale, 0.0, softcap, return_lse, backend, None)
    if _native_route(q, backend, bias):  # the whole cache, lengths on the device, page tables
        out, found = direct_or_stored_kvcache(
            q, k_cache, v_cache, cache_seqlens, block_table, mask=mask, bias=bias,
            backend=backend, scale=scale, softcap=softcap, return_lse=return_lse)
        if out is not None:  # its kept runner ran it
            return out
        if found is not None:
            return _run_stored(found, q, k_cache, v_cache, None, return_lse)
    q, k_cache, v_cache, block_table, capacity, where = check_cache(q, k_cache, v_cache,
                                                                    block_table)
    batch, seq_q, heads_q, _ = q.shape
    paged = block_table is not None
    lens = cache_lengths(cache_seqlens, batch, capacity, q.device, where)
    check_user_mask(mask, "attention_with_kvcache")
    dims = ("[B, H_q, S_q, max_blocks_per_seq * page_size]" if paged
            else "[B, H_q, S_q, S_max]")
    check_bias(bias, (batch, heads_q, seq_q, capacity), dims)

    if paged:
        k, v = gather_pages(k_cache, v_cache, block_table, lens)
    else:  # only the prefix some sequence uses; at least one slot (Padding hides it)
        used = max(1, max(lens))
        k, v = k_cache[:, :used], v_cache[:, :used]
    seq_k = k.shape[1]  # slots past a length hold anything: the Padding hides them (execution)
    if isinstance(bias, torch.Tensor) and bias.dim() >= 1 and bias.shape[-1] != 1:
        bias = bias[..., :seq_k]
    return attention(q, k, v, mask=with_padding(mask, [seq_q] * batch, lens, seq_q, seq_k),
                     bias=bias, scale=scale, softcap=softcap, layout="bshd",
                     return_lse=return_lse, backend=backend)



# ---------------------------------------------------------------------------------------------
# The native path: packed or paged storage as it lies, lengths never read on the host
# ---------------------------------------------------------------------------------------------

def _native_route(q, backend, bias) -> bool:
    """Whether to try the engines that address packed/paged storage themselves (cuDNN): when
    cuDNN is forced, or on an accelerator unless another engine is. A bias tensor spans
    ``max_seqlen`` exactly, which the native graphs round up, so it takes the dense-batch path."""
    if isinstance(bias, torch.Tensor) or not isinstance(q, torch.Tensor):
        return False
    return backend == "cudnn" or (backend == "auto" and calls.on_accelerator(q))


def _run_stored(found, q, k, v, generator, return_lse):
    """``attention``'s result of ``plan_stored``'s ``(engine, problem, plan)``."""
    _, problem, plan = found
    dropout = DropoutState.draw(generator) if problem.dropout_p > 0 else None
    out, lse = execution.run(problem, plan, Inputs(q, k, v, None, dropout), return_lse)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# The traced path: both entry points as entry_ops' custom op (forward, and backward by recompute)
# ---------------------------------------------------------------------------------------------

def _traced(name, tensors, ints, mask, bias, scale, dropout_p, softcap, return_lse, backend,
            generator):
    if bias is not None and not isinstance(bias, (torch.Tensor, Alibi)):
        check_bias(bias, (), "")  # raises what the eager call raises
    kind, table, alibi = split_bias(bias)
    seed = None
    if dropout_p > 0:
        seed = draw_seed(generator)
    spec = call_spec.encode(mask=mask, bias_kind="tensor" if kind == "tensor" else "none",
                            alibi=alibi, scale=scale,
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
