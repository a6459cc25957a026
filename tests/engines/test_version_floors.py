"""The cuDNN engine's limits as a function of ``cudnn.backend_version()`` (issue 36, item 4).

An H200 with cuDNN 9.19 got ``explain() -> cudnn selected`` for a 2-D neighborhood; the build
then failed ("SetAttribute CUDNN_ATTR_TENSOR_CONSTANT_VALUE requires cudnn version 9.22.0") and
the call ran on CuPy. Here the deviceless sweep's problems are analyzed for the oldest backend
the extras allow (9.19.0) and for the newest (9.28.0, the one installed here, which the real
deviceless plans use): each floor shows at 9.19 exactly where the frontend documents it, and what
the engine claims at 9.19 plans with the installed cuDNN.
"""

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch
import cudnn_fake
from deviceless_plans import (FAMILIES, TARGETS, deviceless, directions, needs_fe,  # noqa: F401
                              problem_for)

import cudnn_attn as ca
from cudnn_attn.graphs import _spec, cache_files
from cudnn_attn.graphs._spec import analyze
from cudnn_attn.core.env import cudnn_version_text as version_text
from cudnn_attn.graphs.limits import LIMITS
from cudnn_attn.graphs.targets import target as as_target
from cudnn_attn.model.score_mods import trace

OLDEST, NEWEST = 91900, 92800
ROOT = Path(__file__).resolve().parents[2]


def meta(*shape, dtype=torch.float16):
    return torch.empty(shape, dtype=dtype, device="meta")


def _gen_index_causal(g, s):  # a score_mod without a numeric constant
    i, j = g.gen_index(input=s, axis=2), g.gen_index(input=s, axis=3)
    return g.binary_select(input0=s, input1=g.sub(a=s, b=s), mask=g.cmp_le(input=j, comparison=i))


# The score_mod graphs (the same kinds as test_score_mods' deviceless families).
SCORE_MOD = {
    "softcap": dict(softcap=30.0),
    "natten-1d": dict(mask=ca.Neighborhood((256,), (127,))),
    "natten-2d": dict(mask=ca.Neighborhood((16, 16), (9, 9))),
    "natten-1d-causal-band": dict(mask=ca.Neighborhood((256,), (31,), is_causal=True)),
    "score-mod-no-constant": dict(score_mod=trace(_gen_index_causal)),
}


def score_mod_problem(name, backward):
    q = meta(2, 4, 256, 64)
    problem = ca.AttnProblem.from_tensors(q, q, q, **SCORE_MOD[name])
    return dataclasses.replace(problem, requires_grad=backward)


def sweep():
    """``(label, problem, options, backward, sm)`` of the deviceless sweep."""
    for name, fam in FAMILIES.items():
        for direction in directions(fam):
            for device in TARGETS:
                yield (f"{name}-{direction}-{device}", problem_for(name, direction), fam.options,
                       direction == "bwd", as_target(device).sm)
    for name in SCORE_MOD:
        for backward in (False, True):
            for device in TARGETS:
                yield (f"{name}-{'bwd' if backward else 'fwd'}-{device}",
                       score_mod_problem(name, backward), None, backward, as_target(device).sm)


def documented_floors(problem, backward, sm) -> set:
    """The floors above 9.19 the frontend 1.32 documents for what this graph uses (its own
    messages, not the engine's table): score_mod 9.21, constant tensors 9.22, and on sm_10x the
    D 256 backward kernel 9.26."""
    floors = set()
    hood = problem.neighborhood
    banded = hood is not None and len(hood.spatial_shape) == 1 and hood.is_causal[0] \
        and hood.dilation[0] == 1  # cuDNN's own diagonal band, no score_mod
    if problem.softcap is not None or problem.score_mod is not None or (hood and not banded):
        floors.add("9.21.0")
        if problem.softcap is not None or hood is not None:
            floors.add("9.22.0")  # the window's and the cap's numbers are constants
    if backward and sm // 10 == 10 and (problem.dim_qk, problem.dim_v) == (256, 256):
        floors.add("9.26.0")
    return floors


CASES = list(sweep())


@pytest.mark.parametrize("label,problem,options,backward,sm", CASES,
                         ids=[c[0] for c in CASES])
def test_the_oldest_backend_declines_exactly_the_documented_floors(label, problem, options,
                                                                    backward, sm):
    spec_new, new = analyze(problem, target_sm=sm, options=options, backward=backward,
                            version=NEWEST)
    spec_old, old = analyze(problem, target_sm=sm, options=options, backward=backward,
                            version=OLDEST)
    assert set(new) <= set(old), (new, old)
    added = set(old) - set(new)
    found = {v for r in added for v in re.findall(r"needs cuDNN >= (\d+\.\d+\.\d+), have 9\.19\.0",
                                                 r)}
    assert len(found) == len(added), added  # every new reason names its floor and the version
    assert found == documented_floors(problem, backward, sm)
    if spec_old is not None and spec_new is not None:
        # the one feature the engine drops rather than declines: the sm_10x block mask
        assert dataclasses.replace(spec_old, block_mask=spec_new.block_mask) == spec_new
        assert not spec_old.block_mask


def test_the_sm100_block_mask_waits_for_9_26():
    problem = ca.AttnProblem.from_tensors(*(meta(1, 2, 1024, 64),) * 3,
                                          mask=ca.Neighborhood((32, 32), (7, 7)))
    assert analyze(problem, target_sm=100, version=NEWEST)[0].block_mask
    assert analyze(problem, target_sm=100, version=92600)[0].block_mask
    assert not analyze(problem, target_sm=100, version=92599)[0].block_mask
    assert not analyze(problem, target_sm=90, version=NEWEST)[0].block_mask


