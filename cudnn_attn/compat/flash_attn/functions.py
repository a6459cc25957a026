"""FlashAttention 2.8's differentiable Python functions (``flash_attn_func`` and its packed and
varlen variants) as autograd Functions over the ``mha_*`` entry points: the forward runs
``mha_fwd``/``mha_varlen_fwd``, the backward ``mha_bwd``/``mha_varlen_bwd``'s gradients
(``dense_gradients``/``varlen_gradients``: without ``softmax_d``, which these functions drop, as
FlashAttention's do) with the saved ``softmax_lse`` and dropout seed/offset. The packed variants
unbind their stacked input and call the unpacked function (autograd stacks the gradients back).
Traced calls, and eager calls without dropout, ALiBi or returned probabilities (``_plain_call``),
are ``attention()`` / ``attention_varlen()``'s calls instead: their caches and autograd node.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Union

import torch

from ...model import checks
from ...api import attention
from ...core.caches import LRU
from ...errors import NotSupportedError
from ...model.masks import alibi_distance
from ...model.problem import accumulator_dtype, deterministic_calls
from ...varlen import attention_varlen
from . import _core
from .dense import dense_gradients, mha_fwd
from .varlen import mha_varlen_fwd, varlen_gradients
from ._args import Options, runtime_errors

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
           "flash_attn_varlen_kvpacked_func", "window_pair"]


# FlashAttention's ``window_size``: ``(left, right)`` (ints or 0-d integer tensors, -1 unbounded),
# as a tuple, a list or one 2-element tensor.
WindowSize = Union[tuple[int, int], list[int], torch.Tensor]


def window_pair(window_size: WindowSize) -> tuple:
    """``(left, right)`` from a 2-sequence or a 2-element tensor (ints or 0-d integer tensors;
    ``mha_*`` validate them)."""
    if isinstance(window_size, torch.Tensor):
        if window_size.numel() != 2 or window_size.dim() != 1:
            raise ValueError(f"window_size must have 2 entries (left, right), got a tensor of "
                             f"shape {tuple(window_size.shape)}")
        return window_size[0], window_size[1]
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right), got {window_size!r}")
    return tuple(window_size)


def _traced(q, k, v) -> bool:
    """Whether this call is being traced (torch.compile, torch.export, FakeTensor or meta inputs):
    then the ``mha_*`` entry points, which read lengths and build tile tables on the host, are
    bypassed for ``attention()``/``attention_varlen()``, whose custom ops trace without a break."""
    if torch.compiler.is_compiling():
        return True
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False  # validation explains it
    return any(type(t) is not torch.Tensor or t.is_meta for t in tensors)


def _traceable(alibi_slopes, dropout_p, return_probs, q=None) -> bool:
    """What the traced route computes: everything but the dropout-encoded probabilities
    (``S_dmask``) and ALiBi slopes the route cannot build a bias from (varlen calls, or slopes
    that are not an fp32 ``[H]`` / ``[B, H]`` tensor, which the eager path then explains)."""
    if return_probs and dropout_p > 0:
        return False
    if alibi_slopes is None:
        return True
    if q is None or not isinstance(alibi_slopes, torch.Tensor) \
            or alibi_slopes.dtype != torch.float32:
        return False
    return tuple(alibi_slopes.shape) in ((q.shape[2],), (q.shape[0], q.shape[2]))


def _alibi_bias(slopes: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """FlashAttention's ALiBi as an additive bias ``[B|1, H, S_q, S_k]`` built on the device
    (traceable, no host read): ``-slope * |i + S_k - S_q - j|``, in the scores' precision
    (float32; float64 for float64 inputs)."""
    seq_q, heads, seq_k = q.shape[1], q.shape[2], k.shape[1]
    work = accumulator_dtype(q.dtype)
    rows = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q)
    cols = torch.arange(seq_k, device=q.device)[None, :]
    distance = alibi_distance(rows, cols, work)
    return -slopes.detach().to(q.device, work).reshape(-1, heads, 1, 1) * distance


# The scalar arguments of a call routed to attention()/attention_varlen() -> (Options, mask):
# validating them and building the mask was a quarter of the route's host time, and a model
# repeats a few. Keyed with each value's type (True == 1 == 1.0 hash alike: a valid call must
# not vouch for an invalid one); tensor window sizes are not kept.
_OPTIONS = LRU("flash_attn.options", maxsize=256)
_SCALAR_TYPES = frozenset({int, float, bool, type(None)})


def _options_and_mask(head_dim, dropout_p, softmax_scale, causal, window_size, softcap,
                      seq_k: int, aligned_equal: bool, traced: bool):
    """``(Options, fa_mask)`` of a routed call's scalar arguments, validated (kept for eager
    calls only: a traced call's sizes may be symbolic, and tracing reads no cache)."""
    args = (dropout_p, softmax_scale, causal, softcap, *(
        window_size if type(window_size) is tuple and len(window_size) == 2 else (window_size,)))
    key = None
    if not traced and all(type(a) in _SCALAR_TYPES for a in args):
        key = (head_dim, seq_k, aligned_equal, *((type(a), a) for a in args))
        found = _OPTIONS.get(key)
        if found is not None:
            return found
    left, right = window_pair(window_size)
    opts = Options.of(head_dim, dropout_p, softmax_scale, causal, left, right, softcap)
    found = opts, _core.fa_mask(opts, seq_k, aligned_equal)
    if key is not None:
        _OPTIONS.put(key, found)
    return found


