"""GPU (marked): the fused CuPy kernels against the float64 oracle.

NATTEN 0.21's hard-coded grids (reference section 4.1), shrunk, run through
``fallback_kernels.fused.na_forward/na_backward`` (heads-last) in fp32/fp16/bf16 with NATTEN's
tolerance table; outputs are NaN-poisoned before every run, and two runs must agree bitwise.
The dispatcher's ``backend="cupy"`` path is checked for dense/causal+softcap, GQA and D_v != D_qk.
"""

import math

import pytest
import torch
from oracle import build_visibility, reference_attention

from cudnn_attn.fallback_kernels.wgmma_probe import SHAPES as WGMMA_PROBE_SHAPES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# NATTEN test_fna.py tolerances (atol, rtol=0): fwd, (dq, dk, dv).
TOL = {torch.float32: (1e-4, (1e-2, 1e-4, 1e-4)),
       torch.float16: (1e-2, (1e-2, 1e-2, 1e-2)),
       torch.bfloat16: (5e-2, (1e-2, 1e-2, 1e-2))}
GQA_BWD = (3e-2, 4e-2, 4e-2)

# (batch, heads, heads_kv, head_dim, shape, kernel, stride, dilation), shrunk from section 4.1.
GRID = [
    (1, 3, 3, 128, (128,), (63,), (31,), (1,)),
    (1, 4, 2, 64, (128,), (63,), (31,), (1,)),
    (1, 1, 1, 32, (128,), (3,), (2,), (5,)),
    (1, 1, 1, 64, (128,), (8,), (7,), (5,)),
    (1, 2, 2, 64, (125,), (15,), (1,), (1,)),
    (1, 4, 1, 32, (5, 25), (5, 16), (1, 16), (1, 1)),
    (1, 1, 1, 32, (84, 19), (7, 3), (1, 1), (5, 1)),
    (1, 1, 1, 128, (19, 29), (8, 8), (1, 1), (2, 3)),
    (1, 1, 1, 32, (16, 16), (16, 16), (1, 1), (1, 1)),
    (1, 1, 1, 64, (28, 40), (17, 31), (1, 1), (1, 1)),
    (1, 2, 2, 32, (8, 8, 16), (3, 3, 3), (2, 1, 2), (2, 2, 4)),
    (1, 1, 1, 32, (13, 11, 9), (3, 4, 3), (2, 3, 3), (3, 2, 2)),
    (1, 1, 1, 32, (8, 4, 8), (7, 3, 7), (1, 1, 1), (1, 1, 1)),
]


def _fused():
    from cudnn_attn.fallback_kernels import fused

    return fused


def _oracle(q, k, v, spec, causal, scale, dout):
    """float64 out, lse (heads-last) and grads via the dense oracle."""
    _, _, _, _, shape, kernel, stride, dilation = spec
    B, H, Dv = q.shape[0], q.shape[-2], v.shape[-1]
    S = math.prod(shape)
    vis = build_visibility(1, S, S, neighborhood=dict(spatial_shape=shape, kernel_size=kernel,
                                                      stride=stride, dilation=dilation,
                                                      is_causal=causal))
    q64, k64, v64 = (t.detach().double().cpu().reshape(B, S, t.shape[-2], t.shape[-1])
                     .requires_grad_(True) for t in (q, k, v))
    out, lse = reference_attention(q64, k64, v64, vis, layout="bshd", scale=scale)
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double().cpu().reshape(B, S, H, Dv))
    return out.detach(), lse.transpose(1, 2), [g.reshape(t.shape) for g, t in zip(grads, (q, k, v))]


def _inputs(spec, dtype, dim_v, seed):
    B, H, Hkv, D, shape, *_ = spec
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, *shape, H, D, generator=g)
    k = torch.randn(B, *shape, Hkv, D, generator=g)
    v = torch.randn(B, *shape, Hkv, dim_v, generator=g)
    dout = 0.05 * torch.randn(B, *shape, H, dim_v, generator=g)
    return [t.to("cuda", dtype) for t in (q, k, v, dout)]


