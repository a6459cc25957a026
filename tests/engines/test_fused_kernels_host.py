"""CPU: the fused NA kernels (``fallback_kernels/fused_attention.cu``) executed on the host.

The float32 instances (head dims 32 and 64; the fp16/bf16 instances, which run mma.sync under
the emulation of ``host_cuda/ptx.h``, are tested in ``test_emulation_16bit.py``) of the forward,
backward-dQ and backward-dK/dV kernels are compiled with g++ against
``tests/host_cuda/emu.h`` (128 threads per block as fibers, warp shuffles, ``__syncthreads``) and
driven by ``fallback_kernels.fused`` itself: ``na_forward``/``na_backward`` for neighborhoods and
``run_forward``/``run_backward`` for bands, so the geometry table, tile choice, grid, strides,
shared-memory size and every packed argument come from the module. Only the device plumbing is
replaced: ``fused._function`` (returns the host kernel, which type-checks each argument),
``launch.kernel_arg`` (a tensor stays a tensor; None stays ``np.uint64(0)``), ``launch.TorchStream``
and the CUDA-device check of ``fused._tokens``.

References: ``oracle.reference_attention`` in float64 with visibility from ``oracle`` (the
neighborhood rule or ``build_visibility`` for bands); gradients by float64 autograd.
"""

import math

import numpy as np
import oracle
import pytest
import torch
from host_cuda import build

from cudnn_attn.model import geometry
from cudnn_attn.fallback_kernels import fused as F
from cudnn_attn.fallback_kernels import launch

HEAD_DIMS = (32, 64)
TOL = {"rtol": 2e-4, "atol": 2e-5}


def _expressions():
    return [F.expression(k, torch.float32, hd) for k in F.KERNELS for hd in HEAD_DIMS]


@pytest.fixture(scope="module")
def lib(request, tmp_path_factory):
    known = {v.expression for v in F.variants()}
    assert set(_expressions()) <= known
    return build.host_library(request, tmp_path_factory, F, _expressions())


class _NoStream:
    def __init__(self, device):
        self.index, self.stream = 0, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _host_tokens(t, rank, name):
    # fused._tokens without its CUDA-device check: [B, *spatial, H, D] -> [B, S, H, D].
    assert isinstance(t, torch.Tensor) and t.dim() == rank + 3, name
    return F._last_contiguous(t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1]))


def _host_launch(monkeypatch, capability=(9, 0)):
    """launch.py's device plumbing replaced: tensors stay tensors, no CuPy stream; the device
    reports ``capability`` (which picks the fused build, see ``fused.pipelined``)."""
    monkeypatch.setattr(launch, "kernel_arg", lambda t: np.uint64(0) if t is None else t.detach())
    monkeypatch.setattr(launch, "TorchStream", _NoStream)
    monkeypatch.setattr(F, "_capability", lambda index: capability)


@pytest.fixture
def launches(lib, monkeypatch):
    """Route fused.py's launches to the host library; returns the list of launches made."""
    calls = []

    def function(kernel, dtype, head_dim, device_index, use_pipelined=False):
        assert not use_pipelined  # fp32 always takes the exact FMA build
        fn = lib[build.export_name(F.expression(kernel, dtype, head_dim))]

        def launch(grid, block, args, shared_mem=0, stream=None):
            calls.append((kernel, head_dim, tuple(grid), tuple(block), shared_mem))
            assert tuple(block) == (F.THREADS, 1, 1) and grid[1] <= 65535 and grid[2] <= 65535
            assert shared_mem == F.smem_bytes(kernel, dtype, head_dim)
            fn(grid, block, args, shared_mem=shared_mem)
        return launch

    monkeypatch.setattr(F, "_function", function)
    _host_launch(monkeypatch)
    monkeypatch.setattr(F, "_tokens", _host_tokens)
    return calls


# ---------------------------------------------------------------------------------------------
# Oracle
# ---------------------------------------------------------------------------------------------

