"""Attention sinks and keys/values with different head counts, against a float64 brute force.

The oracle here appends the sink as one more score column (its value is zero) and reads key and
value heads each with its own ratio, straight from the contract; masks come from tests/oracle.py.
"""

import math

import pytest
import torch

import cudnn_attn as ca
import oracle

F64 = torch.float64


def brute_force(q, k, v, visible, sinks=None, scale=None):
    """(out, lse) in bhsd, float64: softmax over [scores, sink] with query head h reading key head
    h // (H_q / H_k) and value head h // (H_q / H_v)."""
    q, k, v = (t.to(F64) for t in (q, k, v))
    B, Hq, Sq, D = q.shape
    k = k.repeat_interleave(Hq // k.shape[1], 1)
    v = v.repeat_interleave(Hq // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * (D ** -0.5 if scale is None else scale)
    s = s.masked_fill(~visible[:, None], -math.inf)
    if sinks is not None:
        column = sinks.to(F64).view(1, Hq, 1, 1).expand(B, Hq, Sq, 1)
        s = torch.cat([s, column], -1)
    lse = s.logsumexp(-1)
    p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse)[..., None])
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse


MASKS = {
    "none": (None, {}),
    "causal_br": (ca.Causal("bottom_right"), dict(causal="bottom_right")),
    "window": (ca.SlidingWindow(2, 1), dict(window=(2, 1))),
    # Batch 1 has no queries and no keys: its rows see nothing.
    "padding": (ca.Padding([5, 0], [7, 0]) & ca.Causal(), dict(causal="top_left",
                                                                seq_lens_q=[5, 0],
                                                                seq_lens_kv=[7, 0])),
}


def _inputs(B=2, Hq=4, Hk=2, Hv=1, Sq=6, Skv=8, D=8, Dv=8, dtype=F64, layout="bhsd", seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, Hq, Sq, D), (B, Hk, Skv, D), (B, Hv, Skv, Dv)]
    tensors = [torch.randn(s, generator=g, dtype=F64).to(dtype) for s in shapes]
    if layout == "bshd":
        tensors = [t.transpose(1, 2).contiguous() for t in tensors]
    sinks = torch.randn(Hq, generator=g, dtype=torch.float32) * 2
    return (*tensors, sinks)


def _bhsd(t, layout):
    return t if layout == "bhsd" else t.transpose(1, 2)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("heads", [(4, 4, 4), (4, 2, 2), (4, 2, 1), (6, 3, 2)])
def test_sinks_and_head_counts_forward_backward(layout, mask_name, heads):
    Hq, Hk, Hv = heads
    mask, described = MASKS[mask_name]
    q, k, v, sinks = _inputs(Hq=Hq, Hk=Hk, Hv=Hv, layout=layout, Dv=12)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks = sinks.to(F64).requires_grad_()
    out, lse = ca.attention(q, k, v, mask=mask, layout=layout, sinks=sinks, return_lse=True)
    visible = oracle.build_visibility(2, 6, 8, **described)
    ref_out, ref_lse = brute_force(*(_bhsd(t, layout) for t in (q, k, v)), visible, sinks)
    torch.testing.assert_close(_bhsd(out, layout), ref_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-10)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    dlse = torch.randn(lse.shape, generator=g, dtype=F64)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ref_out * _bhsd(dout, layout)).sum() + (ref_lse * dlse).sum(),
                               (q, k, v, sinks))
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def test_rows_that_see_nothing_give_zero_and_the_sink_as_lse():
    q, k, v, sinks = _inputs()
    out, lse = ca.attention(q, k, v, mask=ca.Padding([6, 3], [8, 0]), sinks=sinks,
                            return_lse=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(lse[1], sinks.to(F64)[:, None].expand(4, 6))


def test_minus_infinite_sinks_are_no_sinks_and_never_nan():
    q, k, v, _ = _inputs(Hk=4, Hv=4)
    mask = ca.Padding([6, 3], [8, 0])  # batch 1: rows that see nothing
    none = torch.full((4,), -math.inf, requires_grad=True)
    out, lse = ca.attention(q, k, v, mask=mask, sinks=none, return_lse=True)
    plain, plain_lse = ca.attention(q, k, v, mask=mask, return_lse=True)
    torch.testing.assert_close(out, plain)
    torch.testing.assert_close(lse, plain_lse)
    (grad,) = torch.autograd.grad(out.sum() + lse.nan_to_num(0, 0, 0).sum(), none)
    assert torch.equal(grad, torch.zeros(4))


def test_half_precision_sinks_against_the_oracle():
    q, k, v, sinks = _inputs(dtype=torch.bfloat16, Hk=2, Hv=2)
    out, lse = ca.attention(q, k, v, mask=ca.Causal(), sinks=sinks, return_lse=True)
    ref_out, ref_lse = brute_force(q, k, v, oracle.build_visibility(2, 6, 8, causal="top_left"),
                                   sinks)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.to(F64), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.to(F64), ref_lse, atol=1e-5, rtol=1e-5)


