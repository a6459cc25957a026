"""What FlashAttention's entry points share: its mask arguments as a mask, the problem, and the
forward/backward runs through ``cudnn_attn.core.execution`` (``dense``, ``varlen`` and ``kvcache`` call
these)."""

from __future__ import annotations

import dataclasses

import torch

from ...core import execution
from ...core.caches import LRU
from ...model.masks import Causal, SlidingWindow, same_alignment
from ...model.problem import AttnProblem
from ...model.inputs import DropoutState, Inputs
from ...packed.prepared import modes_key, tensor_key
from ._args import Options

__all__ = ["fa_window", "fa_mask", "fa_positions_per_token", "forward", "backward"]


# ---------------------------------------------------------------------------------------------
# masks, problems, engines
# ---------------------------------------------------------------------------------------------

def fa_window(opts: Options, seq_k: int) -> tuple[int, int]:
    """FlashAttention's ``(left, right)`` window after its own normalization: a side at least
    ``seq_k`` (``max_seqlen_k`` for packed calls) is unbounded (-1); causal sets ``right = 0``."""
    left = -1 if opts.left >= seq_k else opts.left
    right = 0 if opts.causal else (-1 if opts.right >= seq_k else opts.right)
    return left, right


def fa_mask(opts: Options, seq_k: int, aligned_equal: bool, alibi: bool = False):
    """FlashAttention's causal/window arguments as a mask (its alignment is bottom-right).

    ``aligned_equal``: every sequence has as many queries as keys, so the alignments coincide
    (``masks.same_alignment``) and top-left is used (cuDNN combines it with more features).
    """
    left, right = fa_window(opts, seq_k)
    alignment = same_alignment("bottom_right", aligned_equal)
    if left < 0 and right < 0:
        # No mask, but ALiBi is aligned bottom-right all the same: an unbounded window carries
        # the alignment.
        return SlidingWindow(-1, -1, alignment) if alibi and not aligned_equal else None
    if left < 0 and right == 0:
        return Causal(alignment)
    return SlidingWindow(left, right, alignment)


def fa_positions_per_token(opts: Options, seq_k: int) -> bool:
    """Whether ``flash_attn_with_kvcache`` rotates query ``i`` at ``n + i`` (a causal or local
    call, after the window's normalization against ``seq_k``) rather than every query at ``n``."""
    return max(fa_window(opts, seq_k)) >= 0


def _problem(q, k, v, mask, alibi, opts: Options) -> AttnProblem:
    # repeatable: FlashAttention's forward is bitwise repeatable, so every call here must be
    problem = AttnProblem.from_tensors(q, k, v, mask=mask, bias=alibi, scale=opts.scale,
                                       dropout_p=opts.p_dropout, softcap=opts.softcap,
                                       layout="bshd", return_lse=True)
    return dataclasses.replace(problem, repeatable=True)


# A call's signature -> execution.plan_call's (engine, problem, plan). A training step repeats a
# few signatures, and building and planning the problem was most of a small call's host time
# (attention()'s own call cache does the same).
_PLANNED = LRU("flash_attn.planned", maxsize=256)
_Tensor = torch.Tensor


def _planned(q, k, v, mask, alibi, opts: Options, **fields):
    """``execution.plan_call`` of the call's problem (``fields`` replaced), once per signature;
    every call with ALiBi slopes (their values live in the problem) or a tensor subclass, and
    every traced call, plans anew."""
    key = None
    if (alibi is None and type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor
            and not q.is_meta and not torch.compiler.is_compiling()):
        key = (tensor_key(q), tensor_key(k), tensor_key(v), mask, opts,
               tuple(sorted(fields.items())), *modes_key())
    found = None if key is None else _PLANNED.get(key)
    if found is None:
        problem = _problem(q, k, v, mask, alibi, opts)
        found = execution.plan_call(dataclasses.replace(problem, **fields) if fields else problem)
        if key is not None:
            _PLANNED.put(key, found)
    return found