def dense_rpb(rpb, spatial, kernel, dilation, vis):
    """[1, H, N, N] bias: rpb[h, (j - i) / d + k - 1 per axis] at visible pairs, 0 elsewhere."""
    H, N = rpb.shape[0], vis.shape[-1]
    coords = np.array(np.unravel_index(np.arange(N), spatial)).T  # [N, rank]
    bias = torch.zeros(1, H, N, N, dtype=torch.float64)
    for i, j in zip(*np.nonzero(vis)):
        idx = tuple(int((cj - ci) // d + k - 1)
                    for ci, cj, d, k in zip(coords[i], coords[j], dilation, kernel))
        bias[0, :, i, j] = rpb[(slice(None), *idx)].double()
    return bias


def reference(q, k, v, dout, vis, scale, softcap=None, bias=None):
    """float64 (out, lse [B, S, H], dq, dk, dv) on token-major [B, S, H, D] inputs."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out, lse = oracle.reference_attention(*leaves, vis, layout="bshd", scale=scale,
                                          softcap=softcap, bias=bias)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return (out.detach(), lse.transpose(1, 2).detach(), *grads)


def check(name, got, ref):
    assert not torch.isnan(got).any(), f"{name}: NaN (unwritten element?)"
    torch.testing.assert_close(got.double(), ref, **TOL, msg=lambda m: f"{name}: {m}")


def rand(shape, g):
    return torch.randn(*shape, generator=g, dtype=torch.float64).float()


# ---------------------------------------------------------------------------------------------
# Neighborhoods through na_forward / na_backward (heads-last)
# ---------------------------------------------------------------------------------------------

# name -> spatial, kernel, stride, dilation, causal, H, H_kv, D_qk, D_v, extra
NA_CASES = {
    "1d-rpb": ((20,), (5,), (1,), (1,), (False,), 2, 2, 16, 16, {"rpb": True}),
    "1d-multitile": ((150,), (7,), (1,), (1,), (False,), 1, 1, 8, 8, {}),
    "1d-stride-dilation-causal": ((23,), (4,), (2,), (2,), (True,), 1, 1, 8, 8, {}),
    "2d-gqa-dv": ((9, 10), (3, 5), (1, 2), (2, 1), (False, True), 4, 2, 12, 20, {}),
    "2d-tiles": ((12, 20), (5, 7), (2, 1), (1, 2), (False, False), 1, 1, 8, 8,
                 {"query_tile": (8, 8), "key_tile": (4, 16)}),
    # Dilation groups of unequal tile counts (axis 0: groups of 9, 8, 8 rows; tiles of 8).
    "2d-dilation-groups": ((25, 8), (3, 3), (1, 1), (3, 1), (False, True), 1, 1, 8, 8,
                           {"query_tile": (8, 8), "key_tile": (8, 8)}),
    "3d-causal": ((4, 6, 6), (3, 3, 3), (1, 1, 2), (1, 2, 1), (True, False, False), 1, 1, 8, 8,
                  {}),
    "2d-softcap-hd64-rpb": ((7, 8), (3, 5), (1, 1), (1, 1), (False, False), 2, 1, 40, 24,
                            {"softcap": 1.5, "rpb": True}),
}


@pytest.mark.parametrize("name", list(NA_CASES))
def test_neighborhood_forward_backward(launches, name):
    spatial, kernel, stride, dilation, causal, H, Hkv, Dqk, Dv, extra = NA_CASES[name]
    g = torch.Generator().manual_seed(len(name))
    B = 2
    q, k = rand((B, *spatial, H, Dqk), g), rand((B, *spatial, Hkv, Dqk), g)
    v, dout = rand((B, *spatial, Hkv, Dv), g), rand((B, *spatial, H, Dv), g)
    rpb = rand((H, *(2 * x - 1 for x in kernel)), g) if extra.get("rpb") else None
    softcap = extra.get("softcap")
    scale = 0.7 / math.sqrt(Dqk)
    geom = {"kernel_size": kernel, "stride": stride, "dilation": dilation, "is_causal": causal,
            "scale": scale, "query_tile": extra.get("query_tile"),
            "key_tile": extra.get("key_tile")}

    out_buf = torch.full((B, *spatial, H, Dv), math.nan)
    lse_buf = torch.full((B, *spatial, H), math.nan)
    out, lse = F.na_forward(q, k, v, rpb=rpb, softcap=softcap, out=out_buf, lse=lse_buf, **geom)
    assert out is out_buf and lse is lse_buf

    N = math.prod(spatial)
    vis = oracle.build_visibility(1, N, N, neighborhood={
        "spatial_shape": spatial, "kernel_size": kernel, "stride": stride, "dilation": dilation,
        "is_causal": causal})
    tok = lambda t: t.reshape(B, N, *t.shape[-2:])
    bias = dense_rpb(rpb, spatial, kernel, dilation, vis[0].numpy()) if rpb is not None else None
    r_out, r_lse, *_ = reference(tok(q), tok(k), tok(v), tok(dout), vis, scale, softcap, bias)
    check("out", tok(out), r_out)
    check("lse", lse.reshape(B, N, H), r_lse)

    tiles = [c for c in launches if c[0] == "na_fused_forward"]
    assert tiles[0][1] == F.head_dim_bucket(Dqk, Dv)
    if name in ("1d-multitile", "2d-tiles", "2d-dilation-groups"):
        assert tiles[0][2][0] > 1  # several query tiles per (batch, head)

    if rpb is not None:  # na_backward has no rpb: the gradient test runs without it
        out, lse = F.na_forward(q, k, v, softcap=softcap, **geom)
    dq, dk, dv = F.na_backward(q, k, v, out, lse, dout, softcap=softcap, **geom)
    _, _, r_dq, r_dk, r_dv = reference(tok(q), tok(k), tok(v), tok(dout), vis, scale, softcap)
    check("dq", tok(dq), r_dq)
    check("dk", tok(dk), r_dk)
    check("dv", tok(dv), r_dv)
    assert {c[0] for c in launches} == set(F.KERNELS)


# ---------------------------------------------------------------------------------------------
# Bands through run_forward / run_backward (heads-first strided views, NaN-prefilled outputs)
# ---------------------------------------------------------------------------------------------

# name -> S_q, S_kv, (left, right, alignment) or "causal-br" / "causal-tl" / None (dense), H,
# H_kv, D_qk, D_v, softcap
BAND_CASES = {
    "dense-gqa": (37, 50, None, 2, 1, 8, 8, None),
    "causal-bottom-right": (20, 45, "causal-br", 1, 1, 8, 12, None),
    "causal-bottom-right-empty-rows": (30, 20, "causal-br", 2, 2, 8, 8, None),
    "causal-top-left-unseen-keys": (20, 40, "causal-tl", 1, 1, 6, 6, None),
    "sliding-window-multitile": (70, 70, (5, 3, "top_left"), 1, 1, 8, 8, None),
    "window-softcap-unaligned": (33, 33, (4, 0, "top_left"), 2, 1, 6, 10, 3.0),
    # Unmasked ("full") tiles next to masked ones, and tiles one key/query short of full: the
    # last query tile (rows 128, 129) visits keys 66.. of which key 66 only row 128 sees; key
    # tile 64..127 visits query tile 64..127 whose last row sees keys from 65 on.
    "left-window-full-tiles": (130, 130, (62, -1, "top_left"), 1, 1, 8, 8, None),
}


def _band(Sq, Skv, mask):
    if mask is None:
        return geometry.band_table(Sq, Skv), {}
    if mask == "causal-br":
        return geometry.band_table(Sq, Skv, -1, 0, Skv - Sq), {"causal": "bottom_right"}
    if mask == "causal-tl":
        return geometry.band_table(Sq, Skv, -1, 0, 0), {"causal": "top_left"}
    left, right, align = mask
    offset = Skv - Sq if align == "bottom_right" else 0
    return geometry.band_table(Sq, Skv, left, right, offset), {"window": mask}


def _heads_first(shape, g):
    """A [B, S, H, D] view of a [B, H, S, D] tensor (the bhsd layout the backend passes)."""
    B, S, H, D = shape
    return rand((B, H, S, D), g).transpose(1, 2)


@pytest.mark.parametrize("name", list(BAND_CASES))
def test_band_forward_backward(launches, name):
    Sq, Skv, mask, H, Hkv, Dqk, Dv, softcap = BAND_CASES[name]
    B = 2
    g = torch.Generator().manual_seed(len(name) + 100)
    q, k = _heads_first((B, Sq, H, Dqk), g), _heads_first((B, Skv, Hkv, Dqk), g)
    v, dout = _heads_first((B, Skv, Hkv, Dv), g), _heads_first((B, Sq, H, Dv), g)
    table, vis_kw = _band(Sq, Skv, mask)
    boxes = F.choose_tiles(tuple(table), 1)
    scale = 1.0 / math.sqrt(Dqk)
    nan = lambda *s: torch.full(s, math.nan)

    out = nan(B, H, Sq, Dv).transpose(1, 2)
    lse = nan(B, H, Sq).transpose(1, 2)
    F.run_forward(q, k, v, out, lse, table, boxes, scale, softcap or 0.0)
    vis = oracle.build_visibility(1, Sq, Skv, **vis_kw)
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, dout, vis, scale, softcap)
    check("out", out, r_out)
    check("lse", lse, r_lse)

    # Built as CupyPlan.backward builds it: with one head torch keeps a size-1 stride that differs
    # from lse's, which the launcher must accept.
    delta = F.backward_delta(out, dout, lse)
    dq, dk, dv = (nan(B, h, S, D).transpose(1, 2)
                  for h, S, D in ((H, Sq, Dqk), (Hkv, Skv, Dqk), (Hkv, Skv, Dv)))
    F.run_backward(q, k, v, dout, lse, delta, dq, dk, dv, table, boxes, scale, softcap or 0.0)
    check("dq", dq, r_dq)
    check("dk", dk, r_dk)
    check("dv", dv, r_dv)

    if name.endswith("empty-rows"):  # rows 0..9 see no key: exact zeros and -inf
        assert torch.equal(out[:, :Sq - Skv], torch.zeros_like(out[:, :Sq - Skv]))
        assert torch.isneginf(lse[:, :Sq - Skv]).all()
        assert torch.equal(dq[:, :Sq - Skv], torch.zeros_like(dq[:, :Sq - Skv]))
    if name.endswith("unseen-keys"):  # keys 20..39 are seen by nobody
        assert torch.equal(dk[:, Sq:], torch.zeros_like(dk[:, Sq:]))
        assert torch.equal(dv[:, Sq:], torch.zeros_like(dv[:, Sq:]))
    # Head dims that are not multiples of 4 floats take the scalar-load staging path.
    assert F._aligned((q, k, v), q.dtype) == int(Dqk % 4 == 0 and Dv % 4 == 0)


def test_real_threads_match_oracle(request, tmp_path_factory, monkeypatch):
    """One small neighborhood with every block on 128 real std::threads (barriers and warp
    exchanges under the OS scheduler rather than the fibers' fixed order)."""
    exprs = [F.expression(k, torch.float32, 32) for k in F.KERNELS]
    real = build.host_library(request, tmp_path_factory, F, exprs, real_threads=True)
    monkeypatch.setattr(F, "_function", lambda kernel, dtype, hd, dev, pipelined=False: real[
        build.export_name(F.expression(kernel, dtype, hd))])
    _host_launch(monkeypatch)
    monkeypatch.setattr(F, "_tokens", _host_tokens)
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (rand((1, 21, 2, 8), g) for _ in range(4))
    geom = {"kernel_size": (5,), "stride": (2,), "dilation": (2,), "is_causal": (False,),
            "scale": 0.4}
    out, lse = F.na_forward(q, k, v, **geom)
    dq, dk, dv = F.na_backward(q, k, v, out, lse, dout, **geom)
    vis = oracle.build_visibility(1, 21, 21, neighborhood={
        "spatial_shape": (21,), "kernel_size": 5, "stride": 2, "dilation": 2, "is_causal": False})
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv),
                              reference(q, k, v, dout, vis, 0.4)):
        check(name, got, ref)


