"""cudnn_attn.integrations.transformers: ``attn_implementation="cudnn_attn"`` in Hugging Face
transformers decoder models (tiny models built from configs in code, no downloads), compared with
transformers' own "sdpa" (or "eager" where SDPA cannot run: Gemma-2's softcap) in float32:
padding through the attention mask, GQA, sliding windows, softcap, generation with a cache.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cudnn_attn.integrations.transformers as ca_hf  # noqa: E402
from hf_tiny import NAME, TOL, gemma2, gpt_oss, llama, mistral  # noqa: E402

MODELS = {"llama_gqa": (llama, "sdpa"), "mistral_sliding_window": (mistral, "sdpa"),
          "gemma2_softcap_sliding": (gemma2, "eager"), "gpt_oss_sinks": (gpt_oss, "eager")}


def build(name):
    torch.manual_seed(0)
    factory, peer = MODELS[name]
    return factory().eval(), peer


def inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    return ids, mask


def logits(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_equal_the_peer_with_padding(name):
    model, peer = build(name)
    ids, mask = inputs()
    ours, theirs = logits(model, NAME, ids, mask), logits(model, peer, ids, mask)
    real = mask.bool()  # padded positions' logits are not defined by either
    torch.testing.assert_close(ours[real], theirs[real], **TOL)
    # the mask matters: without it the padded rows' logits change
    unmasked = logits(model, NAME, ids, torch.ones_like(mask))
    assert not torch.allclose(unmasked[1][real[1]], ours[1][real[1]], **TOL)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generation_with_cache_equals_the_peer(name):
    model, peer = build(name)
    ids, mask = inputs()
    outs = {}
    for impl in (NAME, peer):
        model.set_attn_implementation(impl)
        outs[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
    assert torch.equal(outs[NAME].sequences, outs[peer].sequences)
    for a, b in zip(outs[NAME].logits, outs[peer].logits):
        torch.testing.assert_close(a, b, **TOL)


def test_training_step_gradients_equal_sdpa():
    model, _ = build("llama_gqa")
    ids, mask = inputs()
    grads = {}
    for impl in (NAME, "sdpa"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        grads[impl] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads[NAME], grads["sdpa"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_register_registers_both_interfaces_and_checks_its_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    assert ca_hf.register("cudnn_attn_other") == "cudnn_attn_other"
    assert AttentionInterface._global_mapping["cudnn_attn_other"] is ca_hf.attention_forward
    assert "cudnn_attn_other" in AttentionMaskInterface._global_mapping
    with pytest.raises(TypeError, match="name"):
        ca_hf.register("")


def test_attention_sinks_reach_the_softmax():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 3, 8, generator=g) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0])
    module = torch.nn.Module()
    out, _ = ca_hf.attention_forward(module, q, k, v, None, s_aux=sinks)
    plain, _ = ca_hf.attention_forward(module, q, k, v, None)
    s = (q @ k.transpose(-1, -2)) * 8 ** -0.5
    s = s.masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
    s = torch.cat([s, sinks.view(1, 2, 1, 1).expand(1, 2, 3, 1)], -1)
    expected = (torch.softmax(s, -1)[..., :-1] @ v).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, plain)
