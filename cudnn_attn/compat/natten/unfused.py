"""Unfused neighborhood attention: NATTEN 0.17's ``qk`` and ``av`` operators, N-d, in torch.

Layout (heads-first, as NATTEN 0.17): ``query/key/value`` are ``[B, H, S, D]`` with the spatial
axes already flattened row-major; ``attn`` is ``[B, H, S, K]`` with ``K = prod(kernel_size)``.
Slot ``(s_0, s_1, ...)`` (row-major over the kernel dims) of query ``i`` holds the key whose axis-``a``
coordinate is ``window_start_a(i) + s_a * dilation_a``, the window being NATTEN's rule
(``_tiles.neighborhood_axis``). A causal window cut at the query keeps its *first* ``count`` slots;
the others are invalid: ``-inf`` in ``qk``, ignored by ``av``, zero gradient everywhere.

RPB (NATTEN 0.17): ``rpb`` is ``[H, 2k_0-1, ...]``; slot ``(i, j)`` reads, per axis,
``(j_a - i_a) / d_a + k_a - 1``.

The torch composites (gather + batched matmul, chunked over queries so the gathered keys stay
bounded) give reverse AD (rpb included), fp64 and forward AD for free. On CUDA tensors, when CuPy
can run, ``qk``/``av`` go through autograd Functions around ``fallback_kernels.unfused``, with
``jvp`` written out (each op is linear in each argument).
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass, field

import torch

from ...torch_engine.tiles import neighborhood_axis

__all__ = [
    "NaGeometry",
    "av",
    "av_torch",
    "extra_logits",
    "na_table",
    "qk",
    "qk_torch",
    "rpb_logits",
]

# Elements of one gathered chunk (B * H * queries * K * D) before the loop moves on.
CHUNK_ELEMENTS = 1 << 24
_KERNEL_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


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


@dataclass
class NaTable:
    """Gather tables: ``keys[i, s]`` flat key index, ``valid[i, s]``, ``rel[i, s]`` flat rpb entry."""

    keys: torch.Tensor
    valid: torch.Tensor
    rel: torch.Tensor
    all_valid: bool
    _copies: dict = field(default_factory=dict, repr=False)

    def on(self, device) -> NaTable:
        device = torch.device(device)
        if device == self.keys.device:
            return self
        if device not in self._copies:
            self._copies[device] = NaTable(self.keys.to(device), self.valid.to(device),
                                           self.rel.to(device), self.all_valid)
        return self._copies[device]


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


@functools.lru_cache(maxsize=128)
def na_table(geom: NaGeometry) -> NaTable:
    """The (cached, CPU) gather tables of ``geom``; ``.on(device)`` copies them once per device."""
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
    table = na_table(geom).on(query.device)
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
    table = na_table(geom).on(attn.device)
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
# CUDA: the unfused RawKernels, behind autograd Functions with jvp
# ---------------------------------------------------------------------------------------------

@functools.cache
def _kernel_module():
    """``fallback_kernels.unfused`` when CUDA and CuPy are present, else None."""
    if not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None:
        return None
    try:
        from ...fallback_kernels import unfused
    except ImportError:
        return None
    return unfused


def _use_kernels(x: torch.Tensor, geom: NaGeometry) -> bool:
    # The kernels implement NATTEN 0.17's ops: no stride.
    return (x.is_cuda and x.dtype in _KERNEL_DTYPES and all(s == 1 for s in geom.stride)
            and _kernel_module() is not None)


def _kernel_args(geom: NaGeometry):
    return geom.kernel, geom.dilation, geom.causal


# The kernels take NATTEN's spatial layout ``[B, H, *spatial, C]``; the composites here work on
# flattened tokens ``[B, H, S, C]``. Both are views of the same contiguous memory.
def _spatial(x: torch.Tensor, geom: NaGeometry) -> torch.Tensor:
    return x.contiguous().view(*x.shape[:2], *geom.shape, x.shape[-1])


def _tokens(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(2, -2)


def _qk_kernel(query, key, rpb, geom):
    return _tokens(_kernel_module().qk_forward(_spatial(query, geom), _spatial(key, geom), rpb,
                                               *_kernel_args(geom)))


def _av_kernel(attn, value, geom):
    return _tokens(_kernel_module().av_forward(_spatial(attn, geom), _spatial(value, geom),
                                               *_kernel_args(geom)))


class _QKKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, rpb, geom):
        attn = _qk_kernel(query, key, rpb, geom)
        ctx.geom, ctx.has_rpb = geom, rpb is not None
        ctx.save_for_backward(query, key)
        ctx.save_for_forward(query, key)
        return attn

    @staticmethod
    def backward(ctx, d_attn):
        query, key = ctx.saved_tensors
        geom = ctx.geom
        need_rpb = ctx.has_rpb and ctx.needs_input_grad[2]
        dq, dk, drpb = _kernel_module().qk_backward(
            _spatial(d_attn, geom), _spatial(query, geom), _spatial(key, geom),
            *_kernel_args(geom), need_rpb)
        return _tokens(dq), _tokens(dk), drpb, None

    @staticmethod
    def jvp(ctx, dq, dk, drpb, _geom):
        # qk is bilinear in (q, k) and affine in rpb: d attn = qk(dq, k) + qk(q, dk) + rpb(drpb).
        query, key = ctx.saved_tensors
        geom = ctx.geom
        table = na_table(geom).on(query.device)
        tangent = torch.zeros(*query.shape[:3], geom.num_slots, dtype=query.dtype,
                              device=query.device)
        if dq is not None:
            tangent = tangent + _qk_kernel(dq, key, None, geom)
        if dk is not None:
            tangent = tangent + _qk_kernel(query, dk, None, geom)
        if drpb is not None:
            tangent = tangent + rpb_logits(drpb, table).to(tangent.dtype)
        return torch.where(table.valid, tangent, 0.0)  # the -inf slots are constant


class _AVKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn, value, geom):
        out = _av_kernel(attn, value, geom)
        ctx.geom = geom
        ctx.save_for_backward(attn, value)
        ctx.save_for_forward(attn, value)
        return out

    @staticmethod
    def backward(ctx, d_out):
        attn, value = ctx.saved_tensors
        geom = ctx.geom
        d_attn, d_value = _kernel_module().av_backward(
            _spatial(d_out, geom), _spatial(attn, geom), _spatial(value, geom),
            *_kernel_args(geom))
        return _tokens(d_attn), _tokens(d_value), None

    @staticmethod
    def jvp(ctx, d_attn, d_value, _geom):
        # av is bilinear: d out = av(d_attn, v) + av(attn, d_v).
        attn, value = ctx.saved_tensors
        tangent = torch.zeros(*attn.shape[:3], value.shape[-1], dtype=value.dtype,
                              device=value.device)
        if d_attn is not None:
            tangent = tangent + _av_kernel(d_attn, value, ctx.geom)
        if d_value is not None:
            tangent = tangent + _av_kernel(attn, d_value, ctx.geom)
        return tangent


# ---------------------------------------------------------------------------------------------
# Entry points used by neighborhood.py and the modules (no validation here)
# ---------------------------------------------------------------------------------------------

def qk(query, key, geom: NaGeometry, rpb=None):
    """``[B, H, S, D] x [B, H, S, D] -> [B, H, S, K]`` logits (no scaling), invalid slots -inf."""
    if _use_kernels(query, geom):  # the kernels read rpb in their accumulator dtype
        return _QKKernel.apply(query, key, rpb, geom)
    return qk_torch(query, key, geom, rpb)


def av(attn, value, geom: NaGeometry):
    """``[B, H, S, K] x [B, H, S, Dv] -> [B, H, S, Dv]``; invalid slots ignored."""
    if _use_kernels(value, geom):
        return _AVKernel.apply(attn, value, geom)
    return av_torch(attn, value, geom)


def extra_logits(query, additional_keys):
    """Logits against extra keys every query sees: ``[B, H, S, D] x [B, H, n, D] -> [B, H, S, n]``."""
    return query @ additional_keys.transpose(-1, -2)
