"""Packed self-attention (one offsets tensor for queries and keys) as one runner bound once per
kept call signature: the direct path of cuDNN's ragged graphs.

Why: ``flash_attn_varlen_func`` in training -- self-attention over packed sequences, the same
``cu_seqlens`` for both sides -- spent about 110 us of host time per forward on the CPU
stand-in (``benchmarks/cudnn_host.py``), ten times a dense call: it rebuilt per call what its
kept signature (``packed.prepared``) already fixes (a problem with its ``Padding`` and
``Ragged`` storage, the plan's buffer dict, their checks). ``RaggedCall`` makes only what the
call's offsets determine -- the lengths (one subtraction) and the five element offsets (one
product) -- and the outputs, then binds and launches.

The results are the full path's (``CudnnPlan.forward`` / ``backward`` with
``_runtime.PAST_THE_END``): tokens past the last sequence get out 0 and stats ``-inf``, and
zero gradients (cuDNN writes none of them). No token of a sequence lacks keys: with shared
offsets each sequence has as many keys as queries, and the masks the native route takes
(causal, sliding windows) keep the diagonal. So the stats the backward reads (only those of
tokens inside sequences) are finite as the forward wrote them.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from . import _runtime
from .launch import aligned_inputs, execute, execute_backward
from ._emit import UID
from ..core.autograd_node import record_direct

__all__ = ["RaggedCall", "Offsets"]

_Q, _K, _V, _O, _SCALE, _STATS = (int(UID.Q), int(UID.K), int(UID.V), int(UID.O),
                                  int(UID.SCALE), int(UID.STATS))
_SEQ_LEN_Q, _SEQ_LEN_KV = int(UID.SEQ_LEN_Q), int(UID.SEQ_LEN_KV)


class Offsets(NamedTuple):
    """What one call's offsets give its graphs: the ``[B, 1, 1, 1]`` int32 lengths (both sides)
    and the ragged element offsets (``{uid: [B + 1, 1, 1, 1] int32}``). The backward binds the
    forward's."""

    lengths: torch.Tensor
    ragged: dict


class RaggedCall:
    """``(q, k, v, cu_seqlens_q, cu_seqlens_k) -> out`` of a kept varlen signature whose graphs
    bind q, k, v, the scale, the lengths and ragged offsets of one offsets tensor, and out (with
    the stats and gradients of the backward): no bias, dropout, returned lse or sign-carrying
    scale.
    ``CudnnPlan.storage_direct`` decides which signatures qualify; ``__call__`` answers ``None``
    (the caller takes the full path) for a call it cannot take as it lies: other offsets for
    the keys, offsets on another device, or grad mode off where the signature requires grad.
    ``forward``: the forward graph (with stats when ``backward`` is given); ``per_token``: the
    elements per token of Q, O, Stats, K and V (``_runtime.ragged_offsets_of``)."""

    __slots__ = ("forward", "backward", "device", "scale", "batch", "heads_q", "dim_v",
                 "per_token")

    def __init__(self, spec, forward, backward, scale: torch.Tensor, device: torch.device):
        self.forward, self.backward = forward, backward
        self.device, self.scale = device, scale
        self.batch, self.heads_q, self.dim_v = spec.batch, spec.heads_q, spec.dim_v
        self.per_token = (spec.heads_q * spec.dim_qk, spec.heads_q * spec.dim_v, spec.heads_q,
                          spec.heads_kv * spec.dim_qk, spec.heads_kv * spec.dim_v)

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k) -> Optional[torch.Tensor]:
        if cu_seqlens_k is not cu_seqlens_q or cu_seqlens_q.device != q.device:
            return None
        grad = self.backward is not None
        if grad and not torch.is_grad_enabled():
            return None
        call = self._offsets(cu_seqlens_q)
        if grad:
            return record_direct(self, q, k, v, call)
        out = self._new_out(q)
        execute(self.forward, self._bind(q, k, v, out, call), self.device)
        return out

    def _offsets(self, cu: torch.Tensor) -> Offsets:
        lengths = _runtime.int32_column(torch.diff(cu), (self.batch, 1, 1, 1))
        return Offsets(lengths, _runtime.ragged_offsets_of(self.batch, self.per_token, cu, cu))

    def _new_out(self, q: torch.Tensor) -> torch.Tensor:
        """Zeros (no token past the last sequence is written), ``[total_q, H_q, D_v]``."""
        if q.shape[2] == self.dim_v:
            return torch.zeros_like(q)
        return q.new_zeros((q.shape[0], self.heads_q, self.dim_v))

    def _bind(self, q, k, v, out, call: Offsets) -> dict:
        q, k, v = aligned_inputs(q, k, v)
        buffers = {_Q: q, _K: k, _V: v, _SCALE: self.scale, _O: out,
                   _SEQ_LEN_Q: call.lengths, _SEQ_LEN_KV: call.lengths}
        buffers.update(call.ragged)
        return buffers

    # -- the autograd node's two halves (core.autograd_node.record_direct) ----------------------
    def record(self, q, k, v, call: Offsets) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, stats)`` of the forward with stats (``[total_q, H_q, 1]`` fp32)."""
        out = self._new_out(q)
        stats = torch.full((q.shape[0], self.heads_q, 1), -math.inf, dtype=torch.float32,
                           device=q.device)
        buffers = self._bind(q, k, v, out, call)
        buffers[_STATS] = stats
        execute(self.forward, buffers, self.device)
        return out, stats

    def gradients(self, q, k, v, call: Offsets, out, stats, dout) -> tuple:
        """``(dq, dk, dv)``: zeros where no sequence reaches, cuDNN's elsewhere."""
        return execute_backward(self.backward, self._bind(q, k, v, out, call), dout, stats,
                                _zeroed_like(q, k, v), self.device)


def _zeroed_like(q, k, v) -> tuple:
    """Zeroed gradients shaped like q, k and v (contiguous): one fill when all three share a
    shape and dtype, three otherwise."""
    if q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype:
        return tuple(q.new_zeros((3, *q.shape)).unbind(0))
    return tuple(torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
