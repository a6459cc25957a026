"""CPU checks of the CuPy backend: supports() reasons, geometry tables, and the fused kernels' tile
walk (which key tiles a query tile visits, which query tiles a key tile visits, when masking is
skipped), replayed in Python against the float64 oracle's visibility matrix.

The walk replay follows fused_attention.cu step by step (block decode, per-axis ranges, box
slots, full-tile test) so a wrong skipping rule shows up here without a GPU.
"""

import itertools

import numpy as np
import pytest
import torch
from oracle import build_visibility

from cudnn_attn.model import geometry
from cudnn_attn.fallback_kernels import fused, tile_shapes
from cudnn_attn.fallback_kernels.backend import CupyBackend, problem_table
from cudnn_attn.model.masks import Alibi, Causal, Neighborhood, Padding, SlidingWindow
from cudnn_attn.model.problem import AttnProblem


def _problem(B=1, H=2, S=16, Skv=None, D=16, Dv=None, dtype=torch.float16, device="meta",
             layout="bhsd", **kw):
    Skv = S if Skv is None else Skv
    Dv = D if Dv is None else Dv
    q = torch.empty(B, H, S, D, dtype=dtype, device=device)
    k = torch.empty(B, H, Skv, D, dtype=dtype, device=device)
    v = torch.empty(B, H, Skv, Dv, dtype=dtype, device=device)
    return AttnProblem.from_tensors(q, k, v, layout=layout, **kw)


def _reasons(problem):
    return "\n".join(CupyBackend().supports(problem))


# ---------------------------------------------------------------------------------------------
# supports()
# ---------------------------------------------------------------------------------------------

def test_no_cuda_is_a_reason():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "no CUDA device" in _reasons(_problem())


def test_cpu_tensors_are_a_reason():
    assert "CUDA tensors; these are on cpu" in _reasons(_problem(device="cpu"))


@pytest.mark.parametrize("dtype", [torch.float64])
def test_dtype_reason(dtype):
    assert f"dtype {dtype} is not supported" in _reasons(_problem(dtype=dtype))


def test_head_dim_reason():
    assert "head dim 136 exceeds 128" in _reasons(_problem(D=64, Dv=136))
    assert "head dim" not in _reasons(_problem(D=128, Dv=40))


def test_dropout_bias_alibi_padding_reasons():
    assert "dropout is not supported" in _reasons(_problem(dropout_p=0.1))
    bias = torch.empty(1, 2, 16, 16, dtype=torch.float16, device="meta")
    assert "a bias tensor is not supported" in _reasons(_problem(bias=bias))
    assert "ALiBi is not supported" in _reasons(_problem(bias=Alibi()))
    assert "Padding masks are not supported" in _reasons(_problem(mask=Padding([16])))


def test_mask_combination_reasons():
    mixed = Neighborhood(16, 3) & Causal()
    assert "Neighborhood combined with other masks (Causal)" in _reasons(_problem(mask=mixed))
    aligned = Causal("top_left") & SlidingWindow(3, 0, "bottom_right")
    assert "mixed alignments" in _reasons(_problem(S=8, Skv=12, mask=aligned))


def test_served_masks_have_only_machine_reasons():
    machine = set(CupyBackend().availability()) | {
        "the CuPy kernels run CUDA tensors; these are on meta"}
    for mask, kw in [(None, {}), (Causal("bottom_right"), dict(Skv=20, softcap=5.0)),
                     (SlidingWindow(3, 1), {}), (Neighborhood((4, 4), (3, 2), 1, (1, 2)), {})]:
        assert set(CupyBackend().supports(_problem(mask=mask, **kw))) <= machine, mask


# ---------------------------------------------------------------------------------------------
# Geometry tables
# ---------------------------------------------------------------------------------------------

def test_band_tables_match_masks():
    p = _problem(S=5, Skv=9, mask=Causal("bottom_right") & SlidingWindow(2, 3, "bottom_right"))
    table, reasons = problem_table(p)
    assert reasons == [] and table[:10] == [1, 5, 9, 1, 1, 1, 0, 2, 0, 4]
    assert table[10:] == [1, 1, 1, 1, 1, 1, 0, -1, -1, 0] * 2
    assert problem_table(_problem(S=5))[0][:10] == [1, 5, 5, 1, 1, 1, 0, -1, -1, 0]


