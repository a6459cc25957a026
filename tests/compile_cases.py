"""Attention calls for the torch.compile / export / torch.func tests: one per feature of the contract.

Each case is ``(fn, make_args)``: ``fn(*args)`` calls a public surface and builds its masks inside
(so the compiler traces mask construction too), ``make_args()`` returns fresh float64 inputs, the
differentiable ones with ``requires_grad``.
"""

from __future__ import annotations

import torch

import cudnn_attn as ca
from cudnn_attn import Alibi, Causal, Neighborhood, Padding, RelPosBias, SlidingWindow
from cudnn_attn import neighborhood as nat

B, H, D = 2, 2, 8


def rand(*shape, grad=True, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, requires_grad=grad)


def qkv(s_q=12, s_kv=None, heads_kv=H, d_v=D, layout="bhsd", heads=H):
    s_kv = s_q if s_kv is None else s_kv
    if layout == "bhsd":
        return rand(B, heads, s_q, D), rand(B, heads_kv, s_kv, D), rand(B, heads_kv, s_kv, d_v)
    return rand(B, s_q, heads, D), rand(B, s_kv, heads_kv, D), rand(B, s_kv, heads_kv, d_v)


def _lens(*values):
    return torch.tensor(values)


ATTENTION = {
    "none": (lambda q, k, v: ca.attention(q, k, v), lambda: qkv()),
    "causal_top_left": (lambda q, k, v: ca.attention(q, k, v, mask=Causal()),
                        lambda: qkv(9, 12)),
    "causal_bottom_right": (lambda q, k, v: ca.attention(q, k, v, mask=Causal("bottom_right")),
                            lambda: qkv(7, 12)),
    "sliding_window": (lambda q, k, v: ca.attention(q, k, v, mask=SlidingWindow(3, 1)),
                       lambda: qkv(12)),
    "sliding_window_bottom_right": (
        lambda q, k, v: ca.attention(q, k, v, mask=SlidingWindow(2, 0, "bottom_right")),
        lambda: qkv(9, 12)),
    "neighborhood_1d": (lambda q, k, v: ca.attention(q, k, v, mask=Neighborhood(16, 5, dilation=2)),
                        lambda: qkv(16)),
    "neighborhood_2d": (lambda q, k, v: ca.attention(
        q, k, v, mask=Neighborhood((4, 5), 3, stride=(1, 2), is_causal=(True, False))),
        lambda: qkv(20)),
    "neighborhood_3d": (lambda q, k, v: ca.attention(
        q, k, v, mask=Neighborhood((2, 4, 6), (2, 3, 3), dilation=(1, 1, 2))),
        lambda: qkv(48)),
    "padding_int": (lambda q, k, v: ca.attention(q, k, v, mask=Padding([5, 12], [7, 10])),
                    lambda: qkv(12)),
    "padding_tensor": (lambda q, k, v, lq, lk: ca.attention(
        q, k, v, mask=Padding(lq, lk) & Causal("bottom_right")),
        lambda: (*qkv(12), _lens(5, 12), _lens(7, 10))),
    "alibi": (lambda q, k, v: ca.attention(q, k, v, mask=Causal(), bias=Alibi()),
              lambda: qkv(12)),
    "tensor_bias": (lambda q, k, v, b: ca.attention(q, k, v, bias=b, mask=SlidingWindow(4, 4)),
                    lambda: (*qkv(12), rand(1, H, 12, 12))),
    "rel_pos_bias": (lambda q, k, v, t: ca.attention(q, k, v, mask=Neighborhood((4, 4), 3),
                                                     bias=RelPosBias(t)),
                     lambda: (*qkv(16), rand(H, 5, 5))),
    "softcap": (lambda q, k, v: ca.attention(q, k, v, mask=Causal(), softcap=2.0),
                lambda: qkv(12)),
    "dropout": (lambda q, k, v: ca.attention(q, k, v, dropout_p=0.25), lambda: qkv(12)),
    "gqa": (lambda q, k, v: ca.attention(q, k, v, mask=Causal()),
            lambda: qkv(12, heads=4, heads_kv=2)),
    "dv_ne_dqk_bshd_lse": (lambda q, k, v: ca.attention(q, k, v, layout="bshd", return_lse=True,
                                                        mask=Causal("bottom_right")),
                           lambda: qkv(7, 12, d_v=5, layout="bshd")),
}


def _heads_last(*spatial, heads=H, d=D):
    return tuple(rand(B, *spatial, heads, d) for _ in range(3))


