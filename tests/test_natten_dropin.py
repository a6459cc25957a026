"""``cudnn_attn.natten`` as a one-line replacement for ``import natten`` (NATTEN 0.21.7, plus 0.17's
unfused ops and module keywords).

Signatures are compared with the installed NATTEN's; results with NATTEN itself on the CPU
(``backend="flex-fna"``, fp32) or with the float64 brute force of ``tests/na_oracle.py``.
"""

import inspect
import math
import warnings

import pytest
import torch

import cudnn_attn
import cudnn_attn.natten as ours
import na_oracle

natten = pytest.importorskip("natten")

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

F64 = torch.float64


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


# ------------------------------------------------------------------------------------------------
# Signatures
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["na1d", "na2d", "na3d"])
def test_na_signatures_are_natten_021s_with_rpb_keyword_only_at_the_end(name):
    theirs, mine = _params(getattr(natten, name)), _params(getattr(ours, name))
    assert mine[:len(theirs)] == theirs
    assert mine[len(theirs):] == [("rpb", inspect.Parameter.KEYWORD_ONLY, None)]


@pytest.mark.parametrize("name", ["attention", "merge_attentions"])
def test_attention_and_merge_signatures_are_natten_021s(name):
    assert _params(getattr(ours, name)) == _params(getattr(natten, name))


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_module_positional_order_is_natten_021s(rank):
    theirs = [p[0] for p in _params(getattr(natten, f"NeighborhoodAttention{rank}D").__init__)]
    mine = _params(getattr(ours, f"NeighborhoodAttention{rank}D").__init__)
    positional = [n for n, kind, _ in mine if kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == theirs


def test_the_namespace_has_natten_s_public_functions_and_flags():
    wanted = set(natten.__all__) - {"HAS_LIBNATTEN", "__version__"}
    wanted = {n for n in wanted if not n.startswith("get_") or "config" not in n}
    assert wanted <= set(ours.__all__)
    assert cudnn_attn.natten is ours and ours.functional.na2d is ours.na2d
    from cudnn_attn.natten.functional import na3d
    assert na3d is ours.na3d
    assert set(cudnn_attn.neighborhood.__all__) == set(ours.__all__)


# ------------------------------------------------------------------------------------------------
# Calls in NATTEN's argument order, against NATTEN itself
# ------------------------------------------------------------------------------------------------

def _qkv(B, shape, H, D, seed=0, Hkv=None):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, *shape, H, D, generator=g),
            torch.randn(B, *shape, Hkv or H, D, generator=g),
            torch.randn(B, *shape, Hkv or H, D, generator=g))


CASES = [((24,), 5, 2, 2, False), ((24,), 7, 1, 3, True), ((9, 12), (3, 5), (2, 1), (2, 2), (True, False)),
         ((6, 5, 7), (3, 3, 4), (1, 2, 2), 1, (False, True, False))]


