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

import torch

from ..caches import LRU
from ..geometry import band_table, neighborhood_table
from ..masks import Causal, Padding, SlidingWindow, mask_parts
from ..problem import AttnProblem
from . import fused
from .limits import kernel_reasons, machine_reasons, problem_reasons

__all__ = ["CupyBackend", "CupyPlan", "problem_table"]

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
    left, right, alignments = -1, -1, set()
    for m in parts:
        if isinstance(m, Causal):
            right = 0 if right < 0 else min(right, 0)
            alignments.add(m.alignment)
        elif isinstance(m, SlidingWindow):
            if m.left >= 0:
                left = m.left if left < 0 else min(left, m.left)
            if m.right >= 0:
                right = m.right if right < 0 else min(right, m.right)
            alignments.add(m.alignment)
        elif not isinstance(m, Padding):
            return None, [f"mask {type(m).__name__} is not supported"]
    if len(alignments) > 1:
        return None, ["Causal/SlidingWindow masks with mixed alignments are not supported"]
    offset = problem.seq_kv - problem.seq_q if alignments == {"bottom_right"} else 0
    return band_table(problem.seq_q, problem.seq_kv, left, right, offset), []


class CupyBackend:
    """Backend ``"cupy"``: the fused tiled kernels, compiled with NVRTC, launched through CuPy."""

    name = "cupy"

    def __init__(self):
        self._plans = _PLANS

    def availability(self) -> list[str]:
        return machine_reasons()

    def supports(self, problem: AttnProblem) -> list[str]:
        return (kernel_reasons(problem.device) + problem_reasons(problem)
                + problem_table(problem)[1])

    def plan(self, problem: AttnProblem) -> "CupyPlan":
        return self._plans.get_or_create(problem.plan_key, lambda: CupyPlan(problem))


class CupyPlan:
    """Geometry table (uploaded once per device) and tile boxes of one ``plan_key``."""

    def __init__(self, problem: AttnProblem):
        table, reasons = problem_table(problem)
        if reasons:
            raise ValueError("; ".join(reasons))
        self.table = tuple(table)
        hood = problem.neighborhood
        rank = hood.ndim if hood is not None else 1
        self.boxes = fused.choose_tiles(self.table, rank)
        self.o_shape = ((problem.batch, problem.heads_q, problem.seq_q, problem.dim_v)
                        if problem.layout == "bhsd"
                        else (problem.batch, problem.seq_q, problem.heads_q, problem.dim_v))

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
                          self.boxes, problem.scale, problem.softcap or 0.0, rpb)
        return out, lse

    def backward(self, problem, inputs, out, lse, dout, dlse=None):
        """``(dq, dk, dv, None)`` from the forward's LSE; ``dlse`` (the gradient reaching the
        returned LSE) enters as ``delta = rowsum(dO * O) - dlse``."""
        q, k, v = inputs.q, inputs.k, inputs.v
        tok = functools.partial(self._tokens, problem)
        o_t, do_t = tok(out), tok(dout)
        delta = (do_t.float() * o_t.float()).sum(-1).transpose(1, 2).contiguous()  # [B, H, S]
        if dlse is not None:
            delta = (delta - dlse.to(torch.float32)).contiguous()
        lse = lse.to(torch.float32).contiguous()
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        fused.run_backward(tok(q), tok(k), tok(v), do_t, lse.transpose(1, 2),
                           delta.transpose(1, 2), tok(dq), tok(dk), tok(dv), self.table,
                           self.boxes, problem.scale, problem.softcap or 0.0)
        return dq, dk, dv, None
