"""The torch engine: exact attention forward (with LSE) and backward on any device and dtype.

It is what CPU users run and the oracle the GPU engines are tested against. Work is organised in
tiles (see ``_tiles``): a tile of queries is scored against the box of keys its masks allow, in
float32 (float64 for float64 inputs), one batched matmul per chunk of tiles. Unmasked and plain
causal problems go through PyTorch's fused CPU kernel when it gives the same result.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Optional

import torch

from ._tiles import (AxisWindows, Tiles, Visibility, build_tiles, choose_tile_shape,
                     neighborhood_axis, sequence_axis)
from .masks import Causal, Neighborhood, SlidingWindow, mask_parts
from .problem import AttnProblem

__all__ = ["TorchBackend", "TorchPlan"]

# Scores held at once per chunk of tiles (elements); keeps the working set cache-sized.
CHUNK_ELEMENTS = 1 << 22
PLAN_CACHE_SIZE = 128


class TorchBackend:
    """Runs everything, everywhere; the oracle for the other backends."""

    name = "torch"

    def __init__(self):
        self._plans: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def availability(self) -> list[str]:
        return []

    def supports(self, problem: AttnProblem) -> list[str]:
        return []

    def plan(self, problem: AttnProblem) -> "TorchPlan":
        key = problem.plan_key
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = TorchPlan(problem)
        with self._lock:
            self._plans[key] = plan
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        return plan


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class TorchPlan:
    """Tile tables for one ``plan_key``, built once; ``forward``/``backward`` run them."""

    def __init__(self, problem: AttnProblem):
        masks = mask_parts(problem.mask)
        self.visibility = Visibility(masks, problem.seq_q, problem.seq_kv)
        padded = self.visibility.padding is not None
        self.dynamic_lines = padded and any(
            m.alignment == "bottom_right" for m in self.visibility.line_masks)
        hood = problem.neighborhood
        if hood is not None:
            axes = [neighborhood_axis(*a) for a in hood.axes()]
            shape = hood.spatial_shape
            extra_static = any(isinstance(m, (Causal, SlidingWindow, Neighborhood))
                               for m in masks if m is not hood)
        else:
            axes = [sequence_axis(problem.seq_q, problem.seq_kv, masks, padded)]
            shape = (problem.seq_q,)
            extra_static = False
        needs_mask = hood is not None or (bool(self.visibility.line_masks) and not self.dynamic_lines)
        self.tiles: Tiles = build_tiles(axes, shape, problem.seq_kv, choose_tile_shape(axes),
                                        needs_mask)
        t = self.tiles
        if extra_static and t.static_mask is not None:
            t.static_mask &= self._static_on_the_fly(t.q_idx[:, :, None], t.k_idx[:, None, :])
        self.evaluate_static = needs_mask and t.static_mask is None
        self.fused_ok = _fused_cpu_ok(problem)  # plan_key fixes bias/alibi/softcap/dropout

    # -- masks and biases for one chunk of tiles -------------------------------------------------
    def _static_on_the_fly(self, qi, kj):
        return self.visibility.static(qi, kj, self.dynamic_lines)

    def _chunk_mask(self, lo: int, hi: int, keys: torch.Tensor, device) -> Optional[torch.Tensor]:
        """Visibility for tiles [lo, hi) as [B|1, n, T, W] bool, or None if all visible."""
        t = self.tiles
        qi = t.q_idx[lo:hi].to(device)[:, :, None]
        kj = keys[:, None, :] if keys.dim() == 2 else keys.view(1, 1, -1)
        if t.static_mask is not None:
            mask = t.static_mask[lo:hi].to(device)
        elif self.evaluate_static:
            mask = self._static_on_the_fly(qi, kj) & t.owned[lo:hi, :, None].to(device)
        elif not bool(t.owned[lo:hi].all()):
            mask = t.owned[lo:hi, :, None].to(device)
        else:
            mask = None
        for extra in (self.visibility.lines(qi, kj) if self.dynamic_lines else None,
                      self.visibility.padded(qi, kj)):
            if extra is not None:
                mask = extra if mask is None else mask & extra
        if mask is not None and mask.dim() == 3:
            mask = mask[None]
        return mask

    def _chunk_bias(self, problem, bias, lo, hi, keys, device, dtype):
        """Additive bias (tensor and/or ALiBi) as [B|1, Hkv, n, T, G, W], or None."""
        t = self.tiles
        qi = t.q_idx[lo:hi].to(device)
        total = None
        kj = keys[:, None, :] if keys.dim() == 2 else keys.view(1, 1, -1)
        if bias is not None:
            b4 = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
            full = b4.expand(b4.shape[0], b4.shape[1], problem.seq_q, problem.seq_kv)
            total = _heads_to_groups(full[:, :, qi[:, :, None], kj].to(dtype), problem)
        if problem.alibi is not None:
            slopes = problem.alibi.slope_table(problem.batch, problem.heads_q).to(device, dtype)
            aligned = qi[:, :, None] + self.visibility.offset(self._alibi_alignment(), device)
            dist = (aligned - kj).abs().to(dtype)
            if dist.dim() == 3:
                dist = dist[None]
            alibi = -slopes.view(slopes.shape[0], problem.heads_kv, problem.group_size, 1, 1, 1) \
                * dist[:, None, None]
            alibi = alibi.permute(0, 1, 3, 4, 2, 5)
            total = alibi if total is None else total + alibi
        return total

    def _alibi_alignment(self) -> str:
        lines = self.visibility.line_masks
        return lines[0].alignment if lines else "top_left"

    # -- the shared score computation -----------------------------------------------------------
    def _scores(self, problem, qs, k5, bias, lo, hi, keys):
        """Masked scores for tiles [lo, hi): returns (s, capped_tanh or None, mask)."""
        B, Hkv, G = problem.batch, problem.heads_kv, problem.group_size
        t = self.tiles
        n, T = hi - lo, t.size
        qg = qs.index_select(2, t.q_idx[lo:hi].reshape(-1).to(qs.device))
        if t.k_idx is None:
            s = torch.matmul(qg.view(B, Hkv, n * T * G, -1), k5.transpose(-1, -2))
            kg = None
        else:
            kg = k5.index_select(2, keys.reshape(-1)).view(B, Hkv, n, t.num_keys, -1)
            s = torch.matmul(qg.view(B, Hkv, n, T * G, -1), kg.transpose(-1, -2))
        s = s.view(B, Hkv, n, T, G, t.num_keys)
        tanh = None
        if problem.softcap is not None:
            tanh = (s / problem.softcap).tanh_()
            s = tanh * problem.softcap
        extra = self._chunk_bias(problem, bias, lo, hi, keys, qs.device, s.dtype)
        if extra is not None:
            s = s + extra
        mask = self._chunk_mask(lo, hi, keys, qs.device)
        if mask is not None:
            s = s.masked_fill(~mask[:, None, :, :, None, :], -math.inf)
        return qg, kg, s, tanh

    def _chunks(self, problem):
        per_tile = problem.batch * problem.heads_q * self.tiles.size * self.tiles.num_keys
        step = max(1, CHUNK_ELEMENTS // max(per_tile, 1))
        for lo in range(0, self.tiles.count, step):
            yield lo, min(lo + step, self.tiles.count)

    def _keys(self, lo, hi, device):
        t = self.tiles
        if t.k_idx is None:
            return torch.arange(t.num_keys, device=device)
        return t.k_idx[lo:hi].to(device)

    # -- forward / backward ---------------------------------------------------------------------
    def forward(self, problem, q, k, v, bias, generator):
        """``(out, lse, dropout_state)``: out in the call's layout and dtype, lse [B, H, S_q]."""
        if self.fused_ok:
            return (*_fused_cpu(problem, q, k, v), None)
        dtype = _compute_dtype(problem.dtype)
        qs, k5, v5 = _grouped_inputs(problem, q, k, v, dtype)
        B, Hkv, G, T = problem.batch, problem.heads_kv, problem.group_size, self.tiles.size
        rows = self.tiles.count * T
        out_t = qs.new_empty(B, Hkv, rows, G, problem.dim_v)
        lse_t = qs.new_empty(B, Hkv, rows, G)
        dropout = _Dropout(problem, generator, qs.device)
        for lo, hi in self._chunks(problem):
            keys = self._keys(lo, hi, qs.device)
            _, _, s, _ = self._scores(problem, qs, k5, bias, lo, hi, keys)
            lse = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - _finite(lse)[..., None])
            p = dropout.apply(p)
            o = _apply_values(p, v5, keys, self.tiles)
            out_t[:, :, lo * T:hi * T] = o.reshape(B, Hkv, (hi - lo) * T, G, -1)
            lse_t[:, :, lo * T:hi * T] = lse.reshape(B, Hkv, (hi - lo) * T, G)
        inverse = self.tiles.inverse.to(qs.device)
        out = _ungroup(problem, out_t.index_select(2, inverse)).to(problem.dtype)
        lse = lse_t.index_select(2, inverse).permute(0, 1, 3, 2).reshape(B, problem.heads_q, -1)
        return out, lse.to(_lse_dtype(problem.dtype)), dropout.state

    def backward(self, problem, q, k, v, bias, out, lse, dout, dropout_state, dlse=None):
        """Gradients ``(dq, dk, dv, dbias)`` from the saved LSE (dbias None unless it needs one).

        ``dlse`` (optional) is the gradient reaching the returned LSE; d lse / d s = p.
        """
        dtype = _compute_dtype(problem.dtype)
        qs, k5, v5 = _grouped_inputs(problem, q, k, v, dtype)
        B, Hkv, G, T = problem.batch, problem.heads_kv, problem.group_size, self.tiles.size
        do5 = _group_queries(problem, dout, dtype)
        delta = (do5 * _group_queries(problem, out, dtype)).sum(-1)        # [B, Hkv, S_q, G]
        if dlse is not None:
            delta = delta - dlse.to(dtype).view(B, Hkv, G, -1).permute(0, 1, 3, 2)
        lse5 = lse.to(dtype).view(B, Hkv, G, -1).permute(0, 1, 3, 2)        # [B, Hkv, S_q, G]
        rows = self.tiles.count * T
        dq_t = qs.new_zeros(B, Hkv, rows, G, problem.dim_qk)
        dk = torch.zeros_like(k5)
        dv = torch.zeros_like(v5)
        dbias_full = None
        if problem.bias_requires_grad:
            dbias_full = qs.new_zeros(B, problem.heads_q, problem.seq_q, problem.seq_kv)
        dropout = _Dropout(problem, None, qs.device, state=dropout_state)
        for lo, hi in self._chunks(problem):
            n = hi - lo
            keys = self._keys(lo, hi, qs.device)
            rows_idx = self.tiles.q_idx[lo:hi].reshape(-1).to(qs.device)
            qg, kg, s, tanh = self._scores(problem, qs, k5, bias, lo, hi, keys)
            lse_g = lse5.index_select(2, rows_idx).view(B, Hkv, n, T, G)
            p = torch.exp(s - _finite(lse_g)[..., None])
            keep = dropout.keep(p)
            dog = do5.index_select(2, rows_idx).view(B, Hkv, n, T * G, -1)
            pd = p if keep is None else p * keep
            vg = v5 if self.tiles.k_idx is None else \
                v5.index_select(2, keys.reshape(-1)).view(B, Hkv, n, self.tiles.num_keys, -1)
            kk = k5 if kg is None else kg
            dp = _matmul_keys(dog, vg, n, transpose_keys=True)   # [B,Hkv,n,T*G,W]
            dp = dp.view_as(p)
            if keep is not None:
                dp = dp * keep
            ds = p * (dp - delta.index_select(2, rows_idx).view(B, Hkv, n, T, G)[..., None])
            if dbias_full is not None:
                _scatter_dbias(dbias_full, ds, rows_idx, keys, problem, n, T)
            if tanh is not None:
                ds = ds * (1 - tanh * tanh)
            ds2 = ds.reshape(B, Hkv, n, T * G, -1)
            pd2 = pd.reshape(B, Hkv, n, T * G, -1)
            dq_t[:, :, lo * T:hi * T] = _matmul_keys(ds2, kk, n).reshape(B, Hkv, n * T, G, -1)
            dk_c = torch.matmul(ds2.transpose(-1, -2), qg.view(B, Hkv, n, T * G, -1))
            dv_c = torch.matmul(pd2.transpose(-1, -2), dog)
            _add_to_keys(dk, dk_c, keys, self.tiles)
            _add_to_keys(dv, dv_c, keys, self.tiles)
        dq = _ungroup(problem, dq_t.index_select(2, self.tiles.inverse.to(qs.device)))
        dq = (dq * problem.scale).to(problem.dtype)
        dk = _to_layout(problem, dk).to(problem.dtype)
        dv = _to_layout(problem, dv).to(problem.dtype)
        dbias = None
        if dbias_full is not None:
            dbias = _reduce_to(dbias_full, problem.bias.shape).to(problem.bias.dtype)
        return dq, dk, dv, dbias


