"""The tile model of the fused kernels: what one launch visits, computes and loads, on the CPU.

For a geometry table (``cudnn_attn.model.geometry``: a neighborhood or a 1-D band) and a (query
box, key box) pair it counts, per batch and query head, what the fused kernels' tile walk does
(the walk of ``fused.py``'s Python mirror: each query box visits the key boxes that tile the
per-axis key range its queries see):

* ``query_tiles`` (forward / dQ blocks), ``key_tiles`` (dK/dV blocks), ``tile_pairs`` (key boxes
  visited by all query boxes), ``unmasked_pairs`` (pairs that need no mask, :func:`pair_unmasked`);
* ``useful`` score elements (visible query-key pairs, exact) and ``computed`` ones (every pair
  computes ``QUERY_TILE x KEY_TILE`` scores);
* bytes loaded and FLOPs per direction (:class:`TileFigures`).

Boxes factorise over axes, and so does visibility (a key is visible iff it is on every axis), so
every count is a product of per-axis counts: a 32^3 problem costs three 32-long passes. The tile
sizes come from ``tile_shapes`` (``FUSED_QUERY_TILE`` / ``FUSED_KEY_TILE``, read at call time);
:func:`predicted_ms` turns the figures into a time on a GPU's ceilings (``core.roofline``) with
the kernels' measured efficiencies (``FUSED_EFFICIENCY``); :func:`choose_tiles` is the boxes the
kernels launch with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..core import roofline
from ..core.caches import memoize
from ..model.geometry import (MODE_BAND, axis_dilation, axis_window, group_len,
                              neighborhood_table, table_axes)
from . import tile_shapes

__all__ = ["AxisCounts", "TileFigures", "axis_counts", "pair_unmasked", "axis_pair_unmasked",
           "tile_figures", "neighborhood_figures", "element_bytes", "choose_tiles", "forward_tiles",
           "wide_tiles", "wide_key_tiles", "dkdv_tiles",
           "FUSED_EFFICIENCY", "predicted_ms"]

BACKWARD_FLOP_FACTOR = roofline.BACKWARD_FLOP_FACTOR

# Fractions of the 16-bit matmul ceiling the fused kernels reach, per direction and tile path
# (unmasked pairs skip the per-element visibility test). THESE DESCRIBE TODAY'S KERNELS (the
# 4-warp, 64/64-tile, serialized-geometry ones of issue 34): a least-squares fit (log time) of
# the tile model to issue 34's H200 bf16 forward rows (2-D 128x128 k31 H8 D128 2.55 ms, k7 0.82
# ms, 2-D 64x64 k13 H16 D64 0.53 ms, 1-D 32768 k2048 H16 62 TFLOP/s, 3-D 32^3 k7 13.4 TFLOP/s;
# predicted/measured within 0.7-1.45x); backward from 2-D k31 (4.82 ms) and 1-D k2048 (70 TFLOP/s).
# A rewritten kernel updates them from benchmarks/neighborhood.py's measured/predicted column.
FUSED_EFFICIENCY = {"fwd": {"unmasked": 0.088, "masked": 0.037},
                    "bwd": {"unmasked": 0.098, "masked": 0.056}}


def axis_pair_unmasked(window_lo: Sequence[int], window_hi: Sequence[int], key_start: int,
                       key_side: int, key_end: int) -> bool:
    """Whether a (query segment, key segment) pair needs no mask on one axis.

    ``window_lo[i], window_hi[i]``: the key window ``[lo, hi)`` (group coordinates) of each real
    query of the segment; the key segment is ``[key_start, key_start + key_side)`` and
    ``key_end`` the end of the key range the segment's query box visits (within the group). The
    pair is unmasked iff the key segment is whole (``key_start + key_side <= key_end``: no slot
    past the range, which a mask would have to hide) and every query sees every key of it.
    """
    key_stop = key_start + key_side
    return key_stop <= key_end and max(window_lo) <= key_start and key_stop <= min(window_hi)


def pair_unmasked(per_axis: Sequence[tuple[Sequence[int], Sequence[int], int, int, int]]) -> bool:
    """Whether a (query box, key box) pair needs no mask: unmasked on every axis
    (:func:`axis_pair_unmasked` of each axis' ``(window_lo, window_hi, key_start, key_side,
    key_end)``). Visibility is the AND of the axes, so every query of the box sees every key of
    the key box exactly when that holds on each axis. The one rule of the tile model; a kernel
    that skips the mask test must skip it on exactly these pairs."""
    return all(axis_pair_unmasked(*axis) for axis in per_axis)


@dataclass(frozen=True)
class AxisCounts:
    """One axis' share of the counts (the multi-axis counts are products of these)."""

    query_tiles: int
    key_tiles: int
    pairs: int
    unmasked_pairs: int
    useful: int      # sum over queries of the keys each sees on this axis


