"""Checked by mypy (``[tool.mypy] files``), never run by pytest: the public API used the way user
code uses it, so a public name a type checker cannot see, or a return type that does not fit,
fails CI."""

from __future__ import annotations

import torch

import cudnn_attn as ca
import cudnn_attn.natten as natten
from cudnn_attn.distributed import context_parallel_attention
from cudnn_attn.flash_api import mha_fwd
from cudnn_attn.flash_attn_interface import flash_attn_func, flash_attn_with_kvcache
from cudnn_attn.nn import MultiheadAttention
from cudnn_attn.ops import na2d_forward, valid_tile_sizes


def user_code(q: torch.Tensor) -> list[object]:
    out: torch.Tensor = ca.attention(q, q, q, mask=ca.Causal())
    out2, lse = ca.attention(q, q, q, mask=ca.Neighborhood((4, 4), 3), return_lse=True)
    varlen = ca.attention_varlen(q, q, q, q, q, 4, 4, mask=ca.Causal() & ca.Padding([3]))
    explanation: ca.Explanation = ca.explain(q, q, q, bias=ca.Alibi())
    selected: str | None = explanation.selected
    layer = MultiheadAttention(64, 4, mask=ca.SlidingWindow(8, 0))
    return [out, out2, lse, varlen, selected, layer(q), natten.na2d(q, q, q, kernel_size=3),
            flash_attn_func(q, q, q, causal=True), flash_attn_with_kvcache, mha_fwd, na2d_forward,
            valid_tile_sizes, context_parallel_attention, ca.selftest, ca.SdpaAttributes,
            ca.graph_cache.info(), ca.__version__]
