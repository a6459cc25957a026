"""Bad arguments get a clear ValueError/TypeError naming the argument — never silent garbage, a
crash deep inside, or an allocator error. One row per argument the data-safety review found."""

from __future__ import annotations

import math

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn import neighborhood as nb
from cudnn_attn.compat.cudnn_frontend import (SdpaAttributes, SdpaBackwardAttributes,
                                               scaled_dot_product_flash_attention,
                                               scaled_dot_product_flash_attention_backward)

Q = torch.randn(1, 2, 8, 16)
PACKED = Q[0].transpose(0, 1).contiguous()
CU = torch.tensor([0, 8], dtype=torch.int32)
EMPTY_HEADS = torch.randn(1, 6, 6, 2, 0)

CASES = {
    "alibi NaN slope": (lambda: ca.attention(Q, Q, Q, bias=ca.Alibi([math.nan, 1.0])),
                        ValueError, "Alibi slopes"),
    "alibi inf slope tensor": (lambda: ca.Alibi(torch.tensor([1.0, math.inf])), ValueError,
                               "Alibi slopes"),
    "alibi NaN slope per batch": (lambda: ca.Alibi([[0.5, math.nan]]), ValueError,
                                  "Alibi slopes"),
    "return_lse string": (lambda: ca.attention(Q, Q, Q, return_lse="yes"), TypeError,
                          "return_lse"),
    "return_lse int": (lambda: ca.attention(Q, Q, Q, return_lse=1), TypeError, "return_lse"),
    "explain return_lse": (lambda: ca.explain(Q, Q, Q, return_lse="yes"), TypeError,
                           "return_lse"),
    "generator string": (lambda: ca.attention(Q, Q, Q, dropout_p=0.1, generator="x"), TypeError,
                         "generator"),
    "window beyond int32": (lambda: ca.SlidingWindow(10 ** 30, 0), ValueError, "left"),
    "window right beyond int32": (lambda: ca.SlidingWindow(0, 2 ** 31), ValueError, "right"),
    "padding beyond int32": (lambda: ca.Padding([2 ** 40]), ValueError, "seq_lens_q"),
    "varlen max_seqlen beyond int32": (
        lambda: ca.attention_varlen(PACKED, PACKED, PACKED, CU, CU, 2 ** 40, 8), ValueError,
        "max_seqlen_q"),
    "na2d head dim 0": (lambda: nb.na2d(EMPTY_HEADS, EMPTY_HEADS, EMPTY_HEADS, 3), ValueError,
                        "head dim"),
    "na2d head dim 0 with scale": (
        lambda: nb.na2d(EMPTY_HEADS, EMPTY_HEADS, EMPTY_HEADS, 3, scale=0.5), ValueError,
        "head dim"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_argument_is_named(name):
    call, error, word = CASES[name]
    with pytest.raises(error, match=word):
        call()


def test_a_valid_call_does_not_vouch_for_an_invalid_one():
    # The per-call cache keys on the arguments: a cached return_lse=True must not let "yes" in.
    ca.attention(Q, Q, Q, return_lse=True)
    with pytest.raises(TypeError, match="return_lse"):
        ca.attention(Q, Q, Q, return_lse="yes")


def test_a_generous_max_seqlen_costs_nothing():
    # max_seqlen is an upper bound (FlashAttention): 10**6 with 8 tokens runs on 8 tokens.
    out = ca.attention_varlen(PACKED, PACKED, PACKED, CU, CU, 10 ** 6, 10 ** 6)
    want = ca.attention_varlen(PACKED, PACKED, PACKED, CU, CU, 8, 8)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_a_generous_max_seqlen_with_a_bias_of_that_size():
    bias = torch.randn(1, 2, 20, 24)
    out = ca.attention_varlen(PACKED, PACKED, PACKED, CU, CU, 20, 24, bias=bias)
    want = ca.attention(Q, Q, Q, bias=bias[..., :8, :8])
    torch.testing.assert_close(out, want[0].transpose(0, 1))


def _builder_tensors():
    q = torch.randn(1, 2, 8, 16)
    attrs = SdpaAttributes().set_attn_scale(0.25).set_generate_stats(True)
    o, stats = scaled_dot_product_flash_attention(q, q, q, attrs)
    return q, o, stats, SdpaBackwardAttributes().set_attn_scale(0.25)


@pytest.mark.parametrize("which, change, error, word", [
    ("o", lambda t: t.to("meta"), ValueError, "o must be on"),
    ("dO", lambda t: t.to("meta"), ValueError, "dO must be on"),
    ("stats", lambda t: t.to("meta"), ValueError, "stats must be on"),
    ("dO", lambda t: t.half(), TypeError, "dO must have q's dtype"),
    ("o", lambda t: t.double(), TypeError, "o must have q's dtype"),
    ("stats", lambda t: t.half(), TypeError, "stats must be torch.float32"),
])
def test_builder_backward_checks_device_and_dtype(which, change, error, word):
    q, o, stats, back = _builder_tensors()
    args = {"o": o, "dO": torch.randn_like(o), "stats": stats}
    args[which] = change(args[which])
    with pytest.raises(error, match=word):
        scaled_dot_product_flash_attention_backward(q, q, q, args["o"], args["dO"],
                                                    args["stats"], back)


def test_builder_backward_still_matches_autograd():
    q, o, stats, back = _builder_tensors()
    dout = torch.randn_like(o)
    got = scaled_dot_product_flash_attention_backward(q, q, q, o, dout, stats, back)
    leaf = [q.clone().double().requires_grad_() for _ in range(3)]
    ref = torch.softmax(leaf[0] @ leaf[1].transpose(-1, -2) * 0.25, -1) @ leaf[2]
    want = torch.autograd.grad(ref, leaf, dout.double())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)
