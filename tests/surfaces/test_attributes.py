"""The cuDNN-style attribute builder (cudnn_attn.attributes) against the float64 brute-force oracle:
every setter and their combinations, stats, inference mode, backward vs autograd, both dropout forms,
chaining and error messages."""

from __future__ import annotations

import oracle
import pytest
import torch

from cudnn_attn import Alibi, Causal, Padding, SlidingWindow
from cudnn_attn.core import dispatch
from cudnn_attn.compat.cudnn_frontend import attributes
from cudnn_attn.compat.cudnn_frontend.attributes import SdpaAttributes, SdpaBackwardAttributes
from cudnn_attn.model.masks import mask_parts

F64 = torch.float64
fwd = attributes.scaled_dot_product_flash_attention
bwd = attributes.scaled_dot_product_flash_attention_backward


def case(id, **kw):
    cfg = {"B": 2, "H": 2, "Hkv": None, "Sq": 5, "Skv": None, "D": 8, "Dv": None, "causal": None,
           "window": None, "padding": None, "padding_form": "1d", "alibi": False,
           "bias_shape": None, "scale": None, "strided": False}
    cfg.update(kw)
    cfg["Hkv"] = cfg["Hkv"] or cfg["H"]
    cfg["Skv"] = cfg["Skv"] or cfg["Sq"]
    cfg["Dv"] = cfg["Dv"] or cfg["D"]
    return pytest.param(cfg, id=id)


CASES = [
    case("default-scale-is-1"),
    case("scale-float", scale=0.3),
    case("scale-tensor-0d", scale="t0"),
    case("scale-tensor-1111", scale="t4"),
    case("causal-top-left", causal="top_left", Sq=6, Skv=6, scale=0.5),
    case("causal-bottom-right", causal="bottom_right", Sq=4, Skv=7),
    case("window", window=(2, 1), Sq=7, Skv=7),
    case("window-follows-br-causal", causal="bottom_right", window=(2, -1), Sq=4, Skv=8),
    case("window-explicit-br", window=(1, 0, "bottom_right"), Sq=4, Skv=6),
    case("window-left-only", window=(0, -1), Sq=5, Skv=5),
    case("padding-1d", padding=((5, 2), (6, 3)), Sq=5, Skv=6),
    case("padding-4d-causal-br", padding=((3, 5), (6, 2)), padding_form="4d",
         causal="bottom_right", Sq=5, Skv=6),
    case("alibi-causal", alibi=True, causal="top_left", H=4, Sq=6, Skv=8),
    # cuDNN's ALiBi needs right bound 0 and top-left alignment (bottom-right is rejected).
    case("alibi-bias-padding-tl", alibi=True, causal="top_left", bias_shape=(1, 2, 5, 6),
         padding=((4, 5), (6, 3)), Sq=5, Skv=6),
    case("bias-1h", bias_shape=(1, 2, 5, 7), Skv=7, scale=0.7),
    case("bias-b11s", bias_shape=(2, 1, 1, 7), Skv=7),
    case("gqa-dv", H=4, Hkv=2, Dv=16, causal="top_left", Sq=6, Skv=6),
    case("mqa-strided", H=4, Hkv=1, strided=True, Sq=5, Skv=9, window=(3, 0)),
    case("kitchen-sink", H=4, Hkv=2, causal="top_left", window=(3, -1), alibi=True,
         bias_shape=(2, 4, 7, 7), padding=((7, 5), (6, 7)), Sq=7, Skv=7, scale=0.4),
]


def by_id(name):
    return next(c.values[0] for c in CASES if c.id == name)