def _causal_combos(rank):
    return [tuple(bool(c >> a & 1) for a in range(rank)) for c in range(2 ** rank)]


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("index", range(len(GRID)))
def test_natten_grid(index, dtype):
    fused = _fused()
    spec = GRID[index]
    B, H, Hkv, D, shape, kernel, stride, dilation = spec
    rank = len(shape)
    fwd_tol, bwd_tol = TOL[dtype]
    if Hkv != H and dtype != torch.float32:
        bwd_tol = GQA_BWD
    for n, causal in enumerate(_causal_combos(rank)):
        dim_v = D if n % 2 == 0 else max(8, D - 24)
        q, k, v, dout = _inputs(spec, dtype, dim_v, seed=index * 16 + n)
        scale = D ** -0.5
        kw = dict(kernel_size=kernel, stride=stride, dilation=dilation, is_causal=causal,
                  scale=scale)
        ref_out, ref_lse, ref_grads = _oracle(q, k, v, spec, causal, scale, dout)
        results = []
        for _ in range(2):
            out = torch.full((B, *shape, H, dim_v), float("nan"), dtype=dtype, device="cuda")
            lse = torch.full((B, *shape, H), float("nan"), dtype=torch.float32, device="cuda")
            out, lse = fused.na_forward(q, k, v, out=out, lse=lse, **kw)
            grads = fused.na_backward(q, k, v, out, lse, dout, **kw)
            results.append((out, lse, *grads))
        for a, b in zip(*results):
            assert torch.equal(a, b), "two runs differ"
        out, lse, dq, dk, dv = results[0]
        S = math.prod(shape)
        torch.testing.assert_close(out.double().cpu().reshape(B, S, H, dim_v), ref_out,
                                   atol=fwd_tol, rtol=0)
        torch.testing.assert_close(lse.double().cpu().reshape(B, S, H), ref_lse,
                                   atol=max(fwd_tol, 1e-4), rtol=0)
        for got, ref, tol in zip((dq, dk, dv), ref_grads, bwd_tol):
            torch.testing.assert_close(got.double().cpu(), ref, atol=tol, rtol=0)


