"""Command line (also ``python -m cudnn_attn``).

``cudnn-attn info``, ``demo``, ``explain --shape B,H,S,D ...``, ``cache info``,
``cache warm CONFIG [--save DIR]`` and ``cache clear [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
# problem specs: shared by ``explain`` and ``cache warm``
# --------------------------------------------------------------------------------------------

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "half": "float16", "fp32": "float32", "float32": "float32", "fp64": "float64",
          "float64": "float64"}
SPEC_KEYS = {"name", "shape", "heads_kv", "seq_kv", "dim_v", "dtype", "mask", "layout", "alibi",
             "softcap", "dropout_p", "backward"}


def parse_mask(text: str | None) -> Any:
    """``none``, ``causal[:bottom_right]``, ``window:L,R[,bottom_right]`` -> a mask object."""
    import cudnn_attn as ca

    text = (text or "none").strip().lower()
    kind, _, rest = text.partition(":")
    try:
        if kind == "none" and not rest:
            return None
        if kind == "causal":
            return ca.Causal(rest or "top_left")
        if kind == "window":
            left, right, *align = rest.split(",")
            return ca.SlidingWindow(int(left), int(right), *align)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"mask {text!r}: {exc}") from None
    raise ValueError(f"mask must be none, causal[:bottom_right] or window:L,R[,bottom_right], "
                     f"got {text!r}")


def _shape(value: Any) -> tuple[int, int, int, int]:
    parts = value.split(",") if isinstance(value, str) else value
    try:
        dims = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise ValueError(f"shape must be four positive ints B,H,S,D, got {value!r}")
    return dims  # type: ignore[return-value]


def build_inputs(spec: dict, device: str) -> tuple[Any, Any, Any, dict]:
    """Uninitialized q, k, v and the attention kwargs a problem spec describes.

    ``spec``: ``shape`` [B, H, S, D] (of q, whatever the layout), optional ``heads_kv``,
    ``seq_kv``, ``dim_v``, ``dtype`` (bf16/fp16/fp32/fp64), ``mask`` (see ``parse_mask``),
    ``layout``, ``alibi`` (bool), ``softcap``, ``dropout_p``, ``backward`` (bool: inputs
    require grad), ``name``.
    """
    import torch

    import cudnn_attn as ca

    if not isinstance(spec, dict):
        raise ValueError(f"a problem must be a JSON object, got {spec!r}")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"unknown problem keys {unknown} (known: {sorted(SPEC_KEYS)})")
    if "shape" not in spec:
        raise ValueError("a problem needs a 'shape' [B, H, S, D]")
    B, H, S, D = _shape(spec["shape"])
    h_kv, s_kv, d_v = (int(spec.get(key) or dflt) for key, dflt in
                       (("heads_kv", H), ("seq_kv", S), ("dim_v", D)))
    dtype_name = DTYPES.get(str(spec.get("dtype", "bf16")).lower())
    if dtype_name is None:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.get('dtype')!r}")
    layout = spec.get("layout", "bhsd")
    grad = bool(spec.get("backward", False))

    def make(h: int, s: int, d: int) -> Any:
        shape = (B, h, s, d) if layout == "bhsd" else (B, s, h, d)
        return torch.empty(shape, dtype=getattr(torch, dtype_name), device=device,
                           requires_grad=grad)

    kwargs = {"mask": parse_mask(spec.get("mask")), "layout": layout,
              "bias": ca.Alibi() if spec.get("alibi") else None,
              "softcap": spec.get("softcap"), "dropout_p": float(spec.get("dropout_p", 0.0))}
    return make(H, S, D), make(h_kv, s_kv, D), make(h_kv, s_kv, d_v), kwargs


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------------------------
# explain
# --------------------------------------------------------------------------------------------


def cmd_explain(args: argparse.Namespace) -> int:
    """Print each backend's verdict for one call and, with the cuDNN frontend, its graph."""
    import cudnn_attn as ca
    from cudnn_attn._probe import module_missing

    spec = {"shape": args.shape, "heads_kv": args.heads_kv, "seq_kv": args.seq_kv,
            "dim_v": args.dim_v, "dtype": args.dtype, "mask": args.mask, "layout": args.layout,
            "alibi": args.alibi, "softcap": args.softcap, "dropout_p": args.dropout,
            "backward": args.backward}
    try:
        q, k, v, kwargs = build_inputs(spec, args.device or default_device())
        print(ca.explain(q, k, v, **kwargs))
    except (ValueError, TypeError) as exc:
        print(f"cudnn-attn explain: {exc}", file=sys.stderr)
        return 2
    title = f"cuDNN graph ({'backward' if args.backward else 'forward'}, sm_{args.target_sm})"
    missing = module_missing("cudnn", "cu12")
    if missing:
        print(f"\n{title}: unavailable ({missing[0]})")
        return 0
    try:
        from cudnn_attn.graphs import describe
    except (ImportError, AttributeError) as exc:
        print(f"\n{title}: unavailable (graphs.describe is not in this version: {exc})")
        return 0
    try:
        graph = describe(q, k, v, backward=args.backward, target_sm=args.target_sm, **kwargs)
    except ca.NotSupportedError as exc:
        print(f"\n{title}: not supported\n{exc}")
        return 0
    print(f"\n{title}:\n{graph}")
    return 0


