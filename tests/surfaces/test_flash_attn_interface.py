"""cudnn_attn.flash_attn_interface: FlashAttention 2.8.3's Python API against a float64 oracle.

FlashAttention's published semantics, written out here: bottom-right causal, inclusive windows
(-1 unbounded, a window >= S_k unbounded, causal sets right = 0), ALiBi ``-slope * |i + S_k -
S_q - j|``, softcap, GQA; ``return_attn_probs`` returns ``(out, softmax_lse, S_dmask)`` with
``S_dmask`` empty without dropout and, with dropout, ``exp(s - running max)`` per key block with
dropped entries negated, padded to multiples of 128. Covered: every function's forward and
gradients, packed layouts, varlen, 0-d tensor window sizes, dropout (the encoding, the backward
replaying the mask), the signatures, and errors catchable as RuntimeError.
"""

from __future__ import annotations

import inspect
import itertools

import oracle
import pytest
import torch

from cudnn_attn import NotSupportedError
from cudnn_attn.flash_attn_interface import (_get_block_size_n, flash_attn_func,
                                             flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                                             flash_attn_varlen_func,
                                             flash_attn_varlen_kvpacked_func,
                                             flash_attn_varlen_qkvpacked_func,
                                             flash_attn_with_kvcache)

F64 = torch.float64
TOL = dict(atol=1e-10, rtol=1e-10)
GRAD_TOL = dict(atol=1e-9, rtol=1e-8)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, g, grad=False):
    return torch.randn(*shape, generator=g, dtype=F64).requires_grad_(grad)


def reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None,
              keep=None, p=0.0):
    """float64 oracle on bshd tensors (differentiable); keep: explicit dropout keep mask
    [B, H, S_q, S_k]. Returns (out, lse, probs [B, H, S_q, S_k])."""
    B, Sq, H, _ = q.shape
    Sk = k.shape[1]
    left, right = (-1 if w < 0 or w >= Sk else w for w in window)
    if causal:
        right = 0
    vis = oracle.build_visibility(B, Sq, Sk, window=(left, right, "bottom_right"))
    bias = None if slopes is None else oracle.alibi_bias(slopes.to(F64), B, H, Sq, Sk,
                                                         [Sk - Sq] * B)
    kw = dict(layout="bshd", scale=scale, softcap=softcap or None, bias=bias)
    eye = torch.eye(Sk, dtype=F64)[None, :, None, :].expand(B, Sk, k.shape[2], Sk)
    probs = oracle.reference_attention(q, k, eye, vis, **kw)[0].permute(0, 2, 1, 3)
    _, lse = oracle.reference_attention(q, k, v, vis, **kw)
    weights = probs if keep is None else probs * keep / (1 - p)
    rep = H // k.shape[2]
    out = torch.einsum("bhij,bjhd->bihd", weights, v.repeat_interleave(rep, dim=2))
    return out, lse, probs


