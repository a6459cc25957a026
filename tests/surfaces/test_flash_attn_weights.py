"""FlashAttention's ``S_dmask`` on an engine that does not hand its weights back (issue 36,
item 5a): the weights come from calls whose values are identity columns, 128 keys at a time, on
the engine that drew the call's dropout mask. Before, one call took ``v`` widened by the whole
identity (``S_k + D_v`` value columns): past cuDNN's 256 no backend could run it.

The cuDNN engine runs here through ``cudnn_fake`` (its executor draws the dropout mask from the
graph's seed over the (query, key) positions, as cuDNN's Philox stream does); the oracle is the
float64 attention with the keep mask decoded from ``S_dmask``."""

import cudnn_fake
import pytest
import torch
from test_flash_api import bwd, dense_inputs, explicit_mask_oracle, fa_decode, fwd, gen, r128, ref_one


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_weights_of_any_size_replay_the_engines_mask(monkeypatch, causal):
    _, built = cudnn_fake.install(monkeypatch)
    # S_k + D_v = 364 > 256; causal: FlashAttention's bottom-right diagonal with dropout, which
    # cuDNN takes as the top-left band it equals without padding (item 5c)
    B, Sq, Sk, H, D, p = 2, 40, 300, 2, 64, 0.25
    q, k, v = (t.half() for t in dense_inputs(B, Sq, Sk, H, H, D, seed=3))
    out, *_, lse, seed, offset, probs = fwd(q, k, v, p=p, causal=causal, gen=gen(0),
                                            return_softmax=True)
    assert probs.shape == (B, H, r128(Sq), r128(Sk))
    assert built and all(spec.dim_v <= 128 for spec, _ in built)  # the cuDNN engine ran them all
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