@pytest.mark.parametrize("shape, kernel, stride, dilation, causal", CASES)
def test_positional_calls_match_natten(shape, kernel, stride, dilation, causal):
    rank = len(shape)
    q, k, v = _qkv(2, shape, 2, 16)
    args = (q, k, v, kernel, stride, dilation, causal, 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want, want_lse = getattr(natten, f"na{rank}d")(*args, backend="flex-fna", return_lse=True)
    got, got_lse = getattr(ours, f"na{rank}d")(*args, None, None, None, "flex-fna", None, None,
                                               None, None, None, False, True, None, False, True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5)


def test_additional_keys_are_the_ninth_positional_argument():
    q, k, v = _qkv(1, (6, 7), 2, 8, seed=1)
    extra_k, extra_v = (torch.randn(1, 5, 2, 8, dtype=F64) for _ in range(2))
    q, k, v = (t.to(F64) for t in (q, k, v))
    out = ours.na2d(q, k, v, 3, 1, 1, False, None, extra_k, extra_v)
    ref, _ = na_oracle.na_reference(q, k, v, (6, 7), (3, 3), add_k=extra_k, add_v=extra_v)
    torch.testing.assert_close(out, ref)


def test_none_means_natten_s_defaults():
    q, k, v = _qkv(1, (10, 9), 2, 8, seed=2)
    torch.testing.assert_close(ours.na2d(q, k, v, 3, None, None, None),
                               ours.na2d(q, k, v, 3, 1, 1, False))
    module = ours.NeighborhoodAttention1D(16, 2, 3, None, None, None)
    assert (module.stride, module.dilation, module.is_causal) == ((1,), (1,), (False,))


@pytest.mark.parametrize("backend", ["cutlass-fna", "hopper-fna", "blackwell-fna", "flex-fna",
                                     None, "auto", "torch"])
def test_natten_and_our_backend_names_give_the_same_result(backend):
    q, k, v = _qkv(1, (12,), 2, 8, seed=3)
    torch.testing.assert_close(ours.na1d(q, k, v, 5, backend=backend), ours.na1d(q, k, v, 5))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(backend="cutlass-fmha"), NotImplementedError, "unrecognized backend"),
    (dict(backend="xformers"), NotImplementedError, "unrecognized backend"),
    (dict(q_tile_shape=8, kv_tile_shape=(4,)), ValueError, "tile shape"),
    (dict(q_tile_shape=(8, 8, 8, 8), kv_tile_shape=(4,)), ValueError, "tile shape"),
    (dict(q_tile_shape=(4,), kv_tile_shape=(8, 8)), ValueError, "kv_tile_shape must have 1"),
    # NATTEN 0.21's kernels take both tiles of a pass or neither (a ValueError before any other).
    (dict(q_tile_shape=(4,)), ValueError, "specify both q_tile_shape and kv_tile_shape"),
    (dict(q_tile_shape=8), ValueError, "specify both q_tile_shape and kv_tile_shape"),
    (dict(kv_tile_shape=(4,)), ValueError, "specify both q_tile_shape and kv_tile_shape"),
    (dict(backward_kv_tile_shape=(4,)), ValueError, "specify both backward_q_tile_shape"),
    (dict(backward_kv_splits=("a",)), ValueError, "tile shape"),
    (dict(kernel_schedule="fast"), ValueError, "Kernel schedule fast is invalid"),
    (dict(torch_compile=1), TypeError, "torch_compile"),
    (dict(attention_kwargs=[1]), TypeError, "attention_kwargs"),
])
def test_tuning_arguments_are_validated_like_natten(kwargs, error, match):
    q, k, v = _qkv(1, (12,), 2, 8)
    with pytest.raises(error, match=match):
        ours.na1d(q, k, v, 5, **kwargs)


def test_valid_tuning_arguments_are_hints_that_change_nothing():
    q, k, v = _qkv(1, (8, 8), 2, 8, seed=4)
    hinted = ours.na2d(q, k, v, 3, q_tile_shape=(4, 4), kv_tile_shape=(4, 8),
                       backward_q_tile_shape=(8, 8), backward_kv_tile_shape=(8, 8),
                       backward_kv_splits=(1, 2), backward_use_pt_reduction=True,
                       run_persistent_kernel=False, kernel_schedule="coop", torch_compile=True)
    torch.testing.assert_close(hinted, ours.na2d(q, k, v, 3), rtol=0, atol=0)


def test_fused_ops_refuse_nested_tensors_as_natten():
    q = torch.nested.nested_tensor([torch.randn(1, 8, 2, 4), torch.randn(1, 10, 2, 4)])
    with pytest.raises(NotImplementedError, match="nested"):
        ours.na1d(q, q, q, 3)


# ------------------------------------------------------------------------------------------------
# attention (dense and varlen) and merge_attentions
# ------------------------------------------------------------------------------------------------

def _dense(q, k, v, causal, scale=None):
    """float64 heads-last attention, top-left causal: (out, lse [B, S, H])."""
    q, k, v = (t.to(F64).transpose(1, 2) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return (torch.softmax(s, -1) @ v).transpose(1, 2), s.logsumexp(-1).transpose(1, 2)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_dense_against_the_brute_force(causal):
    q, k, v = _qkv(2, (11,), 4, 8, seed=5, Hkv=2)
    out, lse = ours.attention(q, k, v, causal, 0.4, return_lse=True, backend="cutlass-fmha")
    ref, ref_lse = _dense(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), causal, 0.4)
    torch.testing.assert_close(out.to(F64), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.to(F64), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["seqlens", "cumulative"])
