"""NATTEN-compatible neighborhood attention: the fused ``na1d/na2d/na3d`` (NATTEN 0.21 API, plus
0.17's ``rpb``) and ``merge_attentions``; the unfused ``na{1,2,3}d_qk`` / ``na{1,2,3}d_av``
(NATTEN 0.17) are re-exported from :mod:`.unfused`.

Neighbor rule: NATTEN 0.21 per axis (kernel, stride, dilation, causal), see ``masks.Neighborhood``.
The fused functions run ``cudnn_attn.attention(mask=Neighborhood(...))`` on the flattened tokens, so
they pick the fastest engine (the CuPy kernels on a GPU, the tiled torch engine on CPU). Layouts:

* fused: heads-last ``[B, *spatial, H, D]`` (k/v may have ``H_kv`` heads, ``H % H_kv == 0``);
* unfused: heads-first ``[B, H, *spatial, D]``, see :mod:`.unfused`.

The public namespace ``cudnn_attn.neighborhood`` adds the modules (:mod:`.modules`).
"""

from __future__ import annotations

import torch

from ... import _checks
from ...api import attention
from .common import check_rpb, doc_fields, geometry, neighborhood_attention
from .unfused import na1d_av, na1d_qk, na2d_av, na2d_qk, na3d_av, na3d_qk

__all__ = [
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
]

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
        _checks.tensor(f"outputs[{i}]", o, floating=True)
        _checks.tensor(f"lses[{i}]", l, floating=True)
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

def _na(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale, rpb,
        additional_keys, additional_values, return_lse):
    layout = "[B, *spatial, H, D]"
    for name, t in (("query", query), ("key", key), ("value", value)):
        _checks.tensor(name, t, ndim=rank + 3, what=layout, floating=True)
    B, spatial, H, D = query.shape[0], tuple(query.shape[1:-2]), query.shape[-2], query.shape[-1]
    Hkv, Dv = key.shape[-2], value.shape[-1]
    _checks.like("key", key, query, "query", expected=(B, *spatial, Hkv, D),
                 what="[B, *spatial, H_kv, D] of query")
    _checks.like("value", value, query, "query", expected=(B, *spatial, Hkv, Dv),
                 what="[B, *spatial, H_kv, D_v] of key")
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    geom = geometry(spatial, kernel_size, stride, dilation, is_causal)
    scale = _checks.softmax_scale("scale", scale, D, error=TypeError)
    if (additional_keys is None) != (additional_values is None):
        raise ValueError("additional_keys and additional_values must be given together")
    S = geom.num_tokens
    if rpb is not None:
        _checks.tensor("rpb", rpb, floating=True)
        check_rpb(rpb, H, geom.kernel, geom.causal, query)
    out, lse = neighborhood_attention(query, key, value, geom, scale, rpb)
    if additional_keys is not None:
        _checks.tensor("additional_keys", additional_keys, ndim=4, what="[B, n_extra, H_kv, D]",
                       floating=True)
        _checks.tensor("additional_values", additional_values, ndim=4,
                       what="[B, n_extra, H_kv, D_v]", floating=True)
        n = additional_keys.shape[1]
        _checks.like("additional_keys", additional_keys, query, "query",
                     expected=(B, n, Hkv, D), what="[B, n_extra, H_kv, D]")
        _checks.like("additional_values", additional_values, query, "query",
                     expected=(B, n, Hkv, Dv), what="[B, n_extra, H_kv, D_v]")
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


def _document():
    for rank in (1, 2, 3):
        globals()[f"na{rank}d"].__doc__ = _FUSED_DOC.format(**doc_fields(rank))


_document()
