"""Issue 36: a process that used the cuDNN engine exits quietly. What the package's caches hold
from the frontend (built graphs, plans, handles, deviceless results) is released by an exit hook
that runs before the frontend's module is torn down; nanobind then has nothing to report.

Each check runs a fresh interpreter: a probe registered with ``atexit`` before ``cudnn_attn`` is
imported runs after every hook the library registers (last in, first out) and prints what the
cuDNN caches still hold at that point.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
needs_fe = pytest.mark.skipif(__import__("importlib").util.find_spec("cudnn") is None,
                              reason="nvidia-cudnn-frontend is not installed")

PROBE = """
import atexit, sys

def report():
    from cudnn_attn.core.caches import cache_sizes
    held = {k: v for k, v in cache_sizes().items() if k.startswith("cudnn.") and v}
    print("HELD", repr(held), file=sys.stderr)

atexit.register(report)
"""


def _run(body: str) -> tuple[dict, str]:
    """``(cuDNN caches still holding entries at exit, stderr without the probe's line)``."""
    code = PROBE + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=str(ROOT), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stderr.splitlines()
    (held,) = [ast.literal_eval(line[5:]) for line in lines if line.startswith("HELD ")]
    return held, "\n".join(line for line in lines if not line.startswith("HELD "))


@needs_fe
def test_deviceless_graphs_are_released_before_the_frontend_and_exit_is_quiet():
    held, stderr = _run("""
        import torch
        import cudnn_attn as ca
        from cudnn_attn.graphs import deviceless
        from cudnn_attn.model.problem import AttnProblem

        q = torch.empty(2, 4, 256, 64, dtype=torch.float16, device="meta", requires_grad=True)
        problem = AttnProblem.from_tensors(q, q, q, mask=ca.Causal())
        for backward in (False, True):
            assert deviceless.plan_problem(problem, "h100", backward=backward).ok
    """)
    assert held == {}, f"cuDNN caches still hold {held} when the frontend is torn down"
    assert "nanobind" not in stderr and "leak" not in stderr, stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cudnn_call_exits_quietly_on_the_gpu():
    held, stderr = _run("""
        import torch
        import cudnn_attn as ca

        q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16,
                               requires_grad=True) for _ in range(3))
        out = ca.attention(q, k, v, mask=ca.Causal(), backend="cudnn")
        out.sum().backward()
        torch.cuda.synchronize()
    """)
    assert held == {}, f"cuDNN caches still hold {held} when the frontend is torn down"
    assert "nanobind" not in stderr and "leak" not in stderr, stderr[-3000:]
