"""The ``explain`` and ``cache`` subcommands of the command line (see ``cli.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

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
