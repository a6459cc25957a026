"""Golden neighborhood checks (reference/neighborhood-attention.md, section 1.6).

* Every golden 1-D neighbor set, checked on the oracle and on the library (q = k = 0 so attention is
  uniform over the visible keys, v = one-hot(key index) so `out[i]` reveals the neighbor set of query i).
* Exhaustive properties of the oracle's rule (window sizes, causal end, dilation residue classes, the
  equivalent Flex clamp form) and the library's neighbor sets for a few 2-D / 3-D configs.
* The published numeric anchors (out, lse) for the fp32 recipe, NATTEN heads-last layout.
"""

import oracle
import pytest
import torch
from common import ca

R = lambda a, b: list(range(a, b + 1))

# (L, k, s, d, causal) -> neighbor set per query, transcribed verbatim from section 1.6.
GOLDEN = {
    (8, 3, 1, 1, False): [
        [0, 1, 2],
        [0, 1, 2],
        [1, 2, 3],
        [2, 3, 4],
        [3, 4, 5],
        [4, 5, 6],
        [5, 6, 7],
        [5, 6, 7],
    ],
    (8, 4, 1, 1, False): [R(0, 3), R(0, 3), R(0, 3), R(1, 4), R(2, 5), R(3, 6), R(4, 7), R(4, 7)],
    (8, 5, 1, 1, False): [R(0, 4)] * 3 + [R(1, 5), R(2, 6)] + [R(3, 7)] * 3,
    (10, 3, 1, 3, False): [
        [0, 3, 6],
        [1, 4, 7],
        [2, 5, 8],
        [0, 3, 6],
        [1, 4, 7],
        [2, 5, 8],
        [3, 6, 9],
        [1, 4, 7],
        [2, 5, 8],
        [3, 6, 9],
    ],
    (8, 3, 2, 1, False): [[0, 1, 2]] * 2 + [[2, 3, 4]] * 2 + [[4, 5, 6]] * 2 + [[5, 6, 7]] * 2,
    (8, 4, 4, 1, False): [R(0, 3)] * 4 + [R(4, 7)] * 4,
    (9, 3, 3, 1, False): [R(0, 2)] * 3 + [R(3, 5)] * 3 + [R(6, 8)] * 3,
    (8, 3, 1, 1, True): [[0], [0, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4], [3, 4, 5], [4, 5, 6], [5, 6, 7]],
    (8, 3, 2, 1, True): [[0], [0, 1], [1, 2], [1, 2, 3], [3, 4], [3, 4, 5], [5, 6], [5, 6, 7]],
    (10, 3, 1, 3, True): [[0], [1], [2], [0, 3], [1, 4], [2, 5], [0, 3, 6], [1, 4, 7], [2, 5, 8], [3, 6, 9]],
}


def _gid(key):
    L, k, s, d, c = key
    return f"L{L}-k{k}-s{s}-d{d}" + ("-causal" if c else "")


GOLDEN_PARAMS = [pytest.param(key, sets, id=_gid(key)) for key, sets in GOLDEN.items()]


def library_neighbor_sets(spatial_shape, kernel_size, stride=1, dilation=1, is_causal=False):
    """Neighbor sets as seen by cudnn_attn.attention: q = k = 0, v = one-hot(key), fp64."""
    lib = ca()
    shape = spatial_shape if isinstance(spatial_shape, tuple) else (spatial_shape,)
    S = 1
    for x in shape:
        S *= x
    q = torch.zeros(1, 1, S, 8, dtype=torch.float64)
    k = torch.zeros(1, 1, S, 8, dtype=torch.float64)
    v = torch.eye(S, dtype=torch.float64).reshape(1, 1, S, S)
    mask = lib.Neighborhood(spatial_shape, kernel_size, stride=stride, dilation=dilation, is_causal=is_causal)
    out = lib.attention(q, k, v, mask=mask, backend="torch")[0, 0]
    sets = []
    for i in range(S):
        row = out[i]
        nz = torch.nonzero(row > 1e-12).flatten().tolist()
        # uniform weights over exactly the visible keys, zero elsewhere
        torch.testing.assert_close(row[nz], torch.full((len(nz),), 1.0 / len(nz), dtype=torch.float64))
        assert float(row.abs().sum()) == pytest.approx(1.0, abs=1e-12)
        sets.append(nz)
    return sets


@pytest.mark.parametrize("key,golden", GOLDEN_PARAMS)
def test_oracle_matches_golden(key, golden):
    L, k, s, d, c = key
    assert [oracle.na_axis_neighbors(L, i, k, s, d, c) for i in range(L)] == golden
    assert [list(map(int, x)) for x in oracle.neighbor_sets(L, k, s, d, c)] == golden


@pytest.mark.parametrize("key,golden", GOLDEN_PARAMS)
def test_library_matches_golden(key, golden):
    L, k, s, d, c = key
    assert library_neighbor_sets(L, k, s, d, c) == golden