# ---------------------------------------------------------------------------------------------
# Every sign and size of the scale (a hidden pair stays hidden: scaling happens before masking)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [-2.0, -0.3, 0.0, 1e-3])
@pytest.mark.parametrize("mask", ["causal-tl", "causal-br", (2, 1, "top_left")],
                         ids=["causal-tl", "causal-br", "window"])
def test_band_kernels_take_any_scale(launches, mask, scale):
    B, H, Sq, Skv, D = 1, 2, 24, 24 if mask != "causal-br" else 30, 8
    g = torch.Generator().manual_seed(11)
    q, k = _heads_first((B, Sq, H, D), g), _heads_first((B, Skv, H, D), g)
    v, dout = _heads_first((B, Skv, H, D), g), _heads_first((B, Sq, H, D), g)
    table, vis_kw = _band(Sq, Skv, mask)
    boxes = F.choose_tiles(tuple(table), 1)
    nan = lambda *s: torch.full(s, math.nan)
    out, lse = nan(B, H, Sq, D).transpose(1, 2), nan(B, H, Sq).transpose(1, 2)
    F.run_forward(q, k, v, out, lse, table, boxes, scale, 0.0)
    vis = oracle.build_visibility(1, Sq, Skv, **vis_kw)
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, dout, vis, scale)
    check("out", out, r_out)
    check("lse", lse, r_lse)
    delta = F.backward_delta(out, dout, lse)
    dq, dk, dv = (nan(B, H, S, D).transpose(1, 2) for S in (Sq, Skv, Skv))
    F.run_backward(q, k, v, dout, lse, delta, dq, dk, dv, table, boxes, scale, 0.0)
    check("dq", dq, r_dq)
    check("dk", dk, r_dk)
    check("dv", dv, r_dv)


