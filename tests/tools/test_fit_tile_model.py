"""benchmarks/fit_tile_model.py on a synthetic GPU record: rows timed by a known tile model.

The record's times come from ``tile_model.kernel_ms`` at chosen efficiencies and wide gain, each
forced variant on the boxes its kernels take on an H200 (ours-64: ``choose_tiles`` everywhere;
ours-wide: ``wide_tiles`` for the forward and dQ, ``wide_key_tiles`` for dK/dV up to head dim 64),
on problems that mix unmasked and masked tile pairs. The fit must recover the constants and keep
every ordering of the measured rows.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from common import load_script

from cudnn_attn.core import roofline
from cudnn_attn.fallback_kernels import tile_model
from cudnn_attn.model.geometry import neighborhood_table

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fit_tile_model.py"
PROBLEMS = [((128, 128), (31, 31), 64, 128), ((128, 128), (7, 7), 64, 128),
            ((64, 64), (13, 13), 64, 64), ((8192,), (1023,), 64, 128), ((4096,), (255,), 64, 64)]
TRUTH = {"fwd": {"unmasked": 0.21, "masked": 0.12}, "bwd": {"unmasked": 0.17, "masked": 0.09}}
GAIN = 1.4


def _load():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return load_script(SCRIPT, "fit_tile_model")
    finally:
        sys.path.remove(str(SCRIPT.parent))


def synthetic_rows(monkeypatch):
    monkeypatch.setattr(tile_model, "WIDE_EFFICIENCY_GAIN", GAIN)
    h200 = roofline.DEVICE_CEILINGS["H200"]
    rows = []
    for spatial, kernel, heads, dim in PROBLEMS:
        rank = len(spatial)
        table = tuple(neighborhood_table(spatial, kernel, (1,) * rank, (1,) * rank,
                                         (False,) * rank))
        narrow = tile_model.choose_tiles(table, rank)
        boxes = {"ours-64": {"fwd": narrow, "dq": narrow, "dkdv": narrow},
                 "ours-wide": {"fwd": tile_model.wide_tiles(table, rank),
                               "dq": tile_model.wide_tiles(table, rank),
                               "dkdv": (tile_model.wide_key_tiles(table, rank) if dim <= 64
                                        else narrow)}}
        for direction, kernels in (("fwd", ("fwd",)), ("bwd", ("dq", "dkdv"))):
            row = {"problem": f"{spatial} k{kernel}", "spatial": list(spatial),
                   "kernel": list(kernel), "dtype": "bf16", "D": dim, "H": heads, "B": 1,
                   "dir": direction, "capability": [9, 0], "model_ceilings": "H200"}
            for variant, chosen in boxes.items():
                ms = 0.0
                for name in kernels:
                    qbox, kbox = chosen[name]
                    figures = tile_model.tile_figures(table, qbox, kbox, dim_qk=dim, heads=heads,
                                                      query_tile=math.prod(qbox),
                                                      key_tile=math.prod(kbox))
                    ms += tile_model.kernel_ms(figures, name, h200, TRUTH[direction])
                    assert ms > 1e3 * figures.bytes[name] / h200.bandwidth  # compute-bound
                row[f"{variant}_ms"] = ms
            rows.append(row)
    monkeypatch.undo()
    return rows


def test_the_fit_recovers_the_constants(monkeypatch):
    fit = _load()
    rows = synthetic_rows(monkeypatch)
    assert any(r["ours-64_ms"] < r["ours-wide_ms"] for r in rows)  # both orders occur
    assert any(r["ours-64_ms"] > r["ours-wide_ms"] for r in rows)
    samples = fit.samples(rows)
    assert len(samples) == 2 * len(rows)
    result = fit.fit(samples)
    assert result["gain"] == pytest.approx(GAIN)
    for direction, eff in TRUTH.items():
        for path, value in eff.items():
            assert result[direction][path] == pytest.approx(value, rel=1e-6)
    assert fit.concordance(samples, lambda s: result[s["dir"]], result["gain"]) == 1.0
    # the current constants are not the truth: some predicted time differs from the record
    now = {"fwd": tile_model.FUSED_EFFICIENCY["fwd"], "bwd": tile_model.FUSED_EFFICIENCY["dq"]}
    assert any(abs(fit.predict(s, now[s["dir"]], tile_model.WIDE_EFFICIENCY_GAIN)
                   - s["seconds"]) > 0.01 * s["seconds"] for s in samples)


def test_main_prints_the_constants_and_writes_json(monkeypatch, tmp_path, capsys):
    fit = _load()
    record = tmp_path / "neighborhood.json"
    record.write_text(json.dumps({"rows": synthetic_rows(monkeypatch)
                                  + [{"problem": "fp32 row", "dtype": "fp32", "dir": "fwd"}]}))
    out = tmp_path / "fit.json"
    assert fit.main([str(record), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"WIDE_EFFICIENCY_GAIN = {GAIN:.2f}" in printed and "FUSED_EFFICIENCY['dkdv']" in printed
    saved = json.loads(out.read_text())
    assert saved["ordering"]["fit"] == 1.0 and len(saved["rows"]) == 2 * len(PROBLEMS) * 2


def test_a_record_without_the_forced_variants_cannot_be_fitted(tmp_path, capsys):
    fit = _load()
    record = tmp_path / "old.json"
    record.write_text(json.dumps({"rows": [{"problem": "2-D", "dtype": "bf16", "dir": "fwd",
                                            "D": 128, "H": 8, "ours_ms": 2.5}]}))
    assert fit.main([str(record)]) == 1
    assert "nothing to fit" in capsys.readouterr().out


def test_the_gpu_report_carries_the_refit(monkeypatch):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        report = load_script(SCRIPT.parent / "gpu_report.py", "gpu_report_for_fit")
    finally:
        if str(SCRIPT.parent) in sys.path:  # the script takes its folder off the path itself
            sys.path.remove(str(SCRIPT.parent))
    lines = report.tile_model_lines(synthetic_rows(monkeypatch))
    assert lines[0] == "## Tile model refit" and "100%" in lines[2]
    assert f"WIDE_EFFICIENCY_GAIN = {GAIN:.2f}" in lines
    assert report.tile_model_lines([{"problem": "x", "dtype": "bf16", "dir": "fwd"}]) == []
