"""CPU: the fp16/bf16 kernels run under the host emulation of their inline PTX.

``tests/host_cuda`` translates every ``asm`` statement of the kernel text NVRTC compiles into a
call of ``ptx.h``: ``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`` as a
warp-collective with the PTX ISA's per-lane fragment tables, and the ``cvt`` conversions bit-exact
(round-to-nearest-even, overflow to inf, subnormals, canonical NaN). Here:

* the conversions against PyTorch's IEEE conversions, over special values, every half and a
  million random float bit patterns (through common.cu's own conversion functions);
* the mma against an independent transcription of the ISA's fragment tables in Python;
* the fused forward, dQ and dK/dV kernels (driven by ``fallback_kernels.fused`` exactly as
  ``tests/engines/test_fused_kernels_host.py`` drives the fp32 ones) for 1/2/3-D neighborhoods and bands,
  GQA, ``D_v != D_qk``, softcap, RPB, against the float64 oracle with the dtype rule of
  ``host_cuda/lowp.py`` (2x fwd / 3x bwd the error of a plain computation in the dtype, and
  unbiased rounding);
* the unfused kernels' fp16/bf16 instances against the float64 oracle of
  ``tests/engines/test_unfused_kernels_host.py`` (fp32 accumulation, one rounding at the store).
"""

import math

import numpy as np
import oracle
import pytest
import test_fused_kernels_host as FH
import test_unfused_kernels_host as UH
import torch
from host_cuda import build, lowp

from cudnn_attn.fallback_kernels import _loader
from cudnn_attn.fallback_kernels import fused as F
from cudnn_attn.fallback_kernels import unfused as U

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (32, 64)
IDS = {torch.float16: "fp16", torch.bfloat16: "bf16"}


PIPELINED_KERNELS = (*F.KERNELS, *F.WIDE_KERNELS)


def fused_expressions(dtypes=DTYPES, head_dims=HEAD_DIMS, kernels=F.KERNELS):
    return [F.expression(k, dt, hd) for k in kernels for dt in dtypes for hd in head_dims
            if k != F.WIDE_DKDV or hd in F.WIDE_DKDV_HEAD_DIMS]


@pytest.fixture(scope="module")
def lib16(request, tmp_path_factory):
    return build.host_library(request, tmp_path_factory, F, fused_expressions())


@pytest.fixture(scope="module")
def lib16_pipelined(request, tmp_path_factory):
    """The sm_80+ build (ldmatrix, cp.async double buffering): the text NVRTC compiles with
    ``fused.PIPELINED_DEFINES``."""
    return build.host_library(request, tmp_path_factory, F,
                              fused_expressions(head_dims=F.HEAD_DIMS, kernels=PIPELINED_KERNELS),
                              source=_loader.source_text(F.SOURCE, F.PIPELINED_DEFINES))


def route_fused(monkeypatch, lib, pipelined=False):
    """fused.py's launches go to ``lib`` (the pipelined build when ``pipelined``: the device then
    reports sm_90, else sm_75); returns the list of launched kernels."""
    calls = []

    def function(kernel, dtype, head_dim, device_index, use_pipelined=False):
        assert use_pipelined == pipelined
        fn = lib[build.export_name(F.expression(kernel, dtype, head_dim))]

        def launch(grid, block, args, shared_mem=0, stream=None):
            assert shared_mem == F.smem_bytes(kernel, dtype, head_dim, pipelined)
            calls.append(kernel)
            fn(grid, block, args, shared_mem=shared_mem)
        return launch

    monkeypatch.setattr(F, "_function", function)
    # The wgmma kernels' gate (the layout probe) has its own tests (test_wgmma_probe.py).
    monkeypatch.setattr(F, "_wgmma_layouts_read_right", lambda device_index: True)
    FH._host_launch(monkeypatch, (9, 0) if pipelined else (7, 5))
    monkeypatch.setattr(F, "_tokens", FH._host_tokens)
    return calls


# ---------------------------------------------------------------------------------------------
# The instructions themselves: cvt through common.cu's conversions, mma through the kernel's
# na_mma16816, each in a small extra kernel appended to the NVRTC text
# ---------------------------------------------------------------------------------------------

