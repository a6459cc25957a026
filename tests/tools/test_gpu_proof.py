"""benchmarks/gpu_proof.py on CPU: the one prepared GPU call's plumbing. Its deadlines kill a
step and the step's children, side-by-side steps overlap, junit counts come from a real pytest
run, and a smoke run (--allow-cpu) leaves the summary JSON and the tarball the device tool
brings back."""

import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
from common import flash_attn_checkout, load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_proof.py"


@pytest.fixture(scope="module")
def G():
    folder = str(SCRIPT.parent)
    sys.path.insert(0, folder)  # the script imports its sibling _report
    try:
        return load_script(SCRIPT, "bench_gpu_proof")
    finally:
        if folder in sys.path:  # the script takes its folder off the path itself
            sys.path.remove(folder)


def _step(G, name, code, cap=30.0, phase=1):
    return G.Step(name, [sys.executable, "-c", textwrap.dedent(code)], phase, cap)


def test_a_step_past_its_deadline_is_killed_with_its_children(G, tmp_path):
    pid_file = tmp_path / "child.pid"
    code = f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        print("started", flush=True)
        time.sleep(120)
    """
    start = time.monotonic()
    [result] = G.run_steps([_step(G, "sleeper", code, cap=3.0)], tmp_path, start + 100,
                           side_by_side=True)
    assert result.timed_out and result.returncode is None and not result.ok
    assert result.seconds < 60  # killed at its 3 s cap, not after the 120 s sleep
    assert "started" in result.log_tail
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild went with the step's process group
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {child} outlived the deadline")


def test_exit_status_log_tail_and_the_budget(G, tmp_path):
    ok = _step(G, "ok", "print('hello from the step')")
    bad = _step(G, "bad", "import sys; print('about to fail'); sys.exit(3)")
    late = _step(G, "late", "print('never')")
    results = G.run_steps([ok, bad], tmp_path, time.monotonic() + 100, side_by_side=False)
    assert [(r.name, r.returncode, r.ok) for r in results] == [("ok", 0, True), ("bad", 3, False)]
    assert results[0].log_tail[-1] == "hello from the step"
    assert results[1].log_tail[-1] == "about to fail"
    assert results[0].log_tail[0].startswith("$ ")  # each log starts with its command
    [skipped] = G.run_steps([late], tmp_path, time.monotonic() + G.MIN_START_S / 2,
                            side_by_side=True)
    assert skipped.not_started and skipped.returncode is None and not skipped.ok
    assert not (tmp_path / "late.log").exists()


@pytest.mark.parametrize("side_by_side", [True, False])
def test_side_by_side_steps_overlap_and_sequential_ones_do_not(G, tmp_path, side_by_side):
    code = """
        import time
        print("mark start", time.time(), flush=True)
        time.sleep(1.0)
        print("mark end", time.time(), flush=True)
    """
    G.run_steps([_step(G, "a", code), _step(G, "b", code)], tmp_path, time.monotonic() + 100,
                side_by_side=side_by_side)
    times = {n: {line.split()[1]: float(line.split()[2])
                 for line in (tmp_path / f"{n}.log").read_text().splitlines()
                 if line.startswith("mark ")}
             for n in "ab"}
    overlap = times["b"]["start"] < times["a"]["end"]
    assert overlap == side_by_side


def test_junit_counts_from_a_real_pytest_run(G, tmp_path):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("fixture exploded")

        def test_one(): pass
        def test_two(): pass
        def test_wrong(): assert 1 + 1 == 3, "arithmetic"
        def test_skipped(): pytest.skip("not here")
        def test_errored(broken): pass
    """))
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", str(tmp_path / "test_sample.py")],
                   cwd=tmp_path, capture_output=True, check=False)
    counts = G.junit_counts(xml)
    assert counts["gpu"] == {"passed": 2, "failed": 1, "errors": 1, "skipped": 1}
    found = {f["test"].rsplit("::", 1)[-1]: f for f in counts["failures"]}
    assert set(found) == {"test_wrong", "test_errored"}
    assert found["test_wrong"]["outcome"] == "failed" and "arithmetic" in found["test_wrong"]["message"]
    assert found["test_errored"]["outcome"] == "errors"


