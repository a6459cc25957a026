"""Graph caches warmed ahead of time on this CPU machine for a described GPU (``graphs.aot``,
``cudnn-attn cache warm --target``).

* The files hold serialized graphs with their plans, for the target: the header carries the
  target's environment, the payload the engine and kernels cuDNN picked, and the cuDNN blob
  deserializes back into cuDNN (against the same description, without a GPU).
* A process whose environment matches the target (what an H100 reports) loads them and serves
  the cuDNN engine's own keys with zero plan builds; any other environment (another GPU name,
  SM count or compute capability, another cuDNN version) rejects them and rebuilds.
* The keys are the ones ``CudnnPlan`` asks for (checked through the stand-in executor).
Executing such a plan on a GPU is not checked here (no GPU): that is the GPU proof's job.
"""

import json

import pytest
import torch
import cudnn_fake
from deviceless_plans import deviceless, needs_fe  # noqa: F401

import cudnn_attn as ca
from cudnn_attn import cli
from cudnn_attn.core import dispatch
from cudnn_attn.core.caches import clear_caches
from cudnn_attn.graphs import aot, cache_files
from cudnn_attn.graphs.cache import GraphCache, make_key
from cudnn_attn.graphs.sdpa import BuiltGraph
from cudnn_attn.graphs.targets import target

CONFIG = {"defaults": {"dtype": "bf16"}, "problems": [
    {"name": "prefill-causal", "shape": [1, 8, 512, 128], "heads_kv": 2, "mask": "causal"},
    {"name": "train-window", "shape": [2, 4, 256, 64], "mask": "window:64,0", "backward": True},
]}


def problems(device="meta"):
    from cudnn_attn.cli.specs import build_inputs

    out = []
    for spec in CONFIG["problems"]:
        q, k, v, kwargs = build_inputs({**CONFIG["defaults"], **spec}, device)
        out.append(ca.AttnProblem.from_tensors(q, k, v, **kwargs))
    return out


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDNN_ATTN_CACHE_KEY_FILE",
                  str(tmp_path_factory.mktemp("config") / "graph-cache.key"))
        yield


@pytest.fixture(scope="module")
def warmed(tmp_path_factory, key_file, deviceless):  # noqa: F811
    directory = tmp_path_factory.mktemp("warm-h100")
    results, written = aot.warm(problems(), "h100", directory)
    return directory, results, written


def backend_keys(monkeypatch, problem_list):
    """The keys the cuDNN engine's plans look up for ``problem_list`` on ``cuda:0`` (recorded by
    running them through the stand-in executor, whose device is the CPU)."""
    fresh, _ = cudnn_fake.install(monkeypatch)
    engine = dispatch.get_backend("cudnn")
    for problem in problem_list:
        import dataclasses

        engine.plan(dataclasses.replace(problem, device=torch.device("cpu")))
    keys = [make_key(key[0], torch.device("cuda", 0)) for key in fresh.keys()]
    clear_caches()
    return keys


@needs_fe
def test_warmed_files_hold_plans_for_the_target(warmed):
    directory, results, written = warmed
    assert written == 3 and all(r.ok for r in results)  # forward; forward + backward
    assert [tag for tag, _ in results[1].graphs] == ["sdpa_forward", "sdpa_backward"]
    for _, engine in results[0].graphs + results[1].graphs:
        assert engine.engine_id in (6, 9) and any("_sm90_" in k for k in engine.kernels)
    files = sorted(directory.iterdir())
    assert len(files) == 3
    env = target("h100").environment()
    for path in files:
        kind, key_text, payload = cache_files.decode_file(
            path.read_bytes(), env, cache_files_secret(), 1 << 30)
        assert kind == "cudnn_attn.sdpa"
        meta, blob = BuiltGraph.split_payload(payload)
        assert meta["target"] == "h100" and meta["engine"]["kernels"]
        assert len(blob) > 10_000
        built = aot.load_deviceless(payload, "h100")  # cuDNN reads the plan back
        assert built.built and built.engine.engine_id == meta["engine"]["engine_id"]
        assert built.workspace_size == meta["workspace"]


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@needs_fe
def test_cli_warms_a_cache_for_a_target(tmp_path, capsys, warmed):
    config = tmp_path / "warm.json"
    config.write_text(json.dumps({**CONFIG, "problems": CONFIG["problems"] + [
        {"name": "head-dim-512", "shape": [1, 4, 256, 512]}]}))
    out_dir = tmp_path / "cache"
    code, out, err = run_cli(capsys, "cache", "warm", config, "--target", "h100", "--save",
                             out_dir)
    assert code == 0, err
    assert "target h100: NVIDIA H100 80GB HBM3, sm_90, 132 SMs" in out
    assert "sdpa_backward: engine 6 [" in out and "_sm90_flash_bprop_" in out
    assert "head-dim-512: declined on h100: cuDNN's SDPA engines serve head dims up to" in out
    assert "saved 3 graph file(s)" in out
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        p.name for p in warmed[0].iterdir())  # the same keys as aot.warm's
    # (runs before the tests below: they empty the per-process plan cache this one reuses)


