"""What the peer-suite runners share: run pytest on an adapted copy, report its counts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# A conftest's text for ``--engine cudnn-standin`` (both runners): the plugin
# ``tests/cudnn_standin.py`` (the cuDNN engine's host logic on this CPU), loaded from here.
STANDIN_CONFTEST = f"""

import sys

sys.path.insert(0, {str(REPO / "tests")!r})
pytest_plugins = ["cudnn_standin"]
"""


def counts(summary: str) -> dict:
    """pytest's final line as ``{"passed": n, "failed": n, ...}``."""
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|"
                                                  r"deselected|xfailed|xpassed)", summary)}


def run_pytest(workdir: Path, tests: list, extra_args: list, json_path, record: dict) -> int:
    """Run ``tests`` in ``workdir`` with ``workdir`` and this repository first on the path; print
    pytest's output, write ``record`` plus the counts to ``json_path`` (if given)."""
    # The caller's path stays behind ours (a GPU host's .pysite holds the cuDNN frontend; the
    # GPU proof's pytest plugins sit there too).
    path = [str(workdir), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
           *map(str, tests), *extra_args]
    # Streamed line by line (a long run shows its progress, and a killed one what it reached).
    run = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, bufsize=1)
    summary = ""
    for line in run.stdout:
        print(line, end="", flush=True)
        if line.strip():
            summary = line.strip()
    returncode = run.wait()
    if json_path:
        Path(json_path).write_text(json.dumps(
            {**record, "counts": counts(summary), "summary": summary,
             "returncode": returncode}, indent=2))
    return returncode
