"""``Explanation``: every engine's verdict on one call (what ``explain()`` returns, and the unfused
NATTEN ops' ``explain``)."""

from __future__ import annotations

from typing import Iterator, Mapping, Optional

from ..model.problem import AttnProblem
from . import dispatch

__all__ = ["Explanation"]


class Explanation(Mapping):
    """Each backend's verdict, in priority order: ``"selected"``, ``"available"`` or reasons.

    ``engines``: for a call cuDNN can run whose graphs ``graph_cache`` already holds (an earlier
    call, or a loaded warm cache), the engine cuDNN picked per graph (``"sdpa_forward"``,
    ``"sdpa_backward"`` -> ``EngineChoice``: engine id, knobs, kernels). ``notes``: how the
    selected engine runs the call when that is not plain (e.g. cuDNN's two-row graph for a
    repeatable single-query call). ``predicted_ms``: each engine's predicted time where
    ``auto``'s cost rule compared engines (``dispatch.cost_choice``), and ``why`` its one-line
    account (``""`` when the priority order decided)."""

    def __init__(self, problem: AttnProblem, verdicts: dict, engines: Optional[dict] = None,
                 cost: Optional["dispatch.CostChoice"] = None, notes: Optional[list] = None):
        self.problem = problem
        self._verdicts = verdicts
        self.engines = dict(engines or {})
        self.notes = list(notes or [])
        cost = cost or dispatch.CostChoice()
        self.predicted_ms = dict(cost.predicted)
        self.why = cost.why

    def __getitem__(self, name: str):
        return self._verdicts[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._verdicts)

    def __len__(self) -> int:
        return len(self._verdicts)

    @property
    def selected(self) -> Optional[str]:
        return next((n for n, v in self._verdicts.items() if v == "selected"), None)

    def __str__(self) -> str:
        text = f"{self.problem.describe()}\n{dispatch.format_reasons(self._verdicts)}"
        if self.why:
            text += f"\n{self.why}"
        for tag, engine in self.engines.items():
            text += f"\ncuDNN {tag}: " + str(engine).replace("\n", "\n  ")
        for note in self.notes:
            text += f"\n{self.selected}: {note}"
        return text

    def __repr__(self) -> str:
        return f"Explanation({self._verdicts!r})"
