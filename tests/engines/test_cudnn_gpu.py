"""GPU (marked): the cuDNN engine against the float64 oracle. Skips cleanly without CUDA/cuDNN.

* Every configuration the engine builds (masks, padding with empty rows, ALiBi, bias + dBias,
  GQA/MQA, D_v != D_qk, layouts and strides, odd sizes) runs with ``backend="cudnn"`` in fp16
  and bf16; errors follow FlashAttention's rule: within 2x (forward) / 3x (backward) of a plain
  PyTorch computation in the same dtype, both measured against the float64 oracle.
* Rows that see no key: out exactly 0, lse -inf, no NaN anywhere (gradients included).
* The known NaN case: S % 128 == 64 with a mask and rows whose LSE is below about -88.7.
* Philox dropout: the kept pattern read back through an identity V reproduces out and grads.
* Cache hits rebuild nothing; the deterministic backward is bitwise repeatable; other streams.
"""

import importlib.util
import math

import oracle
import pytest
import torch
from common import Problem

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                       reason="nvidia-cudnn-frontend is not installed"),
]

P = Problem
CASES = [
    P(id="dense", B=2, Hq=4, Sq=128, D=64),
    P(id="dense-odd-113", B=2, Hq=2, Sq=113, Skv=97, D=40),
    P(id="gqa-causal", B=2, Hq=8, Hkv=2, Sq=256, D=64, causal="top_left"),
    P(id="mqa", B=1, Hq=4, Hkv=1, Sq=200, Skv=300, D=128),
    P(id="causal-br", B=2, Hq=2, Sq=77, Skv=213, D=72, causal="bottom_right"),
    P(id="decode-br", B=3, Hq=4, Sq=1, Skv=333, D=64, causal="bottom_right"),
    P(id="window", B=1, Hq=2, Sq=300, D=64, window=(17, 3)),
    P(id="window-br", B=1, Hq=2, Sq=100, Skv=260, D=64, window=(31, 0, "bottom_right")),
    P(id="causal&window", B=2, Hq=2, Sq=257, D=64, causal="top_left", window=(40, -1)),
    P(id="padding", B=3, Hq=2, Sq=130, Skv=140, D=64, seq_lens_q=(130, 64, 1),
      seq_lens_kv=(140, 7, 33)),
    P(id="padding-causal-br-empty-rows", B=3, Hq=2, Sq=96, Skv=80, D=64, causal="bottom_right",
      seq_lens_q=(96, 50, 20), seq_lens_kv=(80, 10, 20)),
    P(id="padding-window-br", B=2, Hq=2, Sq=64, Skv=192, D=64, window=(16, 0, "bottom_right"),
      seq_lens_q=(64, 20), seq_lens_kv=(192, 90)),
    P(id="alibi-causal-h6", B=2, Hq=6, Sq=160, D=64, causal="top_left", alibi="default"),
    P(id="alibi-causal-padding", B=2, Hq=4, Sq=128, D=64, causal="top_left", alibi="default",
      seq_lens_q=(128, 70), seq_lens_kv=(128, 90)),
    P(id="bias-1hss", B=2, Hq=2, Sq=128, Skv=256, D=64, bias_shape=(1, 2, 128, 256)),
    P(id="bias-bhss-causal", B=2, Hq=2, Sq=128, D=64, bias_shape=(2, 2, 128, 128), causal="top_left"),
    P(id="bias-b11s", B=2, Hq=2, Sq=128, D=64, bias_shape=(2, 1, 1, 128)),
    P(id="bias-skv-100", B=2, Hq=2, Sq=64, Skv=100, D=64, bias_shape=(1, 2, 64, 100)),
    P(id="dv<dqk", B=2, Hq=2, Sq=128, D=128, Dv=64),
    P(id="d192-dv128", B=1, Hq=2, Sq=128, D=192, Dv=128, causal="top_left"),
    P(id="bshd-gqa", B=2, Hq=4, Hkv=2, Sq=96, D=64, layout="bshd", causal="top_left"),
    P(id="s1023", B=1, Hq=2, Sq=1023, D=64, causal="top_left"),
]