# ---------------------------------------------------------------------------------------------
# Layout helpers: the engine works on [B, H_kv, S, G, D] queries and [B, H_kv, S, D] keys/values.
# ---------------------------------------------------------------------------------------------

def _bhsd(problem, t: torch.Tensor) -> torch.Tensor:
    return t if problem.layout == "bhsd" else t.transpose(1, 2)


def _group_queries(problem, t, dtype):
    x = _bhsd(problem, t).to(dtype)
    B, H, S, D = x.shape
    return x.view(B, problem.heads_kv, problem.group_size, S, D).transpose(2, 3)


def _grouped_inputs(problem, q, k, v, dtype):
    qs = _group_queries(problem, q, dtype) * problem.scale
    return qs, _bhsd(problem, k).to(dtype), _bhsd(problem, v).to(dtype)


def _ungroup(problem, x):
    """[B, H_kv, S, G, D] -> the call's layout with H_q heads."""
    B, Hkv, S, G, D = x.shape
    if problem.layout == "bhsd":
        return x.permute(0, 1, 3, 2, 4).reshape(B, Hkv * G, S, D)
    return x.permute(0, 2, 1, 3, 4).reshape(B, S, Hkv * G, D)


def _to_layout(problem, x):
    return x if problem.layout == "bhsd" else x.transpose(1, 2).contiguous()


