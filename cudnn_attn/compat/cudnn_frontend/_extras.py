"""The builder's score modifiers and extra outputs, translated: ``set_score_mod`` into the
problem's ``score_mod`` program, ``set_block_mask`` into an additive ``-inf`` bias on the pairs it
drops, ``set_logit_max`` / ``set_score_sum_exp`` / ``set_rng_dump`` into what the torch engine
reports (the engine that computes them; cuDNN's own outputs are not bound by this library)."""

from __future__ import annotations

import dataclasses
import math

import torch

from ... import execution
from ...problem import TensorSpec
from ...runtime import Inputs
from ...score_mods import trace
from ._score_attrs import BLOCK_BITS, BLOCK_TILE, block_mask_visibility

__all__ = ["score_mod_of", "with_block_mask", "needs_torch_engine", "write_row_stats",
           "keep_mask"]


def score_mod_of(attrs):
    """The recorded program of ``set_score_mod`` (+ ``set_score_mod_bprop``), or ``None``."""
    bprop = getattr(attrs, "score_mod_bprop", None)
    if attrs.score_mod is None:
        if bprop is not None:
            raise ValueError("set_score_mod_bprop needs set_score_mod (the forward's modifier)")
        return None
    return trace(attrs.score_mod, bprop)


def with_block_mask(attrs, bias, q, k):
    """``bias`` plus ``-inf`` on the pairs the block mask drops (``bias`` if there is none)."""
    mask = getattr(attrs, "block_mask", None)
    if mask is None:
        return bias
    B, H, Sq, Skv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    want = (B, H, -(-Sq // BLOCK_TILE), -(-(-(-Skv // BLOCK_TILE)) // BLOCK_BITS))
    if tuple(mask.shape) != want:
        raise ValueError(f"set_block_mask: block_mask must have shape [B, H_q, ceil(S_q/128), "
                         f"ceil(ceil(S_kv/128)/8)] = {list(want)}, got {tuple(mask.shape)}")
    if mask.device != q.device:
        raise ValueError(f"set_block_mask: block_mask must be on q's device {q.device}, got "
                         f"{mask.device}")
    dtype = bias.dtype if bias is not None else (q.dtype if q.dtype.is_floating_point
                                                else torch.float32)
    dropped = torch.zeros(B, H, Sq, Skv, dtype=dtype, device=q.device).masked_fill_(
        ~block_mask_visibility(mask, Sq, Skv), -math.inf)
    return dropped if bias is None else bias + dropped


def needs_torch_engine(attrs) -> bool:
    """Whether the call asks for an output only the torch engine reports."""
    return any(getattr(attrs, name, None) is not None
               for name in ("logit_max", "score_sum_exp", "rng_dump"))


def write_row_stats(attrs, row_stats: dict) -> None:
    for name, key in (("logit_max", "max"), ("score_sum_exp", "sum_exp")):
        dst = getattr(attrs, name, None)
        if dst is None:
            continue
        value = row_stats[key]
        if dst.numel() != value.numel():
            raise ValueError(f"set_{name}: the tensor must be [B, H_q, S_q, 1] = "
                             f"{list(value.shape) + [1]}, got {tuple(dst.shape)}")
        dst.copy_(value.reshape(dst.shape))


def keep_mask(problem, inputs) -> torch.Tensor:
    """``[B, H_q, S_q, S_kv]`` 0/1: the dropout keep mask the torch engine draws for the call's
    ``DropoutState`` (0 where a pair is hidden: its weight is 0 whatever the draw). Found by
    running the call with ``V = I``: its output is ``P * keep / (1 - p)``, the same draws (the
    engine's tiles and chunks do not depend on ``D_v``)."""
    B, Hkv, Skv = problem.batch, problem.heads_kv, problem.seq_kv
    q = inputs.q
    eye = torch.eye(Skv, dtype=q.dtype, device=q.device).expand(B, Hkv, Skv, Skv)
    if problem.layout == "bshd":
        eye = eye.transpose(1, 2)
    base = dataclasses.replace(problem, dim_v=Skv, v=TensorSpec.of(eye), requires_grad=False,
                               bias_requires_grad=False, return_lse=False)
    weights = []
    for p in (problem.dropout_p, 0.0):
        variant = dataclasses.replace(base, dropout_p=p)
        _, variant, plan = execution.plan_call(variant, "torch")
        feed = Inputs(q, inputs.k, eye, inputs.bias, inputs.dropout, inputs.dropout_mask)
        out, _ = execution.forward(variant, plan, feed, need_lse=False)
        out = out.to(torch.float64)
        weights.append(out if problem.layout == "bhsd" else out.transpose(1, 2))
    dropped, plain = weights
    keep = torch.where(plain > 0, dropped / plain.clamp_min(1e-300) * (1 - problem.dropout_p),
                       torch.zeros_like(plain))
    return keep.round()
