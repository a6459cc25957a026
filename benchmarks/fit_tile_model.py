"""Refit the tile model's efficiencies from a GPU record of benchmarks/neighborhood.py (no GPU).

The fused kernels' predicted time (``cudnn_attn.fallback_kernels.tile_model.kernel_ms``) is the
products they compute over unmasked and masked tile pairs, each at a fraction of the matmul
ceiling (``FUSED_EFFICIENCY``), the wide kernels at ``WIDE_EFFICIENCY_GAIN`` times that. Those
constants decide both which kernel a device launches (``forward_tiles``, ``dkdv_tiles``) and
``auto``'s choice between the fused kernels and dense cuDNN, so a rewritten kernel is not done
until they describe it. This script reads the rows where the record timed every problem on the
64-slot kernels (``ours-64``) and on the wide ones (``ours-wide``), 16-bit only, and finds:

* per direction, the two efficiencies (unmasked, masked) and the one wide gain that minimise the
  squared relative error of the predicted compute time (the backward: dQ and dK/dV one after the
  other, one efficiency pair for both kernels, as ``FUSED_EFFICIENCY`` states it); the gain is
  shared by both directions (a grid over the gain, linear least squares inside);
* the rows' measured and predicted times under the current and the fitted constants, and how
  often the model orders two measured times of a direction the way the GPU did.

Usage:  python benchmarks/fit_tile_model.py RECORD.json [...] [--json OUT]
A record is a ``neighborhood-<date>.json`` (its ``rows``). Prints the table and the constants to
paste into tile_model.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

import _report  # benchmarks/_report.py (this script's folder is on sys.path)

VARIANTS = ("ours-64", "ours-wide")  # forced kernels: their boxes follow from the device alone
GAINS = np.round(np.arange(0.50, 3.001, 0.01), 2)  # the wide gain's grid
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DIRECTIONS = ("fwd", "bwd")


def variant_boxes(variant, table, rank, dtype, head_dim, capability):
    """``{kernel: (query box, key box)}`` an engine of the record launched: ours-64 the 64-slot
    boxes everywhere; ours-wide the wide kernels' where the device runs them (as the benchmark
    forces them: ``tile_model.wide_tiles`` / ``wide_key_tiles`` in place of the rule)."""
    from cudnn_attn.fallback_kernels import fused_build, tile_model

    narrow = tile_model.choose_tiles(table, rank)
    if variant == "ours-64" or not fused_build.wide(dtype, capability):
        return {"fwd": narrow, "dq": narrow, "dkdv": narrow}
    query_major = tile_model.wide_tiles(table, rank)
    key_major = (tile_model.wide_key_tiles(table, rank)
                 if head_dim in fused_build.WIDE_DKDV_HEAD_DIMS else narrow)
    return {"fwd": query_major, "dq": query_major, "dkdv": key_major}


def samples(rows):
    """One sample per (row, variant) with a measured time: its direction, measured seconds and
    the compute seconds at efficiency 1 per (path, wide) of the kernels it ran."""
    from cudnn_attn.core import roofline
    from cudnn_attn.fallback_kernels import fused_build, tile_model
    from cudnn_attn.model.geometry import neighborhood_table

    out = []
    for row in rows:
        dtype = DTYPES.get(row.get("dtype"))
        if dtype is None or "spatial" not in row or "capability" not in row:
            continue  # fp32 has its own path; rows before the record carried shapes
        spatial, kernel = tuple(row["spatial"]), tuple(row["kernel"])
        rank = len(spatial)
        table = tuple(neighborhood_table(spatial, kernel, (1,) * rank, (1,) * rank,
                                         (False,) * rank))
        peak = roofline.DEVICE_CEILINGS.get(row.get("model_ceilings"),
                                            roofline.DEFAULT_CEILINGS).matmul
        head_dim = fused_build.head_dim_bucket(row["D"], row["D"])
        for variant in VARIANTS:
            ms = row.get(f"{variant}_ms")
            if not ms:
                continue
            boxes = variant_boxes(variant, table, rank, dtype, head_dim,
                                  tuple(row["capability"]))
            work = dict.fromkeys(itertools.product(("unmasked", "masked"), (False, True)), 0.0)
            for name in tile_model.DIRECTION_KERNELS[row["dir"]]:
                qbox, kbox = boxes[name]
                figures = tile_model.tile_figures(
                    table, qbox, kbox, dim_qk=row["D"], dtype=dtype, batch=row.get("B", 1),
                    heads=row["H"], query_tile=math.prod(qbox), key_tile=math.prod(kbox))
                wide = tile_model.runs_wide(figures, name)
                for path, flops in tile_model.kernel_work(figures, name).items():
                    work[path, wide] += flops / peak
            out.append({"problem": row["problem"], "H": row["H"], "D": row["D"],
                        "dtype": row["dtype"], "dir": row["dir"], "engine": variant,
                        "seconds": ms / 1e3, "work": work})
    return out


def predict(sample, eff, gain):
    """Predicted compute seconds of a sample with efficiencies ``eff`` and the wide ``gain``."""
    return sum(w / (eff[path] * (gain if wide else 1.0))
               for (path, wide), w in sample["work"].items())


def _fit_direction(group, gain):
    """Least squares on the relative error for (1/unmasked, 1/masked) at a fixed gain; a path
    no sample exercises keeps ``None``. Returns (efficiencies, sum of squared errors)."""
    columns = [[(s["work"]["unmasked", False] + s["work"]["unmasked", True] / gain) / s["seconds"],
                (s["work"]["masked", False] + s["work"]["masked", True] / gain) / s["seconds"]]
               for s in group]
    a = np.array(columns)
    used = a.any(axis=0)
    x = np.zeros(2)
    if used.any():
        x[used] = np.linalg.lstsq(a[:, used], np.ones(len(group)), rcond=None)[0]
    if (x[used] <= 0).any():  # a negative inverse efficiency: the data cannot tell the paths apart
        return None, math.inf
    eff = {path: (1 / x[i] if used[i] else None) for i, path in enumerate(("unmasked", "masked"))}
    residual = float(((a @ x) - 1.0) @ ((a @ x) - 1.0))
    return eff, residual


def fit(sample_list):
    """``{"gain": g, "fwd": {...}, "bwd": {...}, "error": ...}``: the constants minimising the
    summed squared relative error of both directions (``None`` where a direction has no rows)."""
    groups = {d: [s for s in sample_list if s["dir"] == d] for d in DIRECTIONS}
    best = None
    for gain in GAINS:
        total, result = 0.0, {"gain": float(gain)}
        for direction, group in groups.items():
            eff, residual = _fit_direction(group, gain) if group else (None, 0.0)
            total += residual
            result[direction] = eff
        if best is None or total < best["error"]:
            best = {**result, "error": total}
    return best


def concordance(sample_list, eff_of, gain):
    """Fraction of pairs (same direction, measured times 10 % apart or more) the model orders as
    the GPU did."""
    agree = total = 0
    for a, b in itertools.combinations(sample_list, 2):
        if a["dir"] != b["dir"] or max(a["seconds"], b["seconds"]) < 1.1 * min(a["seconds"], b["seconds"]):
            continue
        total += 1
        pa, pb = predict(a, eff_of(a), gain), predict(b, eff_of(b), gain)
        agree += (pa < pb) == (a["seconds"] < b["seconds"])
    return agree / total if total else None


def current_constants():
    from cudnn_attn.fallback_kernels import tile_model

    return tile_model.FUSED_EFFICIENCY, tile_model.WIDE_EFFICIENCY_GAIN


def refit(rows) -> dict | None:
    """``{"fit", "ordering", "rows"}`` for a record's rows (``None`` when none can be fitted):
    the fitted constants, the fraction of measured pairs each set of constants orders right
    (``now`` and ``fit``), and per sample the measured and both predicted ms."""
    sample_list = samples(rows)
    if not sample_list:
        return None
    efficiency, gain = current_constants()
    now = {"fwd": efficiency["fwd"], "bwd": efficiency["dq"]}  # one figure for both backward kernels
    fitted = fit(sample_list)
    complete = {d: bool(fitted[d]) and None not in fitted[d].values() for d in DIRECTIONS}
    table = [{"problem": s["problem"], "H": s["H"], "D": s["D"], "dtype": s["dtype"],
              "dir": s["dir"], "engine": s["engine"], "measured_ms": 1e3 * s["seconds"],
              "model_now_ms": 1e3 * predict(s, now[s["dir"]], gain),
              "model_fit_ms": (1e3 * predict(s, fitted[s["dir"]], fitted["gain"])
                               if complete[s["dir"]] else None)}
             for s in sample_list]
    ordering = {"now": concordance(sample_list, lambda s: now[s["dir"]], gain)}
    if all(complete[s["dir"]] for s in sample_list):
        ordering["fit"] = concordance(sample_list, lambda s: fitted[s["dir"]], fitted["gain"])
    return {"fit": fitted, "ordering": ordering, "rows": table}


def constant_lines(fitted: dict) -> list[str]:
    """The fitted constants as tile_model.py spells them."""
    lines = [f"WIDE_EFFICIENCY_GAIN = {fitted['gain']:.2f}"]
    from cudnn_attn.fallback_kernels.tile_model import DIRECTION_KERNELS

    for direction, names in DIRECTION_KERNELS.items():
        lines += [f"FUSED_EFFICIENCY[{name!r}] = {fitted[direction]}" for name in names]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("records", type=Path, nargs="+", help="neighborhood-<date>.json files")
    parser.add_argument("--json", type=Path, help="write the fit and the table here")
    args = parser.parse_args(argv)
    rows = [row for path in args.records for row in json.loads(path.read_text()).get("rows", [])]
    result = refit(rows)
    if result is None:
        print("no 16-bit row with ours-64 / ours-wide times and the problem's shape: nothing to "
              "fit (records from before the forced variants cannot be refitted)")
        return 1
    _report.print_table(result["rows"], list(result["rows"][0]))
    print(f"ordering of measured pairs kept by the model: {result['ordering']}")
    print("fitted constants (tile_model.py):")
    for line in constant_lines(result["fit"]):
        print("  " + line)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
