"""cuDNN's score_mod everywhere: the recording graph and its torch interpreter against float64
oracles (softcap, masks, NATTEN's neighborhoods from ``geometry``), the builder's new setters
(score_mod/_bprop, block mask, logit max, score sum exp, rng dump, hints) against brute force, and
the cuDNN engine's score_mod graphs (softcap, neighborhoods) validated for sm_90 and sm_100."""

import itertools
import math

import pytest
import torch

import builder_grid as grid
import cudnn_attn as ca
from cudnn_attn.core import dispatch
from cudnn_attn import graphs
from cudnn_attn.compat.cudnn_frontend._score_attrs import block_mask_visibility
from cudnn_attn.model.geometry import neighborhood_mask
from cudnn_attn.graphs._spec import analyze
from cudnn_attn.graphs.backend import CudnnBackend
from cudnn_attn.graphs.score_mod_masks import mask_program
from cudnn_attn.model.masks import Causal, Neighborhood, SlidingWindow
from cudnn_attn.model.problem import AttnProblem
from cudnn_attn.model.score_mods import ScoreMod, softcap, trace

F64 = torch.float64


def _index_of(shape):
    def index(axis):
        view = [1] * 4
        view[axis] = shape[axis]
        return torch.arange(shape[axis], dtype=F64).view(view)
    return index


def _causal_mod(g, s):
    row = g.gen_index(input=s, axis=2)
    col = g.gen_index(input=s, axis=3)
    return g.binary_select(input0=s, input1=float("-inf"),
                           mask=g.cmp_ge(input=row, comparison=col))


# -- the interpreter ------------------------------------------------------------------------------

def test_softcap_program_and_its_bprop_match_autograd():
    s = torch.randn(2, 3, 5, 7, dtype=F64, generator=torch.Generator().manual_seed(0)) * 20
    program = softcap(4.0)
    torch.testing.assert_close(program.apply(s, _index_of(s.shape)), 4.0 * torch.tanh(s / 4.0))
    leaf = s.clone().requires_grad_()
    grad = torch.randn_like(s)
    (want,) = torch.autograd.grad(4.0 * torch.tanh(leaf / 4.0), leaf, grad)
    assert program.bprop is not None  # cuDNN's Softcap::backward, op for op
    torch.testing.assert_close(program.gradient(s, grad, _index_of(s.shape)), want)


def test_integer_typed_tensors_truncate_and_selects_pick_input0_where_true():
    def mod(g, s):
        half = g.div(a=g.gen_index(input=s, axis=3), b=2.0).set_data_type("INT32")
        return g.binary_select(input0=half, input1=-1.0,
                               mask=g.cmp_lt(input=g.gen_index(input=s, axis=2), comparison=2))
    s = torch.zeros(1, 1, 3, 5, dtype=F64)
    out = trace(mod).apply(s, _index_of(s.shape))[0, 0]
    assert out[:2].tolist() == [[0, 0, 1, 1, 2]] * 2 and out[2].tolist() == [-1] * 5


@pytest.mark.parametrize("hood", [
    Neighborhood((13,), (5,)), Neighborhood((13,), (4,)), Neighborhood((12,), (3,), dilation=3),
    Neighborhood((12,), (5,), stride=2), Neighborhood((12,), (4,), stride=3, is_causal=True),
    Neighborhood((4, 5), (3, 3)), Neighborhood((4, 6), (2, 3), dilation=(2, 1),
                                                is_causal=(True, False)),
    Neighborhood((2, 3, 4), (2, 3, 3), stride=(1, 2, 1))], ids=repr)
def test_neighborhood_programs_match_natten_geometry(hood):
    n = hood.num_tokens
    s = torch.randn(1, 1, n, n, dtype=F64)
    kept = torch.isfinite(mask_program(neighborhood=hood).apply(s, _index_of(s.shape)))[0, 0]
    want = neighborhood_mask(hood.spatial_shape, hood.kernel_size, hood.stride, hood.dilation,
                             hood.is_causal)
    assert torch.equal(kept, want)


def test_programs_are_hashable_and_round_trip_through_json():
    program = mask_program(softcap=2.5, neighborhood=Neighborhood((4, 4), (3, 3)))
    assert hash(program) == hash(ScoreMod.from_json(program.to_json()))
    assert ScoreMod.from_json(program.to_json()) == program


