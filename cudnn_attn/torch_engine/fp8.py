"""cuDNN's FP8 attention (``sdpa_fp8`` / ``sdpa_fp8_backward``), computed in PyTorch.

The quantization points are the ones the cuDNN frontend's FP8 graphs spell out
(``scaled_dot_product_flash_attention.h`` and ``sdpa_fp8_bwd.h``), in their order, with float32
compute (cuDNN's compute type) and every FP8 cast rounding to nearest even and **saturating**
(a value past the format's largest finite number becomes that number, as cuDNN's cast does;
torch's own cast gives inf for E5M2). Every amax is taken **before** the scale it precedes.
Tensors are ``[B, H, S, D]``; scales and descales float32 ``[1, 1, 1, 1]`` tensors.

Forward (the cuDNN frontend's own FP8 reference, ``test/python/sdpa/fp8_ref.py``: an online
softmax over blocks of ``KV_BLOCK`` keys, as the fused kernels run it)::

    S    = Q K^T * attn_scale * descale_q * descale_k, masked         (float32)
    per key block: m = the running row max, moved only when the block's max exceeds it by more
                   than a factor 2^RESCALE_LOG2 (seeded with the sink logit; o, l rescaled then)
        P~   = exp(S - m)                      (unnormalized, at most 2^RESCALE_LOG2)
        l   += rowsum(P~)                      (unquantized)
        o   += cast_q(P~ * scale_s * 2^-RESCALE_LOG2) V * descale_s * 2^RESCALE_LOG2 * descale_v
    O    = o / max(l, 1);   Stats = logsumexp(S) (sink logits join it)
    amax_s = amax(softmax(S));  amax_o = amax(O);   O8 = cast_o(O * scale_o)

P is quantized **before** normalization, relative to the running max: an FP8 code's rounding
depends on where a value sits between two powers of two, so quantizing the normalized P instead
moves O by up to a step of the format (E5M2: ``amax_o`` 3 % off cuDNN's on an H200, issue 36).

Backward (``P`` recomputed from ``Stats``, normalized, as the frontend's reference does)::

    D    = rowsum(dO * O) * descale_dO * descale_o
    dV   = (cast_q(P * scale_s)^T dO) * descale_s * descale_dO
    dS   = (dO V^T * descale_dO * descale_v - D) * P * attn_scale
    amax_dP = amax(dS);           dS8 = cast_dO(dS * scale_dP)
    dQ   = (dS8 K) * descale_dP * descale_k;   dK = (dS8^T Q) * descale_dP * descale_q
    amax_dX = amax(dX);           dX8 = cast_grad(dX * scale_dX)

``cast_q`` is to the inputs' type (E5M2 P for E5M2 inputs), ``cast_dO`` to dO's (the frontend's
graph, ``sdpa_fp8_bwd.h``); an H200 with cuDNN 9.19 agrees for E4M3, E5M2 and the hybrid form
(E4M3 inputs, E5M2 dO): 95-99.8 % of its gradient codes equal this pipeline's, 7-77 % with
any other choice of the two types (issue 36). The rest are dS / P values within ~1e-3 of a
rounding midpoint that cuDNN's float32 arithmetic rounds the other way; an E5M2 code step is a
quarter, so a few such elements exceed NVIDIA's rtol 0.2 (``tests/fp8_reference.py``'s
``assert_fp8_grad_close`` allows for them). The tests compare this module with independent
float64 transcriptions of the frontend's semantics (``tests/fp8_reference.py``,
``tests/engines/test_fp8_pipeline.py``) and, on a GPU, with cuDNN.
"""

from __future__ import annotations

import math

import torch

from ..model.masks import Padding, mask_parts
from .tiles import Visibility

