"""An independent float64 reference of cuDNN's FP8 attention (the frontend's ``sdpa_fp8`` /
``sdpa_fp8_backward``), written from the semantics the cuDNN frontend publishes in its own FP8
test reference (``test/python/sdpa/fp8_ref.py``: the forward's online softmax over blocks of 128
keys quantizes the unnormalized probabilities against the running row maximum, moved only past
a factor 2**4; the backward quantizes the normalized P recomputed from the stats), one query row
at a time, not from the engine's code.

FP8 rounding is done here by arithmetic (round half to even on the format's grid, saturating at
its largest finite value), not by torch's casts; masks are spelled out per (batch, row, key) in
cuDNN's band convention (left bound exclusive, right bound inclusive, bottom-right diagonal at
``S_kv - S_q`` of each sequence's lengths)."""

from __future__ import annotations

import math

import torch

# (mantissa bits, smallest normal exponent, largest finite value)
FORMATS = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 ``x`` rounded half-to-even onto ``dtype``'s grid, saturating; float64 result."""
    mbits, emin, top = FORMATS[dtype]
    x = x.double()
    mag = x.abs()
    exp = torch.floor(torch.log2(torch.where(mag > 0, mag, torch.ones_like(mag))))
    exp = torch.clamp(exp, min=emin)
    ulp = torch.pow(2.0, exp - mbits)
    r = torch.round(x / ulp) * ulp   # torch.round is half-to-even
    r = torch.clamp(r, -top, top)
    return torch.where(torch.isnan(x), x, r)


def band_visible(b_lens_q, b_lens_kv, seq_q, seq_kv, alignment="top_left", left=None,
                 right=None):
    """``[B, 1, S_q, S_kv]`` bool: key ``j`` visible from query ``i`` of batch ``b``."""
    batch = len(b_lens_q)
    vis = torch.zeros(batch, 1, seq_q, seq_kv, dtype=torch.bool)
    for b in range(batch):
        lq, lkv = b_lens_q[b], b_lens_kv[b]
        shift = lkv - lq if alignment == "bottom_right" else 0
        for i in range(lq):
            for j in range(lkv):
                ok = True
                if right is not None and j > i + shift + right:
                    ok = False
                if left is not None and j <= i + shift - left:
                    ok = False
                vis[b, 0, i, j] = ok
    return vis


def _group(h, heads_q, heads_kv):
    return h // (heads_q // heads_kv)


# The cuDNN frontend's FP8 reference (test/python/sdpa/fp8_ref.py, fp16_ref.py): keys in blocks
# of 128, a running max that moves only past a factor 2**4 (its tests' rescale threshold).
KEY_BLOCK, RESCALE_LOG2 = 128, 4.0


def _row_output(s_row, v_rows, sink, sc, p_dtype):
    """One query row as the frontend's blocked FP8 forward computes it: ``(O row, amax-free)``.
    ``s_row`` float64 scores (``-inf`` where hidden), ``v_rows`` ``[S_kv, D_v]``."""
    threshold = RESCALE_LOG2 * math.log(2.0)
    m = -math.inf if sink is None else float(sink)
    total = 0.0 if sink is None else 1.0
    acc = torch.zeros(v_rows.shape[1], dtype=torch.float64)
    for start in range(0, s_row.shape[0], KEY_BLOCK):
        block = s_row[start:start + KEY_BLOCK]
        block_max = float(block.max())
        if m == -math.inf or block_max - m > threshold:
            if m != -math.inf:  # rescale what was accumulated against the old maximum
                acc, total = acc * math.exp(m - block_max), total * math.exp(m - block_max)
            m = block_max
        if m == -math.inf:
            continue  # nothing visible yet
        p = torch.exp(block - m)  # unnormalized; hidden keys give exp(-inf) = 0
        total += float(p.sum())
        codes = quantize(p * sc["scale_s"] * 2.0 ** -RESCALE_LOG2, p_dtype)
        acc = acc + codes @ v_rows[start:start + KEY_BLOCK] * sc["descale_s"] \
            * 2.0 ** RESCALE_LOG2 * sc["descale_v"]
    return acc / max(total, 1.0)


