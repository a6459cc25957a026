"""attention_varlen (packed [total, H, D] + cu_seqlens) against the float64 oracle run on each
sequence alone: ragged lengths (1, 2, 113, empty), GQA, D_v != D_qk, causal in both alignments,
sliding windows, tensor bias, ALiBi, softcap, the packed [H, total_q] lse, dropout, gradients
(autograd vs the oracle's autograd, gradcheck) and input errors."""

from __future__ import annotations

import itertools
import re

import oracle
import pytest
import torch
from common import ca, lib_mask

from cudnn_attn.varlen import attention_varlen

F64 = torch.float64
TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=2e-5)}


def oracle_one(q1, k1, v1, *, causal=None, window=None, bias=None, slopes=None, scale=None,
               softcap=None):
    """The oracle on one sequence: q1 ``[S_q, H_q, D]``, k1/v1 ``[S_k, H_kv, D]``; bias
    broadcastable to ``[1, H_q, S_q, S_k]``; slopes ``[H_q]``. Returns float64 (out ``[S_q, H_q,
    D_v]``, lse ``[H_q, S_q]``), differentiable."""
    Sq, Hq = q1.shape[0], q1.shape[1]
    Sk, Dv = k1.shape[0], v1.shape[2]
    if Sk == 0 or Sq == 0:  # nothing visible: out 0, lse -inf (keep a graph to q/k/v)
        zero = 0.0 * (q1.sum() + k1.sum() + v1.sum()).to(F64)
        out = torch.zeros(Sq, Hq, Dv, dtype=F64) + zero
        return out, torch.full((Hq, Sq), float("-inf"), dtype=F64)
    vis = oracle.build_visibility(1, Sq, Sk, causal=causal, window=window)
    if slopes is not None:
        align = causal or (window[2] if window is not None and len(window) > 2 else "top_left")
        offs = oracle.aligned_offsets(1, Sq, Sk, align)
        ab = oracle.alibi_bias(slopes, 1, Hq, Sq, Sk, offs)
        bias = ab if bias is None else bias + ab
    out, lse = oracle.reference_attention(q1[None], k1[None], v1[None], vis, layout="bshd",
                                          scale=scale, softcap=softcap, bias=bias)
    return out[0], lse[0]


def pack(lens, H, D, dtype, g):
    return torch.randn(sum(lens), H, D, generator=g, dtype=F64).to(dtype)


def cu(lens, dtype=torch.int32):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=dtype)


def oracle_varlen(q, k, v, lens_q, lens_k, *, bias=None, slopes=None, **kw):
    """Per-sequence oracle results packed like attention_varlen's: (out [total_q, H, D_v],
    lse [H, total_q])."""
    outs, lses = [], []
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        bias_b = None
        if bias is not None:  # [b, :, :lq, :lk] of the bias broadcast to 4-D (size-1 dims stay)
            full = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
            row = b if full.shape[0] > 1 else 0
            bias_b = full[row:row + 1, :, :lq, :lk]
        slopes_b = None
        if slopes is not None:
            slopes_b = slopes[b] if isinstance(slopes, torch.Tensor) and slopes.dim() == 2 else slopes
        o, lse = oracle_one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]],
                            bias=bias_b, slopes=slopes_b, **kw)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def check(out, lse, ref_out, ref_lse, dtype, total_q, Hq, Dv):
    assert out.shape == (total_q, Hq, Dv) and out.dtype == dtype
    assert lse.shape == (Hq, total_q), f"lse must be FA2's packed [H, total_q], got {lse.shape}"
    assert lse.dtype == (F64 if dtype == F64 else torch.float32)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.to(F64), ref_out, **TOL[dtype])
    torch.testing.assert_close(lse.to(F64), ref_lse, **TOL[dtype])


