"""GPU (marked): varlen and KV-cache calls on cuDNN's own ragged and page-table graphs, sync-free,
and a decode step captured in a CUDA graph. Skips cleanly without CUDA/cuDNN.

* ``attention_varlen`` / ``flash_attn_varlen_func`` run the ragged graph on the packed tensors,
  forward and backward, against the float64 oracle on each sequence (empty sequences included).
* ``attention_with_kvcache`` runs the page-table graph over a pool whose slots past the lengths
  (and unused pages) hold NaN: nothing past a length reaches the result.
* Every call above runs under ``torch.cuda.set_sync_debug_mode("error")``: a host read of a
  length, offset or table would raise.
* A decode step (``attention_with_kvcache`` and ``flash_attn_with_kvcache`` with its in-place
  append) is captured once in a CUDA graph and replayed with new tokens, lengths and pages.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools

import pytest
import torch
from test_varlen import oracle_varlen

import cudnn_attn as ca
from cudnn_attn.graphs.cache import graph_cache
from cudnn_attn.varlen import attention_varlen, attention_with_kvcache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                       reason="nvidia-cudnn-frontend is not installed"),
]

F16, F64 = torch.float16, torch.float64
DEV = "cuda"


@contextlib.contextmanager
def sync_free():
    """Any synchronising CUDA call (a host read of a device tensor) raises inside."""
    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEV)


@pytest.mark.parametrize("causal", [None, "top_left", "bottom_right"])
@pytest.mark.parametrize("lens", [((100, 1, 0, 257), (100, 30, 4, 257)), ((64, 64), (64, 64))],
                         ids=["ragged", "even"])
def test_varlen_runs_the_ragged_graph_sync_free(causal, lens):
    lens_q, lens_k = lens
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens_q), 8, 64, generator=g).to(F16)
    k = torch.randn(sum(lens_k), 2, 64, generator=g).to(F16)
    v = torch.randn(sum(lens_k), 2, 64, generator=g).to(F16)
    qd, kd, vd = (t.to(DEV).requires_grad_(True) for t in (q, k, v))
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    mask = None if causal is None else ca.Causal(causal)
    ca.clear_caches()
    with sync_free():
        out, lse = attention_varlen(qd, kd, vd, cu_q, cu_k, max(lens_q), max(lens_k), mask=mask,
                                    return_lse=True, backend="cudnn")
        grads = torch.autograd.grad(out.float().square().sum(), [qd, kd, vd])
    assert graph_cache.info()["builds"] >= 2, "cuDNN's forward and backward graphs were not built"
    ref_in = [t.to(F64).requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse = oracle_varlen(*ref_in, lens_q, lens_k, **({} if causal is None else
                                                                {"causal": causal}))
    torch.testing.assert_close(out.cpu().to(F64), ref_out, atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(lse.cpu().to(F64), ref_lse, atol=1e-3, rtol=1e-3)
    expected = torch.autograd.grad(ref_out.square().sum(), ref_in)
    for name, a, e in zip("qkv", grads, expected):
        assert not a.isnan().any(), f"NaN in d{name}"
        torch.testing.assert_close(a.cpu().to(F64), e, atol=5e-2, rtol=5e-2)


def test_flash_attn_varlen_func_is_sync_free_on_cudnn():
    from cudnn_attn.flash_attn_interface import flash_attn_varlen_func

    lens = (33, 7, 128)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lens), 4, 64, generator=g).to(F16) for _ in range(3))
    qd, kd, vd = (t.to(DEV).requires_grad_(True) for t in (q, k, v))
    cu_d = cu(lens)
    with sync_free():
        out = flash_attn_varlen_func(qd, kd, vd, cu_d, cu_d, max(lens), max(lens), causal=True)
        out.float().sum().backward()
    ref, _ = oracle_varlen(q.to(F64), k.to(F64), v.to(F64), lens, lens, causal="top_left")
    torch.testing.assert_close(out.detach().cpu().to(F64), ref, atol=3e-3, rtol=3e-3)
    assert not qd.grad.isnan().any()


def _pool(lens, page, pages, heads, dim, seed):
    """A NaN-poisoned page pool with each sequence's tokens on shuffled pages, its block table
    (unused entries point at a NaN page) and the dense float64 copy of the tokens."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    num_blocks = B * pages + 1
    k_pool = torch.full((num_blocks, page, heads, dim), float("nan"), dtype=F16)
    v_pool = torch.full_like(k_pool, float("nan"))
    table = torch.randperm(num_blocks - 1, generator=g)[:B * pages].view(B, pages)
    dense = []
    for b, n in enumerate(lens):
        kb = torch.randn(n, heads, dim, generator=g).to(F16)
        vb = torch.randn(n, heads, dim, generator=g).to(F16)
        for t in range(n):
            k_pool[table[b, t // page], t % page] = kb[t]
            v_pool[table[b, t // page], t % page] = vb[t]
        table[b, -(-n // page):] = num_blocks - 1
        dense.append((kb, vb))
    return k_pool.to(DEV), v_pool.to(DEV), table.to(torch.int32).to(DEV), dense


def _decode_oracle(q, dense, lens):
    outs = []
    for b, n in enumerate(lens):
        o, _ = oracle_varlen(q[b].cpu().to(F64), dense[b][0].to(F64), dense[b][1].to(F64),
                             [q.shape[1]], [n], causal="bottom_right")
        outs.append(o)
    return torch.stack(outs)


@pytest.mark.parametrize("surface", ["attention_with_kvcache", "flash_attn_with_kvcache"])
def test_paged_decode_reads_nothing_past_the_lengths_sync_free(surface):
    """NaN-poisoned pages past the lengths change nothing. flash_attn_with_kvcache (a
    FlashAttention surface: repeatable) ran a two-row graph here and gave NaN everywhere on an
    H200 (seen under capture; this call is eager): it keeps the one-row graph now."""
    from cudnn_attn.flash_attn_interface import flash_attn_with_kvcache

    lens, page, pages = [300, 1, 64, 129], 64, 6
    k_pool, v_pool, table, dense = _pool(lens, page, pages, 2, 128, seed=2)
    q = torch.randn(len(lens), 1, 8, 128, generator=torch.Generator().manual_seed(3)).to(F16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    qd = q.to(DEV)  # before the block: a host-to-device copy synchronises (issue 23)
    with sync_free():
        if surface == "attention_with_kvcache":
            out = attention_with_kvcache(qd, k_pool, v_pool, seqlens, block_table=table,
                                         mask=ca.Causal("bottom_right"), backend="cudnn")
        else:
            out = flash_attn_with_kvcache(qd, k_pool, v_pool, cache_seqlens=seqlens,
                                          block_table=table, causal=True)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().to(F64), _decode_oracle(q, dense, lens), atol=3e-3,
                               rtol=3e-3)


@pytest.mark.parametrize("queries", [1, 5])
def test_dense_cache_forward_reads_nothing_past_the_lengths(queries):
    """A forward no gradient follows binds a dense cache as it lies (no zeroed copies: cuDNN's
    padding mask keeps what lies past the key lengths out, as benchmarks/decode_rows.py's probe
    showed on an H200): NaN there, lengths on and off the kernels' tile edges, must not reach
    the result."""
    lens, capacity, heads, dim = [300, 1, 64, 129], 384, 2, 128
    g = torch.Generator().manual_seed(6)
    past = torch.arange(capacity)[None, :] >= torch.tensor(lens)[:, None]
    k, v = (torch.randn(len(lens), capacity, heads, dim, generator=g).to(F16)
            .masked_fill(past[:, :, None, None], float("nan")) for _ in range(2))
    q = torch.randn(len(lens), queries, 8, dim, generator=g).to(F16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kd, vd, qd = k.to(DEV), v.to(DEV), q.to(DEV)
    with sync_free():
        out = attention_with_kvcache(qd, kd, vd, seqlens, mask=ca.Causal("bottom_right"),
                                     backend="cudnn")
    assert not out.isnan().any()
    dense = [(k[b, :n], v[b, :n]) for b, n in enumerate(lens)]
    torch.testing.assert_close(out.cpu().to(F64), _decode_oracle(q, dense, lens), atol=3e-3,
                               rtol=3e-3)


@pytest.mark.parametrize("surface", ["attention_with_kvcache", "flash_attn_with_kvcache"])
def test_decode_step_is_captured_in_a_cuda_graph_and_replayed(surface):
    """Capture one step; replay it with new query tokens, new lengths and new pages, each time
    against the oracle. With flash_attn_with_kvcache the step also appends the new token."""
    from cudnn_attn.flash_attn_interface import flash_attn_with_kvcache

    B, Hq, Hkv, D, page, pages = 4, 8, 2, 64, 64, 4
    lens = [10, 70, 1, 200]
    k_pool, v_pool, table, dense = _pool(lens, page, pages, Hkv, D, seed=4)
    gen = torch.Generator().manual_seed(5)
    q = torch.zeros(B, 1, Hq, D, dtype=F16, device=DEV)
    k_new = torch.zeros(B, 1, Hkv, D, dtype=F16, device=DEV)
    v_new = torch.zeros(B, 1, Hkv, D, dtype=F16, device=DEV)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)

    def step():
        if surface == "attention_with_kvcache":
            return attention_with_kvcache(q, k_pool, v_pool, seqlens, block_table=table,
                                          mask=ca.Causal("bottom_right"), backend="cudnn")
        return flash_attn_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=seqlens,
                                       block_table=table, causal=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: graphs built, workspaces allocated. (Its append
        step()                     # writes zeros where the first replay writes its token.)
    torch.cuda.current_stream().wait_stream(side)
    builds = graph_cache.info()["builds"]
    graph = torch.cuda.CUDAGraph()
    with sync_free(), torch.cuda.graph(graph):
        out = step()
    assert graph_cache.info()["builds"] == builds  # the capture found every graph built
    appends = surface == "flash_attn_with_kvcache"
    for _ in range(3):
        qh = torch.randn(B, 1, Hq, D, generator=gen).to(F16)
        kh = torch.randn(B, 1, Hkv, D, generator=gen).to(F16)
        vh = torch.randn(B, 1, Hkv, D, generator=gen).to(F16)
        q.copy_(qh.to(DEV))
        if appends:  # the step itself writes the token at lens[b], then attends lens + 1 keys
            k_new.copy_(kh.to(DEV))
            v_new.copy_(vh.to(DEV))
        else:  # the token is written here, then the step attends lens + 1 keys
            for b, n in enumerate(lens):
                page_id = int(table[b, n // page])
                k_pool[page_id, n % page] = kh[b, 0].to(DEV)
                v_pool[page_id, n % page] = vh[b, 0].to(DEV)
            seqlens.copy_(torch.tensor([n + 1 for n in lens], dtype=torch.int32))
        for b in range(B):
            dense[b] = (torch.cat([dense[b][0], kh[b]]), torch.cat([dense[b][1], vh[b]]))
        lens = [n + 1 for n in lens]
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        torch.testing.assert_close(out.cpu().to(F64), _decode_oracle(qh, dense, lens), atol=3e-3,
                                   rtol=3e-3)
        if appends:  # the next step appends after this one's token
            seqlens.copy_(torch.tensor(lens, dtype=torch.int32))


def test_padding_with_device_lengths_is_sync_free_and_reuses_the_graph():
    import oracle

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 4, 130, 64, generator=g).to(F16) for _ in range(3))
    qd, kd, vd = (t.to(DEV) for t in (q, k, v))
    builds = None
    for lens in ([130, 64, 1], [7, 130, 0]):
        lens_d = torch.tensor(lens, dtype=torch.int32, device=DEV)
        with sync_free():
            out = ca.attention(qd, kd, vd, mask=ca.Causal() & ca.Padding(lens_d, lens_d),
                               backend="cudnn")
        vis = oracle.build_visibility(3, 130, 130, causal="top_left", seq_lens_q=lens,
                                      seq_lens_kv=lens)
        ref, _ = oracle.reference_attention(q, k, v, vis)
        torch.testing.assert_close(out.cpu().to(F64), ref, atol=3e-3, rtol=3e-3)
        if builds is None:
            builds = graph_cache.info()["builds"]
    assert graph_cache.info()["builds"] == builds  # new lengths, same graph
