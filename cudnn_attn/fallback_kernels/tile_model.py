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
:func:`kernel_ms` turns the figures into a kernel's time on a GPU's ceilings (``core.roofline``)
with the kernels' measured efficiencies (``FUSED_EFFICIENCY``). :func:`choose_tiles` is the
64-slot boxes; :func:`query_major_tiles` / :func:`key_major_tiles` the boxes (and so the kernels:
a 128-slot box names a wide kernel) a device launches, each wide kernel taken where the model
predicts it faster; :func:`launch_figures` the figures of one call's kernels at those boxes, what
``auto``'s cost rule and ``benchmarks/neighborhood.py`` predict from.
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
from . import fused_build, tile_shapes

__all__ = ["AxisCounts", "TileFigures", "axis_counts", "pair_unmasked", "axis_pair_unmasked",
           "tile_figures", "neighborhood_figures", "element_bytes", "choose_tiles", "forward_tiles",
           "wide_tiles", "wide_key_tiles", "dkdv_tiles", "WIDE_EFFICIENCY_GAIN",
           "query_major_tiles", "key_major_tiles", "LaunchFigures", "launch_figures",
           "PRODUCTS", "DIRECTION_KERNELS", "FUSED_EFFICIENCY", "HOST_MS", "paced_ms", "kernel_work", "runs_wide", "kernel_ms",
           "predicted_ms"]

BACKWARD_FLOP_FACTOR = roofline.BACKWARD_FLOP_FACTOR

# GEMM-sized products per tile pair, per kernel: the forward S = Q K^T and P V; dQ recomputes S,
# then dP = dO V^T and dQ += dS K; dK/dV recomputes S^T and dP^T, then dV += P^T dO and dK += dS^T
# Q. Seven backward products where FlashAttention-2 does five (BACKWARD_FLOP_FACTOR: the useful
# FLOPs' convention): the split into two kernels keeps the backward free of atomics.
PRODUCTS = {"fwd": 2, "dq": 3, "dkdv": 4}
DIRECTION_KERNELS = {"fwd": ("fwd",), "bwd": ("dq", "dkdv")}  # the backward: dQ, then dK/dV

# Fractions of the 16-bit matmul ceiling the fused kernels reach on the products they compute,
# per kernel and tile path (unmasked pairs skip the per-element visibility test): a least-squares
# fit (log time) of the tile model to the third H200 run's bf16 rows, 64-slot and wide kernels
# forced on every problem (benchmarks/results/neighborhood-2026-11-29.json and more/: 2-D 128x128
# k31 H16 D128, k7 H8 D128, 2-D 64x64 k13 H16 D64, 1-D 32768 k2048 H16 D128, 3-D 32^3 k7 H16
# D128; measured pairs the model orders as the GPU did: 90 % with the earlier constants, 92 %
# with these), one figure for both backward kernels (per product computed). Small problems were
# host-bound in that run (2-D 64x64 k13: 0.47 ms per forward, 0.07 ms of kernel), so these are
# low for them. ``benchmarks/fit_tile_model.py`` refits them from a GPU record.
_BACKWARD_FIT = {"unmasked": 0.304, "masked": 0.133}
FUSED_EFFICIENCY = {"fwd": {"unmasked": 0.360, "masked": 0.163},
                    "dq": dict(_BACKWARD_FIT), "dkdv": dict(_BACKWARD_FIT)}

# The host's milliseconds per call of the engine that launches these kernels (its Python and the
# launches), which set the pace of back-to-back calls whose kernels take less: the same run's
# small problems (2-D 64x64 k13 H16 D64, 2-D 128x128 k7 H8 D128) took 0.47 / 0.40 ms per forward
# against 0.11 / 0.13 ms this model predicts (0.07 / 0.16 ms in the profile), and 1.7 / 1.6 ms per
# backward against 0.47 / 0.55 ms. Measured before launches took tensors as addresses (DLPack
# then); benchmarks/na_host.py measures the host alone for the next refit.
HOST_MS = {"fwd": 0.30, "bwd": 1.1}


