"""The engines behind ``torch.library`` custom ops: what torch.compile, torch.export and torch.func see.

Two ops::

    cudnn_attn::attention_forward(q, k, v, bias?, dropout_mask?, lens_q?, lens_kv?, seed?,
                                  float? scale, float dropout_p, float? softcap, str spec)
        -> (out, lse)
    cudnn_attn::attention_backward(dout, dlse?, q, k, v, bias?, dropout_mask?, lens_q?, lens_kv?,
                                   seed?, out, lse, scale?, dropout_p, softcap?, spec)
        -> (dq, dk, dv, dbias)

``spec`` is the call's constants as text (``call_spec``): masks, bias kind, ALiBi slopes, layout,
backend. The scalars are float arguments (Dynamo may trace them as symbols). Tensors are runtime
inputs: the bias or RelPosBias table, padding lengths given as tensors, the dropout seed. Each op has a fake implementation (shapes
only, so FakeTensor and meta inputs propagate and the compiler never looks inside), a vmap rule
(one call per vmapped slice), and the forward has an autograd formula that calls the backward op.
Inside, an op builds the ``AttnProblem`` from its real tensors, asks ``dispatch`` for the plan and
runs it: whatever is data-dependent (lengths read on the host, tile tables) happens there, never
on a traced path. Both ops run with autocast off; ``attention()`` applies the one autocast rule
(``autocast_inputs``) before it calls them.

``torch.func``: ``grad``/``vjp``/``jacrev`` and ``vmap`` go through ``FunctorchAttention`` (an
``autograd.Function`` with ``setup_context``, as functorch requires), whose ``jvp`` is the forward-mode
formula ``forward_tangents`` (no dropout, no softcap, no bias tangent: otherwise a clear error).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
from torch import Tensor

from . import _checks, call_spec, dispatch, execution
from ._checks import default_scale
from .caches import LRU
from .errors import NotSupportedError
from .masks import Padding, RelPosBias, mask_parts, split_bias
from .problem import AttnProblem, accumulator_dtype
from .runtime import DropoutState, Inputs, draw_seed

__all__ = [
    "FunctorchAttention",
    "attention_backward",
    "attention_forward",
    "autocast_inputs",
    "autocast_off",
    "forward_tangents",
    "traced_attention",
]


# (spec, tensor metadata) -> (call, problem, plan): repeated compiled calls skip validation.
_PREPARED = LRU("custom_ops.prepared", maxsize=256)


def _meta(t: Optional[Tensor]):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def autocast_off(device_type: str):
    """A context that turns autocast off on ``device_type`` if it is on (engines pick their own
    accumulation dtypes; autocast must not recast their matmuls)."""
    if _autocast_on(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _autocast_devices() -> frozenset:
    """The device types autocast supports here, asked once at import: ``is_autocast_available``
    cannot be traced by torch.compile before torch 2.13, and the answer never changes."""
    candidates = {"cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla",
                  torch._C._get_privateuse1_backend_name()}
    found = set()
    for device_type in candidates:
        try:
            if torch.amp.is_autocast_available(device_type):
                found.add(device_type)
        except RuntimeError:  # a device type this build does not know
            pass
    return frozenset(found)


_AUTOCAST_DEVICES = _autocast_devices()


def _autocast_on(device_type: str) -> bool:
    return device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type)


def autocast_inputs(q: Tensor, k: Tensor, v: Tensor):
    """The autocast rule: under ``torch.autocast(device, dtype)``, float32/16-bit ``q``, ``k``,
    ``v`` are cast to ``dtype`` (float64 stays float64), as torch SDPA does; the bias keeps its
    dtype. So ``out`` has the autocast dtype and ``lse`` float32, whatever the mask, the backend or
    ``requires_grad``."""
    device_type = q.device.type
    if not _autocast_on(device_type):
        return q, k, v
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in (q, k, v))


def _prepare(spec: str, q, k, v, bias, dropout_mask, lens_q, lens_kv, scalars, *,
             plan: bool = True):
    """``(call, problem, plan)`` of one op call (``scalars``: scale, dropout_p, softcap);
    ``plan=False`` (fake tensors) validates only."""
    call = call_spec.decode(spec)
    scale, dropout_p, softcap = scalars
    key = None
    if plan and not call.runtime_padding:
        key = (spec, scalars, _meta(q), _meta(k), _meta(v), _meta(bias), _meta(dropout_mask),
               torch.are_deterministic_algorithms_enabled(), dispatch.policy_key())
        hit = _PREPARED.get(key)
        if hit is not None:
            return hit
    # Runtime lengths are read here, on the host, when the op runs (never while tracing).
    padding = Padding(lens_q, lens_kv) if call.runtime_padding and plan else None
    bias_arg = RelPosBias(bias) if call.bias_kind == "rpb" else \
        bias if call.bias_kind == "tensor" else None
    problem = AttnProblem.from_tensors(
        q, k, v, mask=call.mask(padding), bias=bias_arg, scale=scale,
        dropout_p=dropout_p, softcap=softcap, layout=call.layout, return_lse=True,
        alibi=call.alibi, dropout_mask=dropout_mask, dropout_scale=call.dropout_scale)
    problem = dataclasses.replace(problem, requires_grad=call.requires_grad,
                                  bias_requires_grad=call.bias_requires_grad)
    entry = (call, problem, dispatch.plan_for(problem, call.backend)[1] if plan else None)
    if key is not None:
        _PREPARED.put(key, entry)
    return entry


def _dropout(problem: AttnProblem, seed: Optional[Tensor]) -> Optional[DropoutState]:
    if problem.dropout_p == 0:
        return None
    if seed is None:
        raise ValueError("a dropout call needs its seed tensor")
    values = seed.tolist()
    return DropoutState(int(values[0]), int(values[1]) if len(values) > 1 else 0)


def _static_shapes(*tensors) -> bool:
    return all(isinstance(d, int) for t in tensors if t is not None for d in t.shape)


# ---------------------------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------------------------

@torch.library.custom_op("cudnn_attn::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                      dropout_mask: Optional[Tensor], lens_q: Optional[Tensor],
                      lens_kv: Optional[Tensor], seed: Optional[Tensor], scale: Optional[float],
                      dropout_p: float, softcap: Optional[float],
                      spec: str) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one attention call described by ``spec`` (see the module doc)."""
    _, problem, plan = _prepare(spec, q, k, v, bias, dropout_mask, lens_q, lens_kv,
                                (scale, dropout_p, softcap))
    inputs = Inputs(q, k, v, bias, _dropout(problem, seed), dropout_mask)
    with autocast_off(q.device.type):
        out, lse = execution.forward(problem, plan, inputs)
    return out.contiguous(), lse.contiguous()


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, bias, dropout_mask, lens_q, lens_kv, seed, scale,
                            dropout_p, softcap, spec):
    call = call_spec.decode(spec)
    scalars = (scale, dropout_p, softcap)
    if _static_shapes(q, k, v, bias, dropout_mask) and all(
            type(x) in (float, int, type(None)) for x in scalars):
        _prepare(spec, q, k, v, bias, dropout_mask, lens_q, lens_kv, scalars,
                 plan=False)  # validates
    if call.layout == "bhsd":
        B, H, S = q.shape[0], q.shape[1], q.shape[2]
        out_shape = (B, H, S, v.shape[3])
    else:
        B, S, H = q.shape[0], q.shape[1], q.shape[2]
        out_shape = (B, S, H, v.shape[3])
    return (q.new_empty(out_shape),
            q.new_empty((B, H, S), dtype=accumulator_dtype(q.dtype)))


