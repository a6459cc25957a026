"""benchmarks/gpu_report.py and benchmarks/ceilings.py on CPU.

The GPU benchmarks cannot run here, so their records are written the way the scripts write them:
rows with the scripts' keys and FLOP counts (their ``flops``/``na_flops``), ``ceilings.add_fraction``
for ``ours/ceiling``, and ``_report.write_json`` for the file. The report is then checked for the
figures of every row, the verdicts, the plot series and its behaviour without matplotlib.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from common import load_script

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
DEVICE = "NVIDIA H100 80GB HBM3"
CEILINGS = {"device": DEVICE, "copy_tbps": 3.012, "copy_bytes": 2 ** 30, "matmul_tflops": 800.0,
            "matmul_n": 8192, "matmul_dtype": "bfloat16"}
TORCH_CUDNN_ERROR = "RuntimeError: No available kernel. Aborting execution."


@pytest.fixture(scope="module")
def report():
    sys.path.insert(0, str(BENCH))  # the scripts import their siblings _report and ceilings
    try:
        return load_script(BENCH / "gpu_report.py", "bench_gpu_report")
    finally:
        if str(BENCH) in sys.path:  # loading cudnn.py has usually taken it off already
            sys.path.remove(str(BENCH))


def cudnn_row(report, s, causal, direction, ours, bare, flash, torch_cudnn):
    """One throughput row as bench_shape writes it (bf16, D=128, hidden 2048, 16k tokens)."""
    bench = report.bench_cudnn
    b, h = bench.TOKENS // s, bench.HIDDEN // 128
    work = bench.flops(b, h, s, 128, causal, direction)
    row = {"dtype": "bfloat16", "D": 128, "S": s, "B": b, "H": h, "causal": causal, "dir": direction,
           "ours_ms": work / ours / 1e9, "bare_ms": work / bare / 1e9, "ours_tflops": ours,
           "bare_tflops": bare, "ours/bare": ours / bare, "torch-flash_tflops": flash,
           "torch-cudnn_tflops": torch_cudnn}
    if torch_cudnn is None:
        row["torch-cudnn_error"] = TORCH_CUDNN_ERROR
    return row


def cudnn_rows(report, min_vs_bare=0.99):
    """The --quick grid; the S=8k causal forward has ours/bare = ``min_vs_bare``."""
    return [
        cudnn_row(report, 1024, False, "fwd", 401.5, 410.25, 380.0, 395.125),
        cudnn_row(report, 1024, False, "bwd", 301.0, 305.0, 280.0, None),
        cudnn_row(report, 8192, True, "fwd", 612.5 * min_vs_bare, 612.5, 550.0, 600.0),
        cudnn_row(report, 8192, True, "bwd", 512.0, 515.0, 470.0, 505.0),
    ]


def overhead_rows(tiny_vs_bare=1.02):
    bare = 12.0
    return [{"call": "bare execute", "us_per_call": bare, "vs_bare": 1.0},
            {"call": "attention(backend='cudnn')", "us_per_call": bare * tiny_vs_bare,
             "vs_bare": tiny_vs_bare},
            {"call": "attention() auto", "us_per_call": 13.5, "vs_bare": 13.5 / bare},
            {"call": "graph_cache hit (host lookup)", "us_per_call": 0.4, "vs_bare": None},
            {"call": "decode paged: ours", "us_per_call": 31.0, "vs_bare": None},
            {"call": "decode paged: NaN past the lengths", "us_per_call": None, "vs_bare": None,
             "finite_with_nan_past_lengths": False, "max_diff_vs_hidden": None}]


def neighborhood_rows(report, ours_fwd=300.0, flex_fwd=180.0, natten_error=True):
    """bench_problem's two rows for the target problem (bf16, D=128, 2-D 128x128 k=31x31)."""
    bench = report.bench_neighborhood
    spatial, kernel = bench.PROBLEMS[2]
    rows = []
    for direction, ours, flex in (("fwd", ours_fwd, flex_fwd), ("bwd", 220.0, 150.0)):
        work = bench.na_flops(1, 16, spatial, kernel, 128, direction)
        row = {"problem": "2-D 128x128 k=31x31", "rank": 2, "dtype": "bf16", "D": 128, "H": 16, "B": 1,
               "dir": direction, "errors": {}, "flex_ms": work / flex / 1e9, "flex_tflops": flex,
               "sdpa-cudnn_ms": 4.25, "sdpa-cudnn_tflops": 550.0}
        if ours is not None:
            row.update({"ours_ms": work / ours / 1e9, "ours_tflops": ours, "ours/flex": ours / flex})
        else:
            row["errors"]["ours"] = "RuntimeError: no cupy"
        if natten_error:
            row["errors"]["natten-flex"] = "ModuleNotFoundError: No module named 'natten'"
        else:
            row["natten-flex_tflops"] = 0.8 * flex
        rows.append(row)
    rows[0]["max|ours-flex|"] = 0.0078125
    return rows


