"""The visibility rules, defined once: NATTEN 0.21 neighborhoods and 1-D bands, plus the geometry
table the ``.cu`` kernels read.

Every engine and tool that needs "which keys does query ``i`` see" calls this module: the torch
engine's tile tables (``torch_engine/tiles.py``), the Python mirror of the fused kernels' tile walk
(``fallback_kernels/fused.py``), the unfused kernels' launchers (``fallback_kernels/unfused.py``)
and the demo's float64 brute force (``cli/demo.py``). The window functions accept Python ints or
integer tensors (elementwise), so the same formula serves a scalar replay and a vectorised table.

**Neighborhood axis** (length ``L``, kernel ``k``, stride ``s``, dilation ``d``, causal ``c``):
position ``i`` belongs to dilation group ``g = i % d`` at index ``idx = i // d`` of a group of
``group_len(L, d, g)`` members. Inside its group it sees the indices ``[start, end)`` of
:func:`neighborhood_window`; the window of a stride group is its *leader*'s (the centre member, or
the last one when causal), and a non-causal window is shifted back inside at the borders (even
kernels included: ``k // 2`` on the left, ``k // 2 - 1`` on the right).

**Band** (1-D): key ``j`` is visible from query ``i`` iff ``i + offset - left <= j <= i + offset +
right`` (``-1``: that side unbounded); ``offset = S_kv - S_q`` gives bottom-right alignment.

**Geometry table**: ``MAX_AXES`` records of ``AXIS_FIELDS`` int32 in ``NaAxis`` field order
(``fallback_kernels/common.cu``); unused axes are length-1 bands.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["AXIS_FIELD_NAMES", "AXIS_FIELDS", "MAX_AXES", "MODE_NEIGHBORHOOD", "MODE_BAND",
           "UNUSED_AXIS", "group_len", "neighborhood_window", "band_window", "axis_window",
           "neighborhood_positions", "neighborhood_axis_mask", "band_mask", "neighborhood_mask",
           "neighborhood_table", "band_table", "table_axes", "axis_dilation"]

# NaAxis (common.cu) field order; modes NA_AXIS_NEIGHBORHOOD / NA_AXIS_BAND.
AXIS_FIELD_NAMES = ("mode", "len_q", "len_kv", "kernel", "stride", "dilation", "causal", "left",
                    "right", "offset")
AXIS_FIELDS = len(AXIS_FIELD_NAMES)
MAX_AXES = 3
MODE_NEIGHBORHOOD, MODE_BAND = 0, 1
UNUSED_AXIS = (MODE_BAND, 1, 1, 1, 1, 1, 0, -1, -1, 0)


def _is_tensor(*values) -> bool:
    return any(isinstance(v, torch.Tensor) for v in values)


def _min(a, b):
    return torch.minimum(torch.as_tensor(a), torch.as_tensor(b)) if _is_tensor(a, b) else min(a, b)


def _max(a, b):
    return torch.maximum(torch.as_tensor(a), torch.as_tensor(b)) if _is_tensor(a, b) else max(a, b)


# ---------------------------------------------------------------------------------------------
# The rules (ints or integer tensors, elementwise)
# ---------------------------------------------------------------------------------------------

def group_len(length, dilation, group):
    """Members of dilation group ``group`` on an axis of ``length`` positions."""
    return (length - group + dilation - 1) // dilation


def neighborhood_window(idx, glen, kernel: int, stride: int, causal: bool):
    """``(start, end)``: the group indices seen by the member ``idx`` of a group of ``glen``."""
    if causal:
        leader = _min((idx // stride) * stride + stride - 1, glen - 1)
        return _max(leader - kernel + 1, 0), _min(idx + 1, glen)
    left, right = kernel // 2, kernel // 2 + kernel % 2 - 1
    leader = _min((idx // stride) * stride + stride // 2, glen - 1)
    past_end = leader + right >= glen
    shift = (glen - right - leader - 1) * past_end  # window shifted back inside at the end
    start = _max(leader - left, 0) + shift
    return start, start + kernel


def band_window(i, len_kv: int, left: int = -1, right: int = -1, offset: int = 0):
    """``(lo, hi)``: the keys ``[lo, hi)`` query ``i`` sees in a band, clamped to ``[0, len_kv]``
    with ``hi >= lo`` (an empty row is ``lo == hi``)."""
    aligned = i + offset
    lo = 0 * aligned if left < 0 else _max(aligned - left, 0)
    hi = 0 * aligned + len_kv if right < 0 else _min(aligned + right + 1, len_kv)
    lo = _min(lo, len_kv)
    return lo, _max(hi, lo)


def axis_window(axis: Sequence[int], idx, glen):
    """Window ``[lo, hi)`` (group coordinates) of one geometry-table axis record for the member
    ``idx`` of a group of ``glen`` (``na_group_window`` in ``common.cu``)."""
    mode, _, len_kv, kernel, stride, _, causal, left, right, offset = axis
    if mode == MODE_BAND:
        return band_window(idx, len_kv, left, right, offset)
    return neighborhood_window(idx, glen, kernel, stride, bool(causal))


def axis_dilation(axis: Sequence[int]) -> int:
    """The dilation of a table axis record (bands have none: 1)."""
    return axis[5] if axis[0] == MODE_NEIGHBORHOOD else 1


def neighborhood_positions(length: int, kernel: int, stride: int, dilation: int, causal: bool):
    """Per position ``i`` of one axis (int64 tensors of ``length``): ``(group, idx, start, end)``,
    its dilation group, its index there and its window ``[start, end)`` in group indices. Key
    ``j`` is visible iff ``j % dilation == group`` and ``start <= j // dilation < end``."""
    i = torch.arange(length)
    group, idx = i % dilation, i // dilation
    start, end = neighborhood_window(idx, group_len(length, dilation, group), kernel, stride,
                                     causal)
    return group, idx, start, end


