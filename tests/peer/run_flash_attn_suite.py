"""Run FlashAttention's own ``tests/test_flash_attn.py`` against ``cudnn_attn.flash_attn_interface``.

The test file is FlashAttention's, unchanged except for what a CPU machine needs: ``"cuda"``
devices become ``"cpu"``, the GPU capability flags are fixed (as on an sm80: every dtype and head
dim runs), the memory probe reports 80 GB, and the race-condition test loops 3 times instead of 250.
``import flash_attn`` finds a stand-in package that re-exports ``cudnn_attn.flash_attn_interface``;
its test helpers (``bert_padding``, copied from the given FlashAttention checkout) and a plain
PyTorch ``apply_rotary_emb`` (the reference the kvcache test compares against) sit next to it.
The parameter grid is sampled: ``--per-test`` cases of each test function, chosen by ``--seed``.

    git clone --branch v2.8.3 https://github.com/Dao-AILab/flash-attention /tmp/fa
    pip install einops
    python tests/peer/run_flash_attn_suite.py /tmp/fa --per-test 10 --json fa-suite.json

Prints pytest's output as it runs and exits with pytest's status; ``--json`` also writes the
counts.

``--device cuda`` runs the file as FlashAttention ships it (its own device, capability flags and
loops: ``benchmarks/gpu_proof.py``'s ``flash-attn-suite`` step) and orders the sample round-robin
over the test functions (drawn from the grid before collection, which for the whole grid takes
minutes), so a run that stops at ``--time-budget`` has reached every function. ``--stage DIR``
copies the two files the runner reads from a checkout into ``DIR`` (a small folder a device call
can carry) and exits. The full ``--per-test 10`` sample needs about 17 GB of free memory (its largest case,
``test_flash_attn_splitkv`` with 100000 keys, peaks at 16.4 GB with its references) and ran 44
minutes on 2 shared cores (``benchmarks/results/flash_attn_suite-2026-11-26.json``).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

from _suite import STANDIN_CONFTEST, run_pytest

# (pattern, replacement) applied to the test file's text, in order; each must match.
DEVICE_EDITS = [
    (r'is_sm75 = torch\.cuda\.get_device_capability\("cuda"\) == \(7, 5\)', "is_sm75 = False"),
    (r'is_sm8x = torch\.cuda\.get_device_capability\("cuda"\)\[0\] == 8', "is_sm8x = True"),
    (r'is_sm80 = torch\.cuda\.get_device_capability\("cuda"\) == \(8, 0\)', "is_sm80 = True"),
    (r'is_sm90 = torch\.cuda\.get_device_capability\("cuda"\) == \(9, 0\)', "is_sm90 = False"),
    (r'torch\.cuda\.get_device_properties\("cuda"\)\.total_memory', "(80 * 2**30)"),
    (r'device = "cuda"', 'device = "cpu"'),
    (r'device="cuda"', 'device="cpu"'),
    (r"for i in range\(250\):", "for i in range(3):"),
]

FLASH_ATTN_SHIM = '''"""Stand-in for the flash_attn package: cudnn_attn's drop-in."""
from cudnn_attn.flash_attn_interface import *  # noqa: F401,F403
'''

INTERFACE_SHIM = '''from cudnn_attn.flash_attn_interface import *  # noqa: F401,F403
from cudnn_attn.flash_attn_interface import _get_block_size_n  # noqa: F401
'''

# FlashAttention's apply_rotary_emb semantics in plain PyTorch (the test's reference): rotate the
# first 2 * cos.shape[-1] features; token s of batch b uses row s + seqlen_offsets[b].
ROTARY_REFERENCE = '''import torch


def _rotate_half(x, interleaved):
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((-b, a), dim=-1).flatten(-2)
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0,
                     cu_seqlens=None, max_seqlen=None):
    assert cu_seqlens is None, "the reference takes [B, S, H, D] inputs only"
    batch, seqlen = x.shape[0], x.shape[1]
    offsets = torch.as_tensor(seqlen_offsets, device=x.device).reshape(-1).expand(batch)
    positions = offsets[:, None] + torch.arange(seqlen, device=x.device)
    rot = 2 * cos.shape[-1]
    c, s = cos[positions][:, :, None], sin[positions][:, :, None]
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
    else:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
    head = x[..., :rot]
    rotated = head.float() * c.float() + _rotate_half(head.float(), interleaved) * s.float()
    out = torch.cat((rotated.to(x.dtype), x[..., rot:]), dim=-1)
    if inplace:
        x.copy_(out)
        return x
    return out
