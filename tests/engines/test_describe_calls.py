"""``graphs.describe`` for varlen and KV-cache calls, without a GPU.

The oracle is cuDNN's documented native layouts (reference §1.5-1.6), built by hand here through the
dense builder path: a packed ``[total, H, D]`` call is the THD descriptor ``(B, H, max_seqlen, D)``
with token-major strides ``[S*H*D, D, H*D, 1]``, ragged offsets on Q/K/V/O(/Stats) and the lengths
as ``seq_len_q/kv``; a paged cache is ``(num_blocks, H_kv, page, D)`` containers with
``(B, 1, pages, 1)`` page tables and ``max_seq_len_kv = pages * page``. ``describe`` must give the
same graph as that hand-built problem (the frontend's C++ JSON, both validators), the same graph for
any lengths (they are inputs), and the entry points' own errors for bad arguments.
"""

import importlib.util
import json
import re

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.graphs import GraphOptions, PagedKV, describe
from cudnn_attn.graphs.sdpa import describe_problem, validate_for

pytestmark = pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                                reason="nvidia-cudnn-frontend is not installed")
F16 = torch.float16


def meta(*shape, dtype=F16, grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


def cu(lens):
    return torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def cpp_json(problem, options, sm=90, backward=False, stats=True):
    text = str(validate_for(problem, sm, backward=backward, options=options, stats=stats))
    return json.loads(re.sub(r'"gid": \d+,', "", text))


def tensors(j):
    return {t["name"]: t for t in j["tensors"]}


LENS_Q, LENS_K = [100, 3, 0, 17], [128, 60, 5, 12]
H, HKV, D = 4, 2, 64


def varlen_call(lens_q=LENS_Q, lens_k=LENS_K, max_q=128, max_k=128, grad=False, **kw):
    q = meta(sum(lens_q), H, D, grad=grad)
    k, v = meta(sum(lens_k), HKV, D, grad=grad), meta(sum(lens_k), HKV, D, grad=grad)
    return (q, k, v), dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max_q,
                           max_seqlen_k=max_k, **kw)


def thd_problem(lens_q=LENS_Q, lens_k=LENS_K, max_q=128, max_k=128, mask=None, grad=False, **kw):
    """The documented THD descriptor, by hand: (B, H, S_max, D) with token-major strides."""
    B = len(lens_q)

    def t(S, heads):
        return torch.empty_strided((B, S, heads, D), (S * heads * D, heads * D, D, 1), dtype=F16,
                                   device="meta", requires_grad=grad)

    padding = ca.Padding(lens_q, lens_k)
    return ca.AttnProblem.from_tensors(t(max_q, H), t(max_k, HKV), t(max_k, HKV), layout="bshd",
                                       mask=padding if mask is None else mask & padding, **kw)


VARLEN_CASES = {
    "plain": {},
    "causal-br": {"mask": ca.Causal("bottom_right")},
    "causal-tl": {"mask": ca.Causal()},
    "window": {"mask": ca.SlidingWindow(16, 0, "bottom_right")},
    "alibi": {"mask": ca.Causal(), "bias": ca.Alibi()},
    "dropout": {"dropout_p": 0.1},
}


