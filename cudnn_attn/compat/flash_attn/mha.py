"""FlashAttention's C++ entry points (PyTorch's ``flash_api.h``) on every engine.

``mha_fwd``, ``mha_varlen_fwd``, ``mha_bwd`` and ``mha_varlen_bwd`` take the positional arguments
of ``pytorch_flash::mha_*`` (with ``softcap`` after ``window_size_right``, as in current
FlashAttention 2) and return the same tuples. Each call becomes one ``AttnProblem`` in the
``"bshd"`` layout (varlen calls: a padded batch with a ``Padding`` mask) and runs on the engine the
dispatcher selects: cuDNN where it can express the call, otherwise the torch engine.

FlashAttention semantics (``S_q``/``S_k`` the lengths of one sequence):

* causal is aligned bottom-right: query ``i`` sees keys ``j <= i + S_k - S_q``. Windows are
  inclusive, ``i + S_k - S_q - left <= j <= i + S_k - S_q + right``; a negative size is
  unbounded. As FlashAttention does, a window ``>= S_k`` (``max_seqlen_k`` for varlen) becomes
  unbounded and ``is_causal`` sets ``window_size_right = 0``.
* ``alibi_slopes_`` (``[H]`` or ``[B, H]``, float32 or float64) adds
  ``-slope * |i + S_k - S_q - j|``. ``softcap > 0`` maps scores to ``softcap * tanh(s / softcap)``
  before ALiBi. GQA: ``H_q % H_k == 0``, query head ``h`` reads kv head ``h // (H_q // H_k)``.
* ``p_dropout`` is the probability of dropping an attention weight; kept weights scale by
  ``1 / (1 - p_dropout)``. Softcap with dropout is allowed here (FlashAttention refuses it).

Conventions of this implementation (where FlashAttention leaves room or differs):

* ``q_padded``, ``k_padded``, ``v_padded`` are the inputs themselves: no engine needs the head
  dim padded to a multiple of 8, so nothing is padded (any head dim works; ``D_v`` may differ
  from ``D_qk``).
* ``softmax_lse`` is float32 (float64 for float64 inputs), ``[B, H, S_q]``; varlen: ``[H,
  total_q]``. A row that sees no key gets ``out = 0`` and ``lse = -inf`` (FlashAttention writes
  ``+inf``); the backward accepts either.
* ``philox_seed`` / ``philox_offset`` are 0-d int64 CPU tensors: the call's dropout stream
  (``DropoutState``), drawn from ``gen_`` (or the default CPU generator). Every engine derives its
  keep masks from these two numbers alone, so ``mha_bwd`` regenerates exactly the forward's keep
  mask from them (pass them back unchanged). Without dropout both are 0.
* ``return_softmax`` works with or without dropout and returns ``p`` ``[B, H, S_q, S_k]`` in q's
  dtype (varlen: ``[B, H, max_seqlen_q, max_seqlen_k]``, zero past each sequence): the attention
  weights *after dropout*, i.e. dropped entries are 0 and kept ones are scaled by
  ``1 / (1 - p_dropout)``, so ``out = p @ v`` exactly. (FlashAttention returns the pre-dropout
  weights with dropped entries negated, padded to multiples of 128.) The weights come from the same
  engine call as ``out`` (the identity is appended to ``v``), so they cost ``S_k`` extra value
  columns: a testing aid, as in FlashAttention. Without it ``p`` is an empty tensor.
* ``softmax_d`` (the backward's fourth result) is ``rowsum(dout * out)``, ``[B, H, S_q]``
  (varlen ``[H, total_q]``), in the lse dtype.
* Output buffers ``out_``, ``dq_``, ``dk_``, ``dv_`` are written and returned.
* ``softmax_scale`` may be ``None`` for FlashAttention's default ``head_size ** -0.5``.
* ``deterministic`` asks for a deterministic backward (as does
  ``torch.use_deterministic_algorithms(True)``). With dropout the backward must run on the engine
  that made the mask: if that engine has no deterministic backward for the call,
  ``NotSupportedError`` says so.
* ``zero_tensors`` (varlen) is accepted; every element of the results is written anyway.
* Paged KV (``block_table_``): any page size; pages are gathered into a padded batch, so every
  engine runs it. ``cu_seqlens_k`` gives the key lengths (``seqused_k`` overrides them).
"""

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

__all__ = ["mha_fwd", "mha_varlen_fwd", "mha_bwd", "mha_varlen_bwd"]

# The entry points live in ``dense`` (mha_fwd, mha_bwd) and ``varlen`` (mha_varlen_*); they run
# through ``_forward`` / ``_backward`` below, which look up ``_dropout_engine`` here (tests
# replace it). They load on first access, so this module imports neither.
_PUBLIC = {"mha_fwd": ".dense", "mha_bwd": ".dense", "mha_varlen_fwd": ".varlen",
           "mha_varlen_bwd": ".varlen"}


def __getattr__(name):
    if name in _PUBLIC:
        import importlib

        value = getattr(importlib.import_module(_PUBLIC[name], __package__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


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
    """bshd q/k/v -> ``(out, lse, dropout state, probs or None)`` on the selected engine."""
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
            return out, lse, dropout, None
        # One call computes out and the weights: p @ [v | I] = [out | p].
        seq_k, dim_v = k.shape[1], v.shape[3]
        eye = torch.eye(seq_k, dtype=v.dtype, device=v.device)
        v_aug = torch.cat([v, eye[None, :, None, :].expand(v.shape[0], seq_k, v.shape[2], seq_k)],
                          dim=-1)
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
    return out_aug[..., :dim_v], lse, dropout, out_aug[..., dim_v:].permute(0, 2, 1, 3)


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
    # Rows that see no key: FlashAttention writes +inf, the engines take -inf.
    lse = lse.masked_fill(lse == math.inf, -math.inf)
    inputs = Inputs(q, k, v, None, dropout if opts.p_dropout > 0 else None)
    with torch.no_grad():
        dq, dk, dv, _ = plan.backward(problem, inputs, out, lse, dout)
    return dq, dk, dv
