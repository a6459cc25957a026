"""Backend protocol, the one registry (priority order cudnn -> cupy -> torch) and selection.

A backend answers ``supports(problem)`` with a list of reasons it cannot run the problem (empty
means it can). Selection walks the registry and takes the first backend with no reasons; when a
user forces a backend that has reasons, or nothing can run, ``NotSupportedError`` lists them all.
There is never a silent fallback from a forced backend.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from .caches import LRU
from .errors import NotSupportedError, format_reasons
from .problem import AttnProblem

__all__ = ["NotSupportedError", "Backend", "BACKENDS", "BACKEND_NAMES", "get_backend", "select",
           "plan_for", "verdicts", "format_reasons"]

logger = logging.getLogger("cudnn_attn")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def apply_log_level(value: str | None) -> None:
    """Set the ``cudnn_attn`` logger's level from ``CUDNN_ATTN_LOG_LEVEL``'s text: a name of
    ``LOG_LEVELS`` (any case) or an integer. Anything else warns and leaves the level alone:
    a typo in an environment variable must not break ``import cudnn_attn``."""
    if value is None or not value.strip():
        return
    text = value.strip().upper()
    if text in LOG_LEVELS:
        logger.setLevel(text)
    elif text.lstrip("-").isdigit():
        logger.setLevel(int(text))
    else:
        import warnings

        warnings.warn(f"CUDNN_ATTN_LOG_LEVEL={value!r} is not a log level (one of "
                      f"{', '.join(LOG_LEVELS)} or an integer); ignored", RuntimeWarning,
                      stacklevel=2)


apply_log_level(os.environ.get("CUDNN_ATTN_LOG_LEVEL"))


class Backend(Protocol):
    """What every engine provides. Plans are cached by the engine, keyed on ``problem.plan_key``.

    ``supports(problem)`` is pure: no graph build, no compile. ``plan(problem)`` builds (or fetches)
    what the problem needs and may still decline by raising ``NotSupportedError`` (cuDNN's
    build-time "not supported"); dispatch then takes the next engine and remembers the decline.
    A plan has ``forward(problem, inputs, need_lse=True) -> (out, lse)`` and
    ``backward(problem, inputs, out, lse, dout, dlse=None) -> (dq, dk, dv, dbias)``, with
    ``inputs`` a ``runtime.Inputs`` and lse ``[B, H_q, S_q]`` (natural log, float32; float64 for
    float64 inputs; ``-inf`` on rows that see no key).
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


# (engine, decline key) -> reasons of a plan build the engine declined.
_DECLINED = LRU("dispatch.declined", maxsize=1024)


def _decline_key(engine, problem: AttnProblem) -> tuple:
    return (engine.name, problem.plan_key, problem.requires_grad, problem.return_lse)


def reasons_of(engine, problem: AttnProblem) -> list[str]:
    """``engine.supports(problem)`` plus any decline remembered from an earlier plan build."""
    reasons = engine.supports(problem)
    if not reasons:
        reasons = list(_DECLINED.get(_decline_key(engine, problem), ()))
    return reasons


def verdicts(problem: AttnProblem) -> dict[str, list[str]]:
    """Every backend's reasons for ``problem``, in priority order."""
    return {b.name: reasons_of(b, problem) for b in BACKENDS}


def _try_plan(engine, problem: AttnProblem):
    """``engine.plan(problem)``, or ``None`` after remembering the reasons it declined with."""
    try:
        return engine.plan(problem)
    except NotSupportedError as exc:
        found = exc.reasons.get(engine.name) or [str(exc)]
        _DECLINED.put(_decline_key(engine, problem), tuple(found))
        return None


def plan_for(problem: AttnProblem, backend: str = "auto"):
    """``(engine, plan)`` for ``problem``: the forced engine, or the first in priority order
    whose ``supports()`` is empty and whose plan build does not decline."""
    if backend != "auto":
        chosen = get_backend(backend)
        reasons = reasons_of(chosen, problem)
        plan = None if reasons else _try_plan(chosen, problem)
        if plan is None:
            reasons = reasons or reasons_of(chosen, problem)
            raise NotSupportedError(problem, {chosen.name: reasons}, forced=chosen.name)
        return chosen, plan
    collected = {}
    for candidate in BACKENDS:
        reasons = reasons_of(candidate, problem)
        if not reasons:
            plan = _try_plan(candidate, problem)
            if plan is not None:
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug("selected %s for %s (skipped: %s)", candidate.name,
                                 problem.describe(), collected or "none")
                return candidate, plan
            reasons = reasons_of(candidate, problem)
        collected[candidate.name] = reasons
    raise NotSupportedError(problem, collected)


def select(problem: AttnProblem, backend: str = "auto"):
    """The engine that runs ``problem`` (see ``plan_for``; its plan is built and cached)."""
    return plan_for(problem, backend)[0]
