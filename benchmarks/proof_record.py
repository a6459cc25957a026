"""gpu_proof's record: what each step's files say, and the summary written whole or not at all.

A step cut at its deadline still counts: pytest's outcome stream (``pytest_plugins/``) and the
selftest's JSON-lines stream hold every verdict up to the kill, so the summary gives their
counts marked ``partial``. The record and the tarball are written to a temporary name and
renamed, so a kill mid-write leaves the previous complete file, never half of a new one.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _report
import proof_extras

from proof_steps import StepResult

MORE = "more"  # the phase 3 benchmarks' folder
TUNED = "tuned"  # the autotuned cuDNN rows' folder (phase 3, last)
NAME_WIDTH = 24  # the step-name column of the printed summary
TARBALL = "gpu_proof-files.tar.gz"
SKIP_REASONS_SHOWN = 20


CAUSES_SHOWN = 20
FLASH_ATTN_STEP = "flash-attn-suite"


def _cause(message: str) -> str:
    """A failure's cause: its message with the numbers that differ per case taken out."""
    return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", message)[:200]


def _count(outcomes: dict[str, str], messages: dict[str, tuple[str, str]], marker: str,
           failures_shown: int) -> dict[str, Any]:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    skips: Counter = Counter()
    causes: Counter = Counter()
    failures = []
    for test_id, outcome in outcomes.items():
        counts[outcome] += 1
        kind, message = messages.get(test_id, ("", ""))
        if outcome == "skipped":
            skips[message or "(no reason given)"] += 1
        elif outcome in ("failed", "errors"):
            failures.append({"test": test_id, "outcome": outcome, "message": message[:300]})
            causes[_cause(message) or "(no message)"] += 1
    return {marker: counts, "failures": failures[:failures_shown],
            "failures_total": len(failures),
            "skip_reasons": dict(skips.most_common(SKIP_REASONS_SHOWN)),
            "causes": dict(causes.most_common(CAUSES_SHOWN))}


