"""FlashAttention's packed (varlen) entry points ``mha_varlen_fwd`` / ``mha_varlen_bwd``
(``[total, H, D]`` with ``cu_seqlens``, optional paged K/V). On the torch engine (the rule of
``cudnn_attn.packed.groups.by_length_groups``) and without dropout, weights or paging, the sequences run
as one dense batch per distinct ``(len_q, len_k)`` (``packed.groups.grouped_varlen``), so each costs
its own length; otherwise as one batch padded to ``max_seqlen`` with a ``Padding`` mask
(``varlen.PaddedBatch``): the fallback every surface shares when no engine runs the packed tensors
as they lie (``native``). Conventions:
``cudnn_attn.compat.flash_attn.mha``'s docstring."""

from __future__ import annotations

import torch

from ...model import checks
from ...model.inputs import DropoutState
from ...varlen import PaddedBatch, cu_lengths, gather_pages, index_tensor
from ...packed.args import check_maxima
from ...packed.groups import by_length_groups, grouped_varlen
from . import _core, _probs, native
from ._args import (Options, alibi_arg, flag, generator_arg, into, like, philox_state, same_dtype,
                    seed_tensors, softmax_d_of, runtime_errors)

__all__ = ["mha_varlen_fwd", "mha_varlen_bwd", "varlen_gradients"]


def _packing(lens_q, lens_k, max_seqlen_q, max_seqlen_k, device):
    """``(batch, max_q, max_k)``: the packed batch padded to ``max_seqlen_q/k`` (FlashAttention's
    bounds; the weights of ``return_softmax`` span them), at least one slot, which the
    ``Padding`` hides."""
    max_q, max_k = check_maxima(max_seqlen_q, max_seqlen_k, lens_q, lens_k)
    return PaddedBatch(lens_q, lens_k, max(max_q, 1), max(max_k, 1), device), max_q, max_k


def _grouped(q, k, v, lens_q, lens_k, max_k: int, opts: Options, alibi):
    """``(out [total_q, H, D_v], lse [H, total_q])`` through ``packed.groups.grouped_varlen``
    (one dense batch per length group, the torch engine's route). FlashAttention normalizes its
    window against ``max_seqlen_k``, not the sequence's length: so does the mask here."""
    return grouped_varlen(q, k, v, lens_q, lens_k, _core.fa_mask(opts, max_k, False, alibi is not None),
                          alibi, opts.scale, opts.softcap, True, "auto")


def _varlen_heads(q, k, v, paged: bool):
    q = checks.tensor("q", q, ndim=3, what="[total_q, num_heads, head_size]")
    if paged:
        what = "[num_blocks, page_block_size, num_heads_k, head_size{}] (paged, with block_table_)"
        k = checks.tensor("k", k, ndim=4, what=what.format(""))
        v = checks.tensor("v", v, ndim=4, what=what.format("_v"))
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"k and v must have the same pages, page size and heads, got "
                             f"k={tuple(k.shape)}, v={tuple(v.shape)}")
    else:
        k = checks.tensor("k", k, ndim=3, what="[total_k, num_heads_k, head_size] (or 4-D pages with "
                    "block_table_)")
        v = checks.tensor("v", v, ndim=3, what="[total_k, num_heads_k, head_size_v]")
        if k.shape[:2] != v.shape[:2]:
            raise ValueError(f"k and v must have the same tokens and heads, got "
                             f"k={tuple(k.shape)}, v={tuple(v.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k head size must equal q head size, got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}")
    if q.shape[1] % max(k.shape[-2], 1):
        raise ValueError(f"num_heads must be a multiple of num_heads_k (GQA/MQA), got "
                         f"{q.shape[1]} and {k.shape[-2]}")
    return q, k, v


def _cu_total(cu) -> int:
    """``cu[-1]`` where it can be read (the paged cache has no packed key axis to check)."""
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.numel() and \
            not cu.dtype.is_floating_point:
        return int(cu[-1])
    return 0