def test_attention_varlen_is_each_sequence_alone(form):
    lens = [5, 0, 9, 3]
    q, k, v = _qkv(1, (sum(lens),), 2, 8, seed=6)
    t = torch.tensor(lens, dtype=torch.int32)
    if form == "seqlens":
        kwargs = dict(seqlens_Q=t, seqlens_KV=t)
    else:
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), t.cumsum(0).to(torch.int32)])
        kwargs = dict(cumulative_seqlen_Q=cu, cumulative_seqlen_KV=cu, max_seqlen_Q=9,
                      max_seqlen_KV=9)
    out, lse = ours.attention(q, k, v, is_causal=True, return_lse=True, **kwargs)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    start = 0
    for n in lens:
        if n:
            piece = slice(start, start + n)
            ref, ref_lse = _dense(q[:, piece], k[:, piece], v[:, piece], True)
            torch.testing.assert_close(out[:, piece].to(F64), ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[:, piece].to(F64), ref_lse, atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("kwargs, match", [
    (dict(seqlens_Q=torch.tensor([4])), "both of seqlens_Q and seqlens_KV"),
    (dict(seqlens_Q=torch.tensor([4]), seqlens_KV=torch.tensor([4])), "torch.int32"),
    (dict(cumulative_seqlen_Q=torch.tensor([0, 4], dtype=torch.int32)), "all of cumulative"),
    (dict(cumulative_seqlen_Q=torch.tensor([0, 4], dtype=torch.int32),
          cumulative_seqlen_KV=torch.tensor([0, 4], dtype=torch.int32), max_seqlen_Q=9,
          max_seqlen_KV=4), "cannot exceed total"),
])
def test_attention_varlen_arguments_raise_natten_s_errors(kwargs, match):
    q, k, v = _qkv(1, (4,), 2, 8)
    with pytest.raises(ValueError, match=match):
        ours.attention(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="batch = 1"):
        q2, k2, v2 = _qkv(2, (4,), 2, 8)
        ours.attention(q2, k2, v2, seqlens_Q=torch.tensor([2, 2], dtype=torch.int32),
                       seqlens_KV=torch.tensor([2, 2], dtype=torch.int32))


@pytest.mark.parametrize("torch_compile, use_autograd_fix", [(True, True), (False, False)])
def test_merge_attentions_matches_natten_and_its_gradient_is_exact(torch_compile,
                                                                   use_autograd_fix):
    q, k, v = _qkv(1, (10,), 2, 8, seed=7)
    q.requires_grad_()
    parts = [ours.attention(q, k[:, a:b], v[:, a:b], return_lse=True) for a, b in ((0, 4), (4, 10))]
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    out, lse = ours.merge_attentions(outs, lses, torch_compile, use_autograd_fix)
    theirs, their_lse = natten.merge_attentions([o.detach() for o in outs],
                                                [l.detach() for l in lses], torch_compile=False,
                                                use_autograd_fix=False)
    torch.testing.assert_close(out, theirs)
    torch.testing.assert_close(lse, their_lse)
    whole = ours.attention(q, k, v)
    (got,) = torch.autograd.grad(out.sum(), q)
    (want,) = torch.autograd.grad(whole.sum(), q)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# Context flags
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def fresh_context():
    ours.context.reset()
    yield ours.context
    ours.context.reset()


def test_deterministic_mode_plans_deterministic_backwards(fresh_context, monkeypatch):
    from cudnn_attn import dispatch
    seen = []
    original = dispatch.plan_for

    def spy(problem, *args, **kwargs):
        seen.append(problem.deterministic)
        flipped.append(torch.are_deterministic_algorithms_enabled())
        return original(problem, *args, **kwargs)

    flipped = []
    monkeypatch.setattr(dispatch, "plan_for", spy)
    cudnn_attn.clear_caches()
    q, k, v = _qkv(1, (9, 9), 1, 8, seed=8)
    ours.na2d(q, k, v, 3)
    assert seen and not any(seen)
    ours.use_deterministic_algorithms(True)
    assert ours.are_deterministic_algorithms_enabled()
    seen.clear()
    ours.na2d(q, k, v, 3)
    assert seen and all(seen)
    # A per-call field of the problem: torch's process-wide flag is untouched, even during the call.
    assert not torch.are_deterministic_algorithms_enabled() and not any(flipped)


def test_context_flags_follow_natten_s_rules(fresh_context):
    assert ours.is_kv_parallelism_in_fused_na_enabled() and ours.is_memory_usage_default()
    ours.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="deterministic"):
        ours.use_kv_parallelism_in_fused_na(True)
    ours.use_kv_parallelism_in_fused_na(False)
    assert not ours.is_kv_parallelism_in_fused_na_enabled()
    ours.set_memory_usage_preference("strict")
    assert ours.is_memory_usage_strict() and not ours.is_memory_usage_default()
    with pytest.raises(ValueError, match="default.*strict.*unrestricted"):
        ours.set_memory_usage_preference("low")
    ours.allow_flex_compile(True, backprop=True)
    assert ours.is_flex_compile_allowed() and ours.is_flex_compile_backprop_allowed()
    ours.disable_flex_compile_backprop()
    assert ours.is_flex_compile_allowed() and not ours.is_flex_compile_backprop_allowed()
    ours.disable_flex_compile()
    assert not ours.is_flex_compile_allowed()


