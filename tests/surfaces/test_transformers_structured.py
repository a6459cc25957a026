"""Hugging Face models reach the engines with structured masks: every attention problem the
dispatcher sees while tiny Llama (causal, GQA), Mistral (sliding window), Gemma-2 (softcap +
sliding window) and BERT (bidirectional) models run padded batches (left and right padding) has
``Causal`` / ``SlidingWindow`` / ``Padding`` or no mask, and no bias tensor; the outputs equal
transformers' own "sdpa" ("eager" for Gemma-2's softcap, which "sdpa" refuses) at real tokens.
A 4-D mask the model is given, or a mask function the structure cannot express, still runs (as a
bias), and ``output_attentions=True`` behaves as under "sdpa"."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cudnn_attn as ca  # noqa: E402
from cudnn_attn.integrations import hf_masks  # noqa: E402
import cudnn_attn.integrations.transformers as ca_hf  # noqa: E402
from hf_tiny import NAME, TOL, bert, gemma2, llama, mistral  # noqa: E402
from hf_tiny import attention_calls, problems  # noqa: E402,F401  (fixtures)


# name -> (factory, peer implementation, mask parts that must reach the engines)
MODELS = {"llama": (llama, "sdpa", {"Causal"}),
          "mistral": (mistral, "sdpa", {"SlidingWindow(left=4, right=0"}),
          "gemma2": (gemma2, "eager", {"SlidingWindow(left=3, right=0", "Causal",
                                       "softcap=3.0"}),
          "bert": (bert, "sdpa", {"mask=none"})}


def build(name):
    torch.manual_seed(0)
    return MODELS[name][0]().eval()


def padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    return ids, mask


def output(model, ids, mask, **kw):
    with torch.no_grad():
        out = model(ids, attention_mask=mask, **kw)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("name", sorted(MODELS))
def test_padded_batches_reach_the_engines_structured(name, problems):
    model = build(name)
    _, peer, expected = MODELS[name]
    ids, mask = padded_batch()
    model.set_attn_implementation(peer)
    theirs = output(model, ids, mask)
    model.set_attn_implementation(NAME)
    ours = output(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], **TOL)
    if name != "bert":  # right-padding queries: what "sdpa" gives them (generate() reads them)
        torch.testing.assert_close(ours[2, 9:], theirs[2, 9:], **TOL)
    assert problems, "no attention call reached the dispatcher"
    described = [p.describe() for p in problems]
    assert all(p.bias is None for p in problems), described
    for part in expected:
        assert any(part in d for d in described), (part, described)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_generation_with_left_padding_stays_structured(name, problems):
    model = build(name)
    peer = MODELS[name][1]
    ids, mask = padded_batch()
    ids, mask = ids[:2], mask[:2]  # left padding only (what generate() expects)
    outs = {}
    for impl in (NAME, peer):
        model.set_attn_implementation(impl)
        del problems[:]
        outs[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True)
        if impl == NAME:
            ours = list(problems)
    assert torch.equal(outs[NAME].sequences, outs[peer].sequences)
    for a, b in zip(outs[NAME].logits, outs[peer].logits):
        torch.testing.assert_close(a, b, **TOL)
    assert ours and all(p.bias is None for p in ours), [p.describe() for p in ours]


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_explain_of_the_captured_calls_names_a_structured_mask(name, attention_calls):
    calls = attention_calls
    model = build(name)
    model.set_attn_implementation(NAME)
    ids, _ = padded_batch()
    output(model, ids, torch.ones_like(ids))
    assert calls
    explained = [str(ca.explain(*a, **{k: v for k, v in kw.items() if k != "sinks"}))
                 for a, kw in calls]
    assert all("bias=" not in e for e in explained), explained
    want = "SlidingWindow(left=" if name != "llama" else "Causal(alignment="
    assert any(want in e for e in explained), explained


def test_a_4d_mask_from_the_model_runs_as_a_bias(problems):
    model = build("llama")
    ids, mask = padded_batch()
    # An arbitrary pattern: each query sees itself and every even key before it.
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    dense = ((j <= i) & ((j % 2 == 0) | (j == i)))[None, None].expand(3, 1, 12, 12)
    model.set_attn_implementation("sdpa")
    theirs = output(model, ids, dense)
    model.set_attn_implementation(NAME)
    ours = output(model, ids, dense)
    torch.testing.assert_close(ours, theirs, **TOL)
    assert any(p.bias is not None for p in problems)


def test_mask_pattern_recognizes_only_what_the_masks_express():
    mu = transformers.masking_utils
    assert hf_masks.mask_pattern(mu.causal_mask_function) == (True, None)
    assert hf_masks.mask_pattern(mu.bidirectional_mask_function) == (False, None)
    assert hf_masks.mask_pattern(mu.sliding_window_causal_mask_function(7)) == (True, 7)
    assert hf_masks.mask_pattern(mu.sliding_window_bidirectional_mask_function(3)) == (False, 3)
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    custom = mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: k == 0)
    blockwise = mu.or_masks(mu.causal_mask_function,
                            mu.blockwise_overlay(torch.zeros(1, 4, dtype=torch.long)))
    for fn in (chunked, custom, blockwise,
               mu.and_masks(mu.sliding_window_overlay(3), mu.bidirectional_mask_function)):
        assert hf_masks.mask_pattern(fn) is None
    # and those get transformers' own dense mask
    dense = hf_masks.structured_mask(1, 4, 4, mask_function=custom, allow_is_causal_skip=False)
    assert isinstance(dense, torch.Tensor) and dense.shape == (1, 1, 4, 4)
    assert dense[0, 0, 3].tolist() == [True, True, True, True]
    assert dense[0, 0, 1].tolist() == [True, True, False, False]


def test_output_attentions_behaves_as_sdpa(caplog):
    model = build("llama")
    ids, mask = padded_batch()
    results = {}
    for impl in ("sdpa", NAME):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            results[impl] = model(ids, attention_mask=mask, output_attentions=True).attentions
    assert results[NAME] == results["sdpa"]  # no weights from either
    with caplog.at_level(logging.WARNING, logger="cudnn_attn"):
        ca_hf._warned.clear()
        module = torch.nn.Module()
        q = torch.zeros(1, 1, 2, 4)
        ca_hf.attention_forward(module, q, q, q, None, output_attentions=True)
    assert "output_attentions=True" in caplog.text
