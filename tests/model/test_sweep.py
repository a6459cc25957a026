"""Hypothesis sweep (derandomized) of random valid problems vs the float64 oracle.

* 1/2/3-D neighborhoods with random kernel / stride / dilation / per-axis causal (axis sizes 2..12),
  GQA, D_v != D_qk, both layouts: forward out and lse in fp64.
* Sliding windows (random signs incl. -1, both alignments), optionally AND-ed with causal and padding,
  with GQA, ALiBi, softcap and tensor bias: forward out and lse in fp64.
* fp64 gradients (q, k, v, bias) vs the oracle's autograd on a smaller subset of both families.

The forward sweeps draw 120 problems each by default, 250 with ``CUDNN_ATTN_FULL_SWEEP=1``;
``test_strategies_cover_the_space`` guards what the strategies can reach.
"""

import torch
from common import Problem, check_forward, check_grads
from full_sweep import FULL
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = {
    "derandomize": True,
    "deadline": None,
    "suppress_health_check": list(HealthCheck),
    "database": None,
}
FORWARD_EXAMPLES = 250 if FULL else 120


@st.composite
def neighborhood_problems(draw, max_tokens=240, small=False):
    rank = draw(st.integers(1, 3))
    shape, ks, ss, ds, cs = [], [], [], [], []
    budget = max_tokens
    for a in range(rank):
        remaining_axes = rank - a - 1
        hi = min(12, budget // (2**remaining_axes))
        L = draw(st.integers(2, max(2, hi)))
        budget //= L
        k = draw(st.integers(2, L))
        d = draw(st.integers(1, L // k))
        s = draw(st.integers(1, k))
        c = draw(st.booleans())
        shape.append(L), ks.append(k), ss.append(s), ds.append(d), cs.append(c)

    # exercise both the scalar and the tuple spelling of per-axis arguments
    def spell(vals):
        if rank == 1 and draw(st.booleans()):
            return vals[0]
        return tuple(vals)

    nb = {
        "spatial_shape": spell(shape),
        "kernel_size": spell(ks),
        "stride": spell(ss),
        "dilation": spell(ds),
        "is_causal": spell(cs),
    }
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 3))
    D = draw(st.integers(1, 8 if small else 17))
    Dv = draw(st.sampled_from([D, max(1, D - 3), D + 5]))
    return Problem(
        id="na",
        B=draw(st.integers(1, 2)),
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        Dv=Dv,
        neighborhood=nb,
        layout=draw(st.sampled_from(["bhsd", "bshd"])),
    )


@st.composite
def window_problems(draw, max_s=24):
    B = draw(st.integers(1, 3))
    Sq = draw(st.integers(1, max_s))
    Skv = draw(st.integers(1, max_s))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 3))
    D = draw(st.integers(1, 12))
    kinds = draw(st.sets(st.sampled_from(["window", "causal", "padding"]), min_size=1))
    window = causal = seq_q = seq_kv = None
    align = draw(st.sampled_from(["top_left", "bottom_right"]))
    if "window" in kinds:
        window = (draw(st.integers(-1, Skv + 1)), draw(st.integers(-1, Skv + 1)), align)
    if "causal" in kinds:
        causal = align  # mixed alignments: see test_masks.py::test_mixed_alignment_masks_are_anded
    if "padding" in kinds:
        seq_q = tuple(draw(st.integers(1, Sq)) for _ in range(B))
        seq_kv = tuple(draw(st.integers(1, Skv)) for _ in range(B))
    extra = draw(st.sampled_from(["none", "alibi", "bias", "softcap"]))
    alibi = "default" if extra == "alibi" else None
    bias_shape = None
    if extra == "bias":
        bias_shape = draw(st.sampled_from([(B, Hq, Sq, Skv), (1, Hq, Sq, Skv), (B, 1, 1, Skv), (Sq, Skv)]))
    softcap = draw(st.floats(0.5, 10.0)) if extra == "softcap" else None
    return Problem(
        id="win",
        B=B,
        Hq=Hq,
        Hkv=Hkv,
        Sq=Sq,
        Skv=Skv,
        D=D,
        causal=causal,
        window=window,
        seq_lens_q=seq_q,
        seq_lens_kv=seq_kv,
        alibi=alibi,
        bias_shape=bias_shape,
        softcap=softcap,
        layout=draw(st.sampled_from(["bhsd", "bshd"])),
    )


@settings(max_examples=FORWARD_EXAMPLES, **SETTINGS)
@given(problem=neighborhood_problems(), seed=st.integers(0, 2**16))
def test_sweep_neighborhood_forward_fp64(problem, seed):
    check_forward(problem, torch.float64, seed)


@settings(max_examples=FORWARD_EXAMPLES, **SETTINGS)
@given(problem=window_problems(), seed=st.integers(0, 2**16))
def test_sweep_window_causal_padding_forward_fp64(problem, seed):
    check_forward(problem, torch.float64, seed)


@settings(max_examples=60, **SETTINGS)
@given(problem=neighborhood_problems(max_tokens=60, small=True), seed=st.integers(0, 2**16))
def test_sweep_neighborhood_grads_fp64(problem, seed):
    check_grads(problem, seed)


@settings(max_examples=60, **SETTINGS)
@given(problem=window_problems(max_s=10), seed=st.integers(0, 2**16))
def test_sweep_window_grads_fp64(problem, seed):
    check_grads(problem, seed)


def test_strategies_cover_the_space():
    """Guard against a sweep that silently degenerates (e.g. never draws 3-D or causal axes)."""
    from hypothesis import find

    find(
        neighborhood_problems(),
        lambda p: (
            isinstance(p.neighborhood["spatial_shape"], tuple)
            and len(p.neighborhood["spatial_shape"]) == 3
            and any(p.neighborhood["is_causal"])
            and max(p.neighborhood["dilation"]) > 1
            and max(p.neighborhood["stride"]) > 1
        ),
        settings=settings(max_examples=2000, database=None),
    )
    find(
        window_problems(),
        lambda p: p.window is not None and p.window[0] == -1 and p.seq_lens_q is not None and p.Hq != p.Hkv,
        settings=settings(max_examples=2000, database=None),
    )