def _heads_to_groups(x, problem):
    """[B|1, H|1, n, T, W] -> [B|1, Hkv|1, n, T, G|1, W]."""
    b, h, n, T, W = x.shape
    if h == 1:
        return x.view(b, 1, n, T, 1, W)
    return x.view(b, problem.heads_kv, problem.group_size, n, T, W).permute(0, 1, 3, 4, 2, 5)


def _finite(lse):
    return lse.masked_fill(lse == -math.inf, 0.0)


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _matmul_keys(rows, keys, n, transpose_keys=False):
    """rows [B,Hkv,n,R,X] @ keys ([B,Hkv,S,Y] shared, or [B,Hkv,n,W,Y] per tile)."""
    other = keys.transpose(-1, -2) if transpose_keys else keys
    if keys.dim() == 4:
        B, Hkv, _, R, X = rows.shape
        return torch.matmul(rows.reshape(B, Hkv, n * R, X), other).view(B, Hkv, n, R, -1)
    return torch.matmul(rows, other)


def _apply_values(p, v5, keys, tiles):
    B, Hkv, n, T, G, W = p.shape
    if tiles.k_idx is None:
        return _matmul_keys(p.reshape(B, Hkv, n, T * G, W), v5, n)
    vg = v5.index_select(2, keys.reshape(-1)).view(B, Hkv, n, W, -1)
    return torch.matmul(p.reshape(B, Hkv, n, T * G, W), vg)


