"""NATTEN-compatible neighborhood attention: the fused ``na1d/na2d/na3d`` (NATTEN 0.21 API, plus
0.17's ``rpb``), the unfused ``na{1,2,3}d_qk`` / ``na{1,2,3}d_av`` (NATTEN 0.17), ``merge_attentions``
and the ``NeighborhoodAttention1D/2D/3D`` modules.

Neighbor rule: NATTEN 0.21 per axis (kernel, stride, dilation, causal), see ``masks.Neighborhood``.
The fused functions run ``cudnn_attn.attention(mask=Neighborhood(...))`` on the flattened tokens, so
they pick the fastest engine (the CuPy kernels on a GPU, the tiled torch engine on CPU). Layouts:

* fused: heads-last ``[B, *spatial, H, D]`` (k/v may have ``H_kv`` heads, ``H % H_kv == 0``);
* unfused: heads-first ``[B, H, *spatial, D]``; ``attn`` is ``[B, H, *spatial, prod(kernel)(+extra)]``
  with slot order row-major over the kernel dims, masked (causally cut) slots ``-inf``.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from . import unfused as _na_unfused
from .modules import NeighborhoodAttention1D, NeighborhoodAttention2D, NeighborhoodAttention3D, is_fna_enabled, is_fused_na_enabled, use_fused_na
from .unfused import NaGeometry
from ...api import attention
from ...masks import Neighborhood
from ...problem import FLOAT_DTYPES

__all__ = [
    "NeighborhoodAttention1D",
    "NeighborhoodAttention2D",
    "NeighborhoodAttention3D",
    "is_fna_enabled",
    "is_fused_na_enabled",
    "merge_attentions",
    "na1d",
    "na1d_av",
    "na1d_qk",
    "na2d",
    "na2d_av",
    "na2d_qk",
    "na3d",
    "na3d_av",
    "na3d_qk",
    "use_fused_na",
]


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def _check_tensor(name, x, rank, layout):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float64, float32, float16 or bfloat16, got {x.dtype}")
    if rank is not None and x.dim() != rank + 3:
        raise ValueError(f"{name} must be {layout} ({rank + 3}-D), got shape {tuple(x.shape)}")


def _check_like(name, x, ref, ref_name="query"):
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} dtype {x.dtype} does not match {ref_name} dtype {ref.dtype}")
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}")


def _check_shape(name, x, expected, what):
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {what} = {tuple(expected)}, got {tuple(x.shape)}")


def _check_scale(scale, head_dim):
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float or None, got {scale!r}")
    return float(scale)


def _check_rpb(rpb, geom: NaGeometry, heads, query):
    _check_tensor("rpb", rpb, None, "")
    if rpb.device != query.device:
        raise ValueError(f"rpb is on {rpb.device} but query is on {query.device}")
    if any(k % 2 == 0 for k in geom.kernel):
        raise ValueError(f"rpb needs odd kernel sizes (NATTEN 0.17), got kernel_size={geom.kernel}")
    if any(geom.causal):
        raise ValueError(f"rpb is not supported with causal masking, got is_causal={geom.causal}")
    expected = (heads, *(2 * k - 1 for k in geom.kernel))
    _check_shape("rpb", rpb, expected, "[heads, 2*kernel_size-1 per axis]")


def _geometry(spatial, kernel_size, stride, dilation, is_causal) -> NaGeometry:
    nb = Neighborhood(spatial, kernel_size, stride, dilation, is_causal)  # validates every rule
    return NaGeometry(nb.spatial_shape, nb.kernel_size, nb.stride, nb.dilation, nb.is_causal)


def _unfused_geometry(spatial, kernel_size, dilation, is_causal) -> NaGeometry:
    geom = _geometry(spatial, kernel_size, 1, dilation, is_causal)
    if any(k % 2 == 0 for k in geom.kernel):
        raise ValueError(f"kernel_size must be odd for the unfused ops (NATTEN 0.17), got "
                         f"{kernel_size!r}")
    return geom


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# merge_attentions
# ---------------------------------------------------------------------------------------------

def merge_attentions(outputs, lses):
    """Merge attention results over disjoint key sets through their log-sum-exps.

    ``outputs[i]`` is ``[B, *S, H, D]`` (heads-last) and ``lses[i]`` ``[B, *S, H]`` (natural log).
    Returns ``(out, lse)`` of attention over the union of the key sets: out in ``outputs[0]``'s
    dtype, lse float32 (float64 if an input is float64). Rows that are ``-inf`` in every input give
    ``out = 0`` and ``lse = -inf`` (never NaN). Differentiable in every output and lse.

    Equivalent PyTorch::

        lse = torch.logsumexp(torch.stack(lses), 0)
        out = sum(torch.exp(l - lse)[..., None] * o for o, l in zip(outputs, lses))
    """
    if not isinstance(outputs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("outputs and lses must be lists of tensors")
    if not outputs or len(outputs) != len(lses):
        raise ValueError(f"outputs and lses must be non-empty and of equal length, got "
                         f"{len(outputs)} and {len(lses)}")
    for i, (o, l) in enumerate(zip(outputs, lses)):
        _check_tensor(f"outputs[{i}]", o, None, "")
        _check_tensor(f"lses[{i}]", l, None, "")
        if o.dim() < 2 or tuple(l.shape) != tuple(o.shape[:-1]):
            raise ValueError(f"lses[{i}] must have shape outputs[{i}].shape[:-1] = "
                             f"{tuple(o.shape[:-1])}, got {tuple(l.shape)}")
        if o.shape != outputs[0].shape:
            raise ValueError(f"outputs[{i}] has shape {tuple(o.shape)}, outputs[0] has "
                             f"{tuple(outputs[0].shape)}")
        if o.device != outputs[0].device or l.device != outputs[0].device:
            raise ValueError(f"outputs[{i}]/lses[{i}] are not on {outputs[0].device}")
    acc = torch.float64 if any(t.dtype == torch.float64 for t in (*outputs, *lses)) else torch.float32
    stacked = torch.stack([l.to(acc) for l in lses])
    peak = stacked.detach().amax(0)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(stacked - peak)                     # -inf rows -> 0, gradient 0
    total = weights.sum(0)
    empty = total == 0
    safe = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, float("-inf")), peak + torch.log(safe))
    coef = weights / safe
    out = sum(c[..., None] * o.to(acc) for c, o in zip(coef.unbind(0), outputs))
    return out.to(outputs[0].dtype), lse


# ---------------------------------------------------------------------------------------------
# Fused: na1d / na2d / na3d
# ---------------------------------------------------------------------------------------------

@functools.cache
def _fused_module():
    """``fallback_kernels.fused`` when the CuPy backend can run, else None."""
    from ...dispatch import get_backend
    try:
        if get_backend("cupy").availability():
            return None
        from ...fallback_kernels import fused
    except (ImportError, KeyError, ValueError):
        return None
    return fused


def _fused_can_run(query, value) -> bool:
    """The fused kernels' own limits (dtype, head dim); outside them the composite runs."""
    from ...fallback_kernels.tiles import FUSED_DTYPES, MAX_HEAD_DIM
    return query.dtype in FUSED_DTYPES and max(query.shape[-1], value.shape[-1]) <= MAX_HEAD_DIM


