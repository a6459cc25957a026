"""FlashAttention's packed and KV-cache calls on an engine that reads the tensors as they lie:
cuDNN's ragged (THD) graph for ``mha_varlen_fwd`` / ``mha_varlen_bwd`` (``cu_seqlens`` and
``seqused_k`` kept on the device), and its page-table (or whole-cache) graph for
``flash_attn_with_kvcache`` (``cache_seqlens`` on the device, the append and rotary done there),
so nothing is padded or gathered and nothing is read on the host.

Taken on an accelerator for calls without paging, ALiBi slopes or returned weights (those need
the lengths on the host, or slopes cuDNN cannot take); when no engine runs the packed problem
the caller builds dense batches instead. FlashAttention aligns causal masks and windows to each
sequence's bottom-right; when ``cu_seqlens_q is cu_seqlens_k`` every sequence has as many queries
as keys and top-left is the same diagonal (which cuDNN combines with dropout).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...model import checks
from ...core import execution
from ...packed import calls
from ...errors import NotSupportedError
from ...model.inputs import DropoutState, Inputs
from ...packed.prepared import stored_kvcache, stored_varlen
from ._args import Options
from ._core import fa_mask, fa_positions_per_token
from .rotary import apply_rotary

__all__ = ["takes", "forward", "backward", "takes_kvcache", "kvcache"]


def takes(q, paged: bool, alibi_slopes, return_softmax: bool, p_dropout: float = 0.0) -> bool:
    """Whether a varlen call tries the packed engines first (returned weights: with dropout
    only, whose mask the packed call's backward replays)."""
    return (calls.on_accelerator(q) and not paged and alibi_slopes is None
            and (not return_softmax or p_dropout > 0))


def _planned(q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, opts: Options, grad: bool,
             deterministic: bool = False, required: bool = False) -> Optional[tuple]:
    """``plan_stored``'s ``(engine, problem, plan)`` of the packed call, or ``None``."""
    same = cu_q is cu_k and seqused_k is None
    return stored_varlen(q, k, v, cu_q, cu_k, max_q, max_k, mask=fa_mask(opts, max_k, same),
                         seqused_k=seqused_k, required=required,
                         adjust={"requires_grad": grad, "deterministic": deterministic,
                                 "repeatable": True},  # FlashAttention's forward: repeatable
                         scale=opts.scale, dropout_p=opts.p_dropout, softcap=opts.softcap,
                         return_lse=True)


def forward(q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, opts: Options, gen_,
            weights: Optional[dict] = None):
    """``(out [total_q, H, D_v], lse [H, total_q], dropout state)``, or ``None`` when no engine
    runs the packed problem. A ``weights`` dict asks for the attention weights (the torch
    engine's, of its padded batch ``[B, H, S_q, S_k]``); another engine leaves them to the
    caller's dense batches (``None``)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    found = _planned(q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, opts, grad=False)
    if found is None or (weights is not None and found[0].name != "torch"):
        return None  # the caller builds dense batches
    _, problem, plan = found
    dropout = DropoutState.draw(gen_) if opts.p_dropout > 0 else DropoutState(0, 0)
    inputs = Inputs(q, k, v, None, dropout if opts.p_dropout > 0 else None)
    out, lse = execution.forward(problem, plan, inputs, weights=weights)
    return out, lse, dropout


def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, opts: Options,
             deterministic: bool, dropout: DropoutState) -> Optional[tuple]:
    """``(dq, dk, dv)`` through the packed engine's backward, or ``None`` when none runs it.
    A dropout mask can only be replayed by the engine that drew it: then a decline raises."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    found = _planned(q, k, v, cu_q, cu_k, None, max_q, max_k, opts, grad=True,
                     deterministic=deterministic or torch.are_deterministic_algorithms_enabled(),
                     required=opts.p_dropout > 0)
    if found is None:
        return None
    _, problem, plan = found
    inputs = Inputs(q, k, v, None, dropout if opts.p_dropout > 0 else None)
    dq, dk, dv, _ = execution.backward(problem, plan, inputs, out.contiguous(),
                                       execution.lse_from_flash(lse), dout.contiguous())
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# ---------------------------------------------------------------------------------------------

def takes_kvcache(q, cache_seqlens, cache_batch_idx, cache_leftpad, alibi_slopes) -> bool:
    """Whether a KV-cache call tries the engines that read the cache as it lies (whole cache,
    device lengths, page tables): on an accelerator, without the arguments whose values the
    dense path must read (``cache_batch_idx``, ``cache_leftpad``, ALiBi slopes)."""
    return (calls.on_accelerator(q) and cache_batch_idx is None
            and cache_leftpad is None and alibi_slopes is None
            and not (isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dim() == 0))


def kvcache(q, cache, k, v, cache_seqlens, block_table, rotary, interleaved: bool,
            opts: Options):
    """``(out, lse)`` of ``flash_attn_with_kvcache`` with nothing read on the host (a decode
    step that can be captured in a CUDA graph), or ``None`` (before any side effect) when no
    engine runs the cache as it lies. ``cache`` is ``kvcache._Cache``; ``rotary`` its checked
    ``(cos, sin)`` or None. New ``k``/``v`` are written at ``cache_seqlens[b] ..`` unchecked,
    as FlashAttention does."""
    batch, seq_q = q.shape[:2]
    seq_new = 0 if k is None else k.shape[1]
    if rotary is not None and rotary[0].shape[0] < cache.capacity:
        return None  # the dense path checks the positions it actually rotates
    if cache_seqlens is None:
        lens = torch.full((batch,), cache.capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, torch.Tensor):
        lens = checks.index_tensor("cache_seqlens", cache_seqlens, ndim=1, device=q.device)
        if lens.shape[0] != batch:
            raise ValueError(f"cache_seqlens must have one entry per batch ({batch}), got shape "
                             f"{tuple(lens.shape)}")
        lens = lens.to(q.device, non_blocking=True)
    else:
        lens = torch.full((batch,), checks.integer("cache_seqlens", cache_seqlens),
                          dtype=torch.int32, device=q.device)
    # where new tokens go (int64, [B, 1]); made only when there are any (a kernel per call)
    starts = lens.to(torch.int64)[:, None] if rotary is not None or k is not None else None
    if rotary is not None:
        per_token = torch.arange(seq_q, device=q.device)
        step = per_token if fa_positions_per_token(opts, cache.capacity) else \
            torch.zeros_like(per_token)
        q = apply_rotary(q, *rotary, starts + step, interleaved)
        k = apply_rotary(k, *rotary, starts + torch.arange(seq_new, device=q.device), interleaved)
    try:
        found = stored_kvcache(q, cache.k_cache, cache.v_cache,
                               lens + seq_new if seq_new else lens, block_table,
                               mask=fa_mask(opts, cache.capacity, False),
                               adjust={"repeatable": True},  # FlashAttention's: repeatable
                               scale=opts.scale, softcap=opts.softcap, return_lse=True)
    except NotSupportedError:
        return None
    if found is None:
        return None
    _, problem, plan = found
    if k is not None:
        cache.append(k, v, starts, check=False)
    return execution.forward(problem, plan, Inputs(q, cache.k_cache, cache.v_cache))
