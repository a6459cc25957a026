"""What FlashAttention's entry points share: its mask arguments as a mask, the problem, the engine
that makes and replays a dropout mask, and the forward/backward runs (``dense`` and ``varlen`` call
these)."""

from __future__ import annotations

import dataclasses
import math

import torch

from ... import dispatch
from ...dispatch import NotSupportedError
from ...masks import Causal, SlidingWindow
from ...problem import AttnProblem
from ...runtime import DropoutState, Inputs
from ._args import _Options


# ---------------------------------------------------------------------------------------------
# masks, problems, engines
# ---------------------------------------------------------------------------------------------

def _fa_mask(opts: _Options, seq_k: int, aligned_equal: bool, alibi: bool):
    """FlashAttention's causal/window arguments as a mask, after its own normalization.

    ``aligned_equal``: every sequence has as many queries as keys, so bottom-right equals
    top-left; top-left is then used (cuDNN combines it with more features).
    """
    left = -1 if opts.left >= seq_k else opts.left
    right = -1 if opts.right >= seq_k else opts.right
    if opts.causal:
        right = 0
    alignment = "top_left" if aligned_equal else "bottom_right"
    if left < 0 and right < 0:
        # No mask, but ALiBi is aligned bottom-right all the same: an unbounded window carries
        # the alignment.
        return SlidingWindow(-1, -1, alignment) if alibi and not aligned_equal else None
    if left < 0 and right == 0:
        return Causal(alignment)
    return SlidingWindow(left, right, alignment)


def fa_positions_per_token(opts: _Options, seq_k: int) -> bool:
    """Whether ``flash_attn_with_kvcache`` rotates query ``i`` at ``n + i`` (a causal or local
    call, after the window's normalization against ``seq_k``) rather than every query at ``n``."""
    left = -1 if opts.left >= seq_k else opts.left
    right = 0 if opts.causal else (-1 if opts.right >= seq_k else opts.right)
    return left >= 0 or right >= 0


def engine_lse(lse: torch.Tensor) -> torch.Tensor:
    """A FlashAttention ``softmax_lse`` in the engines' convention: rows that see no key are
    ``+inf`` in FlashAttention's, ``-inf`` in the engines'."""
    return lse.masked_fill(lse == math.inf, -math.inf)


def _problem(q, k, v, mask, alibi, opts: _Options) -> AttnProblem:
    return AttnProblem.from_tensors(q, k, v, mask=mask, bias=alibi, scale=opts.scale,
                                    dropout_p=opts.p_dropout, softcap=opts.softcap,
                                    layout="bshd", return_lse=True)


def _dropout_engine(problem: AttnProblem):
    """The engine that makes (forward) and replays (backward) the dropout mask of ``problem``:
    selected as for a call that will run backward, whatever the deterministic setting, so both
    directions pick the same one."""
    probe = dataclasses.replace(problem, requires_grad=True, deterministic=False)
    return dispatch.select(probe), probe


def _forward(q, k, v, mask, alibi, opts: _Options, return_softmax, gen_):
    """bshd q/k/v -> ``(out, lse, dropout state, probs, keep)`` on the selected engine.

    With ``return_softmax``: ``probs`` ``[B, H, S_q, S_k]`` are the pre-dropout attention weights
    and ``keep`` (with dropout, else None) says which entries the dropout mask kept; both are
    None otherwise.
    """
    problem = _problem(q, k, v, mask, alibi, opts)
    dropout = DropoutState(0, 0)
    if opts.p_dropout > 0:
        dropout = DropoutState.draw(gen_)
        backend, problem = _dropout_engine(problem)
    else:
        backend = dispatch.select(problem)
    inputs = Inputs(q, k, v, None, dropout if opts.p_dropout > 0 else None)
    with torch.no_grad():
        if not return_softmax:
            out, lse = backend.plan(problem).forward(problem, inputs)
            return out, lse, dropout, None, None
        # One call computes out and the weights: p @ [v | I] = [out | p].
        seq_k, dim_v = k.shape[1], v.shape[3]
        eye = _identity(v, seq_k)
        v_aug = torch.cat([v, eye], dim=-1)
        aug = _problem(q, k, v_aug, mask, alibi, opts)
        if opts.p_dropout > 0:
            reasons = backend.supports(aug)
            if reasons:  # the weights must come from the engine that replays the mask
                why = ("return_softmax with dropout appends the identity to v (D_v + S_k "
                       f"columns) and must run on {backend.name!r}, the engine that replays the "
                       "dropout mask in mha_bwd")
                raise NotSupportedError(aug, {backend.name: [why, *reasons]}, forced=backend.name)
        else:
            backend = dispatch.select(aug)
        inputs.v = v_aug
        out_aug, lse = backend.plan(aug).forward(aug, inputs)
        probs = out_aug[..., dim_v:].permute(0, 2, 1, 3)
        keep = None
        if opts.p_dropout > 0:
            # The dropped weights themselves: the same call without dropout, v = I.
            plain = _problem(q, k, eye, mask, alibi, dataclasses.replace(opts, p_dropout=0.0))
            dropped, _ = dispatch.select(plain).plan(plain).forward(plain, Inputs(q, k, eye))
            kept_values, probs = probs, dropped.permute(0, 2, 1, 3)
            keep = (kept_values != 0) | (probs == 0)
    return out_aug[..., :dim_v], lse, dropout, probs, keep


def _identity(v: torch.Tensor, seq_k: int) -> torch.Tensor:
    """``[B, S_k, H_kv, S_k]`` with ``I`` in each head: as values, attention returns its weights."""
    eye = torch.eye(seq_k, dtype=v.dtype, device=v.device)
    return eye[None, :, None, :].expand(v.shape[0], seq_k, v.shape[2], seq_k)


def _backward(dout, q, k, v, out, lse, mask, alibi, opts: _Options, deterministic, dropout):
    """bshd tensors -> ``(dq, dk, dv)`` through the selected engine's backward."""
    problem = _problem(q, k, v, mask, alibi, opts)
    problem = dataclasses.replace(
        problem, requires_grad=True,
        deterministic=deterministic or torch.are_deterministic_algorithms_enabled())
    if opts.p_dropout > 0:
        backend, _ = _dropout_engine(problem)
        reasons = backend.supports(problem)
        if reasons:
            why = f"the dropout mask was made by {backend.name!r}, so its backward must run there"
            raise NotSupportedError(problem, {backend.name: [why, *reasons]}, forced=backend.name)
    else:
        backend = dispatch.select(problem)
    plan = backend.plan(problem)
    lse = engine_lse(lse)
    inputs = Inputs(q, k, v, None, dropout if opts.p_dropout > 0 else None)
    with torch.no_grad():
        dq, dk, dv, _ = plan.backward(problem, inputs, out, lse, dout)
    return dq, dk, dv
