"""The selftest's running record: one JSON line per event, written and flushed as it happens.

A selftest that is killed (a deadline, a crashed engine, a hung kernel) still leaves every result
judged before that on disk. Each line is one ``os.write`` to a file opened with ``O_APPEND``, so
several engine processes can share one stream without tearing each other's lines, and a kill can
cut at most the last line (which :func:`read_events` skips).

Events, each a dict with ``"event"``:

* ``engine``: an engine process started (``backend``, ``unavailable`` reasons, ``runs``, ``device``)
* ``begin``: run ``index`` of ``backend`` (``case``, ``dtype``) is about to be judged
* ``result``: its verdict (``index`` and :meth:`Outcome.as_dict`'s fields)
* ``crash``: the engine's process died during run ``index`` (``returncode``, ``why``)
* ``interrupted``: the engine stopped at ``index`` on SIGINT
* ``end``: the engine judged every run it was given
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .cases import Case
from .checks import Outcome

__all__ = ["ResultStream", "read_events", "outcome_from_event", "case_from_dict"]


class ResultStream:
    """Appends events to ``path`` (created if missing), each line durable once written."""

    def __init__(self, path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, default=str) + "\n"
        os.write(self._fd, line.encode())  # one write: whole line or (killed) nothing after it

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ResultStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_events(path) -> list[dict[str, Any]]:
    """Every complete event in the stream at ``path`` ([] when there is none)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:  # the line a kill cut short
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def _tuples(value):
    """JSON turned the case's tuples into lists; a frozen Case wants them back (hashable)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def case_from_dict(params: dict[str, Any]) -> Case:
    """The :class:`Case` whose :meth:`Case.as_dict` gave ``params``."""
    return Case(**{k: _tuples(v) for k, v in params.items()})


def outcome_from_event(event: dict[str, Any]) -> Outcome:
    """The :class:`Outcome` a ``result`` event describes."""
    return Outcome(case_from_dict(event["params"]), event["backend"], event["dtype"],
                   forward=event["forward"], backward=event["backward"],
                   forward_ratio=event.get("forward_ratio"),
                   backward_ratio=event.get("backward_ratio"),
                   detail=list(event.get("detail") or []), seconds=event.get("seconds") or 0.0)
