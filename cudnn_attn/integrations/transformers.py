"""Hugging Face transformers: ``attn_implementation="cudnn_attn"``.

::

    import cudnn_attn.integrations.transformers as ca_hf
    ca_hf.register()                       # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cudnn_attn")

``register(name)`` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
:func:`cudnn_attn.integrations.hf_masks.structured_mask` to its ``AttentionMaskInterface`` under
``name`` (without a mask builder registered, transformers builds no mask at all, so padding would
be ignored). The masks reach the engines structured, never as a dense bias unless the model
really asks for an arbitrary mask:

* causal (bottom-right aligned when the queries are the last keys, as with a cache), sliding
  windows (``SlidingWindow(w - 1, 0)`` for transformers' ``sliding_window = w``) and
  bidirectional attention become ``Causal`` / ``SlidingWindow`` / no mask;
* padding from the 2-D ``attention_mask``: right padding (each row's tokens a prefix, queries and
  keys starting together) adds ``Padding(S_q, lengths)`` to that mask, so every query row, padding
  ones included, gets what "sdpa" gives it; otherwise (left padding, holes, a cache) the real tokens
  are packed and run through ``attention_varlen`` with per-sequence lengths (as transformers'
  FlashAttention-2 integration does), and outputs at padding queries are zeros (no implementation
  defines their logits);
* a 4-D mask the model passes itself, custom mask functions (``or``/``and`` masks, packed
  sequences, chunked or block-wise attention) and static-cache offsets under compile get
  transformers' own boolean mask as a bias.

GQA goes to the engines as is (no ``repeat_kv``); ``softcap`` (Gemma-2), ``scaling``, ``dropout``
(training) and sinks (``s_aux``, gpt-oss) are passed on. ``output_attentions=True`` behaves as
transformers' "sdpa" does: a warning, and no attention weights (``None``). Results equal
``attn_implementation="sdpa"`` up to rounding (at real tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ..api import attention
from ..model.masks import Causal, Padding, SlidingWindow
from ..rewrites.sinks import merge_sinks
from ..varlen import attention_varlen
from .hf_masks import StructuredMask, structured_mask

__all__ = ["register", "attention_forward"]

logger = logging.getLogger("cudnn_attn")
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def _bias(mask: torch.Tensor) -> torch.Tensor:
    """transformers' mask -> an additive bias: boolean (True = attend) -> 0 / -inf; a float mask
    is already additive."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
            ~mask, float("-inf"))
    return mask


def _mask_of(struct: StructuredMask, alignment: str):
    """Causal / SlidingWindow / None for the structure, with ``alignment``."""
    if struct.causal:
        return Causal(alignment) if struct.window is None else \
            SlidingWindow(struct.window - 1, 0, alignment)
    return None if struct.window is None else SlidingWindow(struct.window, struct.window, alignment)


def _alignment(struct: StructuredMask):
    """How query ``i`` lines up with key ``j`` (absolute positions ``q_offset + i`` and
    ``kv_offset + j``): ``"bottom_right"`` when the queries are the last keys, ``"top_left"``
    when both start together, else None (no mask of ours aligns them)."""
    shift = struct.q_offset - struct.kv_offset
    if shift == struct.kv_length - struct.q_length:
        return "bottom_right"
    return "top_left" if shift == 0 else None


def _one_run(valid: torch.Tensor) -> bool:
    """Every row's True entries are contiguous (left or right padding, no holes)."""
    starts = valid[:, 1:] & ~valid[:, :-1]
    return bool((starts.sum(1) + valid[:, 0].to(starts.dtype) <= 1).all())


def _is_prefix(valid: torch.Tensor, lens: torch.Tensor) -> bool:
    """Each row's True entries are its first ``lens[b]`` (right padding)."""
    return bool((valid == (torch.arange(valid.shape[1], device=valid.device) < lens[:, None])).all())


def _packed_queries(struct: StructuredMask):
    """``(queries [B, S_q] bool, alignment)`` for the packed form, or None when it would not
    keep each query's keys.

    Bidirectional: every query, every real key. Causal, queries and keys starting together
    (prefill) with each row's tokens contiguous (left or right padding): the queries from the
    row's first token on, top-left aligned, so trailing padding queries see what "sdpa" shows
    them. Otherwise (a cache, holes): the real queries, bottom-right aligned, which needs each
    query's own slot among the keys, no real key after the last query, and, for a window (it
    counts positions), contiguous tokens.
    """
    padding: Any = struct.padding
    if not struct.causal:
        return None if struct.window is not None else (
            torch.ones(padding.shape[0], struct.q_length, dtype=torch.bool,
                       device=padding.device), "top_left")
    shift = struct.q_offset - struct.kv_offset
    contiguous = _one_run(padding)
    if shift == 0 and contiguous:
        first = padding.to(torch.int8).argmax(1)
        return torch.arange(struct.q_length, device=padding.device) >= first[:, None], "top_left"
    if shift < 0 or shift + struct.q_length > struct.kv_length:
        return None
    if bool(padding[:, shift + struct.q_length:].any()):
        return None
    if struct.window is not None and not contiguous:
        return None
    return padding[:, shift:shift + struct.q_length], "bottom_right"


