"""Hypothesis fuzzing of the public surfaces, well-formed arguments or not: every call either
raises a documented exception (ValueError, TypeError, NotSupportedError) or returns what the
float64 oracle (tests/oracle.py) computes from the same plain description."""

from __future__ import annotations

import math

import numpy as np
import oracle
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cudnn_attn as ca
from cudnn_attn import neighborhood as nb

DOCUMENTED = (ValueError, TypeError, ca.NotSupportedError)
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
ALIGNMENTS = st.sampled_from(["top_left", "bottom_right"])
# One fault per call at most (half the calls have none), so valid calls are common and every
# kind of bad argument is reached.
FAULTS = ["dtype", "layout", "head-dim", "window", "lengths", "bias-shape", "alibi", "scale",
          "softcap", "dropout", "return_lse"]
BAD = {"window": st.sampled_from([-2, 1.5, "x", 2 ** 40]),
       "lengths": st.sampled_from(["negative", "long", "count"]),
       "scale": st.sampled_from([math.nan, math.inf, "x", True]),
       "softcap": st.sampled_from([math.nan, -1.0, "x", True]),
       "dropout": st.sampled_from([1.5, -0.1, math.nan, "x"]),
       "return_lse": st.sampled_from(["yes", 1, None])}


def _tensor(draw, shape, dtype, layout):
    x = torch.from_numpy(np.random.default_rng(draw(st.integers(0, 2**16))).standard_normal(shape))
    return x.to(dtype) if layout == "bhsd" else x.transpose(1, 2).contiguous().to(dtype)


@st.composite
def attention_calls(draw):
    """(q, k, v, mask builders, bias, kwargs, plain description for the oracle)."""
    fault = draw(st.sampled_from([None] * len(FAULTS) + FAULTS))
    b, h_kv, group = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    s_q, s_kv = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    d, d_v = (0 if fault == "head-dim" else draw(st.sampled_from([1, 4, 8]))), \
        draw(st.sampled_from([1, 4, 8]))
    dtype = torch.int64 if fault == "dtype" else draw(st.sampled_from([torch.float64,
                                                                      torch.float32]))
    layout = "bsdh" if fault == "layout" else draw(st.sampled_from(["bhsd", "bshd"]))
    shape_layout = "bshd" if layout == "bshd" else "bhsd"
    q = _tensor(draw, (b, h_kv * group, s_q, d), dtype, shape_layout)
    k = _tensor(draw, (b, h_kv, s_kv, d), dtype, shape_layout)
    v = _tensor(draw, (b, h_kv, s_kv, d_v), dtype, shape_layout)
    desc = {"b": b, "s_q": s_q, "s_kv": s_kv, "layout": layout, "causal": None, "window": None,
            "lens": None, "alibi": None, "bias": None}
    align = draw(ALIGNMENTS)
    masks = []
    if draw(st.booleans()):
        masks.append(lambda: ca.Causal(align))
        desc["causal"] = align
    if fault == "window" or draw(st.booleans()):
        left, right = draw(st.integers(-1, 9)), draw(st.integers(-1, 9))
        if fault == "window":
            left = draw(BAD["window"])
        masks.append(lambda: ca.SlidingWindow(left, right, align))
        desc["window"] = (left, right, align)
    if fault == "lengths" or draw(st.booleans()):
        lens_q = [draw(st.integers(0, s_q)) for _ in range(b)]
        lens_kv = [draw(st.integers(0, s_kv)) for _ in range(b)]
        bad = draw(BAD["lengths"]) if fault == "lengths" else None
        if bad == "negative":
            lens_q[0] = -1
        elif bad == "long":
            lens_kv[-1] = s_kv + 1
        elif bad == "count":
            lens_q.append(1)
        masks.append(lambda: ca.Padding(lens_q, lens_kv))
        desc["lens"] = (lens_q, lens_kv)
    bias = None
    bias_kind = fault if fault in ("bias-shape", "alibi") else \
        draw(st.sampled_from([None, None, "tensor", "alibi-ok"]))
    if bias_kind in ("tensor", "bias-shape"):
        rows = s_q + 1 if bias_kind == "bias-shape" else s_q
        bias = _tensor(draw, (1, h_kv * group, rows, s_kv), torch.float64, "bhsd")
        desc["bias"] = bias
    elif bias_kind == "alibi-ok":
        slopes = draw(st.lists(st.floats(0.01, 1.0), min_size=h_kv * group,
                               max_size=h_kv * group))
        bias, desc["alibi"] = (lambda: ca.Alibi(slopes)), slopes
    elif bias_kind == "alibi":
        bad_slopes = draw(st.sampled_from([[math.nan] * (h_kv * group), [0.5] * 7]))
        bias = lambda: ca.Alibi(bad_slopes)
    kwargs = {"scale": draw(st.one_of(st.none(), st.floats(-2.0, 2.0))),
              "softcap": draw(st.one_of(st.none(), st.floats(0.5, 5.0), st.just(0.0))),
              "dropout_p": 0.0, "return_lse": draw(st.booleans()), "layout": layout}
    for name, key in (("scale", "scale"), ("softcap", "softcap"), ("dropout", "dropout_p"),
                      ("return_lse", "return_lse")):
        if fault == name:
            kwargs[key] = draw(BAD[name])
    return q, k, v, masks, bias, kwargs, desc


