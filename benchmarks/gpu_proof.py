"""One prepared call on a GPU host: the whole GPU proof (tests, selftest, sanitizer, benchmarks)
inside a time budget, with everything it learns packed under ``--out``, and nothing lost to a
deadline, a hang or a crash.

On the device (README, "Running on a GPU"; ``.whl`` and ``.cubins`` carried, ``timeout_s`` 600):

    t0=$(date +%s); source .whl/on-host || exit 1; python3 benchmarks/gpu_proof.py --out $OUT \
        --cubins .cubins --call-started $t0 --commit <git rev-parse HEAD, pasted in here>

Phase 1, correctness, runs its steps side by side (they share the GPU, not timings; each
process gets ``cores // processes`` threads):
  gpu-tests         pytest -m gpu with pytest-xdist workers and a per-test timeout of the thread
                    method (a hung kernel costs its test, not the step: the worker is replaced);
                    junit XML, and every outcome streamed as it happens
  selftest-full     cudnn-attn selftest --full, each engine in its own process, every verdict
                    streamed (a crashed or hung engine's process is replaced; the others go on)
  selftest-plain    the CuPy engine's selftest on the plain (not cp.async-pipelined) build
  sanitize-<tool>   benchmarks/sanitize.py, one process per compute-sanitizer tool
  flash-attn-suite  FlashAttention 2.8.3's own tests/test_flash_attn.py, as shipped, against
                    cudnn_attn (tests/peer/run_flash_attn_suite.py --device cuda): a seeded
                    sample of each test function, round-robin, no case started after 120 s
                    (capped at 150 s); counts and failure causes in the record. It reads the
                    two files ``--flash-attn DIR`` holds (default ``.peers/flash-attention``,
                    git-ignored, carried: ``run_flash_attn_suite.py CHECKOUT --stage DIR``) and
                    needs einops (``fetch-wheels einops``)
Phase 2, speed, alone on the GPU, in order of importance, each with its own share of the time:
benchmarks/cudnn.py --quick, then benchmarks/neighborhood.py --quick, each writing its JSON into
the run's folder, with the machine's ceilings; then the warm start of the graph caches carried
in ``.graphs`` (``proof_extras``). Phase 3, only with time left: the fused neighborhood kernels'
profile, where the host time goes (``na_host.py``, ``host_profile.py``), then the rest of the
bf16 D=128 rows into ``more/``; ``gpu_report.py`` merges them with phase 2's; last, the
autotuned cuDNN rows into ``tuned/``.

A step's deadline (its cap, its share, never past the budget) sends its process group SIGINT,
then SIGTERM, then SIGKILL (``proof_steps``); whatever is left of the group when the step ends
is ended too. The record ``OUT/gpu_proof-<date>.json`` (environment, the commit passed in, the
device's NVRTC, the budget and the margin measured, each step's exit status, seconds, signals
and threads, pytest counts per marker with failing ids and skip reasons, the selftest tables,
partial counts of a cut step, the sanitizer's counts, the benchmarks' verdicts) is rewritten
after every step, and ``OUT/gpu_proof-files.tar.gz`` (every log, junit XML, stream and raw JSON)
after every phase, both through a temporary file and a rename (``proof_record``). The summary is
printed last, so the call's output tail holds it even when no file comes back. Exit status 1
when any step failed or timed out (phase 3's may run out of time).

``--cubins DIR`` seeds the NVRTC cubin cache with programs compiled ahead, so no process on the
device spends its minutes compiling: ``--prebuild DIR --arch sm_90`` fills DIR on any machine
whose NVRTC has the device's version (no GPU needed; the cache key holds NVRTC's version, so a
cubin from another version is simply not used, and the summary counts what was compiled there).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# This script's siblings, also when it is loaded by path (gpu_report, the tests) after loading
# cudnn.py took this folder off sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  benchmarks/_report.py
import proof_extras  # noqa: E402
import proof_record  # noqa: E402
import proof_steps  # noqa: E402
from proof_record import (MORE, TUNED, NAME_WIDTH, junit_counts, stream_counts, summarize,  # noqa: E402,F401
                          summary_lines, write_record)
from proof_steps import (LADDER_S, MIN_START_S, Step, StepResult, end_group,  # noqa: E402,F401
                         group_members, run_steps)

_report.unshadow_cudnn()  # this folder's cudnn.py is not the cuDNN frontend (and off the path)

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package is the repository's
    sys.path.insert(0, str(ROOT))
PLUGINS = Path(__file__).resolve().parent / "pytest_plugins"
SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck")
DEVICE_NVRTC = "13.0"  # the H100/H200 image's CUDA 13.0 (../shared/gpu.md)
NVRTC_FILE = "nvrtc-version.txt"  # --prebuild writes the NVRTC version its cubins are for
# The budget: the device runs one command for at most LIMIT_S. Before gpu_proof starts, on-host
# installs the wheels and prints the versions (its seconds are measured with --call-started);
# after the budget, a cut step may take LADDER_S to die and the record RECORD_S to be written.
LIMIT_S = 600.0
ON_HOST_S = 45.0  # on-host's and gpu_proof's start when --call-started does not measure them
RECORD_S = 10.0
SAFETY_S = 20.0
DEFAULT_BUDGET_S = LIMIT_S - ON_HOST_S - LADDER_S - RECORD_S - SAFETY_S
TEST_TIMEOUT_S = 120.0  # one GPU test; a hung one costs this, not the step
CASE_TIMEOUT_S = 120.0  # one selftest run
ENGINES = 3  # the selftest's engine processes (cudnn, cupy, torch)
FLASH_ATTN_DIR = ROOT / ".peers" / "flash-attention"  # the staged FA 2.8.3 files (git-ignored)
FLASH_ATTN_CAP_S = 150.0  # the FA suite's slice of the 600 s call ...
ARTIFACTS_ENV = "CUDNN_ATTN_GPU_ARTIFACTS"  # where a GPU test keeps a failure's tensors
FLASH_ATTN_BUDGET_S = 120.0  # ... in which the runner starts no case after this: it ends itself
FLASH_ATTN_PER_TEST = 6  # sampled cases per FA test function (seeded): 84 of the grid's 508,772
FLASH_ATTN_WORKERS = 1  # phase 1 then keeps to the device's 16 cores (gpu-tests has 8)
FLASH_ATTN_TEST_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------

def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def pytest_options(name: str, work: Path, workers: int, test_timeout_s: float
                   ) -> tuple[list[str], bool]:
    """``(options, xdist)``: junit XML and the outcome stream in ``work``, xdist workers, and a
    per-test timeout of the thread method, which stops a test hung in a call that released the
    GIL (the signal method cannot); it ends the worker's process, so it needs xdist to replace
    the worker and go on (without xdist: the signal method)."""
    options = [f"--junitxml={work / (name + '.xml')}", "-p", "outcome_stream",
               f"--outcome-stream={work / (name + '.jsonl')}"]
    xdist = workers > 1 and _has_module("xdist")
    if xdist:  # the device image has pytest-xdist and pytest-timeout
        options += ["-n", str(workers)]
    if _has_module("pytest_timeout"):
        options += [f"--timeout={test_timeout_s:g}",
                    f"--timeout-method={'thread' if xdist else 'signal'}"]
    return options, xdist


def _plugins_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(PLUGINS) + (os.pathsep + path if path else "")}


def pytest_step(name: str, work: Path, args: list[str], python: str = sys.executable,
                workers: int = 8, test_timeout_s: float = TEST_TIMEOUT_S, cap_s: float = 360.0,
                phase: int = 1) -> Step:
    """A pytest run as a step (``pytest_options``)."""
    options, xdist = pytest_options(name, work, workers, test_timeout_s)
    argv = [python, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", *args, *options]
    # Tests keep what a failure needs to be diagnosed on the CPU there (the tarball takes it).
    artifacts = {ARTIFACTS_ENV: str(work / f"{name}-artifacts")}
    return Step(name, argv, phase, cap_s, env={**_plugins_env(), **artifacts},
                processes=workers if xdist else 1)


def flash_attn_step(work: Path, source: Path, python: str = sys.executable,
                    workers: int = FLASH_ATTN_WORKERS, per_test: int = FLASH_ATTN_PER_TEST,
                    seed: int = 0) -> Step:
    """FlashAttention 2.8.3's ``tests/test_flash_attn.py`` on the GPU through the CPU peer
    runner (``--device cuda``: the file as shipped), as a pytest step of its own slice."""
    name = "flash-attn-suite"
    options, xdist = pytest_options(name, work, workers, FLASH_ATTN_TEST_TIMEOUT_S)
    argv = [python, str(ROOT / "tests" / "peer" / "run_flash_attn_suite.py"), str(source),
            "--device", "cuda", "--per-test", str(per_test), "--seed", str(seed),
            "--time-budget", f"{FLASH_ATTN_BUDGET_S:g}", "--json", str(work / f"{name}.json"),
            *options]
    return Step(name, argv, 1, FLASH_ATTN_CAP_S, env=_plugins_env(),
                processes=workers if xdist else 1)


def plan(work: Path, python: str = sys.executable, workers: int = 8,
         test_timeout_s: float = TEST_TIMEOUT_S, flash_attn: Path = FLASH_ATTN_DIR) -> list[Step]:
    """Every step of a full run, in priority order, writing its files under ``work``
    (``flash_attn``: the staged FlashAttention files)."""
    bench = ROOT / "benchmarks"
    selftest = [python, "-m", "cudnn_attn", "selftest", "--case-timeout", f"{CASE_TIMEOUT_S:g}"]

    def files(name: str) -> list[str]:
        return ["--json", str(work / f"{name}.json"), "--stream", str(work / f"{name}.jsonl")]

    steps = [
        pytest_step("gpu-tests", work, ["-m", "gpu"], python, workers, test_timeout_s),
        Step("selftest-full", [*selftest, "--full", *files("selftest-full")], 1, 330.0,
             processes=ENGINES),
        Step("selftest-plain", [*selftest, "--backend", "cupy", *files("selftest-plain")], 1,
             150.0, env={"CUDNN_ATTN_FUSED_PIPELINED": "0"}),
    ]
    for tool in SANITIZER_TOOLS:
        # The script's own per-tool timeout ends first, so it still writes its summary.
        steps.append(Step(f"sanitize-{tool}", [python, str(bench / "sanitize.py"), "--tools", tool,
                                               "--json", str(work / f"sanitize-{tool}.json"),
                                               "--timeout", "300"], 1, 330.0))
    steps.append(flash_attn_step(work, flash_attn, python))
    # In order of importance, each keeping its share however long the one before it takes.
    for suite, share in (("cudnn", 85.0), ("neighborhood", 65.0)):
        steps.append(Step(f"bench-{suite}", [python, str(bench / f"{suite}.py"), "--quick",
                                             "--results-dir", str(work)], 2, 150.0,
                          share_s=share))
    steps.append(proof_extras.warm_start_step(work, python))  # graph caches warmed ahead
    # With time left: the rest of the bf16 rows (the cuDNN curve's other sequence lengths; issue
    # 34's 2-D k7 and 64x64 k13 problems, then the 1-D and 3-D neighborhoods at D=128), in a
    # folder of their own; gpu_report merges them.
    more = ["--no-ceilings", "--results-dir", str(work / MORE)]
    steps += [
        proof_extras.profile_na_step(work, python),  # the fused kernels' profile first
        *proof_extras.host_steps(work, python),  # then where the host time goes
        Step("bench-cudnn-more", [python, str(bench / "cudnn.py"), "--quick", "--seqs", "512",
                                  "2048", "4096", "16384", "8128", *more], 3, 240.0, optional=True),
        Step("bench-neighborhood-more", [python, str(bench / "neighborhood.py"), "--issue-rows",
                                         "--dims", "1", "3",
                                         "--dtypes", "bf16", "--head-dims", "128", "--repeats", "3",
                                         "--warmup", "2", *more], 3, 240.0, optional=True),
        # Last: issue 35's autotuned plans (every plan cuDNN offers, timed, the fastest kept)
        # against the heuristic's and torch's, at two lengths.
        Step("bench-cudnn-tuned", [python, str(bench / "cudnn.py"), "--quick", "--autotune",
                                   "--seqs", "1024", "8192", "--no-ceilings", "--results-dir",
                                   str(work / TUNED)], 3, 180.0, optional=True),
    ]
    return steps


def phase_reserve(steps: list[Step], phase: int) -> float:
    """The seconds phase ``phase`` leaves to the later phases' steps that must run: each one's
    share, plus the signal ladder of the step cut before it."""
    return sum(s.share_s + LADDER_S for s in steps if s.phase > phase and not s.optional)


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
    """Compile every kernel variant for ``archs`` into ``directory``, one cubin each (no GPU
    needed). Exit status 1 (the cubins written all the same) when a variant spills registers:
    the CPU suite compiles every variant for every arch only under ``CUDNN_ATTN_FULL_SWEEP=1``,
    so this is where each one the device will load is checked."""
    os.environ["CUDNN_ATTN_CUBIN_CACHE"] = str(directory.resolve())
    from cudnn_attn import fallback_kernels
    from cudnn_attn.fallback_kernels import cubin_cache

    version = cubin_cache.nvrtc_version()
    if version != expect_nvrtc:
        print(f"gpu_proof: NVRTC here is {version}, the device's is {expect_nvrtc}: these cubins "
              f"would not be used there. Compile with NVRTC {expect_nvrtc}: a plain venv whose "
              ".pth file names this Python's site-packages, with cupy-cuda13x and "
              "nvidia-cuda-nvrtc==13.0.* installed --no-deps into it (README, 'Running on a "
              "GPU'), or pass --expect-nvrtc.", file=sys.stderr)
        return 2
    before = _cubins(directory)
    spilling = []
    for arch in archs:
        start = time.perf_counter()
        records = fallback_kernels.compile_all(arch, jobs=fallback_kernels.default_jobs())
        print(f"{arch}: {len(records)} kernels in {time.perf_counter() - start:.1f} s")
        spilling += [r for r in records if r.spill_stores or r.spill_loads]
    added = _cubins(directory) - before
    (directory / NVRTC_FILE).write_text(version + "\n")  # the record compares it with the device's
    print(f"{directory}: {len(_cubins(directory))} cubins ({len(added)} new), NVRTC {version}")
    for r in spilling:
        print(f"gpu_proof: {r.kernel} spills on {r.arch} ({r.spill_stores} bytes stored, "
              f"{r.spill_loads} loaded)", file=sys.stderr)
    return 1 if spilling else 0


def device_nvrtc() -> dict[str, Any]:
    """NVRTC's version here (CuPy's), and the version the carried cubins were compiled with."""
    try:
        from cudnn_attn.fallback_kernels import cubin_cache

        return {"version": cubin_cache.nvrtc_version()}
    except Exception as exc:  # noqa: BLE001 - no CuPy, or no loadable NVRTC: say so
        return {"version": None, "error": f"{type(exc).__name__}: {exc}"[:300]}


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def budget_facts(args: argparse.Namespace, begin_wall: float) -> dict[str, Any]:
    """The budget and where it comes from: the seconds before gpu_proof started (measured with
    ``--call-started``, else assumed), the signal ladder, the record's write and a margin."""
    before = (begin_wall - args.call_started if args.call_started is not None else None)
    budget = args.budget
    if budget is None:
        budget = (LIMIT_S - before - LADDER_S - RECORD_S - SAFETY_S if before is not None
                  else DEFAULT_BUDGET_S)
    return {"limit_s": LIMIT_S, "budget_s": round(budget, 1),
            "before_start_s": None if before is None else round(before, 1),
            "assumed_before_start_s": ON_HOST_S if before is None else None,
            "ladder_s": LADDER_S, "record_s": RECORD_S, "safety_s": SAFETY_S}