def _padded_call(struct, real_q, alignment, query, key, value, **kw):
    """``[B, S_q, H, D_v]`` through ``attention_varlen`` on the real tokens (zeros elsewhere)."""
    sinks = kw.pop("sinks")
    padding = struct.padding
    lens_q, lens_k = real_q.sum(1), padding.sum(1)
    cu_q = torch.nn.functional.pad(lens_q.cumsum(0), (1, 0)).to(torch.int32)
    cu_k = torch.nn.functional.pad(lens_k.cumsum(0), (1, 0)).to(torch.int32)
    q = query.transpose(1, 2)[real_q]                  # [total_q, H, D]
    k, v = (t.transpose(1, 2)[padding] for t in (key, value))
    mask = _mask_of(struct, alignment)
    out = attention_varlen(q, k, v, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()), mask=mask,
                           return_lse=sinks is not None, **kw)
    if sinks is not None:
        out, lse = out
        out = merge_sinks(out[None], lse[None], sinks, "bshd")[0][0]
    batch, seq_q = real_q.shape
    full = out.new_zeros(batch, seq_q, *out.shape[1:])
    return full.index_put(tuple(real_q.nonzero().t()), out)


def _structured_call(struct: StructuredMask, query, key, value, **kw):
    """``[B, S_q, H, D_v]`` for a structured mask, or None when only the dense mask serves."""
    alignment = _alignment(struct)
    if struct.padding is None or bool(struct.padding.all()):
        if alignment is None:
            return None
        return attention(query, key, value, mask=_mask_of(struct, alignment), **kw).transpose(1, 2)
    lens_k = struct.padding.sum(1)
    if alignment == "top_left" and _is_prefix(struct.padding, lens_k):
        # Right padding: Padding hides the keys past each length and keeps every query row, so
        # padding queries get what "sdpa" gives them too (generate() reads the last one).
        full_q = torch.full_like(lens_k, struct.q_length)
        mask = _mask_of(struct, "top_left")
        padding = Padding(full_q, lens_k)
        mask = padding if mask is None else mask & padding
        return attention(query, key, value, mask=mask, **kw).transpose(1, 2)
    packed = _packed_queries(struct)
    if packed is None:
        return None
    real_q, alignment = packed
    return _padded_call(struct, real_q, alignment, query, key, value, **kw)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: StructuredMask | torch.Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None,
                      softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature on ``cudnn_attn.attention``.

    Args:
        module: the calling attention layer (its ``is_causal`` is the default of ``is_causal``).
        query: ``[B, H_q, S_q, D]``; key, value: ``[B, H_kv, S_k, D]`` (GQA: ``H_q % H_kv == 0``).
        attention_mask: a :class:`~cudnn_attn.integrations.hf_masks.StructuredMask` (from the
            registered mask builder), None, a boolean ``[B, 1 or H_q, S_q, S_k]`` (True = attend)
            or an additive float mask of that shape.
        dropout, scaling, softcap: attention dropout (training), softmax scale, logit softcap.
        s_aux: (keyword) attention sinks, one logit per query head (gpt-oss).

    Returns:
        ``(out [B, S_q, H_q, D], None)`` (no attention weights), as transformers expects.

    Equivalent PyTorch::

        out = F.scaled_dot_product_attention(query, key, value, attn_mask=dense_mask,
                                             scale=scaling, enable_gqa=True).transpose(1, 2)
    """
    if kwargs.get("output_attentions", False):
        _warn_once("cudnn_attn (like transformers' `sdpa`) does not return attention weights: "
                   "`output_attentions=True` gives None. Use attn_implementation='eager' for them.")
    kw: dict[str, Any] = dict(scale=scaling, dropout_p=dropout if getattr(module, "training", False) else 0.0,
              softcap=softcap if softcap else None, sinks=kwargs.get("s_aux"))
    if isinstance(attention_mask, StructuredMask):
        out = _structured_call(attention_mask, query, key, value, **kw)
        if out is not None:
            return out.contiguous(), None
        attention_mask = attention_mask.dense()
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    mask = bias = None
    if attention_mask is not None:
        bias = _bias(attention_mask[:, :, :, : key.shape[-2]])
    elif causal and query.shape[2] > 1:
        mask = Causal("bottom_right")
    out = attention(query, key, value, mask=mask, bias=bias, **kw)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "cudnn_attn") -> str:
    """Make ``attn_implementation=name`` use cudnn_attn in transformers models; returns ``name``.

    Registers :func:`attention_forward` (``AttentionInterface``) and
    :func:`~cudnn_attn.integrations.hf_masks.structured_mask` (``AttentionMaskInterface``) under
    ``name``. Needs ``transformers`` (the ``[hf]``
    extra). Calling it again is harmless.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError("cudnn_attn.integrations.transformers needs transformers: pip install "
                          "'cudnn-attn[hf]'") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, structured_mask)
    return name
