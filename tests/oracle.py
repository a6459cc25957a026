"""Independent float64 brute-force oracle for the cudnn_attn test suite.

Written from the public contract (DESIGN.md, the foundation contract) and the NATTEN 0.21 neighborhood
rule (reference/neighborhood-attention.md, section 1.2). It never imports cudnn_attn: masks are described
with plain arguments (strings, tuples, dicts), the visibility matrix is built with Python loops / numpy,
and attention is a dense float64 torch computation (differentiable, so gradients come from autograd).

Score pipeline (contract): s = scale * q.k; softcap: s = c * tanh(s / c); s += bias (tensor and/or
ALiBi); masked -> -inf; p = softmax(s); out = p @ v; lse = logsumexp(masked s). A row with no visible
key has out = 0 and lse = -inf.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------------
# Neighborhood rule (NATTEN 0.21 / GNA), one axis.
# ----------------------------------------------------------------------------------------------------


def na_axis_neighbors(L: int, i: int, k: int, s: int = 1, d: int = 1, causal: bool = False) -> list[int]:
    """Global key indices that query ``i`` sees on one axis of length ``L`` (section 1.2 rule)."""
    if not (k >= 2 and 1 <= s <= k and d >= 1 and k * d <= L and 0 <= i < L):
        raise ValueError(f"invalid neighborhood axis params L={L} i={i} k={k} s={s} d={d}")
    g = i % d  # dilation group of the query
    idx = i // d  # index inside the group
    Lg = L // d + 1 - ((g + (d - L % d)) // d)  # qkv_fix_dilation
    assert Lg == len(range(g, L, d))
    wl = k // 2
    wr = k // 2 + (k % 2) - 1
    if not causal:
        leader = min((idx // s) * s + s // 2, Lg - 1)
        start = max(leader - wl, 0) + (Lg - wr - leader - 1 if leader + wr >= Lg else 0)
        end = start + k
    else:
        leader = min((idx // s) * s + s - 1, Lg - 1)
        start = max(leader - wl - wr, 0)
        end = min(idx + 1, Lg)
    return [t * d + g for t in range(start, end)]


def na_axis_neighbors_clamp_form(L: int, i: int, k: int, s: int = 1, d: int = 1) -> list[int]:
    """Equivalent non-causal form (Flex): centre = clamp(leader, wl, Lg-1-wr); keys [centre-wl, centre+wr]."""
    g, idx = i % d, i // d
    Lg = len(range(g, L, d))
    wl, wr = k // 2, k // 2 + (k % 2) - 1
    leader = min((idx // s) * s + s // 2, Lg - 1)
    centre = min(max(leader, wl), Lg - 1 - wr)
    return [t * d + g for t in range(centre - wl, centre + wr + 1)]


def _per_axis(value, n: int, name: str) -> tuple:
    if isinstance(value, (tuple, list)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries, expected {n}")
        return tuple(value)
    return (value,) * n


def neighborhood_visibility(spatial_shape, kernel_size, stride=1, dilation=1, is_causal=False) -> np.ndarray:
    """Dense [S, S] boolean visibility of a 1/2/3-D neighborhood on the row-major flattening."""
    shape = tuple(spatial_shape) if isinstance(spatial_shape, (tuple, list)) else (spatial_shape,)
    n = len(shape)
    ks = _per_axis(kernel_size, n, "kernel_size")
    ss = _per_axis(stride, n, "stride")
    ds = _per_axis(dilation, n, "dilation")
    cs = _per_axis(is_causal, n, "is_causal")
    axis_masks = []
    for L, k, s, d, c in zip(shape, ks, ss, ds, cs):
        m = np.zeros((L, L), dtype=bool)
        for i in range(L):
            for j in na_axis_neighbors(L, i, k, s, d, bool(c)):
                m[i, j] = True
        axis_masks.append(m)
    # AND over axes on the row-major flattening: vis[(q0,q1,..),(k0,k1,..)] = prod_a M_a[q_a, k_a],
    # which is the Kronecker product of the per-axis matrices.
    vis = np.ones((1, 1), dtype=np.int64)
    for m in axis_masks:
        vis = np.kron(vis, m.astype(np.int64))
    return vis.astype(bool)


def neighbor_sets(spatial_shape, kernel_size, stride=1, dilation=1, is_causal=False) -> list[list[int]]:
    vis = neighborhood_visibility(spatial_shape, kernel_size, stride, dilation, is_causal)
    return [list(np.nonzero(row)[0]) for row in vis]


# ----------------------------------------------------------------------------------------------------
# Dense visibility for every mask kind.
# ----------------------------------------------------------------------------------------------------


def aligned_offsets(B, S_q, S_kv, alignment="top_left", seq_lens_q=None, seq_lens_kv=None) -> list[int]:
    """Per-batch offset o_b so that the aligned query index is i' = i + o_b."""
    if alignment == "top_left":
        return [0] * B
    if alignment != "bottom_right":
        raise ValueError(alignment)
    if seq_lens_q is None:
        return [S_kv - S_q] * B
    return [int(seq_lens_kv[b]) - int(seq_lens_q[b]) for b in range(B)]


