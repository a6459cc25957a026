"""Which positions of a sequence each rank holds, and moving between shards and the whole.

``"contiguous"``: rank ``r`` holds block ``r`` of ``W`` near-equal blocks (``torch.tensor_split``
sizes, so any length works). ``"zigzag"``: the sequence is cut into ``2W`` chunks and rank ``r``
holds chunks ``r`` and ``2W-1-r``, which gives every rank the same causal work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..model import checks
from .agreement import DTYPE, RankDisagreement, agreed_lengths, choice, encode_choice, encode_dtype, integers

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["SHARDINGS", "Chunk", "chunks_of", "shard_sequence", "unshard_sequence", "world",
           "all_lengths", "gather_uneven", "check_shard_lengths"]

SHARDINGS = ("contiguous", "zigzag")
_MAX_DIMS = 8
# What every rank's unshard_sequence call must pass alike (see agreement.py).
_SHARED = (integers("number of dims"), integers("dim"), DTYPE, choice("sharding", SHARDINGS),
           integers("shape outside dim", _MAX_DIMS - 1))


@dataclass(frozen=True)
class Chunk:
    """Global positions ``[start, start + size)`` of one piece of a rank's shard, and where it
    sits in that shard (``local``)."""

    start: int
    size: int
    local: int


def world(group) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group`` (the default group for None)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("cudnn_attn.distributed needs torch.distributed initialised "
                           "(dist.init_process_group) before the call")
    return dist.get_rank(group), dist.get_world_size(group)


def _check_sharding(sharding: str) -> None:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")


def _split_sizes(length: int, parts: int) -> list[int]:
    return [length // parts + (1 if i < length % parts else 0) for i in range(parts)]


def chunks_of(length: int, world_size: int, sharding: str) -> list[list[Chunk]]:
    """Per rank, its chunks of a sequence of ``length`` positions, in shard order."""
    _check_sharding(sharding)
    if sharding == "contiguous":
        sizes = _split_sizes(length, world_size)
        starts = [sum(sizes[:r]) for r in range(world_size)]
        return [[Chunk(starts[r], sizes[r], 0)] for r in range(world_size)]
    sizes = _split_sizes(length, 2 * world_size)
    starts = [sum(sizes[:c]) for c in range(2 * world_size)]
    ranks = []
    for r in range(world_size):
        first, second = r, 2 * world_size - 1 - r
        ranks.append([Chunk(starts[first], sizes[first], 0),
                      Chunk(starts[second], sizes[second], sizes[first])])
    return ranks


def check_shard_lengths(call: str, lengths: list[int], sharding: str) -> None:
    """Every rank's length (the same list on every rank) is what ``sharding`` of their sum gives
    it; else the same ``RankDisagreement`` on every rank."""
    chunks = chunks_of(sum(lengths), len(lengths), sharding)
    expected = [sum(c.size for c in rank_chunks) for rank_chunks in chunks]
    wrong = [r for r, (n, e) in enumerate(zip(lengths, expected)) if n != e]
    if wrong:
        raise RankDisagreement(
            f"{call}: sharding={sharding!r} of {sum(lengths)} positions over {len(lengths)} ranks "
            f"gives rank(s) {wrong} " + ", ".join(str(expected[r]) for r in wrong)
            + " positions, but they hold " + ", ".join(str(lengths[r]) for r in wrong))


def all_lengths(local: int, group, device) -> list[int]:
    """Every rank's local length (one small all-gather)."""
    _, size = world(group)
    mine = torch.tensor([local], device=device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    return [int(x) for x in every]


def gather_uneven(x: torch.Tensor, lengths: list[int], group, dim: int) -> list[torch.Tensor]:
    """Every rank's ``x`` (``lengths[r]`` long on ``dim``): padded to the longest for the
    all-gather (backends differ on uneven sizes), then trimmed."""
    longest = max(lengths)
    pad = list(x.shape)
    pad[dim] = longest - x.shape[dim]
    padded = torch.cat([x, x.new_zeros(pad)], dim).contiguous()
    every = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(every, padded, group=group)
    return [t.narrow(dim, 0, n) for t, n in zip(every, lengths)]


def shard_sequence(x: torch.Tensor, sharding: str = "zigzag", group: ProcessGroup | None = None,
                   dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (every rank passes the same ``x``).

    Equivalent PyTorch (contiguous): ``torch.tensor_split(x, world_size, dim)[rank]``; zigzag:
    ``torch.cat([c[rank], c[2 * W - 1 - rank]], dim)`` with ``c = torch.tensor_split(x, 2 * W, dim)``.
    """
    rank, size = world(group)
    pieces = chunks_of(x.shape[dim], size, sharding)[rank]
    return torch.cat([x.narrow(dim, c.start, c.size) for c in pieces], dim)


def unshard_sequence(x: torch.Tensor, sharding: str = "zigzag", group: ProcessGroup | None = None,
                     dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard ``x`` (the inverse of :func:`shard_sequence`;
    an all-gather, so every rank gets the whole sequence)."""
    rank, size = world(group)

    def validate():
        _check_sharding(sharding)
        t = checks.tensor("x", x)
        if t.dim() > _MAX_DIMS:
            raise ValueError(f"x must have at most {_MAX_DIMS} dims, got shape {tuple(t.shape)}")
        axis = checks.integer("dim", dim, -t.dim(), maximum=t.dim() - 1) % t.dim()
        others = [n for d, n in enumerate(t.shape) if d != axis]
        return t.shape[axis], (t.dim(), axis, encode_dtype(t.dtype),
                               encode_choice(sharding, SHARDINGS),
                               *(others + [-1] * (_MAX_DIMS - 1 - len(others))))

    lengths = agreed_lengths("unshard_sequence", group, x, _SHARED, validate)
    total = sum(lengths)
    check_shard_lengths("unshard_sequence", lengths, sharding)
    shards = gather_uneven(x, lengths, group, dim)
    pieces = []
    for r, rank_chunks in enumerate(chunks_of(total, size, sharding)):
        pieces += [(c.start, shards[r].narrow(dim, c.local, c.size)) for c in rank_chunks]
    return torch.cat([p for _, p in sorted(pieces, key=lambda item: item[0])], dim)
