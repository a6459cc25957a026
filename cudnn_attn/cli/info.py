"""``cudnn-attn info``: versions, GPU facts and each backend's availability."""

from __future__ import annotations

import argparse
from typing import Any

from .output import print_json


def cmd_info(args: argparse.Namespace) -> int:
    """Print versions, GPU facts and each backend's availability (with reasons when unusable)."""
    from cudnn_attn.core import env
    from cudnn_attn.core.dispatch import BACKENDS

    facts = env.collect()
    backends = {backend.name: backend.availability() for backend in BACKENDS}
    if args.json:
        print_json({"environment": facts,
                    "backends": {name: {"available": not reasons, "reasons": reasons}
                                 for name, reasons in backends.items()}})
        return 0
    width = max(len(key) for key in facts)
    for key, value in facts.items():
        print(f"{key:<{width}}  {'-' if value is None else value}")
    print("\nbackends (priority order):")
    for name, reasons in backends.items():
        print(f"  {name:<6} {'available' if not reasons else 'unavailable'}")
        for reason in reasons:
            print(f"         - {reason}")
    return 0


def add_parser(sub: Any) -> None:
    info = sub.add_parser("info", help="versions, GPU and backend availability")
    info.add_argument("--json", action="store_true",
                      help="print one JSON object (environment, backends) instead of the text")
    info.set_defaults(func=cmd_info)
