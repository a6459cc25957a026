"""Numbers a hostile caller picks: every sign and size of ``scale`` with every mask kind, NaN and
+inf bias entries where the mask hides them, and scalars outside float32's range.

Oracle: ``oracle.reference_attention`` in float64 (scores scaled, biased, then *hidden*: a hidden
pair is -inf whatever its bias). CPU here: the torch engine and every surface that reaches it
(``attention``, FlashAttention's and NATTEN's APIs, autocast); the CuPy kernels' and the cuDNN
plan's handling of the same scales run in ``test_fused_kernels_host.py`` and
``test_cudnn_graphs.py`` (host emulation and the cuDNN stand-in).
"""

from __future__ import annotations

import math

import oracle
import pytest
import torch

import cudnn_attn as ca
from cudnn_attn import natten as N
from cudnn_attn.flash_attn_interface import flash_attn_func

S = 8
SCALES = (-3.0, -0.5, -1e-3, 0.0, 1e-3, 0.5, 4.0)
# name -> (mask, build_visibility keywords, S_q, S_kv)
MASKS = {
    "none": (None, {}, S, S),
    "causal": (ca.Causal(), {"causal": "top_left"}, S, S),
    "causal-bottom-right": (ca.Causal("bottom_right"), {"causal": "bottom_right"}, 5, S),
    "window": (ca.SlidingWindow(2, 1), {"window": (2, 1)}, S, S),
    "neighborhood": (ca.Neighborhood((S,), 3), {"neighborhood": {"spatial_shape": (S,),
                                                                 "kernel_size": 3}}, S, S),
    "neighborhood-causal": (ca.Neighborhood((S,), 3, is_causal=True),
                            {"neighborhood": {"spatial_shape": (S,), "kernel_size": 3,
                                              "is_causal": True}}, S, S),
    "padding": (ca.Padding([S, 5], [S, 3]), {"seq_lens_q": [S, 5], "seq_lens_kv": [S, 3]}, S, S),
    "causal-and-padding": (ca.Causal() & ca.Padding([S, 6], [S, 4]),
                           {"causal": "top_left", "seq_lens_q": [S, 6], "seq_lens_kv": [S, 4]},
                           S, S),
}


def _inputs(sq, skv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, n, 16, generator=g, dtype=torch.float64).to(dtype)
            for n in (sq, skv, skv)]


def _reference(q, k, v, visible, scale, bias=None, layout="bhsd"):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    if bias is not None:
        leaves.append(bias.detach().double().requires_grad_())
    out, lse = oracle.reference_attention(*leaves[:3], visible, scale=scale, layout=layout,
                                          bias=None if bias is None else leaves[3])
    return out, lse, leaves


def _grads(out, lse, leaves, seed=3):
    g = torch.Generator().manual_seed(seed)
    d_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    d_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    loss = (out.double() * d_out).sum() + (lse.double().masked_fill(lse.isinf(), 0) * d_lse).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_every_scale_with_every_mask_on_the_torch_engine(mask_name, scale):
    mask, vis_kw, sq, skv = MASKS[mask_name]
    q, k, v = _inputs(sq, skv)
    visible = oracle.build_visibility(2, sq, skv, **vis_kw)
    want, want_lse, leaves = _reference(q, k, v, visible, scale)
    # The no-gradient call first (it may take the direct fast path), then with gradients.
    out = ca.attention(q, k, v, mask=mask, scale=scale, backend="torch")
    assert not out.isnan().any()
    torch.testing.assert_close(out, want.detach(), atol=1e-10, rtol=1e-10)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = ca.attention(*mine, mask=mask, scale=scale, backend="torch", return_lse=True)
    torch.testing.assert_close(out, want.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse.detach(), atol=1e-10, rtol=1e-10)
    for name, got, expected in zip("qkv", _grads(out, lse, mine), _grads(want, want_lse, leaves)):
        assert not got.isnan().any(), f"NaN in d{name}"
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9, msg=f"d{name}")


def _causal_visibility(sq, skv, alignment="top_left"):
    return oracle.build_visibility(1, sq, skv, causal=alignment)


@pytest.mark.parametrize("scale", [-0.5, -2.0])
def test_negative_scale_through_every_causal_surface(scale):
    """The plain-causal calls that PyTorch's fused CPU kernel served (and got NaN for)."""
    q, k, v = (t.transpose(1, 2).contiguous() for t in _inputs(S, S))  # bshd
    want, _, _ = _reference(q, k, v, _causal_visibility(S, S), scale, layout="bshd")
    want = want.detach()
    results = {
        "flash_attn_func": flash_attn_func(q, k, v, softmax_scale=scale, causal=True),
        "natten.attention": N.attention(q, k, v, is_causal=True, scale=scale),
        # A causal kernel spanning the whole axis is plain causal attention.
        "na1d": N.na1d(q, k, v, kernel_size=S, is_causal=True, scale=scale),
        "attention(bshd)": ca.attention(q, k, v, mask=ca.Causal(), scale=scale, layout="bshd"),
    }
    for name, out in results.items():
        assert not out.isnan().any(), f"{name}: NaN"
        torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10, msg=name)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = ca.attention(q.float(), k.float(), v.float(), mask=ca.Causal(), scale=scale,
                           layout="bshd")
    assert low.dtype == torch.bfloat16 and not low.isnan().any(), "autocast: NaN"
    torch.testing.assert_close(low.double(), want, atol=5e-2, rtol=5e-2)


