"""Problem features every surface reaches through dispatch: NATTEN's relative positional bias
(``bias=RelPosBias(table)``) and an explicit dropout mask (the cuDNN builder's
``set_dropout(mask, scale)``), on the torch engine, against a float64 brute force."""

import itertools
import math

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.model.masks import RelPosBias
from cudnn_attn.model.problem import AttnProblem
from cudnn_attn.model.inputs import DropoutState, Inputs
from oracle import neighborhood_visibility

F64 = torch.float64


def rpb_brute_force(q, k, v, hood, table, scale):
    """Dense float64 attention with NATTEN's rpb rule written out pair by pair."""
    visible = torch.as_tensor(neighborhood_visibility(hood.spatial_shape, hood.kernel_size,
                                                      hood.stride, hood.dilation, hood.is_causal))
    coords = list(itertools.product(*[range(n) for n in hood.spatial_shape]))
    bias = torch.zeros(q.shape[1], len(coords), len(coords), dtype=F64)
    for i, ci in enumerate(coords):
        for j, cj in enumerate(coords):
            if visible[i, j]:
                entry = tuple((b - a) // d + kk - 1
                              for a, b, d, kk in zip(ci, cj, hood.dilation, hood.kernel_size))
                bias[:, i, j] = table[(slice(None),) + entry]
    s = (scale * q @ k.transpose(-1, -2) + bias).masked_fill(~visible, -math.inf)
    return torch.softmax(s, -1) @ v, s.logsumexp(-1)


RPB_CASES = [
    ((9,), (3,), (1,), (2,), (False,)),
    ((5, 6), (3, 3), (1, 2), (1, 2), (False, False)),
    ((4, 5, 3), (3, 3, 3), (1, 1, 1), (1, 1, 1), (False, False, False)),
    ((7, 6), (5, 3), (1, 1), (1, 1), (True, False)),
]


@pytest.mark.parametrize("shape,kernel,stride,dilation,causal", RPB_CASES)
def test_rel_pos_bias_forward_and_gradients(shape, kernel, stride, dilation, causal):
    gen = torch.Generator().manual_seed(len(shape))
    hood = ca.Neighborhood(shape, kernel, stride, dilation, causal)
    S = math.prod(shape)
    q, k, v = (torch.randn(2, 4, S, 8, dtype=F64, generator=gen).requires_grad_(True)
               for _ in range(3))
    table = torch.randn(4, *(2 * x - 1 for x in kernel), dtype=F64, generator=gen)
    table.requires_grad_(True)
    out, lse = ca.attention(q, k, v, mask=hood, bias=RelPosBias(table), return_lse=True,
                            backend="torch")
    ref, ref_lse = rpb_brute_force(q, k, v, hood, table, 8 ** -0.5)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    g = torch.randn(out.shape, dtype=F64, generator=gen)
    got = torch.autograd.grad((out * g).sum() + lse.sum(), (q, k, v, table))
    expected = torch.autograd.grad((ref * g).sum() + ref_lse.sum(), (q, k, v, table))
    for name, a, b in zip(("dq", "dk", "dv", "drpb"), got, expected):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")


def test_rel_pos_bias_fp32_inference_path():
    hood = ca.Neighborhood((6, 7), (3, 5))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 42, 16, generator=gen) for _ in range(3))
    table = torch.randn(2, 5, 9, generator=gen)
    for _ in range(2):  # the second call reuses the plan: the table must still be read afresh
        table = table + 1
        out = ca.attention(q, k, v, mask=hood, bias=RelPosBias(table), backend="torch")
        ref, _ = rpb_brute_force(q.double(), k.double(), v.double(), hood, table.double(),
                                 16 ** -0.5)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_rel_pos_bias_validation():
    q = torch.randn(1, 2, 9, 4)
    with pytest.raises(ValueError, match="Neighborhood"):
        ca.attention(q, q, q, bias=RelPosBias(torch.zeros(2, 5)))
    with pytest.raises(ValueError, match="shape"):
        ca.attention(q, q, q, mask=ca.Neighborhood(9, 3), bias=RelPosBias(torch.zeros(2, 4)))
    with pytest.raises(TypeError, match="RelPosBias table"):
        RelPosBias([1.0, 2.0])


@pytest.mark.parametrize("mask_shape", [(2, 3, 7, 9), (1, 3, 1, 9), (7, 9)])
def test_explicit_dropout_mask_matches_the_dense_formula(mask_shape):
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 3, 7, 5, dtype=F64, generator=gen, requires_grad=True)
    k = torch.randn(2, 3, 9, 5, dtype=F64, generator=gen, requires_grad=True)
    v = torch.randn(2, 3, 9, 6, dtype=F64, generator=gen, requires_grad=True)
    keep = (torch.rand(mask_shape, generator=gen) > 0.3).to(F64)
    problem = AttnProblem.from_tensors(q, k, v, mask=ca.Causal("bottom_right"), return_lse=True,
                                       dropout_mask=keep, dropout_scale=1 / 0.7)
    plan = ca.core.dispatch.plan_for(problem, "torch")[1]
    out, lse = ca.core.execution.run(problem, plan, Inputs(q, k, v, dropout_mask=keep), True)
    visible = torch.ones(7, 9, dtype=torch.bool).tril(2)
    s = (q @ k.transpose(-1, -2) * 5 ** -0.5).masked_fill(~visible, -math.inf)
    ref = (torch.softmax(s, -1) * keep / 0.7) @ v
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, s.logsumexp(-1))
    g = torch.randn(out.shape, dtype=F64, generator=gen)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    expected = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_dropout_mask_validation():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="dropout_mask"):
        AttnProblem.from_tensors(q, q, q, dropout_mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match="exclusive"):
        AttnProblem.from_tensors(q, q, q, dropout_p=0.1, dropout_mask=torch.ones(4, 4))


def test_dropout_state_replays_and_offsets_select_streams():
    q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(i))
               for i in range(3))
    problem = AttnProblem.from_tensors(q, k, v, dropout_p=0.5)
    plan = ca.core.dispatch.plan_for(problem, "torch")[1]

    def run(seed, offset):
        return plan.forward(problem, Inputs(q, k, v, dropout=DropoutState(seed, offset)))[0]

    assert torch.equal(run(7, 0), run(7, 0))
    assert not torch.equal(run(7, 0), run(7, 1))
    assert not torch.equal(run(7, 0), run(8, 0))
    with pytest.raises(ValueError, match="seed"):
        DropoutState(-1)
    with pytest.raises(TypeError, match="generator"):
        DropoutState.draw("x")


def test_engines_that_cannot_apply_a_feature_say_so():
    from cudnn_attn.fallback_kernels.limits import problem_reasons

    q = torch.randn(1, 2, 9, 4)
    hood = ca.Neighborhood(9, 3)
    table = torch.zeros(2, 5, requires_grad=True)
    grad_rpb = AttnProblem.from_tensors(q, q, q, mask=hood, bias=RelPosBias(table))
    assert any("RelPosBias" in r and "gradient" in r for r in problem_reasons(grad_rpb))
    strided = AttnProblem.from_tensors(q, q, q, mask=ca.Neighborhood(9, 3, stride=2),
                                       bias=RelPosBias(table.detach()))
    assert any("stride" in r for r in problem_reasons(strided))
    inference = AttnProblem.from_tensors(q, q, q, mask=hood, bias=RelPosBias(table.detach()))
    assert problem_reasons(inference) == []
    masked = AttnProblem.from_tensors(q, q, q, dropout_mask=torch.ones(9, 9))
    assert any("dropout mask" in r for r in problem_reasons(masked))