def test_cudnn_shaped_sinks_are_accepted():
    q, k, v, sinks = _inputs()
    flat = ca.attention(q, k, v, sinks=sinks)
    torch.testing.assert_close(ca.attention(q, k, v, sinks=sinks.view(1, 4, 1, 1)), flat)


@pytest.mark.parametrize("sinks, error, match", [
    (torch.zeros(3), ValueError, r"sinks must have one logit per query head.*\[4\].*\(3,\)"),
    (torch.zeros(1, 4, 2, 1), ValueError, "sinks must have one logit"),
    (torch.zeros(4, dtype=torch.int32), TypeError, "sinks must be float"),
    ([0.0] * 4, TypeError, "sinks must be a torch.Tensor"),
    (torch.zeros(4, device="meta"), ValueError, "sinks must be on q's device"),
])
def test_bad_sinks_raise_naming_them(sinks, error, match):
    q, k, v, _ = _inputs()
    with pytest.raises(error, match=match):
        ca.attention(q, k, v, sinks=sinks)
    with pytest.raises(error, match=match):
        ca.explain(q, k, v, sinks=sinks)


def test_head_counts_that_do_not_divide_the_query_heads_raise():
    q, k, v, _ = _inputs(Hq=4, Hk=2, Hv=3)
    with pytest.raises(ValueError, match=r"H_q=4, H_k=2, H_v=3"):
        ca.attention(q, k, v)


def test_explain_takes_sinks_and_different_head_counts():
    q, k, v, sinks = _inputs(Hq=6, Hk=3, Hv=2)
    verdicts = ca.explain(q, k, v, sinks=sinks)
    assert verdicts.selected == "torch"
    assert verdicts.problem.heads_kv == 6  # lcm(3, 2) repeated heads