# --------------------------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------------------------


def _print_info(info: dict) -> None:
    width = max(map(len, info))
    for key, value in info.items():
        print(f"  {key:<{width}}  {round(value, 6) if isinstance(value, float) else value}")


def cmd_cache_info(args: argparse.Namespace) -> int:
    """Print the process cache counters and what the cache directory holds."""
    from cudnn_attn.graphs.cache import SUFFIX, GraphCache, default_cache_dir, graph_cache

    directory = args.dir or default_cache_dir()
    print("graph_cache (this process):")
    _print_info(graph_cache.info())
    files = sorted(directory.glob("*" + SUFFIX)) if directory.is_dir() else []
    print(f"cache dir: {directory}{'' if directory.is_dir() else ' (does not exist)'}")
    if files:
        probe = GraphCache()
        accepted = probe.load(directory)
        size = sum(f.stat().st_size for f in files)
        print(f"  files: {len(files)} ({size} bytes), usable here: {accepted}, "
              f"rejected: {probe.info()['rejected_files']}")
    else:
        print("  files: 0")
    return 0


def progress(items: Sequence[Any], desc: str) -> tuple[Any, Callable[[str], None]]:
    """``(iterator, write)``: a tqdm bar when tqdm is installed, else ``[i/N]`` prefixed lines."""
    try:
        from tqdm import tqdm
    except ImportError:
        state = {"i": 0}

        def plain() -> Any:
            for i, item in enumerate(items, 1):
                state["i"] = i
                yield item

        return plain(), lambda line: print(f"{desc} [{state['i']}/{len(items)}] {line}", flush=True)
    bar = tqdm(items, desc=desc, unit="problem")
    return bar, bar.write


def read_config(path: str) -> list[dict]:
    """Problems of a warm-up config: ``{"defaults": {...}, "problems": [...]}`` or a list."""
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    if isinstance(config, list):
        config = {"problems": config}
    if not isinstance(config, dict) or not isinstance(config.get("problems"), list):
        raise ValueError(f"{path}: expected a list of problems or {{'problems': [...]}}")
    unknown = sorted(set(config) - {"defaults", "problems"})
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {unknown}")
    defaults = config.get("defaults") or {}
    return [{**defaults, **p} if isinstance(p, dict) else p for p in config["problems"]]


def warm_one(backend: Any, spec: dict, device: str) -> str:
    """Build one problem's plan through the graph cache; a line saying what happened."""
    import cudnn_attn as ca
    from cudnn_attn.graphs.cache import graph_cache

    q, k, v, kwargs = build_inputs(spec, device)
    problem = ca.AttnProblem.from_tensors(q, k, v, **kwargs)
    before = graph_cache.info()
    reasons = backend.supports(problem)  # on a GPU the cudnn backend builds here already
    if reasons:
        return f"cannot build on {backend.name}: " + "; ".join(reasons)
    try:
        plan = backend.plan(problem)
        if callable(getattr(plan, "prepare", None)):  # plans that build their graphs lazily
            plan.prepare(problem)
    except ca.NotSupportedError as exc:
        return f"cannot build on {backend.name}: {exc}"
    after = graph_cache.info()
    built, loaded = after["builds"] - before["builds"], after["loads"] - before["loads"]
    return f"ok ({built} built, {loaded} loaded, {after['hits'] - before['hits']} cached)"


