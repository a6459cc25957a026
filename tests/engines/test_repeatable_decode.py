"""Issue 36 item 3: a single-query call that must be bitwise repeatable never reaches cuDNN's
``S_q = 1`` decode path (200 repeats on an H200 gave 105-157 distinct outputs there).

FlashAttention surfaces (whose forward is repeatable) and calls under torch's deterministic mode
run a two-row graph: an extra query row in front (bottom-right alignment by the graph's sizes) or
behind (top-left, no band, or a padding mask that hides it), discarded from the results. On this
CPU the stand-in executor (``cudnn_fake``) shows which graph cuDNN receives and that the results
and gradients are the call's (float64 oracle); the GPU test repeats the call 200 times.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from oracle import build_visibility, reference_attention
from test_native_storage import _paged_cache, device_only, fake  # noqa: F401  (fixture)

import cudnn_attn as ca
import cudnn_fake
from cudnn_attn.graphs import decode_rows
from cudnn_attn.graphs.notes import plan_notes
from cudnn_attn.model.problem import AttnProblem

F16, F64 = torch.float16, torch.float64
pytestmark = pytest.mark.skipif(not cudnn_fake.frontend_present(),
                                reason="nvidia-cudnn-frontend is not installed")


def _bshd(B, S, H, D, seed, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, H, D, generator=g).to(F16).requires_grad_(grad)


def _seq_q_of_graphs(fake_state, since=0):
    return [(spec.seq_q, backward) for spec, backward in fake_state[1][since:]]


def _oracle(q, k, v, causal: bool, window=None):
    """float64 attention on bshd tensors, FlashAttention's bottom-right alignment."""
    B, Sq, H, _ = q.shape
    Sk = k.shape[1]
    kw = {}
    if causal:
        kw["causal"] = "bottom_right"
    if window is not None:
        kw["window"] = (*window, "bottom_right")
    vis = build_visibility(1, Sq, Sk, **kw) if kw else torch.ones(1, Sq, Sk, dtype=torch.bool)
    leaves = [t.detach().to(F64).transpose(1, 2).requires_grad_() for t in (q, k, v)]
    out, _ = reference_attention(*leaves, vis, scale=q.shape[-1] ** -0.5)
    return out.transpose(1, 2), leaves


# A decode step's causal mask hides nothing (one query aligned bottom-right): the problem drops
# it, and the extra row goes behind as without a mask; a window that hides keys keeps the row
# in front.
@pytest.mark.parametrize("causal, window, where", [(True, None, "back"), (False, None, "back"),
                                                   (False, (7, 0), "front")],
                         ids=["causal", "no-mask", "window"])
def test_flash_attn_func_runs_a_two_row_graph_with_the_calls_results(causal, window, where,
                                                                      fake):
    from cudnn_attn.flash_attn_interface import flash_attn_func

    q, k, v = _bshd(2, 1, 4, 16, 1), _bshd(2, 23, 4, 16, 2), _bshd(2, 23, 4, 16, 3)
    out = flash_attn_func(q, k, v, causal=causal,
                          window_size=(-1, -1) if window is None else window)
    out = cudnn_fake.host(out)
    assert _seq_q_of_graphs(fake) == [(2, False), (2, True)], "cuDNN got an S_q = 1 graph"
    mask = ca.SlidingWindow(*window, "bottom_right") if window else \
        ca.Causal("bottom_right") if causal else None
    problem = AttnProblem.from_tensors(q, k, v, layout="bshd", mask=mask)
    assert decode_rows.side(problem) == where
    ref, leaves = _oracle(q, k, v, causal, window)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
    d_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
    got = torch.autograd.grad(out, (q, k, v), d_out.to(F16))
    want = torch.autograd.grad(ref, leaves, d_out)
    for name, a, e in zip("qkv", got, want):
        torch.testing.assert_close(a.to(F64), e.transpose(1, 2), atol=1e-2, rtol=1e-2,
                                   msg=lambda m, name=name: f"d{name}: {m}")