'''

SAMPLING_CONFTEST = '''import random
import time
from collections import defaultdict

import pytest

PER_TEST = int({per_test})
SEED = int({seed})
ROUND_ROBIN = {round_robin}
THIN_GRID = {thin_grid}
TIME_BUDGET_S = {time_budget}
STOPPED = "time budget reached"
START = time.monotonic()


def _draw(calls, keep, salt):
    rng = random.Random(f"{{SEED}}:{{salt}}:{{len(calls)}}")
    return [calls[i] for i in sorted(rng.sample(range(len(calls)), keep))]


if THIN_GRID and PER_TEST > 0:
    # Sample the parameter grid while pytest builds it, not its items afterwards: FlashAttention's
    # whole grid is 508,772 items, 80 s and 3 GB to collect. After each parametrize mark a
    # seeded subset of the combinations goes on (pytest keeps them in Metafunc._calls, its own
    # attribute: this runner's pytest, not cudnn_attn, depends on it).
    _parametrize = pytest.Metafunc.parametrize

    def _thinned(self, *args, **kwargs):
        _parametrize(self, *args, **kwargs)
        if len(self._calls) > 4 * PER_TEST:
            self._calls = _draw(self._calls, 4 * PER_TEST, self.function.__name__)

    pytest.Metafunc.parametrize = _thinned


@pytest.hookimpl(trylast=True)
def pytest_generate_tests(metafunc):
    calls = getattr(metafunc, "_calls", None)
    if THIN_GRID and PER_TEST > 0 and calls and len(calls) > PER_TEST:
        metafunc._calls = _draw(calls, PER_TEST, metafunc.function.__name__)


def pytest_collection_modifyitems(config, items):
    if PER_TEST <= 0:
        return
    groups = defaultdict(list)
    for item in items:
        groups[item.originalname].append(item)
    rng = random.Random(SEED)
    keep = set()
    for name in sorted(groups):
        chosen = groups[name] if len(groups[name]) <= PER_TEST else rng.sample(groups[name], PER_TEST)
        keep.update(id(i) for i in chosen)
    config.hook.pytest_deselected(items=[i for i in items if id(i) not in keep])
    items[:] = [i for i in items if id(i) in keep]
    if ROUND_ROBIN:  # one case of each function, then the second of each, ...
        queues = defaultdict(list)
        for item in items:
            queues[item.originalname].append(item)
        depth = max((len(q) for q in queues.values()), default=0)
        items[:] = [q[i] for i in range(depth) for q in queues.values() if i < len(q)]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    # Past the budget no case starts; the run ends as a finished one (its counts are whole).
    if TIME_BUDGET_S and time.monotonic() - START > TIME_BUDGET_S:
        item.session.shouldstop = STOPPED
        return True
    return None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if session.shouldstop == STOPPED and exitstatus == pytest.ExitCode.INTERRUPTED:
        print(f"\\n{{STOPPED}} ({{TIME_BUDGET_S:g}} s): the cases not started are not counted")
        session.exitstatus = (pytest.ExitCode.TESTS_FAILED if session.testsfailed
                              else pytest.ExitCode.OK)
