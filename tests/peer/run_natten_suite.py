"""Run NATTEN's own tests against ``cudnn_attn.natten`` on the CPU.

``import natten`` finds a stand-in package (``standins/natten017`` or ``standins/natten021``): the
functions under test are ``cudnn_attn.natten``'s; beside them sit only the helpers the tests import
that are not attention (NATTEN's kernel switches and capability probes, argument normalisation,
skip decorators, a logger, NATTEN's backend queries answered with NATTEN's own names).

* NATTEN 0.17.5: ``tests/test_na{1,2,3}d.py`` (the unfused ``na*d_qk/av`` ops) and
  ``test_context.py``, unchanged (tests of NATTEN's CUDA kernels skip without CUDA; those of its
  GEMM kernels always skip); ``test_fna{1,2,3}d.py``, ``test_compile.py`` with the CPU as the device
  and CPU-sized problems (``CPU_EDITS_017``, ``SIZE_EDITS``); tests of NATTEN's FlexAttention
  backend (``natten.flex``) skip.
* NATTEN 0.21.x: ``tests/test_attn_merge.py`` (merged partial attentions against the whole, values
  and gradients), ``tests/test_torch_compile.py`` (``torch.compile(fullgraph=True)`` modules
  against eager ones), ``tests/test_fmha.py`` (``natten.attention`` against torch SDPA, and run
  twice for determinism) and ``tests/test_fmha_varlen.py`` (varlen against each sequence alone).
  Adapted for the CPU only: ``"cuda"`` becomes ``"cpu"``, float16 becomes float32 where a file
  fixes it, SDPA's CUDA-only kernel choice becomes the CPU's, and problem sizes shrink
  (``SIZE_EDITS``). Hopper/Blackwell kernel tests and extended sweeps skip. NATTEN 0.21's other
  files compare NATTEN's kernels with NATTEN's compiled reference, which does not exist here.

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

from _suite import STANDIN_CONFTEST, run_pytest

HERE = Path(__file__).resolve().parent
FILES = {"0.17": ("test_na1d.py", "test_na2d.py", "test_na3d.py", "test_fna1d.py", "test_fna2d.py",
                  "test_fna3d.py", "test_compile.py", "test_context.py"),
         "0.21": ("__init__.py", "utils.py", "test_attn_merge.py", "test_torch_compile.py",
                  "test_fmha.py", "test_fmha_varlen.py")}

DEVICE_EDITS = [(r'device="cuda"', 'device="cpu"'), (r'device = "cuda"', 'device = "cpu"'),
                (r'set_default_device\("cuda"\)', 'set_default_device("cpu")'),
                (r"dtype = torch\.float16", "dtype = torch.float32"),
                (r"torch\.cuda\.empty_cache\(\)", "None"),
                # test_fmha.py's torch reference asks for SDPA's memory-efficient kernel, which is
                # CUDA-only; on the CPU: SDPA's fused CPU kernel, or its math path where that
                # kernel declines (D_v != D)
                (r"backends=\[torch\.nn\.attention\.SDPBackend\.EFFICIENT_ATTENTION\]",
                 "backends=[torch.nn.attention.SDPBackend.FLASH_ATTENTION, "
                 "torch.nn.attention.SDPBackend.MATH]")]


def _shrink_lengths(match, factor=16):
    """A varlen problem's list of sequence lengths, each divided by ``factor`` (rounded up)."""
    lengths = [-(-int(n) // factor) for n in match.group(2).split(", ")]
    return match.group(1) + "[" + ", ".join(map(str, lengths)) + "]"

# NATTEN 0.17's fused-attention, compile and context tests name CUDA only as their device (fused NA
# ran on CUDA alone there); here they run on the CPU. Its unfused test_na*d.py files are left as
# they are: their CUDA tests compare NATTEN's CUDA kernels with its CPU ones.
CPU_EDITS_017 = [(r'device="cuda"', 'device="cpu"'), (r"\.is_cuda\b", ".is_cpu"),
                 (r"\.cuda\(\)", ".cpu()"),
                 (r"\n *@skip_if_cuda_is_not_supported\(\)", "")]

# NATTEN 0.21's problem sizes are for a GPU: the same shapes of problem, CPU-sized.
# NATTEN 0.17's test_compile.py marks three tests as expected failures because NATTEN's own ops
# break the graph there; cudnn_attn's compile with fullgraph=True, so the mark goes and they must pass.
SIZE_EDITS = {
    # NATTEN 0.17's fused 1-D sizes (L up to 5000, kernels up to 2047, up to 48 heads) become
    # CPU-sized problems with the same kernel/length/dilation relations.
    "test_fna1d.py": [(r"\(4, 3, 256, 56, 255, 1\)", "(1, 3, 256, 56, 255, 1)"),
                      (r"\(2, 2, 4096, 64, 2047, 1\)", "(1, 2, 256, 64, 127, 1)"),
                      (r"\(2, 4, 4096, 72, 2047, 2\)", "(1, 2, 256, 72, 127, 2)"),
                      (r"\(4, 3, 5000, 80, 511, 8\)", "(1, 3, 500, 80, 51, 8)"),
                      (r"\(4, 3, 5000, 88, 255, 16\)", "(1, 3, 500, 88, 25, 16)"),
                      (r"\(1, 12, 512, 96, 255, 1\)", "(1, 2, 512, 96, 255, 1)"),
                      (r"\(4, 24, 512, 128, 99, 1\)", "(1, 2, 512, 128, 99, 1)"),
                      (r"\(1, 48, 512, 256, 45, 4\)", "(1, 2, 512, 256, 45, 4)"),
                      (r"\(1, 1, 4096, 128\)", "(1, 1, 512, 128)"),
                      (r"\(1, 1, 2047, 256\)", "(1, 1, 255, 256)"),
                      (r"\(1, 2, 1023, 256\)", "(1, 2, 127, 256)")],
    # NATTEN 0.17's fused 2-D/3-D grids: the fused result is checked against NATTEN's unfused
    # na*d_qk/av with their backward (the reference), whose cost grows with batch x heads x tokens
    # x kernel. Problems whose reference exceeds ~1M (token, slot) pairs per (batch, head) run
    # with batch = heads = 1; one whose grid is larger is halved on an axis with the same
    # kernel and dilation (kernel x dilation still fits). Grids, kernels, dilations, head dims and
    # every causal / additional-KV / bias combination are NATTEN's.
    "test_fna2d.py": [(r"\(4, 3, 32, 32, 56, 31, 31, 1, 1\)", "(1, 1, 32, 32, 56, 31, 31, 1, 1)"),
                      (r"\(2, 2, 32, 64, 64, 25, 31, 1, 2\)", "(1, 1, 32, 64, 64, 25, 31, 1, 2)"),
                      (r"\(2, 4, 64, 128, 72, 55, 101, 1, 1\)", "(1, 1, 32, 64, 72, 27, 51, 1, 1)"),
                      (r"\(2, 4, 64, 128, 72, 21, 29, 3, 4\)", "(1, 1, 64, 128, 72, 21, 29, 3, 4)"),
                      (r"\(4, 3, 56, 56, 80, 7, 7, 2, 4\)", "(1, 1, 56, 56, 80, 7, 7, 2, 4)"),
                      (r"\(4, 3, 28, 46, 88, 11, 13, 1, 1\)", "(1, 1, 28, 46, 88, 11, 13, 1, 1)")],
    "test_fna3d.py": [(r"\(4, 8, 32, 10, 10, 48, 7, 3, 3, 1, 2, 3\)",
                       "(1, 1, 32, 10, 10, 48, 7, 3, 3, 1, 2, 3)"),
                      (r"\(1, 12, 32, 8, 8, 48, 7, 5, 5, 2, 1, 1\)",
                       "(1, 1, 32, 8, 8, 48, 7, 5, 5, 2, 1, 1)")],
    "test_compile.py": [(r"\n *@unittest\.expectedFailure(?=\n *@skip_if_torch_compile)", "")],
    # NATTEN 0.21's FMHA problems (sequence lengths up to 12072 x 1680, 4096 x 4096) with their
    # sequence lengths divided by 8; batch, heads, head dims (D != D_v included) and causal as NATTEN's.
    "test_fmha.py": [(r"\(1, 1, 192, 64, 3584, 381\)", "(1, 1, 192, 64, 448, 381)"),
                     (r"\(1, 1, 288, 256, 12072, 1680\)", "(1, 1, 288, 256, 1509, 210)"),
                     (r"\(1, 1, 32, 128, 128, 4096\)", "(1, 1, 32, 128, 128, 512)"),
                     (r"\(1, 1, 192, 192, 3584, 381\)", "(1, 1, 192, 192, 448, 381)"),
                     (r"\(1, 1, 288, 288, 12072, 1680\)", "(1, 1, 288, 288, 1509, 210)"),
                     (r"\(1, 1, 32, 32, 128, 4096\)", "(1, 1, 32, 32, 128, 512)"),
                     (r"\(1, 1, 128, 128, 256, 10240\)", "(1, 1, 128, 128, 256, 1280)"),
                     (r"\(3, 7, 1, 128, 3584, 2077\)", "(3, 7, 1, 128, 448, 260)"),
                     (r"\(2, 4, 2, 32, 1639, 4000\)", "(2, 4, 2, 32, 205, 500)"),
                     (r"\(2, 4, 4, 32, 4096, 4096\)", "(2, 4, 4, 32, 512, 512)")],
    # Every varlen problem's sequence lengths divided by 16 (rounded up): the same batches,
    # heads, head dims and mixes of Q longer / shorter than KV.
    "test_fmha_varlen.py": [(r"(?m)(^\s+|, )\[(\d+(?:, \d+)+)\]", _shrink_lengths)],
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


# Left out, with the reason (none at present).
DESELECT = {"0.17": [], "0.21": []}


def version_of(source: Path) -> str:
    return "0.21" if (source / "tests" / "test_attn_merge.py").exists() else "0.17"


def adapt(name: str, text: str, version: str) -> str:
    if version == "0.17":
        if name.startswith("test_na") or name == "test_context.py":
            return text  # unchanged: its CPU tests run on the CPU as they are
        edits = CPU_EDITS_017 + SIZE_EDITS.get(name, [])
        for pattern, replacement in edits:
            text = re.sub(pattern, replacement, text)
        return text
    for pattern, replacement in DEVICE_EDITS + SIZE_EDITS.get(name, []):
        text = re.sub(pattern, replacement, text)
    return text


def build(source: Path, work: Path, version: str, engine: str = "auto") -> list:
    """Copy the stand-in package and the adapted test files into ``work``;
    ``engine="cudnn-standin"`` adds ``_suite.STANDIN_CONFTEST``."""
    standin = HERE / "standins" / ("natten017" if version == "0.17" else "natten021") / "natten"
    shutil.copytree(standin, work / "natten", ignore=shutil.ignore_patterns("__pycache__"))
    target = work / "tests"
    target.mkdir()
    if engine == "cudnn-standin":
        (work / "conftest.py").write_text(STANDIN_CONFTEST)
    for name in FILES[version]:
        (target / name).write_text(adapt(name, (source / "tests" / name).read_text(), version))
    return [target / name for name in FILES[version] if name.startswith("test_")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a NATTEN 0.17.5 or 0.21.x checkout")
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--engine", choices=("auto", "cudnn-standin"), default="auto",
                        help="cudnn-standin: the calls cuDNN takes run through "
                             "tests/cudnn_fake.py, CPU tensors counting as device tensors")
    args, pytest_args = parser.parse_known_args()  # the rest goes to pytest (e.g. -k NAME)
    source = args.source.resolve()
    version = version_of(source)
    with tempfile.TemporaryDirectory(prefix="natten-suite-") as tmp:
        tests = build(source, Path(tmp), version, args.engine)
        deselect = [f"--deselect={node}" for node in DESELECT[version]]
        return run_pytest(Path(tmp), tests, deselect + pytest_args, args.json,
                          {"source": str(args.source), "natten": version, "engine": args.engine,
                           "files": [t.name for t in tests], "deselected": DESELECT[version]})


if __name__ == "__main__":
    sys.exit(main())
