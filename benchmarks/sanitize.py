"""Every CUDA kernel of the package under compute-sanitizer (memcheck, racecheck, initcheck).

Run from the repository root on a CUDA machine:

    python benchmarks/sanitize.py [--tools memcheck,racecheck,initcheck] [--json PATH]
                                  [--cases SUBSTRING] [--sanitizer PATH] [--timeout SECONDS]

For each tool it re-invokes itself as ``compute-sanitizer --tool TOOL ... python sanitize.py
--child``; the child runs a small problem of every kernel instance (fused forward, dQ, dK/dV in
fp32/fp16/bf16 at every compiled head dim, neighborhoods and bands, GQA, D_v != D_qk, softcap,
RPB, the sm_80+ pipelined build and the plain one; the four unfused kernels in
fp64/fp32/fp16/bf16). Only the package's kernels are
instrumented (``--kernel-name kns=na_``), PyTorch's caching allocator is off in the child so
every buffer's bounds are exact, and outputs are NaN-filled before each launch so initcheck sees
only the kernels' own reads. The sanitizer's text report is parsed (``parse_report``) into error
and warning counts and each record: its first line, kernel, thread, address and allocation
lines, and the case that produced it (the child marks each case's start; ``by_case`` counts the
printed records per case and kernel, up to ``PRINT_LIMIT``); a JSON summary is written (default
``sanitize.json``) and the exit status is 1 if any tool reports an error, any case fails, or a
report has no summary line (a crashed child). Without a CUDA device it says so and exits 0;
``--list`` prints the cases anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

TOOLS = ("memcheck", "racecheck", "initcheck")
KERNEL_FILTER = "kns=na_"
CASE_MARK = "SANITIZE-CASE"
_PREFIX = re.compile(r"^=+ ?(.*)$")
_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+) errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed \((\d+) errors?, "
                           r"(\d+) warnings?\)")
_CASE = re.compile(rf"^{CASE_MARK} (\S+) (ok|FAILED)(?: (.*))?$")
_CASE_START = re.compile(rf"^{CASE_MARK}-START (\S+)$")
_KERNEL = re.compile(r"^at (?:void )?([^(]+?)(?:\(|\+0x|$)")
PRINT_LIMIT = 2000  # records printed per tool run (each attributed to its case)
DEVICE = "cuda"  # where the cases' tensors live (the CPU tests trace the cases on "meta")
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package is the repository's
    sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------------------------------
# The problems (child side)
# ---------------------------------------------------------------------------------------------

def _device_randn(generator, dtype):
    """``randn`` drawn on the host and copied in (a cudaMemcpy, which initcheck tracks).

    Why: only the package's kernels are instrumented (``--kernel-name kns=na_``), so initcheck
    does not see what torch's own kernels (randn, casts, fills, reductions) write, and it flags
    every read of such memory. The first GPU run (issue 23) reported 595220 16-byte reads, the
    size of the q/k/v/dout row loads, with every output NaN-poisoned and the results right; its
    inputs came from ``torch.randn(device="cuda")``. So every buffer a kernel reads is copied
    in or written by a package kernel (the band case's ``delta``, the unfused rpb's type): what
    is left are real uninitialised reads (``tests/tools/test_sanitize_inputs.py`` checks it)."""
    import torch

    return lambda *s: torch.randn(*s, generator=generator).to(dtype).to(DEVICE)


def _fused_cases():
    """name -> zero-argument function running one fused problem (forward and backward)."""
    import torch

    from cudnn_attn.fallback_kernels import fused as F

    def neighborhood(dtype, d_qk, d_v, spatial, kernel, stride, dilation, causal, heads=(2, 1),
                     rpb=False, softcap=None):
        def run():
            g = torch.Generator().manual_seed(0)
            rnd = _device_randn(g, dtype)
            H, Hkv = heads
            q, k = rnd(1, *spatial, H, d_qk), rnd(1, *spatial, Hkv, d_qk)
            v, dout = rnd(1, *spatial, Hkv, d_v), rnd(1, *spatial, H, d_v)
            geom = {"kernel_size": kernel, "stride": stride, "dilation": dilation,
                    "is_causal": causal, "scale": d_qk ** -0.5, "softcap": softcap}
            bias = _device_randn(g, torch.float32)(H, *(2 * x - 1 for x in kernel)) \
                if rpb else None
            out = torch.full((1, *spatial, H, d_v), math.nan, device=DEVICE, dtype=dtype)
            lse = torch.full((1, *spatial, H), math.nan, device=DEVICE)
            F.na_forward(q, k, v, rpb=bias, out=out, lse=lse, **geom)
            if bias is None:
                F.na_backward(q, k, v, out, lse, dout, **geom)
        return run

    def band(dtype, d, s_q, s_kv, left, right, offset):
        def run():
            from cudnn_attn.model import geometry

            g = torch.Generator().manual_seed(1)
            rnd = lambda s, h, dd: _device_randn(g, dtype)(1, h, s, dd).transpose(1, 2)
            q, k, v, dout = rnd(s_q, 2, d), rnd(s_kv, 1, d), rnd(s_kv, 1, d), rnd(s_q, 2, d)
            table = geometry.band_table(s_q, s_kv, left, right, offset)
            boxes = F.choose_tiles(tuple(table), 1)
            nan = lambda *s: torch.full(s, math.nan, device=DEVICE, dtype=dtype)
            out = nan(1, 2, s_q, d).transpose(1, 2)
            lse = torch.full((1, 2, s_q), math.nan, device=DEVICE).transpose(1, 2)
            F.run_forward(q, k, v, out, lse, table, boxes, d ** -0.5)
            # As the backend builds it, on the package's own kernel: a delta torch computes is
            # written where initcheck does not look (3 x 640 reports in the third H200 run).
            delta = F.backward_delta(out, dout, lse)
            dq, dk, dv = (nan(1, h, s, d).transpose(1, 2) for h, s in ((2, s_q), (1, s_kv),
                                                                     (1, s_kv)))
            F.run_backward(q, k, v, dout, lse, delta, dq, dk, dv, table, boxes, d ** -0.5)
        return run

    cases = {}
    for dname, dtype in (("fp32", torch.float32), ("fp16", torch.float16),
                         ("bf16", torch.bfloat16)):
        for hd in F.HEAD_DIMS:
            d_v = hd if hd == 32 else hd - 8  # D_v != D_qk above the smallest bucket
            cases[f"fused-{dname}-hd{hd}-2d"] = neighborhood(
                dtype, hd, d_v, (9, 10), (3, 5), (1, 2), (2, 1), (False, True))
        cases[f"fused-{dname}-1d-rpb"] = neighborhood(dtype, 32, 32, (40,), (7,), (1,), (1,),
                                                      (False,), heads=(2, 2), rpb=True)
        cases[f"fused-{dname}-3d-softcap"] = neighborhood(
            dtype, 32, 32, (4, 5, 6), (3, 3, 3), (1, 1, 2), (1, 2, 1), (True, False, False),
            softcap=2.0)
        cases[f"fused-{dname}-band-causal-empty-rows"] = band(dtype, 64, 70, 40, -1, 0, -30)
        if dtype != torch.float32:  # on sm_80+ the above ran the pipelined build; the plain one:
            cases[f"fused-{dname}-plain-build-hd64-2d"] = _plain_build(neighborhood(
                dtype, 64, 56, (9, 10), (3, 5), (1, 2), (2, 1), (False, True)))
            # On sm_90+ the wide kernels (forward and dQ over 128-query boxes, dK/dV over
            # 128-key boxes up to head dim 64), whatever the tile model says.
            for hd in F.HEAD_DIMS:
                cases[f"fused-{dname}-wide-hd{hd}-2d"] = _wide_boxes(neighborhood(
                    dtype, hd, hd if hd == 32 else hd - 8, (12, 20), (5, 9), (1, 1), (1, 2),
                    (True, False)))
            # On sm_90 the opt-in wgmma forwards (64-query and wide boxes) at head dims 64, 128.
            for hd in (64, 128):
                run = neighborhood(dtype, hd, hd - 8, (12, 20), (5, 9), (1, 1), (1, 2),
                                   (True, False))
                cases[f"fused-{dname}-wgmma-hd{hd}-2d"] = _wgmma(run)
                cases[f"fused-{dname}-wgmma-wide-hd{hd}-2d"] = _wide_boxes(_wgmma(run))
    return cases


def _wide_boxes(run):
    """``run`` with every kernel on the wide kernels' boxes (``tile_model.wide_tiles``,
    ``wide_key_tiles``) where the device runs them (sm_90+; elsewhere the 64-slot kernels)."""
    def wrapped():
        from unittest import mock

        from cudnn_attn.fallback_kernels import tile_model

        with mock.patch.multiple(tile_model, forward_tiles=tile_model.wide_tiles,
                                 dkdv_tiles=tile_model.wide_key_tiles):
            run()
    return wrapped


def _with_env(name: str, value: str, run):
    """``run`` with the environment variable ``name`` set to ``value``."""
    def wrapped():
        with mock.patch.dict(os.environ, {name: value}):
            run()
    return wrapped


def _plain_build(run):
    """``run`` with the fused module's pipelined sm_80+ build switched off."""
    return _with_env("CUDNN_ATTN_FUSED_PIPELINED", "0", run)


