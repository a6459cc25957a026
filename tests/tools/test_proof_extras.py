"""gpu_proof's evidence steps on the CPU (``benchmarks/proof_extras.py``): the fused kernels'
profile (``profile_na.py``, ``ncu_report.py``) and the warm start (``warm_start.py``).

* Nsight Compute: the command lines, ``ncu`` found off ``PATH``, and its ``--csv --page details``
  output (a sample in its documented format) read into per-launch headline figures.
* The profiler's kernel table from a real ``torch.profiler`` run (CPU events here, CUDA there).
* The warm-start rounds with a real ``GraphCache`` and a serializable stand-in plan: files of the
  same environment serve every key with 0 builds, another environment's are rejected and rebuilt,
  and the record's verdict and summary lines say so.
* ``--prepare`` warms the config for the H100 and the H200 with ``cudnn-attn cache warm
  --target`` (deviceless cuDNN), and the device side picks the matching target's files, which a
  cache of that environment accepts with the carried key.
* Without CUDA both scripts exit 0 and write nothing; the plan entries have bounded shares.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import load_script
from deviceless_plans import needs_fe

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _load(name):
    sys.path.insert(0, str(BENCH))  # the scripts import their siblings
    try:
        return load_script(BENCH / f"{name}.py", f"bench_{name}")
    finally:
        if str(BENCH) in sys.path:
            sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def ncu():
    return _load("ncu_report")


@pytest.fixture(scope="module")
def profile():
    return _load("profile_na")


@pytest.fixture(scope="module")
def warm():
    return _load("warm_start")


@pytest.fixture(scope="module")
def extras():
    _load("gpu_proof")
    return sys.modules["proof_extras"]


# ---------------------------------------------------------------------------------------------
# Nsight Compute
# ---------------------------------------------------------------------------------------------

def test_ncu_command_lines(ncu, tmp_path):
    report = tmp_path / "p.ncu-rep"
    command = ncu.profile_command("/usr/local/cuda/bin/ncu", report, ["python", "x.py", "--child"],
                                  launch_count=4)
    assert command[0] == "/usr/local/cuda/bin/ncu"
    assert command[command.index("--kernel-name") + 1] == "regex:na_fused"
    assert command[command.index("--launch-count") + 1] == "4"
    sections = [command[i + 1] for i, a in enumerate(command) if a == "--section"]
    assert sections == ["SpeedOfLight", "Occupancy", "LaunchStats", "MemoryWorkloadAnalysis"]
    assert command[command.index("--export") + 1] == str(report)
    assert command[-3:] == ["python", "x.py", "--child"]  # the program comes last, untouched
    assert command.index("--export") < command.index("python")
    assert ncu.import_command("ncu", report) == ["ncu", "--import", str(report), "--csv",
                                                 "--page", "details"]
    with pytest.raises(ValueError, match="launch_count"):
        ncu.profile_command("ncu", report, ["python"], launch_count=0)


def test_ncu_is_found_off_path(ncu, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    fake = tmp_path / "cuda" / "bin" / "ncu"
    assert ncu.find_ncu((str(fake),)) is None
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    assert ncu.find_ncu((str(fake),)) is None  # not executable
    fake.chmod(0o755)
    assert ncu.find_ncu((str(tmp_path / "nowhere"), str(fake))) == str(fake)
    assert ncu.NCU_PATHS == ("/usr/local/cuda/bin/ncu",)


# Nsight Compute 2025's details page as CSV (two launches; columns between ID and Kernel Name
# and after it as that version prints them).
NCU_CSV = '''==PROF== Connected to process 4242 (/usr/bin/python3.12)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Frequency","Ghz","2.62"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","msecond","2,140.50"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","GPU Speed Of Light Throughput","Memory Throughput","%","21.37"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","GPU Speed Of Light Throughput","DRAM Throughput","%","3.05"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","GPU Speed Of Light Throughput","L2 Cache Throughput","%","18.44"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","GPU Speed Of Light Throughput","Compute (SM) Throughput","%","41.92"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","168"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","Launch Statistics","Dynamic Shared Memory Per Block","Kbyte/block","92.67"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","Launch Statistics","Static Shared Memory Per Block","byte/block","0"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","Launch Statistics","Grid Size","","2,048"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","Occupancy","Theoretical Occupancy","%","12.50"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","Occupancy","Achieved Occupancy","%","12.31"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","Memory Workload Analysis","Memory Throughput","Gbyte/s","98.21"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","Memory Workload Analysis","L2 Hit Rate","%","91.6"
"0","4242","python3.12","127.0.0.1","void na_fused_forward<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","Memory Workload Analysis","Mem Busy","%","n/a"
"1","4242","python3.12","127.0.0.1","void na_fused_backward_dq<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","GPU Speed Of Light Throughput","Compute (SM) Throughput","%","55.10"
"1","4242","python3.12","127.0.0.1","void na_fused_backward_dq<__nv_bfloat16, 128>(NaParams)","1","7","(128, 1, 1)","(256, 8, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","255"
'''


def test_ncu_csv_gives_each_launch_its_headline(ncu):
    launches = ncu.parse_csv(NCU_CSV)
    assert [(l["id"], l["kernel"]) for l in launches] == [
        ("0", "void na_fused_forward<__nv_bfloat16, 128>(NaParams)"),
        ("1", "void na_fused_backward_dq<__nv_bfloat16, 128>(NaParams)")]
    first = launches[0]["headline"]
    assert first["sm_throughput_pct"] == {"unit": "%", "value": 41.92}
    assert first["duration"] == {"unit": "msecond", "value": 2140.5}  # thousands separator
    assert first["grid_size"]["value"] == 2048.0
    assert first["achieved_occupancy_pct"]["value"] == 12.31
    assert first["theoretical_occupancy_pct"]["value"] == 12.5
    assert first["registers_per_thread"]["value"] == 168.0
    assert first["dynamic_shared_memory_per_block"] == {"unit": "Kbyte/block", "value": 92.67}
    assert first["dram_throughput_pct"]["value"] == 3.05
    assert first["l2_throughput_pct"]["value"] == 18.44
    # The same metric name in two sections: each headline reads its own section.
    assert first["memory_throughput_pct"] == {"unit": "%", "value": 21.37}
    assert first["memory_throughput"] == {"unit": "Gbyte/s", "value": 98.21}
    assert first["mem_busy_pct"]["value"] == "n/a"  # not a number: kept as text
    second = launches[1]["headline"]
    assert second == {"sm_throughput_pct": {"unit": "%", "value": 55.1},
                      "registers_per_thread": {"unit": "register/thread", "value": 255.0}}
    assert launches[0]["metrics"]["Occupancy"]["Achieved Occupancy"]["value"] == 12.31


def test_ncu_csv_without_its_columns_is_refused(ncu):
    with pytest.raises(ValueError, match="no Nsight Compute CSV header"):
        ncu.parse_csv("==ERROR== ERR_NVGPUCTRPERM - The user does not have permission\n")
    with pytest.raises(ValueError, match="Metric Value"):
        ncu.parse_csv('"ID","Kernel Name","Section Name","Metric Name","Metric Unit"\n'
                      '"0","k","s","m","u"\n')


# ---------------------------------------------------------------------------------------------
# The profiler's table, the problems, the script without CUDA
# ---------------------------------------------------------------------------------------------

def test_kernel_table_from_a_real_profile(profile):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.mm(a, b)
        torch.add(a, b)
    events = profile.profiler_events(prof, torch.autograd.DeviceType.CPU)
    table = {row["kernel"]: row for row in profile.kernel_table(events)}
    assert table["aten::mm"]["calls"] == 3 and table["aten::add"]["calls"] == 1
    mm = [us for name, us in events if name == "aten::mm"]
    assert table["aten::mm"]["total_us"] == pytest.approx(sum(mm), abs=1e-3)
    assert table["aten::mm"]["mean_us"] == pytest.approx(sum(mm) / 3, abs=1e-3)
    assert profile.profiler_events(prof) == []  # no CUDA event on this machine


def test_kernel_table_sums_per_name_longest_first(profile):
    rows = profile.kernel_table([("na_fused_backward_dq", 2.0), ("na_fused_forward", 1.5),
                                 ("na_fused_backward_dq", 4.0), ("fill", 0.25)])
    assert rows == [
        {"kernel": "na_fused_backward_dq", "calls": 2, "total_us": 6.0, "mean_us": 3.0},
        {"kernel": "na_fused_forward", "calls": 1, "total_us": 1.5, "mean_us": 1.5},
        {"kernel": "fill", "calls": 1, "total_us": 0.25, "mean_us": 0.25}]


def test_issue_34_problems(profile):
    by_name = {p["name"]: p for p in profile.PROBLEMS}
    assert by_name["2d-128x128-k31"] == {"name": "2d-128x128-k31", "spatial": [128, 128],
                                         "kernel": [31, 31], "heads": 8, "dim": 128, "batch": 1}
    assert (by_name["1d-32768-k2048"]["spatial"], by_name["1d-32768-k2048"]["kernel"]) == \
        ([32768], [2048])
    assert by_name["3d-32-k7"]["kernel"] == [7, 7, 7] and by_name["3d-32-k7"]["heads"] == 16
    assert by_name["2d-64x64-k13-d64"]["dim"] == 64 and by_name["2d-128x128-k7"]["heads"] == 8
    assert [p["name"] for p in profile.pick(["3d-32-k7", "2d-128x128-k31"])] == \
        ["2d-128x128-k31", "3d-32-k7"]  # the table's order
    with pytest.raises(ValueError, match="unknown problems"):
        profile.pick(["4d"])


@pytest.mark.parametrize("script", ["profile_na.py", "warm_start.py"])
def test_without_cuda_the_scripts_write_nothing(script, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    argv = (["--results-dir", str(tmp_path)] if script == "profile_na.py"
            else ["--carried", str(tmp_path), "--results-dir", str(tmp_path)])
    done = subprocess.run([sys.executable, str(BENCH / script), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU" in done.stdout and list(tmp_path.iterdir()) == []


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


def test_profile_summary_from_its_json(extras, tmp_path):
    record = {"problems": [
        {"name": "2d-128x128-k31", "fwd": {"all_us_per_call": 2200.0, "kernels": [
            {"kernel": "na_fused_forward", "calls": 3, "total_us": 6420.0, "mean_us": 2140.0}]},
         "fwd+bwd": {"error": "RuntimeError: out of memory"}}],
        "ncu": {"skipped": "no ncu on PATH nor in /usr/local/cuda/bin/ncu"}}
    (tmp_path / "profile_na-2026-11-28.json").write_text(json.dumps(record))
    summary = extras.summarize("profile-na", tmp_path)
    assert summary["file"] == "profile_na-2026-11-28.json"
    assert summary["kernels"]["2d-128x128-k31 fwd"]["top"] == [
        {"kernel": "na_fused_forward", "calls": 3, "mean_us": 2140.0}]
    lines = extras.summary_lines(extras.StepResult("profile-na", "cmd", summary=summary), " ")
    assert "2d-128x128-k31 fwd: 2.200 ms/call, top na_fused_forward 2.140 ms" in lines[0]
    assert "fwd+bwd: RuntimeError: out of memory" in lines[1]
    assert lines[2].endswith("ncu: no ncu on PATH nor in /usr/local/cuda/bin/ncu")


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


# ---------------------------------------------------------------------------------------------
# The device-side calls, run on the CPU with the torch engine (the code the GPU runs, no GPU)
# ---------------------------------------------------------------------------------------------

def test_profile_problem_runs_the_neighborhood_calls(profile, monkeypatch):
    monkeypatch.setattr(profile, "DEVICE", "cpu")
    monkeypatch.setattr(profile, "BACKEND", "torch")
    monkeypatch.setattr(profile, "ACTIVITY", "CPU")
    problem = profile._problem("tiny", (6, 5), (3, 3), heads=2, dim=16)
    result = profile.profile_problem(problem, repeats=2)
    for direction in profile.DIRECTIONS:
        entry = result[direction]
        assert "error" not in entry, entry
        assert entry["kernels"] and all(r["calls"] >= 1 for r in entry["kernels"])
        assert entry["fused_us_per_call"] == 0  # the torch engine launches no na_fused kernel
        assert entry["all_us_per_call"] > 0
    backward = {r["kernel"] for r in result["fwd+bwd"]["kernels"]}
    assert any("Backward" in name for name in backward)  # the gradients ran
    assert result["useful_flop_fwd"] == 4.0 * 2 * 30 * 9 * 16
    monkeypatch.setattr(profile, "BACKEND", "no-such-engine")
    failed = profile.profile_problem(problem, repeats=1)
    assert set(failed["fwd"]) == {"error"} and "no-such-engine" in failed["fwd"]["error"]


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


def test_profile_main_writes_the_record_and_reads_ncu_back(profile, monkeypatch, tmp_path):
    """The whole script as the device runs it, on the CPU: the torch engine and CPU events stand
    in for the fused kernels, a fake ``ncu`` (writes the report, prints the CSV sample) for
    Nsight Compute; the record holds both, and the report, CSV and log sit beside it."""
    fake = tmp_path / "bin" / "ncu"
    fake.parent.mkdir()
    (tmp_path / "sample.csv").write_text(NCU_CSV)
    fake.write_text(f"""#!{sys.executable}
