"""benchmarks/sanitize.py on CPU: argument handling, the CPU exit, its case list (every kernel
instance), and the parsing of compute-sanitizer's text reports (samples written from the
Compute Sanitizer documentation's report formats for memcheck, racecheck and initcheck)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sanitize.py"


@pytest.fixture(scope="module")
def S():
    return load_script(SCRIPT, "bench_sanitize")


MEMCHECK_ERROR = """\
========= COMPUTE-SANITIZER
SANITIZE-CASE fused-fp32-hd32-2d ok 0.811
========= Invalid __global__ write of size 4 bytes
=========     at na_neighbor_dot<float>(const float *, const float *, const float *, float *, const int *, int, int, int, int, int)+0x1b0
=========     by thread (31,0,0) in block (3,0,0)
=========     Address 0x7f3c5e000400 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f3c5e000000 of size 1024 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========     Host Frame: [0x2f0a1] in libcuda.so.1
=========
SANITIZE-CASE unfused-fp32 ok 0.512
========= ERROR SUMMARY: 1 error
"""

RACECHECK = """\
========= COMPUTE-SANITIZER
SANITIZE-CASE fused-fp16-hd32-2d ok 3.2
========= Error: Race reported between Write access at na_fused_forward<na_half, 32>(...)+0x4d0 in fused_attention.cu:412
=========     and Read access at na_fused_forward<na_half, 32>(...)+0x520 in fused_attention.cu:420 [128 hazards]
=========
========= Warning: Race reported between Read access at na_fused_backward_dq<na_half, 32>(...)+0x90
=========     and Write access at na_fused_backward_dq<na_half, 32>(...)+0x110 [4 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""

INITCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
SANITIZE-CASE fused-bf16-hd64-2d ok 1.0
SANITIZE-CASE unfused-bf16 FAILED RuntimeError: CUDA error: an illegal memory access was encountered
========= ERROR SUMMARY: 0 errors
"""

INITCHECK_ERROR = """\
========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at na_fused_backward_dq<float, 32>(...)+0x2a0
=========     by thread (0,0,0) in block (0,1,0)
=========     Address 0x7f0010000100
=========
========= ERROR SUMMARY: 1 error
"""

CRASHED = """\
========= COMPUTE-SANITIZER
SANITIZE-CASE fused-fp32-hd32-2d ok 0.8
Segmentation fault (core dumped)
"""


def test_parse_memcheck_report(S):
    r = S.parse_report(MEMCHECK_ERROR)
    assert r["errors"] == 1 and r["warnings"] == 0
    assert r["records"] == ["Invalid __global__ write of size 4 bytes"]
    assert r["cases"] == {"ok": ["fused-fp32-hd32-2d", "unfused-fp32"], "failed": {}}
    assert S.verdict(r, 0) == ["1 error(s)"]


def test_parse_racecheck_report(S):
    r = S.parse_report(RACECHECK)
    assert r["errors"] == 1 and r["warnings"] == 1
    assert [x.split(" at ")[0] for x in r["records"]] == [
        "Error: Race reported between Write access", "Warning: Race reported between Read access"]
    assert S.verdict(r, 0) == ["1 error(s)"]
    warnings_only = RACECHECK.replace("(1 error, 1 warning)", "(0 errors, 2 warnings)")
    assert S.verdict(S.parse_report(warnings_only), 0) == []


def test_parse_initcheck_reports(S):
    clean = S.parse_report(INITCHECK_CLEAN)
    assert clean["errors"] == 0 and clean["records"] == []
    assert clean["cases"]["failed"] == {
        "unfused-bf16": "RuntimeError: CUDA error: an illegal memory access was encountered"}
    assert S.verdict(clean, 1) == ["failed cases: unfused-bf16"]
    bad = S.parse_report(INITCHECK_ERROR)
    assert bad["errors"] == 1
    assert bad["records"] == ["Uninitialized __global__ memory read of size 4 bytes"]


def test_a_run_without_summary_fails(S):
    r = S.parse_report(CRASHED)
    assert r["errors"] is None
    assert S.verdict(r, -11) == ["no summary line: the sanitized run did not finish"]
    assert S.verdict(S.parse_report("========= ERROR SUMMARY: 0 errors\n"), 3) == ["exit status 3"]
    assert S.verdict(S.parse_report("========= ERROR SUMMARY: 0 errors\n"), 0) == []


def test_arguments(S):
    args = S.parse_args([])
    assert args.tools == list(S.TOOLS) and args.json == "sanitize.json" and not args.child
    assert S.parse_args(["--tools", "racecheck, memcheck"]).tools == ["racecheck", "memcheck"]
    for bad in (["--tools", "memcheck,synccheckk"], ["--tools", ","], ["--timeout", "0"]):
        with pytest.raises(SystemExit):
            S.parse_args(bad)


def test_sanitizer_command_reinvokes_itself_as_child(S):
    cmd = S.sanitizer_command("/opt/cs", "racecheck", "fp16", S.KERNEL_FILTER)
    assert cmd[:3] == ["/opt/cs", "--tool", "racecheck"]
    assert cmd[cmd.index("--kernel-name") + 1] == "kns=na_"
    assert cmd[-5:] == [sys.executable, str(SCRIPT), "--child", "--cases", "fp16"]
    assert "--kernel-name" not in S.sanitizer_command("/opt/cs", "memcheck", None, "")


def test_find_sanitizer_prefers_an_explicit_executable(S, tmp_path):
    fake = tmp_path / "compute-sanitizer"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert S.find_sanitizer(str(fake)) == str(fake)
    plain = tmp_path / "not-executable"
    plain.write_text("")
    assert S.find_sanitizer(str(plain)) != str(plain)


def test_cases_cover_every_kernel_instance(S):
    from cudnn_attn.fallback_kernels import fused as F

    names = S.case_names()
    for dtype in ("fp32", "fp16", "bf16"):
        for hd in F.HEAD_DIMS:
            assert f"fused-{dtype}-hd{hd}-2d" in names
            assert (f"fused-{dtype}-wide-hd{hd}-2d" in names) == (dtype != "fp32")
        for hd in (64, 128):  # the wgmma forwards' head dims, 64-query and wide boxes
            for boxes in ("", "wide-"):
                assert (f"fused-{dtype}-wgmma-{boxes}hd{hd}-2d" in names) == (dtype != "fp32")
    assert {f"unfused-{d}" for d in ("fp64", "fp32", "fp16", "bf16")} <= set(names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only exit")
def test_cpu_machine_exits_zero_and_writes_nothing(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(tmp_path / "s.json")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert not (tmp_path / "s.json").exists()
    listed = subprocess.run([sys.executable, str(SCRIPT), "--list", "--cases", "unfused"],
                            capture_output=True, text=True, env=env, timeout=300, check=False)
    assert listed.returncode == 0 and listed.stdout.split() == [
        "unfused-fp64", "unfused-fp32", "unfused-fp16", "unfused-bf16"]


INITCHECK_TWO_CASES = """\
========= COMPUTE-SANITIZER
SANITIZE-CASE-START fused-fp32-hd32-1d
SANITIZE-CASE fused-fp32-hd32-1d ok 0.5
SANITIZE-CASE-START fused-bf16-hd64-2d-rpb
========= Uninitialized __global__ memory read of size 16 bytes
=========     at void na_fused_forward<__nv_bfloat16, 64>(const __nv_bfloat16 *, float *)+0x1c40 in fused_attention.cu:233
=========     by thread (64,0,0) in block (3,1,0)
=========     Address 0x7f2c00a01f00
=========     and is inside the nearest allocation at 0x7f2c00a00000 of size 8192 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========     Host Frame: [0x2f0a1] in libcuda.so.1
=========
========= Uninitialized __global__ memory read of size 16 bytes
=========     at void na_fused_forward<__nv_bfloat16, 64>(const __nv_bfloat16 *, float *)+0x1c40 in fused_attention.cu:233
=========     by thread (65,0,0) in block (3,1,0)
=========     Address 0x7f2c00a01f10
=========
SANITIZE-CASE fused-bf16-hd64-2d-rpb ok 0.9
========= ERROR SUMMARY: 2 errors
"""


def test_initcheck_records_keep_kernel_address_and_case(S):
    """issue 23: 595220 initcheck errors came back as bare first lines; each record now says
    which kernel, thread, address and allocation, and which case ran it."""
    r = S.parse_report(INITCHECK_TWO_CASES)
    assert r["errors"] == 2 and len(r["records"]) == 2
    first = r["details"][0]
    assert first["case"] == "fused-bf16-hd64-2d-rpb"
    assert first["kernel"] == "na_fused_forward<__nv_bfloat16, 64>"
    assert "fused_attention.cu:233" in first["at"] and first["thread"].startswith("thread (64")
    assert first["address"] == ["Address 0x7f2c00a01f00", "and is inside the nearest allocation "
                                "at 0x7f2c00a00000 of size 8192 bytes"]
    assert r["by_case"] == {"fused-bf16-hd64-2d-rpb": {
        f"{first['kernel']}: Uninitialized __global__ memory read of size 16 bytes": 2}}
    assert r["cases"]["ok"] == ["fused-fp32-hd32-1d", "fused-bf16-hd64-2d-rpb"]


def test_the_child_marks_where_each_case_starts(S):
    src = Path(S.__file__).read_text()
    assert 'f"{CASE_MARK}-START {name}"' in src and "stderr=subprocess.STDOUT" in src


def test_a_run_cut_after_the_first_tool_keeps_that_tools_summary(S, tmp_path, monkeypatch):
    """The summary is rewritten after each tool: a kill during racecheck leaves memcheck's."""
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd[2])
        if len(calls) == 2:
            raise KeyboardInterrupt  # the proof's SIGINT while the second tool runs
        return subprocess.CompletedProcess(cmd, 1, stdout=MEMCHECK_ERROR)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(S, "find_sanitizer", lambda given: "/opt/compute-sanitizer")
    monkeypatch.setattr(S, "environment", lambda: {"gpu": "stand-in"})
    monkeypatch.setattr(S.subprocess, "run", fake_run)
    out = tmp_path / "s.json"
    args = S.parse_args(["--tools", "memcheck,racecheck", "--json", str(out)])
    with pytest.raises(KeyboardInterrupt):
        S.run_parent(args)
    import json
    summary = json.loads(out.read_text())
    assert calls == ["memcheck", "racecheck"]
    assert summary["complete"] is False and list(summary["tools"]) == ["memcheck"]
    assert summary["tools"]["memcheck"]["errors"] == 1 and not summary["tools"]["memcheck"]["ok"]
