"""explain() verdicts on this CPU machine, and dropout semantics.

* explain() maps "cudnn", "cupy", "torch" (that order) to "selected" / "available" / reasons; on a CPU-only
  machine torch is selected and cudnn / cupy carry non-empty reason lists; str() names every backend.
* Dropout: a seeded generator reproduces the output exactly, a different seed changes it; surviving
  probabilities are scaled by exactly 1/(1-p) and the dropped fraction is ~p; E[out] ~ no-dropout out;
  lse ignores dropout; backward uses the forward's mask (gradcheck with a reseeded generator).
"""

import importlib.util
from collections.abc import Mapping

import pytest
import torch
from common import Problem, ca, qkv

BACKEND_ORDER = ["cudnn", "cupy", "torch"]
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only verdicts")


EXPLAIN_CALLS = [
    pytest.param({}, id="dense"),
    pytest.param({"mask": "causal"}, id="causal"),
    pytest.param({"mask": "window", "bias": "alibi"}, id="window-alibi"),
    pytest.param({"mask": "na"}, id="neighborhood"),
    pytest.param({"dropout_p": 0.1}, id="dropout"),
    pytest.param({"dtype": torch.float64}, id="fp64"),
    pytest.param({"dtype": torch.bfloat16, "layout": "bshd"}, id="bf16-bshd"),
]


def _explain_args(spec):
    lib = ca()
    dtype = spec.get("dtype", torch.float32)
    q, k, v = qkv(1, 2, 8, 4, Skv=8, dtype=dtype)
    if spec.get("layout") == "bshd":
        q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    kw = {}
    if "layout" in spec:
        kw["layout"] = spec["layout"]
    mask = spec.get("mask")
    if mask == "causal":
        kw["mask"] = lib.Causal()
    elif mask == "window":
        kw["mask"] = lib.SlidingWindow(2, 0)
    elif mask == "na":
        kw["mask"] = lib.Neighborhood((2, 4), (2, 3))
    if spec.get("bias") == "alibi":
        kw["bias"] = lib.Alibi()
    if "dropout_p" in spec:
        kw["dropout_p"] = spec["dropout_p"]
    return (q, k, v), kw


@CPU_ONLY
@pytest.mark.parametrize("spec", EXPLAIN_CALLS)
def test_explain_verdicts_cpu(spec):
    args, kw = _explain_args(spec)
    ex = ca().explain(*args, **kw)
    assert isinstance(ex, Mapping)
    assert list(ex.keys()) == BACKEND_ORDER
    assert ex["torch"] == "selected"
    for name in ("cudnn", "cupy"):
        reasons = ex[name]
        assert isinstance(reasons, list) and reasons, (
            f"{name}: expected a non-empty reason list, got {reasons!r}"
        )
        assert all(isinstance(r, str) and r.strip() for r in reasons)
    text = str(ex)
    for name in BACKEND_ORDER:
        assert name in text
    assert "selected" in text
    # the selection explain() reports actually runs
    out = ca().attention(*args, **kw)
    assert torch.isfinite(out).all()


@CPU_ONLY
@pytest.mark.parametrize("forced", ["cudnn", "cupy", "torch"])
def test_explain_with_forced_backend_never_raises(forced):
    ex = ca().explain(*qkv(1, 2, 6, 4, Skv=8), backend=forced)
    assert list(ex.keys()) == BACKEND_ORDER
    if forced == "torch":
        assert ex["torch"] == "selected"
    else:
        assert isinstance(ex[forced], list) and ex[forced]
        assert "selected" not in [ex["cudnn"], ex["cupy"]]


def test_notsupported_reasons_match_explain():
    """A forced backend that cannot run raises NotSupportedError whose reasons are explain()'s reasons."""
    lib = ca()
    args = qkv(1, 2, 6, 4, Skv=8)
    ex = lib.explain(*args)
    for name in ("cudnn", "cupy"):
        if not isinstance(ex[name], list):
            continue  # usable on this machine
        with pytest.raises(lib.NotSupportedError) as ei:
            lib.attention(*args, backend=name)
        assert set(ei.value.reasons[name]) == set(ex[name])


