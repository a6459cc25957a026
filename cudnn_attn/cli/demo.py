"""``cudnn-attn demo``: representative problems on ``backend="auto"``, checked against a float64
brute force whose visibility comes from ``cudnn_attn.model.geometry``."""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .output import print_json
from .specs import positive_int, real_device_arg

# Max abs error allowed against the float64 brute force, per input dtype (outputs are O(1)).
TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}


def brute_force(q: Any, k: Any, v: Any, visible: Any) -> Any:
    """Dense float64 softmax attention over ``visible`` ([S_q, S_kv] bool), bhsd layout, on the CPU."""
    import torch

    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@dataclass(frozen=True)
class DemoProblem:
    name: str
    shape: tuple[int, int, int, int]  # B, H, S, D (bhsd)
    mask: Callable[[], Any]  # builds the cudnn_attn mask object
    visible: Callable[[], Any]  # builds the brute-force [S, S] bool mask


def demo_problems() -> list[DemoProblem]:
    """The representative problems ``cudnn-attn demo`` runs."""
    import cudnn_attn as ca
    from cudnn_attn.model.geometry import band_mask, neighborhood_mask

    return [
        DemoProblem("causal LM  B2 H8 S512 D64", (2, 8, 512, 64), ca.Causal,
                    lambda: band_mask(512, 512, -1, 0)),
        DemoProblem(
            "sliding window (128, 0)  B1 H8 S2048 D64",
            (1, 8, 2048, 64),
            lambda: ca.SlidingWindow(128, 0),
            lambda: band_mask(2048, 2048, 128, 0),
        ),
        DemoProblem(
            "neighborhood 2-D 32x32 k7x7  B1 H4 D32",
            (1, 4, 32 * 32, 32),
            lambda: ca.Neighborhood((32, 32), (7, 7)),
            lambda: neighborhood_mask((32, 32), (7, 7)),
        ),
    ]


def median_ms(fn: Callable[[], Any], repeats: int, sync: Callable[[], Any] | None = None) -> float:
    """Median wall time of ``fn`` in milliseconds over ``repeats`` runs, after one warm-up call."""

    def call() -> None:
        fn()
        if sync is not None:
            sync()

    call()
    return 1e3 * statistics.median(timeit.repeat(call, number=1, repeat=repeats))


def cmd_demo(args: argparse.Namespace) -> int:
    """Run each demo problem on backend="auto", check it against float64, print a table."""
    import torch

    import cudnn_attn as ca

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("float16" if device.startswith("cuda") else "float32"))
    tol = TOLERANCE[str(dtype).removeprefix("torch.")]
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    gen = torch.Generator().manual_seed(args.seed)

    dtype_name = str(dtype).removeprefix("torch.")
    show = print if not args.json else (lambda *a, **k: None)  # JSON: one object at the end
    show(f"device {device}, dtype {dtype_name}, tolerance {tol:g}, median of {args.repeats} runs")
    header = f"{'problem':<42} {'backend':<8} {'max abs err':>12} {'time ms':>10}  check"
    show(header + "\n" + "-" * len(header))
    failures, rows = 0, []
    for problem in demo_problems():
        q, k, v = (torch.randn(problem.shape, generator=gen).to(device, dtype) for _ in range(3))
        mask = problem.mask()
        explanation = ca.explain(q, k, v, mask=mask, backend="auto")
        chosen = next((name for name, verdict in explanation.items() if verdict == "selected"), "?")
        out = ca.attention(q, k, v, mask=mask, backend="auto")
        err = (out.to("cpu", torch.float64) - brute_force(q, k, v, problem.visible())).abs().max().item()
        ms = median_ms(lambda: ca.attention(q, k, v, mask=mask, backend="auto"), args.repeats, sync)  # noqa: B023
        ok = err <= tol
        failures += not ok
        rows.append({"problem": problem.name, "shape": list(problem.shape), "backend": chosen,
                     "max_abs_err": err, "time_ms": ms, "ok": ok})
        show(f"{problem.name:<42} {chosen:<8} {err:>12.3e} {ms:>10.2f}  {'ok' if ok else 'FAIL'}")
    if args.json:
        print_json({"device": device, "dtype": dtype_name, "tolerance": tol,
                    "repeats": args.repeats, "ok": not failures, "problems": rows})
    if failures:
        print(f"\n{failures} problem(s) exceeded the tolerance {tol:g}", file=sys.stderr)
    return 1 if failures else 0


def seed_arg(text: str) -> int:
    """argparse type: a seed ``torch.Generator.manual_seed`` takes (0 <= seed < 2**63)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**63), got {text!r}")
    return value


def add_parser(sub: Any) -> None:
    demo = sub.add_parser("demo", help="run representative problems on backend='auto' and check them")
    demo.add_argument("--device", type=real_device_arg,
                      help="torch device (default: cuda if available, else cpu)")
    demo.add_argument("--dtype", choices=sorted(TOLERANCE),
                      help="input dtype (default: float16 on cuda, float32 on cpu)")
    demo.add_argument("--repeats", type=positive_int, default=5,
                      help="timed runs per problem (default: 5)")
    demo.add_argument("--seed", type=seed_arg, default=0, help="random seed for the inputs (default: 0)")
    demo.add_argument("--json", action="store_true",
                      help="print one JSON object (settings and each problem's row) instead of the table")
    demo.set_defaults(func=cmd_demo)
