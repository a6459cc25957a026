"""The torch engine: exact attention forward (with LSE) and backward on any device and dtype.

It is what CPU users run and the oracle the GPU engines are tested against. Work is organised in
tiles (see ``tiles``): a tile of queries is scored against the box of keys its masks allow, in
float32 (float64 for float64 inputs), one batched matmul per chunk of tiles. Unmasked and plain
causal problems go through PyTorch's fused CPU kernel when it gives the same result.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..core.caches import LRU
from . import cpu_sdpa
from .dropout import DropoutStream
from .segments import add_at
from .layouts import cols, compute_dtype, lse_dtype, lse_layout, lse_rows, rows_of, uncols, unrows
from .tiles import Tiles, Visibility, build_tiles, choose_tile_shape, neighborhood_axis, sequence_axis
from ..model.masks import Causal, Neighborhood, SlidingWindow, alibi_distance, mask_parts
from ..model.problem import AttnProblem
from ..model.storage import Ragged
from .ragged import RaggedPlan

__all__ = ["TorchBackend", "TorchPlan"]

# Scores per chunk of tiles (elements): small enough that a chunk's gathered keys stay in cache
# and its buffers are recycled by the allocator instead of being mapped afresh on every call.
CHUNK_ELEMENTS = 1 << 20
# Scores of a single tile (times batch x heads) may reach this; it bounds the tile size.
TILE_ELEMENTS = 1 << 22
PLAN_CACHE_SIZE = 128
# Largest additive float mask (elements) a plan keeps between calls.
MAX_CACHED_MASK = 1 << 25


class TorchBackend:
    """Runs everything, everywhere; the oracle for the other backends."""

    name = "torch"
    # Runs packed/paged storage and whole caches as they lie (would read a whole dense cache).
    runs_stored = False

    def __init__(self):
        self._plans = LRU("torch.plans", PLAN_CACHE_SIZE)

    def availability(self) -> list[str]:
        return []

    def supports(self, problem: AttnProblem) -> list[str]:
        # Packed sequences run as their padded batch (``ragged``); a paged cache is left to
        # attention_with_kvcache's dense batches (its pools would be gathered whole).
        if problem.storage is not None and not isinstance(problem.storage, Ragged):
            return [f"the torch engine addresses dense batches, not {problem.storage!r} storage"]
        return []

    def plan(self, problem: AttnProblem):
        if isinstance(problem.storage, Ragged):
            return self._plans.get_or_create(problem.plan_key,
                                             lambda: RaggedPlan(self, problem))
        return self._plans.get_or_create(problem.plan_key, lambda: TorchPlan(problem))


class TorchPlan:
    """Tile tables for one ``plan_key``, built once; ``forward``/``backward`` run them."""

    def __init__(self, problem: AttnProblem):
        masks = mask_parts(problem.mask)
        self.visibility = Visibility(masks, problem.seq_q, problem.seq_kv)
        padded = self.visibility.has_padding
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
        tile_shape = choose_tile_shape(axes, problem.batch * problem.heads_q, TILE_ELEMENTS)
        self.tiles: Tiles = build_tiles(axes, shape, problem.seq_kv, tile_shape, needs_mask)
        t = self.tiles
        if extra_static and t.static_mask is not None:
            static = self._static_on_the_fly(t.q_idx[:, :, None], t.k_idx[:, None, :])
            if static is not None:
                t.static_mask &= static
        self.evaluate_static = needs_mask and t.static_mask is None
        # Stored inverted: the hot loop fills hidden pairs, so this saves a pass per call.
        t.hidden = None if t.static_mask is None else ~t.static_mask
        # plan_key pins what these depend on: bias/alibi/softcap/dropout presence, dims, device.
        self.fused_ok = cpu_sdpa.whole_problem_ok(problem)
        self.fused_tiles = cpu_sdpa.tiles_ok(problem)
        # The fused path's additive masks depend on nothing per call here: build them once.
        per_call = (self.dynamic_lines or self.visibility.has_padding or problem.bias is not None
                    or problem.alibi is not None or problem.rpb is not None)
        small = t.count * t.size * problem.group_size * t.num_keys <= MAX_CACHED_MASK
        self.additive_masks = None if per_call or not small else {}

    def direct(self, problem):
        """``(q, k, v) -> out`` for calls of ``problem`` that need no lse and no gradient, when one
        public op computes them (else None): the eager fast path keeps it with its call signature."""
        if self.fused_ok and not problem.requires_grad and problem.heads_q == problem.heads_kv \
                and cpu_sdpa.whole_problem_scale_ok(problem):
            return cpu_sdpa.out_only(problem)
        return None

    # -- masks and biases for one chunk of tiles -------------------------------------------------
    def _static_on_the_fly(self, qi, kj):
        return self.visibility.static(qi, kj, self.dynamic_lines)

    def hidden_of(self, problem, lo: int, hi: int, keys: torch.Tensor,
                  device) -> Optional[torch.Tensor]:
        """Hidden (query, key) pairs of tiles [lo, hi) as [B|1, n, T, W] bool, or None."""
        t = self.tiles.on(device)
        qi = t.q_idx[lo:hi][:, :, None]
        kj = keys[:, None, :] if keys.dim() == 2 else keys.view(1, 1, -1)
        if t.hidden is not None:
            visible = None
            hidden = t.hidden[lo:hi]
        elif self.evaluate_static:
            visible = t.owned[lo:hi, :, None]
            static = self._static_on_the_fly(qi, kj)
            visible = visible if static is None else visible & static
            hidden = None
        elif not bool(t.owned[lo:hi].all()):
            visible, hidden = t.owned[lo:hi, :, None], None
        else:
            visible = hidden = None
        padding = problem.padding
        for extra in (self.visibility.lines(qi, kj, padding) if self.dynamic_lines else None,
                      self.visibility.padded(qi, kj, padding)):
            if extra is not None:
                visible = extra if visible is None else visible & extra
        if visible is not None:
            hidden = ~visible if hidden is None else hidden | ~visible
        if hidden is None:
            return None
        return hidden if hidden.dim() == 4 else hidden[None]

    def pairs_of(self, problem, full, lo, hi, keys, dtype):
        """Entries of a tensor broadcastable to [B, H, S_q, S_kv] at the (query, key) pairs of
        tiles [lo, hi), as [B|1, Hkv|1, n, T, G|1, W]."""
        qi = self.tiles.on(full.device).q_idx[lo:hi]
        kj = keys[:, None, :] if keys.dim() == 2 else keys.view(1, 1, -1)
        b4 = full.reshape((1,) * (4 - full.dim()) + tuple(full.shape))
        b4 = b4.expand(b4.shape[0], b4.shape[1], problem.seq_q, problem.seq_kv)
        return _heads_to_groups(b4[:, :, qi[:, :, None], kj].to(dtype), problem)

    def rpb_index(self, problem, lo, hi, keys, device):
        """Flat RelPosBias entry of each (query, key) pair of tiles [lo, hi) ([n|1, T, W])."""
        hood = problem.neighborhood
        qi = self.tiles.on(device).q_idx[lo:hi][:, :, None]
        kj = keys[:, None, :] if keys.dim() == 2 else keys.view(1, 1, -1)
        index = torch.zeros((), dtype=torch.long, device=device)
        for axis, (_, k, _, d, _) in enumerate(hood.axes()):
            inner = math.prod(hood.spatial_shape[axis + 1:])
            offset = (kj // inner % hood.spatial_shape[axis]
                      - qi // inner % hood.spatial_shape[axis]).div(d, rounding_mode="floor")
            # Hidden pairs may fall outside the table: clamp them (their weight is 0 anyway).
            entry = (offset + k - 1).clamp_(0, 2 * k - 2)
            index = index * (2 * k - 1) + entry
        return index

    def bias_of(self, problem, bias, lo, hi, keys, device, dtype):
        """Additive bias (tensor, RelPosBias and/or ALiBi) as [B|1, Hkv, n, T, G, W], or None."""
        qi = self.tiles.on(device).q_idx[lo:hi]
        total = None
        kj = keys[:, None, :] if keys.dim() == 2 else keys.view(1, 1, -1)
        if problem.bias is not None:
            total = self.pairs_of(problem, bias, lo, hi, keys, dtype)
        elif problem.rpb is not None:
            entries = bias.reshape(problem.heads_q, -1)[:, self.rpb_index(problem, lo, hi, keys,
                                                                          device)]
            total = _heads_to_groups(entries[None].to(dtype), problem)
        if problem.alibi is not None:
            slopes = problem.alibi.slope_table(problem.batch, problem.heads_q).to(device, dtype)
            aligned = qi[:, :, None] + self.visibility.offset(self._alibi_alignment(), device,
                                                               problem.padding)
            dist = alibi_distance(aligned, kj, dtype)
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
    def _scores(self, problem, qs, k3, bias, lo, hi, keys):
        """Scores of tiles [lo, hi) as [B, H_kv, n, T, G, W] with hidden pairs at -inf.

        Returns ``(qg, kg, s, chain, hidden)``: the gathered queries [BH, n, T*G, D] and keys
        ([BH, n, W, D], or None when every tile reads all keys), ``chain(ds)`` taking the
        gradient of the modified scores back through softcap / score_mod (or None) and the
        hidden-pair mask broadcastable to ``s`` (or None).
        """
        B, Hkv, G = problem.batch, problem.heads_kv, problem.group_size
        t = self.tiles
        n, T, W = hi - lo, t.size, t.num_keys
        qg = qs.index_select(1, t.on(qs.device).q_idx[lo:hi].reshape(-1))
        qg = qg.view(B * Hkv, n, T * G, -1)
        if t.k_idx is None:
            kg = None
            s = torch.matmul(qg.view(B * Hkv, n * T * G, -1), k3.transpose(1, 2))
        else:
            kg = _gather_keys(k3, keys, t, n)
            s = torch.matmul(qg, kg.transpose(-1, -2))
        s = s.view(B, Hkv, n, T, G, W)
        chain = None
        if problem.softcap is not None:
            tanh = (s / problem.softcap).tanh_()
            s = tanh * problem.softcap
            chain = lambda ds: ds.mul_(1 - tanh * tanh)  # noqa: E731
        if problem.score_mod is not None:
            s, chain = self._score_mod(problem, s, chain, lo, hi, keys)
        extra = self.bias_of(problem, bias, lo, hi, keys, qs.device, s.dtype)
        if extra is not None:
            s.add_(extra)
        hidden = self.hidden_of(problem, lo, hi, keys, qs.device)
        if hidden is not None:
            hidden = hidden[:, None, :, :, None, :]
            s.masked_fill_(hidden, -math.inf)
        return qg, kg, s, chain, hidden

    def _score_mod(self, problem, s, chain, lo, hi, keys):
        """The call's score_mod on scores ``[B, H_kv, n, T, G, W]`` of tiles [lo, hi), with the
        chain rule through it (its ``score_mod_bprop`` when it has one)."""
        program, device = problem.score_mod, s.device
        n, T, W = s.shape[2], s.shape[3], s.shape[5]
        q_idx = self.tiles.on(device).q_idx[lo:hi]

        def index(axis):
            if axis == 0:
                return torch.arange(problem.batch, device=device).view(-1, 1, 1, 1, 1, 1)
            if axis == 1:  # head h = h_kv * G + g (GQA groups of consecutive query heads)
                G = problem.group_size
                return (torch.arange(problem.heads_kv, device=device).view(1, -1, 1, 1, 1, 1) * G
                        + torch.arange(G, device=device).view(1, 1, 1, 1, -1, 1))
            if axis == 2:
                return q_idx.view(1, 1, n, T, 1, 1)
            return keys.view(1, 1, n, 1, 1, W) if keys.dim() == 2 else keys.view(1, 1, 1, 1, 1, -1)

        raw = s
        modified = program.apply(raw, index)
        inner = chain

        def through(ds):
            ds = program.gradient(raw, ds, index)
            return ds if inner is None else inner(ds)
        return modified.clone(), through

    def chunks(self, problem):
        per_tile = problem.batch * problem.heads_q * self.tiles.size * self.tiles.num_keys
        step = max(1, CHUNK_ELEMENTS // max(per_tile, 1))
        for lo in range(0, self.tiles.count, step):
            yield lo, min(lo + step, self.tiles.count)

    def keys_of(self, lo, hi, device):
        t = self.tiles
        if t.k_idx is None:
            return torch.arange(t.num_keys, device=device)
        return t.on(device).k_idx[lo:hi]

    # -- forward / backward ---------------------------------------------------------------------
    def forward(self, problem, inputs, need_lse=True, row_stats=None, weights=None):
        """``(out, lse)``: out in the call's layout and dtype, lse [B, H, S_q] (``None`` allowed
        when ``need_lse`` is false and nothing will run backward). A dict ``row_stats`` receives
        each row's score maximum ``"max"`` and ``"sum_exp"`` = sum of ``exp(s - max)`` (lse's
        layout; cuDNN's ``score_max`` / ``score_sum_exp``: ``lse = max + log(sum_exp)``).
        A dict ``weights`` receives the attention weights ``[B, H_q, S_q, S_kv]`` (compute
        dtype): ``"probs"`` before dropout, ``"dropped"`` as applied (kept entries scaled by
        ``1 / (1 - p)``, dropped ones 0; the same tensor without dropout)."""
        q, k, v, bias = inputs.q, inputs.k, inputs.v, inputs.bias
        plain = row_stats is None and weights is None
        if self.fused_ok and plain and cpu_sdpa.whole_problem_scale_ok(problem):
            return cpu_sdpa.whole_problem(problem, q, k, v, need_lse)
        if self.fused_tiles and plain:
            return cpu_sdpa.tile_forward(self, problem, q, k, v, bias)
        dtype = compute_dtype(problem.dtype)
        qs = rows_of(problem, q, dtype, problem.scale)
        k3, v3 = cols(problem, k, dtype), cols(problem, v, dtype)
        BH, G, T = problem.batch * problem.heads_kv, problem.group_size, self.tiles.size
        rows = self.tiles.count * T
        out_t = qs.new_empty(BH, rows, G, problem.dim_v)
        lse_t = qs.new_empty(BH, rows, G)
        max_t, sum_t = (qs.new_empty(BH, rows, G), qs.new_empty(BH, rows, G)) \
            if row_stats is not None else (None, None)
        dropout = DropoutStream(problem, inputs, qs.device)
        full = None if weights is None else {
            name: qs.new_zeros(problem.batch, problem.heads_q, problem.seq_q, problem.seq_kv)
            for name in ("probs", "dropped")}
        for lo, hi in self.chunks(problem):
            n = hi - lo
            keys = self.keys_of(lo, hi, qs.device)
            _, _, s, _, hidden = self._scores(problem, qs, k3, bias, lo, hi, keys)
            peak = s.amax(-1)
            shift = _finite(peak)
            p = _exp_shifted(s, shift, hidden, dead=peak == -math.inf)
            total = p.sum(-1)
            keep = dropout.keep(self, p, lo, hi, keys)
            if full is not None:
                probs = p / _nonzero(total)[..., None]
                for name, w in (("probs", probs), ("dropped", probs if keep is None else
                                                   probs * keep)):
                    _put_pairs(full[name], w, self.tiles.on(qs.device), lo, hi, keys)
            if keep is not None:
                p = p * keep
            o = _times_keys(p.view(BH, n, T * G, -1), _gather_keys(v3, keys, self.tiles, n),
                            keys, self.tiles)
            total = total.view(BH, n * T, G)
            out_t[:, lo * T:hi * T] = o.view(BH, n * T, G, -1) / _nonzero(total)[..., None]
            lse_t[:, lo * T:hi * T] = shift.view(BH, n * T, G) + total.log()
            if max_t is not None:
                max_t[:, lo * T:hi * T] = peak.reshape(BH, n * T, G)
                sum_t[:, lo * T:hi * T] = total
        inverse = self.tiles.on(qs.device).inverse
        if full is not None:
            weights.update(full)
        if max_t is not None:
            for name, t in (("max", max_t), ("sum_exp", sum_t)):
                row_stats[name] = lse_layout(problem, t.index_select(1, inverse)).to(
                    lse_dtype(problem.dtype))
        out = unrows(problem, out_t.index_select(1, inverse)).to(problem.dtype)
        lse = lse_layout(problem, lse_t.index_select(1, inverse))
        return out, lse.to(lse_dtype(problem.dtype))

    def backward(self, problem, inputs, out, lse, dout, dlse=None):
        """Gradients ``(dq, dk, dv, dbias)`` from the saved LSE (dbias None unless it needs one).

        ``dlse`` (optional) is the gradient reaching the returned LSE; d lse / d s = p.
        """
        q, k, v, bias = inputs.q, inputs.k, inputs.v, inputs.bias
        if self.fused_ok and dlse is None and problem.heads_q == problem.heads_kv \
                and cpu_sdpa.whole_problem_scale_ok(problem):
            return cpu_sdpa.whole_backward(problem, q, k, v, out, lse, dout)
        if self.fused_tiles and dlse is None and not problem.bias_requires_grad:
            return cpu_sdpa.tile_backward(self, problem, q, k, v, bias, out, lse, dout)
        dtype = compute_dtype(problem.dtype)
        B, Hkv, G, T = problem.batch, problem.heads_kv, problem.group_size, self.tiles.size
        BH = B * Hkv
        qs = rows_of(problem, q, dtype, problem.scale)
        k3, v3 = cols(problem, k, dtype), cols(problem, v, dtype)
        do3 = rows_of(problem, dout, dtype)
        delta = (do3.view(BH, problem.seq_q, G, -1)
                 * rows_of(problem, out, dtype).view(BH, problem.seq_q, G, -1)).sum(-1)
        if dlse is not None:
            delta = delta - lse_rows(problem, dlse.to(dtype))
        lse3 = lse_rows(problem, lse.to(dtype))
        dq_t = qs.new_zeros(BH, self.tiles.count * T, G * problem.dim_qk)
        dk, dv = torch.zeros_like(k3), torch.zeros_like(v3)
        dbias_full = drpb = None
        if problem.bias_requires_grad and problem.rpb is not None:
            drpb = qs.new_zeros(problem.heads_q, math.prod(problem.rpb.shape[1:]))
        elif problem.bias_requires_grad:
            dbias_full = qs.new_zeros(B, problem.heads_q, problem.seq_q, problem.seq_kv)
        dropout = DropoutStream(problem, inputs, qs.device)
        for lo, hi in self.chunks(problem):
            n = hi - lo
            keys = self.keys_of(lo, hi, qs.device)
            rows_idx = self.tiles.on(qs.device).q_idx[lo:hi].reshape(-1)
            qg, kg, s, chain, hidden = self._scores(problem, qs, k3, bias, lo, hi, keys)
            lse_g = lse3.index_select(1, rows_idx).view(s.shape[:-1])
            p = _exp_shifted(s, _finite(lse_g), hidden, dead=lse_g == -math.inf)
            keep = dropout.keep(self, p, lo, hi, keys)
            dog = do3.index_select(1, rows_idx).view(BH, n, T * G, -1)
            vg = _gather_keys(v3, keys, self.tiles, n)
            dp = _times_keys(dog, vg, keys, self.tiles, transpose=True).view_as(p)
            pd = p
            if keep is not None:
                dp.mul_(keep)
                pd = p * keep
            ds = dp.sub_(delta.index_select(1, rows_idx).view(s.shape[:-1])[..., None]).mul_(p)
            if dbias_full is not None:
                _scatter_dbias(dbias_full, ds, rows_idx, keys, problem, n, T)
            if drpb is not None:
                _scatter_drpb(drpb, ds, self.rpb_index(problem, lo, hi, keys, qs.device))
            if chain is not None:
                ds = chain(ds)
            ds = ds.reshape(BH, n, T * G, -1)
            dq_t[:, lo * T:hi * T] = _times_keys(ds, k3 if kg is None else kg, keys,
                                                 self.tiles).view(BH, n * T, -1)
            _add_to_keys(dk, ds, qg, keys, self.tiles)
            _add_to_keys(dv, pd.view(BH, n, T * G, -1), dog, keys, self.tiles)
        dq = dq_t.index_select(1, self.tiles.on(qs.device).inverse) * problem.scale
        dbias = None
        if dbias_full is not None:
            dbias = _reduce_to(dbias_full, problem.bias.shape).to(problem.bias.dtype)
        elif drpb is not None:
            dbias = drpb.view(problem.rpb.shape).to(problem.rpb.dtype)
        return (unrows(problem, dq).to(problem.dtype), uncols(problem, dk).to(problem.dtype),
                uncols(problem, dv).to(problem.dtype), dbias)


def _heads_to_groups(x, problem):
    """[B|1, H|1, n, T, W] -> [B|1, Hkv|1, n, T, G|1, W]."""
    b, h, n, T, W = x.shape
    if h == 1:
        return x.view(b, 1, n, T, 1, W)
    return x.view(b, problem.heads_kv, problem.group_size, n, T, W).permute(0, 1, 3, 4, 2, 5)


# exp() is many times slower on inputs that underflow (and on -inf): clamp just above the
# smallest normal float, then zero the hidden pairs explicitly.
_EXP_FLOOR = {torch.float32: -87.0, torch.float64: -708.0}


def _exp_shifted(s, shift, hidden, dead):
    """exp(s - shift) in place, with hidden pairs and ``dead`` rows (no finite score) exactly 0."""
    s.sub_(shift[..., None]).clamp_(min=_EXP_FLOOR[s.dtype]).exp_()
    if hidden is not None:
        s.masked_fill_(hidden, 0.0)
    if bool(dead.any()):
        s.masked_fill_(dead[..., None], 0.0)
    return s


def _finite(x):
    return x.masked_fill(x == -math.inf, 0.0)


def _nonzero(total):
    return total.masked_fill(total == 0, 1.0)


def _gather_keys(x3, keys, tiles, n):
    """Each tile's keys [BH, n, W, X], or ``x3`` itself when every tile reads all keys."""
    if tiles.k_idx is None:
        return x3
    return x3.index_select(1, keys.reshape(-1)).view(x3.shape[0], n, tiles.num_keys, -1)


