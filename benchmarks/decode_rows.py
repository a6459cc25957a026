"""GPU rows of ``benchmarks/cudnn.py``: one decode step against a KV cache with device lengths
(``attention_with_kvcache`` on the cuDNN engine's native route), and what cuDNN does with values
stored past the lengths.

The problem: 8 sequences, a cache of 8192 tokens each, 8 KV heads and 8 query heads, D = 128,
bf16 (128 MiB per cache), lengths between 2048 and 4096, bottom-right causal. Microseconds per
call, back to back (one synchronisation per batch of calls, as a decode loop runs):

  decode dense: ours            the dense cache; the engine hides the positions past the lengths
                                (two cache-sized ``torch.where`` copies per call)
  decode dense, unhidden: probe the same graph on the cache as it lies (hiding switched off)
  decode paged: ours            the same tokens in pages of 64 through a block table (the engine
                                never copies the pools)
  decode dense: torch-<backend> the peer in the same run: torch SDPA as its users decode (the
                                boolean mask made from the lengths per call, ``attn_mask=``) on its
                                efficient and cuDNN backends (one that cannot run it is left out)

and, with NaN stored past every length (in K, in V, in both; through the caches, in the pages
too), whether the result stays finite and equal to the hidden call's for the unhidden dense
graph and for the paged one (``finite_with_nan_past_lengths``, ``max_diff_vs_hidden``): if
cuDNN alone keeps such values out, the dense route can drop its copies (or the one of the side
that is safe); if it does not, the paged route needs them.
``vs_torch_cudnn`` of ours' rows: over torch's padded call (cuDNN backend, else efficient).

``growing``: the decode loop of Hugging Face's dynamic cache through FlashAttention's API -- the
cache a ``[B, H, n, D]`` tensor grown by ``torch.cat`` at every step, passed as its ``bshd`` view
to ``flash_attn_func`` (one query, ``causal=True``) -- from a fresh graph cache, microseconds
per step over the whole loop with its graph builds (``graphs_built``):

  decode growing: ours, length buckets   the engine's default (``graphs.length_buckets``)
  decode growing: ours, exact graphs     ``CUDNN_ATTN_LENGTH_BUCKETS=0``: a graph per step
                                         (fewer steps: each builds)
  decode growing: torch-flash            the peer: torch SDPA's flash backend on the bhsd cache
"""

from __future__ import annotations

import contextlib
import os
import time
from unittest import mock

import torch

import _report

DECODE = (8, 8192, 8, 128)  # batch, cache capacity, heads (q and kv), head dim
PAGE = 64
GROWING = (4, 1000, 32, 128, 128)  # batch, first length, heads, head dim, steps
EXACT_STEPS = 24  # the exact-graph loop builds at every step


@contextlib.contextmanager
def _unhidden():
    """The engine's hiding of padded positions switched off (a probe, never the library's)."""
    from cudnn_attn.core import execution

    hide = execution.hide_padding
    execution.hide_padding = lambda problem, inputs, *args, **kwargs: inputs
    try:
        yield
    finally:
        execution.hide_padding = hide


