"""FlashAttention's ``S_dmask`` on an engine that does not hand its weights back (issue 36,
item 5a): the weights come from calls whose values are identity columns, ``D_v`` keys at a time
in v's layout (the call's own graph), on the engine that drew the call's dropout mask.
Before, one call took ``v`` widened by the whole identity (``S_k + D_v`` value columns): past
cuDNN's 256 no backend could run it. Then the calls took 128 columns whatever ``D_v``:
cuDNN's Philox pattern follows the kernel the graph's sizes choose, and on an H200 a D = 192
call's ``S_dmask`` showed almost nothing dropped (FlashAttention's
test_flash_attn_varlen_qkvpacked, d=192).

The cuDNN engine runs here through ``cudnn_fake`` (its executor draws the dropout mask from the
graph's seed and all its Q/K/V dims: only the call's own graph replays the mask); the oracle is
the float64 attention with the keep mask decoded from ``S_dmask``."""

import cudnn_fake
import pytest
import torch
from test_flash_api import bwd, dense_inputs, explicit_mask_oracle, fa_decode, fwd, gen, r128, ref_one


@pytest.mark.parametrize("D", [64, 192])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_weights_of_any_size_replay_the_engines_mask(monkeypatch, causal, D):
    _, built = cudnn_fake.install(monkeypatch)
    # S_k + D_v = 364 > 256; causal: FlashAttention's bottom-right diagonal with dropout, which
    # cuDNN takes as the top-left band it equals without padding (item 5c)
    B, Sq, Sk, H, p = 2, 40, 300, 2, 0.25
    q, k, v = (t.half() for t in dense_inputs(B, Sq, Sk, H, H, D, seed=3))
    out, *_, lse, seed, offset, probs = fwd(q, k, v, p=p, causal=causal, gen=gen(0),
                                            return_softmax=True)
    assert probs.shape == (B, H, r128(Sq), r128(Sk))
    # the cuDNN engine ran them all, each the call's own graph (D_v value columns)
    assert built and {spec.dim_v for spec, _ in built} == {D}
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    _, _, ref_p = ref_one(*(t.detach() for t in leaves), causal=causal)
    pre, keep = fa_decode(probs.double(), ref_p, D, True)
    torch.testing.assert_close(pre, ref_p, atol=2e-3, rtol=2e-3)
    assert 0.6 < keep[ref_p > 0].double().mean() < 0.9
    ref_out = explicit_mask_oracle(*leaves, keep.double(), p, causal=causal)
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-3, rtol=2e-3)
    dout = torch.randn(out.shape, generator=gen(2), dtype=torch.float64).half()
    dq, dk, dv, _ = bwd(dout, q, k, v, out, lse, p=p, causal=causal, seed=seed, offset=offset)
    exp = torch.autograd.grad(ref_out, leaves, dout.double())
    for name, got, want in zip("qkv", (dq, dk, dv), exp):
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2, msg=name)



def test_varlen_qkvpacked_dropout_weights_are_the_mask_the_output_used(monkeypatch):
    """FlashAttention's test_flash_attn_varlen_qkvpacked[0.17-1025-192-...] failed on an H200:
    its out_ref, built from the returned S_dmask, was 0.445 off (S_dmask showed almost nothing
    dropped). The same call, smaller, through the cuDNN stand-in: the output is the float64
    attention with the keep mask decoded from S_dmask's signs."""
    import math

    from cudnn_attn.flash_attn_interface import flash_attn_varlen_qkvpacked_func

    _, built = cudnn_fake.install(monkeypatch)
    lens, H, D, p = [37, 130, 5], 2, 192, 0.17
    g = gen(6)
    qkv = torch.randn(sum(lens), 3, H, D, generator=g, dtype=torch.float64).half()
    cu = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    torch.manual_seed(0)
    out, _, s_dmask = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), p,
                                                       return_attn_probs=True)
    assert built and any(spec.dim_v == D for spec, _ in built)  # cuDNN ran the call
    kept, outs = [], []
    for b, n in enumerate(lens):
        qb, kb, vb = (t.double().transpose(0, 1) for t in qkv[cu[b]:cu[b] + n].unbind(1))
        prob = torch.softmax(qb @ kb.transpose(-1, -2) / math.sqrt(D), -1)
        keep = s_dmask[b, :, :n, :n] >= 0  # FlashAttention's sign: dropped entries negative
        kept.append(keep.flatten())
        outs.append((prob * keep / (1 - p) @ vb).transpose(0, 1))
    assert 0.7 < torch.cat(kept).double().mean() < 0.95
    torch.testing.assert_close(out.double(), torch.cat(outs), atol=2e-3, rtol=2e-3)

