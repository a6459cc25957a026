"""Length buckets (``cudnn_attn.graphs.length_buckets``): once a kind of cuDNN graph has been built
for ``BUCKET_AFTER`` shapes at call time, a call of that kind with uncached sizes runs on its
bucket's graph (q, k, v zero-padded, the real lengths as the graph's padding mask, results
sliced). Run on this CPU through ``cudnn_fake``'s stand-in executor, which computes each graph
the engine hands cuDNN in float64; results checked against float64 brute force (``oracle``)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudnn_attn as ca
import cudnn_fake
import oracle
from cudnn_attn.core.caches import clear_caches
from cudnn_attn.graphs import churn, length_buckets
from cudnn_attn.graphs.length_buckets import BUCKET_AFTER, bucket
from cudnn_attn.model import masks
from cudnn_attn.packed import calls

F16, BF16, F64 = torch.float16, torch.bfloat16, torch.float64
pytestmark = pytest.mark.skipif(not cudnn_fake.frontend_present(),
                                reason="nvidia-cudnn-frontend is not installed")


@pytest.fixture
def fake(monkeypatch):
    """The fake cuDNN engine; CPU length tensors count as device (runtime) lengths. Yields
    the list of ``(spec, backward)`` of every graph built."""
    monkeypatch.setattr(masks, "_runtime_lengths", lambda value: isinstance(value, torch.Tensor))
    monkeypatch.setattr(calls, "on_accelerator", lambda t: isinstance(t, torch.Tensor))
    monkeypatch.delenv(length_buckets.ENV, raising=False)
    _, built = cudnn_fake.install(monkeypatch)
    yield built
    clear_caches()


def test_bucket_rule():
    """Exact up to EXACT_UP_TO; above, the smallest multiple of max(64, a quarter of the power
    of two at or below n) that holds n: less than 25 % (or 64 rows) more, four per octave,
    and a bucket is its own bucket."""
    for n in range(1, 20000):
        b = bucket(n)
        if n <= length_buckets.EXACT_UP_TO:
            assert b == n
            continue
        step = max(64, 2 ** (math.floor(math.log2(n)) - 2))
        assert b % step == 0 and n <= b < n + step, n
        assert b - n < max(64, n / 4)
        assert bucket(b) == b
    octave = {bucket(n) for n in range(4097, 8193)}
    assert octave == {5120, 6144, 7168, 8192}


def _visibility(B, S_q, S_kv, mask_kind, lens=None):
    lens_q, lens_kv = (None, None) if lens is None else lens
    if mask_kind is None:
        return oracle.build_visibility(B, S_q, S_kv, seq_lens_q=lens_q, seq_lens_kv=lens_kv)
    return oracle.build_visibility(B, S_q, S_kv, causal=mask_kind, seq_lens_q=lens_q,
                                   seq_lens_kv=lens_kv)


def _decode_step(n, gen, layout="bhsd", heads=(2, 2), dtype=F16):
    H, H_kv = heads
    shape_q, shape_kv = ((1, H, 1, 16), (1, H_kv, n, 16)) if layout == "bhsd" else \
        ((1, 1, H, 16), (1, n, H_kv, 16))
    q = torch.randn(shape_q, generator=gen).to(dtype)
    k, v = (torch.randn(shape_kv, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_growing_cache_builds_a_graph_per_bucket_not_per_step(fake, layout):
    """A decode loop over a growing cache (bottom-right causal, GQA, keys one longer at every
    step): BUCKET_AFTER exact graphs, then one per bucket; every output and lse matches
    float64 brute force."""
    gen = torch.Generator().manual_seed(1)
    lengths = range(40, 300)
    mask = ca.Causal("bottom_right")
    for n in lengths:
        q, k, v = _decode_step(n, gen, layout, heads=(4, 2))
        out, lse = ca.attention(q, k, v, mask=mask, layout=layout, return_lse=True,
                                backend="cudnn")
        vis = _visibility(1, 1, n, "bottom_right")
        ref, ref_lse = oracle.reference_attention(q, k, v, vis, layout=layout)
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse.to(F64), ref_lse, atol=1e-4, rtol=1e-4)
    sizes = [spec.seq_kv for spec, _ in fake]
    first = list(lengths)[:BUCKET_AFTER]
    later = {bucket(n) for n in list(lengths)[BUCKET_AFTER:]}
    assert sizes[:BUCKET_AFTER] == first
    # then one graph per bucket, with the lengths as its padding mask (a length that is its
    # own bucket shares it)
    assert sorted(sizes[BUCKET_AFTER:]) == sorted(later)
    assert all(spec.padding for spec, _ in fake[BUCKET_AFTER:])


def test_flash_attn_decode_with_a_dynamic_cache(fake):
    """Hugging Face's flash_attention_2 decode over a dynamic cache: ``flash_attn_func`` with
    one query and keys one longer per step (a repeatable surface: the bucket's graph keeps the
    two-row form). A handful of graphs, outputs exact, and every repeat of a step bitwise
    equal."""
    from cudnn_attn.flash_attn_interface import flash_attn_func

    gen = torch.Generator().manual_seed(2)
    for n in range(100, 180):
        q, k, v = _decode_step(n, gen, "bshd", heads=(4, 4))
        out = flash_attn_func(q, k, v, causal=True)
        ref, _ = oracle.reference_attention(q, k, v, None, layout="bshd")
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
        assert torch.equal(flash_attn_func(q, k, v, causal=True), out)
    # 100..107 exact, then the buckets 128 and 192
    assert [spec.seq_kv for spec, _ in fake] == [*range(100, 108), 128, 192]


@pytest.mark.parametrize("layout,heads,mask_kind", [("bhsd", (2, 2), "top_left"),
                                                    ("bshd", (4, 2), "bottom_right"),
                                                    ("bhsd", (2, 1), None)])
def test_training_with_dynamic_lengths_forward_and_backward(fake, layout, heads, mask_kind):
    """Self-attention whose length changes per batch (dynamic padding in training), with a
    backward: once bucketed, out, lse and dq, dk, dv match float64 brute force (and the
    graphs built stay few)."""
    gen = torch.Generator().manual_seed(3)
    H, H_kv = heads
    mask = None if mask_kind is None else ca.Causal(mask_kind)
    lengths = [20 + 7 * i for i in range(BUCKET_AFTER + 6)]
    for n in lengths:
        shape = (lambda h: (2, h, n, 16)) if layout == "bhsd" else (lambda h: (2, n, h, 16))
        q = torch.randn(shape(H), generator=gen).to(BF16).requires_grad_(True)
        k, v = (torch.randn(shape(H_kv), generator=gen).to(BF16).requires_grad_(True)
                for _ in range(2))
        out, lse = ca.attention(q, k, v, mask=mask, layout=layout, return_lse=True,
                                backend="cudnn")
        dout = torch.randn(out.shape, generator=gen).to(BF16)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        leaves = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
        ref, ref_lse = oracle.reference_attention(*leaves, _visibility(2, n, n, mask_kind),
                                                  layout=layout)
        ref_grads = torch.autograd.grad(ref, leaves, dout.to(F64))
        torch.testing.assert_close(out.to(F64), ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.to(F64), ref_lse, atol=1e-3, rtol=1e-3)
        for got, want in zip(grads, ref_grads):
            assert got.shape == want.shape
            torch.testing.assert_close(got.to(F64), want, atol=4e-2, rtol=4e-2)
    bucketed = [n for n in lengths[BUCKET_AFTER:] if bucket(n) != n]
    assert bucketed, "the grid must reach the bucketed path"
    assert any(spec.padding for spec, _ in fake)
    assert sum(1 for spec, backward in fake if backward) <= BUCKET_AFTER + len(set(
        bucket(n) for n in bucketed))


@pytest.mark.parametrize("runtime", [False, True])
def test_the_calls_own_padding_stays_its_lengths(fake, runtime):
    """A call with a ``Padding`` (ints, or runtime tensors) whose sizes churn: the bucket's
    graph reads the call's lengths, the padded rows are zero, and the result matches."""
    gen = torch.Generator().manual_seed(5)
    for i, n in enumerate(range(30, 30 + BUCKET_AFTER + 5)):
        lens = [n - 3 - i % 4, n]
        padding = ca.Padding(torch.tensor(lens) if runtime else lens)
        q, k, v = (torch.randn(2, 2, n, 16, generator=gen).to(F16) for _ in range(3))
        out = ca.attention(q, k, v, mask=ca.Causal() & padding, backend="cudnn")
        vis = oracle.build_visibility(2, n, n, causal="top_left", seq_lens_q=lens,
                                      seq_lens_kv=lens)
        ref, _ = oracle.reference_attention(q, k, v, vis)
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
    assert any(spec.seq_q == spec.seq_kv == 64 for spec, _ in fake)  # 30 + 8 .. 42: bucket 64