def _traced_results(result, q, return_probs):
    """``attention()``'s result in FlashAttention's form (``S_dmask`` empty without dropout;
    ``softmax_lse`` not differentiable, as the eager path marks it)."""
    if not return_probs:
        return result
    out, lse = result
    return out, lse.detach(), q.new_empty(0)


def _results(ctx, out, lse, probs, return_softmax):
    if not return_softmax:
        return out
    ctx.mark_non_differentiable(lse, probs)
    return out, lse, probs


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax):
        left, right = window_pair(window_size)
        out, _, _, _, lse, seed, offset, probs = mha_fwd(
            q, k, v, None, alibi_slopes, dropout_p, softmax_scale, causal, left, right, softcap,
            return_softmax and dropout_p > 0, None)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.args = (alibi_slopes, dropout_p, softmax_scale, causal, left, right, softcap,
                    deterministic)
        return _results(ctx, out, lse, probs, return_softmax)

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        alibi, p, scale, causal, left, right, softcap, deterministic = ctx.args
        dq, dk, dv = dense_gradients(dout, q, k, v, out, lse, None, None, None, alibi, p,
                                     scale, causal, left, right, softcap, deterministic, seed,
                                     offset)
        return dq, dk, dv, *([None] * 8)


class _FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, block_table):
        left, right = window_pair(window_size)
        out, _, _, _, lse, seed, offset, probs = mha_varlen_fwd(
            q, k, v, None, cu_seqlens_q, cu_seqlens_k, None, block_table, alibi_slopes,
            max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, False, causal, left, right,
            softcap, return_softmax and dropout_p > 0, None)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seed, offset)
        ctx.args = (alibi_slopes, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                    left, right, softcap, deterministic)
        ctx.paged = block_table is not None
        return _results(ctx, out, lse, probs, return_softmax)

    @staticmethod
    def backward(ctx, dout, *_):
        if ctx.paged:
            raise NotSupportedError(
                "flash_attn_varlen_func backward",
                {"flash_attn": ["the backward through a paged KV cache (block_table) is not "
                                "supported, as in FlashAttention: pass dense k/v to train"]})
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        alibi, max_q, max_k, p, scale, causal, left, right, softcap, deterministic = ctx.args
        dq, dk, dv = varlen_gradients(dout, q, k, v, out, lse, None, None, None, cu_q, cu_k,
                                      alibi, max_q, max_k, p, scale, False, causal, left, right,
                                      softcap, deterministic, seed, offset)
        return dq, dk, dv, *([None] * 13)


