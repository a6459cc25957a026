"""NATTEN 0.17's unfused neighborhood ops ``na{1,2,3}d_qk`` / ``na{1,2,3}d_av``, heads-first.

This surface validates NATTEN's arguments and translates them (spatial axes flattened row-major,
a ``masks.Neighborhood``) for ``cudnn_attn.core.unfused_ops.qk`` / ``av``, dispatched to the CuPy
kernels or the torch composites. ``attn`` is ``[B, H, *spatial, prod(kernel)(+extra)]`` with slot
order row-major over the kernel dims, masked (causally cut) slots ``-inf``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ...model import checks
from ...core import unfused_ops
from .common import check_rpb, doc_fields, unfused_geometry

__all__ = ["na1d_qk", "na2d_qk", "na3d_qk", "na1d_av", "na2d_av", "na3d_av"]


# ---------------------------------------------------------------------------------------------
# Unfused (NATTEN 0.17): na*d_qk / na*d_av
# ---------------------------------------------------------------------------------------------

def _nested(op, tensors: dict, extra_name: str, extra, *args):
    """NATTEN 0.17's nested inputs: each component is a whole input of ``op`` (its own batch,
    heads and spatial size); the results are nested the same way. Forward only, as NATTEN."""
    names = list(tensors)
    if not all(isinstance(t, torch.Tensor) and t.is_nested for t in tensors.values()):
        raise ValueError("Expected all inputs to be nested.")
    if any(t.requires_grad for t in tensors.values()):
        raise ValueError("Autograd is not supported for nested tensors.")
    sizes = {t.size(0) for t in tensors.values()}
    if extra is not None:
        if not (isinstance(extra, torch.Tensor) and extra.is_nested):
            raise ValueError(f"Expected all inputs to be nested, but {extra_name} were passed "
                             f"and are not nested.")
        sizes.add(extra.size(0))
    if len(sizes) != 1:
        raise ValueError("Got nested inputs, but they don't match in size.")
    parts = zip(*(tensors[n].unbind() for n in names),
                extra.unbind() if extra is not None else [None] * sizes.pop())
    return torch.nested.nested_tensor([op(*part, *args) for part in parts])


def _na_qk(rank, query, key, kernel_size, dilation, additional_keys, is_causal, rpb):
    if getattr(query, "is_nested", False) or getattr(key, "is_nested", False):
        if rpb is not None and rpb.is_nested:
            raise ValueError("Positional biases cannot be nested.")
        return _nested(lambda q, k, extra: _na_qk(rank, q, k, kernel_size, dilation, extra,
                                                  is_causal, rpb),
                       {"query": query, "key": key}, "additional keys", additional_keys)
    layout = "[B, H, *spatial, D]"
    checks.tensor("query", query, ndim=rank + 3, what=layout, floating=True)
    checks.tensor("key", key, ndim=rank + 3, what=layout, floating=True)
    checks.like("key", key, query, "query", expected=query.shape, what="query's shape")
    B, H, spatial, D = query.shape[0], query.shape[1], tuple(query.shape[2:-1]), query.shape[-1]
    geom = unfused_geometry(spatial, kernel_size, dilation, is_causal)
    if rpb is not None:
        check_rpb(rpb, H, geom.kernel_size, geom.is_causal, query)
    q, k = query.flatten(2, -2), key.flatten(2, -2)
    attn = unfused_ops.qk(q, k, geom, rpb)
    if additional_keys is not None:
        checks.tensor("additional_keys", additional_keys, ndim=4, what="[B, H, n_extra, D]",
                       floating=True)
        checks.like("additional_keys", additional_keys, query, "query",
                     expected=(B, H, additional_keys.shape[2], D), what="[B, H, n_extra, D]")
        attn = torch.cat([attn, unfused_ops.extra_logits(q, additional_keys)], -1)
    return attn.unflatten(2, spatial)


def _na_av(rank, attn, value, kernel_size, dilation, additional_values, is_causal):
    if getattr(attn, "is_nested", False) or getattr(value, "is_nested", False):
        return _nested(lambda a, v, extra: _na_av(rank, a, v, kernel_size, dilation, extra,
                                                  is_causal),
                       {"attn": attn, "value": value}, "additional values", additional_values)
    checks.tensor("value", value, ndim=rank + 3, what="[B, H, *spatial, D]", floating=True)
    checks.tensor("attn", attn, ndim=rank + 3, what="[B, H, *spatial, prod(kernel_size) (+n_extra)]",
                   floating=True)
    checks.like("attn", attn, value, "value")
    B, H, spatial, Dv = value.shape[0], value.shape[1], tuple(value.shape[2:-1]), value.shape[-1]
    geom = unfused_geometry(spatial, kernel_size, dilation, is_causal)
    K = math.prod(geom.kernel_size)
    n = 0
    if additional_values is not None:
        checks.tensor("additional_values", additional_values, ndim=4, what="[B, H, n_extra, D]",
                       floating=True)
        n = additional_values.shape[2]
        checks.like("additional_values", additional_values, value, "value",
                     expected=(B, H, n, Dv), what="[B, H, n_extra, D]")
    checks.shape("attn", attn, (B, H, *spatial, K + n), "[B, H, *spatial, prod(kernel_size) + n_extra]")
    a = attn.flatten(2, -2)
    out = unfused_ops.av(a[..., :K], value.flatten(2, -2), geom)
    if n:
        out = out + a[..., K:] @ additional_values
    return out.unflatten(2, spatial)


_QK_DOC = """Unfused {rank}-D neighborhood logits (NATTEN 0.17 ``na{rank}d_qk``), heads-first, unscaled.

    Args:
        query, key: ``[B, H, {axes}, D]``. kernel_size: odd int(s) > 1; dilation: int(s) >= 1.
        additional_keys: ``[B, H, n_extra, D]``; their logits are appended after the
            ``prod(kernel_size)`` neighborhood slots.
        is_causal: bool or per-axis tuple; causally cut slots hold ``-inf``.
        rpb: ``[H, {rpb}]`` relative positional bias (odd kernels, non-causal), slot key ``j`` of
            query ``i`` reads ``(j - i) / dilation + kernel - 1`` per axis.

    Returns:
        ``attn`` ``[B, H, {axes}, prod(kernel_size) (+ n_extra)]``. Reverse AD (rpb included),
        forward AD and float64 supported. Nested ``query``/``key`` (and ``additional_keys``):
        each component is a whole input, the result is nested alike (forward only, as NATTEN).

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
        (+ attn[..., i, K:] @ additional_values)``. Nested inputs: per component, as ``qk``.
    """


def na1d_qk(query: torch.Tensor, key: torch.Tensor, kernel_size: int | Sequence[int],
            dilation: int | Sequence[int] = 1, additional_keys: torch.Tensor | None = None,
            is_causal: bool | Sequence[bool] = False, rpb: torch.Tensor | None = None) -> torch.Tensor:
    return _na_qk(1, query, key, kernel_size, dilation, additional_keys, is_causal, rpb)


def na2d_qk(query: torch.Tensor, key: torch.Tensor, kernel_size: int | Sequence[int],
            dilation: int | Sequence[int] = 1, additional_keys: torch.Tensor | None = None,
            is_causal: bool | Sequence[bool] = False, rpb: torch.Tensor | None = None) -> torch.Tensor:
    return _na_qk(2, query, key, kernel_size, dilation, additional_keys, is_causal, rpb)


def na3d_qk(query: torch.Tensor, key: torch.Tensor, kernel_size: int | Sequence[int],
            dilation: int | Sequence[int] = 1, additional_keys: torch.Tensor | None = None,
            is_causal: bool | Sequence[bool] = False, rpb: torch.Tensor | None = None) -> torch.Tensor:
    return _na_qk(3, query, key, kernel_size, dilation, additional_keys, is_causal, rpb)


def na1d_av(attn: torch.Tensor, value: torch.Tensor, kernel_size: int | Sequence[int],
            dilation: int | Sequence[int] = 1, additional_values: torch.Tensor | None = None,
            is_causal: bool | Sequence[bool] = False) -> torch.Tensor:
    return _na_av(1, attn, value, kernel_size, dilation, additional_values, is_causal)


def na2d_av(attn: torch.Tensor, value: torch.Tensor, kernel_size: int | Sequence[int],
            dilation: int | Sequence[int] = 1, additional_values: torch.Tensor | None = None,
            is_causal: bool | Sequence[bool] = False) -> torch.Tensor:
    return _na_av(2, attn, value, kernel_size, dilation, additional_values, is_causal)


def na3d_av(attn: torch.Tensor, value: torch.Tensor, kernel_size: int | Sequence[int],
            dilation: int | Sequence[int] = 1, additional_values: torch.Tensor | None = None,
            is_causal: bool | Sequence[bool] = False) -> torch.Tensor:
    return _na_av(3, attn, value, kernel_size, dilation, additional_values, is_causal)


def _document():
    for rank in (1, 2, 3):
        fmt = doc_fields(rank)
        globals()[f"na{rank}d_qk"].__doc__ = _QK_DOC.format(**fmt)
        globals()[f"na{rank}d_av"].__doc__ = _AV_DOC.format(**fmt)


_document()