def _na_rpb(query, key, value, geom: NaGeometry, scale, rpb):
    """NA with RPB; heads-last ``[B, *spatial, H, D]`` in, ``([B, S, H, Dv], [B, S, H])`` out."""
    B, H = query.shape[0], query.shape[-2]
    S = geom.num_tokens
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, rpb))
    if query.is_cuda and not grad and all(s == 1 for s in geom.stride):
        fused = _fused_module()
        if fused is not None and _fused_can_run(query, value):
            out, lse = fused.na_forward(query, key, value, kernel_size=geom.kernel,
                                        stride=geom.stride, dilation=geom.dilation,
                                        is_causal=geom.causal, scale=scale, rpb=rpb)
            return out.reshape(B, S, H, -1), lse.reshape(B, S, H)
    # Exact unfused composite: logits (+rpb) -> softmax -> av; O(S * k) memory, differentiable.
    work = query.dtype if query.dtype in (torch.float64, torch.float32) else torch.float32
    q, k, v = (t.reshape(B, S, t.shape[-2], t.shape[-1]).transpose(1, 2).to(work)
               for t in (query, key, value))
    group = H // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = _na_unfused.qk(q * scale, k, geom, rpb.to(work))
    lse = logits.logsumexp(-1)  # non-causal: every row has prod(kernel) valid slots
    out = _na_unfused.av(torch.softmax(logits, -1), v, geom)
    return out.transpose(1, 2).to(query.dtype), lse.transpose(1, 2).to(_lse_dtype(query.dtype))