'''

# What the runner reads from a FlashAttention checkout (``--stage`` copies exactly these).
SOURCE_FILES = ("tests/test_flash_attn.py", "flash_attn/bert_padding.py")


def adapt(text: str) -> str:
    """The test file with the CPU edits applied (each edit must find its target)."""
    for pattern, replacement in DEVICE_EDITS:
        text, count = re.subn(pattern, replacement, text)
        if not count:
            raise SystemExit(f"the test file has no {pattern!r}: not FlashAttention 2.8's file?")
    return text


def missing(source: Path) -> list[str]:
    """Why ``source`` cannot be run (no checkout, no einops), as sentences; empty when it can."""
    gaps = [f"{source / name} is missing (a FlashAttention 2.8.x checkout, or a folder made "
            f"with --stage)" for name in SOURCE_FILES if not (source / name).is_file()]
    try:
        import einops  # noqa: F401  (FlashAttention's tests and bert_padding import it)
    except ImportError:
        gaps.append("einops is not installed (FlashAttention's tests import it; on the GPU "
                    "host, bring its wheel: ../shared/gpu/fetch-wheels einops)")
    return gaps


def stage(source: Path, target: Path) -> None:
    """Copy ``SOURCE_FILES`` from the checkout ``source`` into ``target``."""
    for name in SOURCE_FILES:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / name, target / name)


def build(source: Path, work: Path, per_test: int, seed: int, device: str = "cpu",
          time_budget: float = 0.0, engine: str = "auto") -> Path:
    """Write the test file (adapted for the CPU, or as shipped for ``device="cuda"``), the
    stand-in package and the sampling conftest to ``work``. On ``cuda`` the sample is drawn
    from the grid before collection (seconds, not minutes) and run round-robin; a
    ``time_budget`` (s) starts no case after it. ``engine="cudnn-standin"`` (CPU only) runs
    the calls cuDNN takes through the stand-in (``_suite.STANDIN_CONFTEST``)."""
    package = work / "flash_attn"
    (package / "layers").mkdir(parents=True)
    (package / "__init__.py").write_text(FLASH_ATTN_SHIM)
    (package / "flash_attn_interface.py").write_text(INTERFACE_SHIM)
    (package / "layers" / "__init__.py").write_text("")
    (package / "layers" / "rotary.py").write_text(ROTARY_REFERENCE)
    shutil.copy(source / "flash_attn" / "bert_padding.py", package / "bert_padding.py")
    gpu = device == "cuda"
    conftest = SAMPLING_CONFTEST.format(per_test=per_test, seed=seed, round_robin=gpu,
                                        thin_grid=gpu, time_budget=time_budget)
    if engine == "cudnn-standin":
        conftest += STANDIN_CONFTEST
    (work / "conftest.py").write_text(conftest)
    test = work / "test_flash_attn.py"
    text = (source / "tests" / "test_flash_attn.py").read_text()
    test.write_text(adapt(text) if device == "cpu" else text)
    return test


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("source", type=Path, help="a FlashAttention 2.8.x checkout")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: the file with the CPU edits; cuda: as shipped")
    parser.add_argument("--time-budget", type=float, default=0.0, metavar="S",
                        help="start no case after S seconds (0: no limit); the run then ends "
                             "with the counts of the cases it ran")
    parser.add_argument("--stage", type=Path, metavar="DIR",
                        help="copy the files the runner reads into DIR and exit")
    parser.add_argument("--per-test", type=int, default=10,
                        help="sampled cases per test function (0: the whole grid)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--json", type=Path, help="write the counts here")
    parser.add_argument("--engine", choices=("auto", "cudnn-standin"), default="auto",
                        help="cudnn-standin (CPU only): the calls cuDNN takes run through "
                             "tests/cudnn_fake.py, CPU tensors counting as device tensors")
    args, pytest_args = parser.parse_known_args()  # the rest goes to pytest (e.g. -k NAME)
    if args.engine != "auto" and args.device != "cpu":
        parser.error("--engine cudnn-standin runs on the CPU only (--device cpu)")
    if args.stage is not None:
        stage(args.source, args.stage)
        print(f"staged {', '.join(SOURCE_FILES)} into {args.stage}")
        return 0
    gaps = missing(args.source)
    if gaps:
        print("run_flash_attn_suite: cannot run: " + "; ".join(gaps), file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fa-suite-") as tmp:
        test = build(args.source.resolve(), Path(tmp), args.per_test, args.seed, args.device,
                     args.time_budget, args.engine)
        return run_pytest(Path(tmp), [test], pytest_args, args.json,
                          {"source": str(args.source), "per_test": args.per_test,
                           "seed": args.seed, "device": args.device, "engine": args.engine,
                           "time_budget_s": args.time_budget})


if __name__ == "__main__":
    sys.exit(main())
