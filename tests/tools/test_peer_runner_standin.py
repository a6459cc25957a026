"""``run_flash_attn_suite.py --engine cudnn-standin``: FlashAttention's tests through the cuDNN
engine's host logic on the CPU (``tests/cudnn_fake.py`` computing the graphs cuDNN receives)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from common import flash_attn_checkout

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "peer" / "run_flash_attn_suite.py"

# Every line the runner's CPU edits rewrite, then one case through flash_attn_func.
FA_TESTS = '''
import pytest
import torch
from einops import rearrange
from flash_attn import flash_attn_func

is_sm75 = torch.cuda.get_device_capability("cuda") == (7, 5)
is_sm8x = torch.cuda.get_device_capability("cuda")[0] == 8
is_sm80 = torch.cuda.get_device_capability("cuda") == (8, 0)
is_sm90 = torch.cuda.get_device_capability("cuda") == (9, 0)
MEMORY = torch.cuda.get_device_properties("cuda").total_memory
device = "cuda"
OPTIONS = dict(device="cuda")
for i in range(250):
    pass


@pytest.mark.parametrize("seqlen_k", [1, 77])
def test_flash_attn_output(seqlen_k):
    g = torch.Generator().manual_seed(seqlen_k)
    q = torch.randn(2, 1, 4, 32, generator=g).to(torch.float16)
    k, v = (torch.randn(2, seqlen_k, 2, 32, generator=g).to(torch.float16) for _ in range(2))
    out = flash_attn_func(q, k, v, causal=True)
    kk, vv = (t.double().repeat_interleave(2, dim=2) for t in (k, v))
    p = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) / 32 ** 0.5, -1)
    want = rearrange(torch.einsum("bhqk,bkhd->bhqd", p, vv), "b h s d -> b s h d")
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
'''


@pytest.fixture
def checkout(tmp_path):
    pytest.importorskip("cudnn")  # the stand-in reads the frontend's serialized graph
    return flash_attn_checkout(tmp_path, FA_TESTS)


def test_the_suite_runs_its_calls_through_the_cudnn_standin(checkout):
    done = subprocess.run([sys.executable, str(RUNNER), str(checkout), "--engine",
                           "cudnn-standin", "--per-test", "2"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    # both decode steps (one query: FlashAttention's repeatable forward, a two-row graph)
    assert "cuDNN stand-in: 2 tests ran cuDNN graphs, 0 other engines only" in done.stdout
    assert "2 passed" in done.stdout


def test_the_standin_is_refused_on_a_gpu_run(checkout):
    done = subprocess.run([sys.executable, str(RUNNER), str(checkout), "--engine",
                           "cudnn-standin", "--device", "cuda"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "runs on the CPU only" in done.stderr
