"""Command line (also ``python -m cudnn_attn``).

``cudnn-attn info``, ``demo``, ``explain --shape B,H,S,D ...``, ``cache info``,
``cache warm CONFIG [--save DIR]`` and ``cache clear [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# parse_mask/progress are re-exported for the subcommands' users and tests.
from .graphs import add_cache_parser, add_explain_parser, parse_mask, progress  # noqa: F401
from .kernels import add_kernels_parser

# Max abs error allowed against the float64 brute force, per input dtype (outputs are O(1)).
TOLERANCE = {"float64": 1e-10, "float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}


# --------------------------------------------------------------------------------------------
# info
# --------------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    """Print versions, GPU facts and each backend's availability (with reasons when unusable)."""
    from cudnn_attn import _env
    from cudnn_attn.dispatch import BACKENDS

    facts = _env.collect()
    width = max(len(key) for key in facts)
    for key, value in facts.items():
        print(f"{key:<{width}}  {'-' if value is None else value}")
    print("\nbackends (priority order):")
    for backend in BACKENDS:
        reasons = backend.availability()
        print(f"  {backend.name:<6} {'available' if not reasons else 'unavailable'}")
        for reason in reasons:
            print(f"         - {reason}")
    return 0


# --------------------------------------------------------------------------------------------
# float64 brute force: materialize the visible (query, key) pairs one query at a time
# --------------------------------------------------------------------------------------------


def band_mask(s_q: int, s_kv: int, left: int, right: int) -> Any:
    """Top-left aligned band: key j visible from query i iff i-left <= j <= i+right (-1: unbounded)."""
    import torch

    mask = torch.zeros(s_q, s_kv, dtype=torch.bool)
    for i in range(s_q):
        lo = 0 if left < 0 else max(i - left, 0)
        hi = s_kv - 1 if right < 0 else min(i + right, s_kv - 1)
        mask[i, lo : hi + 1] = True
    return mask


def neighborhood_axis_mask(length: int, k: int, s: int = 1, d: int = 1, causal: bool = False) -> Any:
    """NATTEN 0.21 neighbor sets on one axis (reference/neighborhood-attention.md section 1.2)."""
    import torch

    mask = torch.zeros(length, length, dtype=torch.bool)
    wl, wr = k // 2, k // 2 + k % 2 - 1
    for i in range(length):
        g, idx = i % d, i // d  # dilation group and index inside it
        lg = len(range(g, length, d))  # group length
        if causal:
            leader = min(idx // s * s + s - 1, lg - 1)
            start, end = max(leader - k + 1, 0), min(idx + 1, lg)
        else:
            leader = min(idx // s * s + s // 2, lg - 1)
            start = max(leader - wl, 0) + (leader + wr >= lg) * (lg - wr - leader - 1)
            end = start + k
        for t in range(start, end):
            mask[i, t * d + g] = True
    return mask


def neighborhood_mask(spatial_shape: Sequence[int], kernel_size: Sequence[int]) -> Any:
    """Neighborhood mask on the row-major flattening: AND of the per-axis masks (a Kronecker product)."""
    import torch

    mask = torch.ones(1, 1, dtype=torch.int8)
    for length, k in zip(spatial_shape, kernel_size):
        mask = torch.kron(mask, neighborhood_axis_mask(length, k).to(torch.int8))
    return mask.bool()


def brute_force(q: Any, k: Any, v: Any, visible: Any) -> Any:
    """Dense float64 softmax attention over ``visible`` ([S_q, S_kv] bool), bhsd layout, on the CPU."""
    import torch

    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# --------------------------------------------------------------------------------------------
# demo
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoProblem:
    name: str
    shape: tuple[int, int, int, int]  # B, H, S, D (bhsd)
    mask: Callable[[], Any]  # builds the cudnn_attn mask object
    visible: Callable[[], Any]  # builds the brute-force [S, S] bool mask


def demo_problems() -> list[DemoProblem]:
    """The representative problems ``cudnn-attn demo`` runs."""
    import cudnn_attn as ca

    return [
        DemoProblem("causal LM  B2 H8 S512 D64", (2, 8, 512, 64), ca.Causal, lambda: band_mask(512, 512, -1, 0)),
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

    print(f"device {device}, dtype {str(dtype).removeprefix('torch.')}, tolerance {tol:g}, "
          f"median of {args.repeats} runs")
    header = f"{'problem':<42} {'backend':<8} {'max abs err':>12} {'time ms':>10}  check"
    print(header + "\n" + "-" * len(header))
    failures = 0
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
        print(f"{problem.name:<42} {chosen:<8} {err:>12.3e} {ms:>10.2f}  {'ok' if ok else 'FAIL'}")
    if failures:
        print(f"\n{failures} problem(s) exceeded the tolerance {tol:g}", file=sys.stderr)
    return 1 if failures else 0


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``cudnn-attn`` argument parser."""
    from cudnn_attn import _env

    parser = argparse.ArgumentParser(
        prog="cudnn-attn",
        description="Attention on cuDNN graphs, CuPy kernels or PyTorch, chosen per call.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_env.package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="versions, GPU and backend availability")
    info.set_defaults(func=cmd_info)

    demo = sub.add_parser("demo", help="run representative problems on backend='auto' and check them")
    demo.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    demo.add_argument("--dtype", choices=sorted(TOLERANCE),
                      help="input dtype (default: float16 on cuda, float32 on cpu)")
    demo.add_argument("--repeats", type=int, default=5, help="timed runs per problem (default: 5)")
    demo.add_argument("--seed", type=int, default=0, help="random seed for the inputs (default: 0)")
    demo.set_defaults(func=cmd_demo)

    add_explain_parser(sub)
    add_cache_parser(sub)
    add_kernels_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the chosen subcommand; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
