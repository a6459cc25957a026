"""Positions past a sequence's length are not tokens: NaN stored there (in q, k, v, the bias or
the incoming gradient) must not change any output or gradient, on every surface that takes
lengths, for every mask kind. Each case poisons those positions with NaN and compares against
the float64 oracle on clean inputs (tests/oracle.py); gradients there must be exactly 0."""

from __future__ import annotations

import itertools
import math

import oracle
import pytest
import torch
from common import lib_mask

import cudnn_attn as ca
import cudnn_fake
from cudnn_attn.core.caches import clear_caches
from cudnn_attn.model import masks
from cudnn_attn.compat.cudnn_frontend import (SdpaAttributes, SdpaBackwardAttributes,
                                               scaled_dot_product_flash_attention,
                                               scaled_dot_product_flash_attention_backward)

B, HQ, SQ, SKV, D = 2, 4, 10, 12, 8
LENS_Q, LENS_KV = (10, 6), (12, 7)
MASKS = {"none": {}, "causal-top-left": {"causal": "top_left"},
         "causal-bottom-right": {"causal": "bottom_right"}, "window": {"window": (2, 1)},
         "window-bottom-right": {"window": (3, 0, "bottom_right")}}
EXTRAS = ("plain", "alibi", "bias", "softcap", "gqa")
TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _valid(lens, seq):
    return torch.arange(seq)[None, :] < torch.tensor(lens)[:, None]


def _poison_rows(x, lens, seq_dim):
    """NaN at every position ``>= lens[b]`` along ``seq_dim`` of a batch-first tensor."""
    hidden = ~_valid(lens, x.shape[seq_dim])
    shape = [1] * x.dim()
    shape[0], shape[seq_dim] = hidden.shape
    return x.masked_fill(hidden.view(shape), math.nan)


def _alibi_offsets(mask_kw):
    align = mask_kw.get("causal") or (mask_kw["window"][2] if "window" in mask_kw
                                      and len(mask_kw["window"]) > 2 else "top_left")
    return oracle.aligned_offsets(B, SQ, SKV, align, LENS_Q, LENS_KV)


def _case(mask_name, extra, dtype, lengths_as_tensor):
    g = torch.Generator().manual_seed(hash((mask_name, extra)) % 2**31)
    hkv = 2 if extra == "gqa" else HQ
    q = torch.randn(B, HQ, SQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, hkv, SKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, hkv, SKV, D, generator=g, dtype=torch.float64)
    bias = torch.randn(B, HQ, SQ, SKV, generator=g, dtype=torch.float64) if extra == "bias" \
        else None
    dout = torch.randn(B, HQ, SQ, D, generator=g, dtype=torch.float64)
    return q, k, v, bias, dout


def _oracle(mask_kw, extra, q, k, v, bias, dout):
    vis = oracle.build_visibility(B, SQ, SKV, seq_lens_q=LENS_Q, seq_lens_kv=LENS_KV, **mask_kw)
    leaves = [t.clone().requires_grad_() for t in (q, k, v) + ((bias,) if bias is not None else ())]
    out, _ = oracle.reference_attention(
        *leaves[:3], vis, bias=leaves[3] if bias is not None else None,
        softcap=2.0 if extra == "softcap" else None,
        alibi_slopes=ca.masks.alibi_slopes(HQ) if extra == "alibi" else None,
        alibi_offsets=_alibi_offsets(mask_kw) if extra == "alibi" else None)
    grads = torch.autograd.grad(out, leaves, dout)
    return out, grads


def _poisoned(q, k, v, bias, dout, dtype):
    """bhsd inputs with NaN past the lengths (the bias at every cell of a hidden row or key)."""
    q, k, v, dout = (t.transpose(1, 2) for t in (q, k, v, dout))  # batch, seq first
    q, dout = _poison_rows(q, LENS_Q, 1), _poison_rows(dout, LENS_Q, 1)
    k, v = _poison_rows(k, LENS_KV, 1), _poison_rows(v, LENS_KV, 1)
    q, k, v, dout = (t.transpose(1, 2).to(dtype) for t in (q, k, v, dout))
    if bias is not None:
        bias = _poison_rows(_poison_rows(bias.transpose(1, 2), LENS_Q, 1).transpose(1, 3),
                            LENS_KV, 1).transpose(1, 3).transpose(1, 2).to(dtype)
    return q, k, v, bias, dout


