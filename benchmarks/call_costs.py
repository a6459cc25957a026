"""Call costs for benchmarks/cudnn.py: one call's latency, and the kernels a call launches.

GPU helpers (they need CUDA); ``only_in`` is plain Python.
"""

from __future__ import annotations

import time

LATENCY_SAMPLES = 15


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


def kernels_of(fn) -> list[str]:
    """The CUDA kernels one call of ``fn`` launches (torch.profiler), in launch order."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [e.name for e in sorted(events, key=lambda e: e.time_range.start)
            if not e.name.startswith(("Memcpy", "Memset"))]


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