def _wgmma(run):
    """``run`` with the opt-in wgmma forwards (``fused_build.hopper``; sm_90 only, elsewhere the
    same kernels as without)."""
    return _with_env("CUDNN_ATTN_NA_WGMMA", "1", run)


def _unfused_cases():
    import torch

    from cudnn_attn.fallback_kernels import unfused as U
    from cudnn_attn.model.problem import accumulator_dtype

    def run_all(dtype):
        def run():
            g = torch.Generator().manual_seed(2)
            spatial, kernel, dilation, causal = (6, 7), (3, 3), (2, 1), (False, False)
            rnd = _device_randn(g, dtype)
            q, k, v, d_out = (rnd(1, 2, *spatial, 8) for _ in range(4))
            # The bias in the accumulator type, as qk_forward reads it (fp16/bf16 values): a
            # 16-bit one would be cast by torch on the device, where initcheck does not look.
            rpb = torch.randn(*U.rpb_shape(2, kernel), generator=g).to(dtype).to(
                accumulator_dtype(dtype)).to(DEVICE)
            attn = U.qk_forward(q, k, rpb, kernel, dilation, causal)
            U.qk_backward(attn, q, k, kernel, dilation, causal, True)
            U.av_forward(attn, v, kernel, dilation, causal)
            U.av_backward(d_out, attn, v, kernel, dilation, causal)
            U.qk_forward(q, k, None, (2, 3), dilation, (True, False))  # causal, no rpb
        return run

    return {f"unfused-{n}": run_all(dt) for n, dt in (("fp64", torch.float64),
                                                     ("fp32", torch.float32),
                                                     ("fp16", torch.float16),
                                                     ("bf16", torch.bfloat16))}


