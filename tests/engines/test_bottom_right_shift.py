"""FlashAttention's bottom-right causal mask (and window) with dropout or a bias on cuDNN (issue
36, item 5c). cuDNN's bottom-right diagonal excludes both; without padding its offset
``S_kv - S_q`` is the same for every row, so the band is a top-left one with shifted bounds,
which cuDNN takes with them. Checked against cuDNN's own plans (deviceless) on every target;
the numbers through ``cudnn_fake`` are in ``tests/surfaces/test_flash_attn_weights.py``."""

import dataclasses

import pytest
import torch
from deviceless_plans import TARGETS, assert_plans, deviceless, needs_fe  # noqa: F401

import cudnn_attn as ca
from cudnn_attn.graphs._spec import Band, analyze


def meta(*shape, grad=False):
    return torch.empty(shape, dtype=torch.float16, device="meta", requires_grad=grad)


def problem(mask, **kw):
    q, k = meta(2, 4, 128, 64), meta(2, 4, 384, 64)
    return ca.AttnProblem.from_tensors(q, k, k, mask=mask, **kw)


def visible(band: Band, s_q: int, s_kv: int) -> torch.Tensor:
    """cuDNN's documented rule: key j of query i iff i' - L < j <= i' + R."""
    i = torch.arange(s_q)[:, None] + (s_kv - s_q if band.alignment == "bottom_right" else 0)
    j = torch.arange(s_kv)[None, :]
    keep = torch.ones(s_q, s_kv, dtype=torch.bool)
    if band.left is not None:
        keep &= j > i - band.left
    if band.right is not None:
        keep &= j <= i + band.right
    return keep


@pytest.mark.parametrize("mask", [ca.Causal("bottom_right"), ca.SlidingWindow(300, 0, "bottom_right"),
                                  ca.SlidingWindow(-1, 5, "bottom_right")], ids=str)
@pytest.mark.parametrize("extra", [dict(dropout_p=0.1), dict(bias=meta(1, 4, 128, 384))],
                         ids=["dropout", "bias"])
def test_the_shifted_band_keeps_the_same_pairs(mask, extra):
    plain = analyze(problem(mask))[0].band
    spec, reasons = analyze(problem(mask, **extra))
    assert not reasons, reasons
    assert plain.alignment == "bottom_right" and spec.band.alignment == "top_left"
    assert torch.equal(visible(spec.band, 128, 384), visible(plain, 128, 384))


def test_what_cannot_shift_stays_declined():
    padded = ca.Causal("bottom_right") & ca.Padding([128, 30], [384, 100])
    assert any("cannot be combined with dropout" in r
               for r in analyze(problem(padded, dropout_p=0.1))[1])
    # a left bound the offset would move past the diagonal: cuDNN's left bound must stay >= 1
    narrow = ca.SlidingWindow(10, 0, "bottom_right")
    assert any("cannot be combined with dropout" in r
               for r in analyze(problem(narrow, dropout_p=0.1))[1])


@needs_fe
@pytest.mark.parametrize("target", TARGETS)
def test_cudnn_plans_the_shifted_band_with_dropout(target, deviceless):  # noqa: F811
    for extra in (dict(dropout_p=0.1, return_lse=True), dict(bias=meta(1, 4, 128, 384))):
        p = problem(ca.Causal("bottom_right"), **extra)
        assert assert_plans(deviceless, p, target, build=False).ok
        trained = dataclasses.replace(p, requires_grad=True)
        assert assert_plans(deviceless, trained, target, backward=True, build=False).ok