@torch.library.custom_op("cudnn_attn::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                       bias: Optional[Tensor], dropout_mask: Optional[Tensor],
                       lens_q: Optional[Tensor], lens_kv: Optional[Tensor],
                       seed: Optional[Tensor], out: Tensor, lse: Tensor,
                       scale: Optional[float], dropout_p: float, softcap: Optional[float],
                       spec: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dbias)``; ``dbias`` is empty unless the spec says the bias needs a grad."""
    _, problem, plan = _prepare(spec, q, k, v, bias, dropout_mask, lens_q, lens_kv,
                                (scale, dropout_p, softcap))
    inputs = Inputs(q, k, v, bias, _dropout(problem, seed), dropout_mask)
    with autocast_off(q.device.type):
        dq, dk, dv, dbias = execution.backward(problem, plan, inputs, out, lse, dout, dlse)
    dbias = q.new_empty(0) if dbias is None else dbias
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dbias.contiguous()


@attention_backward.register_fake
def _attention_backward_fake(dout, dlse, q, k, v, bias, dropout_mask, lens_q, lens_kv, seed,
                             out, lse, scale, dropout_p, softcap, spec):
    call = call_spec.decode(spec)
    dbias = bias.new_empty(bias.shape) if call.bias_requires_grad and bias is not None \
        else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


# -- autograd ----------------------------------------------------------------------------------

def _setup_context(ctx, inputs, output):
    q, k, v, bias, dropout_mask, lens_q, lens_kv, seed, *scalars, spec = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, bias, dropout_mask, lens_q, lens_kv, seed, out, lse)
    ctx.spec, ctx.scalars = spec, tuple(scalars)
    if not call_spec.decode(spec).return_lse:
        ctx.mark_non_differentiable(lse)  # internal: the caller never sees it


def _backward(ctx, dout, dlse):
    q, k, v, bias, dropout_mask, lens_q, lens_kv, seed, out, lse = ctx.saved_tensors
    call = call_spec.decode(ctx.spec)
    if dout is None:
        dout = torch.zeros_like(out)
    if not call.return_lse:
        dlse = None  # lse was internal: nothing can reach it
    dq, dk, dv, dbias = attention_backward(dout.contiguous(), dlse, q, k, v, bias, dropout_mask,
                                           lens_q, lens_kv, seed, out, lse, *ctx.scalars,
                                           ctx.spec)
    return (dq, dk, dv, dbias if call.bias_requires_grad else None,
            None, None, None, None, None, None, None, None)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


# -- vmap: one call per slice (padding lengths, ALiBi slopes and biases stay per batch) ---------

def _slices(tensors, dims, size):
    for i in range(size):
        yield tuple(t if d is None or t is None else t.select(d, i) for t, d in zip(tensors, dims))


def _forward_vmap(info, in_dims, *args):
    *tensors, spec = args
    results = [attention_forward(*part, spec)
               for part in _slices(tensors, in_dims[:-1], info.batch_size)]
    return tuple(torch.stack(r) for r in zip(*results)), (0, 0)


def _backward_vmap(info, in_dims, *args):
    *tensors, spec = args
    results = [attention_backward(*part, spec)
               for part in _slices(tensors, in_dims[:-1], info.batch_size)]
    return tuple(torch.stack(r) for r in zip(*results)), (0, 0, 0, 0)


attention_forward.register_vmap(_forward_vmap)
attention_backward.register_vmap(_backward_vmap)


# ---------------------------------------------------------------------------------------------
# torch.func
# ---------------------------------------------------------------------------------------------

class FunctorchAttention(torch.autograd.Function):
    """The forward op as functorch needs it: ``setup_context``, ``backward``, ``jvp``; vmap is
    generated from the ops' own vmap rules."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q, k, v, bias, dropout_mask, lens_q, lens_kv, seed, scale, dropout_p, softcap,
                spec):
        return attention_forward(q, k, v, bias, dropout_mask, lens_q, lens_kv, seed, scale,
                                 dropout_p, softcap, spec)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup_context(ctx, inputs, output)
        ctx.save_for_forward(*inputs[:8], *output)
        ctx.set_materialize_grads(False)  # an input without a tangent arrives as None

    @staticmethod
    def backward(ctx, dout, dlse):
        # functorch differentiates with create_graph=True; the backward op has no second
        # derivative, so it must not be recorded (it would demand a setup_context of its own).
        with torch.no_grad():
            return _backward(ctx, dout, dlse)

    @staticmethod
    def jvp(ctx, dq, dk, dv, dbias, d_dropout_mask, d_lens_q, d_lens_kv, d_seed, d_scale,
            d_dropout_p, d_softcap, d_spec):
        q, k, v, bias, dropout_mask, lens_q, lens_kv, seed, out, lse = ctx.saved_tensors
        with torch.no_grad():
            d_out, d_lse = forward_tangents(ctx.spec, ctx.scalars, (q, k, v, bias, dropout_mask,
                                                                    lens_q, lens_kv, seed),
                                            out, lse, dq, dk, dv, dbias)
        # An lse the caller does not see is marked non-differentiable: it has no tangent.
        return d_out, d_lse if call_spec.decode(ctx.spec).return_lse else None


