"""The machine's two ceilings, measured in the same run as a benchmark: device-to-device copy
bandwidth (TB/s, bytes read + written) and a bf16 matmul (TFLOP/s, 2 * n^3 per product).

A benchmark's TFLOP/s mean little without them: ``fraction of matmul ceiling`` compares a kernel
with what this very GPU, at this clock and temperature, reaches on the easiest dense work.

Run alone:  python benchmarks/ceilings.py [--device cuda]   (prints the figures as JSON)
Each figure is the median of ``repeats`` timed batches after a warm-up (``_report.time_ms``, synced).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import _report  # benchmarks/_report.py (this script's folder is on sys.path)

COPY_BYTES = 2 ** 30  # 1 GiB each way: far past L2, so the copy runs at DRAM speed
MATMUL_N = 8192       # 8192^3 bf16: large enough to saturate the tensor cores


def _device_and_sync(device: str):
    """``(torch.device, sync)``; a clear error when CUDA is asked for and torch sees no GPU."""
    import torch  # imported here: benchmarks/cudnn.py imports this module before unshadowing cudnn

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"ceilings.measure(device={device!r}) needs a CUDA GPU; torch sees none "
                           "(pass device='cpu' for a smoke run)")
    return dev, (torch.cuda.synchronize if dev.type == "cuda" else None)


def copy_tbps(dev, sync, *, nbytes: int, repeats: int, number: int) -> float:
    """Device-to-device copy bandwidth in TB/s, counting the bytes read and the bytes written."""
    import torch

    src = torch.randn(max(1, nbytes // 4), device=dev, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = _report.time_ms(lambda: dst.copy_(src), warmup=3, repeats=repeats, number=number, sync=sync)
    moved = 2 * src.numel() * src.element_size()
    return moved / (ms * 1e-3) / 1e12


def matmul_tflops(dev, sync, *, n: int, repeats: int, number: int) -> float:
    """bf16 ``n x n @ n x n`` throughput in TFLOP/s on random data (zeros would flatter the clocks)."""
    import torch

    a, b = (torch.randn(n, n, device=dev, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    ms = _report.time_ms(lambda: torch.mm(a, b, out=out), warmup=3, repeats=repeats, number=number,
                         sync=sync)
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def measure(device: str = "cuda", *, copy_bytes: int = COPY_BYTES, matmul_n: int = MATMUL_N,
            repeats: int = 5, number: int = 10) -> dict[str, Any]:
    """Both ceilings on ``device``: ``{"device", "copy_tbps", "copy_bytes", "matmul_tflops",
    "matmul_n", "matmul_dtype"}``. Takes about a second on an H100; frees its buffers after."""
    import torch

    dev, sync = _device_and_sync(device)
    result = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "copy_tbps": copy_tbps(dev, sync, nbytes=copy_bytes, repeats=repeats, number=number),
        "copy_bytes": copy_bytes,
        "matmul_tflops": matmul_tflops(dev, sync, n=matmul_n, repeats=repeats, number=number),
        "matmul_n": matmul_n,
        "matmul_dtype": "bfloat16",
    }
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # give the benchmark that follows its memory back
    return result


def describe(ceilings: dict[str, Any] | None) -> str:
    """One printable line for a ``measure()`` result (or for a run that skipped it)."""
    if not ceilings:
        return "ceilings: not measured (--no-ceilings)"
    return (f"ceilings on {ceilings['device']}: copy {ceilings['copy_tbps']:.2f} TB/s (read + write), "
            f"bf16 matmul {ceilings['matmul_n']}^3 {ceilings['matmul_tflops']:.0f} TFLOP/s")


def add_fraction(rows: list[dict[str, Any]], ceilings: dict[str, Any] | None,
                 key: str = "ours_tflops", column: str = "ours/ceiling") -> None:
    """Set ``row[column] = row[key] / matmul ceiling`` on every row that has ``key`` (in place)."""
    if not ceilings:
        return
    for row in rows:
        if row.get(key) is not None:
            row[column] = row[key] / ceilings["matmul_tflops"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    print(json.dumps(measure(args.device), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
