"""The public exceptions. This module imports nothing of the package, so every module can use it."""

from __future__ import annotations


from typing import Mapping

__all__ = ["NotSupportedError", "format_reasons"]


def format_reasons(reasons: Mapping[str, "list[str] | str"]) -> str:
    """One block of text: each engine's verdict (a string) or its list of reasons."""
    lines = []
    for name, verdict in reasons.items():
        if isinstance(verdict, str):
            lines.append(f"  {name:<6} {verdict}")
        else:
            lines.append(f"  {name:<6} cannot run:")
            lines.extend(f"           - {reason}" for reason in verdict)
    return "\n".join(lines)


class NotSupportedError(NotImplementedError):
    """A valid call that no (or not the requested) engine can run.

    ``reasons`` maps each engine that was considered to its list of reasons; ``problem`` is the
    call's description (anything with a ``describe()`` method, usually an ``AttnProblem``).
    """

    def __init__(self, problem: object, reasons: Mapping[str, list[str]], forced: str = "") -> None:
        self.problem = problem
        self.reasons = dict(reasons)
        head = (f"backend={forced!r} cannot run this attention call" if forced
                else "no backend can run this attention call")
        summary = problem.describe() if hasattr(problem, "describe") else str(problem)
        super().__init__(f"{head}:\n  {summary}\n{format_reasons(self.reasons)}")