def _build(masks, bias):
    mask = None
    for make in masks:
        mask = make() if mask is None else mask & make()
    return mask, (bias() if callable(bias) else bias)


def _oracle(q, k, v, kwargs, desc):
    lens = desc["lens"]
    vis = oracle.build_visibility(
        desc["b"], desc["s_q"], desc["s_kv"], causal=desc["causal"], window=desc["window"],
        seq_lens_q=lens[0] if lens else None, seq_lens_kv=lens[1] if lens else None)
    offsets = None
    if desc["alibi"] is not None:
        align = desc["causal"] or (desc["window"][2] if desc["window"] else "top_left")
        offsets = oracle.aligned_offsets(desc["b"], desc["s_q"], desc["s_kv"], align,
                                         lens[0] if lens else None, lens[1] if lens else None)
    softcap = kwargs["softcap"] if kwargs["softcap"] else None
    return oracle.reference_attention(q, k, v, vis, layout=desc["layout"], scale=kwargs["scale"],
                                      softcap=softcap, bias=desc["bias"],
                                      alibi_slopes=desc["alibi"], alibi_offsets=offsets)


def _real(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _assert_documented_valid(q, kwargs, desc):
    """A call that returned must have had arguments the docstring allows."""
    assert type(kwargs["return_lse"]) is bool
    assert kwargs["dropout_p"] == 0.0
    assert kwargs["scale"] is None or _real(kwargs["scale"])
    assert kwargs["softcap"] is None or (_real(kwargs["softcap"]) and kwargs["softcap"] >= 0)
    assert desc["layout"] in ("bhsd", "bshd") and q.dtype.is_floating_point and q.shape[-1] > 0
    if desc["window"] is not None:
        assert all(type(x) is int and -1 <= x < 2 ** 31 for x in desc["window"][:2])
    if desc["lens"] is not None:
        lens_q, lens_kv = desc["lens"]
        assert len(lens_q) == len(lens_kv) == desc["b"]
        assert all(0 <= n <= desc["s_q"] for n in lens_q)
        assert all(0 <= n <= desc["s_kv"] for n in lens_kv)


@FUZZ
@given(attention_calls())
def test_attention_raises_a_documented_error_or_matches_the_oracle(call):
    q, k, v, masks, bias, kwargs, desc = call
    try:
        mask, bias = _build(masks, bias)
        result = ca.attention(q, k, v, mask=mask, bias=bias, **kwargs)
    except DOCUMENTED:
        return
    _assert_documented_valid(q, kwargs, desc)
    out, lse = result if kwargs["return_lse"] is True else (result, None)
    want, want_lse = _oracle(q, k, v, kwargs, desc)
    tol = 1e-10 if q.dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        finite = torch.isfinite(want_lse)
        torch.testing.assert_close(lse.double()[finite], want_lse[finite], rtol=tol, atol=tol)


@st.composite
def varlen_calls(draw):
    lens_q = draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
    lens_k = draw(st.lists(st.integers(0, 5), min_size=len(lens_q), max_size=len(lens_q)))
    heads, d = draw(st.sampled_from([(1, 1), (2, 1), (2, 2)])), draw(st.sampled_from([1, 4]))
    mask = draw(st.sampled_from([None, "causal-tl", "causal-br", "window"]))
    max_q = max(lens_q) + draw(st.sampled_from([0, 3, -1, 10 ** 9]))
    max_k = max(lens_k) + draw(st.sampled_from([0, 2]))
    cu_kind = draw(st.sampled_from(["ok", "ok", "ok", "short", "float", "decreasing"]))
    return lens_q, lens_k, heads, d, mask, max_q, max_k, cu_kind, draw(st.integers(0, 2**16))


def _cu(lens, kind):
    cu = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    if kind == "short":
        return cu[:-1]
    if kind == "float":
        return cu.float()
    if kind == "decreasing" and len(cu) > 2:
        return cu.flip(0)
    return cu


@FUZZ
@given(varlen_calls())
def test_varlen_raises_a_documented_error_or_matches_each_sequence(call):
    lens_q, lens_k, (h_q, h_kv), d, mask_kind, max_q, max_k, cu_kind, seed = call
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), h_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), h_kv, d, generator=g, dtype=torch.float64)
    masks = {None: (None, {}), "causal-tl": (ca.Causal(), {"causal": "top_left"}),
             "causal-br": (ca.Causal("bottom_right"), {"causal": "bottom_right"}),
             "window": (ca.SlidingWindow(1, 0), {"window": (1, 0)})}
    mask, kw = masks[mask_kind]
    try:
        out = ca.attention_varlen(q, k, v, _cu(lens_q, cu_kind), _cu(lens_k, "ok"), max_q, max_k,
                                  mask=mask)
    except DOCUMENTED:
        return
    assert cu_kind == "ok" or (cu_kind == "decreasing" and len(lens_q) == 1)
    starts_q, starts_k = np.cumsum([0, *lens_q]), np.cumsum([0, *lens_k])
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        one = slice(starts_q[b], starts_q[b] + n_q)
        if n_k == 0:  # no key: out = 0
            assert torch.equal(out[one], torch.zeros_like(out[one]))
            continue
        keys = slice(starts_k[b], starts_k[b] + n_k)
        vis = oracle.build_visibility(1, n_q, n_k, **kw)
        want, _ = oracle.reference_attention(q[None, one], k[None, keys], v[None, keys], vis,
                                             layout="bshd")
        torch.testing.assert_close(out[one], want[0], rtol=1e-10, atol=1e-10)