def case_names() -> list[str]:
    """Every case the child runs (importable without a GPU: the functions are only built)."""
    return list(_fused_cases()) + list(_unfused_cases())


def run_child(pattern: str | None) -> int:
    import torch

    cases = {**_fused_cases(), **_unfused_cases()}
    failed = 0
    for name, run in cases.items():
        if pattern and pattern not in name:
            continue
        start = time.perf_counter()
        print(f"{CASE_MARK}-START {name}", flush=True)  # the records that follow are this case's
        try:
            run()
            torch.cuda.synchronize()
            print(f"{CASE_MARK} {name} ok {time.perf_counter() - start:.3f}", flush=True)
        except Exception as exc:  # noqa: BLE001 - recorded; the other cases still run
            failed += 1
            detail = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
            print(f"{CASE_MARK} {name} FAILED {detail}", flush=True)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# Reading compute-sanitizer's text report (parent side)
# ---------------------------------------------------------------------------------------------

def parse_report(text: str) -> dict:
    """Counts and records of one compute-sanitizer run.

    Lines the tool prints start with ``=========``; a record starts at an unindented line
    (``Invalid __global__ read ...``, ``Error: Race reported ...``, ``Uninitialized __global__
    memory read ...``) and its indented lines follow. ``errors`` is the larger of the ERROR
    SUMMARY and the RACECHECK SUMMARY error counts (None without any summary: the run did not
    finish); ``warnings`` the racecheck warnings. The child's case lines are collected too.
    """
    errors = warnings = None
    records: list[str] = []
    details: list[dict] = []
    cases = {"ok": [], "failed": {}}
    current = None  # the case whose kernels are running (SANITIZE-CASE-START ... its verdict)
    for line in text.splitlines():
        start = _CASE_START.match(line.strip())
        if start:
            current = start.group(1)
            continue
        case = _CASE.match(line.strip())
        if case:
            if case.group(2) == "ok":
                cases["ok"].append(case.group(1))
            else:
                cases["failed"][case.group(1)] = case.group(3) or ""
            current = None
            continue
        m = _PREFIX.match(line)
        if m is None:
            continue
        body = m.group(1)
        summary = _ERROR_SUMMARY.search(body)
        race = _RACE_SUMMARY.search(body)
        if summary:
            errors = max(errors or 0, int(summary.group(1)))
        elif race:
            errors = max(errors or 0, int(race.group(2)))
            warnings = (warnings or 0) + int(race.group(3))
        elif body and not body[0].isspace() and not body.startswith("COMPUTE-SANITIZER"):
            records.append(body.strip())
            details.append({"message": body.strip(), "case": current, "kernel": None,
                            "at": None, "thread": None, "address": []})
        elif body.strip() and details and not body.strip().startswith("Host Frame"):
            _add_detail(details[-1], body.strip())
    return {"errors": errors, "warnings": warnings or 0, "records": records, "details": details,
            "by_case": _by_case(details), "cases": cases}


