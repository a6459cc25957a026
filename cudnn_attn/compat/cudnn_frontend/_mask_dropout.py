"""TODO(lead): delete this module at merge. The explicit-mask dropout form
(``set_dropout(mask, scale[, scale_inv])``) computed densely in torch ops, used only while
``AttnProblem.from_tensors`` does not accept ``dropout_mask=`` / ``dropout_scale=``; afterwards
the attribute builder runs that form through a plan like every other call."""

from __future__ import annotations

import math

import torch

from ...masks import Alibi, mask_parts
from ...problem import AttnProblem
from ...torch_engine.tiles import Visibility
from ._translate import alibi_dense, check_broadcast, compute_dtype, translate

__all__ = ["dense_problem", "dense_forward", "dense_backward"]


def dense_problem(attrs, q, k, v):
    """Validate as the engine path does (no dropout in the problem) and fold ALiBi into a bias."""
    mask, bias = translate(attrs, q, k)
    problem = AttnProblem.from_tensors(q, k, v, mask=mask, bias=bias, scale=attrs.attn_scale,
                                       layout="bhsd")
    if isinstance(bias, Alibi):
        bias = alibi_dense(mask, problem.batch, problem.heads_q, problem.seq_q, problem.seq_kv,
                            q.device, compute_dtype(q.dtype))
    keep = attrs.dropout[1]
    if keep.device != q.device:
        raise ValueError(f"set_dropout: mask must be on q's device {q.device}, got {keep.device}")
    check_broadcast("set_dropout: mask", keep, (problem.batch, problem.heads_q, problem.seq_q,
                                                  problem.seq_kv))
    return problem, bias


def _dense_scores(problem, attrs, q, k, bias):
    """Masked scores ``[B, H_q, S_q, S_kv]`` (``-inf`` where hidden) and the expanded keys."""
    ct = compute_dtype(q.dtype)
    kx = k.to(ct).repeat_interleave(problem.group_size, dim=1)
    s = attrs.attn_scale * torch.matmul(q.to(ct), kx.transpose(-1, -2))
    if bias is not None:
        s = s + bias.to(ct)
    parts = mask_parts(problem.mask)
    if parts:
        vis = Visibility(parts, problem.seq_q, problem.seq_kv)
        qi = torch.arange(problem.seq_q, device=q.device)[:, None]
        kj = torch.arange(problem.seq_kv, device=q.device)[None, :]
        visible = None
        for part in (vis.lines(qi, kj, problem.padding), vis.padded(qi, kj, problem.padding)):
            if part is not None:
                visible = part if visible is None else visible & part
        if visible is not None:
            s = s.masked_fill(~(visible if visible.dim() == 4 else visible[None, None]),
                              -math.inf)
    return s.expand(problem.batch, problem.heads_q, problem.seq_q, problem.seq_kv), kx


def _probs(s, lse):
    """``exp(s - lse)``; rows with ``lse = -inf`` (no visible key) are exactly 0."""
    return torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)[..., None])


def _keep(attrs, dtype):
    return attrs.dropout[1].to(dtype) * attrs.dropout[2]


def _group_sum(x, problem):
    B, _, S, D = x.shape
    return x.view(B, problem.heads_kv, problem.group_size, S, D).sum(2)


def dense_forward(problem, attrs, q, k, v, bias):
    s, _ = _dense_scores(problem, attrs, q, k, bias)
    lse = s.logsumexp(-1)
    vx = v.to(s.dtype).repeat_interleave(problem.group_size, dim=1)
    o = torch.matmul(_probs(s, lse) * _keep(attrs, s.dtype), vx)
    return o.to(q.dtype), lse.to(compute_dtype(q.dtype))


def dense_backward(problem, attrs, q, k, v, bias, o, dO, lse):
    s, kx = _dense_scores(problem, attrs, q, k, bias)
    ct = s.dtype
    p = _probs(s, lse.to(ct))
    keep = _keep(attrs, ct)
    vx = v.to(ct).repeat_interleave(problem.group_size, dim=1)
    do, qc = dO.to(ct), q.to(ct)
    dv = torch.matmul((p * keep).transpose(-1, -2), do)
    dp = torch.matmul(do, vx.transpose(-1, -2)) * keep
    # delta = rowsum(dO * o) = rowsum(P * dP) because o = (P * keep) @ V.
    ds = p * (dp - (do * o.to(ct)).sum(-1, keepdim=True))
    dq = attrs.attn_scale * torch.matmul(ds, kx)
    dk = attrs.attn_scale * torch.matmul(ds.transpose(-1, -2), qc)
    return (dq.to(q.dtype), _group_sum(dk, problem).to(k.dtype),
            _group_sum(dv, problem).to(v.dtype))
