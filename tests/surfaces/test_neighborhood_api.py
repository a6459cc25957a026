"""``cudnn_attn.neighborhood.na1d/na2d/na3d`` and ``merge_attentions`` vs the float64 brute force
(``na_oracle`` on ``oracle.py``), the golden neighbor sets and numeric anchors (reference section
1.6), gradients (rpb included) and argument errors."""

import math

import na_oracle
import pytest
import torch
from test_neighborhood_golden import GOLDEN

from cudnn_attn import neighborhood as N

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}
NA = {1: N.na1d, 2: N.na2d, 3: N.na3d}

# (shape, kernel, stride, dilation, causal, H, H_kv, D, D_v)
CASES = [
    ((13,), 3, 1, 1, False, 2, 2, 8, 8),
    ((13,), 4, 2, 3, True, 2, 1, 8, 16),            # even kernel, stride, dilation, causal, GQA, Dv
    ((17,), 5, 5, 2, False, 3, 3, 16, 8),
    ((7, 9), (3, 4), (1, 2), (2, 1), (False, True), 4, 2, 8, 8),
    ((6, 8), (6, 3), (3, 3), (1, 2), (True, True), 2, 2, 8, 4),
    ((5, 6, 7), (3, 2, 3), (2, 1, 3), (1, 2, 2), (True, False, True), 2, 1, 8, 8),
    ((4, 4, 5), (4, 3, 5), (1, 3, 2), (1, 1, 1), (False, False, False), 1, 1, 4, 12),
]


def _cid(c):
    shape, k, s, d, causal, H, Hkv, D, Dv = c
    return f"L{shape}-k{k}-s{s}-d{d}-c{causal}-H{H}/{Hkv}-D{D}/{Dv}".replace(" ", "")


def _inputs(shape, H, Hkv, D, Dv, dtype=torch.float64, seed=0, B=2, extra=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)
    t = [rnd(B, *shape, H, D), rnd(B, *shape, Hkv, D), rnd(B, *shape, Hkv, Dv)]
    if extra:
        t += [rnd(B, extra, Hkv, D), rnd(B, extra, Hkv, Dv)]
    return t


def _close(a, b, tol, what):
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_na_matches_brute_force(case, dtype):
    shape, k, s, d, causal, H, Hkv, D, Dv = case
    q, kk, v = _inputs(shape, H, Hkv, D, Dv, dtype)
    out, lse = NA[len(shape)](q, kk, v, k, s, d, causal, return_lse=True)
    ref, ref_lse = na_oracle.na_reference(q, kk, v, shape, k, s, d, causal)
    assert out.dtype == dtype and out.shape == ref.shape
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert lse.shape == ref_lse.shape
    _close(out, ref, TOL[dtype], "out")
    _close(lse, ref_lse, TOL[dtype], "lse")
    assert torch.equal(NA[len(shape)](q, kk, v, k, s, d, causal), out)  # return_lse=False


@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_na_custom_scale_and_additional_kv(case):
    shape, k, s, d, causal, H, Hkv, D, Dv = case
    q, kk, v, ak, av = _inputs(shape, H, Hkv, D, Dv, extra=5, seed=1)
    out, lse = NA[len(shape)](q, kk, v, k, s, d, causal, scale=0.37, additional_keys=ak,
                              additional_values=av, return_lse=True)
    ref, ref_lse = na_oracle.na_reference(q, kk, v, shape, k, s, d, causal, 0.37, add_k=ak, add_v=av)
    _close(out, ref, 1e-10, "out")
    _close(lse, ref_lse, 1e-10, "lse")