def test_step_selection_by_prefix(G, tmp_path):
    steps = G.plan(tmp_path)
    names = [s.name for s in steps]
    assert names[0] == "gpu-tests" and {"bench-cudnn", "bench-neighborhood"} <= set(names)
    assert [s.name for s in G.select(steps, "sanitize", "sanitize-racecheck")] == \
        ["sanitize-memcheck", "sanitize-initcheck"]
    assert [s.name for s in G.select(steps, None, "bench,sanitize,warm-start,profile-na,host")] == \
        ["gpu-tests", "selftest-full", "selftest-plain", "flash-attn-suite"]
    with pytest.raises(ValueError, match="'benchmark'"):
        G.select(steps, "benchmark", None)
    assert all(s.phase == (3 if s.name.endswith(("-more", "-tuned")) else 2)
               for s in steps if s.name.startswith("bench"))
    evidence = {"warm-start": 2, "profile-na": 3, "host-na": 3,  # proof_extras: alone on
                "host-profile": 3}                                 # the GPU, after phase 1
    assert {s.name: s.phase for s in steps if s.name in evidence} == evidence
    assert all(s.phase == 1 for s in steps
               if not s.name.startswith("bench") and s.name not in evidence)
    assert [s.name for s in G.select(steps, "bench-cudnn", None)] == \
        ["bench-cudnn", "bench-cudnn-more", "bench-cudnn-tuned"]


def test_carried_cubins_seed_a_cache_of_our_own(G, tmp_path, monkeypatch):
    from cudnn_attn.fallback_kernels import cubin_cache

    carried = tmp_path / "carried"
    # Built ahead on another machine: signed with its key, not the device's.
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "build-key"))
    for key in ("a" * 64, "b" * 64):
        assert cubin_cache.store(key, b"\x7fELF" + key.encode(), {"k<float>": "_Z1k"}, "", carried)
    (carried / "notes.txt").write_text("not a cubin")
    (carried / ("c" * 64 + ".cubin")).write_bytes(b"c.cubin")  # not an entry: not adopted
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE", str(tmp_path / "device-key"))
    cache = tmp_path / "cache"
    assert G.seed_cubin_cache(carried, cache) == 2
    assert sorted(p.name for p in cache.iterdir()) == ["a" * 64 + ".cubin", "b" * 64 + ".cubin"]
    assert cubin_cache.load("a" * 64, ["k<float>"], cache)[0] == b"\x7fELFaaaa" + b"a" * 60
    assert G.seed_cubin_cache(None, tmp_path / "empty") == 0


def test_prebuild_refuses_another_nvrtc_version(G, tmp_path, capsys, monkeypatch):
    pytest.importorskip("cupy")
    from cudnn_attn.fallback_kernels import cubin_cache

    try:
        here = cubin_cache.nvrtc_version()
    except Exception as exc:  # noqa: BLE001 - CuPy without a loadable NVRTC
        pytest.skip(f"NVRTC does not load here: {exc}")
    monkeypatch.setenv("CUDNN_ATTN_CUBIN_CACHE", str(tmp_path / "unused"))
    assert G.main(["--prebuild", str(tmp_path / "cubins"), "--expect-nvrtc", "0.1"]) == 2
    message = capsys.readouterr().err
    assert f"NVRTC here is {here}" in message and "0.1" in message
    assert not (tmp_path / "cubins").exists()