__all__ = ["FP8_DTYPES", "KV_BLOCK", "RESCALE_LOG2", "fp8_max", "saturating_cast", "visibility",
           "fp8_forward", "fp8_backward"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The key block of the online softmax and its lazy-rescale threshold (log2 units): the values of
# the cuDNN frontend's FP8 reference and of its tests.
KV_BLOCK = 128
RESCALE_LOG2 = 4.0


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(dtype).max)


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to nearest even in ``dtype``; FP8 saturates at its largest finite value
    (NaN stays NaN). Other dtypes are a plain cast."""
    if dtype in FP8_DTYPES:
        top = fp8_max(dtype)
        x = x.clamp(-top, top)
    return x.to(dtype)


def visibility(mask, batch: int, seq_q: int, seq_kv: int, device):
    """``(visible [B|1, 1, S_q, S_kv] bool or None, live_rows [B, 1, S_q, 1] bool or None)``:
    the keys each query sees under ``mask`` (causal / window / padding parts), and the query rows
    that are tokens (padding's ``i < seq_len_q``)."""
    parts = mask_parts(mask)
    padding = next((m for m in parts if isinstance(m, Padding)), None)
    rules = Visibility(parts, seq_q, seq_kv)
    qi = torch.arange(seq_q, device=device).view(1, 1, -1, 1)
    kj = torch.arange(seq_kv, device=device).view(1, 1, 1, -1)
    visible = rules.lines(qi, kj, padding)
    live = None
    if padding is not None:
        lens_q, lens_kv = (t.view(-1, 1, 1, 1) for t in padding.tensors(device))
        live = qi < lens_q
        keys = (kj < lens_kv) & live
        visible = keys if visible is None else visible & keys
    return visible, live


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x if h == heads else x.view(b, heads, h // heads, s, d).sum(2)


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax().reshape(1, 1, 1, 1).float() if x.numel() else x.new_zeros(1, 1, 1, 1)


def _scores(q, k, attn_scale, descale_q, descale_k, visible):
    """Masked float32 scores in the graph's order: matmul, attn_scale, descale_q, descale_k."""
    s = q.float() @ _repeat_heads(k, q.shape[1]).float().transpose(-1, -2)
    s = s * attn_scale * descale_q * descale_k
    return s if visible is None else s.masked_fill(~visible, float("-inf"))


def _probabilities(s, lse):
    """``exp(S - lse)``, 0 where a key is hidden or the row sees nothing (``lse = -inf``)."""
    p = torch.exp(s - lse)
    return torch.where(torch.isfinite(lse) & torch.isfinite(s), p, torch.zeros_like(p))


def _lse(s, sinks, live):
    """Natural-log logsumexp over the keys (and the sink logit); ``-inf`` for rows with nothing
    to see and for padded rows (a padded row is not a token, even with a sink)."""
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        s = torch.cat([s, sink], dim=-1)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    if live is not None:
        lse = lse.masked_fill(~live, float("-inf"))
    return lse


def _blocked_pv(s, v, scale_s, descale_s, p_dtype, sinks, live):
    """``softmax(S) V`` as the fused kernels compute it (module doc): per block of ``KV_BLOCK``
    keys, the unnormalized ``exp(S - m)`` is cast to ``p_dtype`` at ``scale_s * 2^-RESCALE_LOG2``
    and accumulated; the sum of the unquantized values normalizes at the end."""
    threshold = RESCALE_LOG2 * math.log(2.0)
    shape = s.shape[:3] + (1,)
    if sinks is None:
        m = s.new_full(shape, -math.inf)
        l = s.new_zeros(shape)
    else:  # the sink seeds the running max and the sum (exp(sink - sink) = 1)
        m = sinks.float().view(1, -1, 1, 1).expand(shape).clone()
        l = s.new_ones(shape)
    o = s.new_zeros(s.shape[:3] + (v.shape[-1],))
    for start in range(0, s.shape[-1], KV_BLOCK):
        block = s[..., start:start + KV_BLOCK]
        block_max = block.amax(dim=-1, keepdim=True)
        m_new = torch.where(torch.isneginf(m) | (block_max - m > threshold), block_max, m)
        step = m - m_new  # NaN while both are -inf: nothing to rescale yet
        rescale = torch.where(step < -threshold, torch.exp(step), torch.ones_like(step))
        o, l = o * rescale, l * rescale
        p = torch.exp(block - m_new).nan_to_num(nan=0.0)
        if live is not None:
            p = p.masked_fill(~live, 0.0)
        l = l + p.sum(dim=-1, keepdim=True)
        codes = saturating_cast(p * (scale_s * 2.0 ** -RESCALE_LOG2), p_dtype).float()
        o = o + (codes @ v[:, :, start:start + KV_BLOCK]) * (descale_s * 2.0 ** RESCALE_LOG2)
        m = m_new
    return o / l.clamp(min=1.0)


def fp8_forward(q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, *,
                attn_scale: float, visible=None, live=None, sinks=None,
                o_dtype: torch.dtype | None = None):
    """``(o, stats [B, H, S_q, 1] float32, amax_s, amax_o)`` of cuDNN's FP8 forward (module doc).
    ``o`` is in ``o_dtype`` (default q's FP8 type); the amaxes are float32 ``[1, 1, 1, 1]``."""
    s = _scores(q, k, attn_scale, descale_q, descale_k, visible)
    lse = _lse(s, sinks, live)
    amax_s = _amax(_probabilities(s, lse))
    o = _blocked_pv(s, _repeat_heads(v, q.shape[1]).float(), scale_s, descale_s, q.dtype, sinks,
                    live) * descale_v
    amax_o = _amax(o)
    o_out = saturating_cast(o * scale_o, o_dtype or q.dtype)
    return o_out, lse, amax_s, amax_o


def fp8_backward(q, k, v, o, dO, stats, descale_q, descale_k, descale_v, descale_o, descale_dO,
                 descale_s, descale_dP, scale_s, scale_dQ, scale_dK, scale_dV, scale_dP, *,
                 attn_scale: float, visible=None, live=None, sinks=None,
                 grad_dtype: torch.dtype | None = None):
    """``(dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dP, dsink)`` of cuDNN's FP8 backward
    (module doc); ``dsink`` is ``[1, H_q, 1, 1]`` float32 with ``sinks``, else ``None``. The
    gradients are in ``grad_dtype`` (default dO's FP8 type) and have k's and v's head counts."""
    heads = q.shape[1]
    s = _scores(q, k, attn_scale, descale_q, descale_k, visible)
    lse = stats.float().reshape(s.shape[0], heads, s.shape[2], 1)
    p = _probabilities(s, lse)
    if live is not None:
        p = p.masked_fill(~live, 0.0)
    dOf = dO.float()
    delta = (dOf * o.float()).sum(-1, keepdim=True) * descale_dO * descale_o
    p8 = saturating_cast(p * scale_s, q.dtype).float()
    dv = _sum_heads((p8.transpose(-1, -2) @ dOf) * descale_s * descale_dO, v.shape[1])
    dp = (dOf @ _repeat_heads(v, heads).float().transpose(-1, -2)) * descale_dO * descale_v
    ds = (dp - delta) * p * attn_scale
    amax_dp = _amax(ds)
    ds8 = saturating_cast(ds * scale_dP, dO.dtype).float()
    dq = (ds8 @ _repeat_heads(k, heads).float()) * descale_dP * descale_k
    dk = _sum_heads((ds8.transpose(-1, -2) @ q.float()) * descale_dP * descale_q, k.shape[1])
    dtype = grad_dtype or dO.dtype
    grads, amaxes = [], []
    for g, scale in ((dq, scale_dQ), (dk, scale_dK), (dv, scale_dV)):
        amaxes.append(_amax(g))
        grads.append(saturating_cast(g * scale, dtype))
    dsink = None
    if sinks is not None:  # d lse / d sink = exp(sink - lse); d loss / d lse = -D per row
        p_sink = torch.exp(sinks.float().view(1, -1, 1, 1) - lse)
        p_sink = torch.where(torch.isfinite(lse), p_sink, torch.zeros_like(p_sink))
        dsink = -(p_sink * delta).sum(dim=(0, 2), keepdim=True)
    return (*grads, *amaxes, amax_dp, dsink)
