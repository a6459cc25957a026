"""Where the host time of a call goes on a GPU, ours next to torch's (torch.profiler, GPU only).

Run from the repository root:  python benchmarks/host_profile.py [--results-dir DIR]

The H200 run of 2026-11-29 (`results/gpu-2026-11-29.md`) left two gaps the kernels do not
explain: the cuDNN engine's backward alone, one call between two synchronisations, took
0.15-0.45 ms longer than torch's cuDNN backward on the same kernels (S = 1024 to 4096), and
``flash_attn_varlen_func`` forward + backward on a tiny packed batch took 1105 us against 396 us
for torch's padded call. For each of those calls (and its peer) this records the enqueue time
per call (the host's part: calls made back to back after a synchronisation) and torch.profiler's
operators and kernels per call (self CPU and device microseconds, calls), and the timeline of a
synchronized call (``call_costs.timeline``: host range, first kernel's start, device busy and
idle, latency), so the next change aims at what the host really spends. JSON: results/host_profile-<date>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path (tests)
import _report  # noqa: E402  benchmarks/_report.py
import call_costs  # noqa: E402  a synchronized call's timeline
import varlen_rows  # noqa: E402  imported before unshadowing: that takes this folder off sys.path

_report.unshadow_cudnn()  # this folder's cudnn.py is not the cuDNN frontend
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package is the repository's
    sys.path.insert(0, str(ROOT))
CALLS, TOP = 20, 25
BACKWARD_SHAPE = (16, 16, 1024, 128)  # the record's S = 1024 row: B, H, S, D (bf16)


def calls() -> dict:
    """``{label: one call}``: the tiny varlen rows (``varlen_rows``) and the S = 1024 backward,
    ours and torch's cuDNN SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cudnn_attn as ca

    found = dict(varlen_rows.calls("cuda"))
    q, k, v = (torch.randn(BACKWARD_SHAPE, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = ca.attention(q, k, v, backend="cudnn")
    dout = torch.randn_like(out)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = sdpa(q, k, v)
    found["bwd S=1024: ours"] = lambda: torch.autograd.grad(out, (q, k, v), dout,
                                                            retain_graph=True)
    found["bwd S=1024: torch-cudnn"] = lambda: torch.autograd.grad(ref, (q, k, v), dout,
                                                                   retain_graph=True)
    return found


def profile_call(fn, n: int = CALLS) -> dict:
    """Enqueue microseconds per call, and the profiler's operators per call (top ``TOP`` by
    self CPU time) with the kernels' device time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    enqueue_us = 1e6 * (time.perf_counter() - start) / n
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [{"name": e.key, "calls_per_call": e.count / n,
            "self_cpu_us_per_call": e.self_cpu_time_total / n,
            "device_us_per_call": getattr(e, "self_device_time_total",
                                          getattr(e, "self_cuda_time_total", 0.0)) / n}
           for e in events[:TOP]]
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP,
                                    max_name_column_width=70))
    return {"enqueue_us": enqueue_us, "ops": ops}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=_report.RESULTS_DIR,
                        help="where the JSON goes (default benchmarks/results)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/host_profile.py profiles calls on a CUDA GPU; torch sees none here. "
              "Nothing was run or written (benchmarks/cudnn_host.py and na_host.py measure the "
              "host time on the CPU).")
        return 0
    rows = []
    for label, fn in calls().items():
        print(f"\n===== {label}")
        try:
            rows.append({"call": label, **profile_call(fn),
                         "timeline": call_costs.timeline(fn)})
        except RuntimeError as exc:  # a peer that cannot run the call here
            rows.append({"call": label, "error": str(exc).splitlines()[0][:300]})
        print(f"enqueue: {rows[-1].get('enqueue_us', float('nan')):.1f} us per call")
        line = rows[-1].get("timeline")
        if line:
            print("one synchronized call, us: " + ", ".join(
                f"{k} {v:.1f}" for k, v in line.items() if isinstance(v, float)))
    path = _report.write_json("host_profile", {"calls": CALLS, "rows": rows},
                              results_dir=args.results_dir)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
