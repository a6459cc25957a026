"""Builder attributes -> the unified problem's mask and bias (``Causal``, ``SlidingWindow``,
``Padding``, ``Alibi`` or a bias tensor)."""

from __future__ import annotations

import functools
import operator

import torch


from ... import _checks
from ...errors import NotSupportedError
from ...masks import Alibi, Causal, Padding, SlidingWindow, mask_parts
from ._attrs import check_broadcast

__all__ = ["translate", "check_broadcast", "band_mask"]


def _band_mask(attrs):
    """cuDNN's diagonal band as a mask: ``i' - L < j <= i' + R`` (left bound exclusive)."""
    alignment, left, right = attrs.band()
    if left is None and right is None:
        return None
    if left is None and right == 0:
        return Causal(alignment)
    return SlidingWindow(-1 if left is None else left - 1, -1 if right is None else right,
                         alignment)


def _side(lengths, cumulative, side: str):
    """One side's lengths from ``seq_len_*`` or ``cu_seq_len_*`` (cuDNN: one form per side)."""
    if lengths is not None and cumulative is not None:
        raise ValueError(f"seq_len_{side} and cu_seq_len_{side} cannot both be set.")
    return lengths if lengths is not None else cumulative


def _padding_of(attrs, batch: int, seq_q: int, seq_kv: int):
    lens_q = _side(attrs.seq_len_q, attrs.cu_seq_len_q, "q")
    lens_kv = _side(attrs.seq_len_kv, attrs.cu_seq_len_kv, "kv")
    if attrs.padding is not None:
        lens_q, lens_kv = attrs.padding
    elif attrs.use_padding:
        if lens_q is None or lens_kv is None:
            raise ValueError("Padding mask requires seq_len_q/seq_len_kv (or "
                             "cu_seq_len_q/cu_seq_len_kv) to be set.")
    elif lens_q is not None or lens_kv is not None:
        raise ValueError("seq_len_q/seq_len_kv needs to be set only if padding mask is enabled.")
    else:
        return None
    if len(lens_q) != batch or len(lens_kv) != batch:
        raise ValueError(f"set_padding_mask: seq_len_q / seq_len_kv need {batch} entries (q's "
                         f"batch), got {len(lens_q)} and {len(lens_kv)}")
    runtime = isinstance(lens_q, torch.Tensor) or isinstance(lens_kv, torch.Tensor)
    if not runtime and (max(lens_q) > seq_q or max(lens_kv) > seq_kv):  # runtime: never read
        raise ValueError(f"set_padding_mask: lengths exceed the tensors: seq_len_q={lens_q} "
                         f"(S_q={seq_q}), seq_len_kv={lens_kv} (S_kv={seq_kv})")
    return Padding(lens_q, lens_kv)


def _cudnn_verdicts(attrs, q, k, v, padded: bool, backward: bool, packed: bool) -> list[str]:
    """What cuDNN's validators reject in this configuration, in their words."""
    seq_q, seq_kv = q.shape[2], k.shape[2]
    alignment, left, right = attrs.band()
    reasons = []
    if q.shape[3] % 8 or (isinstance(v, torch.Tensor) and v.dim() == 4 and v.shape[3] % 8):
        reasons.append("hidden_dim should be multiple of 8")
    for name, t in (("Q", q), ("K", k), ("V", v)):
        if isinstance(t, torch.Tensor) and t.dim() == 4 and t.stride(3) != 1:
            reasons.append(f"The stride for the last dimension corresponding to the embedding "
                           f"size per head should be 1 for {name}")
    if attrs.alibi and right != 0:
        reasons.append("When alibi mask is used, diagonal_band_right_bound needs to be set to 0.")
    if right is not None and alignment == "bottom_right":  # a bottom-right causal diagonal
        dropout = attrs.dropout is not None and not (attrs.dropout[0] == "philox"
                                                     and attrs.dropout[1] == 0)
        if attrs.bias is not None or attrs.alibi or dropout:
            reasons.append("Bottom right causal mask is only supported with is_bias=False, "
                           "is_alibi=False, is_dropout=False.")
        if seq_q > seq_kv and not padded:
            reasons.append("Bottom right causal mask does not support max_s_q > max_s_kv.")
    if left is not None and seq_q > seq_kv and not padded:
        reasons.append("Sliding window attention is only supported with max_s_q <= max_s_kv.")
    if getattr(attrs, "score_mod", None) is not None and (
            left is not None or right is not None or attrs.alibi or padded):
        # cuDNN's score_mod replaces the built-in mask subgraphs (fold masks into the score_mod)
        reasons.append("Attention score mod enabled and hence other subgraphs are disabled.")
    if backward and seq_q == seq_kv == 1:
        reasons.append("s_q = s_kv = 1 is not supported.")
    if not packed and (attrs.max_total_seq_len_q is not None
                       or attrs.max_total_seq_len_kv is not None):
        # This builder's tensors are dense [B, H, S, D], never cuDNN's ragged layout.
        reasons.append("max_total_seq_len_q/kv is only supported with packed (ragged) layout")
    return reasons


def band_mask(attrs):
    """The call's diagonal band and window as one mask (no lengths), or ``None``."""
    parts = [m for m in (_band_mask(attrs),) if m is not None]
    if attrs.window is not None:  # this builder's FlashAttention-style window, on top
        left, right, alignment = attrs.window
        parts.append(SlidingWindow(left, right, alignment or attrs.band()[0]))
    return functools.reduce(operator.and_, parts) if parts else None


def _mask_of(attrs, batch: int, seq_q: int, seq_kv: int):
    parts = [m for m in (band_mask(attrs), _padding_of(attrs, batch, seq_q, seq_kv))
             if m is not None]
    return functools.reduce(operator.and_, parts) if parts else None


def translate(attrs, q, k, v=None, backward: bool = False, packed: bool = False):
    """``(mask, bias, alibi)`` for the call: a bias tensor or ``None``, an ``Alibi`` or ``None``.
    What cuDNN rejects raises ``NotSupportedError`` with cuDNN's reason. ``packed``: q/k/v are
    the logical ``[B, H, max_seqlen, D]`` views of packed (ragged) tensors."""
    for name, t in (("q", q), ("k", k)):
        _checks.tensor(name, t, ndim=4, what="[B, H, S, D]")
    B, H, Sq, Skv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = _mask_of(attrs, B, Sq, Skv)
    padded = any(isinstance(m, Padding) for m in mask_parts(mask))
    reasons = _cudnn_verdicts(attrs, q, k, v, padded, backward, packed)
    if reasons:
        raise NotSupportedError(f"cuDNN SDPA{' backward' if backward else ''} with {attrs!r}",
                                {"cudnn": reasons})
    bias = attrs.bias
    if bias is not None:
        if bias.device != q.device:
            raise ValueError(f"set_bias: bias must be on q's device {q.device}, got {bias.device}")
        check_broadcast("set_bias: bias", bias, (B, H, Sq, Skv))
        bias = bias.detach()
    # cuDNN's ALiBi adds slope_h * (j - i) with right bound 0 and top-left alignment (anything
    # else is rejected above): on every visible pair that is Alibi()'s -slope_h * |i - j|, and
    # cuDNN's default slopes are the paper's, as Alibi()'s.
    return mask, bias, (Alibi() if attrs.alibi else None)
