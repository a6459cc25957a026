"""``cudnn-attn cache info|warm|clear``: the graph cache's counters, warm-up and files."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .specs import (
    UsageError,
    build_inputs,
    decode_inputs,
    default_device,
    parse_decode,
    positive_int,
    real_device_arg,
)


def _print_info(info: dict) -> None:
    width = max(map(len, info))
    for key, value in info.items():
        print(f"  {key:<{width}}  {round(value, 6) if isinstance(value, float) else value}")


def _describe_dir(directory) -> tuple[str, list[str]]:
    """``(status, notes)`` of a cache directory: what it holds, without following links."""
    import os
    import stat

    from cudnn_attn.graphs.cache import SUFFIX

    if not os.path.lexists(directory):
        return "does not exist", []
    if not os.path.isdir(directory):
        return "not a directory", []
    regular, size, other = 0, 0, []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if not entry.name.endswith(SUFFIX):
            continue
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            regular, size = regular + 1, size + st.st_size
        else:
            kind = ("link" if stat.S_ISLNK(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode)
                    else "FIFO" if stat.S_ISFIFO(st.st_mode) else "special file")
            other.append(f"{entry.name} ({kind})")
    notes = [f"files: {regular} ({size} bytes)"]
    if other:
        notes.append(f"not regular files (never read): {', '.join(other)}")
    return "", notes


def cmd_cache_info(args: argparse.Namespace) -> int:
    """Print the process cache counters and what the cache directory holds."""
    from cudnn_attn.graphs.cache import GraphCache, default_cache_dir, graph_cache, secret_key_path

    directory = args.dir or default_cache_dir()
    print("graph_cache (this process):")
    _print_info(graph_cache.info())
    status, notes = _describe_dir(directory)
    print(f"cache dir: {directory}{f' ({status})' if status else ''}")
    print(f"cache key: {secret_key_path()}")
    if status:
        print("  files: 0")
        return 0
    probe = GraphCache()
    accepted = probe.load(directory)  # logs (and counts) every file it refuses, and why
    notes[0] += f", usable here: {accepted}, rejected: {probe.info()['rejected_files']}"
    for note in notes:
        print(f"  {note}")
    return 0


def progress(items: Sequence[Any], desc: str, file: Any = None) -> tuple[Any, Callable[[str], None]]:
    """``(iterator, write)``: a tqdm bar when tqdm is installed, else ``[i/N]`` prefixed lines.

    ``file``: where the bar and the lines go (default: stdout).
    """
    try:
        from tqdm import tqdm
    except ImportError:
        state = {"i": 0}

        def plain() -> Any:
            for i, item in enumerate(items, 1):
                state["i"] = i
                yield item

        return plain(), lambda line: print(f"{desc} [{state['i']}/{len(items)}] {line}",
                                           file=file or sys.stdout, flush=True)
    bar = tqdm(items, desc=desc, file=file)
    return bar, lambda line: bar.write(line, file=file)


MAX_CONFIG_BYTES = 16 << 20  # thousands of problems; /dev/zero or a runaway file is refused
MAX_CONFIG_DEPTH = 32  # a config nests 3 deep; json.loads would recurse on deeper hostile input


def read_config(path: str) -> list[dict]:
    """Problems of a warm-up config: ``{"defaults": {...}, "problems": [...]}`` or a list. A regular
    file of at most ``MAX_CONFIG_BYTES`` (a FIFO or device is refused, never read)."""
    from cudnn_attn.trusted_files import Rejected, json_depth_ok, read_regular_path

    try:
        data = read_regular_path(path, MAX_CONFIG_BYTES)
    except Rejected as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not json_depth_ok(data, MAX_CONFIG_DEPTH):
        raise ValueError(f"{path}: nests deeper than {MAX_CONFIG_DEPTH} levels")
    try:
        config = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from None
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


def warm_decode(spec: Any, device: str) -> str:
    """One real ``attention_with_kvcache`` call of ``spec``'s shapes (zeros) on the cuDNN engine:
    it builds exactly the graphs a decode step of those shapes uses. A line saying what happened."""
    import torch

    import cudnn_attn as ca
    from cudnn_attn.graphs.cache import graph_cache

    call, kwargs = decode_inputs(spec, device)
    before = graph_cache.info()
    try:
        ca.attention_with_kvcache(*call, **kwargs, backend="cudnn")
        torch.cuda.synchronize(device)
    except ca.NotSupportedError as exc:
        return f"cannot build on cudnn: {exc}"
    after = graph_cache.info()
    built, loaded = after["builds"] - before["builds"], after["loads"] - before["loads"]
    return f"ok ({built} built, {loaded} loaded, {after['hits'] - before['hits']} cached)"


def _decode_spec(args: argparse.Namespace) -> Any:
    """The ``--decode`` call (None without it); refuses without a CUDA device."""
    import torch

    options = {"--page-size": args.page_size, "--max-blocks": args.max_blocks,
               "--num-blocks": args.num_blocks, "--seq-q": args.seq_q, "--dtype": args.dtype,
               "--mask": args.mask}
    if args.decode is None:
        given = [name for name, value in options.items() if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: options of a --decode call; add --decode "
                             f"B,H_Q,H_KV,D")
        if args.config is None:
            raise UsageError("nothing to warm: give a config file (JSON problems) and/or "
                             "--decode B,H_Q,H_KV,D --page-size P --max-blocks N")
        return None
    spec = parse_decode(args.decode, page_size=args.page_size, max_blocks=args.max_blocks,
                        num_blocks=args.num_blocks, seq_q=args.seq_q or 1,
                        dtype=args.dtype or "fp16", mask=args.mask or "causal:bottom_right")
    device = args.device or default_device()
    if torch.device(device).type != "cuda":  # the cuDNN engine runs only there
        why = "no CUDA device is available to torch" if args.device is None else f"got --device {device}"
        raise UsageError(f"--decode warms cuDNN graphs with a real call and needs a CUDA device; {why}")
    return spec


def warm_for_target(args: argparse.Namespace) -> int:
    """``cache warm CONFIG --target T --save DIR``: plan the config's graphs for a described
    device without a GPU (``graphs.aot.warm``) and save them for that device."""
    import cudnn_attn as ca
    from cudnn_attn.graphs import aot
    from cudnn_attn.graphs.targets import target

    if args.save is None:
        raise UsageError("--target warms a cache for another machine: give --save DIR")
    extra = [flag for flag, given in (("--load", args.load), ("--decode", args.decode),
                                      ("--device", args.device)) if given is not None]
    if extra:
        raise UsageError(f"{', '.join(extra)}: not used with --target (the graphs are planned "
                         f"for the described device; put every call in the config)")
    if args.config is None:
        raise UsageError("nothing to warm: give a config file (JSON problems) with --target")
    try:
        device = target(args.target)
        specs = read_config(args.config)
    except (OSError, ValueError) as exc:
        print(f"cudnn-attn cache warm: error: {exc}", file=sys.stderr)
        return 2
    names, problems, invalid = [], [], 0
    for index, spec in enumerate(specs):
        name = (spec.get("name") if isinstance(spec, dict) else None) or f"problem {index}"
        try:
            q, k, v, kwargs = build_inputs(spec, "meta")
            problems.append(ca.AttnProblem.from_tensors(q, k, v, **kwargs))
            names.append(name)
        except (ValueError, TypeError) as exc:
            invalid += 1
            print(f"{name}: invalid: {exc}")
    print(f"target {device.name}: {device.device_name}, sm_{device.sm}, {device.sm_count} SMs "
          f"(planned without a GPU)")
    results, written = aot.warm(problems, device, args.save)
    failed = 0
    for name, result in zip(names, results):
        if result.ok:
            print(f"{name}: ok")
            for tag, engine in result.graphs:
                print(f"  {tag}: {engine}".replace("\n", "\n  "))
        else:
            failed += result.error.startswith("cuDNN refused")
            print(f"{name}: {result.error}")
    print(f"saved {written} graph file(s) to {args.save}; on a GPU that matches the target, "
          f"graph_cache.load() serves them without building plans (others rebuild)")
    return 2 if invalid else 1 if failed else 0


def cmd_cache_warm(args: argparse.Namespace) -> int:
    """Build every problem of a config (and the ``--decode`` call) through the graph cache,
    optionally saving the plans; with ``--target``, plan them for a described device."""
    from cudnn_attn.dispatch import get_backend
    from cudnn_attn.graphs.cache import graph_cache

    if args.backend != "cudnn":
        raise UsageError(f"--backend {args.backend}: only cuDNN plans are graphs that the cache "
                         f"builds and saves; the {args.backend} backend has nothing to warm")
    if args.target is not None:
        return warm_for_target(args)
    decode = _decode_spec(args)
    try:
        specs = read_config(args.config) if args.config is not None else []
    except (OSError, ValueError) as exc:
        print(f"cudnn-attn cache warm: error: {exc}", file=sys.stderr)
        return 2
    if args.load:
        print(f"loaded {graph_cache.load(args.load)} graph file(s) from {args.load}")
    backend, device = get_backend(args.backend), args.device or default_device()
    items, write = progress(specs + ([decode] if decode else []), "warm")
    invalid = failed = 0
    for index, spec in enumerate(items):
        name = spec.get("name") if isinstance(spec, dict) else None
        name = spec.describe() if spec is decode else name or f"problem {index}"
        try:
            status = (warm_decode(spec, device) if spec is decode
                      else warm_one(backend, spec, device))
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


def add_parser(sub: Any) -> None:
    """``cudnn-attn cache info|warm|clear``."""
    from pathlib import Path

    from cudnn_attn.dispatch import BACKEND_NAMES

    cache = sub.add_parser("cache", help="the graph cache: info, warm-up, clear")
    csub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    info = csub.add_parser("info", help="counters and the cache directory")
    info.add_argument("--dir", type=Path, help="cache directory (default: the user cache dir)")
    info.set_defaults(func=cmd_cache_info)
    warm = csub.add_parser("warm", help="build the problems of a JSON config (and/or a paged "
                           "decode call) through the cache")
    warm.add_argument("config", nargs="?",
                      help='JSON: {"defaults": {...}, "problems": [{"shape": '
                      '[B,H,S,D], "dtype": "bf16", "mask": "causal", ...}]}')
    warm.add_argument("--backend", default="cudnn", choices=BACKEND_NAMES,
                      help="backend to build on (default and only useful choice: cudnn)")
    warm.add_argument("--device", type=real_device_arg,
                      help="torch device (default: cuda if available, else cpu)")
    warm.add_argument("--load", type=Path, help="load saved graphs from DIR first")
    warm.add_argument("--save", type=Path, help="save the built graphs to DIR")
    warm.add_argument("--target", metavar="DEVICE",
                      help="plan for a described GPU without one (a100, h100, h200, b200, or "
                           "the path of a device JSON from cudnn.create_device_properties(i)"
                           ".serialize()); needs --save")
    dec = warm.add_argument_group(
        "paged decode (GPU only)", "warm the graphs of attention_with_kvcache(q [B, S_q, H_Q, D], "
        "k/v pools [num_blocks, page_size, H_KV, D], cache_seqlens, block_table [B, max_blocks]) "
        "by one real call with zeros, as a decode server makes it")
    dec.add_argument("--decode", metavar="B,H_Q,H_KV,D", help="batch, query heads, K/V heads, "
                     "head dim of the decode call")
    dec.add_argument("--page-size", type=positive_int, help="tokens per page")
    dec.add_argument("--max-blocks", type=positive_int, help="pages per sequence (block table "
                     "width: the cache capacity)")
    dec.add_argument("--num-blocks", type=positive_int, help="pages in the pool (default "
                     "B * max-blocks)")
    dec.add_argument("--seq-q", type=positive_int, help="query tokens per step (default 1)")
    dec.add_argument("--dtype", help="bf16 | fp16 | fp32 (default fp16)")
    dec.add_argument("--mask", help="none | causal[:bottom_right] | window:L,R[,bottom_right] "
                     "(default causal:bottom_right)")
    warm.set_defaults(func=cmd_cache_warm)
    clear = csub.add_parser("clear", help="empty the cache and delete its files")
    clear.add_argument("--dir", type=Path, help="cache directory (default: the user cache dir)")
    clear.set_defaults(func=cmd_cache_clear)
