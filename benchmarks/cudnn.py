"""GPU benchmark: the cuDNN engine vs torch SDPA (flash and cudnn backends) and vs a hand-built
cuDNN-frontend graph's ``execute``; cache-hit call overhead; graph build milliseconds.

Run from the repository root on a CUDA machine:  python benchmarks/cudnn.py [--quick]
Without CUDA (or without the cuDNN frontend) it says so and exits 0, writing nothing.

Throughput problems: hidden size 2048 (H = 2048 / D), 16k tokens per batch (B = 16384 / S),
[B, H, S, D] contiguous, fp16/bf16, D in {64, 128}, S in {512 .. 16k}, causal and not; forward,
backward and forward + backward (backward FLOPs = 2.5 x forward). Each is timed two ways:
throughput (back-to-back calls, one synchronisation per batch: ``<engine>_ms`` and TFLOP/s) and
latency (one call between two synchronisations, the host's launch included: ``<engine>_latency_ms``,
median). For each we time
  * ours:   cudnn_attn.attention(..., backend="cudnn") (forward; and its autograd backward)
  * bare:   the same SDPA graph built by hand with the frontend (reference section 2.1), buffers
            preallocated, timed on ``graph.execute`` alone
  * torch-flash / torch-cudnn: torch.nn.functional.scaled_dot_product_attention under
            sdpa_kernel(FLASH_ATTENTION / CUDNN_ATTENTION)
Host time (issue 35): the tiny call 1 x 8 x 128 x 64 bf16 causal forward, us per call of ours,
torch SDPA's cuDNN and flash backends and the bare execute, back to back; and the same call with
``Padding`` lengths (device tensors and host ints) against torch's padded call as its users write
it (the mask made from the lengths, then ``attn_mask=``); a tiny packed call (``varlen_rows.py``:
``attention_varlen`` forward, ``flash_attn_varlen_func`` forward + backward) against torch's
padded call of the same tokens. Kernels and timelines (issue 35), every shape: the
CUDA kernels one forward + backward launches, ours and torch SDPA's cuDNN backend, from
torch.profiler, and those only one of them launches; and for the backward and forward +
backward of ours, the bare execute and torch's cuDNN backend, where a synchronized call's time
goes (``call_costs.timeline``: host range, first kernel's start, device busy and idle, latency;
``<engine>_timeline`` in the rows). Decode (``decode_rows.py``):
one step against a dense and a paged KV cache with device lengths, us per call, and whether
cuDNN alone keeps NaN stored past the lengths out of the result.
Targets (issues 3, 14 and 35): ours >= 0.98 x bare at large shapes; call within 1.05 x bare execute
on a tiny problem; ours >= torch-cudnn on every shape both ran, in throughput and in latency; the
tiny call's host time <= 1.05 x torch-cudnn's; H200 bf16 D=128 causal S=8k: forward >= 640,
backward >= 540 TFLOP/s. FP8 rows (``fp8_rows.py``; ``--no-fp8`` skips them): E4M3
``sdpa_fp8`` forward and backward, D=128, ours only (published H200: ~1,060 / ~670 TFLOP/s).
The machine's ceilings (benchmarks/ceilings.py) are measured once
per run, and each throughput row gets ``ours/ceiling`` (ours over the bf16 matmul ceiling).
JSON: <--results-dir>/cudnn-<date>.json (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import timeit
from pathlib import Path

import _report  # benchmarks/_report.py (this script's folder is on sys.path)
import call_costs  # latency, kernel lists (this folder's)
import ceilings  # imported before unshadowing: that takes this folder off sys.path
import decode_rows  # one decode step against a KV cache, and NaN past the lengths
import varlen_rows  # a tiny packed call, ours vs torch's padded one
import fp8_rows  # the FP8 rows (sdpa_fp8 / sdpa_fp8_backward, E4M3, D=128)

_report.unshadow_cudnn()  # this folder's cudnn.py is not the cuDNN frontend
import torch

TOKENS, HIDDEN = 16384, 2048
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
# S % 128 == 64: the training graphs carry a full-length padding mask (graphs._spec._open_tiles,
# cuDNN's open tails), whose cost these rows show; --seqs only (FP8 rows skip them)
TAIL_SEQS = (8128,)
TARGET_TFLOPS = {"fwd": 640.0, "bwd": 540.0}  # H200, bf16, D=128, causal, S=8k
TARGET_VS_BARE, TARGET_OVERHEAD, TARGET_VS_TORCH_CUDNN = 0.98, 1.05, 1.0
TARGET_HOST_VS_TORCH = 1.05  # the tiny causal call's host time over torch-cudnn's
TINY_CALL = "attention(backend='cudnn')"  # the overhead row the tiny-call target reads
TINY_CAUSAL = (1, 8, 128, 64)  # issue 35's host-time problem (bf16, causal forward)
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
TIMELINE_DIRECTIONS = ("bwd", "fwd+bwd")  # where the latency misses were (2026-11-30)


def flops(b, h, s, d, causal, direction):
    f = 4.0 * b * h * s * s * d / (2 if causal else 1)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[direction]


def bare_graph(q, causal, backward):
    """The SDPA graph written directly against the frontend, as its samples do."""
    import cudnn

    from cudnn_attn.graphs._runtime import handle_for

    handle = handle_for(q.device)
    io = cudnn.data_type.HALF if q.dtype == torch.float16 else cudnn.data_type.BFLOAT16
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    b, h, s, d = q.shape
    st = list(q.stride())

    def t(name, uid, dim=(b, h, s, d), stride=st, dt=io):
        return g.tensor(name=name, dim=list(dim), stride=list(stride), data_type=dt, uid=uid)

    Q, K, V = t("q", 1), t("k", 2), t("v", 3)
    mask = dict(diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                diagonal_band_right_bound=0) if causal else {}
    if not backward:
        out_t, stats = g.sdpa(name="sdpa", q=Q, k=K, v=V, attn_scale=d ** -0.5, generate_stats=True,
                          **mask)
        out_t.set_output(True).set_dim([b, h, s, d]).set_stride(st).set_uid(4)
        stats.set_output(True).set_data_type(cudnn.data_type.FLOAT).set_uid(5)
        uids = (1, 2, 3, 4, 5)
    else:
        out_t, dO = t("o", 4), t("do", 6)
        stats = t("stats", 5, (b, h, s, 1), (h * s, s, 1, 1), cudnn.data_type.FLOAT)
        dQ, dK, dV = g.sdpa_backward(name="sdpa_backward", q=Q, k=K, v=V, o=out_t, dO=dO, stats=stats,
                                     attn_scale=d ** -0.5, **mask)
        for x, uid in ((dQ, 7), (dK, 8), (dV, 9)):
            x.set_output(True).set_dim([b, h, s, d]).set_stride(st).set_uid(uid)
        uids = (1, 2, 3, 4, 6, 5, 7, 8, 9)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return g, handle, uids


def timed(fn, args, number=None):
    torch.cuda.synchronize()
    if number is None:  # aim at about 50 ms per batch
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        number = max(1, min(200, int(0.05 / max(time.perf_counter() - start, 1e-6))))
    return _report.time_ms(fn, warmup=args.warmup, repeats=args.repeats, number=number,
                           sync=torch.cuda.synchronize)


def tuned_calls(q, k, v, mask, dout):
    """``{direction: fn}`` of ``attention(backend="cudnn")`` on graphs autotuned
    (``CUDNN_ATTN_AUTOTUNE=1``): the engine's caches are emptied and the graphs rebuilt under
    the switch, tuned by a first call here (untimed); the switch is off again on return, and
    the tuned graphs stay in the graph cache (``bench_shape`` empties it after timing them)."""
    import os

    import cudnn_attn as ca
    from cudnn_attn.graphs import autotune

    ca.clear_caches()
    os.environ[autotune.ENV] = "1"
    try:
        out = ca.attention(q, k, v, mask=mask, backend="cudnn")
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # tunes both graphs
    finally:
        del os.environ[autotune.ENV]
    plan_graphs = [g for g in _plans_graphs() if getattr(g, "tuned", False)]
    print("  tuned: " + "; ".join(f"{'bwd' if g.backward else 'fwd'} {g.engine}".replace("\n", " ")
                                  for g in plan_graphs))

    def both():
        torch.autograd.grad(ca.attention(q, k, v, mask=mask, backend="cudnn"), (q, k, v), dout)

    return {"fwd": lambda: ca.attention(q, k, v, mask=mask, backend="cudnn"),
            "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
            "fwd+bwd": both}


def _plans_graphs():
    from cudnn_attn.graphs.cache import graph_cache

    return [graph_cache.peek(key) for key in graph_cache.keys()]


def bench_shape(dtype, d, s, causal, args):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cudnn_attn as ca

    h, b = HIDDEN // d, max(1, TOKENS // s)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    mask = ca.Causal() if causal else None
    rows = []
    out = ca.attention(q, k, v, mask=mask, backend="cudnn")
    dout = torch.randn_like(out)

    def ours_both():
        torch.autograd.grad(ca.attention(q, k, v, mask=mask, backend="cudnn"), (q, k, v), dout)

    ours = {"fwd": lambda: ca.attention(q, k, v, mask=mask, backend="cudnn"),
            "bwd": lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
            "fwd+bwd": ours_both}
    torch_fns = {}
    for label, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION),
                           ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                ref = sdpa(q, k, v, is_causal=causal)

            def fwd(backend=backend):
                with sdpa_kernel(backend):
                    return sdpa(q, k, v, is_causal=causal)

            def both(fwd=fwd):
                torch.autograd.grad(fwd(), (q, k, v), dout)

            torch_fns[label] = {"fwd": fwd,
                                "bwd": lambda ref=ref: torch.autograd.grad(ref, (q, k, v), dout,
                                                                           retain_graph=True),
                                "fwd+bwd": both}
        except RuntimeError as exc:  # that SDPA backend cannot run this shape here
            torch_fns[label] = str(exc).splitlines()[0]
    bare = {}
    o, st = torch.empty_like(q), torch.empty(b, h, s, 1, device="cuda", dtype=torch.float32)
    grads = [torch.empty_like(q) for _ in range(3)]
    for direction in ("fwd", "bwd"):  # the forward first: it fills o and st for the backward
        g, handle, uids = bare_graph(q, causal, direction == "bwd")
        ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
        bufs = [q, k, v, o, st] if direction == "fwd" else [q, k, v, o, dout, st, *grads]
        bare[direction] = (lambda g=g, bufs=bufs, ws=ws, handle=handle, uids=uids:
                           g.execute(bufs, ws, handle=handle, tensor_uids=uids))
        bare[direction]()
    bare["fwd+bwd"] = lambda: (bare["fwd"](), bare["bwd"]())
    for direction in DIRECTIONS:
        work = flops(b, h, s, d, causal, direction)
        row = {"dtype": str(dtype).split(".")[-1], "D": d, "S": s, "B": b, "H": h,
               "causal": causal, "dir": direction}
        for label, fn in (("ours", ours[direction]), ("bare", bare[direction])):
            row[f"{label}_ms"] = timed(fn, args)
            row[f"{label}_latency_ms"] = call_costs.latency_ms(fn)
            row[f"{label}_tflops"] = work / row[f"{label}_ms"] / 1e9
        row["ours/bare"] = row["bare_ms"] / row["ours_ms"]
        for label, fns in torch_fns.items():
            if isinstance(fns, str):
                row[f"{label}_tflops"] = None
                row[f"{label}_error"] = fns
                continue
            try:
                row[f"{label}_ms"] = timed(fns[direction], args)
                row[f"{label}_latency_ms"] = call_costs.latency_ms(fns[direction])
                row[f"{label}_tflops"] = work / row[f"{label}_ms"] / 1e9
            except RuntimeError as exc:  # e.g. a backward that SDPA backend lacks
                row[f"{label}_tflops"] = None
                row[f"{label}_error"] = str(exc).splitlines()[0]
        if row.get("torch-cudnn_tflops"):
            row["ours/torch-cudnn"] = row["torch-cudnn_ms"] / row["ours_ms"]
            row["ours/torch-cudnn latency"] = (row["torch-cudnn_latency_ms"]
                                               / row["ours_latency_ms"])
        rows.append(row)
    if args.kernels and isinstance(torch_fns.get("torch-cudnn"), dict):
        # Every shape: whether ours and torch launch the same kernels there (a throughput gap
        # on the same kernels is then layout or launch, not the plan), and where a
        # synchronized call's latency goes (host before the first kernel, or gaps between).
        engines = {"ours": ours, "bare": bare, "torch-cudnn": torch_fns["torch-cudnn"]}
        for row in rows:
            if row["dir"] in TIMELINE_DIRECTIONS:
                for label, fns in engines.items():
                    row[f"{label}_timeline"] = call_costs.timeline(fns[row["dir"]])
        both = next(r for r in rows if r["dir"] == "fwd+bwd")
        mine, theirs = both["ours_timeline"]["kernels"], both["torch-cudnn_timeline"]["kernels"]
        args.kernel_records.append({
            "shape": f"{rows[0]['dtype']} B={b} H={h} S={s} D={d} "
                     f"{'causal' if causal else 'full'} fwd+bwd",
            "ours": mine, "torch-cudnn": theirs, "ours_only": call_costs.only_in(mine, theirs),
            "torch_only": call_costs.only_in(theirs, mine)})
    if args.autotune:  # after the rest: tuning replaces the cached graphs ours ran on
        tuned = tuned_calls(q, k, v, mask, dout)
        for row in rows:
            direction = row["dir"]
            row["ours-tuned_ms"] = timed(tuned[direction], args)
            row["ours-tuned_latency_ms"] = call_costs.latency_ms(tuned[direction])
            row["ours-tuned_tflops"] = flops(b, h, s, d, causal, direction) / \
                row["ours-tuned_ms"] / 1e9
            if row.get("torch-cudnn_ms"):
                row["ours-tuned/torch-cudnn"] = row["torch-cudnn_ms"] / row["ours-tuned_ms"]
        ca.clear_caches()  # the next shape starts from heuristic plans again
    return rows


def timeline_rows(rows: list[dict]) -> list[dict]:
    """One printable row per shape, direction and engine that has a ``<engine>_timeline``."""
    found = []
    for row in rows:
        for engine in ("ours", "bare", "torch-cudnn"):
            line = row.get(f"{engine}_timeline")
            if line:
                found.append({"S": row["S"], "causal": row["causal"], "dir": row["dir"],
                              "engine": engine, **{k: v for k, v in line.items()
                                                   if k != "kernels"}})
    return found


def bench_overhead(args):
    """Host cost of a cache-hit call on a tiny problem vs the bare execute; lookup alone."""
    import cudnn_attn as ca
    from cudnn_attn.graphs.cache import graph_cache

    q, k, v = (torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    ca.attention(q, k, v, backend="cudnn")
    g, handle, uids = bare_graph(q, False, False)
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    bufs = [q, k, v, torch.empty_like(q), torch.empty(1, 1, 128, 1, device="cuda")]
    n = args.overhead_iters
    calls = {"bare execute": lambda: g.execute(bufs, ws, handle=handle, tensor_uids=uids),
             TINY_CALL: lambda: ca.attention(q, k, v, backend="cudnn"),
             "attention() auto": lambda: ca.attention(q, k, v)}
    us = {label: 1e3 * _report.time_ms(fn, warmup=n, repeats=args.repeats, number=n,
                                        sync=torch.cuda.synchronize) for label, fn in calls.items()}
    key = next(iter(graph_cache.keys()))
    lookup = 1e6 * min(timeit.repeat(lambda: graph_cache.get_or_build(key, None), number=10000,
                                     repeat=5)) / 10000
    rows = [{"call": label, "us_per_call": t, "vs_bare": t / us["bare execute"]}
            for label, t in us.items()]
    rows.append({"call": "graph_cache hit (host lookup)", "us_per_call": lookup, "vs_bare": None})
    return rows + bench_tiny_causal(args)


def bench_tiny_causal(args):
    """Issue 35's host-time rows: 1 x 8 x 128 x 64 bf16 causal forward, back to back (the GPU
    work is a few microseconds, so the host's time per call sets the pace): ours, torch SDPA's
    cuDNN and flash backends, the bare execute; ``vs_torch_cudnn`` = us / torch-cudnn's us."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cudnn_attn as ca

    q, k, v = (torch.randn(TINY_CAUSAL, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = ca.Causal()
    g, handle, uids = bare_graph(q, True, False)
    ws = torch.empty(g.get_workspace_size(), device="cuda", dtype=torch.uint8)
    bufs = [q, k, v, torch.empty_like(q), torch.empty(*TINY_CAUSAL[:3], 1, device="cuda")]

    def under(backend):
        def call():
            with sdpa_kernel(backend):
                return sdpa(q, k, v, is_causal=True)
        return call

    calls = {"tiny causal: ours": lambda: ca.attention(q, k, v, mask=mask, backend="cudnn"),
             "tiny causal: torch-cudnn": under(SDPBackend.CUDNN_ATTENTION),
             "tiny causal: torch-flash": under(SDPBackend.FLASH_ATTENTION),
             "tiny causal: bare execute": lambda: g.execute(bufs, ws, handle=handle,
                                                            tensor_uids=uids)}
    us = _host_us(calls, args)
    bare_us, torch_us = us.get("tiny causal: bare execute"), us.get("tiny causal: torch-cudnn")
    return [{"call": label, "us_per_call": t, "vs_bare": t / bare_us if bare_us else None,
             "vs_torch_cudnn": t / torch_us if torch_us else None}
            for label, t in us.items()] + bench_tiny_padded(args, q, k, v) + bench_tiny_varlen(args)


def bench_tiny_varlen(args):
    """``varlen_rows``' tiny packed calls (ours and torch's padded one); an error is printed and
    leaves the rows out, so that it never costs the rows after it."""
    try:
        return varlen_rows.rows(_host_us(varlen_rows.calls("cuda"), args))
    except Exception as exc:  # noqa: BLE001 - a benchmark section, reported and skipped
        print(f"tiny varlen rows not measured: {type(exc).__name__}: {exc}")
        return []


def bench_tiny_padded(args, q, k, v):
    """The same tiny causal call with ``Padding`` lengths (the sequence 100 of 128 tokens):
    ours with device lengths (runtime, passed to the runner per call) and with host lengths
    (static, bound once), against torch SDPA as its users write it (the boolean mask made from
    the lengths per call, then ``attn_mask=``) on its cuDNN and efficient backends;
    ``vs_torch_cudnn`` = us / that torch-cudnn row (torch-efficient's where cuDNN declines)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cudnn_attn as ca

    seq = q.shape[2]
    lengths = torch.tensor([100], device="cuda", dtype=torch.int32)
    runtime = ca.Causal() & ca.Padding(lengths)
    static = ca.Causal() & ca.Padding([100])
    positions = torch.arange(seq, device="cuda")
    below = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()

    def under(backend):
        def call():
            allowed = varlen_rows.padded_mask(positions, lengths, below)
            with sdpa_kernel(backend):
                return sdpa(q, k, v, attn_mask=allowed)
        return call

    calls = {"tiny padded (device lengths): ours":
             lambda: ca.attention(q, k, v, mask=runtime, backend="cudnn"),
             "tiny padded (host lengths): ours":
             lambda: ca.attention(q, k, v, mask=static, backend="cudnn"),
             "tiny padded: torch-cudnn": under(SDPBackend.CUDNN_ATTENTION),
             "tiny padded: torch-efficient": under(SDPBackend.EFFICIENT_ATTENTION)}
    us = _host_us(calls, args)
    torch_us = us.get("tiny padded: torch-cudnn") or us.get("tiny padded: torch-efficient")
    return [{"call": label, "us_per_call": t, "vs_bare": None,
             "vs_torch_cudnn": t / torch_us if torch_us else None} for label, t in us.items()]


def _host_us(calls: dict, args) -> dict:
    """Microseconds per call of each of ``calls``, back to back (one sync per sample); a call
    an SDPA backend cannot run here is left out, with its reason printed."""
    n, us = args.overhead_iters, {}
    for label, fn in calls.items():
        try:
            us[label] = 1e3 * _report.time_ms(fn, warmup=n, repeats=args.repeats, number=n,
                                              sync=torch.cuda.synchronize)
        except RuntimeError as exc:  # that SDPA backend cannot run it here
            print(f"{label}: {str(exc).splitlines()[0]}")
    return us


def bench_builds(args):
    """Milliseconds to build (validate + plan + finalize) forward and backward graphs."""
    import cudnn_attn as ca
    from cudnn_attn.graphs import build_backward, build_forward

    rows = []
    for dtype in args.dtypes:
        for d in (64, 128):
            q, k, v = (torch.randn(2, HIDDEN // d, 4096, d, device="cuda", dtype=dtype,
                                   requires_grad=True) for _ in range(3))
            problem = ca.AttnProblem.from_tensors(q, k, v, mask=ca.Causal())
            for label, build in (("fwd", build_forward), ("bwd", build_backward)):
                built = build(problem)
                rows.append({"graph": f"{label} {str(dtype).split('.')[-1]} D={d} S=4096 causal",
                             "build_ms": 1e3 * built.build_seconds,
                             "workspace_MiB": built.workspace_size / 2 ** 20})
    return rows


def _verdict(value, ok):
    """``{"value", "met"}``: met is None when nothing was measured (value None)."""
    return {"value": value, "met": None if value is None else bool(ok(value))}


def headline_tflops(rows):
    """``{dir: ours TFLOP/s}`` of the headline shape: bf16, D=128, causal, S=8k."""
    return {r["dir"]: r["ours_tflops"] for r in rows
            if r["dtype"] == "bfloat16" and r["D"] == 128 and r["S"] == 8192 and r["causal"]}


def target_verdicts(rows, overhead):
    """``{target: {"value", "met"}}`` from the throughput and overhead rows (also gpu_report's)."""
    tiny = next((r["vs_bare"] for r in overhead if r["call"] == TINY_CALL), None)
    host = next((r.get("vs_torch_cudnn") for r in overhead
                 if r["call"] == "tiny causal: ours"), None)
    padded = next((r.get("vs_torch_cudnn") for r in overhead
                   if r["call"] == "tiny padded (device lengths): ours"), None)
    large = [r["ours/bare"] for r in rows if r["S"] >= 4096 and "ours/bare" in r]  # not FP8
    vs_torch_cudnn = [r["ours_tflops"] / r["torch-cudnn_tflops"] for r in rows
                      if r.get("torch-cudnn_tflops")]
    latency = [r["ours/torch-cudnn latency"] for r in rows if r.get("ours/torch-cudnn latency")]
    headline = headline_tflops(rows)
    return {
        f"tiny call vs bare <= {TARGET_OVERHEAD}": _verdict(tiny, lambda x: x <= TARGET_OVERHEAD),
        f"tiny causal call host time vs torch-cudnn <= {TARGET_HOST_VS_TORCH}":
            _verdict(host, lambda x: x <= TARGET_HOST_VS_TORCH),
        f"tiny padded call (device lengths) host time vs torch's padded call <= "
        f"{TARGET_HOST_VS_TORCH}": _verdict(padded, lambda x: x <= TARGET_HOST_VS_TORCH),
        f"large shapes ours/bare >= {TARGET_VS_BARE} (min)":
            _verdict(min(large, default=None), lambda x: x >= TARGET_VS_BARE),
        f"ours/torch-cudnn >= {TARGET_VS_TORCH_CUDNN} on the same shapes (min)":
            _verdict(min(vs_torch_cudnn, default=None), lambda x: x >= TARGET_VS_TORCH_CUDNN),
        f"ours/torch-cudnn latency >= {TARGET_VS_TORCH_CUDNN} on the same shapes (min)":
            _verdict(min(latency, default=None), lambda x: x >= TARGET_VS_TORCH_CUDNN),
        **{f"bf16 D=128 causal S=8k {k} >= {v} TFLOP/s (H200)":
           _verdict(headline.get(k), lambda x, v=v: x >= v) for k, v in TARGET_TFLOPS.items()},
    }


def verdict_line(target, verdict):
    """``ok  / MISS / n/a  <target>: <value>`` for printing."""
    met, value = verdict["met"], verdict["value"]
    mark = "n/a " if met is None else ("ok  " if met else "MISS")
    return f"{mark} {target}: {'not measured' if value is None else f'{value:.3f}'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--overhead-iters", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="bf16, D=128, S in {1k, 8k} only")
    parser.add_argument("--seqs", type=int, nargs="+", choices=SEQS + TAIL_SEQS, default=None,
                        help="these sequence lengths instead (e.g. the rest of a --quick run's "
                             "curve)")
    parser.add_argument("--no-json", action="store_true", help="print only, write no results file")
    parser.add_argument("--no-fp8", action="store_true",
                        help="skip the FP8 rows (cuDNN's sdpa_fp8 and its backward, D=128)")
    parser.add_argument("--only-fp8", action="store_true",
                        help="the FP8 rows alone (no overhead, build or fp16/bf16 rows)")
    parser.add_argument("--no-ceilings", action="store_true",
                        help="skip measuring the copy and matmul ceilings")
    parser.add_argument("--autotune", action="store_true",
                        help="also time each shape on autotuned graphs (CUDNN_ATTN_AUTOTUNE=1: "
                             "every plan timed on the first call, the fastest kept)")
    parser.add_argument("--no-kernels", action="store_true",
                        help="skip the profiler's kernel lists and call timelines (ours, bare, "
                             "torch-cudnn; backward and forward+backward)")
    parser.add_argument("--results-dir", type=Path, default=_report.RESULTS_DIR,
                        help="where the JSON goes (default benchmarks/results)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/cudnn.py needs a CUDA GPU; torch sees none here. Nothing was run or written.")
        return 0
    if importlib.util.find_spec("cudnn") is None:
        print("benchmarks/cudnn.py needs the cuDNN frontend (pip install 'cudnn-attn[cu12]'). "
              "Nothing was run or written.")
        return 0
    args.dtypes = (torch.bfloat16,) if args.quick else (torch.float16, torch.bfloat16)
    args.kernels, args.kernel_records = not args.no_kernels, []
    dims = (128,) if args.quick else (64, 128)
    seqs = args.seqs or ((1024, 8192) if args.quick else SEQS)
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    machine = None if args.no_ceilings else ceilings.measure()
    print(ceilings.describe(machine) + "\n")

    overhead, builds, rows = [], [], []

    def save(complete: bool = False):
        """The JSON with everything measured so far (rewritten whole after each section and
        shape, so a run cut short keeps its rows; ``complete`` tells the two apart)."""
        if args.no_json:
            return None
        verdicts = target_verdicts(rows, overhead)
        return _report.write_json("cudnn", {
            "options": {k: (str(v) if k == "dtypes" else v) for k, v in vars(args).items()
                        if k != "kernel_records"},
            "kernels": args.kernel_records,
            "device": torch.cuda.get_device_name(), "problem": {"tokens": TOKENS, "hidden": HIDDEN},
            "ceilings": machine, "overhead": overhead, "builds": builds, "throughput": rows,
            "headline_tflops": headline_tflops(rows), "complete": complete,
            # name -> met (as before: gpu_proof.py reads it) and, apart, name -> the figure judged
            "targets": {name: v["met"] for name, v in verdicts.items()},
            "target_values": {name: v["value"] for name, v in verdicts.items()}},
            results_dir=args.results_dir)

    if args.only_fp8:
        args.dtypes = ()
    else:
        overhead = bench_overhead(args)
        save()
        overhead += decode_rows.bench(args)
        save()
        overhead += decode_rows.growing(args)
        save()
        _report.print_table(overhead, ["call", "us_per_call", "vs_bare", "vs_torch_cudnn",
                                       "finite_with_nan_past_lengths", "max_diff_vs_hidden",
                                       "graphs_built", "vs_torch_flash"])
        print(f"target: attention(backend='cudnn') <= {TARGET_OVERHEAD} x bare execute; tiny "
              f"causal ours <= {TARGET_HOST_VS_TORCH} x torch-cudnn\n")
        builds = bench_builds(args)
        save()
        _report.print_table(builds, ["graph", "build_ms", "workspace_MiB"])
    for dtype in args.dtypes:
        for d in dims:
            for s in seqs:
                for causal in (False, True):
                    rows += bench_shape(dtype, d, s, causal, args)
                    save()
    if not args.no_fp8:
        rows += fp8_rows.bench([n for n in seqs if n in SEQS], args, timed, flops, TOKENS,
                               HIDDEN)
    ceilings.add_fraction(rows, machine)
    cols = ["dtype", "D", "S", "causal", "dir", "ours_tflops", "bare_tflops", "ours/bare",
            "torch-flash_tflops", "torch-cudnn_tflops", "ours/torch-cudnn", "ours/ceiling"]
    if args.autotune:
        cols[6:6] = ["ours-tuned_tflops", "ours-tuned/torch-cudnn"]
    print()
    _report.print_table(rows, cols)
    print("\nlatency (one call between synchronisations), ms:")
    _report.print_table(rows, ["dtype", "D", "S", "causal", "dir", "ours_latency_ms",
                               "bare_latency_ms", "torch-flash_latency_ms",
                               "torch-cudnn_latency_ms", "ours/torch-cudnn latency"])
    for record in args.kernel_records:
        print(f"\nkernels per call, {record['shape']}: ours {len(record['ours'])}, torch-cudnn "
              f"{len(record['torch-cudnn'])}; ours only: {record['ours_only'] or 'none'}; "
              f"torch only: {record['torch_only'] or 'none'}")
    if args.kernel_records:
        print("\nwhere a synchronized call's time goes (medians, us: host range, first kernel's "
              "start, device busy, idle between kernels, latency):")
        _report.print_table(timeline_rows(rows), ["S", "causal", "dir", "engine", "host_us",
                                                  "first_kernel_us", "busy_us", "idle_us",
                                                  "latency_us"])
    print()
    for name, verdict in target_verdicts(rows, overhead).items():
        print(f"  {verdict_line(name, verdict)}")
    path = save(complete=True)
    if path is not None:
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