def _na(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale, rpb,
        additional_keys, additional_values, return_lse):
    layout = "[B, *spatial, H, D]"
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_tensor(name, t, rank, layout)
    _check_like("key", key, query)
    _check_like("value", value, query)
    B, spatial, H, D = query.shape[0], tuple(query.shape[1:-2]), query.shape[-2], query.shape[-1]
    Hkv, Dv = key.shape[-2], value.shape[-1]
    _check_shape("key", key, (B, *spatial, Hkv, D), "[B, *spatial, H_kv, D] of query")
    _check_shape("value", value, (B, *spatial, Hkv, Dv), "[B, *spatial, H_kv, D_v] of key")
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    geom = _geometry(spatial, kernel_size, stride, dilation, is_causal)
    scale = _check_scale(scale, D)
    if (additional_keys is None) != (additional_values is None):
        raise ValueError("additional_keys and additional_values must be given together")
    S = geom.num_tokens
    if rpb is None:
        nb = Neighborhood(geom.shape, geom.kernel, geom.stride, geom.dilation, geom.causal)
        out, lse = attention(query.reshape(B, S, H, D), key.reshape(B, S, Hkv, D),
                             value.reshape(B, S, Hkv, Dv), mask=nb, scale=scale, layout="bshd",
                             return_lse=True)
        lse = lse.transpose(1, 2)
    else:
        _check_rpb(rpb, geom, H, query)
        out, lse = _na_rpb(query, key, value, geom, scale, rpb)
    if additional_keys is not None:
        _check_tensor("additional_keys", additional_keys, 1, "[B, n_extra, H_kv, D]")
        _check_tensor("additional_values", additional_values, 1, "[B, n_extra, H_kv, D_v]")
        _check_like("additional_keys", additional_keys, query)
        _check_like("additional_values", additional_values, query)
        n = additional_keys.shape[1]
        _check_shape("additional_keys", additional_keys, (B, n, Hkv, D), "[B, n_extra, H_kv, D]")
        _check_shape("additional_values", additional_values, (B, n, Hkv, Dv),
                     "[B, n_extra, H_kv, D_v]")
        extra, extra_lse = attention(query.reshape(B, S, H, D), additional_keys, additional_values,
                                     scale=scale, layout="bshd", return_lse=True)
        out, lse = merge_attentions([out, extra], [lse, extra_lse.transpose(1, 2)])
    out = out.reshape(B, *spatial, H, Dv)
    lse = lse.reshape(B, *spatial, H)
    return (out, lse) if return_lse else out