LENS = [  # (lens_q, lens_k)
    ((1, 2, 113), (1, 2, 113)),
    ((1, 2, 113), (5, 1, 40)),
    ((7, 3, 2), (2, 9, 30)),
    # one long sequence among short ones that share their lengths (groups of several), and
    # sequences with no query or no key
    ((41, 3, 5, 3, 0, 3, 5), (41, 6, 2, 6, 4, 6, 0)),
]

CASES = [
    dict(id="plain"),
    dict(id="causal-tl", mask=dict(causal="top_left")),
    dict(id="causal-br", mask=dict(causal="bottom_right")),
    dict(id="window-tl", mask=dict(window=(3, 1))),
    dict(id="window-br", mask=dict(window=(4, 0, "bottom_right"))),
    dict(id="causal-br&window", mask=dict(causal="bottom_right", window=(2, -1, "bottom_right"))),
    dict(id="bias-full", bias="full"),
    dict(id="bias-bcast", bias="bcast", mask=dict(causal="top_left")),
    dict(id="alibi-default-br", alibi="default", mask=dict(causal="bottom_right")),
    dict(id="alibi-bh", alibi="bh", mask=dict(window=(5, 0, "bottom_right"))),
    dict(id="softcap-scale", softcap=1.5, scale=0.3),
]


def run_case(case, lens_q, lens_k, dtype=F64, Hq=4, Hkv=2, D=16, Dv=8, extra=(3, 2), seed=0,
             cu_dtype=torch.int32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = pack(lens_q, Hq, D, dtype, g), pack(lens_k, Hkv, D, dtype, g), pack(lens_k, Hkv, Dv, dtype, g)
    B, mq, mk = len(lens_q), max(lens_q) + extra[0], max(lens_k) + extra[1]
    bias = slopes = None
    lib_bias = None
    if case.get("bias") == "full":
        bias = lib_bias = torch.randn(B, Hq, mq, mk, generator=g, dtype=F64).to(dtype)
    elif case.get("bias") == "bcast":
        bias = lib_bias = torch.randn(Hq, 1, mk, generator=g, dtype=F64).to(dtype)
    if case.get("alibi") == "default":
        slopes, lib_bias = oracle.default_alibi_slopes(Hq), ca().Alibi()
    elif case.get("alibi") == "bh":
        slopes = torch.rand(B, Hq, generator=g, dtype=F64) * 0.5 + 0.05
        lib_bias = ca().Alibi(slopes)
    mask_kw = case.get("mask", {})
    dev = [t.to(device) for t in (q, k, v, cu(lens_q, cu_dtype), cu(lens_k, cu_dtype))]
    if isinstance(lib_bias, torch.Tensor):
        lib_bias = lib_bias.to(device)
    out, lse = attention_varlen(*dev, mq, mk, mask=lib_mask(**mask_kw), bias=lib_bias,
                                scale=case.get("scale"), softcap=case.get("softcap"),
                                return_lse=True)
    out, lse = out.cpu(), lse.cpu()
    ref_out, ref_lse = oracle_varlen(q, k, v, lens_q, lens_k, bias=bias, slopes=slopes,
                                     scale=case.get("scale"), softcap=case.get("softcap"), **mask_kw)
    check(out, lse, ref_out, ref_lse, dtype, sum(lens_q), Hq, Dv)


@pytest.mark.parametrize("lens", LENS, ids=["same", "ragged", "short-q", "mixed"])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_forward_vs_oracle(case, lens):
    run_case(case, *lens)


@pytest.mark.parametrize("lens", LENS[1:], ids=["ragged", "short-q", "mixed"])
@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_padded_path_vs_oracle(case, lens, monkeypatch):
    # The one padded batch GPU engines (and dropout) take; on the CPU calls group by length.
    import cudnn_attn.varlen as varlen
    monkeypatch.setattr(varlen, "by_length_groups", lambda *args: False)  # as bound in varlen
    run_case(case, *lens)


def test_cpu_cost_follows_each_sequence_not_the_longest(monkeypatch):
    # 1 long + 30 short sequences: grouped by length, the short ones never pad to the long one.
    import cudnn_attn.packed.groups as varlen
    shapes = []
    original = varlen.attention
    monkeypatch.setattr(varlen, "attention",
                        lambda q, k, v, **kw: shapes.append(tuple(q.shape[:2])) or original(
                            q, k, v, **kw))
    run_case(dict(id="causal", mask=dict(causal="bottom_right")), (60,) + (4,) * 30,
             (60,) + (6,) * 30, Hq=2, Hkv=1, D=8, Dv=8)
    assert sorted(shapes) == [(1, 60), (30, 4)]


def test_float32_int64_cu_and_exact_max():
    run_case(dict(mask=dict(causal="bottom_right")), (3, 113, 1), (60, 113, 2),
             dtype=torch.float32, extra=(0, 0), cu_dtype=torch.int64)


@pytest.mark.parametrize("mask", [None, dict(causal="bottom_right"), dict(window=(1, 1))])
def test_empty_sequences(mask):
    """Zero-length query and key sequences: an empty key set gives out 0 and lse -inf."""
    run_case(dict(mask=mask or {}), (0, 4, 3, 2, 0), (5, 0, 3, 0, 0), Hq=2, Hkv=1, D=8, Dv=8)


def test_all_empty():
    q, k = torch.zeros(0, 2, 8, dtype=F64), torch.zeros(0, 1, 8, dtype=F64)
    v = torch.zeros(0, 1, 4, dtype=F64)
    out, lse = attention_varlen(q, k, v, cu((0, 0)), cu((0, 0)), 0, 0, return_lse=True)
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 8, generator=g, dtype=F64)
    out, lse = attention_varlen(q, k, v, cu((1, 2)), cu((0, 0)), 2, 0, return_lse=True,
                                bias=torch.ones(2, 2, 2, 0, dtype=F64))
    assert torch.equal(out, torch.zeros(3, 2, 4, dtype=F64))
    assert torch.isneginf(lse).all() and lse.shape == (2, 3)


