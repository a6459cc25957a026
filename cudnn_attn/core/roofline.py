"""Predicted times from a GPU's ceilings: the cost rule ``auto`` compares engines with.

A kernel's time is the larger of its two ceilings, ``bytes / bandwidth`` and ``flops / (matmul
peak x efficiency)``, where the efficiency is the fraction of the 16-bit tensor-core peak that
kind of work reaches (measured, per path: the fused kernels' unmasked and masked tiles live with
their tile model, ``fallback_kernels.tile_model``; dense cuDNN is here). Pure Python: no GPU is
touched except to read the device's name.

Calibration (H200, bf16, issue 34's table, measured side by side): dense cuDNN over all tokens ran
2-D 128x128 H8 D128 in 1.70 ms (647 TFLOP/s, 0.82 of the 790 ceiling), 1-D/3-D 32768 tokens H16
D128 in 14.4 ms (611, 0.77), 2-D 64x64 H16 D64 in 0.23 ms (299 TFLOP/s: a score element at D=64
cost as much time as at D=128, hence ``MIN_SCORE_FLOPS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

from .caches import memoize

__all__ = ["Ceilings", "DEVICE_CEILINGS", "DEFAULT_CEILINGS", "ceilings_for",
           "capability_for", "score_flops",
           "roofline_ms", "dense_figures", "dense_ms", "DENSE_EFFICIENCY", "MIN_SCORE_FLOPS",
           "BACKWARD_FLOP_FACTOR"]

BACKWARD_FLOP_FACTOR = 2.5  # backward matmuls: 5 GEMM-sized products to the forward's 2
# dense cuDNN SDPA: fraction of the matmul ceiling (0.77-0.82 measured on an H200, see above)
DENSE_EFFICIENCY = 0.78
# Work per score element is counted as at least this many FLOPs (4 x 128): below D=128 the
# softmax and the per-element bookkeeping, not the matmuls, set the time (H200: dense cuDNN took
# 0.86 ps per score element at D=64 and 0.79 ps at D=128).
MIN_SCORE_FLOPS = 512
# 32-bit FMA units against the 16-bit tensor cores (H100 SXM: 67 vs 989 TFLOP/s dense): the
# fp32 path of the fused kernels computes without tensor cores.
FP32_FRACTION = 1 / 16


@dataclass(frozen=True)
class Ceilings:
    """A GPU's ceilings: device-memory ``bandwidth`` (bytes/s), 16-bit tensor-core ``matmul``
    peak (FLOP/s, dense) and the rate of 32-bit lane instructions (``pointwise``, per second:
    SMs x 128 lanes x clock), which a cuDNN score_mod program runs on; ``capability`` the
    compute capability, which decides the kernels a model of this GPU launches."""

    name: str
    bandwidth: float
    matmul: float
    pointwise: float
    capability: tuple[int, int] = (9, 0)


# Measured ceilings where a run measured them (gpu.md: H100 ~3.0 TB/s, ~800 TFLOP/s; H200 ~4.3
# TB/s, ~790), else data-sheet figures.
DEVICE_CEILINGS = {
    "H200": Ceilings("H200", 4.3e12, 790e12, 132 * 128 * 1.98e9),
    "H100": Ceilings("H100", 3.0e12, 800e12, 132 * 128 * 1.98e9),
    "A100": Ceilings("A100", 1.9e12, 280e12, 108 * 64 * 1.41e9, (8, 0)),
    "B200": Ceilings("B200", 7.7e12, 2200e12, 148 * 128 * 1.9e9, (10, 0)),
}
DEFAULT_CEILINGS = DEVICE_CEILINGS["H100"]


@memoize("roofline.ceilings", maxsize=16)
def _ceilings_of(name: str) -> Ceilings:
    upper = name.upper()
    for key, ceilings in DEVICE_CEILINGS.items():
        if key in upper:
            return ceilings
    return DEFAULT_CEILINGS


def ceilings_for(device) -> Ceilings:
    """The ceilings of ``device`` (a CUDA device, by its name); ``DEFAULT_CEILINGS`` (H100) for
    an unknown GPU or a non-CUDA device. Only ratios between engines decide ``auto``, so a
    wrong guess shifts both sides alike."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_CEILINGS
    return _ceilings_of(torch.cuda.get_device_name(device))


