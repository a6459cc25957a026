"""attention_with_kvcache against the float64 oracle run on each sequence's valid cache prefix:
dense and paged caches (shuffled block tables, page sizes 1, 3, 16, garbage in unused table entries,
NaN-poisoned slots past cache_seqlens), decode (S_q = 1) and chunked prefill (S_q > 1) with causal
/ window masks in both alignments, GQA, D_v != D_qk, bias, ALiBi, softcap, cache_seqlens of 0,
the forms of cache_seqlens, and input errors."""

from __future__ import annotations

import math
import re

import oracle
import pytest
import torch
from common import ca, lib_mask
from test_varlen import TOL, oracle_one

from cudnn_attn.varlen import attention_with_kvcache

F64 = torch.float64


def make(B=3, Sq=1, Hq=4, Hkv=2, D=8, Dv=6, cap=40, lens=(0, 1, 17), dtype=F64, seed=0):
    """q, the logical per-sequence caches [B, cap, H_kv, D] (NaN past each length) and lens."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype)

    q = rnd(B, Sq, Hq, D)
    k, v = rnd(B, cap, Hkv, D), rnd(B, cap, Hkv, Dv)
    for b, n in enumerate(lens):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    return q, k, v, list(lens), g


def paginate(k, v, lens, page, g, extra_pages=3):
    """Scatter logical caches into shuffled pages; unneeded table entries hold -1 and unused pages NaN."""
    B, cap = k.shape[:2]
    max_blocks = math.ceil(cap / page)
    num_blocks = B * max_blocks + extra_pages
    perm = torch.randperm(num_blocks, generator=g)
    k_pages = torch.full((num_blocks, page, *k.shape[2:]), float("nan"), dtype=k.dtype)
    v_pages = torch.full((num_blocks, page, *v.shape[2:]), float("nan"), dtype=v.dtype)
    table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        for j in range(math.ceil(n / page)):
            pid = int(perm[b * max_blocks + j])
            table[b, j] = pid
            rows = slice(j * page, min((j + 1) * page, cap))
            k_pages[pid, : rows.stop - rows.start] = k[b, rows]
            v_pages[pid, : rows.stop - rows.start] = v[b, rows]
    return k_pages, v_pages, table, max_blocks * page


def oracle_cache(q, k, v, lens, *, bias=None, slopes=None, **kw):
    outs, lses = [], []
    for b, n in enumerate(lens):
        bias_b = None if bias is None else bias[b:b + 1, ..., :n]
        o, lse = oracle_one(q[b], k[b, :n], v[b, :n], bias=bias_b, slopes=slopes, **kw)
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def check(out, lse, ref_out, ref_lse, dtype=F64):
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert lse.shape == ref_lse.shape, f"lse {tuple(lse.shape)} != [B, H_q, S_q] {tuple(ref_lse.shape)}"
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.to(F64), ref_out, **TOL[dtype])
    torch.testing.assert_close(lse.to(F64), ref_lse, **TOL[dtype])


MASKS = [
    dict(),
    dict(causal="bottom_right"),
    dict(causal="top_left"),
    dict(window=(5, 0, "bottom_right")),
]
MASK_IDS = ["none", "causal-br", "causal-tl", "window-br"]


@pytest.mark.parametrize("mask", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("Sq", [1, 4])
def test_dense(mask, Sq):
    q, k, v, lens, _ = make(Sq=Sq, lens=(0, 2, 17))
    out, lse = attention_with_kvcache(q, k, v, torch.tensor(lens, dtype=torch.int32),
                                      mask=lib_mask(**mask), return_lse=True)
    check(out, lse, *oracle_cache(q, k, v, lens, **mask))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize("page", [1, 3, 16])
@pytest.mark.parametrize("mask", MASKS[:2] + MASKS[3:], ids=["none", "causal-br", "window-br"])
def test_paged(page, mask):
    q, k, v, lens, g = make(B=4, Sq=3, lens=(0, 1, 17, 40), seed=page)
    k_pages, v_pages, table, _ = paginate(k, v, lens, page, g)
    out, lse = attention_with_kvcache(q, k_pages, v_pages, torch.tensor(lens), block_table=table,
                                      mask=lib_mask(**mask), return_lse=True)
    check(out, lse, *oracle_cache(q, k, v, lens, **mask))


def test_paged_equals_dense_float32():
    q, k, v, lens, g = make(B=2, Sq=2, lens=(5, 33), dtype=torch.float32)
    k_pages, v_pages, table, _ = paginate(k, v, lens, 3, g)
    kw = dict(mask=ca().Causal("bottom_right"), return_lse=True)
    paged = attention_with_kvcache(q, k_pages, v_pages, lens, block_table=table.long(), **kw)
    dense = attention_with_kvcache(q, k, v, lens, **kw)
    check(*paged, *oracle_cache(q, k, v, lens, causal="bottom_right"), dtype=torch.float32)
    torch.testing.assert_close(paged[0], dense[0], atol=1e-6, rtol=1e-6)


def test_bias_and_softcap_dense_and_paged():
    q, k, v, lens, g = make(B=3, Sq=2, lens=(4, 0, 25), cap=30)
    bias = torch.randn(3, 4, 2, 30, generator=g, dtype=F64)
    kw = dict(causal="bottom_right", softcap=2.5, scale=0.4)
    ref = oracle_cache(q, k, v, lens, bias=bias, **kw)
    lib_kw = dict(mask=ca().Causal("bottom_right"), softcap=2.5, scale=0.4, return_lse=True)
    check(*attention_with_kvcache(q, k, v, lens, bias=bias, **lib_kw), *ref)
    k_pages, v_pages, table, logical = paginate(k, v, lens, 16, g)  # 2 pages of 16 = 32 positions
    paged_bias = torch.cat([bias, torch.randn(3, 4, 2, logical - 30, generator=g, dtype=F64)], -1)
    check(*attention_with_kvcache(q, k_pages, v_pages, lens, block_table=table, bias=paged_bias,
                                  **lib_kw), *ref)


def test_broadcast_bias():
    q, k, v, lens, g = make(B=2, Sq=3, lens=(6, 11), cap=12)
    bias = torch.randn(4, 1, 12, generator=g, dtype=F64)
    out, lse = attention_with_kvcache(q, k, v, lens, bias=bias, return_lse=True)
    ref = oracle_cache(q, k, v, lens, bias=bias.expand(2, 4, 3, 12))
    check(out, lse, *ref)


def test_alibi_aligned_to_cache_end():
    q, k, v, lens, _ = make(B=3, Sq=2, Hq=4, Hkv=1, lens=(3, 9, 1))
    slopes = oracle.default_alibi_slopes(4)
    out, lse = attention_with_kvcache(q, k, v, lens, bias=ca().Alibi(),
                                      mask=ca().Causal("bottom_right"), return_lse=True)
    check(out, lse, *oracle_cache(q, k, v, lens, slopes=slopes, causal="bottom_right"))


def test_cache_seqlens_forms():
    q, k, v, _, _ = make(B=2, Sq=1, lens=(7, 7))
    results = [attention_with_kvcache(q, k, v, form, mask=ca().Causal("bottom_right"))
               for form in (7, [7, 7], (7, 7), torch.tensor([7, 7], dtype=torch.int32),
                            torch.tensor([7, 7]), torch.tensor(7))]
    ref, _ = oracle_cache(q, k, v, [7, 7], causal="bottom_right")
    for r in results:
        torch.testing.assert_close(r, ref, **TOL[F64])


def test_all_empty_and_full_cache():
    q, k, v, _, _ = make(B=2, Sq=2, lens=(40, 40))
    out, lse = attention_with_kvcache(q, k, v, 0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out, lse = attention_with_kvcache(q, k, v, 40, mask=ca().Causal("bottom_right"), return_lse=True)
    check(out, lse, *oracle_cache(q, k, v, [40, 40], causal="bottom_right"))


def test_backend_is_forwarded():
    q, k, v, lens, _ = make(lens=(1, 2, 3))
    attention_with_kvcache(q, k, v, lens, backend="torch")
    with pytest.raises(ca().NotSupportedError):
        attention_with_kvcache(q, k, v, lens, backend="cupy")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=str)
@pytest.mark.parametrize("page", [None, 3, 16])
def test_cuda_matches_oracle(page, dtype):
    q, k, v, lens, g = make(B=4, Sq=3, lens=(0, 1, 17, 40), dtype=dtype, seed=21)
    table = None
    kc, vc = k, v
    if page is not None:
        kc, vc, table, _ = paginate(k, v, lens, page, g)
        table = table.cuda()
    out, lse = attention_with_kvcache(q.cuda(), kc.cuda(), vc.cuda(), torch.tensor(lens).cuda(),
                                      block_table=table, mask=ca().Causal("bottom_right"),
                                      return_lse=True)
    check(out.cpu(), lse.cpu(), *oracle_cache(q, k, v, lens, causal="bottom_right"), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

def _call(paged=False, **override):
    q, k, v, lens, g = make(B=2, Sq=1, lens=(5, 9), cap=12)
    args = dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lens)
    if paged:
        k, v, table, _ = paginate(k, v, lens, 4, g, extra_pages=0)
        args.update(k_cache=k, v_cache=v, block_table=table)
    args.update(override)
    pos = [args.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens")]
    return attention_with_kvcache(*pos, **args)


ERRORS = [
    ("q-rank", False, dict(q=torch.zeros(2, 4, 8, dtype=F64)), ValueError, "q must be 4-D"),
    ("q-type", False, dict(q="q"), TypeError, "q must be a torch.Tensor"),
    ("k-rank", False, dict(k_cache=torch.zeros(2, 12, 16, dtype=F64)), ValueError, "k_cache must be 4-D"),
    ("kv-shape", False, dict(v_cache=torch.zeros(2, 11, 2, 6, dtype=F64)), ValueError,
     "k_cache and v_cache must agree on [B, S_max, H_kv]"),
    ("d-mismatch", False, dict(k_cache=torch.zeros(2, 12, 2, 4, dtype=F64)), ValueError, "head dim"),
    ("dense-batch", False, dict(k_cache=torch.zeros(3, 12, 2, 8, dtype=F64),
                                v_cache=torch.zeros(3, 12, 2, 6, dtype=F64)), ValueError,
     "k_cache must have q's batch size 2"),
    ("lens-over", False, dict(cache_seqlens=[5, 13]), ValueError, "cache_seqlens[1] = 13 is outside [0, 12]"),
    ("lens-negative", False, dict(cache_seqlens=-1), ValueError, "cache_seqlens[0] = -1"),
    ("lens-count", False, dict(cache_seqlens=[1, 2, 3]), ValueError, "one entry per batch (2)"),
    ("lens-float", False, dict(cache_seqlens=2.5), TypeError, "cache_seqlens must be an int"),
    ("lens-tensor-dtype", False, dict(cache_seqlens=torch.tensor([1.0, 2.0])), TypeError,
     "cache_seqlens must be int32 or int64"),
    ("lens-device", False, dict(cache_seqlens=torch.zeros(2, dtype=torch.int32, device="meta")),
     ValueError, "q's device"),
    ("mask-padding", False, dict(mask="padding"), ValueError, "must not contain Padding"),
    ("mask-neighborhood", False, dict(mask="neighborhood"), ValueError, "must not contain Neighborhood"),
    ("bias-shape", False, dict(bias=torch.zeros(2, 4, 1, 9, dtype=F64)), ValueError,
     "[B, H_q, S_q, S_max]"),
    ("dtype", False, dict(k_cache=torch.zeros(2, 12, 2, 8, dtype=torch.float32)), TypeError,
     "share a dtype"),
    ("gqa", False, dict(k_cache=torch.zeros(2, 12, 3, 8, dtype=F64),
                        v_cache=torch.zeros(2, 12, 3, 6, dtype=F64)), ValueError, "multiple of kv heads"),
    ("table-dtype", True, dict(block_table=torch.zeros(2, 3)), TypeError, "block_table must be int32"),
    ("table-rank", True, dict(block_table=torch.zeros(6, dtype=torch.int32)), ValueError,
     "block_table must be 2-D"),
    ("table-rows", True, dict(block_table=torch.zeros(3, 3, dtype=torch.int32)), ValueError,
     "block_table must have one row per batch (2)"),
    ("table-range", True, dict(block_table=torch.tensor([[0, 1, -1], [2, 7, 4]], dtype=torch.int32)),
     ValueError, "block_table[1, 1] = 7 is not a page"),
    ("table-negative", True, dict(block_table=torch.tensor([[-1, 1, -1], [2, 3, 4]], dtype=torch.int32)),
     ValueError, "block_table[0, 0] = -1"),
    ("pages-short", True, dict(block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)),
     ValueError, "cache_seqlens[1] = 9 is outside [0, 8] (block_table holds 2 pages of 4 tokens)"),
    ("paged-bias", True, dict(bias=torch.zeros(1, 1, 1, 11, dtype=F64)), ValueError,
     "[B, H_q, S_q, max_blocks_per_seq * page_size]"),
]


@pytest.mark.parametrize("name,paged,override,exc,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(name, paged, override, exc, match):
    lib = ca()
    if override.get("mask") == "padding":
        override["mask"] = lib.Causal("bottom_right") & lib.Padding((1, 1), (5, 9))
    elif override.get("mask") == "neighborhood":
        override["mask"] = lib.Neighborhood(4, 3)
    with pytest.raises(exc, match=re.escape(match)):
        _call(paged=paged, **override)


def test_unused_table_entries_are_not_read():
    """Entries past a sequence's page count may hold anything (FlashAttention ignores them)."""
    q, k, v, lens, g = make(B=2, Sq=1, lens=(3, 9), cap=12)
    k_pages, v_pages, table, _ = paginate(k, v, lens, 4, g, extra_pages=0)
    table[0, 1:] = 10_000
    out = attention_with_kvcache(q, k_pages, v_pages, lens, block_table=table)
    torch.testing.assert_close(out, oracle_cache(q, k, v, lens)[0], **TOL[F64])