def test_attention_is_two_row_only_when_it_must_be_repeatable(fake):
    q, k, v = (torch.randn(1, 2, s, 16).to(F16) for s in (1, 9, 9))
    window = ca.SlidingWindow(4, 0, "bottom_right")  # hides keys 0-3 of the one query
    ca.attention(q, k, v, mask=window, backend="cudnn")
    assert _seq_q_of_graphs(fake) == [(1, False)], "a plain call keeps cuDNN's decode graph"
    torch.use_deterministic_algorithms(True)
    try:
        out = ca.attention(q, k, v, mask=window, backend="cudnn")
        explanation = ca.explain(q, k, v, mask=window)
    finally:
        torch.use_deterministic_algorithms(False)
    assert _seq_q_of_graphs(fake)[1:] == [(2, False)]
    ref = ca.attention(q.double(), k.double(), v.double(), mask=window, backend="torch")
    torch.testing.assert_close(cudnn_fake.host(out).double(), ref, atol=2e-3, rtol=2e-3)
    assert explanation.selected == "cudnn"
    assert any("two-row graph" in note and "in front" in note for note in explanation.notes)
    assert "two-row graph" in str(explanation)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_one_row_backward_cudnn_cannot_plan_runs_as_two_rows(fake, layout):
    """B = H_q = S_q = 1 with a backward (planning cuDNN's one-row backward crashed the
    process, cudnn-frontend #1071): the plain call stays on cuDNN as a two-row graph, forward
    and backward, with the call's results; the one-row problem itself keeps the reason, and
    explain() names it."""
    shape = (lambda s: (1, 1, s, 16)) if layout == "bhsd" else (lambda s: (1, s, 1, 16))
    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(shape(s), generator=gen).to(F16).requires_grad_(True)
               for s in (1, 40, 40))
    problem = AttnProblem.from_tensors(q, k, v, layout=layout)
    assert decode_rows.needed(problem) and ca.graphs.cudnn_reasons(problem) == []
    one_row = ca.graphs._spec.analyze(problem, two_rows=False)[1]
    assert any("cudnn-frontend #1071" in r for r in one_row), one_row
    out = ca.attention(q, k, v, layout=layout, backend="cudnn")
    dout = torch.randn(out.shape, generator=gen).to(F16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert _seq_q_of_graphs(fake) == [(2, False), (2, True)]
    leaves = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    ref, _ = reference_attention(*leaves, None, layout=layout)
    torch.testing.assert_close(cudnn_fake.host(out).to(F64), ref, atol=2e-3, rtol=2e-3)
    for got, want in zip(grads, torch.autograd.grad(ref, leaves, dout.to(F64))):
        torch.testing.assert_close(got.to(F64), want, atol=2e-3, rtol=2e-3)
    notes = ca.explain(q, k, v, layout=layout, backend="cudnn").notes
    assert any("two-row graph" in n and "#1071" in n for n in notes), notes


def test_dropout_forward_and_backward_run_the_same_two_row_graph(fake):
    from cudnn_attn.flash_attn_interface import flash_attn_func

    q, k, v = _bshd(1, 1, 2, 16, 5), _bshd(1, 17, 2, 16, 6), _bshd(1, 17, 2, 16, 7)
    out = flash_attn_func(q, k, v, dropout_p=0.3)  # cuDNN takes dropout with top-left bands
    cudnn_fake.host(out).sum().backward()
    assert _seq_q_of_graphs(fake) == [(2, False), (2, True)]  # one mask shape: replayable


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "dense"])
def test_kvcache_decode_step_keeps_the_one_row_graph(paged, fake, monkeypatch):
    """A decode step over a cache whose keys end at ``cache_seqlens`` runs cuDNN's one-row
    graph: as a two-row graph, ``flash_attn_with_kvcache`` over NaN-poisoned pages gave NaN
    everywhere on an H200 (cuDNN's S_q >= 2 kernels multiply V rows past the lengths by 0), where
    the one-row graph over the same pages gave the oracle's numbers. explain() says so."""
    from cudnn_attn.compat.flash_attn import native
    from cudnn_attn.flash_attn_interface import flash_attn_with_kvcache

    B, H, D, page, pages = 3, 2, 16, 16, 3
    lens = [5, 1, 30]
    if paged:
        k_pool, v_pool, table, dense_k, dense_v = _paged_cache(lens, page, H, D, seed=3,
                                                               poison=False, pages=pages)
        table[table < 0] = 0
    else:
        g = torch.Generator().manual_seed(2)
        k_pool = torch.randn(B, pages * page, H, D, generator=g).to(F16)
        v_pool = torch.randn(B, pages * page, H, D, generator=g).to(F16)
        dense_k, dense_v, table = k_pool, v_pool, None
    q = _bshd(B, 1, H, D, 9, grad=False)
    monkeypatch.setattr(native, "takes_kvcache",
                        lambda *args: args[2] is None and args[3] is None)
    lens_t = device_only(torch.tensor(lens, dtype=torch.int32))
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=lens_t, causal=True,
                                       block_table=None if table is None else device_only(table),
                                       return_softmax_lse=True)
    spec = fake[1][-1][0]
    assert spec.seq_q == 1 and spec.padding and (spec.paged is not None) == paged
    cache = torch.empty(B, pages * page, H, D, dtype=F16)
    problem = dataclasses.replace(AttnProblem.from_tensors(
        q, cache, cache, mask=ca.Padding([1] * B, lens), layout="bshd"), repeatable=True)
    assert not decode_rows.needed(problem) and decode_rows.keys_end_inside(problem)
    assert any("one-row" in n for n in plan_notes(problem))
    out = cudnn_fake.host(out)
    for b, n in enumerate(lens):
        keys, values = dense_k[b, :n].to(F64), dense_v[b, :n].to(F64)
        w = torch.softmax(q[b, 0, :, None].to(F64) @ keys.permute(1, 2, 0) * D ** -0.5, dim=-1)
        torch.testing.assert_close(out[b, 0].to(F64), (w @ values.transpose(0, 1))[:, 0],
                                   atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("lengths", ["static", "runtime"])
def test_two_row_results_are_the_calls_row_and_rows_without_keys_are_zero(layout, lengths,
                                                                          fake):
    """The real row is copied out of the two-row results (contiguous out, ``[B, H, 1]`` lse)
    with the rows that see no key (``seq_lens_kv = 0``) filled: out 0, lse -inf. Static
    lengths find them for both graph rows, runtime ones for the call's row only."""
    B, H, S, D = 3, 2, 9, 16
    lens_kv = [4, 0, 9]
    g = torch.Generator().manual_seed(11)
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    q = torch.randn((B, H, 1, D) if layout == "bhsd" else (B, 1, H, D), generator=g).to(F16)
    k, v = (torch.randn(shape, generator=g).to(F16) for _ in range(2))
    k[1], v[1] = float("nan"), float("nan")  # a sequence without keys: none of this is read
    if lengths == "static":
        padding = ca.Padding([1] * B, lens_kv)
    else:
        padding = ca.Padding(torch.ones(B, dtype=torch.int32), torch.tensor(lens_kv))
    mask = ca.Causal("bottom_right") & padding
    torch.use_deterministic_algorithms(True)
    try:
        out, lse = ca.attention(q, k, v, mask=mask, layout=layout, return_lse=True,
                                backend="cudnn")
    finally:
        torch.use_deterministic_algorithms(False)
    assert _seq_q_of_graphs(fake) == [(2, False)]
    out, lse = cudnn_fake.host(out), cudnn_fake.host(lse)
    assert out.shape == q.shape and out.is_contiguous() and lse.shape == (B, H, 1)
    ref, ref_lse = ca.attention(q.double(), k.double().nan_to_num(), v.double().nan_to_num(),
                                mask=ca.Causal("bottom_right") & ca.Padding([1] * B, lens_kv),
                                layout=layout, return_lse=True, backend="torch")
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-3, rtol=2e-3)
    assert (out[1] == 0).all() and (lse[1] == -float("inf")).all()


