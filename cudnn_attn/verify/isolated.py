"""The selftest with each engine in a process of its own, and the report any stream rebuilds.

On a GPU one illegal memory access poisons the CUDA context of its process: every later call
there fails, whichever engine makes it. So :func:`run_isolated` starts one
:mod:`~cudnn_attn.verify.engine_process` per engine (side by side). When one dies (a fault, an
abort, or no verdict within ``case_timeout_s``), the run it died in is recorded as a failure
naming why, and a fresh process goes on from the next run, at most ``MAX_CRASHES`` times per
engine. The other engines never notice.

Every verdict is in the JSON-lines stream the moment it is known (:mod:`.stream`), so
:func:`report_from_stream` gives the table and counts of a run that was killed at any point.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cases import Case
from .checks import Outcome
from .report import SelftestReport
from .runs import plan_runs
from .stream import ResultStream, case_from_dict, outcome_from_event, read_events

__all__ = ["run_isolated", "report_from_stream", "report_from_events", "MAX_CRASHES"]

MAX_CRASHES = 3  # per engine; then its remaining runs are reported as not judged
INTERRUPTED = 130
_POLL_S = 0.5


def _exit_why(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


def _open_run(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last ``begin`` of one engine's events that has no verdict after it."""
    judged = {e["index"] for e in events if e["event"] in ("result", "crash")}
    begun = [e for e in events if e["event"] == "begin" and e["index"] not in judged]
    return begun[-1] if begun else None


def _child_env() -> dict[str, str]:
    """The children import this very package, wherever the parent found it."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class _Engine(threading.Thread):
    """Runs one engine's processes until its runs are judged, restarting after each crash."""

    def __init__(self, backend: str, runs: list[tuple[Case, str]], argv: list[str],
                 stream_path: Path, case_timeout_s: float | None, stopping: threading.Event):
        super().__init__(name=f"selftest-{backend}", daemon=True)
        self.backend, self.runs, self.argv = backend, runs, argv
        self.stream_path, self.case_timeout_s, self.stopping = stream_path, case_timeout_s, stopping
        self.proc: subprocess.Popen | None = None
        self.crashes = 0

    def _events(self) -> list[dict[str, Any]]:
        return [e for e in read_events(self.stream_path) if e.get("backend") == self.backend]

    def _hung(self) -> bool:
        """The open run has had no verdict for longer than ``case_timeout_s``."""
        if not self.case_timeout_s:
            return False
        run = _open_run(self._events())
        return run is not None and time.time() - run.get("time", time.time()) > self.case_timeout_s

    def _wait(self) -> bool:
        """Wait for the process; kill it and return True when its current run hangs."""
        checked = time.monotonic()
        while True:
            try:
                self.proc.wait(timeout=_POLL_S)
                return False
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() - checked >= 2.0 and not self.stopping.is_set():
                checked = time.monotonic()
                if self._hung():
                    self.proc.kill()
                    self.proc.wait()
                    return True

    def run(self) -> None:
        start = 0
        while not self.stopping.is_set():
            self.proc = subprocess.Popen([*self.argv, "--start", str(start)], env=_child_env())
            hung = self._wait()
            code = self.proc.returncode
            if self.stopping.is_set() or (code in (0, INTERRUPTED) and not hung):
                return
            run = _open_run(self._events())
            why = (f"no verdict within {self.case_timeout_s:g} s (hung), killed" if hung
                   else _exit_why(code))
            with ResultStream(self.stream_path) as stream:
                if run is None:  # it died outside any run (an import, the engine's setup)
                    stream.write("crash", backend=self.backend, index=None, returncode=code,
                                 why=why)
                    return
                case, dtype = self.runs[run["index"]]
                stream.write("crash", backend=self.backend, index=run["index"], case=case.name,
                             dtype=dtype, params=case.as_dict(), returncode=code, why=why)
            print(f"selftest {self.backend}: the engine's process died in {case.name} {dtype} "
                  f"({why}); {'going on from the next run' if self.crashes + 1 < MAX_CRASHES else 'giving up'}",
                  file=sys.stderr, flush=True)
            self.crashes += 1
            start = run["index"] + 1
            if start >= len(self.runs) or self.crashes >= MAX_CRASHES:
                return


def _stop(engines: list[_Engine], grace_s: float = 3.0) -> None:
    """After a SIGINT: the children (which got it too when it came from a terminal) write their
    ``interrupted`` line and stop; any still running a moment later get SIGINT from here, and
    SIGKILL when that does not end them either."""
    deadline = time.monotonic() + 0.5
    for sig in (signal.SIGINT, signal.SIGKILL):
        for engine in engines:
            proc = engine.proc
            while proc is not None and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if proc is not None and proc.poll() is None:
                proc.send_signal(sig)
        deadline = time.monotonic() + grace_s


