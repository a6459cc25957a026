"""``graphs.ordered_launch``: a built graph's backend plan runs through the same C++ call, with
the same arguments, as the frontend's own ``pygraph.execute`` makes for it (the oracle: the
frontend, on a graph planned deviceless for an H100, its C++ entries recorded instead of run);
anything else keeps the frontend's dispatch."""

from __future__ import annotations

import types

import pytest
import torch

import cudnn_attn as ca

cudnn = pytest.importorskip("cudnn")

from cudnn._handle import Handle  # noqa: E402

from cudnn_attn.graphs import sdpa, targets  # noqa: E402
from cudnn_attn.graphs.ordered_launch import VALIDATED, launcher  # noqa: E402
from cudnn_attn.model.problem import AttnProblem  # noqa: E402


# A frontend release the launch was not validated against keeps its own dispatch (which makes
# the same C++ calls: every comparison below holds either way).
_EXPECTED = "_BackendLaunch" if cudnn.__version__.startswith(VALIDATED) else "_FrontendLaunch"


class _Recorded:
    """The lowered C++ graph with its execute entries recorded (and not run); ``result`` is
    what ``_execute_ordered`` answers (``None``: the pack was complete in C++)."""

    def __init__(self, lowered, result=None):
        self._lowered, self.result, self.calls = lowered, result, []

    def __getattr__(self, name):
        return getattr(self._lowered, name)

    def _execute_ordered(self, *args):
        self.calls.append(("_execute_ordered",) + args)
        return self.result

    def _execute_ordered_pack(self, *args):
        self.calls.append(("_execute_ordered_pack",) + args)


def _planned(mask=None, backward=False):
    meta = torch.empty(1, 4, 128, 64, dtype=torch.float16, device="meta",
                       requires_grad=backward)
    problem = AttnProblem.from_tensors(meta, meta, meta, mask=mask)
    build = sdpa.build_backward if backward else sdpa.build_forward
    return build(problem, target=targets.target("h100"))


def _same_calls(first, second):
    assert [c[0] for c in first] == [c[0] for c in second]
    for a, b in zip(first, second):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert x is y or x == y, (a[0], x, y)


@pytest.mark.parametrize("mask, backward", [(ca.Causal(), False), (None, True),
                                            (ca.SlidingWindow(16, 0), False)])
def test_the_launch_makes_the_frontends_own_cpp_call(mask, backward):
    built = _planned(mask, backward)
    graph = built.graph
    recorded = graph._lowered_graph = _Recorded(graph._lowered_graph)
    buffers = [torch.empty(1) for _ in built.order]
    handle = Handle(0x1234, 0, 0)
    graph.execute(buffers, "workspace", handle=handle, tensor_uids=built.order)
    by_frontend, recorded.calls = recorded.calls, []
    launch = launcher(graph, built.order)
    assert type(launch).__name__ == _EXPECTED
    launch(buffers, "workspace", handle)
    _same_calls(by_frontend, recorded.calls)
    assert by_frontend[0][2] is buffers and by_frontend[0][-2] == 0x1234  # buffers, handle


def test_a_pack_the_frontend_finishes_is_finished_as_it_does(monkeypatch):
    built = _planned(ca.Causal())
    graph = built.graph
    raw = ("native", (), (0, 0), ())
    recorded = graph._lowered_graph = _Recorded(graph._lowered_graph, result=raw)
    finished = []

    def finish(schema, result, workspace, override_uids):
        finished.append((schema, result, workspace, override_uids))
        return types.SimpleNamespace(native="packed", workspace="its workspace")

    monkeypatch.setattr(graph, "_finish_ordered", finish)
    buffers = [torch.empty(1) for _ in built.order]
    graph.execute(buffers, "ws", handle=None, tensor_uids=built.order)
    by_frontend, recorded.calls = recorded.calls, []
    finished_by_frontend, finished[:] = list(finished), []
    launcher(graph, built.order)(buffers, "ws", None)
    _same_calls(by_frontend, recorded.calls)
    assert [c[0] for c in recorded.calls] == ["_execute_ordered", "_execute_ordered_pack"]
    assert recorded.calls[1][1:3] == ("packed", "its workspace")
    assert finished == finished_by_frontend and finished[0][1] is raw