def test_calls_that_read_positions_keep_exact_graphs(fake, monkeypatch):
    """A bias tensor (sized by the call) keeps exact graphs, as do all calls with
    ``CUDNN_ATTN_LENGTH_BUCKETS=0``: a graph per shape, none with lengths of its own (a bias
    graph's full-length padding aside); explain() of the next such shape says why."""
    gen = torch.Generator().manual_seed(6)
    lengths = range(30, 30 + BUCKET_AFTER + 3)
    for n in lengths:
        q, k, v = _decode_step(n, gen)
        bias = torch.randn(1, 2, 1, n, generator=gen).to(F16)
        out = ca.attention(q, k, v, bias=bias, backend="cudnn")
        ref, _ = oracle.reference_attention(q, k, v, None, bias=bias.to(F64))
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
    assert [spec.seq_kv for spec, _ in fake] == list(lengths)
    assert not any(spec.padding and not spec.synthetic_padding for spec, _ in fake)

    q, k, v = _decode_step(200, gen)
    bias = torch.randn(1, 2, 1, 200, generator=gen).to(F16)
    note = ca.explain(q, k, v, bias=bias, backend="cudnn").notes[-1]  # after the bias's own
    assert f"{BUCKET_AFTER + 3} graphs of this kind" in note and "a bias or ALiBi" in note

    monkeypatch.setenv(length_buckets.ENV, "0")
    fake.clear()
    for n in lengths:
        q, k, v = _decode_step(n, gen)
        ca.attention(q, k, v, backend="cudnn")
    assert [spec.seq_kv for spec, _ in fake] == list(lengths)
    (note,) = ca.explain(*_decode_step(200, gen), backend="cudnn").notes
    assert f"{length_buckets.ENV}=0" in note


