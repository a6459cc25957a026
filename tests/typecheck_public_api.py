# mypy: warn-unused-ignores
"""Checked by mypy (``[tool.mypy] files``), never run by pytest: the public API used the way user
code uses it, so a public name a type checker cannot see, or a return type that does not fit,
fails CI. ``wrong_calls`` holds calls the peers' types reject, each with the ignore of the error
mypy must report: ``warn-unused-ignores`` (this file only) fails CI when one of them stops being
an error (a parameter turned ``Any``, a decorator that erases the signature).
``assert_type`` fails on results that became ``Any``."""

from __future__ import annotations

import torch
from typing_extensions import assert_type

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


def typed_compat_calls(q: torch.Tensor, out: torch.Tensor) -> list[object]:
    """The compat surfaces with the peers' argument types: each call type-checks as written in
    the peers' docs, and the results have the peers' types."""
    na2d_forward(out, q, q, q, None, (3, 3), 1, False, None, None, None)  # libnatten op: -> None
    fused: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = natten.na2d(
        q, q, q, kernel_size=(3, 3), dilation=2, is_causal=(True, False), q_tile_shape=(8, 8),
        kv_tile_shape=(8, 8))
    merged: tuple[torch.Tensor, torch.Tensor] = natten.merge_attentions([q, q], [q, q])
    weights: torch.Tensor = natten.na2d_qk(q, q, 3)
    configs: list[tuple[int, int]] = natten.get_configs_for_flex_fmha(q, q, q)
    layer = natten.NeighborhoodAttention2D(64, 4, (3, 5), dilation=(1, 2), qk_scale=0.1)
    windowed = flash_attn_func(q, q, q, window_size=(128, 0), softcap=30.0)
    attrs = ca.SdpaAttributes().set_causal_mask(True).set_sliding_window(64, 0, "top_left") \
        .set_padding_mask([3, 4], torch.tensor([4, 4])).set_attn_scale(0.125)
    o, stats = ca.scaled_dot_product_flash_attention(q, q, q, attrs)
    with ca.use_backend("torch") as allowed:
        names: tuple[str, ...] = allowed
    with natten.deterministic_scope():
        pass
    fp8_out, amaxes = ca.attention_fp8(q, q, q, ca.DelayedScaling(), mask=ca.Causal(), scale=0.1)
    report = ca.selftest(backends="torch", dtypes=["float32"], stream="selftest.jsonl")
    problem = ca.AttnProblem.from_tensors(q, q, q, mask=ca.Padding([3, 4]), bias=ca.Alibi())
    return [fused, merged, weights, configs, layer, windowed, o, stats, names, fp8_out,
            amaxes["q"], report.ok, problem]


def result_types(q: torch.Tensor) -> None:
    assert_type(natten.na2d_qk(q, q, 3), torch.Tensor)
    assert_type(natten.merge_attentions([q, q], [q, q]), tuple[torch.Tensor, torch.Tensor])
    assert_type(mha_fwd(q, q, q, None, None, 0.0, None, False, -1, -1, 0.0, False, None),
                tuple[torch.Tensor, ...])
    assert_type(na2d_forward(q, q, q, q, None, 3, 1, False, None, None, None), None)
    assert_type(ca.SdpaAttributes().set_causal_mask(True), ca.SdpaAttributes)
    assert_type(ca.use_backend("torch").__enter__(), tuple[str, ...])
    assert_type(context_parallel_attention(q, q, q, return_lse=False),
                torch.Tensor | tuple[torch.Tensor, torch.Tensor])


def wrong_calls(q: torch.Tensor) -> None:
    flash_attn_func(q, q, q, window_size="left")  # type: ignore[arg-type]
    flash_attn_with_kvcache(q, q, q, cache_seqlens="3")  # type: ignore[arg-type]
    natten.na2d(q, q, q, kernel_size="3")  # type: ignore[arg-type]
    natten.na2d(q, q, q, 3, q_tile_shape=8)  # type: ignore[arg-type]
    na2d_forward(q, q, q, q, None, 3, 1, False, None, "8", None)  # type: ignore[arg-type]
    mha_fwd(q, q, q, None, None, 0.0, None, "yes", -1, -1, 0.0, False, None)  # type: ignore[arg-type]
    ca.SdpaAttributes().set_sliding_window(3, 0, "middle")  # type: ignore[arg-type]
    ca.selftest(backends=3)  # type: ignore[arg-type]
    ca.Padding(3)  # type: ignore[arg-type]
    ca.attention_fp8(q, q, q, ca.DelayedScaling(), descale_q="1")  # type: ignore[arg-type]
    MultiheadAttention(64, 4, device=torch.float32)  # type: ignore[arg-type]
    ca.graph_cache.save(3)  # type: ignore[arg-type]