def _times_keys(rows, keys_t, keys, tiles, transpose=False):
    """rows [BH, n, R, X] times per-tile keys [BH, n, W, Y] (or shared [BH, S_kv, Y])."""
    other = keys_t.transpose(-1, -2) if transpose else keys_t
    if keys_t.dim() == 3:
        BH, n, R, X = rows.shape
        return torch.matmul(rows.reshape(BH, n * R, X), other).view(BH, n, R, -1)
    return torch.matmul(rows, other)


def _add_to_keys(acc, weights, rows, keys, tiles):
    """acc[BH, S_kv, X] += weights[BH, n, R, W]^T @ rows[BH, n, R, X], scattered to the keys."""
    BH, n, R, W = weights.shape
    if tiles.k_idx is None:
        acc += torch.matmul(weights.reshape(BH, n * R, W).transpose(1, 2),
                            rows.reshape(BH, n * R, -1))
    else:
        grads = torch.matmul(weights.transpose(-1, -2), rows)
        add_at(acc, keys.reshape(-1), grads.view(BH, n * W, -1))


def _scatter_dbias(dbias_full, ds, rows_idx, keys, problem, n, T):
    # ds: [B, Hkv, n, T, G, W] -> [B*H, n*T*W]; rows not owned carry zeros (they are masked),
    # and add_at accumulates the duplicate positions they share with their owners.
    B, Hkv, _, _, G, W = ds.shape
    grads = ds.permute(0, 1, 4, 2, 3, 5).reshape(B * Hkv * G, n * T * W)
    cols = keys.view(1, -1).expand(n * T, W) if keys.dim() == 1 else \
        keys[:, None, :].expand(n, T, W).reshape(n * T, W)
    flat = (rows_idx[:, None] * problem.seq_kv + cols).reshape(-1)
    add_at(dbias_full.view(B * Hkv * G, -1), flat, grads)