@runtime_errors
def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: float | None = None, causal: bool = False, window_size: WindowSize = (-1, -1),
                    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                    deterministic: bool = False, return_attn_probs: bool = False) -> Any:
    """FlashAttention's ``flash_attn_func`` (differentiable in q, k, v).

    Args:
        q: ``[B, S_q, H, D]``; k: ``[B, S_k, H_k, D]``; v: ``[B, S_k, H_k, D_v]`` (``H % H_k ==
            0``: query head ``h`` reads kv head ``h // (H // H_k)``).
        dropout_p: dropout probability on the attention weights (0.0 for evaluation).
        softmax_scale: default ``D ** -0.5``.
        causal: bottom-right aligned: query ``i`` sees keys ``j <= i + S_k - S_q``.
        window_size: ``(left, right)``, ints or 0-d integer tensors; query ``i`` sees keys in
            ``[i + S_k - S_q - left, i + S_k - S_q + right]``, -1 unbounded.
        softcap: ``> 0`` applies ``softcap * tanh(s / softcap)`` to the scores.
        alibi_slopes: fp32 ``[H]`` or ``[B, H]``: adds ``-slope * |i + S_k - S_q - j|``.
        deterministic: ask for a deterministic backward.
        return_attn_probs: also return ``softmax_lse`` ``[B, H, S_q]`` (float32; float64 for
            float64 inputs) and ``S_dmask``, the weights in FlashAttention's encoding (only with
            dropout, else an empty tensor; see ``compat.flash_attn._probs``).

    Returns:
        ``out`` ``[B, S_q, H, D_v]``, or ``(out, softmax_lse, S_dmask)``.

    Equivalent PyTorch (no dropout, H == H_k)::

        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # masked as above
        out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)

    Under ``torch.compile``/``torch.export`` (and FakeTensor/meta inputs) the call runs as
    ``attention()``'s custom ops, without a graph break (``alibi_slopes`` as a bias tensor built
    in the graph), except with ``return_attn_probs`` and dropout (``S_dmask``), which take the
    eager path.
    """
    checks.flag("deterministic", deterministic)  # read only by the backward: check it now
    traced = _traced(q, k, v)
    if traced and _traceable(alibi_slopes, dropout_p, return_attn_probs, q) or \
            not traced and _plain_call((q, k, v), 4, dropout_p, alibi_slopes,
                                       return_attn_probs) and q.shape[1] > 1:
        opts, mask = _options_and_mask(q.shape[-1], dropout_p, softmax_scale, causal,
                                       window_size, softcap, k.shape[1],
                                       q.shape[1] == k.shape[1], traced)
        bias = None if alibi_slopes is None else _alibi_bias(alibi_slopes, q, k)
        with deterministic_calls(deterministic) if deterministic else nullcontext():
            # a deterministic backward, recorded in the problem
            return _traced_results(
                attention(q, k, v, mask=mask, bias=bias, scale=opts.scale,
                          dropout_p=opts.p_dropout, softcap=opts.softcap, layout="bshd",
                          return_lse=bool(return_attn_probs)),
                q, return_attn_probs)
    return _FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                                alibi_slopes, deterministic, return_attn_probs)


def _plain_call(tensors, ndim: int, dropout_p, alibi_slopes, return_attn_probs) -> bool:
    """Whether an eager call of a differentiable function is ``attention()``'s (or
    ``attention_varlen()``'s) as it stands: no dropout (whose seed ``mha_*bwd`` replays), no
    ALiBi slopes, no probabilities or lse returned, q, k, v strided ``ndim``-D tensors (the
    ``mha_*`` route explains a nested or sparse one). The caller adds: more than one query (a
    single query must be bitwise repeatable: the ``mha_*`` route plans it so). Such a call then
    takes the public function's caches (``attention()``'s direct runner; the packed call's kept
    plan) and its autograd node, whose backward reuses the forward's problem: a fraction of the
    ``mha_*`` route's host time."""
    if not (dropout_p == 0 and type(dropout_p) is not bool and alibi_slopes is None
            and return_attn_probs is False):
        return False
    return all(isinstance(t, torch.Tensor) and not t.is_nested and t.layout == torch.strided
               and t.dim() == ndim for t in tensors)


def _many_queries(max_seqlen_q) -> bool:
    """A packed call's bound on its sequences' queries, an int above 1 (``_plain_call``)."""
    return isinstance(max_seqlen_q, int) and type(max_seqlen_q) is not bool and max_seqlen_q > 1


def _unbind(name: str, packed, dim: int, count: int, ndim: int):
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != ndim or packed.shape[dim] != count:
        raise ValueError(f"{name} must be {ndim}-D with {count} at dim {dim}, got shape "
                         f"{tuple(packed.shape)}")
    return packed.unbind(dim)


@runtime_errors
def flash_attn_qkvpacked_func(qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
                              causal: bool = False, window_size: WindowSize = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                              return_attn_probs: bool = False) -> Any:
    """``flash_attn_func`` on ``qkv`` ``[B, S, 3, H, D]`` (differentiable in qkv)."""
    q, k, v = _unbind("qkv", qkv, 2, 3, 5)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


