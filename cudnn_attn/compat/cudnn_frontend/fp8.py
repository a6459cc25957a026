"""The cuDNN frontend's FP8 SDPA builder calls, with cuDNN's argument order and semantics.

``sdpa_fp8(q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o, attrs)``
-> ``(o, stats, amax_s, amax_o)`` and ``sdpa_fp8_backward(q, k, v, o, dO, stats, descale_q,
descale_k, descale_v, descale_o, descale_dO, descale_s, descale_dP, scale_s, scale_dQ, scale_dK,
scale_dV, scale_dP, attrs)`` -> ``(dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dP)``.

* ``q``, ``k``, ``v`` are ``[B, H, S, D]`` in one of ``torch.float8_e4m3fn`` /
  ``torch.float8_e5m2`` (GQA/MQA: ``H_k``, ``H_v`` divide ``H_q``); packed ``[total, H, D]``
  tensors with ``set_cu_seq_len_q/kv`` (or ``set_seq_len_*``) and paged K/V containers with
  ``set_paged_attention_k/v_table`` as ``scaled_dot_product_flash_attention`` takes them.
* Scales and descales are float32 ``[1, 1, 1, 1]`` tensors or Python numbers; the amaxes are
  float32 ``[1, 1, 1, 1]`` tensors, each taken before the scale it precedes. ``o`` is in q's FP8
  type (keyword ``o_dtype=``: another FP8 type, or bf16/fp16 where cuDNN allows it), ``stats``
  ``[B, H_q, S_q, 1]`` float32 natural-log LSE (``None`` with ``set_is_inference(True)``). The
  gradients are in dO's type (keyword ``grad_dtype=``).
* Masks: causal (either alignment), diagonal bands, padding, sink tokens (``set_dSink_token``
  receives the sinks' gradient). No bias, ALiBi or dropout (cuDNN's FP8 graphs have no bias or
  ALiBi; this library does not replay cuDNN's FP8 dropout stream).
* Keyword ``backend=`` ``"auto"`` (cuDNN on a CUDA device where its FP8 limits allow, else the
  torch engine, which computes the same quantization points exactly), ``"cudnn"`` or ``"torch"``.

Equivalent PyTorch of the forward (``cast`` = round to nearest even, saturating; no GQA)::

    s = (q.float() @ k.float().transpose(-1, -2)) * attn_scale * descale_q * descale_k
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    amax_s = p.abs().max()
    o = (cast(p * scale_s, q.dtype).float() @ v.float()) * descale_s * descale_v
    amax_o = o.abs().max();  o = cast(o * scale_o, q.dtype)
"""

from __future__ import annotations

import torch

from ...model import checks
from ...errors import NotSupportedError
from ...core.fp8 import (BACKWARD_SCALES,
    FORWARD_SCALES,
    FP8_DTYPES,
    Fp8Tensors,
    Scale,
    as_scale,
    fp8_problem,
    run_backward,
    run_forward,
)
from ._attrs import SdpaAttributes, SdpaBackwardAttributes
from ._translate import translate
from .attributes import unpage

__all__ = ["sdpa_fp8", "sdpa_fp8_backward"]


