"""Unfused neighborhood attention (NATTEN 0.17's ``qk`` / ``av``) in torch, and the one place that
says which implementation serves a tensor.

Layout (heads-first, as NATTEN 0.17): the token functions (``qk``, ``av``, ``qk_torch``,
``av_torch``) take ``query/key/value`` ``[B, H, S, D]`` with the spatial axes flattened row-major;
``attn`` is ``[B, H, S, K]`` with ``K = prod(kernel_size)``. Slot ``(s_0, s_1, ...)`` (row-major over
the kernel dims) of query ``i`` holds the key whose axis-``a`` coordinate is
``window_start_a(i) + s_a * dilation_a``, the window being NATTEN's rule
(``torch_engine.tiles.neighborhood_axis``). A causal window cut at the query keeps its *first*
``count`` slots; the others are invalid: ``-inf`` in ``qk``, ignored by ``av``, zero gradient.

RPB (NATTEN 0.17): ``rpb`` is ``[H, 2k_0-1, ...]``; slot ``(i, j)`` reads, per axis,
``(j_a - i_a) / d_a + k_a - 1``.

The torch engine of the unfused ops (``TorchUnfusedOps``, dispatched by ``cudnn_attn.core.unfused_ops``
like any engine): the token composites ``qk_torch`` / ``av_torch`` (gather + batched matmul,
chunked over queries so the gathered keys stay bounded; reverse AD, forward AD and float64 for
free) and the launchers' interface (``qk_forward``, ``qk_backward``, ``av_forward``,
``av_backward``: spatial layout ``[B, H, *spatial, C]``) in torch.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..core.caches import memoize
from .tiles import neighborhood_axis

__all__ = [
    "NaGeometry",
    "NaTable",
    "TorchUnfusedOps",
    "av_backward",
    "av_forward",
    "av_torch",
    "na_table",
    "qk_backward",
    "qk_forward",
    "qk_torch",
    "rpb_logits",
]

# Elements of one gathered chunk (B * H * queries * K * D) before the loop moves on.
CHUNK_ELEMENTS = 1 << 24
# Looked up once: torch.compile cannot trace a sys.modules lookup on every call.
_THIS_MODULE = sys.modules[__name__]


class TorchUnfusedOps:
    """The torch engine of the unfused ops: runs every problem (any device, dtype, stride),
    deterministically; its token functions are differentiable composites."""

    name = "torch"

    def supports(self, problem) -> list[str]:
        return []

    @property
    def composites(self):
        """The differentiable token functions ``qk_torch`` / ``av_torch`` (this module)."""
        return _THIS_MODULE

    def launchers(self):
        """``qk_forward``, ``qk_backward``, ``av_forward``, ``av_backward`` in torch."""
        return _THIS_MODULE


# ---------------------------------------------------------------------------------------------
# Geometry and gather tables
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class NaGeometry:
    """Normalised per-axis parameters of one unfused call (all rank-sized tuples)."""

    shape: tuple
    kernel: tuple
    stride: tuple
    dilation: tuple
    causal: tuple

    @property
    def num_slots(self) -> int:
        return math.prod(self.kernel)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, eq=False)
class NaTable:
    """Gather tables: ``keys[i, s]`` flat key index, ``valid[i, s]``, ``rel[i, s]`` flat rpb entry."""

    keys: torch.Tensor
    valid: torch.Tensor
    rel: torch.Tensor
    all_valid: bool


def _axis_slots(length, kernel, stride, dilation, causal):
    """Per-axis ``[L, k]`` key coordinates, validity and rpb offsets, from the library's rule."""
    win = neighborhood_axis(length, kernel, stride, dilation, causal)
    position = torch.empty_like(win.q_order)
    position[win.q_order] = torch.arange(length)         # original -> dilation-grouped position
    lo, hi = win.lo[position], win.hi[position]          # runs are contiguous in grouped order
    reordered = lo[:, None] + torch.arange(kernel)
    valid = reordered < hi[:, None]
    # Invalid (causally cut) slots point at the window's first key so every gather stays in range.
    keys = win.k_order[torch.where(valid, reordered, lo[:, None])]
    rel = (keys - torch.arange(length)[:, None]) // dilation + kernel - 1
    return keys, valid, torch.where(valid, rel, 0)