def decode(S, probs, head_dim, dropout):
    """FlashAttention's S_dmask -> (pre-dropout probabilities, keep), the running max taken from
    the oracle's probabilities (FlashAttention's own test does this with its scores)."""
    Sq, Sk = probs.shape[-2:]
    r128 = lambda n: -(-n // 128) * 128  # noqa: E731
    assert S.shape[-2:] == (r128(Sq), r128(Sk))
    assert (S[..., Sq:, :] == 0).all() and (S[..., Sk:] == 0).all()
    S = S[..., :Sq, :Sk].to(F64)
    width = _get_block_size_n("cpu", head_dim, dropout, False)
    running_max = torch.zeros_like(probs)
    for c0 in range(0, Sk, width):
        running_max[..., c0:c0 + width] = probs[..., c0:].amax(-1, keepdim=True)
    return S.abs() * running_max, S >= 0


CASES = {  # (B, S_q, S_k, H, H_k, D, D_v), options
    "causal_gqa": ((2, 5, 9, 4, 2, 16, 16), dict(causal=True)),
    "window_alibi": ((2, 7, 7, 4, 4, 8, 8), dict(window=(2, 1), slopes="bh")),
    "window_tensor_softcap": ((1, 9, 6, 3, 1, 8, 12), dict(window="tensor", softcap=1.5)),
    "causal_long_q_empty_rows": ((1, 8, 3, 2, 2, 8, 8), dict(causal=True, slopes="h")),
}


def case_inputs(name, grad=True, seed=0):
    (B, Sq, Sk, H, Hk, D, Dv), opts = CASES[name]
    opts = dict(opts)
    g = gen(seed)
    q, k, v = (randn(B, Sq, H, D, g=g, grad=grad), randn(B, Sk, Hk, D, g=g, grad=grad),
               randn(B, Sk, Hk, Dv, g=g, grad=grad))
    kind = opts.pop("slopes", None)
    if kind:
        opts["slopes"] = torch.rand(*((H,) if kind == "h" else (B, H)), generator=g) * 0.5
    if opts.get("window") == "tensor":  # 0-d integer tensors, as torch.randint gives
        opts["window"] = torch.tensor([3, 0])
    return q, k, v, opts


def api_kwargs(opts):
    window = opts.get("window", (-1, -1))
    return dict(causal=opts.get("causal", False), window_size=window,
                softcap=opts.get("softcap", 0.0), alibi_slopes=opts.get("slopes"))


def ref_kwargs(opts):
    window = opts.get("window", (-1, -1))
    return dict(opts, window=tuple(int(w) for w in window))


@pytest.mark.parametrize("name", sorted(CASES))
def test_func_forward_lse_and_gradients(name):
    q, k, v, opts = case_inputs(name)
    out, lse, S = flash_attn_func(q, k, v, return_attn_probs=True, **api_kwargs(opts))
    ref_out, ref_lse, _ = reference(q, k, v, **ref_kwargs(opts))
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    assert S.numel() == 0  # no dropout: FlashAttention returns no probabilities
    dout = randn(*out.shape, g=gen(9))
    got = torch.autograd.grad(out, (q, k, v), dout)
    exp = torch.autograd.grad(ref_out, (q, k, v), dout)
    for n, a, b in zip("qkv", got, exp):
        torch.testing.assert_close(a, b, **GRAD_TOL, msg=lambda m, n=n: f"d{n}: {m}")


def test_func_defaults_and_plain_return():
    q, k, v, _ = case_inputs("causal_gqa", grad=False)
    out = flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, reference(q, k, v)[0], **TOL)
    torch.testing.assert_close(flash_attn_func(q, k, v, 0.0, 0.3, True),
                               reference(q, k, v, causal=True, scale=0.3)[0], **TOL)


@pytest.mark.parametrize("name", ["causal_gqa", "window_alibi"])
def test_dropout_probabilities_encoding_and_backward(name):
    q, k, v, opts = case_inputs(name, seed=3)
    p = 0.3
    torch.manual_seed(11)
    out, lse, S = flash_attn_func(q, k, v, p, return_attn_probs=True, **api_kwargs(opts))
    _, ref_lse, probs = reference(q.detach(), k.detach(), v.detach(), **ref_kwargs(opts))
    pre, keep = decode(S, probs, q.shape[-1], True)
    torch.testing.assert_close(pre, probs, **TOL)  # pre-dropout weights
    assert 0.1 < 1 - keep[probs > 0].double().mean() < 0.5  # some dropped (negated), most kept
    torch.testing.assert_close(lse, ref_lse, **TOL)
    ref_out, _, _ = reference(q, k, v, keep=keep.to(F64), p=p, **ref_kwargs(opts))
    torch.testing.assert_close(out, ref_out, **TOL)
    dout = randn(*out.shape, g=gen(2))
    got = torch.autograd.grad(out, (q, k, v), dout)
    exp = torch.autograd.grad(ref_out, (q, k, v), dout)
    for n, a, b in zip("qkv", got, exp):
        torch.testing.assert_close(a, b, **GRAD_TOL, msg=lambda m, n=n: f"d{n}: {m}")