WGMMA_GRID = [i for i, spec in enumerate(GRID) if spec[3] in (64, 128)]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma kernels run on sm_90 only")
@pytest.mark.parametrize("boxes", ["choose_tiles", "wide_tiles"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("index", WGMMA_GRID)
def test_wgmma_kernels(index, dtype, boxes, monkeypatch):
    """The opt-in Hopper kernels (CUDNN_ATTN_NA_WGMMA=1): the forward on 64- and 128-query boxes
    and, on 64-slot boxes, dQ and dK/dV, every causal combination: NATTEN's tolerances against
    the float64 oracle, bitwise repeatable, and the wgmma kernels are what ran."""
    from cudnn_attn.fallback_kernels import tile_model

    fused = _fused()
    launched = []
    real_function = fused._function

    def spy(kernel, *args, **kwargs):
        launched.append(kernel)
        return real_function(kernel, *args, **kwargs)

    monkeypatch.setenv(fused.HOPPER_ENV, "1")
    monkeypatch.setattr(fused, "_function", spy)
    monkeypatch.setattr(tile_model, "forward_tiles", getattr(tile_model, boxes))
    monkeypatch.setattr(tile_model, "dkdv_tiles", tile_model.choose_tiles)
    spec = GRID[index]
    B, H, Hkv, D, shape, kernel, stride, dilation = spec
    fwd_tol, bwd_tol = TOL[dtype]
    if Hkv != H:
        bwd_tol = GQA_BWD
    for n, causal in enumerate(_causal_combos(len(shape))):
        dim_v = D if n % 2 == 0 else max(8, D - 24)
        q, k, v, dout = _inputs(spec, dtype, dim_v, seed=index * 16 + n)
        kw = dict(kernel_size=kernel, stride=stride, dilation=dilation, is_causal=causal,
                  scale=D ** -0.5)
        ref_out, ref_lse, ref_grads = _oracle(q, k, v, spec, causal, D ** -0.5, dout)
        runs = []
        for _ in range(2):
            out = torch.full((B, *shape, H, dim_v), float("nan"), dtype=dtype, device="cuda")
            lse = torch.full((B, *shape, H), float("nan"), dtype=torch.float32, device="cuda")
            out, lse = fused.na_forward(q, k, v, out=out, lse=lse, **kw)
            runs.append((out, lse, *fused.na_backward(q, k, v, out, lse, dout, **kw)))
        assert all(torch.equal(a, b) for a, b in zip(*runs)), "two runs differ"
        out, lse, *grads = runs[0]
        S = math.prod(shape)
        torch.testing.assert_close(out.double().cpu().reshape(B, S, H, dim_v), ref_out,
                                   atol=fwd_tol, rtol=0)
        torch.testing.assert_close(lse.double().cpu().reshape(B, S, H), ref_lse,
                                   atol=fwd_tol, rtol=0)
        for got, ref, tol in zip(grads, ref_grads, bwd_tol):
            torch.testing.assert_close(got.double().cpu(), ref, atol=tol, rtol=0)
    twins = {fused.hopper_twin("na_fused_backward_dkdv")}
    if boxes == "wide_tiles":
        twins |= {fused.hopper_twin(fused.WIDE_FORWARD), fused.hopper_twin(fused.WIDE_DQ)}
    else:
        twins |= {fused.hopper_twin("na_fused_forward"), fused.hopper_twin("na_fused_backward_dq")}
    assert twins <= set(launched)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the wgmma kernels run on sm_90 only")
@pytest.mark.parametrize("shape", WGMMA_PROBE_SHAPES, ids=lambda s: f"hd{s[0]}-k{s[1]}")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_wgmma_layouts(dtype, shape, tmp_path):
    """The wgmma kernels' operand layouts on the device (``wgmma_probe``): one tile of each
    product form, small integers, exact. A mismatch keeps the inputs and outputs (in
    ``$CUDNN_ATTN_GPU_ARTIFACTS``, which the GPU proof packs) so that the layout the hardware
    read can be found on the CPU, against the host emulation."""
    import os

    from cudnn_attn.fallback_kernels import wgmma_probe

    given = {name: t.cuda() for name, t in wgmma_probe.inputs(dtype, *shape).items()}
    want = wgmma_probe.expected({name: t.cpu() for name, t in given.items()})
    got = wgmma_probe.run(given)
    found = wgmma_probe.mismatches(got, want)
    if found:
        keep = os.environ.get("CUDNN_ATTN_GPU_ARTIFACTS") or str(tmp_path)
        os.makedirs(keep, exist_ok=True)
        path = os.path.join(keep, f"wgmma_probe-{str(dtype)[6:]}-hd{shape[0]}-k{shape[1]}.pt")
        torch.save({"inputs": {n: t.cpu() for n, t in given.items()},
                    "got": {n: t.cpu() for n, t in got.items()}, "expected": want,
                    "mismatches": found}, path)
    assert found == {}, f"wgmma read a layout other than the emulation's (kept in {keep}): {found}"


def test_explicit_tiles_and_rpb():
    fused = _fused()
    shape, kernel = (12, 10), (5, 3)
    q, k, v, _ = _inputs((1, 2, 2, 32, shape, kernel, (1, 1), (1, 1)), torch.float32, 32, 7)
    rpb = torch.randn(2, 9, 5, device="cuda")
    kw = dict(kernel_size=kernel, stride=(1, 1), dilation=(1, 1), is_causal=(False, False),
              scale=0.3)
    out, _ = fused.na_forward(q, k, v, rpb=rpb, query_tile=(4, 16), key_tile=(16, 4), **kw)
    S = 120
    vis = build_visibility(1, S, S, neighborhood=dict(spatial_shape=shape, kernel_size=kernel))
    i0 = torch.arange(S) // 10
    i1 = torch.arange(S) % 10
    bias = rpb.cpu().double()[:, (i0[None] - i0[:, None] + 4).clamp(0, 8),
                              (i1[None] - i1[:, None] + 2).clamp(0, 4)]
    ref, _ = reference_attention(*(t.double().cpu().reshape(1, S, 2, 32) for t in (q, k, v)),
                                 vis, layout="bshd", scale=0.3, bias=bias[None])
    torch.testing.assert_close(out.double().cpu().reshape(1, S, 2, 32), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_backend_causal_softcap_gqa_dv(layout, dtype):
    import cudnn_attn as ca
    from cudnn_attn.model.masks import Causal

    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, Sq, Skv, D, Dv = 2, 4, 2, 77, 130, 40, 72
    shape = (lambda h, s, d: (B, h, s, d)) if layout == "bhsd" else (lambda h, s, d: (B, s, h, d))
    q = torch.randn(*shape(Hq, Sq, D), generator=g)
    k = torch.randn(*shape(Hkv, Skv, D), generator=g)
    v = torch.randn(*shape(Hkv, Skv, Dv), generator=g)
    dout = torch.randn(*shape(Hq, Sq, Dv), generator=g)
    vis = build_visibility(B, Sq, Skv, causal="bottom_right")
    qs, ks, vs = (t.double().requires_grad_(True) for t in (q, k, v))
    ref, ref_lse = reference_attention(qs, ks, vs, vis, layout=layout, softcap=4.0)
    ref_grads = torch.autograd.grad(ref, (qs, ks, vs), dout.double())
    dev = [t.to("cuda", dtype).requires_grad_(True) for t in (q, k, v)]
    out, lse = ca.attention(*dev, mask=Causal("bottom_right"), softcap=4.0, layout=layout,
                            return_lse=True, backend="cupy")
    grads = torch.autograd.grad(out, dev, dout.to("cuda", dtype))
    fwd, bwd = {torch.float32: (1e-4, 1e-3), torch.float16: (1e-2, 3e-2),
                torch.bfloat16: (5e-2, 1e-1)}[dtype]
    torch.testing.assert_close(out.double().cpu(), ref, atol=fwd, rtol=0)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=max(fwd, 1e-4), rtol=0)
    for got, exp in zip(grads, ref_grads):
        torch.testing.assert_close(got.double().cpu(), exp, atol=bwd, rtol=bwd)


def test_backend_rows_that_see_nothing():
    """Bottom-right causal with S_q > S_kv: early rows see no key -> out 0, lse -inf, no NaN."""
    import cudnn_attn as ca
    from cudnn_attn.model.masks import Causal

    q = torch.randn(1, 2, 90, 32, device="cuda")
    k = torch.randn(1, 2, 20, 32, device="cuda")
    v = torch.randn(1, 2, 20, 32, device="cuda")
    out, lse = ca.attention(q, k, v, mask=Causal("bottom_right"), return_lse=True,
                            backend="cupy")
    assert torch.isfinite(out).all()
    assert (out[:, :, :70] == 0).all() and (lse[:, :, :70] == -math.inf).all()
    assert torch.isfinite(lse[:, :, 70:]).all()
