"""Shared benchmark helpers: timing, a printed table, and a JSON record under benchmarks/results/.

Result files are named ``<suite>-<YYYY-MM-DD>.json`` (UTC date): one file per suite per day, a rerun on
the same day replaces it, older days stay as history. Each holds the environment (cudnn_attn.core.env),
the command line, the date, the options and every figure the run printed.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import timeit
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def unshadow_cudnn() -> None:
    """Take this folder off the import path. Running ``python benchmarks/<script>.py`` puts it
    first, and its ``cudnn.py`` (a benchmark) would then be what ``import cudnn`` finds, in the
    scripts and inside cudnn_attn, instead of the cuDNN frontend package."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    module = sys.modules.get("cudnn")
    if module is not None and Path(getattr(module, "__file__", "") or ".").resolve().parent == here:
        del sys.modules["cudnn"]


def time_ms(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 5,
    number: int = 1,
    sync: Callable[[], Any] | None = None,
) -> float:
    """Median milliseconds per call of ``fn``.

    ``warmup`` untimed calls first; then ``repeats`` batches of ``number`` calls each, and the median
    batch time divided by ``number``. ``sync`` (e.g. ``torch.cuda.synchronize``) ends every batch.
    """

    def batch() -> None:
        for _ in range(number):
            fn()
        if sync is not None:
            sync()

    for _ in range(warmup):
        fn()
    if sync is not None:
        sync()
    return 1e3 * statistics.median(timeit.repeat(batch, number=1, repeat=repeats)) / number


def format_cell(value: Any) -> str:
    """A table cell: None as "-", floats with 2 decimals (3 significant digits below 0.01)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 else f"{value:.2f}"
    return str(value)


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    """Print ``rows`` (dicts) as an aligned text table with the given ``columns`` (missing: "-")."""
    cells = [[format_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max([len(col), *(len(r[i]) for r in cells)]) for i, col in enumerate(columns)]
    line = "  ".join(f"{col:>{w}}" if i else f"{col:<{w}}" for i, (col, w) in enumerate(zip(columns, widths)))
    print(line)
    print("-" * len(line))
    for r in cells:
        print("  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(r, widths))))


def load_sibling(name: str) -> ModuleType:
    """Import the benchmark script ``benchmarks/<name>.py`` as module ``bench_<name>`` (once).

    By path and under another name: ``cudnn.py`` imported as ``cudnn`` would shadow the frontend.
    """
    module_name = f"bench_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, Path(__file__).parent / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


# The commit under test, passed in by whoever launched the run (gpu_proof.py --commit): a
# checkout copied to a device may carry a stale .git (issue 23: "78783be-dirty" for 7cfa5f7).
COMMIT_ENV = "CUDNN_ATTN_COMMIT"


def _git_describe() -> str | None:
    """The commit under test: ``$CUDNN_ATTN_COMMIT`` when set (never a device-side describe),
    else ``git describe --always --dirty`` of the checkout, or None outside a repository."""
    given = os.environ.get(COMMIT_ENV, "").strip()
    if given:
        return given
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=RESULTS_DIR.parent,
                              capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def write_json(suite: str, payload: dict[str, Any], results_dir: Path = RESULTS_DIR) -> Path:
    """Write ``payload`` plus env, command line and date to ``results_dir/<suite>-<date>.json``
    (through a temporary file and a rename)."""
    from cudnn_attn.core import env as _env

    env = _env.collect()
    record = {
        "suite": suite,
        "date": env["date"],
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "git": _git_describe(),
        "env": env,
        **payload,
    }
    day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{suite}-{day}.json"
    # Whole or not at all: a kill mid-write leaves the previous file, not half of this one.
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(record, indent=2, default=str) + "\n")
    os.replace(partial, path)
    return path
