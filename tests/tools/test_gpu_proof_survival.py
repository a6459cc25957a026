"""benchmarks/gpu_proof.py loses nothing to a deadline, a hang or a kill (issue 24), on the CPU.

Real pytest runs and real processes: a test hung in a call that released the GIL costs its
per-test timeout and the step goes on; a step cut at its deadline still yields its counts, from
junit XML after SIGINT and from the outcome stream when only SIGKILL ends it; no process of a
step outlives it; a slow first benchmark cannot eat the second one's share; side-by-side steps
split the cores; a record killed mid-write is the previous whole record, never half a new one.
"""

import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
from common import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_proof.py"


@pytest.fixture(scope="module")
def G():
    folder = str(SCRIPT.parent)
    sys.path.insert(0, folder)  # the script imports its siblings (_report, proof_steps, ...)
    try:
        return load_script(SCRIPT, "bench_gpu_proof")
    finally:
        if folder in sys.path:
            sys.path.remove(folder)


@pytest.fixture
def short_ladder(G, monkeypatch):
    """SIGINT, SIGTERM, SIGKILL a second or two apart instead of the real graces."""
    steps = G.proof_steps
    ladder = ((signal.SIGINT, 3.0), (signal.SIGTERM, 2.0), (signal.SIGKILL, 3.0))
    monkeypatch.setattr(steps, "LADDER", ladder)
    monkeypatch.setattr(steps, "LADDER_S", sum(w for _, w in ladder))
    return ladder


def _needs_plugins():
    for plugin in ("xdist", "pytest_timeout"):  # in the [test] extra and on the GPU image
        pytest.importorskip(plugin)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _write_tests(folder: Path, body: str) -> Path:
    path = folder / "test_sample.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_a_hung_gil_free_call_costs_its_timeout_and_the_step_goes_on(G, tmp_path):
    _needs_plugins()
    pid_file = tmp_path / "hung.pid"
    tests = _write_tests(tmp_path, f"""
        import ctypes, os

        def test_before(): pass

        def test_hung():
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            # glibc's system() waits with the GIL released and retries after signals, like a
            # sync on a hung kernel: pytest-timeout's signal method cannot stop it.
            ctypes.CDLL(None).system(b"sleep 90")

        def test_after_1(): pass
        def test_after_2(): pass
    """)
    step = G.pytest_step("hung", tmp_path, [str(tests)], workers=2, test_timeout_s=3,
                         cap_s=150.0)
    assert "--timeout-method=thread" in step.argv and "-n" in step.argv
    [result] = G.run_steps([step], tmp_path, time.monotonic() + 200, side_by_side=True,
                           cwd=tmp_path)
    assert not result.timed_out and result.returncode == 1, result.log_tail
    assert result.seconds < 80  # the 90 s hang was cut at its 3 s timeout
    counts = G.junit_counts(tmp_path / "hung.xml")
    # junit and the stream call the crashed worker's test an error
    assert counts["gpu"] == {"passed": 3, "failed": 0, "errors": 1, "skipped": 0}
    [failure] = counts["failures"]
    assert failure["test"].endswith("test_hung") and "crashed" in failure["message"]
    streamed = G.stream_counts(tmp_path / "hung.jsonl")
    assert streamed["gpu"] == counts["gpu"]
    assert not _alive(int(pid_file.read_text()))  # the replaced worker is gone
    assert result.leftovers >= 1  # its `sleep 90` outlived it, until the step ended


@pytest.mark.parametrize("workers", [1, 2])
def test_a_step_cut_at_its_deadline_still_yields_its_counts(G, tmp_path, short_ladder, workers):
    if workers > 1:
        _needs_plugins()
    tests = _write_tests(tmp_path, """
        import time, pytest

        @pytest.mark.parametrize("i", range(5))
        def test_quick(i): pass

        def test_skipped(): pytest.skip("needs a CUDA device")

        def test_zz_slow(): time.sleep(300)
    """)
    # pytest reaches test_zz_slow in ~1 s (~4 s with two xdist workers) on a loaded 2-core machine
    step = G.pytest_step("cut", tmp_path, [str(tests)], workers=workers, cap_s=10.0 + 5 * workers)
    [result] = G.run_steps([step], tmp_path, time.monotonic() + 200, side_by_side=True,
                           cwd=tmp_path)
    assert result.timed_out and result.signals[0] == "SIGINT" and result.returncode is None
    summary = G.proof_record._tests_summary(result, tmp_path)
    assert summary["partial"]
    assert summary["gpu"]["passed"] == 5 and summary["gpu"]["skipped"] == 1
    assert summary["skip_reasons"] == {"needs a CUDA device": 1}
    if workers == 1:  # (xdist's controller takes longer than this test's short grace)
        assert (tmp_path / "cut.xml").exists()  # SIGINT let pytest write what ran


def test_counts_survive_a_step_that_only_sigkill_ends(G, tmp_path, short_ladder):
    tests = _write_tests(tmp_path, """
        import signal, time

        def test_a(): pass
        def test_b(): pass
        def test_c(): assert False, "wrong"

        def test_zz_deaf():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(300)
    """)
    step = G.pytest_step("deaf", tmp_path, [str(tests)], workers=1, cap_s=8.0)
    [result] = G.run_steps([step], tmp_path, time.monotonic() + 200, side_by_side=True,
                           cwd=tmp_path)
    assert result.signals == ["SIGINT", "SIGTERM", "SIGKILL"]
    assert not (tmp_path / "deaf.xml").exists()  # pytest never got to write its junit XML
    summary = G.proof_record._tests_summary(result, tmp_path)
    assert summary["source"] == "outcome stream" and summary["partial"]
    assert summary["gpu"] == {"passed": 2, "failed": 1, "errors": 0, "skipped": 0}
    assert summary["failures"][0]["message"].startswith("AssertionError: wrong")


