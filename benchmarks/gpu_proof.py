"""One prepared call on a GPU host: the whole GPU proof (tests, selftest, sanitizer, benchmarks)
inside a time budget, with everything it learns packed under ``--out``.

On the device (``../shared/gpu.md``; ``.whl`` and ``.cubins`` carried, ``timeout_s`` 600):

    source .whl/on-host || exit 1; python3 benchmarks/gpu_proof.py --out $OUT --cubins .cubins

Phase 1, correctness, runs its steps side by side (they share the GPU, not timings):
  gpu-tests         pytest -m gpu, with pytest-xdist workers and a per-test timeout when those
                    plugins are installed; junit XML
  selftest-full     cudnn-attn selftest --full, every engine that can run there
  selftest-plain    the CuPy engine's selftest on the plain (not cp.async-pipelined) build
  sanitize-<tool>   benchmarks/sanitize.py, one process per compute-sanitizer tool
Phase 2, speed, alone on the GPU: benchmarks/cudnn.py --quick, then benchmarks/neighborhood.py
--quick, each writing its JSON into the run's folder, with the machine's ceilings. Phase 3, only
with time left: the rest of the bf16 D=128 rows (the cuDNN curve's other sequence lengths; the
1-D and 3-D neighborhoods) into ``more/``; ``gpu_report.py`` merges them with phase 2's.

Every step has a deadline (its cap, never past the budget). At the deadline its whole process
group is killed and it is recorded as timed out, with the tail of its log. After each phase the
run writes ``OUT/gpu_proof-<date>.json`` (environment, command, each step's exit status and
seconds, pytest counts per marker with the failing test ids, the selftest tables, the
sanitizer's counts, the cubins compiled on the device, the benchmarks' verdicts) and
``OUT/gpu_proof-files.tar.gz`` (every log, the junit XML, every raw JSON: two files, well inside
the device tool's eight). The summary is printed last, so the call's output tail holds it even
when no file comes back. Exit status 1 when any step failed or timed out (phase 3's may run out
of time).

``--cubins DIR`` seeds the NVRTC cubin cache with programs compiled ahead, so no process on the
device spends its minutes compiling: ``--prebuild DIR --arch sm_90`` fills DIR on any machine
whose NVRTC has the device's version (no GPU needed; the cache key holds NVRTC's version, so a
cubin from another version is simply not used, and the summary counts what was compiled there).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _report  # benchmarks/_report.py (this script's folder is on sys.path)

_report.unshadow_cudnn()  # this folder's cudnn.py is not the cuDNN frontend

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package is the repository's
    sys.path.insert(0, str(ROOT))
SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck")
DEVICE_NVRTC = "13.0"  # the H100/H200 image's CUDA 13.0 (../shared/gpu.md)
MIN_START_S = 20.0  # a step with less time than this left is not started
KILL_GRACE_S = 5.0  # SIGTERM, then SIGKILL this much later
PHASE_2_RESERVE_S = 150.0  # the benchmarks' share of the budget when phase 1 runs long
MORE = "more"  # the phase 3 benchmarks' folder
NAME_WIDTH = 24  # the step-name column of the printed summary


@dataclass
class Step:
    """One command of the run: ``phase`` 1 steps run side by side, later phases one at a time."""

    name: str
    argv: list[str]
    phase: int
    cap_s: float
    env: dict[str, str] = field(default_factory=dict)
    optional: bool = False  # a timeout or no time to start is no failure (extra rows)


@dataclass
class StepResult:
    name: str
    command: str
    returncode: int | None = None  # None: not started, or killed at its deadline
    seconds: float = 0.0
    timed_out: bool = False
    not_started: str | None = None  # why, when it never ran
    log_tail: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    optional: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def failed(self) -> bool:
        """Not ok, unless an optional step merely ran out of time."""
        return not self.ok and not (self.optional and (self.timed_out or self.not_started))


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------

def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def plan(work: Path, python: str = sys.executable, workers: int = 8,
         test_timeout_s: float = 240.0) -> list[Step]:
    """Every step of a full run, in priority order, writing its files under ``work``."""
    bench = ROOT / "benchmarks"
    tests = [python, "-m", "pytest", "-q", "-m", "gpu", "-rfE", "-p", "no:cacheprovider",
             f"--junitxml={work / 'gpu-tests.xml'}"]
    if workers > 1 and _has_module("xdist"):  # the device image has pytest-xdist
        tests += ["-n", str(workers)]
    if _has_module("pytest_timeout"):  # one hung test must not eat the whole budget
        tests += [f"--timeout={test_timeout_s:g}"]
    selftest = [python, "-m", "cudnn_attn", "selftest", "--no-progress"]
    steps = [
        Step("gpu-tests", tests, 1, 360.0),
        Step("selftest-full", [*selftest, "--full", "--json", str(work / "selftest-full.json")],
             1, 330.0),
        Step("selftest-plain", [*selftest, "--backend", "cupy", "--json",
                                str(work / "selftest-plain.json")], 1, 150.0,
             env={"CUDNN_ATTN_FUSED_PIPELINED": "0"}),
    ]
    for tool in SANITIZER_TOOLS:
        # The script's own per-tool timeout ends first, so it still writes its summary.
        steps.append(Step(f"sanitize-{tool}", [python, str(bench / "sanitize.py"), "--tools", tool,
                                               "--json", str(work / f"sanitize-{tool}.json"),
                                               "--timeout", "300"], 1, 330.0))
    for suite in ("cudnn", "neighborhood"):
        steps.append(Step(f"bench-{suite}", [python, str(bench / f"{suite}.py"), "--quick",
                                             "--results-dir", str(work)], 2, 150.0))
    # With time left: the rest of the bf16 D=128 rows (the cuDNN curve's other sequence lengths,
    # the 1-D and 3-D neighborhoods), in a folder of their own; gpu_report merges them.
    more = ["--no-ceilings", "--results-dir", str(work / MORE)]
    steps += [
        Step("bench-cudnn-more", [python, str(bench / "cudnn.py"), "--quick", "--seqs", "512",
                                  "2048", "4096", "16384", *more], 3, 240.0, optional=True),
        Step("bench-neighborhood-more", [python, str(bench / "neighborhood.py"), "--dims", "1", "3",
                                         "--dtypes", "bf16", "--head-dims", "128", "--repeats", "3",
                                         "--warmup", "2", *more], 3, 240.0, optional=True),
    ]
    return steps


def select(steps: list[Step], only: str | None, skip: str | None) -> list[Step]:
    """The steps whose names start with one of ``only``'s comma-separated prefixes (all when
    None), less those matching ``skip``; a prefix that matches no step is a ValueError."""
    def prefixes(spec: str | None) -> list[str]:
        return [p.strip() for p in (spec or "").split(",") if p.strip()]

    for p in prefixes(only) + prefixes(skip):
        if not any(s.name.startswith(p) for s in steps):
            raise ValueError(f"no step is named {p!r}; steps: {', '.join(s.name for s in steps)}")
    return [s for s in steps
            if (only is None or any(s.name.startswith(p) for p in prefixes(only)))
            and not any(s.name.startswith(p) for p in prefixes(skip))]


# ---------------------------------------------------------------------------------------------
# Running with deadlines
# ---------------------------------------------------------------------------------------------

@dataclass
class _Running:
    step: Step
    proc: subprocess.Popen
    log: Any
    log_path: Path
    started: float
    deadline: float


def _start(step: Step, work: Path, deadline: float, env: dict[str, str]) -> _Running:
    log_path = work / f"{step.name}.log"
    log = open(log_path, "w")
    log.write(f"$ {shlex.join(step.argv)}\n")
    log.flush()
    # A new session per step, so the deadline kills the step's children too (sanitizer, workers).
    proc = subprocess.Popen(step.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**env, **step.env}, start_new_session=True)
    return _Running(step, proc, log, log_path, time.monotonic(), deadline)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 25) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _finish(run: _Running, timed_out: bool) -> StepResult:
    if timed_out:
        _kill_group(run.proc)
    run.log.close()
    return StepResult(run.step.name, shlex.join(run.step.argv),
                      None if timed_out else run.proc.returncode,
                      round(time.monotonic() - run.started, 1), timed_out,
                      log_tail=_tail(run.log_path), optional=run.step.optional)


def run_steps(steps: list[Step], work: Path, stop_at: float, *, side_by_side: bool,
              env: dict[str, str] | None = None, poll_s: float = 0.2) -> list[StepResult]:
    """Run ``steps`` (all at once, or one after another) so that none outlives ``stop_at``
    (a ``time.monotonic()`` instant) nor its own cap. Results come back in ``steps``' order."""
    env = dict(os.environ if env is None else env)
    results: dict[str, StepResult] = {}
    pending, running = list(steps), []
    while pending or running:
        now = time.monotonic()
        while pending and (side_by_side or not running):
            step = pending.pop(0)
            if stop_at - now < MIN_START_S:
                results[step.name] = StepResult(step.name, shlex.join(step.argv),
                                                not_started="no time left in the budget",
                                                optional=step.optional)
                continue
            running.append(_start(step, work, min(now + step.cap_s, stop_at), env))
        for run in list(running):
            done = run.proc.poll() is not None
            if done or time.monotonic() >= run.deadline:
                results[run.step.name] = _finish(run, timed_out=not done)
                running.remove(run)
        if running:
            time.sleep(poll_s)
    return [results[s.name] for s in steps]