def _rand_inputs(problem, dtype, seed):
    inp = problem.make_inputs(dtype, seed=seed)
    if inp["bias"] is not None:
        inp["bias"] = inp["bias"] * 0.5
    return inp


def _leaves(problem, inp, dtype, device):
    out = {}
    for name, t in inp.items():
        if isinstance(t, torch.Tensor) and name in ("q", "k", "v", "bias"):
            # cuDNN reduces dBias over B and H only: a bias broadcast along S gets no gradient
            grad = name != "bias" or tuple(t.shape[-2:]) == (problem.Sq, problem.Skv)
            out[name] = t.detach().to(device=device, dtype=dtype).requires_grad_(grad)
        else:
            out[name] = t
    return out


def _max_err(a, b):
    d = (a.double() - b.double()).abs()
    d = d[torch.isfinite(d)]
    return d.max().item() if d.numel() else 0.0


def _skip_if_declined_by_rules(problem, inp):
    import cudnn_attn as ca
    from cudnn_attn.graphs import cudnn_reasons

    p = ca.AttnProblem.from_tensors(inp["q"], inp["k"], inp["v"], **problem.kwargs(inp))
    reasons = cudnn_reasons(dataclass_replace(p, requires_grad=True))
    if reasons:  # an architecture limit known without building (e.g. sm_80 backward D > 128)
        pytest.skip("; ".join(reasons))


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


def check_against_oracle(problem, dtype, seed=0, inp=None):
    inp = inp or _rand_inputs(problem, dtype, seed)
    dev = torch.device("cuda")
    lib = _leaves(problem, inp, dtype, dev)
    _skip_if_declined_by_rules(problem, lib)
    base = _leaves(problem, inp, dtype, "cpu")  # the plain low-precision PyTorch baseline
    ref = _leaves(problem, inp, torch.float64, "cpu")
    out, lse = problem.run_lib(lib, backend="cudnn")
    ref_out, ref_lse = problem.run_oracle(ref)
    base_out = problem.run_lowp_baseline(base)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    err, err_pt = _max_err(out.cpu(), ref_out), _max_err(base_out.cpu(), ref_out)
    assert err <= 2 * err_pt + 1e-5, f"out error {err:.3g} > 2 x baseline {err_pt:.3g}"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse.cpu()), empty), "rows that see no key: lse must be -inf"
    o = out.cpu() if problem.layout == "bhsd" else out.cpu().transpose(1, 2)
    assert (o[empty] == 0).all(), "rows that see no key must be exactly 0"
    torch.testing.assert_close(lse.cpu().double()[~empty], ref_lse[~empty], atol=2e-3, rtol=1e-3)

    g = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    names = [n for n in ("q", "k", "v", "bias")
             if isinstance(lib.get(n), torch.Tensor) and lib[n].requires_grad]
    got = torch.autograd.grad((out.double() * g.to(dev)).sum(), [lib[n] for n in names])
    exp = torch.autograd.grad((ref_out * g).sum(), [ref[n] for n in names])
    bas = torch.autograd.grad((base_out.double() * g).sum(), [base[n] for n in names],
                              allow_unused=True)
    for n, a, e, b in zip(names, got, exp, bas):
        assert not a.isnan().any(), f"NaN in d{n}"
        err, err_pt = _max_err(a.cpu(), e), _max_err(b.cpu(), e) if b is not None else 0.0
        assert err <= 3 * err_pt + 1e-5, f"d{n} error {err:.3g} > 3 x baseline {err_pt:.3g}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("problem", [pytest.param(c, id=c.id) for c in CASES])
def test_cudnn_matches_the_oracle(problem, dtype):
    check_against_oracle(problem, dtype, seed=hash(problem.id) % 1000)


