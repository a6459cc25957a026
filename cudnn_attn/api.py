"""The unified entry points: ``attention()`` and ``explain()``, and the autograd wrapper."""

from __future__ import annotations


from typing import Literal, Optional, overload

import torch

from .tracing import custom_ops
from .core import dispatch, execution
from .core.explanation import Explanation
from .core.caches import LRU
from .model.masks import (Alibi, Causal, Mask, MaskSet, Padding, RelPosBias, SlidingWindow,
                          split_bias)
from .model.problem import AttnProblem, deterministic_requested
from .rewrites.kv_heads import head_counts_differ, repeat_to_common_heads
from .model.inputs import DropoutState, Inputs
from .rewrites.sinks import check_sinks, merge_sinks

__all__ = ["attention", "explain", "Explanation"]

# Global switches _through_ops reads on every eager call (bound once: attribute lookups add up).
_autocast_on = torch._C._is_any_autocast_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_level = torch._C._functorch.peek_interpreter_stack
_forward_ad = torch.autograd.forward_ad
_deterministic = torch.are_deterministic_algorithms_enabled
_deterministic_requested = deterministic_requested  # a surface's per-call request (NATTEN's)
_is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor

# Recently used call signatures -> (problem, plan, direct runner or None). A hit skips validation
# and dispatch, which is most of the per-call cost on small problems.
_CALLS = LRU("api.calls", maxsize=256)
# Stride-free signatures -> direct runner, for the calls that have one: reading three strides and
# hashing them is a tenth of a tiny call's time. A runner whose plan depends on strides (cuDNN's:
# its graphs were built for them) compares them itself and answers None for others, as it does
# for any call it cannot take; the call then takes the full path (the torch engine's runners,
# calling torch SDPA, serve any strides).
_DIRECT = LRU("api.direct_calls", maxsize=256)