def _autotuner_state():
    a = ours.AutotunerContext
    return (ours.is_autotuner_enabled_for_forward(), ours.is_autotuner_enabled_for_backward(),
            ours.is_autotuner_thorough_for_forward(), ours.is_autotuner_thorough_for_backward(),
            a.warmup_steps_forward, a.warmup_steps_backward, a.steps_forward, a.steps_backward)


def test_autotuner_flags_follow_natten_017_s_rules(fresh_context):
    """NATTEN 0.17's use_autotuner (natten/context.py): None leaves a setting; (False, False, ...)
    turns both passes off and returns before touching anything else; disable_autotuner keeps
    the step counts."""
    assert _autotuner_state() == (False, False, False, False, 5, 5, 5, 5)
    assert not ours.is_autotuner_enabled()
    ours.use_autotuner(True)
    assert _autotuner_state()[:4] == (True, False, False, False) and ours.is_autotuner_enabled()
    ours.use_autotuner(False, True, False, True, 8, 3, 2, 1)
    assert _autotuner_state() == (False, True, False, True, 8, 3, 2, 1)
    ours.use_autotuner(False, False, True, False, 9, 9, 9, 9)  # both off: nothing else changes
    assert _autotuner_state() == (False, False, False, True, 8, 3, 2, 1)
    ours.use_autotuner(thorough_mode_forward=True, steps_backward=17)
    assert _autotuner_state() == (False, False, True, True, 8, 3, 2, 17)
    ours.disable_autotuner()
    assert _autotuner_state() == (False, False, False, False, 8, 3, 2, 17)
    ours.AutotunerContext.reset()
    assert _autotuner_state() == (False, False, False, False, 5, 5, 5, 5)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(forward_pass=1), ValueError, "Expected `bool`"),
    (dict(backward_pass="yes"), ValueError, "Expected `bool`"),
    (dict(thorough_mode_forward=0), ValueError, "Expected `bool`"),
    (dict(steps_forward=2.0), ValueError, "Expected `int`"),
    (dict(warmup_steps_backward="5"), ValueError, "Expected `int`"),
])
def test_autotuner_arguments_raise_natten_s_errors(fresh_context, kwargs, error, match):
    with pytest.raises(error, match=match):
        ours.use_autotuner(**kwargs)


def test_autotuner_and_deterministic_modes(fresh_context):
    ours.use_deterministic_algorithms(True)
    for kwargs in (dict(forward_pass=True), dict(backward_pass=True)):
        with pytest.raises(RuntimeError, match="deterministic mode"):
            ours.use_autotuner(**kwargs)
    ours.use_autotuner(False, False)  # turning it off is allowed
    ours.use_deterministic_algorithms(False)
    torch.use_deterministic_algorithms(True)
    try:
        ours.use_autotuner(True, True, warmup_steps_forward=2)  # torch's mode: ignored entirely
        assert _autotuner_state() == (False, False, False, False, 5, 5, 5, 5)
    finally:
        torch.use_deterministic_algorithms(False)


