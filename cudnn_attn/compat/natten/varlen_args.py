"""NATTEN 0.21's varlen arguments of ``natten.attention``, checked with NATTEN's rules and messages.

Varlen means the sequence-packed layout: batch 1, sequences back to back on the token axis. They
are described by lengths (``seqlens_Q``/``seqlens_KV``, int32, on q's device) or by cumulative
offsets with maximum lengths (``cumulative_seqlen_Q``/``_KV`` int32 ``[B + 1]`` and ints
``max_seqlen_Q``/``_KV``). ``offsets`` returns the latter form, or ``None`` for a dense call.
"""

from __future__ import annotations

import torch

__all__ = ["offsets"]


def _both_int32_1d(names: str, a, b, device) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError(f"{names} must both be tensors.")
    if a.device != device or b.device != device:
        raise ValueError(f"{names} must be on the same device as QKV, but got {a.device}, "
                         f"{b.device}, query on {device}.")
    if a.dtype != torch.int32 or b.dtype != torch.int32:
        raise ValueError(f"{names} must both be torch.int32 tensors, got {a.dtype}, {b.dtype}.")
    if a.dim() != 1 or b.dim() != 1:
        raise ValueError(f"{names} must both be 1-D tensors, got {a.dim()}-D and {b.dim()}-D.")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{names} must match in size, got {tuple(a.shape)}, {tuple(b.shape)}.")


def _packed(query) -> None:
    if query.shape[0] != 1:
        raise ValueError(f"Variable length Attention only supports sequence-packed memory layout "
                         f"(batch = 1), got query.shape[0]={query.shape[0]}.")


def offsets(query, key, seqlens_Q, seqlens_KV, cumulative_seqlen_Q, cumulative_seqlen_KV,
            max_seqlen_Q, max_seqlen_KV):
    """``(cu_q, cu_kv, max_q, max_kv)`` of a varlen call, ``None`` for a dense one."""
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"Q, K, and V must match in batch size, got {query.shape[0]}, "
                         f"{key.shape[0]}.")
    lengths = (seqlens_Q, seqlens_KV)
    cumulative = (cumulative_seqlen_Q, cumulative_seqlen_KV)
    if all(x is None for x in lengths + cumulative) and all(
            x is None or x == 0 for x in (max_seqlen_Q, max_seqlen_KV)):
        return None
    if seqlens_Q is not None or seqlens_KV is not None:
        if (seqlens_Q is None) != (seqlens_KV is None):
            raise ValueError("Variable length Attention requires both of seqlens_Q and "
                             "seqlens_KV to be set.")
        _both_int32_1d("seqlens_Q and seqlens_KV", *lengths, query.device)
        if seqlens_Q.shape[0] < 1:
            raise ValueError("seqlens_Q and seqlens_KV must contain at least one element.")
        _packed(query)
        zero = seqlens_Q.new_zeros(1)
        return (torch.cat([zero, seqlens_Q.cumsum(0).to(torch.int32)]),
                torch.cat([zero, seqlens_KV.cumsum(0).to(torch.int32)]),
                int(seqlens_Q.max()), int(seqlens_KV.max()))
    if any(x is None for x in cumulative + (max_seqlen_Q, max_seqlen_KV)):
        raise ValueError("Variable length Attention requires all of cumulative_seqlen_{Q,KV} and "
                         "max_seqlen_{Q,KV} to be set.")
    _packed(query)
    if not isinstance(max_seqlen_Q, int) or not isinstance(max_seqlen_KV, int):
        raise ValueError(f"max_seqlen_Q and max_seqlen_KV must be ints, got {max_seqlen_Q!r}, "
                         f"{max_seqlen_KV!r}.")
    for name, value, total in (("max_seqlen_Q", max_seqlen_Q, query.shape[1]),
                               ("max_seqlen_KV", max_seqlen_KV, key.shape[1])):
        if value > total:
            raise ValueError(f"Maximum sequence length cannot exceed total, got {name}={value}, "
                             f"total={total}.")
        if value < 0:
            raise ValueError(f"Maximum sequence length cannot be negative, got {name}={value}.")
    _both_int32_1d("cumulative_seqlen_Q and cumulative_seqlen_KV", *cumulative, query.device)
    if cumulative_seqlen_Q.shape[0] < 2:
        raise ValueError("cumulative_seqlen_Q and cumulative_seqlen_KV must contain at least 2 "
                         "elements.")
    return cumulative_seqlen_Q, cumulative_seqlen_KV, max_seqlen_Q, max_seqlen_KV