def _add_detail(record: dict, line: str) -> None:
    """One indented line of a record: where (kernel and offset), which thread, which address
    and allocation."""
    kernel = _KERNEL.match(line)
    if kernel and record["at"] is None:
        record["kernel"], record["at"] = kernel.group(1), line[3:]
    elif line.startswith("by thread") and record["thread"] is None:
        record["thread"] = line[3:]
    elif line.startswith(("Address", "and is", "Access at", "Allocation")) or \
            "allocation" in line:
        record["address"].append(line)


def _by_case(details: list[dict]) -> dict:
    """``{case: {"kernel: message": count}}`` over the printed records (up to the print limit)."""
    table: dict = {}
    for d in details:
        key = f"{d['kernel']}: {d['message']}"
        per_case = table.setdefault(d["case"] or "(outside any case)", {})
        per_case[key] = per_case.get(key, 0) + 1
    return table


def verdict(report: dict, returncode: int) -> list[str]:
    """Why one tool's run fails (empty: clean)."""
    why = []
    if report["errors"] is None:
        why.append("no summary line: the sanitized run did not finish")
    elif report["errors"]:
        why.append(f"{report['errors']} error(s)")
    if report["cases"]["failed"]:
        why.append("failed cases: " + ", ".join(sorted(report["cases"]["failed"])))
    if returncode != 0 and not why:
        why.append(f"exit status {returncode}")
    return why


# ---------------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------------