def reference_forward(q8, k8, v8, sc, attn_scale, visible, lens_q, sinks=None, o_dtype=None):
    """``(o as float64 codes (quantized values), stats, amax_s, amax_o)``; ``sc`` maps cuDNN's
    scale names to floats. P is quantized unnormalized, block by block, against the running row
    maximum (the frontend's ``compute_ref``); ``amax_s`` is the normalized softmax's maximum."""
    B, Hq, Sq, _ = q8.shape
    Hk, Hv, Dv = k8.shape[1], v8.shape[1], v8.shape[3]
    q, k, v = (t.double() for t in (q8, k8, v8))
    o = torch.zeros(B, Hq, Sq, Dv, dtype=torch.float64)
    stats = torch.full((B, Hq, Sq, 1), -math.inf, dtype=torch.float64)
    amax_s = torch.zeros((), dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            s = q[b, h] @ k[b, _group(h, Hq, Hk)].T * attn_scale * sc["descale_q"] \
                * sc["descale_k"]
            s = s.masked_fill(~visible[b, 0], -math.inf)
            sink = None if sinks is None else sinks[h].double()
            for i in range(lens_q[b]):
                row = s[i] if sink is None else torch.cat([s[i], sink.view(1)])
                if row.max() == -math.inf:
                    continue
                lse = torch.logsumexp(row, 0)
                stats[b, h, i, 0] = lse
                amax_s = torch.maximum(amax_s, torch.exp(s[i] - lse).max())
                o[b, h, i] = _row_output(s[i], v[b, _group(h, Hq, Hv)], sink, sc, q8.dtype)
    amax_o = o.abs().max()
    o_dtype = o_dtype or q8.dtype
    if o_dtype not in FORMATS:  # a 16-bit O: one rounding of O * scale_o, no FP8 cast
        return (o * sc["scale_o"]).to(o_dtype).double(), stats, amax_s, amax_o
    return quantize(o * sc["scale_o"], o_dtype), stats, amax_s, amax_o


def reference_backward(q8, k8, v8, o8, dO8, stats, sc, attn_scale, visible, lens_q, sinks=None,
                       grad_dtype=None):
    """``(dq, dk, dv as float64 codes, amax_dq, amax_dk, amax_dv, amax_dP, dsink)``."""
    B, Hq, Sq, D = q8.shape
    Hk, Hv, Skv, Dv = k8.shape[1], v8.shape[1], k8.shape[2], v8.shape[3]
    q, k, v, o, dO = (t.double() for t in (q8, k8, v8, o8, dO8))
    dq = torch.zeros(B, Hq, Sq, D, dtype=torch.float64)
    dk = torch.zeros(B, Hk, Skv, D, dtype=torch.float64)
    dv = torch.zeros(B, Hv, Skv, Dv, dtype=torch.float64)
    ds_all = torch.zeros(B, Hq, Sq, Skv, dtype=torch.float64)
    dsink = torch.zeros(1, Hq, 1, 1, dtype=torch.float64)
    grad_dtype = grad_dtype or dO8.dtype
    for b in range(B):
        for h in range(Hq):
            hk, hv = _group(h, Hq, Hk), _group(h, Hq, Hv)
            s = q[b, h] @ k[b, hk].T * attn_scale * sc["descale_q"] * sc["descale_k"]
            s = s.masked_fill(~visible[b, 0], -math.inf)
            lse = stats[b, h].double()
            p = torch.where(torch.isfinite(s) & torch.isfinite(lse), torch.exp(s - lse),
                            torch.zeros_like(s))
            p[lens_q[b]:] = 0
            delta = (dO[b, h] * o[b, h]).sum(-1, keepdim=True) * sc["descale_dO"] \
                * sc["descale_o"]
            p8 = quantize(p * sc["scale_s"], q8.dtype)
            dv[b, hv] += p8.T @ dO[b, h] * sc["descale_s"] * sc["descale_dO"]
            dp = dO[b, h] @ v[b, hv].T * sc["descale_dO"] * sc["descale_v"]
            ds_all[b, h] = p * (dp - delta) * attn_scale
            if sinks is not None:
                live = torch.isfinite(lse)
                p_sink = torch.where(live, torch.exp(sinks[h].double() - lse),
                                     torch.zeros_like(lse))
                dsink[0, h, 0, 0] -= (p_sink * delta).sum()
    amax_dp = ds_all.abs().max()
    ds8 = quantize(ds_all * sc["scale_dP"], dO8.dtype)
    for b in range(B):
        for h in range(Hq):
            hk = _group(h, Hq, Hk)
            dq[b, h] = ds8[b, h] @ k[b, hk] * sc["descale_dP"] * sc["descale_k"]
            dk[b, hk] += ds8[b, h].T @ q[b, h] * sc["descale_dP"] * sc["descale_q"]
    amaxes = [g.abs().max() for g in (dq, dk, dv)]
    codes = [quantize(g * sc[n], grad_dtype) for g, n in ((dq, "scale_dQ"), (dk, "scale_dK"),
                                                          (dv, "scale_dV"))]
    return (*codes, *amaxes, amax_dp, dsink if sinks is not None else None)


def code_step(x: float, scale: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s codes around ``x`` (a dequantized value stored as
    ``x * scale``), in dequantized units: ``2**(floor(log2 |x * scale|) - mantissa bits)``."""
    mbits, emin, _ = FORMATS[dtype]
    e = max(math.floor(math.log2(max(abs(x * scale), 2.0 ** emin))), emin)
    return 2.0 ** (e - mbits) / scale


def assert_fp8_grad_close(got, want_codes, scale, dtype, reach, outliers=1e-3):
    """A cuDNN FP8 gradient against the float64 reference, dequantized (``/ scale``).

    Every element must be within ``atol 0.04`` (NVIDIA's) and ``rtol`` of one code step of
    ``dtype`` (``max(0.2, 2**-mantissa bits)``: 0.25 for E5M2, whose neighbouring codes are a
    quarter apart, so one value rounded the other way from the reference's already breaks
    NVIDIA's rtol 0.2), except a fraction ``outliers`` of them, which may be off by ``reach``
    more: the most one intermediate code (dS or P) rounded the other way can move the result
    (that code's step times the largest operand it multiplies). cuDNN's float32 arithmetic
    rounds a few intermediates lying within ~1e-3 of a rounding midpoint the other way
    (an H200 with cuDNN 9.19 did, issue 36); a wrong quantization point moves most codes."""
    g, w = got.double() / scale, want_codes.double() / scale
    mbits = FORMATS[dtype][0]
    bound = 0.04 + max(0.2, 2.0 ** -mbits) * w.abs()
    diff = (g - w).abs()
    out = diff > bound
    assert out.double().mean().item() <= outliers, (
        f"{int(out.sum())} of {out.numel()} elements outside atol 0.04 / rtol "
        f"{max(0.2, 2.0 ** -mbits)} (max difference {diff.max().item():.4g})")
    worst = (diff - bound - reach).max().item()
    assert worst <= 0, f"an element is {worst:.4g} past one intermediate code's reach {reach:.4g}"