def _fit(x: torch.Tensor, seq: int) -> torch.Tensor:
    """Dim 1 cut or zero-padded to ``seq``."""
    if x.shape[1] >= seq:
        return x[:, :seq]
    pad = x.new_zeros(x.shape[0], seq - x.shape[1], *x.shape[2:])
    return torch.cat([x, pad], dim=1)


def _varlen_keys(k, v, lens_k, full_k, table, pack):
    """Each sequence's keys/values as a padded ``[B, S_k, H_k, D]`` batch (paged caches
    gathered, keys past ``seqused_k`` left out)."""
    if table is not None:
        pages = gather_pages(k, v, table, lens_k)
        return tuple(_fit(x, pack.seq_k) for x in pages)  # the Padding hides past lens_k
    if lens_k != full_k:  # only the first seqused_k[b] keys of each sequence
        starts = torch.tensor([0, *full_k[:-1]]).cumsum(0).tolist()
        index = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens_k)]).to(k.device)
        k, v = k.index_select(0, index), v.index_select(0, index)
    return pack.pad_k(k), pack.pad_k(v)


def _used_lengths(seqused_k, lens_k, paged: bool, device) -> list[int]:
    used = index_tensor("seqused_k", seqused_k, 1, device).tolist()
    if len(used) != len(lens_k):
        raise ValueError(f"seqused_k must have one entry per sequence ({len(lens_k)}), got "
                         f"{len(used)}")
    for b, (n, cap) in enumerate(zip(used, lens_k)):
        if n < 0 or (not paged and n > cap):
            raise ValueError(f"seqused_k[{b}] = {n} must be in [0, {cap}] (the keys of "
                             f"sequence {b} in cu_seqlens_k)")
    return used


def _block_table(block_table_, lens_k, page: int, device) -> torch.Tensor:
    table = index_tensor("block_table_", block_table_, 2, device)
    if table.shape[0] != len(lens_k):
        raise ValueError(f"block_table_ must have one row per sequence ({len(lens_k)}), got "
                         f"shape {tuple(table.shape)}")
    capacity = table.shape[1] * page
    for b, n in enumerate(lens_k):
        if n > capacity:
            raise ValueError(f"sequence {b} has {n} keys but block_table_ holds "
                             f"{table.shape[1]} pages of {page} tokens ({capacity})")
    return table


def _batch_lengths(q, k, cu_seqlens_q, cu_seqlens_k, paged: bool):
    lens_q = cu_lengths("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q", q.device)
    # A paged cache has no packed key axis: cu_seqlens_k only gives the lengths.
    total_k = _cu_total(cu_seqlens_k) if paged else k.shape[0]
    lens_k = cu_lengths("cu_seqlens_k", cu_seqlens_k, total_k, "k", q.device)
    if len(lens_k) != len(lens_q):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same batch, got "
                         f"{len(lens_q)} and {len(lens_k)} sequences")
    return lens_q, lens_k


