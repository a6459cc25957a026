"""``cudnn-attn explain``: each backend's verdict for one call and, with the cuDNN frontend,
its graph."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .specs import DTYPES, build_inputs, default_device


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


def add_parser(sub: Any) -> None:
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
