"""flash_attn_with_kvcache (cudnn_attn.flash_attn_interface) against a float64 oracle written
from FlashAttention 2.8.3's published rules:

* new k/v are written in place at cache positions ``n .. n + S_new - 1`` (``n =
  cache_seqlens[b]``) of cache row ``cache_batch_idx[b]`` (or of the pages ``block_table``
  names); k is rotated at those positions, v is not;
* q is rotated at ``n + i`` when the call is causal or local, else every query at ``n``;
* attention runs over cache positions ``cache_leftpad[b] .. n + S_new - 1`` as one sequence,
  bottom-right aligned with the queries (window, causal and ALiBi relative to it);
* ``num_splits`` never changes the result; ``return_softmax_lse`` adds ``[B, H, S_q]``.
"""

from __future__ import annotations

import re

import pytest
import torch

import oracle
from cudnn_attn.flash_attn_interface import flash_attn_with_kvcache

F64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)


def randn(*shape, g):
    return torch.randn(*shape, generator=g, dtype=F64)


def rotate(x, cos, sin, positions, interleaved):
    """x [S, H, D] rotated at positions [S]: pairs (a, b) -> (a cos - b sin, a sin + b cos)."""
    r = 2 * cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    y = x.clone()
    if interleaved:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
        y[..., 0:r:2], y[..., 1:r:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :r // 2], x[..., r // 2:r]
        y[..., :r // 2], y[..., r // 2:r] = a * c - b * s, a * s + b * c
    return y


def expected(q, cache_k, cache_v, k, v, lens, *, rows=None, lefts=None, rotary=None,
             interleaved=True, causal=False, window=(-1, -1), slopes=None, softcap=0.0):
    """The updated caches (dense, rows indexed like k_cache) and (out, lse) of the call."""
    B, Sq, H, D = q.shape
    cap = cache_k.shape[1]
    rows = list(range(B)) if rows is None else rows
    lefts = [0] * B if lefts is None else lefts
    new = 0 if k is None else k.shape[1]
    cache_k, cache_v = cache_k.clone(), cache_v.clone()
    left, right = (-1 if w < 0 or w >= cap else w for w in window)
    if causal:
        right = 0
    per_token = left >= 0 or right >= 0
    outs, lses = [], []
    for b in range(B):
        n, qb = lens[b], q[b]
        if rotary is not None:
            cos, sin = rotary
            kb = rotate(k[b], cos, sin, torch.arange(n, n + new), interleaved)
            qpos = torch.arange(n, n + Sq) if per_token else torch.full((Sq,), n)
            qb = rotate(q[b], cos, sin, qpos, interleaved)
        elif k is not None:
            kb = k[b]
        if k is not None:
            cache_k[rows[b], n:n + new] = kb
            cache_v[rows[b], n:n + new] = v[b]
        keys = cache_k[rows[b], lefts[b]:n + new][None]
        values = cache_v[rows[b], lefts[b]:n + new][None]
        Sk = keys.shape[1]
        if Sk == 0:
            outs.append(torch.zeros(Sq, H, cache_v.shape[-1], dtype=F64))
            lses.append(torch.full((H, Sq), float("-inf"), dtype=F64))
            continue
        vis = oracle.build_visibility(1, Sq, Sk, window=(left, right, "bottom_right"))
        bias = None
        if slopes is not None:
            bias = oracle.alibi_bias(slopes[b:b + 1].to(F64), 1, H, Sq, Sk, [Sk - Sq])
        out, lse = oracle.reference_attention(qb[None], keys, values, vis, layout="bshd",
                                              bias=bias, softcap=softcap or None)
        outs.append(out[0])
        lses.append(lse[0])
    return cache_k, cache_v, torch.stack(outs), torch.stack(lses)


def setup(B=2, Sq=3, new=3, cap=16, H=4, Hk=2, D=16, rows=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = randn(B, Sq, H, D, g=g)
    cache_k, cache_v = randn(rows or B, cap, Hk, D, g=g), randn(rows or B, cap, Hk, D, g=g)
    k = randn(B, new, Hk, D, g=g) if new else None
    v = randn(B, new, Hk, D, g=g) if new else None
    return g, q, cache_k, cache_v, k, v


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(2, 1)),
                                  dict(causal=True, window=(3, -1))], ids=str)
