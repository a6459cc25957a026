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
counts. The full ``--per-test 10`` sample needs about 17 GB of free memory (its largest case,
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

from _suite import run_pytest

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
from collections import defaultdict

PER_TEST = int({per_test})
SEED = int({seed})


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
'''


def adapt(text: str) -> str:
    """The test file with the CPU edits applied (each edit must find its target)."""
    for pattern, replacement in DEVICE_EDITS:
        text, count = re.subn(pattern, replacement, text)
        if not count:
            raise SystemExit(f"the test file has no {pattern!r}: not FlashAttention 2.8's file?")
    return text


def build(source: Path, work: Path, per_test: int, seed: int) -> Path:
    """Write the adapted test file, the stand-in package and the sampling conftest to ``work``."""
    package = work / "flash_attn"
    (package / "layers").mkdir(parents=True)
    (package / "__init__.py").write_text(FLASH_ATTN_SHIM)
    (package / "flash_attn_interface.py").write_text(INTERFACE_SHIM)
    (package / "layers" / "__init__.py").write_text("")
    (package / "layers" / "rotary.py").write_text(ROTARY_REFERENCE)
    shutil.copy(source / "flash_attn" / "bert_padding.py", package / "bert_padding.py")
    (work / "conftest.py").write_text(SAMPLING_CONFTEST.format(per_test=per_test, seed=seed))
    test = work / "test_flash_attn.py"
    test.write_text(adapt((source / "tests" / "test_flash_attn.py").read_text()))
    return test


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a FlashAttention 2.8.x checkout")
    parser.add_argument("--per-test", type=int, default=10,
                        help="sampled cases per test function (0: the whole grid)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--json", type=Path, help="write the counts here")
    args, pytest_args = parser.parse_known_args()  # the rest goes to pytest (e.g. -k NAME)
    with tempfile.TemporaryDirectory(prefix="fa-suite-") as tmp:
        test = build(args.source.resolve(), Path(tmp), args.per_test, args.seed)
        return run_pytest(Path(tmp), [test], pytest_args, args.json,
                          {"source": str(args.source), "per_test": args.per_test,
                           "seed": args.seed})


if __name__ == "__main__":
    sys.exit(main())