@pytest.mark.parametrize("kind", ["ragged", "bias"])
def test_calls_that_cannot_take_the_extra_row_leave_cudnn_with_the_reason(kind):
    from cudnn_attn.graphs._spec import analyze

    q = torch.empty(2, 1, 4, 16, dtype=F16, device="meta")
    k = torch.empty(2, 9, 4, 16, dtype=F16, device="meta")
    kw = dict(layout="bshd")
    if kind == "bias":
        kw["bias"] = torch.empty(1, 4, 1, 9, dtype=F16, device="meta")
    problem = AttnProblem.from_tensors(q, k, k, **kw)
    if kind == "ragged":
        from cudnn_attn.model.storage import Ragged

        problem = dataclasses.replace(problem, storage=Ragged())
    assert analyze(dataclasses.replace(problem, repeatable=False))[1] == [] or kind == "ragged"
    spec, reasons = analyze(dataclasses.replace(problem, repeatable=True))
    assert spec is None and any("two-row graph" in r for r in reasons), reasons


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("surface", ["flash_attn_func", "deterministic-attention"])
def test_single_query_calls_are_bitwise_repeatable_on_the_gpu(surface):
    """FlashAttention's test_flash_attn_race_condition case that failed on an H200:
    (S_q, S_k) = (1, 239), d = 160, causal; 200 repeats, one result."""
    from cudnn_attn.flash_attn_interface import flash_attn_func

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, 4, 160, generator=g).to("cuda", F16) for s in (1, 239, 239))

    def call():
        if surface == "flash_attn_func":
            return flash_attn_func(q, k, v, causal=True)
        return ca.attention(q, k, v, mask=ca.Causal("bottom_right"), layout="bshd")

    torch.use_deterministic_algorithms(surface != "flash_attn_func")
    try:
        if surface != "flash_attn_func":
            assert ca.explain(q, k, v, mask=ca.Causal("bottom_right"), layout="bshd")\
                .selected is not None
        first = call()
        distinct = sum(not torch.equal(call(), first) for _ in range(199))
    finally:
        torch.use_deterministic_algorithms(False)
    assert distinct == 0, f"{distinct} of 199 repeats differ from the first"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seq_q", [1, 2, 3, 8])
