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
from typing import Mapping, Optional

import torch

from ..core.env import cudnn_version_text as version_text

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
    # cuDNN's SM90 backward walks keys and queries in tiles of up to 128 rows and, without a
    # padding mask, lets the zero-filled tail of the last tile into exp(S - LSE) unmasked: once
    # a row's LSE is below -ln(FLT_MAX) = -88.7 that overflows, and inf * 0 gives NaN. Reported
    # for the key tail, S_kv % 128 == 64 (NaN dQ; cudnn-frontend #160 and PR #628, still failing
    # on cuDNN 9.30; PyTorch #196678 with a bias), and for the query tail, S_q = 1 with S_kv = 128
    # (NaN dK and dV; cudnn-frontend #1072, cuDNN 9.25 and 9.26). A padding mask with the full
    # lengths avoids both (the maintainers' workaround), so graphs whose sizes leave a tail get
    # one (``_spec._open_tiles``).
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
    # backward with B = H_q = S_q = 1: planning it crashed the process (a segfault in
    # create_execution_plans on an H200, cuDNN 9.26; cudnn-frontend #1071), so it is declined
    backward_single_row: bool = False
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

    # -- cuDNN backend versions (``cudnn.backend_version()``: 10000 * major + 100 * minor + patch).
    # The oldest backend the engine runs on: the ``[cu12]``/``[cu13]`` extras' floor, and the
    # oldest a GPU run has verified (an H200, cuDNN 9.19.0). Below it the frontend has gates this
    # table does not model (SDPA broken on 9.10.0/9.10.1, deterministic backward from 9.11, ...).
    min_backend_version: int = 91900
    # The floors of graph features above ``min_backend_version`` (the frontend 1.32's checks):
    # a score_mod needs the unified SDPA node ("Attention score modifier for unified SDPA node
    # requires cuDNN 9.21.0 or above") ...
    score_mod_min_version: int = 92100
    # ... and its numeric constants (``tensor_scalar(v, COMPILE_TIME_CONST)``: softcap, every
    # neighborhood window) are constant tensors ("SetAttribute CUDNN_ATTR_TENSOR_CONSTANT_VALUE
    # requires cudnn version 9.22.0"; an H200 with 9.19 declined a 2-D neighborhood at build).
    score_mod_constant_min_version: int = 92200
    # Planning without a GPU (a described device, ``graphs.deviceless``): 9.19.0 and 9.20.0
    # propose no SDPA engine that finalizes for any graph (every engine config "not supported"
    # at create_execution_plans), 9.21.0, 9.22.0, 9.23.0, 9.26.1 and 9.28 plan every graph of
    # benchmarks/warm_problems.json for the H100 and the H200 (measured on the CPU, 2026-11-29).
    deviceless_min_version: int = 92100
    # "Unified SDPA with Block_mask on SM10x requires cuDNN 9.26.0 or newer due to a masked-tile
    # initialization bug in older backends": older backends run the neighborhood without one.
    block_mask_min_version: Mapping = field(default_factory=lambda: _frozen({10: 92600}))
    # the dedicated backward kernels of ``backward_head_dim_extra``: "d_qk == 192 and d_v == 128
    # (requires cuDNN 9.19+) or d_qk == d_v == 256 (requires cuDNN 9.26+)"
    backward_head_dim_extra_min_version: Mapping = field(default_factory=lambda: _frozen(
        {(192, 128): 91900, (256, 256): 92600}))

    def backward_head_dim_limit(self, major: int) -> int:
        return self.backward_head_dim.get(major, self.default_backward_head_dim)

    def backward_head_dims_ok(self, major: int, d_qk: int, d_v: int,
                              version: Optional[int] = None) -> bool:
        """Whether sm major ``major``'s backward serves ``(d_qk, d_v)`` on cuDNN ``version``
        (``None``: the newest)."""
        if max(d_qk, d_v) <= self.backward_head_dim_limit(major):
            return True
        if (d_qk, d_v) not in self.backward_head_dim_extra.get(major, ()):
            return False
        floor = self.backward_head_dim_extra_min_version.get((d_qk, d_v), 0)
        return version is None or version >= floor

    def backward_head_dim_reasons(self, sm: int, d_qk: int, d_v: int,
                                  version: Optional[int] = None) -> list[str]:
        """Why the backward on ``sm`` (e.g. 90) and cuDNN ``version`` cannot take the head dims."""
        major = sm // 10
        if self.backward_head_dims_ok(major, d_qk, d_v, version):
            return []
        if self.backward_head_dims_ok(major, d_qk, d_v):  # a dedicated kernel of a later cuDNN
            floor = self.backward_head_dim_extra_min_version[(d_qk, d_v)]
            return [f"cuDNN's SDPA backward on sm_{sm} with D_qk={d_qk}, D_v={d_v} needs cuDNN "
                    f">= {version_text(floor)}, have {version_text(version)}"]
        return [f"cuDNN's SDPA backward on sm_{sm} serves head dims up to "
                f"{self.backward_head_dim_limit(major)}, got D_qk={d_qk}, D_v={d_v}"]

    def block_mask_ok(self, major: int, version: Optional[int] = None) -> bool:
        """Whether graphs on sm major ``major`` carry a block mask on cuDNN ``version``."""
        if major < self.block_mask_min_major:
            return False
        return version is None or version >= self.block_mask_min_version.get(major, 0)

    def version_reasons(self, version: int, **features: bool) -> list[str]:
        """Why cuDNN ``version`` cannot build a graph using ``features`` (name -> used:
        ``score_mod``, ``score_mod_constants``): the package floor, then each feature's."""
        have = version_text(version)
        reasons = []
        if version < self.min_backend_version:
            reasons.append(f"cudnn_attn's cuDNN engine needs cuDNN >= "
                           f"{version_text(self.min_backend_version)}, have {have}")
        floors = {"score_mod": (self.score_mod_min_version, "a score_mod (softcap, a "
                                "neighborhood, the builder's score_mod)"),
                  "score_mod_constants": (self.score_mod_constant_min_version,
                                          "a score_mod with numeric constants (constant "
                                          "tensors, CUDNN_ATTR_TENSOR_CONSTANT_VALUE)")}
        for name, used in features.items():
            floor, what = floors[name]
            if used and version < floor:
                reasons.append(f"{what} needs cuDNN >= {version_text(floor)}, have {have}")
        return reasons

LIMITS = CudnnLimits()

# Module-level names kept for readers of the old constants.
MAX_HEAD_DIM = LIMITS.max_head_dim
BACKWARD_HEAD_DIM = LIMITS.backward_head_dim
