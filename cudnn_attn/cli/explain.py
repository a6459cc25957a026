"""``cudnn-attn explain``: each backend's verdict for one call and, with the cuDNN frontend,
its graph."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from .specs import DTYPES, MASK_SYNTAX, build_inputs, default_device, device_arg, positive_int


def explain_on(device: str, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """``cudnn_attn.explain`` for tensors that would live on ``device``, described by ``meta``
    tensors of their shapes: the verdicts of the same problem on ``device``, nothing allocated."""
    from cudnn_attn.model.problem import AttnProblem

    return explain_problem(device, AttnProblem.from_tensors(q, k, v, **kwargs))


def explain_problem(device: str, problem: Any) -> Any:
    """Each backend's verdict for ``problem`` moved to ``device``."""
    import torch

    from cudnn_attn.core import dispatch
    from cudnn_attn.api import Explanation

    problem = dataclasses.replace(problem, device=torch.device(device))
    verdicts, cost = dispatch.auto_verdicts(problem)
    return Explanation(problem, verdicts, cost=cost)


def _lengths(name: str, text: str) -> list[int]:
    try:
        lens = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be integers separated by ',', got {text!r}") from None
    if min(lens) < 0:
        raise ValueError(f"{name} must be >= 0, got {text!r}")
    return lens


def call_inputs(args: argparse.Namespace, q: Any, k: Any, v: Any, kwargs: dict):
    """``(label, q, k, v, call kwargs)`` of a ``--varlen`` call (packed ``[total, H, D]`` meta
    tensors, ``cu_seqlens`` and maxima) or a ``--cache-seqlens`` call (``q [B, S, H, D]``, a dense
    ``[B, seq_kv, H_kv, D]`` cache or, with ``--page-size``, a paged one and its block table);
    ``None`` for a plain call."""
    import torch

    if args.varlen is None and args.cache_seqlens is None:
        if args.page_size is not None:
            raise ValueError("--page-size needs --cache-seqlens")
        return None
    if args.varlen is not None and args.cache_seqlens is not None:
        raise ValueError("--varlen and --cache-seqlens describe different calls; pass one")
    if args.layout is not None and args.layout != "bshd":
        raise ValueError("varlen and KV-cache calls are token-major: use --layout bshd")
    # build_inputs made [B, S, H, D] (bshd) tensors: B, S, H, D of each side come from them
    batch, seq_q, heads_q, dim = q.shape
    seq_kv, heads_kv, dim_v = k.shape[1], k.shape[2], v.shape[3]
    kwargs = {**kwargs, "layout": "bshd"}

    def packed(tokens: int, heads: int, d: int) -> Any:
        return torch.empty(tokens, heads, d, dtype=q.dtype, device="meta",
                           requires_grad=q.requires_grad)

    if args.varlen is not None:
        text_q, _, text_k = args.varlen.partition("/")
        lens_q = _lengths("--varlen lengths", text_q)
        lens_k = _lengths("--varlen kv lengths", text_k) if text_k else lens_q
        if len(lens_q) != batch or len(lens_k) != batch:
            raise ValueError(f"--varlen needs one length per batch ({batch}, from --shape), got "
                             f"{len(lens_q)} and {len(lens_k)}")
        cu = [torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
              for lens in (lens_q, lens_k)]
        label = (f"varlen call: B={batch}, lengths {lens_q} / {lens_k}, max_seqlen_q={seq_q}, "
                 f"max_seqlen_k={seq_kv} (cuDNN's ragged layout)")
        call = dict(kwargs, cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=seq_q,
                    max_seqlen_k=seq_kv)
        return (label, packed(sum(lens_q), heads_q, dim), packed(sum(lens_k), heads_kv, dim),
                packed(sum(lens_k), heads_kv, dim_v), call)
    lens = _lengths("--cache-seqlens", args.cache_seqlens)
    if len(lens) == 1:
        lens = lens * batch
    call = dict(kwargs, cache_seqlens=torch.tensor(lens, dtype=torch.int32))
    if args.page_size is None:
        label = f"KV-cache call: B={batch}, cache_seqlens {lens}, S_max={seq_kv} (dense cache)"
        return label, q, k, v, call
    pages = -(-seq_kv // args.page_size)
    call["block_table"] = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)

    def container(d: int) -> Any:
        return torch.empty(batch * pages, args.page_size, heads_kv, d, dtype=q.dtype,
                           device="meta")

    label = (f"KV-cache call: B={batch}, cache_seqlens {lens}, {pages} pages of "
             f"{args.page_size} tokens per sequence (cuDNN's page tables)")
    return label, q, container(dim), container(dim_v), call


