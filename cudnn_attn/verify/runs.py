"""Judging one engine's runs in order, each verdict streamed and reported as soon as it is known.

Shared by the in-process selftest and the per-engine child processes
(:mod:`cudnn_attn.verify.engine_process`), so both judge, stream and count the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from .cases import Case
from .checks import Outcome, run_case
from .stream import ResultStream

__all__ = ["DTYPES", "plan_runs", "judge_runs"]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}


def plan_runs(cases: Sequence[Case], dtypes: Sequence[str]) -> list[tuple[Case, str]]:
    """One engine's runs in the order they are judged; a run's index names it in the stream."""
    return [(case, dtype) for case in cases for dtype in dtypes]


def judge_runs(backend: str, runs: Sequence[tuple[Case, str]], device: torch.device,
               stream: ResultStream | None, report: Callable[[Outcome], None],
               start: int = 0) -> list[Outcome]:
    """Judge ``runs[start:]`` on ``backend``: a ``begin`` event before each run and a ``result``
    event after it, so a process that dies mid-run leaves the run it died in named."""
    outcomes = []
    for index in range(start, len(runs)):
        case, dtype = runs[index]
        if stream is not None:
            stream.write("begin", backend=backend, index=index, case=case.name, dtype=dtype,
                         time=time.time())
        outcome = run_case(case, backend, DTYPES[dtype], device)
        if stream is not None:
            stream.write("result", index=index, **outcome.as_dict())
        report(outcome)
        outcomes.append(outcome)
    return outcomes