def _assert_matches(got, want, dtype, what):
    assert torch.isfinite(got).all(), f"{what}: NaN/inf leaked from past the lengths"
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype], msg=what)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mask_name, extra", list(itertools.product(MASKS, EXTRAS)))
def test_attention_ignores_everything_past_padding_lengths(mask_name, extra, dtype):
    tensor_lengths = (list(MASKS).index(mask_name) + EXTRAS.index(extra)) % 2 == 1
    mask_kw = MASKS[mask_name]
    clean = _case(mask_name, extra, dtype, tensor_lengths)
    want_out, want_grads = _oracle(mask_kw, extra, *clean)
    q, k, v, bias, dout = _poisoned(*clean, dtype)
    leaves = [t.requires_grad_() for t in (q, k, v) + ((bias,) if bias is not None else ())]
    lens = (torch.tensor(LENS_Q), torch.tensor(LENS_KV)) if tensor_lengths else (LENS_Q, LENS_KV)
    mask = lib_mask(**{"causal": mask_kw.get("causal"), "window": mask_kw.get("window")})
    mask = ca.Padding(*lens) if mask is None else mask & ca.Padding(*lens)
    out = ca.attention(*leaves[:3], mask=mask, backend="torch",
                       bias=ca.Alibi() if extra == "alibi" else leaves[3] if bias is not None
                       else None, softcap=2.0 if extra == "softcap" else None)
    _assert_matches(out, want_out, dtype, "out")
    grads = torch.autograd.grad(out, leaves, dout)
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
        _assert_matches(got, want, dtype, name)


