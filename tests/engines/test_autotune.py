"""Plan autotuning (issue 35, ``graphs.autotune``), on this CPU: the selection rule with a fake
graph and a fake timer, the opt-in switches, and the engine's first-call tuning through the
stand-in executor of ``cudnn_fake`` (each "plan" computes the documented result, so the output
is checked against the float64 oracle whichever plan runs).
"""

from __future__ import annotations

import pytest
import torch

import cudnn_attn as ca
import cudnn_fake
import oracle
from cudnn_attn.core.caches import clear_caches
from cudnn_attn.graphs import _emit, autotune
from cudnn_attn.graphs import backend as cudnn_backend
from cudnn_attn.graphs._spec import GraphOptions
from cudnn_attn.graphs.plan_choice import EngineChoice
from cudnn_attn.graphs.sdpa import BuiltGraph

F16, F64 = torch.float16, torch.float64
pytestmark = pytest.mark.skipif(not cudnn_fake.frontend_present(),
                                reason="nvidia-cudnn-frontend is not installed")


class RankedPlans:
    """A graph's ranked plan list as the frontend exposes it: ``declines`` are refused at
    build time; ``built`` lists every build, ``ran`` every plan executed."""

    def __init__(self, count: int, declines=(), inner=None):
        self.count, self.declines, self.inner = count, set(declines), inner
        self.built, self.ran, self.selected = [], [], 0

    def get_execution_plan_count(self):
        return self.count

    def build_plan_at_index(self, index):
        if index in self.declines:
            raise _emit.cudnn_module().cudnnGraphNotSupportedError(f"plan {index} declined")
        self.built.append(index)
        self.selected = index
        return self

    def get_workspace_size_plan_at_index(self, index):
        return 64 * (index + 1)

    def get_workspace_size(self):
        return self.get_workspace_size_plan_at_index(self.selected)

    def get_engine_and_knobs_at_index(self, index):
        return 100 + index, {"TILE_M": index}

    def get_plan_name_at_index(self, index):
        return f"eng{100 + index}"

    def execute_plan_at_index(self, buffers, workspace, index, handle, tensor_uids=None):
        assert workspace is not None and workspace.numel() >= 64 * (index + 1)
        self.ran.append(index)
        self.inner.execute(dict(zip(tensor_uids, buffers)), workspace, handle)

    def execute(self, buffers, workspace, handle=None, tensor_uids=None):
        self.ran.append(("selected", self.selected))
        self.inner.execute(dict(zip(tensor_uids, buffers)), workspace, handle)


# ---------------------------------------------------------------------------------------------
# the selection rule
# ---------------------------------------------------------------------------------------------

def test_the_fastest_plan_that_builds_is_selected():
    graph = RankedPlans(4, declines={2})
    graph.inner = None
    ran = []
    best, timings = autotune.fastest_plan(graph, ran.append,
                                          lambda fn: (fn(), {0: 3.0, 1: 1.5, 3: 2.0}[ran[-1]])[1])
    assert best == 1 and timings == [(0, 3.0), (1, 1.5), (3, 2.0)]
    assert ran == [0, 1, 3] and graph.built[-1] == 1 and graph.selected == 1


def test_a_tie_keeps_the_higher_ranked_plan_and_no_plan_is_an_error():
    graph = RankedPlans(3)
    best, _ = autotune.fastest_plan(graph, lambda i: None, lambda fn: 1.0)
    assert best == 0 and graph.selected == 0
    with pytest.raises(RuntimeError, match="none of the graph's plans"):
        autotune.fastest_plan(RankedPlans(2, declines={0, 1}), lambda i: None, lambda fn: 1.0)


def test_autotuning_is_opt_in(monkeypatch):
    monkeypatch.delenv(autotune.ENV, raising=False)
    assert not autotune.requested() and not autotune.requested(GraphOptions())
    assert autotune.requested(GraphOptions(autotune=True))
    monkeypatch.setenv(autotune.ENV, "1")
    assert autotune.requested()
    monkeypatch.setenv(autotune.ENV, "0")
    assert not autotune.requested()


def test_the_tuned_choice_survives_the_cache_files_json():
    choice = EngineChoice(9, (("TILE_M", 3),), "eng9", (), ((0, 2.5), (4, 1.25)))
    again = EngineChoice.from_json(choice.to_json())
    assert again == choice and again.autotuned and "fastest of 2 timed plans" in str(again)
    assert not EngineChoice.from_json({"engine_id": 1, "knobs": []}).autotuned