def _signature(q, k, v, mask, padding, bias, scale, dropout_p, softcap, layout, return_lse,
               backend):
    """A flat, hashable summary of a call, strides aside (``padding``: ``mask``'s runtime
    ``Padding``, if any); ``None`` when an argument is not what it should be (validation then
    explains what is wrong)."""
    if bias is None:
        bias_key = None
    else:
        try:
            kind, t, alibi = split_bias(bias)
        except TypeError:
            return None
        bias_key = alibi if t is None else \
            (kind, t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
    if padding is not None:
        # Runtime Paddings of one batch size compare equal (their tensors are values, not
        # keys): the cached problem, holding another call's lengths, gets this call's
        # (AttnProblem.rebound). The lengths' shapes are what validation checked.
        mask = (mask, padding.runtime[0].shape, padding.runtime[1].shape)
    if type(scale) is bool or type(dropout_p) is bool or type(softcap) is bool \
            or type(return_lse) is not bool:
        # True == 1 == 1.0 hash alike: a valid call (scale=1.0) must not vouch for an invalid one.
        return None
    try:
        # No tensor types: only plain torch.Tensor inputs get here (_through_ops).
        return (q.layout, k.layout, v.layout,  # a sparse q must not find a dense call's runner
                q.shape, q.dtype, q.device, q.requires_grad,
                k.shape, k.dtype, k.device, k.requires_grad,
                v.shape, v.dtype, v.device, v.requires_grad,
                mask, bias_key, scale, dropout_p, softcap, layout, return_lse, backend,
                _deterministic(), _deterministic_requested(), dispatch.policy_key())
    except (AttributeError, TypeError, RuntimeError):  # RuntimeError: a nested tensor's shape
        return None


def _run_direct(direct, q, k, v, bias, dropout_p, generator, padding=None):
    """``direct(q, k, v)``; with a bias tensor ``direct(q, k, v, bias)`` (ALiBi's slopes live in
    the plan); with dropout ``direct(q, k, v, bias or None, generator)`` (the runner draws the
    call's seed); with runtime ``Padding`` lengths ``direct(q, k, v, bias or None, generator,
    padding)``: the per-call operands a runner takes besides q, k, v. ``None``: the runner
    cannot take this call."""
    table = bias if isinstance(bias, _Tensor) else None
    if padding is not None:  # only a runner that takes_lengths is kept for such a call
        return direct(q, k, v, table, generator, padding)
    if dropout_p:  # a runner exists only for a signature whose dropout_p was validated
        return direct(q, k, v, table, generator)
    return direct(q, k, v) if table is None else direct(q, k, v, table)


def _runtime_padding(mask) -> Optional[Padding]:
    """The ``Padding`` of ``mask`` whose lengths are runtime tensors, if any."""
    if mask is None:
        return None
    kind = type(mask)
    if kind is Padding:
        return mask if mask.runtime is not None else None
    if kind is MaskSet:
        parts = mask.members
    elif kind in _SIMPLE_MASKS:
        return None
    else:
        parts = mask.parts() if isinstance(mask, Mask) else ()
    for m in parts:
        if isinstance(m, Padding) and m.runtime is not None:
            return m
    return None


_SIMPLE_MASKS = frozenset({Causal, SlidingWindow})


def _cached(signature, q, k, v):
    """The ``(problem, plan, direct runner or None)`` an earlier call with this signature and
    these strides prepared, or ``None``."""
    if signature is None:
        return None
    try:
        return _CALLS.get((signature, q.stride(), k.stride(), v.stride()))
    except TypeError:  # unhashable argument: let validation explain it
        return None


def _prepare(q, k, v, mask, bias, scale, dropout_p, softcap, layout, return_lse, backend,
             signature, padding):
    """``(problem, plan, direct runner or None)`` of a call whose ``_signature`` is given
    (``padding``: its runtime ``Padding``, if any)."""
    key = None if signature is None else (signature, q.stride(), k.stride(), v.stride())
    try:
        cached = _CALLS.get(key) if key is not None else None
    except TypeError:  # unhashable argument: let validation explain it
        key, cached = None, None
    if cached is not None:
        return cached
    problem = AttnProblem.from_tensors(q, k, v, mask=mask, bias=bias, scale=scale,
                                       dropout_p=dropout_p, softcap=softcap, layout=layout,
                                       return_lse=return_lse)
    plan = dispatch.plan_for(problem, backend)[1]
    # A call that needs no lse and no gradient may run through one public op (the plan says).
    direct = execution.direct_runner(problem, plan)
    if direct is not None and padding is not None \
            and not getattr(direct, "takes_lengths", False):
        direct = None  # a runner bound to this call's lengths would serve the next with them
    if direct is not None and key is not None:
        _DIRECT.put(signature, direct)
    entry = (problem, plan, direct)
    if key is not None:
        _CALLS.put(key, entry)
    return entry


def _through_ops(q, k, v) -> bool:
    """Whether this call must go through the custom ops: it is traced (torch.compile, export,
    FakeTensor or meta inputs, a dispatch mode), under torch.func or forward-mode AD, or under
    autocast. Plain eager calls run the same plan directly, with less per-call overhead."""
    if _is_compiling():
        return True
    if type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor:
        return (q.is_meta or _autocast_on() or _dispatch_modes() > 0
                or _functorch_level() is not None or _forward_ad._current_level >= 0)
    # A tensor subclass (FakeTensor, FunctionalTensor, ...) is traced; anything else is not a
    # tensor and validation explains what is wrong.
    return isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) \
        and isinstance(v, torch.Tensor)


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Mask | None = ...,
              bias: torch.Tensor | Alibi | RelPosBias | None = ..., scale: float | None = ...,
              dropout_p: float = ..., softcap: float | None = ..., layout: str = ...,
              return_lse: Literal[False] = ..., backend: str = ...,
              generator: torch.Generator | None = ..., sinks: torch.Tensor | None = ...,
              ) -> torch.Tensor: ...


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Mask | None = ...,
              bias: torch.Tensor | Alibi | RelPosBias | None = ..., scale: float | None = ...,
              dropout_p: float = ..., softcap: float | None = ..., layout: str = ...,
              return_lse: Literal[True], backend: str = ...,
              generator: torch.Generator | None = ..., sinks: torch.Tensor | None = ...,
              ) -> tuple[torch.Tensor, torch.Tensor]: ...


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Mask | None = ...,
              bias: torch.Tensor | Alibi | RelPosBias | None = ..., scale: float | None = ...,
              dropout_p: float = ..., softcap: float | None = ..., layout: str = ...,
              return_lse: bool = ..., backend: str = ...,
              generator: torch.Generator | None = ..., sinks: torch.Tensor | None = ...,
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Mask | None = None,
              bias: torch.Tensor | Alibi | RelPosBias | None = None, scale: float | None = None,
              dropout_p: float = 0.0, softcap: float | None = None, layout: str = "bhsd",
              return_lse: bool = False, backend: str = "auto",
              generator: torch.Generator | None = None, sinks: torch.Tensor | None = None,
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact scaled dot-product attention on the fastest backend that can run it.

    Args:
        q: queries, ``[B, H_q, S_q, D_qk]`` (``layout="bhsd"``, as torch SDPA) or
            ``[B, S_q, H_q, D_qk]`` (``layout="bshd"``, as FlashAttention).
        k: keys, ``[B, H_kv, S_kv, D_qk]`` (or bshd). ``H_q % H_kv == 0``: query head ``h``
            reads kv head ``h // (H_q // H_kv)`` (GQA/MQA).
        v: values, ``[B, H_v, S_kv, D_v]`` (or bshd); ``D_v`` may differ from ``D_qk``, and
            ``H_v`` from ``H_kv`` (both divide ``H_q``; query head ``h`` reads value head
            ``h // (H_q // H_v)``).
        mask: ``Causal``, ``SlidingWindow``, ``Neighborhood``, ``Padding`` or an ``&`` of them.
        bias: a float tensor broadcastable to ``[B, H_q, S_q, S_kv]`` added to the scores,
            ``Alibi(slopes=None)``, or ``RelPosBias(table)`` (NATTEN's relative positional bias,
            with a ``Neighborhood`` mask).
        scale: softmax scale; ``D_qk ** -0.5`` by default.
        dropout_p: probability of dropping an attention weight (kept ones scale by
            ``1 / (1 - dropout_p)``); ``generator`` makes it reproducible.
        softcap: ``None``/0 for off; else scores become ``softcap * tanh(scores / softcap)``
            before the bias is added.
        return_lse: also return the natural-log log-sum-exp of the masked scores,
            ``[B, H_q, S_q]``, float32 (float64 for float64 inputs).
        backend: ``"auto"`` (cudnn -> cupy -> torch, first that can run it), or a name; a named
            backend that cannot run the call raises ``NotSupportedError`` with its reasons.
        sinks: attention sinks, one logit per query head (``[H_q]``, differentiable): each row's
            softmax denominator gains ``exp(sinks[h])``, with no value attached (gpt-oss, cuDNN's
            ``sink_token``); the lse includes it. Runs on every engine (``cudnn_attn.rewrites.sinks``).

    Returns:
        ``out`` in the layout of ``q`` with ``D_v`` features, or ``(out, lse)``. A query that sees
        no key gets ``out = 0`` and ``lse = -inf``.

    FP8 (E4M3/E5M2, cuDNN's ``sdpa_fp8`` and its backward) is ``cudnn_attn.attention_fp8`` /
    ``cudnn_attn.FP8Attention``: its inputs come with scales and it returns amaxes for a
    delayed-scaling recipe, which this function's contract has no place for.

    Equivalent PyTorch (bhsd, no GQA; ``visible`` the boolean mask the ``mask`` describes)::

        s = scale * q @ k.transpose(-1, -2)
        if softcap: s = softcap * torch.tanh(s / softcap)
        s = (s + bias).masked_fill(~visible, float("-inf"))
        lse = s.logsumexp(-1)
        out = torch.dropout(torch.softmax(s, -1).nan_to_num(0.0), dropout_p, True) @ v
        # with sinks: lse = torch.logaddexp(lse, sinks[:, None]); out = out * exp(lse0 - lse)

    Under ``torch.compile`` (``fullgraph=True`` included), ``torch.export``, FakeTensor/meta
    inputs, ``torch.func`` and autocast the call runs through the custom ops of ``custom_ops``
    (same engines, same plans). Autocast rule: float32/16-bit ``q, k, v`` are cast to the
    autocast dtype, as torch SDPA does; ``out`` has that dtype, ``lse`` float32.
    """
    if sinks is not None:
        out, lse = attention(q, k, v, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p,
                             softcap=softcap, layout=layout, return_lse=True, backend=backend,
                             generator=generator)
        out, lse = merge_sinks(out, lse, check_sinks(sinks, lse.shape[1], q), layout)
        return (out, lse) if return_lse else out
    traced = _through_ops(q, k, v)
    entry = declined = None
    padding = _runtime_padding(mask)
    if not traced:
        try:
            signature = _signature(q, k, v, mask, padding, bias, scale, dropout_p, softcap,
                                   layout, return_lse, backend)
            direct = _DIRECT.get(signature)
        except TypeError:  # unhashable argument: let validation explain it
            signature = direct = None
        if direct is not None:
            out = direct(q, k, v) if bias is None and not dropout_p and padding is None else \
                _run_direct(direct, q, k, v, bias, dropout_p, generator, padding)
            if out is not None:  # None: a call the runner cannot take
                return out
            declined = direct
        entry = _cached(signature, q, k, v)
    if entry is None:  # a call seen before had equal head counts and was valid: skip both
        if head_counts_differ(q, k, v, layout):  # never cached: its signature names other heads
            return attention(q, *repeat_to_common_heads(q, k, v, layout), mask=mask, bias=bias,
                             scale=scale, dropout_p=dropout_p, softcap=softcap, layout=layout,
                             return_lse=return_lse, backend=backend, generator=generator)
        if traced:
            return custom_ops.traced_attention(
                q, k, v, mask=mask, bias=bias, scale=scale, dropout_p=dropout_p,
                softcap=softcap, layout=layout, return_lse=return_lse, backend=backend,
                generator=generator)
        entry = _prepare(q, k, v, mask, bias, scale, dropout_p, softcap, layout, return_lse,
                         backend, signature, padding)
    problem, plan, direct = entry
    if direct is not None and direct is not declined:
        out = direct(q, k, v) if bias is None and not dropout_p and padding is None else \
            _run_direct(direct, q, k, v, bias, dropout_p, generator, padding)
        if out is not None:
            return out
    if padding is not None and problem.padding is not padding:
        problem = problem.rebound(padding)
    table = split_bias(bias)[1]  # the runtime tensor (Alibi's slopes live in the problem)
    dropout = DropoutState.draw(generator) if problem.dropout_p > 0 else None
    out, lse = execution.run(problem, plan, Inputs(q, k, v, table, dropout), return_lse)
    return (out, lse) if return_lse else out


def explain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Mask | None = None,
            bias: torch.Tensor | Alibi | RelPosBias | None = None, scale: float | None = None,
            dropout_p: float = 0.0, softcap: float | None = None, layout: str = "bhsd",
            return_lse: bool = False, backend: str = "auto",
            generator: torch.Generator | None = None, sinks: torch.Tensor | None = None,
            ) -> Explanation:
    """What each backend says about this call, without running it.

    Takes ``attention()``'s arguments. Malformed input raises as ``attention()`` would; an
    unsupported call does not raise: every verdict is in the result (``print()`` it). Sinks and
    ``H_k != H_v`` run on every engine (as a merge and as repeated heads), so the verdicts are
    those of the call without them.
    """
    if head_counts_differ(q, k, v, layout):
        k, v = repeat_to_common_heads(q, k, v, layout)
    problem = AttnProblem.from_tensors(q, k, v, mask=mask, bias=bias, scale=scale,
                                       dropout_p=dropout_p, softcap=softcap, layout=layout,
                                       return_lse=return_lse)
    if sinks is not None:
        check_sinks(sinks, problem.heads_q, q)
    if backend != "auto":
        dispatch.get_backend(backend)
    verdicts, cost = dispatch.auto_verdicts(problem, backend)  # pure: builds nothing
    engines = {}
    if isinstance(verdicts.get("cudnn"), str):  # cuDNN can run it: its graphs may be cached
        engines = dispatch.get_backend("cudnn").known_engines(problem)
    explanation = Explanation(problem, verdicts, engines, cost)
    notes = getattr(dispatch.get_backend(explanation.selected), "notes", None) \
        if explanation.selected else None
    explanation.notes = notes(problem) if notes else []
    return explanation
