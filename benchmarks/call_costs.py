"""Call costs for benchmarks/cudnn.py and host_profile.py: one call's latency, the kernels a
call launches, and where a synchronized call's time goes (its timeline).

GPU helpers (they need CUDA); ``only_in`` and ``summarize_timeline`` are plain Python.
"""

from __future__ import annotations

import time

LATENCY_SAMPLES = 15
TIMELINE_SAMPLES = 5


def latency_ms(fn, samples: int = LATENCY_SAMPLES) -> float:
    """Median milliseconds of one call between two synchronisations (queue empty at the start):
    what a caller waiting for each result sees, its host launch time included."""
    import torch  # here: cudnn.py imports this module before it unshadows `cudnn`

    fn()
    times = []
    for _ in range(samples):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def only_in(ours: list[str], theirs: list[str]) -> list[str]:
    """The kernels of ``ours`` with no kernel of the same name in ``theirs`` (counted: ours
    launching a kernel twice where theirs launches it once lists it once)."""
    left = list(theirs)
    extra = []
    for name in ours:
        if name in left:
            left.remove(name)
        else:
            extra.append(name)
    return extra


def timeline(fn, samples: int = TIMELINE_SAMPLES) -> dict:
    """Where one call's latency goes (``summarize_timeline``), from torch.profiler over
    ``samples`` calls each between two synchronisations: the host's time, when the first kernel
    started, how long the device computed and how long it sat idle in between. A latency above
    the kernels' own time is then either host time before the first kernel or gaps between
    kernels, and this says which."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(samples):
            torch.cuda.synchronize()
            with record_function(f"call#{i}"):
                fn()
            torch.cuda.synchronize()
    calls, kernels = [], []
    for e in prof.events():
        span = (e.time_range.start, e.time_range.end)
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((*span, e.name))
        elif e.name.startswith("call#"):
            calls.append(span)
    return summarize_timeline(calls, kernels)


def summarize_timeline(calls: list[tuple[float, float]],
                       kernels: list[tuple[float, float, str]]) -> dict:
    """Per call (host ranges ``calls`` in microseconds, the device's ``kernels`` as (start, end,
    name), one clock), the medians of: ``host_us`` (the call's own host range),
    ``first_kernel_us`` (from the call's start to its first kernel's), ``busy_us`` (device time
    covered by kernels, overlaps counted once), ``idle_us`` (between its first kernel's start
    and its last one's end, nothing ran) and ``latency_us`` (call start to last kernel end, or
    to the host's end when later); ``kernels``: the first call's kernel names in order. A
    kernel belongs to the call in whose window [start, next call's start) it started."""
    calls = sorted(calls)
    per_call = []
    for i, (start, end) in enumerate(calls):
        until = calls[i + 1][0] if i + 1 < len(calls) else float("inf")
        mine = sorted(k for k in kernels if start <= k[0] < until)
        busy, reach = 0.0, None
        for k_start, k_end, _ in mine:  # union of the kernels' intervals
            if reach is None or k_start >= reach:
                busy += k_end - k_start
                reach = k_end
            elif k_end > reach:
                busy += k_end - reach
                reach = k_end
        first = mine[0][0] if mine else None
        last = max((k[1] for k in mine), default=None)
        per_call.append({
            "host_us": end - start,
            "first_kernel_us": None if first is None else first - start,
            "busy_us": busy,
            "idle_us": None if first is None else (last - first) - busy,
            "latency_us": max(end, last if last is not None else end) - start,
            "kernels": [k[2] for k in mine]})

    def median(key):
        values = sorted(c[key] for c in per_call if c[key] is not None)
        return values[len(values) // 2] if values else None

    summary = {key: median(key) for key in
               ("host_us", "first_kernel_us", "busy_us", "idle_us", "latency_us")}
    summary["calls"] = len(per_call)
    summary["kernels"] = per_call[0]["kernels"] if per_call else []
    return summary