@pytest.mark.parametrize("scale", [-2.0, 0.0])
def test_neighborhood_kernels_take_any_scale(launches, scale):
    spatial, kernel, causal = (20,), (5,), (True,)
    g = torch.Generator().manual_seed(12)
    B, H, D = 1, 2, 8
    q, k, v, dout = (rand((B, *spatial, H, D), g) for _ in range(4))
    geom = {"kernel_size": kernel, "stride": (1,), "dilation": (1,), "is_causal": causal,
            "scale": scale, "query_tile": None, "key_tile": None}
    out, lse = F.na_forward(q, k, v, **geom)
    N = math.prod(spatial)
    vis = oracle.build_visibility(1, N, N, neighborhood={
        "spatial_shape": spatial, "kernel_size": kernel, "is_causal": causal})
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, dout, vis, scale)
    check("out", out, r_out)
    check("lse", lse, r_lse)
    dq, dk, dv = F.na_backward(q, k, v, out, lse, dout, **geom)
    check("dq", dq, r_dq)
    check("dk", dk, r_dk)
    check("dv", dv, r_dv)


@pytest.mark.parametrize("with_dlse", [False, True], ids=["no-dlse", "dlse"])
def test_backward_delta_kernel(launches, with_dlse):
    """``backward_delta`` (the na_fused_backward_delta kernel) against float64: rowsum(dO * O)
    minus the LSE's gradient, for heads-first views of odd sizes (D_v 20 in the 32 bucket, 3
    heads, 37 tokens), the result laid out like the lse view it is given."""
    g = torch.Generator().manual_seed(5)
    B, S, H, Dv = 2, 37, 3, 20
    out = rand((B, H, S, Dv), g).transpose(1, 2)
    dout = rand((B, H, S, Dv), g).transpose(1, 2)
    lse = torch.full((B, H, S), math.nan).transpose(1, 2)
    dlse = rand((B, H, S), g).transpose(1, 2) if with_dlse else None
    delta = F.backward_delta(out, dout, lse, dlse)
    assert delta.shape == lse.shape and delta.stride() == lse.stride()
    ref = (out.double() * dout.double()).sum(-1)
    if with_dlse:
        ref = ref - dlse.double()
    check("delta", delta, ref)
    assert {c[0] for c in launches} == {"na_fused_backward_delta"}


