"""Peer check against NATTEN 0.21.7 itself (`natten.na{1,2,3}d(..., backend="flex-fna")`, CPU fp32).

Random heads-last q/k/v; cudnn_attn.attention(layout="bshd", mask=Neighborhood(...)) must match NATTEN's
out and lse to 1e-5. Configs: shrunk versions of NATTEN's own test grids (test_fna.py / test_flex.py)
over causal combinations, plus seeded random problems drawn like NATTEN's random sweep (smaller).
NATTEN's CPU path: fp32 only, head_dim a power of two >= 8, forward only, D_v == D.
"""

import importlib
import math
import random
import warnings

import pytest
import torch
from common import ca

natten = pytest.importorskip("natten")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

# (batch, heads, heads_kv, head_dim, input_shape, kernel_size, stride, dilation), shrunk from NATTEN's grids
GRID = [
    (1, 2, 1, 8, (128,), (3,), (2,), (5,)),
    (1, 1, 1, 16, (128,), (8,), (7,), (5,)),
    (1, 2, 2, 8, (125,), (15,), (1,), (1,)),
    (2, 4, 2, 16, (64,), (31,), (15,), (1,)),
    (1, 1, 1, 32, (128,), (3,), (2,), (10,)),
    (1, 1, 1, 8, (28, 23), (7, 20), (1, 6), (4, 1)),
    (1, 4, 2, 32, (5, 25), (5, 16), (1, 16), (1, 1)),
    (1, 1, 1, 16, (19, 29), (8, 8), (1, 1), (2, 3)),
    (1, 1, 1, 16, (16, 16), (3, 3), (1, 1), (1, 1)),
    (2, 4, 2, 16, (16, 32), (7, 9), (3, 4), (2, 3)),
    (1, 1, 1, 8, (13, 11, 9), (3, 4, 3), (2, 3, 3), (3, 2, 2)),
    (1, 4, 1, 16, (8, 8, 16), (3, 3, 3), (2, 1, 2), (2, 2, 4)),
    (1, 2, 1, 16, (8, 8, 12), (5, 8, 11), (2, 3, 4), (1, 1, 1)),
    (1, 1, 1, 16, (8, 4, 8), (7, 3, 7), (1, 1, 1), (1, 1, 1)),
]


def _causal_combos(rank, idx):
    """1-D: both; 2-D/3-D: non-causal plus one causal pattern (alternating all-causal / mixed)."""
    if rank == 1:
        return [(False,), (True,)]
    mixed = tuple(bool((a + idx) % 2) for a in range(rank))
    return [(False,) * rank, (True,) * rank if idx % 2 else mixed]


def _cid(cfg, causal):
    B, H, Hkv, D, shape, k, s, d = cfg
    j = lambda t: "x".join(map(str, t))
    c = "".join("T" if x else "F" for x in causal)
    return f"B{B}-H{H}-{Hkv}-D{D}-L{j(shape)}-k{j(k)}-s{j(s)}-d{j(d)}-c{c}"


GRID_PARAMS = [
    pytest.param(cfg, c, id=_cid(cfg, c))
    for i, cfg in enumerate(GRID)
    for c in _causal_combos(len(cfg[4]), i)
]