def _outer(parts, combine, init):
    """``[L_0.., k_0..]`` broadcast of per-axis ``[L_a, k_a]`` tables, reshaped to ``[S, K]``."""
    rank = len(parts)
    total = init
    for a, t in enumerate(parts):
        view = [1] * (2 * rank)
        view[a], view[rank + a] = t.shape
        total = combine(total, t.view(view))
    shape = [p.shape[0] for p in parts] + [p.shape[1] for p in parts]
    total = total.expand(shape)
    return total.reshape(math.prod(shape[:rank]), -1)


def na_table(geom: NaGeometry, device=None) -> NaTable:
    """The gather tables of ``geom`` on ``device`` (CPU by default), built once and copied once per
    device (both cached). Under torch.compile / export they are constants of the graph."""
    if torch.compiler.is_compiling():
        table = _constant_table(geom.shape, geom.kernel, geom.stride, geom.dilation, geom.causal)
        if device is None or torch.device(device) == table.keys.device:
            return table
        return NaTable(table.keys.to(device), table.valid.to(device), table.rel.to(device),
                       table.all_valid)
    table = _cpu_table(geom)
    if device is None or torch.device(device) == table.keys.device:
        return table
    return _table_on(geom, torch.device(device))


@memoize("torch_engine.neighborhood_ops.device_tables", 128)
def _table_on(geom: NaGeometry, device: torch.device) -> NaTable:
    table = _cpu_table(geom)
    return NaTable(table.keys.to(device), table.valid.to(device), table.rel.to(device),
                   table.all_valid)


@torch.compiler.assume_constant_result
def _constant_table(shape, kernel, stride, dilation, causal) -> NaTable:
    # Called by Dynamo at trace time with constant arguments; the result is baked in.
    return _cpu_table(NaGeometry(shape, kernel, stride, dilation, causal))


@memoize("torch_engine.neighborhood_ops.na_table", 128)
def _cpu_table(geom: NaGeometry) -> NaTable:
    # Real tensors even when a trace (FakeTensor, export) is running: the tables are cached.
    with _disable_current_modes():
        return _build_table(geom)


def _build_table(geom: NaGeometry) -> NaTable:
    axes = [_axis_slots(*a) for a in zip(geom.shape, geom.kernel, geom.stride, geom.dilation,
                                          geom.causal)]
    rank = len(axes)
    strides = [math.prod(geom.shape[a + 1:]) for a in range(rank)]
    rel_strides = [math.prod(2 * k - 1 for k in geom.kernel[a + 1:]) for a in range(rank)]
    zero, true = torch.zeros((), dtype=torch.long), torch.ones((), dtype=torch.bool)
    keys = _outer([k * s for (k, _, _), s in zip(axes, strides)], torch.add, zero)
    valid = _outer([v for _, v, _ in axes], torch.logical_and, true)
    rel = _outer([r * s for (_, _, r), s in zip(axes, rel_strides)], torch.add, zero)
    return NaTable(keys.contiguous(), valid.contiguous(), rel.contiguous(), bool(valid.all()))


# ---------------------------------------------------------------------------------------------
# Torch composites on flattened tokens
# ---------------------------------------------------------------------------------------------

