"""Packed sequences grouped by length: the torch engine's varlen path.

A batch padded to its longest sequence costs the torch engine ``B * longest**2``, whatever the
other lengths. Grouping the sequences by ``(len_q, len_k)`` makes each group one dense batch with
no padding, so every sequence costs what its own length costs. ``attention_varlen`` and
FlashAttention's varlen surface use it when ``by_length_groups`` says so.
"""

from __future__ import annotations

import itertools

import torch

from ..api import attention
from ..model.masks import Alibi
from ..model.problem import accumulator_dtype

__all__ = ["by_length_groups", "length_groups", "packed_rows", "group_bias", "grouped_varlen"]


def by_length_groups(q, backend, dropout_p) -> bool:
    """Whether the call runs as one dense batch per distinct ``(len_q, len_k)`` (cost follows
    each sequence's own length) instead of one batch padded to the longest sequence.

    The torch engine runs it (any call it takes on the CPU, or ``backend="torch"``): a padded batch
    costs it ``B * longest**2`` whatever the lengths. GPU engines keep the one padded call (one
    graph or kernel launch). Dropout keeps it too: its masks are drawn over the padded batch, and
    surfaces replay them with the call's seed.
    """
    return dropout_p == 0 and (backend == "torch" or (backend == "auto"
                                                      and q.device.type == "cpu"))


def length_groups(lens_q, lens_k) -> dict:
    """``{(len_q, len_k): [sequences]}`` in first-seen order, sequences without queries left out."""
    groups: dict = {}
    for b, pair in enumerate(zip(lens_q, lens_k)):
        if pair[0]:
            groups.setdefault(pair, []).append(b)
    return groups


def packed_rows(lengths: list[int], members: list[int], device) -> torch.Tensor:
    """Packed rows of sequences ``members``, in order (sequence ``b`` holds ``lengths[b]`` rows
    after those of sequences ``0..b-1``)."""
    starts = [0, *itertools.accumulate(lengths)]
    return torch.cat([torch.arange(starts[b], starts[b] + lengths[b]) for b in members]).to(device)


def group_bias(bias, members: list[int], len_q: int, len_k: int):
    """The bias of sequences ``members`` cropped to their lengths (local positions)."""
    if isinstance(bias, Alibi):
        per_batch = bias.slopes is not None and isinstance(bias.slopes[0], tuple)
        return Alibi([bias.slopes[b] for b in members]) if per_batch else bias
    if not isinstance(bias, torch.Tensor):
        return None
    full = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    if full.shape[0] != 1:
        full = full.index_select(0, torch.tensor(members, device=full.device))
    return full[:, :, :len_q if full.shape[2] != 1 else 1, :len_k if full.shape[3] != 1 else 1]


def grouped_varlen(q, k, v, lens_q, lens_k, mask, bias, scale, softcap, return_lse, backend):
    """``attention_varlen`` as one dense ``attention`` call per distinct ``(len_q, len_k)``: the
    sequences of a group share their lengths, so nothing is padded and ``mask`` keeps its
    per-sequence meaning (bottom-right aligns each sequence's last query with its last key)."""
    groups = length_groups(lens_q, lens_k)
    H, Dv, acc = q.shape[1], v.shape[2], accumulator_dtype(q.dtype)
    outs, lses, order = [], [], []
    for (len_q, len_k), members in groups.items():
        rows = packed_rows(lens_q, members, q.device)
        n = len(members)
        order.append(rows)
        if len_k == 0:  # these queries see no key
            outs.append(q.new_zeros(n * len_q, H, Dv))
            lses.append(torch.full((H, n * len_q), float("-inf"), dtype=acc, device=q.device))
            continue
        keys = packed_rows(lens_k, members, q.device)
        out, lse = attention(q.index_select(0, rows).view(n, len_q, H, -1),
                             *(t.index_select(0, keys).view(n, len_k, t.shape[1], -1)
                               for t in (k, v)),
                             mask=mask, bias=group_bias(bias, members, len_q, len_k),
                             scale=scale, softcap=softcap, layout="bshd", return_lse=True,
                             backend=backend)
        outs.append(out.reshape(n * len_q, H, Dv))
        lses.append(lse.permute(1, 0, 2).reshape(H, n * len_q))
    if not outs:  # no query anywhere
        empty = q.new_zeros(0, H, Dv)
        return (empty, torch.zeros(H, 0, dtype=acc, device=q.device)) if return_lse else empty
    order = torch.cat(order)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(),
                                                                      device=order.device))
    out = torch.cat(outs).index_select(0, inverse)
    if not return_lse:
        return out
    return out, torch.cat(lses, 1).index_select(1, inverse)