def cache_files_secret():
    from cudnn_attn.graphs.cache import secret_key

    return secret_key()


@needs_fe
def test_a_matching_gpu_serves_the_engines_keys_without_building(warmed, monkeypatch):
    directory, results, _ = warmed
    keys = backend_keys(monkeypatch, problems())
    assert len(keys) == 3
    # What BuiltGraph.from_bytes does on an H100, done against the description on this CPU.
    monkeypatch.setitem(cache_files._DESERIALIZERS, "cudnn_attn.sdpa",
                        lambda payload: aot.load_deviceless(payload, "h100"))
    h100 = GraphCache(environment=target("h100").environment)
    assert h100.load(directory) == 3

    def build():
        raise AssertionError("a warmed graph was rebuilt")

    served = [h100.get_or_build(key, build) for key in keys]
    info = h100.info()
    assert info["builds"] == 0 and info["loads"] == 3 and info["rejected_files"] == 0
    engines = {engine for r in results for _, engine in r.graphs}
    assert {g.engine for g in served} == engines and all(g.built for g in served)


@needs_fe
@pytest.mark.parametrize("change", [
    {"gpu_name": "NVIDIA H200"},                              # same sm_90 and SM count
    {"sm_count": 114},                                        # H100 PCIe
    {"gpu_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0", "sm_count": 108},
    {"cudnn_backend": 92900},                                 # another cuDNN
], ids=["h200", "sm-count", "a100", "cudnn-version"])
def test_another_gpu_rejects_the_files_and_rebuilds(warmed, monkeypatch, change):
    directory, _, _ = warmed
    keys = backend_keys(monkeypatch, problems())
    env = {**target("h100").environment(), **change}
    other = GraphCache(environment=lambda: env)
    assert other.load(directory) == 0 and other.info()["rejected_files"] == 3
    assert [other.get_or_build(key, lambda: "rebuilt") for key in keys] == ["rebuilt"] * 3
    assert other.info()["builds"] == 3


def test_described_environments_tell_the_shipped_gpus_apart():
    envs = {name: target(name).environment() for name in ("a100", "h100", "h200", "b200")}
    assert len({json.dumps(e, sort_keys=True) for e in envs.values()}) == 4
    assert envs["h100"]["sm_count"] == envs["h200"]["sm_count"] == 132  # told apart by name
    assert set(envs["h100"]) == set(cache_files.current_environment())


# ---------------------------------------------------------------------------------------------
# cudnn-attn cache warm --target
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,match", [
    (["--target", "h100"], "give --save DIR"),
    (["--target", "h100", "--save", "X", "--decode", "1,8,8,64"], "--decode: not used"),
])
def test_cli_target_usage_errors(tmp_path, capsys, argv, match):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(CONFIG))
    code, _, err = run_cli(capsys, "cache", "warm", config, *argv)
    assert code == 2 and match in err


def test_cli_unknown_target_is_an_error(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(CONFIG))
    code, _, err = run_cli(capsys, "cache", "warm", config, "--target", "v100", "--save",
                           tmp_path / "d")
    assert code == 2 and "neither a shipped device" in err
