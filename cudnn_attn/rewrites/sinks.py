"""Attention sinks: one learned logit per query head that joins every row's softmax.

A sink is a key every query sees, with score ``sinks[h]`` and a value of zero (gpt-oss, cuDNN's
``sink_token``, FlashAttention's ``learnable_sink``)::

    p_ij   = exp(s_ij - lse_i),   lse_i = log(exp(sinks[h]) + sum_j exp(s_ij))
    out_i  = sum_j p_ij v_j       (the sink takes weight, adds nothing)

Every engine computes it exactly without knowing about sinks, because adding a zero-valued key is
a merge of two partial results: the engine's ``(out0, lse0)`` over the real keys and ``(0, sink)``
for the sink. So ``lse = logaddexp(lse0, sink)`` and ``out = out0 * exp(lse0 - lse)``; a row that
sees no key gets ``out = 0`` and ``lse = sink``.

The backward needs nothing new either: with the forward's ``out`` and ``lse`` (sink included, as
cuDNN's Stats), an engine's backward already sees the sink's share of each row. The sinks' own
gradient is ``dsink_h = sum_{b,i} p_sink_bhi * (dlse_bhi - rowsum(dout * out)_bhi)`` with
``p_sink = exp(sink - lse)``.
"""

from __future__ import annotations

import math

import torch

from ..model import checks
from .merging import merge_weights

__all__ = ["check_sinks", "merge_sinks", "sink_gradient"]


def check_sinks(sinks, heads_q: int, q: torch.Tensor) -> torch.Tensor:
    """``sinks`` as a ``[H_q]`` float tensor on ``q``'s device; cuDNN's ``[1, H_q, 1, 1]`` is
    accepted too. Raises ``TypeError``/``ValueError`` naming what is wrong."""
    sinks = checks.tensor("sinks", sinks, floating=True)
    if tuple(sinks.shape) not in ((heads_q,), (1, heads_q, 1, 1)):
        raise ValueError(f"sinks must have one logit per query head, shape [H_q] = [{heads_q}] "
                         f"(or [1, {heads_q}, 1, 1]), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")
    return sinks.reshape(heads_q)


def _per_row(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``[H_q]`` -> broadcastable against ``lse`` ``[B, H_q, S_q]``, in the lse's dtype."""
    return sinks.to(lse.dtype).view(1, -1, 1)


def _on_rows(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``[B, H, S]`` -> broadcastable against ``out`` in ``layout``."""
    return x[..., None] if layout == "bhsd" else x.transpose(1, 2)[..., None]


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, layout: str):
    """``(out, lse)`` of the call with ``sinks`` from the engine's ``(out0, lse0)`` without them.

    Differentiable (autograd gives the gradients of the formula above); ``out`` keeps its dtype.
    """
    weights, merged = merge_weights([lse, _per_row(sinks, lse)])
    return out * _on_rows(weights[0], layout).to(out.dtype), merged


def sink_gradient(out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, sinks: torch.Tensor,
                  layout: str, dlse=None) -> torch.Tensor:
    """``d loss / d sinks`` (``[H_q]``, in ``sinks``' dtype) from the forward's ``out`` and ``lse``
    (sink included) and the gradients reaching them."""
    acc = lse.dtype
    row = (dout.to(acc) * out.to(acc)).sum(-1)
    row = row if layout == "bhsd" else row.transpose(1, 2)
    if dlse is not None:
        row = row - dlse.to(acc)
    # -inf (a row that sees nothing, with a sink of -inf): exp(-inf - 0) = 0, not NaN.
    p_sink = torch.exp(_per_row(sinks, lse) - torch.where(lse == -math.inf, 0.0, lse))
    return -(p_sink * row).sum((0, 2)).to(sinks.dtype)
