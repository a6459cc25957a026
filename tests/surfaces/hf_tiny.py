"""Tiny Hugging Face models built from configs (no downloads), shared by the transformers tests,
and the ``problems`` fixture: every AttnProblem the dispatcher plans while a test runs."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cudnn_attn as ca  # noqa: E402
import cudnn_attn.integrations.transformers as ca_hf  # noqa: E402
from cudnn_attn.core import dispatch  # noqa: E402

NAME = ca_hf.register()
TOL = dict(atol=2e-5, rtol=2e-5)
SMALL = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def mistral(window=5):
    return transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL,
                                                                      sliding_window=window))


def gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **SMALL, head_dim=8, sliding_window=4, attn_logit_softcapping=3.0,
        final_logit_softcapping=None))


def gpt_oss():
    cfg = transformers.GptOssConfig(**SMALL, head_dim=8, sliding_window=4, num_local_experts=4,
                                    num_experts_per_tok=2,
                                    layer_types=["sliding_attention", "full_attention"])
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # sinks large enough to move the logits well past the tolerance
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
    return model


def bert():
    bert_config = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    return transformers.BertModel(transformers.BertConfig(**bert_config))


@pytest.fixture
def problems(monkeypatch):
    """Every AttnProblem the dispatcher plans while the test runs (planning happens when a call
    runs, also inside a compiled graph)."""
    seen = []
    plan_for = dispatch.plan_for

    def spy(problem, backend="auto"):
        seen.append(problem)
        return plan_for(problem, backend)

    monkeypatch.setattr(dispatch, "plan_for", spy)
    ca.clear_caches()  # a call remembered by an earlier test would skip planning (and the spy)
    return seen


@pytest.fixture
def attention_calls(monkeypatch):
    """``(args, kwargs)`` of every ``attention()`` call the HF integration makes while the test
    runs (what ``explain()`` is then asked about)."""
    from cudnn_attn.integrations import hf_calls

    calls = []
    real_attention = hf_calls.attention

    def recorder(*args, **kwargs):
        calls.append((args, kwargs))
        return real_attention(*args, **kwargs)

    monkeypatch.setattr(hf_calls, "attention", recorder)
    return calls