# ------------------------------------------------------------------------------------------------------
# dropout
# ------------------------------------------------------------------------------------------------------


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_dropout_reproducible_with_seeded_generator():
    lib = ca()
    q, k, v = qkv(2, 2, 16, 8, Skv=24, dtype=torch.float64)
    kw = {"mask": lib.Causal(alignment="bottom_right"), "dropout_p": 0.25}
    a = lib.attention(q, k, v, generator=_gen(123), **kw)
    b = lib.attention(q, k, v, generator=_gen(123), **kw)
    c = lib.attention(q, k, v, generator=_gen(124), **kw)
    assert torch.equal(a, b), "same seed must give identical output"
    assert not torch.equal(a, c), "different seeds must give different outputs"
    ref = lib.attention(q, k, v, mask=kw["mask"])
    assert not torch.allclose(a, ref), "dropout_p=0.25 had no effect"


def test_dropout_zero_is_exact():
    lib = ca()
    q, k, v = qkv(1, 2, 6, 4, Skv=8, dtype=torch.float64)
    a = lib.attention(q, k, v, dropout_p=0.0, generator=_gen(5))
    b = lib.attention(q, k, v)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("p_drop", [0.1, 0.3, 0.6])
def test_dropout_mask_scaling_and_fraction(p_drop):
    """v = identity makes out equal the (dropped-out) probability matrix itself: every entry is either 0
    or p_ij / (1 - p_drop), and the dropped fraction of visible entries is ~p_drop."""
    lib = ca()
    B, H, Sq, Skv = 2, 2, 48, 128
    p = Problem(B=B, Hq=H, Sq=Sq, Skv=Skv, D=8, Dv=Skv, causal="bottom_right")
    inp = p.make_inputs(torch.float64, seed=31)
    inp["v"] = torch.eye(Skv, dtype=torch.float64).expand(B, H, Skv, Skv).contiguous()
    probs, _ = p.run_oracle(inp)  # [B, H, Sq, Skv] softmax probabilities
    out = lib.attention(
        inp["q"],
        inp["k"],
        inp["v"],
        mask=lib.Causal(alignment="bottom_right"),
        dropout_p=p_drop,
        generator=_gen(2024),
    )
    visible = probs > 0
    kept = out != 0
    assert not (kept & ~visible).any(), "dropout produced weight on a masked key"
    torch.testing.assert_close(out[kept], probs[kept] / (1 - p_drop), atol=1e-12, rtol=1e-10)
    frac = 1 - kept[visible].double().mean().item()
    n = int(visible.sum())
    sigma = (p_drop * (1 - p_drop) / n) ** 0.5
    assert abs(frac - p_drop) <= max(0.01, 6 * sigma), f"dropped fraction {frac:.4f} vs p={p_drop} (n={n})"


def test_dropout_expectation_matches_no_dropout():
    """Mean over many seeds approaches the no-dropout output (6-sigma bound from the exact variance)."""
    lib = ca()
    p_drop, n_runs = 0.3, 40
    p = Problem(B=1, Hq=2, Sq=12, Skv=160, D=8, Dv=6)
    inp = p.make_inputs(torch.float64, seed=3)
    q, k, v = inp["q"], inp["k"], inp["v"]
    ref = lib.attention(q, k, v)
    inp_eye = dict(inp, v=torch.eye(160, dtype=torch.float64).expand(1, 2, 160, 160))
    probs, _ = p.replace(Dv=160).run_oracle(inp_eye)
    # Var(out[i, d]) = p/(1-p) * sum_j P_ij^2 v_jd^2 for one run
    var = p_drop / (1 - p_drop) * torch.einsum("bhij,bhjd->bhid", probs**2, v**2)
    acc = torch.zeros_like(ref)
    for s in range(n_runs):
        acc += lib.attention(q, k, v, dropout_p=p_drop, generator=_gen(1000 + s))
    mean = acc / n_runs
    z = (mean - ref) / (var / n_runs).sqrt()
    assert z.abs().max() < 6.0, f"max |z| = {z.abs().max():.2f}"
    assert (mean - ref).abs().max() > 0  # it did drop something


