"""Rotary position embedding as FlashAttention's ``flash_attn_with_kvcache`` applies it."""

from __future__ import annotations

import torch

from ...model.problem import accumulator_dtype

__all__ = ["apply_rotary"]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotate the first ``rotary_dim = 2 * cos.shape[1]`` features of ``x`` ``[B, S, H, D]``.

    Token ``(b, s)`` uses row ``positions[b, s]`` of ``cos``/``sin`` ``[S_ro, rotary_dim / 2]``.
    ``interleaved``: pairs ``(0, 1), (2, 3), ...`` (GPT-J); otherwise ``(i, i + rotary_dim / 2)``
    (GPT-NeoX). Each pair ``(a, b)`` becomes ``(a cos - b sin, a sin + b cos)``, computed in float32
    (float64 for float64 ``x``) and rounded once to ``x``'s dtype; features past ``rotary_dim``
    are unchanged.

    Equivalent PyTorch (non-interleaved)::

        a, b = x[..., :r // 2], x[..., r // 2:r]
        c, s = cos[positions][:, :, None], sin[positions][:, :, None]
        out = torch.cat([a * c - b * s, a * s + b * c, x[..., r:]], dim=-1)
    """
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim == 0:
        return x
    work = accumulator_dtype(x.dtype)
    c = cos.to(work)[positions][:, :, None, :]
    s = sin.to(work)[positions][:, :, None, :]
    head = x[..., :rotary_dim].to(work)
    if interleaved:
        a, b = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:
        a, b = head.chunk(2, dim=-1)
        rotated = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([rotated.to(x.dtype), x[..., rotary_dim:]], dim=-1)