def _check_attrs(attrs, cls, fn):
    if not isinstance(attrs, cls):
        raise TypeError(f"{fn}: attrs must be {cls.__name__}, got {type(attrs).__name__}")
    reasons = []
    if attrs.bias is not None:
        reasons.append("sdpa_fp8 takes no bias")
    if attrs.alibi:
        reasons.append("sdpa_fp8 takes no ALiBi mask")
    if attrs.dropout is not None and not (attrs.dropout[0] == "philox" and attrs.dropout[1] == 0):
        reasons.append("FP8 dropout is not implemented by this library (cuDNN's Philox stream "
                       "cannot be replayed elsewhere)")
    if reasons:
        raise NotSupportedError(f"{fn} with {attrs!r}", {"cudnn": reasons, "torch": reasons})


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """One-byte types travel as uint8 (indexing and copies of FP8 are not everywhere)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _lengths(attrs, side: str) -> list[int]:
    for name in (f"seq_len_{side}", f"cu_seq_len_{side}"):
        value = getattr(attrs, name)
        if value is not None:
            return [int(n) for n in (value.tolist() if isinstance(value, torch.Tensor) else value)]
    if attrs.padding is not None:
        value = attrs.padding[0 if side == "q" else 1]
        return [int(n) for n in (value.tolist() if isinstance(value, torch.Tensor) else value)]
    raise ValueError(f"packed [total, H, D] tensors need their lengths: set_cu_seq_len_{side} "
                     f"(or set_seq_len_{side}) with set_padding_mask(True)")


def _to_dense(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """``[total, H, D]`` -> ``[B, H, max(lens), D]`` (zeros past each length)."""
    raw = _bytes(x)
    dense = raw.new_zeros(len(lens), max(max(lens), 1), *raw.shape[1:])
    start = 0
    for b, n in enumerate(lens):
        dense[b, :n] = raw[start:start + n]
        start += n
    return dense.transpose(1, 2).view(x.dtype)


def _to_packed(x: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """``[B, H, S, D]`` -> ``[sum(lens), H, D]``."""
    raw = _bytes(x).transpose(1, 2)
    return torch.cat([raw[b, :n] for b, n in enumerate(lens)]).view(x.dtype)


def _sinks(attrs, heads_q: int, device):
    if attrs.sink_token is None:
        return None
    if attrs.sink_token.numel() != heads_q:
        raise ValueError(f"set_sink_token: sink_token must have H_q = {heads_q} elements, got "
                         f"shape {tuple(attrs.sink_token.shape)}")
    return attrs.sink_token.detach().to(device=device, dtype=torch.float32).reshape(heads_q)


def _dense_kv(attrs, q, k, v):
    """Paged K/V containers gathered through the page tables (dense ``[B, H, S_kv, D]``)."""
    if getattr(attrs, "k_table", None) is None and getattr(attrs, "v_table", None) is None:
        return k, v
    dk, dv = unpage(attrs, q, _bytes(k), _bytes(v))
    return dk.view(k.dtype), dv.view(v.dtype)


def sdpa_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descale_q: Scale,
             descale_k: Scale, descale_v: Scale, descale_s: Scale, scale_s: Scale, scale_o: Scale,
             attrs: SdpaAttributes, *, o_dtype: torch.dtype | None = None,
             backend: str = "auto",
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(o, stats, amax_s, amax_o)`` of cuDNN's FP8 forward (module doc)."""
    _check_attrs(attrs, SdpaAttributes, "sdpa_fp8")
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.tensor(name, t, dtypes=FP8_DTYPES)
    q, k, v = (t.detach() for t in (q, k, v))
    if all(t.dim() == 3 for t in (q, k, v)):  # packed [total, H, D]
        lens_q, lens_kv = _lengths(attrs, "q"), _lengths(attrs, "kv")
        o, stats, amax_s, amax_o = sdpa_fp8(
            _to_dense(q, lens_q), _to_dense(k, lens_kv), _to_dense(v, lens_kv), descale_q,
            descale_k, descale_v, descale_s, scale_s, scale_o, attrs, o_dtype=o_dtype,
            backend=backend)
        stats = None if stats is None else _to_packed(stats, lens_q)
        return _to_packed(o, lens_q), stats, amax_s, amax_o
    k, v = _dense_kv(attrs, q, k, v)
    mask, _, _ = translate(attrs, q, k, v)
    sinks = _sinks(attrs, q.shape[1], q.device)
    problem = fp8_problem(q, k, v, mask=mask, scale=attrs.attn_scale, out=o_dtype,
                          sink=sinks is not None)
    values = (descale_q, descale_k, descale_v, descale_s, scale_s, scale_o)
    scales = {n: as_scale(n, x, q.device) for n, x in zip(FORWARD_SCALES, values)}
    o, stats, amax_s, amax_o = run_forward(problem, Fp8Tensors(q, k, v, scales, sinks), backend)
    return o, (stats if attrs.generate_stats else None), amax_s, amax_o