def test_prebuild_fails_naming_a_variant_that_spills(G, tmp_path, capsys, monkeypatch):
    pytest.importorskip("cupy")
    from cudnn_attn import fallback_kernels
    from cudnn_attn.fallback_kernels import CompileRecord, cubin_cache

    records = {"sm_90": [CompileRecord("k<a>", "sm_90", 40, 0, 0, 0, "k<a>"),
                         CompileRecord("k<b>", "sm_90", 255, 8, 4, 16, "k<b>")],
               "sm_80": [CompileRecord("k<a>", "sm_80", 40, 0, 0, 0, "k<a>")]}
    monkeypatch.setattr(cubin_cache, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(fallback_kernels, "compile_all", lambda arch, jobs: records[arch])
    monkeypatch.setenv("CUDNN_ATTN_CUBIN_CACHE", str(tmp_path / "unused"))
    cubins = tmp_path / "cubins"
    cubins.mkdir()
    assert G.main(["--prebuild", str(cubins), "--expect-nvrtc", "13.0", "--arch", "sm_80"]) == 0
    assert G.main(["--prebuild", str(cubins), "--expect-nvrtc", "13.0", "--arch", "sm_80",
                   "--arch", "sm_90"]) == 1
    err = capsys.readouterr().err
    assert "k<b> spills on sm_90 (8 bytes stored, 4 loaded)" in err and "k<a>" not in err
    assert (cubins / G.NVRTC_FILE).read_text() == "13.0\n"  # written all the same


def test_without_a_gpu_it_runs_nothing(G, tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert G.main(["--out", str(tmp_path / "out")]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_smoke_run_writes_the_record_and_the_tarball(G, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the smoke run is the CPU's; a GPU host runs the real thing")
    out = tmp_path / "out"
    started = int(time.time()) - 30  # as if on-host had taken 30 s before this started
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--allow-cpu",
                           "--steps", "gpu-tests,selftest-plain", "--workers", "2",
                           "--call-started", str(started), "--commit", "0123abcd"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    # The CuPy selftest cannot run without a GPU: a failed step makes the whole run fail.
    assert done.returncode == 1, done.stdout + done.stderr
    [record] = out.glob("gpu_proof-*.json")
    data = json.loads(record.read_text())
    steps = {s["name"]: s for s in data["steps"]}
    assert set(steps) == {"gpu-tests", "selftest-plain"} and not data["ok"]
    tests = steps["gpu-tests"]
    assert tests["returncode"] == 0 and not tests["timed_out"]
    counts = tests["summary"]["gpu"]
    assert counts["skipped"] > 0 and counts["passed"] == counts["failed"] == counts["errors"] == 0
    plain = steps["selftest-plain"]
    assert plain["returncode"] == 1 and plain["summary"]["ok"] is False
    assert "cupy" in plain["summary"]["unavailable"] and "cupy" in plain["summary"]["table"]
    assert data["env"]["torch"] == torch.__version__ and "command" in data
    assert data["commit"] == data["git"] == "0123abcd"  # passed in: not the device's .git
    assert "version" in data["nvrtc"]  # the device's NVRTC (or why none loads)
    budget = data["budget"]  # the 600 s limit less what on-host took, the ladder, the record
    assert budget["before_start_s"] >= 30 and budget["limit_s"] == 600
    assert budget["budget_s"] == pytest.approx(600 - budget["before_start_s"] - budget["ladder_s"]
                                               - budget["record_s"] - budget["safety_s"], abs=0.2)
    assert budget["margin_s"] > budget["safety_s"]  # measured: the run ended well inside
    assert tests["summary"]["skip_reasons"] and not tests["summary"]["partial"]
    assert sum(tests["summary"]["skip_reasons"].values()) == counts["skipped"]
    assert tests["threads"] >= 1 and tests["signals"] == [] and tests["leftovers"] == 0
    assert plain["summary"]["source"] == "json"
    with tarfile.open(out / "gpu_proof-files.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu-tests.log", "gpu-tests.xml", "gpu-tests.jsonl", "selftest-plain.log",
            "selftest-plain.json", "selftest-plain.jsonl"} <= names
    assert sorted(p.name for p in out.iterdir()) == [record.name, "gpu_proof-files.tar.gz"]
    lines = done.stdout.strip().splitlines()
    last = lines[next(i for i, line in enumerate(lines) if line.startswith("wrote ")):]
    assert any(line.startswith("gpu-tests") and "ok (exit 0" in line for line in last)
    assert any(line.startswith("selftest-plain") and "FAILED (exit 1" in line for line in last)


def test_summary_lines_name_every_verdict_and_count(G):
    bench = G.StepResult("bench-cudnn", "python cudnn.py", returncode=0, seconds=61.0, summary={
        "targets": {"tiny call": True, "large shapes": False, "headline": None},
        "target_values": {"tiny call": 1.02, "large shapes": 0.95, "headline": None}})
    tests = G.StepResult("gpu-tests", "pytest", returncode=1, seconds=200.0, summary={
        "gpu": {"passed": 300, "failed": 1, "errors": 0, "skipped": 3},
        "failures": [{"test": "tests/x.py::test_y", "outcome": "failed", "message": "boom"}]})
    late = G.StepResult("bench-neighborhood", "python neighborhood.py", timed_out=True, seconds=150)
    lines = G.summary_lines([tests, bench, late])
    text = "\n".join(lines)
    assert lines[0].startswith("gpu-tests") and "FAILED (exit 1" in lines[0]
    assert "'failed': 1" in text and "failed: tests/x.py::test_y: boom" in text
    assert "ok   tiny call: 1.02" in text and "MISS large shapes: 0.95" in text
    assert "n/a  headline" in text
    assert any(line.startswith("bench-neighborhood") and "TIMED OUT after 150 s" in line
               for line in lines)


def test_extra_rows_may_run_out_of_time_without_failing_the_run(G, tmp_path):
    code = "import time; time.sleep(120)"
    extra = G.Step("bench-extra", [sys.executable, "-c", code], 3, 1.0, optional=True)
    needed = G.Step("gpu-tests", [sys.executable, "-c", code], 1, 1.0)
    results = G.run_steps([extra, needed], tmp_path, time.monotonic() + 100, side_by_side=True)
    assert all(r.timed_out and not r.ok for r in results)
    assert [r.failed for r in results] == [False, True]
    crashed = G.run_steps([G.Step("bench-crash", [sys.executable, "-c", "raise SystemExit(2)"], 3,
                                  30.0, optional=True)], tmp_path, time.monotonic() + 100,
                          side_by_side=False)
    assert crashed[0].failed  # an optional step that ran and failed is a failure
    steps = G.plan(tmp_path)
    assert {s.name for s in steps if s.optional} == {s.name for s in steps if s.phase == 3} \
        == {"profile-na", "host-na", "host-profile", "bench-cudnn-more",
            "bench-neighborhood-more", "bench-cudnn-tuned"}
    lines = G.summary_lines(results)
    assert "(extra rows: not a failure)" in lines[0] and "not a failure" not in lines[1]


def test_benchmark_steps_read_their_own_folder(G, tmp_path):
    (tmp_path / G.MORE).mkdir()
    quick = {"targets": {"tiny call": True}, "target_values": {"tiny call": 1.01}, "rows": []}
    more = {"targets": {"tiny call": False}, "target_values": {"tiny call": 1.2}}
    (tmp_path / "cudnn-2026-11-26.json").write_text(json.dumps(quick))
    (tmp_path / G.MORE / "cudnn-2026-11-26.json").write_text(json.dumps(more))
    first = G.summarize(G.StepResult("bench-cudnn", "cmd"), tmp_path)
    second = G.summarize(G.StepResult("bench-cudnn-more", "cmd"), tmp_path)
    assert first["file"] == "cudnn-2026-11-26.json" and first["targets"] == {"tiny call": True}
    assert second["file"] == "more/cudnn-2026-11-26.json"
    assert second["target_values"] == {"tiny call": 1.2}
    assert G.summarize(G.StepResult("bench-neighborhood", "cmd"), tmp_path) == {}
    (tmp_path / G.TUNED).mkdir()
    (tmp_path / G.TUNED / "cudnn-2026-11-29.json").write_text(json.dumps(more))
    tuned = G.summarize(G.StepResult("bench-cudnn-tuned", "cmd"), tmp_path)
    assert tuned["file"] == "tuned/cudnn-2026-11-29.json" and tuned["targets"] == more["targets"]


def test_a_commit_passed_in_names_every_record(G, tmp_path, monkeypatch):
    """issue 23: the record said "78783be-dirty" (a stale .git on the device) for 7cfa5f7."""
    report = sys.modules["_report"]
    monkeypatch.setenv(report.COMMIT_ENV, "7cfa5f7")
    path = report.write_json("cudnn", {"rows": []}, results_dir=tmp_path)
    assert json.loads(path.read_text())["git"] == "7cfa5f7"
    child = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "import _report; print(_report._git_describe())",
                            str(SCRIPT.parent)], env={**os.environ}, capture_output=True,
                           text=True, timeout=60)
    assert child.stdout.strip() == "7cfa5f7", child.stderr
    monkeypatch.delenv(report.COMMIT_ENV)
    assert report._git_describe() != "7cfa5f7"



# -- FlashAttention's own suite on the GPU (issue 36, item 7) ------------------------------------

# A stand-in for FlashAttention's checkout: its test file imports flash_attn (the runner's shim
# of cudnn_attn's drop-in) and einops, as FA's does; one test of each outcome.
FAKE_FA_TESTS = """
import pytest
import torch
from einops import rearrange
from flash_attn import flash_attn_func


@pytest.mark.parametrize("seqlen", [17, 64, 113])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_output(seqlen, causal):
    g = torch.Generator().manual_seed(seqlen)
    q, k, v = (torch.randn(2, seqlen, 3, 16, generator=g, dtype=torch.float64) for _ in range(3))
    out = flash_attn_func(q, k, v, causal=causal)
    mask = torch.ones(seqlen, seqlen).tril() if causal else torch.ones(seqlen, seqlen)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    p = torch.softmax(s.masked_fill(mask == 0, float("-inf")), -1)
    want = rearrange(torch.einsum("bhqk,bkhd->bhqd", p, v), "b h s d -> b s h d")
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("d", [8, 16])
def test_flash_attn_cannot_run(d):
    raise NotImplementedError(f"no backend can run this call (d={d})")


def test_flash_attn_skips():
    pytest.skip("FA's own skip")
"""


@pytest.fixture
def fake_flash_attn(tmp_path):
    return flash_attn_checkout(tmp_path, FAKE_FA_TESTS)


def test_the_flash_attn_step_runs_the_peer_runner_as_shipped(G, tmp_path):
    [step] = [s for s in G.plan(tmp_path, flash_attn=tmp_path / "fa") if s.name == "flash-attn-suite"]
    assert step.phase == 1 and step.cap_s == G.FLASH_ATTN_CAP_S <= 150 and not step.optional
    argv = step.argv
    assert argv[1].endswith("tests/peer/run_flash_attn_suite.py") and argv[2] == str(tmp_path / "fa")
    assert argv[argv.index("--device") + 1] == "cuda"
    assert int(argv[argv.index("--per-test") + 1]) == G.FLASH_ATTN_PER_TEST
    budget = float(argv[argv.index("--time-budget") + 1])
    assert budget + 20 <= step.cap_s  # the runner stops itself before the step's deadline
    assert f"--junitxml={tmp_path / 'flash-attn-suite.xml'}" in argv
    assert f"--outcome-stream={tmp_path / 'flash-attn-suite.jsonl'}" in argv
    assert str(G.PLUGINS) in step.env["PYTHONPATH"]
    assert G.parse_args(["--out", "x"]).flash_attn == str(G.FLASH_ATTN_DIR)


def test_the_runner_stages_what_it_reads_and_says_what_is_missing(fake_flash_attn, tmp_path):
    runner = ROOT / "tests" / "peer" / "run_flash_attn_suite.py"
    staged = tmp_path / "staged"
    done = subprocess.run([sys.executable, str(runner), str(fake_flash_attn), "--stage",
                           str(staged)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(str(p.relative_to(staged)) for p in staged.rglob("*.py")) == [
        "flash_attn/bert_padding.py", "tests/test_flash_attn.py"]
    missing = subprocess.run([sys.executable, str(runner), str(tmp_path / "nowhere"),
                              "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "test_flash_attn.py is missing" in missing.stderr


def test_the_runner_starts_no_case_after_its_time_budget(fake_flash_attn, tmp_path):
    slow = fake_flash_attn / "tests" / "test_flash_attn.py"
    slow.write_text(slow.read_text() + textwrap.dedent("""
        @pytest.mark.parametrize("i", range(30))
        def test_flash_attn_slow(i):
            import time
            time.sleep(0.5)
    """))
    runner = ROOT / "tests" / "peer" / "run_flash_attn_suite.py"
    record = tmp_path / "run.json"
    done = subprocess.run([sys.executable, str(runner), str(fake_flash_attn), "--device", "cuda",
                           "--per-test", "30", "--time-budget", "8", "--json", str(record),
                           "-k", "slow or skips"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "time budget reached" in done.stdout
    counts = json.loads(record.read_text())["counts"]
    # round-robin: the skip ran second, whatever the budget; then slow cases until 8 s (from
    # the runner's start: collection counts too, so a loaded machine may start none of them)
    assert counts["skipped"] == 1 and counts["passed"] < 30, counts


def test_smoke_run_of_the_flash_attn_step_records_counts_and_causes(G, fake_flash_attn,
                                                                    tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the smoke run is the CPU's; a GPU host runs the real thing")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--allow-cpu",
                           "--steps", "flash-attn-suite", "--flash-attn", str(fake_flash_attn)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr  # the failing case fails the run
    [record] = out.glob("gpu_proof-*.json")
    [step] = json.loads(record.read_text())["steps"]
    summary = step["summary"]
    # 6 cases of the first function (all of them: fewer than --per-test), 2 + 1 of the others
    assert summary["flash_attn"] == {"passed": 6, "failed": 2, "errors": 0, "skipped": 1}, step
    assert summary["causes"] == {"NotImplementedError: no backend can run this call (d=N)": 2}
    assert summary["skip_reasons"] and not summary["partial"]
    assert (summary["per_test"], summary["seed"], summary["device"]) == (
        G.FLASH_ATTN_PER_TEST, 0, "cuda")
    lines = done.stdout.strip().splitlines()
    assert any("2 x NotImplementedError: no backend can run" in line for line in lines)
    with tarfile.open(out / "gpu_proof-files.tar.gz") as tar:
        assert {"flash-attn-suite.xml", "flash-attn-suite.jsonl", "flash-attn-suite.log",
                "flash-attn-suite.json"} <= set(tar.getnames())


def test_the_gpu_sample_reaches_every_test_function_first(tmp_path):
    """Round-robin order (``--device cuda``): a run cut at its deadline has run each function."""
    sys.path.insert(0, str(ROOT / "tests" / "peer"))
    try:
        import run_flash_attn_suite as runner
    finally:
        sys.path.remove(str(ROOT / "tests" / "peer"))
    namespace: dict = {}
    exec(runner.SAMPLING_CONFTEST.format(per_test=2, seed=0, round_robin=True, thin_grid=False,
                                         time_budget=0), namespace)

    class Item:
        def __init__(self, name, i):
            self.originalname, self.i = name, i

    class Hook:
        def pytest_deselected(self, items):
            self.dropped = items

    class Config:
        hook = Hook()

    items = [Item("a", i) for i in range(5)] + [Item("b", i) for i in range(3)] + [Item("c", 0)]
    namespace["pytest_collection_modifyitems"](Config(), items)
    names = [i.originalname for i in items]
    assert names[:3] == ["a", "b", "c"] and sorted(names) == ["a", "a", "b", "b", "c"]
    assert len(Config.hook.dropped) == 4


def test_gpu_tests_keep_their_artifacts_in_the_tarball(G, tmp_path):
    """A GPU test that fails keeps what the CPU needs to diagnose it (the wgmma probe's tensors)
    under ``$CUDNN_ATTN_GPU_ARTIFACTS``: a folder of the run's work, which the tarball packs."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    out.mkdir()
    [step] = [s for s in G.plan(work) if s.name == "gpu-tests"]
    keep = Path(step.env[G.ARTIFACTS_ENV])
    assert keep.parent == work and G.ARTIFACTS_ENV == "CUDNN_ATTN_GPU_ARTIFACTS"
    keep.mkdir()
    (keep / "wgmma_probe-bf16-hd128-k64.pt").write_bytes(b"tensors")
    G.write_record(out, work, [], {}, tarball=True)
    with tarfile.open(out / "gpu_proof-files.tar.gz") as tar:
        assert f"{keep.name}/wgmma_probe-bf16-hd128-k64.pt" in tar.getnames()