# -- varlen: dropout, a head dim cuDNN does not take, the weights (items 5b/5d) -----------------

def test_varlen_dropout_with_an_odd_head_dim_runs_packed_both_ways(monkeypatch):
    """On a GPU, cuDNN declines D = 12; the forward fell back to dense batches, the backward
    (pinned to a packed engine by the dropout mask) found none. The torch engine now runs the
    packed problem both ways, weights included. This CPU plays the accelerator."""
    import math

    from cudnn_attn.flash_api import mha_varlen_bwd, mha_varlen_fwd
    from cudnn_attn.packed import calls

    monkeypatch.setattr(calls, "on_accelerator", lambda t: True)
    lens_q, lens_k, H, D, p = [5, 9, 1], [7, 11, 4], 2, 12, 0.3
    g = gen(4)
    q = torch.randn(sum(lens_q), H, D, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), H, D, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), H, D, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, *lens_q]).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k]).cumsum(0).to(torch.int32)
    args = dict(max_seqlen_q=9, max_seqlen_k=11, softmax_scale=None, zero_tensors=False,
                is_causal=True, window_size_left=-1, window_size_right=-1, softcap=0.0)
    out, *_, lse, seed, offset, s_dmask = mha_varlen_fwd(
        q, k, v, None, cu_q, cu_k, None, None, None, p_dropout=p, return_softmax=True,
        gen_=gen(0), **args)
    assert s_dmask.shape == (3, H, 128, 128)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    outs, kept = [], []
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        qb, kb, vb = (t[c[b]:c[b] + n].transpose(0, 1) for t, c, n in
                      ((leaves[0], cu_q, lq), (leaves[1], cu_k, lk), (leaves[2], cu_k, lk)))
        s = (qb @ kb.transpose(-1, -2) / math.sqrt(D)).masked_fill(
            torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + lk - lq, -math.inf)
        prob = torch.softmax(s, -1)
        keep = s_dmask[b, :, :lq, :lk] >= 0  # FlashAttention's sign: dropped entries negative
        kept.append(keep[prob.detach() > 0])
        outs.append((prob * keep / (1 - p) @ vb).transpose(0, 1))
    want = torch.cat(outs)
    assert 0.5 < torch.cat(kept).double().mean() < 0.9
    torch.testing.assert_close(out, want.detach())
    dout = torch.randn(out.shape, generator=gen(5), dtype=torch.float64)
    dq, dk, dv, _ = mha_varlen_bwd(dout, q, k, v, out, lse, None, None, None, cu_q, cu_k, None,
                                   p_dropout=p, deterministic=False, philox_seed=seed,
                                   philox_offset=offset, **args)
    for name, got, exp in zip("qkv", (dq, dk, dv), torch.autograd.grad(want, leaves, dout)):
        torch.testing.assert_close(got, exp, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("D", [64, 59, 192], ids=["d64", "d59-padded", "d192"])
def test_gpu_dropout_weights_of_any_size_replay_the_mask(D):
    """On the GPU (cuDNN): S_k + D_v > 256, FlashAttention's bottom-right causal diagonal with
    dropout, (d59) a head dim cuDNN takes zero-padded, and (d192) a D_v whose kernel draws
    another Philox pattern than 128 value columns do."""
    B, Sq, Sk, H, p = 2, 40, 300, 2, 0.25
    q, k, v = (t.half().cuda() for t in dense_inputs(B, Sq, Sk, H, H, D, seed=3))
    g = torch.Generator(device="cuda").manual_seed(0)
    out, *_, lse, seed, offset, probs = fwd(q, k, v, p=p, causal=True, gen=g,
                                            return_softmax=True)
    leaves = [t.detach().double().cpu().requires_grad_(True) for t in (q, k, v)]
    _, _, ref_p = ref_one(*(t.detach() for t in leaves), causal=True)
    keep = fa_decode(probs.double().cpu(), ref_p, D, True)[1].double()
    assert 0.6 < keep[ref_p > 0].mean() < 0.9
    ref_out = explicit_mask_oracle(*leaves, keep, p, causal=True)
    assert (out.double().cpu() - ref_out.detach()).abs().max().item() < 2e-2
    dout = torch.randn(out.shape, generator=gen(2), dtype=torch.float64).half().cuda()
    dq, dk, dv, _ = bwd(dout, q, k, v, out, lse, p=p, causal=True, seed=seed, offset=offset)
    exp = torch.autograd.grad(ref_out, leaves, dout.double().cpu())
    for name, got, want in zip("qkv", (dq, dk, dv), exp):
        err = (got.double().cpu() - want).abs().max().item()
        assert err < 5e-2 * max(1.0, want.abs().max().item()), name