def test_explain_names_the_bucket_and_a_cached_shape_stays_exact(fake):
    """After the churn, ``explain()`` of an uncached shape says it runs on its bucket's graph
    (with the sizes); a shape built before the churn keeps its exact graph (nothing built)."""
    gen = torch.Generator().manual_seed(7)
    for n in range(50, 50 + BUCKET_AFTER):
        ca.attention(*_decode_step(n, gen), backend="cudnn")
    q, k, v = _decode_step(100, gen)
    text = str(ca.explain(q, k, v, backend="cudnn"))
    assert "length bucket" in text and "S_kv 100 -> 128" in text
    before = len(fake)
    q, k, v = _decode_step(50, gen)
    out = ca.attention(q, k, v, backend="cudnn")
    ref, _ = oracle.reference_attention(q, k, v, None)
    torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
    assert len(fake) == before
    assert churn.shapes_built(fake[0][0]) == BUCKET_AFTER


def test_the_benchmarks_growing_cache_rows_run(fake, monkeypatch):
    """``benchmarks/cudnn.py``'s growing-cache rows (``decode_rows.growing``), on this CPU
    through the stand-in and at a small size: every row present, the bucketed loop builds
    fewer graphs than the exact one, and the environment switch is put back."""
    import argparse
    import os

    from common import load_benchmark

    rows_module = load_benchmark("decode_rows")
    monkeypatch.setattr(rows_module, "GROWING", (1, 40, 2, 16, 24))
    monkeypatch.setattr(rows_module, "EXACT_STEPS", 12)
    rows = {r["call"]: r for r in rows_module.growing(argparse.Namespace(), device="cpu")}
    buckets = rows["decode growing: ours, length buckets"]
    exact = rows["decode growing: ours, exact graphs"]
    assert "decode growing: torch-flash" in rows and "vs_torch_flash" in buckets
    assert exact["graphs_built"] == exact["steps"] == 12
    assert buckets["steps"] == 24 and buckets["graphs_built"] == BUCKET_AFTER + 1  # then 64
    assert length_buckets.ENV not in os.environ


