"""auto's cost rule for Neighborhood problems (issue 34, "never slower than dense").

Where both the cuDNN engine (dense attention with the exact mask) and the fused CuPy kernels can
run a neighborhood, ``auto`` takes the one with the smaller predicted time (``core/roofline.py``,
``fallback_kernels/tile_model.py``) and ``explain()`` says so. The problems are CUDA problems
described on ``meta`` tensors; the machine checks (CuDNN importable, a GPU, NVRTC) are switched
off so each engine's own problem rules decide. The calibration is checked against issue 34's
H200 measurements (ours vs dense cuDNN on the same tokens): the model must order them alike.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.core import dispatch, roofline
from cudnn_attn.fallback_kernels import backend as cupy_backend
from cudnn_attn.fallback_kernels import tile_model
from cudnn_attn.graphs.score_mod_masks import mask_program


def neighborhood_problem(spatial, kernel, heads, dim, device="cuda", requires_grad=False):
    tokens = math.prod(spatial)
    q = torch.empty(1, tokens, heads, dim, dtype=torch.bfloat16, device="meta")
    problem = ca.AttnProblem.from_tensors(q, q, q, mask=ca.Neighborhood(spatial, kernel),
                                          layout="bshd")
    return dataclasses.replace(problem, device=torch.device(device, 0) if device == "cuda"
                               else torch.device(device), requires_grad=requires_grad)


@pytest.fixture
def gpu_engines(monkeypatch):
    """cuDNN and the CuPy kernels as on a GPU machine; plans are sentinels (nothing builds)."""
    cudnn, cupy = dispatch.get_backend("cudnn"), dispatch.get_backend("cupy")
    monkeypatch.setattr(cudnn, "availability", lambda: [])
    monkeypatch.setattr(cupy_backend, "kernel_reasons", lambda device=None: [])
    monkeypatch.setattr(cudnn, "plan", lambda problem: "cudnn plan")
    monkeypatch.setattr(cupy, "plan", lambda problem: "cupy plan")
    ca.clear_caches()
    yield
    ca.clear_caches()


# The third H200 run (ms per forward, back to back): ours 0.47 (the host's pace: its kernel
# takes 0.07), dense cuDNN 0.15; and ours 0.40 (kernel 0.16), dense 1.78.
SMALL = ((64, 64), (13, 13), 16, 64)
LARGE_SMALL_KERNEL = ((128, 128), (7, 7), 8, 128)


def test_auto_picks_dense_cudnn_for_the_small_problem(gpu_engines):
    problem = neighborhood_problem(*SMALL)
    engine, plan = dispatch.plan_for(problem)
    assert (engine.name, plan) == ("cudnn", "cudnn plan")
    verdicts, cost = dispatch.auto_verdicts(problem)
    assert verdicts == {"cudnn": "selected", "cupy": "available", "torch": "available"}
    assert cost.best == "cudnn" and cost.predicted["cudnn"] < cost.predicted["cupy"]
    (reason,) = cost.passed_over["cupy"]
    assert reason.startswith("auto prefers cudnn: predicted ") and "backend='cupy'" in reason


def test_auto_picks_the_fused_kernels_for_a_large_problem_with_a_small_kernel(gpu_engines):
    problem = neighborhood_problem(*LARGE_SMALL_KERNEL)
    assert dispatch.plan_for(problem)[0].name == "cupy"
    verdicts, cost = dispatch.auto_verdicts(problem)
    assert verdicts == {"cudnn": "available", "cupy": "selected", "torch": "available"}
    assert cost.best == "cupy" and list(cost.passed_over) == ["cudnn"]


def test_explain_says_which_and_why(gpu_engines, monkeypatch):
    from cudnn_attn.cli.explain import explain_problem

    problem = neighborhood_problem(*SMALL)
    shown = explain_problem("cuda:0", problem)
    cost = dispatch.cost_choice(problem)
    assert shown.selected == "cudnn" and shown.predicted_ms == cost.predicted
    expected = (f"auto picks cudnn by predicted time: cudnn {cost.predicted['cudnn']:.3g} ms vs "
                f"cupy {cost.predicted['cupy']:.3g} ms (roofline cost model)")
    assert shown.why == expected and expected in str(shown)


def test_forced_backends_ignore_the_cost_rule(gpu_engines):
    problem = neighborhood_problem(*SMALL)
    assert dispatch.plan_for(problem, "cupy")[0].name == "cupy"
    verdicts, cost = dispatch.auto_verdicts(problem, "cupy")
    assert verdicts["cupy"] == "selected" and cost.best is None and not cost.predicted
    problem = neighborhood_problem(*LARGE_SMALL_KERNEL)
    assert dispatch.plan_for(problem, "cudnn")[0].name == "cudnn"


def test_a_declining_engine_leaves_the_other(gpu_engines, monkeypatch):
    # cuDNN unavailable (or declining: gpufix-b's version floors): the fused kernels run it.
    monkeypatch.setattr(dispatch.get_backend("cudnn"), "availability",
                        lambda: ["cuDNN too old (test)"])
    problem = neighborhood_problem(*SMALL)
    assert dispatch.plan_for(problem)[0].name == "cupy"
    verdicts, cost = dispatch.auto_verdicts(problem)
    assert verdicts["cupy"] == "selected" and cost.why == "" and list(cost.predicted) == ["cupy"]


def test_other_masks_keep_the_priority_order(gpu_engines):
    q = torch.empty(1, 512, 8, 64, dtype=torch.bfloat16, device="meta")
    problem = dataclasses.replace(ca.AttnProblem.from_tensors(q, q, q, mask=ca.Causal(),
                                                              layout="bshd"),
                                  device=torch.device("cuda", 0))
    assert dispatch.cost_choice(problem).predicted == {}
    assert dispatch.plan_for(problem)[0].name == "cudnn"


def test_cpu_problems_are_unaffected():
    problem = neighborhood_problem(*SMALL, device="cpu")
    assert dispatch.cost_choice(problem) == dispatch.CostChoice()
    verdicts, _ = dispatch.auto_verdicts(problem)
    assert verdicts["torch"] == "selected"
    q = torch.randn(1, 2, 36, 8)
    out = ca.attention(q, q, q, mask=ca.Neighborhood((6, 6), (3, 3)))
    assert ca.explain(q, q, q, mask=ca.Neighborhood((6, 6), (3, 3))).selected == "torch"
    assert out.shape == q.shape and ca.explain(q, q, q).why == ""


# The third H200 run's bf16 rows (benchmarks/results/neighborhood-2026-11-29.json and more/,
# profile_na-2026-11-29.json): (spatial, kernel, heads, D, ours: the fused forward's kernel ms,
# dense cuDNN SDPA's forward ms over every token). The two small problems were host-bound back
# to back (0.47 and 0.40 ms per call): theirs is the profile's kernel time (the same problems).
MEASURED = [((128, 128), (31, 31), 16, 128, 1.101, 3.529),
            ((128, 128), (7, 7), 8, 128, 0.164, 1.776),
            ((64, 64), (13, 13), 16, 64, 0.069, 0.152),
            ((32768,), (2048,), 16, 128, 2.523, 14.651),
            ((32, 32, 32), (7, 7, 7), 16, 128, 1.831, 14.619)]


@pytest.mark.parametrize("row", MEASURED, ids=lambda r: f"{r[0]}k{r[1]}")
def test_the_calibration_orders_the_measured_rows(row):
    spatial, kernel, heads, dim, ours, dense = row
    figures = tile_model.neighborhood_figures(spatial, kernel, dim_qk=dim, heads=heads)
    h200 = roofline.DEVICE_CEILINGS["H200"]
    fused = tile_model.predicted_ms(figures, "fwd", h200)
    tokens = math.prod(spatial)
    ops = len(mask_program(neighborhood=ca.Neighborhood(spatial, kernel)).ops)
    predicted_dense = roofline.dense_ms("fwd", ceilings=h200, mask_ops=ops, batch=1,
                                        heads=heads, heads_kv=heads, seq_q=tokens,
                                        seq_kv=tokens, dim_qk=dim, dim_v=dim,
                                        dtype=torch.bfloat16)
    assert (fused < predicted_dense) == (ours < dense)
    assert 0.5 < ours / fused < 2.0  # the fit's spread (0.64-1.27x)


def test_the_host_sets_a_small_problems_pace():
    """Back to back, the slower of the host and the kernels sets the pace: a small problem's
    prediction is the host's time per call (``tile_model.HOST_MS``), a large one's the kernels'
    (the third H200 run: 2-D 64x64 k13 took 0.47 ms per forward, its kernel 0.07 ms)."""
    h200 = roofline.DEVICE_CEILINGS["H200"]
    engine = cupy_backend.CupyBackend()
    for spatial, kernel, heads, dim, host_bound in ((*SMALL, True),
                                                    ((128, 128), (31, 31), 16, 128, False)):
        for grad in (False, True):
            problem = neighborhood_problem(spatial, kernel, heads, dim, requires_grad=grad)
            figures = tile_model.neighborhood_figures(spatial, kernel, dim_qk=dim, heads=heads)
            directions = ("fwd", "bwd") if grad else ("fwd",)
            kernels = sum(tile_model.predicted_ms(figures, d, h200) for d in directions)
            host = sum(tile_model.HOST_MS[d] for d in directions)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(roofline, "ceilings_for", lambda device: h200)
                mp.setattr(roofline, "capability_for", lambda device: (8, 0))  # 64-slot boxes
                predicted = engine.predicted_ms(problem)
            assert predicted == pytest.approx(host if host_bound else kernels)


def test_roofline_takes_the_larger_ceiling():
    ceilings = roofline.Ceilings("test", bandwidth=1e12, matmul=1e14, pointwise=1e13)
    assert roofline.roofline_ms([(1e11, 0.5)], 1e9, ceilings) == pytest.approx(2.0)
    assert roofline.roofline_ms([(1e11, 0.5)], 4e9, ceilings) == pytest.approx(4.0)
    assert roofline.roofline_ms([(1e11, 0.5), (1e11, 1.0)], 0, ceilings) == pytest.approx(3.0)
    assert roofline.roofline_ms([(1e11, 0.5)], 0, ceilings, pointwise_ops=5e10) == \
        pytest.approx(5.0)
    assert roofline.roofline_ms([(1e11, 0.5)], 0, ceilings, torch.float32) == pytest.approx(32.0)
    assert roofline.score_flops(256, 256) == 1024 and roofline.score_flops(32, 32) == 512


def test_a_declined_plan_of_the_preferred_engine_goes_back_to_the_other(gpu_engines,
                                                                         monkeypatch):
    # the cost rule prefers the fused kernels (k7), whose plan build then declines: cuDNN,
    # passed over for its predicted time, runs it, not the torch engine after it.
    builds = []

    def declines(problem):
        builds.append(problem)
        raise ca.NotSupportedError(problem, {"cupy": ["declined (test)"]}, forced="cupy")

    monkeypatch.setattr(dispatch.get_backend("cupy"), "plan", declines)
    problem = neighborhood_problem(*LARGE_SMALL_KERNEL)
    assert dispatch.plan_for(problem)[0].name == "cudnn"
    assert len(builds) == 1 and dispatch.auto_verdicts(problem)[0]["cupy"] == ["declined (test)"]


def test_a_declining_preferred_cudnn_hands_the_call_to_the_fused_kernels(gpu_engines,
                                                                        monkeypatch):
    # cuDNN 9.19 on the H200 (issue 36): supports() says yes, the 2-D neighborhood graph then
    # declines at build (needs 9.22). The small problem prefers cuDNN; after the decline the
    # fused kernels run it, not the torch engine, and explain() shows the remembered decline.
    def declines(problem):
        raise ca.NotSupportedError(problem, {"cudnn": ["requires cudnn version 9.22.0 (test)"]},
                                   forced="cudnn")

    monkeypatch.setattr(dispatch.get_backend("cudnn"), "plan", declines)
    problem = neighborhood_problem(*SMALL)
    assert dispatch.plan_for(problem)[0].name == "cupy"
    verdicts, cost = dispatch.auto_verdicts(problem)
    assert verdicts["cudnn"] == ["requires cudnn version 9.22.0 (test)"]
    assert verdicts["cupy"] == "selected" and cost.best is None
