"""cuDNN's FP8 SDPA limits (issue 30) as ``NotSupportedError`` reasons: the engine's declared
reasons (``graphs/fp8.py``) against the cuDNN frontend's own C++ validator for sm_90 and sm_100,
run without a GPU (``backend_graph(sm_version=...)``), on a grid of head dims, masks, lengths and
head counts; the version gates; the graphs' keyword arguments against the installed binding."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.errors import NotSupportedError
from cudnn_attn.fp8 import cudnn_fp8_reasons, fp8_problem
from cudnn_attn.graphs.fp8 import Fp8Spec, fp8_reasons, validate_fp8

cudnn = pytest.importorskip("cudnn")
E4M3 = torch.float8_e4m3fn
VERSION = 92800

GRID = list(itertools.product(
    (90, 100), (False, True), ((64, 64), (128, 128), (80, 80), (256, 256), (192, 128), (128, 64)),
    (None, "top_left", "bottom_right"), ((128, 128), (64, 192), (100, 100), (256, 128)), (4, 2)))


def _problem(dims, causal, seqs, heads_kv, padding=False, sink=False):
    (d_qk, d_v), (s_q, s_kv) = dims, seqs
    q = torch.empty(2, 4, s_q, d_qk, dtype=E4M3, device="meta")
    k = torch.empty(2, heads_kv, s_kv, d_qk, dtype=E4M3, device="meta")
    v = torch.empty(2, heads_kv, s_kv, d_v, dtype=E4M3, device="meta")
    parts = [] if causal is None else [ca.Causal(causal)]
    if padding:
        parts.append(ca.Padding((s_q, s_q - 1), (s_kv, s_kv - 3)))
    mask = None
    for m in parts:
        mask = m if mask is None else mask & m
    return fp8_problem(q, k, v, mask=mask, scale=0.125, sink=sink)


def test_declared_reasons_agree_with_cudnns_validator_on_the_grid():
    verdicts = {True: 0, False: 0}
    for sm, backward, dims, causal, seqs, heads_kv in GRID:
        spec, reasons = cudnn_fp8_reasons(_problem(dims, causal, seqs, heads_kv), backward,
                                          sm=sm, version=VERSION)
        try:
            validate_fp8(spec, backward, sm)
            accepted, message = True, ""
        except cudnn.cudnnGraphNotSupportedError as exc:
            accepted, message = False, str(exc)
        verdicts[accepted] += 1
        assert accepted == (not reasons), (sm, backward, dims, causal, seqs, heads_kv, message,
                                           reasons)
    assert verdicts[True] > 100 and verdicts[False] > 100  # the grid exercises both sides


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("sm", [90, 100])
def test_padding_and_sinks_validate_on_hopper_and_blackwell(sm, backward):
    problem = _problem((128, 128), "top_left", (128, 128), 2, padding=True, sink=True)
    problem = dataclasses.replace(problem, dsink=backward)
    spec, reasons = cudnn_fp8_reasons(problem, backward, sm=sm, version=VERSION)
    assert spec.padding and spec.sink
    if sm == 90 and not backward:  # validates, but its kernel does not build (test_fp8_deviceless)
        assert len(reasons) == 1 and "sink tokens" in reasons[0]
    else:
        assert reasons == []
    # The C++ binding takes keywords strictly (a misspelled one is a TypeError), unlike pygraph.
    validate_fp8(spec, backward, sm)
    if backward:
        validate_fp8(dataclasses.replace(spec, deterministic=True), backward, sm)


def test_the_issues_limits_are_reasons():
    spec = Fp8Spec(2, 4, 4, 4, 128, 128, 128, 128, "FP8_E4M3", "FP8_E4M3", "FP8_E4M3")
    assert fp8_reasons(spec, False, 90, VERSION) == []
    assert "Hopper (sm_90) and newer" in " ".join(fp8_reasons(spec, False, 89, VERSION))
    assert "9.1.0 and not 9.10.0" in " ".join(fp8_reasons(spec, False, 90, 91000))
    assert "9.1.0 and not 9.10.0" in " ".join(fp8_reasons(spec, True, 90, 90000))
    hopper_bwd = dataclasses.replace(spec, dim_qk=64, dim_v=64)
    assert "D_qk = D_v = 128" in " ".join(fp8_reasons(hopper_bwd, True, 90, VERSION))
    assert fp8_reasons(hopper_bwd, True, 100, VERSION) == []
    wide = dataclasses.replace(spec, dim_qk=272, dim_v=272)
    assert "head dims <= 256" in " ".join(fp8_reasons(wide, False, 90, VERSION))
    odd = dataclasses.replace(spec, dim_qk=40, dim_v=40)
    assert "multiples of 16" in " ".join(fp8_reasons(odd, False, 100, VERSION))
    bottom_right = dataclasses.replace(spec, alignment="bottom_right", right_bound=0)
    assert "Blackwell" in " ".join(fp8_reasons(bottom_right, False, 90, VERSION))
    assert fp8_reasons(bottom_right, False, 100, VERSION) == []
    ragged = dataclasses.replace(spec, ragged=True)
    assert "THD" in " ".join(fp8_reasons(ragged, True, 90, VERSION))
    half_o = dataclasses.replace(spec, out="BFLOAT16")
    assert "Blackwell and cuDNN >= 9.13" in " ".join(fp8_reasons(half_o, False, 90, VERSION))
    assert fp8_reasons(half_o, False, 100, VERSION) == []
    assert fp8_reasons(half_o, False, 100, 91200) != []


def test_masks_fp8_graphs_cannot_express_are_rejected_everywhere():
    q = torch.zeros(1, 2, 8, 16).to(E4M3)
    with pytest.raises(NotSupportedError, match="causal, band and padding masks"):
        ca.attention_fp8(q, q, q, ca.DelayedScaling(), mask=ca.Neighborhood((8,), 3),
                         descale_q=1, descale_k=1, descale_v=1)