# ---------------------------------------------------------------------------------------------
# the engine tunes each graph on its first call, once
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def tuned_engine(monkeypatch):
    """The fake cuDNN engine whose graphs offer 3 ranked plans (plan 1 declined; plan 2 the
    fastest by the fake timer) and are built as the engine builds them (``build_graph``'s
    default: the environment decides). Yields ``[(ranked plans, BuiltGraph), ...]``."""
    cudnn_fake.install(monkeypatch)
    graphs = []

    def build(problem, spec, backward):
        inner = cudnn_fake.FakeGraph(*cudnn_fake.serialized_graph(spec, backward))
        ranked = RankedPlans(3, declines={1}, inner=inner)
        inputs, outputs = _emit.io_uids(spec, backward)
        built = BuiltGraph(ranked, spec, backward, inputs, outputs, 64, True,
                           autotune=autotune.requested())
        graphs.append((ranked, built))
        return built

    def time_ms(fn):  # the plan a call ran, from the ranked lists it appended to
        before = [len(ranked.ran) for ranked, _ in graphs]
        fn()
        (index,) = [i for (ranked, _), n in zip(graphs, before) for i in ranked.ran[n:]]
        return {0: 2.0, 2: 0.5}[index]

    monkeypatch.setattr(cudnn_backend, "build_graph", build)
    monkeypatch.setattr(autotune, "cuda_time_ms", time_ms)
    yield graphs
    clear_caches()


def test_the_first_call_times_each_plan_and_later_calls_run_the_fastest(tuned_engine,
                                                                        monkeypatch):
    monkeypatch.setenv(autotune.ENV, "1")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 24, 16, generator=g).to(F16) for _ in range(3))
    ref, _ = oracle.reference_attention(q.to(F64), k.to(F64), v.to(F64),
                                        oracle.build_visibility(2, 24, 24, causal="top_left"))
    for _ in range(3):
        out = ca.attention(q, k, v, mask=ca.Causal(), backend="cudnn")
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
    ((ranked, built),) = tuned_engine
    assert ranked.built == [0, 2, 2]  # each plan that builds, then the fastest selected
    assert ranked.ran == [0, 2] + [("selected", 2)] * 3
    assert built.tuned and built.workspace_size == 64 * 3
    assert built.engine.engine_id == 102 and built.engine.timings == ((0, 2.0), (2, 0.5))


def test_the_backward_graph_is_tuned_on_its_own_first_call(tuned_engine, monkeypatch):
    monkeypatch.setenv(autotune.ENV, "1")
    q, k, v = (torch.randn(1, 2, 16, 16).to(F16).requires_grad_(True) for _ in range(3))
    for _ in range(2):
        out = ca.attention(q, k, v, backend="cudnn")
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert [b.backward for _, b in tuned_engine] == [False, True]
    for ranked, built in tuned_engine:
        assert built.tuned and ranked.ran == [0, 2] + [("selected", 2)] * 2


def test_without_the_switch_nothing_is_timed(tuned_engine, monkeypatch):
    monkeypatch.delenv(autotune.ENV, raising=False)
    q, k, v = (torch.randn(1, 2, 16, 16).to(F16) for _ in range(3))
    ca.attention(q, k, v, backend="cudnn")
    ca.attention(q, k, v, backend="cudnn")
    ((ranked, built),) = tuned_engine
    assert ranked.built == [] and ranked.ran == [("selected", 0)] * 2 and not built.tuned


def test_a_graph_first_run_inside_a_capture_is_tuned_later(tuned_engine, monkeypatch):
    from cudnn_attn.graphs import _runtime

    monkeypatch.setenv(autotune.ENV, "1")
    q, k, v = (torch.randn(1, 2, 16, 16).to(F16) for _ in range(3))
    monkeypatch.setattr(_runtime, "capturing", lambda: True)
    ca.attention(q, k, v, backend="cudnn")
    ((ranked, built),) = tuned_engine
    assert ranked.built == [] and not built.tuned
    monkeypatch.setattr(_runtime, "capturing", lambda: False)
    ca.attention(q, k, v, backend="cudnn")
    assert built.tuned and ranked.built == [0, 2, 2]
