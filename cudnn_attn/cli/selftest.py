"""``cudnn-attn selftest``: every engine that runs here, every feature, against the float64
oracle; prints the engine x feature table, optionally writes JSON, exits 1 on any failure."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def cmd_selftest(args: argparse.Namespace) -> int:
    from cudnn_attn.verify import selftest

    report = selftest(backends=args.backend, dtypes=args.dtype, quick=not args.full,
                      progress=not args.no_progress)
    if args.json:
        report.settings["command"] = " ".join(["cudnn-attn", *sys.argv[1:]])
        report.to_json(args.json)
    print(report.table())
    if args.json:
        print(f"wrote {args.json}")
    return 0 if report.ok else 1


def add_parser(sub: Any) -> None:
    from cudnn_attn.dispatch import BACKEND_NAMES
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
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_selftest)
