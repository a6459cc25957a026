"""The selftest's result: a table a person reads at a glance, and JSON for the record."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .checks import Outcome

__all__ = ["LEGEND", "SelftestReport"]

# Printed under the table: what a cell says, in the words a first-time reader needs.
LEGEND = ("cells: pass = every case matched the float64 oracle; +d = some cases or backwards "
          "declined; FAIL = a case exceeded its limit; declined = the engine refused every case "
          "(reasons below); - = not run. Nx = worst error over that of the naive computation in "
          "the same dtype (limits: 2x forward, 3x backward); ms = time of all its cases.")


def _cell(outcomes: list[Outcome]) -> str:
    """``pass 0.8x 12ms`` / ``FAIL 3.1x`` / ``declined``, over every case and dtype of a cell."""
    statuses = {o.status for o in outcomes}
    ratios = [r for o in outcomes for r in (o.forward_ratio, o.backward_ratio) if r is not None]
    worst = f" {max(ratios):.2f}x" if ratios else ""
    millis = f" {1000 * sum(o.seconds for o in outcomes):.0f}ms"
    if "FAIL" in statuses:
        return "FAIL" + worst + millis
    if "pass" in statuses:
        partly = "+d" if "declined" in statuses or any(o.backward == "declined"
                                                       for o in outcomes) else ""
        return "pass" + partly + worst + millis
    return "declined"


@dataclass
class SelftestReport:
    """Every outcome of a selftest run, the engines it could not run, and the environment.

    ``ok`` is true when nothing failed (declines are not failures); ``table()`` is the engine x
    feature summary; ``to_json(path)`` writes everything, including each case's parameters.
    """

    outcomes: list[Outcome]
    unavailable: dict[str, list[str]] = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Nothing failed, every engine asked for by name could run here, and every engine that
        could run judged all its runs (an interrupted or cut-short run is not ok)."""
        return (not self.failures and not (self.settings.get("requested") and self.unavailable)
                and not self.settings.get("incomplete") and not self.settings.get("interrupted"))

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "FAIL"]

    @property
    def counts(self) -> dict[str, int]:
        counts = {"pass": 0, "FAIL": 0, "declined": 0}
        for o in self.outcomes:
            counts[o.status] += 1
        return counts

    def table(self) -> str:
        """Rows: features; columns: engines; cells: status, worst error ratio (engine error over
        the naive computation's; limits 2x forward, 3x backward), time; then failures and
        declines with their reasons."""
        backends = list(dict.fromkeys(o.backend for o in self.outcomes))
        cells: dict[tuple, list[Outcome]] = defaultdict(list)
        for o in self.outcomes:
            cells[o.case.feature, o.backend].append(o)
        features = list(dict.fromkeys(o.case.feature for o in self.outcomes))
        rows = [["feature", *backends]]
        rows += [[f, *(_cell(cells[f, b]) if cells[f, b] else "-" for b in backends)]
                 for f in features]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(LEGEND)
        verdict = "FAIL, requested but" if self.settings.get("requested") else ""
        for name, reasons in self.unavailable.items():
            lines.append(f"{name}: {verdict} not run on this machine ({'; '.join(reasons)})"
                         .replace(":  ", ": "))
        for name, how_far in (self.settings.get("incomplete") or {}).items():
            lines.append(f"{name}: NOT FINISHED, {how_far}")
        for o in self.failures:
            lines.append(f"FAIL {o.backend} {o.dtype} {o.case.name}: {' | '.join(o.detail)}")
        declined = defaultdict(list)
        for o in self.outcomes:
            if o.forward == "declined" or o.backward == "declined":
                declined[o.backend, o.detail[-1][:200]].append(o.case.name)
        for (backend, reason), names in declined.items():
            shown = ", ".join(sorted(set(names))[:6]) + (" ..." if len(set(names)) > 6 else "")
            lines.append(f"declined by {backend} ({shown}): {reason}")
        c = self.counts
        lines.append(f"{c['pass']} passed, {c['FAIL']} failed, {c['declined']} declined "
                     f"({len(self.outcomes)} runs"
                     f"{', interrupted' if self.settings.get('interrupted') else ''})")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        # The table goes in too: a record read on another machine shows what the run printed.
        return {"ok": self.ok, "counts": self.counts, "table": self.table(),
                "settings": self.settings, "environment": self.environment,
                "unavailable": self.unavailable, "results": [o.as_dict() for o in self.outcomes]}

    def to_json(self, path) -> None:
        """Write :meth:`as_dict` to ``path`` whole or not at all (a temporary file, renamed)."""
        path = Path(path)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(self.as_dict(), indent=1, default=str) + "\n")
        os.replace(partial, path)
