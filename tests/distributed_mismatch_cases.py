"""Calls whose ranks disagree (run by tests/test_distributed_agreement.py inside each gloo rank).

Each case builds valid arguments for every rank and then changes one of them on the last rank
only: something every rank must share, or something only that rank's own validation rejects.
``expected`` is a word the error must contain (the argument it names).
"""

from __future__ import annotations

import torch

import cudnn_attn as ca
from cudnn_attn import distributed as cp


def _ring_inputs(rank, world, B=2, length=12, Hq=2, Hkv=2, D=8, Dv=6, dtype=torch.float64,
                 sharding="zigzag"):
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(B, length, h, d, generator=g, dtype=dtype)
            for h, d in ((Hq, D), (Hkv, D), (Hkv, Dv))]
    return [cp.shard_sequence(t, sharding) for t in full]


def ring(changed: dict, expected: str, *, local=None):
    """A ring call where the last rank passes ``changed`` (shape keywords of ``_ring_inputs``
    or keyword arguments of the call); ``local(q, k, v, kwargs)`` edits that rank's call."""
    def call(rank, world):
        last = rank == world - 1
        shape = {n: v for n, v in changed.items() if n in ("B", "Hq", "Hkv", "D", "Dv", "dtype")}
        kwargs = dict(mask=ca.Causal(), sharding="zigzag", scale=0.3)
        if last:
            kwargs.update({n: v for n, v in changed.items() if n not in shape})
        q, k, v = _ring_inputs(rank, world, sharding=kwargs["sharding"], **(shape if last else {}))
        if last and local is not None:
            q, k, v, kwargs = local(q, k, v, kwargs)
        return cp.context_parallel_attention(q, k, v, **kwargs)
    return call, expected


def _bhsd(q, k, v, kwargs):
    return (*(t.transpose(1, 2) for t in (q, k, v)), {**kwargs, "layout": "bhsd"})


def _one_more_row(q, k, v, kwargs):
    return (*(torch.cat([t, t[:, :1]], 1) for t in (q, k, v)), kwargs)


def _not_a_tensor(q, k, v, kwargs):
    return q.tolist(), k, v, kwargs


def halo(changed: dict, expected: str):
    """A halo call (1-D or 2-D grid split on axis 0) where the last rank passes ``changed``."""
    def call(rank, world):
        last = rank == world - 1
        grid = changed.get("grid", (12, 4)) if last else (12, 4)
        heads = changed.get("heads", 2) if last else 2
        dim = changed.get("D", 4) if last else 4
        dtype = changed.get("dtype", torch.float64) if last else torch.float64
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(1, *grid, heads, dim, generator=g, dtype=dtype) for _ in range(3))
        rows = slice(rank * grid[0] // world, (rank + 1) * grid[0] // world)
        kwargs = dict(kernel_size=3, stride=1, dilation=1, is_causal=False, scale=0.4)
        if last:
            kwargs.update({n: x for n, x in changed.items() if n in kwargs})
        return cp.neighborhood_attention(q[:, rows], k[:, rows], v[:, rows], **kwargs)
    return call, expected


def unshard(changed: dict, expected: str):
    def call(rank, world):
        last = rank == world - 1
        x = torch.randn(2, 4 - rank, changed.get("width", 5) if last else 5,
                        dtype=changed.get("dtype", torch.float32) if last else torch.float32)
        return cp.unshard_sequence(x, changed.get("sharding", "contiguous") if last
                                   else "contiguous")
    return call, expected


CASES = {
    "ring-length": ring({}, "positions", local=_one_more_row),
    "ring-batch": ring({"B": 3}, "batch size B"),
    "ring-query-heads": ring({"Hq": 4}, "query heads H_q"),
    "ring-kv-heads": ring({"Hkv": 1}, "key/value heads H_kv"),
    "ring-head-dim": ring({"D": 4}, "head dim D"),
    "ring-value-head-dim": ring({"Dv": 4}, "value head dim D_v"),
    "ring-dtype": ring({"dtype": torch.float32}, "dtype"),
    "ring-layout": ring({}, "layout", local=_bhsd),
    "ring-sharding": ring({"sharding": "contiguous"}, "sharding"),
    "ring-mask-none": ring({"mask": None}, "mask band"),
    "ring-window": ring({"mask": ca.SlidingWindow(3, 1)}, "mask band"),
    "ring-scale": ring({"scale": 0.25}, "scale"),
    "ring-bad-layout-one-rank": ring({"layout": "sbhd"}, "failed validation"),
    "ring-neighborhood-one-rank": ring({"mask": ca.Neighborhood((12,), 3)}, "failed validation"),
    "ring-not-a-tensor-one-rank": ring({}, "failed validation", local=_not_a_tensor),
    "halo-kernel": halo({"kernel_size": 5}, "kernel_size"),
    "halo-stride": halo({"stride": 2}, "stride"),
    "halo-dilation": halo({"dilation": 2}, "dilation"),
    "halo-causal": halo({"is_causal": (True, False)}, "is_causal"),
    "halo-extent": halo({"grid": (12, 5)}, "spatial extent"),
    "halo-rank": halo({"grid": (12,)}, "number of spatial axes"),
    "halo-heads": halo({"heads": 1}, "heads H"),
    "halo-head-dim": halo({"D": 8}, "head dim D"),
    "halo-dtype": halo({"dtype": torch.float32}, "dtype"),
    "halo-scale": halo({"scale": 0.5}, "scale"),
    "halo-bad-kernel-one-rank": halo({"kernel_size": 3.0}, "failed validation"),
    "unshard-shape": unshard({"width": 4}, "shape outside dim"),
    "unshard-dtype": unshard({"dtype": torch.float64}, "dtype"),
    "unshard-sharding": unshard({"sharding": "zigzag"}, "sharding"),
}


def warm_up(rank, world):
    """One agreeing call of each kind (it must run)."""
    ring({}, "")[0](rank, world)
    halo({}, "")[0](rank, world)
    unshard({}, "")[0](rank, world)