def _add_to_keys(acc, tile_grads, keys, tiles):
    """Accumulate per-tile key gradients [B,Hkv,n,W,D] into [B,Hkv,S_kv,D]."""
    if tiles.k_idx is None:
        acc += tile_grads.sum(2)
    else:
        acc.index_add_(2, keys.reshape(-1), tile_grads.reshape(*acc.shape[:2], -1, acc.shape[-1]))


def _scatter_dbias(dbias_full, ds, rows_idx, keys, problem, n, T):
    # ds: [B, Hkv, n, T, G, W] -> [B*H, n*T*W]; rows not owned carry zeros (they are masked),
    # and index_add_ accumulates the duplicate positions they share with their owners.
    B, Hkv, _, _, G, W = ds.shape
    grads = ds.permute(0, 1, 4, 2, 3, 5).reshape(B * Hkv * G, n * T * W)
    cols = keys.view(1, -1).expand(n * T, W) if keys.dim() == 1 else \
        keys[:, None, :].expand(n, T, W).reshape(n * T, W)
    flat = (rows_idx[:, None] * problem.seq_kv + cols).reshape(-1)
    dbias_full.view(B * Hkv * G, -1).index_add_(1, flat, grads)


def _reduce_to(full, shape):
    """Sum a [B, H, S_q, S_kv] gradient down to a broadcast bias shape."""
    lead = full.dim() - len(shape)
    x = full.sum(dim=tuple(range(lead))) if lead else full
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(dim=dims, keepdim=True) if dims else x


