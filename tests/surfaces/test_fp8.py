"""FP8 attention (issue 30): the builder's ``sdpa_fp8`` / ``sdpa_fp8_backward`` against the
independent float64 reference in ``fp8_reference.py``, within NVIDIA's tolerances on dequantized
results (O: atol 0.08 / rtol 0.2; dQ, dK, dV: atol 0.04 / rtol 0.2) and, stricter, code by code;
cuDNN's FP8 limits as ``NotSupportedError`` reasons, checked against the frontend's own C++
validator for sm_90 and sm_100 without a GPU; the training path (``attention_fp8``)."""

from __future__ import annotations

import math

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.errors import NotSupportedError
from fp8_reference import band_visible, quantize, reference_backward, reference_forward

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FWD_TOL = dict(atol=0.08, rtol=0.2)
BWD_TOL = dict(atol=0.04, rtol=0.2)


def po2_scale(amax: float, dtype) -> float:
    """NVIDIA's test scale: the format's largest power of two over amax's, times 1/4."""
    largest = 128.0 if dtype == E4M3 else 32768.0
    return largest / 2 ** math.ceil(math.log2(max(float(amax), 0.0625))) * 0.25


def fp8_input(shape, dtype, gen):
    x = torch.randn(*shape, generator=gen)
    scale = po2_scale(x.abs().max(), dtype)
    return quantize(x * scale, dtype).to(dtype), 1.0 / scale


CASES = {
    # name: (B, H_q, H_kv, S_q, S_kv, D, causal, lens_q, lens_kv, sink)
    "plain": (2, 2, 2, 24, 40, 32, None, None, None, False),
    "causal": (1, 3, 3, 33, 33, 16, "top_left", None, None, False),
    "padding": (2, 2, 2, 20, 28, 32, None, (13, 20), (28, 9), False),
    "gqa": (1, 4, 2, 17, 24, 16, None, None, None, False),
    "sink": (1, 2, 1, 16, 16, 16, "top_left", None, None, True),
    "bottom_right": (1, 2, 2, 12, 30, 16, "bottom_right", None, None, False),
    "band": (1, 2, 2, 30, 30, 16, "top_left", None, None, False),   # + left bound 6
    # three key blocks of the online softmax (128, 128, 44), with padding and a sink
    "blocks": (2, 2, 1, 9, 300, 16, None, (9, 4), (300, 200), True),
}
LEFT_BOUND = {"band": 6}


def _attrs(cls, case, attn_scale, sinks):
    B, _, _, Sq, Skv, _, causal, lens_q, lens_kv, _ = case
    a = cls().set_attn_scale(attn_scale)
    if case is CASES["band"]:
        a.set_diagonal_band_left_bound(LEFT_BOUND["band"])
    if causal == "top_left":
        a.set_causal_mask(True)
    elif causal == "bottom_right":
        a.set_causal_mask_bottom_right(True)
    if lens_q is not None:
        a.set_padding_mask(True).set_seq_len_q(torch.tensor(lens_q)) \
            .set_seq_len_kv(torch.tensor(lens_kv))
    if sinks is not None:
        a.set_sink_token(sinks.view(1, -1, 1, 1))
    return a


def _visible(case):
    B, _, _, Sq, Skv, _, causal, lens_q, lens_kv, _ = case
    lens_q, lens_kv = lens_q or (Sq,) * B, lens_kv or (Skv,) * B
    right = 0 if causal else None
    left = LEFT_BOUND["band"] if case is CASES["band"] else None
    return band_visible(lens_q, lens_kv, Sq, Skv, causal or "top_left", left, right), lens_q


