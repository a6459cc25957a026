"""``cudnn-attn kernels``: compile every CuPy kernel variant with NVRTC and print its budget."""

from __future__ import annotations

import argparse
import json
from typing import Any


def cmd_kernels(args: argparse.Namespace) -> int:
    from cudnn_attn import fallback_kernels

    rows = []
    for arch in args.arch:
        rows += fallback_kernels.compile_all(arch)
    if args.json:
        print(json.dumps([{k: r[k] for k in r.keys()} for r in rows], indent=2))
    else:
        width = max(len(r.kernel) for r in rows)
        print(f"{'kernel':<{width}}  arch    regs  spill st  spill ld")
        for r in rows:
            print(f"{r.kernel:<{width}}  {r.arch:<6}  {r.registers:>4}  {r.spill_stores:>8}"
                  f"  {r.spill_loads:>8}")
    spilling = [r for r in rows if r.spill_stores or r.spill_loads]
    return 1 if spilling else 0


def add_parser(sub: Any) -> None:
    kernels = sub.add_parser("kernels", help="compile the CuPy kernels with NVRTC (no GPU needed) "
                                             "and print registers/spills")
    kernels.add_argument("--arch", action="append", default=None,
                         help="target, e.g. sm_90 (repeatable; default: sm_80 and sm_90)")
    kernels.add_argument("--json", action="store_true", help="print JSON records")
    kernels.set_defaults(func=lambda a: cmd_kernels(_with_default_arch(a)))


def _with_default_arch(args: argparse.Namespace) -> argparse.Namespace:
    if not args.arch:
        args.arch = ["sm_80", "sm_90"]
    return args