@pytest.mark.parametrize("name", VARLEN_CASES)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_varlen_describe_is_the_documented_ragged_graph(name, backward):
    kw = VARLEN_CASES[name]
    (q, k, v), call = varlen_call(grad=backward, **kw)
    graph = describe(q, k, v, backward=backward, target_sm=90, **call)  # both validators ran
    (node,) = graph.nodes
    assert node.node_type.name == ("SDPA_BWD" if backward else "SDPA")
    problem, options = describe_problem(q, k, v, **call)
    assert options.ragged and options.paged is None
    expected = thd_problem(grad=backward, **kw)
    assert problem == expected
    stats = backward
    got = cpp_json(problem, options, backward=backward, stats=stats)
    assert got == cpp_json(expected, GraphOptions(ragged=True), backward=backward, stats=stats)
    t = tensors(got)
    B = len(LENS_Q)
    assert t["q"]["dim"] == [B, H, 128, D] and t["q"]["stride"] == [128 * H * D, D, H * D, 1]
    assert t["k"]["dim"] == [B, HKV, 128, D] and t["k"]["stride"] == [128 * HKV * D, D, HKV * D, 1]
    ragged = {"q": "ragged_q", "k": "ragged_k", "v": "ragged_v", "o": "ragged_o"}
    if backward:
        ragged.update(dq="ragged_q", dk="ragged_k", dv="ragged_v", do="ragged_o",
                      stats="ragged_stats")
    for name_, offsets in ragged.items():
        assert t[name_]["ragged_offset_name"] == offsets, name_
        assert t[offsets]["dim"] == [B + 1, 1, 1, 1]
    assert t["seq_len_q"]["dim"] == t["seq_len_kv"]["dim"] == [B, 1, 1, 1]
    assert got["nodes"][0]["padding_mask"]


def test_one_varlen_graph_serves_every_batch_of_lengths():
    (q, k, v), call = varlen_call(mask=ca.Causal("bottom_right"))
    base = cpp_json(*describe_problem(q, k, v, **call))
    (q2, k2, v2), other = varlen_call(lens_q=[1, 128, 7, 0], lens_k=[1, 128, 90, 3],
                                      mask=ca.Causal("bottom_right"))
    assert cpp_json(*describe_problem(q2, k2, v2, **other)) == base
    lengths_unknown = dict(call, cu_seqlens_q=meta(5, dtype=torch.int32),
                           cu_seqlens_k=meta(5, dtype=torch.int32))
    assert cpp_json(*describe_problem(q, k, v, **lengths_unknown)) == base
    longer = dict(call, max_seqlen_q=256)
    assert tensors(cpp_json(*describe_problem(q, k, v, **longer)))["q"]["dim"] == [4, H, 256, D]


def test_varlen_options_merge_and_max_total():
    (q, k, v), call = varlen_call()
    opts = GraphOptions(max_total_seq_len_q=120, max_total_seq_len_kv=205)
    problem, options = describe_problem(q, k, v, options=opts, **call)
    assert options == GraphOptions(ragged=True, max_total_seq_len_q=120, max_total_seq_len_kv=205)
    assert cpp_json(problem, options)["nodes"][0]["max_total_seq_len_q"] == 120


def test_varlen_bias_spans_the_maxima():
    (q, k, v), call = varlen_call()
    bias = meta(1, H, 128, 128)
    t = tensors(cpp_json(*describe_problem(q, k, v, bias=bias, **call)))
    assert t["bias"]["dim"] == [1, H, 128, 128]
    with pytest.raises(ValueError, match=r"max_seqlen_q, max_seqlen_k\] = \[4, 4, 128, 128\]"):
        describe(q, k, v, bias=meta(1, H, 64, 128), **call)


# ---------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------

CACHE_LENS = [5, 100, 256]


def test_dense_kvcache_is_the_padded_graph_over_the_whole_cache():
    q, cache = meta(3, 4, H, D), meta(3, 256, HKV, D)
    lens = torch.tensor(CACHE_LENS)
    problem, options = describe_problem(q, cache, cache, cache_seqlens=lens,
                                        mask=ca.Causal("bottom_right"))
    assert options == GraphOptions()
    expected = ca.AttnProblem.from_tensors(
        q, cache, cache, layout="bshd",
        mask=ca.Causal("bottom_right") & ca.Padding([4, 4, 4], CACHE_LENS))
    assert problem == expected
    j = cpp_json(problem, options)
    assert j["nodes"][0]["padding_mask"] and j["nodes"][0]["diagonal_alignment"] == "BOTTOM_RIGHT"
    assert tensors(j)["k"]["dim"] == [3, HKV, 256, D]
    # every step's lengths (an int for all, meta) describe the same graph
    for other in (100, torch.empty(3, dtype=torch.int32, device="meta")):
        p2, o2 = describe_problem(q, cache, cache, cache_seqlens=other,
                                  mask=ca.Causal("bottom_right"))
        assert cpp_json(p2, o2) == j