def _check_backward(q, v, o, dO, stats):
    checks.tensor("o", o, dtypes=FP8_DTYPES + (torch.bfloat16, torch.float16))
    checks.tensor("dO", dO, dtypes=FP8_DTYPES)
    checks.tensor("stats", stats, dtypes=(torch.float32,))
    want = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    for name, t in (("o", o), ("dO", dO)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape [B, H_q, S_q, D_v] = {list(want)}, got "
                             f"{tuple(t.shape)}")
    if tuple(stats.shape) not in (want[:3] + (1,), want[:3]):
        raise ValueError(f"stats must be [B, H_q, S_q, 1] = {list(want[:3]) + [1]}, got "
                         f"{tuple(stats.shape)}")
    for name, t in (("o", o), ("dO", dO), ("stats", stats)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")


def sdpa_fp8_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      dO: torch.Tensor, stats: torch.Tensor, descale_q: Scale, descale_k: Scale,
                      descale_v: Scale, descale_o: Scale, descale_dO: Scale, descale_s: Scale,
                      descale_dP: Scale, scale_s: Scale, scale_dQ: Scale, scale_dK: Scale,
                      scale_dV: Scale, scale_dP: Scale, attrs: SdpaBackwardAttributes, *,
                      grad_dtype: torch.dtype | None = None, backend: str = "auto",
                      ) -> tuple[torch.Tensor, ...]:
    """``(dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dP)`` of cuDNN's FP8 backward; ``attrs``
    describes the forward call (same masks, scale and sinks). ``amax_dP`` is the amax of
    ``dS = P * (dP - D) * attn_scale`` before ``scale_dP``, as cuDNN's graph takes it."""
    fn = "sdpa_fp8_backward"
    _check_attrs(attrs, SdpaBackwardAttributes, fn)
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.tensor(name, t, dtypes=FP8_DTYPES)
    values = (descale_q, descale_k, descale_v, descale_o, descale_dO, descale_s, descale_dP,
              scale_s, scale_dQ, scale_dK, scale_dV, scale_dP)
    if all(t.dim() == 3 for t in (q, k, v)):  # packed [total, H, D]
        lens_q, lens_kv = _lengths(attrs, "q"), _lengths(attrs, "kv")
        q_dense, k_dense, v_dense, o_dense, dO_dense, stats_dense = (
            _to_dense(t, lens) for t, lens in ((q, lens_q), (k, lens_kv), (v, lens_kv),
                                               (o, lens_q), (dO, lens_q), (stats, lens_q)))
        out = sdpa_fp8_backward(q_dense, k_dense, v_dense, o_dense, dO_dense, stats_dense, *values,
                                attrs, grad_dtype=grad_dtype, backend=backend)
        grads = [_to_packed(g, lens) for g, lens in zip(out[:3], (lens_q, lens_kv, lens_kv))]
        return (*grads, *out[3:])
    q, k, v, o, dO, stats = (t.detach() if isinstance(t, torch.Tensor) else t
                             for t in (q, k, v, o, dO, stats))
    _check_backward(q, v, o, dO, stats)
    if attrs.dsink_token is not None and attrs.sink_token is None:
        raise ValueError("set_dSink_token needs set_sink_token (the forward's sinks)")
    mask, _, _ = translate(attrs, q, k, v, backward=True)
    sinks = _sinks(attrs, q.shape[1], q.device)
    problem = fp8_problem(q, k, v, mask=mask, scale=attrs.attn_scale, out=dO.dtype,
                          grad=grad_dtype, o_type=o.dtype, sink=sinks is not None,
                          dsink=attrs.dsink_token is not None)
    scales = {n: as_scale(n, x, q.device) for n, x in zip(BACKWARD_SCALES, values)}
    tensors = Fp8Tensors(q, k, v, scales, sinks, o=o, dO=dO, stats=stats)
    *out, dsink = run_backward(problem, tensors, backend)
    if attrs.dsink_token is not None:
        if attrs.dsink_token.numel() != dsink.numel():
            raise ValueError(f"set_dSink_token: dSink_token must have H_q = {dsink.numel()} "
                             f"elements, got shape {tuple(attrs.dsink_token.shape)}")
        attrs.dsink_token.copy_(dsink.reshape(attrs.dsink_token.shape))
    return tuple(out)
