"""GPU (marked): the unfused NA kernels (``fallback_kernels.unfused``) against a float64 brute force.

The slot layout of NATTEN 0.17's ``na*d_qk``/``na*d_av`` is built here from the oracle's per-axis
rule (slot t of an axis = the t-th key of the query's window; truncated causal windows fill the
first slots) and cross-checked against ``oracle.build_visibility``. References are float64
autograd on the inputs rounded to the tested dtype. Outputs are NaN-poisoned before each launch,
invalid slots of the inputs hold NaN (the kernels must never read them), and every launcher is
run twice to check bitwise repeatability. Skips where torch sees no CUDA device.
"""

import functools
import itertools
import math

import numpy as np
import oracle
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# name -> (spatial, kernel, dilation, causal, B, H, D); rpb runs where the kernel is odd and
# no axis is causal (NATTEN 0.17's restriction).
CASES = {
    "1d": ((17,), (5,), (1,), (False,), 2, 3, 24),
    "1d-dilated": ((19,), (3,), (4,), (False,), 1, 2, 7),
    "1d-causal": ((16,), (7,), (2,), (True,), 2, 2, 33),
    "1d-even": ((12,), (4,), (1,), (False,), 1, 2, 16),
    "1d-full": ((9,), (9,), (1,), (False,), 1, 1, 8),
    "2d": ((9, 11), (3, 5), (2, 1), (False, False), 2, 2, 16),
    "2d-causal-mixed": ((7, 9), (3, 4), (2, 1), (False, True), 1, 3, 40),
    "3d": ((5, 6, 7), (3, 3, 5), (1, 2, 1), (False, False, False), 1, 2, 8),
    "3d-causal": ((6, 5, 4), (3, 5, 3), (2, 1, 1), (True, False, True), 2, 1, 12),
}
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _uses_rpb(kernel, causal):
    return not any(causal) and all(k % 2 for k in kernel)