def write_records(report, tmp_path, *, cudnn=None, neighborhood=None, ceilings=True):
    """Write the two JSON records with _report.write_json and the scripts' payload keys."""
    machine = dict(CEILINGS) if ceilings else None
    paths = []
    if cudnn is not None:
        report.ceilings.add_fraction(cudnn, machine)
        overhead = overhead_rows()
        verdicts = report.bench_cudnn.target_verdicts(cudnn, overhead)
        paths.append(report._report.write_json("cudnn", {
            "options": {"quick": True}, "device": DEVICE, "problem": {"tokens": 16384, "hidden": 2048},
            "ceilings": machine, "overhead": overhead, "builds": [], "throughput": cudnn,
            "headline_tflops": report.bench_cudnn.headline_tflops(cudnn),
            "targets": {name: v["met"] for name, v in verdicts.items()},
            "target_values": {name: v["value"] for name, v in verdicts.items()}}, results_dir=tmp_path))
    if neighborhood is not None:
        report.ceilings.add_fraction(neighborhood, machine)
        met, text = report.bench_neighborhood.target_verdict(neighborhood)
        paths.append(report._report.write_json("neighborhood", {
            "options": {"quick": True}, "device": DEVICE, "ceilings": machine, "rows": neighborhood,
            "target": {"met": met, "text": text}}, results_dir=tmp_path))
    return paths


