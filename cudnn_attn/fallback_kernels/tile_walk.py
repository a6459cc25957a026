"""Python mirror of the fused kernels' tile walk (``fused_attention.cu``): per axis, the key range
a query box sees and the query range that sees a key box, the tiles of an axis in the kernels'
enumeration order, launch grids and the key slots the forward visits. The window rule itself is
``geometry.axis_window``; the CPU tests check the kernels' skipping rule against it through these
(``fused`` re-exports them).
"""

from __future__ import annotations

from typing import Sequence

from ..model.geometry import MAX_AXES, axis_dilation, axis_window, group_len, table_axes
from .tile_shapes import FUSED_QUERY_TILE

__all__ = ["group_key_range", "group_query_range", "axis_tiles", "axis_tile_list", "launch_grid",
           "pad3", "forward_tokens"]


def group_key_range(ax, glen: int, q0: int, q1: int) -> tuple[int, int]:
    """Keys [lo, hi) of a group that the queries [q0, q1) see (na_group_key_range)."""
    lo0, _ = axis_window(ax, q0, glen)
    _, hi1 = axis_window(ax, q1 - 1, glen)
    return lo0, max(hi1, lo0)


def group_query_range(ax, glen_q: int, k0: int, k1: int) -> tuple[int, int]:
    """Queries [lo, hi) of a group that see any key of [k0, k1) (monotone windows;
    na_group_query_range)."""
    lo = next((i for i in range(glen_q) if axis_window(ax, i, glen_q)[1] > k0), glen_q)
    hi = next((i for i in range(lo, glen_q) if axis_window(ax, i, glen_q)[0] >= k1), glen_q)
    return lo, hi


def axis_tiles(length: int, d: int, tile: int) -> int:
    r, q = length % d, length // d
    return r * -(-(q + 1) // tile) + (d - r) * -(-q // tile)


def axis_tile_list(length: int, d: int, tile: int) -> list[tuple[int, int, int]]:
    """(group, first, end) of every tile of an axis, in the kernels' enumeration order."""
    out = []
    for g in range(d):
        glen = group_len(length, d, g)
        out.extend((g, s, min(s + tile, glen)) for s in range(0, glen, tile))
    return out


def launch_grid(table: Sequence[int], box: Sequence[int], heads: int, batch: int,
                own_queries: bool = True) -> tuple[int, int, int]:
    """Blocks of a launch: tiles (product over axes) x heads x batch. ``box`` is the own tile
    shape (rank-sized or 3 entries); ``own_queries`` False for the dK/dV kernel (key tiles)."""
    box = pad3(box)
    n = 1
    for ax, t in zip(table_axes(table), box):
        n *= axis_tiles(ax[1] if own_queries else ax[2], axis_dilation(ax), t)
    return (n, heads, batch)


def pad3(box: Sequence[int]) -> tuple[int, int, int]:
    """A rank-sized box as the kernels' three sides (missing axes 1)."""
    return tuple(box) + (1,) * (MAX_AXES - len(box))


def forward_tokens(table: Sequence[int], query_box: Sequence[int],
                   key_box: Sequence[int]) -> int:
    """Key slots the forward visits over all query tiles (per batch and head): the per-axis
    sums of visited key tiles multiply, because the boxes factorise over axes."""
    total = 1
    for ax, qt, kt in zip(table_axes(table), pad3(query_box), pad3(key_box)):
        d, axis_sum = axis_dilation(ax), 0
        for g, q0, q1 in axis_tile_list(ax[1], d, qt):
            lo, hi = group_key_range(ax, group_len(ax[1], d, g), q0, q1)
            axis_sum += -(-(hi - lo) // kt)
        total *= axis_sum * kt
    return total * FUSED_QUERY_TILE
