"""The cuDNN builder against cuDNN's own validator and the frontend's reference semantics.

Draws ``--count`` random configurations the way the frontend's ``test_mhas`` does (see
``tests/builder_grid.py``), asks cuDNN's C++ validator (sm_90, no GPU needed) for its verdict, runs
the same configuration through ``cudnn_attn``'s attribute builder on the CPU, and compares what
both accept with a float64 reference of the frontend's semantics; the cuDNN engine's own graph for
the same call (``graphs.describe``) gets the same verdict check (``engine_disagreements``), and
``missing_setters`` counts the frontend's SDPA setters the builder lacks. Prints the counts and writes
``benchmarks/results/builder_grid-<date>.json``.

    python benchmarks/builder_grid.py --count 1000
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import _report  # benchmarks/_report.py (this script's folder is on sys.path)

_report.unshadow_cudnn()  # this folder's cudnn.py is not the cuDNN frontend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import builder_grid as grid  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000, help="configurations (default 1000)")
    parser.add_argument("--no-json", action="store_true", help="print only")
    args = parser.parse_args()
    counts = dict(configs=0, accepted_by_both=0, rejected_by_both=0, same_reason=0,
                  disagreements=0, compared=0, h_k_ne_h_v=0, engine_disagreements=0)
    worst, disagreements = 0.0, []
    for seed in range(args.count):
        c = grid.sample(seed)
        theirs = grid.cudnn_verdict(c)
        if c.backward and theirs is not None:  # the builder runs the forward first
            theirs = grid.cudnn_verdict(dataclasses.replace(c, backward=False)) or theirs
        mine, out, stats, grads = grid.run_builder(c)
        engine = grid.engine_verdict(c)
        counts["configs"] += 1
        counts["h_k_ne_h_v"] += c.heads_v != c.h_kv
        if grid.engine_disagrees(c, theirs, engine):
            counts["engine_disagreements"] += 1
            disagreements.append({"config": dataclasses.asdict(c), "cudnn": theirs,
                                  "engine": engine})
        if (theirs is None) != (mine is None):
            counts["disagreements"] += 1
            disagreements.append({"config": dataclasses.asdict(c), "cudnn": theirs, "ours": mine})
        elif theirs is None:
            counts["accepted_by_both"] += 1
            err = grid.compare(c, out, stats, grads)
            if not math.isnan(err):
                counts["compared"] += 1
                worst = max(worst, err)
        else:
            counts["rejected_by_both"] += 1
            counts["same_reason"] += grid.same_reason(mine, theirs)
    counts["max_abs_error_float64"] = worst
    missing = grid.missing_setters()
    counts["missing_setters"] = sum(len(v) for v in missing.values())
    _report.print_table([counts], list(counts))
    if not args.no_json:
        print(_report.write_json("builder_grid", {"options": vars(args), "counts": counts,
                                                  "missing_setters": missing,
                                                  "disagreements": disagreements}))


if __name__ == "__main__":
    main()
