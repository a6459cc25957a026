"""The run API (``cudnn_attn.core.execution``) and the unfused ops' dispatch (``cudnn_attn.core.unfused_ops``):
the dropout engine pinned from forward to backward, what the stored route takes, the lse edge,
positions past lengths hidden in both directions, and the unfused engines' verdicts. Oracles:
float64 brute force (``tests/oracle.py``) and the engines' declared reasons."""

import dataclasses
import math

import pytest
import torch

from cudnn_attn.core import dispatch, execution, unfused_ops
from cudnn_attn.errors import NotSupportedError
from cudnn_attn.model.masks import Neighborhood, Padding
from cudnn_attn.model.problem import AttnProblem, deterministic_calls
from cudnn_attn.model.inputs import Inputs

F64 = torch.float64


def _qkv(b=2, h=2, s=6, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, d, dtype=F64, generator=g) for _ in range(3)]


def _brute(q, k, v, lens):
    """Per sequence: attention over its first lens[b] queries and keys; zeros past them."""
    out = torch.zeros_like(q)
    for b, n in enumerate(lens):
        s = q[b, :, :n] @ k[b, :, :n].transpose(-1, -2) / math.sqrt(q.shape[-1])
        out[b, :, :n] = torch.softmax(s, -1) @ v[b, :, :n]
    return out


def test_dropout_forward_is_planned_as_its_backward():
    q, k, v = _qkv()
    problem = AttnProblem.from_tensors(q, k, v, dropout_p=0.3, return_lse=True)
    engine, planned, _ = execution.plan_call(problem)
    assert planned.requires_grad and not planned.deterministic  # the backward's forward
    assert engine.name == dispatch.plan_for(planned)[0].name
    plain = AttnProblem.from_tensors(q, k, v, return_lse=True)
    assert execution.plan_call(plain)[1] is plain  # no dropout: planned as it is


def test_a_dropout_backward_stays_on_the_engine_that_drew_the_mask(monkeypatch):
    q, k, v = _qkv()
    problem = dataclasses.replace(AttnProblem.from_tensors(q, k, v, dropout_p=0.3),
                                  requires_grad=True, deterministic=True)

    class Drew:  # the engine chosen for the mask, unable to run the deterministic backward
        name = "torch"

        def supports(self, p):
            return ["no deterministic backward (test)"] if p.deterministic else []

    monkeypatch.setattr(execution, "dropout_engine", lambda probe, backend="auto": Drew())
    with pytest.raises(NotSupportedError, match="dropout mask was made by 'torch'"):
        execution.plan_call(problem)


def test_forward_and_backward_hide_what_lies_past_the_lengths():
    q, k, v = _qkv()
    lens = [4, 6]
    for t in (q, k, v):
        t[0, :, 4:] = float("nan")  # not tokens: must never reach a result
    problem = AttnProblem.from_tensors(q, k, v, mask=Padding(lens, lens), return_lse=True)
    _, problem, plan = execution.plan_call(problem)
    out, lse = execution.forward(problem, plan, Inputs(q, k, v))
    clean = [t.nan_to_num(0.0) for t in (q, k, v)]
    torch.testing.assert_close(out, _brute(*clean, lens))
    assert torch.isfinite(lse[0, :, :4]).all()
    dout = torch.randn_like(out)
    dout[0, :, 4:] = float("nan")
    grad_problem = dataclasses.replace(problem, requires_grad=True)
    _, grad_problem, plan = execution.plan_call(grad_problem)
    dq, dk, dv, _ = execution.backward(grad_problem, plan, Inputs(q, k, v), out, lse, dout)
    leaves = [t.clone().requires_grad_(True) for t in clean]
    expected = torch.autograd.grad(_brute(*leaves, lens), leaves, dout.nan_to_num(0.0))
    for got, want in zip((dq, dk, dv), expected):
        torch.testing.assert_close(got, want)


def test_the_stored_route_takes_only_an_engine_that_runs_storage_as_it_lies():
    q, k, v = _qkv()
    problem = AttnProblem.from_tensors(q, k, v)
    assert dispatch.plan_for(problem)[0].name == "torch"      # on the CPU
    assert execution.plan_stored(problem) is None              # the torch engine would read it whole
    with pytest.raises(NotSupportedError):
        execution.plan_stored(problem, "cudnn")                # a forced engine never falls back


