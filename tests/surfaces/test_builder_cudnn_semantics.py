"""The cuDNN attribute builder speaks cuDNN: on random configurations drawn like the frontend's
``test_mhas``, it accepts exactly what cuDNN's own validator accepts (rejecting with cuDNN's
reason), and what it runs matches the frontend's reference semantics in float64.

A deterministic sample runs by default; ``CUDNN_ATTN_FULL_SWEEP=1`` runs 1000 configurations
(``benchmarks/builder_grid.py`` prints the counts of the full grid).
"""

import dataclasses
import math
import os

import pytest
import torch

import builder_grid as grid
from full_sweep import FULL
import cudnn_attn as ca

pytest.importorskip("cudnn")

COUNT = 1000 if FULL else 120


@pytest.mark.parametrize("seed", range(COUNT))
def test_builder_and_cudnn_agree(seed):
    c = grid.sample(seed)
    theirs = grid.cudnn_verdict(c)
    if c.backward and theirs is not None:  # the builder runs the forward first
        theirs = grid.cudnn_verdict(dataclasses.replace(c, backward=False)) or theirs
    mine, out, stats, grads = grid.run_builder(c)
    if theirs is not None:
        assert mine is not None, f"cuDNN rejects {c}: {theirs}; the builder ran it"
        assert grid.same_reason(mine, theirs), (mine, theirs)
        return
    assert mine is None, f"cuDNN accepts {c}; the builder rejected it: {mine}"
    err = grid.compare(c, out, stats, grads)
    assert math.isnan(err) or err < 1e-9, f"{c}: error {err}"


@pytest.mark.parametrize("seed", range(0, COUNT, 3))
def test_the_engine_graph_and_cudnn_agree(seed):
    """The cuDNN engine's own graph for the same call (``graphs.describe``, validated by cuDNN
    for sm_90) refuses only what cuDNN refuses, up to its documented rewrites."""
    c = grid.sample(seed)
    theirs, engine = grid.cudnn_verdict(c), grid.engine_verdict(c)
    assert not grid.engine_disagrees(c, theirs, engine), (c, theirs, engine)


def test_the_sample_covers_both_verdicts_and_every_spelling():
    configs = [grid.sample(seed) for seed in range(COUNT)]
    verdicts = [grid.cudnn_verdict(c) for c in configs]
    assert sum(v is None for v in verdicts) > COUNT // 3
    assert sum(v is not None for v in verdicts) > 10
    assert {c.spelling for c in configs} == {"none", "causal", "band", "window_length"}


def test_band_setters_follow_cudnn_precedence():
    a = (ca.SdpaAttributes().set_diagonal_alignment("bottom_right")
         .set_diagonal_band_right_bound(3).set_sliding_window_length(4))
    assert a.band() == ("bottom_right", 4, 3)
    a.set_diagonal_band_left_bound(2)
    assert a.band() == ("bottom_right", 2, 3)          # the left bound wins over the length
    a.set_causal_mask(True)
    assert a.band() == ("top_left", 2, 0)              # causal pins alignment and right bound
    with pytest.raises(ValueError, match="Right bound needs to be larger than or equal to zero"):
        a.set_diagonal_band_right_bound(-1)
    with pytest.raises(ValueError, match="Left bound needs to be greater than zero"):
        a.set_diagonal_band_left_bound(0)
    with pytest.raises(ValueError, match="set_diagonal_alignment"):
        a.set_diagonal_alignment("middle")


def test_padding_in_cudnn_s_two_steps():
    q = torch.randn(2, 1, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="Padding mask requires seq_len_q/seq_len_kv"):
        ca.scaled_dot_product_flash_attention(q, q, q, ca.SdpaAttributes().set_padding_mask(True))
    with pytest.raises(ValueError, match="only if padding mask is enabled"):
        ca.scaled_dot_product_flash_attention(q, q, q, ca.SdpaAttributes().set_seq_len_q([2, 3])
                                              .set_seq_len_kv([4, 4]))