# ---------------------------------------------------------------------------------------------
# Dropout with a replayable stream: backward regenerates the forward's keep masks chunk by chunk.
# ---------------------------------------------------------------------------------------------

class _Dropout:
    def __init__(self, problem, generator, device, state=None):
        self.p = problem.dropout_p
        self.generator = None
        self.state = None
        if self.p == 0:
            return
        gen = torch.Generator(device=device)
        if state is not None:
            gen.set_state(state)
        else:
            # The user's generator (or the global one) seeds a private stream we can replay.
            source = generator.device if generator is not None else "cpu"
            seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator, device=source))
            gen.manual_seed(seed)
            self.state = gen.get_state()
        self.generator = gen

    def keep(self, p):
        """Scaled keep mask for the next chunk (``None`` without dropout)."""
        if self.generator is None:
            return None
        draw = torch.rand(p.shape, generator=self.generator, device=p.device, dtype=p.dtype)
        return (draw >= self.p).to(p.dtype) / (1.0 - self.p)

    def apply(self, p):
        keep = self.keep(p)
        return p if keep is None else p * keep


# ---------------------------------------------------------------------------------------------
# PyTorch's fused CPU attention, used where it computes exactly the same thing.
# ---------------------------------------------------------------------------------------------

def _fused_cpu_ok(problem: AttnProblem) -> bool:
    if problem.device.type != "cpu" or problem.dim_qk != problem.dim_v:
        return False
    if problem.bias or problem.alibi or problem.softcap or problem.dropout_p:
        return False
    parts = mask_parts(problem.mask)
    if not parts:
        return True
    if len(parts) == 1 and isinstance(parts[0], Causal):
        return parts[0].alignment == "top_left" or problem.seq_q == problem.seq_kv
    return False


def _fused_cpu(problem, q, k, v):
    q, k, v = (_bhsd(problem, t) for t in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, problem.mask is not None, scale=problem.scale)
    if problem.layout == "bshd":
        out = out.transpose(1, 2)
    return out, lse.to(_lse_dtype(problem.dtype))
