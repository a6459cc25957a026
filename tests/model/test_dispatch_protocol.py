"""The engine protocol: supports() is pure, a plan build may decline and dispatch then moves on
(once: the decline is remembered per plan key and shown by explain()), forced engines never fall
back, and NotSupportedError lists every engine's reasons."""

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn.core import dispatch
from cudnn_attn.errors import NotSupportedError


@pytest.fixture
def declining_cudnn(monkeypatch):
    """The cuDNN engine accepts everything in supports() and declines every plan build."""
    engine = dispatch.get_backend("cudnn")
    builds = []

    def plan(problem):
        builds.append(problem)
        raise NotSupportedError(problem, {"cudnn": ["cudnnGraphNotSupportedError (test)"]},
                                forced="cudnn")

    monkeypatch.setattr(engine, "supports", lambda problem: [])
    monkeypatch.setattr(engine, "plan", plan)
    ca.clear_caches()
    yield builds
    ca.clear_caches()


def test_a_declined_plan_moves_dispatch_to_the_next_engine_once(declining_cudnn):
    q = torch.randn(1, 2, 8, 16)
    out = ca.attention(q, q, q, mask=ca.Causal())
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out, ref)
    assert len(declining_cudnn) == 1
    ca.attention(q, q, q, mask=ca.Causal(), scale=0.3)   # same plan key: no second build
    assert len(declining_cudnn) == 1
    verdicts = ca.explain(q, q, q, mask=ca.Causal())
    assert verdicts["cudnn"] == ["cudnnGraphNotSupportedError (test)"]
    assert verdicts.selected == "torch"
    with pytest.raises(NotSupportedError, match="cudnnGraphNotSupportedError") as info:
        ca.attention(q, q, q, mask=ca.Causal(), backend="cudnn")
    assert list(info.value.reasons) == ["cudnn"]


def test_supports_and_verdicts_build_nothing(monkeypatch):
    # A CUDA problem that cuDNN accepts on every rule: the old supports() built its graphs here.
    import dataclasses

    from cudnn_attn.graphs import backend as cudnn_backend

    def forbidden(*args, **kwargs):
        raise AssertionError("supports()/verdicts() built a graph")

    monkeypatch.setattr(cudnn_backend, "build_graph", forbidden)
    engine = dispatch.get_backend("cudnn")
    monkeypatch.setattr(engine, "availability", lambda: [])
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    problem = dataclasses.replace(ca.AttnProblem.from_tensors(q, q, q, mask=ca.Causal()),
                                  device=torch.device("cuda", 0))
    ca.clear_caches()
    assert engine.supports(problem) == []
    assert dispatch.verdicts(problem)["cudnn"] == []
    with pytest.raises(AssertionError, match="built a graph"):  # the plan is where builds happen
        engine.plan(problem)
    ca.clear_caches()


def test_not_supported_error_lists_every_engine():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(NotSupportedError) as info:
        ca.attention(q, q, q, backend="cupy")
    assert list(info.value.reasons) == ["cupy"] and info.value.reasons["cupy"]
    assert isinstance(info.value, NotImplementedError)
    explained = ca.explain(q, q, q)
    assert set(explained) == set(dispatch.BACKEND_NAMES)
    assert all(explained[name] for name in ("cudnn", "cupy"))   # reasons on a CPU tensor


def test_errors_module_is_the_public_home_of_the_exception():
    assert ca.NotSupportedError is NotSupportedError is dispatch.NotSupportedError
