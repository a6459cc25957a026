"""Tile shapes of the fused kernel: which (query tile, key tile) pairs it can run.

The fused kernel works on ``FUSED_QUERY_TILE`` queries and ``FUSED_KEY_TILE`` keys at a time (both
fixed at compile time, the ``QUERY_TILE``/``KEY_TILE`` macros of ``fused_attention.cu``); a
rank-``n`` problem shapes them into boxes whose sides are powers of two, so the valid pairs are
every such factorisation of the two. The box shape is a launch argument, not a compile-time one:
every pair below runs on the same compiled kernels.
"""

from __future__ import annotations

import itertools

import torch

from ..core.caches import memoize
from .limits import FUSED_DTYPES, MAX_HEAD_DIM

__all__ = ["FUSED_QUERY_TILE", "FUSED_KEY_TILE", "WIDE_QUERY_TILE", "WIDE_KEY_TILE",
           "FUSED_DTYPES", "MAX_HEAD_DIM", "box_shapes",
           "valid_tile_sizes", "check_tile_sizes"]

FUSED_QUERY_TILE = 64
FUSED_KEY_TILE = 64
# The pipelined build's wide forward and dQ: 128-query boxes against the same 64-key boxes.
# Chosen by ``tile_model.forward_tiles``, never asked for by a user's tile sizes (those name the
# kernels above, which every build has).
WIDE_QUERY_TILE = 128
# The wide dK/dV (sm_90+, head dims up to 64): 128-key boxes against 64-query boxes. Chosen by
# ``tile_model.dkdv_tiles``.
WIDE_KEY_TILE = 128


@memoize("fallback_kernels.box_shapes")
def box_shapes(volume: int, rank: int) -> tuple[tuple[int, ...], ...]:
    """Every ``rank``-tuple of powers of two whose product is ``volume``, largest first."""
    exponent = volume.bit_length() - 1
    shapes = [tuple(2 ** e for e in split)
              for split in itertools.product(range(exponent + 1), repeat=rank)
              if sum(split) == exponent]
    return tuple(sorted(shapes, reverse=True))


def valid_tile_sizes(na_dim: int, head_dim: int, dtype: torch.dtype) -> list:
    """Every ``(query_tile_size, key_tile_size)`` pair the fused kernel accepts.

    Each entry is a pair of ``na_dim``-tuples. Empty when the fused kernel cannot run
    ``head_dim``/``dtype`` at all (head_dim above 128, float64).

    Example::

        >>> valid_tile_sizes(2, 64, torch.float16)[:2]
        [((64, 1), (64, 1)), ((64, 1), (32, 2))]
    """
    if na_dim not in (1, 2, 3):
        raise ValueError(f"na_dim must be 1, 2 or 3, got {na_dim!r}")
    if not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if dtype not in FUSED_DTYPES or head_dim > MAX_HEAD_DIM:
        return []
    return [(q, k) for q in box_shapes(FUSED_QUERY_TILE, na_dim)
            for k in box_shapes(FUSED_KEY_TILE, na_dim)]


def check_tile_sizes(na_dim: int, head_dim: int, dtype: torch.dtype, query_tile_size,
                     key_tile_size) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Normalise a user's tile pair (ints or tuples) or raise a ``ValueError`` naming the valid ones."""
    def as_tuple(value, name):
        if isinstance(value, int) and not isinstance(value, bool):
            return (value,) * na_dim
        if isinstance(value, (tuple, list)) and len(value) == na_dim and all(
                isinstance(x, int) and not isinstance(x, bool) for x in value):
            return tuple(value)
        raise ValueError(f"{name} must be an int or a tuple of {na_dim} ints, got {value!r}")

    pair = (as_tuple(query_tile_size, "query_tile_size"), as_tuple(key_tile_size, "key_tile_size"))
    valid = valid_tile_sizes(na_dim, head_dim, dtype)
    if pair not in valid:
        listed = ", ".join(f"({q}, {k})" for q, k in valid) or "none for this head_dim/dtype"
        raise ValueError(
            f"invalid tile sizes query_tile_size={pair[0]}, key_tile_size={pair[1]} for a "
            f"{na_dim}-D problem with head_dim={head_dim}, dtype={dtype}; valid (query tile, key "
            f"tile) pairs: {listed}")
    return pair
