"""What the command line prints and returns (issue 26): ``--json`` on every reporting
subcommand, quiet broken pipes, status 1 when a command did nothing it was asked, both caches
in ``cache``, per-kernel progress, a compact ``explain``, the selftest legend, versions as
people write them; the logging variable; no CuPy import on a machine without CUDA."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def private_caches(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE",
                       str(tmp_path_factory.mktemp("config") / "graph-cache.key"))
    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", str(tmp_path_factory.mktemp("graphs")))
    monkeypatch.setenv("CUDNN_ATTN_CUBIN_CACHE", str(tmp_path_factory.mktemp("cubins")))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> tuple[int, object]:
    code, out, _ = run(capsys, *argv, "--json")
    return code, json.loads(out)  # stdout is exactly one JSON document


# --------------------------------------------------------------------------------------------
# --json
# --------------------------------------------------------------------------------------------

def test_info_json_has_the_environment_and_every_backend(capsys):
    code, data = run_json(capsys, "info")
    assert code == 0 and data["environment"]["torch"] == torch.__version__
    from cudnn_attn.core.dispatch import BACKENDS

    assert list(data["backends"]) == [b.name for b in BACKENDS]
    for backend in BACKENDS:  # the same verdicts the backends give
        reasons = backend.availability()
        assert data["backends"][backend.name] == {"available": not reasons, "reasons": reasons}


def test_explain_json_matches_the_python_api(capsys):
    code, data = run_json(capsys, "explain", "--shape", "1,2,64,32", "--mask", "causal",
                          "--dtype", "fp32")
    q = torch.empty(1, 2, 64, 32)
    expected = ca.explain(q, q, q, mask=ca.Causal())
    assert code == 0 and data["selected"] == expected.selected
    assert data["verdicts"] == {name: (v if isinstance(v, str) else list(v))
                                for name, v in expected.items()}
    assert data["graph"]["status"] in ("validated", "unavailable", "not supported")


def test_demo_json_rows_are_checked_against_float64(capsys):
    code, data = run_json(capsys, "demo", "--repeats", "1", "--dtype", "float64")
    assert code == 0 and data["ok"] and data["dtype"] == "float64"
    assert len(data["problems"]) == 3
    assert all(row["ok"] and row["max_abs_err"] <= data["tolerance"] for row in data["problems"])


def test_cache_info_and_clear_json_cover_both_caches(capsys, tmp_path):
    graphs, cubins = tmp_path / "graphs", tmp_path / "cubins"
    graphs.mkdir()
    cubins.mkdir()
    for i in range(3):
        (cubins / f"{i:064x}.cubin").write_bytes(b"x" * 100)
    (cubins / "notes.txt").write_text("not an entry")
    code, data = run_json(capsys, "cache", "info", "--dir", str(graphs), "--cubin-dir", str(cubins))
    assert code == 0
    assert data["cubins"] == {"dir": str(cubins), "status": "", "files": 3, "bytes": 300}
    assert data["graphs"]["dir"] == str(graphs) and data["graphs"]["files"] == 0
    code, out, _ = run(capsys, "cache", "info", "--dir", str(graphs), "--cubin-dir", str(cubins))
    assert f"cubin dir: {cubins}" in out and "files: 3 (300 bytes)" in out
    code, data = run_json(capsys, "cache", "clear", "--dir", str(graphs), "--cubin-dir", str(cubins))
    assert code == 0 and data["cubins"]["removed"] == 3 and data["graphs"]["removed"] == 0
    assert [p.name for p in cubins.iterdir()] == ["notes.txt"]


def test_cache_clear_one_cache_only(capsys, tmp_path):
    cubins = tmp_path / "cubins"
    cubins.mkdir()
    (cubins / f"{0:064x}.cubin").write_bytes(b"x")
    code, out, _ = run(capsys, "cache", "clear", "--graphs", "--cubin-dir", str(cubins))
    assert code == 0 and "graph file(s)" in out and "cubin" not in out
    assert len(list(cubins.iterdir())) == 1
    code, out, _ = run(capsys, "cache", "clear", "--cubins", "--cubin-dir", str(cubins))
    assert code == 0 and "removed 1 cubin file(s)" in out and "graph" not in out


@pytest.mark.parametrize("action", ["info", "clear"])
@pytest.mark.parametrize("option", ["--dir", "--cubin-dir"])
def test_cache_refuses_what_is_not_a_directory(capsys, tmp_path, action, option):
    victim = tmp_path / "passwd"
    victim.write_text("root:x:0:0")
    code, out, err = run(capsys, "cache", action, option, str(victim))
    assert code == 2 and err.strip() == f"cudnn-attn cache {action}: error: {option} {victim}: " \
                                        f"not a directory"
    assert victim.read_text() == "root:x:0:0"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: nothing can be built")
def test_cache_warm_that_builds_nothing_exits_1(capsys, tmp_path):
    config = tmp_path / "warm.json"
    config.write_text(json.dumps([{"shape": [1, 2, 128, 64], "mask": "causal"}]))
    code, out, err = run(capsys, "cache", "warm", str(config))
    assert code == 1 and "cannot build on cudnn" in out and "1 of 1 problem(s) built nothing" in err
    from cudnn_attn import graph_cache

    builds_before = graph_cache.info()["builds"]  # process-wide: earlier tests may have built
    code, out, err = run(capsys, "cache", "warm", str(config), "--json")
    data = json.loads(out)
    assert code == 1 and data["problems"][0]["status"].startswith("cannot build")
    assert data["graph_cache"]["builds"] == builds_before


# --------------------------------------------------------------------------------------------
# pipes, mistakes
# --------------------------------------------------------------------------------------------

class ClosedPipe(io.StringIO):
    """A stdout whose reader has gone (``| head -1``) after the first line."""

    def write(self, text: str) -> int:
        if self.getvalue().count("\n") >= 1:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)

    def fileno(self) -> int:
        raise io.UnsupportedOperation("no descriptor")


def test_a_closed_pipe_ends_quietly(capsys, monkeypatch):
    stdout = ClosedPipe()
    monkeypatch.setattr(sys, "stdout", stdout)
    code = cli.main(["explain", "--shape", "1,2,64,32", "--mask", "causal"])
    err = capsys.readouterr().err
    assert code == 0 and err == "" and stdout.getvalue().startswith("q=[B=1")


def test_a_closed_pipe_in_a_real_process_is_quiet():
    """``cudnn-attn info --json | head -c 1``: no 'Broken pipe', status 0."""
    proc = subprocess.Popen([sys.executable, "-m", "cudnn_attn", "explain", "--shape",
                             "1,2,64,32", "--mask", "causal", "--graph"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(1)
    proc.stdout.close()  # the reader leaves before the command has printed everything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and "Broken pipe" not in err and "Traceback" not in err


@pytest.mark.parametrize("mask, match", [
    ("window:128", "a window needs its left and right bounds"),
    ("window:1,2,3,4", "a window needs its left and right bounds"),
    ("window:a,b", "integers"),
    ("neighborhood:32x32", "a neighborhood needs its grid and kernel"),
])
def test_mask_mistakes_are_one_line(capsys, mask, match):
    code, out, err = run(capsys, "explain", "--shape", "1,2,64,32", "--mask", mask)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and match in lines[0] and "unpack" not in err


# --------------------------------------------------------------------------------------------
# kernels, explain, selftest, versions
# --------------------------------------------------------------------------------------------

def test_kernels_progress_is_one_line_per_kernel(capsys, monkeypatch):
    pytest.importorskip("cupy", reason="kernels needs CuPy and NVRTC ([test] extra)")
    from cudnn_attn import fallback_kernels
    from cudnn_attn.fallback_kernels import CompileRecord, KernelBuild

    fake = {"fused": ["a", "b", "c"], "unfused": ["d", "e"]}
    origins = {"b": "disk", "e": "memory"}
    calls = []

    def compile_all(arch, progress=None, jobs=None):
        calls.append((arch, jobs))
        records = []
        for name, kernels in fake.items():
            for kernel in kernels:
                records.append(CompileRecord(kernel=f"{name}.{kernel}", arch=arch, registers=32,
                                             spill_stores=0, spill_loads=0, stack_bytes=0,
                                             expression=kernel))
                progress(len(records), 5, KernelBuild(records[-1], 1.25 * len(records),
                                                      origins.get(kernel, "compiled")))
        return records

    monkeypatch.setattr(fallback_kernels, "kernel_programs", lambda arch: fake)
    monkeypatch.setattr(fallback_kernels, "compile_all", compile_all)
    code, out, err = run(capsys, "kernels", "--arch", "sm_80", "--arch", "sm_90", "--jobs", "3")
    assert code == 0 and calls == [("sm_80", 3), ("sm_90", 3)]
    lines = [line for line in err.splitlines() if line.startswith("kernels [")]
    assert lines[:3] == ["kernels [1/10] sm_80 fused.a 1.2 s",
                         "kernels [2/10] sm_80 fused.b 2.5 s (disk)",
                         "kernels [3/10] sm_80 fused.c 3.8 s"]
    assert lines[5:] == ["kernels [6/10] sm_90 fused.a 1.2 s",
                         "kernels [7/10] sm_90 fused.b 2.5 s (disk)",
                         "kernels [8/10] sm_90 fused.c 3.8 s",
                         "kernels [9/10] sm_90 unfused.d 5.0 s",
                         "kernels [10/10] sm_90 unfused.e 6.2 s (memory)"]
    assert "compiling 10 kernel(s) for sm_80, sm_90 with NVRTC (3 at a time)" in err.splitlines()[0]
    rows = out.splitlines()
    assert len(rows) == 1 + 10 and rows[1].split()[:2] == ["fused.a", "sm_80"]  # stdout: the table
    with pytest.raises(SystemExit) as exit_:  # argparse's one-line usage error
        cli.main(["kernels", "--arch", "sm_90", "--jobs", "0"])
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--jobs: must be a positive integer, got '0'" in err


def test_explain_is_compact_and_the_whole_graph_is_behind_a_flag(capsys):
    pytest.importorskip("cudnn", reason="the graph section needs the cuDNN frontend")
    argv = ["explain", "--shape", "1,2,128,64", "--mask", "causal"]
    code, compact, _ = run(capsys, *argv)
    assert code == 0 and "validated (--graph prints the whole graph)" in compact
    assert len(compact.splitlines()) < 25
    assert re.search(r"tensor q: dim \[1, 2, 128, 64\] stride \[16384, 8192, 64, 1\] BFLOAT16",
                     compact)
    code, full, _ = run(capsys, *argv, "--graph")
    graph_text = full.split("cuDNN graph (forward, sm_90):\n", 1)[1]
    assert code == 0 and json.loads(graph_text)["nodes"][0]["type"] == "SDPA"


def test_selftest_table_has_its_legend():
    from cudnn_attn.verify.report import LEGEND, SelftestReport

    table = SelftestReport(outcomes=[]).table()
    assert LEGEND in table and "pass" in LEGEND and "declined" in LEGEND and "2x forward" in LEGEND


@pytest.mark.parametrize("number, text", [(92800, "9.28.0"), (90100, "9.1.0"), (91002, "9.10.2"),
                                          (8907, "8.9.7"), (8600, "8.6.0"), (None, None),
                                          ("unavailable", "unavailable")])
def test_cudnn_versions_as_people_write_them(number, text):
    from cudnn_attn.core.env import cudnn_version_text

    assert cudnn_version_text(number) == text


def test_info_prints_cudnn_as_a_dotted_version(capsys):
    pytest.importorskip("cudnn", reason="needs the cuDNN frontend")
    code, out, _ = run(capsys, "info")
    line = next(line for line in out.splitlines() if line.startswith("cudnn_backend"))
    assert code == 0 and re.fullmatch(r"cudnn_backend\s+9\.\d+\.\d+", line.strip()), line


def test_version_has_one_source():
    from importlib.metadata import version

    assert ca.__version__ == version("cudnn-attn")
    proc = subprocess.run([sys.executable, "-m", "cudnn_attn", "--version"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == f"cudnn-attn {ca.__version__}"
    assert "__version__ =" not in (ROOT / "cudnn_attn" / "__init__.py").read_text().replace(
        "__version__: str = _installed_version()", "")


# --------------------------------------------------------------------------------------------
# environment: logging, the first call
# --------------------------------------------------------------------------------------------

def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, **env})


def test_a_bad_log_level_warns_and_is_ignored():
    proc = python("import logging, cudnn_attn; "
                  "print(logging.getLogger('cudnn_attn').level)", CUDNN_ATTN_LOG_LEVEL="verbose")
    assert proc.returncode == 0 and proc.stdout.strip() == "0"  # NOTSET: left alone
    assert "CUDNN_ATTN_LOG_LEVEL='verbose' is not a log level" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("value, level", [("debug", 10), ("INFO", 20), (" warning ", 30), ("40", 40)])
def test_a_good_log_level_is_applied(value, level, monkeypatch):
    import logging

    from cudnn_attn.core.dispatch import apply_log_level

    logger = logging.getLogger("cudnn_attn")
    monkeypatch.setattr(logger, "level", logger.level)
    apply_log_level(value)
    assert logger.level == level


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case without a CUDA device")
def test_the_first_call_without_cuda_does_not_import_cupy():
    proc = python(
        "import sys, torch, cudnn_attn as ca\n"
        "q = torch.randn(1, 2, 16, 8, requires_grad=True)\n"
        "ca.attention(q, q, q, mask=ca.Causal()).sum().backward()\n"
        "ca.attention(q, q, q, mask=ca.Neighborhood(16, 3))\n"
        "print(ca.explain(q, q, q).selected)\n"
        "print(sorted(m for m in sys.modules if m == 'cupy' or m.startswith('cupy.')))\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["torch", "[]"]