@runtime_errors
def mha_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_: torch.Tensor | None,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   seqused_k: torch.Tensor | None, block_table_: torch.Tensor | None,
                   alibi_slopes_: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int,
                   p_dropout: float, softmax_scale: float | None, zero_tensors: bool,
                   is_causal: bool, window_size_left: int, window_size_right: int,
                   softcap: float, return_softmax: bool, gen_: torch.Generator | None,
                   ) -> tuple[torch.Tensor, ...]:
    """FlashAttention forward on packed sequences (``[total, H, D]`` with ``cu_seqlens``).

    ``seqused_k`` (int ``[B]``) limits each sequence's keys to its first ``seqused_k[b]``.
    ``block_table_`` (int ``[B, max_blocks]``) makes ``k``/``v`` paged caches ``[num_blocks,
    page_size, H_k, D]`` of any page size: key ``t`` of sequence ``b`` is row ``t % page_size`` of
    page ``block_table_[b, t // page_size]``; the key lengths are ``cu_seqlens_k``'s (or
    ``seqused_k``). Returns ``(out [total_q, H, D_v], q, k, v, softmax_lse [H, total_q],
    philox_seed, philox_offset, p)``, ``p`` the weights in FlashAttention's encoding
    ``[B, H, round128(max_seqlen_q), round128(max_seqlen_k)]`` or empty.
    """
    paged = block_table_ is not None
    q, k, v = _varlen_heads(q, k, v, paged)
    return_softmax = flag("return_softmax", return_softmax)
    if native.takes(q, paged, alibi_slopes_, return_softmax, p_dropout):
        opts = Options.of(q.shape[-1], p_dropout, softmax_scale, is_causal, window_size_left,
                           window_size_right, softcap)
        flag("zero_tensors", zero_tensors)
        like("out_", out_, (q.shape[0], q.shape[1], v.shape[-1]), q, optional=True)
        weights: dict | None = {} if return_softmax else None
        res = native.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                             max_seqlen_k, opts, generator_arg(gen_), weights)
        if res is not None:
            out, lse, dropout = res
            p = q.new_empty(0) if weights is None else _packed_weights(
                weights, max_seqlen_q, max_seqlen_k, q, opts)
            return (into(out_, out), q, k, v, lse, *seed_tensors(dropout), p)
    lens_q, full_k = _batch_lengths(q, k, cu_seqlens_q, cu_seqlens_k, paged)
    lens_k = full_k if seqused_k is None else _used_lengths(seqused_k, full_k, paged, q.device)
    table = _block_table(block_table_, lens_k, k.shape[1], q.device) if paged else None
    pack, max_q, max_k = _packing(lens_q, lens_k, max_seqlen_q, max_seqlen_k, q.device)
    opts = Options.of(q.shape[-1], p_dropout, softmax_scale, is_causal, window_size_left,
                      window_size_right, softcap)
    flag("zero_tensors", zero_tensors)
    gen_ = generator_arg(gen_)
    alibi = alibi_arg(alibi_slopes_, pack.batch, q.shape[1], q.device)
    like("out_", out_, (q.shape[0], q.shape[1], v.shape[-1]), q, optional=True)

    if (by_length_groups(q, "auto", opts.p_dropout) and not return_softmax and not paged
            and seqused_k is None):
        with torch.no_grad():
            out, lse = _grouped(q, k, v, lens_q, lens_k, max_k, opts, alibi)
        return (into(out_, out), q, k, v, lse, *seed_tensors(DropoutState(0, 0)), q.new_empty(0))
    mask = pack.mask(_core.fa_mask(opts, max_k, lens_q == lens_k, alibi is not None))
    kp, vp = _varlen_keys(k, v, lens_k, full_k, table, pack)
    out, lse, dropout, probs, keep = _core.forward(pack.pad_q(q), kp, vp, mask, alibi, opts,
                                                   return_softmax, gen_)
    p = q.new_empty(0)
    if probs is not None:
        window = (slice(None), slice(None), slice(max_q), slice(max_k))
        p = _probs.encode(probs[window], None if keep is None else keep[window], q.shape[-1],
                          opts.causal, q.dtype)
    return (into(out_, pack.unpad(out, pack.slots_q)), q, k, v, pack.lse_packed(lse),
            *seed_tensors(dropout), p)


def _packed_weights(weights: dict, max_seqlen_q, max_seqlen_k, q, opts: Options):
    """``S_dmask`` from the weights of a packed call's padded batch (its bounds may exceed
    ``max_seqlen_q/k``: FlashAttention's tensor spans those)."""
    max_q, max_k = check_maxima(max_seqlen_q, max_seqlen_k, None, None)
    window = (slice(None), slice(None), slice(max_q), slice(max_k))
    probs, dropped = weights["probs"][window], weights["dropped"][window]
    return _probs.encode(probs, (dropped != 0) | (probs == 0), q.shape[-1], opts.causal, q.dtype)


