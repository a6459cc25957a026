"""FlashAttention's Python API under torch.compile(fullgraph=True) and torch.export: zero graph
breaks (``torch._dynamo.explain``), cold, forward and backward equal to the eager call (which runs
``mha_fwd``/``mha_bwd``), and the eager call itself against a float64 brute force."""

from __future__ import annotations

import math

import pytest
import torch
from compile_cases import assert_eager_equal, assert_one_graph

from cudnn_attn.flash_attn_interface import (flash_attn_func, flash_attn_kvpacked_func,
                                             flash_attn_qkvpacked_func, flash_attn_varlen_func)


def rand(*shape, grad=True):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=grad)


def _cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


SLOPES_H = torch.tensor([0.5, 0.25, 0.125, 0.0625])  # fp32, as FlashAttention requires
SLOPES_BH = torch.rand(2, 4, generator=torch.Generator().manual_seed(3))

CASES = {  # name -> (fn, make_args)
    "causal_gqa_bottom_right": (lambda q, k, v: flash_attn_func(q, k, v, causal=True),
                                lambda: (rand(2, 7, 4, 8), rand(2, 12, 2, 8), rand(2, 12, 2, 8))),
    "window_softcap_scale": (
        lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=0.3, window_size=(3, 1),
                                        softcap=2.0),
        lambda: (rand(2, 12, 2, 8), rand(2, 12, 2, 8), rand(2, 12, 2, 8))),
    "dv_ne_d_lse": (lambda q, k, v: flash_attn_func(q, k, v, causal=True,
                                                    return_attn_probs=True)[:2],
                    lambda: (rand(2, 9, 2, 8), rand(2, 9, 2, 8), rand(2, 9, 2, 5))),
    "alibi_slopes_h": (lambda q, k, v: flash_attn_func(q, k, v, causal=True,
                                                       alibi_slopes=SLOPES_H),
                       lambda: (rand(2, 7, 4, 8), rand(2, 12, 2, 8), rand(2, 12, 2, 8))),
    "alibi_slopes_bh_window": (
        lambda q, k, v: flash_attn_func(q, k, v, window_size=(3, 2), alibi_slopes=SLOPES_BH),
        lambda: (rand(2, 9, 4, 8), rand(2, 9, 4, 8), rand(2, 9, 4, 8))),
    "dropout": (lambda q, k, v: flash_attn_func(q, k, v, dropout_p=0.25, causal=True),
                lambda: (rand(2, 10, 2, 8), rand(2, 10, 2, 8), rand(2, 10, 2, 8))),
    "qkvpacked": (lambda qkv: flash_attn_qkvpacked_func(qkv, causal=True),
                  lambda: (rand(2, 9, 3, 2, 8),)),
    "kvpacked_window": (lambda q, kv: flash_attn_kvpacked_func(q, kv, window_size=(2, 0)),
                        lambda: (rand(2, 6, 4, 8), rand(2, 11, 2, 2, 8))),
    "varlen_causal_lse": (
        lambda q, k, v, cq, ck: flash_attn_varlen_func(q, k, v, cq, ck, 7, 8, causal=True,
                                                       return_attn_probs=True)[:2],
        lambda: (rand(10, 4, 8), rand(13, 2, 8), rand(13, 2, 8), _cu(3, 7), _cu(5, 8))),
    "varlen_window": (
        lambda q, k, v, cq, ck: flash_attn_varlen_func(q, k, v, cq, ck, 7, 7,
                                                       window_size=(2, 1)),
        lambda: (rand(10, 2, 8), rand(10, 2, 8), rand(10, 2, 8), _cu(7, 3), _cu(7, 3))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_without_breaks_and_equals_eager(name):
    fn, make = CASES[name]
    args = make()
    assert_one_graph(fn, *args)
    assert_eager_equal(fn, args)


def _brute_force(q, k, v, scale, visible):
    """float64 FlashAttention semantics, [B, S, H, D], GQA by repeating kv heads."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~visible, -math.inf)
    lse = s.logsumexp(-1)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v), lse


def test_eager_reference_is_flash_attention_semantics():
    """The eager call the compiled one is compared with: bottom-right causal GQA with
    ``S_q < S_k`` against the float64 brute force (query i sees keys j <= i + S_k - S_q)."""
    q, k, v = rand(2, 5, 4, 8, grad=False), rand(2, 9, 2, 8, grad=False), \
        rand(2, 9, 2, 8, grad=False)
    i, j = torch.arange(5)[:, None], torch.arange(9)[None]
    want, want_lse = _brute_force(q, k, v, 8 ** -0.5, j <= i + 4)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True),
                             fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), want, rtol=1e-12, atol=1e-12)


class _Wrap(torch.nn.Module):
    def forward(self, q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=(4, -1), softcap=3.0)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
def test_export(strict):
    """One opaque op in the exported graph; the program equals the eager call."""
    q, k, v = rand(1, 6, 2, 8, grad=False), rand(1, 9, 2, 8, grad=False), \
        rand(1, 9, 2, 8, grad=False)
    program = torch.export.export(_Wrap(), (q, k, v), strict=strict)
    ours = [str(n.target) for n in program.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("cudnn_attn.")]
    assert ours == ["cudnn_attn.attention_forward.default"]
    torch.testing.assert_close(program.module()(q, k, v), _Wrap()(q, k, v), rtol=0, atol=0)


def test_meta_inputs_propagate_shapes():
    q, k, v = (torch.empty(2, 5, 4, 8, device="meta"), torch.empty(2, 9, 2, 8, device="meta"),
               torch.empty(2, 9, 2, 6, device="meta"))
    out, lse, probs = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == (2, 5, 4, 6) and out.device.type == "meta"
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    assert probs.numel() == 0
