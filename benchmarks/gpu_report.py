"""The report of a GPU benchmark run, made afterwards on any machine (no GPU needed).

The GPU session runs, writing its JSON under $OUT:
    python benchmarks/cudnn.py --quick --results-dir $OUT
    python benchmarks/neighborhood.py --quick --results-dir $OUT
and then, here:
    python benchmarks/gpu_report.py $OUT/cudnn-<date>.json $OUT/neighborhood-<date>.json \\
        [more/cudnn-<date>.json ...] [gpu_proof.json] --out benchmarks/results

writes ``gpu-<date>.md`` (device, date, ceilings, every table and target verdict) and, when
matplotlib is installed (the ``plot`` extra), ``cudnn-<date>.png`` (TFLOP/s against sequence length
per engine and peer) and ``neighborhood-<date>.png`` (bars per problem); it prints a README-ready
summary table. The verdicts are recomputed from the rows with the benchmark scripts' own rules.
A ``gpu_proof-<date>.json`` adds a correctness section (each step's state, the pytest counts
and failures, the selftest tables, the sanitizer's counts, in gpu_proof's own words); any other
JSON only contributes its device and date.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _report  # benchmarks/_report.py (this script's folder is on sys.path)
import ceilings  # before load_sibling("cudnn"), which takes this folder off sys.path

# The scripts' own verdict rules, not copies of them (loading cudnn.py also unshadows `cudnn`).
bench_cudnn = _report.load_sibling("cudnn")
bench_neighborhood = _report.load_sibling("neighborhood")
fit_tile_model = _report.load_sibling("fit_tile_model")
gpu_proof = _report.load_sibling("gpu_proof")  # its summary lines, for the correctness section

CUDNN_ENGINES = ("ours", "bare", "torch-flash", "torch-cudnn")
NEIGHBORHOOD_ENGINES = ("ours", "flex", "natten-flex")  # the useful-TFLOP/s ones (sdpa-* run dense)
SUMMARY_SEQS = (1024, 8192)  # the cuDNN rows of --quick, also the README's

CUDNN_COLUMNS = [("dtype", "dtype"), ("D", "D"), ("S", "S"), ("causal", "causal"), ("dir", "dir"),
                 ("ours TFLOP/s", "ours_tflops"), ("bare", "bare_tflops"), ("ours/bare", "ours/bare"),
                 ("torch-flash", "torch-flash_tflops"), ("torch-cudnn", "torch-cudnn_tflops"),
                 ("ours/ceiling", "ours/ceiling")]
OVERHEAD_COLUMNS = [("call", "call"), ("us per call", "us_per_call"), ("vs bare", "vs_bare"),
                    ("vs torch-cudnn", "vs_torch_cudnn"),
                    ("finite with NaN past the lengths", "finite_with_nan_past_lengths"),
                    ("max diff vs hidden", "max_diff_vs_hidden")]
NEIGHBORHOOD_COLUMNS = [("problem", "problem"), ("dtype", "dtype"), ("D", "D"), ("dir", "dir"),
                        ("ours ms", "ours_ms"), ("ours TFLOP/s", "ours_tflops"),
                        ("wgmma TFLOP/s", "ours-wgmma_tflops"), ("wgmma/ours", "wgmma/ours"),
                        ("64-slot ms", "ours-64_ms"), ("wide ms", "ours-wide_ms"),
                        ("model ms", "model_fused_ms"),
                        ("flex", "flex_tflops"), ("natten-flex", "natten-flex_tflops"),
                        ("ours/flex", "ours/flex"), ("ours/ceiling", "ours/ceiling"),
                        ("sdpa-cudnn ms", "sdpa-cudnn_ms"), ("sdpa-flash ms", "sdpa-flash_ms"),
                        ("max abs ours-flex", "max|ours-flex|")]


# -- input ---------------------------------------------------------------------------------------

KNOWN_SUITES = ("cudnn", "neighborhood", "gpu_proof")


# Each benchmark's list of rows, and the fields naming one row: a second record of the same
# suite (gpu_proof's extra rows) adds the rows the first lacks.
ROWS = {"cudnn": ("throughput", ("dtype", "D", "S", "causal", "dir")),
        "neighborhood": ("rows", ("problem", "dtype", "D", "dir"))}


def merge_rows(base: dict[str, Any], extra: dict[str, Any], suite: str) -> None:
    """Add ``extra``'s rows that ``base`` lacks to ``base`` (in place); ``base`` keeps its
    ceilings, overhead and options unless it has none."""
    field, naming = ROWS[suite]
    seen = {tuple(row[k] for k in naming) for row in base[field]}
    base[field] += [row for row in extra[field] if tuple(row[k] for k in naming) not in seen]
    for key, value in extra.items():
        if base.get(key) is None:
            base[key] = value


def load_records(paths: Sequence[Path]) -> dict[str, dict[str, Any]]:
    """``{suite: record}``: benchmark records of one suite merged (the first given first); a file
    of another suite is kept under its file name, for its device and date only."""
    records = {}
    for path in paths:
        record = json.loads(Path(path).read_text())
        suite = record.get("suite")
        if suite in ROWS and suite in records:
            merge_rows(records[suite], record, suite)
        else:
            records[suite if suite in KNOWN_SUITES else Path(path).name] = record
    return records


def record_device(record: dict[str, Any]) -> str | None:
    """The GPU a record was measured on: its ``device``, else the environment's ``gpu``."""
    return record.get("device") or (record.get("env") or {}).get("gpu")