# (shape, kernel, stride, dilation, H, H_kv) -- odd kernels, non-causal
RPB_CASES = [
    ((11,), 3, 1, 1, 2, 2),
    ((10,), 3, 1, 3, 2, 1),
    ((15,), 5, 2, 2, 1, 1),                       # stride with rpb: an extension of NATTEN 0.17
    ((7, 9), (3, 5), (1, 1), (2, 1), 2, 2),
    ((5, 6, 7), (3, 3, 5), (1, 1, 1), (1, 2, 1), 2, 1),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", RPB_CASES, ids=lambda c: f"L{c[0]}-k{c[1]}-s{c[2]}-d{c[3]}")
def test_na_rpb_matches_brute_force(case, dtype):
    shape, k, s, d, H, Hkv = case
    q, kk, v, ak, av = _inputs(shape, H, Hkv, 8, 8, dtype, seed=2, extra=3)
    ks = na_oracle.per_axis(k, len(shape))
    rpb = torch.randn(H, *(2 * x - 1 for x in ks), dtype=torch.float64).to(dtype)
    out, lse = NA[len(shape)](q, kk, v, k, s, d, rpb=rpb, return_lse=True)
    ref, ref_lse = na_oracle.na_reference(q, kk, v, shape, k, s, d, False, rpb=rpb)
    _close(out, ref, TOL[dtype], "out")
    _close(lse, ref_lse, TOL[dtype], "lse")
    out = NA[len(shape)](q, kk, v, k, s, d, rpb=rpb, additional_keys=ak, additional_values=av)
    ref, _ = na_oracle.na_reference(q, kk, v, shape, k, s, d, False, rpb=rpb, add_k=ak, add_v=av)
    _close(out, ref, TOL[dtype], "out+extra")


@pytest.mark.parametrize("use_rpb", [False, True], ids=["plain", "rpb"])
def test_na_gradients_match_brute_force(use_rpb):
    shape, k, s, d, causal = (6, 7), (3, 5), (1, 2), (2, 1), (False, not use_rpb)
    q, kk, v, ak, av = _inputs(shape, 4, 2, 8, 12, extra=4, seed=3, grad=True)
    rpb = torch.randn(4, 5, 9, dtype=torch.float64, requires_grad=True) if use_rpb else None
    out = N.na2d(q, kk, v, k, s, d, causal, rpb=rpb, additional_keys=ak, additional_values=av)
    ref, _ = na_oracle.na_reference(q, kk, v, shape, k, s, d, causal, rpb=rpb, add_k=ak, add_v=av)
    dout = torch.randn_like(ref)
    leaves = [t for t in (q, kk, v, ak, av, rpb) if t is not None]
    got = torch.autograd.grad(out, leaves, dout)
    exp = torch.autograd.grad(ref, leaves, dout)
    for name, a, e in zip(["q", "k", "v", "extra_k", "extra_v", "rpb"], got, exp):
        _close(a, e, 1e-9, f"d{name}")


def test_lse_gradient_flows():
    shape = (9,)
    q, kk, v = _inputs(shape, 2, 2, 8, 8, grad=True)
    _, lse = N.na1d(q, kk, v, 3, is_causal=True, return_lse=True)
    _, ref_lse = na_oracle.na_reference(q, kk, v, shape, 3, causal=True)
    got = torch.autograd.grad(lse.sum(), [q, kk])
    exp = torch.autograd.grad(ref_lse.sum(), [q, kk])
    for a, e in zip(got, exp):
        _close(a, e, 1e-9, "dlse")


# ------------------------------------------------------------------------------------------------
# Golden values (reference section 1.6)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: "L{}-k{}-s{}-d{}-c{}".format(*k))
def test_golden_neighbor_sets(key):
    L, k, s, d, causal = key
    q = torch.zeros(1, L, 1, 4, dtype=torch.float64)
    v = torch.eye(L, dtype=torch.float64).reshape(1, L, 1, L)
    out = N.na1d(q, q, v, k, s, d, causal)[0, :, 0]
    for i, expected in enumerate(GOLDEN[key]):
        row = out[i]
        seen = torch.nonzero(row > 1e-12).flatten().tolist()
        assert seen == expected, f"query {i}: {seen} != {expected}"
        _close(row[seen], torch.full((len(seen),), 1.0 / len(seen), dtype=torch.float64), 1e-12, f"weights of {i}")


ANCHORS = {
    ((3,), 1, 1, False): ([0.780141, 0.680639, 0.988809, 1.331538, 1.446389, 1.357484, 1.233786,
                           1.171496],
                          [1.667541, 2.891932, 2.090779, 0.948765, 1.950970, 3.396440, 3.200493,
                           1.862507]),
    ((4,), 1, 1, False): ([0.852503, 0.697210, 0.699721, 1.128291, 1.420964, 1.363243, 1.291824,
                           1.246483], None),
    ((3,), 2, 2, False): ([0.812777, 0.934103, 0.601962, 1.070252, 1.318762, 1.300782, 1.310209,
                           1.230148], None),
    ((3,), 1, 1, True): ([0.500000, 0.628553, 0.683420, 1.088248, 1.427925, 1.442165, 1.353591,
                          1.171496],
                         [0.881740, 2.799310, 2.963813, 1.461992, 1.600757, 3.125964, 3.320046,
                          1.862507]),
}


@pytest.mark.parametrize("key", list(ANCHORS), ids=lambda k: "k{}-s{}-d{}-c{}".format(*k))
def test_numeric_anchors(key):
    k, s, d, causal = key
    x = torch.arange(64, dtype=torch.float32).reshape(1, 8, 1, 8)
    q, kk, v = torch.sin(0.1 * x), torch.cos(0.07 * x), torch.sin(0.05 * x) + 0.5
    out, lse = N.na1d(q, kk, v, k, s, d, causal, return_lse=True)
    exp_out, exp_lse = ANCHORS[key]
    torch.testing.assert_close(out[0, :, 0, 0], torch.tensor(exp_out), atol=2e-6, rtol=0)
    if exp_lse is not None:
        torch.testing.assert_close(lse[0, :, 0], torch.tensor(exp_lse), atol=2e-6, rtol=0)


def test_golden_rpb_indices():
    """RPB idx (L=7,k=3), (L=10,k=3,d=3), (L=9,k=5): rpb = arange, q = k = 0, uniform v = one-hot."""
    golden = {
        (7, 3, 1): [[2, 3, 4]] + [[1, 2, 3]] * 5 + [[0, 1, 2]],
        (10, 3, 3): [[2, 3, 4]] * 3 + [[1, 2, 3]] * 4 + [[0, 1, 2]] * 3,
        (9, 5, 1): [list(range(4, 9)), list(range(3, 8))] + [list(range(2, 7))] * 5
        + [list(range(1, 6)), list(range(5))],
    }
    for (L, k, d), expected in golden.items():
        q = torch.zeros(1, 1, L, 4, dtype=torch.float64)
        rpb = torch.arange(2 * k - 1, dtype=torch.float64)[None]
        attn = N.na1d_qk(q, q, k, d, rpb=rpb)[0, 0]
        assert attn.tolist() == [[float(x) for x in row] for row in expected], (L, k, d)


# ------------------------------------------------------------------------------------------------
# merge_attentions
# ------------------------------------------------------------------------------------------------

def test_merge_attentions_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(5)
    B, S, H, D = 2, 6, 3, 8
    q, k, v = (torch.randn(B, S + 7, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    q = q[:, :S].requires_grad_(True)
    parts = [(0, 3), (3, 7), (7, 13)]
    outs, lses = [], []
    for a, b in parts:
        o, l = na_oracle.oracle.reference_attention(q, k[:, a:b], v[:, a:b], layout="bshd")
        outs.append(o)
        lses.append(l.transpose(1, 2))
    out, lse = N.merge_attentions(outs, lses)
    ref, ref_lse = na_oracle.oracle.reference_attention(q, k, v, layout="bshd")
    _close(out, ref, 1e-12, "out")
    _close(lse, ref_lse.transpose(1, 2), 1e-12, "lse")
    dout = torch.randn_like(out)
    _close(torch.autograd.grad(out, q, dout)[0], torch.autograd.grad(ref, q, dout)[0], 1e-12, "dq")


def test_merge_attentions_handles_empty_rows():
    o1 = torch.randn(1, 4, 2, 3, requires_grad=True)
    o2 = torch.randn(1, 4, 2, 3, requires_grad=True)
    l1 = torch.tensor([[[0.5, -math.inf], [-math.inf, -math.inf], [1.0, 2.0], [-math.inf, 0.0]]],
                      requires_grad=True)
    l2 = torch.tensor([[[-math.inf, 0.3], [-math.inf, -math.inf], [0.0, -1.0], [-math.inf, 0.0]]],
                      requires_grad=True)
    out, lse = N.merge_attentions([o1, o2], [l1, l2])
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out[0, 1], torch.zeros(2, 3))           # empty in both
    assert lse[0, 1].tolist() == [-math.inf, -math.inf]
    torch.testing.assert_close(out[0, 0, 0], o1[0, 0, 0])              # only one side visible
    torch.testing.assert_close(out[0, 0, 1], o2[0, 0, 1])
    torch.testing.assert_close(out[0, 3, 1], (o1[0, 3, 1] + o2[0, 3, 1]) / 2)
    torch.testing.assert_close(lse[0, 3, 1], torch.tensor(math.log(2.0)))
    grads = torch.autograd.grad((out.sum() + lse[lse.isfinite()].sum()), [o1, o2, l1, l2])
    assert all(not g.isnan().any() for g in grads)
    assert float(grads[0][0, 1].abs().sum()) == 0.0


def test_merge_attentions_single_and_dtype():
    o = torch.randn(1, 3, 2, 4, dtype=torch.float16)
    l = torch.randn(1, 3, 2)
    out, lse = N.merge_attentions([o, o], [l, l])
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, o)
    torch.testing.assert_close(lse, l + math.log(2.0))


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


ERRORS = [
    ("kernel-1", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 1), ValueError,
     "kernel_size"),
    ("kernel*dil>L", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3, dilation=3),
     ValueError, "kernel_size"),
    ("stride>k", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3, stride=4),
     ValueError, "stride"),
    ("rank-tuple", lambda: N.na2d(_t(1, 8, 8, 1, 4), _t(1, 8, 8, 1, 4), _t(1, 8, 8, 1, 4), (3, 3, 3)),
     ValueError, "kernel_size"),
    ("query-rank", lambda: N.na2d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3), ValueError,
     "query"),
    ("key-shape", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 9, 1, 4), _t(1, 9, 1, 4), 3), ValueError,
     "key"),
    ("heads", lambda: N.na1d(_t(1, 8, 3, 4), _t(1, 8, 2, 4), _t(1, 8, 2, 4), 3), ValueError, "heads"),
    ("dtype", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4, dtype=torch.float64), _t(1, 8, 1, 4), 3),
     ValueError, "key"),  # NATTEN 0.21: ValueError
    ("int", lambda: N.na1d(torch.ones(1, 8, 1, 4, dtype=torch.int32), _t(1, 8, 1, 4), _t(1, 8, 1, 4),
                           3), NotImplementedError, "query"),  # NATTEN: no backend for it
    ("not-tensor", lambda: N.na1d([1.0], _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3), TypeError, "query"),
    ("scale", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3, scale="x"),
     TypeError, "scale"),
    ("causal-type", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3, is_causal=2),
     ValueError, "is_causal"),
    # NATTEN 0.21's types for arguments of the wrong kind (its check_all_args / tensor checks).
    ("kernel-float", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3.0),
     ValueError, "kernel_size"),
    ("causal-str", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3,
                                  is_causal="yes"), ValueError, "is_causal"),
    ("attention-causal-str", lambda: N.attention(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4),
                                                 is_causal="yes"), ValueError, "is_causal"),
    ("attention-dtype", lambda: N.attention(_t(1, 8, 1, 4), _t(1, 8, 1, 4, dtype=torch.float64),
                                            _t(1, 8, 1, 4)), ValueError, "key"),
    ("attention-int", lambda: N.attention(*(torch.ones(1, 8, 1, 4, dtype=torch.int64),) * 3),
     NotImplementedError, "query"),
    ("attention-q-tile-alone", lambda: N.attention(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4),
                                                   q_tile_size=64), ValueError,
     "specify both q_tile_size and kv_tile_size"),
    ("sparse", lambda: N.na1d(_t(1, 8, 1, 4).to_sparse(), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3),
     NotImplementedError, "query"),
    ("rpb-even", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 4, rpb=_t(1, 7)),
     ValueError, "rpb"),
    ("rpb-causal", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3, is_causal=True,
                                  rpb=_t(1, 5)), ValueError, "rpb"),
    ("rpb-shape", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3, rpb=_t(2, 5)),
     ValueError, "rpb"),
    ("extra-alone", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3,
                                   additional_keys=_t(1, 2, 1, 4)), ValueError, "additional"),
    ("extra-shape", lambda: N.na1d(_t(1, 8, 1, 4), _t(1, 8, 1, 4), _t(1, 8, 1, 4), 3,
                                   additional_keys=_t(1, 2, 1, 5), additional_values=_t(1, 2, 1, 4)),
     ValueError, "additional_keys"),
    # NATTEN 0.21: at least two parts, as many lse tensors as outputs.
    ("merge-one", lambda: N.merge_attentions([_t(1, 2, 1, 4)], [_t(1, 2, 1)]), ValueError,
     "at least two"),
    ("merge-len", lambda: N.merge_attentions([_t(1, 2, 1, 4)] * 2, [_t(1, 2, 1)]), ValueError,
     "match"),
    ("merge-shape", lambda: N.merge_attentions([_t(1, 2, 1, 4)] * 2, [_t(1, 2, 1), _t(1, 2, 2)]),
     ValueError, "lse_tensors"),
    ("merge-flag", lambda: N.merge_attentions([_t(1, 2, 1, 4)] * 2, [_t(1, 2, 1)] * 2,
                                              torch_compile=None), TypeError, "torch_compile"),
    ("merge-type", lambda: N.merge_attentions(_t(1, 2, 1, 4), _t(1, 2, 1)), TypeError, "lists"),
]