def forward_tangents(spec, scalars, tensors, out, lse, dq, dk, dv, dbias):
    """Forward-mode derivative ``(d out, d lse)`` of attention for tangents ``dq, dk, dv``.

    With ``P`` the attention weights, ``s`` the scores and ``delta_i = sum_j P_ij ds_ij``::

        d out_i = sum_j P_ij dv_j + sum_j P_ij ds_ij v_j - delta_i out_i,   d lse_i = delta_i
        ds_ij   = scale * (dq_i . k_j + q_i . dk_j)

    Every ``sum_j P_ij x_j`` is one more attention call of the same problem with ``x`` as the
    values: ``[dv | k | dk | k (x) v | dk (x) v]`` side by side, so the engine that ran the forward
    computes the tangent too. Softcap, dropout and a tangent on the bias make ``ds`` or ``P``
    per-pair and are not supported.
    """
    q, k, v, bias, dropout_mask, lens_q, lens_kv, _seed = tensors
    scale, dropout_p, softcap = scalars
    reasons = []
    if dropout_p > 0 or dropout_mask is not None:
        reasons.append("dropout has no forward-mode formula here")
    if softcap:
        reasons.append("softcap has no forward-mode formula here")
    if dbias is not None:
        reasons.append("a tangent on the bias (tensor or RelPosBias table) is not supported; "
                       "detach it or use reverse mode (torch.func.grad / jacrev)")
    if reasons:
        raise NotSupportedError("cudnn_attn.attention under forward-mode AD (torch.func.jvp, "
                                "torch.autograd.forward_ad)", {"jvp": reasons})
    values = []
    if dv is not None:
        values.append(dv)
    if dq is not None:
        values += [k, _outer(k, v)]
    if dk is not None:
        values += [dk, _outer(dk, v)]
    if not values:
        return torch.zeros_like(out), torch.zeros_like(lse)
    sizes = [x.shape[-1] for x in values]
    inner = call_spec.forward_only(spec)
    sums, _ = attention_forward(q, k, torch.cat(values, -1), bias, None, lens_q, lens_kv, None,
                                scale, 0.0, None, inner)
    parts = list(sums.split(sizes, -1))
    d_out = parts.pop(0) if dv is not None else torch.zeros_like(out)
    delta = out.new_zeros(out.shape[:-1])
    weighted = out.new_zeros(out.shape)
    for tangent, primal in ((dq, None), (dk, q)):
        if tangent is None:
            continue
        keys, products = parts.pop(0), parts.pop(0).unflatten(-1, (k.shape[-1], v.shape[-1]))
        row = tangent if primal is None else primal
        delta = delta + (row * keys).sum(-1)
        weighted = weighted + torch.einsum("...d,...de->...e", row, products)
    scale = default_scale(q.shape[-1]) if scale is None else scale
    delta, weighted = delta * scale, weighted * scale
    d_out = d_out + weighted - delta[..., None] * out
    d_lse = delta if call_spec.decode(spec).layout == "bhsd" else delta.transpose(1, 2)
    return d_out, d_lse.to(lse.dtype).contiguous()


