"""Where the engine cuDNN picked shows: ``graphs.describe(..., target=)``,
``deviceless.describe_plan``, ``cudnn-attn explain --target`` and ``explain()`` (from the graph
cache, building nothing)."""

import torch
import cudnn_fake
from deviceless_plans import deviceless, needs_fe  # noqa: F401

import cudnn_attn as ca
from cudnn_attn import cli
from cudnn_attn.graphs import describe
from cudnn_attn.graphs._spec import analyze
from cudnn_attn.graphs.cache import make_key

import pytest


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


@needs_fe
def test_describe_with_a_target_plans_the_graph(deviceless):  # noqa: F811
    q = meta(2, 8, 512, 128)
    graph = describe(q, q, q, mask=ca.Causal(), target="h100")
    assert graph.get_plan_name_at_index(0).startswith("eng9_")  # Hopper flash fprop
    plan = deviceless.describe_plan(q, q, q, mask=ca.Causal(), target="h100")
    assert str(plan).startswith("forward on h100: engine 9 [KERNEL_CFG=1")
    assert "_sm90_flash_fprop_" in str(plan)
    back = deviceless.describe_plan(q, q, q, mask=ca.Causal(), target="a100", backward=True)
    assert back.engine.engine_id == 7 and "_sm80_flash_bprop_" in back.engine.kernels[-1]


@needs_fe
def test_describe_with_a_target_raises_what_cudnn_or_the_limits_refuse(deviceless):  # noqa: F811
    q = meta(2, 4, 256, 128)
    with pytest.raises(ca.NotSupportedError, match="no sm_100 engine for a forward with Philox"):
        describe(q, q, q, dropout_p=0.1, target="b200")
    assert describe(q, q, q, dropout_p=0.1, target="h100") is not None


@needs_fe
def test_cli_explain_names_the_engine_for_a_target(capsys, deviceless):  # noqa: F811
    code = cli.main(["explain", "--shape", "2,8,512,128", "--mask", "causal", "--target", "h100"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "cuDNN execution plan for h100 (planned without a GPU): engine 9 [" in out
    assert "_sm90_flash_fprop_" in out
    code = cli.main(["explain", "--shape", "2,8,512,128", "--target", "v100"])
    out, err = capsys.readouterr()
    assert code == 2 and "neither a shipped device" in err and not out


@needs_fe
def test_explain_shows_the_engine_of_a_cached_graph_without_building(monkeypatch, deviceless):  # noqa: F811
    # The stand-in executor makes "cudnn" eligible on this CPU; the graph cache holds a graph
    # planned (deviceless) for an H100, as it would after a call on one.
    cache, built = cudnn_fake.install(monkeypatch)
    q = torch.zeros(1, 4, 128, 64, dtype=torch.float16)
    problem = ca.AttnProblem.from_tensors(q, q, q, mask=ca.Causal())
    spec = analyze(problem)[0].forward_variant(False)
    planned = deviceless.plan_spec(spec, False, "h100").built
    cache.get_or_build(make_key(("sdpa_forward", spec), problem.device), lambda: planned)
    before = cache.info()
    verdicts = ca.explain(q, q, q, mask=ca.Causal())
    assert verdicts["cudnn"] == "selected"
    assert verdicts.engines == {"sdpa_forward": planned.engine}
    assert "cuDNN sdpa_forward: engine 9 [" in str(verdicts)
    after = cache.info()
    assert (after["builds"], after["hits"], after["misses"]) == (
        before["builds"], before["hits"], before["misses"]) and not built
    assert ca.explain(q, q, q).engines == {}  # no mask: another graph, not cached
