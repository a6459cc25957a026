"""``context_parallel_attention``: attention over a sequence sharded across ranks."""

from __future__ import annotations

from typing import Any

import torch

from .. import _checks
from ..masks import Causal, SlidingWindow
from .ring import RingAttention, Schedule
from .sharding import SHARDINGS, all_lengths, world

__all__ = ["context_parallel_attention"]


def _band(mask) -> tuple[int, int]:
    """``(left, right)`` of the supported global masks (top-left: one sequence, S_q = S_kv, so
    both alignments coincide)."""
    if mask is None:
        return (-1, -1)
    if isinstance(mask, Causal):
        return (-1, 0)
    if isinstance(mask, SlidingWindow):
        return (mask.left, mask.right)
    raise ValueError(f"mask must be None, Causal() or SlidingWindow(left, right) for context "
                     f"parallelism, got {mask!r}")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: Any = None,
                               mask: Any = None, scale: float | None = None, layout: str = "bshd",
                               sharding: str = "zigzag", return_lse: bool = False) -> Any:
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
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(name, t, ndim=4)
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"layout must be 'bshd' or 'bhsd', got {layout!r}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    _checks.flag("return_lse", return_lse)
    if layout == "bhsd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"q, k and v must hold the same positions of the sequence, got "
                         f"{q.shape[1]}, {k.shape[1]} and {v.shape[1]}")
    scale = _checks.softmax_scale("scale", scale, q.shape[-1])
    rank, size = world(group)
    length = sum(all_lengths(q.shape[1], group, q.device))
    schedule = Schedule(length, size, sharding, _band(mask), rank)
    expected = schedule.rows(rank)
    if q.shape[1] != expected:
        raise ValueError(f"rank {rank} holds {q.shape[1]} positions but sharding={sharding!r} "
                         f"of {length} positions over {size} ranks gives it {expected}")
    out, lse = RingAttention.apply(q, k, v, schedule, scale, group)
    if layout == "bhsd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