@pytest.mark.parametrize("backend", ["torch", "cudnn"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_a_forward_without_gradient_ignores_everything_past_padding_lengths(
        mask_name, backend, monkeypatch):
    # Without a gradient to follow, the padded query rows reach the engine as they are (only
    # k, v and the bias are zeroed there): each such row sees no key, so out is 0 and lse -inf
    # there whatever q holds, and no real row reads it. cuDNN runs through the float64
    # stand-in executor, which writes NaN on every row that sees no key.
    dtype, tol = (torch.float64, 1e-10) if backend == "torch" else (torch.float16, 2e-3)
    if backend == "cudnn":
        if not cudnn_fake.frontend_present():
            pytest.skip("nvidia-cudnn-frontend is not installed")
        monkeypatch.setattr(masks, "_runtime_lengths", lambda v: isinstance(v, torch.Tensor))
        cudnn_fake.install(monkeypatch)
    mask_kw = MASKS[mask_name]
    clean = _case(mask_name, "plain", dtype, False)
    vis = oracle.build_visibility(B, SQ, SKV, seq_lens_q=LENS_Q, seq_lens_kv=LENS_KV, **mask_kw)
    q, k, v, _, _ = _poisoned(*clean, dtype)
    want_out, want_lse = oracle.reference_attention(*clean[:3], vis)  # float64, clean inputs
    for lens in ((LENS_Q, LENS_KV), (torch.tensor(LENS_Q), torch.tensor(LENS_KV))):
        base = lib_mask(causal=mask_kw.get("causal"), window=mask_kw.get("window"))
        mask = ca.Padding(*lens) if base is None else base & ca.Padding(*lens)
        out, lse = ca.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
        assert torch.isfinite(out).all(), "NaN/inf leaked from past the lengths"
        torch.testing.assert_close(out.double(), want_out, rtol=tol, atol=tol)
        hidden = ~_valid(LENS_Q, SQ)[:, None, :].expand_as(lse)
        assert torch.isneginf(lse[hidden]).all()
        torch.testing.assert_close(lse[~hidden].double(), want_lse[~hidden], rtol=tol, atol=tol)
    clear_caches()


@pytest.mark.parametrize("rows", [1, SQ], ids=["one-row", "rows"])
@pytest.mark.parametrize("tensor_lengths", [False, True], ids=["host-lengths", "device-lengths"])
def test_a_one_row_cudnn_forward_without_gradient_binds_the_callers_keys(
        tensor_lengths, rows, monkeypatch):
    """cuDNN's one-row (decode) kernel keeps what lies past the key lengths out of a forward
    (an H200 with NaN stored there, cuDNN 9.19: benchmarks/results/cudnn-2026-11-29.json), so
    such a call that no gradient follows binds the caller's K and V as they are: no cache-sized
    copies per decode step. Its graphs of more rows multiply the V rows there by P = 0 (the same
    run), so those calls, and every call a gradient follows, still bind zeroed copies (whose
    gradients past the lengths are exactly 0). Every call, the first (full path) and the later
    ones (the direct runner), against the float64 oracle on clean inputs."""
    if not cudnn_fake.frontend_present():
        pytest.skip("nvidia-cudnn-frontend is not installed")
    monkeypatch.setattr(masks, "_runtime_lengths", lambda v: isinstance(v, torch.Tensor))
    cudnn_fake.install(monkeypatch)
    bound = []
    execute = cudnn_fake.FakeGraph.execute

    def spy(graph, buffers, workspace, handle):
        bound.append({role: buffers[graph.uid(role)].data_ptr() for role in ("K", "V")
                      if not graph.backward})
        return execute(graph, buffers, workspace, handle)

    monkeypatch.setattr(cudnn_fake.FakeGraph, "execute", spy)
    clean = _case("causal-bottom-right", "plain", torch.float16, tensor_lengths)
    clean = (clean[0][:, :, -rows:], *clean[1:])  # the last rows: bottom-right, as decode sits
    lens_q = tuple(min(n, rows) for n in LENS_Q)
    vis = oracle.build_visibility(B, rows, SKV, seq_lens_q=lens_q, seq_lens_kv=LENS_KV,
                                  causal="bottom_right")
    want_out = oracle.reference_attention(*clean[:3], vis)[0]
    q, k, v = (_poison_rows(t.transpose(1, 2), lens, 1).transpose(1, 2).to(torch.float16)
               for t, lens in ((clean[0], lens_q), (clean[1], LENS_KV), (clean[2], LENS_KV)))
    lens = (torch.tensor(lens_q), torch.tensor(LENS_KV)) if tensor_lengths else (lens_q, LENS_KV)
    mask = ca.Causal("bottom_right") & ca.Padding(*lens)
    for _ in range(3):
        bound.clear()
        out = ca.attention(q, k, v, mask=mask, backend="cudnn")
        unzeroed = bound == [{"K": k.data_ptr(), "V": v.data_ptr()}]
        assert unzeroed == (rows == 1), bound
        assert torch.isfinite(out).all(), "NaN leaked from past the lengths"
        torch.testing.assert_close(out.double(), want_out, rtol=2e-3, atol=2e-3)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    for _ in range(2):
        bound.clear()
        out = ca.attention(*leaves, mask=mask, backend="cudnn")
        assert bound and bound[0]["K"] != leaves[1].data_ptr(), "K bound unhidden for a gradient"
        torch.testing.assert_close(out.double(), want_out, rtol=2e-3, atol=2e-3)
        dk, dv = torch.autograd.grad(out, leaves[1:], torch.ones_like(out))
        past = ~_valid(LENS_KV, SKV)[:, None, :, None].expand_as(dk)
        assert (dk[past] == 0).all() and (dv[past] == 0).all()
    clear_caches()


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_layouts_and_empty_sequences(layout):
    lens_q, lens_kv = (0, 3), (5, 0)
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=torch.float64) for _ in range(3))
    poisoned = [_poison_rows(t.transpose(1, 2), lens, 1) for t, lens in
                ((q, lens_q), (k, lens_kv), (v, lens_kv))]
    if layout == "bhsd":
        poisoned = [t.transpose(1, 2) for t in poisoned]
    poisoned = [t.requires_grad_() for t in poisoned]
    out, lse = ca.attention(*poisoned, mask=ca.Padding(lens_q, lens_kv), layout=layout,
                            return_lse=True, backend="torch")
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    grads = torch.autograd.grad(out.sum(), poisoned)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_slots_past_cache_seqlens(paged):
    lens = (5, 9)
    q = torch.randn(2, 3, 2, 8, dtype=torch.float64)  # bshd
    k, v = (torch.randn(2, 12, 2, 8, dtype=torch.float64) for _ in range(2))
    vis = oracle.build_visibility(2, 3, 12, causal="bottom_right", seq_lens_q=(3, 3),
                                  seq_lens_kv=lens)
    want, _ = oracle.reference_attention(q, k, v, vis, layout="bshd")
    k_bad, v_bad = (_poison_rows(t, lens, 1) for t in (k, v))
    args = (k_bad, v_bad)
    kw = {}
    if paged:
        pages = torch.randperm(6)
        args = tuple(t.reshape(2 * 3, 4, 2, 8)[torch.argsort(pages)] for t in args)
        kw["block_table"] = pages.view(2, 3).to(torch.int32)
    out = ca.attention_with_kvcache(q, *args, torch.tensor(lens), mask=ca.Causal("bottom_right"),
                                    backend="torch", **kw)
    _assert_matches(out, want, torch.float64, "out")