@pytest.mark.parametrize("seq_k", [239, 2048])
@pytest.mark.parametrize("group", [1, 8], ids=["mha", "gqa8"])
@pytest.mark.parametrize("dim", [64, 128])
def test_few_query_calls_are_bitwise_repeatable_on_the_gpu(seq_q, seq_k, group, dim):
    """Beyond the one case that failed: few queries against many keys, with and without GQA
    (a decode kernel may pack a group's query heads into rows, or split the keys between
    blocks and add their partial sums in any order), through a repeatable surface; 50 repeats,
    one result. Any shape listed here as failing needs the two-row treatment too."""
    from cudnn_attn.flash_attn_interface import flash_attn_func

    g = torch.Generator().manual_seed(seq_q * 1000 + seq_k)
    q = torch.randn(2, seq_q, 8, dim, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(2, seq_k, 8 // group, dim, generator=g).to("cuda", torch.bfloat16)
            for _ in range(2))
    first = flash_attn_func(q, k, v, causal=True)
    distinct = sum(not torch.equal(flash_attn_func(q, k, v, causal=True), first)
                   for _ in range(49))
    assert distinct == 0, f"{distinct} of 49 repeats differ from the first"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kvcache_decode_step_repeatability_on_the_gpu():
    """A paged decode step of flash_attn_with_kvcache runs cuDNN's one-row graph (the two-row
    graph read NaN past the lengths, ``decode_rows.keys_end_inside``); is that graph bitwise
    repeatable with a padding mask and page tables? 100 repeats, one result, or the count."""
    from cudnn_attn.flash_attn_interface import flash_attn_with_kvcache

    B, H, Hkv, D, page, pages = 4, 8, 2, 128, 64, 8
    lens = [239, 1, 300, 511]
    g = torch.Generator().manual_seed(21)
    k_pool, v_pool = (torch.randn(B * pages, page, Hkv, D, generator=g).to("cuda", F16)
                      for _ in range(2))
    table = torch.randperm(B * pages, generator=g).view(B, pages).to("cuda", torch.int32)
    q = torch.randn(B, 1, H, D, generator=g).to("cuda", F16)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def call():
        return flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens,
                                       block_table=table, causal=True)

    first = call()
    distinct = sum(not torch.equal(call(), first) for _ in range(99))
    assert distinct == 0, f"{distinct} of 99 repeats differ from the first"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_row_backward_runs_as_two_rows_on_the_gpu():
    """cudnn-frontend #1071's shape (B = H_q = H_kv = S_q = 1, S_kv = 128, D = 64, bf16, a
    backward) on cuDNN itself, as the two-row graph: it plans (the one-row graph crashed the
    process on cuDNN 9.26) and gives torch's math backend's out and gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device="cuda").manual_seed(14)
    q, k, v = (torch.randn(1, 1, s, 64, device="cuda", generator=g).to(torch.bfloat16)
               .requires_grad_(True) for s in (1, 128, 128))
    out = ca.attention(q, k, v, backend="cudnn")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        ref = sdpa(*leaves)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for got, want in zip(grads, torch.autograd.grad(ref, leaves, dout.float())):
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
