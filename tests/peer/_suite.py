"""What the peer-suite runners share: run pytest on an adapted copy, report its counts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


# A conftest's text for ``--engine cudnn-standin`` (both runners): the cuDNN engine's host logic
# on this CPU. tests/cudnn_fake.py computes, in float64, each graph the engine hands cuDNN (its
# serialized form: masks, score_mod programs, padding, ragged offsets, page tables, the two-row
# decode graph); CPU tensors count as device tensors, so the native varlen and KV-cache routes
# run; dropout stays on the other engines (the stand-in draws no Philox stream, and the peers'
# tests check the pattern a call returns). The summary counts the tests that ran cuDNN graphs and
# the commonest reasons cuDNN declined a problem (counted each time a problem is checked).
STANDIN_CONFTEST = f"""

import collections
import re
import sys

import pytest
import torch

sys.path.insert(0, {str(REPO / "tests")!r})
import cudnn_fake  # noqa: E402
from cudnn_attn.core import dispatch  # noqa: E402
from cudnn_attn.model import masks  # noqa: E402
from cudnn_attn.packed import calls  # noqa: E402

SERVED = {{"cudnn": 0, "other": 0}}
DECLINED = collections.Counter()  # cuDNN's reasons, numbers blanked, over every call


def _supports(engine, problem):
    reasons = engine.graph_reasons(problem)
    if problem.dropout_p > 0:
        reasons = reasons + ["the stand-in draws no Philox stream"]
    DECLINED.update({{re.sub(r"[0-9]+", "N", r.splitlines()[0])[:110] for r in reasons}})
    return reasons


@pytest.fixture(autouse=True)
def _cudnn_standin(monkeypatch):
    monkeypatch.setattr(masks, "_runtime_lengths", lambda value: isinstance(value, torch.Tensor))
    monkeypatch.setattr(calls, "on_accelerator", lambda t: isinstance(t, torch.Tensor))
    _, built = cudnn_fake.install(monkeypatch)
    engine = dispatch.get_backend("cudnn")
    monkeypatch.setattr(engine, "supports", lambda problem: _supports(engine, problem))
    yield
    SERVED["cudnn" if built else "other"] += 1


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"cuDNN stand-in: {{SERVED['cudnn']}} tests ran cuDNN graphs, "
                                f"{{SERVED['other']}} other engines only")
    for reason, n in DECLINED.most_common(10):
        terminalreporter.write_line(f"  cuDNN declined {{n}} problems: {{reason}}")
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
