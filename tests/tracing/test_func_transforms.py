"""torch.func over attention(): grad (against eager autograd), vmap and vmap(grad) (against a loop
of eager calls), jvp / jacfwd / forward-mode AD (against the float64 oracle's own forward-mode
derivative), the clear error where no forward-mode formula exists, and the autocast dtype rule."""

from __future__ import annotations

import oracle
import pytest
import torch
from compile_cases import ATTENTION, outputs, rand

import cudnn_attn as ca
from cudnn_attn import Alibi, Causal, Neighborhood, Padding, RelPosBias, SlidingWindow


def _total(result):
    return sum((i + 1) * torch.where(torch.isfinite(o), o, 0).sum()
               for i, o in enumerate(outputs(result)))


@pytest.mark.parametrize("case", ["causal_bottom_right", "neighborhood_2d", "padding_tensor",
                                  "tensor_bias", "rel_pos_bias", "softcap", "dropout", "gqa",
                                  "dv_ne_dqk_bshd_lse"])
def test_grad_matches_eager_autograd(case):
    fn, make = ATTENTION[case]
    args = make()
    wrt = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad)
    plain = tuple(a.detach() for a in args)
    torch.manual_seed(7)
    got = torch.func.grad(lambda *a: _total(fn(*a)), argnums=wrt)(*plain)
    torch.manual_seed(7)
    want = torch.autograd.grad(_total(fn(*args)), [args[i] for i in wrt])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


VMAPPED = {  # case -> in_dims of its arguments (None: shared by every slice)
    "causal_bottom_right": (0, 0, 0),
    "padding_tensor": (0, 0, 0, None, None),
    "rel_pos_bias": (0, 0, 0, None),
    "tensor_bias": (0, None, 0, 0),
    "dv_ne_dqk_bshd_lse": (0, 0, 0),
}


def _batched(args, in_dims, n=3):
    return tuple(a.detach() if d is None else torch.stack([torch.randn_like(a) for _ in range(n)])
                 for a, d in zip(args, in_dims))


def _slice(args, in_dims, i):
    return tuple(a if d is None else a[i] for a, d in zip(args, in_dims))


@pytest.mark.parametrize("case", sorted(VMAPPED))
def test_vmap_matches_a_loop(case):
    fn, make = ATTENTION[case]
    in_dims = VMAPPED[case]
    args = _batched(make(), in_dims)
    got = outputs(torch.func.vmap(fn, in_dims=in_dims)(*args))
    for i in range(3):
        for g, w in zip(got, outputs(fn(*_slice(args, in_dims, i))), strict=True):
            torch.testing.assert_close(g[i], w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["padding_tensor", "rel_pos_bias"])
def test_per_sample_grads(case):
    """vmap(grad): one gradient of q per sample, each equal to its own eager backward."""
    fn, make = ATTENTION[case]
    in_dims = VMAPPED[case]
    args = _batched(make(), in_dims)
    got = torch.func.vmap(torch.func.grad(lambda *a: _total(fn(*a))), in_dims=in_dims)(*args)
    for i in range(3):
        sample = [a.clone().requires_grad_(j == 0) for j, a in enumerate(_slice(args, in_dims, i))]
        (want,) = torch.autograd.grad(_total(fn(*sample)), sample[:1])
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)


# -- forward mode -------------------------------------------------------------------------------

def _visible(B, s_q, s_kv, **kw):
    return oracle.build_visibility(B, s_q, s_kv, **kw)


JVP_CASES = {  # name -> (attention kwargs, oracle kwargs, shapes (s_q, s_kv, h, h_kv, d_v), layout)
    "none": ({}, {}, (9, 9, 2, 2, 8), "bhsd"),
    "causal_bottom_right_gqa": ({"mask": Causal("bottom_right")},
                                {"causal": "bottom_right"}, (5, 9, 4, 2, 8), "bhsd"),
    "window_dv_bshd": ({"mask": SlidingWindow(2, 1)}, {"window": (2, 1)}, (9, 9, 2, 1, 5),
                       "bshd"),
    "padding_empty_rows": ({"mask": Padding([4, 0], [6, 3])},
                           {"seq_lens_q": [4, 0], "seq_lens_kv": [6, 3]}, (7, 8, 2, 2, 8),
                           "bhsd"),
    "neighborhood_2d": ({"mask": Neighborhood((3, 6), 3, dilation=(1, 2))},
                        {"neighborhood": {"spatial_shape": (3, 6), "kernel_size": 3,
                                          "dilation": (1, 2)}}, (18, 18, 2, 2, 8), "bhsd"),
    "alibi_causal": ({"mask": Causal(), "bias": Alibi()}, {"causal": "top_left"},
                     (9, 9, 2, 2, 8), "bhsd"),
}