import sys
argv = sys.argv[1:]
if "--import" in argv:
    print(open({str(tmp_path / "sample.csv")!r}).read())
else:
    assert argv[argv.index("--kernel-name") + 1] == "regex:na_fused", argv
    assert "--child" in argv, argv
    open(argv[argv.index("--export") + 1], "wb").write(b"NCU-REP")
    print("==PROF== Report: written")
""")
    fake.chmod(0o755)
    monkeypatch.setattr(profile.ncu_report, "find_ncu", lambda: str(fake))
    monkeypatch.setattr(profile, "DEVICE", "cpu")
    monkeypatch.setattr(profile, "BACKEND", "torch")
    monkeypatch.setattr(profile, "ACTIVITY", "CPU")
    monkeypatch.setattr(profile, "PROBLEMS", [profile._problem("tiny", (6, 5), (3, 3), 2, 16)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "CPU stand-in")
    from cudnn_attn.core import env  # its GPU facts would ask the CUDA that is not here

    monkeypatch.setattr(env, "collect", lambda: {"date": "2026-11-28T10:00:00+00:00"})
    out = tmp_path / "out"
    assert profile.main(["--results-dir", str(out), "--repeats", "1", "--ncu-problems", "tiny",
                         "--time-limit", "600"]) == 0
    [path] = out.glob("profile_na-*.json")
    record = json.loads(path.read_text())
    assert record["device"] == "CPU stand-in" and record["backend"] == "torch"
    assert [p["name"] for p in record["problems"]] == ["tiny"]
    assert record["problems"][0]["fwd"]["kernels"]
    found = record["ncu"]
    assert "error" not in found, found
    assert found.get("report") == "profile_na.ncu-rep", found
    assert found["command"][0] == str(fake)
    assert [launch["kernel"] for launch in found["launches"]] == [
        "void na_fused_forward<__nv_bfloat16, 128>(NaParams)",
        "void na_fused_backward_dq<__nv_bfloat16, 128>(NaParams)"]
    assert found["launches"][0]["headline"]["achieved_occupancy_pct"]["value"] == 12.31
    assert (out / "profile_na.ncu-rep").read_bytes() == b"NCU-REP"
    assert (out / "profile_na-ncu.csv").read_text().strip() == NCU_CSV.strip()
    assert "Report: written" in (out / "profile_na-ncu.log").read_text()

    fake.write_text("#!/bin/sh\necho '==ERROR== ERR_NVGPUCTRPERM - no permission' >&2\nexit 1\n")
    assert profile.main(["--results-dir", str(out), "--repeats", "1", "--ncu-problems", "tiny",
                         "--time-limit", "600"]) == 0
    refused = json.loads(path.read_text())["ncu"]
    assert "ncu wrote no report (exit 1" in refused["error"]
    assert "ERR_NVGPUCTRPERM" in refused["output_tail"]
    assert profile.main(["--results-dir", str(out), "--repeats", "1", "--ncu-problems", "tiny",
                         "--time-limit", "5"]) == 0
    assert "left of --time-limit 5" in json.loads(path.read_text())["ncu"]["skipped"]


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
