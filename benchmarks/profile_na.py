"""GPU kernel profile of the fused neighborhood kernels (issue 34's problems, bf16).

Run from the repository root on a CUDA machine:  python benchmarks/profile_na.py
Without CUDA it says so and exits 0, writing nothing.

Each problem (B=1; H, D as issue 34 lists them) runs through ``cudnn_attn.neighborhood.na{n}d``
with ``backend="cupy"`` (the fused kernels), forward and forward + backward, once to warm up and
``--repeats`` times under ``torch.profiler`` (CUDA activity): the JSON records, per problem and
direction, every kernel's calls, total and mean GPU microseconds. Then, when Nsight Compute is
there (``ncu``: on ``PATH`` or in ``/usr/local/cuda/bin``) and time is left, ``ncu`` replays the
first ``--launch-count`` launches of the ``na_fused_*`` kernels of the ``--ncu-problems`` (this
script again, ``--child``) with the sections Speed Of Light, Occupancy, Launch Statistics and
Memory Workload Analysis, keeps the ``.ncu-rep`` beside the JSON and records each launch's
headline figures (``ncu_report``). Whatever fails (a problem, ncu's permissions, its timeout) is
recorded as an error string; the script itself never fails for it.
JSON: <--results-dir>/profile_na-<date>.json (default benchmarks/results/), rewritten after
each problem.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path (tests)
import _report  # noqa: E402  benchmarks/_report.py
import ncu_report  # noqa: E402

NEIGHBORHOOD = _report.load_sibling("neighborhood")  # its problem shapes, not a copy of them
_report.unshadow_cudnn()  # this folder's cudnn.py is not the cuDNN frontend (and off the path)
BACKEND = "cupy"  # the fused kernels
DTYPE = "bf16"
# Module constants so a CPU smoke run can swap them (the torch engine, CPU events).
DEVICE, ACTIVITY = "cuda", "CUDA"


def _problem(name: str, spatial, kernel, heads: int, dim: int) -> dict[str, Any]:
    return {"name": name, "spatial": list(spatial), "kernel": list(kernel), "heads": heads,
            "dim": dim, "batch": 1}


# Issue 34's rows, in order of importance (the ncu child runs the first ones).
PROBLEMS = [
    _problem("2d-128x128-k31", *NEIGHBORHOOD.PROBLEMS[2], heads=8, dim=128),
    _problem("1d-32768-k2048", *NEIGHBORHOOD.PROBLEMS[1], heads=16, dim=128),
    _problem("3d-32-k7", *NEIGHBORHOOD.PROBLEMS[3], heads=16, dim=128),
    _problem("2d-128x128-k7", (128, 128), (7, 7), heads=8, dim=128),
    _problem("2d-64x64-k13-d64", (64, 64), (13, 13), heads=16, dim=64),
]
NCU_PROBLEMS = ("2d-128x128-k31", "1d-32768-k2048")
DIRECTIONS = ("fwd", "fwd+bwd")


def pick(names: Iterable[str] | None) -> list[dict[str, Any]]:
    """The problems named (all when None), in ``PROBLEMS``' order; an unknown name is a
    ValueError listing the known ones."""
    if names is None:
        return list(PROBLEMS)
    names = list(names)
    known = [p["name"] for p in PROBLEMS]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown problems {unknown}; known: {', '.join(known)}")
    return [p for p in PROBLEMS if p["name"] in names]


def kernel_table(events: Iterable[tuple[str, float]]) -> list[dict[str, Any]]:
    """``(kernel name, microseconds)`` pairs summed per name: calls, total and mean, the
    longest total first."""
    totals: dict[str, list[float]] = {}
    for name, micros in events:
        totals.setdefault(name, []).append(float(micros))
    rows = [{"kernel": name, "calls": len(times), "total_us": round(sum(times), 3),
             "mean_us": round(sum(times) / len(times), 3)} for name, times in totals.items()]
    return sorted(rows, key=lambda r: (-r["total_us"], r["kernel"]))


def profiler_events(prof, device_type=None) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of the profile's events that ran on ``device_type`` (default
    CUDA: the kernels), from a finished ``torch.profiler.profile``."""
    import torch

    device_type = torch.autograd.DeviceType.CUDA if device_type is None else device_type
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
            if e.device_type == device_type]


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_call(problem: dict[str, Any], direction: str):
    """A closure running ``problem`` once in ``direction`` on the fused engine."""
    import torch

    from cudnn_attn import neighborhood

    rank = len(problem["spatial"])
    shape = (problem["batch"], *problem["spatial"], problem["heads"], problem["dim"])
    device = DEVICE
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16,
                           requires_grad=direction != "fwd") for _ in range(3))
    na = getattr(neighborhood, f"na{rank}d")
    kernel = tuple(problem["kernel"])
    if direction == "fwd":
        return lambda: na(q, k, v, kernel, backend=BACKEND)
    dout = torch.randn(shape, device=device, dtype=torch.bfloat16)

    def forward_backward():
        out = na(q, k, v, kernel, backend=BACKEND)
        return torch.autograd.grad(out, (q, k, v), dout)
    return forward_backward


