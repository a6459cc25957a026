"""gpu_proof's ``warm-start`` step on the CPU (``benchmarks/warm_start.py``,
``proof_extras.py``): graph caches warmed ahead for the H100 and the H200, loaded on the device.

* The rounds with a real ``GraphCache`` and a serializable stand-in plan: files of the same
  environment serve every key with 0 builds, another environment's are rejected and rebuilt,
  and the record's verdict and summary lines say so.
* ``--prepare`` warms the config for the H100 and the H200 with ``cudnn-attn cache warm
  --target`` (deviceless cuDNN), and the device side picks the matching target's files, which a
  cache of that environment accepts with the carried key.
* The plan entries have bounded shares; without CUDA the script exits 0 and writes nothing.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import load_benchmark
from deviceless_plans import needs_fe

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def warm():
    return load_benchmark("warm_start")


@pytest.fixture(scope="module")
def extras():
    load_benchmark("gpu_proof")
    return sys.modules["proof_extras"]

# ---------------------------------------------------------------------------------------------
# The warm start
# ---------------------------------------------------------------------------------------------

class FakePlan:
    """A stand-in plan the graph cache can save and load (what BuiltGraph is on a GPU)."""

    serial_kind = "test.fake_plan"

    def __init__(self, key):
        self.key = key

    def serialize(self):
        return self.key.encode()


class Clock:
    """Time that moves only when told: a build costs 250 ms, a load 5 ms."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    from cudnn_attn.graphs import cache_files

    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "key" / "graph-cache.key"))
    clock = Clock()

    def restore(payload):
        clock.now += 0.005
        return FakePlan(payload.decode())
    monkeypatch.setitem(cache_files._DESERIALIZERS, FakePlan.serial_kind, restore)
    return clock


def _calls(cache, clock, names=("prefill", "decode", "train")):
    def build(key):
        clock.now += 0.25
        return FakePlan(key)

    return {n: (lambda n=n: cache.get_or_build(("plan", n), lambda: build(n))) for n in names}


H100_ENV = {"gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "sm_count": 132,
            "cudnn_backend": 92800, "cudnn_frontend": "1.32.0"}


def _carried(tmp_path, env, clock):
    from cudnn_attn.graphs.cache import GraphCache

    ahead = GraphCache(environment=lambda: env)
    for call in _calls(ahead, clock).values():
        call()
    assert ahead.save(tmp_path / "carried") == 3
    return tmp_path / "carried"


def test_carried_files_serve_every_first_call_without_a_build(warm, stand_in, tmp_path):
    from cudnn_attn.graphs.cache import GraphCache

    carried = _carried(tmp_path, H100_ENV, stand_in)
    device = GraphCache(environment=lambda: H100_ENV)
    record = warm.run_rounds(_calls(device, stand_in), tmp_path / "work", carried, cache=device,
                             clear=device.clear, clock=stand_in)
    rounds = record["rounds"]
    assert list(rounds) == list(warm.ROUNDS)
    assert (rounds["cold-first"]["builds"], rounds["cold-first"]["files_saved"]) == (3, 3)
    assert rounds["cold"]["builds"] == 3 and rounds["cold"]["loads"] == 0
    for name in ("carried", "saved"):
        assert rounds[name]["files_accepted"] == 3
        assert (rounds[name]["builds"], rounds[name]["loads"]) == (0, 3)
        assert rounds[name]["problems"]["decode"] == {"first_call_ms": 5.0, "builds": 0,
                                                      "loads": 1, "hits": 0,
                                                      "rejected_files": 0}
    assert rounds["cold"]["problems"]["train"]["first_call_ms"] == 250.0
    assert record["verdict"]["carried"] == {
        "ran": True, "builds": 0, "loads": 3, "files_accepted": 3, "rejected_files": 0,
        "goal_met": True, "first_calls_ms": 15.0, "cold_calls_ms": 750.0, "speedup": 50.0}


def test_another_environments_files_are_rejected_and_rebuilt(warm, stand_in, tmp_path):
    from cudnn_attn.graphs.cache import GraphCache

    carried = _carried(tmp_path, {**H100_ENV, "cudnn_backend": 92800}, stand_in)
    device_env = {**H100_ENV, "cudnn_backend": 91900}  # the device image's cuDNN
    device = GraphCache(environment=lambda: device_env)
    record = warm.run_rounds(_calls(device, stand_in), tmp_path / "work", carried, cache=device,
                             clear=device.clear, clock=stand_in)
    carried_round = record["rounds"]["carried"]
    assert carried_round["files_accepted"] == 0 and carried_round["rejected_files"] == 3
    assert carried_round["builds"] == 3
    assert record["verdict"]["carried"]["goal_met"] is False
    assert record["verdict"]["carried"]["speedup"] == 1.0
    assert record["verdict"]["saved"]["goal_met"] is True  # saved on the device: its own env