def _chunk(rows: int, per_row: int) -> int:
    return max(1, min(rows, CHUNK_ELEMENTS // max(per_row, 1)))


def _gather(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``x[:, :, keys]`` for ``x`` ``[B, H, S, D]`` and ``keys`` ``[C, K]`` -> ``[B, H, C, K, D]``."""
    return x.index_select(2, keys.reshape(-1)).unflatten(2, tuple(keys.shape))


def rpb_logits(rpb: torch.Tensor, table: NaTable) -> torch.Tensor:
    """``[H, S, K]`` bias per slot (0 at invalid slots; they are masked anyway)."""
    return rpb.flatten(1)[:, table.rel]


def qk_torch(query, key, geom: NaGeometry, rpb=None):
    """Composite ``qk``: ``attn[b, h, i, s] = <q_i, k_{key(i, s)}> (+ rpb)``; invalid slots -inf."""
    table = na_table(geom, query.device)
    B, H, S, D = query.shape
    step = _chunk(S, B * H * geom.num_slots * D)
    parts = []
    for c0 in range(0, S, step):
        kg = _gather(key, table.keys[c0:c0 + step])
        parts.append(torch.einsum("bhcd,bhckd->bhck", query[:, :, c0:c0 + step], kg))
    attn = torch.cat(parts, 2) if len(parts) > 1 else parts[0]
    if rpb is not None:
        attn = attn + rpb_logits(rpb, table).to(attn.dtype)
    if not table.all_valid:
        attn = attn.masked_fill(~table.valid, float("-inf"))
    return attn


def av_torch(attn, value, geom: NaGeometry):
    """Composite ``av``: ``out[b, h, i] = sum_s attn[b, h, i, s] * v_{key(i, s)}`` over valid slots."""
    table = na_table(geom, attn.device)
    B, H, S, _ = attn.shape
    if not table.all_valid:
        attn = attn.masked_fill(~table.valid, 0.0)
    step = _chunk(S, B * H * geom.num_slots * value.shape[-1])
    parts = []
    for c0 in range(0, S, step):
        vg = _gather(value, table.keys[c0:c0 + step])
        parts.append(torch.einsum("bhck,bhckd->bhcd", attn[:, :, c0:c0 + step], vg))
    return torch.cat(parts, 2) if len(parts) > 1 else parts[0]


# ---------------------------------------------------------------------------------------------
# The launchers' interface in torch (spatial layout ``[B, H, *spatial, C]``, tuples per axis)
# ---------------------------------------------------------------------------------------------

def _launcher_geometry(x: torch.Tensor, kernel_size, dilation, is_causal) -> NaGeometry:
    spatial = tuple(x.shape[2:-1])
    return NaGeometry(spatial, tuple(kernel_size), (1,) * len(spatial), tuple(dilation),
                      tuple(bool(c) for c in is_causal))


def _store(result: torch.Tensor, out) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def qk_forward(query, key, rpb, kernel_size, dilation, is_causal, attn=None):
    """``fallback_kernels.unfused.qk_forward`` in torch (no grad): ``[B, H, *S, prod(kernel)]``."""
    geom = _launcher_geometry(query, kernel_size, dilation, is_causal)
    with torch.no_grad():
        result = qk_torch(query.flatten(2, -2), key.flatten(2, -2), geom, rpb).unflatten(2, geom.shape)
    return _store(result, attn)


def qk_backward(d_attn, query, key, kernel_size, dilation, is_causal, need_rpb_grad):
    """``fallback_kernels.unfused.qk_backward`` in torch: ``(dq, dk, drpb or None)``."""
    geom = _launcher_geometry(query, kernel_size, dilation, is_causal)
    with torch.enable_grad():
        q, k = (t.detach().flatten(2, -2).requires_grad_(True) for t in (query, key))
        # The bias gradient does not depend on the bias value: a zero rpb makes autograd give it.
        rpb = None
        if need_rpb_grad:
            rpb = torch.zeros(query.shape[1], *(2 * x - 1 for x in geom.kernel), dtype=query.dtype,
                              device=query.device, requires_grad=True)
        attn = qk_torch(q, k, geom, rpb)
        dq, dk, *drpb = torch.autograd.grad(attn, [q, k] + ([rpb] if rpb is not None else []),
                                            d_attn.flatten(2, -2), allow_unused=True)
    dq = torch.zeros_like(query) if dq is None else dq.unflatten(2, geom.shape)
    dk = torch.zeros_like(key) if dk is None else dk.unflatten(2, geom.shape)
    return dq, dk, (drpb[0] if drpb else None)


def av_forward(attn, value, kernel_size, dilation, is_causal, out=None):
    """``fallback_kernels.unfused.av_forward`` in torch (no grad): ``[B, H, *S, D_v]``."""
    geom = _launcher_geometry(value, kernel_size, dilation, is_causal)
    with torch.no_grad():
        result = av_torch(attn.flatten(2, -2), value.flatten(2, -2), geom).unflatten(2, geom.shape)
    return _store(result, out)


def av_backward(d_out, attn, value, kernel_size, dilation, is_causal):
    """``fallback_kernels.unfused.av_backward`` in torch: ``(d_attn, d_value)``."""
    geom = _launcher_geometry(value, kernel_size, dilation, is_causal)
    with torch.enable_grad():
        a, v = (t.detach().flatten(2, -2).requires_grad_(True) for t in (attn, value))
        out = av_torch(a, v, geom)
        da, dv = torch.autograd.grad(out, (a, v), d_out.flatten(2, -2), allow_unused=True)
    da = torch.zeros_like(attn) if da is None else da.unflatten(2, geom.shape)
    dv = torch.zeros_like(value) if dv is None else dv.unflatten(2, geom.shape)
    return da, dv
