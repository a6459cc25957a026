"""Float64 brute force for the NATTEN-compatible API (``cudnn_attn.neighborhood``), built on
``oracle.py`` (the neighbor rule and dense attention). Never imports cudnn_attn.

* fused ``na*d`` (heads-last): dense masked attention with a dense RPB bias and extra keys;
* unfused ``qk``/``av`` (heads-first, NATTEN 0.17 slots): dense scores ``q @ k^T`` read at each
  query's slot keys through a one-hot selection tensor, so gradients come from autograd;
* a query-chunked forward/backward (explicit softmax-attention gradient formulas) for the large
  grid cases where a dense ``S x S`` autograd graph would not fit.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import oracle
import torch


def per_axis(value, n):
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def axis_slots(L, k, s, d, causal):
    """Per query: the NATTEN 0.17 slot keys (ascending neighbors), ``None`` for cut slots."""
    rows = []
    for i in range(L):
        keys = sorted(oracle.na_axis_neighbors(L, i, k, s, d, causal))
        rows.append(keys + [None] * (k - len(keys)))
    return rows


def slot_table(shape, kernel, stride=1, dilation=1, causal=False):
    """``[S, K]`` int64 flat key per (query, slot), ``-1`` where the slot is cut."""
    n = len(shape)
    kernel, stride, dilation, causal = (per_axis(x, n) for x in (kernel, stride, dilation, causal))
    axes = [axis_slots(*a) for a in zip(shape, kernel, stride, dilation, causal)]
    S, K = math.prod(shape), math.prod(kernel)
    table = np.full((S, K), -1, dtype=np.int64)
    for qi, qc in enumerate(itertools.product(*(range(L) for L in shape))):
        for si, sc in enumerate(itertools.product(*(range(k) for k in kernel))):
            keys = [axes[a][qc[a]][sc[a]] for a in range(n)]
            if all(x is not None for x in keys):
                table[qi, si] = int(np.ravel_multi_index(keys, shape))
    return table


def selection(table, S):
    """One-hot ``[S, K, S]`` float64: ``E[i, s, key(i, s)] = 1`` for valid slots."""
    S_q, K = table.shape
    E = torch.zeros(S_q, K, S, dtype=torch.float64)
    i, s = np.nonzero(table >= 0)
    E[i, s, table[i, s]] = 1.0
    return E


def dense_rpb(rpb, shape, kernel, stride=1, dilation=1):
    """``[H, S, S]`` bias ``rpb[h, (j_a - i_a) / d_a + k_a - 1 ...]`` on visible pairs, else 0."""
    n = len(shape)
    kernel, dilation = per_axis(kernel, n), per_axis(dilation, n)
    vis = oracle.neighborhood_visibility(shape, kernel, stride, dilation, False)
    coords = np.stack(np.unravel_index(np.arange(math.prod(shape)), shape), 1)  # [S, n]
    qi, kj = np.nonzero(vis)
    rel = [(coords[kj, a] - coords[qi, a]) // dilation[a] + kernel[a] - 1 for a in range(n)]
    for a in range(n):
        assert (rel[a] >= 0).all() and (rel[a] <= 2 * kernel[a] - 2).all(), "rpb index out of range"
    S = math.prod(shape)
    out = torch.zeros(rpb.shape[0], S, S, dtype=torch.float64)
    out[:, qi, kj] = rpb.to(torch.float64)[(slice(None), *(torch.from_numpy(r) for r in rel))]
    return out


def na_reference(q, k, v, shape, kernel, stride=1, dilation=1, causal=False, scale=None, rpb=None,
                 add_k=None, add_v=None):
    """Heads-last brute force: ``(out [B, *shape, H, Dv], lse [B, *shape, H])`` in float64."""
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    S = math.prod(shape)
    flat = lambda t: t.reshape(B, S, t.shape[-2], t.shape[-1]).to(torch.float64)
    qf, kf, vf = flat(q), flat(k), flat(v)
    vis = torch.from_numpy(oracle.neighborhood_visibility(shape, kernel, stride, dilation, causal))
    bias = None
    if rpb is not None:
        bias = dense_rpb(rpb, shape, kernel, stride, dilation)[None]
    if add_k is not None:
        n = add_k.shape[1]
        kf = torch.cat([kf, add_k.to(torch.float64)], 1)
        vf = torch.cat([vf, add_v.to(torch.float64)], 1)
        vis = torch.cat([vis, torch.ones(S, n, dtype=torch.bool)], 1)
        if bias is not None:
            bias = torch.cat([bias, torch.zeros(1, H, S, n, dtype=torch.float64)], -1)
    out, lse = oracle.reference_attention(qf, kf, vf, vis[None], layout="bshd",
                                          scale=scale if scale is not None else D ** -0.5, bias=bias)
    return out.reshape(B, *shape, H, -1), lse.transpose(1, 2).reshape(B, *shape, H)


def qk_reference(q, k, shape, kernel, dilation=1, causal=False, rpb=None, add_k=None):
    """Heads-first unfused logits ``[B, H, *shape, K (+n)]``; cut slots ``-inf``."""
    B, H = q.shape[:2]
    S = math.prod(shape)
    qf, kf = q.reshape(B, H, S, -1).double(), k.reshape(B, H, S, -1).double()
    dense = qf @ kf.transpose(-1, -2)
    if rpb is not None:
        dense = dense + dense_rpb(rpb, shape, kernel, 1, dilation)
    table = slot_table(shape, kernel, 1, dilation, causal)
    attn = torch.einsum("bhij,isj->bhis", dense, selection(table, S))
    attn = attn.masked_fill(torch.from_numpy(table < 0), float("-inf"))
    if add_k is not None:
        attn = torch.cat([attn, qf @ add_k.double().transpose(-1, -2)], -1)
    return attn.reshape(B, H, *shape, -1)


def av_reference(attn, v, shape, kernel, dilation=1, causal=False, add_v=None):
    """Heads-first unfused weighting ``[B, H, *shape, Dv]``; cut slots ignored."""
    B, H = v.shape[:2]
    S = math.prod(shape)
    table = slot_table(shape, kernel, 1, dilation, causal)
    K = table.shape[1]
    a = attn.reshape(B, H, S, -1).double()
    na = a[..., :K].masked_fill(torch.from_numpy(table < 0), 0.0)
    dense = torch.einsum("bhis,isj->bhij", na, selection(table, S))
    out = dense @ v.reshape(B, H, S, -1).double()
    if add_v is not None:
        out = out + a[..., K:] @ add_v.double()
    return out.reshape(B, H, *shape, -1)


def chunked_na_fwd_bwd(q, k, v, dout, shape, kernel, stride, dilation, causal, scale=None,
                       chunk=256):
    """Heads-last NA forward and backward in float64, query rows in chunks (no autograd graph).

    Returns ``out, lse, dq, dk, dv`` (heads-last, GQA gradients summed over the query group).
    Per chunk: ``p = softmax(masked scale q k^T)``, ``out = p v``, ``ds = p * (dO v^T - rowsum(dO*out))``,
    ``dq = scale ds k``, ``dk += scale ds^T q``, ``dv += p^T dO``.
    """
    B, H, D = q.shape[0], q.shape[-2], q.shape[-1]
    Hkv = k.shape[-2]
    S = math.prod(shape)
    scale = D ** -0.5 if scale is None else scale
    flat = lambda t: t.reshape(B, S, t.shape[-2], t.shape[-1]).double().transpose(1, 2)
    qf, kf, vf, gf = flat(q), flat(k), flat(v), flat(dout)
    rep = H // Hkv
    kf, vf = kf.repeat_interleave(rep, 1), vf.repeat_interleave(rep, 1)
    n = len(shape)
    params = [per_axis(x, n) for x in (kernel, stride, dilation, causal)]
    axis_masks = []
    for a, L in enumerate(shape):
        m = np.zeros((L, L), dtype=bool)
        for i in range(L):
            m[i, oracle.na_axis_neighbors(L, i, *(p[a] for p in params))] = True
        axis_masks.append(m)
    coords = np.stack(np.unravel_index(np.arange(S), shape), 1)
    out = torch.empty(B, H, S, vf.shape[-1], dtype=torch.float64)
    lse = torch.empty(B, H, S, dtype=torch.float64)
    dq = torch.empty_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    for c0 in range(0, S, chunk):
        rows = slice(c0, min(c0 + chunk, S))
        vis = np.ones((rows.stop - c0, S), dtype=bool)
        for a in range(n):
            vis &= axis_masks[a][coords[rows, a]][:, coords[:, a]]
        cols = torch.from_numpy(np.nonzero(vis.any(0))[0])  # keys no row of the chunk sees add 0
        vis_t = torch.from_numpy(vis)[:, cols]
        kc, vc = kf[:, :, cols], vf[:, :, cols]
        s = (scale * qf[:, :, rows] @ kc.transpose(-1, -2)).masked_fill(~vis_t, float("-inf"))
        m = s.amax(-1, keepdim=True)
        e = torch.exp(s - m)
        l = e.sum(-1, keepdim=True)
        p = e / l
        o = p @ vc
        out[:, :, rows], lse[:, :, rows] = o, (m + l.log()).squeeze(-1)
        g = gf[:, :, rows]
        ds = p * (g @ vc.transpose(-1, -2) - (g * o).sum(-1, keepdim=True))
        dq[:, :, rows] = scale * ds @ kc
        dk[:, :, cols] += scale * ds.transpose(-1, -2) @ qf[:, :, rows]
        dv[:, :, cols] += p.transpose(-1, -2) @ g
    fold = lambda t: t.view(B, Hkv, rep, S, -1).sum(2)
    back = lambda t, heads: t.transpose(1, 2).reshape(B, *shape, heads, -1)
    return (back(out, H), lse.transpose(1, 2).reshape(B, *shape, H), back(dq, H),
            back(fold(dk), Hkv), back(fold(dv), Hkv))
