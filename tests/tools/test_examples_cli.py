"""The examples' command lines: every option explains itself, ``--help`` only prints, outputs go
to the current directory unless told otherwise, and paths that do not exist are refused before
any work."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
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


# Runs each example as ``python EXAMPLE --help`` would (``__main__``, that argv, in a folder of
# its own), one after the other in one fresh interpreter: one start of torch for all of them, not
# one each (a tenth of the suite's subprocess time). Prints nothing itself; the results go to a
# JSON file, so anything an example starts that writes to the process's stdout shows.
_HELP_DRIVER = """
import contextlib, io, json, os, runpy, sys
work, target = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for name, path, folder in work:
    os.chdir(folder)
    sys.argv = [path, "--help"]
    out, err, code = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code
        except BaseException as exc:  # noqa: BLE001  (reported, not raised: the others still run)
            code = f"raised {exc!r}"
    results[name] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
with open(target, "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def help_runs(tmp_path_factory):
    """name -> ``{"code", "stdout", "stderr", "folder"}`` of each example's ``--help``."""
    root = tmp_path_factory.mktemp("help")
    work = [(name, str(EXAMPLES / f"{name}.py"), str(root / name)) for name in SCRIPTS]
    for _, _, folder in work:
        Path(folder).mkdir()
    result = root / "results.json"
    proc = subprocess.run([sys.executable, "-c", _HELP_DRIVER, json.dumps(work), str(result)],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    runs = json.loads(result.read_text())
    for name, _, folder in work:
        runs[name]["folder"] = Path(folder)
    return runs


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_only_prints(name, help_runs):
    """``--help`` prints usage and exits 0 without running anything (context_parallel used to
    start its processes) and without writing anything."""
    run = help_runs[name]
    assert run["code"] in (0, None), run["stderr"]
    assert run["stdout"].startswith("usage:") and "rank" not in run["stdout"].split("options:")[0]
    assert list(run["folder"].iterdir()) == []


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
