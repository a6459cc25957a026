"""The warm start a server relies on, proven on the GPU: graph caches written ahead on a CPU
machine (``cudnn-attn cache warm --target h100`` / ``h200``), loaded on the device.

Here, before the device call (no GPU needed; ``--prepare`` runs the CLI once per target):

    python benchmarks/warm_start.py --prepare .graphs

writes ``.graphs/h100/`` and ``.graphs/h200/`` (the graph files of ``warm_problems.json``, each
``cache warm``'s log beside them), ``.graphs/problems.json`` (the config), the throwaway key
that signs them (``graph-cache.key``: copying a cache to another machine needs its key, see
docs/serving.md) and ``manifest.json`` (the cuDNN versions they were planned with, the files per
target). The device call carries ``.graphs`` like ``.cubins``.

On the device (``gpu_proof``'s ``warm-start`` step):

    python benchmarks/warm_start.py --carried .graphs --results-dir OUT

copies the carried files and key into private folders of its own (the cache's trust model wants
them owned by this user, mode 0600/0700), picks the target whose GPU name, compute capability
and SM count are this GPU's, and times the first call of every problem (forward, and backward
for ``"backward": true``) in rounds, each after ``cudnn_attn.clear_caches()``:

  cold-first  plans built on the device (also pays loading cuDNN's kernels: reported, not
              compared); the graphs are then saved to a folder of this device (``saved``)
  carried     the carried target's files loaded first: the goal is 0 plans built
  saved       the files this device saved in cold-first loaded first (the same load path with
              files whose environment matches by construction)
  cold        built again, kernels loaded: the cold figure the warm ones are compared with

The JSON gives, per round, plans built / loaded / files accepted and rejected
(``graph_cache.info()``) and per problem the first call's milliseconds:
<--results-dir>/warm_start-<date>.json (default benchmarks/results/). Without CUDA it says so,
exits 0 and writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path (tests)
import _report  # noqa: E402  benchmarks/_report.py

_report.unshadow_cudnn()  # this folder's cudnn.py is not the cuDNN frontend (and off the path)
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package is the repository's
    sys.path.insert(0, str(ROOT))
CONFIG = Path(__file__).resolve().parent / "warm_problems.json"
TARGETS = ("h100", "h200")
MANIFEST, KEY, PROBLEMS = "manifest.json", "graph-cache.key", "problems.json"
DEVICE_CUDNN = 91900  # the H100/H200 image's cuDNN backend (../shared/gpu.md)
ROUNDS = ("cold-first", "carried", "saved", "cold")
MATCH_KEYS = ("gpu_name", "compute_capability", "sm_count")
DEVICE, BACKEND = "cuda", "cudnn"  # module constants so a CPU smoke run can swap them


# ---------------------------------------------------------------------------------------------
# Here: the caches warmed ahead
# ---------------------------------------------------------------------------------------------

def prepare(folder: Path, config: Path = CONFIG, targets: tuple[str, ...] = TARGETS,
            python: str = sys.executable) -> dict[str, Any]:
    """Warm ``config`` for every target into ``folder`` (emptied first) with ``cudnn-attn cache
    warm --target``, signed with a key of the folder's own; the manifest written there."""
    from cudnn_attn.graphs.cache_files import cudnn_versions
    from cudnn_attn.graphs.targets import target

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(mode=0o700, parents=True)
    shutil.copyfile(config, folder / PROBLEMS)
    env = {**os.environ, "CUDNN_ATTN_CACHE_KEY_FILE": str(folder.resolve() / KEY)}
    backend, frontend = cudnn_versions()
    manifest: dict[str, Any] = {"cudnn_backend": backend, "cudnn_frontend": frontend,
                                "config": PROBLEMS, "targets": {}}
    for name in targets:
        save = folder / name
        done = subprocess.run([python, "-m", "cudnn_attn", "cache", "warm", str(folder / PROBLEMS),
                               "--target", name, "--save", str(save)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        (folder / f"{name}.log").write_text(done.stdout + done.stderr)
        files = sorted(p.name for p in save.glob("*")) if save.is_dir() else []
        manifest["targets"][name] = {"exit": done.returncode, "files": len(files),
                                     "environment": target(name).environment()}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# ---------------------------------------------------------------------------------------------
# On the device: the rounds
# ---------------------------------------------------------------------------------------------

def private_copy(source: Path, destination: Path, names: tuple[str, ...] | None = None) -> Path:
    """``source``'s regular files (those ``names`` only, when given) copied into
    ``destination`` (created 0700), each 0600 and owned by this user, as the cache's trust
    model wants, whoever owns the carried ones."""
    destination.mkdir(mode=0o700, parents=True, exist_ok=True)
    for item in sorted(source.iterdir()):
        if names is not None and item.name not in names:
            continue
        if item.is_file() and not item.is_symlink():
            target = destination / item.name
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as fh:
                fh.write(item.read_bytes())
    return destination


def matching_target(manifest: dict[str, Any], environment: dict[str, Any]) -> str | None:
    """The manifest's target whose GPU (name, compute capability, SM count) is ``environment``'s."""
    for name, entry in manifest.get("targets", {}).items():
        planned = entry.get("environment") or {}
        if all(planned.get(k) == environment.get(k) for k in MATCH_KEYS):
            return name
    return None


def _counts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("builds", "loads", "hits", "rejected_files")}


def run_round(name: str, calls: dict[str, Callable[[], Any]], *, cache, clear: Callable[[], Any],
              load_from: Path | None = None, sync: Callable[[], Any] = lambda: None,
              clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """One round: ``clear()``, then (``load_from``) ``cache.load`` of those files, then every
    call once, timed to its ``sync()``; the cache's counters per call and for the round."""
    clear()
    start = cache.info()
    result: dict[str, Any] = {"round": name, "problems": {}}
    if load_from is not None:
        t0 = clock()
        result["files_accepted"] = cache.load(load_from)
        result["load_ms"] = round(1e3 * (clock() - t0), 3)
    for problem, call in calls.items():
        before = cache.info()
        t0 = clock()
        try:
            call()
            sync()
        except Exception as exc:  # noqa: BLE001 - a failed call is a result, not a crash
            result["problems"][problem] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        result["problems"][problem] = {"first_call_ms": round(1e3 * (clock() - t0), 3),
                                       **_counts(before, cache.info())}
    result.update(_counts(start, cache.info()))
    return result


def run_rounds(calls: dict[str, Callable[[], Any]], work: Path, carried: Path | None, *,
               cache, clear: Callable[[], Any], sync: Callable[[], Any] = lambda: None,
               deadline: float = math.inf, clock: Callable[[], float] = time.perf_counter
               ) -> dict[str, Any]:
    """Every round of ``ROUNDS`` that ``deadline`` (a ``time.monotonic()`` instant) leaves time
    for; ``carried``: the carried target's files (None: that round says why it did not run).
    The rounds and the verdict: plans built with the carried files, and first-call speedups."""
    saved = work / "saved-on-device"
    rounds: dict[str, Any] = {}
    for name in ROUNDS:
        if time.monotonic() >= deadline:
            rounds[name] = {"round": name, "skipped": "no time left"}
            continue
        if name == "carried" and carried is None:
            rounds[name] = {"round": name, "skipped": "no carried files for this GPU"}
            continue
        source = carried if name == "carried" else saved if name == "saved" else None
        rounds[name] = run_round(name, calls, cache=cache, clear=clear, load_from=source,
                                 sync=sync, clock=clock)
        if name == "cold-first":
            try:
                rounds[name]["files_saved"] = cache.save(saved)
            except Exception as exc:  # noqa: BLE001 - the saved round then loads nothing
                rounds[name]["save_error"] = f"{type(exc).__name__}: {exc}"[:300]
        got = rounds[name]
        firsts = [f"{p} {r['first_call_ms']:.1f} ms" if "first_call_ms" in r
                  else f"{p} {r['error']}" for p, r in got["problems"].items()]
        print(f"{name}: {got['builds']} built, {got['loads']} loaded, {got['rejected_files']} "
              f"rejected; first calls {', '.join(firsts)}", flush=True)
    return {"rounds": rounds, "verdict": verdict(rounds)}


def verdict(rounds: dict[str, Any]) -> dict[str, Any]:
    """Per warm round: plans built (goal 0), loaded, and the first call's total milliseconds
    against the cold round's (``speedup``: cold / warm, over the problems both ran)."""
    cold = rounds.get("cold", {}).get("problems") or rounds.get("cold-first", {}).get("problems")
    out: dict[str, Any] = {}
    for name in ("carried", "saved"):
        entry = rounds.get(name, {})
        if "problems" not in entry:
            out[name] = {"ran": False, "why": entry.get("skipped", "not run")}
            continue
        both = [p for p, r in entry["problems"].items()
                if "first_call_ms" in r and "first_call_ms" in (cold or {}).get(p, {})]
        warm_ms = sum(entry["problems"][p]["first_call_ms"] for p in both)
        cold_ms = sum(cold[p]["first_call_ms"] for p in both) if cold else 0.0
        out[name] = {"ran": True, "builds": entry["builds"], "loads": entry["loads"],
                     "files_accepted": entry.get("files_accepted"),
                     "rejected_files": entry["rejected_files"],
                     "goal_met": entry["builds"] == 0 and entry["loads"] > 0,
                     "first_calls_ms": round(warm_ms, 3), "cold_calls_ms": round(cold_ms, 3),
                     "speedup": round(cold_ms / warm_ms, 2) if warm_ms > 0 else None}
    return out


def make_call(spec: dict[str, Any]) -> Callable[[], Any]:
    """One problem of the config as a server makes it (cuDNN engine, random inputs): forward,
    and the gradients too when it is a training problem."""
    import torch

    import cudnn_attn as ca
    from cudnn_attn.cli.specs import build_inputs

    q, k, v, kwargs = build_inputs(spec, DEVICE)
    q, k, v = (torch.randn_like(t).requires_grad_(t.requires_grad) for t in (q, k, v))
    if not q.requires_grad:
        return lambda: ca.attention(q, k, v, **kwargs, backend=BACKEND)

    def train():
        out = ca.attention(q, k, v, **kwargs, backend=BACKEND)
        return torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    return train


def carried_setup(carried: Path, work: Path, environment: dict[str, Any]
                  ) -> tuple[dict[str, Any], Path | None, list[dict[str, Any]]]:
    """Read what was carried for this GPU (``environment``: ``current_environment()``):
    ``(record, graph folder or None, problem specs)``. The key and the matching target's files
    are copied into private folders under ``work`` and ``$CUDNN_ATTN_CACHE_KEY_FILE`` names the
    key's copy; ``record["error"]`` when nothing usable was carried."""
    from cudnn_attn.cli.cache import read_config

    record: dict[str, Any] = {"environment": environment, "carried": str(carried)}
    if not (carried / MANIFEST).is_file():
        record["error"] = (f"no {MANIFEST} in {carried}: prepare the caches before the call "
                           f"(python benchmarks/warm_start.py --prepare {carried}) and carry it")
        return record, None, []
    manifest = json.loads((carried / MANIFEST).read_text())
    record["manifest"] = manifest
    if manifest.get("cudnn_backend") != environment.get("cudnn_backend"):
        record["cudnn_mismatch"] = (f"the files were planned with cuDNN "
                                    f"{manifest.get('cudnn_backend')}, this device has "
                                    f"{environment.get('cudnn_backend')}: they are rejected")
    name = matching_target(manifest, environment)
    record["target"] = name
    # The key first: the cache reads it (once per path) at its first load or save.
    key = private_copy(carried, work / "carried-key", (KEY,)) / KEY
    os.environ["CUDNN_ATTN_CACHE_KEY_FILE"] = str(key)
    files = private_copy(carried / name, work / f"carried-{name}") if name else None
    return record, files, read_config(str(carried / manifest.get("config", PROBLEMS)))


def on_device(carried: Path, work: Path, time_limit: float) -> dict[str, Any]:
    """The record of the device run (the GPU's environment, the carried manifest, the rounds)."""
    import torch

    import cudnn_attn as ca
    from cudnn_attn.graphs.cache import graph_cache
    from cudnn_attn.graphs.cache_files import current_environment

    deadline = time.monotonic() + time_limit
    record, files, specs = carried_setup(carried, work, current_environment())
    if "error" in record:
        return record
    calls = {spec.get("name") or f"problem {i}": make_call(spec) for i, spec in enumerate(specs)}
    # One call of another shape first: CUDA context, cuBLAS/cuDNN handles, not in any round.
    small = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    ca.attention(small, small, small, backend="cudnn")
    torch.cuda.synchronize()
    record.update(run_rounds(calls, work, files, cache=graph_cache, clear=ca.clear_caches,
                             sync=torch.cuda.synchronize, deadline=deadline))
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", type=Path, metavar="DIR",
                        help="warm the config for every target into DIR (no GPU needed) and exit")
    parser.add_argument("--config", type=Path, default=CONFIG, help="problems (--prepare)")
    parser.add_argument("--carried", type=Path, default=ROOT / ".graphs",
                        help="the folder --prepare wrote (default .graphs)")
    parser.add_argument("--results-dir", type=Path, default=_report.RESULTS_DIR,
                        help="where the JSON goes (default benchmarks/results)")
    parser.add_argument("--time-limit", type=float, default=35.0,
                        help="seconds for the rounds; the later ones are skipped past it")
    args = parser.parse_args(argv)
    if args.prepare is not None:
        manifest = prepare(args.prepare, args.config)
        for name, entry in manifest["targets"].items():
            print(f"{name}: {entry['files']} graph file(s), cache warm exit {entry['exit']} "
                  f"(log: {args.prepare / (name + '.log')})")
        if manifest["cudnn_backend"] != DEVICE_CUDNN:
            print(f"note: planned with cuDNN {manifest['cudnn_backend']}; the device image has "
                  f"{DEVICE_CUDNN}, whose load rejects these files (the record says so), and "
                  f"which cannot plan them itself (graphs.limits: deviceless_min_version)")
        return 0 if all(e["exit"] == 0 and e["files"] for e in manifest["targets"].values()) else 1
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/warm_start.py needs a CUDA GPU to load the caches; torch sees none "
              "here. Nothing was run or written (--prepare DIR warms them without one).")
        return 0
    work = Path(tempfile.mkdtemp(prefix="warm_start_"))
    try:
        record = on_device(args.carried, work, args.time_limit)
    except Exception as exc:  # noqa: BLE001 - the record says what failed; the proof goes on
        record = {"carried": str(args.carried), "error": f"{type(exc).__name__}: {exc}"[:500]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {_report.write_json('warm_start', record, results_dir=args.results_dir)}")
    print(json.dumps({"target": record.get("target"), "verdict": record.get("verdict"),
                      "error": record.get("error"), "cudnn_mismatch": record.get("cudnn_mismatch")},
                     indent=2))
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())
