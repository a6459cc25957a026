"""cudnn_attn.flash_api (FlashAttention's mha_fwd / mha_varlen_fwd / mha_bwd / mha_varlen_bwd)
against the float64 brute-force oracle.

FlashAttention semantics are written out here independently of the library: bottom-right causal,
inclusive windows with -1 unbounded (a window >= S_k, or max_seqlen_k for varlen, becomes -1;
causal sets the right window to 0), ALiBi ``-slope * |i + S_k - S_q - j|``, softcap, GQA. Covered:
every option and their combinations, return_softmax against the oracle's probabilities, ragged
varlen batches (1, 2, 113 tokens, empty), seqused_k, paged caches with shuffled block tables and
odd page sizes, output buffers, gradients through mha_bwd / mha_varlen_bwd against float64
autograd, dropout (reproducibility, the kept mask, the backward against autograd through the
explicit mask), and input errors. GPU tests (marked) run the same checks in fp16/bf16 with the
tolerance policy.
"""

from __future__ import annotations

import itertools

import oracle
import pytest
import torch

from cudnn_attn import NotSupportedError
from cudnn_attn.core import dispatch
from cudnn_attn.core.caches import clear_caches
from cudnn_attn.flash_api import mha_bwd, mha_fwd, mha_varlen_bwd, mha_varlen_fwd

F64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)
GRAD_TOL = dict(atol=1e-9, rtol=1e-8)


# ---------------------------------------------------------------------------------------------
# the oracle with FlashAttention's argument conventions
# ---------------------------------------------------------------------------------------------

def fa_window(causal, left, right, seq_k_norm):
    """FlashAttention's normalization of (is_causal, window_size_left, window_size_right)."""
    left = -1 if left < 0 or left >= seq_k_norm else left
    right = -1 if right < 0 or right >= seq_k_norm else right
    if causal:
        right = 0
    return left, right


def ref_one(q, k, v, *, causal=False, left=-1, right=-1, softcap=0.0, slopes=None, scale=None,
            norm_k=None):
    """Dense float64 oracle on bshd tensors; slopes [H] or [B, H]. Returns (out, lse, probs)."""
    B, Sq, H, _ = q.shape
    Sk = k.shape[1]
    if Sq == 0 or Sk == 0:
        zero = 0.0 * (q.sum() + k.sum() + v.sum()).to(F64)
        return (torch.zeros(B, Sq, H, v.shape[3], dtype=F64) + zero,
                torch.full((B, H, Sq), float("-inf"), dtype=F64),
                torch.zeros(B, H, Sq, Sk, dtype=F64))
    left, right = fa_window(causal, left, right, Sk if norm_k is None else norm_k)
    vis = oracle.build_visibility(B, Sq, Sk, window=(left, right, "bottom_right"))
    bias = None
    if slopes is not None:
        bias = oracle.alibi_bias(slopes.to(F64), B, H, Sq, Sk, [Sk - Sq] * B)
    kw = dict(layout="bshd", scale=scale, softcap=softcap or None, bias=bias)
    out, lse = oracle.reference_attention(q, k, v, vis, **kw)
    eye = torch.eye(Sk, dtype=F64)[None, :, None, :].expand(B, Sk, k.shape[2], Sk)
    probs, _ = oracle.reference_attention(q.detach(), k.detach(), eye, vis, **kw)
    return out, lse, probs.permute(0, 2, 1, 3)


def cu(lens, dtype=torch.int32):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=dtype)


def ref_varlen(q, k_seqs, v_seqs, lens_q, *, slopes=None, max_k=None, max_q=None, **kw):
    """Per-sequence oracle; k_seqs/v_seqs: each sequence's keys [S_k, H, D]. Returns packed
    (out [total_q, H, D_v], lse [H, total_q]) and probs [B, H, max_q, max_k]."""
    outs, lses, probs = [], [], []
    starts = cu(lens_q).tolist()
    max_q = max(lens_q) if max_q is None else max_q
    for b, (kb, vb) in enumerate(zip(k_seqs, v_seqs)):
        qb = q[starts[b]:starts[b + 1]][None]
        sb = None
        if slopes is not None:
            sb = slopes[b] if slopes.dim() == 2 else slopes
        o, lse, p = ref_one(qb, kb[None], vb[None], slopes=sb, norm_k=max_k, **kw)
        outs.append(o[0])
        lses.append(lse[0])
        full = torch.zeros(q.shape[1], max_q, max_k, dtype=F64)
        full[:, :p.shape[2], :p.shape[3]] = p[0]
        probs.append(full)
    return torch.cat(outs), torch.cat(lses, dim=1), torch.stack(probs)


