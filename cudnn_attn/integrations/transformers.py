"""Hugging Face transformers: ``attn_implementation="cudnn_attn"``.

::

    import cudnn_attn.integrations.transformers as ca_hf
    ca_hf.register()                       # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cudnn_attn")

``register(name)`` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
transformers' own SDPA mask builder to its ``AttentionMaskInterface`` under ``name`` (without a
mask function registered, transformers builds no mask at all, so padding would be ignored). The
mask arrives as a boolean ``[B, 1, S_q, S_k]`` tensor (True = attend) that already combines
causality, padding (the ``attention_mask`` of ``generate``/``forward``) and sliding windows; or as
None where transformers found it unnecessary (no padding, ``S_q == 1`` or ``S_q == S_k``), and then
the call is causal (bottom-right aligned) exactly when the module is and ``S_q > 1``, as for SDPA.
GQA goes to the engines as is (no ``repeat_kv``); ``softcap`` (Gemma-2), ``scaling`` and
``dropout`` are passed on. Results equal ``attn_implementation="sdpa"`` up to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..api import attention
from ..masks import Causal

__all__ = ["register", "attention_forward"]


def _bias(mask: torch.Tensor) -> torch.Tensor:
    """transformers' mask -> an additive bias: boolean (True = attend) -> 0 / -inf; a float mask
    is already additive."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
            ~mask, float("-inf"))
    return mask


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | Sequence[bool] | None = None, softcap: float | None = None,
                      **kwargs: Any) -> Any:
    """transformers' attention-function signature on ``cudnn_attn.attention``.

    Args:
        module: the calling attention layer (its ``is_causal`` is the default of ``is_causal``).
        query: ``[B, H_q, S_q, D]``; key, value: ``[B, H_kv, S_k, D]`` (GQA: ``H_q % H_kv == 0``).
        attention_mask: None, a boolean ``[B, 1 or H_q, S_q, S_k]`` (True = attend) or an
            additive float mask of that shape.
        dropout, scaling, softcap: attention dropout (training), softmax scale, logit softcap.
        s_aux: (keyword) attention sinks, one logit per query head (gpt-oss).

    Returns:
        ``(out [B, S_q, H_q, D], None)`` (no attention weights), as transformers expects.

    Equivalent PyTorch::

        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             scale=scaling, enable_gqa=True).transpose(1, 2)
    """
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    mask = bias = None
    if attention_mask is not None:
        bias = _bias(attention_mask[:, :, :, : key.shape[-2]])
    elif causal and query.shape[2] > 1:
        mask = Causal("bottom_right")
    out = attention(query, key, value, mask=mask, bias=bias, scale=scaling,
                    dropout_p=dropout if getattr(module, "training", False) else 0.0,
                    softcap=softcap if softcap else None, sinks=kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None


def register(name: str = "cudnn_attn") -> str:
    """Make ``attn_implementation=name`` use cudnn_attn in transformers models; returns ``name``.

    Registers :func:`attention_forward` (``AttentionInterface``) and transformers' SDPA mask
    builder (``AttentionMaskInterface``) under ``name``. Needs ``transformers`` (the ``[hf]``
    extra). Calling it again is harmless.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as e:
        raise ImportError("cudnn_attn.integrations.transformers needs transformers: pip install "
                          "'cudnn-attn[hf]'") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
