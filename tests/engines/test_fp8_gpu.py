"""GPU (marked): cuDNN's FP8 graphs (``sdpa_fp8`` / ``sdpa_fp8_backward``, ``backend="cudnn"``)
against the float64 reference of ``fp8_reference.py`` and the torch engine, within NVIDIA's
tolerances on dequantized results (O: atol 0.08 / rtol 0.2; dQ, dK, dV: atol 0.04 / rtol 0.2,
widened to one code step for E5M2 and to one intermediate code's reach for a few elements:
``assert_fp8_grad_close``). Skips cleanly without CUDA, cuDNN or an sm_90+ device."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import cudnn_attn as ca
from fp8_reference import (assert_fp8_grad_close, band_visible, code_step, quantize,
                           reference_backward, reference_forward)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                       reason="nvidia-cudnn-frontend is not installed"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                       reason="cuDNN's FP8 attention needs sm_90+"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FWD_TOL = dict(atol=0.08, rtol=0.2)
NAMES_BWD = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s",
             "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


def po2(amax, dtype):
    largest = 128.0 if dtype == E4M3 else 32768.0
    return largest / 2 ** math.ceil(math.log2(max(float(amax), 0.0625))) * 0.25


def fp8(shape, dtype, gen):
    x = torch.randn(*shape, generator=gen)
    s = po2(x.abs().max(), dtype)
    return quantize(x * s, dtype).to(dtype), 1.0 / s


# (B, H_q, H_kv, S_q, S_kv, D, causal, lens_q, lens_kv, sink)
CASES = {
    "plain": (2, 2, 2, 128, 128, 128, False, None, None, False),
    "causal_gqa": (1, 4, 2, 128, 256, 128, True, None, None, False),
    "padding": (2, 2, 2, 128, 128, 128, True, (100, 128), (128, 77), False),
    "sink": (1, 2, 2, 128, 128, 128, True, None, None, True),
    "d64_forward": (1, 2, 2, 64, 96, 64, False, None, None, False),
}


def _attrs(cls, case, scale, sinks):
    a = cls().set_attn_scale(scale).set_causal_mask(case[6])
    if case[7] is not None:
        a.set_padding_mask(True).set_seq_len_q(torch.tensor(case[7], device="cuda")) \
            .set_seq_len_kv(torch.tensor(case[8], device="cuda"))
    if sinks is not None:
        a.set_sink_token(sinks.view(1, -1, 1, 1).cuda())
    return a


@pytest.mark.parametrize("io", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", list(CASES))
def test_cudnn_fp8_matches_the_reference(name, io):
    B, Hq, Hkv, Sq, Skv, D, causal, lens_q, lens_kv, sink = case = CASES[name]
    gen = torch.Generator().manual_seed(11)
    (q, dq_), (k, dk_), (v, dv_) = (fp8(s, io, gen) for s in ((B, Hq, Sq, D), (B, Hkv, Skv, D),
                                                             (B, Hkv, Skv, D)))
    sinks = torch.randn(Hq, generator=gen) if sink else None
    scale = D ** -0.5
    lq, lkv = lens_q or (Sq,) * B, lens_kv or (Skv,) * B
    visible = band_visible(lq, lkv, Sq, Skv, "top_left", None, 0 if causal else None)
    sc = dict(descale_q=dq_, descale_k=dk_, descale_v=dv_, scale_s=448.0 if io == E4M3 else
              32768.0)
    sc["descale_s"] = 1 / sc["scale_s"]
    amax_o = reference_forward(q, k, v, dict(sc, scale_o=1.0), scale, visible, lq, sinks)[3]
    sc["scale_o"] = po2(amax_o, io)
    want_o, want_stats, _, want_amax_o = reference_forward(q, k, v, sc, scale, visible, lq, sinks)
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    gq, gk, gv = (t.cuda() for t in (q, k, v))
    scales = [torch.full((1, 1, 1, 1), sc[n], device="cuda") for n in names]
    fattrs = _attrs(ca.SdpaAttributes, case, scale, sinks)
    forward_backend = "cudnn"
    if sink and torch.cuda.get_device_capability()[0] == 9:  # the declared Hopper limit
        with pytest.raises(ca.NotSupportedError, match="sink tokens"):
            ca.sdpa_fp8(gq, gk, gv, *scales, fattrs, backend="cudnn")
        forward_backend = "auto"  # the torch engine, on the GPU
    o, stats, amax_s, amax_o = ca.sdpa_fp8(gq, gk, gv, *scales, fattrs, backend=forward_backend)
    torch.testing.assert_close(o.cpu().double() / sc["scale_o"], want_o / sc["scale_o"],
                               **FWD_TOL)
    live = torch.isfinite(want_stats)
    torch.testing.assert_close(stats.cpu().double()[live], want_stats[live], rtol=1e-3,
                               atol=1e-3)
    torch.testing.assert_close(amax_o.item(), want_amax_o.item(), rtol=0.05, atol=0)
    if D != 128:  # the Hopper FP8 backward takes D = 128 only
        return
    dO, ddo = fp8(o.shape, io, gen)
    bsc = dict(sc, descale_o=1 / sc["scale_o"], descale_dO=ddo)
    ones = dict(bsc, scale_dP=1.0, descale_dP=1.0, scale_dQ=1.0, scale_dK=1.0, scale_dV=1.0)
    o_c, stats_c = o.cpu(), stats.cpu()
    first = reference_backward(q, k, v, o_c, dO, stats_c, ones, scale, visible, lq, sinks)
    bsc.update(scale_dP=po2(first[6], io), scale_dQ=po2(first[3], io),
               scale_dK=po2(first[4], io), scale_dV=po2(first[5], io))
    bsc["descale_dP"] = 1 / bsc["scale_dP"]
    want = reference_backward(q, k, v, o_c, dO, stats_c, bsc, scale, visible, lq, sinks)
    battrs = _attrs(ca.SdpaBackwardAttributes, case, scale, sinks)
    got = ca.sdpa_fp8_backward(gq, gk, gv, o, dO.cuda(), stats,
                               *(torch.full((1, 1, 1, 1), bsc[n], device="cuda")
                                 for n in NAMES_BWD), battrs, backend="cudnn")
    # Issue 36: on an H200 (cuDNN 9.19) 95-99.8 % of the gradient codes equal the reference's;
    # the rest come from dS / P codes that cuDNN rounds the other way near a midpoint, which
    # with E5M2's quarter steps can exceed NVIDIA's tolerance (1 or 2 of 65536 elements).
    dequant = [(t.double() * bsc[n]).abs().max().item() for t, n in
               ((k, "descale_k"), (q, "descale_q"), (dO, "descale_dO"))]
    step_ds = code_step(want[6].item(), bsc["scale_dP"], dO.dtype)
    reach = (step_ds * dequant[0], step_ds * dequant[1],
             code_step(1.0, bsc["scale_s"], io) * dequant[2])
    for g, w, n, r in zip(got[:3], want[:3], ("scale_dQ", "scale_dK", "scale_dV"), reach):
        assert_fp8_grad_close(g.cpu(), w, bsc[n], g.dtype, r)
        assert (g.cpu().double() == w).double().mean() > 0.9  # a wrong cast point moves most
    for g, w in zip(got[3:7], want[3:7]):
        torch.testing.assert_close(g.item(), w.item(), rtol=0.05, atol=1e-4)


def test_training_path_runs_cudnn_forward_and_backward():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    recipe = ca.DelayedScaling()
    for _ in range(2):
        out, amaxes = ca.attention_fp8(q, k, v, recipe, mask=ca.Causal(), backend="cudnn")
        out.float().pow(2).mean().backward()
        recipe.update()
    ref = ca.attention(q, k, v, mask=ca.Causal())
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert rel < 0.08 and set(amaxes) == set(ca.DelayedScaling.TENSORS)
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
