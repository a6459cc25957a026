"""``cudnn-attn selftest``: every engine that runs here, every feature, against the float64
oracle; prints the engine x feature table, optionally writes JSON, exits 1 on any failure.

Each engine runs in a process of its own (``--one-process`` for all in this one), every verdict
is appended to ``--stream`` the moment it is known, and progress goes to stderr as a bar on a
terminal and as one line per verdict anywhere else (a log): a run killed midway still says what
passed and failed. SIGINT ends it early with the table of what was judged (exit status 130)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

INTERRUPTED = 130  # the shell's status for SIGINT


def cmd_selftest(args: argparse.Namespace) -> int:
    from cudnn_attn.verify import selftest

    report = selftest(backends=args.backend, dtypes=args.dtype, quick=not args.full,
                      progress=not args.no_progress, stream=args.stream,
                      isolate=not args.one_process, case_timeout_s=args.case_timeout or None)
    if args.json:
        report.settings["command"] = " ".join(["cudnn-attn", *sys.argv[1:]])
        report.to_json(args.json)
    print(report.table())
    if args.json:
        print(f"wrote {args.json}")
    if report.settings.get("interrupted"):
        return INTERRUPTED
    return 0 if report.ok else 1


def add_parser(sub: Any) -> None:
    from cudnn_attn.core.dispatch import BACKEND_NAMES
    from cudnn_attn.verify import DTYPES

    p = sub.add_parser("selftest", help="check every engine on this machine against a float64 "
                                        "oracle (exit 1 on any failure)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", default=True,
                      help="one small case per feature (default; under a minute on a CPU)")
    size.add_argument("--full", action="store_true",
                      help="also every head dim 32..256, larger sequences, more dtypes")
    p.add_argument("--backend", action="append", choices=BACKEND_NAMES,
                   help="engine to check (repeatable; default: every engine available here)")
    p.add_argument("--dtype", action="append", choices=tuple(DTYPES),
                   help="input dtype (repeatable; default depends on the device)")
    p.add_argument("--json", metavar="PATH", help="write every result and the environment here")
    p.add_argument("--stream", metavar="PATH",
                   help="append every verdict here as it is judged (JSON lines, flushed)")
    p.add_argument("--one-process", action="store_true",
                   help="judge every engine in this process (default: one process per engine, "
                        "so a crash in one cannot touch the others' results)")
    p.add_argument("--case-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="kill an engine's process when one run takes longer, record that run as "
                        "hung and go on with the next (default %(default)g; 0: no limit; not "
                        "with --one-process)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress (default: a bar on a terminal, one line per verdict otherwise)")
    p.set_defaults(func=cmd_selftest)
