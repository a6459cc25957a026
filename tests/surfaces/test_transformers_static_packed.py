"""Hugging Face masks that used to fall back to a dense bias now reach the engines structured:
static caches (eager and under ``torch.compile(fullgraph=True)``: no host read, no graph break),
packed sequences (``position_ids`` restarting, as ``DataCollatorWithFlattening`` makes them),
bidirectional sliding windows (ModernBERT), and what stays dense (a window with holes in the
2-D mask). Peers: transformers' own "sdpa" on tiny models built from configs (float32), and,
for packed sequences, each sequence run alone."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import cudnn_attn as ca  # noqa: E402
from cudnn_attn.integrations import hf_calls, hf_masks  # noqa: E402
from hf_tiny import NAME, TOL, bert, gemma2, gpt_oss, llama  # noqa: E402
from hf_tiny import attention_calls, problems  # noqa: E402,F401  (fixtures)
from hf_tiny import mistral as mistral_with_window  # noqa: E402


def mistral(window=3):
    return mistral_with_window(window)


def modernbert():
    cfg = transformers.ModernBertConfig(vocab_size=97, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=64, local_attention=4,
                                        layer_types=["sliding_attention", "full_attention"],
                                        pad_token_id=0)
    return transformers.ModernBertModel(cfg)


def build(factory):
    torch.manual_seed(0)
    return factory().eval()


def token_ids(batch, seq, seed=1):
    return torch.randint(1, 97, (batch, seq), generator=torch.Generator().manual_seed(seed))


def structured(problems, *parts):
    """No problem carries a bias, and each of ``parts`` is in some problem's description."""
    described = [p.describe() for p in problems]
    assert problems and all(p.bias is None for p in problems), described
    for part in parts:
        assert any(part in d for d in described), (part, described)


def logits_of(model, impl, *args, **kwargs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(*args, **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# --- a. static caches ---------------------------------------------------------------------------

def generate_static(model, impl, ids, mask, compiled):
    model.set_attn_implementation(impl)
    kw = {}
    if compiled:  # transformers compiles the decode steps; fullgraph: a graph break would raise
        config = transformers.CompileConfig(fullgraph=True, backend="eager")
        config._compile_all_devices = True  # CPU too (transformers compiles on GPUs only)
        kw = dict(compile_config=config)
    return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                          cache_implementation="static", output_logits=True,
                          return_dict_in_generate=True, **kw)


# (model, peer, holes in the 2-D mask besides left padding): Mistral's layers are all sliding
# windows (a static sliding cache passes int offsets), Gemma-2 mixes both with softcap ("sdpa"
# refuses softcap: its peer is "eager"), gpt-oss with attention sinks.
# (A window with holes stays dense in the prompt: see test_a_window_with_holes_stays_dense.)
STATIC = {"llama": (llama, "sdpa", False), "llama_holes": (llama, "sdpa", True),
          "mistral": (mistral, "sdpa", False), "gemma2": (gemma2, "eager", False),
          "gpt_oss_sinks": (gpt_oss, "eager", False)}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", sorted(STATIC))
def test_static_cache_generation_equals_the_peer_and_stays_structured(case, compiled, problems):
    factory, peer, holes = STATIC[case]
    model = build(factory)
    ids = token_ids(2, 7)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    if holes:
        mask[0, 2] = 0
    torch._dynamo.reset()
    ours = generate_static(model, NAME, ids, mask, compiled)
    ours_problems = list(problems)
    theirs = generate_static(model, peer, ids, mask, compiled)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits):
        torch.testing.assert_close(a, b, **TOL)
    structured(ours_problems)
    # decode steps: one query against a masked cache (Padding of the visible keys, or a band);
    # a band that hides nothing (a sliding cache no longer than the window) is dropped, a full
    # cache never runs unmasked
    window = getattr(model.config, "sliding_window", None) or 0
    steps = [p for p in ours_problems if p.seq_q == 1]
    assert steps and all(p.mask is not None or p.seq_kv <= window for p in steps), \
        [p.describe() for p in steps]


