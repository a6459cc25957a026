"""Head dims cuDNN does not take run on it zero-padded to a multiple of 8 (issue 36, item 5b), as
FlashAttention pads them: outputs sliced back, gradients exact. Through ``cudnn_fake`` (the
graph cuDNN receives, executed in float64) against the float64 oracle, and the padded graph
planned deviceless."""

import dataclasses

import pytest
import torch
import cudnn_fake
from deviceless_plans import assert_plans, deviceless, needs_fe  # noqa: F401

import cudnn_attn as ca
from cudnn_attn.graphs._spec import analyze
from cudnn_attn.graphs.head_pad import needs_padding, padded_problem


def inputs(D, Dv, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 50, D, generator=g).to(dtype)
    k = torch.randn(2, 2, 70, D, generator=g).to(dtype)
    v = torch.randn(2, 2, 70, Dv, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("D,Dv", [(20, 12), (12, 12), (36, 64)])
def test_padded_head_dims_match_the_oracle_forward_and_backward(monkeypatch, D, Dv):
    _, built = cudnn_fake.install(monkeypatch)
    q, k, v = (t.requires_grad_(True) for t in inputs(D, Dv))
    assert ca.explain(q, k, v, mask=ca.Causal("bottom_right"), backend="cudnn")["cudnn"] \
        == "selected"
    out = ca.attention(q, k, v, mask=ca.Causal("bottom_right"), backend="cudnn")
    assert out.shape == (2, 4, 50, Dv)
    assert built and {(s.dim_qk, s.dim_v) for s, _ in built} == {(-(-D // 8) * 8, -(-Dv // 8) * 8)}
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    want = ca.attention(*leaves, mask=ca.Causal("bottom_right"), backend="torch")
    torch.testing.assert_close(out.double(), want.detach(), atol=2e-3, rtol=2e-3)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).half()
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert any(b for _, b in built)  # the backward graph ran too
    for name, g, e in zip("qkv", got, torch.autograd.grad(want, leaves, dout.double())):
        torch.testing.assert_close(g.double(), e, atol=1e-2, rtol=1e-2, msg=name)


def test_only_dims_cuDNN_refuses_are_padded():
    q, k, v = (t.to("meta") for t in inputs(20, 12))
    problem = ca.AttnProblem.from_tensors(q, k, v)
    assert needs_padding(problem) and any("multiples of 8" in r for r in analyze(problem)[1])
    padded = padded_problem(problem)
    assert (padded.dim_qk, padded.dim_v, padded.scale) == (24, 16, problem.scale)
    assert not analyze(padded)[1] and not needs_padding(padded)
    assert not needs_padding(ca.AttnProblem.from_tensors(*(t.to("meta") for t in inputs(16, 8))))


@needs_fe
@pytest.mark.parametrize("target", ["a100", "h100", "b200"])
def test_the_padded_graph_plans(target, deviceless):  # noqa: F811
    q, k, v = (t.to("meta") for t in inputs(20, 12))
    problem = ca.AttnProblem.from_tensors(q, k, v, mask=ca.Causal(), dropout_p=0.1,
                                          return_lse=True)
    padded = dataclasses.replace(padded_problem(problem), requires_grad=True)
    assert assert_plans(deviceless, padded, target, build=False).ok
    assert assert_plans(deviceless, padded, target, backward=True, build=False).ok