def table_line(markdown, *leading):
    """The one markdown table line that starts with the cells ``leading``."""
    start = "| " + " | ".join(map(str, leading)) + " |"
    found = [line for line in markdown.splitlines() if line.startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


# -- ceilings ------------------------------------------------------------------------------------

def test_ceilings_need_cuda_and_smoke_run_on_cpu(report):
    ceilings = report.ceilings
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            ceilings.measure()
    got = ceilings.measure("cpu", copy_bytes=2 ** 16, matmul_n=32, repeats=2, number=1)
    for key in ("copy_tbps", "matmul_tflops"):
        assert isinstance(got[key], float) and got[key] > 0
    assert got["copy_bytes"] == 2 ** 16 and got["matmul_n"] == 32 and got["device"] == "cpu"
    assert "TB/s" in ceilings.describe(got) and "not measured" in ceilings.describe(None)
    rows = [{"ours_tflops": 400.0}, {"ours_tflops": None}, {}]
    ceilings.add_fraction(rows, CEILINGS)
    assert rows == [{"ours_tflops": 400.0, "ours/ceiling": 0.5}, {"ours_tflops": None}, {}]


@pytest.mark.parametrize("script", ["cudnn.py", "neighborhood.py"])
def test_scripts_take_the_new_options_and_write_nothing_without_cuda(script, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(BENCH / script), "--quick", "--no-ceilings",
                           "--results-dir", str(tmp_path / "out")], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "needs a CUDA GPU" in done.stdout and not (tmp_path / "out").exists()


# -- markdown ------------------------------------------------------------------------------------

def test_markdown_holds_every_figure_of_every_row(report, tmp_path):
    rows, na = cudnn_rows(report), neighborhood_rows(report)
    records = report.load_records(write_records(report, tmp_path, cudnn=rows, neighborhood=na))
    text = report.report_markdown(records)
    cell = report._report.format_cell
    assert DEVICE in text.splitlines()[0] and records["cudnn"]["date"][:10] in text.splitlines()[0]
    assert "copy 3.01 TB/s" in text and "bf16 matmul 8192^3 800 TFLOP/s" in text
    assert table_line(text, "bfloat16", 128, 8192, True, "fwd") == (
        "| bfloat16 | 128 | 8192 | True | fwd | 606.38 | 612.50 | 0.99 | 550.00 | 600.00 | 0.76 |")
    for row in rows:
        line = table_line(text, row["dtype"], row["D"], row["S"], row["causal"], row["dir"])
        cells = line.strip("|").split(" | ")
        assert [c.strip() for c in cells[5:]] == [cell(row.get(k)) for k in (
            "ours_tflops", "bare_tflops", "ours/bare", "torch-flash_tflops", "torch-cudnn_tflops",
            "ours/ceiling")]
    for row in overhead_rows():
        assert table_line(text, row["call"]) == "| " + " | ".join(
            [row["call"]] + [cell(row.get(key)) for key in (
                "us_per_call", "vs_bare", "vs_torch_cudnn", "finite_with_nan_past_lengths",
                "max_diff_vs_hidden")]) + " |"
    for row in na:
        line = table_line(text, row["problem"], row["dtype"], row["D"], row["dir"])
        for key in ("ours_ms", "ours_tflops", "flex_tflops", "ours/flex", "ours/ceiling", "sdpa-cudnn_ms"):
            assert f" {cell(row[key])} |" in line, key
    assert "max abs ours-flex" in text and cell(0.0078125) in table_line(text, na[0]["problem"], "bf16",
                                                                         128, "fwd")


def test_verdicts_are_recomputed_with_their_figures(report, tmp_path):
    rows = cudnn_rows(report, min_vs_bare=0.97)
    records = report.load_records(write_records(report, tmp_path, cudnn=rows,
                                                neighborhood=neighborhood_rows(report, 300.0, 210.0)))
    lines = report.verdict_lines(records)
    assert "* cudnn: MISS large shapes ours/bare >= 0.98 (min): 0.970" in lines
    assert "* cudnn: ok   tiny call vs bare <= 1.05: 1.020" in lines
    # min of ours/torch-cudnn over the rows where it ran: 401.5/395.125, 594.125/600, 512/505
    assert f"* cudnn: MISS ours/torch-cudnn >= 1.0 on the same shapes (min): {594.125 / 600:.3f}" in lines
    assert "* cudnn: MISS bf16 D=128 causal S=8k fwd >= 640.0 TFLOP/s (H200): 594.125" in lines
    na_line = next(line for line in lines if line.startswith("* neighborhood"))
    assert "target MISSED" in na_line and "300.0 TFLOP/s" in na_line and "1.43x Flex" in na_line

    good = cudnn_rows(report, min_vs_bare=0.99)
    good[2]["torch-cudnn_tflops"] = 590.0
    records = report.load_records(write_records(report, tmp_path, cudnn=good,
                                                neighborhood=neighborhood_rows(report, 300.0, 180.0)))
    lines = report.verdict_lines(records)
    assert "* cudnn: ok   large shapes ours/bare >= 0.98 (min): 0.990" in lines
    assert any(line.startswith("* neighborhood: target MET") and "1.67x Flex" in line for line in lines)


def test_missing_peers_and_missing_ours(report, tmp_path):
    rows = cudnn_rows(report)
    for row in rows:  # torch-cudnn ran nowhere
        row["torch-cudnn_tflops"] = None
        row["torch-cudnn_error"] = TORCH_CUDNN_ERROR
    na = neighborhood_rows(report, ours_fwd=None)
    records = report.load_records(write_records(report, tmp_path, cudnn=rows, neighborhood=na,
                                                ceilings=False))
    text = report.report_markdown(records)
    assert table_line(text, "bfloat16", 128, 1024, False, "fwd").endswith("| 380.00 | - | - |")
    assert "n/a  ours/torch-cudnn >= 1.0 on the same shapes (min): not measured" in text
    assert "target NOT MEASURED" in text and "RuntimeError: no cupy" in text
    assert f"* torch-cudnn: {TORCH_CUDNN_ERROR}" in text
    assert "* natten-flex: ModuleNotFoundError: No module named 'natten'" in text
    assert "ceilings: not measured" in text
    summary = report.summary_markdown(records)
    assert "torch-cudnn -" in summary and "ceilings in the same run" not in summary


def test_summary_is_a_readme_table(report, tmp_path):
    records = report.load_records(write_records(report, tmp_path, cudnn=cudnn_rows(report),
                                                neighborhood=neighborhood_rows(report)))
    summary = report.summary_markdown(records)
    date = records["cudnn"]["date"][:10]
    assert summary.startswith(f"Measured on {date} on {DEVICE} (ceilings in the same run: "
                              "copy 3.01 TB/s, bf16 matmul 800 TFLOP/s):")
    line = table_line(summary, "attention() cuDNN, bf16 D=128 S=8192 causal fwd")
    assert line == ("| attention() cuDNN, bf16 D=128 S=8192 causal fwd | 606.38 | 0.76 | "
                    "bare 612.50 (0.99x), torch-flash 550.00 (1.10x), torch-cudnn 600.00 (1.01x) |")
    line = table_line(summary, "fused neighborhood, bf16 D=128 2-D 128x128 k=31x31 fwd")
    assert "| 300.00 | 0.38 | flex 180.00 (1.67x), natten-flex - |" in line


# -- plots ---------------------------------------------------------------------------------------

def test_cudnn_series_are_the_input_figures(report):
    rows = cudnn_rows(report)
    rows.append(cudnn_row(report, 4096, True, "fwd", 580.0, 590.0, 520.0, 575.0))
    series = report.cudnn_series(rows)
    assert set(series) == {("bfloat16", 128, False, "fwd"), ("bfloat16", 128, False, "bwd"),
                           ("bfloat16", 128, True, "fwd"), ("bfloat16", 128, True, "bwd")}
    causal_fwd = series[("bfloat16", 128, True, "fwd")]
    assert causal_fwd["ours"] == ([4096, 8192], [580.0, rows[2]["ours_tflops"]])
    assert causal_fwd["bare"] == ([4096, 8192], [590.0, 612.5])
    assert causal_fwd["torch-cudnn"] == ([4096, 8192], [575.0, 600.0])
    assert "torch-cudnn" not in series[("bfloat16", 128, False, "bwd")]  # it did not run there
    assert series[("bfloat16", 128, False, "bwd")]["torch-flash"] == ([1024], [280.0])


def test_neighborhood_bars_are_the_input_figures(report):
    rows = neighborhood_rows(report, ours_fwd=None, natten_error=False)
    labels, bars = report.neighborhood_bars(rows)
    assert labels == ["2-D 128x128 k=31x31\nbf16 D=128 fwd", "2-D 128x128 k=31x31\nbf16 D=128 bwd"]
    assert bars == {"ours": [None, 220.0], "flex": [180.0, 150.0], "natten-flex": [0.8 * 180.0, 0.8 * 150.0]}


def test_without_matplotlib_the_markdown_is_still_written(report, tmp_path, monkeypatch, capsys):
    paths = write_records(report, tmp_path / "in", cudnn=cudnn_rows(report),
                          neighborhood=neighborhood_rows(report))
    proof = tmp_path / "in" / "notes.json"  # another suite: only its device and date count
    proof.write_text(json.dumps({"suite": "notes", "selftest": {"passed": 812, "failed": 0},
                                 "env": {"gpu": DEVICE, "date": "2026-11-27T01:02:03+00:00"}}))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out = tmp_path / "out"
    assert report.main([*map(str, paths), str(proof), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    date = json.loads(paths[0].read_text())["date"][:10]
    written = out / f"gpu-{date}.md"
    assert written.read_text().startswith(f"# GPU benchmarks, {date}, {DEVICE}")
    assert "notes.json (2026-11-27" in written.read_text()
    assert "plots skipped: matplotlib is not installed" in printed
    assert sorted(p.name for p in out.iterdir()) == [written.name]
    assert f"Measured on {date} on {DEVICE}" in printed and "| row | ours TFLOP/s |" in printed


def test_plots_are_written_as_png(report, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    paths = write_records(report, tmp_path / "in", cudnn=cudnn_rows(report),
                          neighborhood=neighborhood_rows(report))
    out = tmp_path / "out"
    assert report.main([*map(str, paths), "--out", str(out)]) == 0
    date = json.loads(paths[0].read_text())["date"][:10]
    printed = capsys.readouterr().out
    for name in (f"cudnn-{date}.png", f"neighborhood-{date}.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote {out / name}" in printed


def test_a_run_without_benchmark_records_is_refused(report, tmp_path):
    proof = tmp_path / "gpu_proof.json"
    proof.write_text(json.dumps({"selftest": {"passed": 1}}))
    with pytest.raises(SystemExit):
        report.main([str(proof), "--out", str(tmp_path)])


def test_a_gpu_proof_record_adds_the_correctness_section(report, tmp_path):
    proof = report.gpu_proof
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    table = "feature  cudnn\n-------  -----\ndense    pass 0.41x 3ms\n1 passed, 0 failed, 0 declined (1 runs)"
    steps = [
        proof.StepResult("gpu-tests", "pytest -m gpu", returncode=1, seconds=212.0, summary={
            "gpu": {"passed": 301, "failed": 2, "errors": 0, "skipped": 1},
            "failures": [{"test": "tests/engines/test_cupy_gpu.py::test_x", "outcome": "failed",
                          "message": "AssertionError: 3.1x > 2x"}]}),
        proof.StepResult("selftest-full", "selftest --full", returncode=0, seconds=95.0,
                         summary={"ok": True, "counts": {"pass": 1, "FAIL": 0, "declined": 0},
                                  "table": table, "unavailable": {}}),
        proof.StepResult("sanitize-memcheck", "sanitize.py", timed_out=True, seconds=330.0),
    ]
    path = proof.write_record(tmp_path, work, steps, {"budget_s": 540.0, "seconds": 498.2,
                                                      "cubins": {"carried": 3,
                                                                 "compiled_on_device": 0},
                                                      "commit": "0123abcd",
                                                      "nvrtc": {"version": "13.0",
                                                                "cubins_compiled_with": "13.0"},
                                                      "budget": {"limit_s": 600.0,
                                                                 "margin_s": 41.5}})
    record = json.loads(path.read_text())
    record["steps"][0]["field_of_a_later_version"] = 1  # does not stop the report
    path.write_text(json.dumps(record))
    bench = write_records(report, tmp_path, cudnn=cudnn_rows(report))
    assert report.main([str(path), *map(str, bench), "--out", str(out)]) == 0
    [md] = out.glob("gpu-*.md")
    text = md.read_text()
    section = text.split("## Correctness", 1)[1].split("## Ceilings", 1)[0]
    assert "NOT every step passed; 498.2 s of a 540.0 s budget" in section
    assert "carried 3, compiled on the device 0" in section
    assert ("Commit 0123abcd; NVRTC on the device 13.0, cubins compiled with 13.0; 41.5 s left "
            "under the device's 600.0 s limit.") in section
    assert "'passed': 301, 'failed': 2" in section
    assert "failed: tests/engines/test_cupy_gpu.py::test_x: AssertionError: 3.1x > 2x" in section
    assert any(line.startswith("sanitize-memcheck ") and line.endswith("TIMED OUT after 330 s")
               for line in section.splitlines())
    assert table in section  # the selftest table as the run printed it
    # The benchmark sections are still there, and a proof alone is a record too.
    assert "## cuDNN engine: TFLOP/s" in text
    assert report.main([str(path), "--out", str(tmp_path / "alone")]) == 0


def test_extra_rows_of_a_second_record_join_the_first(report, tmp_path):
    [quick] = write_records(report, tmp_path / "quick", cudnn=cudnn_rows(report))
    more_rows = [cudnn_row(report, 4096, True, "fwd", 580.0, 590.0, 520.0, 575.0),
                 cudnn_row(report, 16384, True, "fwd", 640.0, 650.0, 600.0, 630.0),
                 # A row the quick record has too: the first record's figures stay.
                 cudnn_row(report, 8192, True, "bwd", 1.0, 1.0, 1.0, 1.0)]
    [more] = write_records(report, tmp_path / "more", cudnn=more_rows, ceilings=False)
    records = report.load_records([quick, more])
    rows = records["cudnn"]["throughput"]
    assert len(rows) == len(cudnn_rows(report)) + 2
    causal = report.cudnn_series(rows)[("bfloat16", 128, True, "fwd")]
    assert causal["ours"][0] == [4096, 8192, 16384] and causal["ours"][1][::2] == [580.0, 640.0]
    assert report.cudnn_series(rows)[("bfloat16", 128, True, "bwd")]["ours"] == ([8192], [512.0])
    assert records["cudnn"]["ceilings"] == CEILINGS  # the second record measured none
    # The verdicts see the joined rows: ours/bare at S >= 4096 now includes 580 / 590.
    verdicts = report.bench_cudnn.target_verdicts(rows, records["cudnn"]["overhead"])
    large = next(v for k, v in verdicts.items() if k.startswith("large shapes"))
    assert large["value"] == pytest.approx(min(580.0 / 590.0, 0.99, 512.0 / 515.0, 640.0 / 650.0))