PROBE = r"""
__global__ void emu_convert(const float* x, na_half* h, na_bf16* b, float* h_back, float* b_back,
                            int* h_pair, int* b_pair, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        h[i] = NaConvert<na_half>::from(x[i]);
        b[i] = NaConvert<na_bf16>::from(x[i]);
        h_back[i] = na_to_float(h[i]);
        b_back[i] = na_to_float(b[i]);
        h_pair[i] = (int)na_pack2(x[i], -x[i], na_half());
        b_pair[i] = (int)na_pack2(x[i], -x[i], na_bf16());
    }
}
__global__ void emu_widen(const na_half* h, float* out, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = na_to_float(h[i]);
}
__global__ void emu_mma(const int* a, const int* b, const float* c, float* d, int bf16) {
    const int lane = threadIdx.x;
    unsigned int ra[4], rb[2];
    float acc[4];
    for (int r = 0; r < 4; ++r) ra[r] = (unsigned int)a[lane * 4 + r], acc[r] = c[lane * 4 + r];
    for (int r = 0; r < 2; ++r) rb[r] = (unsigned int)b[lane * 2 + r];
    if (bf16) na_mma16816(acc, ra, rb, na_bf16());
    else na_mma16816(acc, ra, rb, na_half());
    for (int r = 0; r < 4; ++r) d[lane * 4 + r] = acc[r];
}
__global__ void emu_ldmatrix(const na_half* src, int* out, int trans) {
    extern __shared__ __align__(16) unsigned char sm[];
    na_half* s = reinterpret_cast<na_half*>(sm);
    for (int i = threadIdx.x; i < 256; i += 32) s[i] = src[i];
    __syncwarp();
    const unsigned int a = (unsigned int)__cvta_generic_to_shared(s + threadIdx.x * 8);
    unsigned int r0, r1, r2, r3;
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
    out[threadIdx.x * 4 + 0] = (int)r0;
    out[threadIdx.x * 4 + 1] = (int)r1;
    out[threadIdx.x * 4 + 2] = (int)r2;
    out[threadIdx.x * 4 + 3] = (int)r3;
}
__global__ void emu_cp_async(const float* src, float* seen) {
    extern __shared__ __align__(16) unsigned char sm[];
    float* s = reinterpret_cast<float*>(sm);
    const int t = threadIdx.x;
    const unsigned int a0 = (unsigned int)__cvta_generic_to_shared(s + t * 4);
    const unsigned int a1 = (unsigned int)__cvta_generic_to_shared(s + 128 + t * 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(a0), "l"(src + t * 4));
    asm volatile("cp.async.commit_group;" ::);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(a1), "l"(src + 128 + t * 4), "r"(t % 2 ? 8 : 0));
    asm volatile("cp.async.commit_group;" ::);
    for (int stage = 0; stage < 3; ++stage) {
        if (stage == 1) asm volatile("cp.async.wait_group %0;" :: "n"(1));
        if (stage == 2) asm volatile("cp.async.wait_all;" ::);
        for (int e = 0; e < 4; ++e) {
            seen[stage * 256 + t * 4 + e] = s[t * 4 + e];
            seen[stage * 256 + 128 + t * 4 + e] = s[128 + t * 4 + e];
        }
    }
}
__global__ void emu_ex2(const float* x, float* y, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y[i]) : "f"(x[i]));
}
"""


@pytest.fixture(scope="module")
def probe(request, tmp_path_factory):
    source = _loader.source_text(F.SOURCE, F.DEFINES) + PROBE
    names = ("emu_convert", "emu_widen", "emu_mma", "emu_ldmatrix", "emu_cp_async", "emu_ex2")
    return build.HostLibrary.build(F, {f"run_{n}": n for n in names},
                                   build.cache_dir(request, tmp_path_factory), source=source)


def _bits16(t):
    return t.view(torch.int16).to(torch.int32) & 0xffff


def test_cvt_matches_ieee_round_to_nearest_even(probe):
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 65504.0, 65519.99, 65520.0, 65536.0,
               2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * (1 + 2 ** -20), 3 * 2.0 ** -26,
               2.0 ** -14 - 2.0 ** -25, 2.0 ** -14, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -9,
               1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 3.3895e38, 3.4028235e38, 1e-45, -1e-40]
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2 ** 32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    x = torch.cat([torch.tensor(special, dtype=torch.float32),
                   torch.from_numpy(random_bits.view(np.float32).copy())])
    n = x.numel()
    h, b = torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)
    h_back, b_back = torch.empty(n), torch.empty(n)
    h_pair, b_pair = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    probe["run_emu_convert"]((1,), (32,), (x, h, b, h_back, b_back, h_pair, b_pair, np.int32(n)))
    nan = torch.isnan(x)
    # PyTorch's conversions are IEEE round-to-nearest-even (overflow to inf, subnormals kept).
    assert torch.equal(_bits16(h)[~nan], _bits16(x[~nan].to(torch.float16)))
    assert torch.equal(_bits16(b)[~nan], _bits16(x[~nan].to(torch.bfloat16)))
    assert (_bits16(h)[nan] == 0x7fff).all() and (_bits16(b)[nan] == 0x7fff).all()
    # Back to f32 exactly; the x2 forms put their first source (hi = -x) in the upper half.
    assert torch.equal(h_back[~nan], h[~nan].float()) and torch.isnan(h_back[nan]).all()
    assert torch.equal(b_back[~nan], b[~nan].float())
    for pair, one in ((h_pair, h), (b_pair, b)):
        assert torch.equal(pair & 0xffff, _bits16(one))
        neg = (-x).to(one.dtype)
        assert torch.equal(((pair >> 16) & 0xffff)[~nan], _bits16(neg)[~nan])


def test_cvt_f16_to_f32_every_half(probe):
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    out = torch.empty(halves.numel())
    probe["run_emu_widen"]((1,), (32,), (halves, out, np.int32(halves.numel())))
    nan = torch.isnan(halves)
    assert torch.equal(out[~nan], halves[~nan].float()) and torch.isnan(out[nan]).all()


