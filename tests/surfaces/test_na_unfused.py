"""Unfused ``na{1,2,3}d_qk`` / ``na{1,2,3}d_av`` (NATTEN 0.17) vs the float64 brute force
(``na_oracle``), NATTEN 0.17's fp64 gradcheck / forward-AD grids (reference section 4.2), a
``torch.func.jvp`` check against finite differences, self-attention equivalence and errors."""

import math

import na_oracle
import pytest
import torch
from torch.autograd import gradcheck

from cudnn_attn import neighborhood as N

QK = {1: N.na1d_qk, 2: N.na2d_qk, 3: N.na3d_qk}
AV = {1: N.na1d_av, 2: N.na2d_av, 3: N.na3d_av}
GC = {"eps": 1e-6, "atol": 1e-6, "rtol": 1e-4, "fast_mode": True}  # NATTEN default; slow mode takes minutes


def _rnd(*shape, seed=0, dtype=torch.float64, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_(grad)


def _rpb(H, kernel, rank, seed=9, grad=False):
    ks = na_oracle.per_axis(kernel, rank)
    return _rnd(H, *(2 * k - 1 for k in ks), seed=seed, grad=grad)


# (B, H, shape, D, kernel, dilation, causal)
CASES = [
    (2, 2, (16,), 8, 5, 1, False),
    (2, 2, (16,), 8, 5, 3, True),
    (1, 3, (9,), 4, 9, 1, False),
    (1, 2, (8, 7), 8, 5, 1, (True, False)),
    (2, 1, (7, 9), 4, (3, 5), (2, 1), False),
    (1, 2, (6, 5), 4, (3, 5), (2, 1), (False, True)),
    (1, 1, (6, 3, 5), 2, (3, 3, 5), (2, 1, 1), (True, False, True)),
    (1, 2, (3, 3, 6), 4, 3, 1, False),
]


def _cid(c):
    B, H, shape, D, k, d, causal = c
    return f"B{B}H{H}-L{shape}-D{D}-k{k}-d{d}-c{causal}".replace(" ", "")


def _noncausal(causal):
    return not any(na_oracle.per_axis(causal, 3))


@pytest.mark.parametrize("extra", [0, 4], ids=["na", "extra4"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=_cid)
def test_qk_av_match_brute_force(case, dtype, extra):
    B, H, shape, D, k, d, causal = case
    rank = len(shape)
    q, kk = _rnd(B, H, *shape, D, seed=1, dtype=dtype), _rnd(B, H, *shape, D, seed=2, dtype=dtype)
    v = _rnd(B, H, *shape, D + 3, seed=3, dtype=dtype)
    ak = _rnd(B, H, extra, D, seed=4, dtype=dtype) if extra else None
    av = _rnd(B, H, extra, D + 3, seed=5, dtype=dtype) if extra else None
    rpb = _rpb(H, k, rank).to(dtype) if _noncausal(causal) else None
    attn = QK[rank](q, kk, k, d, ak, causal, rpb)
    ref = na_oracle.qk_reference(q, kk, shape, k, d, causal, rpb, ak)
    K = math.prod(na_oracle.per_axis(k, rank))
    assert attn.shape == (B, H, *shape, K + extra) and attn.dtype == dtype
    cut = torch.isinf(ref)
    assert torch.equal(torch.isinf(attn), cut) and bool((attn[cut] < 0).all())
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(attn.double().masked_fill(cut, 0), ref.masked_fill(cut, 0),
                               atol=tol, rtol=tol)
    # av gets garbage (not -inf) in cut slots: it must ignore them.
    weights = torch.softmax(ref, -1).masked_fill(cut, 7.0).to(dtype)
    out = AV[rank](weights, v, k, d, av, causal)
    ref_out = na_oracle.av_reference(weights, v, shape, k, d, causal, av)
    assert out.shape == (B, H, *shape, D + 3) and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES[:6], ids=_cid)
def test_gradients_match_brute_force(case):
    B, H, shape, D, k, d, causal = case
    rank = len(shape)
    q, kk = _rnd(B, H, *shape, D, seed=1, grad=True), _rnd(B, H, *shape, D, seed=2, grad=True)
    v, ak = _rnd(B, H, *shape, D, seed=3, grad=True), _rnd(B, H, 3, D, seed=4, grad=True)
    av = _rnd(B, H, 3, D, seed=5, grad=True)
    rpb = _rpb(H, k, rank, grad=True) if _noncausal(causal) else None
    leaves = [t for t in (q, kk, v, ak, av, rpb) if t is not None]

    def run(qk, av_fn):
        w = torch.softmax(qk(q * D ** -0.5, kk, ak, rpb), -1)
        return av_fn(w, v, av)

    got = run(lambda a, b, e, r: QK[rank](a, b, k, d, e, causal, r),
              lambda w, x, e: AV[rank](w, x, k, d, e, causal))
    ref = run(lambda a, b, e, r: na_oracle.qk_reference(a, b, shape, k, d, causal, r, e),
              lambda w, x, e: na_oracle.av_reference(w, x, shape, k, d, causal, e))
    dout = _rnd(*got.shape, seed=6)
    for name, a, e in zip(["q", "k", "v", "ek", "ev", "rpb"], torch.autograd.grad(got, leaves, dout),
                          torch.autograd.grad(ref, leaves, dout)):
        torch.testing.assert_close(a, e, atol=1e-10, rtol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


# NATTEN 0.17 gradcheck grids (B, H, shape, D, kernel, dilation, causal), CPU fp64.
GRADCHECK = [
    (1, 1, (5,), 8, 5, 1, False), (2, 2, (16,), 8, 5, 1, False), (2, 2, (16,), 8, 5, 3, False),
    (2, 2, (7,), 4, 3, 2, False), (2, 2, (16,), 8, 5, 1, True), (2, 2, (7,), 4, 3, 2, True),
    (1, 1, (8, 7), 8, 5, 1, False), (1, 1, (7, 7), 4, 3, 2, False),
    (1, 1, (5, 6), 4, 5, 1, (True, True)), (1, 1, (7, 6), 4, 3, 2, (True, False)),
    (1, 1, (5, 6), 4, (5, 3), (1, 2), False), (1, 1, (6, 5), 4, (3, 5), (2, 1), False),
    (1, 1, (3, 3, 6), 4, 3, 1, False), (1, 1, (6, 3, 5), 2, (3, 3, 5), (2, 1, 1), False),
    (1, 1, (3, 3, 6), 4, 3, 1, (False, True, True)),
]


@pytest.mark.parametrize("case", GRADCHECK, ids=_cid)
def test_gradcheck(case):
    B, H, shape, D, k, d, causal = case
    rank = len(shape)
    q, kk = _rnd(B, H, *shape, D, seed=1, grad=True), _rnd(B, H, *shape, D, seed=2, grad=True)
    ak = _rnd(B, H, 9, D, seed=3, grad=True)
    if _noncausal(causal):
        rpb = _rpb(H, k, rank, grad=True)
        assert gradcheck(lambda a, b, e, r: QK[rank](a, b, k, d, e, causal, r), (q, kk, ak, rpb), **GC)
    else:  # raw -inf slots break finite differences: wrap in softmax as NATTEN does
        assert gradcheck(lambda a, b, e: torch.softmax(QK[rank](a, b, k, d, e, causal), -1),
                         (q, kk, ak), **GC)
    K = math.prod(na_oracle.per_axis(k, rank))
    attn = _rnd(B, H, *shape, K + 9, seed=4, grad=True)
    v, av = _rnd(B, H, *shape, D, seed=5, grad=True), _rnd(B, H, 9, D, seed=6, grad=True)
    assert gradcheck(lambda a, x, e: AV[rank](a, x, k, d, e, causal), (attn, v, av), **GC)


FORWARD_AD = [(2, 2, (16,), 8, 5, 1, False), (2, 2, (16,), 8, 5, 3, False),
              (2, 2, (7,), 4, 3, 2, False), (1, 1, (5, 6), 4, (5, 3), (1, 2), (True, False))]


@pytest.mark.parametrize("case", FORWARD_AD, ids=_cid)
def test_forward_ad_gradcheck(case):
    B, H, shape, D, k, d, causal = case
    rank = len(shape)
    fwd = dict(GC, check_forward_ad=True, check_backward_ad=False, check_undefined_grad=False,
               check_batched_grad=False)
    q, kk = _rnd(B, H, *shape, D, seed=1, grad=True), _rnd(B, H, *shape, D, seed=2, grad=True)
    ak = _rnd(B, H, 9, D, seed=3, grad=True)
    if _noncausal(causal):
        rpb = _rpb(H, k, rank, grad=True)
        assert gradcheck(lambda a, b, e, r: QK[rank](a, b, k, d, e, causal, r), (q, kk, ak, rpb), **fwd)
    else:
        assert gradcheck(lambda a, b, e: torch.softmax(QK[rank](a, b, k, d, e, causal), -1),
                         (q, kk, ak), **fwd)
    K = math.prod(na_oracle.per_axis(k, rank))
    attn = _rnd(B, H, *shape, K + 9, seed=4, grad=True)
    v, av = _rnd(B, H, *shape, D, seed=5, grad=True), _rnd(B, H, 9, D, seed=6, grad=True)
    assert gradcheck(lambda a, x, e: AV[rank](a, x, k, d, e, causal), (attn, v, av), **fwd)


def test_func_jvp_matches_finite_difference():
    """Whole unfused attention (qk + rpb -> softmax -> av) under torch.func.jvp vs a central
    difference along the same random direction."""
    shape, k, d = (6, 7), (3, 5), (2, 1)
    inputs = [_rnd(1, 2, *shape, 4, seed=s) for s in (1, 2, 3)] + [_rpb(2, k, 2)]
    tangents = tuple(_rnd(*t.shape, seed=10 + i) for i, t in enumerate(inputs))

    def f(q, kk, v, rpb):
        return N.na2d_av(torch.softmax(N.na2d_qk(q, kk, k, d, rpb=rpb), -1), v, k, d)

    out, jvp_out = torch.func.jvp(f, tuple(inputs), tangents)
    h = 1e-6
    plus = f(*(x + h * t for x, t in zip(inputs, tangents)))
    minus = f(*(x - h * t for x, t in zip(inputs, tangents)))
    torch.testing.assert_close(out, f(*inputs))
    torch.testing.assert_close(jvp_out, (plus - minus) / (2 * h), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("L", [7, 15])
def test_self_attention_equivalence(L):
    """k = L (odd): NA is plain softmax attention (NATTEN 0.17 test, CPU fp32 atol=rtol=1e-6)."""
    q, kk, v = (_rnd(2, 3, L, 16, seed=s, dtype=torch.float32) for s in (1, 2, 3))
    q = q * 16 ** -0.5
    attn = torch.softmax(N.na1d_qk(q, kk, L), -1)
    out = N.na1d_av(attn, v, L)
    ref = torch.softmax(q @ kk.transpose(-1, -2), -1) @ v
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


def test_extra_tokens_equivalence():
    """NA logits + bmm logits over the extra keys, softmaxed together (NATTEN 0.17 test)."""
    B, H, X, Y, D, n = 1, 2, 9, 8, 8, 9
    q, kk, v = (_rnd(B, H, X, Y, D, seed=s, dtype=torch.float32) for s in (1, 2, 3))
    ak, av = _rnd(B, H, n, D, seed=4, dtype=torch.float32), _rnd(B, H, n, D, seed=5, dtype=torch.float32)
    attn = torch.softmax(N.na2d_qk(q, kk, 5, 1, ak), -1)
    out = N.na2d_av(attn, v, 5, 1, av)
    plain = torch.cat([N.na2d_qk(q, kk, 5), (q.flatten(2, 3) @ ak.transpose(-1, -2)).view(B, H, X, Y, n)], -1)
    plain = torch.softmax(plain, -1)
    ref = N.na2d_av(plain[..., :25], v, 5) + (plain[..., 25:].flatten(2, 3) @ av).view(B, H, X, Y, D)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)
    ref64 = na_oracle.av_reference(torch.softmax(na_oracle.qk_reference(q, kk, (X, Y), 5, add_k=ak), -1),
                                   v, (X, Y), 5, add_v=av)
    torch.testing.assert_close(out.double(), ref64, atol=1e-5, rtol=1e-5)


def _t(*shape):
    return torch.randn(*shape, dtype=torch.float64)


ERRORS = [
    ("even-k", lambda: N.na1d_qk(_t(1, 1, 16, 4), _t(1, 1, 16, 4), 8), ValueError, "odd"),
    ("even-k-av", lambda: N.na1d_av(_t(1, 1, 16, 8), _t(1, 1, 16, 4), 8), ValueError, "odd"),
    ("dilation-0", lambda: N.na1d_qk(_t(1, 1, 16, 4), _t(1, 1, 16, 4), 3, 0), ValueError, "dilation"),
    ("kernel-1", lambda: N.na1d_qk(_t(1, 1, 16, 4), _t(1, 1, 16, 4), 1), ValueError, "kernel_size"),
    ("too-big", lambda: N.na2d_qk(_t(1, 1, 4, 6, 4), _t(1, 1, 4, 6, 4), 5), ValueError, "kernel_size"),
    ("rank", lambda: N.na2d_qk(_t(1, 1, 16, 4), _t(1, 1, 16, 4), 3), ValueError, "query"),
    ("key-shape", lambda: N.na1d_qk(_t(1, 1, 16, 4), _t(1, 2, 16, 4), 3), ValueError, "key"),
    ("rpb-causal", lambda: N.na1d_qk(_t(1, 1, 16, 4), _t(1, 1, 16, 4), 3, is_causal=True,
                                     rpb=_t(1, 5)), ValueError, "rpb"),
    ("rpb-shape", lambda: N.na1d_qk(_t(1, 1, 16, 4), _t(1, 1, 16, 4), 3, rpb=_t(1, 3)), ValueError,
     "rpb"),
    ("extra-shape", lambda: N.na1d_qk(_t(1, 1, 16, 4), _t(1, 1, 16, 4), 3,
                                      additional_keys=_t(1, 1, 2, 5)), ValueError, "additional_keys"),
    ("attn-shape", lambda: N.na1d_av(_t(1, 1, 16, 4), _t(1, 1, 16, 4), 3), ValueError, "attn"),
    ("attn-extra", lambda: N.na1d_av(_t(1, 1, 16, 3), _t(1, 1, 16, 4), 3,
                                     additional_values=_t(1, 1, 2, 4)), ValueError, "attn"),
    ("dtype", lambda: N.na1d_av(_t(1, 1, 16, 3).float(), _t(1, 1, 16, 4), 3), TypeError, "attn"),
]


@pytest.mark.parametrize("name,call,exc,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# ------------------------------------------------------------------------------------------------
# The CUDA routing (autograd Functions around fallback_kernels.unfused), exercised on CPU with a
# stand-in kernel module that implements helper K2's signatures with the brute force.
# ------------------------------------------------------------------------------------------------

class _BruteForceKernels:
    """``qk_forward/qk_backward/av_forward/av_backward`` on NATTEN-layout tensors."""

    @staticmethod
    def qk_forward(query, key, rpb, kernel_size, dilation, is_causal, attn=None):
        shape = tuple(query.shape[2:-1])
        return na_oracle.qk_reference(query, key, shape, kernel_size, dilation, is_causal,
                                      rpb).to(query.dtype)

    @staticmethod
    def qk_backward(d_attn, query, key, kernel_size, dilation, is_causal, need_rpb_grad):
        shape = tuple(query.shape[2:-1])
        with torch.enable_grad():
            q, k = query.detach().requires_grad_(True), key.detach().requires_grad_(True)
            rpb = (torch.zeros(q.shape[1], *(2 * x - 1 for x in kernel_size), dtype=q.dtype,
                               requires_grad=True) if need_rpb_grad else None)
            attn = na_oracle.qk_reference(q, k, shape, kernel_size, dilation, is_causal, rpb)
            leaves = [q, k] + ([rpb] if need_rpb_grad else [])
            grads = torch.autograd.grad(attn, leaves, d_attn)
        return grads[0], grads[1], (grads[2] if need_rpb_grad else None)

    @staticmethod
    def av_forward(attn, value, kernel_size, dilation, is_causal, out=None):
        shape = tuple(value.shape[2:-1])
        return na_oracle.av_reference(attn, value, shape, kernel_size, dilation, is_causal).to(value.dtype)

    @staticmethod
    def av_backward(d_out, attn, value, kernel_size, dilation, is_causal):
        shape = tuple(value.shape[2:-1])
        with torch.enable_grad():
            a, v = attn.detach().requires_grad_(True), value.detach().requires_grad_(True)
            out = na_oracle.av_reference(a, v, shape, kernel_size, dilation, is_causal)
            return torch.autograd.grad(out, [a, v], d_out)


@pytest.fixture
def kernel_routing(monkeypatch):
    from cudnn_attn.fallback_kernels.backend import CupyUnfusedOps

    calls = []
    fake = _BruteForceKernels()
    # The CuPy engine of the unfused ops says it runs every problem and launches the stand-in.
    monkeypatch.setattr(CupyUnfusedOps, "supports", lambda self, problem: [])
    monkeypatch.setattr(CupyUnfusedOps, "launchers", lambda self: calls.append(1) or fake)
    return calls


@pytest.mark.parametrize("causal", [False, (False, True)], ids=["noncausal", "causal"])
def test_kernel_functions_values_grads_and_jvp(kernel_routing, causal):
    shape, k, d = (6, 5), (3, 5), (2, 1)
    q, kk = _rnd(1, 2, *shape, 4, seed=1, grad=True), _rnd(1, 2, *shape, 4, seed=2, grad=True)
    rpb = None if causal else _rpb(2, k, 2, grad=True)
    args = (q, kk) if causal else (q, kk, rpb)
    qk = (lambda a, b: torch.softmax(N.na2d_qk(a, b, k, d, is_causal=causal), -1)) if causal else \
        (lambda a, b, r: N.na2d_qk(a, b, k, d, rpb=r))
    ref = na_oracle.qk_reference(q, kk, shape, k, d, causal, rpb)
    torch.testing.assert_close(N.na2d_qk(q, kk, k, d, is_causal=causal, rpb=rpb), ref)
    assert kernel_routing, "the kernel path was not taken"
    fwd = dict(GC, check_forward_ad=True, check_batched_grad=False, check_undefined_grad=False)
    assert gradcheck(qk, args, **fwd)
    attn = _rnd(1, 2, *shape, 15, seed=4, grad=True)
    v = _rnd(1, 2, *shape, 3, seed=5, grad=True)
    torch.testing.assert_close(N.na2d_av(attn, v, k, d, is_causal=causal),
                               na_oracle.av_reference(attn, v, shape, k, d, causal))
    assert gradcheck(lambda a, x: N.na2d_av(a, x, k, d, is_causal=causal), (attn, v), **fwd)
