"""cudnn_attn.nn.MultiheadAttention against a float64 brute force that uses the module's own weights.

The brute force is plain PyTorch: projections with the module's weight matrices, attention by
oracle.reference_attention with the visibility built by oracle.build_visibility (never by the
library), output projection.
"""

from __future__ import annotations

import oracle
import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.nn import MultiheadAttention

F64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)


def _randn(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64)


def _module(*args, seed=0, **kwargs):
    torch.manual_seed(seed)
    m = MultiheadAttention(*args, dtype=F64, **kwargs).eval()
    with torch.no_grad():  # non-zero biases, so a missing bias term shows
        for p in m.parameters():
            if p.dim() == 1:
                p.normal_()
    return m


def _linear(x, lin):
    y = x @ lin.weight.T
    return y if lin.bias is None else y + lin.bias


def brute_force(m, x, context=None, value=None, *, visible=None, bias=None, alibi=None,
                alibi_offsets=None):
    """Plain float64 computation of module ``m`` on ``[B, S, E]`` inputs; returns (out, lse)."""
    B, S, _ = x.shape
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    if m.cross_attention:
        q = _linear(x, m.q_proj)
        w_k, w_v = m.kv_proj.weight[:Hkv * D], m.kv_proj.weight[Hkv * D:]
        b_k = b_v = None
        if m.kv_proj.bias is not None:
            b_k, b_v = m.kv_proj.bias[:Hkv * D], m.kv_proj.bias[Hkv * D:]
        value = context if value is None else value
        k = context @ w_k.T + (0 if b_k is None else b_k)
        v = value @ w_v.T + (0 if b_v is None else b_v)
    else:
        qkv = _linear(x, m.qkv_proj)
        q, k, v = qkv[..., :H * D], qkv[..., H * D:(H + Hkv) * D], qkv[..., (H + Hkv) * D:]
    S_kv = k.shape[1]
    q, k, v = q.reshape(B, S, H, D), k.reshape(B, S_kv, Hkv, D), v.reshape(B, S_kv, Hkv, D)
    out, lse = oracle.reference_attention(q, k, v, visible, layout="bshd", scale=m.scale,
                                          softcap=m.softcap, bias=bias, alibi_slopes=alibi,
                                          alibi_offsets=alibi_offsets)
    return _linear(out.reshape(B, S, H * D), m.out_proj), lse


SELF_CASES = {
    "plain": dict(),
    "causal": dict(mask=ca.Causal(), vis=dict(causal="top_left")),
    "window": dict(mask=ca.SlidingWindow(3, 1), vis=dict(window=(3, 1))),
    "causal_call_padding": dict(mask=ca.Causal(), call_mask=ca.Padding([12, 5], [12, 5]),
                                vis=dict(causal="top_left", seq_lens_q=[12, 5],
                                         seq_lens_kv=[12, 5])),
    "neighborhood": dict(mask=ca.Neighborhood((3, 4), (2, 3)),
                         vis=dict(neighborhood=dict(spatial_shape=(3, 4), kernel_size=(2, 3)))),
    "alibi_causal": dict(mask=ca.Causal(), alibi=True, vis=dict(causal="top_left")),
    "softcap_noscale": dict(softcap=2.0, scale=0.3),
    "no_bias": dict(bias=False),
}


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("case", list(SELF_CASES))
def test_self_attention_matches_brute_force(case, heads):
    spec = dict(SELF_CASES[case])
    vis_args, call_mask = spec.pop("vis", None), spec.pop("call_mask", None)
    m = _module(32, heads[0], num_kv_heads=heads[1], **spec)
    x = _randn(2, 12, 32, seed=1)
    out, lse = m(x, mask=call_mask, return_lse=True)
    visible = oracle.build_visibility(2, 12, 12, **vis_args) if vis_args else None
    alibi = oracle.default_alibi_slopes(heads[0]) if spec.get("alibi") else None
    ref_out, ref_lse = brute_force(m, x, visible=visible, alibi=alibi)
    assert out.shape == (2, 12, 32) and lse.shape == (2, heads[0], 12)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    torch.testing.assert_close(m(x, x, x, mask=call_mask), out, **TOL)  # torch's calling form


def test_sequence_first_and_tensor_bias():
    m = _module(24, 3, batch_first=False, mask=ca.Causal())
    x = _randn(9, 2, 24, seed=2)  # [S, B, E]
    bias = _randn(2, 3, 9, 9, seed=3)
    out = m(x, attn_bias=bias)
    ref, _ = brute_force(m, x.transpose(0, 1), visible=oracle.build_visibility(
        2, 9, 9, causal="top_left"), bias=bias)
    assert out.shape == (9, 2, 24)
    torch.testing.assert_close(out, ref.transpose(0, 1), **TOL)


@pytest.mark.parametrize("separate_value", [False, True])
def test_cross_attention(separate_value):
    m = _module(32, 4, num_kv_heads=2, cross_attention=True, kdim=20,
                mask=ca.Causal("bottom_right"), alibi=ca.Alibi([0.5, 0.25, 0.125, 0.0625]))
    assert not hasattr(m, "qkv_proj") and m.kv_proj.weight.shape == (2 * 2 * 8, 20)
    x, ctx = _randn(3, 5, 32, seed=4), _randn(3, 11, 20, seed=5)
    value = _randn(3, 11, 20, seed=6) if separate_value else None
    out, lse = m(x, ctx, value, return_lse=True)
    visible = oracle.build_visibility(3, 5, 11, causal="bottom_right")
    ref_out, ref_lse = brute_force(m, x, ctx, value, visible=visible,
                                   alibi=[0.5, 0.25, 0.125, 0.0625], alibi_offsets=[6] * 3)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)