def test_a_compiled_static_decode_step_reads_nothing_on_the_host(monkeypatch):
    """The decode step's calls trace into one graph (fullgraph) with no recompile per step."""
    model = build(llama)
    ids, mask = token_ids(2, 6), torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    generate_static(model, NAME, ids, mask, compiled=True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("factory, band", [
    (llama, "Causal(alignment='bottom_right')"),
    # a window longer than the cache has filled: the static sliding cache is not full yet
    (lambda: mistral(window=6), "SlidingWindow(left=5, right=0, alignment='bottom_right')")],
    ids=["llama", "mistral"])
def test_static_cache_without_a_2d_mask_is_a_band_with_padding(factory, band, problems,
                                                                attention_calls):
    calls = attention_calls
    model = build(factory)
    ids = token_ids(2, 3)
    step = token_ids(2, 1, seed=2)
    outs = {}
    for impl in (NAME, "sdpa"):
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        first = logits_of(model, impl, ids, cache=cache, use_cache=True)
        second = logits_of(model, impl, step, cache=cache, use_cache=True)
        outs[impl] = (first, second)
        if impl == NAME:
            ours_problems = list(problems)
    for a, b in zip(outs[NAME], outs["sdpa"]):
        torch.testing.assert_close(a, b, **TOL)
    structured(ours_problems, band, "Padding")
    explained = [str(ca.explain(*a, **{k: v for k, v in kw.items() if k != "sinks"}))
                 for a, kw in calls]
    assert explained and all("bias=" not in e for e in explained), explained
    assert any("Padding(" in e and band in e for e in explained), explained


def test_a_static_mask_snapshots_the_cache_counter():
    """The cache counts its tokens in place before attention runs: the mask keeps the offset
    the mask was built for."""
    counter = torch.tensor(3)
    built = hf_masks.structured_mask(1, 1, 8, q_offset=counter, kv_offset=0,
                                     attention_mask=torch.ones(1, 4, dtype=torch.bool))
    counter.add_(1)
    assert int(built.q_offset) == 3
    # and generate()'s prepared mask passes back through the builder unchanged
    assert hf_masks.structured_mask(1, 1, 8, attention_mask=built) is built


# --- b. packed sequences ------------------------------------------------------------------------

PACKED_LENGTHS = ((5, 4, 3), (2, 6, 4))  # two rows, three sequences each


def packed_inputs():
    ids = token_ids(2, 12, seed=3)
    positions = torch.tensor([[p for n in row for p in range(n)] for row in PACKED_LENGTHS])
    return ids, positions


@pytest.mark.parametrize("factory", [llama, mistral], ids=["llama", "mistral"])
def test_packed_sequences_run_through_varlen_and_equal_sdpa(factory, problems, monkeypatch):
    model = build(factory)
    ids, positions = packed_inputs()
    calls = []
    real_varlen = hf_calls.attention_varlen

    def recorder(q, k, v, cu_q, cu_k, *args, **kwargs):
        calls.append((cu_q.tolist(), kwargs.get("mask")))
        return real_varlen(q, k, v, cu_q, cu_k, *args, **kwargs)

    monkeypatch.setattr(hf_calls, "attention_varlen", recorder)
    ours = logits_of(model, NAME, ids, position_ids=positions, use_cache=False)
    theirs = logits_of(model, "sdpa", ids, position_ids=positions, use_cache=False)
    torch.testing.assert_close(ours, theirs, **TOL)
    # the independent oracle: each sequence alone
    for row, lengths in enumerate(PACKED_LENGTHS):
        start = 0
        for n in lengths:
            alone = logits_of(model, "sdpa", ids[row:row + 1, start:start + n], use_cache=False)
            torch.testing.assert_close(ours[row, start:start + n], alone[0], **TOL)
            start += n
    assert calls and all(cu == [0, 5, 9, 12, 14, 20, 24] for cu, _ in calls), calls
    structured(problems, "SlidingWindow(left=2, right=0" if factory is mistral else "Causal")


def test_segment_bounds_starts_a_sequence_at_each_id_change_and_row():
    segments = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
    assert hf_calls.segment_bounds(segments).tolist() == [0, 2, 5, 6, 8, 10]
    assert hf_calls.segment_bounds(segments).dtype == torch.int32


# --- c. bidirectional sliding windows ------------------------------------------------------------

def test_bidirectional_sliding_window_is_a_symmetric_window(problems):
    model = build(modernbert)
    ids = token_ids(3, 12, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    ours = logits_of(model, NAME, ids, attention_mask=mask)
    theirs = logits_of(model, "sdpa", ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], **TOL)
    # ModernBERT's local_attention = 4: keys within distance 2 of the query, both sides
    structured(problems, "SlidingWindow(left=2, right=2")
    unpadded = logits_of(model, NAME, ids, attention_mask=torch.ones_like(ids))
    assert not torch.allclose(unpadded[1][real[1]], ours[1][real[1]], **TOL)


# --- d. what stays dense --------------------------------------------------------------------------

def test_a_window_with_holes_stays_dense(problems):
    """A sliding window counts positions: packing the real tokens would close the holes, and no
    mask hides a key inside a row. Such a prompt runs transformers' mask as a bias (exact);
    decode steps with one query still run structured (its visible keys gathered)."""
    model = build(lambda: mistral(window=4))
    ids = token_ids(2, 9, seed=5)
    mask = torch.ones_like(ids)
    mask[0, 7] = 0  # inside the first decode steps' windows (positions 6..9, 7..10) too
    ours = logits_of(model, NAME, ids, attention_mask=mask)
    theirs = logits_of(model, "sdpa", ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], **TOL)
    assert any(p.bias is not None for p in problems)
    del problems[:]
    ours = generate_static(model, NAME, ids, mask, compiled=False)
    theirs = generate_static(model, "sdpa", ids, mask, compiled=False)
    assert torch.equal(ours.sequences, theirs.sequences)
    for a, b in zip(ours.logits, theirs.logits):
        torch.testing.assert_close(a, b, **TOL)
    steps = [p for p in problems if p.seq_q == 1]
    assert steps and all(p.bias is None for p in steps), [p.describe() for p in steps]


