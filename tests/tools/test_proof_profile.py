"""gpu_proof's ``profile-na`` step on the CPU (``benchmarks/profile_na.py``, ``ncu_report.py``,
``proof_extras.py``): the fused neighborhood kernels' profile.

* Nsight Compute: the command lines, ``ncu`` found off ``PATH``, and its ``--csv --page details``
  output (a sample in its documented format) read into per-launch headline figures.
* The profiler's kernel table from a real ``torch.profiler`` run (CPU events here, CUDA there).
* The device-side calls and the whole script run on the CPU with the torch engine standing in
  for the fused kernels and a fake ``ncu``; without CUDA the script exits 0 and writes nothing.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def ncu():
    return load_benchmark("ncu_report")


@pytest.fixture(scope="module")
def profile():
    return load_benchmark("profile_na")


@pytest.fixture(scope="module")
def extras():
    load_benchmark("gpu_proof")
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


def test_without_cuda_the_script_writes_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run([sys.executable, str(BENCH / "profile_na.py"), "--results-dir",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU" in done.stdout and list(tmp_path.iterdir()) == []


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


# ---------------------------------------------------------------------------------------------
# The device-side calls and the script, run on the CPU (torch engine, fake ncu)
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
