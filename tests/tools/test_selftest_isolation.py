"""``cudnn-attn selftest`` loses nothing to a crash, a hang or a kill (issue 24), on the CPU.

Each engine runs in its own process: one that aborts (as a CUDA fault would end it) or hangs in a
case costs that case, recorded as a failure naming why, while the other engines' results stay
intact and the crashed engine goes on from the next case in a fresh process. Every verdict is a
flushed JSON line, so a run killed at any point still says what passed and failed, and progress
reaches a log file line by line.

Only the torch engine runs on a CPU, so the fault is staged in a second engine: a
``sitecustomize`` on the children's path makes "cupy" run the torch engine's computation and
abort (or hang) in one named case, and can slow every run down so that an interrupt reliably
lands while runs remain. Everything else is the real command line.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cudnn_attn.verify import grid
from cudnn_attn.verify.isolated import report_from_stream
from cudnn_attn.verify.stream import read_events

ROOT = Path(__file__).resolve().parents[2]
FAULTY_CASE = "window-8-0"

FAULT_HOOK = """
import os
import time

from cudnn_attn.verify import runs

judge = runs.run_case
delay_s = float(os.environ.get("SELFTEST_DELAY_S", "0"))

def staged(case, backend, dtype, device):
    time.sleep(delay_s)  # a slower machine: an interrupt lands while runs remain
    if backend != "cupy":
        return judge(case, backend, dtype, device)
    if case.name == os.environ["SELFTEST_FAULT_CASE"]:
        if os.environ["SELFTEST_FAULT"] == "abort":
            os.abort()
        time.sleep(600)
    outcome = judge(case, "torch", dtype, device)
    outcome.backend = "cupy"
    return outcome

if os.environ.get("SELFTEST_FAULT"):
    from cudnn_attn.core.dispatch import get_backend

    type(get_backend("cupy")).availability = lambda self: []
runs.run_case = staged
"""


def _selftest(tmp_path, *args, fault=None, delay_s=0.0, **popen):
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(textwrap.dedent(FAULT_HOOK))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT)]),
           "OMP_NUM_THREADS": "1", "SELFTEST_FAULT_CASE": FAULTY_CASE,
           "SELFTEST_DELAY_S": str(delay_s)}
    if fault:
        env["SELFTEST_FAULT"] = fault
    argv = [sys.executable, "-m", "cudnn_attn", "selftest", "--dtype", "float32",
            "--stream", str(tmp_path / "st.jsonl"), "--json", str(tmp_path / "st.json"), *args]
    return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.parametrize("fault", ["abort", "hang"])
def test_a_crashing_engine_leaves_the_other_engines_results_intact(tmp_path, fault):
    proc = _selftest(tmp_path, "--backend", "torch", "--backend", "cupy",
                     "--case-timeout", "12", fault=fault)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 1, out + err
    data = json.loads((tmp_path / "st.json").read_text())
    names = [c.name for c in grid(quick=True)]
    by_engine = {b: {r["case"]: r for r in data["results"] if r["backend"] == b}
                 for b in ("torch", "cupy")}
    # torch judged every case, all passed: the other engine's crash never reached it
    assert list(by_engine["torch"]) == names
    assert all(r["status"] == "pass" for r in by_engine["torch"].values())
    # cupy: the faulty case failed, naming why; a fresh process judged every case after it
    assert list(by_engine["cupy"]) == names
    crashed = by_engine["cupy"][FAULTY_CASE]
    why = "SIGABRT" if fault == "abort" else "hung"
    assert crashed["status"] == "FAIL" and why in crashed["detail"][0], crashed
    assert all(r["status"] == "pass" for c, r in by_engine["cupy"].items() if c != FAULTY_CASE)
    assert data["counts"] == {"pass": 2 * len(names) - 1, "FAIL": 1, "declined": 0}
    assert f"FAIL cupy float32 {FAULTY_CASE}" in out
    assert "going on from the next run" in err
    # progress went to stderr (a pipe here, as in a log) one line per verdict. Each line is one
    # write; the aborting child's crash report is many small ones, so a verdict line may follow
    # a fragment of it on the same line: count the verdicts, not the lines that start with one.
    assert len(re.findall(r"selftest torch \d+/\d+ ", err)) == len(names), err


def _wait_for_results(stream: Path, count: int, proc, timeout_s: float = 300.0) -> None:
    until = time.monotonic() + timeout_s
    while time.monotonic() < until and proc.poll() is None:
        if sum(e["event"] == "result" for e in read_events(stream)) >= count:
            return
        time.sleep(0.2)
    pytest.fail(f"the selftest never judged {count} runs")


def test_a_killed_selftest_still_says_what_it_judged(tmp_path):
    # 30 runs at >= 0.2 s each: the kill lands long before the last
    proc = _selftest(tmp_path, "--backend", "torch", delay_s=0.2, start_new_session=True)
    _wait_for_results(tmp_path / "st.jsonl", 4, proc)
    os.killpg(proc.pid, signal.SIGKILL)  # no chance to write anything more
    proc.communicate()
    assert not (tmp_path / "st.json").exists()
    report = report_from_stream(tmp_path / "st.jsonl")
    assert report.counts["pass"] >= 4 and report.counts["FAIL"] == 0
    assert not report.ok and "judged" in report.settings["incomplete"]["torch"]
    assert "torch: NOT FINISHED" in report.table()
    assert report.environment["torch"]  # the header line carries the environment


def test_sigint_ends_it_with_the_table_of_what_was_judged(tmp_path):
    proc = _selftest(tmp_path, "--backend", "torch", delay_s=0.2, start_new_session=True)
    _wait_for_results(tmp_path / "st.jsonl", 3, proc)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: parent and engines together
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    data = json.loads((tmp_path / "st.json").read_text())
    assert data["settings"]["interrupted"] and not data["ok"]
    assert data["counts"]["pass"] >= 3 and "interrupted" in out
    assert data["settings"]["incomplete"]["torch"].endswith("(interrupted)")


def test_the_stream_survives_a_cut_last_line(tmp_path):
    from cudnn_attn.verify.stream import ResultStream

    path = tmp_path / "s.jsonl"
    with ResultStream(path) as stream:
        stream.write("engine", backend="torch", unavailable=[], runs=2)
        stream.write("begin", backend="torch", index=0, case="dense", dtype="float32")
    with open(path, "a") as f:
        f.write('{"event": "result", "index": 0, "ca')  # what a kill mid-line would leave
    assert [e["event"] for e in read_events(path)] == ["engine", "begin"]