# --- compiled forwards: structured where nothing must be read on the host --------------------

def compiled_logits(model, impl, ids, mask, use_cache):
    model.set_attn_implementation(impl)
    torch._dynamo.reset()
    forward = torch.compile(lambda i, m: model(i, attention_mask=m, use_cache=use_cache),
                            backend="eager", fullgraph=True)
    with torch.no_grad():
        out = forward(ids, mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# (factory, padded, use_cache, what the engines see): BERT's real keys are gathered (every query
# sees the same keys, holes included); a causal prompt without padding is the band; a causal
# prompt with padding would need its layout read on the host, so it keeps transformers' mask (a
# bias), and so does a causal forward without a cache: transformers then builds its
# packed-sequence mask from the position ids inside the compiled region, a closure the
# builder cannot look into while dynamo traces.
COMPILED = {"bert_holes": (bert, True, False, "Padding"),
            "llama": (llama, False, True, "Causal(alignment='bottom_right')"),
            "llama_padded": (llama, True, True, "bias="),
            "llama_no_cache": (llama, False, False, "bias=")}


@pytest.mark.parametrize("case", sorted(COMPILED))
def test_compiled_forward(case, problems):
    factory, padded, use_cache, expected = COMPILED[case]
    model = build(factory)
    ids = token_ids(2, 8, seed=6)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :2] = 0
        mask[1, 5] = 0
    ours = compiled_logits(model, NAME, ids, mask if padded else None, use_cache)
    theirs = logits_of(model, "sdpa", ids, attention_mask=mask if padded else None,
                       use_cache=use_cache)
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], **TOL)
    described = [p.describe() for p in problems]
    assert any(expected in d for d in described), described
    if expected != "bias=":
        structured(problems)