def test_neighborhood_table():
    t = geometry.neighborhood_table((7, 9), (3, 4), (1, 2), (2, 1), (False, True))
    assert t == [0, 7, 7, 3, 1, 2, 0, -1, -1, 0, 0, 9, 9, 4, 2, 1, 1, -1, -1, 0,
                 1, 1, 1, 1, 1, 1, 0, -1, -1, 0]


def _axis_matrix(ax):
    """Dense [L_q, L_kv] visibility of one table axis from the Python mirror of the rule."""
    mode, lq, lkv = ax[0], ax[1], ax[2]
    d = ax[5] if mode == geometry.MODE_NEIGHBORHOOD else 1
    m = np.zeros((lq, lkv), dtype=bool)
    for i in range(lq):
        lo, hi = geometry.axis_window(ax, i // d, geometry.group_len(lq, d, i % d))
        for t in range(lo, hi):
            m[i, t * d + i % d] = True
    return m


def _table_visibility(table):
    vis = np.ones((1, 1), dtype=bool)
    for ax in geometry.table_axes(table):
        vis = np.kron(vis, _axis_matrix(ax)).astype(bool)
    return vis


NEIGHBORHOODS = [
    ((37,), (5,), (1,), (3,), (False,)),
    ((40,), (8,), (7,), (5,), (True,)),
    ((128,), (63,), (31,), (1,), (False,)),
    ((7, 9), (3, 4), (1, 2), (2, 1), (False, True)),
    ((19, 29), (8, 8), (1, 1), (2, 3), (True, False)),
    ((13, 11, 9), (3, 4, 3), (2, 3, 3), (3, 2, 2), (False, True, True)),
    ((8, 4, 8), (7, 3, 7), (1, 1, 1), (1, 1, 1), (True, True, False)),
]


@pytest.mark.parametrize("spec", NEIGHBORHOODS, ids=str)
def test_mirror_rule_matches_oracle(spec):
    shape, k, s, d, c = spec
    expected = build_visibility(1, int(np.prod(shape)), int(np.prod(shape)),
                                neighborhood=dict(spatial_shape=shape, kernel_size=k, stride=s,
                                                  dilation=d, is_causal=c))[0].numpy()
    assert (_table_visibility(geometry.neighborhood_table(*spec)) == expected).all()


BANDS = [(17, 17, -1, -1, 0), (9, 23, -1, 0, 14), (23, 9, -1, 0, -14), (50, 50, 7, 2, 0),
         (30, 70, 5, 0, 40), (70, 30, -1, 3, 0)]


@pytest.mark.parametrize("band", BANDS, ids=str)
def test_band_rule_matches_oracle(band):
    sq, skv, left, right, offset = band
    align = "bottom_right" if offset else "top_left"
    expected = build_visibility(1, sq, skv, window=(left, right, align))[0].numpy()
    assert (_table_visibility(geometry.band_table(*band)) == expected).all()


# ---------------------------------------------------------------------------------------------
# The tile walk, replayed
# ---------------------------------------------------------------------------------------------

def _box_slots(box, lo, hi):
    """Slots of a box in the kernels' order: (group coords or None when outside the clip)."""
    out = []
    for j in range(int(np.prod(box))):
        c = (lo[0] + j // (box[1] * box[2]), lo[1] + (j // box[2]) % box[1], lo[2] + j % box[2])
        out.append(c if all(c[a] < hi[a] for a in range(3)) else None)
    return out


def _token(c, g, d, lens):
    tok = 0
    for a in range(3):
        tok = tok * lens[a] + c[a] * d[a] + g[a]
    return tok


def _walk(table, own_box, other_box, own_queries):
    """Every (query, key) pair a launch treats as visible, with the block/tile that did it."""
    axes = geometry.table_axes(table)
    own_box, other_box = fused.pad3(own_box), fused.pad3(other_box)
    grid = fused.launch_grid(table, own_box, 1, 1, own_queries)[0]
    pairs = []
    for block in range(grid):
        t, idx = block, [0, 0, 0]
        for a in (2, 1, 0):
            ax = axes[a]
            n = fused.axis_tiles(ax[1] if own_queries else ax[2], geometry.axis_dilation(ax), own_box[a])
            idx[a], t = t % n, t // n
        g, d, glen, own_lo, own_hi, lo, hi, tiles = ([0] * 3 for _ in range(8))
        for a, ax in enumerate(axes):
            d[a] = geometry.axis_dilation(ax)
            length = ax[1] if own_queries else ax[2]
            g[a], own_lo[a], end = fused.axis_tile_list(length, d[a], own_box[a])[idx[a]]
            glen[a] = geometry.group_len(ax[1], d[a], g[a])
            own_hi[a] = end
            rng = (fused.group_key_range(ax, glen[a], own_lo[a], own_hi[a]) if own_queries
                   else fused.group_query_range(ax, glen[a], own_lo[a], own_hi[a]))
            lo[a], hi[a] = rng[0], max(rng[1], rng[0])
            tiles[a] = -(-(hi[a] - lo[a]) // other_box[a])
        lens_q = [ax[1] for ax in axes]
        lens_kv = [ax[2] for ax in axes]
        for ti in itertools.product(*(range(n) for n in tiles)):
            cur_lo = [lo[a] + ti[a] * other_box[a] for a in range(3)]
            cur_hi = [min(cur_lo[a] + other_box[a], hi[a]) for a in range(3)]
            full = True
            for a, ax in enumerate(axes):
                if own_queries:
                    wl1 = geometry.axis_window(ax, own_hi[a] - 1, glen[a])[0]
                    wh0 = geometry.axis_window(ax, own_lo[a], glen[a])[1]
                    full &= cur_lo[a] + other_box[a] <= hi[a] and wl1 <= cur_lo[a] \
                        and cur_lo[a] + other_box[a] <= wh0
                else:
                    wl1 = geometry.axis_window(ax, cur_hi[a] - 1, glen[a])[0]
                    wh0 = geometry.axis_window(ax, cur_lo[a], glen[a])[1]
                    full &= wl1 <= own_lo[a] and own_hi[a] <= wh0
            qbox, kbox = (own_box, other_box) if own_queries else (other_box, own_box)
            qs = _box_slots(qbox, *((own_lo, own_hi) if own_queries else (cur_lo, cur_hi)))
            ks = _box_slots(kbox, *((cur_lo, cur_hi) if own_queries else (own_lo, own_hi)))
            for qc in qs:
                for kc in ks:
                    if own_queries and kc is None:
                        continue  # absent key slot: -inf (never part of a full tile)
                    if qc is None:
                        continue  # absent query: not stored (forward/dQ), P = 0 (dK/dV)
                    if kc is None:
                        continue  # absent key row of a dK/dV block: never stored
                    visible = full or all(
                        lo_ <= kc[a] < hi_ for a, (lo_, hi_) in enumerate(
                            geometry.axis_window(axes[a], qc[a], glen[a]) for a in range(3)))
                    if visible:
                        pairs.append((_token(qc, g, d, lens_q), _token(kc, g, d, lens_kv)))
    return pairs


def _check_walk(table, expected, qbox, kbox):
    for own_queries, (own, other) in ((True, (qbox, kbox)), (False, (kbox, qbox))):
        pairs = _walk(table, own, other, own_queries)
        got = np.zeros_like(expected)
        for i, j in pairs:
            got[i, j] = True
        assert len(pairs) == int(expected.sum()), "a pair was visited twice or missed"
        assert (got == expected).all(), ("forward/dQ" if own_queries else "dK/dV")


@pytest.mark.parametrize("spec", NEIGHBORHOODS, ids=str)
def test_tile_walk_visits_every_visible_pair_once(spec):
    table = geometry.neighborhood_table(*spec)
    expected = _table_visibility(table)
    rank = len(spec[0])
    boxes = tile_shapes.box_shapes(64, rank)
    for qbox, kbox in [fused.choose_tiles(tuple(table), rank), (boxes[0], boxes[-1]),
                       (boxes[-1], boxes[len(boxes) // 2])]:
        _check_walk(table, expected, qbox, kbox)


@pytest.mark.parametrize("band", BANDS, ids=str)
def test_band_tile_walk(band):
    table = geometry.band_table(*band)
    _check_walk(table, _table_visibility(table), (64,), (64,))


def test_key_box_contains_every_visible_key():
    """The skipping rule itself: a query tile's key range holds every key any of its queries
    sees (brute force over the oracle's visibility)."""
    shape, k, s, d, c = (19, 29), (8, 8), (1, 1), (2, 3), (True, False)
    table = geometry.neighborhood_table(shape, k, s, d, c)
    vis = build_visibility(1, 19 * 29, 19 * 29, neighborhood=dict(
        spatial_shape=shape, kernel_size=k, stride=s, dilation=d, is_causal=c))[0].numpy()
    axes = geometry.table_axes(table)
    for tile_axis0, tile_axis1 in itertools.product(
            fused.axis_tile_list(19, 2, 8), fused.axis_tile_list(29, 3, 8)):
        ranges = []
        for ax, (g, q0, q1), dd in zip(axes, (tile_axis0, tile_axis1), (2, 3)):
            lo, hi = fused.group_key_range(ax, geometry.group_len(ax[1], dd, g), q0, q1)
            ranges.append((g, q0, q1, lo, hi, dd))
        (g0, a0, b0, lo0, hi0, d0), (g1, a1, b1, lo1, hi1, d1) = ranges
        for i0 in range(a0, b0):
            for i1 in range(a1, b1):
                row = vis[(i0 * d0 + g0) * 29 + i1 * d1 + g1]
                for j in np.nonzero(row)[0]:
                    j0, j1 = divmod(int(j), 29)
                    assert j0 % d0 == g0 and lo0 <= j0 // d0 < hi0
                    assert j1 % d1 == g1 and lo1 <= j1 // d1 < hi1


def test_choose_tiles_minimises_visited_keys():
    table = geometry.neighborhood_table((64, 64), (7, 7), (1, 1), (1, 1), (False, False))
    qbox, kbox = fused.choose_tiles(tuple(table), 2)
    best = fused.forward_tokens(table, qbox, kbox)
    for q in tile_shapes.box_shapes(64, 2):
        for k in tile_shapes.box_shapes(64, 2):
            assert fused.forward_tokens(table, q, k) >= best
    assert qbox == (8, 8)  # a square box wins for a square window


def test_launch_grid_counts_tiles_per_group():
    table = geometry.neighborhood_table((10, 7), (3, 3), (1, 1), (3, 2), (False, False))
    # axis 0: groups of 4, 3, 3 positions -> 1 tile each with side 4; axis 1: 4 and 3 -> 2 tiles
    assert fused.launch_grid(table, (4, 16), 5, 2) == (3 * 2, 5, 2)
    assert fused.launch_grid(geometry.band_table(100, 300), (64,), 1, 1, own_queries=False) == (5, 1, 1)


def test_smem_fits_and_head_dim_bucket():
    for kernel in fused.KERNELS:
        for dtype in fused.CTYPES:
            for hd in fused.HEAD_DIMS:
                assert fused.smem_bytes(kernel, dtype, hd) <= 99 * 1024
    assert fused.head_dim_bucket(40, 72) == 128 and fused.head_dim_bucket(8, 32) == 32
    with pytest.raises(ValueError, match="head dims up to 128"):
        fused.head_dim_bucket(160, 8)


def test_variants_name_every_instance():
    names = {v.expression for v in fused.variants()}
    assert len(names) == 36 and "na_fused_backward_dkdv<na_bf16, 128>" in names
    assert "na_fused_backward_delta<float, 32>" in names


@pytest.mark.parametrize("capability, spatial, kernel, D, wide", [
    ((9, 0), (1024,), (511,), 32, True), ((9, 0), (32, 32), (7, 7), 64, False),
    ((9, 0), (1024,), (511,), 128, True), ((8, 0), (1024,), (511,), 32, False)])
def test_plan_backward_takes_the_tile_rules_boxes(monkeypatch, request, capability, spatial,
                                                   kernel, D, wide):
    """One rule for the query-major kernels: the plan's dQ launches with the boxes its forward
    takes (``fused.forward_boxes``: the wide kernels' on sm_90+ where the tile model prefers
    them); dK/dV with ``tile_model.dkdv_tiles``' pair on sm_90+ up to head dim 64 (maybe 128-key
    boxes), else ``choose_tiles``' 64-slot pair."""
    from types import SimpleNamespace

    from cudnn_attn.fallback_kernels import backend, tile_model

    # A model that takes the wide kernels where their boxes compute fewer elements (the gain
    # guessed before a GPU measured them; the fitted one takes none on these problems).
    monkeypatch.setattr(tile_model, "WIDE_EFFICIENCY_GAIN", 1.25)
    caches = (tile_model.forward_tiles, tile_model.dkdv_tiles)  # memoized choices
    for cached in caches:
        cached.cache_clear()
    request.addfinalizer(lambda: [cached.cache_clear() for cached in caches])
    monkeypatch.setattr(fused, "_capability", lambda index: capability)
    monkeypatch.setattr(fused, "backward_delta", lambda out, dout, like, dlse=None: like)
    seen = {}
    monkeypatch.setattr(fused, "run_backward", lambda *args: seen.update(
        boxes=args[10], dq_boxes=args[13]))
    problem = _problem(S=int(np.prod(spatial)), D=D, mask=Neighborhood(spatial, kernel))
    plan = backend.CupyPlan(problem)
    q, k, v = (torch.empty(1, 2, problem.seq_q, D, dtype=torch.float16, device="meta")
               for _ in range(3))
    lse = torch.empty(1, 2, problem.seq_q, device="meta")
    plan.backward(problem, SimpleNamespace(q=q, k=k, v=v), q, lse, q)
    table, rank = plan.table, len(spatial)
    assert seen["boxes"] == (tile_model.dkdv_tiles(table, rank)
                             if capability >= (9, 0) and D <= 64 else
                             tile_model.choose_tiles(table, rank))
    assert seen["dq_boxes"] == (tile_model.wide_tiles(table, rank) if wide
                                else tile_model.choose_tiles(table, rank))
    assert (np.prod(seen["dq_boxes"][0]) == tile_shapes.WIDE_QUERY_TILE) == wide


def test_run_backward_launches_the_kernel_its_boxes_name(monkeypatch):
    """dQ: the wide kernel for a 128-query box (sm_90+ only), over that box's grid; dK/dV: its
    64-query pair, never a 128-query one, the wide kernel for a 128-key box (sm_90+, head dims
    up to 64)."""
    from cudnn_attn.fallback_kernels import launch

    launched = []
    monkeypatch.setattr(fused, "_launch", lambda kernel, dtype, hd, grid, *rest: launched.append(
        (kernel, grid)))
    monkeypatch.setattr(launch, "device_table", lambda table, device: None)
    monkeypatch.setattr(launch, "TorchStream", lambda device: _Stream())
    table = tuple(geometry.neighborhood_table((1000,), (255,), (1,), (1,), (False,)))
    t = torch.zeros(1, 1000, 1, 32, dtype=torch.bfloat16)
    lse = torch.zeros(1, 1000, 1)
    args = (t, t, t, t, lse, lse, t, t, t, table, ((64,), (64,)), 0.1)
    monkeypatch.setattr(fused, "_capability", lambda index: (9, 0))
    fused.run_backward(*args, dq_boxes=((128,), (64,)))
    assert launched == [(fused.WIDE_DQ, (8, 1, 1)), ("na_fused_backward_dkdv", (16, 1, 1))]
    launched.clear()
    fused.run_backward(*args)
    assert launched[0] == ("na_fused_backward_dq", (16, 1, 1))
    with pytest.raises(ValueError, match="dK/dV walks 64-query boxes"):
        fused.run_backward(*args[:10], ((128,), (64,)), 0.1)
    launched.clear()
    fused.run_backward(*args[:10], ((64,), (128,)), 0.1)
    assert launched == [("na_fused_backward_dq", (16, 1, 1)), (fused.WIDE_DKDV, (8, 1, 1))]
    wide_d = torch.zeros(1, 1000, 1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dims are \\(32, 64\\); this launch has 128"):
        fused.run_backward(wide_d, *args[1:10], ((64,), (128,)), 0.1)
    monkeypatch.setattr(fused, "_capability", lambda index: (8, 0))
    with pytest.raises(ValueError, match="runs na_fused_backward_dq_wide .*sm_80"):
        fused.run_backward(*args, dq_boxes=((128,), (64,)))


class _Stream:
    index = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_kernel_args_are_the_tensors_device_addresses():
    """A launch hands each tensor over as its address (a 64-bit integer the kernel reads as a
    pointer): no DLPack capsule or CuPy array per tensor, which cost host time on every call
    (issue 37's H200 run). Whatever the tensor: a view at an offset, 16-bit, requiring grad;
    ``None`` is the null pointer."""
    from cudnn_attn.fallback_kernels import launch

    base = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    for t in (base, base[1:, 2:], torch.arange(6, dtype=torch.int32), base.detach().half().t()):
        arg = launch.kernel_arg(t)
        assert isinstance(arg, np.uint64) and int(arg) == t.data_ptr()
    assert launch.kernel_arg(None) == np.uint64(0) and isinstance(launch.kernel_arg(None),
                                                                  np.uint64)