def test_no_process_of_a_step_outlives_it(G, tmp_path, short_ladder):
    left = tmp_path / "left.pid"
    deaf = tmp_path / "deaf.pid"
    spawn = """
        import signal, subprocess, sys
        code = ("import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)")
        child = subprocess.Popen([sys.executable, "-c", code])
        open({path!r}, "w").write(str(child.pid))
    """
    # One ends by itself and leaves a child behind; one is cut, its child deaf to SIGINT/TERM.
    quits = G.Step("quits", [sys.executable, "-c", textwrap.dedent(spawn.format(path=str(left)))],
                   1, 60.0)
    stays = G.Step("stays", [sys.executable, "-c", textwrap.dedent(spawn.format(path=str(deaf)))
                             + "\nimport time; time.sleep(300)"], 1, 4.0)
    results = G.run_steps([quits, stays], tmp_path, time.monotonic() + 100, side_by_side=True)
    assert results[0].returncode == 0 and not results[0].timed_out
    assert results[0].leftovers == 1 and results[1].timed_out
    for pid_file in (left, deaf):
        assert not _alive(int(pid_file.read_text())), pid_file.name


def test_a_slow_first_benchmark_leaves_the_next_its_share(G, tmp_path, short_ladder):
    first = G.Step("bench-first", [sys.executable, "-c", "import time; time.sleep(300)"], 2,
                   200.0, share_s=30.0)
    second = G.Step("bench-second", [sys.executable, "-c", "print('ran')"], 2, 200.0,
                    share_s=22.0)
    # Each step is given at least MIN_START_S (20 s): the first 52 - 22 - LADDER_S, the second
    # what the first leaves.
    start = time.monotonic()
    results = G.run_steps([first, second], tmp_path, start + 52, side_by_side=False)
    assert results[0].timed_out
    assert results[0].seconds < 52 - 22 - short_ladder[0][1]  # cut to keep the second's share
    assert results[1].ok and results[1].log_tail[-1] == "ran"
    steps = G.plan(tmp_path)
    shares = [s.share_s for s in steps if s.phase == 2]
    assert [s.name for s in steps if s.phase == 2] == ["bench-cudnn", "bench-neighborhood",
                                                       "warm-start"]
    assert all(share > 0 for share in shares)
    assert G.phase_reserve(steps, 1) == pytest.approx(sum(shares) + 3 * G.LADDER_S)


def test_side_by_side_steps_split_the_cores(G, tmp_path):
    show = "import os; print(os.environ['OMP_NUM_THREADS'], os.environ['MKL_NUM_THREADS'])"
    wide = G.Step("wide", [sys.executable, "-c", show], 1, 60.0, processes=3)
    narrow = G.Step("narrow", [sys.executable, "-c", show], 1, 60.0)
    together = G.run_steps([wide, narrow], tmp_path, time.monotonic() + 100, side_by_side=True,
                           cores=16)
    assert [r.log_tail[-1] for r in together] == ["4 4", "4 4"]  # 16 cores, 4 processes
    [alone] = G.run_steps([wide], tmp_path, time.monotonic() + 100, side_by_side=False,
                          cores=16)
    assert alone.log_tail[-1] == "16 16" and alone.threads == 16
    steps = G.plan(tmp_path, workers=8)
    busy = sum(s.processes for s in steps if s.phase == 1)
    assert busy >= 8 and 16 // busy >= 1  # phase 1 on the device's 16 cores: one thread each


WRITER = """
import os, sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
import proof_record
from proof_steps import StepResult

out, work = Path({out!r}), Path({work!r})
results = [StepResult("gpu-tests", "pytest", returncode=0, seconds=1.0)]
round = 0
while True:
    round += 1
    proof_record.write_record(out, work, results, {{"round": round, "rows": list(range(300000))}})
    print(round, flush=True)
"""


def _mid_write(out: Path, tarball: str, whole_size: int, timeout_s: float = 60.0) -> bool:
    """Wait until the tarball is being rewritten: its temporary file exists (written by rename)
    or the file itself has another size than a whole one (written in place)."""
    until = time.monotonic() + timeout_s
    while time.monotonic() < until:
        if (out / f".{tarball}.partial").exists():
            return True
        try:
            if (out / tarball).stat().st_size != whole_size:
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.001)
    return False


def test_a_record_killed_mid_write_is_the_previous_whole_one(G, tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "big.log").write_bytes(os.urandom(4 << 20))  # gzip cannot shrink it: slow to pack
    code = WRITER.format(bench=str(SCRIPT.parent), out=str(out), work=str(work))
    tarball = G.proof_record.TARBALL
    for attempt in range(3):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                cwd=ROOT)
        assert proc.stdout.readline().strip()  # one whole record exists
        caught = _mid_write(out, tarball, (out / tarball).stat().st_size)
        proc.kill()  # in the middle of writing the next one
        proc.wait()
        proc.stdout.close()
        assert caught, "the writer never started another record"
        [record] = out.glob("gpu_proof-*.json")
        data = json.loads(record.read_text())  # never a truncated file
        assert len(data["rows"]) == 300000
        with tarfile.open(out / tarball) as tar:
            member = tar.getmember("big.log")
            assert len(tar.extractfile(member).read()) == 4 << 20
