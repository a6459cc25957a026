"""The examples' command lines: every option explains itself, ``--help`` only prints, outputs go
to the current directory unless told otherwise, and paths that do not exist are refused before
any work."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from common import load_script

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = sorted(p.stem for p in EXAMPLES.glob("*.py")
                 if "__main__" in p.read_text() and p.stem != "plots")


class Parsed(Exception):
    """Raised in place of parsing: carries the parser the example built."""


def parser_of(name: str, monkeypatch) -> argparse.ArgumentParser:
    module = load_script(EXAMPLES / f"{name}.py", f"example_cli_{name}")

    def capture(self, args=None, namespace=None):
        raise Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    entry = getattr(module, "parse_args", None) or module.main
    with pytest.raises(Parsed) as caught:
        entry([])
    return caught.value.args[0]


def test_every_script_is_covered():
    assert {"context_parallel", "draw_masks", "inference_server", "neighborhood_vision",
            "paged_decode", "quickstart", "train_tiny_transformer"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_option_has_help_text(name, monkeypatch):
    parser = parser_of(name, monkeypatch)
    silent = [action.option_strings[0] for action in parser._actions
              if action.option_strings and not (action.help or "").strip()]
    assert not silent, f"{name}: options without help text: {silent}"
    assert parser.description and not parser.description.rstrip().endswith(("(", ",", "the"))


@pytest.fixture(scope="module")
def fresh_python():
    """Each example's ``--help`` in a process of its own, forked from one that imported torch
    (``fresh_python``): one start of torch for all of them."""
    from fresh_python import FreshPython

    return FreshPython(dict(os.environ))


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_only_prints(name, fresh_python, tmp_path):
    """``--help`` prints usage and exits 0 without running anything (context_parallel used to
    start its processes) and without writing anything."""
    work, out, err = tmp_path / "work", tmp_path / "stdout", tmp_path / "stderr"
    work.mkdir()
    status = fresh_python.run_script(EXAMPLES / f"{name}.py", ["--help"], work, out,
                                     timeout=120, err_log=err)
    assert status == 0, err.read_text()
    stdout = out.read_text()
    assert stdout.startswith("usage:") and "rank" not in stdout.split("options:")[0]
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("name, argv, match", [
    ("inference_server", ["--graph-cache", "/nonexistent/graphs"], "no such directory"),
    ("train_tiny_transformer", ["--text", "/nonexistent/text.txt"], "no such file"),
    ("train_tiny_transformer", ["--plot", "/nonexistent/dir/curves.png"], "no such directory"),
    ("neighborhood_vision", ["--plot", "/nonexistent/dir/v.png"], "no such directory"),
    ("draw_masks", ["--out", "/nonexistent/dir/m.png"], "no such directory"),
    ("context_parallel", ["--nproc", "0"], "--nproc must be >= 1"),
])
def test_unknown_paths_are_refused_before_any_work(name, argv, match, capsys):
    module = load_script(EXAMPLES / f"{name}.py", f"example_refuse_{name}")
    entry = getattr(module, "parse_args", None) or module.main
    with pytest.raises(SystemExit) as exit_:
        entry(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # argparse: the usage, then one error line
    assert "error:" in last and match in last and "Traceback" not in err


@pytest.mark.parametrize("name, option, default", [
    ("draw_masks", "--out", "masks.png"),
    ("train_tiny_transformer", "--plot", "train_tiny_transformer.png"),
    ("neighborhood_vision", "--plot", "neighborhood_vision.png"),
])
def test_outputs_default_to_the_current_directory(name, option, default, monkeypatch):
    parser = parser_of(name, monkeypatch)
    action = next(a for a in parser._actions if option in a.option_strings)
    assert action.default == default and "/" not in str(action.default)
