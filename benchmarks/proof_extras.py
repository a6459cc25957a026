"""gpu_proof's evidence steps beyond the tests and the benchmarks: their plan entries, what the
record keeps of their files, and their lines in the printed summary.

* ``warm-start`` (phase 2, its own share): ``warm_start.py`` loads the graph caches warmed ahead
  on the CPU for the H100 and the H200 (``.graphs``, carried like ``.cubins``) and times every
  problem's first call against a cold build: plans built on the device (the goal is 0), loaded,
  files rejected (``warm_start-<date>.json``).
* ``profile-na`` (phase 3, with the time left, before the extra benchmark rows): ``profile_na.py``
  records the fused neighborhood kernels' GPU time per kernel (``torch.profiler``) and, where
  the image has Nsight Compute, its headline figures per launch; the ``.ncu-rep`` stays in the
  tarball (``profile_na-<date>.json``, ``profile_na.ncu-rep``, ``profile_na-ncu.csv``).
* ``host-na`` and ``host-profile`` (phase 3, with the time left): where the host time goes on
  the GPU, for the gaps the 2026-11-29 run left unexplained by the kernels: ``na_host.py``
  (a fused neighborhood call's host microseconds, with tensors handed over as addresses and,
  for the ratio, through DLPack; a cProfile table in the log) and ``host_profile.py``
  (torch.profiler's operators per call of the cuDNN backward and of ``flash_attn_varlen_func``
  next to torch's calls) (``na_host-<date>.json``, ``host_profile-<date>.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from proof_steps import Step, StepResult

BENCH = Path(__file__).resolve().parent
GRAPHS = BENCH.parent / ".graphs"  # what `warm_start.py --prepare .graphs` wrote, carried
WARM_START, PROFILE_NA, HOST_NA, HOST_PROFILE = ("warm-start", "profile-na", "host-na",
                                                 "host-profile")
WARM_SHARE_S, WARM_CAP_S, WARM_ROUNDS_S = 40.0, 45.0, 28.0
PROFILE_CAP_S, PROFILE_LIMIT_S = 45.0, 38.0
TOP_KERNELS = 3


def warm_start_step(work: Path, python: str, carried: Path = GRAPHS) -> Step:
    """The warm start, alone on the GPU, with a share of its own (``WARM_SHARE_S``)."""
    return Step(WARM_START, [python, str(BENCH / "warm_start.py"), "--carried", str(carried),
                             "--results-dir", str(work),
                             "--time-limit", f"{WARM_ROUNDS_S:g}"],
                2, WARM_CAP_S, share_s=WARM_SHARE_S)


def profile_na_step(work: Path, python: str) -> Step:
    """The fused neighborhood kernels' profile, with the time left (optional)."""
    return Step(PROFILE_NA, [python, str(BENCH / "profile_na.py"), "--results-dir", str(work),
                             "--time-limit", f"{PROFILE_LIMIT_S:g}"],
                3, PROFILE_CAP_S, optional=True)


def host_steps(work: Path, python: str) -> list[Step]:
    """The host-time evidence (optional, with the time left): the fused neighborhood calls',
    then the cuDNN backward's and the packed FlashAttention call's."""
    return [Step(HOST_NA, [python, str(BENCH / "na_host.py"), "--profile", "--json-to",
                           str(work)], 3, 60.0, optional=True),
            Step(HOST_PROFILE, [python, str(BENCH / "host_profile.py"), "--results-dir",
                                str(work)], 3, 60.0, optional=True)]


def _newest(work: Path, suite: str) -> tuple[Path | None, dict[str, Any] | None]:
    """The newest ``<suite>-<date>.json`` in ``work`` and its content (None when unreadable)."""
    found = sorted(work.glob(f"{suite}-*.json"))
    if not found:
        return None, None
    try:
        return found[-1], json.loads(found[-1].read_text())
    except (OSError, ValueError):
        return found[-1], None


def summarize(name: str, work: Path) -> dict[str, Any] | None:
    """What the record keeps of an evidence step's files ({} when it wrote none); None for a
    step that is not one of these."""
    if name == WARM_START:
        path, data = _newest(work, "warm_start")
        keep = ("target", "cudnn_mismatch", "verdict", "error")
        if path is None or data is None:
            return {}
        return {"file": path.name, **{k: data[k] for k in keep if k in data}}
    if name == PROFILE_NA:
        path, data = _newest(work, "profile_na")
        if path is None or data is None:
            return {}
        kernels = {}
        for problem in data.get("problems", []):
            for direction in ("fwd", "fwd+bwd"):
                entry = problem.get(direction) or {}
                kernels[f"{problem['name']} {direction}"] = (
                    {"error": entry["error"]} if "error" in entry else
                    {"us_per_call": entry.get("all_us_per_call"),
                     "top": [{k: r[k] for k in ("kernel", "calls", "mean_us")}
                             for r in entry.get("kernels", [])[:TOP_KERNELS]]})
        ncu = data.get("ncu") or {}
        return {"file": path.name, "kernels": kernels,
                "ncu": {k: ncu[k] for k in ("skipped", "error", "report", "launches") if k in ncu}}
    return None


def summary_lines(result: StepResult, pad: str) -> list[str]:
    """The evidence steps' figures for the printed summary (none for other steps)."""
    s = result.summary
    if result.name == WARM_START and s:
        lines = [f"{pad} {s['error']}"] if s.get("error") else []
        lines += [f"{pad} target {s.get('target')}; {s['cudnn_mismatch']}"
                  if s.get("cudnn_mismatch") else f"{pad} target {s.get('target')}"]
        for which, v in (s.get("verdict") or {}).items():
            if not v.get("ran"):
                lines.append(f"{pad} {which}: not run ({v.get('why')})")
                continue
            lines.append(f"{pad} {'ok  ' if v['goal_met'] else 'MISS'} {which}: {v['builds']} "
                         f"built, {v['loads']} loaded, {v['rejected_files']} rejected; first calls "
                         f"{v['first_calls_ms']:.1f} ms vs cold {v['cold_calls_ms']:.1f} ms")
        return lines
    if result.name == PROFILE_NA and s:
        lines = []
        for what, entry in s.get("kernels", {}).items():
            if "error" in entry:
                lines.append(f"{pad} {what}: {entry['error'][:120]}")
            elif entry["top"]:
                top = entry["top"][0]
                lines.append(f"{pad} {what}: {entry['us_per_call'] / 1e3:.3f} ms/call, top "
                             f"{top['kernel'][:60]} {top['mean_us'] / 1e3:.3f} ms")
        ncu = s.get("ncu") or {}
        lines.append(f"{pad} ncu: " + (ncu.get("skipped") or ncu.get("error")
                                       or f"{len(ncu.get('launches', []))} launches profiled"))
        return lines
    return []
