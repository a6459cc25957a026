"""Every mask kind, bias kind and option of `attention()` vs the independent float64 oracle.

* fp64 (atol 1e-10) and fp32 (atol 1e-5) forward `out` and `lse` for: Causal (both alignments,
  S_q < S_kv and S_q > S_kv), SlidingWindow (every sign combination incl. -1, both alignments),
  Causal & SlidingWindow, Padding (alone, with bottom-right Causal / SlidingWindow, with ALiBi),
  Neighborhood 1/2/3-D (even kernels, stride, dilation with L % d != 0, per-axis causal), tensor bias
  of many broadcast shapes, ALiBi (default and explicit slopes), softcap, GQA/MQA, D_v != D_qk, both
  layouts, explicit scale, odd sizes (S in {1, 2, 113}, D in {40, 72}).
* fp16/bf16 by FlashAttention's rule: error <= 2x the error of a plain low-precision PyTorch
  computation (both against the fp64 oracle) + 1e-5.
* Fully masked rows: out 0, lse -inf, no NaN (also in gradients).
* fp64 gradients (dq, dk, dv, dbias) vs autograd through the oracle.
"""

import zlib

import pytest
import torch
from common import Problem, ca, check_forward, check_grads

P = Problem


def NB1(shape, **kw):
    """Neighborhood kwargs (the oracle's and the library's constructor share them)."""
    return dict(spatial_shape=shape, **kw)