def test_a_shape_that_keeps_coming_back_gets_its_own_graph(fake, monkeypatch):
    """After PROMOTE_AFTER forwards on its bucket's graph, a shape's plan builds the shape's
    own graphs and runs on them; a backward whose forward ran on the bucket (its out and LSE)
    runs on the promoted plan with the same result."""
    monkeypatch.setattr(length_buckets, "PROMOTE_AFTER", 2)
    gen = torch.Generator().manual_seed(8)
    for n in range(60, 60 + BUCKET_AFTER):  # the churn of calls that record a backward
        ca.attention(*(t.requires_grad_(True) for t in _decode_step(n, gen)), backend="cudnn")
    q, k, v = (t.requires_grad_(True) for t in _decode_step(100, gen))
    dout = torch.randn(1, 2, 1, 16, generator=gen).to(F16)
    leaves = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    ref, _ = oracle.reference_attention(*leaves, None)
    ref_grads = torch.autograd.grad(ref, leaves, dout.to(F64))
    outs = []
    for call in range(4):
        out = ca.attention(q, k, v, backend="cudnn")
        outs.append(out)
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
        sizes = [spec.seq_kv for spec, backward in fake if not backward]
        assert sizes.count(100) == (1 if call >= 2 else 0)  # the third forward promotes
        assert sizes.count(128) == 1
    for out in (outs[0], outs[3]):  # a bucketed forward's backward runs on the promoted plan
        grads = torch.autograd.grad(out, (q, k, v), dout)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.to(F64), want, atol=2e-3, rtol=2e-3)
    backwards = [spec.seq_kv for spec, backward in fake if backward]
    assert backwards == [*range(60, 60 + BUCKET_AFTER), 128, 100]  # the bucket's, then its own