def test_flash_lse_edge():
    """FlashAttention's ``+inf`` rows become ``-inf``; either infinity's rows stay ``-inf``, and
    finite values (the largest too) and NaN are kept bit for bit."""
    big = torch.finfo(torch.float32).max
    lse = torch.tensor([1.0, math.inf, -2.0, -math.inf, big, -big, math.nan])
    got = execution.lse_from_flash(lse)
    assert got[:6].tolist() == [1.0, -math.inf, -2.0, -math.inf, big, -big]
    assert math.isnan(got[6]) and got.dtype == lse.dtype


def test_every_plan_answers_direct():
    q, k, v = _qkv()
    problem = AttnProblem.from_tensors(q, k, v)
    _, plan = dispatch.plan_for(problem)
    assert callable(execution.direct_runner(problem, plan))
    with_lse = dataclasses.replace(problem, return_lse=True)
    assert execution.direct_runner(with_lse, plan) is None


def test_deterministic_calls_set_the_problem_field_not_torch_s_flag():
    q, k, v = _qkv()
    with deterministic_calls():
        assert not torch.are_deterministic_algorithms_enabled()
        assert AttnProblem.from_tensors(q, k, v).deterministic
    assert not AttnProblem.from_tensors(q, k, v).deterministic


# ---------------------------------------------------------------------------------------------
# The unfused ops
# ---------------------------------------------------------------------------------------------

def test_unfused_explain_names_every_engine_and_why():
    x = torch.randn(1, 2, 9, 4)
    problem = unfused_ops.UnfusedProblem.of("qk", x, Neighborhood((9,), 3))
    verdict = unfused_ops.explain(problem)
    assert verdict.selected == "torch"
    assert any("CUDA" in r for r in verdict["cupy"])          # the CPU tensor is the reason
    assert "unfused qk" in str(verdict) and "cupy" in str(verdict)
    strided = unfused_ops.UnfusedProblem("qk", Neighborhood((9,), 3, stride=2), torch.float32,
                                         torch.device("cuda"))
    assert any("stride" in r for r in unfused_ops.verdicts(strided)["cupy"])
    assert unfused_ops.verdicts(strided)["torch"] == []
    with pytest.raises(NotSupportedError, match="backend='cupy'"):
        unfused_ops.select(problem, "cupy")
    with pytest.raises(ValueError, match="backend"):
        unfused_ops.select(problem, "nope")


def test_unfused_ops_match_the_brute_force():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 7, 4, dtype=F64, generator=g) for _ in range(3))
    nb = Neighborhood((7,), 3)
    attn = unfused_ops.qk(q, k, nb)
    # Brute force: NATTEN's window of 3 keys clamped inside [0, 7).
    starts = [min(max(i - 1, 0), 7 - 3) for i in range(7)]
    want = torch.stack([(q[:, :, i, None] * k[:, :, s:s + 3]).sum(-1)
                        for i, s in enumerate(starts)], 2)
    torch.testing.assert_close(attn, want)
    out = unfused_ops.av(attn.softmax(-1), v, nb)
    want_out = torch.stack([(attn.softmax(-1)[:, :, i, :, None] * v[:, :, s:s + 3]).sum(-2)
                            for i, s in enumerate(starts)], 2)
    torch.testing.assert_close(out, want_out)


def test_hidden_inputs_keep_the_strides_the_problem_describes():
    """A sliced cache view (gaps between its rows) comes back with the same strides after the
    positions past the lengths are zeroed: a cuDNN graph built from the problem reads the bound
    tensor through those strides."""
    from cudnn_attn.model.inputs import hide_padding

    pool = torch.randn(3, 48, 4, 16, dtype=torch.float64)
    k = pool[:, :42]                                   # [B, S, H, D] with batch stride 48*4*16
    q = torch.randn(3, 2, 4, 16, dtype=torch.float64)
    mask = Padding([2, 2, 2], [7, 2, 42])
    problem = AttnProblem.from_tensors(q, k, k, mask=mask, layout="bshd")
    hidden = hide_padding(problem, Inputs(q, k, k))
    assert hidden.k.stride() == k.stride() == tuple(problem.k.stride)
    lens = torch.tensor([7, 2, 42])
    expect = torch.where((torch.arange(42)[None, :] < lens[:, None])[..., None, None], k, 0)
    assert torch.equal(hidden.k, expect) and torch.equal(hidden.v, expect)