def r128(n):
    return -(-n // 128) * 128


def fa_block_n(head_dim, dropout):
    """FlashAttention's key-block width on sm80 (its ``_get_block_size_n``)."""
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if dropout else 128
    if head_dim <= 96:
        return 64
    return (32 if dropout else 64) if head_dim <= 128 else 64


def fa_decode(S, ref_p, head_dim, dropout):
    """FlashAttention's S_dmask -> (pre-dropout probabilities, keep). S holds exp(s - m), m the
    row max over the key blocks from this one to the last (its forward walks the blocks
    backwards), negated where dropout dropped, zero-padded to multiples of 128; the running max
    is taken from the oracle's probabilities, as FlashAttention's test takes it from its scores."""
    Sq, Sk = ref_p.shape[-2:]
    assert S.shape[-2:] == (r128(Sq), r128(Sk)), S.shape
    assert (S[..., Sq:, :] == 0).all() and (S[..., Sk:] == 0).all()
    S = S[..., :Sq, :Sk].to(ref_p.dtype)
    n = fa_block_n(head_dim, dropout)
    running_max = torch.zeros_like(ref_p)
    for c0 in range(0, Sk, n):
        running_max[..., c0:c0 + n] = ref_p[..., c0:].amax(-1, keepdim=True)
    return S.abs() * running_max, S >= 0


def randn(*shape, g, dtype=F64):
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


def dense_inputs(B, Sq, Sk, Hq, Hkv, D, Dv=None, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return (randn(B, Sq, Hq, D, g=g, dtype=dtype), randn(B, Sk, Hkv, D, g=g, dtype=dtype),
            randn(B, Sk, Hkv, Dv or D, g=g, dtype=dtype))


def make_slopes(kind, B, H, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None
    shape = (H,) if kind == "h" else (B, H)
    return torch.rand(*shape, generator=g, dtype=torch.float32) * 0.5 + 0.05


def fwd(q, k, v, *, out_=None, slopes=None, p=0.0, scale=None, causal=False, left=-1, right=-1,
        softcap=0.0, return_softmax=False, gen=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return mha_fwd(q, k, v, out_, slopes, p, scale, causal, left, right, softcap,
                   return_softmax, gen)


def bwd(dout, q, k, v, out, lse, *, slopes=None, p=0.0, scale=None, causal=False, left=-1,
        right=-1, softcap=0.0, deterministic=False, seed=None, offset=None, bufs=(None,) * 3):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seed = torch.tensor(0) if seed is None else seed
    offset = torch.tensor(0) if offset is None else offset
    return mha_bwd(dout, q, k, v, out, lse, *bufs, slopes, p, scale, causal, left, right,
                   softcap, deterministic, seed, offset)


# ---------------------------------------------------------------------------------------------
# mha_fwd: every option and combination
# ---------------------------------------------------------------------------------------------

SHAPES = {  # (B, S_q, S_k, H_q, H_kv, D, D_v)
    "square_mha": (2, 9, 9, 4, 4, 16, 16),
    "short_q_gqa": (2, 5, 13, 4, 2, 8, 12),
    "long_q_mqa": (1, 13, 5, 4, 1, 8, 8),
    "decode_gqa": (2, 1, 11, 6, 2, 16, 16),
}
WINDOWS = [(-1, -1), (3, -1), (2, 1), (0, 0), (40, 2), (-1, 3)]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_fwd_masks_alibi_softcap(shape, causal, window):
    B, Sq, Sk, Hq, Hkv, D, Dv = SHAPES[shape]
    q, k, v = dense_inputs(B, Sq, Sk, Hq, Hkv, D, Dv)
    for alibi, softcap in itertools.product([None, "h", "bh"], [0.0, 1.5]):
        slopes = make_slopes(alibi, B, Hq)
        res = fwd(q, k, v, slopes=slopes, causal=causal, left=window[0], right=window[1],
                  softcap=softcap, return_softmax=True)
        assert len(res) == 8
        out, qp, kp, vp, lse, seed, offset, p = res
        ref_out, ref_lse, ref_p = ref_one(q, k, v, causal=causal, left=window[0],
                                          right=window[1], softcap=softcap, slopes=slopes)
        what = f"alibi={alibi} softcap={softcap}"
        assert out.shape == (B, Sq, Hq, Dv) and out.dtype == F64, what
        assert lse.shape == (B, Hq, Sq) and lse.dtype == F64, what
        assert p.shape == (B, Hq, r128(Sq), r128(Sk)) and p.dtype == F64, what
        p = fa_decode(p, ref_p, D, False)[0]
        assert qp is q and kp is k and vp is v
        assert seed.dtype == offset.dtype == torch.int64 and int(offset) == 0
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), what
        for name, got, exp in (("out", out, ref_out), ("lse", lse, ref_lse), ("p", p, ref_p)):
            torch.testing.assert_close(got, exp, **TOL,
                                       msg=lambda m, n=f"{name} {what}": f"{n}: {m}")


def test_fwd_without_return_softmax_gives_empty_p_and_matches():
    q, k, v = dense_inputs(2, 7, 10, 4, 2, 16)
    out, *_, lse, seed, offset, p = fwd(q, k, v, causal=True)
    assert p.numel() == 0
    ref_out, ref_lse, _ = ref_one(q, k, v, causal=True)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    assert int(seed) == 0 and int(offset) == 0


def test_fwd_scale_and_empty_rows():
    # S_q > S_k causal (bottom-right): the first S_q - S_k rows see no key: out 0, lse -inf.
    q, k, v = dense_inputs(1, 8, 3, 2, 2, 8)
    out, *_, lse, _, _, p = fwd(q, k, v, causal=True, scale=0.37, return_softmax=True)
    ref_out, ref_lse, ref_p = ref_one(q, k, v, causal=True, scale=0.37)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    torch.testing.assert_close(fa_decode(p, ref_p, 8, False)[0], ref_p, **TOL)
    assert (out[:, :5] == 0).all() and torch.isinf(lse[:, :, :5]).all()


def test_fwd_window_normalization_like_flashattention():
    # right >= S_k becomes unbounded even where S_q > S_k would make it bind (FA's rule).
    q, k, v = dense_inputs(1, 10, 2, 2, 2, 8)
    out, *_, lse, _, _, _ = fwd(q, k, v, left=-1, right=2)
    ref_out, ref_lse, _ = ref_one(q, k, v)  # no window at all
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_fwd_out_buffer_written_and_returned():
    q, k, v = dense_inputs(2, 6, 6, 4, 2, 8)
    buf = torch.full((2, 6, 4, 8), float("nan"), dtype=F64)
    out = fwd(q, k, v, out_=buf, causal=True)[0]
    assert out is buf
    torch.testing.assert_close(buf, ref_one(q, k, v, causal=True)[0], **TOL)


def test_fwd_float32():
    q, k, v = dense_inputs(2, 9, 12, 4, 2, 16, dtype=torch.float32)
    out, *_, lse, _, _, p = fwd(q, k, v, causal=True, left=4, softcap=2.0,
                                slopes=make_slopes("h", 2, 4), return_softmax=True)
    assert out.dtype == p.dtype == torch.float32 and lse.dtype == torch.float32
    ref_out, ref_lse, ref_p = ref_one(q.double(), k.double(), v.double(), causal=True, left=4,
                                      softcap=2.0, slopes=make_slopes("h", 2, 4))
    torch.testing.assert_close(out.double(), ref_out, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(fa_decode(p, ref_p, 16, False)[0], ref_p, atol=3e-5, rtol=3e-5)


# ---------------------------------------------------------------------------------------------
# mha_bwd: gradients against float64 autograd through the oracle
# ---------------------------------------------------------------------------------------------

BWD_CASES = {
    "plain": dict(shape="square_mha"),
    "causal_gqa_short_q": dict(shape="short_q_gqa", causal=True),
    "window_alibi_bh": dict(shape="square_mha", left=3, right=1, alibi="bh"),
    "causal_long_q_empty_rows_softcap": dict(shape="long_q_mqa", causal=True, softcap=1.3),
    "window_alibi_h_softcap_gqa": dict(shape="short_q_gqa", left=4, right=-1, alibi="h",
                                       softcap=2.0),
    "decode_causal_alibi": dict(shape="decode_gqa", causal=True, alibi="h"),
}


@pytest.mark.parametrize("name", sorted(BWD_CASES))
def test_bwd_matches_autograd(name):
    case = dict(BWD_CASES[name])
    B, Sq, Sk, Hq, Hkv, D, Dv = SHAPES[case.pop("shape")]
    slopes = make_slopes(case.pop("alibi", None), B, Hq)
    q, k, v = dense_inputs(B, Sq, Sk, Hq, Hkv, D, Dv, seed=3)
    out, *_, lse, seed, offset, _ = fwd(q, k, v, slopes=slopes, **case)
    dout = randn(*out.shape, g=torch.Generator().manual_seed(9))
    dq, dk, dv, softmax_d = bwd(dout, q, k, v, out, lse, slopes=slopes, seed=seed,
                                offset=offset, **case)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out, _, _ = ref_one(*leaves, slopes=slopes, **case)
    exp = torch.autograd.grad(ref_out, leaves, dout)
    for n, got, e in zip("qkv", (dq, dk, dv), exp):
        assert got.shape == e.shape and got.dtype == F64
        assert not torch.isnan(got).any(), f"NaN in d{n}"
        torch.testing.assert_close(got, e, **GRAD_TOL, msg=lambda m, n=n: f"d{n}: {m}")
    assert softmax_d.shape == (B, Hq, Sq)
    torch.testing.assert_close(softmax_d, (dout * out).sum(-1).permute(0, 2, 1), **TOL)


def test_bwd_buffers_deterministic_and_fa_lse_convention():
    q, k, v = dense_inputs(2, 8, 3, 4, 2, 8, seed=4)  # S_q > S_k causal: rows with no key
    out, *_, lse, _, _, _ = fwd(q, k, v, causal=True)
    dout = randn(*out.shape, g=torch.Generator().manual_seed(5))
    first = bwd(dout, q, k, v, out, lse, causal=True)
    bufs = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    # FlashAttention writes +inf for rows that see nothing; the backward takes either.
    fa_lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    second = bwd(dout, q, k, v, out, fa_lse, causal=True, deterministic=True, bufs=bufs)
    for got, buf in zip(second[:3], bufs):
        assert got is buf
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert (second[0][:, :5] == 0).all()


# ---------------------------------------------------------------------------------------------
# varlen: ragged batches, seqused_k, paged caches
# ---------------------------------------------------------------------------------------------

LENS_Q = [1, 2, 113, 7, 0]
LENS_K = [3, 2, 113, 1, 4]


def varlen_inputs(lens_q, lens_k, Hq, Hkv, D, Dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (randn(sum(lens_q), Hq, D, g=g), randn(sum(lens_k), Hkv, D, g=g),
            randn(sum(lens_k), Hkv, Dv or D, g=g))


def split(x, lens):
    return list(torch.split(x, lens))


def vfwd(q, k, v, cu_q, cu_k, max_q, max_k, *, out_=None, seqused_k=None, block_table=None,
         slopes=None, p=0.0, scale=None, causal=False, left=-1, right=-1, softcap=0.0,
         return_softmax=False, gen=None, zero_tensors=False):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return mha_varlen_fwd(q, k, v, out_, cu_q, cu_k, seqused_k, block_table, slopes, max_q,
                          max_k, p, scale, zero_tensors, causal, left, right, softcap,
                          return_softmax, gen)


def vbwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, *, slopes=None, p=0.0, scale=None,
         causal=False, left=-1, right=-1, softcap=0.0, deterministic=False, seed=None,
         offset=None, bufs=(None,) * 3):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    seed = torch.tensor(0) if seed is None else seed
    offset = torch.tensor(0) if offset is None else offset
    return mha_varlen_bwd(dout, q, k, v, out, lse, *bufs, cu_q, cu_k, slopes, max_q, max_k, p,
                          scale, False, causal, left, right, softcap, deterministic, seed,
                          offset)


VARLEN_OPTS = [
    dict(),
    dict(causal=True),
    dict(causal=True, left=5, alibi="bh"),
    dict(left=2, right=3, softcap=1.5),
    dict(alibi="h", softcap=2.0),
    dict(causal=True, alibi="h", left=200),  # left >= max_seqlen_k: unbounded
]


@pytest.mark.parametrize("opts", VARLEN_OPTS, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (3, 1)], ids=str)
def test_varlen_fwd_ragged(opts, heads):
    opts = dict(opts)
    Hq, Hkv = heads
    slopes = make_slopes(opts.pop("alibi", None), len(LENS_Q), Hq)
    q, k, v = varlen_inputs(LENS_Q, LENS_K, Hq, Hkv, 8, 12)
    max_q, max_k = 120, 117  # larger than needed: padding must not leak
    out, qp, kp, vp, lse, seed, offset, p = vfwd(q, k, v, cu(LENS_Q), cu(LENS_K), max_q, max_k,
                                                 slopes=slopes, return_softmax=True, **opts)
    ref_out, ref_lse, ref_p = ref_varlen(q, split(k, LENS_K), split(v, LENS_K), LENS_Q,
                                         slopes=slopes, max_k=max_k, max_q=max_q, **opts)
    assert out.shape == (sum(LENS_Q), Hq, 12) and lse.shape == (Hq, sum(LENS_Q))
    assert qp is q and kp is k and vp is v
    assert seed.dtype == offset.dtype == torch.int64 and int(seed) == int(offset) == 0
    assert p.shape == (len(LENS_Q), Hq, r128(max_q), r128(max_k))
    p = fa_decode(p, ref_p, 8, False)[0]
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    torch.testing.assert_close(p, ref_p, **TOL)


def test_varlen_equal_lengths_out_buffer_and_int64_cu():
    lens = [4, 9, 1]
    q, k, v = varlen_inputs(lens, lens, 4, 2, 8)
    buf = torch.full((sum(lens), 4, 8), float("nan"), dtype=F64)
    slopes = make_slopes("h", 3, 4)
    res = vfwd(q, k, v, cu(lens, torch.int64), cu(lens, torch.int64), 9, 9, out_=buf,
               causal=True, slopes=slopes, zero_tensors=True)
    assert res[0] is buf
    ref_out, ref_lse, _ = ref_varlen(q, split(k, lens), split(v, lens), lens, causal=True,
                                     slopes=slopes, max_k=9)
    torch.testing.assert_close(buf, ref_out, **TOL)
    torch.testing.assert_close(res[4], ref_lse, **TOL)


def test_varlen_seqused_k():
    lens_q, lens_k, used = [3, 1, 6], [8, 5, 6], [4, 0, 6]
    q, k, v = varlen_inputs(lens_q, lens_k, 2, 2, 8)
    # keys past seqused_k may hold anything
    for kv in (k, v):
        starts = cu(lens_k).tolist()
        for b, n in enumerate(used):
            kv[starts[b] + n:starts[b + 1]] = float("nan")
    out, *_, lse, _, _, p = vfwd(q, k, v, cu(lens_q), cu(lens_k), 6, 6,
                                 seqused_k=torch.tensor(used, dtype=torch.int32), causal=True,
                                 return_softmax=True)
    ks = [x[:n] for x, n in zip(split(k, lens_k), used)]
    vs = [x[:n] for x, n in zip(split(v, lens_k), used)]
    ref_out, ref_lse, ref_p = ref_varlen(q, ks, vs, lens_q, causal=True, max_k=6)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    p = fa_decode(p, ref_p, 8, False)[0]
    torch.testing.assert_close(p, ref_p, **TOL)
    assert torch.isinf(lse[:, 3]).all() and (out[3] == 0).all()  # sequence 1 uses no key


def paged_cache(lens_k, page, Hkv, D, g, spare=3):
    """A shuffled paged cache holding each sequence's keys/values; unused rows are NaN."""
    pages = [-(-n // page) for n in lens_k]
    width = max(pages) + 1
    num_blocks = sum(pages) + spare
    perm = torch.randperm(num_blocks, generator=g)
    kc = torch.full((num_blocks, page, Hkv, D), float("nan"), dtype=F64)
    vc = torch.full_like(kc, float("nan"))
    table = torch.full((len(lens_k), width), 10 ** 6, dtype=torch.int32)  # unused: garbage
    ks, vs, used = [], [], 0
    for b, n in enumerate(lens_k):
        kb, vb = randn(n, Hkv, D, g=g), randn(n, Hkv, D, g=g)
        ks.append(kb)
        vs.append(vb)
        for j in range(pages[b]):
            pid = int(perm[used])
            used += 1
            table[b, j] = pid
            rows = slice(j * page, min((j + 1) * page, n))
            kc[pid, :rows.stop - rows.start] = kb[rows]
            vc[pid, :rows.stop - rows.start] = vb[rows]
    return kc, vc, table, ks, vs


@pytest.mark.parametrize("page", [1, 3, 5, 7, 16])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(left=3, right=0, alibi="h"),
                                  dict(softcap=1.2)], ids=str)
def test_varlen_paged(page, opts):
    opts = dict(opts)
    g = torch.Generator().manual_seed(page)
    lens_q, lens_k = [1, 2, 13, 1], [5, 2, 23, 9]
    Hq, Hkv, D = 4, 2, 8
    slopes = make_slopes(opts.pop("alibi", None), 4, Hq)
    q = randn(sum(lens_q), Hq, D, g=g)
    kc, vc, table, ks, vs = paged_cache(lens_k, page, Hkv, D, g)
    out, _, kp, vp, lse, _, _, p = vfwd(q, kc, vc, cu(lens_q), cu(lens_k), 13, 23,
                                        block_table=table, slopes=slopes, return_softmax=True,
                                        **opts)
    assert kp is kc and vp is vc
    ref_out, ref_lse, ref_p = ref_varlen(q, ks, vs, lens_q, slopes=slopes, max_k=23, **opts)
    torch.testing.assert_close(out, ref_out, **TOL)
    p = fa_decode(p, ref_p, D, False)[0]
    torch.testing.assert_close(lse, ref_lse, **TOL)
    torch.testing.assert_close(p, ref_p, **TOL)


def test_varlen_paged_with_seqused_k():
    g = torch.Generator().manual_seed(11)
    lens_q, cache_lens, used = [2, 3], [10, 7], [6, 7]
    q = randn(sum(lens_q), 2, 8, g=g)
    kc, vc, table, ks, vs = paged_cache(cache_lens, 3, 2, 8, g)
    out, *_, lse, _, _, _ = vfwd(q, kc, vc, cu(lens_q), cu(cache_lens), 3, 10,
                                 seqused_k=torch.tensor(used, dtype=torch.int32),
                                 block_table=table, causal=True)
    ref_out, ref_lse, _ = ref_varlen(q, [x[:n] for x, n in zip(ks, used)],
                                     [x[:n] for x, n in zip(vs, used)], lens_q, causal=True,
                                     max_k=10)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


VARLEN_BWD = [
    dict(),
    dict(causal=True, alibi="bh"),
    dict(left=4, right=2, softcap=1.7),
    dict(causal=True, left=3, alibi="h", softcap=2.5),
]


@pytest.mark.parametrize("opts", VARLEN_BWD, ids=str)
def test_varlen_bwd_matches_autograd(opts):
    opts = dict(opts)
    lens_q, lens_k = [1, 2, 113, 5, 0], [2, 2, 113, 1, 3]
    Hq, Hkv = 4, 2
    slopes = make_slopes(opts.pop("alibi", None), len(lens_q), Hq)
    q, k, v = varlen_inputs(lens_q, lens_k, Hq, Hkv, 8, 12, seed=2)
    cq, ck = cu(lens_q), cu(lens_k)
    out, *_, lse, seed, offset, _ = vfwd(q, k, v, cq, ck, 113, 113, slopes=slopes, **opts)
    dout = randn(*out.shape, g=torch.Generator().manual_seed(6))
    bufs = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    dq, dk, dv, softmax_d = vbwd(dout, q, k, v, out, lse, cq, ck, 113, 113, slopes=slopes,
                                 seed=seed, offset=offset, bufs=bufs, **opts)
    assert dq is bufs[0] and dk is bufs[1] and dv is bufs[2]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out, _, _ = ref_varlen(leaves[0], split(leaves[1], lens_k), split(leaves[2], lens_k),
                               lens_q, slopes=slopes, max_k=113, **opts)
    exp = torch.autograd.grad(ref_out, leaves, dout)
    for n, got, e in zip("qkv", (dq, dk, dv), exp):
        torch.testing.assert_close(got, e, **GRAD_TOL, msg=lambda m, n=n: f"d{n}: {m}")
    assert softmax_d.shape == (Hq, sum(lens_q))
    torch.testing.assert_close(softmax_d, (dout * out).sum(-1).t(), **TOL)


# ---------------------------------------------------------------------------------------------
# dropout
# ---------------------------------------------------------------------------------------------

def gen(seed):
    return torch.Generator().manual_seed(seed)


def test_dropout_reproducible_from_generator():
    q, k, v = dense_inputs(2, 9, 9, 4, 2, 8)
    a = fwd(q, k, v, p=0.3, causal=True, gen=gen(7))
    b = fwd(q, k, v, p=0.3, causal=True, gen=gen(7))
    c = fwd(q, k, v, p=0.3, causal=True, gen=gen(8))
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    assert int(a[5]) == int(b[5]) != int(c[5])
    assert not torch.allclose(a[0], c[0])
    torch.manual_seed(3)  # gen_ = None: the default generator
    d = fwd(q, k, v, p=0.3, causal=True)
    torch.manual_seed(3)
    e = fwd(q, k, v, p=0.3, causal=True)
    torch.testing.assert_close(d[0], e[0], atol=0, rtol=0)


def test_dropout_kept_mask_identity_values_and_rate():
    B, S, H, p = 2, 64, 4, 0.25
    q, k, _ = dense_inputs(B, S, S, H, H, 8)
    eye = torch.eye(S, dtype=F64)[None, :, None, :].expand(B, S, H, S).contiguous()
    # V = identity: out[b, i, h, :] is row i of the dropped, rescaled weights.
    out, *_, lse, _, _, probs = fwd(q, k, eye, p=p, gen=gen(1), return_softmax=True)
    weights = out.permute(0, 2, 1, 3)
    _, ref_lse, ref_p = ref_one(q, k, eye)
    # return_softmax: FlashAttention's encoding, the pre-dropout weights with dropped ones negated
    pre, kept = fa_decode(probs, ref_p, 8, True)
    torch.testing.assert_close(pre, ref_p, **TOL)
    torch.testing.assert_close(weights, ref_p * kept / (1 - p), **TOL)
    assert ((weights != 0) == kept).all()
    torch.testing.assert_close(lse, ref_lse, **TOL)  # lse ignores dropout
    rate = 1 - kept.double().mean().item()
    assert abs(rate - p) < 0.02, rate


def explicit_mask_oracle(q, k, v, keep, p, **kw):
    """Dropout with an explicit keep mask [B, H, S_q, S_k]: (softmax * keep / (1 - p)) @ v."""
    B, Sk, Hkv, _ = k.shape
    eye = torch.eye(Sk, dtype=F64)[None, :, None, :].expand(B, Sk, Hkv, Sk)
    probs, _, _ = ref_one(q, k, eye, **kw)  # differentiable in q and k: [B, S_q, H, S_k]
    dropped = probs * keep.permute(0, 2, 1, 3) / (1 - p)
    rep = q.shape[2] // Hkv
    return torch.einsum("bihj,bjhd->bihd", dropped, v.repeat_interleave(rep, dim=2))


DROPOUT_CASES = {
    "causal_gqa": dict(shape="short_q_gqa", causal=True),
    "window_alibi_softcap": dict(shape="square_mha", left=3, right=2, alibi="bh", softcap=1.5),
    "long_q_empty_rows": dict(shape="long_q_mqa", causal=True),
}


@pytest.mark.parametrize("name", sorted(DROPOUT_CASES))
def test_dropout_backward_replays_the_mask(name):
    case = dict(DROPOUT_CASES[name])
    B, Sq, Sk, Hq, Hkv, D, Dv = SHAPES[case.pop("shape")]
    slopes = make_slopes(case.pop("alibi", None), B, Hq)
    p = 0.4
    q, k, v = dense_inputs(B, Sq, Sk, Hq, Hkv, D, Dv, seed=5)
    out, *_, lse, seed, offset, probs = fwd(q, k, v, p=p, slopes=slopes, gen=gen(21),
                                            return_softmax=True, **case)
    _, _, ref_p = ref_one(q, k, v, slopes=slopes, **case)
    keep = fa_decode(probs, ref_p, D, True)[1].to(F64)
    assert 0 < keep[ref_p > 0].mean() < 1
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = explicit_mask_oracle(*leaves, keep, p, slopes=slopes, **case)
    torch.testing.assert_close(out, ref_out.detach(), **TOL)
    dout = randn(*out.shape, g=gen(4))
    dq, dk, dv, _ = bwd(dout, q, k, v, out, lse, p=p, slopes=slopes, seed=seed, offset=offset,
                        deterministic=True, **case)
    exp = torch.autograd.grad(ref_out, leaves, dout)
    for n, got, e in zip("qkv", (dq, dk, dv), exp):
        torch.testing.assert_close(got, e, **GRAD_TOL, msg=lambda m, n=n: f"d{n}: {m}")


def test_dropout_mask_does_not_depend_on_return_softmax():
    q, k, v = dense_inputs(2, 9, 11, 4, 2, 8)
    a = fwd(q, k, v, p=0.3, causal=True, gen=gen(2))
    b = fwd(q, k, v, p=0.3, causal=True, gen=gen(2), return_softmax=True)
    torch.testing.assert_close(a[0], b[0], **TOL)
    rep = 2
    _, _, ref_p = ref_one(q, k, v, causal=True)
    pre, keep = fa_decode(b[7], ref_p, 8, True)
    torch.testing.assert_close(a[0], torch.einsum("bhij,bjhd->bihd", pre * keep / 0.7,
                                                  v.repeat_interleave(rep, dim=2)), **TOL)


def test_varlen_dropout_backward_replays_the_mask():
    lens_q, lens_k = [1, 2, 40, 0], [3, 2, 37, 4]
    Hq, Hkv, p = 4, 2, 0.3
    q, k, v = varlen_inputs(lens_q, lens_k, Hq, Hkv, 8, seed=8)
    cq, ck = cu(lens_q), cu(lens_k)
    out, *_, lse, seed, offset, probs = vfwd(q, k, v, cq, ck, 40, 37, p=p, causal=True,
                                             softcap=2.0, gen=gen(5), return_softmax=True)
    again = vfwd(q, k, v, cq, ck, 40, 37, p=p, causal=True, softcap=2.0, gen=gen(5))
    torch.testing.assert_close(out, again[0], **TOL)  # same mask without return_softmax
    dout = randn(*out.shape, g=gen(6))
    dq, dk, dv, _ = vbwd(dout, q, k, v, out, lse, cq, ck, 40, 37, p=p, causal=True, softcap=2.0,
                         seed=seed, offset=offset)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    starts_q, starts_k = cq.tolist(), ck.tolist()
    outs = []
    for b in range(len(lens_q)):
        qb = leaves[0][starts_q[b]:starts_q[b + 1]][None]
        kb = leaves[1][starts_k[b]:starts_k[b + 1]][None]
        vb = leaves[2][starts_k[b]:starts_k[b + 1]][None]
        keep = (probs[b:b + 1, :, :lens_q[b], :lens_k[b]] >= 0).to(F64)  # sign: dropped < 0
        if lens_q[b] == 0 or lens_k[b] == 0:
            outs.append(torch.zeros(lens_q[b], Hq, 8, dtype=F64) + 0.0 * qb.sum())
            continue
        outs.append(explicit_mask_oracle(qb, kb, vb, keep, p, causal=True, softcap=2.0,
                                         norm_k=37)[0])
    ref_out = torch.cat(outs)
    torch.testing.assert_close(out, ref_out.detach(), **TOL)
    exp = torch.autograd.grad(ref_out, leaves, dout)
    for n, got, e in zip("qkv", (dq, dk, dv), exp):
        torch.testing.assert_close(got, e, **GRAD_TOL, msg=lambda m, n=n: f"d{n}: {m}")


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

def _dense():
    return dense_inputs(2, 5, 6, 4, 2, 8)


FWD_ERRORS = [
    ("q_not_tensor", dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    ("q_rank", dict(q=torch.zeros(5, 4, 8, dtype=F64)), ValueError, "q must be 4-D"),
    ("int_dtype", dict(q=torch.zeros(2, 5, 4, 8, dtype=torch.int32)), TypeError, "q must be"),
    ("dtype_mismatch", dict(k=torch.zeros(2, 6, 2, 8)), TypeError, "share a dtype"),
    ("gqa", dict(k=torch.zeros(2, 6, 3, 8, dtype=F64), v=torch.zeros(2, 6, 3, 8, dtype=F64)),
     ValueError, "multiple of kv heads"),
    ("head_dim", dict(k=torch.zeros(2, 6, 2, 4, dtype=F64)), ValueError, "head dim"),
    ("p_dropout_one", dict(p_dropout=1.0), ValueError, "p_dropout"),
    ("p_dropout_negative", dict(p_dropout=-0.1), ValueError, "p_dropout"),
    ("softcap_negative", dict(softcap=-1.0), ValueError, "softcap"),
    ("scale_nan", dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
    ("causal_int", dict(is_causal=1), TypeError, "is_causal"),
    ("window_float", dict(window_size_left=1.5), TypeError, "window_size_left"),
    ("window_right_str", dict(window_size_right="2"), TypeError, "window_size_right"),
    ("return_softmax", dict(return_softmax=None), TypeError, "return_softmax"),
    ("gen", dict(gen_=3), TypeError, "gen_"),
    ("alibi_shape", dict(alibi_slopes_=torch.ones(3)), ValueError, "alibi_slopes_"),
    ("alibi_dtype", dict(alibi_slopes_=torch.ones(4, dtype=torch.int64)), TypeError,
     "alibi_slopes_"),
    ("out_shape", dict(out_=torch.zeros(2, 5, 4, 7, dtype=F64)), ValueError, "out_"),
    ("out_dtype", dict(out_=torch.zeros(2, 5, 4, 8)), TypeError, "out_"),
    ("out_type", dict(out_=1), TypeError, "out_"),
]


@pytest.mark.parametrize("name,change,exc,match", FWD_ERRORS, ids=[e[0] for e in FWD_ERRORS])
def test_fwd_errors(name, change, exc, match):
    q, k, v = _dense()
    args = dict(q=q, k=k, v=v, out_=None, alibi_slopes_=None, p_dropout=0.0,
                softmax_scale=0.3, is_causal=False, window_size_left=-1, window_size_right=-1,
                softcap=0.0, return_softmax=False, gen_=None)
    args.update(change)
    with pytest.raises(exc, match=match):
        mha_fwd(*args.values())


def test_bwd_errors():
    q, k, v = _dense()
    out, *_, lse, seed, offset, _ = fwd(q, k, v, p=0.1, gen=gen(0))
    dout = torch.ones_like(out)
    base = dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq_=None, dk_=None,
                dv_=None, alibi_slopes_=None, p_dropout=0.1, softmax_scale=0.3,
                is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                deterministic=False, philox_seed=seed, philox_offset=offset)
    cases = [
        (dict(softmax_lse=lse[:, :, :3]), ValueError, "softmax_lse"),
        (dict(softmax_lse=lse.tolist()), TypeError, "softmax_lse"),
        (dict(dout=dout[:, :3]), ValueError, "dout"),
        (dict(out=out.float()), TypeError, "out"),
        (dict(dq_=torch.zeros(1, dtype=F64)), ValueError, "dq_"),
        (dict(dk_=torch.zeros_like(k).float()), TypeError, "dk_"),
        (dict(philox_seed=torch.tensor(1.5)), ValueError, "philox_seed"),
        (dict(philox_seed="7"), TypeError, "philox_seed"),
        (dict(philox_offset=torch.tensor(-3)), ValueError, "philox_offset"),
        (dict(deterministic=None), TypeError, "deterministic"),
    ]
    for change, exc, match in cases:
        args = dict(base, **change)
        with pytest.raises(exc, match=match):
            mha_bwd(*args.values())


def test_varlen_errors():
    lens = [2, 3]
    q, k, v = varlen_inputs(lens, lens, 2, 2, 8)
    base = dict(q=q, k=k, v=v, out_=None, cu_seqlens_q=cu(lens), cu_seqlens_k=cu(lens),
                seqused_k=None, block_table_=None, alibi_slopes_=None, max_seqlen_q=3,
                max_seqlen_k=3, p_dropout=0.0, softmax_scale=0.3, zero_tensors=False,
                is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                return_softmax=False, gen_=None)
    kc, vc, table, _, _ = paged_cache(lens, 2, 2, 8, gen(0))
    cases = [
        (dict(q=q[None]), ValueError, "q must be 3-D"),
        (dict(cu_seqlens_q=cu(lens).float()), TypeError, "cu_seqlens_q"),
        (dict(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32)), ValueError,
         "cu_seqlens_q must start at 0"),
        (dict(cu_seqlens_k=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError,
         "cu_seqlens_k"),
        (dict(cu_seqlens_k=cu([5])), ValueError, "same batch"),
        (dict(max_seqlen_q=2), ValueError, "max_seqlen_q"),
        (dict(max_seqlen_k=2.0), TypeError, "max_seqlen_k"),
        (dict(seqused_k=torch.tensor([3, 1], dtype=torch.int32)), ValueError, "seqused_k"),
        (dict(seqused_k=torch.tensor([1], dtype=torch.int32)), ValueError, "seqused_k"),
        (dict(zero_tensors=0), TypeError, "zero_tensors"),
        (dict(out_=torch.zeros(5, 2, 7, dtype=F64)), ValueError, "out_"),
        (dict(alibi_slopes_=torch.ones(3, 2)), ValueError, "alibi_slopes_"),
        (dict(k=kc, v=vc), ValueError, "k must be 3-D"),
        (dict(k=kc, v=vc, block_table_=table[:1]), ValueError, "block_table_"),
        (dict(k=kc, v=vc, block_table_=table.float()), TypeError, "block_table_"),
        (dict(k=kc, v=vc, block_table_=table[:, :1]), ValueError, "block_table_ holds"),
        (dict(k=kc, v=vc, block_table_=torch.full_like(table, 99)), ValueError,
         r"block_table\[0, 0\]"),
    ]
    for change, exc, match in cases:
        args = dict(base, **change)
        with pytest.raises(exc, match=match):
            mha_varlen_fwd(*args.values())


def test_varlen_bwd_errors():
    lens = [2, 3]
    q, k, v = varlen_inputs(lens, lens, 2, 2, 8)
    out, *_, lse, _, _, _ = vfwd(q, k, v, cu(lens), cu(lens), 3, 3)
    with pytest.raises(ValueError, match="softmax_lse"):
        vbwd(out, q, k, v, out, lse.t(), cu(lens), cu(lens), 3, 3)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        vbwd(out, q, k, v, out, lse, cu(lens), cu(lens), 3, 1)
    with pytest.raises(ValueError, match="dv_"):
        vbwd(out, q, k, v, out, lse, cu(lens), cu(lens), 3, 3,
             bufs=(None, None, torch.zeros(2, dtype=F64)))


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_softmax_weights_come_from_the_call_itself_on_the_torch_engine(monkeypatch, p):
    # The torch engine hands its weights back from the one forward: no call with v widened by
    # the identity (O(S_k) more value columns, O(S^3) work), no second call without dropout.
    from cudnn_attn.core import execution

    planned = []
    real = execution.plan_call

    def spy(problem, backend="auto"):
        planned.append(problem)
        return real(problem, backend)

    monkeypatch.setattr(execution, "plan_call", spy)
    q, k, v = _dense()
    out, *_, probs = fwd(q, k, v, p=p, gen=gen(0), return_softmax=True)
    assert [(t.dim_v, t.dropout_p) for t in planned] == [(v.shape[-1], p)]
    _, _, ref_p = ref_one(q, k, v)
    pre, keep = fa_decode(probs, ref_p, q.shape[-1], p > 0)
    torch.testing.assert_close(pre, ref_p, **TOL)


def test_dropout_softmax_needs_the_mask_engine(monkeypatch):
    # Dropout with return_softmax needs the engine that makes (and replays) the mask to also run
    # the weights' calls; an engine that cannot is a NotSupportedError, never a different mask.
    # (The torch engine hands its weights back directly: this engine is another one.)
    from cudnn_attn.compat.flash_attn import _core
    from cudnn_attn.core import execution

    weights_calls = []  # the weights' calls (with dropout: the call's own problem, other values)

    class Declines:
        name = "an_engine_without_weights"
        plan = dispatch.get_backend("torch").plan

        def supports(self, problem):
            return ["declines for the test"] if weights_calls else []

    def weights(*args):
        weights_calls.append(True)
        return real_weights(*args)

    real_weights = _core._weights
    monkeypatch.setattr(_core, "_weights", weights)
    monkeypatch.setattr(execution, "dropout_engine", lambda probe, backend="auto": Declines())
    clear_caches()  # calls planned before the engine was swapped keep their plans
    q, k, v = _dense()
    with pytest.raises(NotSupportedError, match="weights with dropout must come from"):
        fwd(q, k, v, p=0.2, gen=gen(0), return_softmax=True)
    weights_calls.clear()
    fwd(q, k, v, p=0.2, gen=gen(0))  # without the weights it runs


# ---------------------------------------------------------------------------------------------
# GPU (marked): the same checks in low precision, with the tolerance policy
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _baseline_err(q, k, v, ref, **kw):
    """Error of a plain PyTorch computation in the inputs' dtype (FlashAttention's rule)."""
    B, Sq, _, _ = q.shape
    Sk = k.shape[1]
    left, right = fa_window(kw.get("causal", False), kw.get("left", -1), kw.get("right", -1), Sk)
    vis = oracle.build_visibility(B, Sq, Sk, window=(left, right, "bottom_right")).to(q.device)
    low = oracle.plain_lowp_attention(q, k, v, vis, layout="bshd", softcap=kw.get("softcap"))
    return (low.double().cpu() - ref).abs().max().item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("opts", [dict(), dict(causal=True), dict(left=16, right=0),
                                  dict(softcap=5.0, causal=True)], ids=str)
def test_gpu_fwd_bwd_tolerance_policy(dtype, opts):
    B, Sq, Sk, H, Hkv, D = 2, 113, 203, 8, 2, 64
    q, k, v = (t.to("cuda", dtype) for t in dense_inputs(B, Sq, Sk, H, Hkv, D, seed=7))
    out, *_, lse, seed, offset, _ = fwd(q, k, v, **opts)
    leaves = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    ref_out, ref_lse, _ = ref_one(*leaves, **opts)
    base = _baseline_err(q, k, v, ref_out.detach(), **opts)
    err = (out.double().cpu() - ref_out.detach()).abs().max().item()
    assert err <= 2 * base + 1e-5, (err, base)
    torch.testing.assert_close(lse.double().cpu(), ref_lse.detach(), atol=1e-3, rtol=1e-3)
    dout = randn(*out.shape, g=gen(1)).to("cuda", dtype)
    dq, dk, dv, _ = bwd(dout, q, k, v, out, lse, seed=seed, offset=offset, **opts)
    exp = torch.autograd.grad(ref_out, leaves, dout.double().cpu())
    low = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    left, right = fa_window(opts.get("causal", False), opts.get("left", -1),
                            opts.get("right", -1), Sk)
    vis = oracle.build_visibility(B, Sq, Sk, window=(left, right, "bottom_right")).to("cuda")
    low_out = oracle.plain_lowp_attention(*low, vis, layout="bshd", softcap=opts.get("softcap"))
    low_grads = torch.autograd.grad(low_out, low, dout)
    for n, got, e, lg in zip("qkv", (dq, dk, dv), exp, low_grads):
        base_g = (lg.double().cpu() - e).abs().max().item()
        err_g = (got.double().cpu() - e).abs().max().item()
        assert err_g <= 3 * base_g + 1e-4, (n, err_g, base_g)


def _dropout_replay(device, dtype):
    """The keep mask decoded from ``S_dmask`` (FlashAttention 2.8.3: ``[B, H, round128(S_q),
    round128(S_k)]``, dropped entries negated) replays the forward and the backward."""
    B, S, H, D, p = 2, 64, 4, 64, 0.25
    q, k, v = (t.to(device, dtype) for t in dense_inputs(B, S, S, H, H, D, seed=3))
    g = torch.Generator(device=device).manual_seed(0)
    out, *_, lse, seed, offset, probs = fwd(q, k, v, p=p, causal=True, gen=g,
                                            return_softmax=True)
    assert probs.shape == (B, H, r128(S), r128(S)) and probs.device == q.device
    leaves = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    _, _, ref_p = ref_one(*(t.detach() for t in leaves), causal=True)
    keep = fa_decode(probs.double().cpu(), ref_p, D, True)[1].double()
    assert 0 < keep[ref_p > 0].mean() < 1
    ref_out = explicit_mask_oracle(*leaves, keep, p, causal=True)
    assert (out.double().cpu() - ref_out.detach()).abs().max().item() < 2e-2
    dout = randn(*out.shape, g=gen(2)).to(device, dtype)
    dq, dk, dv, _ = bwd(dout, q, k, v, out, lse, p=p, causal=True, seed=seed, offset=offset)
    exp = torch.autograd.grad(ref_out, leaves, dout.double().cpu())
    for n, got, e in zip("qkv", (dq, dk, dv), exp):
        assert (got.double().cpu() - e).abs().max().item() < 5e-2 * max(1.0, e.abs().max()), n


def test_dropout_backward_replays_the_mask_decoded_from_s_dmask():
    # issue 23: the GPU test compared the [.., 128, 128] S_dmask with S = 64 rows uncropped
    _dropout_replay("cpu", F64)


@pytest.mark.gpu
@gpu
def test_gpu_dropout_backward_replays_the_mask():
    _dropout_replay("cuda", torch.float16)


def test_expanded_output_buffers_are_refused_clearly():
    # An expanded buffer has one memory slot for many results: a clear error (also a
    # RuntimeError, as FlashAttention's checks raise), not an internal one from copy_.
    q, k, v = dense_inputs(2, 6, 6, 4, 2, 8)
    expanded = torch.zeros(1, 1, 1, 8, dtype=F64).expand(2, 6, 4, 8)
    with pytest.raises(ValueError, match="out_ must not overlap itself") as info:
        fwd(q, k, v, out_=expanded)
    assert isinstance(info.value, RuntimeError)
    out, *_, lse, _, _, _ = fwd(q, k, v)
    strided = torch.zeros(2, 6, 8, 8, dtype=F64)[:, :, ::2]  # a strided view is fine
    assert fwd(q, k, v, out_=strided)[0] is strided
    torch.testing.assert_close(strided, out, **TOL)
    bad_dq = torch.zeros(2, 6, 1, 8, dtype=F64).expand(2, 6, 4, 8)
    with pytest.raises(RuntimeError, match="dq_ must not overlap itself"):
        bwd(torch.ones_like(out), q, k, v, out, lse, bufs=(bad_dq, None, None))