# ---------------------------------------------------------------------------------------------
# NaN / +inf bias where the mask hides it
# ---------------------------------------------------------------------------------------------

HIDING = {
    "causal": (ca.Causal(), {"causal": "top_left"}),
    "window": (ca.SlidingWindow(1, 2), {"window": (1, 2)}),
    "neighborhood": (ca.Neighborhood((S,), 3), {"neighborhood": {"spatial_shape": (S,),
                                                                 "kernel_size": 3}}),
    "neighborhood-causal": (ca.Neighborhood((S,), 4, is_causal=True),
                            {"neighborhood": {"spatial_shape": (S,), "kernel_size": 4,
                                              "is_causal": True}}),
    "padding": (ca.Padding([6, 5]), {"seq_lens_q": [6, 5], "seq_lens_kv": [6, 5]}),
}


@pytest.mark.parametrize("poison", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("bias_shape", [(S, S), (2, 2, S, S)], ids=["broadcast", "full"])
@pytest.mark.parametrize("mask_name", list(HIDING))
def test_hidden_bias_entries_never_change_a_visible_result(mask_name, bias_shape, poison):
    mask, vis_kw = HIDING[mask_name]
    q, k, v = _inputs(S, S, seed=1)
    visible = oracle.build_visibility(2, S, S, **vis_kw)
    g = torch.Generator().manual_seed(2)
    clean = torch.randn(bias_shape, generator=g, dtype=torch.float64)
    # A broadcast bias entry is poisoned only where every batch hides it.
    hidden = ~visible.any(0) if len(bias_shape) == 2 else ~visible[:, None].expand(2, 2, S, S)
    assert hidden.any()
    poisoned = clean.masked_fill(hidden, poison)
    # The oracle on the clean bias: what happens at hidden pairs must not matter.
    want, want_lse, leaves = _reference(q, k, v, visible, 0.4, clean)
    want_grads = _grads(want, want_lse, leaves)
    mine = [t.clone().requires_grad_() for t in (q, k, v, poisoned)]
    out, lse = ca.attention(*mine[:3], mask=mask, bias=mine[3], scale=0.4, return_lse=True)
    no_grad_out = ca.attention(q, k, v, mask=mask, bias=poisoned, scale=0.4)
    for got in (out, no_grad_out):
        assert not got.isnan().any()
        torch.testing.assert_close(got, want.detach(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, want_lse.detach(), atol=1e-10, rtol=1e-10)
    got_grads = _grads(out, lse, mine)
    for name, got, expected in zip(("q", "k", "v", "bias"), got_grads, want_grads):
        if name == "bias":  # visible entries right, hidden ones carry no gradient
            visible_entries = ~hidden
            assert torch.isfinite(got[visible_entries]).all(), "dbias not finite where visible"
            torch.testing.assert_close(got[visible_entries], expected[visible_entries],
                                       atol=1e-9, rtol=1e-9, msg="dbias")
            assert (got[hidden] == 0).all(), "dbias non-zero where hidden"
        else:
            assert not got.isnan().any(), f"NaN in d{name}"
            torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9, msg=f"d{name}")


# ---------------------------------------------------------------------------------------------
# Scalars float32 cannot hold
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kwargs, name", [
    ({"scale": 1e300}, "scale"), ({"scale": -1e39}, "scale"), ({"softcap": 1e300}, "softcap"),
    ({"softcap": 1e-300}, "softcap")])
def test_scalars_beyond_float32_are_refused_naming_the_argument(kwargs, name, dtype):
    q, k, v = _inputs(S, S, dtype=dtype)
    for call in (lambda: ca.attention(q, k, v, **kwargs),
                 lambda: ca.explain(q, k, v, **kwargs),
                 lambda: ca.attention(*(t.to("meta") for t in (q, k, v)), **kwargs)):
        with pytest.raises(ValueError, match=name):
            call()
    if "scale" in kwargs:
        fa = [t.transpose(1, 2) for t in (q, k, v)]
        with pytest.raises(ValueError, match="scale"):
            flash_attn_func(*fa, softmax_scale=kwargs["scale"])


def test_float64_keeps_its_range():
    """float64 inputs compute in float64: 1e300 is a scale it holds (a hard argmax)."""
    q, k, v = _inputs(S, S)
    out = ca.attention(q, k, v, mask=ca.Causal(), softcap=1e300, scale=0.3)
    want, _, _ = _reference(q, k, v, oracle.build_visibility(2, S, S, causal="top_left"), 0.3)
    torch.testing.assert_close(out, want.detach(), atol=1e-10, rtol=1e-10)