def forward(q, k, v, mask, alibi, opts: Options, return_softmax, gen_):
    """bshd q/k/v -> ``(out, lse, dropout state, probs, keep)`` on the selected engine.

    With ``return_softmax``: ``probs`` ``[B, H, S_q, S_k]`` are the pre-dropout attention weights
    and ``keep`` (with dropout, else None) says which entries the dropout mask kept; both are
    None otherwise.
    """
    dropout = DropoutState.draw(gen_) if opts.p_dropout > 0 else DropoutState(0, 0)
    inputs = Inputs(q, k, v, None, dropout if opts.p_dropout > 0 else None)
    engine, problem, plan = _planned(q, k, v, mask, alibi, opts)
    if not return_softmax:
        out, lse = execution.forward(problem, plan, inputs)
        return out, lse, dropout, None, None
    if engine.name == "torch":  # it hands its weights back: O(S_q S_k) on top of the call
        weights: dict = {}
        out, lse = execution.forward(problem, plan, inputs, weights=weights)
        probs = weights["probs"]
        keep = None if opts.p_dropout == 0 else (weights["dropped"] != 0) | (probs == 0)
        return out, lse, dropout, probs, keep
    # Other engines: the call itself, then its weights as the output of calls whose values are
    # identity columns, D_v at a time in v's shape and strides: each is the call's own graph
    # (the same engine, and with dropout the same DropoutState), only the values differ. cuDNN's
    # Philox pattern follows the kernel its graph's sizes choose, not the (query, key) position
    # alone: on an H200, 128 identity columns against a d = 192 call gave weights that disagreed
    # with the call (almost nothing dropped, pre-dropout weights 0.16 off).
    out, lse = execution.forward(problem, plan, inputs)
    plain = dataclasses.replace(opts, p_dropout=0.0)
    probs = _weights(q, k, v, mask, alibi, plain, None, None)
    keep = None
    if opts.p_dropout > 0:
        dropped = _weights(q, k, v, mask, alibi, opts, dropout, engine)
        keep = (dropped != 0) | (probs == 0)
    return out, lse, dropout, probs, keep


def _identity_values(v, start: int, width: int):
    """Values shaped and laid out as ``v`` (contiguous where v broadcasts) whose first ``width``
    columns are columns ``start ..`` of the ``S_k`` identity, the rest zero."""
    if 0 in v.stride():
        values = torch.zeros_like(v, memory_format=torch.contiguous_format)
    else:
        values = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        values.zero_()
    keys = torch.arange(start, start + width, device=v.device)
    values[:, keys, :, torch.arange(width, device=v.device)] = 1
    return values


def _weights(q, k, v, mask, alibi, opts: Options, dropout, engine):
    """The call's attention weights ``[B, H, S_q, S_k]`` (with ``dropout``: as applied, kept
    entries scaled by ``1 / (1 - p)``), ``D_v`` keys per call (``_identity_values``); with
    dropout on ``engine``, the one that drew the mask."""
    seq_k, width = k.shape[1], v.shape[-1]
    parts = []
    for start in range(0, seq_k, width):
        cols = min(width, seq_k - start)
        values = _identity_values(v, start, cols)
        problem = _problem(q, k, values, mask, alibi, opts)
        if dropout is None:
            _, problem, plan = execution.plan_call(problem)
        else:
            _, problem, plan = execution.plan_on(engine, problem, (
                f"the attention weights with dropout must come from {engine.name!r}, the "
                f"engine that drew the call's dropout mask"))
        got, _ = execution.forward(problem, plan, Inputs(q, k, values, None, dropout))
        parts.append(got[..., :cols])
    return torch.cat(parts, dim=-1).permute(0, 2, 1, 3)


def backward(dout, q, k, v, out, lse, mask, alibi, opts: Options, deterministic, dropout):
    """bshd tensors (``lse`` in FlashAttention's convention) -> ``(dq, dk, dv)`` through the
    backward of the engine that ran (and, with dropout, drew the mask of) the forward."""
    _, problem, plan = _planned(
        q, k, v, mask, alibi, opts, requires_grad=True,
        deterministic=deterministic or torch.are_deterministic_algorithms_enabled())
    inputs = Inputs(q, k, v, None, dropout if opts.p_dropout > 0 else None)
    dq, dk, dv, _ = execution.backward(problem, plan, inputs, out,
                                       execution.lse_from_flash(lse), dout)
    return dq, dk, dv