def test_rounds_past_the_deadline_or_without_files_say_why(warm, stand_in, tmp_path):
    import time

    from cudnn_attn.graphs.cache import GraphCache

    device = GraphCache(environment=lambda: H100_ENV)
    record = warm.run_rounds(_calls(device, stand_in), tmp_path / "work", None, cache=device,
                             clear=device.clear, clock=stand_in)
    assert record["rounds"]["carried"] == {"round": "carried",
                                           "skipped": "no carried files for this GPU"}
    assert record["verdict"]["carried"] == {"ran": False, "why": "no carried files for this GPU"}
    late = warm.run_rounds(_calls(device, stand_in), tmp_path / "late", None, cache=device,
                           clear=device.clear, clock=stand_in, deadline=time.monotonic() - 1)
    assert all(r == {"round": n, "skipped": "no time left"} for n, r in late["rounds"].items())


def test_a_failing_call_is_recorded_not_raised(warm, stand_in, tmp_path):
    from cudnn_attn.graphs.cache import GraphCache

    device = GraphCache(environment=lambda: H100_ENV)

    def broken():
        raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")
    result = warm.run_round("cold", {"bad": broken}, cache=device, clear=device.clear,
                            clock=stand_in)
    assert result["problems"]["bad"] == {"error": "RuntimeError: CUDNN_STATUS_EXECUTION_FAILED"}


def test_the_record_and_summary_lines_of_the_step(warm, extras, stand_in, tmp_path):
    from cudnn_attn.graphs.cache import GraphCache

    carried = _carried(tmp_path, H100_ENV, stand_in)
    device = GraphCache(environment=lambda: H100_ENV)
    record = {"target": "h100", "environment": H100_ENV,
              **warm.run_rounds(_calls(device, stand_in), tmp_path / "work", carried,
                                cache=device, clear=device.clear, clock=stand_in)}
    work = tmp_path / "proof"
    work.mkdir()
    (work / "warm_start-2026-11-28.json").write_text(json.dumps(record))
    summary = extras.summarize("warm-start", work)
    assert summary["target"] == "h100" and summary["verdict"]["carried"]["builds"] == 0
    assert summary["file"] == "warm_start-2026-11-28.json"
    result = extras.StepResult("warm-start", "cmd", returncode=0, summary=summary)
    lines = extras.summary_lines(result, " ")
    assert lines[0] == "  target h100"
    assert "ok   carried: 0 built, 3 loaded, 0 rejected; first calls 15.0 ms vs cold 750.0 ms" \
        in lines[1]
    assert extras.summarize("warm-start", tmp_path / "nothing") == {}
    assert extras.summarize("gpu-tests", work) is None  # not an evidence step


def test_plan_entries_have_bounded_shares(extras, tmp_path):
    gpu_proof = sys.modules["bench_gpu_proof"]
    steps = {s.name: s for s in gpu_proof.plan(tmp_path)}
    start, profile = steps["warm-start"], steps["profile-na"]
    assert (start.phase, start.optional, start.share_s) == (2, False, 40.0)
    assert start.cap_s <= 45 and "--time-limit" in start.argv
    assert float(start.argv[start.argv.index("--time-limit") + 1]) < start.cap_s
    assert start.argv[start.argv.index("--carried") + 1] == str(ROOT / ".graphs")
    assert start.argv[start.argv.index("--results-dir") + 1] == str(tmp_path)
    assert (profile.phase, profile.optional) == (3, True) and profile.cap_s <= 45
    assert float(profile.argv[profile.argv.index("--time-limit") + 1]) < profile.cap_s
    assert profile.argv[profile.argv.index("--results-dir") + 1] == str(tmp_path)
    order = list(steps)  # after the benchmarks it must not delay; before the extra rows
    assert order.index("bench-neighborhood") < order.index("warm-start")
    assert order.index("profile-na") < order.index("bench-cudnn-more")
    # Phase 1 keeps its time: the warm start's share is reserved with the benchmarks'.
    assert gpu_proof.phase_reserve(list(steps.values()), 1) == pytest.approx(
        85 + 65 + 40 + 3 * gpu_proof.LADDER_S)


# ---------------------------------------------------------------------------------------------
# --prepare: the CLI warms both targets; the device side takes its own
# ---------------------------------------------------------------------------------------------