CASES = [
    # dense
    P(id="dense", B=2, Hq=3, Sq=17, D=16),
    P(id="dense-sq<skv", B=2, Hq=2, Sq=5, Skv=13, D=8),
    P(id="dense-scale", B=1, Hq=2, Sq=7, Skv=9, D=8, scale=0.37),
    # causal
    P(id="causal-tl-sq<skv", Sq=7, Skv=13, causal="top_left"),
    P(id="causal-br-sq<skv", Sq=7, Skv=13, causal="bottom_right"),
    P(id="causal-tl-sq>skv", Sq=13, Skv=7, causal="top_left"),
    P(id="causal-br-sq>skv", Sq=13, Skv=7, causal="bottom_right"),
    P(id="causal-tl-square", Sq=11, causal="top_left"),
    P(id="causal-br-square", Sq=11, causal="bottom_right"),
    # sliding window: every sign combination, both alignments, S_q != S_kv
    *[
        P(id=f"window-{l}-{r}-{al}-{sq}x{skv}", Sq=sq, Skv=skv, window=(l, r, al))
        for (l, r) in [(2, 3), (0, 0), (3, 0), (0, 2), (-1, 2), (3, -1), (-1, 0), (0, -1), (-1, -1)]
        for al in ("top_left", "bottom_right")
        for (sq, skv) in [(9, 14), (14, 9)]
    ],
    # causal & window
    P(id="causal&window-tl", Sq=12, causal="top_left", window=(3, -1, "top_left")),
    P(id="causal&window-br", Sq=8, Skv=13, causal="bottom_right", window=(4, 2, "bottom_right")),
    P(id="causal&window-br-right", Sq=8, Skv=13, causal="bottom_right", window=(-1, 2, "bottom_right")),
    # padding
    P(id="padding", B=3, Sq=9, Skv=11, seq_lens_q=(9, 4, 1), seq_lens_kv=(11, 6, 3)),
    P(id="padding-q<kv-lens", B=2, Sq=6, Skv=6, seq_lens_q=(6, 2), seq_lens_kv=(3, 5)),
    P(
        id="padding&causal-br",
        B=3,
        Sq=9,
        Skv=11,
        seq_lens_q=(9, 4, 5),
        seq_lens_kv=(11, 6, 3),
        causal="bottom_right",
    ),
    P(
        id="padding&causal-tl",
        B=3,
        Sq=9,
        Skv=11,
        seq_lens_q=(9, 4, 5),
        seq_lens_kv=(11, 6, 3),
        causal="top_left",
    ),
    P(
        id="padding&window-br",
        B=2,
        Sq=8,
        Skv=12,
        seq_lens_q=(3, 8),
        seq_lens_kv=(10, 5),
        window=(2, 1, "bottom_right"),
    ),
    P(
        id="padding&alibi-br",
        B=2,
        Hq=4,
        Sq=8,
        Skv=12,
        seq_lens_q=(3, 8),
        seq_lens_kv=(10, 12),
        causal="bottom_right",
        alibi="default",
    ),
    # neighborhood 1-D
    P(id="na1d-k3", neighborhood=NB1(shape=13, kernel_size=3)),
    P(id="na1d-k4-even", neighborhood=NB1(shape=13, kernel_size=4)),
    P(id="na1d-k2", neighborhood=NB1(shape=9, kernel_size=2)),
    P(id="na1d-k5-s2", neighborhood=NB1(shape=13, kernel_size=5, stride=2)),
    P(id="na1d-k4-s4-blocked", neighborhood=NB1(shape=12, kernel_size=4, stride=4)),
    P(id="na1d-k3-d3-L11", neighborhood=NB1(shape=11, kernel_size=3, dilation=3)),
    P(id="na1d-k2-d4-L10", neighborhood=NB1(shape=10, kernel_size=2, dilation=4)),
    P(id="na1d-k3-causal", neighborhood=NB1(shape=13, kernel_size=3, is_causal=True)),
    P(
        id="na1d-k4-s3-d2-causal",
        neighborhood=NB1(shape=13, kernel_size=4, stride=3, dilation=2, is_causal=True),
    ),
    P(id="na1d-k=L", neighborhood=NB1(shape=7, kernel_size=7)),
    # neighborhood 2-D / 3-D
    P(id="na2d-k3", neighborhood=NB1(shape=(5, 6), kernel_size=3)),
    P(id="na2d-even-k", neighborhood=NB1(shape=(5, 6), kernel_size=(2, 4))),
    P(
        id="na2d-stride-dil",
        neighborhood=NB1(shape=(7, 5), kernel_size=(3, 2), stride=(2, 1), dilation=(2, 2)),
    ),
    P(id="na2d-causal-axis0", neighborhood=NB1(shape=(6, 5), kernel_size=3, is_causal=(True, False))),
    P(
        id="na2d-causal-both",
        neighborhood=NB1(shape=(6, 5), kernel_size=(3, 2), stride=(3, 2), dilation=(2, 1), is_causal=True),
    ),
    P(id="na3d-k2", B=1, neighborhood=NB1(shape=(3, 4, 5), kernel_size=2)),
    P(
        id="na3d-mixed",
        B=1,
        neighborhood=NB1(
            shape=(4, 3, 7),
            kernel_size=(2, 3, 3),
            stride=(2, 1, 3),
            dilation=(2, 1, 2),
            is_causal=(False, True, True),
        ),
    ),
    P(
        id="na1d&padding",
        B=2,
        neighborhood=NB1(shape=10, kernel_size=3),
        seq_lens_q=(10, 6),
        seq_lens_kv=(10, 7),
    ),
    P(id="na2d-gqa-bshd", Hq=4, Hkv=2, layout="bshd", neighborhood=NB1(shape=(4, 5), kernel_size=3)),
    # tensor bias, broadcast shapes
    *[
        P(
            id="bias-" + "x".join(map(str, shp)).replace("11x13", "SqxSkv"),
            B=2,
            Hq=3,
            Sq=11,
            Skv=13,
            bias_shape=shp,
        )
        for shp in [
            (1, 1, 11, 13),
            (2, 1, 11, 13),
            (3, 11, 13),
            (11, 13),
            (2, 3, 11, 13),
            (1, 3, 1, 13),
            (2, 1, 1, 13),
            (13,),
            (2, 3, 11, 1),
        ]
    ],
    P(id="bias&causal", Sq=8, causal="top_left", bias_shape=(2, 2, 8, 8)),
    P(id="bias&na2d", neighborhood=NB1(shape=(4, 4), kernel_size=3), bias_shape=(1, 2, 16, 16)),
    # ALiBi
    P(id="alibi-default-h4", Hq=4, Sq=9, Skv=12, alibi="default"),
    P(id="alibi-default-h6", Hq=6, Sq=9, Skv=12, alibi="default"),
    P(id="alibi-default-h5-causal-br", Hq=5, Sq=9, Skv=12, alibi="default", causal="bottom_right"),
    P(id="alibi-list", Hq=3, Sq=9, Skv=12, alibi="list"),
    P(id="alibi-tensor-h-window-br", Hq=3, Sq=9, Skv=12, alibi="tensor_h", window=(3, 1, "bottom_right")),
    P(id="alibi-tensor-bh", B=2, Hq=3, Sq=9, Skv=12, alibi="tensor_bh", causal="top_left"),
    P(id="alibi-gqa", Hq=4, Hkv=2, Sq=9, alibi="default", causal="top_left"),
    # softcap
    P(id="softcap", Sq=10, Skv=12, softcap=2.0),
    P(id="softcap&causal&bias", Sq=10, softcap=3.5, causal="top_left", bias_shape=(1, 2, 10, 10)),
    # GQA / MQA / D_v
    P(id="gqa-6-2", Hq=6, Hkv=2, Sq=9, Skv=11, causal="top_left"),
    P(id="mqa-4-1", Hq=4, Hkv=1, Sq=9, Skv=11),
    P(id="dv-ne-dqk", Sq=9, Skv=11, D=40, Dv=24, causal="bottom_right"),
    P(id="gqa-dv-bshd", Hq=4, Hkv=2, Sq=9, Skv=11, D=8, Dv=12, layout="bshd", window=(2, 2)),
    # layouts
    P(id="bshd-dense", layout="bshd", Sq=10, Skv=7),
    P(
        id="bshd-causal-br&padding",
        layout="bshd",
        B=2,
        Sq=6,
        Skv=9,
        causal="bottom_right",
        seq_lens_q=(6, 3),
        seq_lens_kv=(9, 4),
    ),
    P(id="bshd-alibi", layout="bshd", Hq=4, Sq=6, alibi="default"),
    # odd sizes
    P(id="S1", B=2, Hq=2, Sq=1, Skv=1, D=40),
    P(id="S1-causal-br-skv2", Sq=1, Skv=2, D=72, causal="bottom_right"),
    P(id="S2-causal", Sq=2, D=40, causal="top_left"),
    P(id="Sq1-Skv113", B=1, Sq=1, Skv=113, D=72),
    P(id="S113-D40-causal", B=1, Hq=2, Sq=113, D=40, causal="top_left"),
    P(id="S113-D72-window-br", B=1, Hq=1, Sq=113, Skv=57, D=72, window=(7, 3, "bottom_right")),
    P(id="S113-na1d", B=1, Hq=1, D=40, neighborhood=NB1(shape=113, kernel_size=8, stride=3, dilation=5)),
]


