"""Builder attributes -> the unified problem's mask and bias (``Causal``, ``SlidingWindow``,
``Padding``, ``Alibi`` or a bias tensor)."""

from __future__ import annotations

import functools
import operator


from ... import _checks
from ...masks import Alibi, Causal, Padding, SlidingWindow
from ._attrs import check_broadcast

__all__ = ["translate", "check_broadcast"]


def _mask_of(attrs, batch: int, seq_q: int, seq_kv: int):
    parts = []
    if attrs.causal is not None:
        parts.append(Causal(attrs.causal))
    if attrs.window is not None:
        left, right, alignment = attrs.window
        parts.append(SlidingWindow(left, right, alignment or attrs.causal or "top_left"))
    if attrs.padding is not None:
        lens_q, lens_kv = attrs.padding
        if len(lens_q) != batch:
            raise ValueError(f"set_padding_mask: seq_len_q has {len(lens_q)} entries, q has "
                             f"batch {batch}")
        if max(lens_q) > seq_q or max(lens_kv) > seq_kv:
            raise ValueError(f"set_padding_mask: lengths exceed the tensors: seq_len_q={lens_q} "
                             f"(S_q={seq_q}), seq_len_kv={lens_kv} (S_kv={seq_kv})")
        parts.append(Padding(lens_q, lens_kv))
    return functools.reduce(operator.and_, parts) if parts else None


def translate(attrs, q, k):
    """``(mask, bias, alibi)`` for the call: a bias tensor or ``None``, an ``Alibi`` or ``None``."""
    for name, t in (("q", q), ("k", k)):
        _checks.tensor(name, t, ndim=4, what="[B, H, S, D]")
    B, H, Sq, Skv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = _mask_of(attrs, B, Sq, Skv)
    bias = attrs.bias
    if bias is not None:
        if bias.device != q.device:
            raise ValueError(f"set_bias: bias must be on q's device {q.device}, got {bias.device}")
        check_broadcast("set_bias: bias", bias, (B, H, Sq, Skv))
        bias = bias.detach()
    return mask, bias, (Alibi() if attrs.alibi else None)