def _random_configs(n, seed0=1000):
    """NATTEN's `_test_randsweep_against_reference` recipe, shrunk for a CPU run."""
    out = []
    for i in range(n):
        rng = random.Random(seed0 + i)
        rank = rng.choice([1, 2, 3])
        max_size = {1: 96, 2: 20, 3: 9}[rank]
        shape = [rng.randint(4, max_size) for _ in range(rank)]
        ks = [rng.randint(2, x) for x in shape]
        ss = [rng.randint(1, k) for k in ks]
        ds = [rng.randint(1, x // k) for x, k in zip(shape, ks)]
        cs = [rng.choice([False, True]) for _ in range(rank)]
        if rank == 1 and cs[0] and ks[0] == shape[0]:
            ks[0] -= 1  # NATTEN routes 1-D causal k == L to causal FMHA, which flex cannot run
            ss[0] = min(ss[0], ks[0])
        heads = rng.randint(1, 3)
        heads_kv = rng.choice([h for h in range(1, heads + 1) if heads % h == 0])
        head_dim = rng.choice([8, 16, 32])
        batch = rng.randint(1, 2)
        out.append(
            ((batch, heads, heads_kv, head_dim, tuple(shape), tuple(ks), tuple(ss), tuple(ds)), tuple(cs))
        )
    return out


RANDOM_PARAMS = [
    pytest.param(cfg, c, id="rand" + str(i) + "-" + _cid(cfg, c))
    for i, (cfg, c) in enumerate(_random_configs(12))
]


def _natten_fn(rank):
    return {1: natten.na1d, 2: natten.na2d, 3: natten.na3d}[rank]


def _compare(cfg, causal, seed):
    B, H, Hkv, D, shape, k, s, d = cfg
    rank = len(shape)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, *shape, H, D, generator=g)
    kk = torch.randn(B, *shape, Hkv, D, generator=g)
    v = torch.randn(B, *shape, Hkv, D, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_out, ref_lse = _natten_fn(rank)(
            q,
            kk,
            v,
            kernel_size=k,
            stride=s,
            dilation=d,
            is_causal=causal,
            backend="flex-fna",
            return_lse=True,
        )
    S = math.prod(shape)
    lib = ca()
    mask = lib.Neighborhood(shape, k, stride=s, dilation=d, is_causal=causal)
    out, lse = lib.attention(
        q.reshape(B, S, H, D),
        kk.reshape(B, S, Hkv, D),
        v.reshape(B, S, Hkv, D),
        mask=mask,
        layout="bshd",
        return_lse=True,
    )
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out.reshape(B, S, H, D), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.reshape(B, S, H).transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg,causal", GRID_PARAMS)
def test_natten_grid(cfg, causal):
    _compare(cfg, causal, seed=len(GRID_PARAMS))


@pytest.mark.parametrize("cfg,causal", RANDOM_PARAMS)
def test_natten_random(cfg, causal):
    _compare(cfg, causal, seed=7)


def test_natten_agrees_with_oracle_on_a_small_case():
    """Sanity of the peer harness itself: NATTEN vs the independent oracle (no cudnn_attn involved)."""
    import oracle

    shape, k, s, d, c = (6, 7), (3, 4), (2, 1), (2, 1), (True, False)
    g = torch.Generator().manual_seed(3)
    q, kk, v = (torch.randn(1, *shape, 2, 8, generator=g) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_out, ref_lse = natten.na2d(
            q, kk, v, kernel_size=k, stride=s, dilation=d, is_causal=c, backend="flex-fna", return_lse=True
        )
    vis = oracle.build_visibility(
        1,
        42,
        42,
        neighborhood={"spatial_shape": shape, "kernel_size": k, "stride": s, "dilation": d, "is_causal": c},
    )
    o, lse = oracle.reference_attention(
        q.reshape(1, 42, 2, 8), kk.reshape(1, 42, 2, 8), v.reshape(1, 42, 2, 8), vis, layout="bshd"
    )
    torch.testing.assert_close(o.float(), ref_out.reshape(1, 42, 2, 8), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.float(), ref_lse.reshape(1, 42, 2).transpose(1, 2), atol=1e-5, rtol=1e-5)


# Arguments of the wrong kind: the error type NATTEN 0.21.7 itself raises on this CPU (its flex
# backend), beside ours. The natten.attention cases are left out: on the CPU NATTEN finds no FMHA
# backend for any call, so its answer there says nothing about the argument.
_Q = (1, 8, 2, 16)
WRONG_KIND = {
    "kernel_size-float": lambda m, q: m.na1d(q, q, q, kernel_size=3.0),
    "kernel_size-float-2d": lambda m, q: m.na2d(*(torch.randn(1, 6, 6, 2, 16),) * 3,
                                               kernel_size=(3.0, 3)),
    "stride-float": lambda m, q: m.na1d(q, q, q, kernel_size=3, stride=1.0),
    "dilation-float": lambda m, q: m.na1d(q, q, q, kernel_size=3, dilation=1.0),
    "is_causal-str": lambda m, q: m.na1d(q, q, q, kernel_size=3, is_causal="yes"),
    "dtype-mix": lambda m, q: m.na1d(q, q.double(), q, kernel_size=3),
    "int-tensors": lambda m, q: m.na1d(q.int(), q.int(), q.int(), kernel_size=3),
    "q_tile_shape-alone": lambda m, q: m.na1d(q, q, q, kernel_size=3, q_tile_shape=(4,)),
    "kv_tile_shape-alone": lambda m, q: m.na1d(q, q, q, kernel_size=3, kv_tile_shape=(4,)),
}


def _raised(call, module):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call(module, torch.randn(*_Q))
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return e
    return None


@pytest.mark.parametrize("name", list(WRONG_KIND))
def test_wrong_kinds_raise_natten_error_types(name):
    theirs = _raised(WRONG_KIND[name], natten)
    ours = _raised(WRONG_KIND[name], importlib.import_module("cudnn_attn.natten"))
    assert theirs is not None, "NATTEN accepted it: the case no longer probes anything"
    assert ours is not None, "accepted here"
    assert isinstance(ours, type(theirs)), f"NATTEN: {theirs!r}; ours: {ours!r}"
