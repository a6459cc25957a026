"""A pytest plugin: each test's outcome as one flushed JSON line, the moment it is known.

    PYTHONPATH=benchmarks/pytest_plugins pytest -p outcome_stream --outcome-stream=PATH ...

junit XML is written only when pytest ends normally (a SIGTERM or SIGKILL leaves none); this
stream survives any kill. Under pytest-xdist the controller receives every worker's reports and
writes them, so there is one writer; a worker that crashed mid-test (pytest-timeout's thread
method ends its process) shows up as that test's failure. Lines:
``{"nodeid", "when", "outcome", "message", "duration"}`` for each setup/call/teardown that
failed or was skipped, and for every call; ``message`` is a skip's reason or a failure's first line.
"""

from __future__ import annotations

import json
import os


def pytest_addoption(parser):
    parser.addoption("--outcome-stream", metavar="PATH", help="append each outcome here")


class _Writer:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and report.passed:
            return
        line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                "message": "" if report.passed else _message(report),
                "duration": round(getattr(report, "duration", 0.0), 3)}
        os.write(self.fd, (json.dumps(line) + "\n").encode())  # one write per line

    def pytest_unconfigure(self, config) -> None:
        os.close(self.fd)


def pytest_configure(config):
    path = config.getoption("outcome_stream")
    if path and not hasattr(config, "workerinput"):  # the xdist controller (or plain pytest)
        config.pluginmanager.register(_Writer(path), "outcome-stream-writer")


def _message(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]