@pytest.mark.parametrize("mask", [None, "causal-tl"], ids=["full", "causal-tl"])
def test_band_kernels_with_very_negative_lse_keep_partial_tiles_masked(launches, mask):
    """cuDNN's open-tail bug class (``graphs.limits.CudnnLimits.key_tile``) checked on our own
    kernels: 100 queries and 100 keys leave partial tiles on both sides, and every score is
    about -106 (each row's LSE below -88.7, where ``exp(0 - LSE)`` of an unmasked zero-filled
    position would overflow fp32). Everything stays finite and matches float64."""
    B, H, S, D = 1, 2, 100, 8
    g = torch.Generator().manual_seed(13)
    q, k = _heads_first((B, S, H, D), g), _heads_first((B, S, H, D), g)
    v, dout = _heads_first((B, S, H, D), g), _heads_first((B, S, H, D), g)
    q[..., 0], k[..., 0] = 1.0, -300.0  # scale 8 ** -0.5: scores about -106
    table, vis_kw = _band(S, S, mask)
    boxes = F.choose_tiles(tuple(table), 1)
    scale = D ** -0.5
    out, lse = torch.empty(B, H, S, D).transpose(1, 2), torch.empty(B, H, S).transpose(1, 2)
    F.run_forward(q, k, v, out, lse, table, boxes, scale, 0.0)
    vis = oracle.build_visibility(1, S, S, **vis_kw)
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, dout, vis, scale)
    assert r_lse.max() < -95
    check("out", out, r_out)
    torch.testing.assert_close(lse.double(), r_lse, rtol=1e-5, atol=1e-3)
    delta = F.backward_delta(out, dout, lse)
    dq, dk, dv = (torch.empty(B, H, S, D).transpose(1, 2) for _ in range(3))
    F.run_backward(q, k, v, dout, lse, delta, dq, dk, dv, table, boxes, scale, 0.0)
    for name, got, want in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        assert torch.isfinite(got).all(), name
        # dQ's first feature sums dS (rows summing to 0) times K's -300s: fp32 cancellation of
        # about 1e-3 of the largest gradient there, where float64 gives 0
        torch.testing.assert_close(got.double(), want, rtol=1e-3,
                                   atol=1e-3 * max(1.0, want.abs().max().item()))