def _windows(axis: Sequence[int], glen: int) -> tuple[list[int], list[int]]:
    lo, hi = axis_window(axis, torch.arange(glen), glen)
    lo, hi = torch.as_tensor(lo).expand(glen), torch.as_tensor(hi).expand(glen)
    return lo.tolist(), torch.maximum(hi, lo).tolist()


@memoize("fallback_kernels.tile_model.axis_counts", maxsize=4096)
def axis_counts(axis: tuple[int, ...], query_side: int, key_side: int) -> AxisCounts:
    """The counts of one geometry-table axis record (a tuple) for box sides ``query_side`` /
    ``key_side`` (memoized: a box search asks each axis for a few side pairs many times)."""
    dilation = axis_dilation(axis)
    len_q, len_kv = axis[1], axis[2]
    query_tiles = key_tiles = pairs = unmasked = useful = 0
    for g in range(dilation):
        glen_q = group_len(len_q, dilation, g)
        glen_kv = len_kv if axis[0] == MODE_BAND else group_len(len_kv, dilation, g)
        key_tiles += -(-glen_kv // key_side)
        if glen_q <= 0:
            continue
        lo, hi = _windows(axis, glen_q)
        useful += sum(hi) - sum(lo)
        for q0 in range(0, glen_q, query_side):
            q1 = min(q0 + query_side, glen_q)
            query_tiles += 1
            first, last = lo[q0], max(hi[q1 - 1], lo[q0])  # monotone windows (fused.py's walk)
            n = -(-(last - first) // key_side)
            pairs += n
            # Key segments [first + j * side, + side) that every query sees, whole inside the
            # range: j from ceil((max lo - first) / side) to floor((min(min hi, last) - side -
            # first) / side) (the arithmetic form of axis_pair_unmasked over the segments).
            top = min(min(hi[q0:q1]), last) - key_side - first
            if top >= 0:
                j0 = -(-(max(lo[q0:q1]) - first) // key_side)
                unmasked += max(0, min(top // key_side, n - 1) - j0 + 1)
    return AxisCounts(query_tiles, key_tiles, pairs, unmasked, useful)


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TileFigures:
    """What the fused kernels do for one problem (all batches and heads) with one box pair.

    Counts of tiles and score elements are per (batch, query head); ``*_flops`` and ``*_bytes``
    cover the whole problem. Bytes count whole tiles (a partial box still moves its real rows
    only, so they are an upper bound at group ends); the backward's dK/dV walk is taken to visit
    as many pairs as the forward (it walks the same pairs key-major)."""

    query_box: tuple[int, ...]
    key_box: tuple[int, ...]
    dtype: torch.dtype
    batch_heads: int
    score_flops: int   # FLOPs a score element costs the cost model (roofline.score_flops)
    query_tile: int
    key_tile: int
    query_tiles: int
    key_tiles: int
    tile_pairs: int
    unmasked_pairs: int
    useful: int
    computed: int
    useful_flops: dict
    computed_flops: dict
    unmasked_flops: dict
    bytes: dict

    @property
    def masked_pairs(self) -> int:
        return self.tile_pairs - self.unmasked_pairs

    @property
    def useful_fraction(self) -> float:
        return self.useful / self.computed if self.computed else 1.0

    @property
    def unmasked_fraction(self) -> float:
        return self.unmasked_pairs / self.tile_pairs if self.tile_pairs else 0.0


def _pad(box: Sequence[int]) -> tuple[int, ...]:
    return tuple(box) + (1,) * (3 - len(box))


def tile_figures(table: Sequence[int], query_box: Sequence[int], key_box: Sequence[int], *,
                 dim_qk: int, dim_v: int | None = None, dtype: torch.dtype = torch.bfloat16,
                 batch: int = 1, heads: int = 1, heads_kv: int | None = None,
                 query_tile: int | None = None, key_tile: int | None = None) -> TileFigures:
    """The :class:`TileFigures` of ``table`` with ``query_box`` / ``key_box`` (rank-sized or 3
    sides); tile sizes default to ``tile_shapes.FUSED_QUERY_TILE`` / ``FUSED_KEY_TILE`` (read at
    call time, so a change there reaches the model)."""
    dim_v = dim_qk if dim_v is None else dim_v
    heads_kv = heads if heads_kv is None else heads_kv
    qt = tile_shapes.FUSED_QUERY_TILE if query_tile is None else query_tile
    kt = tile_shapes.FUSED_KEY_TILE if key_tile is None else key_tile
    qb, kb = _pad(query_box), _pad(key_box)
    if math.prod(qb) != qt or math.prod(kb) != kt:
        raise ValueError(f"query_box {tuple(query_box)} / key_box {tuple(key_box)} must hold "
                         f"{qt} / {kt} positions")
    axes = [axis_counts(tuple(ax), q, k) for ax, q, k in zip(table_axes(table), qb, kb)]
    prod = lambda name: math.prod(getattr(a, name) for a in axes)  # noqa: E731
    query_tiles, key_tiles, pairs = prod("query_tiles"), prod("key_tiles"), prod("pairs")
    unmasked, useful = prod("unmasked_pairs"), prod("useful")
    computed = pairs * qt * kt
    per_score = 2 * (dim_qk + dim_v)  # Q K^T and P V: 4 D per score element when D_qk = D_v
    bh = batch * heads

    def both(forward: float) -> dict:
        return {"fwd": forward, "bwd": forward * BACKWARD_FLOP_FACTOR}

    e = element_bytes(dtype)
    q_rows, kv_rows = bh * query_tiles * qt, bh * pairs * kt
    forward_bytes = (q_rows * (dim_qk + dim_v) * e + q_rows * 4  # Q in, O and lse out
                     + kv_rows * (dim_qk + dim_v) * e)           # K and V per visited key tile
    own_keys = batch * heads_kv * key_tiles * kt
    backward_bytes = (q_rows * (2 * dim_qk + dim_v) * e + q_rows * 8  # dQ: Q, dO in, dQ out; lse, delta
                      + kv_rows * (dim_qk + dim_v) * e                # dQ: K, V per pair
                      + own_keys * 2 * (dim_qk + dim_v) * e           # dK/dV: K, V in, dK, dV out
                      + bh * pairs * qt * ((dim_qk + dim_v) * e + 8)  # dK/dV: Q, dO, lse, delta per pair
                      + q_rows * 2 * dim_v * e)                       # delta = rowsum(dO * O)
    return TileFigures(
        tuple(query_box), tuple(key_box), dtype, bh, roofline.score_flops(dim_qk, dim_v), qt, kt, query_tiles, key_tiles, pairs, unmasked,
        useful, computed, both(bh * useful * per_score), both(bh * computed * per_score),
        both(bh * unmasked * qt * kt * per_score), {"fwd": forward_bytes, "bwd": backward_bytes})


def neighborhood_figures(spatial_shape: Sequence[int], kernel_size: Sequence[int],
                         dilation: Sequence[int] | None = None, stride: Sequence[int] | None = None,
                         is_causal: Sequence[bool] | None = None, *,
                         query_box: Sequence[int] | None = None,
                         key_box: Sequence[int] | None = None, **dims) -> TileFigures:
    """:func:`tile_figures` of a NATTEN neighborhood; boxes default to :func:`choose_tiles`'s.
    ``dims``: ``dim_qk`` (required), ``dim_v``, ``dtype``, ``batch``, ``heads``, ``heads_kv``."""
    rank = len(spatial_shape)
    table = tuple(neighborhood_table(spatial_shape, kernel_size, stride or (1,) * rank,
                                     dilation or (1,) * rank, is_causal or (False,) * rank))
    if query_box is None or key_box is None:
        chosen = choose_tiles(table, rank)
        query_box = chosen[0] if query_box is None else query_box
        key_box = chosen[1] if key_box is None else key_box
    return tile_figures(table, query_box, key_box, **dims)


def choose_tiles(table: Sequence[int], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Default (query box, key box) for a rank: the pair computing the fewest score elements in
    the forward (the fewest key slots visited; ties: the first in ``valid_tile_sizes`` order,
    i.e. larger leading sides). The fused kernels launch with it (``fused.choose_tiles``)."""
    return _choose(tuple(table), rank, tile_shapes.FUSED_QUERY_TILE, tile_shapes.FUSED_KEY_TILE)


@memoize("fallback_kernels.tile_model.choose_tiles", maxsize=512)
def _choose(table: tuple, rank: int, query_tile: int, key_tile: int):
    best = None
    for qt in tile_shapes.box_shapes(query_tile, rank):
        for kt in tile_shapes.box_shapes(key_tile, rank):
            cost = _pairs(table, qt, kt)
            if best is None or cost < best[0]:
                best = (cost, qt, kt)
    assert best is not None  # box_shapes is never empty
    return best[1], best[2]


def _pairs(table: tuple, query_box: Sequence[int], key_box: Sequence[int]) -> int:
    return math.prod(axis_counts(tuple(ax), q, k).pairs
                     for ax, q, k in zip(table_axes(table), _pad(query_box), _pad(key_box)))


# The wide kernels (forward and dQ: 128-query boxes; dK/dV: 128-key boxes; 32 rows per warp)
# load each fragment of the other side once for two mma and each tile of it once for twice the
# rows; their larger boxes compute more masked scores. They are taken while they compute at most
# this many times the score elements of the 64-slot choice: a guess until a GPU record measures
# both kernels on the same problems (benchmarks/neighborhood).
WIDE_COMPUTE_ALLOWANCE = 1.25


def wide_tiles(table: Sequence[int], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The wide kernels' best (query box, key box): ``tile_shapes.WIDE_QUERY_TILE`` queries, the
    fewest score elements computed (``choose_tiles``' rule at that volume)."""
    return _choose(tuple(table), rank, tile_shapes.WIDE_QUERY_TILE, tile_shapes.FUSED_KEY_TILE)


@memoize("fallback_kernels.tile_model.forward_tiles", maxsize=512)
def forward_tiles(table: tuple, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The query-major kernels' (forward and dQ) (query box, key box) where the pipelined build
    runs: :func:`wide_tiles` when its computed score elements stay within
    ``WIDE_COMPUTE_ALLOWANCE`` of :func:`choose_tiles`' pair, else that pair. The query box's
    volume names the kernel (``fused.run_forward``, ``fused.run_backward``); dK/dV keeps
    :func:`choose_tiles`' pair."""
    return _wide_if_allowed(table, choose_tiles(table, rank), wide_tiles(table, rank))


def wide_key_tiles(table: Sequence[int], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The wide dK/dV's best (query box, key box): 64 queries, ``tile_shapes.WIDE_KEY_TILE``
    keys, the fewest score elements computed."""
    return _choose(tuple(table), rank, tile_shapes.FUSED_QUERY_TILE, tile_shapes.WIDE_KEY_TILE)


@memoize("fallback_kernels.tile_model.dkdv_tiles", maxsize=512)
def dkdv_tiles(table: tuple, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """dK/dV's (query box, key box) where the wide dK/dV can run (``fused.dkdv_boxes``): the
    best pair of 64-query and ``tile_shapes.WIDE_KEY_TILE``-key boxes under the rule of
    :func:`forward_tiles` (within ``WIDE_COMPUTE_ALLOWANCE`` of :func:`choose_tiles`' pair), else
    that pair. The key box's volume names the kernel (``fused.run_backward``)."""
    return _wide_if_allowed(table, choose_tiles(table, rank), wide_key_tiles(table, rank))


def _wide_if_allowed(table: tuple, narrow: tuple, wide: tuple) -> tuple:
    """``wide`` when its computed score elements stay within ``WIDE_COMPUTE_ALLOWANCE`` of
    ``narrow``'s, else ``narrow`` (the one rule for every wide kernel)."""
    computed = {boxes: _pairs(tuple(table), *boxes) * math.prod(boxes[0]) * math.prod(boxes[1])
                for boxes in (narrow, wide)}
    return wide if computed[wide] <= WIDE_COMPUTE_ALLOWANCE * computed[narrow] else narrow


def predicted_ms(figures: TileFigures, direction: str, ceilings: roofline.Ceilings,
                 efficiency: dict | None = None) -> float:
    """Predicted ms of the fused kernels (``direction`` "fwd" or "bwd": the backward alone) from
    ``figures``: the unmasked and the masked pairs' matmul times at their ``FUSED_EFFICIENCY``
    (or ``efficiency``: ``{"unmasked": .., "masked": ..}``), against the bytes' time."""
    eff = efficiency or FUSED_EFFICIENCY[direction]
    per_pair = (figures.batch_heads * figures.query_tile * figures.key_tile * figures.score_flops
                * (BACKWARD_FLOP_FACTOR if direction == "bwd" else 1.0))
    work = [(figures.unmasked_pairs * per_pair, eff["unmasked"]),
            (figures.masked_pairs * per_pair, eff["masked"])]
    return roofline.roofline_ms(work, figures.bytes[direction], ceilings, figures.dtype)
