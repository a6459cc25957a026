"""cuDNN's FP8 graphs planned without a GPU (``graphs/fp8_plans.py`` on ``graphs/deviceless``'s
machinery) for described H100 (sm_90) and B200 (sm_100) devices: the engine's declared FP8
reasons hold exactly when cuDNN refuses to plan (through ``check_support``) on a grid of head
dims, masks and directions; a sample builds its plan and names an FP8 kernel of the right
architecture; A100 is refused. ``CUDNN_ATTN_FULL_SWEEP=1`` builds every plan of the grid."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from deviceless_plans import FULL, deviceless, needs_fe  # noqa: F401

import cudnn_attn as ca
from cudnn_attn.fp8 import cudnn_fp8_reasons, fp8_problem

pytestmark = needs_fe
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
SM = {"h100": 90, "b200": 100}
VERSION = 92800


def _problem(dims, causal, heads_kv=2, seqs=(256, 256), dtype=E4M3, padding=False, sink=False):
    (d_qk, d_v), (s_q, s_kv) = dims, seqs
    q = torch.empty(2, 4, s_q, d_qk, dtype=dtype, device="meta")
    k = torch.empty(2, heads_kv, s_kv, d_qk, dtype=dtype, device="meta")
    v = torch.empty(2, heads_kv, s_kv, d_v, dtype=dtype, device="meta")
    mask = None if causal is None else ca.Causal(causal)
    if padding:
        lens = ca.Padding((s_q, s_q // 2), (s_kv, s_kv // 3))
        mask = lens if mask is None else mask & lens
    return fp8_problem(q, k, v, mask=mask, scale=0.125, sink=sink)


GRID = list(itertools.product(("h100", "b200"), (False, True),
                              ((128, 128), (64, 64), (256, 256), (192, 128)),
                              (None, "top_left", "bottom_right"), ((256, 256), (128, 384))))


def test_declared_fp8_limits_hold_exactly_where_cudnn_plans(deviceless):
    from cudnn_attn.graphs.fp8_plans import plan_fp8

    seen = {True: 0, False: 0}
    for device, backward, dims, causal, seqs in GRID:
        spec, reasons = cudnn_fp8_reasons(_problem(dims, causal, seqs=seqs), backward,
                                          sm=SM[device], version=VERSION)
        result = plan_fp8(spec, backward, device, build=FULL)
        seen[result.ok] += 1
        assert result.ok == (not reasons), (device, backward, dims, causal, seqs,
                                            result.refusal, reasons)
    assert seen[True] > 10 and seen[False] > 10


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("device", ["h100", "b200"])
def test_training_graphs_build_fp8_plans(deviceless, device, backward):
    """Padding, causal, GQA, sinks (and their gradient), E4M3 in and E5M2 dO: the hybrid recipe's
    graphs build an FP8 kernel for the architecture."""
    from cudnn_attn.graphs.fp8_plans import plan_fp8

    problem = _problem((128, 128), "top_left", padding=True, sink=True)
    if backward:
        problem = dataclasses.replace(problem, out=E5M2, dsink=True)
    spec, reasons = cudnn_fp8_reasons(problem, backward, sm=SM[device], version=VERSION)
    result = plan_fp8(spec, backward, device)
    if device == "h100" and not backward:  # the declared limit: cuDNN's kernel does not build
        assert "sink tokens" in " ".join(reasons)
        assert not result.ok and "build_plans" in result.refusal
        result = plan_fp8(dataclasses.replace(spec, sink=False), backward, device)
    else:
        assert reasons == []
    assert result.ok, result.refusal
    arch = "sm90" if device == "h100" else "sm100"
    names = " ".join(result.engine.kernels)
    assert arch in names and "f8" in names, names


def test_no_fp8_plan_on_ampere(deviceless):
    from cudnn_attn.graphs.fp8_plans import plan_fp8

    spec, reasons = cudnn_fp8_reasons(_problem((128, 128), None), False, sm=80, version=VERSION)
    assert "Hopper (sm_90) and newer" in " ".join(reasons)
    result = plan_fp8(spec, False, "a100", build=False)
    assert not result.ok and "Hopper" in result.refusal