def _isa_fragments(A, B):
    """Per-lane registers from the PTX ISA's m16n8k16 tables (written out here independently of
    ptx.h): A element a_i of lane (group, tig) at row group (+8 for i in 2,3,6,7), column
    2 tig + (i & 1) (+8 for i >= 4); B element b_i at row 2 tig + (i & 1) (+8 for i >= 2),
    column group; element 2j in the low half of register j."""
    bits = lambda t: int(t.view(torch.int16)) & 0xffff
    a_regs, b_regs = np.zeros((32, 4), np.int64), np.zeros((32, 2), np.int64)
    for lane in range(32):
        group, tig = divmod(lane, 4)
        for i in range(8):
            row = group + (8 if i in (2, 3, 6, 7) else 0)
            col = 2 * tig + (i & 1) + (8 if i >= 4 else 0)
            a_regs[lane, i // 2] |= bits(A[row, col]) << (16 * (i % 2))
        for i in range(4):
            row = 2 * tig + (i & 1) + (8 if i >= 2 else 0)
            b_regs[lane, i // 2] |= bits(B[row, group]) << (16 * (i % 2))
    as_i32 = lambda r: torch.from_numpy(r.astype(np.uint32).view(np.int32).copy())
    return as_i32(a_regs), as_i32(b_regs)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_mma_m16n8k16_against_isa_tables(probe, dtype):
    g = torch.Generator().manual_seed(3)
    A = torch.randn(16, 16, generator=g).to(dtype)
    B = torch.randn(16, 8, generator=g).to(dtype)
    C = torch.randn(16, 8, generator=g)
    a_regs, b_regs = _isa_fragments(A, B)
    # Accumulators: c_i of lane (group, tig) at row group (+8 for i >= 2), column 2 tig + (i & 1).
    pos = [(lane // 4 + (8 if i >= 2 else 0), 2 * (lane % 4) + (i & 1))
           for lane in range(32) for i in range(4)]
    c = torch.tensor([float(C[r, k]) for r, k in pos])
    d = torch.full((128,), math.nan)
    probe["run_emu_mma"]((1,), (32,), (a_regs, b_regs, c, d, np.int32(dtype == torch.bfloat16)))
    expect = A.double() @ B.double() + C.double()
    got = torch.full((16, 8), math.nan, dtype=torch.float64)
    for (r, k), value in zip(pos, d.tolist()):
        got[r, k] = value
    torch.testing.assert_close(got, expect, rtol=2 ** -23, atol=1e-6)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_x4(probe, trans):
    # Four 8x8 matrices of distinct halves; lane l gives the address of row l (matrix l // 8).
    src = torch.arange(256, dtype=torch.float32).to(torch.float16)
    out = torch.zeros(128, dtype=torch.int32)
    probe["run_emu_ldmatrix"]((1,), (32,), (src, out, np.int32(trans)), shared_mem=512)
    mats = src.view(4, 8, 8)
    for lane in range(32):
        for m in range(4):
            # PTX ISA: without .trans lane l holds row l/4, columns 2(l%4), 2(l%4)+1 of matrix m;
            # .trans gives the transposed matrix's.
            mat = mats[m].t() if trans else mats[m]
            row, col = lane // 4, 2 * (lane % 4)
            expect = (int(_bits16(mat[row, col:col + 1])) | (int(_bits16(mat[row, col + 1:col + 2]))
                                                            << 16))
            assert int(out[lane * 4 + m]) & 0xffffffff == expect, (lane, m)


def test_cp_async_lands_only_when_waited_for(probe):
    src = torch.arange(1, 257, dtype=torch.float32)
    seen = torch.zeros(3, 256)
    probe["run_emu_cp_async"]((1,), (32,), (src, seen), shared_mem=1024)
    first, second = slice(0, 128), slice(128, 256)
    assert torch.isnan(seen[0]).all()  # nothing waited for: still the poisoned shared memory
    assert torch.equal(seen[1, first], src[first]) and torch.isnan(seen[1, second]).all()
    # Group 2: odd threads copied 8 of 16 bytes (the rest zero-filled), even threads 0 bytes.
    expect = src[second].clone().view(32, 4)
    expect[0::2] = 0
    expect[1::2, 2:] = 0
    assert torch.equal(seen[2, first], src[first]) and torch.equal(seen[2, second].view(32, 4),
                                                                   expect)


def test_ex2_approx_ftz_as_the_isa_says(probe):
    """ex2.approx.ftz.f32: 2^x within the ISA's 2^-22 relative error (float64 reference), -inf
    gives +0, +inf gives +inf, NaN stays NaN, subnormal inputs read as 0 (2^0 = 1) and subnormal
    results flush to +0."""
    tiny = torch.tensor([1e-40, -1e-40]).float()  # subnormal inputs
    normal = torch.linspace(-126, 127, 501)
    x = torch.cat([torch.tensor([-math.inf, math.inf, math.nan, -149.5, -127.5]), tiny, normal])
    y = torch.full_like(x, 7.0)
    probe["run_emu_ex2"]((1,), (32,), (x, y, np.int32(x.numel())))
    assert y[0].item() == 0.0 and not math.copysign(1.0, y[0].item()) < 0
    assert y[1].item() == math.inf and math.isnan(y[2].item())
    assert y[3].item() == 0.0 and y[4].item() == 0.0  # 2^-149.5, 2^-127.5: subnormal, flushed
    assert torch.equal(y[5:7], torch.ones(2))
    ref = torch.exp2(normal.double())
    assert ((y[7:].double() - ref).abs() <= ref * 2.0 ** -22).all()


# ---------------------------------------------------------------------------------------------
# The 16-bit oracle comparison of one case
# ---------------------------------------------------------------------------------------------

def lowp_baseline(q, k, v, dout, vis, scale, softcap=None, bias=None):
    """(out, dq, dk, dv) of a plain computation in the inputs' dtype (token-major)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = oracle.plain_lowp_attention(*leaves, vis, layout="bshd", scale=scale, softcap=softcap,
                                      bias=bias)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout))


def compare_all(got, ref, base, dtype, names=("out", "dq", "dk", "dv")) -> list[str]:
    failures = []
    for name, g, r, b in zip(names, got, ref, base):
        failures += lowp.compare(name, g, r, b, dtype, 2.0 if name == "out" else 3.0)
    return failures


# name -> spatial, kernel, stride, dilation, causal, H, H_kv, D_qk, D_v, extra
NA_CASES = {
    "1d-rpb": ((20,), (5,), (1,), (1,), (False,), 2, 2, 16, 16, {"rpb": True}),
    "1d-multitile-stride-dilation": ((90,), (7,), (2,), (2,), (False,), 1, 1, 16, 16, {}),
    "2d-gqa-dv-causal": ((9, 10), (3, 5), (1, 2), (2, 1), (False, True), 4, 2, 12, 20, {}),
    "3d-causal": ((4, 6, 6), (3, 3, 3), (1, 1, 2), (1, 2, 1), (True, False, False), 1, 1, 8, 8,
                  {}),
    "2d-softcap-hd64-rpb": ((7, 8), (3, 5), (1, 1), (1, 1), (False, False), 2, 1, 40, 24,
                            {"softcap": 1.5, "rpb": True}),
}


# Head dim 128 (the pipelined dQ's single-buffer path), for the pipelined build only.
PIPELINED_EXTRA = {
    "1d-hd128-gqa-dv": ((24,), (5,), (1,), (1,), (False,), 2, 1, 96, 128, {}),
    # Several key tiles per query tile: the K/V ring wraps around (3 stages at D <= 64).
    "1d-long-window": ((300,), (151,), (1,), (1,), (False,), 1, 1, 16, 16, {}),
    "2d-many-tiles-causal": ((24, 40), (9, 21), (1, 2), (1, 1), (True, False), 1, 1, 32, 32, {}),
}


# The wide kernels' part-tile key steps (16 keys at head dim 128, 32 at 64) over several key
# tiles, whole ones among them: the odometer and the whole-tile path past the first part.
WIDE_EXTRA = {
    "1d-hd64-whole-tiles": ((400,), (255,), (1,), (1,), (False,), 1, 1, 64, 48, {}),
    "1d-hd128-whole-tiles": ((300,), (201,), (1,), (1,), (False,), 1, 1, 128, 112, {}),
}


def neighborhood_failures(name, dtype, backward=True, scale=None) -> list[str]:
    """Run case ``name`` through na_forward/na_backward (routed to a host library) in ``dtype``;
    the oracle comparison's failures."""
    spatial, kernel, stride, dilation, causal, H, Hkv, Dqk, Dv, extra = {
        **NA_CASES, **PIPELINED_EXTRA, **WIDE_EXTRA}[name]
    g = torch.Generator().manual_seed(len(name))
    B, N = 2, math.prod(spatial)
    rnd = lambda *s: FH.rand(s, g).to(dtype)
    q, k, v = rnd(B, *spatial, H, Dqk), rnd(B, *spatial, Hkv, Dqk), rnd(B, *spatial, Hkv, Dv)
    dout = rnd(B, *spatial, H, Dv)
    rpb = FH.rand((H, *(2 * x - 1 for x in kernel)), g) if extra.get("rpb") else None
    softcap = extra.get("softcap")
    scale = 0.7 / math.sqrt(Dqk) if scale is None else scale
    geom = {"kernel_size": kernel, "stride": stride, "dilation": dilation, "is_causal": causal,
            "scale": scale}
    out, lse = F.na_forward(q, k, v, rpb=rpb, softcap=softcap,
                            out=lowp.nan_like(B, *spatial, H, Dv, dtype=dtype),
                            lse=lowp.nan_like(B, *spatial, H, dtype=torch.float32), **geom)
    vis = oracle.build_visibility(1, N, N, neighborhood={
        "spatial_shape": spatial, "kernel_size": kernel, "stride": stride, "dilation": dilation,
        "is_causal": causal})
    tok = lambda t: t.reshape(B, N, *t.shape[-2:])
    bias = (FH.dense_rpb(rpb, spatial, kernel, dilation, vis[0].numpy()) if rpb is not None
            else None)
    ref = FH.reference(tok(q), tok(k), tok(v), tok(dout), vis, scale, softcap, bias)
    base = lowp_baseline(tok(q), tok(k), tok(v), tok(dout), vis, scale, softcap, bias)
    failures = compare_all([tok(out)], [ref[0]], base[:1], dtype)
    failures += lowp.lse_failures(lse.reshape(B, N, H), ref[1])
    if not backward:
        return failures
    if rpb is not None:  # na_backward has no rpb: the gradients are checked without it
        out, lse = F.na_forward(q, k, v, softcap=softcap, **geom)
        ref = FH.reference(tok(q), tok(k), tok(v), tok(dout), vis, scale, softcap)
        base = lowp_baseline(tok(q), tok(k), tok(v), tok(dout), vis, scale, softcap)
    grads = F.na_backward(q, k, v, out, lse, dout, softcap=softcap, **geom)
    return failures + compare_all([tok(x) for x in grads], ref[2:], base[1:], dtype,
                                  ("dq", "dk", "dv"))


# name -> S_q, S_kv, mask (see test_fused_kernels_host._band), H, H_kv, D_qk, D_v, softcap
BAND_CASES = {
    "dense-gqa": (37, 50, None, 2, 1, 16, 16, None),
    "causal-bottom-right-empty-rows": (30, 20, "causal-br", 2, 2, 16, 24, None),
    "sliding-window-softcap-multitile": (70, 70, (5, 3, "top_left"), 1, 1, 8, 8, 3.0),
}


def band_failures(name, dtype) -> list[str]:
    Sq, Skv, mask, H, Hkv, Dqk, Dv, softcap = BAND_CASES[name]
    B = 2
    g = torch.Generator().manual_seed(len(name) + 100)
    q, k = (FH._heads_first(s, g).to(dtype) for s in ((B, Sq, H, Dqk), (B, Skv, Hkv, Dqk)))
    v, dout = (FH._heads_first(s, g).to(dtype) for s in ((B, Skv, Hkv, Dv), (B, Sq, H, Dv)))
    table, vis_kw = FH._band(Sq, Skv, mask)
    boxes = F.choose_tiles(tuple(table), 1)
    scale = 1.0 / math.sqrt(Dqk)
    out = lowp.nan_like(B, H, Sq, Dv, dtype=dtype).transpose(1, 2)
    lse = lowp.nan_like(B, H, Sq, dtype=torch.float32).transpose(1, 2)
    F.run_forward(q, k, v, out, lse, table, boxes, scale, softcap or 0.0)
    delta = F.backward_delta(out, dout, lse)
    dq, dk, dv = (lowp.nan_like(B, h, S, D, dtype=dtype).transpose(1, 2)
                  for h, S, D in ((H, Sq, Dqk), (Hkv, Skv, Dqk), (Hkv, Skv, Dv)))
    F.run_backward(q, k, v, dout, lse, delta, dq, dk, dv, table, boxes, scale, softcap or 0.0)
    vis = oracle.build_visibility(1, Sq, Skv, **vis_kw)
    ref = FH.reference(q, k, v, dout, vis, scale, softcap)
    base = lowp_baseline(q, k, v, dout, vis, scale, softcap)
    failures = compare_all([out, dq, dk, dv], [ref[0], *ref[2:]], base, dtype)
    failures += lowp.lse_failures(lse, ref[1])
    if mask == "causal-br" and Sq > Skv:  # rows that see nothing: exact zeros, -inf
        empty = Sq - Skv
        if not (torch.equal(out[:, :empty].float(), torch.zeros_like(out[:, :empty].float()))
                and torch.isneginf(lse[:, :empty]).all()):
            failures.append("rows that see no key are not 0 / -inf")
    return failures


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("name", list(NA_CASES))
def test_fused_neighborhood_16bit(lib16, monkeypatch, name, dtype):
    calls = route_fused(monkeypatch, lib16)
    assert neighborhood_failures(name, dtype) == []
    assert set(calls) == set(F.KERNELS)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("name", list(BAND_CASES))
def test_fused_band_16bit(lib16, monkeypatch, name, dtype):
    route_fused(monkeypatch, lib16)
    assert band_failures(name, dtype) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("name", list(NA_CASES) + list(PIPELINED_EXTRA) + list(BAND_CASES))
def test_fused_pipelined_16bit(lib16_pipelined, monkeypatch, name, dtype):
    """The sm_80+ build, chosen for fp16/bf16 on an sm_90 device, under the same oracle rule."""
    calls = route_fused(monkeypatch, lib16_pipelined, pipelined=True)
    failures = (band_failures(name, dtype) if name in BAND_CASES
                else neighborhood_failures(name, dtype))
    assert failures == []
    # Forward, dQ and dK/dV: each the 64-slot kernel or the wide one, as the tile model chose
    # (the forward and dQ by one rule); delta always.
    launched = set(calls)
    assert "na_fused_backward_delta" in launched
    for pair in zip(F.KERNELS[:3], F.WIDE_KERNELS):  # each 64-slot kernel and its wide one
        assert len(launched & set(pair)) == 1
    assert (F.WIDE_FORWARD in launched) == (F.WIDE_DQ in launched)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("name", list(NA_CASES) + list(PIPELINED_EXTRA) + list(WIDE_EXTRA))
def test_wide_kernels_16bit(lib16_pipelined, monkeypatch, name, dtype):
    """The wide kernels on every neighborhood case, chosen whatever the tile model would say:
    forward and dQ over 128-query boxes (key steps of 32 at head dim 128 for the forward, of
    64/32/16 at 32/64/128 for dQ), dK/dV over 128-key boxes up to head dim 64 (query steps of 32
    and 16 at 32 and 64; at 128 the 64-key kernel)."""
    from cudnn_attn.fallback_kernels import tile_model

    calls = route_fused(monkeypatch, lib16_pipelined, pipelined=True)
    monkeypatch.setattr(tile_model, "forward_tiles", tile_model.wide_tiles)
    monkeypatch.setattr(tile_model, "dkdv_tiles", tile_model.wide_key_tiles)
    assert neighborhood_failures(name, dtype) == []
    _, _, _, _, _, _, _, Dqk, Dv, _ = {**NA_CASES, **PIPELINED_EXTRA, **WIDE_EXTRA}[name]
    wide_dkdv = F.head_dim_bucket(Dqk, Dv) in F.WIDE_DKDV_HEAD_DIMS
    assert set(calls) == {F.WIDE_FORWARD, F.WIDE_DQ, "na_fused_backward_delta",
                          F.WIDE_DKDV if wide_dkdv else "na_fused_backward_dkdv"}


# The Hopper kernels (wgmma; head dims 64 and 128): the 64-query and the wide forward, and the
# 64-query dQ under a whole backward: masked and whole tiles, bias and softcap, part-tile key
# steps over several tiles, uneven head dims.
HOPPER_CASES = ("2d-softcap-hd64-rpb", "1d-hd128-gqa-dv", "1d-hd64-whole-tiles",
                "1d-hd128-whole-tiles")
HOPPER_BOXES = {"na_fused_forward_wgmma": "choose_tiles", "na_fused_forward_wide_wgmma": "wide_tiles",
                "na_fused_backward_dq_wgmma": "choose_tiles",
                "na_fused_backward_dq_wide_wgmma": "wide_tiles",
                "na_fused_backward_dkdv_wgmma": "choose_tiles"}
HOPPER_BACKWARD = ("na_fused_backward_dq_wgmma", "na_fused_backward_dkdv_wgmma")
# A whole backward per box choice: the kernels it launches (with the delta pass).
HOPPER_BACKWARDS = {
    "backward": {"na_fused_forward_wgmma", *HOPPER_BACKWARD, "na_fused_backward_delta"},
    "backward-wide": {"na_fused_forward_wide_wgmma", "na_fused_backward_dq_wide_wgmma",
                      "na_fused_backward_dkdv_wgmma", "na_fused_backward_delta"}}


@pytest.fixture(scope="module")
def lib16_hopper(request, tmp_path_factory):
    """The wgmma kernels and the backward's delta (whose bucket is D_v's alone), from the text
    NVRTC compiles for sm_90a."""
    exprs = [v.expression for v in F.hopper_variants()] + [
        F.expression("na_fused_backward_delta", dt, hd) for dt in DTYPES for hd in F.HEAD_DIMS]
    return build.host_library(request, tmp_path_factory, F, exprs,
                              source=_loader.source_text(F.SOURCE, F.HOPPER_DEFINES))


@pytest.mark.parametrize("kernel", list(HOPPER_BOXES)[:2] + list(HOPPER_BACKWARDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("name", HOPPER_CASES)
def test_hopper_kernels_16bit(lib16_hopper, monkeypatch, name, dtype, kernel):
    """Opted in on an sm_90 device, the forwards, dQ and dK/dV at head dim 64/128 run on wgmma
    (K, V, and Q and dO where they are B operands, through 128-byte-swizzle descriptors, K-major
    or MN-major; Q from A fragments or, wide, from swizzled shared memory; P, dS and their
    transposes from registers), under the oracle rule of every fused kernel."""
    from cudnn_attn.fallback_kernels import tile_model

    monkeypatch.setenv(F.HOPPER_ENV, "1")
    calls = route_fused(monkeypatch, lib16_hopper, pipelined=True)
    backward = kernel in HOPPER_BACKWARDS
    boxes = HOPPER_BOXES[{"backward": "na_fused_forward_wgmma",
                          "backward-wide": "na_fused_forward_wide_wgmma"}.get(kernel, kernel)]
    monkeypatch.setattr(tile_model, "forward_tiles", getattr(tile_model, boxes))
    monkeypatch.setattr(tile_model, "dkdv_tiles", tile_model.choose_tiles)
    assert neighborhood_failures(name, dtype, backward=backward) == []
    assert set(calls) == HOPPER_BACKWARDS.get(kernel, {kernel})


def test_hopper_forward_selection(monkeypatch):
    """Off unless opted in; sm_90 only (its sm_90a cubins run nowhere else); the pipelined
    build's fp16/bf16 at head dims 64 and 128; compiled for sm_90a by the prebuild."""
    from cudnn_attn import fallback_kernels

    monkeypatch.delenv(F.HOPPER_ENV, raising=False)
    monkeypatch.delenv("CUDNN_ATTN_FUSED_PIPELINED", raising=False)
    assert not F.hopper(torch.bfloat16, (9, 0), 128)
    monkeypatch.setenv(F.HOPPER_ENV, "1")
    assert F.hopper(torch.bfloat16, (9, 0), 128) and F.hopper(torch.float16, (9, 0), 64)
    assert not F.hopper(torch.bfloat16, (10, 0), 128)  # wgmma is sm_90 only
    assert not F.hopper(torch.bfloat16, (8, 0), 128)
    assert not F.hopper(torch.bfloat16, (9, 0), 32) and not F.hopper(torch.float32, (9, 0), 64)
    monkeypatch.setenv("CUDNN_ATTN_FUSED_PIPELINED", "0")
    assert not F.hopper(torch.bfloat16, (9, 0), 128)
    assert F.hopper_twin("na_fused_forward") == "na_fused_forward_wgmma"
    assert F.hopper_twin(F.WIDE_FORWARD) == "na_fused_forward_wide_wgmma"
    assert "fused_hopper" in fallback_kernels.kernel_programs("sm_90")
    assert "fused_hopper" not in fallback_kernels.kernel_programs("sm_100")
    assert "fused_hopper" not in fallback_kernels.kernel_programs("sm_80")
    assert fallback_kernels.target_arch("fused_hopper", "sm_90") == "sm_90a"
    for hd in F.HOPPER_HEAD_DIMS:
        # The 64-query forward: Q's padded rows, the ring's stages of 64 keys unpadded, slots.
        stages = 2 if hd == 128 else 3
        total = (64 * (hd + 8) + 2 * stages * 64 * hd) * 2 + 64 * 32 + 1024
        assert F.smem_bytes("na_fused_forward_wgmma", torch.bfloat16, hd, True) == total
        # The wide one: Q (128 rows) and three (K, V) steps, all unpadded, the query slots.
        step = {64: 64, 128: 32}[hd]
        total = (128 + 2 * 3 * step) * hd * 2 + 128 * 32 + 1024
        assert F.smem_bytes("na_fused_forward_wide_wgmma", torch.bfloat16, hd, True) == total
        assert total <= 99 * 1024


# ---------------------------------------------------------------------------------------------
# Unfused kernels (fp32 accumulation, one rounding at the store)
# ---------------------------------------------------------------------------------------------

UNFUSED_CASES = ("1d-dilated", "2d-causal-one-axis", "3d", "3d-causal-last")


@pytest.fixture(scope="module")
def unfused16(request, tmp_path_factory):
    exprs = [v.expression for v in U.variants() if v.expression.endswith(("<na_half>", "<na_bf16>"))]
    assert len(exprs) == 8  # 4 kernels x {half, bf16}
    return build.host_library(request, tmp_path_factory, U, exprs)


def unfused_failures(got, ref, dtype) -> list[str]:
    """Each 16-bit output within one ulp of the float64 value (plus fp32 accumulation slack),
    and rounded without bias; drpb (fp32) within 1e-4."""
    failures = []
    for name, r in ref.items():
        g = got[name]
        if torch.isnan(g).any():
            failures.append(f"{name}: NaN (an unwritten element or a read invalid slot)")
            continue
        finite = torch.isfinite(r)
        if not torch.equal(torch.isfinite(g), finite) or not torch.equal(g[~finite].double(),
                                                                        r[~finite]):
            failures.append(f"{name}: -inf slots differ")
            continue
        g, r = g[finite].double(), r[finite]
        if name == "drpb":
            ok = torch.allclose(g, r, rtol=1e-5, atol=1e-4)
        else:
            ok = bool(((g - r).abs() <= lowp.EPS[dtype] * r.abs() + 1e-4).all())
            bias, n = lowp.rounding_bias(g, r, dtype)
            if n >= 200 and abs(bias) > lowp.BIAS_LIMIT:
                failures.append(f"{name}: rounding bias {bias:+.3f} ulp over {n} elements")
        if not ok:
            failures.append(f"{name}: max error {float((g - r).abs().max()):.3g}")
    return failures


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("name", UNFUSED_CASES)
def test_unfused_16bit(unfused16, monkeypatch, name, dtype):
    monkeypatch.setattr(UH.HostLaunch, "lib", unfused16)
    monkeypatch.setattr(UH.HostLaunch, "calls", [])
    monkeypatch.setattr(U, "_Launch", UH.HostLaunch)
    monkeypatch.setattr(U, "_check_tensor", UH._cpu_check_tensor)
    spatial, kernel, dilation, causal = UH.CASES[name]
    x = UH.inputs(spatial, kernel, dilation, causal, dtype, B=2, H=3, D=5,
                  use_rpb=UH._rpb_allowed(kernel, causal))
    ref = UH.references(spatial, kernel, dilation, causal,
                        {n: (t.double() if t is not None else None) for n, t in x.items()})
    got = UH.run_all(U, spatial, kernel, dilation, causal, x)
    assert set(got) == set(ref)
    assert all(got[n].dtype == (torch.float32 if n == "drpb" else dtype) for n in got)
    assert unfused_failures(got, ref, dtype) == []


@pytest.mark.parametrize("scale", [-12.0, 0.0, 0.05])
def test_pipelined_any_scale(lib16_pipelined, monkeypatch, scale):
    """Whole tiles of a positive scale fold it into the softmax's FMA (the row max of the raw
    scores); a scale <= 0 must take the multiply-first path (folding -12 would shift by the
    smallest logit and overflow ex2): both against the oracle, over whole and masked tiles."""
    route_fused(monkeypatch, lib16_pipelined, pipelined=True)
    assert neighborhood_failures("1d-long-window", torch.bfloat16, scale=scale) == []


def test_pipelined_build_selection(monkeypatch):
    """fp16/bf16 on sm_80+ take the pipelined build, fp32 never; the switch turns it off; every
    kernel's ring stays within the shared-memory limit."""
    monkeypatch.delenv("CUDNN_ATTN_FUSED_PIPELINED", raising=False)
    assert F.pipelined(torch.float16, (8, 0)) and F.pipelined(torch.bfloat16, (9, 0))
    assert not F.pipelined(torch.float16, (7, 5)) and not F.pipelined(torch.float32, (9, 0))
    monkeypatch.setenv("CUDNN_ATTN_FUSED_PIPELINED", "0")
    assert not F.pipelined(torch.bfloat16, (9, 0))
    for hd in F.HEAD_DIMS:
        # The query-major kernels (forward, dQ): one own tile (Q or dO), a ring of (K, V)
        # stages of 64 rows each, 32 bytes per query slot.
        stages = 2 if hd == 128 else 3
        ring = (64 + 2 * 64 * stages) * (hd + 8) * 2 + 64 * 32
        for kernel in ("na_fused_forward", "na_fused_backward_dq"):
            assert F.smem_bytes(kernel, torch.float16, hd, pipelined=True) == ring
        assert ring <= 99 * 1024
        # dK/dV: K and V of the key box, then a ring of steps (Q and dO rows, 40 bytes per
        # query for its slot, lse and delta): 32 queries x 3 stages at 128, 64 x 2 at 64, 64 x 3.
        qstep, stages = {32: (64, 3), 64: (64, 2), 128: (32, 3)}[hd]
        dkdv = 2 * 64 * (hd + 8) * 2 + stages * (2 * qstep * (hd + 8) * 2 + 40 * qstep)
        assert F.smem_bytes("na_fused_backward_dkdv", torch.float16, hd, pipelined=True) == dkdv
        assert dkdv <= 99 * 1024
    assert {v.expression for v in F.pipelined_variants()} == set(
        fused_expressions(head_dims=F.HEAD_DIMS))
    assert {v.expression for v in F.wide_variants()} == set(
        fused_expressions(head_dims=F.HEAD_DIMS, kernels=F.WIDE_KERNELS))
    for hd, (fwd_step, dq_step) in {32: (64, 32), 64: (64, 32), 128: (32, 16)}.items():
        # The wide kernels: 128-query own tiles (forward: Q; dQ: dO and Q), three (K, V) steps.
        for kernel, own, step in ((F.WIDE_FORWARD, 1, fwd_step), (F.WIDE_DQ, 2, dq_step)):
            total = (own * 128 + 2 * 3 * step) * (hd + 8) * 2 + 128 * 32
            assert F.smem_bytes(kernel, torch.bfloat16, hd, pipelined=True) == total
            assert total <= 99 * 1024
    for hd, qstep in {32: 32, 64: 16}.items():
        # The wide dK/dV: K and V of 128 keys, three stages of (Q, dO) rows and 40 bytes a query.
        total = 2 * 128 * (hd + 8) * 2 + 3 * (2 * qstep * (hd + 8) * 2 + 40 * qstep)
        assert F.smem_bytes(F.WIDE_DKDV, torch.float16, hd, pipelined=True) == total
    assert not F.wide(torch.bfloat16, (9, 0))  # the switch above: no pipelined build at all
    monkeypatch.delenv("CUDNN_ATTN_FUSED_PIPELINED")
    assert F.wide(torch.bfloat16, (9, 0)) and not F.wide(torch.bfloat16, (8, 0))
    assert not F.wide(torch.float32, (9, 0))


@pytest.mark.parametrize("name", ["2d-gqa-dv-causal", "1d-hd128-gqa-dv"])
def test_pipelined_eager_cp_async(lib16_pipelined, monkeypatch, name):
    """The pipelined build with every cp.async landing at once (the other legal extreme)."""
    monkeypatch.setenv("NA_EMU_CP_ASYNC_EAGER", "1")
    route_fused(monkeypatch, lib16_pipelined, pipelined=True)
    assert neighborhood_failures(name, torch.bfloat16) == []


def test_pipelined_real_threads(request, tmp_path_factory, monkeypatch):
    """The pipelined fp16 build with every block on 128 real std::threads: mma/ldmatrix
    rendezvous, cp.async waits and barriers under the OS scheduler rather than the fibers'
    fixed order."""
    exprs = [F.expression(k, torch.float16, 32) for k in F.KERNELS]
    lib = build.host_library(request, tmp_path_factory, F, exprs, real_threads=True,
                             source=_loader.source_text(F.SOURCE, F.PIPELINED_DEFINES))
    route_fused(monkeypatch, lib, pipelined=True)
    assert neighborhood_failures("1d-rpb", torch.float16) == []