def test_bad_callables_fail_clearly():
    with pytest.raises(TypeError, match="must return a tensor of the graph"):
        trace(lambda g, s: 3.0)
    with pytest.raises(AttributeError, match="not one"):
        trace(lambda g, s: g.softmax(input=s))
    with pytest.raises(TypeError, match="tensor_scalar"):
        trace(lambda g, s: g.add(a=s, b=g.tensor(name="x", dim=[1], stride=[1])))


# -- the builder ----------------------------------------------------------------------------------

def _inputs(seed=0, b=2, h=4, h_kv=2, s_q=9, s_kv=11, d=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, s_q, d, dtype=F64, generator=g),
            torch.randn(b, h_kv, s_kv, d, dtype=F64, generator=g),
            torch.randn(b, h_kv, s_kv, d, dtype=F64, generator=g))


def _oracle(q, k, v, modify, scale):
    rep = q.shape[1] // k.shape[1]
    s = scale * q @ k.repeat_interleave(rep, 1).transpose(-1, -2)
    s = modify(s)
    return torch.softmax(s, -1) @ v.repeat_interleave(rep, 1), s


def _softcap_causal(s):
    i = torch.arange(s.shape[-2])[:, None]
    j = torch.arange(s.shape[-1])[None]
    return (2.0 * torch.tanh(s / 2.0)).masked_fill(j > i, -math.inf)


def test_builder_score_mod_forward_backward_and_row_stats_match_float64():
    q, k, v = _inputs()

    def mod(g, s):
        return _causal_mod(g, g.mul(a=g.tanh(input=g.div(a=s, b=2.0)), b=2.0))

    row_max, sum_exp = torch.empty(2, 4, 9, 1), torch.empty(2, 4, 9, 1)
    attrs = (ca.SdpaAttributes().set_attn_scale(0.4).set_score_mod(mod)
             .set_logit_max(row_max).set_score_sum_exp(sum_exp))
    o, stats = ca.scaled_dot_product_flash_attention(q, k, v, attrs)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want, s = _oracle(*leaves, _softcap_causal, 0.4)
    torch.testing.assert_close(o, want.detach())
    torch.testing.assert_close(stats[..., 0], s.logsumexp(-1).detach())
    torch.testing.assert_close(row_max[..., 0].double(), s.amax(-1).detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sum_exp[..., 0].double(),
                               (s - s.amax(-1, keepdim=True)).exp().sum(-1).detach(),
                               rtol=1e-6, atol=1e-6)
    d_o = torch.randn_like(o)
    grads = ca.scaled_dot_product_flash_attention_backward(
        q, k, v, o, d_o, stats, ca.SdpaBackwardAttributes().set_attn_scale(0.4).set_score_mod(mod))
    for got, ref in zip(grads, torch.autograd.grad(want, leaves, d_o)):
        torch.testing.assert_close(got, ref)


def test_score_mod_bprop_is_what_the_backward_uses():
    q, k, v = _inputs(1)
    o, stats = ca.scaled_dot_product_flash_attention(
        q, k, v, ca.SdpaAttributes().set_score_mod(lambda g, s: g.mul(a=s, b=3.0)))
    d_o = torch.randn_like(o)
    chain = ca.scaled_dot_product_flash_attention_backward(
        q, k, v, o, d_o, stats,
        ca.SdpaBackwardAttributes().set_score_mod(lambda g, s: g.mul(a=s, b=3.0)))
    halved = ca.scaled_dot_product_flash_attention_backward(
        q, k, v, o, d_o, stats,
        ca.SdpaBackwardAttributes().set_score_mod(lambda g, s: g.mul(a=s, b=3.0))
        .set_score_mod_bprop(lambda g, dp: g.mul(a=dp, b=1.5)))
    for full, half in zip(chain[:2], halved[:2]):  # dV does not pass through the scores
        torch.testing.assert_close(half, full / 2)
    torch.testing.assert_close(halved[2], chain[2])
    with pytest.raises(ValueError, match="set_score_mod_bprop needs set_score_mod"):
        ca.scaled_dot_product_flash_attention_backward(
            q, k, v, o, d_o, stats,
            ca.SdpaBackwardAttributes().set_score_mod_bprop(lambda g, dp: dp))