def test_dropout_does_not_change_lse():
    lib = ca()
    q, k, v = qkv(1, 2, 10, 4, Skv=12, dtype=torch.float64)
    _, lse_d = lib.attention(q, k, v, dropout_p=0.4, generator=_gen(9), return_lse=True, mask=lib.Causal())
    _, lse = lib.attention(q, k, v, return_lse=True, mask=lib.Causal())
    torch.testing.assert_close(lse_d, lse, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mask", ["none", "causal", "na1d"])
def test_dropout_gradcheck_with_reseeded_generator(mask):
    """Each call reseeds a fresh generator, so the function is deterministic; a backward that used a
    different mask than the forward would fail gradcheck."""
    lib = ca()
    g = torch.Generator().manual_seed(77)
    q, k, v = (
        torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    m = {"none": None, "causal": lib.Causal(), "na1d": lib.Neighborhood(6, 3, dilation=2)}[mask]

    def fn(q, k, v):
        return lib.attention(q, k, v, mask=m, dropout_p=0.35, generator=_gen(4242))

    out = fn(q, k, v)
    assert not torch.allclose(out, lib.attention(q, k, v, mask=m)), "dropout had no effect"
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------------------------------------------
# cudnn-attn explain for varlen and KV-cache calls
# ------------------------------------------------------------------------------------------------------

needs_fe = pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                              reason="nvidia-cudnn-frontend is not installed")


def _cli(capsys, *argv):
    from cudnn_attn import cli

    code = cli.main(["explain", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@CPU_ONLY
@needs_fe
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_cli_explain_varlen_shows_the_verdicts_and_the_ragged_graph(capsys, backward):
    lib = ca()
    code, out, err = _cli(capsys, "--shape", "3,4,128,64", "--heads-kv", "2", "--dtype", "fp16",
                          "--varlen", "100,3,17/128,60,12", "--mask", "causal:bottom_right",
                          *(["--backward"] if backward else []))
    assert code == 0, err
    assert "varlen call: B=3, lengths [100, 3, 17] / [128, 60, 12], max_seqlen_q=128" in out
    # the verdicts are those of the padded [B, max_seqlen, H, D] problem the engines see
    q = torch.empty(3, 128, 4, 64, dtype=torch.float16)
    k = torch.empty(3, 128, 2, 64, dtype=torch.float16)
    mask = lib.Causal("bottom_right") & lib.Padding([100, 3, 17], [128, 60, 12])
    assert str(lib.explain(q, k, k, layout="bshd", mask=mask)) in out
    assert f"cuDNN graph ({'backward' if backward else 'forward'}, sm_90), validated" in out
    offsets = {"q": "ragged_q", "k": "ragged_k", "v": "ragged_v", "o": "ragged_o"}
    if backward:
        offsets.update(dq="ragged_q", do="ragged_o", stats="ragged_stats")
    for name, ragged in offsets.items():
        assert f"  {name}: ragged offsets {ragged} (uid" in out, name
    assert ("stats: ragged offsets" in out) == backward  # the forward builds no stats here


@CPU_ONLY
@needs_fe
def test_cli_explain_paged_kvcache_shows_the_page_tables(capsys):
    code, out, err = _cli(capsys, "--shape", "3,8,1,64", "--heads-kv", "2", "--seq-kv", "256",
                          "--dtype", "fp16", "--cache-seqlens", "5,100,256", "--page-size", "64")
    assert code == 0, err
    assert "KV-cache call: B=3, cache_seqlens [5, 100, 256], 4 pages of 64 tokens" in out
    assert "Page_table_K: uid 20, dims [3, 1, 4, 1]" in out and "max_seq_len_kv: 256" in out
    code, out, _ = _cli(capsys, "--shape", "3,8,1,64", "--heads-kv", "2", "--seq-kv", "256",
                        "--dtype", "fp16", "--cache-seqlens", "7", "--mask", "causal:bottom_right")
    assert code == 0 and "cache_seqlens [7, 7, 7], S_max=256 (dense cache)" in out
    # A bottom-right decode query sits at the last key: no band, so GQA decode is served.
    assert "decode (S_q = 1)" not in out and "cuDNN graph (forward, sm_90)" in out
    code, out, _ = _cli(capsys, "--shape", "3,8,1,64", "--heads-kv", "2", "--seq-kv", "256",
                        "--dtype", "fp16", "--cache-seqlens", "7", "--mask", "causal:top_left")
    assert code == 0 and "not supported" in out and "decode (S_q = 1)" in out


@pytest.mark.parametrize("argv, match", [
    (["--varlen", "5,6"], "one length per batch (3"),
    (["--varlen", "5,x,7"], "integers separated by ','"),
    (["--varlen", "5,6,7", "--layout", "bhsd"], "--layout bshd"),
    (["--varlen", "5,6,7", "--cache-seqlens", "4"], "pass one"),
    (["--page-size", "16"], "--page-size needs --cache-seqlens"),
    (["--cache-seqlens", "4,200,3"], "cache_seqlens[1] = 200 is outside [0, 64]"),
    (["--varlen", "5,65,7"], "max_seqlen_q must be >= the longest sequence"),
])
def test_cli_explain_bad_varlen_and_cache_arguments(capsys, argv, match):
    code, _, err = _cli(capsys, "--shape", "3,2,64,32", *argv)
    assert code == 2 and match in err, err