def native_inputs(problem: Any, options: Any, backward: bool, target_sm: int) -> list[str]:
    """The ragged offsets and page tables of the validated graph (``print(pygraph)`` omits
    which tensor each offset belongs to), from the frontend's C++ graph for ``target_sm``."""
    import json

    from cudnn_attn.graphs.sdpa import validate_for

    stats = backward or problem.requires_grad or problem.return_lse  # as describe builds it
    graph = json.loads(str(validate_for(problem, target_sm, backward=backward, options=options,
                                        stats=stats)))
    lines = [f"  {t['name']}: ragged offsets {t['ragged_offset_name']} (uid "
             f"{t['ragged_offset_uid']})" for t in graph["tensors"] if t.get("ragged_offset_name")]
    node = graph["nodes"][0]
    dims = {t["uid"]: t["dim"] for t in graph["tensors"]}
    for port, uid in sorted(node["inputs"].items()):
        if port.startswith("Page_table"):
            lines.append(f"  {port}: uid {uid}, dims {dims[uid]}")
    if node.get("max_seq_len_kv") is not None:
        lines.append(f"  max_seq_len_kv: {node['max_seq_len_kv']}")
    return lines


def graph_lines(text: str) -> list[str]:
    """A compact reading of the frontend's graph JSON: the context, each node with its ports and
    parameters on one line, each tensor with its dims, strides and type on one line (the full
    JSON prints every number on its own line: ~110 lines for a causal call)."""
    import json

    try:
        graph = json.loads(text)
    except ValueError:
        return text.splitlines()

    def plain(value: Any) -> str:
        return str(value).replace("data_type.", "").replace("diagonal_alignment.", "")

    context = graph.get("context", {})
    lines = [f"  io {plain(context.get('io_data_type'))}, compute "
             f"{plain(context.get('compute_data_type'))}"] if context else []
    for node in graph.get("nodes", []):
        ports = ", ".join(node.get("inputs", {}))
        outs = ", ".join(node.get("outputs", {}))
        params = " ".join(f"{k}={plain(json.dumps(v))}".replace('"', "")
                          for k, v in node.get("params", {}).items())
        lines.append(f"  node {node.get('name')} ({node.get('type')}): {ports} -> {outs}"
                     + (f"; {params}" if params else ""))
    tensors = graph.get("tensors", {})
    items = tensors.items() if isinstance(tensors, dict) else ((t.get("name"), t) for t in tensors)
    for name, t in items:
        virtual = " virtual" if t.get("is_virtual") else ""
        lines.append(f"  tensor {name}: dim {t.get('dim')} stride {t.get('stride')} "
                     f"{plain(t.get('dtype'))}{virtual}")
    return lines


def graph_section(args: argparse.Namespace, q: Any, k: Any, v: Any, kwargs: dict,
                  native: Any) -> dict:
    """What the cuDNN engine would build for the call: ``{"title", "status", "detail",
    "graph"}`` with status ``validated``, ``unavailable`` or ``not supported``. ``native``:
    ``(problem, options)`` of a varlen / KV-cache call, else None."""
    import json

    import cudnn_attn as ca
    from cudnn_attn.core.probe import module_missing

    title = f"cuDNN graph ({'backward' if args.backward else 'forward'}, sm_{args.target_sm})"
    section: dict = {"title": title, "status": "unavailable", "detail": None, "graph": None,
                     "native_inputs": []}
    missing = module_missing("cudnn", "cu12")
    if missing:
        return {**section, "detail": missing[0]}
    try:
        from cudnn_attn.graphs import describe
    except (ImportError, AttributeError) as exc:
        return {**section, "detail": f"graphs.describe is not in this version: {exc}"}
    try:
        graph = describe(q, k, v, backward=args.backward, target_sm=args.target_sm, **kwargs)
        inputs = [] if native is None else native_inputs(*native, args.backward, args.target_sm)
    except ca.NotSupportedError as exc:
        return {**section, "status": "not supported", "detail": str(exc)}
    text = str(graph)
    try:
        parsed: Any = json.loads(text)
    except ValueError:
        parsed = text
    return {**section, "status": "validated", "graph": parsed, "text": text,
            "native_inputs": inputs}