@pytest.mark.parametrize("problem", [pytest.param(c, id=c.id) for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_forward_vs_oracle(problem, dtype):
    check_forward(problem, dtype, seed=zlib.crc32(problem.id.encode()) % 1000)


def test_return_lse_false_returns_tensor():
    p = P(Sq=6, causal="top_left")
    inp = p.make_inputs(torch.float64, 3)
    out = ca().attention(inp["q"], inp["k"], inp["v"], mask=p.lib_mask())
    assert isinstance(out, torch.Tensor)
    ref, _ = p.run_oracle(inp)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_mask_and_is_commutative():
    lib = ca()
    p = P(Sq=9, Skv=12)
    inp = p.make_inputs(torch.float64, 4)
    a = lib.Causal(alignment="bottom_right") & lib.SlidingWindow(2, 1, alignment="bottom_right")
    b = lib.SlidingWindow(2, 1, alignment="bottom_right") & lib.Causal(alignment="bottom_right")
    oa = lib.attention(inp["q"], inp["k"], inp["v"], mask=a)
    ob = lib.attention(inp["q"], inp["k"], inp["v"], mask=b)
    ref, _ = p.replace(causal="bottom_right", window=(2, 1, "bottom_right")).run_oracle(inp)
    torch.testing.assert_close(oa, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ob, ref, atol=1e-10, rtol=1e-10)


def test_mixed_alignment_masks_are_anded():
    """Causal(top_left) & SlidingWindow(bottom_right): the contract defines `&` as the AND of the visible
    sets, each mask with its own alignment (no ALiBi involved, so there is no ambiguity)."""
    p = P(Sq=6, Skv=12, causal="top_left", window=(7, 1, "bottom_right"))
    check_forward(p, torch.float64, seed=12)


RUNTIME_VARIANTS = [
    pytest.param(
        [
            P(B=1, Sq=19, Skv=20, seq_lens_q=(1,), seq_lens_kv=(1,)),
            P(B=1, Sq=19, Skv=20, seq_lens_q=(19,), seq_lens_kv=(20,)),
            P(B=1, Sq=19, Skv=20, seq_lens_q=(7,), seq_lens_kv=(3,)),
        ],
        id="padding-lengths",
    ),
    pytest.param(
        [
            P(B=2, Sq=9, Skv=12, causal="bottom_right", seq_lens_q=(9, 2), seq_lens_kv=(12, 5)),
            P(B=2, Sq=9, Skv=12, causal="bottom_right", seq_lens_q=(3, 9), seq_lens_kv=(4, 12)),
        ],
        id="padding&causal-br-lengths",
    ),
    pytest.param([P(Sq=8, causal="top_left", scale=0.1), P(Sq=8, causal="top_left", scale=1.3)], id="scale"),
    pytest.param([P(Sq=8, softcap=1.0), P(Sq=8, softcap=7.0)], id="softcap"),
    pytest.param(
        [P(Hq=3, Sq=8, alibi="list"), P(Hq=3, Sq=8, alibi="list"), P(Hq=3, Sq=8, alibi="default")],
        id="alibi-slopes",
    ),
]


@pytest.mark.parametrize("problems", RUNTIME_VARIANTS)
def test_repeated_calls_same_shapes_different_runtime_values(problems):
    """Calls with identical shapes/mask structure but different runtime values (sequence lengths, scale,
    softcap, slopes) must each match the oracle: nothing from an earlier call may be reused."""
    for rnd in range(2):
        for n, p in enumerate(problems):
            check_forward(p, torch.float64, seed=100 * rnd + n)


def _strided_copy(x, how):
    """Same values as x, non-contiguous memory."""
    if how == "reversed":  # memory order reversed
        return x.permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
    y = torch.empty(*x.shape, 2, dtype=x.dtype)  # every stride doubled
    y[..., 0] = x
    y[..., 1] = float("nan")
    return y[..., 0]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_non_contiguous_inputs(layout):
    """Strided views give the same result as contiguous inputs and as the oracle."""
    lib = ca()
    p = P(B=2, Hq=3, Sq=11, Skv=9, D=12, causal="bottom_right", layout=layout)
    inp = p.make_inputs(torch.float64, seed=17)
    q = _strided_copy(inp["q"], "reversed")
    k = _strided_copy(inp["k"], "doubled")
    v = _strided_copy(inp["v"], "reversed")
    assert not any(x.is_contiguous() for x in (q, k, v))
    out, lse = lib.attention(
        q, k, v, mask=lib.Causal(alignment="bottom_right"), layout=layout, return_lse=True
    )
    ref, ref_lse = p.run_oracle(inp)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def test_padding_accepts_tensors():
    lib = ca()
    p = P(B=3, Sq=7, Skv=9, seq_lens_q=(7, 2, 5), seq_lens_kv=(9, 4, 1), causal="bottom_right")
    inp = p.make_inputs(torch.float64, 5)
    mask = lib.Causal(alignment="bottom_right") & lib.Padding(
        torch.tensor([7, 2, 5]), torch.tensor([9, 4, 1])
    )
    out, lse = lib.attention(inp["q"], inp["k"], inp["v"], mask=mask, return_lse=True)
    ref, ref_lse = p.run_oracle(inp)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, ref_lse, atol=1e-10, rtol=1e-10)


def test_default_alibi_slopes_equal_explicit_standard_slopes():
    """Alibi() must equal Alibi(slopes=<standard geometric slopes>) (computed independently)."""
    import oracle

    lib = ca()
    for H in (1, 2, 3, 4, 6, 8, 12):
        p = P(B=1, Hq=H, Sq=5, Skv=7)
        inp = p.make_inputs(torch.float64, H)
        a = lib.attention(inp["q"], inp["k"], inp["v"], bias=lib.Alibi())
        b = lib.attention(inp["q"], inp["k"], inp["v"], bias=lib.Alibi(slopes=oracle.default_alibi_slopes(H)))
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda m, H=H: f"H={H}: {m}")