def test_dropout_reproducible_from_the_default_generator():
    q, k, v, _ = case_inputs("causal_gqa", grad=False)
    torch.manual_seed(5)
    a = flash_attn_func(q, k, v, 0.4)
    torch.manual_seed(5)
    b = flash_attn_func(q, k, v, 0.4)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_packed_variants_equal_unpacked_with_gradients():
    g = gen(4)
    qkv = randn(2, 6, 3, 4, 8, g=g, grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.unbind(2)
    ref_out = reference(q, k, v, causal=True)[0]
    torch.testing.assert_close(out, ref_out, **TOL)
    dout = randn(*out.shape, g=g)
    torch.testing.assert_close(torch.autograd.grad(out, qkv, dout)[0],
                               torch.autograd.grad(ref_out, qkv, dout)[0], **GRAD_TOL)

    q = randn(2, 5, 4, 8, g=g, grad=True)
    kv = randn(2, 7, 2, 2, 8, g=g, grad=True)
    out, lse, S = flash_attn_kvpacked_func(q, kv, window_size=(1, 2), return_attn_probs=True)
    ref_out, ref_lse, _ = reference(q, kv[:, :, 0], kv[:, :, 1], window=(1, 2))
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    dout = randn(*out.shape, g=g)
    for a, b in zip(torch.autograd.grad(out, (q, kv), dout),
                    torch.autograd.grad(ref_out, (q, kv), dout)):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def varlen_reference(q, k, v, lens_q, lens_k, **kw):
    outs, lses = [], []
    sq, sk = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b in range(len(lens_q)):
        qb, kb, vb = (q[sq[b]:sq[b + 1]][None], k[sk[b]:sk[b + 1]][None],
                      v[sk[b]:sk[b + 1]][None])
        if lens_q[b] == 0:
            continue
        if lens_k[b] == 0:
            outs.append(torch.zeros(lens_q[b], q.shape[1], v.shape[-1], dtype=F64) + 0 * qb.sum())
            lses.append(torch.full((q.shape[1], lens_q[b]), float("-inf"), dtype=F64))
            continue
        o, lse, _ = reference(qb, kb, vb, **kw)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def test_varlen_func_forward_and_gradients():
    lens_q, lens_k = [3, 1, 7, 0], [5, 4, 7, 2]
    g = gen(6)
    q = randn(sum(lens_q), 4, 8, g=g, grad=True)
    k, v = randn(sum(lens_k), 2, 8, g=g, grad=True), randn(sum(lens_k), 2, 8, g=g, grad=True)
    out, lse, S = flash_attn_varlen_func(q, k, v, cu(lens_q), cu(lens_k), 7, 7, causal=True,
                                         softcap=2.0, return_attn_probs=True)
    ref_out, ref_lse = varlen_reference(q, k, v, lens_q, lens_k, causal=True, softcap=2.0)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    assert S.numel() == 0
    dout = randn(*out.shape, g=g)
    for n, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), dout),
                       torch.autograd.grad(ref_out, (q, k, v), dout)):
        torch.testing.assert_close(a, b, **GRAD_TOL, msg=lambda m, n=n: f"d{n}: {m}")


def test_autograd_backward_skips_softmax_d(monkeypatch):
    """The differentiable functions drop the backward's ``softmax_d`` (as FlashAttention's do),
    so they never compute it: a float32 product of dout and out, four kernels for nothing. Their
    gradients stay those of the float64 reference; ``mha_*_bwd`` still return it."""
    from cudnn_attn.compat.flash_attn import _args, dense, varlen

    def refuse(*args):
        raise AssertionError("softmax_d computed for an autograd backward")

    for module in (_args, dense, varlen):
        monkeypatch.setattr(module, "softmax_d_of", refuse)
    g = gen(8)
    lens = [3, 5]
    q, k, v = (randn(sum(lens), 2, 8, g=g, grad=True) for _ in range(3))
    out = flash_attn_varlen_func(q, k, v, cu(lens), cu(lens), 5, 5, causal=True)
    ref, _ = varlen_reference(q, k, v, lens, lens, causal=True)
    dout = randn(*out.shape, g=g)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                    torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, **GRAD_TOL)
    qd, kd, vd = (t.view(1, sum(lens), 2, 8) for t in (q, k, v))
    out = flash_attn_func(qd, kd, vd, causal=True)
    ref, _, _ = reference(qd, kd, vd, causal=True)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout.view(out.shape)),
                    torch.autograd.grad(ref, (q, k, v), dout.view(out.shape))):
        torch.testing.assert_close(a, b, **GRAD_TOL)