def test_another_selected_plan_goes_back_to_the_frontends_dispatch(monkeypatch):
    built = _planned(ca.Causal())
    graph = built.graph
    launch = launcher(graph, built.order)
    through = []
    monkeypatch.setattr(graph, "execute", lambda *a, **kw: through.append((a, kw)))
    graph._plan_index += 1  # as autotuning's choice would
    buffers = [torch.empty(1) for _ in built.order]
    launch(buffers, None, None)
    assert through == [((buffers, None), {"handle": None, "tensor_uids": built.order})]


def test_a_frontend_release_not_validated_keeps_its_own_dispatch(monkeypatch):
    built = _planned(ca.Causal())
    monkeypatch.setattr(cudnn, "__version__", "9.99.0")
    assert type(launcher(built.graph, built.order)).__name__ == "_FrontendLaunch"


def test_graphs_the_launch_cannot_serve_keep_the_frontends_dispatch():
    unplanned = sdpa.build_forward(AttnProblem.from_tensors(
        *(torch.empty(1, 2, 16, 64, dtype=torch.float16, device="meta"),) * 3))
    assert not unplanned.built
    seen = []
    stand_in = types.SimpleNamespace(execute=lambda *a, **kw: seen.append((a, kw)))
    for graph in (unplanned.graph, stand_in):
        launch = launcher(graph, (1, 2))
        assert type(launch).__name__ == "_FrontendLaunch"
    launcher(stand_in, (1, 2))(["q", "k"], "ws", "handle")
    assert seen == [((["q", "k"], "ws"), {"handle": "handle", "tensor_uids": (1, 2)})]


def test_built_graphs_execute_through_their_launch_made_again_for_a_tuned_plan():
    built = _planned(ca.Causal())
    graph = built.graph
    recorded = graph._lowered_graph = _Recorded(graph._lowered_graph)
    tensors = {u: torch.empty(1) for u in built.order}
    built.execute(tensors, None, None)
    first = built.launch
    assert type(first).__name__ == _EXPECTED
    assert recorded.calls[-1][2] == [tensors[u] for u in built.order]
    built.execute(tensors, None, None)
    assert built.launch is first and len(recorded.calls) == 2
    # autotuning selects the last plan it times (each next one "faster")
    times = iter(range(100, 0, -1))
    built.tune(tensors, lambda size: None, None, lambda fn: (fn(), float(next(times)))[1])
    assert built.launch is None and graph._plan_index == graph.get_execution_plan_count() - 1
    recorded.calls = []
    graph.execute([tensors[u] for u in built.order], None, handle=None, tensor_uids=built.order)
    by_frontend, recorded.calls = recorded.calls, []
    built.execute(tensors, None, None)
    assert getattr(built.launch, "plan_index", graph._plan_index) == graph._plan_index
    _same_calls(by_frontend, recorded.calls)


# ---------------------------------------------------------------------------------------------
# on a GPU: the engine's graphs run through the launch, with the frontend's results
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mask", [None, ca.Causal()])
def test_on_the_gpu_the_launch_runs_and_equals_the_frontends_execute(mask):
    from cudnn_attn.graphs import _runtime

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    problem = AttnProblem.from_tensors(q, k, v, mask=mask)
    built = sdpa.build_forward(problem)
    launch = launcher(built.graph, built.order)
    if built.graph.selected_engine is None:  # a backend plan (sm_90): the launch serves it
        assert type(launch).__name__ == _EXPECTED
    context = _runtime.stream_context(q.device)
    outs = []
    for run in (launch, lambda ordered, ws, handle: built.graph.execute(
            ordered, ws, handle=handle, tensor_uids=built.order)):
        out = torch.empty_like(q)
        tensors = {int(sdpa.UID.Q): q, int(sdpa.UID.K): k, int(sdpa.UID.V): v,
                   int(sdpa.UID.SCALE): torch.full((1, 1, 1, 1), 0.125), int(sdpa.UID.O): out}
        with context.shared.lock:
            handle = context.shared.bind(context.stream)
            run([tensors[u] for u in built.order], context.workspace(built.workspace_size),
                handle)
        outs.append(out)
    torch.cuda.synchronize()
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=mask is not None, scale=0.125)
    assert torch.equal(outs[0], outs[1])  # the same plan on the same inputs
    assert (outs[0].double() - reference).abs().max().item() < 2e-2