def test_autotuner_is_a_hint_that_changes_no_result(fresh_context):
    q, k, v = _qkv(1, (9, 9), 2, 8, seed=5)
    before = ours.na2d(q, k, v, 3, dilation=2, is_causal=(True, False))
    ours.use_autotuner(True, True, True, True, 1, 1, 1, 1)
    assert ours.is_autotuner_enabled()
    assert torch.equal(ours.na2d(q, k, v, 3, dilation=2, is_causal=(True, False)), before)


def test_natten_context_reset_keeps_the_autotuner_and_reset_clears_both(fresh_context):
    ours.use_autotuner(True)
    ours.set_memory_usage_preference("strict")
    ours.NattenContext.reset()
    assert ours.is_memory_usage_default() and ours.is_autotuner_enabled_for_forward()
    ours.context.reset()
    assert not ours.is_autotuner_enabled()


# ------------------------------------------------------------------------------------------------
# Modules: NATTEN 0.21 positional construction, NATTEN 0.17 keywords, state_dict
# ------------------------------------------------------------------------------------------------

def test_a_natten_021_module_state_dict_loads_and_gives_the_same_output():
    torch.manual_seed(0)
    theirs = natten.NeighborhoodAttention2D(32, 4, (3, 5), (1, 2), 1, (False, True), True, 0.2)
    mine = ours.NeighborhoodAttention2D(32, 4, (3, 5), (1, 2), 1, (False, True), True, 0.2)
    mine.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 7, 9, 32)
    with torch.no_grad():  # NATTEN's CPU path (Flex) has no backward
        q, k, v = theirs.qkv(x).reshape(2, 7, 9, 3, 4, 8).unbind(3)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attn = natten.na2d(q, k, v, (3, 5), (1, 2), 1, (False, True), 0.2, backend="flex-fna")
        want = theirs.proj(attn.reshape(2, 7, 9, 32))
        torch.testing.assert_close(mine(x), want, atol=1e-5, rtol=1e-5)


def test_natten_017_keywords_and_state_dict_names():
    module = ours.NeighborhoodAttention2D(dim=16, num_heads=2, kernel_size=3, dilation=2,
                                          rel_pos_bias=True, qkv_bias=False, attn_drop=0.1,
                                          use_experimental_ops=True)
    # NATTEN 0.17's parameters: qkv (no bias here), proj, rpb [H, 2k-1, 2k-1].
    shapes = {n: tuple(p.shape) for n, p in module.state_dict().items()}
    assert shapes == {"qkv.weight": (48, 16), "proj.weight": (16, 16), "proj.bias": (16,),
                      "rpb": (2, 5, 5)}
    with pytest.raises(TypeError, match="not both"):
        ours.NeighborhoodAttention1D(16, 2, 3, dim=16)
    with pytest.raises(TypeError, match="kernel_size"):
        ours.NeighborhoodAttention1D(16, 2)


# ------------------------------------------------------------------------------------------------
# Nested tensors in the unfused ops (NATTEN 0.17)
# ------------------------------------------------------------------------------------------------

def test_nested_unfused_ops_run_each_component_against_the_oracle():
    g = torch.Generator().manual_seed(9)
    shapes = [(1, 2, 14, 8), (2, 3, 16, 4), (1, 1, 21, 8)]
    q, k, v = ([torch.randn(s, generator=g, dtype=F64) for s in shapes] for _ in range(3))
    extra_k = [torch.randn(s[0], s[1], 4, s[3], generator=g, dtype=F64) for s in shapes]
    nest = torch.nested.nested_tensor
    attn = ours.na1d_qk(nest(q), nest(k), 7, 2, additional_keys=nest(extra_k))
    weights = [torch.softmax(a, -1) for a in attn.unbind()]
    out = ours.na1d_av(nest(weights), nest(v), 7, 2, additional_values=nest(extra_k))
    for qi, ki, vi, ek, ai, oi in zip(q, k, v, extra_k, attn.unbind(), out.unbind()):
        ref_attn = na_oracle.qk_reference(qi, ki, (qi.shape[2],), (7,), 2, add_k=ek)
        torch.testing.assert_close(ai, ref_attn)
        ref_out = na_oracle.av_reference(torch.softmax(ref_attn, -1), vi, (qi.shape[2],), (7,), 2,
                                         add_v=ek)
        torch.testing.assert_close(oi, ref_out)


