"""The cuDNN engine's limits, in one place: ``analyze()`` / ``cudnn_reasons`` derive every
reason from ``LIMITS``.

Sources: the cuDNN frontend 1.32 validators (``_sdpa_validate.py`` and the C++
``sdpa_support_surface.h`` / ``scaled_dot_product_flash_attention.h``), the cuDNN release notes,
and the gaps ``shared/reference/cudnn-frontend.md`` (section 4.2) lists as "accepted although
unsupported".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

__all__ = ["CudnnLimits", "LIMITS", "MAX_HEAD_DIM", "BACKWARD_HEAD_DIM"]


def _frozen(d: dict) -> Mapping:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class CudnnLimits:
    """What cuDNN's SDPA graphs can express, and where (per SM major)."""

    # q/k/v/o element types, and the name the graph builder uses for each.
    io_dtypes: Mapping = field(default_factory=lambda: _frozen(
        {torch.float16: "float16", torch.bfloat16: "bfloat16"}))
    # bias element types: q's dtype or float32.
    bias_dtypes: Mapping = field(default_factory=lambda: _frozen(
        {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}))
    # head dims must be multiples of this (both D_qk and D_v).
    head_dim_multiple: int = 8
    # largest head dim any cuDNN backend engine serves (forward; FROST's D512 is a JIT side path).
    max_head_dim: int = 256
    # backward head-dim limit per SM major (C++ validator of sdpa_backward, verified 80..120);
    # other majors: ``default_backward_head_dim``.
    backward_head_dim: Mapping = field(default_factory=lambda: _frozen(
        {8: 128, 9: 256, 10: 128, 12: 128}))
    default_backward_head_dim: int = 128
    # (D_qk, D_v) pairs with dedicated backward kernels beyond the limit, per SM major.
    backward_head_dim_extra: Mapping = field(default_factory=lambda: _frozen(
        {10: ((192, 128), (256, 256))}))
    # oldest SM major with float16/bfloat16 SDPA.
    min_sm_major: int = 8
    # cuDNN masks the padded tail of the last 128-wide key tile only with a padding mask
    # (cudnn-frontend #160, PyTorch #196678: NaN dQ with a bias and S_kv % 128 == 64).
    key_tile: int = 128
    # feature gaps of this engine / cuDNN
    # softcap and NATTEN masks run as a score_mod program (score_mod_masks), which excludes the
    # built-in padding and ALiBi (the band is folded into the program)
    softcap: bool = True
    neighborhood_masks: bool = True
    # a backward with a score_mod_bprop (softcap's) plans from this SM major on (sm_80: no
    # engine; deviceless plans, cuDNN 9.28)
    score_mod_bprop_min_major: int = 9
    # cuDNN's block mask (tiles to skip; forward only): "only supported on Blackwell and Rubin".
    # Neighborhood graphs carry one from this SM major on.
    block_mask_min_major: int = 10
    alibi_custom_slopes: bool = False  # ALiBi uses the standard slopes only
    alibi_needs_causal: bool = True    # ALiBi needs a diagonal right bound of 0
    # what the bottom-right diagonal cannot be combined with
    bottom_right_excludes: tuple = ("bias", "alibi", "dropout")
    # decode (S_q = 1) with a band and H_q != H_kv gives wrong results (cuDNN 9.18.1 notes)
    decode_band_gqa: bool = False
    # backward with S_q = S_kv = 1
    backward_single_token: bool = False
    # packed (ragged) backward cannot read a packed LSE on these SM majors
    ragged_backward_lse_majors: tuple = (8, 12)
    # no dBias with ragged layouts on these SM majors
    ragged_dbias_excluded_majors: tuple = (10,)
    # deterministic backward excludes dbias/dropout/ALiBi on these SM majors
    deterministic_feature_majors: tuple = (10,)
    # paged KV caches: forward only, power-of-two page sizes
    paged_backward: bool = False
    # a Philox-dropout forward without the stats output has no engine on these SM majors
    # (cuDNN 9.28 deviceless plans for a B200: every sm_100 SDPA engine refuses it at
    # create_execution_plans, "KERNEL_CFG knob must be set"; with stats, engine 3 serves it)
    philox_dropout_needs_stats_majors: tuple = (10,)

    def backward_head_dim_limit(self, major: int) -> int:
        return self.backward_head_dim.get(major, self.default_backward_head_dim)

    def backward_head_dims_ok(self, major: int, d_qk: int, d_v: int) -> bool:
        if max(d_qk, d_v) <= self.backward_head_dim_limit(major):
            return True
        return (d_qk, d_v) in self.backward_head_dim_extra.get(major, ())


LIMITS = CudnnLimits()

# Module-level names kept for readers of the old constants.
MAX_HEAD_DIM = LIMITS.max_head_dim
BACKWARD_HEAD_DIM = LIMITS.backward_head_dim