def test_builder_seq_len_forward_and_backward():
    lens_q, lens_kv = torch.tensor(LENS_Q), torch.tensor(LENS_KV)
    q, k, v, _, dout = _case("none", "plain", torch.float64, False)
    want_out, want_grads = _oracle({"causal": "top_left"}, "plain", q, k, v, None, dout)
    qb, kb, vb, _, doutb = _poisoned(q, k, v, None, dout, torch.float64)
    attrs = SdpaAttributes().set_attn_scale(D ** -0.5).set_causal_mask(True) \
        .set_padding_mask(lens_q, lens_kv).set_generate_stats(True)
    o, stats = scaled_dot_product_flash_attention(qb, kb, vb, attrs)
    _assert_matches(o, want_out, torch.float64, "o")
    o_bad = _poison_rows(o.transpose(1, 2), LENS_Q, 1).transpose(1, 2)
    back = SdpaBackwardAttributes().set_attn_scale(D ** -0.5).set_causal_mask(True) \
        .set_padding_mask(lens_q, lens_kv)
    grads = scaled_dot_product_flash_attention_backward(qb, kb, vb, o_bad, doutb, stats, back)
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
        _assert_matches(got, want, torch.float64, name)


def test_flash_attn_seqused_k():
    from cudnn_attn.flash_api import mha_varlen_fwd

    lens = (4, 7)
    q = torch.randn(2, 5, 2, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 9, 2, 8, dtype=torch.float64) for _ in range(2))
    vis = oracle.build_visibility(2, 5, 9, seq_lens_q=(5, 5), seq_lens_kv=lens)
    want, _ = oracle.reference_attention(q, k, v, vis, layout="bshd")
    k_bad, v_bad = (_poison_rows(t, lens, 1) for t in (k, v))
    cu_q = torch.tensor([0, 5, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 18], dtype=torch.int32)
    out = mha_varlen_fwd(q.reshape(10, 2, 8), k_bad.reshape(18, 2, 8), v_bad.reshape(18, 2, 8),
                         None, cu_q, cu_k, torch.tensor(lens, dtype=torch.int32), None, None, 5, 9,
                         0.0, 8 ** -0.5, False, False, -1, -1, 0.0, False, None)[0]
    _assert_matches(out.view(2, 5, 2, 8), want, torch.float64, "out")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cudnn", "torch"])
def test_gpu_engines_ignore_everything_past_padding_lengths(backend):
    clean = [t.cuda() if t is not None else None for t in _case("causal", "plain", None, False)]
    want_out, want_grads = _oracle({"causal": "bottom_right"}, "plain",
                                   *[t.cpu() if t is not None else None for t in clean])
    q, k, v, _, dout = _poisoned(*[t.cpu() if t is not None else None for t in clean],
                                 torch.bfloat16)
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    out = ca.attention(*leaves, mask=ca.Causal("bottom_right") & ca.Padding(
        torch.tensor(LENS_Q, device="cuda"), torch.tensor(LENS_KV, device="cuda")),
        backend=backend)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double().cpu(), want_out, atol=3e-2, rtol=3e-2)
    grads = torch.autograd.grad(out, leaves, dout.cuda())
    for got, want in zip(grads, want_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double().cpu(), want, atol=6e-2, rtol=6e-2)