def _count_plans(monkeypatch) -> list:
    """The problems ``execution.plan_call`` plans from now on (the mha_* route's planning)."""
    from cudnn_attn.compat.flash_attn import _core
    from cudnn_attn.core import execution

    planned: list = []
    plan_call = execution.plan_call
    monkeypatch.setattr(execution, "plan_call",
                        lambda problem, *a: planned.append(problem) or plan_call(problem, *a))
    _core._PLANNED.clear()
    return planned


def test_mha_calls_of_one_signature_are_planned_once(monkeypatch):
    """``mha_fwd`` and ``mha_bwd`` plan their problem once per call signature: later calls with
    new values reuse it (and still match the float64 reference); another mask, shape, dtype or
    deterministic mode is planned anew."""
    from cudnn_attn.flash_api import mha_bwd, mha_fwd

    planned = _count_plans(monkeypatch)
    g = gen(9)

    def step(causal=True, shape=(2, 5, 4, 8), dtype=F64):
        q, k, v = (randn(*shape, g=g).to(dtype) for _ in range(3))
        out, _, _, _, lse, seed, offset, _ = mha_fwd(q, k, v, None, None, 0.0, 0.3, causal, -1,
                                                     -1, 0.0, False, None)
        ref, ref_lse, _ = reference(*(t.to(F64) for t in (q, k, v)), causal=causal, scale=0.3)
        tol = TOL if dtype == F64 else dict(atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.to(F64), ref, **tol)
        torch.testing.assert_close(lse.to(F64), ref_lse, **tol)
        mha_bwd(torch.ones_like(out), q, k, v, out, lse, None, None, None, None, 0.0, 0.3,
                causal, -1, -1, 0.0, False, seed, offset)
        return len(planned)

    assert step() == 2  # the forward's problem and the backward's
    assert step() == 2 and step() == 2  # new values, the same signature
    assert step(causal=False) == 4
    assert step(shape=(1, 6, 4, 8)) == 6
    assert step(dtype=torch.float32) == 8
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert step() == 10  # the problems record the mode
    finally:
        torch.use_deterministic_algorithms(False)
    assert step() == 10


@pytest.mark.parametrize("deterministic", [False, True])
def test_plain_func_calls_take_attentions_direct_route(monkeypatch, deterministic):
    """An eager ``flash_attn_func`` call without dropout, ALiBi or returned probabilities, with
    more than one query, is ``attention()``'s call (its call cache and direct runner: the mha_*
    route plans nothing), made inside ``deterministic_calls`` when it asks for a deterministic
    backward (which records it in the problem). Forward and gradients against the float64
    reference. A single query keeps the mha_* route (planned bitwise repeatable)."""
    from cudnn_attn.compat.flash_attn import functions

    planned = _count_plans(monkeypatch)
    requested = []
    calls = functions.deterministic_calls
    monkeypatch.setattr(functions, "deterministic_calls",
                        lambda on=True: requested.append(on) or calls(on))
    g = gen(10)
    q, k, v = (randn(2, 5, 4, 8, g=g, grad=True) for _ in range(3))
    for _ in range(2):
        out = flash_attn_func(q, k, v, causal=True, window_size=(2, 0),
                              deterministic=deterministic)
        ref, _, _ = reference(q, k, v, causal=True, window=(2, 0))
        torch.testing.assert_close(out, ref, **TOL)
        dout = randn(*out.shape, g=g)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                        torch.autograd.grad(ref, (q, k, v), dout)):
            torch.testing.assert_close(a, b, **GRAD_TOL)
    assert planned == []
    assert requested == ([True, True] if deterministic else [])
    one = flash_attn_func(q[:, :1], k, v, causal=True)
    torch.testing.assert_close(one, reference(q[:, :1], k, v, causal=True)[0], **TOL)
    assert len(planned) == 1 and planned[0].repeatable