def test_sinks_and_head_counts_compile_without_graph_breaks():
    q, k, v, sinks = _inputs(Hq=4, Hk=2, Hv=1, dtype=torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sinks.requires_grad_()

    def fn(q, k, v, sinks):
        return ca.attention(q, k, v, mask=ca.Causal(), sinks=sinks)

    explanation = torch._dynamo.explain(fn)(q, k, v, sinks)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, sinks)
    want = fn(q, k, v, sinks)
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got.sum(), (q, k, v, sinks))
    expected = torch.autograd.grad(want.sum(), (q, k, v, sinks))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_sink_gradient_from_the_saved_forward_matches_autograd(layout):
    # What a surface with its own backward (cuDNN's dSink_token) computes from out, lse, dout.
    from cudnn_attn.rewrites.sinks import sink_gradient

    q, k, v, sinks = _inputs(Hk=4, Hv=4, layout=layout)
    sinks = sinks.requires_grad_()
    mask = ca.Padding([6, 2], [8, 0])
    out, lse = ca.attention(q, k, v, mask=mask, layout=layout, sinks=sinks, return_lse=True)
    g = torch.Generator().manual_seed(3)
    dout, dlse = torch.randn(out.shape, generator=g, dtype=F64), torch.randn(lse.shape, generator=g,
                                                                             dtype=F64)
    (want,) = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), sinks)
    got = sink_gradient(out.detach(), lse.detach(), dout, sinks.detach(), layout, dlse)
    assert got.dtype == sinks.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# The cuDNN attribute builder: sink_token / dSink_token and H_k != H_v, as cuDNN's semantics
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [(4, 4, 4), (4, 2, 1), (6, 3, 2)])
def test_builder_sink_token_and_head_counts_against_the_oracle(heads):
    Hq, Hk, Hv = heads
    q, k, v, sinks = _inputs(Hq=Hq, Hk=Hk, Hv=Hv)
    sinks = sinks.view(1, Hq, 1, 1)
    fwd = ca.SdpaAttributes().set_causal_mask(True).set_attn_scale(0.35).set_sink_token(sinks)
    o, stats = ca.scaled_dot_product_flash_attention(q, k, v, fwd)
    visible = oracle.build_visibility(2, 6, 8, causal="top_left")
    qr, kr, vr, sr = (t.clone().requires_grad_() for t in (q, k, v, sinks.to(F64)))
    ref_o, ref_lse = brute_force(qr, kr, vr, visible, sr.view(Hq), scale=0.35)
    torch.testing.assert_close(o, ref_o, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(stats[..., 0], ref_lse, atol=1e-12, rtol=1e-10)
    d_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    dsink = torch.zeros(1, Hq, 1, 1, dtype=torch.float32)
    bwd = (ca.SdpaBackwardAttributes().set_causal_mask(True).set_attn_scale(0.35)
           .set_sink_token(sinks).set_dSink_token(dsink))
    dq, dk, dv = ca.scaled_dot_product_flash_attention_backward(q, k, v, o, d_o, stats, bwd)
    want = torch.autograd.grad((ref_o * d_o).sum(), (qr, kr, vr, sr))
    for name, got, exp in zip(("dq", "dk", "dv", "dSink"), (dq, dk, dv, dsink), want):
        assert got.shape == exp.shape, name
        torch.testing.assert_close(got.to(F64), exp, atol=1e-5 if name == "dSink" else 1e-11,
                                   rtol=1e-5 if name == "dSink" else 1e-9)


def test_builder_dsink_needs_the_sink_token():
    q, k, v, _ = _inputs(Hk=4, Hv=4)
    o, stats = ca.scaled_dot_product_flash_attention(q, k, v, ca.SdpaAttributes())
    bwd = ca.SdpaBackwardAttributes().set_dSink_token(torch.zeros(1, 4, 1, 1))
    with pytest.raises(ValueError, match="set_sink_token"):
        ca.scaled_dot_product_flash_attention_backward(q, k, v, o, o, stats, bwd)
    with pytest.raises(TypeError, match="set_sink_token: sink_token must be float"):
        ca.SdpaAttributes().set_sink_token(torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_decode_with_sinks_against_the_oracle(paged):
    # gpt-oss style decoding: one new query per sequence against its cache, plus sinks.
    g = torch.Generator().manual_seed(8)
    B, H, Hkv, D, S_max = 2, 4, 2, 8, 12
    q = torch.randn(B, 1, H, D, generator=g, dtype=F64)
    k_cache, v_cache = (torch.randn(B, S_max, Hkv, D, generator=g, dtype=F64) for _ in range(2))
    sinks = torch.randn(H, generator=g, dtype=F64, requires_grad=True)
    lens = [7, 12]
    kwargs = dict(mask=ca.Causal("bottom_right"), sinks=sinks, return_lse=True)
    if paged:  # pages of 4 rows, shuffled
        pages = torch.randperm(6, generator=g)
        table = pages.view(B, 3)
        k_pages = torch.empty(6, 4, Hkv, D, dtype=F64)
        v_pages = torch.empty(6, 4, Hkv, D, dtype=F64)
        k_pages[table.reshape(-1)] = k_cache.reshape(6, 4, Hkv, D)
        v_pages[table.reshape(-1)] = v_cache.reshape(6, 4, Hkv, D)
        out, lse = ca.attention_with_kvcache(q, k_pages, v_pages, lens, block_table=table,
                                             **kwargs)
    else:
        out, lse = ca.attention_with_kvcache(q, k_cache, v_cache, lens, **kwargs)
    for b, n in enumerate(lens):
        visible = torch.ones(1, 1, n, dtype=torch.bool)
        ref_out, ref_lse = brute_force(q[b:b + 1].transpose(1, 2),
                                       k_cache[b:b + 1, :n].transpose(1, 2),
                                       v_cache[b:b + 1, :n].transpose(1, 2), visible, sinks)
        torch.testing.assert_close(out[b:b + 1].transpose(1, 2), ref_out)
        torch.testing.assert_close(lse[b:b + 1], ref_lse)
    (grad,) = torch.autograd.grad(out.sum(), sinks)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