# ------------------------------------------------------------------------------------------------------
# fp16 / bf16: FlashAttention's rule
# ------------------------------------------------------------------------------------------------------

LOWP_CASES = [
    P(id="dense", B=2, Hq=2, Sq=33, Skv=40, D=40),
    P(id="causal-br", Sq=40, Skv=33, D=72, causal="bottom_right"),
    P(id="window", Sq=33, window=(5, 2)),
    P(
        id="padding&causal-br",
        B=2,
        Sq=20,
        Skv=24,
        seq_lens_q=(20, 7),
        seq_lens_kv=(24, 11),
        causal="bottom_right",
    ),
    P(
        id="na2d",
        neighborhood=NB1(shape=(5, 7), kernel_size=(3, 4), dilation=(1, 1), is_causal=(False, True)),
    ),
    P(id="gqa-softcap", Hq=4, Hkv=2, Sq=24, softcap=3.0),
    P(id="alibi-bshd", Hq=4, Sq=24, alibi="default", causal="top_left", layout="bshd"),
    P(id="bias", Sq=24, Skv=20, bias_shape=(1, 2, 24, 20)),
    P(id="S113", B=1, Hq=1, Sq=113, D=40, causal="top_left"),
]


@pytest.mark.parametrize("problem", [pytest.param(c, id=c.id) for c in LOWP_CASES])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_low_precision_flash_rule(problem, dtype):
    inp = problem.make_inputs(dtype, seed=11)
    out, lse = problem.run_lib(inp)
    assert out.dtype == dtype
    assert lse.dtype == torch.float32
    assert not torch.isnan(out).any()
    ref, ref_lse = problem.run_oracle(inp)  # fp64 from the same (rounded) inputs
    base = problem.run_lowp_baseline(inp)
    err = (out.double() - ref).abs().max().item()
    err_pt = (base.double() - ref).abs().max().item()
    assert err <= 2 * err_pt + 1e-5, f"error {err:.3g} > 2 x baseline {err_pt:.3g} + 1e-5"
    # lse is float32 computed from the same inputs; contract: fp16/bf16 computed in fp32 inside
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------
# fully masked rows
# ------------------------------------------------------------------------------------------------------