def build_visibility(
    B: int,
    S_q: int,
    S_kv: int,
    *,
    causal: str | None = None,
    window: tuple | None = None,
    neighborhood: dict | None = None,
    seq_lens_q: Sequence[int] | None = None,
    seq_lens_kv: Sequence[int] | None = None,
) -> torch.Tensor:
    """Boolean visibility [B, S_q, S_kv] (AND of all given masks).

    causal: None | "top_left" | "bottom_right".  window: (left, right[, alignment]) inclusive, -1 unbounded.
    neighborhood: kwargs of neighborhood_visibility.  seq_lens_*: per-batch valid lengths (Padding).
    """
    padded = seq_lens_q is not None or seq_lens_kv is not None
    lq = np.array(list(seq_lens_q) if seq_lens_q is not None else [S_q] * B)[:, None, None]
    lkv = np.array(list(seq_lens_kv) if seq_lens_kv is not None else [S_kv] * B)[:, None, None]
    if not padded:
        lq = np.full((B, 1, 1), S_q)
        lkv = np.full((B, 1, 1), S_kv)
    i = np.arange(S_q)[None, :, None]
    j = np.arange(S_kv)[None, None, :]
    vis = np.ones((B, S_q, S_kv), dtype=bool)
    if padded:
        vis &= (i < lq) & (j < lkv)
    if causal is not None:
        if causal not in ("top_left", "bottom_right"):
            raise ValueError(causal)
        ip = i + (lkv - lq if causal == "bottom_right" else 0)
        vis &= j <= ip
    if window is not None:
        left, right = window[0], window[1]
        align = window[2] if len(window) > 2 else "top_left"
        ip = i + (lkv - lq if align == "bottom_right" else 0)
        if left >= 0:
            vis &= j >= ip - left
        if right >= 0:
            vis &= j <= ip + right
    if neighborhood is not None:
        nb = neighborhood_visibility(**neighborhood)
        if nb.shape != (S_q, S_kv):
            raise ValueError("neighborhood shape does not match S_q/S_kv")
        vis &= nb[None]
    return torch.from_numpy(vis)


# ----------------------------------------------------------------------------------------------------
# ALiBi
# ----------------------------------------------------------------------------------------------------


def default_alibi_slopes(n: int) -> list[float]:
    """Standard ALiBi geometric slopes for n heads (Press et al.; contract formula)."""

    def pow2(m):
        return [2.0 ** (-8.0 * (h + 1) / m) for h in range(m)]

    if n & (n - 1) == 0:
        return pow2(n)
    m = 2 ** math.floor(math.log2(n))
    return pow2(m) + pow2(2 * m)[0::2][: n - m]