def cmd_explain(args: argparse.Namespace) -> int:
    """Print each backend's verdict for one call and, with the cuDNN frontend, a compact reading
    of its graph (``--graph``: the whole graph JSON; ``--json``: everything as one object)."""
    from .output import print_json

    if args.target is not None:
        from cudnn_attn.graphs.targets import target

        target(args.target)  # a bad name fails before anything is printed
    layout = args.layout or ("bshd" if args.varlen or args.cache_seqlens else "bhsd")
    spec = {"shape": args.shape, "heads_kv": args.heads_kv, "seq_kv": args.seq_kv,
            "dim_v": args.dim_v, "dtype": args.dtype, "mask": args.mask, "layout": layout,
            "alibi": args.alibi, "softcap": args.softcap, "dropout_p": args.dropout,
            "backward": args.backward}
    device = args.device or default_device()
    # meta tensors: any shape is described without allocating it (bad values raise ValueError,
    # which main prints as one line with status 2)
    q, k, v, kwargs = build_inputs(spec, "meta")
    call = call_inputs(args, q, k, v, kwargs)
    label, native = None, None
    if call is None:
        explanation = explain_on(device, q, k, v, **kwargs)
    else:
        from cudnn_attn.graphs.entry_calls import call_problem

        label, q, k, v, kwargs = call
        problem, options = call_problem(q, k, v, **kwargs)
        native = (problem, options)
        explanation = explain_problem(device, problem)
    section = graph_section(args, q, k, v, kwargs, native)
    if args.json:
        print_json({"call": label, "problem": explanation.problem.describe(),
                    "selected": explanation.selected, "verdicts": dict(explanation),
                    "graph": {key: section[key] for key in
                              ("title", "status", "detail", "graph", "native_inputs")}})
        return 0
    if label:
        print(label)
    print(explanation)
    if section["status"] == "unavailable":
        print(f"\n{section['title']}: unavailable ({section['detail']})")
    elif section["status"] == "not supported":
        print(f"\n{section['title']}: not supported\n{section['detail']}")
    elif args.graph:
        print(f"\n{section['title']}:\n{section['text']}")
    else:
        print(f"\n{section['title']}, validated (--graph prints the whole graph):")
        print("\n".join(graph_lines(section["text"])))
    if section["native_inputs"]:
        print("ragged offsets and page tables (graph inputs, with the lengths):")
        print("\n".join(section["native_inputs"]))
    if args.target is not None:
        print_target_plan(args, q, k, v, kwargs)
    return 0


def print_target_plan(args: argparse.Namespace, q: Any, k: Any, v: Any, kwargs: dict) -> None:
    """The engine cuDNN picks for the call on a described device, planned without a GPU."""
    from cudnn_attn.graphs.deviceless import describe_plan

    result = describe_plan(q, k, v, target=args.target, backward=args.backward, **kwargs)
    print(f"\ncuDNN execution plan for {args.target} (planned without a GPU): "
          + str(result).split(": ", 1)[1].replace("\n", "\n  "))


def add_parser(sub: Any) -> None:
    """``cudnn-attn explain --shape B,H,S,D ...``."""
    ex = sub.add_parser("explain", help="which backend runs a call, and the cuDNN graph for it")
    ex.add_argument("--shape", required=True, help="q shape B,H,S,D (whatever the layout)")
    ex.add_argument("--heads-kv", type=positive_int, help="kv heads (GQA/MQA; default H)")
    ex.add_argument("--seq-kv", type=positive_int, help="kv sequence length (default S)")
    ex.add_argument("--dim-v", type=positive_int, help="value head dim (default D)")
    ex.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="default bf16")
    ex.add_argument("--mask", default="none", help=MASK_SYNTAX)
    ex.add_argument("--layout", choices=("bhsd", "bshd"),
                    help="default bhsd (bshd for --varlen / --cache-seqlens)")
    ex.add_argument("--varlen", metavar="LENS[/KV_LENS]",
                    help="a packed varlen call (attention_varlen): comma-separated lengths, one "
                         "per batch; --shape's S and --seq-kv are max_seqlen_q/k")
    ex.add_argument("--cache-seqlens", metavar="LENS",
                    help="a KV-cache call (attention_with_kvcache): cached lengths, one per "
                         "batch or one for all; --shape's S is the new tokens, --seq-kv the cache")
    ex.add_argument("--page-size", type=positive_int,
                    help="with --cache-seqlens: a paged cache of pages of this many tokens")
    ex.add_argument("--alibi", action="store_true", help="add ALiBi")
    ex.add_argument("--softcap", type=float, help="tanh soft-capping of the scores (default: none)")
    ex.add_argument("--dropout", type=float, default=0.0, help="dropout_p")
    ex.add_argument("--backward", action="store_true", help="describe the backward graph")
    ex.add_argument("--target-sm", type=int, default=90, help="graph target (default 90)")
    ex.add_argument("--target", metavar="DEVICE",
                    help="also plan the graph for a described GPU without one and name the "
                         "engine cuDNN picks: a100, h100, h200, b200 or a device JSON path")
    ex.add_argument("--device", type=device_arg,
                    help="device the call would run on (default: cuda if available, else cpu); "
                         "nothing is allocated")
    ex.add_argument("--graph", action="store_true",
                    help="print the whole cuDNN graph JSON instead of its compact reading")
    ex.add_argument("--json", action="store_true",
                    help="print one JSON object (verdicts, reasons, graph) instead of the text")
    ex.set_defaults(func=cmd_explain)
