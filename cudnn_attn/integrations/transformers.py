"""Hugging Face transformers: ``attn_implementation="cudnn_attn"``.

::

    import cudnn_attn.integrations.transformers as ca_hf
    ca_hf.register()                       # once per process
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cudnn_attn")

``register(name)`` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and
:func:`cudnn_attn.integrations.hf_masks.structured_mask` to its ``AttentionMaskInterface`` under
``name`` (without a mask builder registered, transformers builds no mask at all, so padding would
be ignored). The masks reach the engines structured (the rules: :mod:`.hf_calls`), with
results equal to "sdpa" at every real token:

* causal (bottom-right aligned when the queries are the last keys, as with a cache), sliding
  windows (``SlidingWindow(w - 1, 0)`` for transformers' ``sliding_window = w``), bidirectional
  attention and bidirectional windows (ModernBERT: ``|q - k| <= w`` is ``SlidingWindow(w, w)``)
  become ``Causal`` / ``SlidingWindow`` / no mask;
* padding from the 2-D ``attention_mask``: right padding adds ``Padding(S_q, lengths)`` (every
  query row, padding ones included, gets what "sdpa" gives it); left padding, holes and cached
  steps run the real tokens through ``attention_varlen`` (as transformers' FlashAttention-2
  integration does; outputs at padding queries are zeros, which no implementation defines);
* packed sequences (``position_ids`` restarting, no 2-D mask, no cache:
  ``DataCollatorWithFlattening``) run through ``attention_varlen`` with ``cu_seqlens`` of the
  sequences;
* static caches (tensor offsets) and compiled steps read nothing on the host:
  ``Padding(S_q, offset + S_q)`` with a bottom-right band, or, for one query with a 2-D mask,
  the visible keys gathered and ``Padding(1, count)``; ``generate(cache_implementation=
  "static")`` compiles its decode steps with ``fullgraph=True``.

transformers' own boolean mask runs as a bias (exact, O(S^2)) only for: a 4-D mask the model
passes itself; custom mask functions (``or``/``and`` masks, chunked or block-wise attention); a
sliding window (causal or bidirectional) whose prompt has holes in the 2-D mask (a window counts
positions, packing closes holes, and no mask hides a key inside a row); and, under
``torch.compile``, a multi-token step with a 2-D mask (its layout cannot be checked without a
host read) and any mask function transformers builds inside the compiled region other than plain
causal / bidirectional (dynamo does not expose a closure's contents: windows built there, and
the packed-sequence mask transformers builds for a forward without a cache).

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
from ..model.masks import Causal
from .hf_calls import structured_call
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
        out = structured_call(attention_mask, query, key, value, **kw)
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
