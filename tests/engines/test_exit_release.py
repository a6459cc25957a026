"""Issue 36: a process that used the cuDNN engine exits quietly, score_mod graphs included.
What the package's caches hold from the frontend (built graphs, plans, handles, deviceless
results) is released by an exit hook that runs before the frontend's module is torn down; a
score_mod graph's cycle inside the frontend is broken when the graph is dropped
(``graphs.callback_cycles``); nanobind then has nothing to report.

Each check runs a fresh interpreter: a probe registered with ``atexit`` before ``cudnn_attn`` is
imported runs after every hook the library registers (last in, first out) and prints what the
cuDNN caches still hold at that point.
"""

from __future__ import annotations

import ast
import gc
import os
import subprocess
import sys
import textwrap
import types
import weakref
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


@needs_fe
def test_score_mod_graphs_are_released_and_exit_is_quiet():
    """A softcap graph carries a score_mod callback (and a bprop in the backward): the frontend
    keeps it in a C++ <-> Python cycle that only ``callback_cycles`` breaks."""
    held, stderr = _run("""
        import torch
        from cudnn_attn.graphs import deviceless
        from cudnn_attn.model.problem import AttnProblem

        q = torch.empty(1, 2, 256, 64, dtype=torch.float16, device="meta", requires_grad=True)
        problem = AttnProblem.from_tensors(q, q, q, softcap=30.0)
        for backward in (False, True):
            assert deviceless.plan_problem(problem, "h100", backward=backward).ok
    """)
    assert held == {}, f"cuDNN caches still hold {held} when the frontend is torn down"
    assert "nanobind" not in stderr and "leak" not in stderr, stderr[-3000:]


def _frontend_callback_wrappers() -> int:
    """Live closures the frontend wrapped around a graph's callbacks (one per callback)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is types.FunctionType
               and o.__code__.co_qualname.startswith("_wrap_callback."))


@needs_fe
def test_a_dropped_score_mod_graph_frees_its_callbacks():
    from cudnn_attn.graphs import sdpa, targets
    from cudnn_attn.model.problem import AttnProblem

    q = torch.empty(1, 2, 128, 64, dtype=torch.float16, device="meta", requires_grad=True)
    problem = AttnProblem.from_tensors(q, q, q, softcap=20.0)
    before = _frontend_callback_wrappers()
    forward = sdpa.build_forward(problem, target=targets.target("h100"))
    backward = sdpa.build_backward(problem, target=targets.target("h100"))
    assert _frontend_callback_wrappers() == before + 3  # score_mod; score_mod and its bprop
    del forward, backward
    assert _frontend_callback_wrappers() == before


class _Shim:
    """Stands in for the frontend's graph shim: its ``_lower`` closes over the C++ graph."""

    def __init__(self, lower):
        self._lower = lower


def test_freed_with_releases_the_noted_closures_when_the_graph_goes():
    from cudnn_attn.graphs.callback_cycles import freed_with

    class Graph:  # the Python graph the package holds
        pass

    class CppGraph:  # the C++ graph, holding the callback as the frontend does
        pass

    def lowering(target):  # the frontend's lower_tensor, closing over its C++ graph
        tensor_map: dict = {}

        def lower(t):
            return target, tensor_map
        return lower

    graph, cpp = Graph(), CppGraph()
    lower = lowering(cpp)
    callback = freed_with(graph, lambda g, score: (g, score))
    cpp.callback = callback
    shim = _Shim(lower)
    assert callback(shim, 7) == (shim, 7)
    assert callback(shim, 8) == (shim, 8)  # noted once
    gone = weakref.ref(cpp)
    del cpp, shim, callback
    assert gone() is not None  # the cycle lives while the Python graph does
    del graph
    assert lower.__closure__ is not None
    assert all(cell.cell_contents is None for cell in lower.__closure__)
    assert gone() is None  # freed by reference counting alone, no collection needed


def test_freed_with_leaves_unweakrefable_graphs_and_missing_callbacks_alone():
    from cudnn_attn.graphs.callback_cycles import freed_with

    def fn(g, t):
        return t

    assert freed_with(object(), None) is None
    assert freed_with(object(), fn) is fn  # a plain object() takes no weak reference


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
