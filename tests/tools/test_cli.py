"""The ``cudnn-attn`` command line: info, explain and cache info|warm|clear."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn import cli
from cudnn_attn.graphs.cache import SUFFIX, GraphCache, graph_cache, register_deserializer

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()


class CliBlob:
    serial_kind = "test-cli-blob"

    def __init__(self, data: bytes):
        self.data = data

    def serialize(self) -> bytes:
        return self.data

    @classmethod
    def from_bytes(cls, data: bytes) -> CliBlob:
        return cls(data)


register_deserializer(CliBlob.serial_kind, CliBlob.from_bytes)


@pytest.fixture(autouse=True)
def private_cache_key(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE",
                       str(tmp_path_factory.mktemp("config") / "graph-cache.key"))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info(capsys):
    code, out, _ = run_cli(capsys, "info")
    assert code == 0 and "torch" in out and "backends (priority order)" in out


def test_explain_prints_the_verdicts_and_the_graph_section(capsys):
    code, out, _ = run_cli(capsys, "explain", "--shape", "1,2,128,64", "--mask", "causal:bottom_right",
                           "--dtype", "fp16", "--heads-kv", "1", "--seq-kv", "256")
    assert code == 0
    q = torch.empty(1, 2, 128, 64, dtype=torch.float16)
    k = torch.empty(1, 1, 256, 64, dtype=torch.float16)
    expected = ca.explain(q, k, k, mask=ca.Causal("bottom_right"))
    assert str(expected) in out  # the same table as the Python API
    assert "cuDNN graph (forward, sm_90)" in out


def test_explain_backward_and_window(capsys):
    code, out, _ = run_cli(capsys, "explain", "--shape", "2,4,64,32", "--mask", "window:16,0",
                           "--backward", "--target-sm", "80", "--layout", "bshd")
    assert code == 0 and "SlidingWindow(left=16, right=0" in out
    assert "cuDNN graph (backward, sm_80)" in out


@pytest.mark.parametrize("argv, match", [
    (["--shape", "1,2,3"], "four positive ints"),
    (["--shape", "1,2,64,32", "--mask", "diagonal"], "mask must be"),
    (["--shape", "1,2,64,32", "--mask", "window:3,x"], "window:3,x"),
    (["--shape", "1,3,64,32", "--heads-kv", "2"], "multiple of kv heads"),
])
def test_explain_bad_arguments(capsys, argv, match):
    code, _, err = run_cli(capsys, "explain", *argv)
    assert code == 2 and match in err


def test_parse_mask():
    assert cli.parse_mask("none") is None and cli.parse_mask(None) is None
    assert cli.parse_mask("causal") == ca.Causal()
    assert cli.parse_mask("Causal:bottom_right") == ca.Causal("bottom_right")
    assert cli.parse_mask("window:8,2,bottom_right") == ca.SlidingWindow(8, 2, "bottom_right")
    assert cli.parse_mask("neighborhood:8x8,3x3") == ca.Neighborhood((8, 8), (3, 3))
    assert cli.parse_mask("neighborhood:16,5,dilation=2,stride=3,causal") == ca.Neighborhood(
        (16,), (5,), stride=(3,), dilation=(2,), is_causal=True)
    assert cli.parse_mask("padding:8,6") == ca.Padding([8, 6])
    assert cli.parse_mask("padding:8,6/16,12") == ca.Padding([8, 6], [16, 12])
    assert cli.parse_mask("causal+padding:5") == ca.Causal() & ca.Padding([5])
    for bad in ("neighborhood:8x8", "neighborhood:8x8,3x3,bogus", "padding:a", "padding:-1",
                "neighborhood:8x8,9x9"):
        with pytest.raises(ValueError, match="mask"):
            cli.parse_mask(bad)


@pytest.mark.parametrize("mask, expected", [
    ("neighborhood:8x8,3x3,dilation=2x2", lambda: ca.Neighborhood((8, 8), (3, 3), dilation=2)),
    ("padding:40,64", lambda: ca.Padding([40, 64])),
])
def test_explain_takes_neighborhood_and_padding_masks(capsys, mask, expected):
    code, out, _ = run_cli(capsys, "explain", "--shape", "2,2,64,32", "--mask", mask,
                           "--dtype", "fp32", "--device", "cpu")
    assert code == 0
    q = torch.empty(2, 2, 64, 32)
    assert str(ca.explain(q, q, q, mask=expected())) in out


def test_explain_describes_a_huge_shape_without_allocating(capsys):
    # 64*64*1e6*128 bf16 elements: a terabyte per tensor if explain allocated it.
    code, out, err = run_cli(capsys, "explain", "--shape", "64,64,1000000,128", "--mask",
                             "causal", "--device", "cpu")
    assert code == 0, err
    assert "S=1000000" in out and "torch  selected" in out


def write_config(tmp_path, problems, defaults=None) -> str:
    path = tmp_path / "warm.json"
    path.write_text(json.dumps({"defaults": defaults or {}, "problems": problems}))
    return str(path)


PROBLEMS = [
    {"name": "causal-lm", "shape": [2, 8, 256, 128], "mask": "causal"},
    {"name": "swa-train", "shape": "1,4,512,64", "mask": "window:128,0", "backward": True},
    {"name": "gqa-decode", "shape": [4, 8, 1, 128], "heads_kv": 2, "seq_kv": 1024,
     "mask": "causal:bottom_right"},
]


def test_cache_warm_reports_each_problem(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain "[i/N]" progress lines
    config = write_config(tmp_path, PROBLEMS, defaults={"dtype": "bf16"})
    code, out, _ = run_cli(capsys, "cache", "warm", config, "--save", str(tmp_path / "saved"))
    declined = out.count("cannot build on cudnn")
    assert code == (1 if declined else 0)  # a problem that built nothing is a status 1
    lines = [line for line in out.splitlines() if line.startswith("warm [")]
    assert [line.split("]")[0] for line in lines] == ["warm [1/3", "warm [2/3", "warm [3/3"]
    for line, problem in zip(lines, PROBLEMS):
        assert f"{problem['name']}: " in line
        if CUDA:
            assert ": ok (" in line or "cannot build on cudnn" in line
        else:  # a CPU-only machine: the cudnn backend says why it cannot build
            assert "cannot build on cudnn" in line and "no CUDA device" in line
    assert "graph_cache:" in out and "saved" in out


@pytest.mark.parametrize("backend", ["torch", "cupy"])
def test_cache_warm_refuses_backends_without_graphs(capsys, tmp_path, backend):
    # Neither builds anything the graph cache keeps: "ok (0 built)" and "saved 0" said nothing.
    config = write_config(tmp_path, PROBLEMS[:1], defaults={"dtype": "fp32"})
    code, out, err = run_cli(capsys, "cache", "warm", config, "--backend", backend, "--device",
                             "cpu", "--save", str(tmp_path / "saved"))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"the {backend} backend has nothing to warm" in err
    assert not (tmp_path / "saved").exists()


def test_cache_warm_rejects_bad_configs(capsys, tmp_path):
    config = write_config(tmp_path, [PROBLEMS[0], {"shape": [1, 2, 64, 32], "dtyp": "bf16"}])
    code, out, _ = run_cli(capsys, "cache", "warm", config)
    assert code == 2 and "invalid: unknown problem keys ['dtyp']" in out
    bad = tmp_path / "bad.json"
    bad.write_text('{"problems": 3}')
    code, _, err = run_cli(capsys, "cache", "warm", str(bad))
    assert code == 2 and "expected a list of problems" in err
    code, _, err = run_cli(capsys, "cache", "warm", str(tmp_path / "missing.json"))
    assert code == 2 and "missing.json" in err


def test_cache_warm_loads_and_rejects_foreign_files(capsys, tmp_path, caplog):
    foreign = GraphCache(environment=lambda: {"gpu_name": "Elsewhere"})
    foreign.get_or_build(("k",), lambda: CliBlob(b"x"))
    foreign.save(tmp_path / "dir")
    config = write_config(tmp_path, [], defaults={})
    before = graph_cache.info()["rejected_files"]
    with caplog.at_level(logging.WARNING, logger="cudnn_attn"):
        code, out, _ = run_cli(capsys, "cache", "warm", config, "--load", str(tmp_path / "dir"))
    assert code == 0 and "loaded 0 graph file(s)" in out
    assert graph_cache.info()["rejected_files"] == before + 1
    assert "another environment" in caplog.text


def test_cache_info_and_clear(capsys, tmp_path):
    directory = tmp_path / "graphs"
    code, out, _ = run_cli(capsys, "cache", "info", "--dir", str(directory))
    assert code == 0 and "hits" in out and "maxsize" in out and "does not exist" in out
    local = GraphCache()  # this machine's environment: usable here
    local.get_or_build(("a",), lambda: CliBlob(b"a"))
    local.get_or_build(("b",), lambda: CliBlob(b"b"))
    assert local.save(directory) == 2
    broken = sorted(directory.glob("*" + SUFFIX))[0]
    broken.write_bytes(broken.read_bytes()[:-5])
    (directory / "README").write_text("not a graph")
    code, out, _ = run_cli(capsys, "cache", "info", "--dir", str(directory))
    assert code == 0 and "files: 2" in out and "usable here: 1" in out and "rejected: 1" in out
    code, out, _ = run_cli(capsys, "cache", "clear", "--dir", str(directory))
    assert code == 0 and "removed 2 graph file(s)" in out
    assert [p.name for p in directory.iterdir()] == ["README"]
    assert graph_cache.info()["size"] == 0


def test_progress_fallback_without_tqdm(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    items, write = cli.progress(["a", "b"], "warm")
    for item in items:
        write(f"did {item}")
    out = capsys.readouterr().out
    assert out.splitlines() == ["warm [1/2] did a", "warm [2/2] did b"]


def test_module_entry_point(tmp_path):
    env = {**os.environ, "CUDNN_ATTN_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "cudnn_attn", "cache", "info"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert f"cache dir: {tmp_path}" in result.stdout