def test_explain_selects_cudnn_for_supported_calls():
    import cudnn_attn as ca

    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    assert ca.explain(q, k, v, mask=ca.Causal()).selected == "cudnn"
    verdict = ca.explain(q.float(), k.float(), v.float())["cudnn"]
    assert any("float16 or bfloat16" in r for r in verdict)


def test_explain_agrees_with_the_engine_on_this_cudnn():
    # Issue 36: on cuDNN 9.19 explain() selected cuDNN for a 2-D neighborhood whose build then
    # failed (constant tensors need 9.22) and the call ran on CuPy. The version floors
    # (graphs/limits.py) now decline it in explain(), before any build.
    import cudnn
    import cudnn_attn as ca

    q, k, v = (torch.randn(1, 2, 64, 32, device="cuda", dtype=torch.float16) for _ in range(3))
    hood = ca.Neighborhood((8, 8), (3, 3))
    verdict = ca.explain(q, k, v, mask=hood, backend="cudnn")["cudnn"]
    if cudnn.backend_version() < 92200:
        assert any("needs cuDNN >= 9.22.0" in r for r in verdict), verdict
        with pytest.raises(ca.NotSupportedError, match="needs cuDNN >= 9.22.0"):
            ca.attention(q, k, v, mask=hood, backend="cudnn")
    else:
        assert verdict == "selected"
        out = ca.attention(q, k, v, mask=hood, backend="cudnn")  # builds: no decline
        want = ca.attention(q.double(), k.double(), v.double(), mask=hood, backend="torch")
        torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
    auto = ca.attention(q, k, v, mask=hood)  # auto: whatever explain() selected runs
    want = ca.attention(q.double(), k.double(), v.double(), mask=hood, backend="torch")
    torch.testing.assert_close(auto.double(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("variant", ["bias", "padding", "none", "one-query"])
def test_seq_len_mod_128_is_64_with_a_mask_and_tiny_lse(variant):
    # PyTorch #196678 / cudnn-frontend PR #628: NaN in dQ when S % 128 == 64 and a row's LSE
    # < -88.7 (with a bias, or no mask at all); cudnn-frontend #1072: NaN in dK, dV with
    # S_q = 1, S_kv = 128 (limits.CudnnLimits.key_tile).
    if variant == "bias":
        p = P(B=2, Hq=2, Sq=192, D=64, bias_shape=(1, 2, 192, 192))
    elif variant == "padding":
        p = P(B=2, Hq=2, Sq=192, D=64, bias_shape=(1, 2, 192, 192), causal="top_left",
              seq_lens_q=(192, 150), seq_lens_kv=(192, 140))
    elif variant == "none":
        p = P(B=2, Hq=2, Sq=192, D=64)
    else:
        p = P(B=1, Hq=2, Sq=1, Skv=128, D=64)
    for dtype in (torch.float16, torch.bfloat16):
        inp = _rand_inputs(p, dtype, seed=4)
        if inp["bias"] is not None:
            inp["bias"][..., :8, :] = -100.0  # these rows' LSE is about -100 + log(S)
        else:  # every score about -106: q's first feature 1, k's -850 (D = 64)
            inp["q"][..., 0], inp["k"][..., 0] = 1.0, -850.0
        check_against_oracle(p, dtype, inp=inp)


def test_dropout_pattern_reproduces_out_and_grads():
    import cudnn_attn as ca

    B, H, S, D, p_drop = 2, 2, 64, 64, 0.25
    dev = torch.device("cuda")
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float16, device=dev) for _ in range(3))
    eye = torch.eye(S, D, dtype=torch.float16, device=dev).expand(B, H, S, D).contiguous()

    def run(values, seed):
        # always with gradients: every run uses the same (training) forward graph
        t = [x.detach().clone().requires_grad_(True) for x in (q, k, values)]
        gen = torch.Generator(device=dev).manual_seed(seed)
        out = ca.attention(*t, mask=ca.Causal(), dropout_p=p_drop, generator=gen, backend="cudnn")
        return out, t

    pattern = run(eye, 7)[0].detach()  # out = dropped, rescaled P (V = identity)
    again, other = run(eye, 7)[0].detach(), run(eye, 8)[0].detach()
    assert torch.equal(pattern, again) and not torch.equal(pattern, other)
    visible = oracle.build_visibility(B, S, S, causal="top_left")[:, None].to(dev)
    kept = (pattern[..., :S] != 0) & visible
    rate = 1 - kept.sum().item() / visible.expand_as(kept).sum().item()
    assert abs(rate - p_drop) < 0.05, rate
    keep = kept.double() / (1 - p_drop)

    out, (tq, tk, tv) = run(v, 7)
    q64, k64, v64 = (x.double().requires_grad_(True) for x in (q, k, v))
    s = (q64 @ k64.transpose(-1, -2)) * D ** -0.5
    prob = torch.softmax(s.masked_fill(~visible, -math.inf), -1)
    ref = (prob * keep) @ v64
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)
    g = torch.randn_like(ref)
    got = torch.autograd.grad((out.double() * g).sum(), (tq, tk, tv))
    exp = torch.autograd.grad((ref * g).sum(), (q64, k64, v64))
    for a, e in zip(got, exp):
        torch.testing.assert_close(a.double(), e, atol=3e-2, rtol=3e-2)


