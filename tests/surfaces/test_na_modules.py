"""``NeighborhoodAttention1D/2D/3D``: a float64 brute-force forward built from the module's own
weights (``na_oracle``), fused == unfused, rpb, attention dropout, weights access, the
``use_fused_na`` switch and the per-module ``use_fused`` override, errors."""

import math

import na_oracle
import pytest
import torch
import torch.nn.functional as F

from cudnn_attn import neighborhood as N

MODULES = {1: N.NeighborhoodAttention1D, 2: N.NeighborhoodAttention2D, 3: N.NeighborhoodAttention3D}


@pytest.fixture(autouse=True)
def _reset_switch():
    N.use_fused_na(False)
    yield
    N.use_fused_na(False)


def brute_force(m, x, weights_mask=None):
    """Float64 module forward from its parameters; also the attention weights ``[B,H,S,S]``."""
    B, spatial, C = x.shape[0], x.shape[1:-1], x.shape[-1]
    H, hd = m.num_heads, C // m.num_heads
    x = x.double()
    qkv = x @ m.qkv.weight.double().T
    if m.qkv.bias is not None:
        qkv = qkv + m.qkv.bias.double()
    q, k, v = qkv.reshape(B, *spatial, 3, H, hd).unbind(-3)
    rpb = m.rpb.detach().double() if m.rpb is not None else None
    S = math.prod(spatial)
    vis = torch.from_numpy(na_oracle.oracle.neighborhood_visibility(
        spatial, m.kernel_size, m.stride, m.dilation, m.is_causal))
    s = m.scale * torch.einsum("bihd,bjhd->bhij", q.reshape(B, S, H, hd), k.reshape(B, S, H, hd))
    if rpb is not None:
        s = s + na_oracle.dense_rpb(rpb, spatial, m.kernel_size, m.stride, m.dilation)
    p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1)
    pd = p if weights_mask is None else p * weights_mask
    out = torch.einsum("bhij,bjhd->bihd", pd, v.reshape(B, S, H, hd)).reshape(B, *spatial, C)
    out = out @ m.proj.weight.double().T + m.proj.bias.double()
    return out, p


CONFIGS = [
    (1, (14,), {"kernel_size": 5, "dilation": 2}),
    (1, (13,), {"kernel_size": 4, "stride": 2, "is_causal": True}),
    (2, (7, 9), {"kernel_size": (3, 5), "dilation": (2, 1), "rel_pos_bias": True}),
    (2, (6, 8), {"kernel_size": (3, 4), "stride": (1, 2), "is_causal": (True, False), "qkv_bias": False}),
    (3, (4, 5, 6), {"kernel_size": 3, "dilation": (1, 1, 2), "rel_pos_bias": True, "qk_scale": 0.3}),
    (3, (4, 4, 5), {"kernel_size": (2, 3, 3), "stride": (2, 1, 3), "is_causal": (False, True, True)}),
]


def _cid(c):
    return f"{c[0]}d-{c[1]}-" + "-".join(f"{k}={v}" for k, v in c[2].items())


def _module(rank, kw, heads=2, dim=16, seed=0, **extra):
    torch.manual_seed(seed)
    m = MODULES[rank](dim, heads, **kw, **extra).double()
    if m.rpb is not None:
        with torch.no_grad():
            m.rpb.normal_()  # larger than the init so the bias matters in the comparison
    return m.eval()