def paced_ms(kernels_ms: float, direction: str) -> float:
    """The time per call back to back: the slower of the kernels (``kernels_ms``) and the
    host (``HOST_MS[direction]``); what ``auto``'s cost rule compares."""
    return max(kernels_ms, HOST_MS[direction])


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

    Counts of tiles and score elements are per (batch, query head); ``*_flops`` and ``bytes``
    cover the whole problem, keyed by kernel (``"fwd"``, ``"dq"`` with the delta pass, ``"dkdv"``)
    and ``"bwd"`` (both backward kernels at these boxes). ``computed_flops`` counts the products
    the kernels compute (``PRODUCTS``); ``useful_flops`` the visible scores at the usual
    convention (backward ``BACKWARD_FLOP_FACTOR`` x forward), what useful TFLOP/s divide. Bytes
    count whole tiles (a partial box still moves its real rows only, so they are an upper bound
    at group ends); the dK/dV walk is taken to visit as many pairs as the forward (it walks the
    same pairs key-major)."""

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
    unmasked, useful_scores = prod("unmasked_pairs"), prod("useful")
    computed = pairs * qt * kt
    per_score = 2 * (dim_qk + dim_v)  # Q K^T and P V: 4 D per score element when D_qk = D_v
    bh = batch * heads
    e = element_bytes(dtype)
    q_rows, kv_rows = bh * query_tiles * qt, bh * pairs * kt
    own_keys = batch * heads_kv * key_tiles * kt
    nbytes = {
        "fwd": (q_rows * (dim_qk + dim_v) * e + q_rows * 4   # Q in, O and lse out
                + kv_rows * (dim_qk + dim_v) * e),            # K and V per visited key tile
        "dq": (q_rows * (2 * dim_qk + dim_v) * e + q_rows * 8  # Q, dO in, dQ out; lse, delta
               + kv_rows * (dim_qk + dim_v) * e               # K, V per pair
               + q_rows * 2 * dim_v * e),                      # the delta pass: rowsum(dO * O)
        "dkdv": (own_keys * 2 * (dim_qk + dim_v) * e           # K, V in, dK, dV out
                 + bh * pairs * qt * ((dim_qk + dim_v) * e + 8))}  # Q, dO, lse, delta per pair
    nbytes["bwd"] = nbytes["dq"] + nbytes["dkdv"]
    per_kernel = {"fwd": per_score, "dq": 2 * (2 * dim_qk + dim_v), "dkdv": 2 * per_score}
    computed_flops = {kernel: bh * computed * flops for kernel, flops in per_kernel.items()}
    computed_flops["bwd"] = computed_flops["dq"] + computed_flops["dkdv"]
    useful = bh * useful_scores * per_score
    return TileFigures(
        tuple(query_box), tuple(key_box), dtype, bh, roofline.score_flops(dim_qk, dim_v), qt, kt,
        query_tiles, key_tiles, pairs, unmasked, useful_scores, computed,
        {"fwd": useful, "bwd": useful * BACKWARD_FLOP_FACTOR}, computed_flops, nbytes)


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
# rows; their larger boxes compute more score elements, and more of their pairs are masked. The
# third H200 run measured both kernels on the same problems and fitted them at this many times
# the 64-slot kernels' efficiency (fit_tile_model.py): below 1, so the model takes a wide kernel
# only where its boxes compute enough fewer elements (none of that run's problems).
WIDE_EFFICIENCY_GAIN = 0.84


def wide_tiles(table: Sequence[int], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The wide kernels' best (query box, key box): ``tile_shapes.WIDE_QUERY_TILE`` queries, the
    fewest score elements computed (``choose_tiles``' rule at that volume)."""
    return _choose(tuple(table), rank, tile_shapes.WIDE_QUERY_TILE, tile_shapes.FUSED_KEY_TILE)