def record_date(record: dict[str, Any]) -> str | None:
    """The record's UTC day, ``YYYY-MM-DD``."""
    date = record.get("date") or (record.get("env") or {}).get("date")
    return str(date)[:10] if date else None


def run_facts(records: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """``(device, date)`` of the run: the first record (benchmarks first) that names them."""
    ordered = sorted(records.values(), key=lambda r: r.get("suite") not in ("cudnn", "neighborhood"))
    device = next((d for d in map(record_device, ordered) if d), "unknown GPU")
    date = next((d for d in map(record_date, ordered) if d), "undated")
    return device, date


# -- markdown ------------------------------------------------------------------------------------

def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A markdown table of ``rows``: ``columns`` are ``(header, key)``; cells as _report prints them."""
    lines = ["| " + " | ".join(header for header, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_report.format_cell(row.get(key)) for _, key in columns) + " |"
              for row in rows]
    return "\n".join(lines)


def ceilings_lines(records: dict[str, dict[str, Any]]) -> list[str]:
    """One bullet per benchmark record: its ceilings, or that it skipped them."""
    return [f"* {suite}: {ceilings.describe(records[suite].get('ceilings'))}"
            for suite in ("cudnn", "neighborhood") if suite in records]


def verdict_lines(records: dict[str, dict[str, Any]]) -> list[str]:
    """Every target verdict with its figure, recomputed from the rows by the scripts' rules."""
    lines = []
    if "cudnn" in records:
        record = records["cudnn"]
        verdicts = bench_cudnn.target_verdicts(record["throughput"], record["overhead"])
        lines += [f"* cudnn: {bench_cudnn.verdict_line(name, v)}" for name, v in verdicts.items()]
    if "neighborhood" in records:
        _, text = bench_neighborhood.target_verdict(records["neighborhood"]["rows"])
        lines.append(f"* neighborhood: {text}")
    return lines


def peer_errors(records: dict[str, dict[str, Any]]) -> list[str]:
    """``engine: message`` for every peer that did not run, once each."""
    found = set()
    for row in records.get("cudnn", {}).get("throughput", []):
        found.update((key[: -len("_error")], msg) for key, msg in row.items() if key.endswith("_error"))
    for row in records.get("neighborhood", {}).get("rows", []):
        found.update(row.get("errors", {}).items())
    return [f"* {engine}: {msg}" for engine, msg in sorted(found)]


def correctness_lines(record: dict[str, Any]) -> list[str]:
    """A gpu_proof record as its run printed it: the step summary, then each selftest table."""
    known = {f.name for f in dataclasses.fields(gpu_proof.StepResult)}  # a newer record's
    results = [gpu_proof.StepResult(**{k: v for k, v in step.items() if k in known})  # extra
               for step in record["steps"]]  # fields do not stop the report
    state = "every step passed" if record.get("ok") else "NOT every step passed"
    cubins = record.get("cubins") or {}
    nvrtc, budget = record.get("nvrtc") or {}, record.get("budget") or {}
    lines = [f"{state}; {record.get('seconds')} s of a {record.get('budget_s')} s budget; cubins "
             f"carried {cubins.get('carried')}, compiled on the device "
             f"{cubins.get('compiled_on_device')}.", "",
             f"Commit {record.get('commit') or record.get('git')}; NVRTC on the device "
             f"{nvrtc.get('version') or nvrtc.get('error')}, cubins compiled with "
             f"{nvrtc.get('cubins_compiled_with')}; {budget.get('margin_s')} s left under the "
             f"device's {budget.get('limit_s')} s limit.", "",
             "```", *gpu_proof.summary_lines(results), "```"]
    for r in results:
        if r.summary.get("table"):
            lines += ["", f"### {r.name}", "", "```", r.summary["table"], "```"]
    return lines


def tile_model_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The tile model refitted to the run's forced-kernel rows (``fit_tile_model``), if any."""
    result = fit_tile_model.refit(rows)
    if result is None:
        return []
    ordering = ", ".join(f"{name} {value:.0%}" for name, value in result["ordering"].items()
                         if value is not None)
    return ["## Tile model refit", "",
            f"{len(result['rows'])} timings of the 64-slot and wide kernels; measured pairs the "
            f"model orders as the GPU did: {ordering or 'none 10 % apart'}. Fitted constants "
            "(`benchmarks/fit_tile_model.py`, for `tile_model.py`):", "", "```",
            *fit_tile_model.constant_lines(result["fit"]), "```", ""]


def _times(value: float | None, base: float | None) -> str:
    return f" ({value / base:.2f}x)" if value and base else ""


def summary_rows(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The README's rows: cuDNN bf16 D=128 at SUMMARY_SEQS, neighborhood bf16 D=128."""
    rows = []
    for r in records.get("cudnn", {}).get("throughput", []):
        if r["dtype"] == "bfloat16" and r["D"] == 128 and r["S"] in SUMMARY_SEQS:
            peers = [f"{engine} {_report.format_cell(r.get(f'{engine}_tflops'))}"
                     f"{_times(r['ours_tflops'], r.get(f'{engine}_tflops'))}"
                     for engine in CUDNN_ENGINES[1:]]
            rows.append({"row": f"attention() cuDNN, bf16 D=128 S={r['S']}"
                                f"{' causal' if r['causal'] else ''} {r['dir']}",
                         "ours": r["ours_tflops"], "ours/ceiling": r.get("ours/ceiling"),
                         "peers": ", ".join(peers)})
    for r in records.get("neighborhood", {}).get("rows", []):
        if r["dtype"] == "bf16" and r["D"] == 128:
            peers = [f"{engine} {_report.format_cell(r.get(f'{engine}_tflops'))}"
                     f"{_times(r.get('ours_tflops'), r.get(f'{engine}_tflops'))}"
                     for engine in NEIGHBORHOOD_ENGINES[1:]]
            rows.append({"row": f"fused neighborhood, bf16 D=128 {r['problem']} {r['dir']}",
                         "ours": r.get("ours_tflops"), "ours/ceiling": r.get("ours/ceiling"),
                         "peers": ", ".join(peers)})
    return rows


def summary_markdown(records: dict[str, dict[str, Any]]) -> str:
    """The README fragment: a dated line naming the GPU and its ceilings, then one table."""
    device, date = run_facts(records)
    ceilings = next((r["ceilings"] for r in records.values() if r.get("ceilings")), None)
    measured = (f" (ceilings in the same run: copy {ceilings['copy_tbps']:.2f} TB/s, bf16 matmul "
                f"{ceilings['matmul_tflops']:.0f} TFLOP/s)") if ceilings else ""
    table = markdown_table(summary_rows(records), [
        ("row", "row"), ("ours TFLOP/s", "ours"), ("of matmul ceiling", "ours/ceiling"),
        ("peers in the same run, TFLOP/s (ours / peer)", "peers")])
    return f"Measured on {date} on {device}{measured}:\n\n{table}\n"


def report_markdown(records: dict[str, dict[str, Any]]) -> str:
    """The whole report: facts, ceilings, verdicts, summary, and every table of the run."""
    device, date = run_facts(records)
    parts = [f"# GPU benchmarks, {date}, {device}", "",
             "Inputs: " + ", ".join(f"{name} ({record_date(r)}, {record_device(r)}, "
                                    f"git {r.get('git')})" for name, r in records.items()), "",
             *(["## Correctness", "", *correctness_lines(records["gpu_proof"]), ""]
               if "gpu_proof" in records else []),
             "## Ceilings", "", *ceilings_lines(records), "",
             "## Targets", "", *verdict_lines(records), "",
             "## Summary", "", summary_markdown(records)]
    if "cudnn" in records:
        record = records["cudnn"]
        parts += ["## cuDNN engine: TFLOP/s", "", markdown_table(record["throughput"], CUDNN_COLUMNS),
                  "", "## cuDNN engine: call overhead (tiny problem)", "",
                  markdown_table(record["overhead"], OVERHEAD_COLUMNS), ""]
    if "neighborhood" in records:
        parts += ["## Fused neighborhood attention", "",
                  ("TFLOP/s count useful (neighborhood) work; sdpa-* run dense attention on the "
                   "same tokens, so compare them by ms."), "",
                  markdown_table(records["neighborhood"]["rows"], NEIGHBORHOOD_COLUMNS), "",
                  *tile_model_lines(records["neighborhood"]["rows"])]
    errors = peer_errors(records)
    if errors:
        parts += ["## Peers that did not run", "", *errors, ""]
    return "\n".join(parts)


# -- plots ---------------------------------------------------------------------------------------

def cudnn_series(rows: Sequence[dict[str, Any]]) -> dict[tuple, dict[str, tuple[list, list]]]:
    """``{(dtype, D, causal, dir): {engine: (sequence lengths, TFLOP/s)}}``, S ascending; an engine
    is left out of a panel where it has no figure (did not run)."""
    series: dict[tuple, dict[str, tuple[list, list]]] = {}
    for r in sorted(rows, key=lambda r: r["S"]):
        panel = series.setdefault((r["dtype"], r["D"], r["causal"], r["dir"]), {})
        for engine in CUDNN_ENGINES:
            value = r.get(f"{engine}_tflops")
            if value is not None:
                xs, ys = panel.setdefault(engine, ([], []))
                xs.append(r["S"])
                ys.append(value)
    return series


def neighborhood_bars(rows: Sequence[dict[str, Any]]) -> tuple[list[str], dict[str, list]]:
    """``(bar group labels, {engine: TFLOP/s per group, None where it did not run})``."""
    labels = [f"{r['problem']}\n{r['dtype']} D={r['D']} {r['dir']}" for r in rows]
    return labels, {engine: [r.get(f"{engine}_tflops") for r in rows]
                    for engine in NEIGHBORHOOD_ENGINES}


def _pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _panel_order(item):
    (dtype, d, causal, direction), _ = item
    return dtype, d, causal, direction != "fwd"  # forward panel before backward


def plot_cudnn(plt, series, ceiling: float | None, title: str, path: Path) -> None:
    """One panel per (dtype, D, causal, dir): TFLOP/s against S, a line per engine (same colour
    in every panel), the matmul ceiling dashed; one legend for the figure."""
    colours = dict(zip(CUDNN_ENGINES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    ncols = min(4, len(series))
    nrows = math.ceil(len(series) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 3.2 * nrows + 0.6), squeeze=False)
    panels = sorted(series.items(), key=_panel_order)
    for ax, ((dtype, d, causal, direction), panel) in zip(axes.flat, panels):
        for engine, (xs, ys) in panel.items():
            ax.plot(xs, ys, marker="o", label=engine, color=colours[engine])
        if ceiling:
            ax.axhline(ceiling, linestyle="--", color="grey", label="bf16 matmul ceiling")
        seqs = sorted({x for xs, _ in panel.values() for x in xs})
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqs, [str(x) for x in seqs])
        ax.set_title(f"{dtype} D={d} {'causal' if causal else 'full'} {direction}", fontsize=9)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_ylim(bottom=0)
    for ax in axes.flat[len(series):]:
        ax.set_visible(False)
    legend = {}  # label -> handle, over every panel: an engine may be missing from some
    for ax in axes.flat:
        legend.update(zip(*reversed(ax.get_legend_handles_labels())))
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=len(legend), fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_neighborhood(plt, labels, bars, title: str, path: Path) -> None:
    """Grouped bars: per problem and direction, one bar per engine (a gap where it did not run)."""
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4))
    width = 0.8 / len(bars)
    for i, (engine, values) in enumerate(bars.items()):
        xs = [x + i * width for x in range(len(labels))]
        ax.bar(xs, [math.nan if v is None else v for v in values], width, label=engine)
        for x, value in zip(xs, values):
            if value is None:  # say so, rather than leave a gap that reads as zero
                ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.set_xticks([x + width * (len(bars) - 1) / 2 for x in range(len(labels))], labels, fontsize=7)
    ax.set_ylabel("useful TFLOP/s")
    ax.legend(fontsize=7)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(records: dict[str, dict[str, Any]], out: Path) -> list[Path] | None:
    """The PNGs of the run under ``out``; None (nothing written) when matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return None
    device, date = run_facts(records)
    written = []
    if "cudnn" in records:
        ceiling = (records["cudnn"].get("ceilings") or {}).get("matmul_tflops")
        path = out / f"cudnn-{date}.png"
        plot_cudnn(plt, cudnn_series(records["cudnn"]["throughput"]), ceiling,
                   f"cuDNN engine vs peers, {device}, {date}", path)
        written.append(path)
    if "neighborhood" in records:
        path = out / f"neighborhood-{date}.png"
        plot_neighborhood(plt, *neighborhood_bars(records["neighborhood"]["rows"]),
                          f"neighborhood attention, {device}, {date}", path)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", type=Path,
                        help="cudnn-<date>.json, neighborhood-<date>.json (and e.g. gpu_proof.json)")
    parser.add_argument("--out", type=Path, default=_report.RESULTS_DIR,
                        help="where gpu-<date>.md and the PNGs go (default benchmarks/results)")
    args = parser.parse_args(argv)
    records = load_records(args.json)
    if not set(KNOWN_SUITES) & records.keys():
        parser.error("none of the files is a cudnn, neighborhood or gpu_proof record")
    args.out.mkdir(parents=True, exist_ok=True)
    _, date = run_facts(records)
    report = args.out / f"gpu-{date}.md"
    report.write_text(report_markdown(records))
    print(f"wrote {report}")
    plots = write_plots(records, args.out)
    if plots is None:
        print("plots skipped: matplotlib is not installed (pip install 'cudnn-attn[plot]')")
    for path in plots or ():
        print(f"wrote {path}")
    print("\nREADME table:\n")
    print(summary_markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
