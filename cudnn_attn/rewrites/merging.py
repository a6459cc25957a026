"""Merging attention results over disjoint key sets through their log-sum-exps.

Attention over keys ``K_1 ∪ ... ∪ K_n`` is a weighted mean of the results over each ``K_i``::

    lse = log(sum_i exp(lse_i)),   out = sum_i exp(lse_i - lse) * out_i

Used by NATTEN's ``merge_attentions`` and additional keys, the context-parallel ring (one block of
keys per step) and attention sinks (a key with a zero value). Rows that see no key in any part
(every ``lse_i = -inf``) give ``out = 0`` and ``lse = -inf``; no NaN, in values or gradients.
"""

from __future__ import annotations

import torch

__all__ = ["merge_weights", "merge_partials"]


def merge_weights(lses):
    """``(weights, lse)``: each part's weight ``exp(lse_i - lse)`` (``lses`` broadcast to one
    shape) and the merged lse, in float32 (float64 if a part is float64). Differentiable."""
    acc = torch.float64 if any(l.dtype == torch.float64 for l in lses) else torch.float32
    stacked = torch.stack(torch.broadcast_tensors(*(l.to(acc) for l in lses)))
    # Shift by the (constant) row maximum for range; -inf parts get weight 0 and gradient 0.
    peak = stacked.detach().amax(0)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(stacked - peak)
    total = weights.sum(0)
    empty = total == 0
    safe = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), peak + torch.log(safe))
    return (weights / safe).unbind(0), lse


def merge_partials(outputs, lses):
    """``(out, lse)`` of the union of the parts: ``outputs[i]`` ``[..., D]`` with ``lses[i]`` of
    shape ``outputs[i].shape[:-1]``; out in ``outputs[0]``'s dtype."""
    weights, lse = merge_weights(lses)
    out = sum(w[..., None] * o.to(w.dtype) for w, o in zip(weights, outputs))
    return out.to(outputs[0].dtype), lse
