"""How one chunk of queries meets one chunk of keys under a global band mask, and the engine
calls for such a pair (forward with its LSE, backward from the merged output's LSE).

A band is ``(left, right)`` as ``SlidingWindow`` (``-1`` unbounded; causal is ``(-1, 0)``; no
mask is ``(-1, -1)``), top-left aligned on global positions (queries and keys are the same
sequence). Query ``i`` and key ``j`` of chunks starting at ``q0`` and ``k0`` are visible iff
``q0 + i - left <= k0 + j <= q0 + i + right``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import execution
from ..api import attention
from ..model.masks import Causal, SlidingWindow
from ..rewrites.merging import merge_partials
from ..model.problem import AttnProblem
from ..model.inputs import Inputs

__all__ = ["HIDDEN", "pair_mask", "forward_pair", "backward_pair", "merge"]

HIDDEN = "hidden"


def pair_mask(band, q0: int, nq: int, k0: int, nk: int, dtype, device):
    """``HIDDEN``, ``None`` (all visible), a library mask, or (for offsets no mask object
    expresses) a ``[1, 1, nq, nk]`` additive 0/-inf bias."""
    left, right = band
    delta = q0 - k0
    if (right >= 0 and nq - 1 + delta + right < 0) or (left >= 0 and delta - left > nk - 1):
        return HIDDEN
    if (right < 0 or delta + right >= nk - 1) and (left < 0 or nq - 1 + delta - left <= 0):
        return None
    if delta == 0:
        return Causal() if band == (-1, 0) else SlidingWindow(left, right)
    if delta == nk - nq:
        return Causal("bottom_right") if band == (-1, 0) else \
            SlidingWindow(left, right, "bottom_right")
    i = torch.arange(nq, device=device)[:, None] + delta
    j = torch.arange(nk, device=device)[None, :]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= i - left
    if right >= 0:
        visible &= j <= i + right
    return torch.zeros(1, 1, nq, nk, dtype=dtype, device=device).masked_fill(~visible,
                                                                             float("-inf"))


def _split(mask):
    return (mask, None) if mask is None or not isinstance(mask, torch.Tensor) else (None, mask)


def forward_pair(q, k, v, mask, scale):
    """``(out, lse)`` of bshd chunks through the dispatcher (any engine that can run it)."""
    lib_mask, bias = _split(mask)
    return attention(q, k, v, mask=lib_mask, bias=bias, scale=scale, layout="bshd",
                     return_lse=True)


def backward_pair(q, k, v, mask, scale, out, lse, dout, dlse):
    """``(dq, dk, dv)`` of one pair from the *merged* ``out``/``lse`` of the query chunk: with
    the global LSE, ``p = exp(s - lse)`` is this pair's share of the global softmax, so the
    engine's backward gives exactly this pair's part of the gradients."""
    lib_mask, bias = _split(mask)
    problem = AttnProblem.from_tensors(q, k, v, mask=lib_mask, bias=bias, scale=scale,
                                       layout="bshd", return_lse=True)
    _, problem, plan = execution.plan_call(dataclasses.replace(problem, requires_grad=True))
    dq, dk, dv, _ = execution.backward(problem, plan, Inputs(q, k, v, bias), out, lse, dout, dlse)
    return dq, dk, dv


def merge(out_a, lse_a, out_b, lse_b):
    """Combine two partial results over disjoint key sets (bshd out, ``[B, H, S]`` lse)."""
    out, lse = merge_partials([out_a, out_b], [lse_a.transpose(1, 2), lse_b.transpose(1, 2)])
    return out, lse.transpose(1, 2).to(lse_a.dtype)
