"""One engine's share of an isolated selftest, in a process of its own.

    python -m cudnn_attn.verify.engine_process --backend cupy --cases cases.json \\
        --dtype float16 --dtype bfloat16 --stream selftest.jsonl [--start N] [--progress]

It judges runs ``N..`` of the engine (:func:`cudnn_attn.verify.runs.plan_runs` order) and
appends every event to the stream. An illegal memory access, an abort or a hang here ends only
this process; the parent (:mod:`cudnn_attn.verify.isolated`) records it and starts another at the
next run. Exit status 0 when every run was judged (failures included), 130 on SIGINT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from .progress import progress_reporter
from .runs import DTYPES, judge_runs, plan_runs
from .stream import ResultStream, case_from_dict

INTERRUPTED = 130  # the shell's status for SIGINT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cudnn_attn.verify.engine_process")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--cases", required=True, help="JSON list of Case.as_dict()")
    parser.add_argument("--dtype", action="append", required=True, choices=tuple(DTYPES))
    parser.add_argument("--stream", required=True)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)

    from cudnn_attn.core.dispatch import get_backend

    with open(args.cases) as f:
        cases = [case_from_dict(c) for c in json.load(f)]
    runs = plan_runs(cases, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with ResultStream(args.stream) as stream:
        unavailable = get_backend(args.backend).availability()
        stream.write("engine", backend=args.backend, unavailable=unavailable, runs=len(runs),
                     start=args.start, device=str(device), pid=os.getpid())
        if unavailable:
            return 0
        report = progress_reporter(len(runs), args.progress, lines=True, first=args.start)
        try:
            judge_runs(args.backend, runs, device, stream, report, start=args.start)
        except KeyboardInterrupt:
            stream.write("interrupted", backend=args.backend)
            return INTERRUPTED
        stream.write("end", backend=args.backend)
    return 0


if __name__ == "__main__":
    sys.exit(main())