@functools.cache
def slot_tables(spatial, kernel, dilation, causal):
    """``keys[i, s]`` (flat key), ``valid[i, s]`` and ``rel[i, s]`` (flat rpb entry)."""
    N, KK = math.prod(spatial), math.prod(kernel)
    keys = np.zeros((N, KK), np.int64)
    valid = np.zeros((N, KK), bool)
    rel = np.zeros((N, KK), np.int64)
    rpb_dims = [2 * k - 1 for k in kernel]
    for i, ic in enumerate(itertools.product(*map(range, spatial))):
        windows = [oracle.na_axis_neighbors(L, x, k, 1, d, c)
                   for L, x, k, d, c in zip(spatial, ic, kernel, dilation, causal)]
        for s, tc in enumerate(itertools.product(*map(range, kernel))):
            if all(t < len(w) for t, w in zip(tc, windows)):
                jc = [w[t] for t, w in zip(tc, windows)]
                keys[i, s] = np.ravel_multi_index(jc, spatial)
                valid[i, s] = True
                rel[i, s] = np.ravel_multi_index(
                    [(j - x) // d + k - 1 for j, x, d, k in zip(jc, ic, dilation, kernel)], rpb_dims)
    vis = oracle.build_visibility(1, N, N, neighborhood={
        "spatial_shape": spatial, "kernel_size": kernel, "dilation": dilation, "is_causal": causal})[0]
    for i in range(N):  # the slot layout must hold exactly the oracle's neighbours
        assert sorted(keys[i][valid[i]].tolist()) == torch.nonzero(vis[i]).flatten().tolist()
    return torch.from_numpy(keys), torch.from_numpy(valid), torch.from_numpy(rel)


class Setup:
    """Random inputs in ``dtype`` on CUDA and float64 references computed from those values."""

    def __init__(self, name, dtype, seed=0):
        spatial, kernel, dilation, causal, B, H, D = CASES[name]
        self.geom = (kernel, dilation, causal)
        self.rpb_on = _uses_rpb(kernel, causal)
        keys, valid, rel = slot_tables(spatial, kernel, dilation, causal)
        self.valid = valid
        KK = keys.shape[1]
        g = torch.Generator().manual_seed(seed)

        def rand(*shape):
            return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

        q, k, v, d_out = (rand(B, H, *spatial, D) for _ in range(4))
        attn, d_attn = (rand(B, H, *spatial, KK) for _ in range(2))
        rpb = rand(H, *[2 * x - 1 for x in kernel]) if self.rpb_on else None
        # The kernels must never read invalid slots: poison them.
        vmask = valid.reshape(*spatial, KK)
        attn_in, d_attn_in = (t.masked_fill(~vmask, math.nan) for t in (attn, d_attn))
        inputs = {"q": q, "k": k, "v": v, "d_out": d_out, "attn": attn_in, "d_attn": d_attn_in}
        self.cuda = {n: t.cuda() for n, t in inputs.items()}
        self.cuda["rpb"] = None if rpb is None else rpb.cuda()

        # float64 copies with the spatial dims flattened (the unpoisoned attn / d_attn).
        inputs.update(attn=attn, d_attn=d_attn)
        f = {n: t.double().flatten(2, -2).requires_grad_(True) for n, t in inputs.items()}
        rp = None if rpb is None else rpb.double().requires_grad_(True)
        logits = (f["q"][:, :, :, None, :] * f["k"][:, :, keys, :]).sum(-1)
        if rp is not None:
            logits = logits + rp.flatten(1)[:, rel]
        masked = torch.where(valid, logits, 0.0)
        wrt = [f["q"], f["k"]] + ([rp] if rp is not None else [])
        grads = torch.autograd.grad(masked, wrt, f["d_attn"])
        out = (torch.where(valid, f["attn"], 0.0)[..., None] * f["v"][:, :, keys]).sum(-2)
        d_attn_av, dv = torch.autograd.grad(out, [f["attn"], f["v"]], f["d_out"])
        shape_d, shape_w = (B, H, *spatial, D), (B, H, *spatial, KK)
        self.ref = {
            "attn": torch.where(valid, logits, -math.inf).detach().reshape(shape_w),
            "dq": grads[0].reshape(shape_d), "dk": grads[1].reshape(shape_d),
            "drpb": grads[2] if rp is not None else None,
            "out": out.detach().reshape(shape_d),
            "d_attn": torch.where(valid, d_attn_av, 0.0).reshape(shape_w), "dv": dv.reshape(shape_d)}
        self.tol = TOL[dtype]

    def check(self, name, got):
        ref = self.ref[name]
        assert got.device.type == "cuda"
        got = got.double().cpu()
        assert not torch.isnan(got).any(), f"{name}: NaN in output"
        torch.testing.assert_close(got, ref, atol=self.tol, rtol=self.tol, msg=name)


def _poison_allocator(nbytes):
    # Fill a block the caching allocator will hand out next with NaN, so outputs the launchers
    # allocate themselves start as NaN too (best effort: the allocator is free to pick another).
    junk = torch.full((nbytes // 8 + 1,), math.nan, dtype=torch.float64, device="cuda")
    del junk


def _unfused():
    from cudnn_attn.fallback_kernels import unfused

    return unfused


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_qk_forward(name, dtype):
    s = Setup(name, dtype)
    c = s.cuda
    attn = torch.full(s.ref["attn"].shape, math.nan, dtype=dtype, device="cuda")
    got = _unfused().qk_forward(c["q"], c["k"], c["rpb"], *s.geom, attn=attn)
    assert got is attn
    ref = s.ref["attn"]
    assert torch.equal(torch.isneginf(got.cpu()), torch.isneginf(ref)), "invalid slots must be -inf"
    finite = ~torch.isneginf(ref)
    torch.testing.assert_close(got.cpu().double()[finite], ref[finite], atol=s.tol, rtol=s.tol)
    again = _unfused().qk_forward(c["q"], c["k"], c["rpb"], *s.geom)
    assert torch.equal(again, got), "qk_forward is not bitwise repeatable"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_qk_backward(name, dtype):
    s = Setup(name, dtype, seed=1)
    c = s.cuda
    _poison_allocator(c["q"].numel() * c["q"].element_size())
    dq, dk, drpb = _unfused().qk_backward(c["d_attn"], c["q"], c["k"], *s.geom, s.rpb_on)
    s.check("dq", dq)
    s.check("dk", dk)
    if s.rpb_on:
        assert drpb.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        s.check("drpb", drpb)
    else:
        assert drpb is None
    again = _unfused().qk_backward(c["d_attn"], c["q"], c["k"], *s.geom, s.rpb_on)
    assert torch.equal(again[0], dq) and torch.equal(again[1], dk)
    if s.rpb_on:
        assert torch.equal(again[2], drpb), "drpb is not bitwise repeatable"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_av_forward(name, dtype):
    s = Setup(name, dtype, seed=2)
    c = s.cuda
    out = torch.full(c["v"].shape, math.nan, dtype=dtype, device="cuda")
    got = _unfused().av_forward(c["attn"], c["v"], *s.geom, out=out)
    assert got is out
    s.check("out", got)
    assert torch.equal(_unfused().av_forward(c["attn"], c["v"], *s.geom), got)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_av_backward(name, dtype):
    s = Setup(name, dtype, seed=3)
    c = s.cuda
    _poison_allocator(c["attn"].numel() * c["attn"].element_size())
    d_attn, dv = _unfused().av_backward(c["d_out"], c["attn"], c["v"], *s.geom)
    s.check("d_attn", d_attn)
    s.check("dv", dv)
    invalid = ~s.valid.reshape(d_attn.shape[2:]).expand(d_attn.shape)
    assert (d_attn.cpu()[invalid] == 0).all(), "invalid slots of d_attn must be exactly 0"
    again = _unfused().av_backward(c["d_out"], c["attn"], c["v"], *s.geom)
    assert torch.equal(again[0], d_attn) and torch.equal(again[1], dv)


def test_non_contiguous_output_buffers_are_filled():
    s = Setup("2d", torch.float32)
    c = s.cuda
    attn = torch.full((*s.ref["attn"].shape[:-1], 2 * s.ref["attn"].shape[-1]), math.nan,
                      device="cuda")[..., ::2]
    assert not attn.is_contiguous()
    assert _unfused().qk_forward(c["q"], c["k"], c["rpb"], *s.geom, attn=attn) is attn
    torch.testing.assert_close(attn.cpu().double(), s.ref["attn"], atol=s.tol, rtol=s.tol)
    out = torch.full(c["v"].shape, math.nan, device="cuda").transpose(-1, -2).contiguous() \
        .transpose(-1, -2)
    assert not out.is_contiguous()
    assert _unfused().av_forward(c["attn"], c["v"], *s.geom, out=out) is out
    s.check("out", out)


def test_non_contiguous_inputs_and_side_stream():
    s = Setup("3d-causal", torch.float32)
    c = s.cuda
    q_nc = c["q"].transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dq, dk, _ = _unfused().qk_backward(c["d_attn"], q_nc, c["k"], *s.geom, False)
    stream.synchronize()
    s.check("dq", dq)
    s.check("dk", dk)


def test_bad_arguments_name_themselves():
    s = Setup("2d", torch.float32)
    c = s.cuda
    u = _unfused()
    with pytest.raises(ValueError, match="key"):
        u.qk_forward(c["q"], c["k"][:, :1], None, *s.geom)
    with pytest.raises(TypeError, match="key"):
        u.qk_forward(c["q"], c["k"].double(), None, *s.geom)
    with pytest.raises(ValueError, match="rpb"):
        u.qk_forward(c["q"], c["k"], c["rpb"][:, :1], *s.geom)
    with pytest.raises(ValueError, match="causal"):
        u.qk_forward(c["q"], c["k"], c["rpb"], (3, 5), (2, 1), (True, False))
    with pytest.raises(ValueError, match="attn"):
        u.av_forward(c["attn"][..., :3], c["v"], *s.geom)
    with pytest.raises(ValueError, match="kernel_size"):
        u.av_forward(c["attn"], c["v"], (5, 3), (2, 1), (False, False))
    with pytest.raises(TypeError, match="value"):
        u.av_forward(c["attn"], c["v"].to(torch.int32), *s.geom)
