"""The parts of context parallelism that need no process group: the shardings, the block
classification against a brute force, and the schedules' promise that hidden blocks are neither
computed nor sent."""

from __future__ import annotations

import itertools

import pytest
import torch

from cudnn_attn.distributed.blocks import HIDDEN, pair_mask
from cudnn_attn.distributed.halo import halo_plan
from cudnn_attn.distributed.ring import Schedule
from cudnn_attn.distributed.sharding import chunks_of
from cudnn_attn.model.geometry import neighborhood_axis_mask
from cudnn_attn.model.masks import Causal


@pytest.mark.parametrize("length, world", [(13, 2), (16, 4), (7, 3), (3, 3)])
def test_shardings_cover_every_position_once(length, world):
    for sharding in ("contiguous", "zigzag"):
        ranks = chunks_of(length, world, sharding)
        covered = sorted(p for chunks in ranks for c in chunks for p in range(c.start, c.start + c.size))
        assert covered == list(range(length))
    zigzag = chunks_of(16, 4, "zigzag")
    assert [(c.start, c.size) for c in zigzag[1]] == [(2, 2), (12, 2)]


def _brute(band, q0, nq, k0, nk):
    left, right = band
    i = torch.arange(q0, q0 + nq)[:, None]
    j = torch.arange(k0, k0 + nk)[None, :]
    vis = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    return vis


def _as_visibility(mask, nq, nk):
    if mask is None:
        return torch.ones(nq, nk, dtype=torch.bool)
    if isinstance(mask, torch.Tensor):
        return mask[0, 0] == 0
    left, right = (-1, 0) if isinstance(mask, Causal) else (mask.left, mask.right)
    offset = 0 if mask.alignment == "top_left" else nk - nq
    return _brute((left, right), offset, nq, 0, nk)


@pytest.mark.parametrize("band", [(-1, 0), (-1, -1), (3, 1), (0, 0), (-1, 2), (2, -1)])
def test_pair_mask_is_the_global_band_on_every_pair(band):
    for q0, nq, k0, nk in itertools.product(range(0, 12, 3), (1, 3, 4), range(0, 12, 3), (2, 3, 5)):
        want = _brute(band, q0, nq, k0, nk)
        got = pair_mask(band, q0, nq, k0, nk, torch.float64, "cpu")
        if got is HIDDEN:
            assert not want.any()
        else:
            assert torch.equal(_as_visibility(got, nq, nk), want), (band, q0, nq, k0, nk, got)


def test_contiguous_causal_never_sends_or_computes_a_hidden_block():
    for rank in range(4):
        schedule = Schedule(16, 4, "contiguous", (-1, 0), rank)
        assert schedule.last == [3, 2, 1, 0]  # block o travels only to the ranks after it
        held = [schedule.block_at(s) for s in range(4) if schedule.holds(s)]
        assert held == list(range(rank, -1, -1))


def test_zigzag_causal_visits_every_rank_and_a_narrow_window_only_neighbours():
    assert Schedule(16, 4, "zigzag", (-1, 0), 0).last == [3, 3, 3, 3]
    narrow = Schedule(32, 4, "contiguous", (2, 0), 0)
    assert narrow.last == [1, 1, 1, 0]


def test_halo_plan_fetches_exactly_the_rows_the_queries_see():
    lengths = [3, 5, 4]
    for kernel, stride, dilation, causal in [(5, 1, 1, False), (3, 2, 2, False), (4, 1, 1, True),
                                             (9, 1, 1, False)]:
        plans, starts = halo_plan(lengths, kernel, stride, dilation, causal)
        axis = neighborhood_axis_mask(12, kernel, stride, dilation, causal)
        for r, ((lo, hi), fetch) in enumerate(plans):
            a, b = starts[r], starts[r] + lengths[r]
            need = set(axis[a:b].any(0).nonzero().flatten().tolist()) - set(range(a, b))
            got = set(itertools.chain.from_iterable(idx.tolist() for idx in fetch.values()))
            assert got == need and lo <= min(need | {a}) and hi >= max(need | {b - 1}) + 1