@pytest.mark.parametrize("new", [0, 1, 3])
def test_dense_append_in_place(mask, new):
    g, q, ck, cv, k, v = setup(new=new)
    lens = [5, 9] if new else [6, 13]
    exp_k, exp_v, exp_out, exp_lse = expected(q, ck, cv, k, v, lens, **mask)
    k_cache, v_cache = ck.clone(), cv.clone()
    kw = dict(causal=mask.get("causal", False), window_size=mask.get("window", (-1, -1)))
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                       cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       return_softmax_lse=True, **kw)
    torch.testing.assert_close(k_cache, exp_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, exp_v, atol=0, rtol=0)
    torch.testing.assert_close(out, exp_out, **TOL)
    torch.testing.assert_close(lse, exp_lse, **TOL)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window=(4, 0))], ids=str)
def test_rotary_positions(interleaved, mask):
    g, q, ck, cv, k, v = setup(Sq=3, new=2)
    cos, sin = randn(16, 6, g=g).cos(), randn(16, 6, g=g).sin()  # rotary_dim 12 of D 16
    lens = [4, 11]
    exp_k, exp_v, exp_out, _ = expected(q, ck, cv, k, v, lens, rotary=(cos, sin),
                                        interleaved=interleaved, **mask)
    k_cache, v_cache = ck.clone(), cv.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                  rotary_interleaved=interleaved,
                                  causal=mask.get("causal", False),
                                  window_size=mask.get("window", (-1, -1)))
    torch.testing.assert_close(k_cache, exp_k, **TOL)
    torch.testing.assert_close(v_cache, exp_v, atol=0, rtol=0)
    torch.testing.assert_close(out, exp_out, **TOL)


def test_cache_batch_idx_and_leftpad_with_alibi():
    g, q, ck, cv, k, v = setup(rows=4, new=2)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    lens, lefts = [7, 10], [2, 0]
    slopes = torch.rand(2, 4, generator=g) * 0.5
    ck[3, :2] = float("nan")  # before cache_leftpad: never read
    cv[3, :2] = float("nan")
    exp_k, exp_v, exp_out, _ = expected(q, ck, cv, k, v, lens, rows=[3, 1], lefts=lefts,
                                        causal=True, slopes=slopes)
    k_cache, v_cache = ck.clone(), cv.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                  cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                  cache_batch_idx=idx,
                                  cache_leftpad=torch.tensor(lefts, dtype=torch.int32),
                                  causal=True, alibi_slopes=slopes)
    torch.testing.assert_close(k_cache, exp_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, exp_v, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(out, exp_out, **TOL)
    assert torch.equal(k_cache[[0, 2]], ck[[0, 2]])  # rows no sequence uses are untouched


@pytest.mark.parametrize("page", [3, 4])
def test_paged_append_equals_dense(page):
    g, q, ck, cv, k, v = setup(new=2, cap=12)
    lens = [3, 8]
    blocks = 12 // page
    table = torch.randperm(2 * blocks + 1, generator=g)[:2 * blocks].view(2, blocks).int()
    pages_k = torch.full((2 * blocks + 1, page, 2, 16), float("nan"), dtype=F64)
    pages_v = pages_k.clone()
    for b in range(2):
        for j in range(blocks):
            pages_k[table[b, j]] = ck[b, j * page:(j + 1) * page]
            pages_v[table[b, j]] = cv[b, j * page:(j + 1) * page]
    cos, sin = randn(12, 8, g=g).cos(), randn(12, 8, g=g).sin()
    exp_k, exp_v, exp_out, _ = expected(q, ck, cv, k, v, lens, rotary=(cos, sin), causal=True)
    out = flash_attn_with_kvcache(q, pages_k, pages_v, k, v, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                  block_table=table, causal=True)
    torch.testing.assert_close(out, exp_out, **TOL)
    for b in range(2):
        for j in range(blocks):
            torch.testing.assert_close(pages_k[table[b, j]], exp_k[b, j * page:(j + 1) * page],
                                       **TOL)
            torch.testing.assert_close(pages_v[table[b, j]], exp_v[b, j * page:(j + 1) * page],
                                       atol=0, rtol=0)


def test_num_splits_int_lengths_and_softcap():
    g, q, ck, cv, _, _ = setup(new=0)
    _, _, exp_out, _ = expected(q, ck, cv, None, None, [9, 9], softcap=1.5)
    for splits in (0, 1, 4):
        out = flash_attn_with_kvcache(q, ck, cv, cache_seqlens=9, softcap=1.5, num_splits=splits)
        torch.testing.assert_close(out, exp_out, **TOL)
    # no cache_seqlens: the whole cache
    _, _, exp_full, _ = expected(q, ck, cv, None, None, [16, 16])
    torch.testing.assert_close(flash_attn_with_kvcache(q, ck, cv), exp_full, **TOL)


def test_empty_cache_rows_give_zeros():
    g, q, ck, cv, _, _ = setup(new=0)
    out, lse = flash_attn_with_kvcache(q, ck, cv, cache_seqlens=torch.tensor([0, 4]),
                                       return_softmax_lse=True)
    assert (out[0] == 0).all() and torch.isinf(lse[0]).all()
    torch.testing.assert_close(out[1], expected(q, ck, cv, None, None, [0, 4])[2][1], **TOL)


ERRORS = [
    ("overflow", dict(cache_seqlens=15), "outside"),
    ("no_lengths", dict(cache_seqlens=None), "cache_seqlens must be given"),
    ("rotary_without_k", dict(k=None, v=None, rotary_cos=torch.ones(16, 4, dtype=F64),
                              rotary_sin=torch.ones(16, 4, dtype=F64)), "need new k"),
    ("rotary_short", dict(rotary_cos=torch.ones(5, 4, dtype=F64),
                          rotary_sin=torch.ones(5, 4, dtype=F64)), "positions"),
    ("leftpad_past_length", dict(cache_leftpad=torch.tensor([9, 0], dtype=torch.int32)),
     "cache_leftpad"),
    ("batch_idx_range", dict(cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)),
     "cache_batch_idx"),
    ("k_without_v", dict(v=None), "together"),
    ("k_dtype", dict(k="float32"), "dtype"),
]