FULLY_MASKED = [
    P(id="causal-br-sq>skv", Sq=9, Skv=4, causal="bottom_right"),
    # bottom-right window with S_q > S_kv: the first queries align before key 0
    P(id="window-br-sq>skv", Sq=10, Skv=4, window=(2, 0, "bottom_right")),
    P(id="padding-q", B=2, Sq=6, Skv=5, seq_lens_q=(2, 6), seq_lens_kv=(5, 3)),
    P(id="padding-causal-br", B=2, Sq=6, Skv=5, seq_lens_q=(6, 6), seq_lens_kv=(5, 2), causal="bottom_right"),
    # j <= i and j >= i - 2 with only 5 keys: rows i >= 7 are empty
    P(id="causal-tl&window-tl-sq>skv", Sq=12, Skv=5, causal="top_left", window=(2, 1, "top_left")),
]


@pytest.mark.parametrize("problem", [pytest.param(c, id=c.id) for c in FULLY_MASKED])
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"]
)
def test_fully_masked_rows(problem, dtype):
    vis = problem.visibility()
    empty = ~vis.any(-1)  # [B, Sq]
    assert empty.any(), "test problem must contain fully masked rows"
    inp = problem.make_inputs(dtype, seed=7)
    out, lse = problem.run_lib(inp)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    o = out if problem.layout == "bhsd" else out.transpose(1, 2)
    e = empty[:, None, :].expand(problem.B, problem.Hq, problem.Sq)
    assert (o[e] == 0).all(), "fully masked rows must be exactly 0"
    assert torch.isneginf(lse[e]).all(), "fully masked rows must have lse = -inf"
    assert torch.isfinite(lse[~e]).all()


