"""``context_parallel_attention``: attention over a sequence sharded across ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..model import checks
from ..model.masks import Causal, Mask, SlidingWindow, band_of
from ..model.problem import AttnProblem
from .agreement import (DTYPE, agreed_lengths, choice, encode_choice,
                        encode_dtype, encode_real, integers, real)
from .ring import RingAttention, Schedule
from .sharding import SHARDINGS, check_shard_lengths, world

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["context_parallel_attention"]

LAYOUTS = ("bshd", "bhsd")
# What every rank must pass alike (checked in the length all-gather, see agreement.py).
_SHARED = (integers("batch size B"), integers("query heads H_q"), integers("key/value heads H_kv"),
           integers("head dim D"), integers("value head dim D_v"), DTYPE, choice("layout", LAYOUTS),
           choice("sharding", SHARDINGS), integers("mask band (left, right)", 2), real("scale"))


def _band(mask) -> tuple[int, int]:
    """``(left, right)`` of the supported global masks (top-left: one sequence, S_q = S_kv, so
    both alignments coincide)."""
    if mask is None:
        return (-1, -1)
    if isinstance(mask, (Causal, SlidingWindow)):
        band = band_of(mask)
        assert band is not None  # a Causal or SlidingWindow mask is one band
        return (band.left, band.right)
    raise ValueError(f"mask must be None, Causal() or SlidingWindow(left, right) for context "
                     f"parallelism, got {mask!r}")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                               group: ProcessGroup | None = None, mask: Mask | None = None,
                               scale: float | None = None, layout: str = "bshd",
                               sharding: str = "zigzag", return_lse: bool = False,
                               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over a sequence split across the ranks of ``group`` (ring attention).

    Each rank passes its shard of the sequence axis (``shard_sequence`` makes them): ``q``
    ``[B, S_local, H_q, D]``, ``k`` ``[B, S_local, H_kv, D]``, ``v`` ``[B, S_local, H_kv, D_v]``
    (``layout="bshd"``; ``"bhsd"`` puts heads before the sequence), ``H_q % H_kv == 0``. Key/value
    blocks travel around the ranks with ``torch.distributed`` point-to-point ops, overlapped with
    the compute of the block in hand; every block runs through the normal dispatcher (cuDNN,
    CuPy or torch); partial results merge through their log-sum-exp. Blocks the mask hides
    entirely are neither computed nor, where the schedule allows, sent. The backward is a ring
    too (dK/dV travel back to their owners).

    Args:
        mask: None, ``Causal()`` or ``SlidingWindow(left, right)`` on global positions.
        sharding: ``"zigzag"`` (rank r holds chunks r and 2W-1-r of 2W: balanced causal work) or
            ``"contiguous"`` (rank r holds block r); must match how the shards were made.
        return_lse: also return this rank's ``[B, H_q, S_local]`` log-sum-exp (float32; float64
            for float64 inputs).

    Returns:
        this rank's shard of the output (same layout), or ``(out, lse)``.

    Equivalent PyTorch (on the gathered sequence)::

        full = attention(unshard(q), unshard(k), unshard(v), mask=mask, layout="bshd")
        out = shard_sequence(full, sharding)
    """
    rank, size = world(group)
    local: dict = {}

    def validate():
        # Everything a rank can get wrong on its own, before the gather (agreement module doc).
        for name, t in (("q", q), ("k", k), ("v", v)):
            checks.tensor(name, t, ndim=4)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
        if sharding not in SHARDINGS:
            raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
        checks.flag("return_lse", return_lse)
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v)) if layout == "bhsd" else (q, k, v)
        if ks.shape[1] != qs.shape[1] or vs.shape[1] != qs.shape[1]:
            raise ValueError(f"q, k and v must hold the same positions of the sequence, got "
                             f"{qs.shape[1]}, {ks.shape[1]} and {vs.shape[1]}")
        # The local shards as one problem: dtypes, devices, heads, head dims, scale range (an
        # empty shard, which a problem refuses, as one position on the meta device).
        probe = (qs, ks, vs) if qs.shape[1] else tuple(
            torch.empty(t.shape[0], 1, *t.shape[2:], dtype=t.dtype, device="meta")
            for t in (qs, ks, vs))
        problem = AttnProblem.from_tensors(*probe, scale=scale, layout="bshd")
        local.update(tensors=(qs, ks, vs), band=_band(mask), scale=problem.scale)
        return qs.shape[1], (problem.batch, problem.heads_q, problem.heads_kv, problem.dim_qk,
                             problem.dim_v, encode_dtype(problem.dtype),
                             encode_choice(layout, LAYOUTS), encode_choice(sharding, SHARDINGS),
                             *local["band"], encode_real(problem.scale))

    lengths = agreed_lengths("context_parallel_attention", group, q, _SHARED, validate)
    q, k, v = local["tensors"]
    length = sum(lengths)
    schedule = Schedule(length, size, sharding, local["band"], rank)
    check_shard_lengths("context_parallel_attention", lengths, sharding)
    scale = local["scale"]
    out, lse = RingAttention.apply(q, k, v, schedule, scale, group)
    if layout == "bhsd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