@pytest.mark.parametrize("name,change,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_are_runtime_errors(name, change, match):
    g, q, ck, cv, k, v = setup(new=3)
    kw = dict(k=k, v=v, cache_seqlens=torch.tensor([5, 9], dtype=torch.int32))
    kw.update(change)
    if kw.get("k") == "float32":
        kw["k"] = k.float()
    with pytest.raises(RuntimeError, match=match):
        flash_attn_with_kvcache(q, ck, cv, **kw)


def test_page_table_overflow_is_a_runtime_error():
    g, q, _, _, k, v = setup(new=2)
    pages = torch.zeros(3, 4, 2, 16, dtype=F64)
    table = torch.tensor([[0, 1], [2, 7]], dtype=torch.int32)  # page 7 does not exist
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, pages, pages.clone(), k, v,
                                cache_seqlens=torch.tensor([1, 5], dtype=torch.int32),
                                block_table=table)
    with pytest.raises(RuntimeError, match="cache_batch_idx"):
        flash_attn_with_kvcache(q, pages, pages.clone(), cache_seqlens=1, block_table=table,
                                cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))


def test_flash_attn_kvcache_paged_block_table_bounds():
    """A paged sequence that outgrows its block_table row: the error names block_table (the
    bound of a paged sequence), not only cache_seqlens."""
    g, q, _, _, k, v = setup(new=2)
    pages = torch.zeros(4, 4, 2, 16, dtype=F64)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)  # 2 pages of 4 tokens each
    with pytest.raises(RuntimeError, match=re.escape(
            "cache_seqlens[1] = 7 is outside [0, 6] (block_table holds 2 pages of 4 tokens and "
            "2 are appended)")):
        flash_attn_with_kvcache(q, pages, pages.clone(), k, v,
                                cache_seqlens=torch.tensor([1, 7], dtype=torch.int32),
                                block_table=table)
    out = flash_attn_with_kvcache(q, pages, pages.clone(), k, v,
                                  cache_seqlens=torch.tensor([1, 6], dtype=torch.int32),
                                  block_table=table)  # exactly full: fine
    assert out.shape == q.shape