@pytest.mark.parametrize("problem", [pytest.param(c, id=c.id) for c in FULLY_MASKED])
def test_fully_masked_rows_grad_finite(problem):
    check_grads(problem, seed=8)


def test_minus_inf_bias_row_is_zero_not_nan():
    """A row whose every key gets a -inf additive bias has no visible key: out 0, lse -inf, no NaN."""
    p = P(B=1, Hq=2, Sq=5, Skv=6, bias_shape=(1, 2, 5, 6))
    inp = p.make_inputs(torch.float64, 9)
    inp["bias"][0, :, 2, :] = float("-inf")
    inp["bias"][0, 1, 4, 1:] = float("-inf")
    out, lse = p.run_lib(inp)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[0, :, 2] == 0).all() and torch.isneginf(lse[0, :, 2]).all()
    ref, _ref_lse = p.run_oracle(inp)
    torch.testing.assert_close(out[0, 1, 4], ref[0, 1, 4], atol=1e-10, rtol=1e-10)


# ------------------------------------------------------------------------------------------------------
# gradients (fp64) vs autograd through the oracle
# ------------------------------------------------------------------------------------------------------

GRAD_CASES = [
    P(id="dense", Sq=7, Skv=9),
    P(id="causal-br", Sq=7, Skv=9, causal="bottom_right"),
    P(id="causal-tl-sq>skv", Sq=9, Skv=5, causal="top_left"),
    P(id="window", Sq=10, window=(2, 1)),
    P(id="window-br-left-unbounded", Sq=6, Skv=10, window=(-1, 1, "bottom_right")),
    P(id="padding&causal-br", B=2, Sq=6, Skv=8, seq_lens_q=(6, 3), seq_lens_kv=(8, 4), causal="bottom_right"),
    P(
        id="na1d-dil-stride-causal",
        neighborhood=NB1(shape=11, kernel_size=3, stride=2, dilation=3, is_causal=True),
    ),
    P(id="na2d", neighborhood=NB1(shape=(4, 5), kernel_size=(2, 3), stride=(1, 2), dilation=(2, 1))),
    P(id="na3d", B=1, neighborhood=NB1(shape=(3, 3, 4), kernel_size=2, is_causal=(True, False, False))),
    P(id="gqa", Hq=4, Hkv=2, Sq=7, Skv=8, causal="top_left"),
    P(id="mqa-dv", Hq=3, Hkv=1, Sq=7, D=8, Dv=5),
    P(id="softcap", Sq=7, softcap=1.5),
    P(id="alibi", Hq=4, Sq=7, Skv=9, alibi="default", causal="bottom_right"),
    P(id="bias-broadcast", Sq=7, Skv=9, bias_shape=(1, 2, 1, 9)),
    P(id="bias-full&causal", Sq=7, bias_shape=(2, 2, 7, 7), causal="top_left"),
    P(id="bshd-gqa-window", Hq=4, Hkv=1, Sq=8, layout="bshd", window=(1, 2)),
]


