"""FlashAttention 2.8.3's private entry points, which libraries built on FlashAttention import
(ring-flash-attn, yunchang, ...): ``_flash_attn_forward``, ``_flash_attn_backward``,
``_flash_attn_varlen_forward``, ``_flash_attn_varlen_backward``.

These names (leading underscore included) are FlashAttention's, so they are the contract here.
They are plain functions with flash-attn 2.8.3's exact parameter names, order and defaults:
callers build keyword dicts from ``inspect.getfullargspec`` and also pass positionally. Each is a
translation onto the public ``mha_*`` entry points (``cudnn_attn.flash_api``), so they run on
whatever path ``mha_*`` runs (every engine, ``use_backend`` honoured); nothing is computed here.

Layouts and results (as FlashAttention 2.8.3):

* forward: ``q [B, S_q, H, D]``, ``k``/``v [B, S_k, H_k, D]`` ->
  ``(out [B, S_q, H, D_v], softmax_lse [B, H, S_q] float32, S_dmask, rng_state [2] int64)``;
  varlen: ``[total, H, D]`` with ``cu_seqlens`` and ``softmax_lse [H, total_q]``; its
  ``leftpad_k`` skips each sequence's first keys (FlashAttention's ``block_info.h``), passed on
  as shifted ``cu_seqlens_k``/``seqused_k``. ``S_dmask`` is
  an empty tensor unless ``return_softmax`` (then FlashAttention's encoding, see
  ``cudnn_attn.compat.flash_attn.mha``). ``rng_state`` is ``(seed, offset)`` of the call's dropout
  stream, on q's device.
* backward: uses the caller's ``out`` and ``softmax_lse`` (ring attention passes merged ones),
  writes ``dq``/``dk``/``dv`` in place when given (strided views included) and returns
  ``softmax_d = rowsum(dout * out)`` (``[B, H, S_q]``; varlen ``[H, total_q]``: FlashAttention
  pads its scratch copy to a multiple of 128, which no caller reads). ``rng_state`` is the
  forward's (None without dropout).

Equivalent PyTorch (no dropout)::

    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale    # + causal/window mask
    softmax_lse = s.logsumexp(-1); out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
"""

from __future__ import annotations

from typing import Optional

import torch

from ...packed.args import index_tensor
from ._args import runtime_errors
from .dense import mha_bwd, mha_fwd
from .varlen import mha_varlen_bwd, mha_varlen_fwd

__all__ = ["_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
           "_flash_attn_varlen_backward"]


def _last_dim_contiguous(x):
    """FlashAttention's ``maybe_contiguous``: only the head dim must be unit-stride."""
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _rng_state(seed: torch.Tensor, offset: torch.Tensor, device) -> torch.Tensor:
    return torch.stack([seed, offset]).to(device)


def _philox_pair(rng_state: Optional[torch.Tensor]):
    """FlashAttention's ``rng_state`` ``[2]`` -> ``(philox_seed, philox_offset)`` of ``mha_bwd``."""
    if rng_state is None:
        return 0, 0
    if not isinstance(rng_state, torch.Tensor) or rng_state.numel() != 2:
        raise TypeError(f"rng_state must be None or the forward's [2] int64 tensor, got "
                        f"{rng_state!r}")
    seed, offset = rng_state.reshape(2).cpu()
    return seed, offset


