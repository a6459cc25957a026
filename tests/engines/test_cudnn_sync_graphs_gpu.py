"""GPU (marked), issue 35: the cuDNN engine's call path never synchronises, and its calls can be
captured in a CUDA graph. Skips cleanly without CUDA/cuDNN.

* No sync: after a warm-up (graph builds, one-time copies of static lengths), each kind of call
  -- dense, causal, window, static and runtime ``Padding``, bias, ALiBi, dropout (default and
  CUDA generator), packed varlen, paged decode -- runs forward and backward under
  ``torch.cuda.set_sync_debug_mode("error")``, where any synchronising CUDA call raises.
* CUDA graphs: a warmed-up call (dense, causal, window, runtime ``Padding``, paged decode,
  packed self-attention; forward, and forward + backward where it has one) is captured once and replayed with new
  inputs and new lengths copied into the captured tensors; every replay equals the eager call.
  Dropout under capture raises ``NotSupportedError`` (never one mask repeated).
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.varlen import attention_varlen, attention_with_kvcache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                       reason="nvidia-cudnn-frontend is not installed"),
]

BF16 = torch.bfloat16


@contextlib.contextmanager
def sync_free():
    """Any synchronising CUDA call inside raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _dense(B=2, H=4, S=256, D=64, grad=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, S, D, device="cuda", dtype=BF16, generator=g).requires_grad_(grad)
            for _ in range(3)]


def _forward_backward(call):
    def run():
        q, k, v = _dense()
        out = call(q, k, v)
        out.backward(torch.ones_like(out))
    return run


_CONSTANTS: dict = {}


def _on_device(name, values):
    """A device int32 tensor made once, in the warm-up (a host list copied to the device is a
    synchronising copy: the thing the calls themselves must not do)."""
    if name not in _CONSTANTS:
        _CONSTANTS[name] = torch.tensor(values, dtype=torch.int32, device="cuda")
    return _CONSTANTS[name]


def _cuda_gen():
    if "gen" not in _CONSTANTS:
        _CONSTANTS["gen"] = torch.Generator(device="cuda").manual_seed(5)
    return _CONSTANTS["gen"]


def _varlen():
    cu = _on_device("cu", [0, 37, 165, 170])
    q, k, v = (torch.randn(170, 4, 64, device="cuda", dtype=BF16, requires_grad=True)
               for _ in range(3))
    out = attention_varlen(q, k, v, cu, cu, 128, 128, mask=ca.Causal("bottom_right"),
                           backend="cudnn")
    out.backward(torch.ones_like(out))


def _paged_decode():
    pages, page = 16, 64
    k_cache, v_cache = (torch.randn(pages, page, 2, 64, device="cuda", dtype=BF16)
                        for _ in range(2))
    table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
    seqlens = _on_device("seqlens", [200, 17])
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=BF16)
    attention_with_kvcache(q, k_cache, v_cache, seqlens, block_table=table, backend="cudnn")


CALLS = {
    "dense": _forward_backward(lambda q, k, v: ca.attention(q, k, v, backend="cudnn")),
    "causal": _forward_backward(lambda q, k, v: ca.attention(q, k, v, mask=ca.Causal(),
                                                             backend="cudnn")),
    "window": _forward_backward(lambda q, k, v: ca.attention(
        q, k, v, mask=ca.SlidingWindow(31, 0), backend="cudnn")),
    "padding-static": _forward_backward(lambda q, k, v: ca.attention(
        q, k, v, mask=ca.Causal() & ca.Padding([256, 100], [200, 256]), backend="cudnn")),
    "padding-runtime": _forward_backward(lambda q, k, v: ca.attention(
        q, k, v, mask=ca.Padding(_on_device("lens", [256, 100])), backend="cudnn")),
    "bias": _forward_backward(lambda q, k, v: ca.attention(
        q, k, v, bias=torch.ones(1, 4, 256, 256, device="cuda", dtype=BF16), backend="cudnn")),
    "alibi": _forward_backward(lambda q, k, v: ca.attention(
        q, k, v, mask=ca.Causal(), bias=ca.Alibi(), backend="cudnn")),
    "dropout": _forward_backward(lambda q, k, v: ca.attention(q, k, v, dropout_p=0.1,
                                                              backend="cudnn")),
    "dropout-cuda-generator": _forward_backward(lambda q, k, v: ca.attention(
        q, k, v, dropout_p=0.1, generator=_cuda_gen(), backend="cudnn")),
    "varlen": _varlen,
    "paged-decode": _paged_decode,
}