@pytest.mark.parametrize("cfg", CONFIGS, ids=_cid)
def test_module_matches_brute_force_fused_and_unfused(cfg):
    rank, spatial, kw = cfg
    m = _module(rank, kw)
    x = torch.randn(2, *spatial, 16, dtype=torch.float64)
    ref, ref_w = brute_force(m, x)
    m.use_fused = False
    unfused, w = m(x, return_attn_weights=True)
    m.use_fused = True
    fused = m(x)
    torch.testing.assert_close(unfused, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(fused, ref, atol=1e-10, rtol=1e-10)
    # Weights: NATTEN 0.17 layout; slot s of query i is the softmax weight of its slot key.
    table = na_oracle.slot_table(spatial, m.kernel_size, m.stride, m.dilation, m.is_causal)
    K = math.prod(m.kernel_size)
    assert w.shape == (2, 2, *spatial, K)
    w = w.reshape(2, 2, -1, K)
    expected = torch.einsum("bhij,isj->bhis", ref_w, na_oracle.selection(table, ref_w.shape[-1]))
    torch.testing.assert_close(w, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("cfg", [CONFIGS[2], CONFIGS[3]], ids=_cid)
def test_module_gradients_fused_equal_unfused(cfg):
    rank, spatial, kw = cfg
    m = _module(rank, kw)
    x = torch.randn(2, *spatial, 16, dtype=torch.float64, requires_grad=True)
    names, params = zip(*[("x", x), *m.named_parameters()])
    grads = []
    for fused in (False, True):
        m.use_fused = fused
        out = m(x)
        grads.append(torch.autograd.grad((out * torch.cos(out)).sum(), params))
    for name, a, b in zip(names, *grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda msg, n=name: f"{n}: {msg}")
        assert float(a.abs().sum()) > 0, name


def test_rpb_parameter_and_gradient():
    m = N.NeighborhoodAttention2D(32, 4, (3, 5), rel_pos_bias=True)
    assert m.rpb.shape == (4, 5, 9) and m.rpb.requires_grad
    assert 0.005 < float(m.rpb.detach().std()) < 0.05 and float(m.rpb.detach().abs().max()) <= 2.0
    x = torch.randn(1, 6, 7, 32)
    for fused in (False, True):
        m.use_fused = fused
        m.zero_grad()
        m(x).square().sum().backward()
        assert m.rpb.grad is not None and float(m.rpb.grad.abs().sum()) > 0
    assert N.NeighborhoodAttention1D(8, 2, 3).rpb is None


def test_attention_dropout_train_and_eval():
    rank, spatial, kw = CONFIGS[2]
    m = _module(rank, kw, attn_drop=0.5, use_fused=True)
    x = torch.randn(2, *spatial, 16, dtype=torch.float64)
    m.train()
    assert not m.uses_fused()  # dropout needs the weights: unfused path even though forced fused
    torch.manual_seed(123)
    out, w = m(x, return_attn_weights=True)
    torch.manual_seed(123)
    keep = F.dropout(torch.ones_like(w), 0.5, training=True)
    # The brute force takes a dense [B, H, S, S] mask: place the slot mask at the slot keys.
    table = na_oracle.slot_table(spatial, m.kernel_size, m.stride, m.dilation, m.is_causal)
    S = table.shape[0]
    dense_keep = torch.einsum("bhis,isj->bhij", keep.reshape(2, 2, S, -1), na_oracle.selection(table, S))
    ref, _ = brute_force(m, x, dense_keep)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    ref_eval, _ = brute_force(m, x)
    assert (out - ref_eval).abs().max() > 1e-3
    m.eval()
    assert m.uses_fused()
    torch.testing.assert_close(m(x), ref_eval, atol=1e-10, rtol=1e-10)


def test_context_switch_and_override(monkeypatch):
    from cudnn_attn.compat.natten import functional  # the modules' fused path calls functional.na2d

    calls = []
    real = functional.na2d
    monkeypatch.setattr(functional, "na2d", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = N.NeighborhoodAttention2D(8, 2, 3).eval()
    x = torch.randn(1, 5, 5, 8)
    assert not N.is_fna_enabled() and not m.uses_fused()
    m(x)
    assert calls == []
    N.use_fused_na()
    assert N.is_fna_enabled() and N.is_fused_na_enabled() and m.uses_fused()
    m(x)
    assert calls == [1]
    m.use_fused = False                     # per-module override beats the switch
    m(x)
    assert calls == [1]
    _, w = N.NeighborhoodAttention2D(8, 2, 3, use_fused=True).eval()(x, return_attn_weights=True)
    assert calls == [1] and w.shape == (1, 2, 5, 5, 9)   # weights force the unfused path
    N.use_fused_na(False)
    assert N.NeighborhoodAttention2D(8, 2, 3, use_fused=True).uses_fused()
    assert "use_fused=True" in repr(N.NeighborhoodAttention2D(8, 2, 3, use_fused=True))


def test_proj_dropout_only_in_training():
    m = N.NeighborhoodAttention1D(8, 2, 3, proj_drop=0.5)
    x = torch.randn(1, 9, 8)
    m.eval()
    torch.testing.assert_close(m(x), m(x))
    m.train()
    assert (m(x) == 0).any()


ERRORS = [
    ("divisible", lambda: N.NeighborhoodAttention1D(10, 3, 3), ValueError, "divisible"),
    ("kernel", lambda: N.NeighborhoodAttention1D(8, 2, 1), ValueError, "kernel_size"),
    ("stride", lambda: N.NeighborhoodAttention1D(8, 2, 3, stride=4), ValueError, "stride"),
    ("rank", lambda: N.NeighborhoodAttention2D(8, 2, (3, 3, 3)), ValueError, "kernel_size"),
    ("rpb-even", lambda: N.NeighborhoodAttention1D(8, 2, 4, rel_pos_bias=True), ValueError,
     "rel_pos_bias"),
    ("rpb-causal", lambda: N.NeighborhoodAttention1D(8, 2, 3, is_causal=True, rel_pos_bias=True),
     ValueError, "rel_pos_bias"),
    ("drop", lambda: N.NeighborhoodAttention1D(8, 2, 3, attn_drop=1.0), ValueError, "attn_drop"),
    ("use_fused", lambda: N.NeighborhoodAttention1D(8, 2, 3, use_fused="yes"), TypeError, "use_fused"),
    ("switch", lambda: N.use_fused_na("yes"), TypeError, "mode"),
    ("input", lambda: N.NeighborhoodAttention2D(8, 2, 3)(torch.randn(1, 5, 8)), ValueError, "x"),
    ("channels", lambda: N.NeighborhoodAttention1D(8, 2, 3)(torch.randn(1, 5, 6)), ValueError, "x"),
    ("too-small", lambda: N.NeighborhoodAttention1D(8, 2, 5)(torch.randn(1, 4, 8)), ValueError,
     "kernel_size"),
]


@pytest.mark.parametrize("name,call,exc,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()