def test_neighborhood_kernels_with_very_negative_lse_stay_finite(launches):
    """The same on the neighborhood kernels: 100 tokens (a partial last tile), kernel 7."""
    spatial, kernel = (100,), (7,)
    g = torch.Generator().manual_seed(14)
    B, H, D = 1, 2, 8
    q, k, v, dout = (rand((B, *spatial, H, D), g) for _ in range(4))
    q[..., 0], k[..., 0] = 1.0, -300.0  # scale 8 ** -0.5: scores about -106
    geom = {"kernel_size": kernel, "stride": (1,), "dilation": (1,), "is_causal": (False,),
            "scale": D ** -0.5, "query_tile": None, "key_tile": None}
    out, lse = F.na_forward(q, k, v, **geom)
    vis = oracle.build_visibility(1, 100, 100, neighborhood={
        "spatial_shape": spatial, "kernel_size": kernel, "is_causal": (False,)})
    r_out, r_lse, r_dq, r_dk, r_dv = reference(q, k, v, dout, vis, D ** -0.5)
    assert r_lse.max() < -95
    check("out", out, r_out)
    dq, dk, dv = F.na_backward(q, k, v, out, lse, dout, **geom)
    for name, got, want in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got.double(), want, rtol=1e-3,
                                   atol=1e-3 * max(1.0, want.abs().max().item()))