def test_each_floor_is_exact_at_its_version():
    q = meta(2, 4, 256, 64)
    hood = ca.AttnProblem.from_tensors(q, q, q, mask=ca.Neighborhood((16, 16), (9, 9)))
    assert ca.graphs.cudnn_reasons(hood, 90, version=92200) == []
    late = ca.graphs.cudnn_reasons(hood, 90, version=92199)
    assert late == ["a score_mod with numeric constants (constant tensors, "
                    "CUDNN_ATTR_TENSOR_CONSTANT_VALUE) needs cuDNN >= 9.22.0, have 9.21.99"]
    free = ca.AttnProblem.from_tensors(q, q, q, score_mod=trace(_gen_index_causal))
    assert ca.graphs.cudnn_reasons(free, 90, version=92100) == []
    assert any("9.21.0" in r for r in ca.graphs.cudnn_reasons(free, 90, version=92000))
    d256 = dataclasses.replace(ca.AttnProblem.from_tensors(
        *(meta(1, 2, 128, 256, dtype=torch.bfloat16),) * 3), requires_grad=True)
    assert ca.graphs.cudnn_reasons(d256, 100, version=92600) == []
    assert ca.graphs.cudnn_reasons(d256, 100, version=92599) == [
        "cuDNN's SDPA backward on sm_100 with D_qk=256, D_v=256 needs cuDNN >= 9.26.0, "
        "have 9.25.99"]
    old = ca.graphs.cudnn_reasons(ca.AttnProblem.from_tensors(q, q, q), 90, version=91002)
    assert old == ["cudnn_attn's cuDNN engine needs cuDNN >= 9.19.0, have 9.10.2"]


def test_the_default_version_is_the_installed_backends(monkeypatch):
    q = meta(2, 4, 256, 64)
    hood = ca.AttnProblem.from_tensors(q, q, q, mask=ca.Neighborhood((16, 16), (9, 9)))
    monkeypatch.setattr(cache_files, "cudnn_versions", lambda: (OLDEST, "1.32.0"))
    assert any("9.22.0" in r for r in ca.graphs.cudnn_reasons(hood, 90))
    assert ca.graphs.cudnn_reasons(hood) == []  # no architecture: no backend to ask
    monkeypatch.setattr(cache_files, "cudnn_versions", lambda: (None, None))
    assert ca.graphs.cudnn_reasons(hood, 90) == []  # cudnn not installed: nothing to read


def test_the_extras_require_the_engines_floor():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+")
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    floor = version_text(LIMITS.min_backend_version).rsplit(".", 1)[0]  # "9.19"
    for extra, wheel in (("cu12", "nvidia-cudnn-cu12"), ("cu13", "nvidia-cudnn-cu13")):
        pins = [r for r in extras[extra] if r.startswith(wheel)]
        assert pins == [f"{wheel}>={floor}"], (extra, pins)


# -- deviceless: what the engine claims at 9.19 plans with the installed cuDNN -------------------

@needs_fe
def test_what_the_oldest_backend_is_given_plans_on_the_installed_one(deviceless):  # noqa: F811
    import cudnn

    assert cudnn.backend_version() >= NEWEST  # the sweep's "newest" is what plans here
    problem = ca.AttnProblem.from_tensors(*(meta(1, 2, 1024, 64),) * 3,
                                          mask=ca.Neighborhood((32, 32), (7, 7)))
    spec = analyze(problem, target_sm=100, version=OLDEST)[1]
    assert spec and "9.22.0" in spec[-1]  # 9.19 runs no neighborhood graph at all
    for version in (92200, 92500):  # a neighborhood without the block mask (cuDNN < 9.26)
        gspec, reasons = analyze(problem, target_sm=100, version=version)
        assert not reasons and not gspec.block_mask
        result = deviceless.plan_spec(gspec.forward_variant(False), False, "b200", build=False)
        assert result.ok, result.refusal


# -- explain() and the engine that then runs agree on the user's cuDNN ----------------------------

@needs_fe
@pytest.mark.parametrize("version,runs_cudnn", [(OLDEST, False), (NEWEST, True)])
def test_explain_agrees_with_the_engine_that_runs(monkeypatch, version, runs_cudnn):
    _, built = cudnn_fake.install(monkeypatch)
    monkeypatch.setattr(cache_files, "cudnn_versions", lambda: (version, "1.32.0"))
    monkeypatch.setattr(_spec, "device_sm", lambda device: 90)  # this CPU plays an sm_90 GPU
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 36, 16, generator=g).half() for _ in range(3))
    hood = ca.Neighborhood((6, 6), (3, 3))
    verdicts = ca.explain(q, k, v, mask=hood, backend="cudnn")
    want = ca.attention(q.double(), k.double(), v.double(), mask=hood, backend="torch")
    if runs_cudnn:
        assert verdicts["cudnn"] == "selected"
        out = ca.attention(q, k, v, mask=hood, backend="cudnn")
        assert built and all(spec.score_mod is not None for spec, _ in built)
        torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
    else:
        assert verdicts["cudnn"] != "selected"
        assert any("needs cuDNN >= 9.22.0, have 9.19.0" in r for r in verdicts["cudnn"])
        with pytest.raises(ca.NotSupportedError, match="needs cuDNN >= 9.22.0"):
            ca.attention(q, k, v, mask=hood, backend="cudnn")
        out = ca.attention(q, k, v, mask=hood)  # auto: the engine explain() selects
        chosen = [n for n, r in ca.explain(q, k, v, mask=hood).items() if r == "selected"]
        assert chosen and chosen[0] != "cudnn" and not built
        torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