@pytest.mark.parametrize("page", [16, 64])
def test_paged_kvcache_is_cuDNNs_page_table_graph(page):
    pages = 256 // page
    q = meta(3, 1, H, D)
    k_cache, v_cache = meta(3 * pages + 5, page, HKV, D), meta(3 * pages + 5, page, HKV, D)
    table = meta(3, pages, dtype=torch.int32)
    graph = describe(q, k_cache, v_cache, cache_seqlens=torch.tensor(CACHE_LENS),
                     block_table=table, target_sm=90)
    assert graph.nodes[0].node_type.name == "SDPA"
    problem, options = describe_problem(q, k_cache, v_cache, cache_seqlens=torch.tensor(CACHE_LENS),
                                        block_table=table)
    assert options.paged == PagedKV(num_blocks=3 * pages + 5, page_size=page, layout="bshd")
    j = cpp_json(problem, options, stats=False)
    node, t = j["nodes"][0], tensors(j)
    assert node["max_seq_len_kv"] == pages * page
    assert node["inputs"]["Page_table_K"] == t["page_table_k"]["uid"]
    assert t["page_table_k"]["dim"] == t["page_table_v"]["dim"] == [3, 1, pages, 1]
    # the containers as cuDNN reads them: (num_blocks, H_kv, page, D) over bshd pages
    assert t["k"]["dim"] == [3 * pages + 5, HKV, page, D]
    assert t["k"]["stride"] == [page * HKV * D, D, HKV * D, 1]
    assert node["padding_mask"]
    assert problem.padding.seq_lens_kv == tuple(CACHE_LENS)


def test_bottom_right_causal_decode_needs_no_band_so_gqa_decode_runs():
    """A decode query (S_q = 1) aligned bottom-right sits at its sequence's last key: causality
    hides nothing there, so the graph has no diagonal band and cuDNN's decode + causal + GQA
    defect does not apply."""
    q, table = meta(3, 1, H, D), meta(3, 4, dtype=torch.int32)
    k_cache = meta(16, 64, HKV, D)
    kw = dict(cache_seqlens=torch.tensor(CACHE_LENS), block_table=table)
    plain = cpp_json(*describe_problem(q, k_cache, k_cache, **kw))
    causal = cpp_json(*describe_problem(q, k_cache, k_cache, mask=ca.Causal("bottom_right"), **kw))
    assert causal == plain
    # A left window bound is still a band: declined as before (the defect is not narrowed).
    with pytest.raises(ca.NotSupportedError, match="decode"):
        describe(q, k_cache, k_cache, mask=ca.SlidingWindow(5, 0, "bottom_right"), **kw)


@pytest.mark.parametrize("case, fragment", [
    ("paged-backward", "no SDPA backward for paged"),
    ("page-48", "power of two"),
    ("strided-container", "contiguous"),
    ("decode-causal-gqa", "decode (S_q = 1)"),
    ("varlen-bwd-sm80", "packed LSE"),
])
def test_declined_calls_name_the_reason(case, fragment):
    q, table = meta(3, 1, H, D), meta(3, 4, dtype=torch.int32)
    k_cache = meta(16, 64, HKV, D)
    lens = torch.tensor(CACHE_LENS)
    kw, args, sm, backward = {}, (q, k_cache, k_cache), 90, False
    if case == "paged-backward":
        kw, backward = dict(cache_seqlens=lens, block_table=table), True
    elif case == "page-48":
        cache = meta(16, 48, HKV, D)
        args, kw = (q, cache, cache), dict(cache_seqlens=[5, 100, 190], block_table=table)
    elif case == "strided-container":
        cache = meta(16, 64, 2 * HKV, D)[:, :, ::2]
        args, kw = (q, cache, cache), dict(cache_seqlens=lens, block_table=table)
    elif case == "decode-causal-gqa":  # top-left: the band is real (query 0 sees key 0)
        kw = dict(cache_seqlens=lens, block_table=table, mask=ca.Causal())
    else:
        args, kw = varlen_call(grad=True)
        sm, backward = 80, True
    with pytest.raises(ca.NotSupportedError) as err:
        describe(*args, backward=backward, target_sm=sm, **kw)
    assert any(fragment in r for r in err.value.reasons["cudnn"]), err.value.reasons