def find_sanitizer(explicit: str | None) -> str | None:
    """compute-sanitizer: --sanitizer, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin, or the
    ``nvidia-cuda-sanitizer-api-cu12`` wheel."""
    candidates = [explicit] if explicit else []
    found = shutil.which("compute-sanitizer")
    candidates += [found] if found else []
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            candidates.append(os.path.join(home, "bin", "compute-sanitizer"))
    try:
        import nvidia.cuda_sanitizer_api as wheel  # type: ignore[import-not-found]

        for root in wheel.__path__:
            candidates.append(os.path.join(root, "compute-sanitizer", "compute-sanitizer"))
    except ImportError:
        pass
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def sanitizer_command(sanitizer: str, tool: str, cases: str | None, kernel_filter: str) -> list:
    cmd = [sanitizer, "--tool", tool, "--print-limit", str(PRINT_LIMIT)]
    if kernel_filter:
        cmd += ["--kernel-name", kernel_filter]
    cmd += [sys.executable, os.path.abspath(__file__), "--child"]
    if cases:
        cmd += ["--cases", cases]
    return cmd


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}")
    return env


def write_summary(path: str, summary: dict, complete: bool) -> None:
    """Rewrite the summary whole after each tool (through a rename), so a run cut short keeps
    the tools that finished; ``complete`` is False until the last one has."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(json.dumps({**summary, "complete": complete}, indent=2) + "\n")
    os.replace(partial, target)


def run_parent(args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("sanitize.py: no CUDA device here; compute-sanitizer runs only on a GPU host. "
              "Nothing was run.")
        return 0
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        print("sanitize.py: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/"
              "bin, or pip install nvidia-cuda-sanitizer-api-cu12); pass --sanitizer PATH",
              file=sys.stderr)
        return 2
    child_env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    summary = {"sanitizer": sanitizer, "environment": environment(), "tools": {}}
    failed = False
    for tool in args.tools:
        cmd = sanitizer_command(sanitizer, tool, args.cases, args.kernel_filter)
        print(f"[{tool}] {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        try:
            # One stream: the sanitizer's records stay between the case marks that bound them.
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=child_env, timeout=args.timeout, check=False)
            text, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as exc:
            text = (exc.stdout or b"").decode(errors="replace") if isinstance(
                exc.stdout, bytes) else (exc.stdout or "")
            code = -1
        report = parse_report(text)
        why = verdict(report, code)
        if code == -1:
            why.append(f"timed out after {args.timeout} s")
        failed = failed or bool(why)
        summary["tools"][tool] = {
            "ok": not why, "why": why, "errors": report["errors"], "warnings": report["warnings"],
            "records": report["records"][:50], "details": report["details"][:50],
            "by_case": report["by_case"], "cases_ok": len(report["cases"]["ok"]),
            "cases_failed": report["cases"]["failed"], "exit_status": code,
            "seconds": round(time.perf_counter() - start, 1)}
        state = "clean" if not why else "FAIL: " + "; ".join(why)
        print(f"[{tool}] {len(report['cases']['ok'])} cases, {state}", flush=True)
        write_summary(args.json, summary, complete=tool == args.tools[-1])
    print(f"summary: {args.json}")
    return 1 if failed else 0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help="comma-separated subset of " + ", ".join(TOOLS))
    parser.add_argument("--json", default="sanitize.json", help="summary file (default %(default)s)")
    parser.add_argument("--cases", default=None, help="run only cases whose name contains this")
    parser.add_argument("--sanitizer", default=None, help="path of compute-sanitizer")
    parser.add_argument("--kernel-filter", default=KERNEL_FILTER,
                        help="compute-sanitizer --kernel-name value ('' instruments every kernel)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per tool")
    parser.add_argument("--list", action="store_true", help="print the case names and exit")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown or not tools:
        parser.error(f"--tools must name some of {', '.join(TOOLS)}; got {args.tools!r}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}")
    args.tools = tools
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(n for n in case_names() if not args.cases or args.cases in n))
        return 0
    if args.child:
        return run_child(args.cases)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