@pytest.mark.parametrize("problem", [pytest.param(c, id=c.id) for c in GRAD_CASES])
def test_grads_vs_oracle(problem):
    check_grads(problem, seed=21)


# Line masks that may hide nothing: (kind, left, right) and the alignments, against the oracle's
# visibility over small sizes (S_q = 1 bottom-right causal is a decode step's mask).
_LINES = [("causal", None, None)] + [("window", left, right) for left in (-1, 0, 1, 2, 3, 6)
                                     for right in (-1, 0, 1, 2, 5)]


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("kind,left,right", _LINES)
def test_line_masks_that_hide_nothing_are_dropped_exactly(kind, left, right, alignment):
    """``without_open_lines`` drops a Causal/SlidingWindow part iff the oracle's visibility of
    that part over ``S_q x S_kv`` is all True, for every size up to 6 x 6; a set of parts keeps
    the ones that hide something; Padding or a Neighborhood in the set keeps the mask whole."""
    import oracle

    import cudnn_attn as lib
    from cudnn_attn.model.masks import without_open_lines

    mask = lib.Causal(alignment) if kind == "causal" else lib.SlidingWindow(left, right, alignment)
    window = (-1, 0, alignment) if kind == "causal" else (left, right, alignment)
    for seq_q in range(1, 7):
        for seq_kv in range(1, 7):
            open_ = bool(oracle.build_visibility(1, seq_q, seq_kv, window=window).all())
            assert (without_open_lines(mask, seq_q, seq_kv) is None) == open_, (seq_q, seq_kv)
    hiding = lib.Causal("top_left")  # hides something on 2 x 2
    open_ = bool(oracle.build_visibility(1, 2, 2, window=window).all())
    assert without_open_lines(mask & hiding, 2, 2) == (hiding if open_ else mask & hiding)
    assert without_open_lines(mask & lib.Padding([1]), 1, 1) == mask & lib.Padding([1])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_a_decode_steps_causal_mask_runs_unmasked_with_the_same_results(layout):
    """One query aligned bottom-right sees every key: the problem carries no mask (the plain
    path of every engine), the result and gradients are the unmasked call's and the oracle's;
    ALiBi keeps the mask (its alignment), and two queries keep it too."""
    import oracle

    import cudnn_attn as lib

    g = torch.Generator().manual_seed(3)
    shape = (2, 3, 1, 8) if layout == "bhsd" else (2, 1, 3, 8)
    kv_shape = (2, 3, 9, 8) if layout == "bhsd" else (2, 9, 3, 8)
    q = torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(kv_shape, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    causal = lib.Causal("bottom_right")
    assert lib.explain(q, k, v, mask=causal, layout=layout).problem.mask is None
    out = lib.attention(q, k, v, mask=causal, layout=layout)
    vis = oracle.build_visibility(2, 1, 9, causal="bottom_right")
    to_bhsd = (lambda t: t) if layout == "bhsd" else (lambda t: t.transpose(1, 2))
    ref, _ = oracle.reference_attention(*(to_bhsd(t) for t in (q, k, v)), vis)
    torch.testing.assert_close(to_bhsd(out), ref, atol=1e-10, rtol=1e-10)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), dout),
                    torch.autograd.grad(to_bhsd(ref), (q, k, v), dout)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert lib.explain(q, k, v, mask=causal, bias=lib.Alibi(), layout=layout).problem.mask \
        == causal
    two = torch.cat([q, q], dim=2 if layout == "bhsd" else 1)
    assert lib.explain(two, k, v, mask=causal, layout=layout).problem.mask == causal
