"""Docs that run (issue 26): every ```python block of README.md and docs/ runs on its own in a
fresh interpreter, on the CPU, without network; a block whose first line is
``# requires: gpu`` or ``# requires: network`` is only compiled. Every figure the benchmark pages
quote is the one in the committed record named next to it; every environment variable the
package reads is in the one table of docs/environment.md."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "CHANGELOG.md",
         *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
SKIP_MARKERS = ("# requires: gpu", "# requires: network")


def python_blocks() -> list[tuple[str, str]]:
    """``(file:line, code)`` of every python block."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = python_blocks()


def test_the_docs_have_python_blocks():
    where = {name.split(":")[0] for name, _ in BLOCKS}
    assert "README.md" in where and len(BLOCKS) >= 8, sorted(where)


@pytest.fixture(scope="module")
def fresh_python():
    """Each block as ``python -c`` in a process of its own (forked from one that imported torch
    only: ``fresh_python``), on the CPU, offline."""
    from fresh_python import FreshPython

    return FreshPython({**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
                        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                        "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("name, code", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_python_block_runs_on_its_own(name, code, tmp_path, fresh_python):
    first = code.lstrip().splitlines()[0].strip() if code.strip() else ""
    compile(code, name, "exec")  # every block is valid Python, skipped ones included
    if first in SKIP_MARKERS:
        return
    log = tmp_path.parent / f"{tmp_path.name}.log"  # the block's folder holds what it writes
    status = fresh_python.run(code, tmp_path, log, env={
        "CUDNN_ATTN_CACHE_DIR": str(tmp_path / "graphs"),
        "CUDNN_ATTN_CACHE_KEY_FILE": str(tmp_path / "graph-cache.key")})
    assert status == 0, f"{name} failed on its own:\n{log.read_text()[-3000:]}"


def test_a_block_runs_in_a_fresh_process_and_its_failure_shows(fresh_python, tmp_path):
    """The runner itself: a new ``__main__`` and working directory per block, the environment
    given, the exit status and the traceback of a failing block."""
    log = tmp_path / "out.log"
    probe = ("import os, sys, torch\n"
             "assert 'cudnn_attn' not in sys.modules and 'pytest' not in sys.modules\n"
             "assert os.getcwd() == os.environ['WANT_CWD'] and sys.argv == ['-c']\n"
             "assert sys.path[0] == '' and os.environ['OMP_NUM_THREADS'] == '1'\n"
             "leftover = globals().get('leftover')\n"
             "assert leftover is None, leftover\n"
             "print('ran'); leftover = 1\n")
    for _ in range(2):  # the second run must not see the first one's globals
        assert fresh_python.run(probe, tmp_path, log, env={"WANT_CWD": str(tmp_path)}) == 0, \
            log.read_text()
        assert log.read_text() == "ran\n"
    assert fresh_python.run("import sys; sys.exit(3)", tmp_path, log) == 3
    assert fresh_python.run("1 / 0", tmp_path, log) == 1
    assert "ZeroDivisionError" in log.read_text()


# --------------------------------------------------------------------------------------------
# figures come from committed records
# --------------------------------------------------------------------------------------------

def record(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / name).read_text())


def test_every_record_a_page_names_is_committed():
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"benchmarks/results/([\w.-]+\.json)", page.read_text()))
    assert named, "the pages name no record"
    missing = sorted(n for n in named if not (ROOT / "benchmarks" / "results" / n).is_file())
    assert not missing


def test_cpu_benchmark_table_is_the_record():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "benchmarks/results/cpu-2026-11-23.json" in page
    data = record("cpu-2026-11-23.json")
    for row in data["neighborhood"]:
        cells = f"| {row['ours_ms']:.1f} ms | {row['sdpa_ms']:.1f} ms | {row['natten_ms']:.0f} ms |"
        assert cells in page, cells
    overhead = {r["call"]: r for r in data["overhead"]}
    assert f"{overhead['attention() auto']['us_per_call']:.1f} us" in page
    assert f"{overhead['SDPA']['us_per_call']:.1f}" in page
    assert f"({overhead['attention() auto']['vs_sdpa']:.2f}x)" in page
    assert overhead["attention() auto"]["target"] == "MISS" and "**missed**" in page


def test_gpu_benchmark_table_is_the_record():
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "benchmarks/results/cudnn-2026-11-26.json" in page
    data = record("cudnn-2026-11-26.json")
    assert data["device"].startswith("NVIDIA H200")
    for r in data["throughput"]:
        cells = (f"| {r['S']} | {'yes' if r['causal'] else 'no'} | {r['dir']} | "
                 f"{r['ours_tflops']:.0f} | {r['bare_tflops']:.0f} | {r['torch-cudnn_tflops']:.0f} | "
                 f"{r['torch-flash_tflops']:.0f} |")
        assert cells in page, cells
    tiny = data["overhead"][1]
    assert f"{tiny['us_per_call']:.1f} us" in page and f"({tiny['vs_bare']:.2f}x)" in page
    assert data["targets"]["tiny call vs bare <= 1.05"] is False and "**missed**" in page


def test_context_parallel_figures_are_the_record():
    page = (ROOT / "docs" / "distributed.md").read_text()
    rows = {(r["ranks"], r["method"]): r for r in record("context_parallel-2026-11-24.json")["rows"]}
    for key, shown in (((2, "halo"), "0.28 MB"), ((4, "halo"), "0.42 MB"),
                       ((2, "ring"), "4.50 MB"), ((4, "ring"), "5.62 MB")):
        assert f"{rows[key]['MB/rank (mean)']:.2f}"[:4] == shown[:4] and shown in page


def test_builder_grid_figures_are_the_record():
    page = (ROOT / "docs" / "varlen.md").read_text()
    counts = record("builder_grid-2026-11-25.json")["counts"]
    assert f"{counts['accepted_by_both']} accepted by both" in page
    assert f"{counts['rejected_by_both']} rejected by both" in page
    assert f"{counts['disagreements']} disagreements" in page


# --------------------------------------------------------------------------------------------
# environment variables: one table
# --------------------------------------------------------------------------------------------

def test_every_environment_variable_is_in_the_table():
    read = set()
    for path in (ROOT / "cudnn_attn").rglob("*.py"):
        text = path.read_text()
        read |= set(re.findall(r"""environ(?:\.get)?[\[(]\s*["'](CUDNN_ATTN_\w+)""", text))
        read |= set(re.findall(r"""user_path\(\s*["'](CUDNN_ATTN_\w+)""", text))
        read |= set(re.findall(r"""_ENV\s*=\s*["'](CUDNN_ATTN_\w+)""", text))
    assert {"CUDNN_ATTN_LOG_LEVEL", "CUDNN_ATTN_CUBIN_CACHE", "CUDNN_ATTN_CACHE_DIR"} <= read
    table = (ROOT / "docs" / "environment.md").read_text()
    rows = set(re.findall(r"^\| `(CUDNN_ATTN_\w+)`", table, re.M))
    assert read <= rows, f"read but not documented: {sorted(read - rows)}"
