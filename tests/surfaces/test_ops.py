"""The libnatten-style op layer (cudnn_attn.ops) on CPU against float64 brute force.

The brute force is built here from tests/oracle.py: the fused op is checked against
``oracle.reference_attention`` with ``oracle.build_visibility``'s NATTEN mask (rpb as a dense bias
from the relative-offset formula), the unfused qk/av ops against a slot table made from
``oracle.na_axis_neighbors`` (slot ``t`` of an axis holds key ``window_start + t * dilation``; a slot
past a causal window's end is invalid). Every out-parameter starts as NaN, so an unwritten element
fails the comparison.
"""

import inspect
import itertools
import math

import numpy as np
import oracle
import pytest
import torch

from cudnn_attn import ops
from cudnn_attn.fallback_kernels import tile_shapes as tiles

B, H, D = 2, 2, 8

# name: (spatial, kernel, dilation, is_causal). The unfused ops take odd kernels (NATTEN 0.17);
# the fused op also takes even ones. rpb only on odd, non-causal cases.
CASES = {
    "1d": ((13,), (5,), (2,), (False,)),
    "1d-causal": ((11,), (5,), (2,), (True,)),
    "2d": ((7, 9), (3, 5), (2, 1), (False, False)),
    "2d-causal": ((6, 8), (5, 3), (1, 2), (False, True)),
    "3d": ((4, 5, 6), (3, 3, 3), (1, 1, 2), (False, False, False)),
    "3d-causal": ((5, 4, 6), (3, 3, 3), (1, 1, 2), (True, False, True)),
}
EVEN_CASES = {
    "1d-even-causal": ((11,), (4,), (2,), (True,)),
    "2d-even": ((6, 8), (4, 3), (1, 2), (False, True)),
    "3d-even": ((4, 5, 6), (2, 3, 4), (2, 1, 1), (False, False, False)),
}
ALL_CASES = {**CASES, **EVEN_CASES}
RPB_CASES = [name for name, (_, _, _, c) in CASES.items() if not any(c)]


def _with_rpb(names):
    cases = [(name, False) for name in sorted(names)] + [(name, True) for name in RPB_CASES]
    return pytest.mark.parametrize("case, with_rpb", cases,
                                   ids=[name + ("-rpb" if rpb else "") for name, rpb in cases])


def _op(rank, name):
    return getattr(ops, f"na{rank}d_{name}")