@pytest.mark.parametrize("name,call,exc,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("name,call,exc,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_after_valid_calls_of_the_same_shapes(name, call, exc, match):
    """A plain call's validation is kept per argument set (functional._VALIDATED): valid calls
    with these tensors' shapes and dtypes first, then every bad call still raises NATTEN's
    error (``3`` and ``3.0``, ``True`` and ``1`` are different arguments)."""
    for rank in (1, 2):
        x = _t(1, *(8,) * rank, 1, 4)
        NA[rank](x, x, x, 3)
        NA[rank](x, x, x, 3, is_causal=True)
        NA[rank](x, x, x, 3, dilation=2, stride=1)
    with pytest.raises(exc, match=match):
        call()


def test_a_repeated_call_is_validated_once(monkeypatch):
    from cudnn_attn.compat.natten import functional

    seen = []
    validate = functional._validate
    monkeypatch.setattr(functional, "_validate", lambda *a: seen.append(a[0]) or validate(*a))
    functional._VALIDATED.clear()
    q, k, v = _inputs((9, 7), 2, 1, 8, 8)
    want = N.na2d(q, k, v, 3, is_causal=(True, False))
    for _ in range(3):  # the same arguments: checked once, the same result
        assert torch.equal(N.na2d(q, k, v, 3, is_causal=(True, False)), want)
    assert seen == [2]
    N.na2d(q, k, v, 3, is_causal=(False, True))  # other arguments: checked
    N.na2d(q, k, v, 3, is_causal=(True, False), q_tile_shape=(8, 8), kv_tile_shape=(8, 8))
    extra = torch.randn(2, 3, 1, 8, dtype=torch.float64)
    N.na2d(q, k, v, 3, additional_keys=extra, additional_values=extra)
    N.na2d(q, k, v, 3, additional_keys=extra, additional_values=extra)
    assert seen == [2] * 5  # tuning hints and extra keys are checked on every call