@pytest.mark.parametrize("deterministic", [False, True])
def test_plain_varlen_calls_take_attention_varlens_route(monkeypatch, deterministic):
    """An eager ``flash_attn_varlen_func`` call without dropout, ALiBi, returned probabilities
    or a block table, whose ``max_seqlen_q`` is above 1, is ``attention_varlen()``'s call (its
    kept plan and autograd node: the backward reuses the forward's problem), never the mha_*
    route's autograd function, inside ``deterministic_calls`` when asked. Self-attention offsets
    (one tensor) and cross lengths with an empty sequence and bottom-right causal windows, forward
    and gradients against the float64 reference per sequence. ``max_seqlen_q = 1`` keeps the
    mha_* route (planned bitwise repeatable)."""
    from cudnn_attn.compat.flash_attn import functions

    routed, requested = [], []
    varlen = functions.attention_varlen
    monkeypatch.setattr(functions, "attention_varlen",
                        lambda *a, **kw: routed.append(kw["mask"]) or varlen(*a, **kw))
    calls = functions.deterministic_calls
    monkeypatch.setattr(functions, "deterministic_calls",
                        lambda on=True: requested.append(on) or calls(on))
    mha_route = functions._FlashAttnVarlenFunc.apply
    monkeypatch.setattr(functions._FlashAttnVarlenFunc, "apply",
                        lambda *a: pytest.fail("the mha_* route took a plain call"))
    g = gen(11)
    lens = [4, 1, 6]
    q, k, v = (randn(sum(lens), 4, 8, g=g, grad=True) for _ in range(3))
    lens_q, lens_k = [3, 2, 0, 5], [5, 2, 3, 4]
    qx = randn(sum(lens_q), 4, 8, g=g, grad=True)
    kx, vx = (randn(sum(lens_k), 2, 8, g=g, grad=True) for _ in range(2))
    offsets = cu(lens)
    cases = [((q, k, v), (offsets, offsets), (lens, lens), dict(causal=True)),
             ((qx, kx, vx), (cu(lens_q), cu(lens_k)), (lens_q, lens_k),
              dict(causal=True, window_size=(1, 0))),
             ((qx, kx, vx), (cu(lens_q), cu(lens_k)), (lens_q, lens_k),
              dict(window_size=(2, 1), softcap=1.5))]
    for tensors, cus, lengths, kw in cases:
        out = flash_attn_varlen_func(*tensors, *cus, max(lengths[0]), max(lengths[1]),
                                     deterministic=deterministic, **kw)
        window = kw.pop("window_size", (-1, -1))
        ref, _ = varlen_reference(*tensors, *lengths, window=window, **kw)
        torch.testing.assert_close(out, ref, **TOL)
        dout = randn(*out.shape, g=g)
        for a, b in zip(torch.autograd.grad(out, tensors, dout),
                        torch.autograd.grad(ref, tensors, dout)):
            torch.testing.assert_close(a, b, **GRAD_TOL)
    assert len(routed) == 3 and routed[0].alignment == "top_left"  # one offsets tensor
    assert routed[1].alignment == "bottom_right"
    assert requested == ([True] * 3 if deterministic else [])
    monkeypatch.setattr(functions._FlashAttnVarlenFunc, "apply", mha_route)
    ones = cu([1, 1])
    single = flash_attn_varlen_func(q[:2], k[:5], v[:5], ones, offsets[:3], 1, 4, causal=True)
    torch.testing.assert_close(single, varlen_reference(q[:2], k[:5], v[:5], [1, 1], lens[:2],
                                                        causal=True)[0], **TOL)
    assert len(routed) == 3


