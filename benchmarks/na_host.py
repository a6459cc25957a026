"""Host microseconds per fused neighborhood call: what the CuPy engine's Python costs per call.

Run from the repository root:  python benchmarks/na_host.py [--profile] [--json | --json-to DIR]

The H200 run of 2026-11-29 timed small neighborhood calls far above their kernels (2-D 64x64
k=13, 16 heads of 64, bf16: forward 0.47 ms per call back to back, its kernel 0.07 ms in the
profile of the same problem): the host, not the GPU, set the pace. This measures that host time
for the problems of ``PROBLEMS`` through the public call (``neighborhood.na2d`` / ``na1d``
under ``use_backend("cupy")``, inputs requiring grad):

  fwd            no grad
  fwd (grad)     the autograd node recorded
  fwd+bwd        that, plus ``torch.autograd.grad`` of the output

* With a GPU: the seconds ``--calls`` calls take to be enqueued after a synchronisation, no
  synchronisation among them (the launch queue holds them: the host's time, whatever the
  kernels take), per call; and the same with the kernels' tensors handed over as CuPy arrays
  through DLPack (``dlpack`` rows: how launches took them before 2026-11-29, for the ratio).
* Without one: the same Python with every kernel launch replaced by a no-op (the CuPy engine's
  device checks answered for CPU tensors), which is all of the engine's own host time except
  CuPy's launch itself.

``--profile`` prints the functions that cost the most (cProfile, fwd+bwd of the first problem).
Timings are the minimum over rounds of the mean per call. JSON: results/na_host-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path (tests)
import _report  # noqa: E402  benchmarks/_report.py

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere: the package is the repository's
    sys.path.insert(0, str(ROOT))

# (name, spatial, kernel, heads, head dim): the record's small problems, then a 1-D one
PROBLEMS = (("2-D 64x64 k=13 H16 D64", (64, 64), 13, 16, 64),
            ("2-D 128x128 k=7 H8 D128", (128, 128), 7, 8, 128),
            ("1-D 4096 k=63 H8 D64", (4096,), 63, 8, 64))


def _dlpack_arg(t):
    """How launches took a tensor before 2026-11-29: a CuPy array through DLPack."""
    import cupy
    import numpy as np

    if t is None:
        return np.uint64(0)
    t = t.detach()
    return cupy.from_dlpack(t.view(torch.int16) if t.element_size() == 2 else t)


@contextlib.contextmanager
def stubbed_launches():
    """The CuPy engine on CPU tensors, every kernel launch a no-op: its Python, timed alone."""
    import numpy as np

    from cudnn_attn.fallback_kernels import backend, fused, launch

    def tokens(t, rank, name):  # fused._tokens without its CUDA-device check
        return fused._last_contiguous(t.reshape(t.shape[0], -1, t.shape[-2], t.shape[-1]))

    def function(kernel, dtype, head_dim, device_index, use_pipelined=False):
        return lambda grid, block, args, shared_mem=0, stream=None: None

    with mock.patch.multiple(fused, _function=function, _tokens=tokens,
                             _capability=lambda index: (9, 0)), \
            mock.patch.multiple(launch, TorchStream=lambda device: contextlib.nullcontext(
                SimpleNamespace(index=0, stream=None)),
                                kernel_arg=lambda t: np.uint64(0 if t is None else
                                                                t.data_ptr())), \
            mock.patch.multiple(backend, kernel_reasons=lambda device=None: [],
                                machine_reasons=lambda: []):
        yield


def calls(spatial, kernel, heads, dim, device):
    """``{case: fn}`` of one problem (inputs requiring grad, bf16)."""
    import cudnn_attn as ca
    from cudnn_attn import neighborhood

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, *spatial, heads, dim, device=device, dtype=torch.bfloat16,
                           generator=g).requires_grad_() for _ in range(3))
    na = getattr(neighborhood, f"na{len(spatial)}d")

    def fwd():
        with ca.use_backend("cupy"):
            return na(q, k, v, kernel)

    dout = torch.randn_like(fwd())

    def nograd():
        with torch.no_grad():
            return fwd()

    def both():
        torch.autograd.grad(fwd(), (q, k, v), dout)

    return {"fwd": nograd, "fwd (grad)": fwd, "fwd+bwd": both}


def host_us(fn, n: int, repeats: int, sync) -> float:
    """Minimum over ``repeats`` rounds of the mean host seconds per call of ``n`` calls made
    back to back after a synchronisation, in microseconds."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    sync()
    return 1e6 * best


def measure(args) -> list[dict]:
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    variants = {"": contextlib.nullcontext}
    if gpu:
        from cudnn_attn.fallback_kernels import launch
        variants["dlpack "] = lambda: mock.patch.object(launch, "kernel_arg", _dlpack_arg)
    rows = []
    with (contextlib.nullcontext() if gpu else stubbed_launches()):
        for name, spatial, kernel, heads, dim in PROBLEMS:
            for case, fn in calls(spatial, kernel, heads, dim, device).items():
                for label, context in variants.items():
                    with context():
                        us = host_us(fn, args.calls, args.repeats, sync)
                    rows.append({"problem": name, "call": f"{label}{case}", "us_per_call": us,
                                 "device": device if gpu else "cpu (launches stubbed)"})
        if args.profile:
            name, spatial, kernel, heads, dim = PROBLEMS[0]
            both = calls(spatial, kernel, heads, dim, device)["fwd+bwd"]
            both()
            profile = cProfile.Profile()
            profile.runcall(lambda: [both() for _ in range(args.calls)])
            sync()
            print(f"\ncProfile, {args.calls} x fwd+bwd of {name} on {device}:")
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per round")
    parser.add_argument("--repeats", type=int, default=7, help="rounds")
    parser.add_argument("--profile", action="store_true", help="also print a cProfile table")
    parser.add_argument("--json", action="store_true",
                        help="also write the results file (benchmarks/results)")
    parser.add_argument("--json-to", type=Path, default=None,
                        help="write the results file into this folder instead")
    args = parser.parse_args(argv)
    rows = measure(args)
    _report.print_table(rows, ["problem", "call", "us_per_call", "device"])
    if args.json or args.json_to is not None:
        path = _report.write_json("na_host", {"problems": [list(p) for p in PROBLEMS],
                                              "calls": args.calls, "rows": rows},
                                  results_dir=args.json_to or _report.RESULTS_DIR)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
