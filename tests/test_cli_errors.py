"""Every ``cudnn-attn`` subcommand, given bad arguments: one line on stderr, exit status 2, never a
traceback; and the directory cases that used to crash (``*.cagraph`` directories, dangling links)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cudnn_attn import cli
from cudnn_attn.graphs.cache import SUFFIX

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def private_cache_key(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("CUDNN_ATTN_CACHE_KEY_FILE",
                       str(tmp_path_factory.mktemp("config") / "graph-cache.key"))


def run_main(capsys, argv, timeout: float = 60.0) -> tuple[int, str, str]:
    """``cli.main(argv)`` in a daemon thread: a command that hangs fails the test, not the suite."""
    box: dict = {}

    def target():
        try:
            box["code"] = cli.main(argv)
        except SystemExit as exc:  # argparse exits
            box["code"] = exc.code

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"cudnn-attn {' '.join(argv)} hangs"
    out, err = capsys.readouterr()
    return box["code"], out, err


def assert_one_line_usage_error(code, out, err, match: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1, err
    assert "Traceback" not in err + out
    assert match in lines[0], lines[0]
    assert lines[0].startswith("cudnn-attn"), lines[0]


SHAPE = ["--shape", "1,2,64,32"]
BAD = [
    ([], "required: COMMAND"),
    (["bogus"], "invalid choice"),
    (["info", "--verbose"], "unrecognized arguments"),
    (["demo", "--repeats", "0"], "positive integer"),
    (["demo", "--repeats", "-3"], "positive integer"),
    (["demo", "--repeats", "x"], "positive integer"),
    (["demo", "--device", "nope"], "not a torch device"),
    (["demo", "--device", "meta"], "meta tensors hold no data"),
    (["demo", "--dtype", "int8"], "invalid choice"),
    (["demo", "--seed", "-1"], "[0, 2**63)"),
    (["demo", "--seed", str(2**70)], "[0, 2**63)"),
    (["explain"], "--shape"),
    (["explain", "--shape", "1,2,3"], "four positive ints"),
    (["explain", "--shape", "1,2,0,32"], "four positive ints"),
    (["explain", "--shape", f"1,2,{2**40},32"], "four positive ints"),
    (["explain", *SHAPE, "--heads-kv", "0"], "positive integer"),
    (["explain", *SHAPE, "--dropout", "x"], "invalid float"),
    (["explain", *SHAPE, "--dropout", "2"], "dropout_p"),
    (["explain", *SHAPE, "--device", "cuda:x"], "--device"),
    (["explain", *SHAPE, "--mask", "diagonal"], "mask must be"),
    (["explain", *SHAPE, "--mask", "neighborhood:8x8,30x3"], "kernel_size"),
    (["explain", *SHAPE, "--mask", "neighborhood:8x8,3x3,bogus"], "neighborhood option"),
    (["explain", *SHAPE, "--mask", "neighborhood:4x4,3x3"], "4"),
    (["explain", *SHAPE, "--mask", "padding:a,b"], "integers"),
    (["explain", *SHAPE, "--mask", "padding:8,8"], "batch"),
    (["kernels", "--arch", "foo"], "sm_80 or sm_90a"),
    (["kernels", "--arch", "sm_70"], "compute capability 8.0"),
    (["kernels", "--arch", "sm_80", "--arch", "compute_90"], "sm_80 or sm_90a"),
    (["cache"], "required: ACTION"),
    (["cache", "warm"], "config"),
    (["cache", "warm", "CONFIG", "--backend", "nope"], "invalid choice: 'nope'"),
    (["cache", "warm", "CONFIG", "--backend", "torch"], "nothing to warm"),
    (["cache", "warm", "MISSING"], "missing.json"),
    (["cache", "warm", "CONFIG", "--device", "gpu"], "not a torch device"),
    (["cache", "info", "--dir"], "expected one argument"),
    (["selftest", "--backend", "nope"], "invalid choice: 'nope'"),
    (["selftest", "--dtype", "float8"], "invalid choice: 'float8'"),
    (["selftest", "--quick", "--full"], "not allowed with"),
    (["selftest", "--json"], "expected one argument"),
]


@pytest.mark.parametrize("argv, match", BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_arguments_give_one_line_and_status_2(capsys, tmp_path, argv, match):
    config = tmp_path / "warm.json"
    config.write_text(json.dumps({"problems": [{"shape": [1, 2, 64, 32]}]}))
    argv = [str(config) if a == "CONFIG" else str(tmp_path / "missing.json") if a == "MISSING"
            else a for a in argv]
    assert_one_line_usage_error(*run_main(capsys, argv), match)


def test_kernels_without_cupy(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    monkeypatch.setitem(sys.modules, "cupy.cuda", None)
    assert_one_line_usage_error(*run_main(capsys, ["kernels", "--arch", "sm_80"]),
                                "needs CuPy with NVRTC")


def test_cache_clear_leaves_directories_named_like_graphs(capsys, tmp_path):
    directory = tmp_path / "graphs"
    directory.mkdir()
    (directory / ("sub" + SUFFIX)).mkdir()
    (directory / ("a" + SUFFIX)).write_bytes(b"x")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    os.symlink(victim, directory / ("link" + SUFFIX))
    code, out, err = run_main(capsys, ["cache", "clear", "--dir", str(directory)])
    assert code == 0 and "Traceback" not in err and "removed 2 graph file(s)" in out
    assert sorted(p.name for p in directory.iterdir()) == ["sub" + SUFFIX]
    assert victim.read_text() == "keep"


def test_cache_info_with_a_dangling_link_and_a_fifo(capsys, tmp_path):
    directory = tmp_path / "graphs"
    directory.mkdir()
    os.symlink(tmp_path / "nowhere", directory / ("dangling" + SUFFIX))
    os.mkfifo(directory / ("fifo" + SUFFIX))
    code, out, err = run_main(capsys, ["cache", "info", "--dir", str(directory)])
    assert code == 0 and "Traceback" not in err
    assert "files: 0 (0 bytes), usable here: 0, rejected: 2" in out
    assert "dangling.cagraph (link)" in out and "fifo.cagraph (FIFO)" in out
    code, out, _ = run_main(capsys, ["cache", "info", "--dir", str(directory / ("fifo" + SUFFIX))])
    assert code == 0 and "(not a directory)" in out


def test_cache_warm_save_to_an_unsafe_directory_is_one_line(capsys, tmp_path, monkeypatch):
    from cudnn_attn.graphs.cache import graph_cache

    monkeypatch.setitem(sys.modules, "tqdm", None)  # no progress bar on stderr
    unsafe = tmp_path / "shared"
    unsafe.mkdir()
    os.chmod(unsafe, 0o777)
    monkeypatch.setattr(graph_cache, "save", lambda d: __import__(
        "cudnn_attn.graphs.cache", fromlist=["x"]).GraphCache.save(_one_entry(), d))
    config = tmp_path / "warm.json"
    config.write_text("[]")
    code, out, err = run_main(capsys, ["cache", "warm", str(config), "--save", str(unsafe)])
    assert_one_line_usage_error(code, out, err, "chmod go-w")
    assert err.startswith("cudnn-attn cache warm: error: refusing cache directory")


class _Blob:
    serial_kind = "test-cli-errors"

    def serialize(self) -> bytes:
        return b"x"


def _one_entry():
    from cudnn_attn.graphs.cache import GraphCache

    cache = GraphCache()
    cache.get_or_build(("k",), _Blob)
    return cache


@pytest.mark.parametrize("argv", [["kernels", "--arch", "sm_70"], ["demo", "--repeats", "0"]])
def test_the_installed_entry_point_prints_no_traceback(tmp_path, argv):
    env = {**os.environ, "CUDNN_ATTN_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "cudnn_attn", *argv], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and len(result.stderr) < 300


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "huge", "deep"])
def test_cache_warm_never_reads_an_unbounded_config(capsys, tmp_path, monkeypatch, kind):
    """``/dev/zero`` once read until the OOM killer stopped it; a FIFO blocked; a deeply nested
    file raised RecursionError. Each is now refused in one line, before (or without) reading."""
    from cudnn_attn.cli import cache as cli_cache

    if kind == "dev-zero":
        config = "/dev/zero"
        if not os.path.exists(config):
            pytest.skip("no /dev/zero on this platform")
        match = "not a regular file"
    elif kind == "fifo":
        config = str(tmp_path / "warm.json")
        os.mkfifo(config)  # nobody writes it: a blocking open would never return
        match = "not a regular file"
    elif kind == "huge":
        config = str(tmp_path / "warm.json")
        with open(config, "wb") as fh:
            fh.truncate(cli_cache.MAX_CONFIG_BYTES + 1)
        match = "byte limit"
    else:
        config = str(tmp_path / "warm.json")
        Path(config).write_text("[" * 100_000 + "]" * 100_000)
        match = "nests deeper"
    code, out, err = run_main(capsys, ["cache", "warm", config], timeout=20.0)
    assert_one_line_usage_error(code, out, err, match)