def test_return_lse_false_and_shapes():
    g = torch.Generator().manual_seed(1)
    q, k, v = pack((2, 5), 3, 8, F64, g), pack((4, 1), 3, 8, F64, g), pack((4, 1), 3, 6, F64, g)
    out = attention_varlen(q, k, v, cu((2, 5)), cu((4, 1)), 5, 4)
    assert isinstance(out, torch.Tensor) and out.shape == (7, 3, 6)


def test_dropout_against_oracle_probabilities():
    """With identity values the output row is the dropped, rescaled probability row: every entry
    is 0 or p_ref / (1 - p); about p of them are dropped; a generator makes it repeatable."""
    lens_q, lens_k, p = (6, 9), (10, 7), 0.4
    g = torch.Generator().manual_seed(7)
    q, k = pack(lens_q, 2, 8, F64, g), pack(lens_k, 2, 8, F64, g)
    mk = max(lens_k)
    v = torch.cat([torch.eye(n, mk, dtype=F64) for n in lens_k])[:, None].expand(-1, 2, -1).contiguous()
    ref, _ = oracle_varlen(q, k, v, lens_q, lens_k, causal="bottom_right")
    runs = [attention_varlen(q, k, v, cu(lens_q), cu(lens_k), mk, mk, dropout_p=p,
                             mask=ca().Causal("bottom_right"),
                             generator=torch.Generator().manual_seed(s)) for s in (11, 11, 12)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    out = runs[0]
    kept = out != 0
    torch.testing.assert_close(out[kept], (ref / (1 - p))[kept], atol=1e-12, rtol=1e-12)
    visible = ref != 0
    assert not (kept & ~visible).any()
    frac = 1 - kept[visible].double().mean().item()
    assert abs(frac - p) < 0.12, frac


GRAD_CASES = [
    dict(id="gqa-causal-br", lens=((3, 1, 6), (4, 2, 6)), mask=dict(causal="bottom_right")),
    dict(id="bias-window", lens=((2, 5), (5, 3)), mask=dict(window=(2, 0)), bias=True),
    dict(id="empty-k-softcap", lens=((3, 2, 0), (0, 4, 2)), softcap=2.0),
    dict(id="mixed-groups-bias", lens=((9, 2, 2, 0, 2), (9, 3, 3, 2, 3)),
         mask=dict(causal="bottom_right"), bias=True),
]


@pytest.mark.parametrize("case", GRAD_CASES, ids=[c["id"] for c in GRAD_CASES])
def test_gradients_vs_oracle(case):
    lens_q, lens_k = case["lens"]
    g = torch.Generator().manual_seed(5)
    q, k, v = pack(lens_q, 4, 8, F64, g), pack(lens_k, 2, 8, F64, g), pack(lens_k, 2, 6, F64, g)
    mq, mk = max(lens_q) + 1, max(lens_k)
    bias = torch.randn(len(lens_q), 4, mq, mk, generator=g, dtype=F64) if case.get("bias") else None
    leaves = [t.requires_grad_() for t in (q, k, v, bias) if t is not None]
    mask_kw = case.get("mask", {})
    out, lse = attention_varlen(q, k, v, cu(lens_q), cu(lens_k), mq, mk, mask=lib_mask(**mask_kw),
                                bias=bias, softcap=case.get("softcap"), return_lse=True)
    ref, _ = oracle_varlen(q, k, v, lens_q, lens_k, bias=bias, softcap=case.get("softcap"), **mask_kw)
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    got = torch.autograd.grad(out, leaves, dout)
    exp = torch.autograd.grad(ref, leaves, dout)
    for name, a, e in zip("qkvb", got, exp):
        assert not torch.isnan(a).any(), f"NaN in d{name}"
        torch.testing.assert_close(a, e, atol=1e-9, rtol=1e-7, msg=lambda m, n=name: f"d{n}: {m}")


def test_gradcheck():
    lens_q, lens_k = (2, 3), (3, 2)
    g = torch.Generator().manual_seed(9)
    q, k, v = pack(lens_q, 2, 3, F64, g), pack(lens_k, 1, 3, F64, g), pack(lens_k, 1, 2, F64, g)
    bias = torch.randn(1, 2, 3, 3, generator=g, dtype=F64)
    tensors = tuple(t.requires_grad_() for t in (q, k, v, bias))

    def fn(q, k, v, bias):
        return attention_varlen(q, k, v, cu(lens_q), cu(lens_k), 3, 3, bias=bias,
                                mask=ca().Causal("bottom_right"))

    assert torch.autograd.gradcheck(fn, tensors, eps=1e-6, atol=1e-6, rtol=1e-4)


def test_backend_is_forwarded():
    g = torch.Generator().manual_seed(2)
    q, k, v = pack((3,), 2, 8, F64, g), pack((3,), 2, 8, F64, g), pack((3,), 2, 8, F64, g)
    attention_varlen(q, k, v, cu((3,)), cu((3,)), 3, 3, backend="torch")
    with pytest.raises(ca().NotSupportedError):
        attention_varlen(q, k, v, cu((3,)), cu((3,)), 3, 3, backend="cupy")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [F64, torch.float32], ids=str)
