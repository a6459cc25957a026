"""Tile tables for the torch engine: which queries form a tile, which keys a tile reads, and
which of those (query, key) pairs are visible.

Every mask here is a per-axis interval in a reordered coordinate system: a neighborhood axis with
dilation ``d`` is reordered so that each dilation group is contiguous, and then every query sees a
contiguous run of keys on every axis. Query tiles are boxes in that order, and a tile's keys are the
box spanned by its queries' runs. All boxes get one size (the widest) so a whole batch of tiles
runs as one batched matmul; memory is O(S * box), never O(S_q * S_kv) for local masks.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..model.geometry import band_window, neighborhood_positions
from ..model.masks import Causal, Neighborhood, Padding, SlidingWindow, line_bounds

# Smallest query tile worth a matmul on CPU; below it per-tile overhead dominates.
MIN_TILE_QUERIES = 64
# Largest query tile; a dense tile's scores are T x S_kv.
MAX_TILE_QUERIES = 512
# A key box this wide (relative to S_kv) is no cheaper than reading every key.
DENSE_FRACTION = 0.6
# Precomputed visibility tables larger than this many booleans are evaluated per chunk instead.
MAX_TABLE_ELEMENTS = 1 << 26


@dataclass
class AxisWindows:
    """Per-axis runs: query at reordered position ``p`` sees reordered keys ``[lo[p], hi[p])``."""

    lo: torch.Tensor
    hi: torch.Tensor
    q_order: torch.Tensor  # reordered position -> original coordinate
    k_order: torch.Tensor

    @property
    def length_q(self) -> int:
        return self.lo.numel()

    @property
    def length_kv(self) -> int:
        return self.k_order.numel()


def neighborhood_axis(length: int, kernel: int, stride: int, dilation: int,
                      causal: bool) -> AxisWindows:
    """NATTEN 0.21's per-axis neighbor rule (``geometry.neighborhood_positions``), in
    dilation-group-contiguous order."""
    i = torch.arange(length)
    group, idx, start, end = neighborhood_positions(length, kernel, stride, dilation, causal)
    sizes = torch.bincount(group, minlength=dilation)
    offset = torch.cumsum(sizes, 0) - sizes                         # first slot of each group
    position = offset[group] + idx                                 # original -> reordered
    order = torch.empty_like(position)
    order[position] = i
    lo = torch.empty_like(start)
    hi = torch.empty_like(end)
    lo[position] = offset[group] + start
    hi[position] = offset[group] + end
    return AxisWindows(lo, hi, order, order)


def sequence_axis(seq_q: int, seq_kv: int, masks, padded: bool) -> AxisWindows:
    """The 1-D run of keys each query may see under causal/window masks (identity order): the
    intersection of their ``geometry.band_window`` runs."""
    i = torch.arange(seq_q)
    lo = torch.zeros(seq_q, dtype=torch.long)
    hi = torch.full((seq_q,), seq_kv, dtype=torch.long)
    for m in masks:
        if not isinstance(m, (Causal, SlidingWindow)):
            continue
        if m.alignment == "bottom_right" and padded:
            continue  # the offset depends on per-batch lengths: keep every key, mask per call
        offset = seq_kv - seq_q if m.alignment == "bottom_right" else 0
        m_lo, m_hi = band_window(i, seq_kv, *line_bounds(m), offset)
        lo, hi = torch.maximum(lo, m_lo), torch.minimum(hi, m_hi)
    return AxisWindows(lo, torch.maximum(hi, lo), torch.arange(seq_q), torch.arange(seq_kv))


def _tile_starts(length: int, tile: int) -> torch.Tensor:
    # The last tile is shifted back to stay in range; the rows it shares are owned by the tile
    # before it.
    return torch.clamp(torch.arange(0, length, tile), max=length - tile)


def _axis_boxes(axis: AxisWindows, tile: int):
    starts = _tile_starts(axis.length_q, tile)
    rows = starts[:, None] + torch.arange(tile)
    box_lo, box_hi = axis.lo[rows].min(1).values, axis.hi[rows].max(1).values
    width = max(int((box_hi - box_lo).max()), 1)
    key_start = torch.clamp(box_lo, max=axis.length_kv - width).clamp(min=0)
    return starts, rows, key_start, width


def _candidate_tiles(length: int) -> list[int]:
    sizes = {length} | {2 ** e for e in range(int(math.log2(length)) + 1)}
    return sorted(sizes)


def choose_tile_shape(axes: list[AxisWindows], copies: int = 1,
                      budget: int = 1 << 22) -> tuple[int, ...]:
    """Per-axis tile sizes that minimise the scores computed, with a floor on the tile size.

    ``copies`` (batch x heads) times one tile's scores should fit in ``budget`` elements; only
    the smallest tiles may exceed it.
    """
    options = []
    for axis in axes:
        per_axis = {}
        for t in _candidate_tiles(axis.length_q):
            starts, _, _, width = _axis_boxes(axis, t)
            per_axis[t] = (starts.numel() * t, width)
        options.append(per_axis)
    floor = min(MIN_TILE_QUERIES, math.prod(a.length_q for a in axes))
    ranked = []
    for combo in itertools.product(*(sorted(o) for o in options)):
        queries = math.prod(combo)
        if queries > max(MAX_TILE_QUERIES, floor):
            continue
        rows = math.prod(o[t][0] for o, t in zip(options, combo))
        width = math.prod(o[t][1] for o, t in zip(options, combo))
        fits = copies * queries * width <= budget or queries == 1
        if fits:
            cost = rows * (width + 8) * (1 + 16 / queries)
            # Tiles under the floor only when nothing at or above it fits the budget.
            ranked.append((queries < floor, cost if queries >= floor else -queries, combo))
    return min(ranked)[2]


@dataclass
class Tiles:
    """Gather tables for one problem. ``n`` tiles of ``T`` queries, each reading ``W`` keys.

    ``k_idx is None`` means every tile reads all keys in order (dense). ``static_mask`` is the
    precomputed visibility of the plan-time masks (``None``: evaluate per chunk, or no mask).
    Rows a tile shares with an earlier tile are not ``owned`` and are masked out entirely.
    """

    q_idx: torch.Tensor                 # [n, T] flattened query index
    k_idx: Optional[torch.Tensor]       # [n, W] flattened key index, or None for all keys
    owned: torch.Tensor                 # [n, T] bool
    inverse: torch.Tensor               # [S_q] position of each query's owning row in n*T
    static_mask: Optional[torch.Tensor]  # [n, T, W] bool
    num_keys: int                       # W
    hidden: Optional[torch.Tensor] = None  # ~static_mask, set by the plan
    _copies: dict = field(default_factory=dict, repr=False)

    def on(self, device) -> "Tiles":
        """These tables on ``device`` (copied once per device, then reused)."""
        device = torch.device(device)
        if device == self.q_idx.device:
            return self
        if device not in self._copies:
            moved = {f: (getattr(self, f).to(device) if isinstance(getattr(self, f), torch.Tensor)
                         else getattr(self, f))
                     for f in ("q_idx", "k_idx", "owned", "inverse", "static_mask", "num_keys",
                               "hidden")}
            self._copies[device] = Tiles(**moved)
        return self._copies[device]

    @property
    def count(self) -> int:
        return self.q_idx.shape[0]

    @property
    def size(self) -> int:
        return self.q_idx.shape[1]


def _outer_index(parts: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """Row-major flattened index of the Cartesian product of per-axis [n_a, t_a] coordinates,
    as [prod n, prod t]."""
    ndim = len(parts)
    strides = [math.prod(shape[a + 1:]) for a in range(ndim)]
    total = 0
    for a, (coords, stride) in enumerate(zip(parts, strides)):
        view = [1] * (2 * ndim)
        view[a], view[ndim + a] = coords.shape
        total = total + (coords * stride).view(view)
    n = math.prod(p.shape[0] for p in parts)
    return total.reshape(n, -1)


def _outer_and(parts: list[torch.Tensor]) -> torch.Tensor:
    """AND of per-axis [n_a, t_a, w_a] masks as [prod n, prod t, prod w]."""
    ndim = len(parts)
    total = None
    for a, m in enumerate(parts):
        view = [1] * (3 * ndim)
        view[a], view[ndim + a], view[2 * ndim + a] = m.shape
        total = m.view(view) if total is None else total & m.view(view)
    n = math.prod(p.shape[0] for p in parts)
    t = math.prod(p.shape[1] for p in parts)
    return total.reshape(n, t, -1)


def build_tiles(axes: list[AxisWindows], shape: tuple[int, ...], seq_kv: int,
                tile_shape: tuple[int, ...], needs_mask: bool) -> Tiles:
    q_parts, k_parts, own_parts, mask_parts = [], [], [], []
    for axis, t in zip(axes, tile_shape):
        starts, rows, key_start, width = _axis_boxes(axis, t)
        keys = key_start[:, None] + torch.arange(width)
        own_parts.append(rows >= torch.arange(len(starts))[:, None] * t)
        lo, hi = axis.lo[rows][:, :, None], axis.hi[rows][:, :, None]
        mask_parts.append((keys[:, None, :] >= lo) & (keys[:, None, :] < hi))
        q_parts.append(axis.q_order[rows])
        k_parts.append(axis.k_order[keys])
    q_idx = _outer_index(q_parts, shape)
    owned = _outer_and([o[:, :, None] for o in own_parts])[:, :, 0]
    num_keys = math.prod(k.shape[1] for k in k_parts)
    dense = num_keys >= DENSE_FRACTION * seq_kv
    if dense:
        k_idx, num_keys = None, seq_kv
    else:
        k_idx = _outer_index(k_parts, shape)
    static = None
    if needs_mask or not bool(owned.all()):
        if dense:
            static = None  # evaluated per chunk from the masks themselves
        elif q_idx.numel() * num_keys <= MAX_TABLE_ELEMENTS:
            static = _outer_and(mask_parts) & owned[:, :, None]
    inverse = torch.empty(int(q_idx.max()) + 1, dtype=torch.long)
    flat_rows = torch.arange(q_idx.numel()).view_as(q_idx)
    inverse[q_idx[owned]] = flat_rows[owned]
    return Tiles(q_idx, k_idx, owned, inverse, static, num_keys)


# ---------------------------------------------------------------------------------------------
# Visibility evaluated on index tensors (for chunks without a precomputed table)
# ---------------------------------------------------------------------------------------------

def _unflatten(index: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    coords = []
    for n in reversed(shape):
        coords.append(index % n)
        index = index // n
    return coords[::-1]


class Visibility:
    """Evaluates an AND of masks on broadcastable (query, key) index tensors."""

    def __init__(self, masks, seq_q: int, seq_kv: int):
        self.seq_q, self.seq_kv = seq_q, seq_kv
        self.line_masks = [m for m in masks if isinstance(m, (Causal, SlidingWindow))]
        # Padding lengths are per-call values (not in the plan key): methods take them as arguments.
        self.has_padding = any(isinstance(m, Padding) for m in masks)
        self.neighborhoods = []
        for m in masks:
            if isinstance(m, Neighborhood):
                axes = [neighborhood_axis(*a) for a in m.axes()]
                inverse = []
                for ax in axes:
                    inv = torch.empty_like(ax.q_order)
                    inv[ax.q_order] = torch.arange(ax.q_order.numel())
                    inverse.append(inv)
                self.neighborhoods.append((m.spatial_shape, axes, inverse))

    def offset(self, alignment: str, device, padding=None) -> torch.Tensor | int:
        """``i' - i`` for an alignment: a scalar, or ``[B, 1, 1, 1]`` with padding."""
        if alignment == "top_left":
            return 0
        if padding is None:
            return self.seq_kv - self.seq_q
        lens_q, lens_kv = padding.tensors(device)
        return (lens_kv - lens_q).view(-1, 1, 1, 1)

    def static(self, qi: torch.Tensor, kj: torch.Tensor, dynamic_lines: bool) -> torch.Tensor | None:
        """Masks that do not depend on per-call values; line masks only if not ``dynamic_lines``."""
        result = None
        for shape, axes, inverse in self.neighborhoods:
            for cq, ck, ax, inv in zip(_unflatten(qi, shape), _unflatten(kj, shape), axes, inverse):
                inv, lo, hi = (x.to(qi.device) for x in (inv, ax.lo, ax.hi))
                pq, pk = inv[cq], inv[ck]
                ok = (pk >= lo[pq]) & (pk < hi[pq])
                result = ok if result is None else result & ok
        if not dynamic_lines:
            line = self.lines(qi, kj)
            if line is not None:
                result = line if result is None else result & line
        return result

    def lines(self, qi: torch.Tensor, kj: torch.Tensor, padding=None) -> torch.Tensor | None:
        result = None
        for m in self.line_masks:
            aligned = qi + self.offset(m.alignment, qi.device, padding)
            left, right = line_bounds(m)
            ok = None
            if left >= 0:
                ok = kj >= aligned - left
            if right >= 0:
                upper = kj <= aligned + right
                ok = upper if ok is None else ok & upper
            if ok is not None:
                result = ok if result is None else result & ok
        return result

    @staticmethod
    def padded(qi: torch.Tensor, kj: torch.Tensor, padding) -> torch.Tensor | None:
        if padding is None:
            return None
        lens_q, lens_kv = (t.view(-1, 1, 1, 1) for t in padding.tensors(qi.device))
        return (qi < lens_q) & (kj < lens_kv)
