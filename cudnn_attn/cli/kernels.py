"""``cudnn-attn kernels``: compile every CuPy kernel variant with NVRTC and print its budget:
registers, spills, shared memory (static and dynamic) and the theoretical occupancy per SM."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from .specs import positive_int

_ARCH = re.compile(r"sm_(\d+)(\d)a?")


def arch_arg(text: str) -> str:
    """argparse type: ``sm_XY`` (or ``sm_XYa``) at or above the kernels' minimum capability."""
    from cudnn_attn.fallback_kernels.limits import LIMITS

    match = _ARCH.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"must look like sm_80 or sm_90a, got {text!r}")
    capability = (int(match.group(1)), int(match.group(2)))
    need = tuple(LIMITS.min_compute_capability)
    if capability < need:
        raise argparse.ArgumentTypeError(
            f"{text}: the CuPy kernels need compute capability {need[0]}.{need[1]} or newer "
            f"(sm_{need[0]}{need[1]})")
    return text.strip()


def cmd_kernels(args: argparse.Namespace) -> int:
    from cudnn_attn import fallback_kernels
    from cudnn_attn.fallback_kernels import KernelCompileError

    try:  # fail in one line, before any work, when CuPy/NVRTC are missing
        from cupy.cuda import nvrtc  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"kernels needs CuPy with NVRTC: pip install 'cudnn-attn[cu12]' ({exc})") from None
    # Each kernel is its own NVRTC program (a few seconds, or milliseconds from the cubin
    # cache): one progress line per kernel, on stderr so that stdout stays parseable.
    total = sum(len(variants) for arch in args.arch
                for variants in fallback_kernels.kernel_programs(arch).values())
    rows: list = []
    jobs = args.jobs or fallback_kernels.default_jobs()
    print(f"kernels: compiling {total} kernel(s) for {', '.join(args.arch)} with NVRTC "
          f"({jobs} at a time)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    for arch in args.arch:
        def show(done: int, count: int, build: Any, arch: str = arch) -> None:
            where = "" if build.origin == "compiled" else f" ({build.origin})"
            print(f"kernels [{len(rows) + done}/{total}] {arch} {build.record.kernel} "
                  f"{build.seconds:.1f} s{where}", file=sys.stderr, flush=True)

        try:
            rows += fallback_kernels.compile_all(arch, progress=show, jobs=jobs)
        except KernelCompileError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"cudnn-attn kernels: error: {first}", file=sys.stderr)
            return 1
    print(f"kernels: {len(rows)} kernel(s) in {time.perf_counter() - start:.1f} s",
          file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps([{k: r[k] for k in r.keys()} for r in rows], indent=2))
    else:
        print(budget_table(rows))
    spilling = [r for r in rows if r.spill_stores or r.spill_loads]
    return 1 if spilling else 0


def budget_table(rows: list) -> str:
    """The stdout table: per kernel its registers, spills, shared memory (static from ptxas, the
    dynamic bytes its launches ask) and the theoretical occupancy they give."""
    def shown(value: Any) -> str:
        return "-" if value is None else str(value)

    width = max(len(r.kernel) for r in rows)
    lines = [f"{'kernel':<{width}}  arch    regs  spill st  spill ld  smem st  smem dyn  threads"
             f"  CTAs/SM  warps/SM  limited by"]
    for r in rows:
        lines.append(f"{r.kernel:<{width}}  {r.arch:<6}  {r.registers:>4}  {r.spill_stores:>8}"
                     f"  {r.spill_loads:>8}  {r.static_smem_bytes:>7}  {r.dynamic_smem_bytes:>8}"
                     f"  {shown(r.threads or None):>7}  {shown(r.ctas_per_sm):>7}"
                     f"  {shown(r.warps_per_sm):>8}  {shown(r.occupancy_limiter)}")
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    kernels = sub.add_parser("kernels", help="compile the CuPy kernels with NVRTC (no GPU needed) "
                                             "and print registers, spills, shared memory and "
                                             "occupancy")
    kernels.add_argument("--arch", action="append", default=None, type=arch_arg,
                         help="target, e.g. sm_90 (repeatable; default: sm_80 and sm_90)")
    kernels.add_argument("--json", action="store_true", help="print JSON records")
    kernels.add_argument("--jobs", type=positive_int, default=None, metavar="N",
                         help="kernels compiled at once (default: the CPUs this process may use, "
                              "at most 8)")
    kernels.set_defaults(func=lambda a: cmd_kernels(_with_default_arch(a)))


def _with_default_arch(args: argparse.Namespace) -> argparse.Namespace:
    if not args.arch:
        args.arch = ["sm_80", "sm_90"]
    return args