@pytest.mark.parametrize("name", list(CALLS))
def test_calls_never_synchronise_after_warm_up(name):
    call = CALLS[name]
    call()
    call()  # warm: graphs built, static lengths on the device, workspace pooled
    with sync_free():
        call()
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------

def _capture(fn, warmups=3):
    """``(graph, outputs)`` of ``fn`` captured after warm-up on a side stream (PyTorch's
    recipe); the capture runs on a stream of its own, as ``torch.cuda.graph`` does by
    default."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    torch.cuda.synchronize()
    return graph, outputs


FORWARD_MASKS = {
    "dense": lambda lens: None,
    "causal": lambda lens: ca.Causal(),
    "window": lambda lens: ca.SlidingWindow(20, 5),
    "padding-runtime": lambda lens: ca.Causal("bottom_right") & ca.Padding(lens[0], lens[1]),
}


@pytest.mark.parametrize("name", list(FORWARD_MASKS))
def test_forward_and_backward_replay_with_new_inputs_and_lengths(name):
    static_q, static_k, static_v = (t.detach().requires_grad_(True) for t in _dense(seed=1))
    static_dout = torch.randn_like(static_q)
    static_lens = (torch.tensor([256, 90], dtype=torch.int32, device="cuda"),
                   torch.tensor([200, 256], dtype=torch.int32, device="cuda"))

    def step():
        for t in (static_q, static_k, static_v):
            t.grad = None
        out = ca.attention(static_q, static_k, static_v, mask=FORWARD_MASKS[name](static_lens),
                           backend="cudnn")
        out.backward(static_dout)
        return out

    graph, static_out = _capture(step)
    for seed, lens in ((2, ([13, 256], [256, 40])), (3, ([256, 256], [1, 256]))):
        fresh = _dense(seed=seed, grad=False)
        for static, value in zip((static_q, static_k, static_v), fresh):
            static.data.copy_(value)
        static_dout.copy_(torch.randn_like(static_dout))
        for static, value in zip(static_lens, lens):
            static.copy_(torch.tensor(value, dtype=torch.int32))
        graph.replay()
        q, k, v = (t.detach().clone().requires_grad_(True) for t in fresh)
        eager_lens = tuple(t.clone() for t in static_lens)
        out = ca.attention(q, k, v, mask=FORWARD_MASKS[name](eager_lens), backend="cudnn")
        out.backward(static_dout)
        torch.testing.assert_close(static_out, out, atol=0, rtol=0)  # same kernel, same inputs
        for static, eager in zip((static_q, static_k, static_v), (q, k, v)):
            # cuDNN's (non-deterministic) backward accumulates dQ in any order: bf16 rounding
            torch.testing.assert_close(static.grad, eager.grad, atol=2e-2, rtol=2e-2)


def test_paged_decode_replays_with_new_lengths_and_tables():
    pages, page = 32, 64
    k_cache, v_cache = (torch.randn(pages, page, 2, 64, device="cuda", dtype=BF16)
                        for _ in range(2))
    table = torch.arange(8, dtype=torch.int32, device="cuda").view(2, 4)
    seqlens = torch.tensor([200, 17], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=BF16)

    def step():
        return attention_with_kvcache(q, k_cache, v_cache, seqlens, block_table=table,
                                      backend="cudnn")

    graph, static_out = _capture(step)
    for lens, pages_of in (([64, 255], [[8, 9, 10, 11], [3, 2, 1, 0]]),
                           ([1, 130], [[31, 30, 29, 28], [12, 13, 14, 15]])):
        q.copy_(torch.randn_like(q))
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        table.copy_(torch.tensor(pages_of, dtype=torch.int32))
        graph.replay()
        eager = attention_with_kvcache(q, k_cache, v_cache, seqlens.clone(),
                                       block_table=table.clone(), backend="cudnn")
        torch.testing.assert_close(static_out, eager, atol=0, rtol=0)


def test_packed_self_attention_replays_with_new_offsets():
    """flash_attn_varlen_func's training call (one offsets tensor for queries and keys), forward
    and backward, captured once the kept runner serves it (``graphs.ragged_call``): replays with
    new tokens and new offsets copied in equal the eager call, whose lengths and ragged offsets
    the capture derives on the device at every replay."""
    from cudnn_attn.flash_attn_interface import flash_attn_varlen_func

    static = [torch.randn(256, 4, 64, device="cuda", dtype=BF16).requires_grad_(True)
              for _ in range(3)]
    static_dout = torch.randn_like(static[0])
    offsets = torch.tensor([0, 100, 130, 250], dtype=torch.int32, device="cuda")

    def step():
        for t in static:
            t.grad = None
        out = flash_attn_varlen_func(*static, offsets, offsets, 128, 128, causal=True)
        out.backward(static_dout)
        return out

    graph, static_out = _capture(step)
    for cu in ([0, 7, 128, 200], [0, 128, 129, 256]):
        fresh = [torch.randn_like(t) for t in static]
        for t, value in zip(static, fresh):
            t.data.copy_(value)
        offsets.copy_(torch.tensor(cu, dtype=torch.int32))
        graph.replay()
        eager_in = [t.clone().requires_grad_(True) for t in fresh]
        eager_cu = offsets.clone()
        out = flash_attn_varlen_func(*eager_in, eager_cu, eager_cu, 128, 128, causal=True)
        out.backward(static_dout)
        torch.testing.assert_close(static_out, out, atol=0, rtol=0)
        for t, eager in zip(static, eager_in):
            torch.testing.assert_close(t.grad, eager.grad, atol=2e-2, rtol=2e-2)


def test_dropout_under_capture_raises_instead_of_repeating_a_mask():
    q, k, v = _dense(grad=False)
    ca.attention(q, k, v, dropout_p=0.1, backend="cudnn")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ca.NotSupportedError, match="CUDA graph capture"):
        with torch.cuda.graph(graph):
            ca.attention(q, k, v, dropout_p=0.1, backend="cudnn")


# ---------------------------------------------------------------------------------------------
# Autotuned plans
# ---------------------------------------------------------------------------------------------

def test_autotuned_graphs_time_their_plans_once_and_agree_with_the_heuristic_plan(monkeypatch):
    from cudnn_attn.graphs import autotune
    from cudnn_attn.graphs.cache import graph_cache

    q, k, v = _dense(seed=4)
    dout = torch.randn_like(q)
    ca.clear_caches()
    out = ca.attention(q, k, v, mask=ca.Causal(), backend="cudnn")
    want = (out, *torch.autograd.grad(out, (q, k, v), dout))
    ca.clear_caches()
    monkeypatch.setenv(autotune.ENV, "1")
    out = ca.attention(q, k, v, mask=ca.Causal(), backend="cudnn")
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    graphs = [graph_cache.peek(key) for key in graph_cache.keys()]
    assert len(graphs) == 2 and all(g.tuned and g.engine.autotuned for g in graphs)
    for a, b in zip(got, want):  # another plan may sum in another order: bf16 rounding apart
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    timed = [g.engine.timings for g in graphs]
    ca.attention(q, k, v, mask=ca.Causal(), backend="cudnn")
    assert [g.engine.timings for g in graphs] == timed  # tuned once
    ca.clear_caches()


def test_the_decode_example_replays_its_captured_step_exactly():
    from pathlib import Path

    from common import load_script

    example = Path(__file__).resolve().parents[2] / "examples" / "cuda_graph_decode.py"
    module = load_script(example, "example_cuda_graph_decode")
    assert module.main(["--steps", "8", "--slots", "3", "--pages-per-slot", "8"]) == 0