# ---------------------------------------------------------------------------------------------
# bad arguments: the entry points' own errors
# ---------------------------------------------------------------------------------------------

def _first_error(fn):
    with pytest.raises((ValueError, TypeError)) as err:
        fn()
    return type(err.value), str(err.value)


@pytest.mark.parametrize("change", [
    {"cu_seqlens_q": torch.tensor([0, 100, 103, 103, 119], dtype=torch.int32)},
    {"cu_seqlens_k": torch.tensor([0, 5, 3, 8, 205], dtype=torch.int32)},
    {"cu_seqlens_k": torch.tensor([0, 128, 205], dtype=torch.int32)},
    {"cu_seqlens_q": torch.tensor([0.0, 120.0])},
    {"max_seqlen_q": 64},
    {"max_seqlen_k": -1},
], ids=["total", "decreasing", "batch", "float", "max-short", "max-negative"])
def test_bad_varlen_arguments_raise_what_attention_varlen_raises(change):
    (q, k, v), call = varlen_call()
    call.update(change)
    got = _first_error(lambda: describe(q, k, v, **call))
    real = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, k, v)]
    expected = _first_error(lambda: ca.attention_varlen(*real, call["cu_seqlens_q"],
                                                        call["cu_seqlens_k"], call["max_seqlen_q"],
                                                        call["max_seqlen_k"]))
    assert got == expected


@pytest.mark.parametrize("change", [
    {"cache_seqlens": [5, 100, 300]},
    {"cache_seqlens": [5, 100]},
    {"block_table": torch.zeros(2, 4, dtype=torch.int32)},
    {"mask": ca.Padding([1, 1, 1])},
], ids=["too-long", "batch", "table-rows", "padding-mask"])
def test_bad_kvcache_arguments_raise_what_attention_with_kvcache_raises(change):
    q, cache = meta(3, 1, H, D), meta(16, 64, HKV, D)
    call = dict(cache_seqlens=CACHE_LENS, block_table=torch.zeros(3, 4, dtype=torch.int32))
    call.update(change)
    got = _first_error(lambda: describe(q, cache, cache, **call))
    real = [torch.zeros(x.shape, dtype=torch.float32) for x in (q, cache, cache)]
    expected = _first_error(lambda: ca.attention_with_kvcache(*real, **call))
    assert got == expected


def test_call_kinds_and_layout_are_checked():
    (q, k, v), call = varlen_call()
    with pytest.raises(ValueError, match="not both"):
        describe(q, k, v, cache_seqlens=3, **call)
    with pytest.raises(ValueError, match="layout must be 'bshd'"):
        describe(q, k, v, layout="bhsd", **call)
    with pytest.raises(ValueError, match="needs cu_seqlens_q, cu_seqlens_k"):
        describe(q, k, v, cu_seqlens_q=call["cu_seqlens_q"])
    with pytest.raises(ValueError, match="must describe the same batch"):
        describe(q, k, v, **dict(call, cu_seqlens_q=meta(5, dtype=torch.int32),
                                 cu_seqlens_k=meta(4, dtype=torch.int32)))
    with pytest.raises(ValueError, match="needs cache_seqlens"):
        describe(meta(3, 1, H, D), meta(16, 64, HKV, D), meta(16, 64, HKV, D),
                 block_table=meta(3, 4, dtype=torch.int32))