def capability_for(device) -> tuple[int, int]:
    """The compute capability of ``device`` where torch can read it, else that of
    :func:`ceilings_for`'s GPU (a CUDA problem described on a machine without one)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return _capability_of(device.index if device.index is not None
                              else torch.cuda.current_device())
    return ceilings_for(device).capability


@memoize("roofline.capability", maxsize=16)
def _capability_of(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return major, minor


def score_flops(dim_qk: int, dim_v: int) -> int:
    """FLOPs a score element costs: ``2 (D_qk + D_v)``, at least ``MIN_SCORE_FLOPS``."""
    return max(2 * (dim_qk + dim_v), MIN_SCORE_FLOPS)


def roofline_ms(work: Iterable[tuple[float, float]], nbytes: float, ceilings: Ceilings,
                dtype: torch.dtype = torch.bfloat16, pointwise_ops: float = 0.0) -> float:
    """Milliseconds of a kernel: ``work`` is ``(flops, efficiency)`` per path (their matmul
    times add), ``nbytes`` its device-memory traffic; ``pointwise_ops`` 32-bit instructions
    that overlap the matmuls (a pipelined kernel's softmax side). fp32 runs at
    ``FP32_FRACTION`` of the tensor-core peak."""
    peak = ceilings.matmul * (FP32_FRACTION if dtype == torch.float32 else 1.0)
    compute = sum(flops / (peak * eff) for flops, eff in work)
    compute = max(compute, pointwise_ops / ceilings.pointwise)
    return 1e3 * max(compute, nbytes / ceilings.bandwidth)


def dense_figures(*, batch: int, heads: int, heads_kv: int, seq_q: int, seq_kv: int,
                  dim_qk: int, dim_v: int, dtype: torch.dtype) -> dict:
    """FLOPs (``score_flops`` per element), score elements and bytes of dense attention over
    all tokens, per direction: every score is computed; Q, K, V, O move once (the re-reads of
    K and V per query tile hit L2), the backward adds dO, dQ, dK, dV and the row statistics."""
    e = torch.empty((), dtype=dtype).element_size()
    scores = batch * heads * seq_q * seq_kv
    q_side = batch * heads * seq_q * (dim_qk + dim_v) * e
    kv_side = batch * heads_kv * seq_kv * (dim_qk + dim_v) * e
    flops = scores * score_flops(dim_qk, dim_v)
    return {"scores": scores, "flops": {"fwd": flops, "bwd": flops * BACKWARD_FLOP_FACTOR},
            "bytes": {"fwd": q_side + kv_side + batch * heads * seq_q * 4,
                      "bwd": 2 * (q_side + kv_side) + q_side + batch * heads * seq_q * 8}}


def dense_ms(direction: str, *, ceilings: Ceilings, mask_ops: int = 0,
             efficiency: float = DENSE_EFFICIENCY, **shape) -> float:
    """Predicted ms of dense cuDNN attention (``direction`` "fwd" or "bwd") on ``shape``
    (``dense_figures``' arguments); ``mask_ops``: the instructions per score element of an
    exact mask run as a score_mod program (overlapping the matmuls, as FlashAttention-3-style
    kernels overlap their softmax)."""
    figures = dense_figures(**shape)
    ops = figures["scores"] * mask_ops * (BACKWARD_FLOP_FACTOR if direction == "bwd" else 1.0)
    return roofline_ms([(figures["flops"][direction], efficiency)], figures["bytes"][direction],
                       ceilings, shape["dtype"], ops)
