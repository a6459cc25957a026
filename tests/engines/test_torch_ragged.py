"""The torch engine runs packed (``Ragged``) problems as they are given (issue 36, item 5d): the
engine of last resort for every varlen call, e.g. dropout with a head dim cuDNN cannot take
(D % 8 != 0), where the forward fell back to dense batches and the backward, pinned to a packed
engine by its dropout mask, found none ("no backend can run").

Oracle: each sequence on its own in float64 (FlashAttention's bottom-right causal diagonal,
``seqused_k``), autograd for the gradients; with dropout, the keep mask the forward reports."""

import math

import pytest
import torch

from cudnn_attn.core import dispatch, execution
from cudnn_attn.model.inputs import DropoutState, Inputs
from cudnn_attn.model.masks import Causal
from cudnn_attn.packed.calls import varlen_problem

F64 = torch.float64
LENS_Q, LENS_K = [5, 0, 9, 1], [7, 3, 11, 4]
HQ, HKV, D, DV = 4, 2, 12, 20  # head dims cuDNN does not take


def cu(lens):
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(LENS_Q), HQ, D, generator=g, dtype=F64)
    k = torch.randn(sum(LENS_K), HKV, D, generator=g, dtype=F64)
    v = torch.randn(sum(LENS_K), HKV, DV, generator=g, dtype=F64)
    return q, k, v


def problem_of(q, k, v, seqused_k=None, **kw):
    return varlen_problem(q, k, v, cu(LENS_Q), cu(LENS_K), max(LENS_Q), max(LENS_K),
                          mask=Causal("bottom_right"), read=seqused_k is None,
                          seqused_k=seqused_k, return_lse=True, **kw)


def oracle(q, k, v, used_k, keep=None, p=0.0):
    """Per sequence, float64: ``(out [total_q, H, D_v], lse [H, total_q])``; ``keep`` (padded
    ``[B, H, S_q, S_k]``) applies a dropout mask scaled by ``1 / (1 - p)``."""
    outs, lses = [], []
    cq, ck = cu(LENS_Q).tolist(), cu(LENS_K).tolist()
    for b, (lq, lk) in enumerate(zip(LENS_Q, used_k)):
        qb = q[cq[b]:cq[b] + lq].transpose(0, 1)
        kb = k[ck[b]:ck[b] + lk].repeat_interleave(HQ // HKV, 1).transpose(0, 1)
        vb = v[ck[b]:ck[b] + lk].repeat_interleave(HQ // HKV, 1).transpose(0, 1)
        s = qb @ kb.transpose(-1, -2) / math.sqrt(D)
        i, j = torch.arange(lq)[:, None], torch.arange(lk)[None, :]
        s = s.masked_fill(j > i + (lk - lq), -math.inf)
        lse = s.logsumexp(-1)
        prob = torch.nan_to_num(torch.exp(s - lse[..., None]))
        if keep is not None:
            prob = prob * keep[b, :, :lq, :lk] / (1 - p)
        outs.append((prob @ vb).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("used", [None, [6, 0, 11, 2]], ids=["cu_seqlens", "seqused_k"])
def test_packed_forward_and_backward_match_the_oracle(used):
    q, k, v = packed()
    seqused = None if used is None else torch.tensor(used, dtype=torch.int32)
    problem = problem_of(q, k, v, seqused)
    engine = dispatch.get_backend("torch")
    assert engine.supports(problem) == []
    plan = engine.plan(problem)
    out, lse = execution.forward(problem, plan, Inputs(q, k, v))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want, want_lse = oracle(*leaves, used or LENS_K)
    torch.testing.assert_close(out, want.detach())
    torch.testing.assert_close(lse, want_lse.detach())  # -inf on the rows of no key
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    dq, dk, dv, _ = execution.backward(problem, plan, Inputs(q, k, v), out, lse, dout)
    for name, got, exp in zip("qkv", (dq, dk, dv), torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(got, exp, msg=name)


def test_packed_dropout_backward_replays_the_forwards_mask():
    q, k, v = packed(2)
    p = 0.3
    problem = problem_of(q, k, v, dropout_p=p)
    found = execution.plan_stored(problem)  # no engine reads packed tensors here but torch's
    assert found is not None and found[0].name == "torch"
    _, problem, plan = found
    inputs = Inputs(q, k, v, None, DropoutState(11, 4))
    weights: dict = {}
    out, lse = execution.forward(problem, plan, inputs, weights=weights)
    keep = weights["dropped"] != 0
    assert 0.5 < keep[weights["probs"] > 0].double().mean() < 0.9
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want, _ = oracle(*leaves, LENS_K, keep.double(), p)
    torch.testing.assert_close(out, want.detach())
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    dq, dk, dv, _ = execution.backward(problem, plan, inputs, out, lse, dout)
    for name, got, exp in zip("qkv", (dq, dk, dv), torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(got, exp, msg=name)


def test_without_dropout_packed_calls_keep_the_dense_batches():
    # The dense-batch path gives the torch engine one batch per length group: plan_stored
    # leaves it the call unless a dropout mask pins the packed problem to it.
    q, k, v = packed()
    assert execution.plan_stored(problem_of(q, k, v)) is None


def test_paged_caches_stay_declined():
    from cudnn_attn.model.storage import Paged
    import dataclasses

    q, k, v = packed()
    paged = dataclasses.replace(problem_of(q, k, v), storage=Paged(num_blocks=4, page_size=8))
    assert "dense batches" in dispatch.get_backend("torch").supports(paged)[0]