def test_no_promotion_inside_a_cuda_graph_capture(fake, monkeypatch):
    """A capture never builds a graph: a shape due for promotion keeps its bucket while the
    stream is being captured, and is promoted at its first call after."""
    capturing = [True]
    monkeypatch.setattr(length_buckets, "capturing", lambda: capturing[0])
    monkeypatch.setattr(length_buckets, "PROMOTE_AFTER", 1)
    gen = torch.Generator().manual_seed(12)
    for n in range(60, 60 + BUCKET_AFTER):
        ca.attention(*_decode_step(n, gen), backend="cudnn")
    q, k, v = _decode_step(100, gen)
    for _ in range(3):
        ca.attention(q, k, v, backend="cudnn")
    assert 100 not in [spec.seq_kv for spec, _ in fake]
    capturing[0] = False
    out = ca.attention(q, k, v, backend="cudnn")
    assert [spec.seq_kv for spec, _ in fake][-1] == 100
    ref, _ = oracle.reference_attention(q, k, v, None)
    torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_growing_cache_on_the_gpu(layout):
    """On cuDNN itself: a decode loop over a growing cache (bottom-right causal, GQA) and a
    training loop over changing lengths (causal, backward), past the churn threshold: a graph
    per bucket, and every result as torch's math backend gives it (the padded keys and rows
    cuDNN masks are zeros, so this checks cuDNN's padding mask as the buckets use it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from cudnn_attn.graphs import cache

    clear_caches()
    g = torch.Generator(device="cuda").manual_seed(9)
    before = cache.graph_cache.info()["builds"]

    def bhsd(t):
        return t if layout == "bhsd" else t.transpose(1, 2)

    def math_sdpa(q, k, v, **kw):
        with sdpa_kernel(SDPBackend.MATH):
            return sdpa(*(bhsd(t).float() for t in (q, k, v)), enable_gqa=True, **kw)

    k_all, v_all = (torch.randn(2, 4, 700, 64, device="cuda", generator=g).to(BF16)
                    for _ in range(2))
    q = torch.randn(2, 8, 1, 64, device="cuda", generator=g).to(BF16)
    for n in range(400, 700, 3):  # 100 steps
        k, v = (bhsd(t[:, :, :n].contiguous()) for t in (k_all, v_all))
        out = ca.attention(bhsd(q), k, v, mask=ca.Causal("bottom_right"), layout=layout,
                           backend="cudnn")
        torch.testing.assert_close(bhsd(out).float(), math_sdpa(bhsd(q), k, v),
                                   atol=2e-2, rtol=2e-2)
    assert cache.graph_cache.info()["builds"] - before <= BUCKET_AFTER + 4  # 448 .. 768
    for n in range(100, 300, 13):
        q, k, v = (bhsd(torch.randn(2, h, n, 64, device="cuda", generator=g).to(BF16))
                   .requires_grad_(True) for h in (8, 4, 4))
        out = ca.attention(q, k, v, mask=ca.Causal(), layout=layout, backend="cudnn")
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
        ref = math_sdpa(*leaves, is_causal=True)
        torch.testing.assert_close(bhsd(out).float(), ref, atol=2e-2, rtol=2e-2)
        for got, want in zip(grads, torch.autograd.grad(ref, leaves, bhsd(dout).float())):
            torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


def test_a_bucket_cuDNN_refuses_leaves_the_call_its_own_graph(fake, monkeypatch):
    """A bucket's graph that cuDNN declines at build (NotSupportedError) does not decline the
    call: it runs on its own graph, and the result is right."""
    from cudnn_attn.graphs import backend as cudnn_backend

    build = cudnn_backend.build_graph

    def refuse_buckets(problem, spec, backward):
        if spec.padding:
            raise ca.NotSupportedError(problem, {"cudnn": ["refused (test)"]}, forced="cudnn")
        return build(problem, spec, backward)

    monkeypatch.setattr(cudnn_backend, "build_graph", refuse_buckets)
    gen = torch.Generator().manual_seed(10)
    for n in range(70, 70 + BUCKET_AFTER + 3):
        q, k, v = _decode_step(n, gen)
        out = ca.attention(q, k, v, backend="cudnn")
        ref, _ = oracle.reference_attention(q, k, v, None)
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
    assert [spec.seq_kv for spec, _ in fake] == list(range(70, 70 + BUCKET_AFTER + 3))


def test_calls_too_large_to_copy_keep_their_own_graphs(fake, monkeypatch):
    """A call whose bucket copies (q, k, v, out at the bucket's sizes, 2 bytes each) exceed
    MAX_COPY_BYTES keeps its own graph, and ``reasons`` says so with the size."""
    from cudnn_attn.model.problem import AttnProblem

    q = torch.empty(2, 4, 100, 16, dtype=F16)
    k = torch.empty(2, 2, 300, 16, dtype=F16)
    problem = AttnProblem.from_tensors(q, k, k)
    expected = 2 * (2 * 128 * 4 * 32 + 2 * 320 * 2 * 32)  # buckets 128 and 320
    assert length_buckets.copy_bytes(problem) == expected
    monkeypatch.setattr(length_buckets, "MAX_COPY_BYTES", expected - 1)
    (why,) = length_buckets.reasons(problem)
    assert "exceed" in why
    gen = torch.Generator().manual_seed(11)
    lengths = range(30, 30 + BUCKET_AFTER + 3)
    monkeypatch.setattr(length_buckets, "MAX_COPY_BYTES", 1000)  # every step's copies exceed it
    for n in lengths:
        ca.attention(*_decode_step(n, gen), backend="cudnn")
    assert [spec.seq_kv for spec, _ in fake] == list(lengths)


_MOVED = length_buckets.BucketPlan._moved


def _spied(record: list):
    """``BucketPlan._moved`` that records each call (a bucketed forward or backward)."""
    def spy(plan, *args):
        record.append(True)
        return _MOVED(plan, *args)

    return spy


MASKS = {"none": (None, {}),
         "causal_tl": (lambda: ca.Causal(), {"causal": "top_left"}),
         "causal_br": (lambda: ca.Causal("bottom_right"), {"causal": "bottom_right"}),
         "window_br": (lambda: ca.SlidingWindow(7, 0, "bottom_right"),
                       {"window": (7, 0, "bottom_right")}),
         "window_tl": (lambda: ca.SlidingWindow(5, 3), {"window": (5, 3, "top_left")})}


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=st.sampled_from(["bhsd", "bshd"]), heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
       mask_kind=st.sampled_from(sorted(MASKS)), grad=st.booleans(),
       queries=st.sampled_from(["decode", "self", "cross"]), view=st.booleans(),
       seq_kv=st.integers(17, 300), seq_q=st.integers(2, 40), seed=st.integers(0, 2**16))
def test_any_bucketed_call_matches_the_oracle(fake, monkeypatch, layout, heads, mask_kind, grad,
                                              queries, view, seq_kv, seq_q, seed):
    """Every call that can buckets (BUCKET_AFTER = 0): masks of both alignments, GQA/MQA, one
    query, self- and cross-attention, strided views (bshd views of bhsd tensors); out, lse and
    (with ``grad``) dq, dk, dv against float64 brute force."""
    monkeypatch.setattr(length_buckets, "BUCKET_AFTER", 0)
    H, H_kv = heads
    seq_q = {"decode": 1, "self": seq_kv, "cross": seq_q}[queries]
    make, rule = MASKS[mask_kind]
    if "bottom_right" in str(rule) and seq_q > seq_kv:
        seq_q = seq_kv
    gen = torch.Generator().manual_seed(seed)

    def tensor(h, s):
        t = torch.randn(2, h, s, 16, generator=gen).to(BF16)
        if layout == "bshd":
            t = t.transpose(1, 2) if view else t.transpose(1, 2).contiguous()
        return t.requires_grad_(grad)

    q, k, v = tensor(H, seq_q), tensor(H_kv, seq_kv), tensor(H_kv, seq_kv)
    moved = []
    monkeypatch.setattr(length_buckets.BucketPlan, "_moved", _spied(moved))
    try:
        out, lse = ca.attention(q, k, v, mask=None if make is None else make(), layout=layout,
                                return_lse=True, backend="cudnn")
    except ca.NotSupportedError:  # a call cuDNN declines whatever its sizes
        return
    assert moved, "the call did not run on its bucket's graph"
    leaves = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    vis = oracle.build_visibility(2, seq_q, seq_kv, **rule) if rule else None
    ref, ref_lse = oracle.reference_attention(*leaves, vis, layout=layout)
    torch.testing.assert_close(out.to(F64), torch.nan_to_num(ref), atol=2e-2, rtol=2e-2)
    seen = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.to(F64)[seen], ref_lse[seen], atol=1e-3, rtol=1e-3)
    if grad:
        dout = torch.randn(out.shape, generator=gen).to(BF16)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        wanted = torch.autograd.grad(torch.nan_to_num(ref), leaves, dout.to(F64))
        for got, want in zip(grads, wanted):
            torch.testing.assert_close(got.to(F64), want, atol=5e-2, rtol=5e-2)
