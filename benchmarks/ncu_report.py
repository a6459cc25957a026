"""Nsight Compute for the fused neighborhood kernels: the command lines and the CSV they print.

``ncu`` is not on the device's ``PATH`` (``../shared/gpu.md``): ``find_ncu`` looks in
``/usr/local/cuda/bin`` as well. A profile is two runs of it: ``profile_command`` replays the
first ``launch_count`` launches of the kernels whose (demangled) name matches ``regex`` with the
sections named, and exports them to a ``.ncu-rep`` file (kept with the record, for the GUI);
``import_command`` prints that file's details page as CSV, one line per metric::

    "ID",...,"Kernel Name",...,"Section Name","Metric Name","Metric Unit","Metric Value"

(the columns between vary with the version; only these five named ones are read).
``parse_csv`` turns it into one record per profiled launch, and ``headline`` picks the figures
the issue asks for from each: SM and memory throughput, achieved occupancy, registers, shared
memory, DRAM and L2 throughput.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
from pathlib import Path
from typing import Any

NCU_PATHS = ("/usr/local/cuda/bin/ncu",)
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "MemoryWorkloadAnalysis")
KERNEL_REGEX = "na_fused"
# headline key: (words in the section's display name, metric name). The section matters where
# two sections share a metric name ("Memory Throughput": % of peak in Speed Of Light, bytes/s
# in Memory Workload Analysis).
HEADLINE = {
    "duration": ("speed of light", "Duration"),
    "sm_throughput_pct": ("speed of light", "Compute (SM) Throughput"),
    "memory_throughput_pct": ("speed of light", "Memory Throughput"),
    "dram_throughput_pct": ("speed of light", "DRAM Throughput"),
    "l2_throughput_pct": ("speed of light", "L2 Cache Throughput"),
    "l1_throughput_pct": ("speed of light", "L1/TEX Cache Throughput"),
    "achieved_occupancy_pct": ("occupancy", "Achieved Occupancy"),
    "theoretical_occupancy_pct": ("occupancy", "Theoretical Occupancy"),
    "registers_per_thread": ("launch statistics", "Registers Per Thread"),
    "dynamic_shared_memory_per_block": ("launch statistics", "Dynamic Shared Memory Per Block"),
    "static_shared_memory_per_block": ("launch statistics", "Static Shared Memory Per Block"),
    "block_size": ("launch statistics", "Block Size"),
    "grid_size": ("launch statistics", "Grid Size"),
    "waves_per_sm": ("launch statistics", "Waves Per SM"),
    "memory_throughput": ("memory workload analysis", "Memory Throughput"),
    "l2_hit_rate_pct": ("memory workload analysis", "L2 Hit Rate"),
    "mem_busy_pct": ("memory workload analysis", "Mem Busy"),
}
COLUMNS = ("ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value")


def find_ncu(candidates: tuple[str, ...] = NCU_PATHS) -> str | None:
    """The ``ncu`` executable: on ``PATH``, else the first of ``candidates`` that exists."""
    found = shutil.which("ncu")
    if found:
        return found
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def profile_command(ncu: str, report: Path, argv: list[str], *, launch_count: int = 8,
                    regex: str = KERNEL_REGEX, sections: tuple[str, ...] = SECTIONS) -> list[str]:
    """``ncu`` profiling the first ``launch_count`` launches of kernels matching ``regex`` in
    the program ``argv`` (and its children), exported to ``report`` (``.ncu-rep``)."""
    if launch_count < 1:
        raise ValueError(f"launch_count must be at least 1, got {launch_count}")
    command = [ncu, "--target-processes", "all", "--kernel-name", f"regex:{regex}",
               "--launch-count", str(launch_count)]
    for section in sections:
        command += ["--section", section]
    return command + ["--export", str(report), "--force-overwrite", *argv]


def import_command(ncu: str, report: Path) -> list[str]:
    """``ncu`` printing ``report``'s details page as CSV."""
    return [ncu, "--import", str(report), "--csv", "--page", "details"]


def number(text: str) -> float | None:
    """A metric value as a float (thousands separators dropped), None when it is not a number
    (``"n/a"``, a name)."""
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def parse_csv(text: str) -> list[dict[str, Any]]:
    """One record per profiled launch, in the report's order: ``{"id", "kernel", "metrics":
    {section: {metric: {"unit", "value"}}}, "headline": {...}}``. Lines before the header
    (``==PROF==`` messages) are skipped; a CSV without the columns gives ``ValueError``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no Nsight Compute CSV header (a line starting with \"ID\") in the text")
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise ValueError(f"Nsight Compute CSV lacks the columns {missing}")
    launches: dict[str, dict[str, Any]] = {}
    for row in reader:
        if row.get("ID") in (None, ""):
            continue
        launch = launches.setdefault(row["ID"], {"id": row["ID"], "kernel": row["Kernel Name"],
                                                 "metrics": {}})
        value = row["Metric Value"]
        launch["metrics"].setdefault(row["Section Name"], {})[row["Metric Name"]] = {
            "unit": row["Metric Unit"], "value": number(value) if number(value) is not None
            else value}
    for launch in launches.values():
        launch["headline"] = headline(launch["metrics"])
    return list(launches.values())


def headline(metrics: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The figures of ``HEADLINE`` found in one launch's metrics, each ``{"value", "unit"}``."""
    found = {}
    for key, (section_words, metric) in HEADLINE.items():
        for section, values in metrics.items():
            if section_words in section.lower() and metric in values:
                found[key] = values[metric]
                break
    return found