def alibi_bias(slopes, B, H, S_q, S_kv, offsets) -> torch.Tensor:
    """-slope[b,h] * |i + o_b - j| as a float64 [B, H, S_q, S_kv] tensor."""
    sl = torch.as_tensor(slopes, dtype=torch.float64)
    if sl.dim() == 1:
        sl = sl.expand(B, H)
    out = torch.empty(B, H, S_q, S_kv, dtype=torch.float64)
    j = torch.arange(S_kv, dtype=torch.float64)
    for b in range(B):
        i = torch.arange(S_q, dtype=torch.float64) + offsets[b]
        dist = (i[:, None] - j[None, :]).abs()
        out[b] = -sl[b][:, None, None] * dist
    return out


# ----------------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------------


def _to_bhsd(x, layout):
    if layout == "bhsd":
        return x
    if layout == "bshd":
        return x.transpose(1, 2)
    raise ValueError(layout)


def reference_attention(
    q,
    k,
    v,
    visible=None,
    *,
    layout: str = "bhsd",
    scale: float | None = None,
    softcap: float | None = None,
    bias=None,
    alibi_slopes=None,
    alibi_offsets=None,
):
    """Dense float64 attention. Returns (out in `layout`, lse [B, H_q, S_q]), both float64.

    visible: bool [B or 1, S_q, S_kv] (broadcast over heads) or None (all visible).
    bias: tensor broadcastable to [B, H_q, S_q, S_kv].  alibi_slopes: [H] or [B, H];
    alibi_offsets: per-batch aligned-query offsets (default top-left zeros).
    Differentiable w.r.t. q, k, v and bias.
    """
    q = _to_bhsd(q, layout).to(torch.float64)
    k = _to_bhsd(k, layout).to(torch.float64)
    v = _to_bhsd(v, layout).to(torch.float64)
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    assert Hq % Hkv == 0
    rep = Hq // Hkv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    if scale is None:
        scale = D**-0.5
    s = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    if softcap is not None and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(torch.float64)
    if alibi_slopes is not None:
        offs = alibi_offsets if alibi_offsets is not None else [0] * B
        s = s + alibi_bias(alibi_slopes, B, Hq, Sq, Skv, offs)
    s = s.expand(B, Hq, Sq, Skv)
    if visible is None:
        vis = torch.ones(B, Hq, Sq, Skv, dtype=torch.bool)
    else:
        vis = visible.to(torch.bool)[:, None].expand(B, Hq, Sq, Skv)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64)
    s = torch.where(vis, s, neg_inf)
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.where(vis, torch.exp(torch.where(vis, s, torch.zeros_like(s)) - m), torch.zeros_like(s))
    l = e.sum(dim=-1, keepdim=True)
    empty = l == 0
    lse = torch.where(empty, neg_inf, m + torch.log(torch.where(empty, torch.ones_like(l), l)))
    p = e / torch.where(empty, torch.ones_like(l), l)
    out = torch.einsum("bhij,bhjd->bhid", p, v)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return out, lse.squeeze(-1)


def plain_lowp_attention(q, k, v, visible=None, *, layout="bhsd", scale=None, softcap=None, bias=None):
    """A plain PyTorch computation entirely in the inputs' (low-precision) dtype: FlashAttention's
    `upcast=False` baseline. Fully masked rows give 0."""
    dt = q.dtype
    q, k, v = (_to_bhsd(x, layout) for x in (q, k, v))
    _B, Hq, _Sq, D = q.shape
    rep = Hq // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    if scale is None:
        scale = D**-0.5
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None and softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.to(dt)
    if visible is not None:
        vis = visible.to(torch.bool)[:, None].expand(s.shape)
        s = s.masked_fill(~vis, float("-inf"))
        p = torch.softmax(s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0)
    else:
        p = torch.softmax(s, dim=-1)
    out = (p.to(dt) @ v).to(dt)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return out