def _put_pairs(full, w, tiles, lo, hi, keys):
    """``full[B, H, S_q, S_kv]`` at the pairs of tiles [lo, hi) = ``w [B, Hkv, n, T, G, W]``:
    owned rows only, each (query, key) pair is written once (a tile's keys are distinct)."""
    B, Hkv, n, T, G, W = w.shape
    values = w.permute(0, 1, 4, 2, 3, 5).reshape(B * Hkv * G, n * T, W)
    cols = keys.view(1, -1).expand(n * T, W) if keys.dim() == 1 else \
        keys[:, None, :].expand(n, T, W).reshape(n * T, W)
    own = tiles.owned[lo:hi].reshape(-1)
    rows = tiles.q_idx[lo:hi].reshape(-1)[own]
    full.view(B * Hkv * G, *full.shape[2:])[:, rows[:, None], cols[own]] = values[:, own]


def _scatter_drpb(drpb, ds, index):
    """drpb [H, R] += ds [B, Hkv, n, T, G, W] summed over the batch, at each pair's entry."""
    B, Hkv, n, T, G, W = ds.shape
    grads = ds.sum(0).permute(0, 3, 1, 2, 4).reshape(Hkv * G, n * T * W)
    add_at(drpb, index.expand(n, T, W).reshape(-1), grads)


def _reduce_to(full, shape):
    """Sum a [B, H, S_q, S_kv] gradient down to a broadcast bias shape."""
    lead = full.dim() - len(shape)
    x = full.sum(dim=tuple(range(lead))) if lead else full
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(dim=dims, keepdim=True) if dims else x