@pytest.mark.parametrize("case", [CASES[2], CASES[5], CASES[6], CASES[9]], ids=lambda c: c["id"])
def test_cuda_matches_oracle(case, dtype):
    run_case(case, (1, 2, 113, 0), (5, 1, 113, 3), dtype=dtype, device="cuda")


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

def _inputs():
    g = torch.Generator().manual_seed(4)
    return pack((2, 3), 2, 8, F64, g), pack((4, 1), 2, 8, F64, g), pack((4, 1), 2, 8, F64, g)


def _call(**override):
    q, k, v = _inputs()
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu((2, 3)), cu_seqlens_k=cu((4, 1)), max_seqlen_q=3,
                max_seqlen_k=4)
    args.update(override)
    pos = [args.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                 "max_seqlen_k")]
    return attention_varlen(*pos, **args)


ERRORS = [
    ("q-not-tensor", dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    ("q-rank", dict(q=torch.zeros(1, 5, 2, 8, dtype=F64)), ValueError, "q must be 3-D"),
    ("k-rank", dict(k=torch.zeros(5, 16, dtype=F64)), ValueError, "k must be 3-D"),
    ("kv-tokens", dict(v=torch.zeros(4, 2, 8, dtype=F64)), ValueError, "k and v must have"),
    ("d-mismatch", dict(k=torch.zeros(5, 2, 4, dtype=F64), v=torch.zeros(5, 2, 4, dtype=F64)),
     ValueError, "head dim"),
    ("gqa", dict(k=torch.zeros(5, 3, 8, dtype=F64), v=torch.zeros(5, 3, 8, dtype=F64)), ValueError,
     "multiple of kv heads"),
    ("dtype-mismatch", dict(k=torch.zeros(5, 2, 8, dtype=torch.float32)), TypeError, "share a dtype"),
    ("cu-not-tensor", dict(cu_seqlens_q=[0, 2, 5]), TypeError, "cu_seqlens_q must be a torch.Tensor"),
    ("cu-float", dict(cu_seqlens_q=torch.tensor([0.0, 2.0, 5.0])), TypeError, "cu_seqlens_q must be int32"),
    ("cu-rank", dict(cu_seqlens_k=cu((4, 1))[None]), ValueError, "cu_seqlens_k must be 1-D"),
    ("cu-short", dict(cu_seqlens_q=torch.tensor([5], dtype=torch.int32)), ValueError, "B + 1 >= 2"),
    ("cu-start", dict(cu_seqlens_q=torch.tensor([1, 2, 5], dtype=torch.int32)), ValueError,
     "cu_seqlens_q must start at 0"),
    ("cu-decreasing", dict(cu_seqlens_k=torch.tensor([0, 4, 3, 5], dtype=torch.int32),
                           cu_seqlens_q=cu((2, 3, 0))), ValueError, "non-decreasing"),
    ("cu-total", dict(cu_seqlens_q=cu((2, 2))), ValueError, "cu_seqlens_q[-1] must equal"),
    ("cu-batch", dict(cu_seqlens_q=cu((2, 3, 0))), ValueError, "same batch"),
    ("cu-device", dict(cu_seqlens_q=torch.zeros(3, dtype=torch.int32, device="meta")), ValueError,
     "q's device"),
    ("max-small", dict(max_seqlen_k=3), ValueError, "max_seqlen_k must be >= the longest"),
    ("max-float", dict(max_seqlen_q=3.0), TypeError, "max_seqlen_q must be an int"),
    ("mask-type", dict(mask="causal"), TypeError, "mask must be a cudnn_attn mask"),
    ("bias-shape", dict(bias=torch.zeros(2, 2, 3, 5, dtype=F64)), ValueError, "max_seqlen_k"),
    ("bias-type", dict(bias=1.0), TypeError, "bias must be"),
    ("dropout", dict(dropout_p=1.5), ValueError, "dropout_p"),
]


def _error_cases():
    lib = ca()
    return ERRORS + [
        ("mask-padding", dict(mask=lib.Causal() & lib.Padding((2, 3), (4, 1))), ValueError,
         "must not contain Padding"),
        ("mask-neighborhood", dict(mask=lib.Neighborhood(4, 3)), ValueError,
         "must not contain Neighborhood"),
    ]


@pytest.mark.parametrize("name,override,exc,match", _error_cases(), ids=[c[0] for c in _error_cases()])
def test_errors(name, override, exc, match):
    with pytest.raises(exc, match=re.escape(match)):
        _call(**override)