def test_score_mod_excludes_built_in_masks_as_cudnn_does():
    q, k, v = _inputs(2)
    attrs = ca.SdpaAttributes().set_score_mod(lambda g, s: s).set_causal_mask(True)
    with pytest.raises(ca.NotSupportedError, match="score mod enabled and hence other subgraphs"):
        ca.scaled_dot_product_flash_attention(q, k, v, attrs)


def test_block_mask_keeps_its_tiles():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 300, 8, dtype=F64, generator=g)
    k = torch.randn(1, 2, 1100, 8, dtype=F64, generator=g)
    mask = torch.randint(0, 256, (1, 2, 3, 2), dtype=torch.uint8, generator=g)
    mask[0, 0, 1] = 0  # a query tile that sees nothing: zeros, stats -inf
    o, stats = ca.scaled_dot_product_flash_attention(q, k, k, ca.SdpaAttributes()
                                                     .set_block_mask(mask))
    s = q @ k.transpose(-1, -2)
    for h in range(2):
        for i in (0, 150, 299):
            for j in (0, 200, 1000, 1099):
                bit = (int(mask[0, h, i // 128, (j // 128) // 8]) >> ((j // 128) % 8)) & 1
                assert bool(block_mask_visibility(mask, 300, 1100)[0, h, i, j]) == bool(bit)
    vis = block_mask_visibility(mask, 300, 1100)
    want = torch.nan_to_num(torch.softmax(s.masked_fill(~vis, -math.inf), -1)) @ k
    torch.testing.assert_close(o, want)
    assert torch.isinf(stats[0, 0, 128:256]).all() and (o[0, 0, 128:256] == 0).all()
    with pytest.raises(ValueError, match="ceil"):
        ca.scaled_dot_product_flash_attention(q, k, k, ca.SdpaAttributes()
                                              .set_block_mask(mask[..., :1]))


def test_rng_dump_is_the_mask_the_call_applied():
    q, k, v = _inputs(4)
    dump = torch.empty(2, 4, 9, 11)
    o, _ = ca.scaled_dot_product_flash_attention(
        q, k, v, ca.SdpaAttributes().set_dropout(0.25, 11, 3).set_rng_dump(dump))
    assert set(dump.unique().tolist()) == {0.0, 1.0}
    p, _ = _oracle(q, k, torch.eye(11, dtype=F64).expand(2, 2, 11, 11), lambda s: s, 1.0)
    torch.testing.assert_close(o, (p * dump / 0.75) @ v.repeat_interleave(2, 1))


def test_hints_log2_stats_and_dsink_spelling():
    q, k, v = _inputs(5)
    plain = ca.scaled_dot_product_flash_attention(q, k, v, ca.SdpaAttributes())
    hinted = ca.scaled_dot_product_flash_attention(
        q, k, v, ca.SdpaAttributes().set_unfuse_fma(True).set_mma_core_mode("BFLOAT16")
        .set_stats_use_log2(True))
    torch.testing.assert_close(hinted[0], plain[0])
    torch.testing.assert_close(hinted[1], plain[1] / math.log(2))
    with pytest.raises(ValueError, match="set_mma_core_mode"):
        ca.SdpaAttributes().set_mma_core_mode("INT8")
    with pytest.raises(TypeError, match="set_unfuse_fma"):
        ca.SdpaAttributes().set_unfuse_fma("yes")
    dsink = torch.empty(1, 4, 1, 1)
    attrs = ca.SdpaBackwardAttributes().set_sink_token(torch.zeros(1, 4, 1, 1)).set_dsink_token(dsink)
    assert attrs.dsink_token is dsink


def test_every_frontend_setter_exists():
    pytest.importorskip("cudnn")
    assert grid.missing_setters() == {"forward": [], "backward": []}
    assert "set_score_mod_bprop" in grid.frontend_setters("backward")


# -- the cuDNN engine's graphs --------------------------------------------------------------------

def _meta(*shape):
    return torch.empty(*shape, dtype=torch.float16, device="meta")


def _problem(shape, **kw):
    return AttnProblem.from_tensors(_meta(*shape), _meta(*shape), _meta(*shape), **kw)


@pytest.mark.parametrize("kw", [dict(softcap=30.0), dict(softcap=30.0, mask=Causal()),
                                dict(softcap=30.0, mask=SlidingWindow(63, 0)),
                                dict(mask=Neighborhood((256,), (127,))),
                                dict(mask=Neighborhood((16, 16), (9, 9)))], ids=repr)
@pytest.mark.parametrize("sm", [90, 100])
@pytest.mark.parametrize("backward", [False, True])
def test_score_mod_graphs_validate_and_mean_the_problem(kw, sm, backward):
    pytest.importorskip("cudnn")
    problem = _problem((1, 2, 256, 64), **kw)
    spec, reasons = analyze(problem, target_sm=sm, backward=backward)
    assert not reasons and spec.score_mod is not None and spec.band is None
    graphs.sdpa.validate_for(problem, sm, backward=backward)
    # the program the graph carries means the problem: same scores, same visible pairs
    s = torch.randn(1, 1, 256, 256, dtype=F64) * 40
    got = spec.score_mod.apply(s, _index_of(s.shape))[0, 0]
    want = s[0, 0]
    if "softcap" in kw:
        want = 30.0 * torch.tanh(want / 30.0)
    hood = kw.get("mask")
    if isinstance(hood, Neighborhood):
        keep = neighborhood_mask(hood.spatial_shape, hood.kernel_size)
    elif hood is not None:
        keep = torch.ones(256, 256, dtype=torch.bool).tril()
        if isinstance(hood, SlidingWindow):
            keep &= torch.ones(256, 256, dtype=torch.bool).triu(-63)
    else:
        keep = torch.ones(256, 256, dtype=torch.bool)
    torch.testing.assert_close(got, want.masked_fill(~keep, -math.inf))


def test_causal_1d_neighborhood_is_the_built_in_band():
    problem = _problem((1, 2, 64, 64), mask=Neighborhood((64,), (9,), is_causal=True))
    spec, reasons = analyze(problem)
    assert not reasons and spec.score_mod is None
    assert (spec.band.alignment, spec.band.left, spec.band.right) == ("top_left", 9, 0)


def test_padding_alibi_and_rpb_are_declared_limits_of_score_mod_graphs():
    reasons = analyze(_problem((2, 2, 64, 64), softcap=5.0, mask=ca.Padding([3, 64], [64, 5])))[1]
    assert any("excludes the padding mask" in r for r in reasons)
    reasons = analyze(_problem((2, 2, 64, 64), softcap=5.0, alibi=ca.Alibi(),
                               mask=Causal()))[1]
    assert any("excludes ALiBi" in r for r in reasons)


def test_band_misses_rows_is_the_band_rule_row_by_row():
    """Brute force over small sizes: some row sees no key exactly when the rule says so."""
    from cudnn_attn.graphs._spec import Band
    from cudnn_attn.graphs.score_mod_masks import band_misses_rows

    for s_q, s_kv, left, right, alignment in itertools.product(
            range(1, 7), range(1, 7), (None, 1, 2, 4), (None, 0, 1, 3),
            ("top_left", "bottom_right")):
        if left is None and right is None:
            continue
        offset = s_kv - s_q if alignment == "bottom_right" else 0
        i = torch.arange(s_q)[:, None] + offset
        j = torch.arange(s_kv)[None, :]
        seen = torch.ones(s_q, s_kv, dtype=torch.bool)
        if left is not None:
            seen &= j > i - left
        if right is not None:
            seen &= j <= i + right
        band = Band(alignment, left, right)
        assert band_misses_rows(band, offset, s_q, s_kv) == bool((~seen.any(1)).any()), \
            (s_q, s_kv, band)


@pytest.mark.parametrize("mask, declined", [
    (Causal("bottom_right"), True),            # rows 0-5 precede every key
    (SlidingWindow(2, 1, "top_left"), True),   # the last rows start past the last key
    (Causal(), False),                         # every row keeps key 0
    (SlidingWindow(20, 8, "bottom_right"), False)], ids=repr)  # row 0 reaches keys 0-2
def test_score_mod_graphs_whose_band_leaves_rows_without_keys_are_declined(mask, declined):
    """cuDNN writes undefined values for a row whose scores are all -inf (its own bottom-right
    band and window refuse S_q > S_kv without padding): a score_mod graph whose folded band
    leaves such rows (S_q = 16 queries, 10 keys) is declined with the reason, so those calls
    run where an empty row gives 0 and -inf."""
    problem = AttnProblem.from_tensors(_meta(1, 2, 16, 64), _meta(1, 2, 10, 64),
                                       _meta(1, 2, 10, 64), softcap=30.0, mask=mask)
    spec, reasons = analyze(problem)
    assert (spec is None) == declined
    assert any("leaves query rows without a key" in r for r in reasons) == declined, reasons


def test_neighborhoods_on_cudnn_are_priced_not_declined():
    # auto weighs cuDNN's dense run of a neighborhood against the fused kernels by predicted time
    # (tests/model/test_cost_dispatch.py); supports() and the preference never decline it.
    engine = CudnnBackend()
    sparse = _problem((1, 2, 256, 64), mask=Neighborhood((16, 16), (5, 5)))
    assert dispatch.auto_reasons(engine, sparse) == []
    assert engine.predicted_ms(sparse) > 0
    band = _problem((1, 2, 64, 64), mask=Neighborhood((64,), (9,), is_causal=True))
    assert engine.predicted_ms(band) is None  # cuDNN's own band: no cost rule


def test_describe_takes_different_key_and_value_heads():
    pytest.importorskip("cudnn")
    graph = graphs.describe(_meta(1, 6, 64, 64), _meta(1, 2, 64, 64), _meta(1, 3, 64, 64))
    assert graph is not None


# -- the graphs, executed by the stand-in that reads what cuDNN received --------------------------

@pytest.fixture
def fake_cudnn(monkeypatch):
    import cudnn_fake
    from cudnn_attn.core.caches import clear_caches

    yield cudnn_fake.install(monkeypatch)
    clear_caches()


@pytest.mark.parametrize("kw", [dict(softcap=5.0, mask=Causal()),
                                dict(softcap=3.0, mask=SlidingWindow(5, 0, "bottom_right")),
                                dict(mask=Neighborhood((6, 5), (3, 3))),
                                dict(mask=Neighborhood((24,), (7,), dilation=2)),
                                dict(mask=Neighborhood((24,), (5,), is_causal=True))], ids=repr)
def test_score_mod_graphs_run_as_the_problem_means(kw, fake_cudnn):
    g = torch.Generator().manual_seed(7)
    n = kw["mask"].num_tokens if isinstance(kw["mask"], Neighborhood) else 24
    q, k, v = (torch.randn(2, 4, n, 16, generator=g).half().requires_grad_() for _ in range(3))
    out = ca.attention(q, k, v, backend="cudnn", **kw)
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ca.attention(*ref_inputs, backend="torch", **kw)
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    d_o = torch.randn(out.shape, generator=g).half()
    got = torch.autograd.grad(out, (q, k, v), d_o)
    want = torch.autograd.grad(ref, ref_inputs, d_o.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=5e-3, rtol=5e-3)
    specs = [spec for spec, _ in fake_cudnn[1]]
    hood = kw["mask"]
    banded = isinstance(hood, Neighborhood) and hood.is_causal[0]
    assert specs and all((spec.score_mod is None) == banded for spec in specs)


def test_softcap_calls_with_rows_that_see_no_key_give_zeros_not_nan(fake_cudnn):
    """FlashAttention's local softcap case (test_flash_attn_varlen_output, S_q > S_k, run
    through the cuDNN stand-in): rows the window leaves without keys came out NaN from the
    score_mod graph, and so did every gradient. Declined on cuDNN, the call runs where such
    rows give 0 (lse -inf) and gradients stay finite."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 16, 16, generator=g).half().requires_grad_()
    k, v = (torch.randn(1, 2, 10, 16, generator=g).half().requires_grad_() for _ in range(2))
    mask = SlidingWindow(3, 2, "bottom_right")
    out, lse = ca.attention(q, k, v, mask=mask, softcap=30.0, return_lse=True)
    assert ca.explain(q, k, v, mask=mask, softcap=30.0).selected != "cudnn"
    assert not fake_cudnn[1], "a score_mod graph was built"
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = ca.attention(*ref_inputs, mask=mask, softcap=30.0, return_lse=True,
                                backend="torch")
    assert (ref[0, :, :4] == 0).all() and (ref_lse[0, :, :4] == -math.inf).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-3, rtol=2e-3)
    got = torch.autograd.grad(out.float().sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), ref_inputs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=5e-3, rtol=5e-3)


# -- deviceless execution plans: every new graph kind, on every architecture ---------------------

from deviceless_plans import TARGETS, assert_plans, deviceless  # noqa: E402,F401  (fixture)
from full_sweep import rotate  # noqa: E402

SCORE_MOD_FAMILIES = {
    "softcap": dict(softcap=30.0),
    "softcap-causal": dict(softcap=30.0, mask=Causal()),
    "softcap-window": dict(softcap=50.0, mask=SlidingWindow(127, 0)),
    "natten-1d": dict(mask=Neighborhood((256,), (127,))),
    "natten-2d": dict(mask=Neighborhood((16, 16), (9, 9))),
    "natten-1d-causal-band": dict(mask=Neighborhood((256,), (31,), is_causal=True)),
    "builder-score-mod": dict(score_mod=trace(_causal_mod)),
}


# Each family and direction on the first target and one more, rotating with the family so that
# every family meets every target and each direction meets each target (``full_sweep.rotate``;
# ``CUDNN_ATTN_FULL_SWEEP=1``: every target): 28 of the 42 plan builds, sm_100's the slowest.
SCORE_MOD_PLANS = [pytest.param(name, backward, target,
                                id=f"{name}-{'bwd' if backward else 'fwd'}-{target}")
                   for f, name in enumerate(SCORE_MOD_FAMILIES)
                   for backward in (False, True)
                   for target in rotate(TARGETS, f + backward)]


@pytest.mark.parametrize("name, backward, target", SCORE_MOD_PLANS)
def test_score_mod_graphs_plan_where_the_engine_claims_them(name, backward, target, deviceless):
    problem = _problem((2, 4, 256, 64), **SCORE_MOD_FAMILIES[name])
    if backward:
        import dataclasses

        problem = dataclasses.replace(problem, requires_grad=True)
    assert_plans(deviceless, problem, target, backward=backward)


def test_neighborhood_block_mask_keeps_every_tile_with_a_visible_pair():
    from cudnn_attn.graphs.score_mod_masks import tile_bitmask

    hood = Neighborhood((24, 24), (5, 5))
    packed = tile_bitmask(hood, 2, 3)
    assert packed.shape == (2, 3, 5, 1) and packed.dtype == torch.uint8
    kept = block_mask_visibility(packed, 576, 576)[0, 0]       # the builder's reading of the bits
    visible = neighborhood_mask((24, 24), (5, 5))
    assert bool((kept | ~visible).all())                        # no visible pair is skipped
    assert not bool(kept.all())                                 # and empty tiles are skipped


@pytest.mark.parametrize("target", ["b200", "h100"])
def test_block_mask_graphs_plan_on_blackwell_only(target, deviceless):
    from cudnn_attn.graphs.targets import target as as_target

    problem = _problem((1, 2, 1024, 64), mask=Neighborhood((32, 32), (7, 7)))
    sm = as_target(target).sm
    spec, reasons = analyze(problem, target_sm=sm)
    assert not reasons and spec.block_mask == (sm >= 100)
    forced = __import__("dataclasses").replace(spec.forward_variant(False), block_mask=True)
    result = deviceless.plan_spec(forced, False, target)
    if sm >= 100:
        assert result.ok, result.refusal
    else:  # the declared limit is cuDNN's: Hopper plans no block mask
        assert not result.ok and "Blackwell" in result.refusal


def test_natten_surface_runs_on_cudnn_when_asked(fake_cudnn):
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 6, 5, 2, 16, generator=g).half() for _ in range(3))  # heads-last
    out = ca.natten.na2d(q, k, v, kernel_size=3, backend="cudnn")
    want = ca.natten.na2d(q.double(), k.double(), v.double(), kernel_size=3, backend="torch")
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
    assert fake_cudnn[1] and all(spec.score_mod is not None for spec, _ in fake_cudnn[1])


@pytest.mark.parametrize("target", TARGETS)
def test_bottom_right_left_bound_alone_takes_a_bias_as_cudnn_plans(target, deviceless):
    """cuDNN's bottom-right restriction (no bias, ALiBi or dropout) is for its causal diagonal;
    a left bound alone validates and plans with a bias (seen in the builder grid)."""
    import dataclasses

    problem = AttnProblem.from_tensors(
        _meta(2, 4, 200, 64), _meta(2, 4, 256, 64), _meta(2, 4, 256, 64),
        bias=_meta(1, 4, 200, 256),
        mask=SlidingWindow(31, -1, "bottom_right") & ca.Padding([200, 100], [256, 130]))
    for backward in (False, True):
        p = dataclasses.replace(problem, requires_grad=True) if backward else problem
        assert assert_plans(deviceless, p, target, backward=backward).ok