@st.composite
def neighborhood_calls(draw):
    rank = draw(st.integers(1, 2))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(rank))

    def per_axis(values):
        one = st.sampled_from(values)
        return st.one_of(one, st.tuples(*[one] * rank), st.tuples(*[one] * (rank + 1)))
    return (shape, draw(per_axis([0, 1, 2, 3, 4, 8])), draw(per_axis([1, 2, 3, 0])),
            draw(per_axis([1, 2, 3, -1])), draw(per_axis([False, True])),
            draw(st.sampled_from([1, 2])), draw(st.integers(0, 2**16)))


def _axes(value, rank):
    return tuple(value) if isinstance(value, tuple) else (value,) * rank


@FUZZ
@given(neighborhood_calls())
def test_neighborhood_raises_a_documented_error_or_matches_natten_rules(call):
    shape, kernel, stride, dilation, causal, heads, seed = call
    rank = len(shape)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, *shape, heads, 4, generator=g, dtype=torch.float64)
               for _ in range(3))
    fn = nb.na1d if rank == 1 else nb.na2d
    try:
        out = fn(q, k, v, kernel_size=kernel, stride=stride, dilation=dilation, is_causal=causal)
    except DOCUMENTED:
        return
    per_axis = [_axes(x, rank) for x in (kernel, stride, dilation, causal)]
    assert all(len(x) == rank for x in per_axis), "a wrong-length tuple was accepted"
    vis = oracle.neighborhood_visibility(shape, *per_axis)  # raises on what NATTEN rejects
    tokens = math.prod(shape)
    want, _ = oracle.reference_attention(q.reshape(1, tokens, heads, 4),
                                         k.reshape(1, tokens, heads, 4),
                                         v.reshape(1, tokens, heads, 4),
                                         torch.from_numpy(vis)[None], layout="bshd")
    torch.testing.assert_close(out.reshape(want.shape), want, rtol=1e-10, atol=1e-10)


def test_the_fuzzers_reach_both_outcomes():
    # Guard against a strategy that only ever errors (or never does): sample and count.
    outcomes = {"error": 0, "result": 0}

    @settings(max_examples=40, deadline=None, derandomize=True, database=None)
    @given(attention_calls())
    def probe(call):
        q, k, v, masks, bias, kwargs, _ = call
        try:
            mask, bias = _build(masks, bias)
            ca.attention(q, k, v, mask=mask, bias=bias, **kwargs)
            outcomes["result"] += 1
        except DOCUMENTED:
            outcomes["error"] += 1
    probe()
    assert outcomes["error"] > 0 and outcomes["result"] > 0, outcomes