# ---------------------------------------------------------------------------------------------
# What each step's files say
# ---------------------------------------------------------------------------------------------

def junit_counts(path: Path, marker: str = "gpu", failures_shown: int = 40) -> dict[str, Any]:
    """``{marker: {passed, failed, errors, skipped}, "failures": [...]}`` from a junit XML file
    (every test of a ``-m marker`` run carries that marker)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(child.tag)
            if kind is None:
                continue
            # A test that failed and then errored in teardown counts once, as failed.
            outcome = kind if outcome == "passed" else outcome
            if kind in ("failed", "errors"):
                message = (child.get("message") or child.text or "").strip().splitlines()
                failures.append({"test": test_id, "outcome": kind,
                                 "message": (message[0] if message else "")[:300]})
        counts[outcome] += 1
    return {marker: counts, "failures": failures[:failures_shown],
            "failures_total": len(failures)}


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _newest(work: Path, suite: str) -> Path | None:
    found = sorted(work.glob(f"{suite}-*.json"))
    return found[-1] if found else None


def summarize(result: StepResult, work: Path) -> dict[str, Any]:
    """The figures a step's own files hold (empty when it wrote none)."""
    name = result.name
    if name == "gpu-tests":
        xml = work / "gpu-tests.xml"
        return junit_counts(xml) if xml.exists() else {}
    if name.startswith("selftest-"):
        data = _load_json(work / f"{name}.json")
        return {} if data is None else {k: data.get(k) for k in ("ok", "counts", "table",
                                                                 "unavailable")}
    if name.startswith("sanitize-"):
        data = _load_json(work / f"{name}.json") or {}
        return {tool: {k: v.get(k) for k in ("ok", "why", "errors", "warnings", "cases_ok",
                                             "cases_failed", "seconds")}
                for tool, v in data.get("tools", {}).items()}
    if name.startswith("bench-"):
        suite = name.removeprefix("bench-")
        folder = work / MORE if suite.endswith("-" + MORE) else work
        path = _newest(folder, suite.removesuffix("-" + MORE))
        data = _load_json(path) if path else None
        keep = ("ceilings", "headline_tflops", "targets", "target_values", "target", "overhead")
        return {} if data is None else {"file": str(path.relative_to(work)),
                                         **{k: data[k] for k in keep if k in data}}
    return {}