def _outer(a: Tensor, b: Tensor) -> Tensor:
    """Per token, the flattened outer product of the features of ``a`` and ``b``."""
    return (a[..., :, None] * b[..., None, :]).flatten(-2)


# ---------------------------------------------------------------------------------------------
# The traced path of attention()
# ---------------------------------------------------------------------------------------------

def _functorch_active() -> bool:
    return (torch._C._functorch.peek_interpreter_stack() is not None
            or torch.autograd.forward_ad._current_level >= 0)


def _scalar(x):
    """A float op argument (a Python number, a Dynamo symbol or a 0-d tensor's value)."""
    return x if isinstance(x, float) else float(x)


def traced_attention(q, k, v, *, mask, bias, scale, dropout_p, softcap, layout, return_lse,
                     backend, generator):
    """``attention()`` through the custom ops: shape logic and constants only, so Dynamo and
    export trace it without a break; validation runs in the ops' fake implementation."""
    _checks.flag("return_lse", return_lse)  # the spec keeps bool(return_lse): check it here
    q, k, v = autocast_inputs(q, k, v)
    kind, table, alibi = split_bias(bias)
    kind = "none" if kind == "alibi" else kind  # the slopes travel in the spec
    lens_q = lens_kv = None
    for m in mask_parts(mask):
        if isinstance(m, Padding) and m.runtime is not None:
            lens_q, lens_kv = m.runtime
    seed = None
    if isinstance(dropout_p, (int, float, torch.SymFloat)) and not isinstance(dropout_p, bool) \
            and dropout_p > 0:
        seed = draw_seed(generator)
    grad = torch.is_grad_enabled()
    bias_grad = grad and table is not None and table.requires_grad
    # The scalars go as float arguments: the spec keeps only what the compiler holds constant.
    spec = call_spec.encode(
        mask=mask, bias_kind=kind, alibi=alibi, scale=None, dropout_p=0.0, softcap=None,
        layout=layout, backend=backend, return_lse=return_lse,
        requires_grad=bias_grad or (grad and (q.requires_grad or k.requires_grad
                                              or v.requires_grad)),
        bias_requires_grad=bias_grad)
    args = (q, k, v, table, None, lens_q, lens_kv, seed,
            None if scale is None else _scalar(scale), _scalar(dropout_p),
            None if softcap is None else _scalar(softcap), spec)
    if not torch.compiler.is_compiling() and _functorch_active():
        out, lse = FunctorchAttention.apply(*args)
    else:
        out, lse = attention_forward(*args)
    return (out, lse) if return_lse else out
