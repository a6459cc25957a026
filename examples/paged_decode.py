"""Autoregressive decoding on a paged KV cache with ``cudnn_attn.attention_with_kvcache``.

A batch of sequences with different prompt lengths shares one pool of fixed-size pages
(``[num_blocks, page_size, H_kv, D]``). Pages come from a shuffled free list, so each sequence's
block table points all over the pool. Every step, a toy one-layer decoder turns each sequence's
hidden state into q/k/v for one new token, appends that token's k/v into the cache (taking a
fresh page when the last one is full), attends with ``attention_with_kvcache(..., block_table=)``
over all of the sequence's tokens, and feeds the result back as the next hidden state. Each step
is checked against plain dense attention over the same tokens (a second, contiguous copy of
the cache, never paged); the check is not timed. Prints tokens/s and the largest deviation;
exits 1 on a mismatch.

    python examples/paged_decode.py                              # 4 sequences, 128 new tokens each
    python examples/paged_decode.py --steps 8 --page-size 5      # a smoke run, odd page size

Runs on CUDA when available (float16 there), else on the CPU (float32).
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch

import cudnn_attn as ca


class PagedKVCache:
    """A page pool with a free list and a block table per sequence (one layer's K and V)."""

    def __init__(self, num_blocks, page_size, kv_heads, head_dim, batch, max_blocks, *, device,
                 dtype, seed):
        self.page_size = page_size
        shape = (num_blocks, page_size, kv_heads, head_dim)
        # Uninitialised on purpose: attention never reads past a sequence's length.
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.block_table = torch.full((batch, max_blocks), -1, dtype=torch.int32)
        self.lens = [0] * batch
        self._table_dev = None

    def pages_in_use(self) -> int:
        return int((self.block_table >= 0).sum())

    def _page_for(self, b: int, pos: int) -> int:
        slot = pos // self.page_size
        if slot >= self.block_table.shape[1]:
            raise RuntimeError(f"sequence {b} outgrew its block table ({pos + 1} tokens)")
        if self.block_table[b, slot] < 0:
            if not self.free:
                raise RuntimeError("the page pool is exhausted")
            self.block_table[b, slot] = self.free.pop()
            self._table_dev = None
        return int(self.block_table[b, slot])

    def append(self, k, v):
        """Write one token per sequence: ``k``/``v`` ``[B, H_kv, D]`` at position ``lens[b]``."""
        pages = [self._page_for(b, n) for b, n in enumerate(self.lens)]
        rows = [n % self.page_size for n in self.lens]
        index = torch.tensor(pages, device=k.device), torch.tensor(rows, device=k.device)
        self.k[index] = k
        self.v[index] = v
        self.lens = [n + 1 for n in self.lens]

    def extend(self, b: int, k, v):
        """Write a prompt (``[n, H_kv, D]``) for sequence ``b`` page by page (prefill)."""
        start = 0
        while start < k.shape[0]:
            pos = self.lens[b]
            page, row = self._page_for(b, pos), pos % self.page_size
            take = min(self.page_size - row, k.shape[0] - start)
            self.k[page, row:row + take] = k[start:start + take]
            self.v[page, row:row + take] = v[start:start + take]
            self.lens[b] += take
            start += take

    def reserve(self, b: int, tokens: int) -> None:
        """Take, now, every page sequence ``b`` needs to hold ``tokens`` tokens (a server that
        reserves at admission never changes a block table while decoding)."""
        for pos in range(0, tokens, self.page_size):
            self._page_for(b, pos)

    def release(self, b: int) -> None:
        """Return sequence ``b``'s pages to the free list and empty its slot."""
        row = self.block_table[b]
        self.free.extend(int(p) for p in row[row >= 0].tolist())
        row.fill_(-1)
        self.lens[b] = 0
        self._table_dev = None

    def table(self, device):
        if self._table_dev is None:
            self._table_dev = self.block_table.to(device)
        return self._table_dev


def dense_attention(q, k, v, lens, scale):
    """Plain PyTorch, float64: ``q`` ``[B, H, D]`` against the first ``lens[b]`` (ints or a tensor)
    of ``k``/``v`` ``[B, S_max, H_kv, D]``. The reference each paged step is checked against."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    s = torch.einsum("bhd,bjhd->bhj", q, k) * scale
    # as_tensor: a device tensor of lengths stays where it is (no copy, no host sync)
    hidden = torch.arange(k.shape[1], device=q.device)[None] >= torch.as_tensor(
        lens, device=q.device)[:, None]
    s = s.masked_fill(hidden[:, None], float("-inf"))
    return torch.einsum("bhj,bjhd->bhd", s.softmax(-1), v)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads, GQA (default 2)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension (default 64)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (any size)")
    p.add_argument("--min-prompt", type=int, default=1, help="shortest prompt in tokens (default 1)")
    p.add_argument("--max-prompt", type=int, default=200, help="longest prompt in tokens (default 200)")
    p.add_argument("--steps", type=int, default=128, help="tokens generated per sequence")
    p.add_argument("--spare-blocks", type=int, default=7, help="pool pages beyond the need")
    p.add_argument("--no-check", action="store_true", help="skip the dense comparison")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and pages (default 0)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    tolerance = 2e-2 if dtype == torch.float16 else 1e-4
    gen = torch.Generator().manual_seed(args.seed)
    rng = random.Random(args.seed)
    B, H, H_kv, D, P = args.batch, args.heads, args.kv_heads, args.head_dim, args.page_size
    E = H * D

    def randn(*shape, std=1.0):
        return (std * torch.randn(*shape, generator=gen)).to(device, dtype)

    # The toy decoder: hidden [B, E] -> q [B, H, D], k/v [B, H_kv, D]; out -> next hidden
    # (residual + layer norm, so the scores stay O(1) however long it runs).
    w_qkv = randn(E, (H + 2 * H_kv) * D, std=E ** -0.5)
    w_out = randn(E, E, std=E ** -0.5)

    prompts = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(B)]
    max_len = max(prompts) + args.steps
    max_blocks = -(-max_len // P)
    need = sum(-(-(n + args.steps) // P) for n in prompts)
    cache = PagedKVCache(need + args.spare_blocks, P, H_kv, D, B, max_blocks, device=device,
                         dtype=dtype, seed=args.seed)
    dense_k = torch.zeros(B, max_len, H_kv, D, device=device, dtype=dtype)  # the check's copy
    dense_v = torch.zeros_like(dense_k)
    for b, n in enumerate(prompts):  # prefill: the prompts' k/v (random here)
        k, v = randn(n, H_kv, D), randn(n, H_kv, D)
        cache.extend(b, k, v)
        dense_k[b, :n], dense_v[b, :n] = k, v
    print(f"{B} sequences, prompts {prompts}, page size {P}, pool of {cache.k.shape[0]} pages "
          f"({cache.pages_in_use()} in use), H={H} H_kv={H_kv} D={D}, {dtype}, device {device}")
    print(f"block table of sequence 0 (shuffled pages): {cache.block_table[0].tolist()[:8]} ...")

    hidden = randn(B, E)
    scale = D ** -0.5
    max_err, decode_s = 0.0, 0.0
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        qkv = (hidden @ w_qkv).view(B, H + 2 * H_kv, D)
        q, k, v = qkv.split((H, H_kv, H_kv), dim=1)
        positions = list(cache.lens)
        cache.append(k, v)
        out = ca.attention_with_kvcache(q[:, None], cache.k, cache.v, cache.lens,
                                        block_table=cache.table(device), scale=scale)
        hidden = torch.nn.functional.layer_norm(hidden + out.reshape(B, E) @ w_out, (E,))
        if device.type == "cuda":
            torch.cuda.synchronize()
        decode_s += time.perf_counter() - t0
        if not args.no_check:
            rows = torch.arange(B, device=device), torch.tensor(positions, device=device)
            dense_k[rows], dense_v[rows] = k, v
            ref = dense_attention(q, dense_k, dense_v, cache.lens, scale)
            max_err = max(max_err, (out[:, 0].double() - ref).abs().max().item())

    tokens = B * args.steps
    used = cache.pages_in_use()
    # attention_with_kvcache gathers the pages into a padded [B, pages * P, H_kv, D] batch:
    gathered = q.new_empty(B, -(-max(cache.lens) // P) * P, H_kv, D)
    engine = ca.explain(q[:, None], gathered, gathered, layout="bshd",
                        mask=ca.Padding([1] * B, cache.lens)).selected
    print(f"decoded {tokens} tokens in {decode_s:.3f} s: {tokens / decode_s:.0f} tokens/s "
          f"(engine: {engine})")
    print(f"pages in use {used} of {cache.k.shape[0]} ({used * P} token slots for "
          f"{sum(cache.lens)} tokens; a dense cache would hold {B * max_len})")
    if args.no_check:
        return 0
    ok = math.isfinite(max_err) and max_err <= tolerance
    print(f"max |paged - dense| = {max_err:.2e} over {args.steps} steps: "
          f"{'matches dense attention' if ok else 'MISMATCH'} (tolerance {tolerance:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