def test_cache_hits_cause_no_rebuild():
    import cudnn_attn as ca
    from cudnn_attn.core import dispatch
    from cudnn_attn.core.caches import clear_caches
    from cudnn_attn.graphs.cache import graph_cache

    q, k, v = (torch.randn(2, 3, 320, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ca.attention(q, k, v, mask=ca.Causal(), scale=0.11, backend="cudnn")
    builds = graph_cache.info()["builds"]
    ca.attention(q, k, v, mask=ca.Causal(), scale=0.12, backend="cudnn")  # runtime scale
    q2, k2, v2 = (torch.randn_like(q) for _ in range(3))
    ca.attention(q2, k2, v2, mask=ca.Causal(), scale=0.13, backend="cudnn")
    clear_caches("api.calls")  # forget the calls and the plans: the graphs come from the cache
    dispatch.get_backend("cudnn").clear()
    hits = graph_cache.info()["hits"]
    ca.attention(q, k, v, mask=ca.Causal(), scale=0.14, backend="cudnn")
    info = graph_cache.info()
    assert info["builds"] == builds and info["hits"] > hits


def test_deterministic_backward_is_bitwise_repeatable():
    import cudnn_attn as ca
    from cudnn_attn.core import dispatch

    inputs = [torch.randn(2, 5, 768, 64, device="cuda", dtype=torch.float16) for _ in range(3)]
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        problem = ca.AttnProblem.from_tensors(*[t.requires_grad_(True) for t in inputs],
                                              mask=ca.Causal())
        assert dispatch.get_backend("cudnn").plan(problem).spec.deterministic
        grads = []
        for _ in range(3):
            leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
            out = ca.attention(*leaves, mask=ca.Causal(), backend="cudnn")
            grads.append(torch.autograd.grad(out.float().square().sum(), leaves))
    finally:
        torch.use_deterministic_algorithms(False)
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            assert torch.equal(a, b)


def test_runs_on_the_current_stream():
    import cudnn_attn as ca

    q, k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    expected = ca.attention(q, k, v, mask=ca.Causal(), backend="cudnn")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = ca.attention(q, k, v, mask=ca.Causal(), backend="cudnn")
    stream.synchronize()
    assert torch.equal(out, expected)


def test_builders_build_plans_on_the_gpu():
    import cudnn_attn as ca
    from cudnn_attn.graphs import build_backward, build_forward

    q, k, v = (torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    problem = ca.AttnProblem.from_tensors(q, k, v, mask=ca.Causal())
    for built in (build_forward(problem), build_backward(problem)):
        assert built.built and built.workspace_size >= 0 and built.build_seconds > 0