def _forward_call(case, io, gen, o_dtype=None):
    B, Hq, Hkv, Sq, Skv, D, *_ = case
    (q, dq_), (k, dk_), (v, dv_) = (fp8_input(s, io, gen) for s in
                                    ((B, Hq, Sq, D), (B, Hkv, Skv, D), (B, Hkv, Skv, D)))
    sinks = torch.randn(Hq, generator=gen) if case[-1] else None
    sc = dict(descale_q=dq_, descale_k=dk_, descale_v=dv_, scale_s=448.0 if io == E4M3 else
              32768.0)
    sc["descale_s"] = 1.0 / sc["scale_s"]
    visible, lens_q = _visible(case)
    scale = D ** -0.5
    # amax_o does not depend on scale_o: a first pass picks NVIDIA's scale from it.
    _, _, _, amax_o = reference_forward(q, k, v, dict(sc, scale_o=1.0), scale, visible, lens_q,
                                        sinks)
    sc["scale_o"] = po2_scale(amax_o, o_dtype or io)
    return (q, k, v), sc, sinks, visible, lens_q, scale


def _dequantized_close(got, want_codes, scale, tol):
    torch.testing.assert_close(got.double() / scale, want_codes / scale, **tol)


@pytest.mark.parametrize("io", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_the_float64_reference(name, io):
    case, gen = CASES[name], torch.Generator().manual_seed(hash(name) % 1000)
    (q, k, v), sc, sinks, visible, lens_q, scale = _forward_call(case, io, gen)
    want_o, want_stats, want_amax_s, want_amax_o = reference_forward(q, k, v, sc, scale, visible,
                                                                     lens_q, sinks)
    attrs = _attrs(ca.SdpaAttributes, case, scale, sinks)
    o, stats, amax_s, amax_o = ca.sdpa_fp8(q, k, v, sc["descale_q"], sc["descale_k"],
                                           sc["descale_v"], sc["descale_s"], sc["scale_s"],
                                           sc["scale_o"], attrs)
    assert o.dtype == io and o.shape == want_o.shape and stats.shape == want_stats.shape
    assert amax_s.shape == amax_o.shape == (1, 1, 1, 1) and amax_s.dtype == torch.float32
    _dequantized_close(o, want_o, sc["scale_o"], FWD_TOL)
    # The quantization points are the reference's: nearly every code is identical (a float32
    # vs float64 difference can only move a value sitting on a rounding midpoint).
    assert (o.double() == want_o).double().mean() > 0.97
    torch.testing.assert_close(stats.double(), want_stats, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(amax_s.double().reshape(()), want_amax_s, rtol=1e-5, atol=0)
    torch.testing.assert_close(amax_o.double().reshape(()), want_amax_o, rtol=2e-3, atol=0)
    if lens_q is not None and min(lens_q) < case[3]:
        b = lens_q.index(min(lens_q))
        assert (o[b, :, lens_q[b]:].float() == 0).all()
        assert torch.isneginf(stats[b, :, lens_q[b]:]).all()


@pytest.mark.parametrize("io,grad_io", [(E4M3, E4M3), (E5M2, E5M2), (E4M3, E5M2)],
                         ids=["e4m3", "e5m2", "hybrid"])
@pytest.mark.parametrize("name", list(CASES))
def test_backward_matches_the_float64_reference(name, io, grad_io):
    case, gen = CASES[name], torch.Generator().manual_seed(7 + hash(name) % 1000)
    (q, k, v), sc, sinks, visible, lens_q, scale = _forward_call(case, io, gen)
    fattrs = _attrs(ca.SdpaAttributes, case, scale, sinks)
    o, stats, _, _ = ca.sdpa_fp8(q, k, v, sc["descale_q"], sc["descale_k"], sc["descale_v"],
                                 sc["descale_s"], sc["scale_s"], sc["scale_o"], fattrs)
    dO, descale_dO = fp8_input(o.shape, grad_io, gen)
    bsc = dict(sc, descale_o=1.0 / sc["scale_o"], descale_dO=descale_dO)
    ones = dict(bsc, scale_dP=1.0, descale_dP=1.0, scale_dQ=1.0, scale_dK=1.0, scale_dV=1.0)
    first = reference_backward(q, k, v, o, dO, stats, ones, scale, visible, lens_q, sinks)
    amax_dq, amax_dk, amax_dv, amax_dp = first[3:7]
    bsc.update(scale_dP=po2_scale(amax_dp, grad_io), scale_dQ=po2_scale(amax_dq, grad_io),
               scale_dK=po2_scale(amax_dk, grad_io), scale_dV=po2_scale(amax_dv, grad_io))
    bsc["descale_dP"] = 1.0 / bsc["scale_dP"]
    want = reference_backward(q, k, v, o, dO, stats, bsc, scale, visible, lens_q, sinks)
    battrs = _attrs(ca.SdpaBackwardAttributes, case, scale, sinks)
    dsink = None
    if sinks is not None:
        dsink = torch.zeros(1, case[1], 1, 1)
        battrs.set_dSink_token(dsink)
    names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s",
             "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
    got = ca.sdpa_fp8_backward(q, k, v, o, dO, stats, *(bsc[n] for n in names), battrs)
    assert len(got) == 7
    for g, w, x, n in zip(got[:3], want[:3], (q, k, v), ("scale_dQ", "scale_dK", "scale_dV")):
        assert g.dtype == grad_io and g.shape == x.shape
        _dequantized_close(g, w, bsc[n], BWD_TOL)
        assert (g.double() == w).double().mean() > 0.95
    for g, w in zip(got[3:7], want[3:7]):
        torch.testing.assert_close(g.double().reshape(()), w, rtol=2e-2, atol=1e-6)
    if sinks is not None:
        torch.testing.assert_close(dsink.double(), want[7], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("io", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_p_is_quantized_unnormalized_against_the_running_maximum(io):
    """Issue 36: cuDNN quantizes exp(S - m) block by block (the frontend's reference), not the
    normalized P. A key in the third block scoring far above the first two moves the running
    maximum (a rescale); O's dequantized values stay within NVIDIA's tolerance of float64
    attention, and the codes are the reference's, which the normalized form's are not."""
    gen = torch.Generator().manual_seed(5)
    B, H, Sq, Skv, D = 1, 2, 6, 300, 16
    (q, dq_), (k, dk_), (v, dv_) = (fp8_input(s, io, gen) for s in
                                    ((B, H, Sq, D), (B, H, Skv, D), (B, H, Skv, D)))
    k = k.float()
    k[:, :, 270] = q.float()[:, :, 0] * 6  # query 0 meets a far larger score in block 3
    k = quantize(k, io).to(io)
    sc = dict(descale_q=dq_, descale_k=dk_, descale_v=dv_,
              scale_s=448.0 if io == E4M3 else 32768.0)
    sc["descale_s"] = 1.0 / sc["scale_s"]
    scale = D ** -0.5
    visible, lens = band_visible((Sq,), (Skv,), Sq, Skv), (Sq,)
    amax_o = reference_forward(q, k, v, dict(sc, scale_o=1.0), scale, visible, lens)[3]
    sc["scale_o"] = po2_scale(amax_o, io)
    want_o, _, _, want_amax_o = reference_forward(q, k, v, sc, scale, visible, lens)
    attrs = ca.SdpaAttributes().set_attn_scale(scale)
    o, _, _, got_amax_o = ca.sdpa_fp8(q, k, v, sc["descale_q"], sc["descale_k"], sc["descale_v"],
                                      sc["descale_s"], sc["scale_s"], sc["scale_o"], attrs)
    assert (o.double() == want_o).double().mean() > 0.97
    torch.testing.assert_close(got_amax_o.double().reshape(()), want_amax_o, rtol=2e-3, atol=0)
    # the semantics is attention's: float64 softmax over the dequantized inputs
    qd, kd, vd = (t.double() * d for t, d in ((q, dq_), (k, dk_), (v, dv_)))
    exact = torch.softmax(qd @ kd.transpose(-1, -2) * scale, dim=-1) @ vd
    tol = dict(atol=0.125 if io == E5M2 else 0.08, rtol=0.2)  # the frontend's, per format
    torch.testing.assert_close(o.double() / sc["scale_o"], exact, **tol)


def test_casts_saturate_instead_of_overflowing():
    gen = torch.Generator().manual_seed(3)
    case = CASES["plain"]
    (q, k, v), sc, _, visible, lens_q, scale = _forward_call(case, E4M3, gen)
    attrs = _attrs(ca.SdpaAttributes, case, scale, None)
    o, _, _, amax_o = ca.sdpa_fp8(q, k, v, sc["descale_q"], sc["descale_k"], sc["descale_v"],
                                  sc["descale_s"], sc["scale_s"], 1e6, attrs)
    values = o.float()
    assert not values.isnan().any() and values.abs().max() == 448.0
    # E5M2 O (another FP8 type than the inputs): torch's own cast would give inf.
    o5, *_ = ca.sdpa_fp8(q, k, v, sc["descale_q"], sc["descale_k"], sc["descale_v"],
                         sc["descale_s"], sc["scale_s"], 1e9, attrs, o_dtype=E5M2)
    assert o5.dtype == E5M2 and o5.float().abs().max() == 57344.0
    # amax is taken before scale_o: the same whatever scale_o is.
    _, _, _, amax_o2 = ca.sdpa_fp8(q, k, v, sc["descale_q"], sc["descale_k"], sc["descale_v"],
                                   sc["descale_s"], sc["scale_s"], 1.0, attrs)
    assert amax_o.item() == amax_o2.item()


def test_scales_as_tensors_equal_scales_as_floats():
    gen = torch.Generator().manual_seed(4)
    case = CASES["causal"]
    (q, k, v), sc, _, _, _, scale = _forward_call(case, E4M3, gen)
    attrs = _attrs(ca.SdpaAttributes, case, scale, None)
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    a = ca.sdpa_fp8(q, k, v, *(sc[n] for n in names), attrs)
    b = ca.sdpa_fp8(q, k, v, *(torch.full((1, 1, 1, 1), sc[n]) for n in names), attrs)
    for x, y in zip(a, b):
        assert torch.equal(x.float(), y.float())


def test_packed_and_paged_forms_equal_the_dense_call():
    gen = torch.Generator().manual_seed(5)
    B, H, D, lens = 2, 2, 16, (5, 9)
    q, k, v = (fp8_input((B, H, 9, D), E4M3, gen)[0] for _ in range(3))
    scales = (0.5, 0.5, 0.5, 1 / 448, 448.0, 64.0)
    dense_attrs = ca.SdpaAttributes().set_attn_scale(0.25).set_padding_mask(True) \
        .set_seq_len_q(torch.tensor(lens)).set_seq_len_kv(torch.tensor(lens))
    o, stats, *_ = ca.sdpa_fp8(q, k, v, *scales, dense_attrs)
    packed = [torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])
              for t in (q, k, v)]
    cu = torch.tensor([0, 5, 14])
    packed_attrs = ca.SdpaAttributes().set_attn_scale(0.25).set_padding_mask(True) \
        .set_cu_seq_len_q(cu).set_cu_seq_len_kv(cu)
    po, pstats, *_ = ca.sdpa_fp8(*packed, *scales, packed_attrs)
    assert po.shape == (14, H, D) and pstats.shape == (14, H, 1)
    for b, n in enumerate(lens):
        rows = slice(int(cu[b]), int(cu[b]) + n)
        assert torch.equal(po[rows].float(), o[b, :, :n].transpose(0, 1).float())
        assert torch.equal(pstats[rows], stats[b, :, :n].transpose(0, 1))
    # Paged K/V: page size 3, blocks shuffled.
    blocks = torch.tensor([[4, 0, 2], [1, 5, 3]])
    kc = torch.zeros(6, H, 3, D).to(E4M3)
    vc = torch.zeros(6, H, 3, D).to(E4M3)
    for b in range(B):
        for page in range(3):
            kc[blocks[b, page]] = k[b, :, 3 * page:3 * page + 3]
            vc[blocks[b, page]] = v[b, :, 3 * page:3 * page + 3]
    paged_attrs = ca.SdpaAttributes().set_attn_scale(0.25).set_padding_mask(True) \
        .set_seq_len_q(torch.tensor(lens)).set_seq_len_kv(torch.tensor(lens)) \
        .set_paged_attention_k_table(blocks).set_paged_attention_v_table(blocks)
    go, gstats, *_ = ca.sdpa_fp8(q, kc, vc, *scales, paged_attrs)
    assert torch.equal(go.float(), o.float()) and torch.equal(gstats, stats)


def test_bad_arguments_name_what_is_wrong():
    q = torch.randn(1, 2, 8, 16).to(E4M3)
    attrs = ca.SdpaAttributes()
    with pytest.raises(TypeError, match="q has dtype torch.bfloat16"):
        ca.sdpa_fp8(q.float().bfloat16(), q, q, 1, 1, 1, 1, 1, 1, attrs)
    with pytest.raises(TypeError, match="share one FP8 type"):
        ca.sdpa_fp8(q, q.float().to(E5M2), q, 1, 1, 1, 1, 1, 1, attrs)
    with pytest.raises(ValueError, match="descale_k must be a float32"):
        ca.sdpa_fp8(q, q, q, 1, torch.ones(2), 1, 1, 1, 1, attrs)
    with pytest.raises(TypeError, match="attrs must be SdpaAttributes"):
        ca.sdpa_fp8(q, q, q, 1, 1, 1, 1, 1, 1, ca.SdpaBackwardAttributes())
    with pytest.raises(NotSupportedError, match="no bias"):
        ca.sdpa_fp8(q, q, q, 1, 1, 1, 1, 1, 1,
                    ca.SdpaAttributes().set_bias(torch.zeros(1, 1, 8, 8)))
    with pytest.raises(NotSupportedError, match="ALiBi"):
        ca.sdpa_fp8(q, q, q, 1, 1, 1, 1, 1, 1,
                    ca.SdpaAttributes().set_alibi_mask(True).set_causal_mask(True))
    with pytest.raises(ValueError, match="backend must be one of"):
        ca.sdpa_fp8(q, q, q, 1, 1, 1, 1, 1, 1, attrs, backend="flash")


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without CUDA")
def test_forcing_cudnn_without_a_gpu_gives_its_reasons():
    q = torch.randn(1, 2, 8, 16).to(E4M3)
    with pytest.raises(NotSupportedError) as info:
        ca.sdpa_fp8(q, q, q, 1, 1, 1, 1, 1, 1, ca.SdpaAttributes(), backend="cudnn")
    assert "cudnn" in info.value.reasons and info.value.reasons["cudnn"]


def test_bf16_output_is_the_unquantized_o():
    """``o_dtype=torch.bfloat16`` (cuDNN: Blackwell, cuDNN >= 9.13): O * scale_o rounded once to
    bf16, no FP8 cast."""
    gen = torch.Generator().manual_seed(8)
    case = CASES["gqa"]
    (q, k, v), sc, _, visible, lens_q, scale = _forward_call(case, E4M3, gen)
    attrs = _attrs(ca.SdpaAttributes, case, scale, None)
    o, *_ = ca.sdpa_fp8(q, k, v, sc["descale_q"], sc["descale_k"], sc["descale_v"],
                        sc["descale_s"], sc["scale_s"], sc["scale_o"], attrs,
                        o_dtype=torch.bfloat16)
    want = reference_forward(q, k, v, sc, scale, visible, lens_q, None,
                             o_dtype=torch.bfloat16)[0]
    assert o.dtype == torch.bfloat16
    assert (o.double() == want).double().mean() > 0.97
    torch.testing.assert_close(o.double(), want, rtol=1e-2, atol=1e-3)