def test_oracle_rule_properties_exhaustive():
    """Section 1.6 properties of the rule, exhaustively for L < 18."""
    for L in range(2, 18):
        for k in range(2, L + 1):
            for d in range(1, L // k + 1):
                for s in range(1, k + 1):
                    for i in range(L):
                        n = oracle.na_axis_neighbors(L, i, k, s, d, False)
                        assert len(n) == k
                        assert all(j % d == i % d for j in n)
                        assert n == oracle.na_axis_neighbors_clamp_form(L, i, k, s, d)
                        if s == 1:
                            assert i in n
                        nc = oracle.na_axis_neighbors(L, i, k, s, d, True)
                        assert max(nc) == i
                        assert all(j % d == i % d for j in nc)
                        if s == 1:
                            assert len(nc) == min(k, i // d + 1)


ND_CONFIGS = [
    pytest.param({"spatial_shape": (4, 5), "kernel_size": (2, 3)}, id="2d-even-k"),
    pytest.param(
        {
            "spatial_shape": (5, 7),
            "kernel_size": (3, 2),
            "stride": (2, 1),
            "dilation": (1, 3),
            "is_causal": (True, False),
        },
        id="2d-stride-dil-causal0",
    ),
    pytest.param(
        {
            "spatial_shape": (7, 4),
            "kernel_size": (3, 4),
            "stride": (3, 2),
            "dilation": (2, 1),
            "is_causal": (False, True),
        },
        id="2d-stride-dil-causal1",
    ),
    pytest.param(
        {
            "spatial_shape": (3, 4, 5),
            "kernel_size": (2, 3, 2),
            "stride": (1, 3, 2),
            "dilation": (1, 1, 2),
            "is_causal": (False, True, True),
        },
        id="3d-mixed",
    ),
    pytest.param({"spatial_shape": (4, 3, 6), "kernel_size": 2, "dilation": (2, 1, 3)}, id="3d-dilation"),
]


@pytest.mark.parametrize("cfg", ND_CONFIGS)
def test_library_nd_neighbor_sets_match_oracle(cfg):
    expected = [list(map(int, x)) for x in oracle.neighbor_sets(**cfg)]
    assert library_neighbor_sets(**cfg) == expected


# Numeric anchors: fp32, B=1, H=1, L=8, D=8, heads-last [B, L, H, D].
ANCHORS = [
    pytest.param(
        {"kernel_size": 3},
        [0.780141, 0.680639, 0.988809, 1.331538, 1.446389, 1.357484, 1.233786, 1.171496],
        [1.667541, 2.891932, 2.090779, 0.948765, 1.950970, 3.396440, 3.200493, 1.862507],
        id="k3",
    ),
    pytest.param(
        {"kernel_size": 4},
        [0.852503, 0.697210, 0.699721, 1.128291, 1.420964, 1.363243, 1.291824, 1.246483],
        None,
        id="k4",
    ),
    pytest.param(
        {"kernel_size": 3, "stride": 2, "dilation": 2},
        [0.812777, 0.934103, 0.601962, 1.070252, 1.318762, 1.300782, 1.310209, 1.230148],
        None,
        id="k3-s2-d2",
    ),
    pytest.param(
        {"kernel_size": 3, "is_causal": True},
        [0.500000, 0.628553, 0.683420, 1.088248, 1.427925, 1.442165, 1.353591, 1.171496],
        [0.881740, 2.799310, 2.963813, 1.461992, 1.600757, 3.125964, 3.320046, 1.862507],
        id="k3-causal",
    ),
]


def _anchor_inputs():
    x = torch.arange(64, dtype=torch.float32).reshape(1, 8, 1, 8)
    return torch.sin(0.1 * x), torch.cos(0.07 * x), torch.sin(0.05 * x) + 0.5


@pytest.mark.parametrize("params,exp_out,exp_lse", ANCHORS)
def test_numeric_anchor_library(params, exp_out, exp_lse):
    lib = ca()
    q, k, v = _anchor_inputs()
    out, lse = lib.attention(q, k, v, mask=lib.Neighborhood(8, **params), layout="bshd", return_lse=True)
    assert out.shape == (1, 8, 1, 8) and lse.shape == (1, 1, 8)
    torch.testing.assert_close(out[0, :, 0, 0], torch.tensor(exp_out), atol=1e-5, rtol=0)
    if exp_lse is not None:
        torch.testing.assert_close(lse[0, 0, :], torch.tensor(exp_lse), atol=1e-5, rtol=0)


@pytest.mark.parametrize("params,exp_out,exp_lse", ANCHORS)
def test_numeric_anchor_oracle(params, exp_out, exp_lse):
    q, k, v = _anchor_inputs()
    nb = dict(spatial_shape=8, **params)
    vis = oracle.build_visibility(1, 8, 8, neighborhood=nb)
    out, lse = oracle.reference_attention(q, k, v, vis, layout="bshd")
    torch.testing.assert_close(out[0, :, 0, 0], torch.tensor(exp_out, dtype=torch.float64), atol=1e-5, rtol=0)
    if exp_lse is not None:
        torch.testing.assert_close(
            lse[0, 0, :], torch.tensor(exp_lse, dtype=torch.float64), atol=1e-5, rtol=0
        )
