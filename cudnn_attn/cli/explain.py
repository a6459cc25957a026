"""``cudnn-attn explain``: each backend's verdict for one call and, with the cuDNN frontend,
its graph."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from .specs import DTYPES, MASK_SYNTAX, build_inputs, default_device, device_arg, positive_int


def explain_on(device: str, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """``cudnn_attn.explain`` for tensors that would live on ``device``, described by ``meta``
    tensors of their shapes: the verdicts of the same problem on ``device``, nothing allocated."""
    import torch

    from cudnn_attn import dispatch
    from cudnn_attn.api import Explanation
    from cudnn_attn.problem import AttnProblem

    problem = AttnProblem.from_tensors(q, k, v, **kwargs)
    problem = dataclasses.replace(problem, device=torch.device(device))
    reasons = dispatch.verdicts(problem)
    chosen = next((name for name, found in reasons.items() if not found), None)
    return Explanation(problem, {name: found or ("selected" if name == chosen else "available")
                                 for name, found in reasons.items()})


def cmd_explain(args: argparse.Namespace) -> int:
    """Print each backend's verdict for one call and, with the cuDNN frontend, its graph."""
    import cudnn_attn as ca
    from cudnn_attn._probe import module_missing

    spec = {"shape": args.shape, "heads_kv": args.heads_kv, "seq_kv": args.seq_kv,
            "dim_v": args.dim_v, "dtype": args.dtype, "mask": args.mask, "layout": args.layout,
            "alibi": args.alibi, "softcap": args.softcap, "dropout_p": args.dropout,
            "backward": args.backward}
    try:  # meta tensors: any shape is described without allocating it
        q, k, v, kwargs = build_inputs(spec, "meta")
        print(explain_on(args.device or default_device(), q, k, v, **kwargs))
    except (ValueError, TypeError) as exc:
        print(f"cudnn-attn explain: error: {exc}", file=sys.stderr)
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
    ex.add_argument("--heads-kv", type=positive_int, help="kv heads (GQA/MQA; default H)")
    ex.add_argument("--seq-kv", type=positive_int, help="kv sequence length (default S)")
    ex.add_argument("--dim-v", type=positive_int, help="value head dim (default D)")
    ex.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="default bf16")
    ex.add_argument("--mask", default="none", help=MASK_SYNTAX)
    ex.add_argument("--layout", default="bhsd", choices=("bhsd", "bshd"))
    ex.add_argument("--alibi", action="store_true", help="add ALiBi")
    ex.add_argument("--softcap", type=float)
    ex.add_argument("--dropout", type=float, default=0.0, help="dropout_p")
    ex.add_argument("--backward", action="store_true", help="describe the backward graph")
    ex.add_argument("--target-sm", type=int, default=90, help="graph target (default 90)")
    ex.add_argument("--device", type=device_arg,
                    help="device the call would run on (default: cuda if available, else cpu); "
                         "nothing is allocated")
    ex.set_defaults(func=cmd_explain)
