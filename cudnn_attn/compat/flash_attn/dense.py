"""FlashAttention's dense-batch entry points ``mha_fwd`` / ``mha_bwd`` (``[B, S, H, D]``); the
conventions are in ``cudnn_attn.compat.flash_attn.mha``'s docstring."""

from __future__ import annotations

import torch

from . import _core, _probs
from ._args import (Options, alibi_arg, dense_qkv, flag, generator_arg, into, like, philox_state,
                    same_dtype, seed_tensors, softmax_d_of, runtime_errors)

__all__ = ["mha_fwd", "mha_bwd", "dense_gradients"]


@runtime_errors
def mha_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out_: torch.Tensor | None,
            alibi_slopes_: torch.Tensor | None, p_dropout: float, softmax_scale: float | None,
            is_causal: bool, window_size_left: int, window_size_right: int, softcap: float,
            return_softmax: bool, gen_: torch.Generator | None) -> tuple[torch.Tensor, ...]:
    """FlashAttention forward on ``[B, S, H, D]`` tensors.

    Returns ``(out, q_padded, k_padded, v_padded, softmax_lse, philox_seed, philox_offset, p)``:
    out ``[B, S_q, H, D_v]`` (``out_`` when given), the inputs, lse ``[B, H, S_q]``, the dropout
    seed/offset for ``mha_bwd``, and when ``return_softmax`` the attention weights in
    FlashAttention's encoding, ``[B, H, round128(S_q), round128(S_k)]`` (else an empty tensor).
    See the module docstring for the conventions.
    """
    q, k, v = dense_qkv(q, k, v)
    batch, seq_q, heads, _ = q.shape
    opts = Options.of(q.shape[3], p_dropout, softmax_scale, is_causal, window_size_left,
                       window_size_right, softcap)
    mask = _core.fa_mask(opts, k.shape[1], seq_q == k.shape[1], alibi_slopes_ is not None)
    return_softmax = flag("return_softmax", return_softmax)
    gen_ = generator_arg(gen_)
    alibi = alibi_arg(alibi_slopes_, batch, heads, q.device)
    like("out_", out_, (batch, seq_q, heads, v.shape[3]), q, optional=True)

    out, lse, dropout, probs, keep = _core.forward(q, k, v, mask, alibi, opts, return_softmax,
                                                    gen_)
    p = q.new_empty(0)
    if probs is not None:
        p = _probs.encode(probs, keep, q.shape[3], opts.causal, q.dtype)
    return (into(out_, out), q, k, v, lse.contiguous(), *seed_tensors(dropout), p)


@runtime_errors
def mha_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            out: torch.Tensor, softmax_lse: torch.Tensor, dq_: torch.Tensor | None,
            dk_: torch.Tensor | None, dv_: torch.Tensor | None, alibi_slopes_: torch.Tensor | None,
            p_dropout: float, softmax_scale: float | None, is_causal: bool, window_size_left: int,
            window_size_right: int, softcap: float, deterministic: bool,
            philox_seed: torch.Tensor | int, philox_offset: torch.Tensor | int,
            ) -> tuple[torch.Tensor, ...]:
    """FlashAttention backward on ``[B, S, H, D]`` tensors: ``(dq, dk, dv, softmax_d)``.

    Takes the forward's arguments, its ``out`` and ``softmax_lse``, and its ``philox_seed`` /
    ``philox_offset`` (the same dropout mask is regenerated). ``dq_``/``dk_``/``dv_`` are written
    and returned when given. ``softmax_d = rowsum(dout * out)``, ``[B, H, S_q]``.
    """
    grads = dense_gradients(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes_,
                            p_dropout, softmax_scale, is_causal, window_size_left,
                            window_size_right, softcap, deterministic, philox_seed, philox_offset)
    return (*grads, softmax_d_of(dout, out, q.dtype).permute(0, 2, 1).contiguous())


@runtime_errors
def dense_gradients(dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, alibi_slopes_, p_dropout,
                    softmax_scale, is_causal, window_size_left, window_size_right, softcap,
                    deterministic, philox_seed, philox_offset) -> tuple[torch.Tensor, ...]:
    """``mha_bwd``'s ``(dq, dk, dv)`` alone: what FlashAttention's autograd function keeps
    (``softmax_d`` costs four kernels and two float32 copies of ``out``'s size)."""
    q, k, v = dense_qkv(q, k, v)
    same_dtype(q, k, v)
    batch, seq_q, heads, _ = q.shape
    o_shape = (batch, seq_q, heads, v.shape[3])
    out, dout = like("out", out, o_shape, q), like("dout", dout, o_shape, q)
    lse = like("softmax_lse", softmax_lse, (batch, heads, seq_q), q, any_float=True)
    bufs = [like(n, b, t.shape, q, optional=True)
            for n, b, t in (("dq_", dq_, q), ("dk_", dk_, k), ("dv_", dv_, v))]
    opts = Options.of(q.shape[3], p_dropout, softmax_scale, is_causal, window_size_left,
                       window_size_right, softcap)
    mask = _core.fa_mask(opts, k.shape[1], seq_q == k.shape[1], alibi_slopes_ is not None)
    deterministic = flag("deterministic", deterministic)
    alibi = alibi_arg(alibi_slopes_, batch, heads, q.device)
    dropout = philox_state(philox_seed, philox_offset)

    grads = _core.backward(dout, q, k, v, out, lse, mask, alibi, opts, deterministic, dropout)
    return tuple(into(b, g) for b, g in zip(bufs, grads))
