"""Ring attention: each rank keeps its queries; key/value blocks travel around the ranks, and
partial results merge through their log-sum-exp. The backward is a ring too: a block's dK/dV
travel with it and go home at the end.

The schedule is static and the same on every rank: block ``o`` (rank ``o``'s keys) is at rank
``(o + s) % W`` at step ``s``, and travels only while a rank further along still needs it — under
a contiguous causal sharding no block ever wraps around, so nothing hidden is sent or computed.
"""

from __future__ import annotations

import torch

from ..model.problem import accumulator_dtype
from .blocks import HIDDEN, backward_pair, forward_pair, merge, pair_mask
from .p2p import Exchange
from .sharding import Chunk, chunks_of

__all__ = ["Schedule", "RingAttention"]


class Schedule:
    """Who needs which block, and how far each block travels."""

    def __init__(self, length: int, world_size: int, sharding: str, band, rank: int):
        self.world, self.rank, self.band = world_size, rank, band
        self.chunks = chunks_of(length, world_size, sharding)
        self.needs = [[any(self._visible(qc, kc) for qc in self.chunks[x] for kc in self.chunks[o])
                       for o in range(world_size)] for x in range(world_size)]
        # Last step at which block o is still somewhere it is needed (0: it never leaves home).
        self.last = [max([s for s in range(world_size) if self.needs[(o + s) % world_size][o]],
                         default=0) for o in range(world_size)]

    def _visible(self, qc: Chunk, kc: Chunk) -> bool:
        return pair_mask(self.band, qc.start, qc.size, kc.start, kc.size, torch.float32,
                         "cpu") is not HIDDEN if qc.size and kc.size else False

    def block_at(self, step: int) -> int:
        """The block this rank holds at ``step`` (if it still travels that far)."""
        return (self.rank - step) % self.world

    def holds(self, step: int) -> bool:
        return step <= self.last[self.block_at(step)]

    def rows(self, owner: int) -> int:
        return sum(c.size for c in self.chunks[owner])


def _pairs(schedule: Schedule, owner: int):
    """(query chunk, key chunk) pairs of this rank against block ``owner``."""
    for qc in schedule.chunks[schedule.rank]:
        for kc in schedule.chunks[owner]:
            if qc.size and kc.size:
                yield qc, kc


def _ring_step(schedule: Schedule, step: int, tensors, group) -> Exchange:
    """Start passing the held block on to the next rank (and receiving the previous rank's)
    for ``step + 1``, where the schedule says the block still travels."""
    exchange = Exchange(group)
    rank, world = schedule.rank, schedule.world
    if step + 1 >= world:
        return exchange.start()
    if schedule.holds(step) and step + 1 <= schedule.last[schedule.block_at(step)]:
        for t in tensors:
            exchange.send(t, (rank + 1) % world)
    incoming = schedule.block_at(step + 1)
    if step + 1 <= schedule.last[incoming]:
        rows = schedule.rows(incoming)
        for t in tensors:
            exchange.recv(t, (t.shape[0], rows, *t.shape[2:]), (rank - 1) % world)
    return exchange.start()


class RingAttention(torch.autograd.Function):
    """bshd local shards -> (out, lse) of attention over the whole sequence."""

    @staticmethod
    def forward(ctx, q, k, v, schedule: Schedule, scale: float, group):
        block = (k, v)
        acc = accumulator_dtype(q.dtype)
        out = torch.zeros(*q.shape[:3], v.shape[3], dtype=acc, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc,
                         device=q.device)
        for step in range(schedule.world):
            exchange = _ring_step(schedule, step, block, group)
            if schedule.holds(step):
                owner = schedule.block_at(step)
                for qc, kc in _pairs(schedule, owner):
                    mask = pair_mask(schedule.band, qc.start, qc.size, kc.start, kc.size,
                                     q.dtype, q.device)
                    if mask is HIDDEN:
                        continue
                    rows = slice(qc.local, qc.local + qc.size)
                    o, s = forward_pair(q[:, rows], block[0][:, kc.local:kc.local + kc.size],
                                        block[1][:, kc.local:kc.local + kc.size], mask, scale)
                    out[:, rows], lse[:, :, rows] = merge(out[:, rows], lse[:, :, rows],
                                                          o.to(acc), s.to(acc))
            received = exchange.wait()
            if received:
                block = tuple(received)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.schedule, ctx.scale, ctx.group = schedule, scale, group
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        schedule, scale, group = ctx.schedule, ctx.scale, ctx.group
        world = schedule.world
        acc = accumulator_dtype(q.dtype)
        dq = torch.zeros_like(q, dtype=acc)
        block = (k, v, torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc))
        dout = dout.contiguous()
        finished = {}  # owner -> (dK, dV) of the blocks whose journey ends here
        for step in range(world):
            if schedule.holds(step):
                owner = schedule.block_at(step)
                kb, vb, dkb, dvb = block
                for qc, kc in _pairs(schedule, owner):
                    mask = pair_mask(schedule.band, qc.start, qc.size, kc.start, kc.size,
                                     q.dtype, q.device)
                    if mask is HIDDEN:
                        continue
                    rows, keys = (slice(qc.local, qc.local + qc.size),
                                  slice(kc.local, kc.local + kc.size))
                    grads = backward_pair(q[:, rows], kb[:, keys], vb[:, keys], mask, scale,
                                          out[:, rows], lse[:, :, rows], dout[:, rows],
                                          None if dlse is None else dlse[:, :, rows])
                    dq[:, rows] += grads[0]
                    dkb[:, keys] += grads[1]
                    dvb[:, keys] += grads[2]
                if step == schedule.last[owner]:
                    finished[owner] = (dkb, dvb)
            # The block (with its gradients so far) moves on after its compute: the backward
            # needs this step's dK/dV before sending them.
            received = _ring_step(schedule, step, block, group).wait()
            if received:
                block = tuple(received)
        dk, dv = _send_home(schedule, finished, k, v, group)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _send_home(schedule: Schedule, finished: dict, k, v, group):
    """After the last step, each block's dK/dV go from their last holder to their owner."""
    rank, world = schedule.rank, schedule.world
    exchange = Exchange(group)
    for owner in sorted(finished):
        if owner != rank:
            for t in finished[owner]:
                exchange.send(t, owner)
    holder = (rank + schedule.last[rank]) % world
    if holder == rank:
        exchange.start().wait()
        return finished[rank]
    mine = [exchange.recv(x.to(accumulator_dtype(x.dtype)), x.shape, holder) for x in (k, v)]
    exchange.start().wait()
    return tuple(mine)