@runtime_errors
def mha_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, softmax_lse: torch.Tensor, dq_: torch.Tensor | None,
                   dk_: torch.Tensor | None, dv_: torch.Tensor | None, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, alibi_slopes_: torch.Tensor | None,
                   max_seqlen_q: int, max_seqlen_k: int, p_dropout: float,
                   softmax_scale: float | None, zero_tensors: bool, is_causal: bool,
                   window_size_left: int, window_size_right: int, softcap: float,
                   deterministic: bool, philox_seed: torch.Tensor | int,
                   philox_offset: torch.Tensor | int,
                   ) -> tuple[torch.Tensor, ...]:
    """FlashAttention backward on packed sequences: ``(dq, dk, dv, softmax_d)``.

    The arguments of ``mha_varlen_fwd`` (without ``seqused_k`` and paging, as FlashAttention),
    its ``out``, ``softmax_lse`` ``[H, total_q]`` and ``philox_seed``/``philox_offset``.
    ``softmax_d = rowsum(dout * out)`` as ``[H, total_q]``.
    """
    grads = varlen_gradients(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q,
                             cu_seqlens_k, alibi_slopes_, max_seqlen_q, max_seqlen_k, p_dropout,
                             softmax_scale, zero_tensors, is_causal, window_size_left,
                             window_size_right, softcap, deterministic, philox_seed,
                             philox_offset)
    return (*grads, softmax_d_of(dout, out, q.dtype).t().contiguous())


@runtime_errors
def varlen_gradients(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k,
                     alibi_slopes_, max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale,
                     zero_tensors, is_causal, window_size_left, window_size_right, softcap,
                     deterministic, philox_seed, philox_offset) -> tuple[torch.Tensor, ...]:
    """``mha_varlen_bwd``'s ``(dq, dk, dv)`` alone: what FlashAttention's autograd function
    keeps (``softmax_d`` costs four kernels and two float32 copies of ``out``'s size)."""
    q, k, v = _varlen_heads(q, k, v, False)
    same_dtype(q, k, v)
    o_shape = (q.shape[0], q.shape[1], v.shape[-1])
    out, dout = like("out", out, o_shape, q), like("dout", dout, o_shape, q)
    lse = like("softmax_lse", softmax_lse, (q.shape[1], q.shape[0]), q, any_float=True)
    bufs = [like(n, b, t.shape, q, optional=True)
            for n, b, t in (("dq_", dq_, q), ("dk_", dk_, k), ("dv_", dv_, v))]
    if native.takes(q, False, alibi_slopes_, False):
        opts = Options.of(q.shape[-1], p_dropout, softmax_scale, is_causal, window_size_left,
                           window_size_right, softcap)
        flag("zero_tensors", zero_tensors)
        grads = native.backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, opts,
                                flag("deterministic", deterministic),
                                philox_state(philox_seed, philox_offset))
        if grads is not None:
            return tuple(into(b, g) for b, g in zip(bufs, grads))
    lens_q, lens_k = _batch_lengths(q, k, cu_seqlens_q, cu_seqlens_k, False)
    pack, _, max_k = _packing(lens_q, lens_k, max_seqlen_q, max_seqlen_k, q.device)
    opts = Options.of(q.shape[-1], p_dropout, softmax_scale, is_causal, window_size_left,
                      window_size_right, softcap)
    flag("zero_tensors", zero_tensors)
    deterministic = flag("deterministic", deterministic)
    alibi = alibi_arg(alibi_slopes_, pack.batch, q.shape[1], q.device)
    dropout = philox_state(philox_seed, philox_offset)
    # One padded batch, never the forward again: FlashAttention's backward reads the caller's
    # ``out`` and ``softmax_lse`` (ring attention passes the ones merged across ranks).
    mask = pack.mask(_core.fa_mask(opts, max_k, lens_q == lens_k, alibi is not None))
    grads = _core.backward(pack.pad_q(dout), pack.pad_q(q), pack.pad_k(k), pack.pad_k(v),
                            pack.pad_q(out), pack.lse_padded(lse), mask, alibi, opts,
                            deterministic, dropout)
    slots = (pack.slots_q, pack.slots_k, pack.slots_k)
    return tuple(into(b, pack.unpad(g, s)) for b, g, s in zip(bufs, grads, slots))