def run(args: argparse.Namespace) -> int:
    begin_wall, begin = time.time(), time.monotonic()
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu_proof: torch sees no CUDA GPU here; nothing was run (--allow-cpu for a "
              "smoke run of the plumbing).")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_proof_"))
    cache = work / "cubins"
    carried_dir = Path(args.cubins) if args.cubins else None
    carried = seed_cubin_cache(carried_dir, cache)
    env = {**os.environ, "CUDNN_ATTN_CUBIN_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    if args.commit:  # every record (this one, the benchmarks' JSON) names the commit passed in
        os.environ[_report.COMMIT_ENV] = env[_report.COMMIT_ENV] = args.commit
    steps = select(plan(work, workers=args.workers, flash_attn=Path(args.flash_attn).resolve()),
                   args.steps, args.skip)
    budget = budget_facts(args, begin_wall)
    stop_at = begin + budget["budget_s"]
    cubins_for = None
    if carried_dir is not None and (carried_dir / NVRTC_FILE).exists():
        cubins_for = (carried_dir / NVRTC_FILE).read_text().strip()
    extra: dict[str, Any] = {
        "commit": args.commit, "budget_s": budget["budget_s"], "budget": budget,
        # `git describe` on the device reads whatever .git is there (a stale one, on the first
        # H200 run): the commit passed in from the checkout that travelled is the truth.
        **({"git": args.commit} if args.commit else {}),
        "nvrtc": {**device_nvrtc(), "cubins_compiled_with": cubins_for},
        "cores": os.cpu_count(), "cubins": {"carried": carried}}
    results: list[StepResult] = []

    def save(tarball: bool) -> Path:
        extra["cubins"]["compiled_on_device"] = len(_cubins(cache)) - carried
        extra["seconds"] = round(time.monotonic() - begin, 1)
        if args.call_started is not None:  # the margin this run left under the device's limit
            extra["budget"]["margin_s"] = round(LIMIT_S - (time.time() - args.call_started), 1)
        return write_record(out, work, results, extra, tarball=tarball)

    def on_result(result: StepResult) -> None:
        result.summary = summarize(result, work)
        results.append(result)
        save(tarball=False)  # after every step: a kill of this very process loses nothing done

    signal.signal(signal.SIGTERM, _interrupt)
    path = save(tarball=True)
    try:
        for phase, side_by_side in ((1, True), (2, False), (3, False)):
            todo = [s for s in steps if s.phase == phase]
            if not todo:
                continue
            reserve = phase_reserve(steps, phase)
            end = max(stop_at - reserve, time.monotonic() + MIN_START_S)
            print(f"phase {phase}: {', '.join(s.name for s in todo)} "
                  f"({min(end, stop_at) - time.monotonic():.0f} s at most)", flush=True)
            run_steps(todo, work, min(end, stop_at), side_by_side=side_by_side, env=env,
                      cwd=ROOT, on_result=on_result)
            path = save(tarball=True)
    except KeyboardInterrupt as exc:
        extra["interrupted"] = str(exc) or "SIGINT"
        print(f"gpu_proof: interrupted ({extra['interrupted']}); the record keeps what ran",
              flush=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        order = {s.name: i for i, s in enumerate(steps)}
        results.sort(key=lambda r: order.get(r.name, len(order)))
        path = save(tarball=True)
    print("\n".join(f"\n[{r.name}] selftest table\n{r.summary['table']}" for r in results
                    if r.summary.get("table")))
    print(f"\nwrote {path} and {out / proof_record.TARBALL} ({extra['seconds']:.0f} s of a "
          f"{budget['budget_s']:.0f} s budget; cubins carried {carried}, compiled here "
          f"{extra['cubins']['compiled_on_device']}; NVRTC here {extra['nvrtc']['version']})")
    print("\n".join(summary_lines(results)))
    shutil.rmtree(work, ignore_errors=True)  # everything worth keeping is in the tarball
    return 1 if any(r.failed for r in results) or "interrupted" in extra else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder for the summary JSON and the tarball ($OUT)")
    parser.add_argument("--budget", type=float,
                        help="seconds for the steps (default: the device's 600 s limit less the "
                             "seconds before this started (--call-started), the signal ladder, "
                             f"the record and a margin; {DEFAULT_BUDGET_S:g} s without "
                             "--call-started)")
    parser.add_argument("--call-started", type=float, metavar="EPOCH",
                        help="when the device command began (t0=$(date +%%s) before on-host): "
                             "the budget then counts the seconds already spent")
    parser.add_argument("--commit", help="the commit under test (git rev-parse HEAD, from the "
                                         "checkout that travels: .git does not)")
    parser.add_argument("--cubins", help="folder of cubins compiled ahead (--prebuild)")
    parser.add_argument("--steps", help="only these steps (comma-separated names or prefixes)")
    parser.add_argument("--skip", help="not these steps (comma-separated names or prefixes)")
    parser.add_argument("--workers", type=int, default=8, help="pytest-xdist workers")
    parser.add_argument("--flash-attn", default=str(FLASH_ATTN_DIR), metavar="DIR",
                        help="FlashAttention 2.8.3's test file and bert_padding.py, staged with "
                             "tests/peer/run_flash_attn_suite.py CHECKOUT --stage DIR "
                             "(default %(default)s)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (smoke)")
    parser.add_argument("--prebuild", metavar="DIR",
                        help="compile every kernel program into DIR and exit (no GPU needed)")
    parser.add_argument("--arch", action="append", help="--prebuild target (default sm_90)")
    parser.add_argument("--expect-nvrtc", default=DEVICE_NVRTC,
                        help="--prebuild refuses another NVRTC version (default %(default)s)")
    args = parser.parse_args(argv)
    if args.prebuild is None and not args.out:
        parser.error("--out is required (or --prebuild DIR)")
    if args.budget is not None and args.budget <= MIN_START_S:
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