def cmd_cache_warm(args: argparse.Namespace) -> int:
    """Build every problem of a config through the graph cache, optionally saving the plans."""
    from cudnn_attn.dispatch import get_backend
    from cudnn_attn.graphs.cache import graph_cache

    try:
        specs = read_config(args.config)
    except (OSError, ValueError) as exc:
        print(f"cudnn-attn cache warm: {exc}", file=sys.stderr)
        return 2
    if args.load:
        print(f"loaded {graph_cache.load(args.load)} graph file(s) from {args.load}")
    backend, device = get_backend(args.backend), args.device or default_device()
    items, write = progress(specs, "warm")
    invalid = failed = 0
    for index, spec in enumerate(items):
        name = spec.get("name") if isinstance(spec, dict) else None
        name = name or f"problem {index}"
        try:
            status = warm_one(backend, spec, device)
        except (ValueError, TypeError) as exc:
            invalid += 1
            status = f"invalid: {exc}"
        except Exception as exc:  # a real build failure: report it, keep warming the rest
            failed += 1
            status = f"FAILED: {type(exc).__name__}: {exc}"
        write(f"{name}: {status}")
    print("graph_cache:")
    _print_info(graph_cache.info())
    if args.save:
        print(f"saved {graph_cache.save(args.save)} graph file(s) to {args.save}")
    return 2 if invalid else 1 if failed else 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    """Empty the process cache and delete the graph files of the cache directory."""
    from cudnn_attn.graphs.cache import clear_dir, default_cache_dir, graph_cache

    directory = args.dir or default_cache_dir()
    graph_cache.clear()
    print(f"removed {clear_dir(directory)} graph file(s) from {directory}")
    return 0


def add_cache_parser(sub: Any) -> None:
    """``cudnn-attn cache info|warm|clear``."""
    from pathlib import Path

    cache = sub.add_parser("cache", help="the graph cache: info, warm-up, clear")
    csub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    info = csub.add_parser("info", help="counters and the cache directory")
    info.add_argument("--dir", type=Path, help="cache directory (default: the user cache dir)")
    info.set_defaults(func=cmd_cache_info)
    warm = csub.add_parser("warm", help="build the problems of a JSON config through the cache")
    warm.add_argument("config", help='JSON: {"defaults": {...}, "problems": [{"shape": '
                      '[B,H,S,D], "dtype": "bf16", "mask": "causal", ...}]}')
    warm.add_argument("--backend", default="cudnn", help="backend to build on (default: cudnn)")
    warm.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    warm.add_argument("--load", type=Path, help="load saved graphs from DIR first")
    warm.add_argument("--save", type=Path, help="save the built graphs to DIR")
    warm.set_defaults(func=cmd_cache_warm)
    clear = csub.add_parser("clear", help="empty the cache and delete its files")
    clear.add_argument("--dir", type=Path, help="cache directory (default: the user cache dir)")
    clear.set_defaults(func=cmd_cache_clear)


def add_explain_parser(sub: Any) -> None:
    """``cudnn-attn explain --shape B,H,S,D ...``."""
    ex = sub.add_parser("explain", help="which backend runs a call, and the cuDNN graph for it")
    ex.add_argument("--shape", required=True, help="q shape B,H,S,D (whatever the layout)")
    ex.add_argument("--heads-kv", type=int, help="kv heads (GQA/MQA; default H)")
    ex.add_argument("--seq-kv", type=int, help="kv sequence length (default S)")
    ex.add_argument("--dim-v", type=int, help="value head dim (default D)")
    ex.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="default bf16")
    ex.add_argument("--mask", default="none",
                    help="none | causal[:bottom_right] | window:L,R[,bottom_right]")
    ex.add_argument("--layout", default="bhsd", choices=("bhsd", "bshd"))
    ex.add_argument("--alibi", action="store_true", help="add ALiBi")
    ex.add_argument("--softcap", type=float)
    ex.add_argument("--dropout", type=float, default=0.0, help="dropout_p")
    ex.add_argument("--backward", action="store_true", help="describe the backward graph")
    ex.add_argument("--target-sm", type=int, default=90, help="graph target (default 90)")
    ex.add_argument("--device", help="tensor device (default: cuda if available, else cpu)")
    ex.set_defaults(func=cmd_explain)


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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the chosen subcommand; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