def bench(args) -> list[dict]:
    """The decode rows (see the module's docstring); ``args.overhead_iters`` calls a batch."""
    import cudnn_attn as ca
    from cudnn_attn.varlen import attention_with_kvcache

    batch, capacity, heads, dim = DECODE
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, 1, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    k_cache, v_cache = (torch.randn(batch, capacity, heads, dim, device="cuda",
                                    dtype=torch.bfloat16, generator=g) for _ in range(2))
    lens = torch.randint(capacity // 4, capacity // 2, (batch,), device="cuda",
                         dtype=torch.int32, generator=g)
    # pages b * pages_per_seq + j hold tokens j * PAGE .. of sequence b: the dense cache's bytes
    pools = [c.view(batch * capacity // PAGE, PAGE, heads, dim) for c in (k_cache, v_cache)]
    table = torch.arange(batch * capacity // PAGE, device="cuda", dtype=torch.int32).view(batch, -1)
    mask = ca.Causal("bottom_right")

    def dense():
        return attention_with_kvcache(q, k_cache, v_cache, lens, mask=mask, backend="cudnn")

    def paged():
        return attention_with_kvcache(q, *pools, lens, block_table=table, mask=mask,
                                      backend="cudnn")

    def dense_unhidden():
        with _unhidden():
            return dense()

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    positions = torch.arange(capacity, device="cuda")
    q_bhsd, k_bhsd, v_bhsd = (t.transpose(1, 2) for t in (q, k_cache, v_cache))

    def torch_padded(backend):
        def call():  # as a torch user decodes: the mask made from the lengths, attn_mask=
            keep = (positions[None, :] < lens[:, None])[:, None, None, :]
            with sdpa_kernel(backend):
                return sdpa(q_bhsd, k_bhsd, v_bhsd, attn_mask=keep)
        return call

    calls = {"decode dense: ours": dense, "decode dense, unhidden: probe": dense_unhidden,
             "decode paged: ours": paged,
             "decode dense: torch-efficient (mask from lengths)":
             torch_padded(SDPBackend.EFFICIENT_ATTENTION),
             "decode dense: torch-cudnn (mask from lengths)":
             torch_padded(SDPBackend.CUDNN_ATTENTION)}
    n = args.overhead_iters
    rows = []
    for label, fn in calls.items():
        try:
            us = 1e3 * _report.time_ms(fn, warmup=10, repeats=args.repeats, number=n,
                                       sync=torch.cuda.synchronize)
        except RuntimeError as exc:
            print(f"{label}: {str(exc).splitlines()[0]}")
            continue
        rows.append({"call": label, "us_per_call": us, "vs_bare": None, "vs_torch_cudnn": None})
    peer = {r["call"]: r["us_per_call"] for r in rows}
    torch_us = peer.get("decode dense: torch-cudnn (mask from lengths)") or \
        peer.get("decode dense: torch-efficient (mask from lengths)")
    for row in rows:  # ours over torch's padded call (its efficient backend where cuDNN's fails)
        if torch_us and row["call"].endswith(": ours"):
            row["vs_torch_cudnn"] = row["us_per_call"] / torch_us
    rows += _nan_probe(dense, dense_unhidden, paged, k_cache, v_cache, lens)
    return rows


def _nan_probe(dense, dense_unhidden, paged, k_cache, v_cache, lens) -> list[dict]:
    """NaN past every length, in K only, in V only, and in both: the unhidden dense graph and
    the paged one against the hidden call (which never sees them). The side tells which copy the
    dense route needs if cuDNN does not keep them out itself: K's NaN reach a result only
    through the scores (a mask that adds ``-inf`` rather than selects it), V's through ``P = 0``
    times NaN."""
    reference = dense().float()
    past = torch.arange(k_cache.shape[1], device="cuda")[None, :] >= lens[:, None].long()
    saved = {id(c): c[past].clone() for c in (k_cache, v_cache)}
    rows = []
    for side, caches in (("K", (k_cache,)), ("V", (v_cache,)), ("K and V", (k_cache, v_cache))):
        for cache in caches:
            cache[past] = float("nan")
        for label, fn in (("decode dense, unhidden", dense_unhidden), ("decode paged", paged)):
            label = f"{label}: NaN past the lengths in {side}"
            try:
                out = fn().float()
            except RuntimeError as exc:
                print(f"{label}: {str(exc).splitlines()[0]}")
                continue
            finite = bool(torch.isfinite(out).all())
            rows.append({"call": label, "us_per_call": None, "vs_bare": None,
                         "vs_torch_cudnn": None, "finite_with_nan_past_lengths": finite,
                         "max_diff_vs_hidden": float((out - reference).abs().max()) if finite
                         else None})
        for cache in caches:  # the next side starts from finite caches
            cache[past] = saved[id(cache)]
    return rows


def growing(args, device: str = "cuda") -> list[dict]:
    """The growing-cache rows (see the module's docstring); ``device`` "cpu" runs them with the
    tests' cuDNN stand-in (a check that the rows run, not a measurement)."""
    import cudnn_attn as ca
    from cudnn_attn.flash_attn_interface import flash_attn_func
    from cudnn_attn.graphs import cache, length_buckets

    batch, first, heads, dim, steps = GROWING
    g = torch.Generator(device=device).manual_seed(1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)

    q = randn(batch, 1, heads, dim)
    start = [randn(batch, heads, first, dim) for _ in range(2)]
    new = [randn(batch, heads, 1, dim) for _ in range(2)]

    def loop(step_fn, n_steps):
        k, v = start
        sync()
        begin = time.perf_counter()
        for _ in range(n_steps):
            k, v = torch.cat([k, new[0]], 2), torch.cat([v, new[1]], 2)
            step_fn(k, v)
        sync()
        return 1e6 * (time.perf_counter() - begin) / n_steps

    def ours(k, v):
        return flash_attn_func(q, k.transpose(1, 2), v.transpose(1, 2), causal=True)

    def torch_flash(k, v):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return sdpa(q.transpose(1, 2), k, v)

    rows = []
    for label, fn, n_steps, env in (
            ("decode growing: ours, length buckets", ours, steps, "1"),
            ("decode growing: ours, exact graphs", ours, EXACT_STEPS, "0"),
            ("decode growing: torch-flash", torch_flash, steps, None)):
        ca.clear_caches()
        cache.graph_cache.clear()  # the module's (a test's stand-in replaces it there)
        before = cache.graph_cache.info()["builds"]
        switch = {} if env is None else {length_buckets.ENV: env}
        try:
            with mock.patch.dict(os.environ, switch):
                us = loop(fn, n_steps)
        except RuntimeError as exc:
            print(f"{label}: {str(exc).splitlines()[0]}")
            continue
        rows.append({"call": label, "us_per_call": us, "vs_bare": None, "vs_torch_cudnn": None,
                     "steps": n_steps, "graphs_built": cache.graph_cache.info()["builds"] - before})
    peer = next((r["us_per_call"] for r in rows if r["call"].endswith("torch-flash")), None)
    for row in rows:
        if peer and ": ours" in row["call"]:
            row["vs_torch_flash"] = row["us_per_call"] / peer
    return rows
