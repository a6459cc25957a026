"""The float64 brute force the selftest holds every engine to, and the naive baseline.

Dense and unfused on purpose: scores for every (query, key) pair, the case's visibility as a
boolean matrix, one softmax. The visibility comes from the plain tuples of a :class:`Case`; only
the neighborhood rule is the library's own (``geometry``, checked against NATTEN's golden values
by the test suite) because it is the one rule of that shape in the project.

Called with ``dtype=torch.float64`` it is the oracle; with the inputs' dtype it is the naive
computation whose error sets the tolerance (FlashAttention's rule: an engine may be at most 2x
(forward) / 3x (backward) as far from the oracle as the naive computation is).
"""

from __future__ import annotations

import torch

from cudnn_attn.model import geometry
from cudnn_attn.model.masks import Alibi

from .cases import Case

__all__ = ["visibility", "aligned_rows", "additive_bias", "reference"]


def _lengths(case: Case, device) -> tuple[torch.Tensor, torch.Tensor]:
    lens = case.lengths
    if lens is None:
        return (torch.full((case.batch,), case.seq_q, device=device),
                torch.full((case.batch,), case.seq_kv, device=device))
    return torch.tensor(lens[0], device=device), torch.tensor(lens[1], device=device)


def aligned_rows(case: Case, alignment: str, device) -> torch.Tensor:
    """``[B, S_q, 1]`` aligned query positions ``i'`` (bottom-right: ``i + len_kv - len_q``)."""
    i = torch.arange(case.seq_q, device=device)[None, :, None]
    if alignment == "top_left":
        return i.expand(case.batch, -1, -1)
    lens_q, lens_kv = _lengths(case, device)
    return i + (lens_kv - lens_q)[:, None, None]


def visibility(case: Case, device="cpu") -> torch.Tensor:
    """``[B, S_q, S_kv]`` bool: the keys each query sees (the AND of the case's masks)."""
    j = torch.arange(case.seq_kv, device=device)[None, None, :]
    vis = torch.ones(case.batch, case.seq_q, case.seq_kv, dtype=torch.bool, device=device)
    for kind, *params in case.mask:
        if kind == "causal":
            vis &= j <= aligned_rows(case, params[0], device)
        elif kind == "window":
            left, right, alignment = params
            rows = aligned_rows(case, alignment, device)
            if left >= 0:
                vis &= j >= rows - left
            if right >= 0:
                vis &= j <= rows + right
        elif kind == "padding":
            lens_q, lens_kv = _lengths(case, device)
            i = torch.arange(case.seq_q, device=device)[None, :, None]
            vis &= (i < lens_q[:, None, None]) & (j < lens_kv[:, None, None])
        elif kind == "neighborhood":
            vis &= geometry.neighborhood_mask(*params).to(device)[None]
        else:
            raise ValueError(f"unknown mask kind {kind!r} in case {case.name}")
    return vis


def _alibi(case: Case, device) -> torch.Tensor:
    """``[B|1, H, S_q, S_kv]``: ``-slope_h * |i' - j|``, ``i'`` aligned like the case's band mask."""
    bands = case.masks_of("causal") + case.masks_of("window")
    alignment = bands[0][-1] if bands else "top_left"
    rows = aligned_rows(case, alignment, device).to(torch.float64)
    j = torch.arange(case.seq_kv, device=device, dtype=torch.float64)[None, None, :]
    slopes = Alibi().slope_table(case.batch, case.heads_q).to(device)
    return -slopes[:, :, None, None] * (rows - j).abs()[:, None]


def _rpb_index(case: Case, device) -> tuple[torch.Tensor, ...]:
    """Per axis, ``[S, S]`` indices into NATTEN's ``[H, 2k-1, ...]`` table for every pair."""
    _, shape, kernel, _, dilation, _ = case.masks_of("neighborhood")[0]
    coords = torch.stack(torch.unravel_index(torch.arange(case.seq_q, device=device), shape))
    index = []
    for axis, (k, d) in enumerate(zip(kernel, dilation)):
        offset = torch.div(coords[axis][None, :] - coords[axis][:, None], d,
                           rounding_mode="floor") + k - 1
        index.append(offset.clamp(0, 2 * k - 2))  # hidden pairs read any entry; they are masked
    return tuple(index)


def additive_bias(case: Case, bias: torch.Tensor | None, device) -> torch.Tensor | None:
    """What the case adds to the scores, broadcastable to ``[B, H, S_q, S_kv]`` (differentiable
    in ``bias``: the tensor bias itself, or the RPB table it indexes)."""
    if case.bias == "tensor":
        return bias
    if case.bias == "alibi":
        return _alibi(case, device)
    if case.bias == "rpb":
        return bias[(slice(None), *_rpb_index(case, device))][None]
    return None


def reference(case: Case, q, k, v, bias=None, *, scale: float, dtype=torch.float64):
    """``(out [B, H, S_q, D_v], lse [B, H, S_q])`` of bhsd inputs, computed in ``dtype``.

    Equivalent to the library's score pipeline: scale, softcap, bias, mask, softmax, ``p @ v``;
    rows that see nothing give ``out = 0`` and ``lse = -inf``.
    """
    q, k, v = (x.to(dtype) for x in (q, k, v))
    group = case.heads_q // case.heads_kv
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if case.softcap:
        s = case.softcap * torch.tanh(s / case.softcap)
    extra = additive_bias(case, bias, q.device)
    if extra is not None:
        s = s + extra.to(dtype)
    vis = visibility(case, q.device)[:, None]
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s, -1)
    empty = torch.isneginf(lse)[..., None]
    p = torch.exp(s - torch.where(empty, 0, lse[..., None]))
    return p.masked_fill(empty, 0) @ v, lse