def run_isolated(names: Sequence[str], dtypes: Sequence[str], cases: Sequence[Case], *,
                 settings: dict[str, Any], environment: dict[str, Any], stream=None,
                 progress: bool = True, case_timeout_s: float | None = None) -> SelftestReport:
    """Judge ``cases`` x ``dtypes`` on each engine in ``names``, one process per engine; the
    events go to ``stream`` (a path; a temporary file when None). Interrupted (SIGINT), it
    returns what was judged, with ``settings["interrupted"]`` set."""
    runs = plan_runs(cases, dtypes)
    with tempfile.TemporaryDirectory(prefix="cudnn_attn_selftest_") as scratch:
        cases_file = Path(scratch) / "cases.json"
        cases_file.write_text(json.dumps([c.as_dict() for c in cases]))
        stream_path = Path(stream) if stream is not None else Path(scratch) / "selftest.jsonl"
        with ResultStream(stream_path) as s:
            s.write("selftest", settings=settings, environment=environment)
        stopping = threading.Event()
        engines = []
        for backend in names:
            argv = [sys.executable, "-m", "cudnn_attn.verify.engine_process", "--backend",
                    backend, "--cases", str(cases_file), "--stream", str(stream_path),
                    *(a for d in dtypes for a in ("--dtype", d)),
                    *(["--progress"] if progress else [])]
            engines.append(_Engine(backend, runs, argv, stream_path, case_timeout_s, stopping))
        for engine in engines:
            engine.start()
        try:
            while any(e.is_alive() for e in engines):
                for engine in engines:
                    engine.join(timeout=0.2)
        except KeyboardInterrupt:
            stopping.set()
            _stop(engines)
            settings["interrupted"] = True
        return report_from_events(read_events(stream_path), settings=settings,
                                  environment=environment)


def _crash_outcome(event: dict[str, Any]) -> Outcome:
    outcome = Outcome(case_from_dict(event["params"]), event["backend"], event["dtype"])
    outcome.fail("forward", f"the engine's process died in this run: {event['why']}")
    return outcome


def report_from_events(events: list[dict[str, Any]], settings: dict[str, Any] | None = None,
                       environment: dict[str, Any] | None = None) -> SelftestReport:
    """The report the events describe, complete or not: an engine whose runs were not all judged
    is listed in ``settings["incomplete"]`` with how far it came (and the report is not ok)."""
    header = next((e for e in events if e["event"] == "selftest"), {})
    settings = dict(settings if settings is not None else header.get("settings") or {})
    environment = environment if environment is not None else header.get("environment") or {}
    names = list(settings.get("backends") or [])
    names += [e["backend"] for e in events if "backend" in e and e["backend"] not in names]
    outcomes: dict[tuple[str, int], Outcome] = {}
    unavailable, totals, stopped = {}, {}, {}
    for e in events:
        kind, backend = e["event"], e.get("backend")
        if kind == "engine":
            totals[backend] = e["runs"]
            if e.get("unavailable"):
                unavailable[backend] = e["unavailable"]
        elif kind == "result":
            outcomes[backend, e["index"]] = outcome_from_event(e)
        elif kind == "crash" and e.get("index") is not None:
            outcomes[backend, e["index"]] = _crash_outcome(e)
        elif kind == "crash":
            stopped[backend] = f"its process ended ({e['why']}) outside any run"
        elif kind == "interrupted":
            stopped[backend] = "interrupted"
    incomplete = {}
    for backend in names:
        if backend in unavailable:
            continue
        judged = sum(1 for b, _ in outcomes if b == backend)
        total = totals.get(backend)
        if total is None:
            incomplete[backend] = stopped.get(backend, "its process never started judging")
        elif judged < total:
            incomplete[backend] = (f"judged {judged} of {total} runs"
                                   f"{' (' + stopped[backend] + ')' if backend in stopped else ''}")
    if incomplete:
        settings["incomplete"] = incomplete
    order = {name: i for i, name in enumerate(names)}
    ordered = [outcomes[key] for key in sorted(outcomes, key=lambda k: (order[k[0]], k[1]))]
    return SelftestReport(ordered, unavailable, environment, settings)


def report_from_stream(path) -> SelftestReport:
    """The report of the selftest whose stream is at ``path`` (e.g. one killed at a deadline)."""
    return report_from_events(read_events(path))
