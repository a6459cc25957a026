"""GPU (marked): issue 28's hostile numbers on the engines only a GPU runs, and the cubin cache
with real NVRTC output.

* Every sign of ``scale`` with causal and sliding-window masks on cuDNN (fp16/bf16) and the CuPy
  kernels (fp32/fp16), forward and gradients, against the float64 oracle: a scale <= 0 must not
  turn a hidden ``-inf`` into ``+inf``/NaN (PyTorch's CPU flash kernel did).
* NaN and +inf bias entries at hidden pairs on cuDNN: hiding replaces the biased score, so no
  visible result (out, dq/dk/dv, dbias at visible entries) changes.
* A bias that is -inf on whole rows on cuDNN and CuPy: such rows 0 and gradients finite, as
  torch SDPA gives them (a probe of what cuDNN writes there: only lengths tell the engine now).
* A real compiled program round-trips through the signed cubin cache, and a forged entry (plain
  sha256) in its place is recompiled, never loaded.
"""

from __future__ import annotations

import math

import pytest
import torch
from oracle import build_visibility, reference_attention

import cudnn_attn as ca

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}
MASKS = {"causal": (ca.Causal(), {"causal": "top_left"}),
         "window": (ca.SlidingWindow(5, 2), {"window": (5, 2)})}


def _inputs(dtype, S=64, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, S, D, generator=g).to("cuda", dtype).requires_grad_()
            for _ in range(3)]


def _check(backend, dtype, mask_name, scale, bias=None, hidden_bias=None):
    mask, vis_kw = MASKS[mask_name]
    q, k, v = _inputs(dtype)
    S = q.shape[2]
    visible = build_visibility(1, S, S, **vis_kw)
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref_bias = None
    if bias is not None:
        ref_bias = bias.detach().double().cpu().requires_grad_()
        leaves.append(ref_bias)
    want, want_lse = reference_attention(*leaves[:3], visible, scale=scale, bias=ref_bias)
    used_bias = bias if hidden_bias is None else hidden_bias
    mine = [q, k, v] + ([used_bias.requires_grad_()] if used_bias is not None else [])
    out, lse = ca.attention(q, k, v, mask=mask, scale=scale, bias=used_bias, backend=backend,
                            return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any(), "NaN"
    tol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), want.detach(), atol=tol, rtol=tol)
    g = torch.Generator().manual_seed(1)
    d_out = torch.randn(want.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, mine, d_out.to("cuda", dtype))
    expected = torch.autograd.grad(want, leaves, d_out)
    for name, a, e in zip(("q", "k", "v", "bias"), got, expected):
        a = a.double().cpu()
        if name == "bias":
            seen = visible[0].expand_as(a)
            assert torch.isfinite(a[seen]).all(), "dbias not finite where visible"
            torch.testing.assert_close(a[seen], e[seen], atol=4 * tol, rtol=4 * tol)
        else:
            assert not a.isnan().any(), f"NaN in d{name}"
            torch.testing.assert_close(a, e, atol=4 * tol, rtol=4 * tol, msg=f"d{name}")


def _need(backend):
    reasons = ca.explain(*_inputs(torch.float16), mask=ca.Causal(), backend=backend)[backend]
    if reasons not in ("selected", "available"):
        pytest.skip(f"{backend} cannot run here: {reasons}")


@pytest.mark.parametrize("scale", [-0.5, -0.01, 0.0, 0.125])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cudnn_takes_any_scale(dtype, mask_name, scale):
    _need("cudnn")
    _check("cudnn", dtype, mask_name, scale)


@pytest.mark.parametrize("scale", [-0.5, 0.0, 0.125])
@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cupy_takes_any_scale(dtype, mask_name, scale):
    _need("cupy")
    _check("cupy", dtype, mask_name, scale)


@pytest.mark.parametrize("poison", [math.nan, math.inf])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_cudnn_hidden_bias_entries_change_nothing(mask_name, poison):
    _need("cudnn")
    dtype = torch.float16
    S = 64
    _, vis_kw = MASKS[mask_name]
    visible = build_visibility(1, S, S, **vis_kw)[0]
    g = torch.Generator().manual_seed(3)
    clean = torch.randn(1, 1, S, S, generator=g).to("cuda", dtype)
    poisoned = clean.masked_fill(~visible.to("cuda"), poison)
    _check("cudnn", dtype, mask_name, 0.125, bias=clean, hidden_bias=poisoned)


def test_cubin_cache_round_trip_and_a_forged_entry(tmp_path, monkeypatch):
    import hashlib

    from cudnn_attn.fallback_kernels import _loader, cubin_cache
    from cudnn_attn.fallback_kernels import unfused as U

    monkeypatch.setenv("CUDNN_ATTN_CUBIN_CACHE", str(tmp_path / "cubins"))
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "key"))
    expressions = ("na_neighbor_gather<float>",)
    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    _loader._PROGRAMS.clear()
    first = _loader.compile_program(U.SOURCE, U.DEFINES, expressions, arch)
    (entry,) = (tmp_path / "cubins").glob("*.cubin")
    _loader._PROGRAMS.clear()
    assert _loader.compile_program(U.SOURCE, U.DEFINES, expressions, arch).cubin == first.cubin
    # A forged entry with a correct plain sha256 (the old format's only check) is not loaded.
    data = entry.read_bytes()
    body = data[:-32].replace(first.cubin, b"\x7fELF" + b"\0" * (len(first.cubin) - 4))
    entry.write_bytes(body + hashlib.sha256(body).digest())
    before = cubin_cache.info()["rejected"]
    _loader._PROGRAMS.clear()
    assert _loader.compile_program(U.SOURCE, U.DEFINES, expressions, arch).cubin == first.cubin
    assert cubin_cache.info()["rejected"] == before + 1
    _loader._PROGRAMS.clear()


# The engines that take a bias tensor (the CuPy kernels take none: the H200 run of 2026-11-29
# found that case declined, as it must be).
@pytest.mark.parametrize("backend", ["cudnn", "torch"])
def test_bias_rows_of_minus_inf_give_zero_rows_and_finite_gradients(backend):
    """An additive bias that is -inf on whole rows (a boolean mask turned into -inf by hand,
    padded query rows included) hides every key of those rows. torch SDPA gives such rows 0
    (its safe softmax) and so does the torch engine; cuDNN's forward is reported to write
    LSE = -inf there and its backward to turn exp(S - LSE) into NaN (cudnn-frontend #262), and
    the engine finds rows without keys only from a Padding's lengths. What a GPU gives here
    decides whether bias graphs need the same care."""
    _need(backend)
    dtype = torch.float16
    q, k, v = _inputs(dtype)
    S = q.shape[2]
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(2, 1, S, S, generator=g)
    bias[0, :, 40:] = -math.inf  # sequence 0: its query rows past 40 see no key
    bias[:, :, :, 50:] = -math.inf  # and no row sees the keys past 50
    out = ca.attention(q, k, v, bias=bias.to("cuda", dtype), backend=backend)
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=bias.double())
    assert not out.isnan().any(), "NaN in out"
    assert (out[0, :, 40:] == 0).all(), "rows without keys are not 0"
    tol = TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), want, atol=tol, rtol=tol)
    d_out = torch.randn(want.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), d_out.to("cuda", dtype))
    expected = torch.autograd.grad(want, leaves, d_out)
    for name, a, e in zip("qkv", got, expected):
        assert not a.isnan().any(), f"NaN in d{name}"
        torch.testing.assert_close(a.double().cpu(), e, atol=4 * tol, rtol=4 * tol,
                                   msg=lambda m, name=name: f"d{name}: {m}")