def make_inputs(cfg, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(H, S, D):
        if cfg["strided"]:  # BSHD memory viewed as BHSD: non-contiguous, last stride 1
            return torch.randn(cfg["B"], S, H, D, generator=g, dtype=F64).to(dtype).transpose(1, 2)
        return torch.randn(cfg["B"], H, S, D, generator=g, dtype=F64).to(dtype)

    q = rnd(cfg["H"], cfg["Sq"], cfg["D"])
    k = rnd(cfg["Hkv"], cfg["Skv"], cfg["D"])
    v = rnd(cfg["Hkv"], cfg["Skv"], cfg["Dv"])
    bias = None
    if cfg["bias_shape"] is not None:
        bias = torch.randn(*cfg["bias_shape"], generator=g, dtype=F64).to(dtype)
    return q, k, v, bias


def configure(attrs, cfg, bias):
    """Apply cfg through the setters (each must return attrs)."""
    steps = []
    if cfg["scale"] == "t0":
        steps.append(("set_attn_scale", (torch.tensor(0.6, dtype=F64),)))
    elif cfg["scale"] == "t4":
        steps.append(("set_attn_scale", (torch.full((1, 1, 1, 1), 0.6),)))
    elif cfg["scale"] is not None:
        steps.append(("set_attn_scale", (cfg["scale"],)))
    if cfg["causal"] == "top_left":
        steps.append(("set_causal_mask", (True,)))
    elif cfg["causal"] == "bottom_right":
        steps.append(("set_causal_mask_bottom_right", (True,)))
    if cfg["window"] is not None:
        steps.append(("set_sliding_window", cfg["window"]))
    if cfg["padding"] is not None:
        lq, lkv = (torch.tensor(x, dtype=torch.int32) for x in cfg["padding"])
        if cfg["padding_form"] == "4d":
            lq, lkv = lq.view(-1, 1, 1, 1), lkv.view(-1, 1, 1, 1).long()
        steps.append(("set_padding_mask", (lq, lkv)))
    if cfg["alibi"]:
        steps.append(("set_alibi_mask", (True,)))
    if bias is not None:
        steps.append(("set_bias", (bias,)))
    for name, args in steps:
        assert getattr(attrs, name)(*args) is attrs, name
    return attrs


def oracle_scale(cfg):
    # "t4" is cuDNN's float32 (1, 1, 1, 1) scale tensor: its value is float32(0.6).
    t4 = torch.tensor(0.6, dtype=torch.float32).item()
    return {None: 1.0, "t0": 0.6, "t4": t4}.get(cfg["scale"], cfg["scale"])


def oracle_visibility(cfg):
    lq, lkv = cfg["padding"] if cfg["padding"] is not None else (None, None)
    window = cfg["window"]
    if window is not None and len(window) == 2:  # follows the causal alignment
        window = (*window, cfg["causal"] or "top_left")
    return oracle.build_visibility(cfg["B"], cfg["Sq"], cfg["Skv"], causal=cfg["causal"],
                                   window=window, seq_lens_q=lq, seq_lens_kv=lkv)


def oracle_bias(cfg, bias):
    if not cfg["alibi"]:
        return bias
    lq, lkv = cfg["padding"] if cfg["padding"] is not None else (None, None)
    align = cfg["causal"] or (cfg["window"][2] if cfg["window"] and len(cfg["window"]) > 2
                              else "top_left")
    offs = oracle.aligned_offsets(cfg["B"], cfg["Sq"], cfg["Skv"], align, lq, lkv)
    ab = oracle.alibi_bias(oracle.default_alibi_slopes(cfg["H"]), cfg["B"], cfg["H"], cfg["Sq"],
                           cfg["Skv"], offs)
    return ab if bias is None else bias + ab


def run_oracle(cfg, q, k, v, bias):
    return oracle.reference_attention(q, k, v, oracle_visibility(cfg), scale=oracle_scale(cfg),
                                      bias=oracle_bias(cfg, bias))


def close(a, b, atol=1e-10, what=""):
    torch.testing.assert_close(a.to(F64), b.to(F64), atol=atol, rtol=atol,
                               msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------
# Forward / backward against the oracle
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", CASES)
def test_forward_matches_oracle(cfg):
    q, k, v, bias = make_inputs(cfg)
    o, stats = fwd(q, k, v, configure(SdpaAttributes(), cfg, bias))
    ref_o, ref_lse = run_oracle(cfg, q, k, v, bias)
    assert o.shape == (cfg["B"], cfg["H"], cfg["Sq"], cfg["Dv"]) and o.dtype == F64
    assert stats.shape == (cfg["B"], cfg["H"], cfg["Sq"], 1) and stats.dtype == F64
    assert not o.isnan().any() and not stats.isnan().any()
    close(o, ref_o, what="o")
    close(stats[..., 0], ref_lse, what="stats")


@pytest.mark.parametrize("cfg", CASES)
def test_backward_matches_oracle_autograd(cfg):
    q, k, v, bias = make_inputs(cfg, seed=1)
    o, stats = fwd(q, k, v, configure(SdpaAttributes(), cfg, bias))
    dO = torch.randn(o.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    dq, dk, dv = bwd(q, k, v, o, dO, stats, configure(SdpaBackwardAttributes(), cfg, bias))
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref_o, _ = run_oracle(cfg, *leaves, bias)
    expected = torch.autograd.grad(ref_o, leaves, dO)
    for name, got, exp, t in zip("qkv", (dq, dk, dv), expected, (q, k, v)):
        assert got.shape == t.shape and got.dtype == t.dtype, name
        assert not got.isnan().any(), f"NaN in d{name}"
        close(got, exp, atol=1e-9, what=f"d{name}")


def test_float32_inputs_give_float32_stats():
    cfg = by_id("causal-top-left")
    q, k, v, bias = make_inputs(cfg, dtype=torch.float32)
    o, stats = fwd(q, k, v, configure(SdpaAttributes(), cfg, bias))
    assert o.dtype == torch.float32 and stats.dtype == torch.float32
    ref_o, ref_lse = run_oracle(cfg, q, k, v, bias)
    close(o, ref_o, atol=1e-5, what="o")
    close(stats[..., 0], ref_lse, atol=1e-5, what="stats")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_float32_stats_and_dtype_preserving_grads(dtype):
    cfg = by_id("gqa-dv")
    q, k, v, bias = make_inputs(cfg, dtype=dtype)
    o, stats = fwd(q, k, v, configure(SdpaAttributes(), cfg, bias))
    assert o.dtype == dtype and stats.dtype == torch.float32
    ref_o, ref_lse = run_oracle(cfg, q, k, v, bias)
    # Within 2x of a plain computation in the same dtype (the suite's tolerance policy).
    base = oracle.plain_lowp_attention(q, k, v, oracle_visibility(cfg), scale=1.0)
    limit = 2 * (base.to(F64) - ref_o).abs().max().item() + 1e-3
    assert (o.to(F64) - ref_o).abs().max().item() <= limit
    close(stats[..., 0], ref_lse, atol=1e-2, what="stats")
    grads = bwd(q, k, v, o, torch.ones_like(o), stats, configure(SdpaBackwardAttributes(), cfg, bias))
    assert [g.dtype for g in grads] == [dtype] * 3 and not any(g.isnan().any() for g in grads)


def test_inference_returns_no_stats_and_same_output():
    cfg = by_id("alibi-causal")
    q, k, v, bias = make_inputs(cfg)
    o_train, _ = fwd(q, k, v, configure(SdpaAttributes(), cfg, bias))
    for attrs in (configure(SdpaAttributes(), cfg, bias).set_is_inference(True),
                  configure(SdpaAttributes(), cfg, bias).set_generate_stats(False)):
        o, none = fwd(q, k, v, attrs)
        assert none is None
        close(o, o_train, what="inference o")
    attrs = SdpaAttributes().set_is_inference(True).set_is_inference(False)
    assert fwd(q, k, v, configure(attrs, cfg, bias))[1] is not None


def test_causal_setters_share_one_alignment_last_wins():
    cfg = case("x", causal="bottom_right", Sq=4, Skv=7).values[0]
    q, k, v, _ = make_inputs(cfg)
    ref_br, _ = run_oracle(cfg, q, k, v, None)
    attrs = SdpaAttributes().set_causal_mask(True).set_causal_mask_bottom_right(True)
    assert attrs.causal == "bottom_right"
    close(fwd(q, k, v, attrs)[0], ref_br, what="bottom-right wins")
    attrs.set_causal_mask(False)  # clears only a top-left mask
    assert attrs.causal == "bottom_right"
    attrs.set_causal_mask_bottom_right(False)
    ref_none, _ = run_oracle(dict(cfg, causal=None), q, k, v, None)
    close(fwd(q, k, v, attrs)[0], ref_none, what="cleared")


def test_translation_reaches_the_dispatcher(monkeypatch):
    seen = []
    real = dispatch.plan_for

    def spy(problem, backend="auto"):
        seen.append(problem)
        return real(problem, backend)

    monkeypatch.setattr(dispatch, "plan_for", spy)
    q, k, v, _ = make_inputs(case("x", Sq=4, Skv=8).values[0])
    attrs = (SdpaAttributes().set_causal_mask(True).set_sliding_window(2, -1)
             .set_padding_mask([4, 3], [8, 6]).set_alibi_mask(True).set_attn_scale(0.25)
             .set_dropout(0.2, 5, 6))
    fwd(q, k, v, attrs)
    (problem,) = seen
    assert set(mask_parts(problem.mask)) == {
        Causal("top_left"), SlidingWindow(2, -1, "top_left"), Padding((4, 3), (8, 6))}
    assert problem.alibi == Alibi() and problem.scale == 0.25 and problem.dropout_p == 0.2
    assert problem.layout == "bhsd" and problem.return_lse


def test_diagonal_band_bounds_map_fa_left_to_cudnn_left_plus_one():
    assert SdpaAttributes().diagonal_band_bounds() == (None, None)
    assert SdpaAttributes().set_causal_mask(True).diagonal_band_bounds() == (None, 0)
    assert SdpaAttributes().set_sliding_window(3, 0).diagonal_band_bounds() == (4, 0)
    assert SdpaAttributes().set_sliding_window(0, 2).diagonal_band_bounds() == (1, 2)
    assert SdpaAttributes().set_sliding_window(2, -1).diagonal_band_bounds() == (3, None)
    both = SdpaAttributes().set_causal_mask(True).set_sliding_window(5, 2)
    assert both.diagonal_band_bounds() == (6, 0)
    assert SdpaAttributes().set_sliding_window(3, 1).set_sliding_window(-1, -1).window is None


# ---------------------------------------------------------------------------------------------
# Dropout
# ---------------------------------------------------------------------------------------------

def _small():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 24, 8, generator=g, dtype=F64)
    k = torch.randn(1, 2, 32, 8, generator=g, dtype=F64)
    v = torch.randn(1, 2, 32, 32, generator=g, dtype=F64)  # D_v = S_kv: see the V = I trick
    return q, k, v


def test_philox_dropout_is_a_function_of_seed_and_offset():
    q, k, v = _small()
    o1, s1 = fwd(q, k, v, SdpaAttributes().set_dropout(0.3, 11, 4))
    o2, s2 = fwd(q, k, v, SdpaAttributes().set_dropout(0.3, torch.tensor([[[[11]]]]),
                                                       torch.tensor(4, dtype=torch.int32)))
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    assert not torch.equal(o1, fwd(q, k, v, SdpaAttributes().set_dropout(0.3, 12, 4))[0])
    assert not torch.equal(o1, fwd(q, k, v, SdpaAttributes().set_dropout(0.3, 11, 5))[0])
    _, ref_lse = oracle.reference_attention(q, k, v, scale=1.0)
    close(s1[..., 0], ref_lse, what="stats are taken before dropout")
    no_drop, _ = fwd(q, k, v, SdpaAttributes().set_dropout(0.0, 11, 4))
    close(no_drop, oracle.reference_attention(q, k, v, scale=1.0)[0], what="p = 0")


def test_philox_dropout_mask_and_backward_vs_oracle():
    """With V = I the output is the dropped, rescaled P itself: that recovers the mask, which
    (same shapes, same seed/offset) is then the explicit mask of a float64 autograd oracle."""
    p = 0.25
    q, k, v = _small()
    attrs = SdpaAttributes().set_dropout(p, 2024, 7)
    eye = torch.eye(32, dtype=F64).expand(1, 2, 32, 32)
    dropped, _ = fwd(q, k, eye, attrs)
    P, _ = oracle.reference_attention(q, k, eye, scale=1.0)
    ratio = dropped / (P / (1 - p))
    keep = (ratio > 0.5).to(F64)
    close(ratio, keep, what="kept weights are P / (1 - p), dropped ones 0")
    assert abs((1 - keep.mean().item()) - p) < 0.08

    o, stats = fwd(q, k, v, attrs)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    P_ref, _ = oracle.reference_attention(leaves[0], leaves[1], eye, scale=1.0)
    ref = (P_ref * keep / (1 - p)) @ leaves[2]
    close(o, ref, what="o with the recovered mask")
    dO = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    grads = bwd(q, k, v, o, dO, stats, SdpaBackwardAttributes().set_dropout(p, 2024, 7))
    for name, got, exp in zip("qkv", grads, torch.autograd.grad(ref, leaves, dO)):
        close(got, exp, atol=1e-9, what=f"d{name}")


class _Wrapped(torch.autograd.Function):
    """forward/backward of the attribute API as one autograd op."""

    @staticmethod
    def forward(ctx, q, k, v, fwd_attrs, bwd_attrs):
        o, stats = fwd(q, k, v, fwd_attrs)
        ctx.save_for_backward(q, k, v, o, stats)
        ctx.bwd_attrs = bwd_attrs
        return o

    @staticmethod
    def backward(ctx, dO):
        q, k, v, o, stats = ctx.saved_tensors
        return (*bwd(q, k, v, o, dO, stats, ctx.bwd_attrs), None, None)


@pytest.mark.parametrize("form", ["philox", "mask"])
def test_dropout_backward_is_the_gradient_of_forward(form):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, s, 8, generator=g, dtype=F64, requires_grad=True)
               for s in (4, 5, 5))
    attrs = []
    for cls in (SdpaAttributes, SdpaBackwardAttributes):
        a = cls().set_causal_mask(True).set_attn_scale(0.8)  # cuDNN: no bottom-right dropout
        if form == "philox":
            a.set_dropout(0.4, 9, 1)
        else:
            mask = torch.rand(1, 2, 4, 5, generator=torch.Generator().manual_seed(2)) > 0.4
            a.set_dropout(mask, 1 / 0.6, 0.6)
        attrs.append(a)
    assert torch.autograd.gradcheck(lambda *t: _Wrapped.apply(*t, *attrs), (q, k, v),
                                    eps=1e-6, atol=1e-7, rtol=1e-5)