def profile_problem(problem: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Per direction: the kernels of ``repeats`` calls (after one warm-up call), or an error."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    result: dict[str, Any] = {**problem, "repeats": repeats}
    for direction in DIRECTIONS:
        try:
            call = make_call(problem, direction)
            call()
            _sync()
            with profile(activities=[getattr(ProfilerActivity, ACTIVITY)]) as prof:
                for _ in range(repeats):
                    call()
                _sync()
            table = kernel_table(profiler_events(prof, getattr(torch.autograd.DeviceType,
                                                               ACTIVITY)))
            fused = sum(r["total_us"] for r in table if ncu_report.KERNEL_REGEX in r["kernel"])
            result[direction] = {"kernels": table,
                                 "fused_us_per_call": round(fused / repeats, 3),
                                 "all_us_per_call": round(sum(r["total_us"] for r in table)
                                                          / repeats, 3)}
        except Exception as exc:  # noqa: BLE001 - a failed problem is a result, not a crash
            result[direction] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    tokens, window = math.prod(problem["spatial"]), math.prod(problem["kernel"])
    result["useful_flop_fwd"] = 4.0 * problem["heads"] * tokens * window * problem["dim"]
    return result


def run_ncu(ncu: str, out_dir: Path, problems: list[str], launch_count: int,
            timeout_s: float) -> dict[str, Any]:
    """Profile the ``na_fused`` launches of ``problems`` (this script as ``--child``) and read
    the report back as CSV; ``{"report", "launches"}`` or ``{"error"}`` (with what ncu said)."""
    report = out_dir / "profile_na.ncu-rep"
    report.unlink(missing_ok=True)  # an earlier run's report is not this one's
    child = [sys.executable, str(Path(__file__).resolve()), "--child", "--problems", *problems]
    command = ncu_report.profile_command(ncu, report, child, launch_count=launch_count)
    found: dict[str, Any] = {"ncu": ncu, "command": command, "timeout_s": round(timeout_s, 1)}
    start = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:]
        return {**found, "error": f"ncu took more than {timeout_s:.0f} s",
                "output_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    found["seconds"] = round(time.monotonic() - start, 1)
    found["output_tail"] = (done.stdout + done.stderr)[-2000:]
    (out_dir / "profile_na-ncu.log").write_text(done.stdout + done.stderr)
    if not report.exists():
        return {**found, "error": f"ncu wrote no report (exit {done.returncode}); see "
                                  f"output_tail (ERR_NVGPUCTRPERM: no access to the counters)"}
    found["report"] = report.name
    imported = subprocess.run(ncu_report.import_command(ncu, report), capture_output=True,
                              text=True, timeout=60)
    (out_dir / "profile_na-ncu.csv").write_text(imported.stdout)
    try:
        found["launches"] = [{k: launch[k] for k in ("id", "kernel", "headline")}
                             for launch in ncu_report.parse_csv(imported.stdout)]
    except ValueError as exc:
        found["error"] = f"{exc}; import exit {imported.returncode}: {imported.stderr[-300:]}"
    return found


def child(problems: list[dict[str, Any]]) -> int:
    """Under ncu: each problem forward + backward once (the launches ncu replays)."""
    for problem in problems:
        make_call(problem, "fwd+bwd")()
        _sync()
    return 0


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()  # --time-limit counts the imports too
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", help="problem names (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="profiled calls per direction")
    parser.add_argument("--results-dir", type=Path, default=_report.RESULTS_DIR,
                        help="where the JSON and the ncu report go (default benchmarks/results)")
    parser.add_argument("--time-limit", type=float, default=40.0,
                        help="seconds for the whole run: ncu gets what the profiler left")
    parser.add_argument("--ncu-problems", nargs="+", default=list(NCU_PROBLEMS),
                        help="the problems ncu replays (default: %(default)s)")
    parser.add_argument("--launch-count", type=int, default=8,
                        help="na_fused launches ncu profiles (default %(default)s)")
    parser.add_argument("--no-ncu", action="store_true", help="torch.profiler only")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        problems, ncu_problems = pick(args.problems), pick(args.ncu_problems)
    except ValueError as exc:
        parser.error(str(exc))
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/profile_na.py needs a CUDA GPU; torch sees none here. "
              "Nothing was run or written.")
        return 0
    if args.child:
        return child(problems)
    record: dict[str, Any] = {"device": torch.cuda.get_device_name(), "backend": BACKEND,
                              "dtype": DTYPE, "options": vars(args), "problems": []}

    def save() -> Path:
        return _report.write_json("profile_na", record, results_dir=args.results_dir)

    for problem in problems:
        record["problems"].append(profile_problem(problem, args.repeats))
        save()
        for direction in DIRECTIONS:
            entry = record["problems"][-1][direction]
            top = entry.get("kernels", [{}])[0]
            print(f"{problem['name']:>18} {direction:<8} "
                  + (entry["error"] if "error" in entry else
                     f"{entry['all_us_per_call'] / 1e3:.3f} ms/call; top {top.get('kernel')} "
                     f"{top.get('mean_us', 0) / 1e3:.3f} ms x {top.get('calls')}"), flush=True)
    ncu = ncu_report.find_ncu()
    left = args.time_limit - (time.monotonic() - start)
    if args.no_ncu:
        record["ncu"] = {"skipped": "--no-ncu"}
    elif ncu is None:
        record["ncu"] = {"skipped": "no ncu on PATH nor in " + ", ".join(ncu_report.NCU_PATHS)}
    elif left < 10:
        record["ncu"] = {"skipped": f"{left:.0f} s left of --time-limit {args.time_limit:g}"}
    else:
        record["ncu"] = run_ncu(ncu, args.results_dir, [p["name"] for p in ncu_problems],
                                args.launch_count, left - 3)
    ncu_state = record["ncu"]
    print("ncu: " + (ncu_state.get("skipped") or ncu_state.get("error")
                     or f"ok, {len(ncu_state.get('launches', []))} launches"))
    print(f"wrote {save()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