def test_the_grid_script_counts_agreement():
    # Also proves the benchmarks folder's cudnn.py no longer shadows the frontend package.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "builder_grid.py"
    # this checkout's package, not whichever cudnn_attn the interpreter would find first
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run([sys.executable, str(script), "--count", "30", "--no-json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    header, _, values = run.stdout.strip().splitlines()[-3:]
    counts = dict(zip(header.split(), values.split()))
    assert counts["configs"] == "30" and counts["disagreements"] == "0"
    assert counts["engine_disagreements"] == "0" and counts["missing_setters"] == "0"


@pytest.mark.parametrize("bias_shape", [(1, 2, 5, 7), (2, 1, 1, 7), (2, 2, 5, 7)])
def test_backward_returns_dbias_when_asked(bias_shape):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(bias_shape, generator=g, dtype=torch.float64)
    fwd = ca.SdpaAttributes().set_attn_scale(0.5).set_bias(bias).set_causal_mask(True)
    o, stats = ca.scaled_dot_product_flash_attention(q, k, v, fwd)
    d_o = torch.randn(o.shape, generator=g, dtype=torch.float64)
    dbias = torch.full(bias_shape, float("nan"), dtype=torch.float64)
    bwd = (ca.SdpaBackwardAttributes().set_attn_scale(0.5).set_bias(bias).set_causal_mask(True)
           .set_dbias(dbias))
    ca.scaled_dot_product_flash_attention_backward(q, k, v, o, d_o, stats, bwd)
    leaf = bias.clone().requires_grad_()
    s = 0.5 * q @ k.transpose(-1, -2) + leaf
    s = s.masked_fill(torch.ones(5, 7, dtype=torch.bool).triu(1), float("-inf"))
    (want,) = torch.autograd.grad(torch.softmax(s, -1) @ v, leaf, d_o)
    torch.testing.assert_close(dbias, want)
    with pytest.raises(ValueError, match="set_dbias needs set_bias"):
        ca.scaled_dot_product_flash_attention_backward(
            q, k, v, o, d_o, stats, ca.SdpaBackwardAttributes().set_dbias(dbias))


def test_paged_caches_read_through_the_page_tables():
    g = torch.Generator().manual_seed(4)
    B, H, D, page, pages = 2, 2, 8, 4, 3
    q = torch.randn(B, H, 2, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, pages * page, D, generator=g, dtype=torch.float64) for _ in range(2))
    order = torch.randperm(B * pages, generator=g)
    table = order.view(B, pages).to(torch.int32)
    containers = []
    for dense in (k, v):  # cuDNN's container [num_blocks, H, page_size, D]
        blocks = torch.empty(B * pages, H, page, D, dtype=torch.float64)
        blocks[order] = dense.view(B, H, pages, page, D).permute(0, 2, 1, 3, 4).reshape(-1, H, page, D)
        containers.append(blocks)
    lens_kv = [9, 12]
    attrs = (ca.SdpaAttributes().set_attn_scale(0.4).set_padding_mask(True)
             .set_seq_len_q([2, 2]).set_seq_len_kv(lens_kv)
             .set_paged_attention_k_table(table[:, None, :, None])
             .set_paged_attention_v_table(table).set_paged_attention_max_seq_len_kv(12))
    out, stats = ca.scaled_dot_product_flash_attention(q, *containers, attrs)
    dense = (ca.SdpaAttributes().set_attn_scale(0.4).set_padding_mask(True).set_seq_len_q([2, 2])
             .set_seq_len_kv(lens_kv))
    want, want_stats = ca.scaled_dot_product_flash_attention(q, k, v, dense)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(stats, want_stats)
    with pytest.raises(ca.NotSupportedError, match="Paged caches can only be used in combination"):
        ca.scaled_dot_product_flash_attention(
            q, *containers, ca.SdpaAttributes().set_paged_attention_k_table(table)
            .set_paged_attention_v_table(table))
    with pytest.raises(ca.NotSupportedError, match="no need to explicitly set max kv"):
        ca.scaled_dot_product_flash_attention(
            q, k, v, ca.SdpaAttributes().set_paged_attention_max_seq_len_kv(12))


def test_cumulative_lengths_implementation_and_max_total():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    by_lengths = (ca.SdpaAttributes().set_padding_mask(True).set_seq_len_q([3, 5])
                  .set_seq_len_kv([7, 2]))
    by_offsets = (ca.SdpaAttributes().set_padding_mask(True)
                  .set_cu_seq_len_q(torch.tensor([0, 3, 8], dtype=torch.int32))
                  .set_cu_seq_len_kv([0, 7, 9]).set_implementation("UNIFIED"))
    want = ca.scaled_dot_product_flash_attention(q, k, v, by_lengths)
    got = ca.scaled_dot_product_flash_attention(q, k, v, by_offsets)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="seq_len_q and cu_seq_len_q cannot both be set"):
        ca.scaled_dot_product_flash_attention(q, k, v, by_offsets.set_seq_len_q([3, 5]))
    with pytest.raises(ValueError, match="start at 0"):
        ca.SdpaAttributes().set_cu_seq_len_q([1, 3])
    with pytest.raises(ValueError, match="AUTO, COMPOSITE or UNIFIED"):
        ca.SdpaAttributes().set_implementation("FAST")
    with pytest.raises(ca.NotSupportedError, match="only supported with packed"):
        ca.scaled_dot_product_flash_attention(q, k, v, ca.SdpaAttributes()
                                              .set_max_total_seq_len_q(10))


def test_head_dims_and_strides_cudnn_rejects():
    q = torch.randn(1, 2, 4, 12, dtype=torch.float64)
    with pytest.raises(ca.NotSupportedError, match="hidden_dim should be multiple of 8"):
        ca.scaled_dot_product_flash_attention(q, q, q, ca.SdpaAttributes())
    q = torch.randn(1, 2, 4, 16, dtype=torch.float64)[..., ::2]
    with pytest.raises(ca.NotSupportedError, match="stride for the last dimension .* 1 for Q"):
        ca.scaled_dot_product_flash_attention(q, q.contiguous(), q.contiguous(),
                                              ca.SdpaAttributes())