@needs_fe
def test_prepare_warms_both_targets_and_the_device_takes_its_own(warm, tmp_path, monkeypatch):
    from cudnn_attn.graphs.cache import GraphCache
    from cudnn_attn.graphs.targets import target

    config = tmp_path / "problems.json"
    config.write_text(json.dumps({"defaults": {"dtype": "bf16"}, "problems": [
        {"name": "prefill", "shape": [1, 4, 256, 64], "mask": "causal"},
        {"name": "train", "shape": [1, 4, 128, 64], "backward": True}]}))
    folder = tmp_path / ".graphs"
    manifest = warm.prepare(folder, config)
    assert set(manifest["targets"]) == {"h100", "h200"}
    for name, entry in manifest["targets"].items():
        assert entry["exit"] == 0 and entry["files"] == 3, (folder / f"{name}.log").read_text()
        assert entry["environment"] == target(name).environment()
        assert len(list((folder / name).glob("*.cagraph"))) == 3
    assert json.loads((folder / "manifest.json").read_text()) == manifest
    assert (folder / "graph-cache.key").stat().st_size == 32
    # The same keys for both (one device index, one problem set); different environments.
    assert sorted(p.name for p in (folder / "h100").iterdir()) == \
        sorted(p.name for p in (folder / "h200").iterdir())

    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", "unset by the test")  # restored after it
    h200 = target("h200").environment()
    record, files, specs = warm.carried_setup(folder, tmp_path / "work", h200)
    assert record["target"] == "h200" and "cudnn_mismatch" not in record
    assert [s["name"] for s in specs] == ["prefill", "train"]
    key = Path(os.environ["CUDNN_ATTN_CACHE_KEY_FILE"])
    assert key.read_bytes() == (folder / "graph-cache.key").read_bytes()
    assert key.stat().st_mode & 0o777 == 0o600 and files.stat().st_mode & 0o777 == 0o700
    assert GraphCache(environment=lambda: h200).load(files) == 3  # with the carried key
    other = GraphCache(environment=lambda: h200)
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "another.key"))
    assert other.load(files) == 0 and other.info()["rejected_files"] == 3  # without it

    old_cudnn = {**target("h100").environment(), "cudnn_backend": 91900}
    record, files, _ = warm.carried_setup(folder, tmp_path / "work2", old_cudnn)
    assert record["target"] == "h100" and "this device has 91900" in record["cudnn_mismatch"]
    unknown = {**h200, "gpu_name": "NVIDIA A100-SXM4-80GB", "sm_count": 108}
    record, files, _ = warm.carried_setup(folder, tmp_path / "work3", unknown)
    assert record["target"] is None and files is None


def test_nothing_carried_is_an_error_that_says_what_to_run(warm, tmp_path):
    record, files, specs = warm.carried_setup(tmp_path / "absent", tmp_path / "work", {})
    assert "--prepare" in record["error"] and files is None and specs == []


def test_the_shipped_warm_config_and_its_calls(warm, monkeypatch):
    from cudnn_attn.cli.cache import read_config
    from cudnn_attn.cli.specs import build_inputs

    specs = read_config(str(warm.CONFIG))
    assert [s["name"] for s in specs] == ["prefill-causal-gqa", "decode-step", "train-causal"]
    for spec in specs:  # every problem is one the CLI builds (on "meta": no memory)
        q, k, v, _ = build_inputs(spec, "meta")
        assert q.dtype == torch.bfloat16 and q.requires_grad == bool(spec.get("backward"))
    monkeypatch.setattr(warm, "DEVICE", "cpu")
    monkeypatch.setattr(warm, "BACKEND", "torch")
    small = {"defaults": {"dtype": "fp32"}}
    infer = warm.make_call({**small["defaults"], "shape": [1, 4, 3, 8], "heads_kv": 2,
                            "seq_kv": 16})
    assert infer().shape == (1, 4, 3, 8)
    train = warm.make_call({**small["defaults"], "shape": [1, 2, 8, 8], "mask": "causal",
                            "backward": True})
    grads = train()
    assert [tuple(g.shape) for g in grads] == [(1, 2, 8, 8)] * 3
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_a_failed_save_on_the_device_is_recorded(warm, stand_in, tmp_path):
    from cudnn_attn.graphs.cache import GraphCache

    class Unsaveable(GraphCache):
        def save(self, directory):
            raise PermissionError(f"{directory}: read-only file system")

    device = Unsaveable(environment=lambda: H100_ENV)
    record = warm.run_rounds(_calls(device, stand_in), tmp_path / "work", None, cache=device,
                             clear=device.clear, clock=stand_in)
    assert "read-only file system" in record["rounds"]["cold-first"]["save_error"]
    saved = record["rounds"]["saved"]
    assert saved["files_accepted"] == 0 and saved["builds"] == 3
    assert record["verdict"]["saved"]["goal_met"] is False



def test_without_cuda_the_script_writes_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, str(BENCH / "warm_start.py"), "--carried",
                           str(tmp_path), "--results-dir", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU" in done.stdout and list(tmp_path.iterdir()) == []