# ---------------------------------------------------------------------------------------------
# Dense boolean masks (small problems: brute forces, demos)
# ---------------------------------------------------------------------------------------------

def neighborhood_axis_mask(length: int, kernel: int, stride: int = 1, dilation: int = 1,
                           causal: bool = False) -> torch.Tensor:
    """``[length, length]`` bool: NATTEN 0.21 neighbor sets on one axis."""
    group, _, start, end = neighborhood_positions(length, kernel, stride, dilation, causal)
    j = torch.arange(length)
    jg = j // dilation
    return ((j[None, :] % dilation == group[:, None]) & (jg[None, :] >= start[:, None])
            & (jg[None, :] < end[:, None]))


def band_mask(seq_q: int, seq_kv: int, left: int = -1, right: int = -1,
              offset: int = 0) -> torch.Tensor:
    """``[seq_q, seq_kv]`` bool of a band (top-left aligned unless ``offset``)."""
    lo, hi = band_window(torch.arange(seq_q), seq_kv, left, right, offset)
    j = torch.arange(seq_kv)
    return (j[None, :] >= lo[:, None]) & (j[None, :] < hi[:, None])


def neighborhood_mask(spatial_shape: Sequence[int], kernel_size: Sequence[int],
                      stride: Sequence[int] | None = None, dilation: Sequence[int] | None = None,
                      is_causal: Sequence[bool] | None = None) -> torch.Tensor:
    """``[N, N]`` bool on the row-major flattening: AND of the per-axis masks (a Kronecker
    product)."""
    rank = len(spatial_shape)
    stride = stride or (1,) * rank
    dilation = dilation or (1,) * rank
    is_causal = is_causal or (False,) * rank
    mask = torch.ones(1, 1, dtype=torch.int8)
    for length, k, s, d, c in zip(spatial_shape, kernel_size, stride, dilation, is_causal):
        mask = torch.kron(mask, neighborhood_axis_mask(length, k, s, d, c).to(torch.int8))
    return mask.bool()


# ---------------------------------------------------------------------------------------------
# The geometry table the kernels read
# ---------------------------------------------------------------------------------------------

def neighborhood_table(spatial_shape: Sequence[int], kernel_size: Sequence[int],
                       stride: Sequence[int], dilation: Sequence[int],
                       is_causal: Sequence[bool]) -> list[int]:
    """The ``MAX_AXES * AXIS_FIELDS`` int32 of a 1/2/3-D neighborhood (rank-sized tuples).

        >>> neighborhood_table((8,), (3,), (1,), (2,), (True,))[:10]
        [0, 8, 8, 3, 1, 2, 1, -1, -1, 0]
    """
    rank = len(kernel_size)
    if not 1 <= rank <= MAX_AXES or len(spatial_shape) != rank:
        raise ValueError(f"kernel_size must have 1 to 3 entries, one per axis of spatial_shape; "
                         f"got kernel_size={tuple(kernel_size)!r}, "
                         f"spatial_shape={tuple(spatial_shape)!r}")
    rows = [(MODE_NEIGHBORHOOD, int(L), int(L), int(k), int(s), int(d), int(bool(c)), -1, -1, 0)
            for L, k, s, d, c in zip(spatial_shape, kernel_size, stride, dilation, is_causal)]
    return [x for row in rows + [UNUSED_AXIS] * (MAX_AXES - rank) for x in row]


def band_table(seq_q: int, seq_kv: int, left: int = -1, right: int = -1,
               offset: int = 0) -> list[int]:
    """The table of a 1-D band (see :func:`band_window`). Dense = (-1, -1), causal = (-1, 0)."""
    return ([MODE_BAND, int(seq_q), int(seq_kv), 1, 1, 1, 0, int(left), int(right), int(offset)]
            + list(UNUSED_AXIS) * (MAX_AXES - 1))


def table_axes(table: Sequence[int]) -> list[tuple[int, ...]]:
    """The ``MAX_AXES`` axis records of a flat table."""
    if len(table) != MAX_AXES * AXIS_FIELDS:
        raise ValueError(f"a geometry table has {MAX_AXES * AXIS_FIELDS} entries, got "
                         f"{len(table)}")
    return [tuple(table[a * AXIS_FIELDS:(a + 1) * AXIS_FIELDS]) for a in range(MAX_AXES)]