def test_routed_calls_keep_their_validated_options_per_typed_value(monkeypatch):
    """A routed call's scalar arguments are validated and made a mask once per value set (with
    each value's type: ``causal=1`` still raises after ``causal=True`` was kept, as do the
    other look-alikes of valid values); a window of 0-d tensors is not kept, and every result
    matches the float64 reference."""
    from cudnn_attn.compat.flash_attn import _core, functions

    functions._OPTIONS.clear()
    made = []
    fa_mask = _core.fa_mask
    monkeypatch.setattr(_core, "fa_mask", lambda *a: made.append(a) or fa_mask(*a))
    g = gen(12)
    q, k, v = (randn(1, 6, 2, 8, g=g) for _ in range(3))
    for _ in range(3):
        out = flash_attn_func(q, k, v, causal=True, window_size=(2, 0))
        torch.testing.assert_close(out, reference(q, k, v, causal=True, window=(2, 0))[0],
                                   **TOL)
    assert len(made) == 1
    bad = [dict(causal=1), dict(softmax_scale=True), dict(window_size=(2.0, 0)),
           dict(softcap=-1.0)]
    for kw in bad:
        with pytest.raises((TypeError, ValueError)):
            flash_attn_func(q, k, v, **{"causal": True, "window_size": (2, 0), **kw})
    window = torch.tensor([2, 0])
    for _ in range(2):
        out = flash_attn_func(q, k, v, causal=True, window_size=window)
        torch.testing.assert_close(out, reference(q, k, v, causal=True, window=(2, 0))[0],
                                   **TOL)
    assert len(made) == 3


def test_varlen_packed_variants():
    lens = [4, 2, 6]
    g = gen(7)
    qkv = randn(sum(lens), 3, 2, 8, g=g, grad=True)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu(lens), 6, causal=True)
    ref_out, _ = varlen_reference(*qkv.unbind(1), lens, lens, causal=True)
    torch.testing.assert_close(out, ref_out, **TOL)
    dout = randn(*out.shape, g=g)
    torch.testing.assert_close(torch.autograd.grad(out, qkv, dout)[0],
                               torch.autograd.grad(ref_out, qkv, dout)[0], **GRAD_TOL)
    q = randn(sum(lens), 4, 8, g=g)
    kv = randn(9, 2, 2, 8, g=g)
    out = flash_attn_varlen_kvpacked_func(q, kv, cu(lens), cu([3, 3, 3]), 6, 3,
                                          window_size=(1, 0))
    ref_out, _ = varlen_reference(q, kv[:, 0], kv[:, 1], lens, [3, 3, 3], window=(1, 0))
    torch.testing.assert_close(out, ref_out, **TOL)