def _nan(*shape, dtype=torch.float64):
    return torch.full(shape, float("nan"), dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# Brute force
# ----------------------------------------------------------------------------------------------------


def slot_table(spatial, kernel, dilation, causal):
    """``keys`` [S, K] flat key index per (query, slot), ``valid`` [S, K], ``rel`` [S, K, rank]."""
    axes = []
    for L, k, d, c in zip(spatial, kernel, dilation, causal, strict=True):
        rows = []
        for i in range(L):
            nb = oracle.na_axis_neighbors(L, i, k, 1, d, c)
            rows.append([(nb[0] + t * d, t < len(nb)) for t in range(k)])
        axes.append(rows)
    keys, valid, rel = [], [], []
    for qc in itertools.product(*(range(L) for L in spatial)):
        for sc in itertools.product(*(range(k) for k in kernel)):
            cells = [axes[a][qc[a]][sc[a]] for a in range(len(spatial))]
            ok = all(v for _, v in cells)
            kc = [j if ok else 0 for j, _ in cells]
            keys.append(np.ravel_multi_index(kc, spatial))
            valid.append(ok)
            rel.append([(j - i) // d + k - 1 if ok else 0
                        for (j, _), i, d, k in zip(cells, qc, dilation, kernel, strict=True)])
    S, K = math.prod(spatial), math.prod(kernel)
    return (torch.tensor(keys).view(S, K), torch.tensor(valid).view(S, K),
            torch.tensor(rel).view(S, K, len(spatial)))


def brute_qk(q, k, rpb, geometry):
    """float64 [B, H, *sp, K] logits; invalid slots -inf. Differentiable."""
    spatial = q.shape[2:-1]
    keys, valid, rel = slot_table(spatial, *geometry)
    qf, kf = q.flatten(2, -2), k.flatten(2, -2)
    attn = (qf[:, :, :, None, :] * kf[:, :, keys]).sum(-1)
    if rpb is not None:
        attn = attn + rpb[(slice(None), *rel.unbind(-1))]
    attn = torch.where(valid, attn, torch.tensor(float("-inf"), dtype=attn.dtype))
    return attn.unflatten(2, spatial)


def brute_av(attn, v, geometry):
    spatial = v.shape[2:-1]
    keys, valid, _ = slot_table(spatial, *geometry)
    a = torch.where(valid, attn.flatten(2, -2), torch.zeros((), dtype=attn.dtype))
    return (a[..., None] * v.flatten(2, -2)[:, :, keys]).sum(-2).unflatten(2, spatial)


def brute_fused(q, k, v, rpb, geometry, scale):
    """Heads-last float64 reference from the oracle's dense NATTEN mask."""
    kernel, dilation, causal = geometry
    spatial = q.shape[1:-2]
    S = math.prod(spatial)
    vis = oracle.build_visibility(1, S, S, neighborhood=dict(
        spatial_shape=spatial, kernel_size=kernel, dilation=dilation, is_causal=causal))
    bias = None
    if rpb is not None:  # rpb index per axis: (j - i) / d + k - 1 on visible pairs
        coords = np.stack(np.unravel_index(np.arange(S), spatial), -1)
        idx = [(coords[None, :, a] - coords[:, None, a]) // dilation[a] + kernel[a] - 1
               for a in range(len(spatial))]
        idx = [torch.from_numpy(np.where(vis[0].numpy(), i, 0)) for i in idx]
        bias = rpb.double()[(slice(None), *idx)][None]
    flat = [t.double().flatten(1, -3) for t in (q, k, v)]
    out, _ = oracle.reference_attention(*flat, vis, layout="bshd", scale=scale, bias=bias)
    return out.unflatten(1, spatial)


def heads_first(case, seed, dv=D):
    spatial, kernel, dilation, causal = ALL_CASES[case]
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, *spatial, D, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(B, H, *spatial, dv, dtype=torch.float64, generator=g)
    return (kernel, dilation, causal), q, k, v, g


# ----------------------------------------------------------------------------------------------------
# The brute force itself agrees with the oracle's visibility
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_slot_table_matches_oracle_visibility(case):
    spatial, kernel, dilation, causal = ALL_CASES[case]
    keys, valid, _ = slot_table(spatial, kernel, dilation, causal)
    S = math.prod(spatial)
    vis = oracle.build_visibility(1, S, S, neighborhood=dict(
        spatial_shape=spatial, kernel_size=kernel, dilation=dilation, is_causal=causal))[0]
    for i in range(S):
        assert sorted(keys[i][valid[i]].tolist()) == torch.nonzero(vis[i]).flatten().tolist()


# ----------------------------------------------------------------------------------------------------
# Unfused ops vs brute force
# ----------------------------------------------------------------------------------------------------


@_with_rpb(CASES)
def test_qk_forward(case, with_rpb):
    geometry, q, k, _, g = heads_first(case, seed=1)
    rank = len(geometry[0])
    rpb = torch.randn(H, *(2 * x - 1 for x in geometry[0]), dtype=torch.float64, generator=g) \
        if with_rpb else None
    attn = _nan(*q.shape[:-1], math.prod(geometry[0]))
    assert _op(rank, "qk_forward")(attn, q, k, rpb, *geometry) is None
    torch.testing.assert_close(attn, brute_qk(q, k, rpb, geometry), atol=1e-12, rtol=1e-12)


@_with_rpb(CASES)
def test_qk_backward(case, with_rpb):
    geometry, q, k, _, g = heads_first(case, seed=2)
    rank = len(geometry[0])
    rpb = torch.randn(H, *(2 * x - 1 for x in geometry[0]), dtype=torch.float64, generator=g)
    d_attn = torch.randn(*q.shape[:-1], math.prod(geometry[0]), dtype=torch.float64, generator=g)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, rpb)]
    ref = brute_qk(inputs[0], inputs[1], inputs[2] if with_rpb else None, geometry)
    # Invalid slots are -inf constants: their d_attn must not reach q or k.
    ref_grads = torch.autograd.grad(ref, inputs if with_rpb else inputs[:2], d_attn)
    dq, dk = _nan(*q.shape), _nan(*k.shape)
    drpb = _nan(*rpb.shape) if with_rpb else None
    assert _op(rank, "qk_backward")(dq, dk, drpb, d_attn, q, k, *geometry) is None
    for got, want in zip((dq, dk, drpb)[:len(ref_grads)], ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_av_forward_ignores_invalid_slots(case):
    geometry, q, _, v, g = heads_first(case, seed=3, dv=5)
    rank = len(geometry[0])
    attn = torch.randn(*q.shape[:-1], math.prod(geometry[0]), dtype=torch.float64, generator=g)
    out = _nan(*v.shape)
    assert _op(rank, "av_forward")(out, attn, v, *geometry) is None
    torch.testing.assert_close(out, brute_av(attn, v, geometry), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("case", sorted(CASES))
def test_av_backward(case):
    geometry, q, _, v, g = heads_first(case, seed=4, dv=5)
    rank = len(geometry[0])
    attn = torch.randn(*q.shape[:-1], math.prod(geometry[0]), dtype=torch.float64, generator=g)
    d_out = torch.randn(*v.shape, dtype=torch.float64, generator=g)
    a, vv = attn.clone().requires_grad_(True), v.clone().requires_grad_(True)
    want_da, want_dv = torch.autograd.grad(brute_av(a, vv, geometry), (a, vv), d_out)
    d_attn, d_value = _nan(*attn.shape), _nan(*v.shape)
    assert _op(rank, "av_backward")(d_attn, d_value, d_out, attn, v, *geometry) is None
    torch.testing.assert_close(d_attn, want_da, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(d_value, want_dv, atol=1e-12, rtol=1e-12)
    _, valid, _ = slot_table(v.shape[2:-1], *geometry)
    assert (d_attn.flatten(2, -2)[..., ~valid] == 0).all()


def test_qk_then_av_is_neighborhood_attention():
    """softmax(qk * scale) then av equals the oracle's masked attention (float64, 2-D causal)."""
    geometry, q, k, v, _ = heads_first("2d-causal", seed=5)
    attn = _nan(*q.shape[:-1], math.prod(geometry[0]))
    ops.na2d_qk_forward(attn, q * D ** -0.5, k, None, *geometry)
    out = _nan(*v.shape)
    ops.na2d_av_forward(out, attn.softmax(-1), v, *geometry)
    want = brute_fused(*(t.movedim(1, -2) for t in (q, k, v)), None, geometry, D ** -0.5)
    torch.testing.assert_close(out.movedim(1, -2), want, atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------------------------------
# Fused op vs the oracle
# ----------------------------------------------------------------------------------------------------


@_with_rpb(ALL_CASES)
def test_fused_forward(case, with_rpb):
    geometry, q, k, v, g = heads_first(case, seed=6, dv=5)
    rank = len(geometry[0])
    q, k, v = (t.movedim(1, -2).float() for t in (q, k, v))  # heads-last, a fused dtype
    rpb = torch.randn(H, *(2 * x - 1 for x in geometry[0]), generator=g) if with_rpb else None
    scale = 0.3
    tile = tiles.valid_tile_sizes(rank, D, torch.float32)[-1]
    out = _nan(*v.shape, dtype=torch.float32)
    assert _op(rank, "forward")(out, q, k, v, rpb, *geometry, scale, *tile) is None
    torch.testing.assert_close(out.double(), brute_fused(q, k, v, rpb, geometry, scale),
                               atol=2e-6, rtol=2e-6)


def test_fused_forward_gqa_default_scale_and_int_shorthand():
    spatial, kernel = (10, 7), 3
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, *spatial, 4, 16, generator=g)
    k = torch.randn(1, *spatial, 2, 16, generator=g)
    v = torch.randn(1, *spatial, 2, 24, generator=g)
    out = _nan(1, *spatial, 4, 24, dtype=torch.float32)
    ops.na2d_forward(out, q, k, v, None, kernel, 2, False, None, 8, 8)  # tiles (8, 8) x (8, 8)
    kk, vv = (t.repeat_interleave(2, dim=-2) for t in (k, v))
    want = brute_fused(q, kk, vv, None, ((3, 3), (2, 2), (False, False)), 16 ** -0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)


# ----------------------------------------------------------------------------------------------------
# Tile sizes
# ----------------------------------------------------------------------------------------------------


def test_valid_tile_sizes_is_reexported():
    assert ops.valid_tile_sizes is tiles.valid_tile_sizes


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_valid_tile_sizes_content(rank):
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        pairs = ops.valid_tile_sizes(rank, 128, dtype)
        assert pairs and len(set(pairs)) == len(pairs)
        for q_tile, k_tile in pairs:
            assert len(q_tile) == len(k_tile) == rank
            assert math.prod(q_tile) == tiles.FUSED_QUERY_TILE and math.prod(k_tile) == tiles.FUSED_KEY_TILE
        # every power-of-two box of the tile volume is there
        n_boxes = math.comb(int(math.log2(tiles.FUSED_QUERY_TILE)) + rank - 1, rank - 1)
        assert len(pairs) == n_boxes * math.comb(int(math.log2(tiles.FUSED_KEY_TILE)) + rank - 1, rank - 1)
    assert ops.valid_tile_sizes(rank, 64, torch.float64) == []
    assert ops.valid_tile_sizes(rank, 129, torch.float16) == []


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_every_valid_tile_pair_is_accepted(rank):
    spatial = {1: (40,), 2: (11, 9), 3: (6, 5, 4)}[rank]
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, *spatial, 1, 8, generator=g) for _ in range(3))
    want = brute_fused(q, k, v, None, ((3,) * rank, (1,) * rank, (False,) * rank), 0.5)
    pairs = ops.valid_tile_sizes(rank, 8, torch.float32)
    for q_tile, k_tile in pairs[::max(1, len(pairs) // 8)] + pairs[-1:]:
        out = _nan(*q.shape, dtype=torch.float32)
        _op(rank, "forward")(out, q, k, v, None, 3, 1, False, 0.5, q_tile, k_tile)
        torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("q_tile, k_tile", [((32, 4), (8, 8)), ((64, 1), (64, 64)), (64, 64),
                                            ((16, 2), (4, 16)), (16, 4)])
def test_invalid_tile_pair_lists_the_valid_ones(q_tile, k_tile):
    q = torch.randn(1, 9, 9, 1, 8)
    out = _nan(*q.shape, dtype=torch.float32)
    with pytest.raises(ValueError, match="tile") as info:
        ops.na2d_forward(out, q, q, q, None, 3, 1, False, 1.0, q_tile, k_tile)
    for pair in ops.valid_tile_sizes(2, 8, torch.float32):
        assert str(pair) in str(info.value)
    assert out.isnan().all()  # rejected before anything ran


def test_tiles_none_for_head_dim_above_128():
    q = torch.randn(1, 9, 1, 136)
    with pytest.raises(ValueError, match="tile"):
        ops.na1d_forward(torch.empty_like(q), q, q, q, None, 3, 1, False, 1.0, 64, 64)
    with pytest.raises(ValueError, match="tile"):
        ops.na1d_forward(torch.empty_like(q), q, q, q, None, 3, 1, False, 1.0, None, None)


# ----------------------------------------------------------------------------------------------------
# Signatures and argument errors
# ----------------------------------------------------------------------------------------------------

SIGNATURES = {
    "forward": "output query key value rpb kernel_size dilation is_causal attn_scale query_tile_size "
               "key_tile_size",
    "qk_forward": "attn query key rpb kernel_size dilation is_causal",
    "qk_backward": "d_query d_key d_rpb d_attn query key kernel_size dilation is_causal",
    "av_forward": "output attn value kernel_size dilation is_causal",
    "av_backward": "d_attn d_value d_out attn value kernel_size dilation is_causal",
}


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures(name, rank):
    fn = _op(rank, name)
    assert fn.__name__ == f"na{rank}d_{name}" and fn.__doc__
    assert list(inspect.signature(fn).parameters) == SIGNATURES[name].split()
    assert fn.__name__ in ops.__all__


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_wrong_argument_counts_name_the_public_op(name, rank):
    """The rank wrappers check the call against the public signature (``rank`` is not one of its
    parameters), so the error names ``na{rank}d_<op>`` and never counts the hidden ``rank``."""
    fn = _op(rank, name)
    params = SIGNATURES[name].split()
    with pytest.raises(TypeError, match=rf"^na{rank}d_{name}\(\): missing a required argument: "
                                        rf"'{params[-1]}'"):
        fn(*([None] * (len(params) - 1)))
    with pytest.raises(TypeError, match=rf"^na{rank}d_{name}\(\): too many positional"):
        fn(*([None] * (len(params) + 1)))
    with pytest.raises(TypeError, match=rf"^na{rank}d_{name}\(\): .*'rank'"):
        fn(*([None] * len(params)), rank=rank)


def _fused_args(**over):
    q = torch.randn(1, 9, 8, 2, 8)
    args = dict(output=torch.empty_like(q), query=q, key=q.clone(), value=q.clone(), rpb=None,
                kernel_size=(3, 3), dilation=(1, 1), is_causal=(False, False), attn_scale=0.5,
                query_tile_size=(8, 8), key_tile_size=(8, 8))
    args.update(over)
    return args


FUSED_ERRORS = [
    (dict(output=torch.empty(1, 9, 8, 2, 7)), ValueError, "output"),
    (dict(output=torch.empty(1, 9, 8, 2, 8, dtype=torch.float16)), TypeError, "output"),
    (dict(output=torch.empty(1, 9, 8, 2, 8, device="meta")), ValueError, "output"),
    (dict(key=torch.randn(1, 9, 7, 2, 8)), ValueError, "key"),
    (dict(value=torch.randn(1, 9, 8, 2)), ValueError, "value"),
    (dict(query=torch.randn(1, 9, 8, 2, 8, dtype=torch.float64)), TypeError, "query"),
    (dict(query="q"), TypeError, "query"),
    (dict(key=torch.randn(1, 9, 8, 3, 8), value=torch.randn(1, 9, 8, 3, 8)), ValueError, "heads"),
    (dict(kernel_size=(3, 11)), ValueError, "kernel_size"),
    (dict(kernel_size=(3, 3, 3)), ValueError, "kernel_size"),
    (dict(dilation=(4, 1)), ValueError, "kernel_size"),
    (dict(is_causal=(True, "no")), TypeError, "is_causal"),
    (dict(rpb=torch.randn(2, 5, 4)), ValueError, "rpb"),
    (dict(rpb=torch.randn(2, 5, 5), is_causal=(True, False)), ValueError, "rpb"),
    (dict(rpb=torch.randn(2, 7, 5), kernel_size=(4, 3)), ValueError, "rpb"),
    (dict(attn_scale="big"), TypeError, "attn_scale"),
    (dict(query_tile_size=(8, 8, 1)), ValueError, "query_tile_size"),
]


@pytest.mark.parametrize("over, exc, word", FUSED_ERRORS, ids=[w + str(i) for i, (_, _, w) in
                                                                enumerate(FUSED_ERRORS)])
def test_fused_argument_errors(over, exc, word):
    with pytest.raises(exc, match=word):
        ops.na2d_forward(**_fused_args(**over))


UNFUSED_ERRORS = [
    ("qk_forward", dict(attn=torch.empty(2, 2, 9, 8)), ValueError, "attn"),
    ("qk_forward", dict(attn=torch.empty(2, 2, 9, 9, dtype=torch.float32)), TypeError, "attn"),
    ("qk_forward", dict(key=torch.randn(2, 2, 9, 4)), ValueError, "key"),
    ("qk_forward", dict(query=torch.randn(2, 2, 9, 5, 1)), ValueError, "query"),
    ("qk_forward", dict(query=torch.randn(2, 2, 9, 5).int()), TypeError, "query"),
    ("qk_forward", dict(rpb=torch.randn(2, 5)), ValueError, "rpb"),
    ("qk_forward", dict(kernel_size=(3, 3)), ValueError, "kernel_size"),
    ("qk_forward", dict(kernel_size=4, attn=torch.randn(2, 2, 9, 4)), ValueError, "odd"),
    ("av_forward", dict(kernel_size=4, attn=torch.randn(2, 2, 9, 4)), ValueError, "odd"),
    ("qk_backward", dict(d_rpb=torch.randn(3, 5, 5)), ValueError, "d_rpb"),
    ("qk_backward", dict(d_query=torch.randn(2, 2, 9, 5, dtype=torch.float32)), TypeError, "d_query"),
    ("qk_backward", dict(d_key=torch.randn(2, 2, 9, 4)), ValueError, "d_key"),
    ("qk_backward", dict(d_attn=torch.randn(2, 2, 9, 8)), ValueError, "d_attn"),
    ("av_forward", dict(output=torch.randn(2, 2, 9, 4)), ValueError, "output"),
    ("av_forward", dict(attn=torch.randn(2, 2, 9, 9, dtype=torch.float32)), TypeError, "attn"),
    ("av_forward", dict(value="v"), TypeError, "value"),
    ("av_backward", dict(d_out=torch.randn(2, 2, 9, 3)), ValueError, "d_out"),
    ("av_backward", dict(d_attn=torch.randn(2, 2, 9, 9, dtype=torch.float16)), TypeError, "d_attn"),
    ("av_backward", dict(d_value=torch.randn(2, 2, 8, 5)), ValueError, "d_value"),
    ("av_backward", dict(dilation=2), ValueError, "kernel_size"),
]


def _unfused_args(name, **over):
    q = torch.randn(2, 2, 9, 5, dtype=torch.float64)  # 1-D heads-first, L=9, kernel 9
    attn = torch.randn(2, 2, 9, 9, dtype=torch.float64)
    base = dict(kernel_size=9, dilation=1, is_causal=False)
    tensors = {
        "qk_forward": dict(attn=attn, query=q, key=q.clone(), rpb=None),
        "qk_backward": dict(d_query=torch.empty_like(q), d_key=torch.empty_like(q),
                            d_rpb=torch.empty(2, 17, dtype=torch.float64), d_attn=attn, query=q,
                            key=q.clone()),
        "av_forward": dict(output=torch.empty_like(q), attn=attn, value=q),
        "av_backward": dict(d_attn=torch.empty_like(attn), d_value=torch.empty_like(q),
                            d_out=q.clone(), attn=attn, value=q),
    }[name]
    return {**tensors, **base, **over}


@pytest.mark.parametrize("name, over, exc, word", UNFUSED_ERRORS,
                         ids=[f"{n}-{w}{i}" for i, (n, _, _, w) in enumerate(UNFUSED_ERRORS)])
def test_unfused_argument_errors(name, over, exc, word):
    args = _unfused_args(name, **over)
    with pytest.raises(exc, match=word):
        _op(1, name)(**args)
    clean = _unfused_args(name)
    assert _op(1, name)(**clean) is None  # the same call without the fault runs


# ----------------------------------------------------------------------------------------------------
# The CUDA branch's hand-off to the kernel modules (stand-ins on CPU: argument forms and write-back)
# ----------------------------------------------------------------------------------------------------


class _KernelStandIn:
    """Records calls in the kernel modules' documented signatures; computes with the brute force."""

    def __init__(self):
        self.calls = []

    def _geometry(self, name, kernel_size, dilation, is_causal):
        for value in (kernel_size, dilation, is_causal):
            assert isinstance(value, tuple), (name, value)  # normalised, rank-sized
        self.calls.append(name)
        return kernel_size, dilation, is_causal

    def qk_forward(self, query, key, rpb, kernel_size, dilation, is_causal, attn=None):
        attn_new = brute_qk(query, key, rpb, self._geometry("qk_forward", kernel_size, dilation,
                                                            is_causal))
        return attn_new if attn is None else attn.copy_(attn_new)

    def qk_backward(self, d_attn, query, key, kernel_size, dilation, is_causal, need_rpb_grad):
        geometry = self._geometry("qk_backward", kernel_size, dilation, is_causal)
        q, k = query.clone().requires_grad_(True), key.clone().requires_grad_(True)
        rpb = torch.zeros(query.shape[1], *(2 * x - 1 for x in kernel_size), dtype=query.dtype,
                          requires_grad=True)
        grads = torch.autograd.grad(brute_qk(q, k, rpb if need_rpb_grad else None, geometry),
                                    [q, k] + [rpb] * need_rpb_grad, d_attn)
        return grads[0], grads[1], grads[2].float() if need_rpb_grad else None  # drpb in fp32

    def av_forward(self, attn, value, kernel_size, dilation, is_causal, out=None):
        return brute_av(attn, value, self._geometry("av_forward", kernel_size, dilation, is_causal))

    def av_backward(self, d_out, attn, value, kernel_size, dilation, is_causal):
        geometry = self._geometry("av_backward", kernel_size, dilation, is_causal)
        a, v = attn.clone().requires_grad_(True), value.clone().requires_grad_(True)
        return torch.autograd.grad(brute_av(a, v, geometry), (a, v), d_out)


@pytest.fixture
def kernel_stand_in(monkeypatch):
    import cudnn_attn.fallback_kernels as package
    from cudnn_attn.fallback_kernels.backend import CupyUnfusedOps

    stand_in = _KernelStandIn()
    monkeypatch.setattr(CupyUnfusedOps, "supports", lambda self, problem: [])
    for name in ("fused", "unfused"):
        monkeypatch.setitem(__import__("sys").modules, f"cudnn_attn.fallback_kernels.{name}", stand_in)
        monkeypatch.setattr(package, name, stand_in, raising=False)
    return stand_in


def test_kernel_branch_hand_off(kernel_stand_in):
    geometry, q, k, v, g = heads_first("2d", seed=9)
    kernel, dilation, _ = geometry
    rpb = torch.randn(H, *(2 * x - 1 for x in kernel), dtype=torch.float64, generator=g)
    attn = _nan(*q.shape[:-1], math.prod(kernel))
    ops.na2d_qk_forward(attn, q, k, rpb, list(kernel), dilation, False)
    torch.testing.assert_close(attn, brute_qk(q, k, rpb, geometry))
    dq, dk, drpb = _nan(*q.shape), _nan(*k.shape), _nan(*rpb.shape)
    ops.na2d_qk_backward(dq, dk, drpb, attn.tanh(), q, k, kernel, dilation, False)
    assert not any(t.isnan().any() for t in (dq, dk, drpb))
    out, d_attn, d_value = _nan(*v.shape), _nan(*attn.shape), _nan(*v.shape)
    ops.na2d_av_forward(out, attn.softmax(-1), v, kernel, dilation, False)
    ops.na2d_av_backward(d_attn, d_value, v, attn.softmax(-1), v, kernel, dilation, False)
    assert not any(t.isnan().any() for t in (out, d_attn, d_value))
    hl = [t.movedim(1, -2).float() for t in (q, k, v)]
    fused_out = _nan(*hl[2].shape[:-1], 2 * D, dtype=torch.float32)[..., ::2]  # strided last dim
    ops.na2d_forward(fused_out, *hl, None, kernel, dilation, False, 0.5, 8, 8)
    torch.testing.assert_close(fused_out.double(), brute_fused(*hl, None, geometry, 0.5),
                               atol=2e-6, rtol=2e-6)
    # The unfused ops reached the CuPy engine's launchers; the fused op is one attention() call
    # that dispatch gives to an engine (here the torch engine: the stand-in has no fused path).
    assert kernel_stand_in.calls == ["qk_forward", "qk_backward", "av_forward", "av_backward"]