@pytest.mark.parametrize("case", sorted(JVP_CASES))
def test_jvp_matches_the_oracle(case):
    kwargs, vis_kwargs, (s_q, s_kv, h, h_kv, d_v), layout = JVP_CASES[case]
    B, D = 2, 8
    shape = (lambda s, n, d: (B, n, s, d)) if layout == "bhsd" else (lambda s, n, d: (B, s, n, d))
    primals = (rand(*shape(s_q, h, D), grad=False), rand(*shape(s_kv, h_kv, D), grad=False),
               rand(*shape(s_kv, h_kv, d_v), grad=False))
    tangents = tuple(torch.randn_like(p) for p in primals)
    visible = _visible(B, s_q, s_kv, **vis_kwargs)
    slopes = torch.tensor(oracle.default_alibi_slopes(h)) if "bias" in kwargs else None

    def ours(q, k, v):
        return ca.attention(q, k, v, layout=layout, return_lse=True, **kwargs)

    def reference(q, k, v):
        out, lse = oracle.reference_attention(q, k, v, visible, layout=layout, alibi_slopes=slopes)
        return out, torch.where(torch.isfinite(lse), lse, 0)

    (out, _), (d_out, d_lse) = torch.func.jvp(ours, primals, tangents)
    (ref_out, _), (ref_d_out, ref_d_lse) = torch.func.jvp(reference, primals, tangents)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(d_out, ref_d_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(d_lse, ref_d_lse, rtol=1e-9, atol=1e-9)


def test_jvp_with_constant_relpos_bias_and_forward_ad():
    """A RelPosBias table without a tangent is a constant; torch.autograd.forward_ad works too."""
    q, k, v = (rand(1, 2, 16, 8, grad=False) for _ in range(3))
    table = rand(2, 5, 5, grad=False)
    mask = Neighborhood((4, 4), 3)
    fn = lambda q: ca.attention(q, k, v, mask=mask, bias=RelPosBias(table))
    tangent = torch.randn_like(q)
    _, got = torch.func.jvp(fn, (q,), (tangent,))
    with torch.autograd.forward_ad.dual_level():
        dual = fn(torch.autograd.forward_ad.make_dual(q, tangent))
        dual_tangent = torch.autograd.forward_ad.unpack_dual(dual).tangent
    want = torch.func.jvp(lambda q: ca.attention(q, k, v, mask=mask, bias=RelPosBias(table),
                                                 backend="torch"), (q,), (tangent,))[1]
    eps = 1e-6
    finite = (fn(q + eps * tangent) - fn(q - eps * tangent)) / (2 * eps)
    torch.testing.assert_close(got, finite, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dual_tangent, got, rtol=0, atol=0)
    torch.testing.assert_close(want, got, rtol=0, atol=0)


def test_jacfwd_equals_jacrev():
    """jacfwd (jvp under vmap) and jacrev (vjp under vmap) agree on a tiny causal GQA problem."""
    q, k, v = rand(1, 2, 3, 4, grad=False), rand(1, 1, 5, 4, grad=False), \
        rand(1, 1, 5, 3, grad=False)
    fn = lambda q, k: ca.attention(q, k, v, mask=Causal("bottom_right"))
    for argnum in (0, 1):
        forward = torch.func.jacfwd(fn, argnums=argnum)(q, k)
        reverse = torch.func.jacrev(fn, argnums=argnum)(q, k)
        torch.testing.assert_close(forward, reverse, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("what", ["softcap", "dropout", "bias_tangent"])
def test_jvp_without_a_formula_raises_clearly(what):
    q, k, v = (rand(1, 2, 6, 4, grad=False) for _ in range(3))
    bias = rand(1, 2, 6, 6, grad=False)
    if what == "bias_tangent":
        fn, primals = (lambda b: ca.attention(q, k, v, bias=b)), (bias,)
    else:
        extra = {"softcap": 3.0} if what == "softcap" else {"dropout_p": 0.5}
        fn, primals = (lambda q: ca.attention(q, k, v, **extra)), (q,)
    with pytest.raises(ca.NotSupportedError, match="forward-mode"):
        torch.func.jvp(fn, primals, tuple(torch.randn_like(p) for p in primals))


# -- autocast -----------------------------------------------------------------------------------

AUTOCAST_MASKS = [None, Causal(), SlidingWindow(2, 2), Neighborhood(12, 3), Padding([5, 12])]


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("mask", AUTOCAST_MASKS, ids=repr)
def test_autocast_rule(mask, requires_grad):
    """Under autocast, q/k/v are cast to the autocast dtype (as torch SDPA): out has that dtype
    and equals a call on the cast inputs; lse is float32. Whatever the mask or requires_grad."""
    q, k, v = (rand(2, 2, 12, 8, dtype=torch.float32, grad=requires_grad) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = ca.attention(q, k, v, mask=mask, return_lse=True)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.dtype == sdpa.dtype == torch.bfloat16
    assert lse.dtype == torch.float32
    want, want_lse = ca.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask=mask,
                                  return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    if requires_grad:
        out.float().sum().backward()
        assert q.grad is not None and q.grad.dtype == torch.float32


def test_autocast_rule_compiled_and_float64():
    q, k, v = (rand(1, 2, 12, 8, dtype=torch.float32, grad=False) for _ in range(3))
    fn = lambda q, k, v: ca.attention(q, k, v, mask=Neighborhood(12, 3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
        eager = fn(q, k, v)
        wide = fn(q.double(), k.double(), v.double())
    assert compiled.dtype == eager.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert wide.dtype == torch.float64  # autocast leaves float64 alone, as it does for SDPA
