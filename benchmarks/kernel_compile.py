"""NVRTC compile times of the CuPy kernels: the unit a first call pays for, and all of them.

The loader compiles each kernel variant as its own NVRTC program. This measures, with the cubin
cache off and nothing memoized (a machine's first call), on the CPU (NVRTC needs no GPU):

* ``first_call``: the kernel a first fused 2-D neighborhood-attention forward needs on an sm_90
  device (fp16, head dim 64: the pipelined build; fp32: the plain build), compiled alone (what
  ``get_function`` compiles now) and as the whole program of its build, every variant in one NVRTC
  program (what ``get_function`` compiled before one program per variant);
* ``compile_all`` (``--all``): every variant for ``--arch`` one program per variant with
  ``--jobs`` threads (each value given), and the same kernels as one program per module (the old
  unit).

Wall and process CPU seconds (all threads) are recorded with the load average, since a shared
machine's wall times vary with its neighbours. Prints a table, writes
``benchmarks/results/kernel_compile-<date>.json``.

    python benchmarks/kernel_compile.py --all --jobs 1 --jobs 2
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import _report  # benchmarks/_report.py (this script's folder is on sys.path)

_report.unshadow_cudnn()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["CUDNN_ATTN_CUBIN_CACHE"] = "off"  # every figure is a cold compile

import torch  # noqa: E402

from cudnn_attn import fallback_kernels  # noqa: E402
from cudnn_attn.core.caches import clear_caches  # noqa: E402
from cudnn_attn.fallback_kernels import _loader, cubin_cache  # noqa: E402
from cudnn_attn.fallback_kernels import fused as F  # noqa: E402


def timed(fn) -> dict:
    """Wall and process CPU seconds of one cold call of ``fn`` (memoized programs dropped)."""
    clear_caches()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"wall_s": round(time.perf_counter() - wall, 2),
            "cpu_s": round(time.process_time() - cpu, 2), "load": os.getloadavg()[0]}


def first_call_rows(arch: str) -> list[dict]:
    """The forward kernel of a first fp16 and a first fp32 fused call (head dim 64), alone and
    as the whole program of its build."""
    rows = []
    for dtype in (torch.float16, torch.float32):
        digits = arch.split("_", 1)[1].rstrip("a")
        use_pipelined = F.pipelined(dtype, (int(digits[:-1]), int(digits[-1])))
        defines, build = ((F.PIPELINED_DEFINES, F.pipelined_variants()) if use_pipelined
                          else (F.DEFINES, F.variants()))
        name = f"na_fused_forward<{F.CTYPES[dtype]},{F.head_dim_bucket(64, 64)}>"
        (variant,) = [v for v in build if v.kernel.split("/")[0] == name]
        every = [v.expression for v in build]
        for unit, expressions in (("one variant", [variant.expression]),
                                  (f"whole program ({len(every)})", every)):
            rows.append({"kernel": variant.kernel, "arch": arch, "unit": unit, **timed(
                lambda e=expressions: _loader.compile_program(F.SOURCE, defines, e, arch))})
    return rows


def compile_all_rows(arch: str, jobs: list[int]) -> list[dict]:
    """Every variant for ``arch``: per variant with each ``jobs``, and per module (old unit)."""
    rows = []
    count = sum(map(len, fallback_kernels.kernel_programs(arch).values()))
    for n in jobs:
        rows.append({"kernel": f"all {count}", "arch": arch, "unit": f"per variant, jobs={n}",
                     **timed(lambda n=n: fallback_kernels.compile_all(arch, jobs=n))})

    def per_module() -> None:
        for name, variants in fallback_kernels.kernel_programs(arch).items():
            module = importlib.import_module(f"cudnn_attn.fallback_kernels.{name}")
            _loader.compile_program(module.SOURCE, module.DEFINES,
                                    [v.expression for v in variants], arch)

    rows.append({"kernel": f"all {count}", "arch": arch, "unit": "per module (3 programs)",
                 **timed(per_module)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", help="target (default sm_90)")
    parser.add_argument("--all", action="store_true", help="also time every kernel (minutes)")
    parser.add_argument("--jobs", type=int, action="append",
                        help="compile_all threads for --all (repeatable; default 1 and the CPUs)")
    parser.add_argument("--no-json", action="store_true", help="print only")
    args = parser.parse_args()
    columns = ["kernel", "arch", "unit", "wall_s", "cpu_s", "load"]
    rows = first_call_rows(args.arch)
    _report.print_table(rows, columns)
    if args.all:
        every = compile_all_rows(args.arch, args.jobs or [1, fallback_kernels.default_jobs()])
        _report.print_table(every, columns)
        rows += every
    if not args.no_json:
        path = _report.write_json("kernel_compile", {
            "options": vars(args), "cpus": fallback_kernels.default_jobs(),
            "nvrtc": cubin_cache.nvrtc_version(), "rows": rows})
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