@pytest.mark.parametrize("make, match", [
    (lambda n, t: (n, t), "Expected all inputs to be nested"),
    (lambda n, t: (n, n.clone().requires_grad_()), "Autograd"),
    (lambda n, t: (n, torch.nested.nested_tensor([torch.randn(1, 1, 8, 4)])), "match in size"),
])
def test_nested_inputs_raise_natten_s_errors(make, match):
    dense = torch.randn(1, 1, 8, 4)
    nested = torch.nested.nested_tensor([torch.randn(1, 1, 8, 4), torch.randn(1, 1, 9, 4)])
    with pytest.raises(ValueError, match=match):
        ours.na1d_qk(*make(nested, dense), 3)


# ------------------------------------------------------------------------------------------------
# A kernel that spans every axis is plain attention
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, causal, expected_mask", [
    ((6, 5, 4), False, "none"), ((30,), True, "Causal(alignment='top_left')"),
    ((7, 9), False, "none")])
def test_a_whole_grid_kernel_runs_as_dense_attention(shape, causal, expected_mask):
    B, H, D = 1, 2, 8
    S = math.prod(shape)
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(B, S, H, D, generator=g, dtype=F64, requires_grad=True)
               for _ in range(3))
    mask = cudnn_attn.Neighborhood(shape, shape, stride=2 if len(shape) == 1 else 1,
                                   is_causal=causal)
    assert expected_mask in str(cudnn_attn.explain(q, k, v, mask=mask, layout="bshd"))
    out = cudnn_attn.attention(q, k, v, mask=mask, layout="bshd")
    ref, _ = na_oracle.na_reference(q, k, v, shape, shape, stride=2 if len(shape) == 1 else 1,
                                    causal=causal)
    ref = ref.reshape(out.shape)
    torch.testing.assert_close(out, ref)
    dout = torch.randn(out.shape, generator=g, dtype=F64)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_a_whole_grid_kernel_with_rpb_keeps_the_neighborhood():
    q, k, v = (t.to(F64) for t in _qkv(1, (5, 5), 2, 8, seed=11))
    rpb = torch.randn(2, 9, 9, dtype=F64)
    out = ours.na2d(q, k, v, 5, rpb=rpb)
    ref, _ = na_oracle.na_reference(q, k, v, (5, 5), (5, 5), rpb=rpb)
    torch.testing.assert_close(out, ref)


def test_na_compiles_without_graph_breaks():
    q, k, v = _qkv(1, (8, 8), 2, 8, seed=12)
    explanation = torch._dynamo.explain(lambda q, k, v: ours.na2d(q, k, v, 3, 1, 2, (True, False)))(
        q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_use_fused_na_takes_natten_017_arguments():
    import cudnn_attn.natten as N
    from cudnn_attn.natten import context
    try:
        N.use_fused_na(True, kv_parallel=False)
        assert N.is_fused_na_enabled() and not N.is_kv_parallelism_in_fused_na_enabled()
        N.use_fused_na(True)
        assert N.is_kv_parallelism_in_fused_na_enabled()
        N.use_fused_na(False)  # off turns KV parallelism off too (NATTEN 0.17)
        assert not N.is_fused_na_enabled() and not N.is_kv_parallelism_in_fused_na_enabled()
        N.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError):
            N.use_fused_na(True, kv_parallel=True)
        N.use_fused_na(False, kv_parallel=True)  # ignored when turning off
    finally:
        N.use_fused_na(False)
        context.reset()


def test_compiled_modules_of_different_sizes_match_eager():
    # A second compile of the same forward sees new sizes and head dims (dynamo's automatic
    # dynamic shapes); the result must still equal the eager module's.
    import cudnn_attn.natten as N
    torch._dynamo.reset()
    torch.manual_seed(0)
    try:
        N.use_fused_na(True)
        for cls, shape, k, dim, heads in ((N.NeighborhoodAttention1D, (40,), 5, 64, 4),
                                          (N.NeighborhoodAttention2D, (9, 7), (5, 3), 32, 2),
                                          (N.NeighborhoodAttention3D, (6, 5, 8), (3, 3, 5), 48, 3)):
            m = cls(dim, heads, k).eval()
            x = torch.randn(2, *shape, dim)
            with torch.no_grad():
                got = torch.compile(m, fullgraph=True)(x)
                want = m(x)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    finally:
        N.use_fused_na(False)
        torch._dynamo.reset()
