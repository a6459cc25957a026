"""The CuPy backend: the fused kernels of ``fused_attention.cu`` behind the ``Backend`` protocol.

It serves ``Neighborhood`` problems (1/2/3-D, per-axis kernel/stride/dilation/causal) and the
1-D band masks (dense, ``Causal``, ``SlidingWindow``, with softcap) that cuDNN declines, in either
layout, fp16/bf16/fp32, head dims up to 128, GQA/MQA and ``D_v != D_qk``: the envelope is
``limits.LIMITS``, and ``supports()`` derives its reasons from it (``limits.kernel_reasons`` for the
machine, ``limits.problem_reasons`` for the problem, ``problem_table`` for the mask). Plans are
cached per ``plan_key`` in a registered LRU; each holds its geometry table (uploaded once per
device by ``launch.device_table``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..core import roofline
from ..core.caches import LRU, memoize
from ..model.geometry import band_table, neighborhood_table
from ..model.masks import Band, Causal, Padding, SlidingWindow, band_of, mask_parts
from ..model.problem import AttnProblem
from . import fused, tile_model
from .limits import kernel_reasons, machine_reasons, problem_reasons

__all__ = ["CupyBackend", "CupyPlan", "CupyUnfusedOps", "problem_table"]

PLAN_CACHE_SIZE = 128
# One registered cache for every instance (a registry name maps to one LRU).
_PLANS = LRU("cupy.plans", PLAN_CACHE_SIZE)


def problem_table(problem: AttnProblem) -> tuple[list[int] | None, list[str]]:
    """The geometry table of ``problem``'s mask, or ``(None, reasons)`` when the fused kernel
    cannot express it."""
    parts = mask_parts(problem.mask)
    hood = problem.neighborhood
    if hood is not None:
        others = [m for m in parts if m is not hood]
        if others:
            return None, ["Neighborhood combined with other masks ("
                          + ", ".join(type(m).__name__ for m in others) + ") is not supported"]
        return neighborhood_table(hood.spatial_shape, hood.kernel_size, hood.stride,
                                  hood.dilation, hood.is_causal), []
    for m in parts:
        if not isinstance(m, (Causal, SlidingWindow, Padding)):
            return None, [f"mask {type(m).__name__} is not supported"]
    band = band_of(problem.mask, problem.seq_q, problem.seq_kv, problem.padding is not None) \
        or Band(-1, -1, "top_left")
    if band.alignment is None:
        return None, ["Causal/SlidingWindow masks with mixed alignments are not supported"]
    offset = problem.seq_kv - problem.seq_q if band.alignment == "bottom_right" else 0
    return band_table(problem.seq_q, problem.seq_kv, band.left, band.right, offset), []


class CupyBackend:
    """Backend ``"cupy"``: the fused tiled kernels, compiled with NVRTC, launched through CuPy."""

    name = "cupy"
    # Runs packed/paged storage and whole caches as they lie (would read a whole dense cache).
    runs_stored = False

    def __init__(self):
        self._plans = _PLANS

    def availability(self) -> list[str]:
        return machine_reasons()

    def supports(self, problem: AttnProblem) -> list[str]:
        return (kernel_reasons(problem.device) + problem_reasons(problem)
                + problem_table(problem)[1])

    def plan(self, problem: AttnProblem) -> "CupyPlan":
        return self._plans.get_or_create(problem.plan_key, lambda: CupyPlan(problem))

    def predicted_ms(self, problem: AttnProblem) -> Optional[float]:
        """Predicted ms of a Neighborhood problem on the fused kernels (the tile model of the
        kernels and boxes launched on the problem's device; forward, plus backward when it
        requires grad), for ``auto``'s cost rule (``dispatch.cost_choice``); ``None`` for band
        masks (no rule: priority order) and masks the kernels cannot express."""
        hood = problem.neighborhood
        table, reasons = problem_table(problem)
        if hood is None or reasons or table is None:
            return None
        return _fused_prediction(tuple(table), hood.ndim, problem.batch, problem.heads_q,
                                 problem.heads_kv, problem.dim_qk, problem.dim_v, problem.dtype,
                                 problem.requires_grad, roofline.ceilings_for(problem.device),
                                 roofline.capability_for(problem.device))


@memoize("cupy.fused_prediction", maxsize=256)
def _fused_prediction(table, rank, batch, heads, heads_kv, dim_qk, dim_v, dtype, backward,
                      ceilings, capability) -> float:
    launch = tile_model.launch_figures(table, rank, capability, dim_qk=dim_qk, dim_v=dim_v,
                                       dtype=dtype, batch=batch, heads=heads, heads_kv=heads_kv)
    directions = ("fwd", "bwd") if backward else ("fwd",)
    return sum(tile_model.paced_ms(launch.predicted_ms(d, ceilings), d) for d in directions)


class CupyUnfusedOps:
    """The CuPy engine of NATTEN's unfused ops (``cudnn_attn.core.unfused_ops``): the RawKernels of
    ``unfused`` (deterministic: fixed-order sums, no atomics), stride 1 only (NATTEN 0.17's ops)."""

    name = "cupy"
    composites = None  # no differentiable token functions: unfused_ops wraps the launchers

    def supports(self, problem) -> list[str]:
        # A CPU tensor is the whole answer: the machine probe (cached behind a lock, which
        # torch.compile cannot trace) is asked only for CUDA tensors.
        if problem.device.type != "cuda":
            return [f"the CuPy kernels run CUDA tensors; these are on {problem.device}"]
        reasons = kernel_reasons(problem.device)
        if any(s != 1 for s in problem.mask.stride):
            reasons.append(f"the unfused kernels implement NATTEN 0.17's ops: stride 1, got "
                           f"stride={problem.mask.stride}")
        return reasons

    def launchers(self):
        """The module of ``qk_forward``, ``qk_backward``, ``av_forward``, ``av_backward``."""
        from . import unfused  # CuPy loads with the first launch
        return unfused


class CupyPlan:
    """Geometry table (uploaded once per device) and tile boxes of one ``plan_key``."""

    def __init__(self, problem: AttnProblem):
        table, reasons = problem_table(problem)
        if reasons:
            raise ValueError("; ".join(reasons))
        self.table = tuple(table)
        hood = problem.neighborhood
        self.rank = hood.ndim if hood is not None else 1
        self.o_shape = ((problem.batch, problem.heads_q, problem.seq_q, problem.dim_v)
                        if problem.layout == "bhsd"
                        else (problem.batch, problem.seq_q, problem.heads_q, problem.dim_v))

    def direct(self, problem):
        """No single public op runs these graphs/kernels: every call takes ``forward``."""
        return None

    @staticmethod
    def _tokens(problem, t):
        """The token-major [B, S, H, ...] view of a call-layout tensor (no copy)."""
        t = t if problem.layout == "bshd" else t.transpose(1, 2)
        return t if t.stride(-1) == 1 else t.contiguous()

    def forward(self, problem, inputs, need_lse=True):
        """``(out, lse)``: out in the call's layout and dtype, lse ``[B, H, S_q]`` fp32
        (natural log; ``-inf`` and out 0 on rows that see no key)."""
        q, k, v = inputs.q, inputs.k, inputs.v
        out = torch.empty(self.o_shape, dtype=problem.dtype, device=q.device)
        lse = torch.empty((problem.batch, problem.heads_q, problem.seq_q), dtype=torch.float32,
                          device=q.device)
        tok = functools.partial(self._tokens, problem)
        rpb = None
        if problem.rpb is not None:  # the kernel reads a contiguous fp32 table
            rpb = inputs.bias.detach().to(torch.float32).contiguous()
        fused.run_forward(tok(q), tok(k), tok(v), tok(out), lse.transpose(1, 2), self.table,
                          fused.forward_boxes(self.table, self.rank, problem.dtype, q.device),
                          problem.scale, problem.softcap or 0.0, rpb)
        return out, lse

    def backward(self, problem, inputs, out, lse, dout, dlse=None):
        """``(dq, dk, dv, None)`` from the forward's LSE; ``dlse`` (the gradient reaching the
        returned LSE) enters as ``delta = rowsum(dO * O) - dlse``."""
        q, k, v = inputs.q, inputs.k, inputs.v
        tok = functools.partial(self._tokens, problem)
        o_t, do_t = tok(out), tok(dout)
        lse = lse.to(torch.float32).contiguous()
        delta = fused.backward_delta(o_t, do_t, lse.transpose(1, 2),
                                     None if dlse is None else dlse.transpose(1, 2))
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        fused.run_backward(tok(q), tok(k), tok(v), do_t, lse.transpose(1, 2),
                           delta, tok(dq), tok(dk), tok(dv), self.table,
                           fused.dkdv_boxes(self.table, self.rank, problem.dtype,
                                            fused.head_dim_bucket(problem.dim_qk, problem.dim_v),
                                            q.device),
                           problem.scale, problem.softcap or 0.0,
                           fused.forward_boxes(self.table, self.rank, problem.dtype, q.device))
        return dq, dk, dv, None