def test_varlen_paged_forward_and_no_backward():
    lens_q, lens_k, page = [2, 3], [5, 9], 4
    g = gen(8)
    q = randn(sum(lens_q), 2, 8, g=g, grad=True)
    k, v = randn(sum(lens_k), 2, 8, g=g), randn(sum(lens_k), 2, 8, g=g)
    pages_k, pages_v = torch.zeros(7, page, 2, 8, dtype=F64), torch.zeros(7, page, 2, 8, dtype=F64)
    table = torch.tensor([[5, 1, 0], [3, 6, 2]], dtype=torch.int32)
    for b, start in enumerate(cu(lens_k).tolist()[:-1]):
        for t in range(lens_k[b]):
            pages_k[table[b, t // page], t % page] = k[start + t]
            pages_v[table[b, t // page], t % page] = v[start + t]
    out = flash_attn_varlen_func(q, pages_k, pages_v, cu(lens_q), cu(lens_k), 3, 9, causal=True,
                                 block_table=table)
    torch.testing.assert_close(out, varlen_reference(q, k, v, lens_q, lens_k, causal=True)[0],
                               **TOL)
    with pytest.raises(NotSupportedError, match="paged"):
        out.sum().backward()


# Signatures of flash-attn 2.8.3 (flash_attn/flash_attn_interface.py), written out.
COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
          ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
          ("deterministic", False), ("return_attn_probs", False)]
REQUIRED = inspect.Parameter.empty
SIGNATURES = {
    flash_attn_func: [("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), *COMMON],
    flash_attn_qkvpacked_func: [("qkv", REQUIRED), *COMMON],
    flash_attn_kvpacked_func: [("q", REQUIRED), ("kv", REQUIRED), *COMMON],
    flash_attn_varlen_func: [("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED),
                             ("cu_seqlens_q", REQUIRED), ("cu_seqlens_k", REQUIRED),
                             ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED), *COMMON,
                             ("block_table", None)],
    flash_attn_varlen_qkvpacked_func: [("qkv", REQUIRED), ("cu_seqlens", REQUIRED),
                                       ("max_seqlen", REQUIRED), *COMMON],
    flash_attn_varlen_kvpacked_func: [("q", REQUIRED), ("kv", REQUIRED),
                                      ("cu_seqlens_q", REQUIRED), ("cu_seqlens_k", REQUIRED),
                                      ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED),
                                      *COMMON],
    flash_attn_with_kvcache: [("q", REQUIRED), ("k_cache", REQUIRED), ("v_cache", REQUIRED),
                              ("k", None), ("v", None), ("rotary_cos", None),
                              ("rotary_sin", None), ("cache_seqlens", None),
                              ("cache_batch_idx", None), ("cache_leftpad", None),
                              ("block_table", None), ("softmax_scale", None), ("causal", False),
                              ("window_size", (-1, -1)), ("softcap", 0.0),
                              ("rotary_interleaved", True), ("alibi_slopes", None),
                              ("num_splits", 0), ("return_softmax_lse", False)],
}


@pytest.mark.parametrize("fn", list(SIGNATURES), ids=lambda f: f.__name__)
def test_signatures_match_flash_attn_2_8_3(fn):
    params = inspect.signature(fn).parameters
    assert [(p.name, p.default) for p in params.values()] == SIGNATURES[fn]


def test_module_is_the_compat_interface_and_exports_everything():
    import cudnn_attn.flash_attn_interface as fai
    from cudnn_attn.compat.flash_attn import interface
    assert fai is interface
    assert {f.__name__ for f in SIGNATURES} <= set(fai.__all__)


def test_block_size_table():
    # FlashAttention's _get_block_size_n on sm80: (head_dim, dropout) -> key-block width.
    expected = {(32, False): 128, (64, False): 128, (64, True): 64, (96, True): 64,
                (128, False): 64, (128, True): 32, (256, False): 64}
    for (d, drop), n in expected.items():
        assert _get_block_size_n("cpu", d, drop, False) == n


ERRORS = [
    ("shape", lambda q, k, v: flash_attn_func(q, k[..., :4], v), "head dim"),
    ("heads", lambda q, k, v: flash_attn_func(q[:, :, :3], k, v), "heads"),
    ("dtype", lambda q, k, v: flash_attn_func(q, k.float(), v), "dtype"),
    ("window", lambda q, k, v: flash_attn_func(q, k, v, window_size=(1, 2, 3)), "window_size"),
    ("window_float", lambda q, k, v: flash_attn_func(q, k, v, window_size=(1.5, 2)),
     "window_size_left"),
    ("dropout", lambda q, k, v: flash_attn_func(q, k, v, 1.0), "p_dropout"),
    ("packed", lambda q, k, v: flash_attn_qkvpacked_func(q), "qkv"),
    ("cu_seqlens", lambda q, k, v: flash_attn_varlen_func(q[0], k[0], v[0], cu([2, 2]),
                                                          cu([3, 3]), 2, 3), "cu_seqlens"),
]


@pytest.mark.parametrize("name,call,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_are_runtime_errors_and_value_or_type_errors(name, call, match):
    q, k, v, _ = case_inputs("causal_gqa", grad=False)
    with pytest.raises(RuntimeError, match=match) as info:
        call(q, k, v)
    assert isinstance(info.value, (ValueError, TypeError))