_FUSED_DOC = """{rank}-D neighborhood attention (NATTEN ``na{rank}d``), heads-last.

    Args:
        query: ``[B, {axes}, H, D]``; key ``[B, {axes}, H_kv, D]``; value ``[B, {axes}, H_kv, D_v]``
            (``H % H_kv == 0``: query head ``h`` reads kv head ``h // (H // H_kv)``).
        kernel_size, stride, dilation: int or {rank}-tuple; ``kernel >= 2``, ``stride <= kernel``,
            ``kernel * dilation <= axis length``.
        is_causal: bool or {rank}-tuple of bools (per axis).
        scale: softmax scale, ``D ** -0.5`` by default.
        rpb: relative positional bias ``[H, {rpb}]`` (NATTEN 0.17; odd kernels, non-causal),
            added after scaling: slot key ``j`` of query ``i`` reads ``(j - i) / dilation +
            kernel - 1`` per axis. Differentiable (unfused exact path when a gradient is needed).
        additional_keys, additional_values: ``[B, n_extra, H_kv, D(_v)]`` keys every query also
            sees; merged with the neighborhood result through the log-sum-exps.
        return_lse: also return ``lse`` ``[B, {axes}, H]``, float32 (float64 for float64 inputs).

    Returns:
        ``out`` ``[B, {axes}, H, D_v]``, or ``(out, lse)``.

    Equivalent PyTorch (``visible`` the NATTEN neighbor mask on the flattened tokens, ``bias`` the
    rpb per (query, key), ``-inf`` off the neighborhood)::

        s = scale * q @ k.transpose(-1, -2) + bias          # per head, tokens flattened
        s = torch.cat([s.masked_fill(~visible, -inf), scale * q @ k_extra.transpose(-1, -2)], -1)
        out = torch.softmax(s, -1) @ torch.cat([v, v_extra]);  lse = s.logsumexp(-1)
    """


def na1d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None,
         rpb=None, additional_keys=None, additional_values=None, return_lse=False):
    return _na(1, query, key, value, kernel_size, stride, dilation, is_causal, scale, rpb,
               additional_keys, additional_values, return_lse)


def na2d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None,
         rpb=None, additional_keys=None, additional_values=None, return_lse=False):
    return _na(2, query, key, value, kernel_size, stride, dilation, is_causal, scale, rpb,
               additional_keys, additional_values, return_lse)


def na3d(query, key, value, kernel_size, stride=1, dilation=1, is_causal=False, scale=None,
         rpb=None, additional_keys=None, additional_values=None, return_lse=False):
    return _na(3, query, key, value, kernel_size, stride, dilation, is_causal, scale, rpb,
               additional_keys, additional_values, return_lse)


# ---------------------------------------------------------------------------------------------
# Unfused (NATTEN 0.17): na*d_qk / na*d_av
# ---------------------------------------------------------------------------------------------

def _na_qk(rank, query, key, kernel_size, dilation, additional_keys, is_causal, rpb):
    layout = "[B, H, *spatial, D]"
    _check_tensor("query", query, rank, layout)
    _check_tensor("key", key, rank, layout)
    _check_like("key", key, query)
    _check_shape("key", key, query.shape, "query's shape")
    B, H, spatial, D = query.shape[0], query.shape[1], tuple(query.shape[2:-1]), query.shape[-1]
    geom = _unfused_geometry(spatial, kernel_size, dilation, is_causal)
    if rpb is not None:
        _check_rpb(rpb, geom, H, query)
    q, k = query.flatten(2, -2), key.flatten(2, -2)
    attn = _na_unfused.qk(q, k, geom, rpb)
    if additional_keys is not None:
        _check_tensor("additional_keys", additional_keys, 1, "[B, H, n_extra, D]")
        _check_like("additional_keys", additional_keys, query)
        _check_shape("additional_keys", additional_keys,
                     (B, H, additional_keys.shape[2], D), "[B, H, n_extra, D]")
        attn = torch.cat([attn, _na_unfused.extra_logits(q, additional_keys)], -1)
    return attn.unflatten(2, spatial)


def _na_av(rank, attn, value, kernel_size, dilation, additional_values, is_causal):
    _check_tensor("value", value, rank, "[B, H, *spatial, D]")
    _check_tensor("attn", attn, rank, "[B, H, *spatial, prod(kernel_size) (+n_extra)]")
    _check_like("attn", attn, value, "value")
    B, H, spatial, Dv = value.shape[0], value.shape[1], tuple(value.shape[2:-1]), value.shape[-1]
    geom = _unfused_geometry(spatial, kernel_size, dilation, is_causal)
    K = geom.num_slots
    n = 0
    if additional_values is not None:
        _check_tensor("additional_values", additional_values, 1, "[B, H, n_extra, D]")
        _check_like("additional_values", additional_values, value, "value")
        n = additional_values.shape[2]
        _check_shape("additional_values", additional_values, (B, H, n, Dv), "[B, H, n_extra, D]")
    _check_shape("attn", attn, (B, H, *spatial, K + n),
                 "[B, H, *spatial, prod(kernel_size) + n_extra]")
    a = attn.flatten(2, -2)
    out = _na_unfused.av(a[..., :K], value.flatten(2, -2), geom)
    if n:
        out = out + a[..., K:] @ additional_values
    return out.unflatten(2, spatial)