@runtime_errors
def _keys_after_leftpad(k: torch.Tensor, v: torch.Tensor, leftpad_k: torch.Tensor,
                        cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                        seqused_k: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention's ``leftpad_k`` as the packed keys, offsets and lengths ``mha_varlen_fwd``
    takes: ``(k', v', cu_seqlens_k', seqused_k')``.

    FlashAttention (``block_info.h``): sequence ``b``'s keys start at row ``cu_seqlens_k[b] +
    leftpad_k[b]`` and number ``used[b] - leftpad_k[b]``, ``used`` being ``seqused_k`` or the
    ``cu_seqlens_k`` lengths. Here sequence ``b``'s span starts at its first kept key and runs on
    to the next sequence's first kept key (``cu'[b] = cu_seqlens_k[b] + leftpad_k[b]``, less the
    rows before sequence 0's first key, which ``k'``/``v'`` drop as views), and ``seqused_k' =
    used - leftpad_k`` keeps only the sequence's own keys. The values are read on the host (to
    check them, and for sequence 0's start).
    """
    if block_table is not None:  # FlashAttention's TORCH_CHECK, word for word
        raise ValueError("We don't support Paged KV and leftpad_k running at the same time yet "
                         "(leftpad_k must be None with block_table)")
    device = k.device
    lefts = index_tensor("leftpad_k", leftpad_k, 1, device)
    batch = index_tensor("cu_seqlens_q", cu_seqlens_q, 1, device).numel() - 1
    if lefts.shape[0] != batch:
        raise ValueError(f"leftpad_k must have shape (batch_size) = ({batch},) (one entry per "
                         f"sequence of cu_seqlens_q), got {tuple(lefts.shape)}")
    cu = index_tensor("cu_seqlens_k", cu_seqlens_k, 1, device)
    if cu.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_k must have shape (batch_size + 1) = ({batch + 1},), got "
                         f"{tuple(cu.shape)}")
    starts, full = cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist()
    used = full
    if seqused_k is not None:
        used = index_tensor("seqused_k", seqused_k, 1, device).tolist()
        if len(used) != batch:
            raise ValueError(f"seqused_k must have shape (batch_size) = ({batch},), got "
                             f"({len(used)},)")
    pads = lefts.tolist()
    what = "cu_seqlens_k" if seqused_k is None else "seqused_k"
    for b, (pad, n, cap) in enumerate(zip(pads, used, full)):
        if not 0 <= n <= cap:
            raise ValueError(f"seqused_k[{b}] = {n} must be in [0, {cap}] (the keys of "
                             f"sequence {b} in cu_seqlens_k)")
        if not 0 <= pad <= n:
            raise ValueError(f"leftpad_k[{b}] = {pad} must be in [0, {n}] (sequence {b} has {n} "
                             f"keys in {what})")
    first = starts[0] + pads[0]
    offsets = [s + pad - first for s, pad in zip(starts, pads)] + [k.shape[0] - first]
    lengths = [n - pad for n, pad in zip(used, pads)]
    return (k[first:], v[first:], torch.tensor(offsets, dtype=cu.dtype, device=cu.device),
            torch.tensor(lengths, dtype=cu.dtype, device=cu.device))


def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                        softmax_scale: float, causal: bool, window_size_left: int,
                        window_size_right: int, softcap: float,
                        alibi_slopes: Optional[torch.Tensor], return_softmax: bool,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention 2.8.3's ``_flash_attn_forward``: ``(out, softmax_lse, S_dmask,
    rng_state)`` on ``[B, S, H, D]`` tensors (module docstring)."""
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    out, _, _, _, lse, seed, offset, s_dmask = mha_fwd(
        q, k, v, None, alibi_slopes, dropout_p, softmax_scale, causal, window_size_left,
        window_size_right, softcap, return_softmax, None)
    return out, lse, s_dmask, _rng_state(seed, offset, q.device)


def _flash_attn_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                               max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                               softmax_scale: float, causal: bool, window_size_left: int = -1,
                               window_size_right: int = -1, softcap: float = 0.0,
                               alibi_slopes: Optional[torch.Tensor] = None,
                               return_softmax: bool = False,
                               block_table: Optional[torch.Tensor] = None,
                               leftpad_k: Optional[torch.Tensor] = None,
                               seqused_k: Optional[torch.Tensor] = None,
                               zero_tensors: bool = False,
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention 2.8.3's ``_flash_attn_varlen_forward``: ``(out [total_q, H, D_v],
    softmax_lse [H, total_q], S_dmask, rng_state)`` on packed ``[total, H, D]`` tensors.

    ``leftpad_k`` (int ``[B]``, FlashAttention's semantics): sequence ``b``'s keys are rows
    ``cu_seqlens_k[b] + leftpad_k[b]`` up to ``cu_seqlens_k[b + 1]`` (up to ``cu_seqlens_k[b] +
    seqused_k[b]`` when ``seqused_k`` is given, which then counts the padding too); masks align
    to those keys. Not with ``block_table`` (as FlashAttention)."""
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    if leftpad_k is not None:
        k, v, cu_seqlens_k, seqused_k = _keys_after_leftpad(
            k, v, leftpad_k, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
    out, _, _, _, lse, seed, offset, s_dmask = mha_varlen_fwd(
        q, k, v, None, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, alibi_slopes,
        max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, zero_tensors, causal,
        window_size_left, window_size_right, softcap, return_softmax, None)
    return out, lse, s_dmask, _rng_state(seed, offset, q.device)


def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, softmax_lse: torch.Tensor, dq: Optional[torch.Tensor],
                         dk: Optional[torch.Tensor], dv: Optional[torch.Tensor], dropout_p: float,
                         softmax_scale: float, causal: bool, window_size_left: int,
                         window_size_right: int, softcap: float,
                         alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                         rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FlashAttention 2.8.3's ``_flash_attn_backward``: writes ``dq``/``dk``/``dv`` (when given)
    and returns ``softmax_d [B, H, S_q]``."""
    dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
    seed, offset = _philox_pair(rng_state)
    *_, softmax_d = mha_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, dropout_p,
                            softmax_scale, causal, window_size_left, window_size_right, softcap,
                            deterministic, seed, offset)
    return softmax_d


def _flash_attn_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, out: torch.Tensor, softmax_lse: torch.Tensor,
                                dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                                dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                dropout_p: float, softmax_scale: float, causal: bool,
                                window_size_left: int, window_size_right: int, softcap: float,
                                alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                                rng_state: Optional[torch.Tensor] = None,
                                zero_tensors: bool = False) -> torch.Tensor:
    """FlashAttention 2.8.3's ``_flash_attn_varlen_backward``: writes ``dq``/``dk``/``dv`` (when
    given) and returns ``softmax_d [H, total_q]``."""
    dout, q, k, v, out = (_last_dim_contiguous(x) for x in (dout, q, k, v, out))
    seed, offset = _philox_pair(rng_state)
    *_, softmax_d = mha_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q,
                                   cu_seqlens_k, alibi_slopes, max_seqlen_q, max_seqlen_k,
                                   dropout_p, softmax_scale, zero_tensors, causal,
                                   window_size_left, window_size_right, softcap, deterministic,
                                   seed, offset)
    return softmax_d
