"""Backend protocol, the one registry (priority order cudnn -> cupy -> torch) and selection.

A backend answers ``supports(problem)`` with a list of reasons it cannot run the problem (empty
means it can). Selection walks the registry and takes the first backend with no reasons; when a
user forces a backend that has reasons, or nothing can run, ``NotSupportedError`` lists them all.
There is never a silent fallback from a forced backend.
"""

from __future__ import annotations

import logging
import os
from typing import Mapping, Protocol, runtime_checkable

from .problem import AttnProblem

__all__ = ["NotSupportedError", "Backend", "BACKENDS", "BACKEND_NAMES", "get_backend", "select",
           "verdicts", "format_reasons"]

logger = logging.getLogger("cudnn_attn")
if "CUDNN_ATTN_LOG_LEVEL" in os.environ:
    logger.setLevel(os.environ["CUDNN_ATTN_LOG_LEVEL"].upper())


class NotSupportedError(NotImplementedError):
    """A valid call that no (or not the requested) backend can run.

    ``reasons`` maps each backend name that was considered to its list of reasons.
    """

    def __init__(self, problem: AttnProblem, reasons: Mapping[str, list[str]], forced: str = ""):
        self.problem = problem
        self.reasons = dict(reasons)
        head = (f"backend={forced!r} cannot run this attention call" if forced
                else "no backend can run this attention call")
        super().__init__(f"{head}:\n  {problem.describe()}\n{format_reasons(self.reasons)}")


def format_reasons(reasons: Mapping[str, list[str] | str]) -> str:
    lines = []
    for name, verdict in reasons.items():
        if isinstance(verdict, str):
            lines.append(f"  {name:<6} {verdict}")
        else:
            lines.append(f"  {name:<6} cannot run:")
            lines.extend(f"           - {reason}" for reason in verdict)
    return "\n".join(lines)


@runtime_checkable
class Backend(Protocol):
    """What every engine provides. Plans are cached by the backend, keyed on ``problem.plan_key``.

    ``plan(problem)`` returns an object with
    ``forward(problem, q, k, v, bias, generator, need_lse=True) -> (out, lse, saved)`` and
    ``backward(problem, q, k, v, bias, out, lse, dout, saved) -> (dq, dk, dv, dbias)``.
    """

    name: str

    def availability(self) -> list[str]:
        """Reasons this backend cannot run on this machine at all (empty: it can)."""

    def supports(self, problem: AttnProblem) -> list[str]:
        """Reasons this backend cannot run ``problem`` (availability included)."""

    def plan(self, problem: AttnProblem):
        """The (cached) executable plan for ``problem``."""


def _registry() -> tuple:
    from .fallback_kernels.backend import CupyBackend
    from .graphs.backend import CudnnBackend
    from .torch_engine.backend import TorchBackend

    return (CudnnBackend(), CupyBackend(), TorchBackend())


BACKENDS: tuple = _registry()
BACKEND_NAMES: tuple[str, ...] = tuple(b.name for b in BACKENDS)
_BY_NAME = {b.name: b for b in BACKENDS}


def get_backend(name: str):
    """The registered backend called ``name``."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"backend must be 'auto' or one of {BACKEND_NAMES}, got {name!r}") from None


def verdicts(problem: AttnProblem) -> dict[str, list[str]]:
    """Every backend's reasons for ``problem``, in priority order."""
    return {b.name: b.supports(problem) for b in BACKENDS}


def select(problem: AttnProblem, backend: str = "auto"):
    """The backend that runs ``problem``: the forced one, or the first in priority order."""
    if backend != "auto":
        chosen = get_backend(backend)
        reasons = chosen.supports(problem)
        if reasons:
            raise NotSupportedError(problem, {chosen.name: reasons}, forced=chosen.name)
        return chosen
    collected = {}
    for candidate in BACKENDS:
        reasons = candidate.supports(problem)
        if not reasons:
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("selected %s for %s (skipped: %s)", candidate.name,
                             problem.describe(), collected or "none")
            return candidate
        collected[candidate.name] = reasons
    raise NotSupportedError(problem, collected)