@memoize("fallback_kernels.tile_model.forward_tiles", maxsize=512)
def forward_tiles(table: tuple, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The query-major kernels' (forward and dQ) (query box, key box) where the wide kernels can
    run: :func:`wide_tiles` when the model predicts the wide forward no slower than the 64-query
    one on :func:`choose_tiles`' pair (:func:`_faster`), else that pair. The query box's volume
    names the kernel (``fused.run_forward``, ``fused.run_backward``)."""
    return _faster(table, "fwd", choose_tiles(table, rank), wide_tiles(table, rank))


def wide_key_tiles(table: Sequence[int], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The wide dK/dV's best (query box, key box): 64 queries, ``tile_shapes.WIDE_KEY_TILE``
    keys, the fewest score elements computed."""
    return _choose(tuple(table), rank, tile_shapes.FUSED_QUERY_TILE, tile_shapes.WIDE_KEY_TILE)


@memoize("fallback_kernels.tile_model.dkdv_tiles", maxsize=512)
def dkdv_tiles(table: tuple, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """dK/dV's (query box, key box) where the wide dK/dV can run (``fused.dkdv_boxes``):
    :func:`wide_key_tiles` when the model predicts the wide dK/dV no slower than the 64-key one
    on :func:`choose_tiles`' pair, else that pair. The key box's volume names the kernel
    (``fused.run_backward``)."""
    return _faster(table, "dkdv", choose_tiles(table, rank), wide_key_tiles(table, rank))


def _faster(table: tuple, kernel: str, narrow: tuple, wide: tuple) -> tuple:
    """Of two box pairs, the one whose matmul time :func:`kernel_ms` predicts the smaller (ties:
    ``wide``; the one rule for every wide kernel). Compute time only: per score element it
    depends on the counts and the efficiencies alone, not on the head dim or the GPU."""
    def cost(boxes):
        figures = tile_figures(table, *boxes, dim_qk=64, query_tile=math.prod(boxes[0]),
                               key_tile=math.prod(boxes[1]))
        eff = _efficiency(kernel, runs_wide(figures, kernel))
        return sum(flops / eff[path] for path, flops in kernel_work(figures, kernel).items())

    return wide if cost(wide) <= cost(narrow) else narrow


def kernel_work(figures: TileFigures, kernel: str) -> dict:
    """``{"unmasked": flops, "masked": flops}``: the products ``kernel`` computes over
    ``figures``' unmasked and masked pairs, at the cost model's FLOPs per score element."""
    per_pair = (figures.batch_heads * figures.query_tile * figures.key_tile * figures.score_flops
                * PRODUCTS[kernel] / PRODUCTS["fwd"])
    return {"unmasked": figures.unmasked_pairs * per_pair,
            "masked": figures.masked_pairs * per_pair}


def runs_wide(figures: TileFigures, kernel: str) -> bool:
    """Whether ``kernel`` over ``figures``' boxes is a wide kernel: more than 64 slots in the box
    of its own side (keys for dK/dV, queries otherwise)."""
    own = figures.key_tile if kernel == "dkdv" else figures.query_tile
    return own > tile_shapes.FUSED_QUERY_TILE


def _efficiency(kernel: str, wide: bool, efficiency: dict | None = None) -> dict:
    """``FUSED_EFFICIENCY[kernel]`` (or ``efficiency``), times ``WIDE_EFFICIENCY_GAIN`` for a
    wide kernel."""
    eff = efficiency or FUSED_EFFICIENCY[kernel]
    gain = WIDE_EFFICIENCY_GAIN if wide else 1.0
    return {path: gain * value for path, value in eff.items()}


def kernel_ms(figures: TileFigures, kernel: str, ceilings: roofline.Ceilings,
              efficiency: dict | None = None) -> float:
    """Predicted ms of one fused kernel (``kernel`` a key of ``PRODUCTS``) walking ``figures``'
    boxes: its unmasked and masked pairs' products at ``FUSED_EFFICIENCY[kernel]`` (or
    ``efficiency``: ``{"unmasked": .., "masked": ..}``), against its bytes' time. A wide kernel
    (a 128-slot box on its own side) is taken to reach ``WIDE_EFFICIENCY_GAIN`` times the
    64-slot kernel's efficiency."""
    eff = _efficiency(kernel, runs_wide(figures, kernel), efficiency)
    work = kernel_work(figures, kernel)
    return roofline.roofline_ms([(work[path], eff[path]) for path in work],
                                figures.bytes[kernel], ceilings, figures.dtype)


def predicted_ms(figures: TileFigures, direction: str, ceilings: roofline.Ceilings,
                 efficiency: dict | None = None) -> float:
    """Predicted ms of the fused kernels at ``figures``' boxes: ``direction`` "fwd", or "bwd"
    (the backward alone: dQ and dK/dV one after the other, :func:`kernel_ms` each; ``efficiency``
    then applies to both)."""
    return sum(kernel_ms(figures, kernel, ceilings, efficiency)
               for kernel in DIRECTION_KERNELS[direction])


def query_major_tiles(table: Sequence[int], rank: int, dtype: torch.dtype,
                      capability: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The (query box, key box) the forward and dQ launch with on a device of ``capability``:
    :func:`forward_tiles` where the wide kernels can run (``fused_build.wide``), else
    :func:`choose_tiles`."""
    if fused_build.wide(dtype, capability):
        return forward_tiles(tuple(table), rank)
    return choose_tiles(table, rank)


def key_major_tiles(table: Sequence[int], rank: int, dtype: torch.dtype, head_dim: int,
                    capability: tuple[int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """dK/dV's (query box, key box) on a device of ``capability``: :func:`dkdv_tiles` where the
    wide dK/dV can run (``fused_build.wide`` and ``head_dim``, the compiled bucket, in
    ``WIDE_DKDV_HEAD_DIMS``), else :func:`choose_tiles`."""
    if fused_build.wide(dtype, capability) and head_dim in fused_build.WIDE_DKDV_HEAD_DIMS:
        return dkdv_tiles(tuple(table), rank)
    return choose_tiles(table, rank)


@dataclass(frozen=True)
class LaunchFigures:
    """The figures of the kernels one call launches: the forward and dQ walk ``query_major``'s
    boxes, dK/dV ``key_major``'s (the wide kernels' where they run)."""

    query_major: TileFigures
    key_major: TileFigures

    def kernel_figures(self, kernel: str) -> TileFigures:
        return self.key_major if kernel == "dkdv" else self.query_major

    def predicted_ms(self, direction: str, ceilings: roofline.Ceilings) -> float:
        """Predicted ms of the forward (``"fwd"``) or the backward alone (``"bwd"``)."""
        return sum(kernel_ms(self.kernel_figures(k), k, ceilings)
                   for k in DIRECTION_KERNELS[direction])

    def total(self, field: str, direction: str) -> float:
        """``computed_flops`` or ``bytes`` of a direction, each kernel at its own boxes."""
        return sum(getattr(self.kernel_figures(k), field)[k] for k in DIRECTION_KERNELS[direction])

    def useful_fraction(self, direction: str) -> float:
        """Visible score elements over computed ones, over the direction's kernels."""
        figures = [self.kernel_figures(k) for k in DIRECTION_KERNELS[direction]]
        computed = sum(f.computed for f in figures)
        return sum(f.useful for f in figures) / computed if computed else 1.0


def launch_figures(table: Sequence[int], rank: int, capability: tuple[int, int], *,
                   dim_qk: int, dim_v: int | None = None, dtype: torch.dtype = torch.bfloat16,
                   **dims) -> LaunchFigures:
    """:class:`LaunchFigures` of ``table`` on a device of ``capability`` (``dims``: ``batch``,
    ``heads``, ``heads_kv``), with the boxes and kernels ``fused`` launches there."""
    head_dim = fused_build.head_dim_bucket(dim_qk, dim_qk if dim_v is None else dim_v)
    both = dict(dim_qk=dim_qk, dim_v=dim_v, dtype=dtype, **dims)

    def figures(boxes):
        qbox, kbox = boxes
        return tile_figures(table, qbox, kbox, query_tile=math.prod(qbox),
                            key_tile=math.prod(kbox), **both)

    return LaunchFigures(figures(query_major_tiles(table, rank, dtype, capability)),
                         figures(key_major_tiles(table, rank, dtype, head_dim, capability)))