@runtime_errors
def flash_attn_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0,
                             softmax_scale: float | None = None, causal: bool = False,
                             window_size: WindowSize = (-1, -1), softcap: float = 0.0,
                             alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                             return_attn_probs: bool = False) -> Any:
    """``flash_attn_func`` on ``q`` ``[B, S_q, H, D]`` and ``kv`` ``[B, S_k, 2, H_k, D]``."""
    k, v = _unbind("kv", kv, 2, 2, 5)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


@runtime_errors
def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                           window_size: WindowSize = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: torch.Tensor | None = None) -> Any:
    """FlashAttention's ``flash_attn_varlen_func`` on packed sequences (differentiable in q, k, v).

    Args:
        q: ``[total_q, H, D]``; k, v: ``[total_k, H_k, D]`` / ``[total_k, H_k, D_v]``, or paged
            caches ``[num_blocks, page_size, H_k, D]`` with ``block_table`` (forward only).
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` cumulative lengths; sequence ``b`` owns
            queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (keys likewise).
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence.
        block_table: int32 ``[B, max_blocks]``: key ``t`` of sequence ``b`` is row
            ``t % page_size`` of page ``block_table[b, t // page_size]``.
        Others: as ``flash_attn_func``, per sequence (positions local to it).

    Returns:
        ``out`` ``[total_q, H, D_v]``, or ``(out, softmax_lse [H, total_q], S_dmask)``.

    Equivalent PyTorch: ``flash_attn_func`` on each sequence alone, outputs concatenated.

    Under ``torch.compile`` (and strict ``torch.export``) dense-k/v calls run as ``attention_varlen()``'s
    op, as ``flash_attn_func`` does (same exceptions: ``alibi_slopes``, ``S_dmask``). An eager
    call without dropout, ALiBi, returned probabilities or ``block_table``, with
    ``max_seqlen_q > 1``, is ``attention_varlen()``'s call (its kept plan; the backward binds
    what the forward derived from the offsets).
    """
    checks.flag("deterministic", deterministic)  # read only by the backward: check it now
    traced = torch.compiler.is_compiling()
    if block_table is None and (
            traced and _traceable(alibi_slopes, dropout_p, return_attn_probs) or
            not traced and _plain_call((q, k, v), 3, dropout_p, alibi_slopes, return_attn_probs)
            and _many_queries(max_seqlen_q)):
        # Per sequence, bottom-right equals top-left where lengths agree: one alignment for all
        # (eager: the mha_* route's, top-left for self-attention offsets, which cuDNN prefers).
        opts, mask = _options_and_mask(q.shape[-1], dropout_p, softmax_scale, causal,
                                       window_size, softcap, max_seqlen_k,
                                       not traced and cu_seqlens_q is cu_seqlens_k, traced)
        with deterministic_calls(deterministic) if deterministic else nullcontext():
            return _traced_results(
                attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 mask=mask, scale=opts.scale, dropout_p=opts.p_dropout,
                                 softcap=opts.softcap, return_lse=bool(return_attn_probs)),
                q, return_attn_probs)
    return _FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                      softcap, alibi_slopes, deterministic, return_attn_probs,
                                      block_table)


@runtime_errors
def flash_attn_varlen_qkvpacked_func(qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                     dropout_p: float = 0.0, softmax_scale: float | None = None,
                                     causal: bool = False, window_size: WindowSize = (-1, -1), softcap: float = 0.0,
                                     alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                     return_attn_probs: bool = False) -> Any:
    """``flash_attn_varlen_func`` on ``qkv`` ``[total, 3, H, D]`` with one ``cu_seqlens``."""
    q, k, v = _unbind("qkv", qkv, 1, 3, 4)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


@runtime_errors
def flash_attn_varlen_kvpacked_func(q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                    dropout_p: float = 0.0, softmax_scale: float | None = None,
                                    causal: bool = False, window_size: WindowSize = (-1, -1), softcap: float = 0.0,
                                    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
                                    return_attn_probs: bool = False) -> Any:
    """``flash_attn_varlen_func`` on ``q`` ``[total_q, H, D]`` and ``kv`` ``[total_k, 2, H_k, D]``."""
    k, v = _unbind("kv", kv, 1, 2, 4)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)
