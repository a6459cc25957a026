"""GPU (marked): paged-KV decode serving on the cuDNN engine. Skips cleanly without CUDA/cuDNN.

* ``cudnn-attn cache warm --decode ...`` saves the decode graphs; a fresh server process that
  loads them (``--graph-cache``) decodes on the cudnn engine with **zero** graph builds, and every
  step matches dense float64 attention. The same server without the cache builds graphs (so zero
  is not a counter that never moves).
* Decode steps (attention, K/V appends, the oracle's bookkeeping) run under
  ``torch.cuda.set_sync_debug_mode("error")``: no host synchronisation.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import load_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("cudnn") is None,
                       reason="nvidia-cudnn-frontend is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "inference_server.py"
# B, H_q, H_kv, D; page size; pages per sequence. The server's --batch/--heads/... say the same.
B, HQ, HKV, D, PAGE, BLOCKS = 4, 8, 2, 64, 16, 8
SERVER = [sys.executable, str(EXAMPLE), "--mode", "decode", "--batch", str(B), "--heads", str(HQ),
          "--kv-heads", str(HKV), "--head-dim", str(D), "--page-size", str(PAGE),
          "--max-blocks", str(BLOCKS), "--requests", "12", "--concurrency", "4",
          "--max-new-tokens", "16", "--dtype", "float16", "--check", "--json"]


@pytest.fixture
def env(tmp_path):
    """The subprocesses' environment: one private graph-cache key for the warm and the server."""
    return {**os.environ, "CUDNN_ATTN_CACHE_KEY_FILE": str(tmp_path / "key" / "graph-cache.key"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run(argv, env) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
                          check=False)
    assert done.returncode == 0, f"{argv}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
    return done.stdout


def serve(extra, env) -> dict:
    report = json.loads(run(SERVER + extra, env))
    assert report["mode"] == "decode" and report["requests"] == 12
    assert report["mismatches"] == 0 and report["compared_tokens"] == report["tokens"] > 0
    assert report["call_signatures"] == 1
    return report


def test_a_warmed_cache_serves_with_zero_graph_builds(tmp_path, env):
    from cudnn_attn.graphs.cache import SUFFIX

    graphs = tmp_path / "graphs"
    out = run([sys.executable, "-m", "cudnn_attn", "cache", "warm", "--decode",
               f"{B},{HQ},{HKV},{D}", "--page-size", str(PAGE), "--max-blocks", str(BLOCKS),
               "--dtype", "fp16", "--mask", "causal:bottom_right", "--save", str(graphs)], env)
    assert ": ok (" in out, out
    saved = sorted(graphs.glob(f"*{SUFFIX}"))
    assert saved, out

    # A fresh process: loads the files at start, then decodes (auto picks the engine).
    warmed = serve(["--graph-cache", str(graphs)], env)
    assert warmed["at_load"]["files"] == len(saved) and warmed["at_load"]["rejected_files"] == 0
    assert warmed["at_load"]["builds"] == 0
    assert warmed["engine"] == "cudnn", warmed["declined"]
    assert warmed["graphs_built"] == 0 and warmed["graph_cache"]["builds"] == 0
    assert warmed["graph_cache"]["loads"] >= 1  # the saved graphs were the ones used
    assert warmed["hit_rate"] == 1.0 and warmed["steps_with_graph_builds"] == 0
    assert warmed["hit_rate_source"] == "graph_cache builds per step"

    # The control: the same server with no cache builds its graphs while serving.
    cold = serve(["--backend", "cudnn"], env)
    assert cold["engine"] == "cudnn" and cold["graphs_built"] >= 1
    assert cold["steps_with_graph_builds"] == 1 and cold["hit_rate"] < 1.0


def test_decode_steps_do_not_synchronize():
    module = load_script(EXAMPLE, "inference_server_gpu")  # puts examples/ on sys.path
    shape = module.DecodeShape(batch=B, heads=HQ, kv_heads=HKV, head_dim=D, page_size=PAGE,
                               max_blocks=BLOCKS, num_blocks=B * BLOCKS, dtype=torch.float16,
                               device="cuda")
    service = module.DecodeService(shape, check=True, seed=3)
    seqs = [service.submit(prompt, 40, seed=i) for i, prompt in enumerate((1, 17, 60))]
    assert service.admit() == 3  # prefill: host work, may synchronize
    service.step()  # the first step picks the engine and builds (or loads) its graphs
    service.compare()
    service.retire()
    assert service.engine == "cudnn", service.declined
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(12):  # steps cross page boundaries (page size 16)
            service.step()
            service.compare()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for _ in range(12):
        service.retire()  # host bookkeeping for the steps above
    stats = service.stats()
    assert stats["compared_tokens"] == 3 * 13 and stats["mismatches"] == 0
    assert stats["max_err"] < 2e-2
    assert not any(s.done.is_set() for s in seqs)  # 40 tokens each: none finished yet