MASK_CASES = [
    case("mask-plain", Sq=6, Skv=7, scale=0.5),
    case("mask-causal-padding-gqa-alibi", H=4, Hkv=2, causal="top_left", alibi=True,
         padding=((6, 3), (7, 5)), Sq=6, Skv=7, Dv=16),
    case("mask-window-bias-strided", window=(2, 1), bias_shape=(2, 1, 6, 6), strided=True,
         Sq=6, Skv=6),
]


@pytest.mark.parametrize("mask_shape", [(2, 1, 6, 7), (1, 4, 6, 7), (6, 7)])
@pytest.mark.parametrize("cfg", MASK_CASES)
def test_explicit_mask_dropout_vs_oracle(cfg, mask_shape):
    mask_shape = mask_shape[:-2] + (cfg["Sq"], cfg["Skv"])
    if len(mask_shape) == 4 and mask_shape[1] not in (1, cfg["H"]):
        mask_shape = (1, cfg["H"], cfg["Sq"], cfg["Skv"])
    q, k, v, bias = make_inputs(cfg, seed=4)
    keep = torch.rand(mask_shape, generator=torch.Generator().manual_seed(8)) > 0.3
    scale = 1 / 0.7
    attrs = configure(SdpaAttributes(), cfg, bias).set_dropout(keep.to(torch.float16), scale)
    o, stats = fwd(q, k, v, attrs)
    # Oracle: P from the float64 brute force with V = I, then (P * mask * scale) @ V.
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    eye = torch.eye(cfg["Skv"], dtype=F64).expand(cfg["B"], cfg["Hkv"], -1, -1)
    P, lse = run_oracle(cfg, leaves[0], leaves[1], eye, bias)
    vx = leaves[2].repeat_interleave(cfg["H"] // cfg["Hkv"], dim=1)
    ref = (P * keep.to(F64) * scale) @ vx
    assert not o.isnan().any()
    close(o, ref, what="o")
    close(stats[..., 0], lse, what="stats")
    dO = torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    battrs = configure(SdpaBackwardAttributes(), cfg, bias).set_dropout(keep, scale, 0.7)
    grads = bwd(q, k, v, o, dO, stats, battrs)
    for name, got, exp in zip("qkv", grads, torch.autograd.grad(ref, leaves, dO)):
        assert not got.isnan().any(), f"NaN in d{name}"
        close(got, exp, atol=1e-9, what=f"d{name}")


def test_explicit_mask_of_ones_equals_no_dropout():
    cfg = MASK_CASES[1].values[0]
    q, k, v, bias = make_inputs(cfg)
    plain = fwd(q, k, v, configure(SdpaAttributes(), cfg, bias))
    ones = fwd(q, k, v, configure(SdpaAttributes(), cfg, bias)
               .set_dropout(torch.ones(1, 1, cfg["Sq"], cfg["Skv"], dtype=torch.bool), 1.0))
    close(ones[0], plain[0], what="o")
    close(ones[1], plain[1], what="stats")


# ---------------------------------------------------------------------------------------------
# Chaining, compute type, errors
# ---------------------------------------------------------------------------------------------

SETTER_CALLS = [
    ("set_causal_mask", (True,)), ("set_causal_mask_bottom_right", (True,)),
    ("set_bias", (torch.zeros(1, 1, 2, 2),)), ("set_attn_scale", (0.5,)),
    ("set_dropout", (0.1, 1, 2)), ("set_dropout", (torch.ones(1, 1, 2, 2), 1.0)),
    ("set_dropout", (torch.ones(1, 1, 2, 2), 2.0, 0.5)), ("set_dropout", (None,)),
    ("set_compute_data_type", (torch.float32,)), ("set_padding_mask", ([1], [2])),
    ("set_padding_mask", (False,)), ("set_alibi_mask", (True,)),
    ("set_sliding_window", (3, 0)), ("set_name", ("attn",)),
]


@pytest.mark.parametrize("cls, extra", [
    (SdpaAttributes, [("set_is_inference", (True,)), ("set_generate_stats", (True,))]),
    (SdpaBackwardAttributes, [("set_deterministic_algorithm", (True,))]),
])
def test_every_setter_chains(cls, extra):
    attrs = cls()
    for name, args in SETTER_CALLS + extra:
        assert getattr(attrs, name)(*args) is attrs, name
    assert "attn" in repr(attrs)
    # set_dropout(None) and set_padding_mask(False) ran after the forms that set them
    assert attrs.dropout is None and attrs.padding is None
    assert attrs.causal == "bottom_right" and attrs.window == (3, 0, None) and attrs.alibi


def test_compute_data_type_accepts_the_cudnn_enum():
    cudnn = pytest.importorskip("cudnn")
    attrs = SdpaAttributes()
    assert attrs.set_compute_data_type(cudnn.data_type.FLOAT) is attrs
    with pytest.raises(ValueError, match="set_compute_data_type.*HALF"):
        attrs.set_compute_data_type(cudnn.data_type.HALF)


M = torch.ones(1, 1, 2, 2)
SETTER_ERRORS = [
    ("set_is_inference", (1,), TypeError, "set_is_inference.*1"),
    ("set_causal_mask", ("yes",), TypeError, "set_causal_mask.*yes"),
    ("set_causal_mask_bottom_right", (None,), TypeError, "set_causal_mask_bottom_right"),
    ("set_alibi_mask", (None,), TypeError, "set_alibi_mask.*None"),
    ("set_attn_scale", (float("nan"),), ValueError, "set_attn_scale.*nan"),
    ("set_attn_scale", (torch.ones(2),), ValueError, r"set_attn_scale.*\(2,\)"),
    ("set_attn_scale", ("0.5",), TypeError, "set_attn_scale.*0.5"),
    ("set_dropout", (1.0, 1, 2), ValueError, r"set_dropout.*\[0, 1\).*1.0"),
    ("set_dropout", (-0.1, 1, 2), ValueError, "set_dropout.*-0.1"),
    ("set_dropout", (0.1, 1.5, 2), TypeError, "set_dropout.*seed.*1.5"),
    ("set_dropout", (0.1, torch.tensor([1.0]), 2), TypeError, "set_dropout.*seed.*float"),
    ("set_dropout", (0.1, 1), TypeError, "set_dropout.*2 arguments"),
    ("set_dropout", (M,), TypeError, "set_dropout.*mask form"),
    ("set_dropout", (M, float("inf")), ValueError, "set_dropout.*scale.*inf"),
    ("set_dropout", (M, 2.0, 0.25), ValueError, "set_dropout.*scale_inv.*0.25"),
    ("set_sliding_window", (-2, 0), ValueError, "set_sliding_window.*left.*-2"),
    ("set_sliding_window", (1.5, 0), TypeError, "set_sliding_window.*1.5"),
    ("set_sliding_window", (1, 0, "middle"), ValueError, "set_sliding_window.*middle"),
    ("set_padding_mask", (torch.tensor([1.0]), torch.tensor([1])), TypeError,
     "set_padding_mask.*seq_len_q.*float32"),
    ("set_padding_mask", ([1, 2], [1]), ValueError, "set_padding_mask.*2 and 1"),
    ("set_padding_mask", ([1, -1], [1, 1]), ValueError, r"set_padding_mask.*\[1, -1\]"),
    ("set_padding_mask", (torch.ones(2, 2, dtype=torch.int64), [1, 1]), ValueError,
     r"set_padding_mask.*\(2, 2\)"),
    ("set_padding_mask", ([1, 2],), TypeError, "set_padding_mask.*seq_len_kv"),
    ("set_bias", ([1.0],), TypeError, "set_bias.*list"),
    ("set_bias", (torch.ones(2, dtype=torch.int64),), TypeError, "set_bias.*int64"),
    ("set_compute_data_type", (torch.float16,), ValueError, "set_compute_data_type.*float16"),
    ("set_compute_data_type", ("float",), TypeError, "set_compute_data_type.*float"),
    ("set_name", (3,), TypeError, "set_name.*3"),
]


@pytest.mark.parametrize("name, args, exc, match", SETTER_ERRORS,
                         ids=[f"{e[0]}-{i}" for i, e in enumerate(SETTER_ERRORS)])
def test_setter_errors_name_the_setter_and_value(name, args, exc, match):
    with pytest.raises(exc, match=match):
        getattr(SdpaAttributes(), name)(*args)


def test_backward_only_and_forward_only_setters():
    with pytest.raises(TypeError, match="set_deterministic_algorithm"):
        SdpaBackwardAttributes().set_deterministic_algorithm("x")
    assert not hasattr(SdpaBackwardAttributes(), "set_is_inference")


def test_call_time_errors():
    q, k, v, _ = make_inputs(case("x", Sq=4, Skv=6).values[0])
    with pytest.raises(TypeError, match="SdpaAttributes.*SdpaBackwardAttributes"):
        fwd(q, k, v, SdpaBackwardAttributes())
    with pytest.raises(TypeError, match="SdpaBackwardAttributes"):
        bwd(q, k, v, q, q, q[..., :1], SdpaAttributes())
    with pytest.raises(ValueError, match=r"set_padding_mask.*need 2 entries.*got 3"):
        fwd(q, k, v, SdpaAttributes().set_padding_mask([1, 2, 3], [1, 2, 3]))
    with pytest.raises(ValueError, match=r"set_padding_mask.*exceed.*S_kv=6"):
        fwd(q, k, v, SdpaAttributes().set_padding_mask([1, 2], [7, 2]))
    with pytest.raises(ValueError, match=r"set_bias.*\(1, 2, 4, 5\)"):
        fwd(q, k, v, SdpaAttributes().set_bias(torch.zeros(1, 2, 4, 5, dtype=F64)))
    with pytest.raises(ValueError, match=r"set_dropout: mask.*\(1, 1, 4, 5\)"):
        fwd(q, k, v, SdpaAttributes().set_dropout(torch.ones(1, 1, 4, 5), 1.0))
    with pytest.raises(ValueError, match=r"q must be 4-D \[B, H, S, D\], got shape \(2, 4, 8\)"):
        fwd(q[0], k, v, SdpaAttributes())
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        fwd(q, [1], v, SdpaAttributes())
    o, stats = fwd(q, k, v, SdpaAttributes())
    battrs = SdpaBackwardAttributes()
    with pytest.raises(ValueError, match=r"stats.*\[2, 2, 4, 1\]"):
        bwd(q, k, v, o, o, stats[:, :1], battrs)
    with pytest.raises(ValueError, match=r"^dO must have shape"):
        bwd(q, k, v, o, o[..., :2], stats, battrs)
    with pytest.raises(TypeError, match="^o must be a torch.Tensor"):
        bwd(q, k, v, None, o, stats, battrs)
    with pytest.raises(ValueError, match="Alibi"):  # mixed alignments cannot align ALiBi
        fwd(q, k, v, SdpaAttributes().set_causal_mask(True).set_alibi_mask(True)
            .set_sliding_window(2, 0, alignment="bottom_right"))