def test_from_torch_matches_torch_module():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(32, 4, batch_first=True, dtype=F64).eval()
    with torch.no_grad():
        ref.in_proj_bias.normal_()
        ref.out_proj.bias.normal_()
    m = MultiheadAttention.from_torch(ref, mask=ca.Causal())
    x = _randn(2, 10, 32, seed=7)
    causal = torch.triu(torch.ones(10, 10, dtype=torch.bool), 1)
    expected = ref(x, x, x, attn_mask=causal, need_weights=False)[0]
    torch.testing.assert_close(m(x), expected, **TOL)
    with pytest.raises(TypeError, match="module"):
        MultiheadAttention.from_torch(torch.nn.Linear(2, 2))


def test_dropout_only_in_training():
    m = _module(32, 4, dropout=0.5, out_dropout=0.25, mask=ca.Causal())
    plain = _module(32, 4, mask=ca.Causal())  # same seed -> same weights
    x = _randn(2, 12, 32, seed=8)
    m.eval()
    torch.testing.assert_close(m(x), plain(x), **TOL)
    torch.testing.assert_close(m(x), m(x), **TOL)
    m.train()
    torch.manual_seed(1)  # out_dropout uses the global generator
    a = m(x, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(1)
    b = m(x, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, b, **TOL)  # reproducible
    assert not torch.allclose(a, plain(x))
    assert (a == 0).float().mean() > 0.1  # output dropout zeroes about a quarter of the entries


def test_gradients_match_brute_force():
    m = _module(24, 4, num_kv_heads=2, mask=ca.SlidingWindow(2, 0), alibi=True)
    x = _randn(2, 7, 24, seed=9).requires_grad_()
    out = m(x)
    grad = _randn(*out.shape, seed=10)
    got = torch.autograd.grad(out, [x, *m.parameters()], grad)
    visible = oracle.build_visibility(2, 7, 7, window=(2, 0))
    ref, _ = brute_force(m, x, visible=visible, alibi=oracle.default_alibi_slopes(4))
    expected = torch.autograd.grad(ref, [x, *m.parameters()], grad)
    for name, g, e in zip(["x"] + [n for n, _ in m.named_parameters()], got, expected):
        assert torch.isfinite(g).all() and g.abs().sum() > 0, name
        torch.testing.assert_close(g, e, **TOL, msg=name)


def test_float32_module_trains_a_step():
    m = MultiheadAttention(16, 2, mask=ca.Causal(), dropout=0.1).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(2, 6, 16)
    loss = m(x).pow(2).mean()
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
    opt.step()


def test_backend_passthrough():
    m = _module(16, 2, backend="torch")
    x = _randn(1, 4, 16, seed=11)
    torch.testing.assert_close(m(x), brute_force(m, x)[0], **TOL)
    if not torch.cuda.is_available():
        with pytest.raises(ca.NotSupportedError):
            _module(16, 2, backend="cudnn")(x)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(embed_dim=30, num_heads=4), ValueError, "divisible"),
    (dict(embed_dim=32, num_heads=0), ValueError, "num_heads"),
    (dict(embed_dim=32.0, num_heads=4), TypeError, "embed_dim"),
    (dict(embed_dim=32, num_heads=4, num_kv_heads=3), ValueError, "num_kv_heads"),
    (dict(embed_dim=32, num_heads=4, dropout=1.0), ValueError, "dropout"),
    (dict(embed_dim=32, num_heads=4, out_dropout=-0.1), ValueError, "out_dropout"),
    (dict(embed_dim=32, num_heads=4, mask="causal"), TypeError, "mask"),
    (dict(embed_dim=32, num_heads=4, alibi="yes"), TypeError, "alibi"),
    (dict(embed_dim=32, num_heads=4, alibi=ca.Alibi([0.5, 0.25])), ValueError, "slopes"),
    (dict(embed_dim=32, num_heads=4, kdim=8), ValueError, "cross_attention"),
    (dict(embed_dim=32, num_heads=4, backend="flash"), ValueError, "backend"),
    (dict(embed_dim=32, num_heads=4, scale=float("nan")), ValueError, "scale"),
    (dict(embed_dim=32, num_heads=4, softcap=-1.0), ValueError, "softcap"),
])
def test_bad_construction(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MultiheadAttention(**kwargs)


def test_bad_calls():
    m = _module(16, 2)
    x = _randn(2, 5, 16, seed=12)
    with pytest.raises(ValueError, match="cross_attention=True"):
        m(x, _randn(2, 5, 16, seed=13))
    with pytest.raises(ValueError, match="query"):
        m(x[0])
    with pytest.raises(TypeError, match="query"):
        m(x.numpy())
    with pytest.raises(TypeError, match="mask"):
        m(x, mask="causal")
    with pytest.raises(ValueError, match="Neighborhood|spatial|S_q"):
        m(x, mask=ca.Neighborhood((2, 2), 2))  # 4 tokens != 5
    a = _module(16, 2, alibi=True)
    with pytest.raises(ValueError, match="alibi"):
        a(x, attn_bias=torch.zeros(1, dtype=F64))
    c = _module(16, 2, cross_attention=True, kdim=8)
    with pytest.raises(ValueError, match="key"):
        c(x)
    with pytest.raises(ValueError, match="key"):
        c(x, _randn(2, 5, 16, seed=14))  # wrong kdim
    with pytest.raises(ValueError, match="batch"):
        c(x, _randn(3, 5, 8, seed=15))
    with pytest.raises(ValueError, match="same batch and length"):
        c(x, _randn(2, 5, 8, seed=16), _randn(2, 4, 8, seed=17))