SURFACES = {
    "na1d": (lambda q, k, v: nat.na1d(q, k, v, kernel_size=5, dilation=2),
             lambda: _heads_last(16)),
    "na2d_causal_lse": (lambda q, k, v: nat.na2d(q, k, v, kernel_size=3, is_causal=(True, False),
                                                 return_lse=True),
                        lambda: _heads_last(4, 5)),
    "na3d_stride": (lambda q, k, v: nat.na3d(q, k, v, kernel_size=(2, 3, 3), stride=(1, 2, 1)),
                    lambda: _heads_last(2, 4, 4)),
    "na2d_rpb": (lambda q, k, v, r: nat.na2d(q, k, v, kernel_size=3, rpb=r),
                 lambda: (*_heads_last(4, 5), rand(H, 5, 5))),
    "na1d_additional_kv": (
        lambda q, k, v, ak, av: nat.na1d(q, k, v, kernel_size=5, additional_keys=ak,
                                         additional_values=av),
        lambda: (*_heads_last(16), rand(B, 3, H, D), rand(B, 3, H, D))),
    "na2d_qk_av_unfused": (
        lambda q, k, v: nat.na2d_av(nat.na2d_qk(q, k, kernel_size=3).softmax(-1), v,
                                    kernel_size=3),
        lambda: tuple(rand(B, H, 4, 5, D) for _ in range(3))),
}


def _cu(*lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


ENTRIES = {  # varlen and KV-cache entry points (one op each; backward by recompute)
    "varlen_causal_alibi_lse": (
        lambda q, k, v, cq, ck: ca.attention_varlen(q, k, v, cq, ck, 8, 8,
                                                    mask=Causal("bottom_right"), bias=Alibi(),
                                                    return_lse=True),
        lambda: (rand(10, 4, D), rand(13, 2, D), rand(13, 2, 6), _cu(3, 7), _cu(6, 7))),
    "varlen_window_bias": (
        lambda q, k, v, cq, ck, b: ca.attention_varlen(q, k, v, cq, ck, 7, 7,
                                                       mask=SlidingWindow(2, 1), bias=b),
        lambda: (rand(10, 2, D), rand(10, 2, D), rand(10, 2, D), _cu(7, 3), _cu(7, 3),
                 rand(2, 2, 7, 7))),
    "kvcache_tensor_lengths": (
        lambda q, kc, vc, lens: ca.attention_with_kvcache(q, kc, vc, lens,
                                                          mask=Causal("bottom_right")),
        lambda: (rand(2, 3, 4, D), rand(2, 9, 2, D), rand(2, 9, 2, D), _lens(5, 9))),
    "kvcache_paged_lse": (
        lambda q, kc, vc, lens, table: ca.attention_with_kvcache(
            q, kc, vc, lens, block_table=table, return_lse=True),
        lambda: (rand(2, 1, 2, D), rand(5, 4, 2, D), rand(5, 4, 2, D), _lens(6, 3),
                 torch.tensor([[3, 1], [4, 0]]))),
}


def _module(factory):
    def make():
        torch.manual_seed(0)
        return factory().double()
    return make


MODULES = {  # name -> (module factory, make_args, call(module, *args))
    "NeighborhoodAttention1D": (_module(lambda: nat.NeighborhoodAttention1D(16, 2, kernel_size=3)),
                                lambda: (rand(B, 9, 16),), lambda m, x: m(x)),
    "NeighborhoodAttention2D_rpb": (
        _module(lambda: nat.NeighborhoodAttention2D(16, 2, kernel_size=3, rel_pos_bias=True)),
        lambda: (rand(B, 5, 6, 16),), lambda m, x: m(x)),
    "NeighborhoodAttention3D": (_module(lambda: nat.NeighborhoodAttention3D(16, 2, kernel_size=2)),
                                lambda: (rand(1, 3, 4, 4, 16),), lambda m, x: m(x)),
    "MultiheadAttention_gqa_alibi_padding": (
        _module(lambda: ca.nn.MultiheadAttention(16, 4, num_kv_heads=2, mask=Causal(),
                                                 alibi=True)),
        lambda: (rand(B, 9, 16), _lens(5, 9)), lambda m, x, lens: m(x, mask=Padding(lens))),
    "MultiheadAttention_cross_lse": (
        _module(lambda: ca.nn.MultiheadAttention(16, 4, cross_attention=True, kdim=12)),
        lambda: (rand(B, 9, 16), rand(B, 7, 12)), lambda m, x, c: m(x, c, return_lse=True)),
}


def outputs(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def grads(result, wrt) -> tuple:
    """Gradients of a fixed random-free scalar of the outputs (each output times its index + 1)."""
    total = sum((i + 1) * torch.where(torch.isfinite(o), o, 0).sum()
                for i, o in enumerate(outputs(result)))
    return torch.autograd.grad(total, wrt, allow_unused=True)


def cold():
    """Dynamo reset and every cache cleared: the next compile is cold."""
    torch._dynamo.reset()
    ca.clear_caches()


def assert_one_graph(fn, *args):
    """Cold, ``fn(*args)`` traces as one graph with no break."""
    cold()
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
    assert explanation.graph_count == 1


def differentiable(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def assert_eager_equal(fn, args, extra_wrt=(), backend="aot_eager", tol=1e-12):
    """Compiled forward and gradients equal eager's (same dropout stream: same seed first)."""
    cold()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    wrt = differentiable(args) + list(extra_wrt)
    torch.manual_seed(123)
    got = compiled(*args)
    torch.manual_seed(123)
    want = fn(*args)
    for g, w in zip(outputs(got), outputs(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    for g, w in zip(grads(got, wrt), grads(want, wrt), strict=True):
        assert w is not None and g is not None
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