_QK_DOC = """Unfused {rank}-D neighborhood logits (NATTEN 0.17 ``na{rank}d_qk``), heads-first, no scaling.

    Args:
        query, key: ``[B, H, {axes}, D]``. kernel_size: odd int(s) > 1; dilation: int(s) >= 1.
        additional_keys: ``[B, H, n_extra, D]``; their logits are appended after the
            ``prod(kernel_size)`` neighborhood slots.
        is_causal: bool or per-axis tuple; causally cut slots hold ``-inf``.
        rpb: ``[H, {rpb}]`` relative positional bias (odd kernels, non-causal), slot key ``j`` of
            query ``i`` reads ``(j - i) / dilation + kernel - 1`` per axis.

    Returns:
        ``attn`` ``[B, H, {axes}, prod(kernel_size) (+ n_extra)]``. Reverse AD (rpb included),
        forward AD and float64 supported.

    Equivalent PyTorch: ``attn[..., i, s] = (q[..., i, :] * k[..., key(i, s), :]).sum(-1) +
    rpb[h, rel(i, s)]``, slots row-major over the kernel dims.
    """

_AV_DOC = """Unfused {rank}-D neighborhood weighting (NATTEN 0.17 ``na{rank}d_av``), heads-first.

    Args:
        attn: ``[B, H, {axes}, prod(kernel_size) (+ n_extra)]`` (e.g. ``softmax(na{rank}d_qk(...))``).
        value: ``[B, H, {axes}, D]``; additional_values ``[B, H, n_extra, D]`` for the trailing
            ``n_extra`` columns of ``attn``. Causally cut slots are ignored.

    Returns:
        ``[B, H, {axes}, D]``: ``out[..., i, :] = sum_s attn[..., i, s] * v[..., key(i, s), :]
        (+ attn[..., i, K:] @ additional_values)``.
    """


def na1d_qk(query, key, kernel_size, dilation=1, additional_keys=None, is_causal=False, rpb=None):
    return _na_qk(1, query, key, kernel_size, dilation, additional_keys, is_causal, rpb)


def na2d_qk(query, key, kernel_size, dilation=1, additional_keys=None, is_causal=False, rpb=None):
    return _na_qk(2, query, key, kernel_size, dilation, additional_keys, is_causal, rpb)


def na3d_qk(query, key, kernel_size, dilation=1, additional_keys=None, is_causal=False, rpb=None):
    return _na_qk(3, query, key, kernel_size, dilation, additional_keys, is_causal, rpb)


def na1d_av(attn, value, kernel_size, dilation=1, additional_values=None, is_causal=False):
    return _na_av(1, attn, value, kernel_size, dilation, additional_values, is_causal)


def na2d_av(attn, value, kernel_size, dilation=1, additional_values=None, is_causal=False):
    return _na_av(2, attn, value, kernel_size, dilation, additional_values, is_causal)


def na3d_av(attn, value, kernel_size, dilation=1, additional_values=None, is_causal=False):
    return _na_av(3, attn, value, kernel_size, dilation, additional_values, is_causal)


def _document():
    axes = {1: "L", 2: "X, Y", 3: "X, Y, Z"}
    rpbs = {1: "2k-1", 2: "2k0-1, 2k1-1", 3: "2k0-1, 2k1-1, 2k2-1"}
    for rank in (1, 2, 3):
        fmt = {"rank": rank, "axes": axes[rank], "rpb": rpbs[rank]}
        globals()[f"na{rank}d"].__doc__ = _FUSED_DOC.format(**fmt)
        globals()[f"na{rank}d_qk"].__doc__ = _QK_DOC.format(**fmt)
        globals()[f"na{rank}d_av"].__doc__ = _AV_DOC.format(**fmt)


_document()
