"""Run NATTEN's own tests against ``cudnn_attn.natten`` on the CPU.

``import natten`` finds a stand-in package (``standins/natten017`` or ``standins/natten021``): the
functions under test are ``cudnn_attn.natten``'s; beside them sit only the helpers the tests import
that are not attention (NATTEN's kernel switches and capability probes, argument normalisation,
skip decorators, a logger, NATTEN's backend queries answered with NATTEN's own names).

* NATTEN 0.17.5: ``tests/test_na{1,2,3}d.py`` (the unfused ``na*d_qk/av`` ops), unchanged.
  Tests of NATTEN's CUDA kernels skip without CUDA; those of its GEMM kernels always skip.
* NATTEN 0.21.x: ``tests/test_attn_merge.py`` (merged partial attentions against the whole, values
  and gradients) and ``tests/test_torch_compile.py`` (``torch.compile(fullgraph=True)`` modules
  against eager ones). Adapted for the CPU only: ``"cuda"`` becomes ``"cpu"``, float16 becomes
  float32, and problem sizes shrink (``SIZE_EDITS``). NATTEN 0.21's other files compare NATTEN's
  kernels with NATTEN's compiled reference, which does not exist here.

    git clone --branch v0.17.5 https://github.com/SHI-Labs/NATTEN /tmp/natten-0.17.5
    python tests/peer/run_natten_suite.py /tmp/natten-0.17.5 --json natten-0.17.json
    git clone --branch v0.21.6 https://github.com/SHI-Labs/NATTEN /tmp/natten-0.21.6
    python tests/peer/run_natten_suite.py /tmp/natten-0.21.6 --json natten-0.21.json

Prints pytest's summary and exits with pytest's status; ``--json`` also writes the counts.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

from _suite import run_pytest

HERE = Path(__file__).resolve().parent
FILES = {"0.17": ("test_na1d.py", "test_na2d.py", "test_na3d.py"),
         "0.21": ("__init__.py", "utils.py", "test_attn_merge.py", "test_torch_compile.py")}

DEVICE_EDITS = [(r'device="cuda"', 'device="cpu"'), (r'device = "cuda"', 'device = "cpu"'),
                (r"dtype = torch\.float16", "dtype = torch.float32"),
                (r"torch\.cuda\.empty_cache\(\)", "None")]

# NATTEN 0.21's problem sizes are for a GPU: the same shapes of problem, CPU-sized.
SIZE_EDITS = {
    "test_attn_merge.py": [(r"max_Q_ = 16384", "max_Q_ = 256"),
                           (r"max_KV_total_ = 2\*\*15", "max_KV_total_ = 512"),
                           (r"head_dim_choices = range\(8, 256 \+ 1, 8\)",
                            "head_dim_choices = range(8, 64 + 1, 8)")],
    # In order: (1024,) shrinks before (16384,) becomes (1024,).
    "test_torch_compile.py": [(r"\(1024,\)", "(256,)"), (r"\(9215,\)", "(215,)"),
                              (r"\(16384,\)", "(1024,)"), (r"\(3287,\)", "(287,)"),
                              (r"\(111,\)", "(31,)"), (r"\(672,\)", "(72,)"),
                              (r"\(688,\)", "(88,)"), (r"\(128,\)", "(32,)"),
                              (r"\(16, 24, 24\)", "(8, 18, 18)"),
                              (r"\(4, 6, 8\)", "(4, 6, 6)"),
                              (r"\[13568\]", "[568]"), (r"\[13496\]", "[496]"),
                              (r"\[8504\]", "[504]"), (r"\[12296\]", "[296]"),
                              (r"\[1024\]", "[256]"),
                              (r"for additional_tokens in \[0, 64\]",
                               "for additional_tokens in [0, 16]")],
}


def version_of(source: Path) -> str:
    return "0.21" if (source / "tests" / "test_attn_merge.py").exists() else "0.17"


def adapt(name: str, text: str, version: str) -> str:
    if version == "0.17":
        return text  # unchanged: its CPU tests run on the CPU as they are
    for pattern, replacement in DEVICE_EDITS + SIZE_EDITS.get(name, []):
        text = re.sub(pattern, replacement, text)
    return text


def build(source: Path, work: Path, version: str) -> list:
    """Copy the stand-in package and the adapted test files into ``work``."""
    standin = HERE / "standins" / ("natten017" if version == "0.17" else "natten021") / "natten"
    shutil.copytree(standin, work / "natten", ignore=shutil.ignore_patterns("__pycache__"))
    target = work / "tests"
    target.mkdir()
    for name in FILES[version]:
        (target / name).write_text(adapt(name, (source / "tests" / name).read_text(), version))
    return [target / name for name in FILES[version] if name.startswith("test_")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a NATTEN 0.17.5 or 0.21.x checkout")
    parser.add_argument("--json", type=Path, help="write the counts here")
    args, pytest_args = parser.parse_known_args()  # the rest goes to pytest (e.g. -k NAME)
    source = args.source.resolve()
    version = version_of(source)
    with tempfile.TemporaryDirectory(prefix="natten-suite-") as tmp:
        tests = build(source, Path(tmp), version)
        return run_pytest(Path(tmp), tests, pytest_args, args.json,
                          {"source": str(args.source), "natten": version,
                           "files": [t.name for t in tests]})


if __name__ == "__main__":
    sys.exit(main())
