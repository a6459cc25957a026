"""The torch engine hands back its attention weights (``execution.forward(..., weights=)``),
against a float64 brute force: the weights FlashAttention's ``return_softmax`` encodes, computed
in the same pass as the output (O(S_q S_k) extra), never by a second call with ``v = I``."""

from __future__ import annotations

import pytest
import torch

import oracle
from common import lib_mask, qkv
from cudnn_attn.core import execution
from cudnn_attn.model.inputs import DropoutState, Inputs
from cudnn_attn.model.problem import AttnProblem

F64 = torch.float64

CASES = {  # (B, H, H_kv, S_q, S_kv, mask description)
    "dense_gqa": (2, 4, 2, 9, 11, {}),
    # long enough for boxes of keys per tile, with rows shared by the last tile
    "window_tiles": (1, 2, 2, 300, 300, {"window": (20, 5)}),
    "causal_bottom_right_padding": (2, 2, 1, 12, 17, {"causal": "bottom_right",
                                                      "seq_lens_q": [12, 5],
                                                      "seq_lens_kv": [17, 9]}),
    "neighborhood_2d": (1, 2, 2, 270, 270, {"neighborhood": {"spatial_shape": (15, 18),
                                                          "kernel_size": (3, 5)}}),
}


def _weights_oracle(q, k, desc):
    """float64 weights [B, H, S_q, S_kv]: attention with v = I."""
    B, _, Sq, _ = q.shape
    Skv = k.shape[2]
    eye = torch.eye(Skv, dtype=F64).expand(B, k.shape[1], Skv, Skv)
    visible = oracle.build_visibility(B, Sq, Skv, **desc) if desc else None
    probs, _ = oracle.reference_attention(q, k, eye, visible)
    return probs


def _run(q, k, v, desc, dropout_p=0.0):
    problem = AttnProblem.from_tensors(q, k, v, mask=lib_mask(**desc), dropout_p=dropout_p,
                                       return_lse=True)
    engine, problem, plan = execution.plan_call(problem, "torch")
    assert engine.name == "torch"
    weights = {}
    dropout = DropoutState(3, 0) if dropout_p else None
    out, _ = execution.forward(problem, plan, Inputs(q, k, v, None, dropout), weights=weights)
    return out, weights


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_weights_match_the_oracle(name, dtype):
    B, H, Hkv, Sq, Skv, desc = CASES[name]
    q, k, v = qkv(B, H, Sq, 8, Skv=Skv, Hkv=Hkv, dtype=dtype, seed=1)
    out, weights = _run(q, k, v, desc)
    want = _weights_oracle(q.double(), k.double(), desc)
    assert set(weights) == {"probs", "dropped"}
    assert weights["probs"].shape == (B, H, Sq, Skv)
    tol = {"atol": 1e-10, "rtol": 1e-10} if dtype == F64 else {"atol": 1e-6, "rtol": 1e-5}
    torch.testing.assert_close(weights["probs"].double(), want, **tol)
    torch.testing.assert_close(weights["dropped"], weights["probs"], atol=0, rtol=0)
    # The weights are the ones the output was made of.
    rep = H // Hkv
    torch.testing.assert_close(
        out.double(), weights["probs"].double() @ v.double().repeat_interleave(rep, 1), **tol)


def test_dropout_weights_are_the_applied_mask():
    q, k, v = qkv(2, 4, 40, 8, Hkv=2, dtype=F64, seed=2)
    out, weights = _run(q, k, v, {"causal": "top_left"}, dropout_p=0.3)
    probs, dropped = weights["probs"], weights["dropped"]
    torch.testing.assert_close(probs, _weights_oracle(q, k, {"causal": "top_left"}))
    kept = dropped != 0
    torch.testing.assert_close(dropped, probs * kept / 0.7)
    assert 0.6 < kept[probs > 0].double().mean() < 0.8
    torch.testing.assert_close(out, dropped @ v.repeat_interleave(2, 1))
    # Asking for the weights does not change the mask: the same call without them.
    problem = AttnProblem.from_tensors(q, k, v, mask=lib_mask(causal="top_left"), dropout_p=0.3,
                                       return_lse=True)
    _, problem, plan = execution.plan_call(problem, "torch")
    plain, _ = execution.forward(problem, plan, Inputs(q, k, v, None, DropoutState(3, 0)))
    torch.testing.assert_close(plain, out, atol=0, rtol=0)
