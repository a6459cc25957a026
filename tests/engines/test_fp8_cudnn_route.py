"""The cuDNN route of the FP8 calls on the CPU: a stand-in for the built graph's ``execute``
reads the buffers the engine binds by uid, computes what cuDNN's ``sdpa_fp8`` /
``sdpa_fp8_backward`` document with the float64 reference (``fp8_reference.py``), and writes the
outputs, with NaN in padded rows (what cuDNN writes there is not to be relied on). The scale
inputs are matched to cuDNN's own positional parameter names, read from the installed binding's
signature, so a scale bound to the wrong uid fails here."""

from __future__ import annotations

import re

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.core import fp8 as fp8_route
from cudnn_attn.graphs.fp8 import UID
from fp8_reference import band_visible, reference_backward, reference_forward

cudnn = pytest.importorskip("cudnn")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CODES = {"FP8_E4M3": E4M3, "FP8_E5M2": E5M2}


def binding_scales(op: str) -> list[str]:
    """The scale parameters of the C++ binding, in its positional order."""
    signature = getattr(cudnn._pybind_module.backend_graph, op).__doc__.split("\n")[0]
    names = re.findall(r"(\w+): cudnn\._compiled_module\.tensor,", signature)
    return [n for n in names if n.startswith(("scale", "descale"))]


class FakeFp8Graph:
    def __init__(self, spec, backward):
        self.spec, self.backward = spec, backward
        self.scales = binding_scales("sdpa_fp8_backward" if backward else "sdpa_fp8")

    def run(self, buffers):
        s, b = self.spec, buffers
        sc = {name: float(b[UID.FP8_SCALES + i]) for i, name in enumerate(self.scales)}
        scale = float(b[UID.SCALE])
        lens_q = (b[UID.SEQ_LEN_Q].view(-1).tolist() if s.padding else [s.seq_q] * s.batch)
        lens_kv = (b[UID.SEQ_LEN_KV].view(-1).tolist() if s.padding else [s.seq_kv] * s.batch)
        visible = band_visible(lens_q, lens_kv, s.seq_q, s.seq_kv, s.alignment,
                               s.left_bound, s.right_bound)
        sinks = b[UID.SINK].view(-1) if s.sink else None
        q, k, v = b[UID.Q], b[UID.K], b[UID.V]
        dead = torch.arange(s.seq_q).view(1, 1, -1, 1) >= torch.tensor(lens_q).view(-1, 1, 1, 1)
        if not self.backward:
            o, stats, amax_s, amax_o = reference_forward(q, k, v, sc, scale, visible, lens_q,
                                                         sinks, o_dtype=b[UID.O].dtype)
            b[UID.O].copy_(o.masked_fill(dead, float("nan")).to(b[UID.O].dtype))
            b[UID.STATS].copy_(stats.masked_fill(dead, float("nan")))
            b[UID.AMAX_S].fill_(float(amax_s))
            b[UID.AMAX_O].fill_(float(amax_o))
            return
        out = reference_backward(q, k, v, b[UID.O], b[UID.DO], b[UID.STATS], sc, scale, visible,
                                 lens_q, sinks, grad_dtype=CODES[s.grad])
        for uid, g in zip((UID.DQ, UID.DK, UID.DV), out[:3]):
            b[uid].copy_(g.to(b[uid].dtype))
        for uid, a in zip((UID.AMAX_DQ, UID.AMAX_DK, UID.AMAX_DV, UID.AMAX_DP), out[3:7]):
            b[uid].fill_(float(a))
        if s.dsink:
            b[UID.DSINK].copy_(out[7].float())


@pytest.fixture
def fake_cudnn(monkeypatch):
    built = []

    def graph(spec, backward, device):
        built.append((spec, backward))
        return FakeFp8Graph(spec, backward)

    monkeypatch.setattr(fp8_route, "fp8_graph", graph)
    monkeypatch.setattr(fp8_route, "_device_facts", lambda device: ([], 100, 92800))  # B200-like
    return built


def test_binding_scale_order_is_cudnns():
    assert binding_scales("sdpa_fp8") == ["descale_q", "descale_k", "descale_v", "descale_s",
                                          "scale_s", "scale_o"]
    assert len(binding_scales("sdpa_fp8_backward")) == 12


def _inputs(seed, B=2, H=2, S=24, D=16):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, S, D, generator=gen) * 4).to(E4M3) for _ in range(3)]


def test_cudnn_route_binds_what_cudnn_reads(fake_cudnn):
    q, k, v = _inputs(0)
    lens = torch.tensor([24, 15])
    sinks = torch.tensor([0.5, -1.0])
    scales = (0.25, 0.25, 0.125, 1 / 448, 448.0, 32.0)  # distinct: a swap shows
    fa = ca.SdpaAttributes().set_attn_scale(0.3).set_causal_mask(True).set_padding_mask(True) \
        .set_seq_len_q(lens).set_seq_len_kv(lens).set_sink_token(sinks.view(1, 2, 1, 1))
    got = ca.sdpa_fp8(q, k, v, *scales, fa, backend="cudnn")
    want = ca.sdpa_fp8(q, k, v, *scales, fa, backend="torch")
    assert [s[1] for s in fake_cudnn] == [False]
    assert fake_cudnn[0][0].padding and fake_cudnn[0][0].sink and fake_cudnn[0][0].right_bound == 0
    o, stats = got[0].float(), got[1]
    assert not o.isnan().any() and (o[1, :, 15:] == 0).all()       # padded rows hidden
    assert torch.isneginf(stats[1, :, 15:]).all()
    assert (got[0].float() == want[0].float()).float().mean() > 0.97
    torch.testing.assert_close(stats, want[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[2:], want[2:]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=0)

    d_o = _inputs(1)[0].float().to(E5M2)
    bscales = (0.25, 0.25, 0.125, 1 / 32.0, 0.5, 1 / 448, 1 / 256.0, 448.0, 8.0, 16.0, 4.0, 256.0)
    dsink = torch.zeros(1, 2, 1, 1)
    ba = ca.SdpaBackwardAttributes().set_attn_scale(0.3).set_causal_mask(True) \
        .set_padding_mask(True).set_seq_len_q(lens).set_seq_len_kv(lens) \
        .set_sink_token(sinks.view(1, 2, 1, 1)).set_dSink_token(dsink)
    gb = ca.sdpa_fp8_backward(q, k, v, got[0], d_o, stats, *bscales, ba, backend="cudnn")
    dsink_cudnn = dsink.clone()
    wb = ca.sdpa_fp8_backward(q, k, v, got[0], d_o, stats, *bscales, ba, backend="torch")
    assert fake_cudnn[-1][1] and fake_cudnn[-1][0].dsink and fake_cudnn[-1][0].grad == "FP8_E5M2"
    for a, b in zip(gb[:3], wb[:3]):
        assert a.dtype == E5M2 and (a.float() == b.float()).float().mean() > 0.95
    for a, b in zip(gb[3:], wb[3:]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=1e-6)
    torch.testing.assert_close(dsink_cudnn, dsink, rtol=1e-4, atol=1e-5)


def test_training_path_runs_through_the_cudnn_route(fake_cudnn):
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=gen).requires_grad_() for _ in range(3))
    out, amaxes = ca.attention_fp8(q, k, v, ca.DelayedScaling(), mask=ca.Causal(),
                                   backend="cudnn")
    out.sum().backward()
    assert [s[1] for s in fake_cudnn] == [False, True]
    assert fake_cudnn[1][0].out == "FP8_E5M2" and fake_cudnn[1][0].o_type == ""
    assert all(torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0 for t in (q, k, v))
