"""Opt-in plan autotuning: time every plan cuDNN offers for a graph and keep the fastest.

cuDNN ranks a graph's execution plans by heuristics and the engine runs the first one that
builds, as PyTorch does. With ``CUDNN_ATTN_AUTOTUNE=1`` in the environment (or
``GraphOptions(autotune=True)`` for a graph built through ``build_forward`` / ``build_backward``),
the first execution of each graph builds every ranked plan (those cuDNN declines are skipped),
times each on the call's own buffers, and selects the fastest: later calls (and the graph
cache, its files included, through ``BuiltGraph.engine``) use that one. The timing synchronises
once, on that first call; a graph first executed inside a CUDA-graph capture is not tuned then
(nothing can be timed there) but on its first eager call.

``fastest_plan`` is the selection rule, with the plan runner and the timer as arguments, so it
is checked without a GPU.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from ._emit import cudnn_module

__all__ = ["ENV", "requested", "fastest_plan", "cuda_time_ms"]

ENV = "CUDNN_ATTN_AUTOTUNE"


def requested(options: Any = None) -> bool:
    """Whether graphs built now are tuned on first use: ``options.autotune`` (a
    ``GraphOptions``), else ``CUDNN_ATTN_AUTOTUNE=1``."""
    if options is not None and getattr(options, "autotune", False):
        return True
    return os.environ.get(ENV, "").strip() == "1"


def fastest_plan(graph, run_at: Callable[[int], None],
                 time_ms: Callable[[Callable[[], None]], float],
                 ) -> tuple[int, list[tuple[int, float]]]:
    """``(index, [(index, ms), ...])``: build each of ``graph``'s ranked plans in turn
    (``build_plan_at_index``; a plan cuDNN declines is skipped), time ``run_at(index)`` with
    ``time_ms``, and select the fastest (built last, so ``execute`` runs it). Ties keep the
    higher-ranked plan."""
    declined = _declines()
    timings: list[tuple[int, float]] = []
    for index in range(graph.get_execution_plan_count()):
        try:
            graph.build_plan_at_index(index)
        except declined:
            continue
        timings.append((index, float(time_ms(_bound(run_at, index)))))
    if not timings:
        raise RuntimeError("cuDNN built none of the graph's plans while autotuning")
    best = min(timings, key=lambda t: (t[1], t[0]))[0]
    graph.build_plan_at_index(best)
    return best, timings


def _bound(run_at: Callable[[int], None], index: int) -> Callable[[], None]:
    def run() -> None:
        run_at(index)
    return run


def _declines() -> tuple:
    return (cudnn_module().cudnnGraphNotSupportedError, NotImplementedError)


def cuda_time_ms(fn: Callable[[], None], repeats: int = 5,
                 stream: Optional[torch.cuda.Stream] = None) -> float:
    """Milliseconds per call of ``fn`` on the current CUDA stream (CUDA events, one warm-up
    call, then ``repeats`` calls back to back); synchronises on the end event."""
    fn()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(repeats):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / repeats
