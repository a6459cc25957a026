"""The FP8 training path (issue 30): ``attention_fp8`` and ``FP8Attention`` with Transformer
Engine's delayed scaling (``DelayedScaling``): the plumbing of scales and amaxes into the builder
calls, autograd through ``sdpa_fp8_backward``, and closeness to float64 attention."""

from __future__ import annotations

import pytest
import torch

import cudnn_attn as ca

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _inputs(seed=0, B=2, H=4, Hkv=2, S=24, D=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(B, Hkv, S, D, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(B, Hkv, S, D, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def _warm(recipe, q, k, v, steps=2, **kw):
    """A few steps so the recipe's scales come from real amaxes (of gradients like the test's:
    delayed scaling saturates what outgrows its history)."""
    for step in range(steps):
        out, _ = ca.attention_fp8(q, k, v, recipe, **kw)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(10 + step)))
        recipe.update()
    for t in (q, k, v):
        t.grad = None


def test_forward_and_backward_are_the_builder_calls_with_the_recipes_scales():
    q, k, v = _inputs()
    recipe = ca.DelayedScaling()
    _warm(recipe, q, k, v, mask=ca.Causal())
    sc = {n: float(recipe.scale_of(n, "cpu")) for n in recipe.TENSORS}
    out, amaxes = ca.attention_fp8(q, k, v, recipe, mask=ca.Causal())
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(dout)

    q8, k8, v8 = ((t.detach() * sc[n]).clamp(-448, 448).to(E4M3)
                  for t, n in ((q, "q"), (k, "k"), (v, "v")))
    scale = 16 ** -0.5
    fa = ca.SdpaAttributes().set_attn_scale(scale).set_causal_mask(True)
    o8, stats, amax_s, amax_o = ca.sdpa_fp8(q8, k8, v8, 1 / sc["q"], 1 / sc["k"], 1 / sc["v"],
                                            1 / sc["s"], sc["s"], sc["o"], fa)
    assert torch.equal(out, o8.float() / sc["o"])
    assert torch.equal(amaxes["o"], amax_o) and torch.equal(amaxes["s"], amax_s)
    assert amaxes["q"].item() == q.detach().abs().max().item()
    d_o8 = (dout * sc["dO"]).clamp(-57344, 57344).to(E5M2)
    ba = ca.SdpaBackwardAttributes().set_attn_scale(scale).set_causal_mask(True)
    dq8, dk8, dv8, a_dq, a_dk, a_dv, a_dp = ca.sdpa_fp8_backward(
        q8, k8, v8, o8, d_o8, stats, 1 / sc["q"], 1 / sc["k"], 1 / sc["v"], 1 / sc["o"],
        1 / sc["dO"], 1 / sc["s"], 1 / sc["dP"], sc["s"], sc["dq"], sc["dk"], sc["dv"],
        sc["dP"], ba)
    for got, g8, name in ((q.grad, dq8, "dq"), (k.grad, dk8, "dk"), (v.grad, dv8, "dv")):
        assert torch.equal(got, g8.float() / sc[name])
    for name, a in (("dq", a_dq), ("dk", a_dk), ("dv", a_dv), ("dP", a_dp)):
        assert torch.equal(amaxes[name], a)
    assert amaxes["dO"].item() == dout.abs().max().item()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_close_to_float64_attention(fmt):
    q, k, v = _inputs(seed=2)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)).requires_grad_()
    recipe = ca.DelayedScaling(fmt)
    _warm(recipe, q, k, v, mask=ca.Causal(), sinks=sinks)
    sinks.grad = None
    out, _ = ca.attention_fp8(q, k, v, recipe, mask=ca.Causal(), sinks=sinks)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    out.backward(dout)
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref = ca.attention(*ref_in[:3], mask=ca.Causal(), sinks=ref_in[3], backend="torch")
    ref.backward(dout.double())

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    assert rel(out, ref) < 0.08   # E4M3 O: 3 mantissa bits
    limit = 0.16 if fmt == "hybrid" else 0.1   # E5M2 gradients: 2 mantissa bits
    for got, want in zip((q.grad, k.grad, v.grad, sinks.grad), ref_in):
        assert rel(got, want.grad) < limit


def test_fp8_inputs_with_their_descales_run_forward_only():
    q, k, v = (t.detach() for t in _inputs(seed=5))
    q8, k8, v8 = ((t * 32).to(E4M3) for t in (q, k, v))
    recipe = ca.DelayedScaling()
    out, amaxes = ca.attention_fp8(q8, k8, v8, recipe, descale_q=1 / 32, descale_k=1 / 32,
                                   descale_v=torch.full((1, 1, 1, 1), 1 / 32))
    o8, _, _, amax_o = ca.sdpa_fp8(q8, k8, v8, 1 / 32, 1 / 32, 1 / 32, 1 / 448, 448.0, 1.0,
                                   ca.SdpaAttributes().set_attn_scale(0.25))
    assert out.dtype == torch.bfloat16 and torch.equal(out, o8.float().bfloat16())
    assert torch.equal(amaxes["o"], amax_o) and "q" not in amaxes
    with pytest.raises(ValueError, match="descale_k"):
        ca.attention_fp8(q8, k8, v8, recipe, descale_q=1.0)


def test_bshd_layout_equals_bhsd():
    q, k, v = (t.detach() for t in _inputs(seed=6))
    a, _ = ca.attention_fp8(q, k, v, ca.DelayedScaling())
    b, _ = ca.attention_fp8(*(t.transpose(1, 2) for t in (q, k, v)), ca.DelayedScaling(),
                            layout="bshd")
    assert torch.equal(a, b.transpose(1, 2))


def test_delayed_scaling_update_follows_transformer_engine():
    recipe = ca.DelayedScaling("hybrid", amax_history_len=3, margin=1)
    i = recipe.TENSORS.index
    recipe.record("q", torch.tensor(2.0))
    recipe.record("q", torch.tensor(1.0))        # the step keeps its largest amax
    recipe.record("dO", torch.tensor(8.0))
    recipe.update()
    assert recipe.scale[i("q")].item() == 448.0 / 2.0 / 2.0
    assert recipe.scale[i("dO")].item() == 57344.0 / 8.0 / 2.0
    assert recipe.scale[i("k")].item() == 1.0      # no amax yet: the scale stays
    recipe.record("q", torch.tensor(0.5))
    recipe.update()
    assert recipe.scale[i("q")].item() == 448.0 / 2.0 / 2.0   # the history's max
    recipe.update()
    assert recipe.scale[i("q")].item() == 448.0 / 2.0 / 2.0
    recipe.update()                                 # 2.0 has left the 3-step history
    assert recipe.scale[i("q")].item() == 448.0 / 0.5 / 2.0
    with pytest.raises(ValueError, match="fp8_format"):
        ca.DelayedScaling("e5m2")


def test_module_trains_and_reports_amaxes():
    torch.manual_seed(0)
    attn = ca.FP8Attention(mask=ca.Causal(), num_sinks=4)
    proj = torch.nn.Linear(16, 48)
    opt = torch.optim.SGD(list(proj.parameters()) + list(attn.parameters()), lr=0.1)
    x = torch.randn(2, 12, 16)
    for _ in range(3):
        q, k, v = proj(x).view(2, 12, 3, 4, 4).permute(2, 0, 3, 1, 4)
        loss = attn(q, k, v).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert attn.sinks.grad is not None and attn.sinks.grad.abs().sum() > 0
    assert set(attn.amaxes) == set(ca.DelayedScaling.TENSORS)
    assert attn.recipe.scale[0].item() != 1.0      # q's scale came from its history
