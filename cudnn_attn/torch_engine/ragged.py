"""Packed (``Ragged``) calls on the torch engine, the engine of last resort for every varlen call.

The packed ``[total, H, D]`` tensors are scattered into one zero-padded ``bshd`` batch of the
problem's bounds (``S_q``, ``S_kv``), the dense plan runs it with the problem's ``Padding``, and
the results are gathered back in the packed engines' convention: out ``[total_q, H, D_v]``, lse
``[H, total_q]``, gradients packed as their inputs. Token positions come from ``cu_seqlens`` on
the device (no host read). A dropout mask is drawn over that padded batch by the forward and
redrawn by the backward of the same problem, so both directions of a packed call agree.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..model.inputs import Inputs, hide_padding
from ..model.problem import AttnProblem, TensorSpec

__all__ = ["RaggedPlan", "dense_problem"]


def dense_problem(problem: AttnProblem) -> AttnProblem:
    """``problem`` (packed, ``bshd``) as the contiguous padded batch of its bounds."""
    b, s_q, s_kv = problem.batch, problem.seq_q, problem.seq_kv

    def spec(seq: int, heads: int, dim: int) -> TensorSpec:
        return TensorSpec((b, seq, heads, dim), (seq * heads * dim, heads * dim, dim, 1),
                          problem.dtype)

    return dataclasses.replace(problem, storage=None, layout="bshd",
                               q=spec(s_q, problem.heads_q, problem.dim_qk),
                               k=spec(s_kv, problem.heads_kv, problem.dim_qk),
                               v=spec(s_kv, problem.heads_kv, problem.dim_v))


def _slots(cu: torch.Tensor, total: int, seq: int, device) -> torch.Tensor:
    """Row of each packed token in the padded ``[B * seq]`` rows; a token past ``seq`` (none
    in a well-formed call) goes to the spare row ``B * seq``."""
    cu = cu.to(device, torch.int64, non_blocking=True)
    batch = cu.shape[0] - 1
    token = torch.arange(total, device=device)
    b = torch.searchsorted(cu[1:], token, right=True).clamp_(max=max(batch - 1, 0))
    pos = token - cu[b]
    return torch.where(pos < seq, b * seq + pos, batch * seq)


def _scatter(x: torch.Tensor, slots: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    rows = x.new_zeros(batch * seq + 1, *x.shape[1:])
    rows.index_copy_(0, slots, x)
    return rows[:-1].view(batch, seq, *x.shape[1:])


def _gather(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, *x.shape[2:])
    return torch.cat([rows, rows.new_zeros(1, *rows.shape[1:])]).index_select(0, slots)


def _lse_packed(lse: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``[B, H, S]`` -> ``[H, total]``."""
    heads = lse.shape[1]
    flat = lse.permute(1, 0, 2).reshape(heads, -1)
    return torch.cat([flat, flat.new_zeros(heads, 1)], dim=1).index_select(1, slots)


def _lse_padded(lse: torch.Tensor, slots: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """``[H, total]`` -> ``[B, H, S]`` (rows past a length hold 0: the ``Padding`` hides them)."""
    heads = lse.shape[0]
    flat = lse.new_zeros(heads, batch * seq + 1)
    flat.index_copy_(1, slots, lse)
    return flat[:, :-1].view(heads, batch, seq).permute(1, 0, 2)


class RaggedPlan:
    """The torch engine's plan of a packed problem: its padded batch's plan, and the moves."""

    def __init__(self, backend, problem: AttnProblem):
        self.backend = backend
        self.dense = backend.plan(dense_problem(problem))

    def direct(self, problem: AttnProblem):
        return None  # the moves in and out are part of every call

    def _dense_call(self, problem: AttnProblem, inputs: Inputs):
        storage = problem.storage
        dense = dense_problem(problem)
        b, device = problem.batch, inputs.q.device
        slots_q = _slots(storage.cu_seqlens_q, inputs.q.shape[0], problem.seq_q, device)
        slots_k = _slots(storage.cu_seqlens_k, inputs.k.shape[0], problem.seq_kv, device)
        moved = Inputs(_scatter(inputs.q, slots_q, b, problem.seq_q),
                       _scatter(inputs.k, slots_k, b, problem.seq_kv),
                       _scatter(inputs.v, slots_k, b, problem.seq_kv),
                       inputs.bias, inputs.dropout, inputs.dropout_mask)
        return dense, hide_padding(dense, moved), slots_q, slots_k

    def forward(self, problem: AttnProblem, inputs: Inputs, need_lse: bool = True,
                row_stats: Optional[dict] = None, weights: Optional[dict] = None):
        """``(out [total_q, H, D_v], lse [H, total_q])``; ``row_stats`` / ``weights`` as the
        dense plan gives them (``[B, H, S_q, ...]``, the padded batch)."""
        dense, moved, slots_q, _ = self._dense_call(problem, inputs)
        out, lse = self.dense.forward(dense, moved, need_lse=need_lse, row_stats=row_stats,
                                      weights=weights)
        return _gather(out, slots_q), None if lse is None else _lse_packed(lse, slots_q)

    def backward(self, problem: AttnProblem, inputs: Inputs, out, lse, dout, dlse=None):
        """``(dq, dk, dv, dbias)`` packed as ``q``, ``k``, ``v`` (dbias as the dense plan's)."""
        dense, moved, slots_q, slots_k = self._dense_call(problem, inputs)
        b, s_q = problem.batch, problem.seq_q
        dq, dk, dv, dbias = self.dense.backward(
            dense, moved, _scatter(out, slots_q, b, s_q), _lse_padded(lse, slots_q, b, s_q),
            _scatter(dout, slots_q, b, s_q),
            None if dlse is None else _lse_padded(dlse, slots_q, b, s_q))
        return _gather(dq, slots_q), _gather(dk, slots_k), _gather(dv, slots_k), dbias
