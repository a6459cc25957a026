"""The cases tests/surfaces/test_distributed.py runs inside each gloo process group (imported by the
spawned workers, so it lives in its own module). Every case compares this rank's shard of the
output and of the input gradients with single-process ``attention()`` / ``na*d`` on the full
tensors, in float64."""

from __future__ import annotations

import torch

import cudnn_attn as ca
from cudnn_attn import distributed as cp
from cudnn_attn import neighborhood as na

RING = []
for sharding in ("zigzag", "contiguous"):
    for mask_name in ("none", "causal", "window", "window-left"):
        RING.append(("ring", sharding, mask_name, 13, 4, 2))     # odd length, GQA
    RING.append(("ring", sharding, "causal", 16, 2, 2))          # even, MHA
# (spatial shape, kernel, stride, dilation, causal, axis-0 split as fractions of the ranks)
HALO = [
    ("halo", (13,), 5, 1, 1, False),
    ("halo", (17,), 5, 2, 2, False),
    ("halo", (14,), 4, 1, 1, True),
    ("halo", (12,), 9, 1, 1, False),                 # a window wider than a neighbor's shard
    ("halo", (9, 6), 3, (2, 1), (1, 2), (True, False)),
    ("halo", (10, 4), (5, 3), 1, (2, 1), False),
    ("halo", (6, 4, 3), 3, 1, 1, (False, True, False)),
]
MASKS = {"none": None, "causal": ca.Causal(), "window": ca.SlidingWindow(3, 1),
         "window-left": ca.SlidingWindow(-1, 2)}


def _grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


def run_ring(case, rank, world):
    _, sharding, mask_name, length, heads_q, heads_kv = case
    g = torch.Generator().manual_seed(length * 7 + heads_q)
    q = torch.randn(2, length, heads_q, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, length, heads_kv, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, length, heads_kv, 6, generator=g, dtype=torch.float64)
    dout = torch.randn(2, length, heads_q, 6, generator=g, dtype=torch.float64)
    mask = MASKS[mask_name]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = ca.attention(*leaves, mask=mask, layout="bshd", backend="torch")
    want_grads = _grads(want, leaves, dout)
    shards = [cp.shard_sequence(t, sharding).requires_grad_() for t in (q, k, v)]
    out, lse = cp.context_parallel_attention(*shards, mask=mask, sharding=sharding,
                                             return_lse=True)
    torch.testing.assert_close(out, cp.shard_sequence(want.detach(), sharding))
    got = _grads(out, shards, cp.shard_sequence(dout, sharding))
    for name, a, b in zip("qkv", got, want_grads):
        torch.testing.assert_close(a, cp.shard_sequence(b, sharding), msg=f"d{name}")
    whole = cp.unshard_sequence(out.detach(), sharding)
    torch.testing.assert_close(whole, want.detach())
    assert lse.shape == (2, heads_q, shards[0].shape[1])


def _uneven(length, world):
    """A deliberately uneven contiguous split (every rank at least one row)."""
    sizes = [1] * world
    for i in range(length - world):
        sizes[(i * 2) % world] += 1
    return sizes


def run_halo(case, rank, world):
    _, shape, kernel, stride, dilation, causal = case
    g = torch.Generator().manual_seed(sum(shape))
    full = [torch.randn(1, *shape, 2, 4, generator=g, dtype=torch.float64) for _ in range(4)]
    q, k, v, dout = full
    fn = (na.na1d, na.na2d, na.na3d)[len(shape) - 1]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = fn(*leaves, kernel_size=kernel, stride=stride, dilation=dilation, is_causal=causal)
    want_grads = _grads(want, leaves, dout)
    sizes = _uneven(shape[0], world)
    a = sum(sizes[:rank])
    rows = slice(a, a + sizes[rank])
    shards = [t[:, rows].clone().requires_grad_() for t in (q, k, v)]
    out = cp.neighborhood_attention(*shards, kernel, stride, dilation, causal)
    torch.testing.assert_close(out, want.detach()[:, rows])
    got = _grads(out, shards, dout[:, rows])
    for name, x, y in zip("qkv", got, want_grads):
        torch.testing.assert_close(x, y[:, rows], msg=f"d{name}")


def run(case, rank, world):
    (run_ring if case[0] == "ring" else run_halo)(case, rank, world)