def junit_counts(path: Path, marker: str = "gpu", failures_shown: int = 40) -> dict[str, Any]:
    """``{marker: {passed, failed, errors, skipped}, "failures": [...], "skip_reasons":
    {reason: count}}`` from a junit XML file (every test of a ``-m marker`` run has it)."""
    outcomes, messages = {}, {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # the test a SIGINT interrupted: an empty <testcase/>
            continue
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            kind = {"failure": "failed", "error": "errors", "skipped": "skipped"}.get(child.tag)
            if kind is None:
                continue
            text = (child.get("message") or child.text or "").strip().splitlines()
            if outcome == "passed":  # a failure then a teardown error counts once, as failed
                outcome = kind
                messages[test_id] = (kind, text[0] if text else "")
        outcomes[test_id] = outcome
    return _count(outcomes, messages, marker, failures_shown)


def stream_counts(path: Path, marker: str = "gpu", failures_shown: int = 40) -> dict[str, Any]:
    """The same counts from ``pytest_plugins/outcome_stream.py``'s lines (a cut run's)."""
    outcomes, messages = {}, {}
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:  # the line a kill cut short
            continue
        test_id, outcome = event["nodeid"], event["outcome"]
        if outcome == "failed" and event["when"] != "call":  # as junit: setup, teardown, a
            # crashed xdist worker ("???") are errors
            outcome = "errors"
        if outcomes.get(test_id, "passed") == "passed":
            outcomes[test_id] = outcome
            messages[test_id] = (outcome, event.get("message", ""))
    return _count(outcomes, messages, marker, failures_shown)


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _newest(work: Path, suite: str) -> Path | None:
    found = sorted(work.glob(f"{suite}-*.json"))
    return found[-1] if found else None


def _tests_summary(result: StepResult, work: Path, marker: str = "gpu") -> dict[str, Any]:
    xml, stream = work / f"{result.name}.xml", work / f"{result.name}.jsonl"
    found = []
    if xml.exists():
        try:
            found.append({**junit_counts(xml, marker), "source": "junit"})
        except ET.ParseError:  # written while the kill came
            pass
    if stream.exists():
        found.append({**stream_counts(stream, marker), "source": "outcome stream"})
    if not found:
        return {}
    # The file that saw the most tests (a cut run's junit lacks what its workers were running).
    best = max(found, key=lambda s: sum(s[marker].values()))
    return {**best, "partial": result.timed_out}


def _selftest_summary(result: StepResult, work: Path) -> dict[str, Any]:
    data = _load_json(work / f"{result.name}.json")
    stream = work / f"{result.name}.jsonl"
    if data is None and stream.exists():  # cut before it wrote its JSON: the stream has it all
        from cudnn_attn.verify.isolated import report_from_stream

        data = report_from_stream(stream).as_dict()
        data["source"] = "stream"
    if data is None:
        return {}
    incomplete = (data.get("settings") or {}).get("incomplete")
    return {**{k: data.get(k) for k in ("ok", "counts", "table", "unavailable")},
            "source": data.get("source", "json"), "incomplete": incomplete,
            "partial": bool(result.timed_out or incomplete
                            or (data.get("settings") or {}).get("interrupted"))}


def summarize(result: StepResult, work: Path) -> dict[str, Any]:
    """The figures a step's own files hold (empty when it wrote none); ``partial`` when the
    step was cut short and the counts are what it judged until then."""
    name = result.name
    extra = proof_extras.summarize(name, work)
    if extra is not None:
        return extra
    if name == "gpu-tests":
        return _tests_summary(result, work)
    if name == FLASH_ATTN_STEP:  # FlashAttention's own tests, with the runner's sample
        summary = _tests_summary(result, work, marker="flash_attn")
        run = _load_json(work / f"{name}.json") or {}
        return {**summary, **{k: run[k] for k in ("per_test", "seed", "device") if k in run}}
    if name.startswith("selftest-"):
        return _selftest_summary(result, work)
    if name.startswith("sanitize-"):
        data = _load_json(work / f"{name}.json") or {}
        return {tool: {k: v.get(k) for k in ("ok", "why", "errors", "warnings", "cases_ok",
                                             "cases_failed", "seconds")}
                for tool, v in data.get("tools", {}).items()}
    if name.startswith("bench-"):
        suite, folder = name.removeprefix("bench-"), work
        for sub in (MORE, TUNED):  # bench-<suite>-<sub> writes into its own folder
            if suite.endswith("-" + sub):
                suite, folder = suite.removesuffix("-" + sub), work / sub
        path = _newest(folder, suite)
        data = _load_json(path) if path else None
        keep = ("ceilings", "headline_tflops", "targets", "target_values", "target", "overhead")
        return {} if data is None else {"file": str(path.relative_to(work)),
                                         **{k: data[k] for k in keep if k in data}}
    return {}


def write_atomically(path: Path, write: Callable[[Path], None]) -> Path:
    """``write(temporary)`` then rename it to ``path``: readers see the old file or the new one."""
    partial = path.with_name(f".{path.name}.partial")
    write(partial)
    os.replace(partial, path)
    return path


def write_record(out: Path, work: Path, results: list[StepResult], extra: dict[str, Any],
                 tarball: bool = True) -> Path:
    """The summary JSON and (``tarball``) the tarball of every file the steps wrote (cubins
    excluded), each written whole or not at all."""
    payload = {"ok": not any(r.failed for r in results), "steps": [vars(r) for r in results],
               **extra}
    path = _report.write_json("gpu_proof", payload, results_dir=out)

    def pack(target: Path) -> None:
        with tarfile.open(target, "w:gz") as tar:
            for item in sorted(work.iterdir()):
                if item.name != "cubins":
                    tar.add(item, arcname=item.name)
    if tarball:
        write_atomically(out / TARBALL, pack)
    return path


def summary_lines(results: list[StepResult]) -> list[str]:
    """The compact picture printed last (the device tool returns the output's tail)."""
    lines = []
    for r in results:
        state = ("not started: " + r.not_started if r.not_started else
                 f"TIMED OUT after {r.seconds:.0f} s" if r.timed_out else
                 f"{'ok' if r.ok else 'FAILED'} (exit {r.returncode}, {r.seconds:.0f} s)")
        if r.optional and not r.ok and not r.failed:
            state += " (extra rows: not a failure)"
        if r.leftovers:
            state += f"; {r.leftovers} leftover process(es) ended"
        lines.append(f"{r.name:<{NAME_WIDTH}} {state}")
        s, pad = r.summary, " " * NAME_WIDTH
        partial = " (partial: cut at its deadline)" if s.get("partial") else ""
        if r.name == "gpu-tests" and s:
            lines.append(f"{pad} gpu: {s['gpu']}{partial}")
            lines += [f"{pad} {f['outcome']}: {f['test']}: {f['message'][:160]}"
                      for f in s["failures"][:15]]
            lines += [f"{pad} skipped {n}: {why[:140]}"
                      for why, n in list((s.get("skip_reasons") or {}).items())[:5]]
        elif r.name == FLASH_ATTN_STEP and s:
            lines.append(f"{pad} flash_attn: {s['flash_attn']}{partial}")
            lines += [f"{pad} {n} x {cause[:150]}" for cause, n in
                      list((s.get("causes") or {}).items())[:8]]
            lines += [f"{pad} skipped {n}: {why[:140]}"
                      for why, n in list((s.get("skip_reasons") or {}).items())[:5]]
        elif r.name.startswith("selftest-") and s.get("counts"):
            lines.append(f"{pad} {s['counts']}{partial}")
            lines += [f"{pad} {engine}: NOT FINISHED, {how}"
                      for engine, how in (s.get("incomplete") or {}).items()]
        elif r.name.startswith("sanitize-"):
            lines += [f"{pad} {tool}: {v.get('errors')} errors, {v.get('cases_ok')} cases ok"
                      f"{'' if v.get('ok') else ', ' + '; '.join(v.get('why') or [])}"
                      for tool, v in s.items()]
        elif r.name.startswith("bench-"):
            values = s.get("target_values") or {}
            for what, met in (s.get("targets") or {}).items():
                mark = "n/a " if met is None else "ok  " if met else "MISS"
                value = values.get(what)
                lines.append(f"{pad} {mark} {what}" + ("" if value is None else f": {value:.3g}"))
            if "target" in s:
                lines.append(f"{pad} {s['target'].get('text')}")
        lines += proof_extras.summary_lines(r, pad)
    return lines