# ---------------------------------------------------------------------------------------------
# The cubin cache
# ---------------------------------------------------------------------------------------------

def _cubins(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*.cubin")} if directory.is_dir() else set()


def seed_cubin_cache(carried: Path | None, cache: Path) -> int:
    """Adopt the carried cubins into a fresh cache directory of ours: they were signed with the
    build machine's key, so ``cubin_cache.adopt`` re-signs the well-formed ones with this user's
    (the cache loads only entries signed so); the number adopted."""
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    if carried is None or not _cubins(carried):
        return 0
    from cudnn_attn.fallback_kernels import cubin_cache

    return cubin_cache.adopt(carried, cache)


def prebuild(directory: Path, archs: list[str], expect_nvrtc: str) -> int:
    """Compile every kernel program for ``archs`` into ``directory`` (no GPU needed)."""
    os.environ["CUDNN_ATTN_CUBIN_CACHE"] = str(directory.resolve())
    from cudnn_attn import fallback_kernels
    from cudnn_attn.fallback_kernels import cubin_cache

    version = cubin_cache.nvrtc_version()
    if version != expect_nvrtc:
        print(f"gpu_proof: NVRTC here is {version}, the device's is {expect_nvrtc}: these cubins "
              f"would not be used there. Compile with NVRTC {expect_nvrtc}, e.g. a venv with "
              "--system-site-packages and cupy-cuda13x + nvidia-cuda-nvrtc==13.0.* "
              "(README, 'Running on a GPU'), or pass --expect-nvrtc.", file=sys.stderr)
        return 2
    before = _cubins(directory)
    for arch in archs:
        start = time.perf_counter()
        records = fallback_kernels.compile_all(arch)
        print(f"{arch}: {len(records)} kernels in {time.perf_counter() - start:.1f} s")
    added = _cubins(directory) - before
    print(f"{directory}: {len(_cubins(directory))} cubins ({len(added)} new), NVRTC {version}")
    return 0


# ---------------------------------------------------------------------------------------------
# The record
# ---------------------------------------------------------------------------------------------

def write_record(out: Path, work: Path, results: list[StepResult], extra: dict[str, Any]) -> Path:
    """The summary JSON and the tarball of every file the steps wrote (cubins excluded)."""
    payload = {"ok": not any(r.failed for r in results), "steps": [vars(r) for r in results],
               **extra}
    path = _report.write_json("gpu_proof", payload, results_dir=out)
    with tarfile.open(out / "gpu_proof-files.tar.gz", "w:gz") as tar:
        for item in sorted(work.iterdir()):
            if item.name != "cubins":
                tar.add(item, arcname=item.name)
    return path


def summary_lines(results: list[StepResult]) -> list[str]:
    """The compact picture printed last (the device tool returns the output's tail)."""
    lines = []
    for r in results:
        state = ("not started: " + r.not_started if r.not_started else
                 f"TIMED OUT after {r.seconds:.0f} s" if r.timed_out else
                 f"{'ok' if r.ok else 'FAILED'} (exit {r.returncode}, {r.seconds:.0f} s)")
        if r.optional and not r.ok and not r.failed:
            state += " (extra rows: not a failure)"
        lines.append(f"{r.name:<{NAME_WIDTH}} {state}")
        s, pad = r.summary, " " * NAME_WIDTH
        if r.name == "gpu-tests" and s:
            lines.append(f"{pad} gpu: {s['gpu']}")
            lines += [f"{pad} {f['outcome']}: {f['test']}: {f['message'][:160]}"
                      for f in s["failures"][:15]]
        elif r.name.startswith("selftest-") and s.get("counts"):
            lines.append(f"{pad} {s['counts']}")
        elif r.name.startswith("sanitize-"):
            lines += [f"{pad} {tool}: {v.get('errors')} errors, {v.get('cases_ok')} cases ok"
                      f"{'' if v.get('ok') else ', ' + '; '.join(v.get('why') or [])}"
                      for tool, v in s.items()]
        elif r.name.startswith("bench-"):
            values = s.get("target_values") or {}
            for what, met in (s.get("targets") or {}).items():
                mark = "n/a " if met is None else "ok  " if met else "MISS"
                value = values.get(what)
                lines.append(f"{pad} {mark} {what}" + ("" if value is None else f": {value:.3g}"))
            if "target" in s:
                lines.append(f"{pad} {s['target'].get('text')}")
    return lines


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_proof: torch sees no CUDA GPU here; nothing was run (--allow-cpu for a "
              "smoke run of the plumbing).")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_proof_"))
    cache = work / "cubins"
    carried = seed_cubin_cache(Path(args.cubins) if args.cubins else None, cache)
    env = {**os.environ, "CUDNN_ATTN_CUBIN_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    steps = select(plan(work, workers=args.workers), args.steps, args.skip)
    begin = time.monotonic()
    stop_at = begin + args.budget
    extra: dict[str, Any] = {"budget_s": args.budget, "cubins": {"carried": carried}}
    results: list[StepResult] = []
    for phase, side_by_side in ((1, True), (2, False), (3, False)):
        todo = [s for s in steps if s.phase == phase]
        if not todo:
            continue
        # Phase 1 leaves the benchmarks their share of the budget, unless there are none.
        reserve = PHASE_2_RESERVE_S if phase == 1 and any(s.phase > 1 for s in steps) else 0.0
        end = max(stop_at - reserve, time.monotonic() + MIN_START_S) if reserve else stop_at
        print(f"phase {phase}: {', '.join(s.name for s in todo)} "
              f"({end - time.monotonic():.0f} s at most)", flush=True)
        done = run_steps(todo, work, min(end, stop_at), side_by_side=side_by_side, env=env)
        for r in done:
            r.summary = summarize(r, work)
        results += done
        extra["cubins"]["compiled_on_device"] = len(_cubins(cache)) - carried
        extra["seconds"] = round(time.monotonic() - begin, 1)
        path = write_record(out, work, results, extra)
    print("\n".join(f"\n[{r.name}] selftest table\n{r.summary['table']}" for r in results
                    if r.summary.get("table")))
    print(f"\nwrote {path} and {out / 'gpu_proof-files.tar.gz'} ({extra['seconds']:.0f} s; "
          f"cubins carried {carried}, compiled here {extra['cubins']['compiled_on_device']})")
    print("\n".join(summary_lines(results)))
    shutil.rmtree(work, ignore_errors=True)  # everything worth keeping is in the tarball
    return 1 if any(r.failed for r in results) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the summary JSON and the tarball ($OUT)")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for the whole run (default %(default)s: inside the device "
                             "tool's 600 s per command)")
    parser.add_argument("--cubins", help="folder of cubins compiled ahead (--prebuild)")
    parser.add_argument("--steps", help="only these steps (comma-separated names or prefixes)")
    parser.add_argument("--skip", help="not these steps (comma-separated names or prefixes)")
    parser.add_argument("--workers", type=int, default=8, help="pytest-xdist workers")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (smoke)")
    parser.add_argument("--prebuild", metavar="DIR",
                        help="compile every kernel program into DIR and exit (no GPU needed)")
    parser.add_argument("--arch", action="append", help="--prebuild target (default sm_90)")
    parser.add_argument("--expect-nvrtc", default=DEVICE_NVRTC,
                        help="--prebuild refuses another NVRTC version (default %(default)s)")
    args = parser.parse_args(argv)
    if args.prebuild is None and not args.out:
        parser.error("--out is required (or --prebuild DIR)")
    if args.budget <= MIN_START_S:
        parser.error(f"--budget must exceed {MIN_START_S:g} s, got {args.budget:g}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prebuild is not None:
        return prebuild(Path(args.prebuild), args.arch or ["sm_90"], args.expect_nvrtc)
    try:
        select(plan(Path(".")), args.steps, args.skip)
    except ValueError as exc:
        print(f"gpu_proof: {exc}", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
