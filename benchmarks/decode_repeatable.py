"""GPU benchmark: what a bitwise repeatable single-query call costs on the cuDNN engine (issue 36).

cuDNN's ``S_q = 1`` decode path is not bitwise repeatable, so repeatable calls (every
FlashAttention surface; torch's deterministic mode) run a two-row graph and drop the extra row
(``cudnn_attn.graphs.decode_rows``). For each decode shape this times, on the cuDNN engine,
  * decode:   the plain call (cuDNN's S_q = 1 graph)
  * two-row:  the same call under ``torch.use_deterministic_algorithms(True)`` (the two-row graph)
and counts the distinct outputs of ``--repeats-bitwise`` repeats of each (decode: expected > 1 on
Hopper; two-row: must be 1). Shapes: bf16, D = 128, causal (bottom-right), B x H_q = 8 x 32,
H_kv = 8, S_kv in {1k, 8k, 32k}; ``--quick``: S_kv = 8k only.

Run from the repository root on a CUDA machine:  python benchmarks/decode_repeatable.py [--quick]
Without CUDA (or without the cuDNN frontend) it says so and exits 0, writing nothing.
JSON: <--results-dir>/decode_repeatable-<date>.json (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import _report  # benchmarks/_report.py (this script's folder is on sys.path)

_report.unshadow_cudnn()  # this folder's cudnn.py is not the cuDNN frontend
import torch

SEQS_KV = (1024, 8192, 32768)
BATCH, HEADS_Q, HEADS_KV, DIM = 8, 32, 8, 128


def _inputs(s_kv: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(BATCH, 1, HEADS_Q, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(BATCH, s_kv, HEADS_KV, DIM, device="cuda", dtype=torch.bfloat16,
                        generator=g) for _ in range(2))
    return q, k, v


def _distinct(call, repeats: int) -> int:
    first = call()
    outputs = [first]
    for _ in range(repeats - 1):
        out = call()
        if not any(torch.equal(out, seen) for seen in outputs):
            outputs.append(out)
    return len(outputs)


def bench(s_kv: int, args) -> dict:
    import cudnn_attn as ca

    q, k, v = _inputs(s_kv)

    def call():
        return ca.attention(q, k, v, mask=ca.Causal("bottom_right"), layout="bshd",
                            backend="cudnn")

    row: dict = {"S_kv": s_kv, "B": BATCH, "H_q": HEADS_Q, "H_kv": HEADS_KV, "D": DIM}
    for name, deterministic in (("decode", False), ("two_row", True)):
        torch.use_deterministic_algorithms(deterministic)
        try:
            if deterministic:
                notes = ca.explain(q, k, v, mask=ca.Causal("bottom_right"), layout="bshd").notes
                row["two_row_note"] = bool(notes)
            row[f"{name}_ms"] = _report.time_ms(call, warmup=args.warmup, repeats=args.repeats,
                                                number=20, sync=torch.cuda.synchronize)
            row[f"{name}_distinct"] = _distinct(call, args.repeats_bitwise)
        finally:
            torch.use_deterministic_algorithms(False)
    row["two_row_over_decode"] = row["two_row_ms"] / row["decode_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S_kv = 8k only")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats-bitwise", type=int, default=200)
    parser.add_argument("--no-json", action="store_true", help="print only, write no results file")
    parser.add_argument("--results-dir", type=Path, default=_report.RESULTS_DIR)
    args = parser.parse_args()
    if not torch.cuda.is_available() or importlib.util.find_spec("cudnn") is None:
        print("benchmarks/decode_repeatable.py needs a CUDA GPU and the cuDNN frontend; this "
              "machine lacks one. Nothing was run or written.")
        return 0
    rows = [bench(s, args) for s in ((8192,) if args.quick else SEQS_KV)]
    _report.print_table(rows, ["S_kv", "decode_ms", "two_row_ms", "two_row_over_decode",
                               "decode_distinct", "two_row_distinct"])
    if not args.no_json:
        path = _report.write_json("decode_repeatable", {"rows": rows}, args.results_dir)
        print(f"wrote {path}")
    return 0 if all(r["two_row_distinct"] == 1 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
