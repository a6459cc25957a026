"""Backend protocol, the one registry (priority order cudnn -> cupy -> torch) and selection.

A backend answers ``supports(problem)`` with a list of reasons it cannot run the problem (empty
means it can). Selection walks the registry and takes the first backend with no reasons; when a
user forces a backend that has reasons, or nothing can run, ``NotSupportedError`` lists them all.
There is never a silent fallback from a forced backend.

The backend policy: :func:`use_backend` / :func:`exclude_backend` (context managers, like
``torch.nn.attention.sdpa_kernel``) restrict which engines any call may use, whatever surface it
comes through (``attention``, varlen, FlashAttention, NATTEN, the cuDNN builder, Hugging Face,
libraries built on those), since every surface selects here. The policy lives in a
``contextvars.ContextVar``: per thread and per asyncio task, and read when an op runs (never while
``torch.compile`` traces), so a compiled graph honours the policy in force at each call. Its
default comes from the environment when the package is imported: ``CUDNN_ATTN_BACKENDS`` (a comma-
separated list of the engines allowed, e.g. ``torch`` or ``cudnn,torch``) and
``CUDNN_ATTN_EXCLUDE_BACKENDS`` (engines never used). An engine outside the policy reports the
reason ``"excluded by ..."`` in ``explain()`` and in ``NotSupportedError``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Optional, Protocol, Union

from .caches import LRU
from ..errors import NotSupportedError, format_reasons
from ..model.problem import AttnProblem

__all__ = ["NotSupportedError", "Backend", "BACKENDS", "BACKEND_NAMES", "get_backend", "select",
           "plan_for", "verdicts", "format_reasons", "use_backend", "exclude_backend",
           "allowed_backends", "policy_key", "CostChoice", "cost_choice", "auto_verdicts"]

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
    float64 inputs; ``-inf`` on rows that see no key), and ``direct(problem)``: a ``(q, k, v) ->
    out`` runner bound once for calls of ``problem`` that need no lse (one that requires grad
    records its own autograd node, and answers ``None`` under ``torch.no_grad``; so does any
    call it cannot take, which then runs the full path), else ``None``. Only ``execution``
    calls these.
    """

    name: str
    # Whether it runs packed/paged calls and whole KV caches as they lie (lengths on the device):
    # the stored route of the varlen/KV-cache surfaces takes only such an engine.
    runs_stored: bool

    def availability(self) -> list[str]:
        """Reasons this backend cannot run on this machine at all (empty: it can)."""

    def supports(self, problem: AttnProblem) -> list[str]:
        """Reasons this backend cannot run ``problem`` (availability included)."""

    def plan(self, problem: AttnProblem):
        """The (cached) executable plan for ``problem``."""


def _registry() -> tuple:
    from ..fallback_kernels.backend import CupyBackend
    from ..graphs.backend import CudnnBackend
    from ..torch_engine.backend import TorchBackend

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


# ---------------------------------------------------------------------------------------------
# the backend policy (use_backend / exclude_backend)
# ---------------------------------------------------------------------------------------------

def _names(arg, what: str) -> tuple[str, ...]:
    """``arg`` (a backend name or an iterable of names) as a tuple of registered names."""
    names = (arg,) if isinstance(arg, str) else tuple(arg) if isinstance(arg, Iterable) else None
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} must be a backend name or a non-empty list of names from "
                        f"{BACKEND_NAMES}, got {arg!r}")
    for n in names:
        if n not in _BY_NAME:
            raise ValueError(f"{what} must name backends from {BACKEND_NAMES}, got {n!r}")
    return names


def _env_policy() -> tuple[tuple[str, ...], str]:
    """The policy the environment asks for at import: ``(allowed names, why the others are
    out)``."""
    allowed, why = BACKEND_NAMES, ""
    for var in ("CUDNN_ATTN_BACKENDS", "CUDNN_ATTN_EXCLUDE_BACKENDS"):
        value = os.environ.get(var, "").strip()
        if not value:
            continue
        names = _names([n.strip() for n in value.split(",") if n.strip()], var)
        keep = set(names) if var == "CUDNN_ATTN_BACKENDS" else set(BACKEND_NAMES) - set(names)
        allowed = tuple(n for n in allowed if n in keep)
        why = f"excluded by the environment ({var}={value})"
    return allowed, why


# (allowed engine names in priority order, the reason given to the others)
_POLICY: contextvars.ContextVar = contextvars.ContextVar("cudnn_attn_backend_policy",
                                                        default=_env_policy())


def allowed_backends() -> tuple[str, ...]:
    """The engines the current backend policy allows, in priority order."""
    return _POLICY.get()[0]


def policy_key() -> tuple:
    """The current policy as a hashable value, for caches of engine choices."""
    return _POLICY.get()[0]


@contextlib.contextmanager
def _policy(allowed: tuple[str, ...], why: str) -> Iterator[tuple[str, ...]]:
    token = _POLICY.set((allowed, why))
    try:
        yield allowed
    finally:
        _POLICY.reset(token)


def use_backend(backends: Union[str, Iterable[str]],
                ) -> AbstractContextManager[tuple[str, ...]]:
    """Context manager: only ``backends`` (a name or names of ``"cudnn"``, ``"cupy"``,
    ``"torch"``) may run attention inside the block, on every surface, for the current thread
    or task. Like ``torch.nn.attention.sdpa_kernel``: the innermost ``use_backend`` replaces the
    allowed set (so it can re-allow an engine an outer ``exclude_backend`` removed). A call that
    no allowed engine can run raises ``NotSupportedError`` (never a silent fallback)::

        with cudnn_attn.use_backend("torch"):
            model(x)          # every attention call inside runs on the torch engine
    """
    names = set(_names(backends, "backends"))
    allowed = tuple(n for n in BACKEND_NAMES if n in names)
    return _policy(allowed, f"excluded by cudnn_attn.use_backend({list(allowed)})")


def exclude_backend(backends: Union[str, Iterable[str]],
                    ) -> AbstractContextManager[tuple[str, ...]]:
    """Context manager: ``backends`` are not used inside the block (on top of the current
    policy), on every surface, for the current thread or task::

        with cudnn_attn.exclude_backend("cudnn"):
            model(x)          # no cuDNN graph runs; the next engine that can, does
    """
    names = _names(backends, "backends")
    allowed = tuple(n for n in allowed_backends() if n not in names)
    return _policy(allowed, f"excluded by cudnn_attn.exclude_backend({list(names)})")


def _policy_reasons(engine) -> list[str]:
    allowed, why = _POLICY.get()
    return [] if engine.name in allowed else [why]


# (engine, decline key) -> reasons of a plan build the engine declined.
_DECLINED = LRU("dispatch.declined", maxsize=1024)


def _decline_key(engine, problem: AttnProblem) -> tuple:
    return (engine.name, problem.plan_key, problem.requires_grad, problem.return_lse)


def reasons_of(engine, problem: AttnProblem) -> list[str]:
    """The backend policy's reason, else ``engine.supports(problem)`` plus any decline
    remembered from an earlier plan build."""
    reasons = _policy_reasons(engine)
    if reasons:
        return reasons
    reasons = engine.supports(problem)
    if not reasons:
        reasons = list(_DECLINED.get(_decline_key(engine, problem), ()))
    return reasons


def auto_reasons(engine, problem: AttnProblem) -> list[str]:
    """Why ``backend="auto"`` passes over ``engine`` although it can run ``problem`` (an
    engine's declared preference, e.g. a speed rule not yet measured); a forced backend ignores
    them."""
    prefer = getattr(engine, "auto_reasons", None)
    return [] if prefer is None else prefer(problem)


@dataclass(frozen=True)
class CostChoice:
    """``auto``'s cost rule for one problem: the predicted ms of every engine that can run it
    and has a cost model (``engine.predicted_ms(problem)``, not ``None``), the fastest, and
    why each slower one is passed over. Empty below two predictions (priority order decides)."""

    predicted: dict = field(default_factory=dict)
    best: Optional[str] = None
    passed_over: dict = field(default_factory=dict)

    @property
    def why(self) -> str:
        """One line for ``explain()``: which engine the cost rule picked and why."""
        if self.best is None:
            return ""
        others = ", ".join(f"{name} {ms:.3g} ms" for name, ms in self.predicted.items()
                           if name != self.best)
        return (f"auto picks {self.best} by predicted time: {self.best} "
                f"{self.predicted[self.best]:.3g} ms vs {others} (roofline cost model)")


def _predicted_ms(engine, problem: AttnProblem) -> Optional[float]:
    predict = getattr(engine, "predicted_ms", None)
    return None if predict is None else predict(problem)


def cost_choice(problem: AttnProblem) -> CostChoice:
    """The cost rule: among the engines ``auto`` could run ``problem`` on (no reasons, no
    declared preference) that predict a time for it, the fastest wins (ties: priority order);
    the others get a reason naming both times. Forced backends never consult it. Today only
    Neighborhood problems have predictions (cuDNN dense with the exact mask, the fused CuPy
    kernels' tile model), so every other call keeps the priority order."""
    predicted = {}
    for engine in BACKENDS:
        if reasons_of(engine, problem) or auto_reasons(engine, problem):
            continue
        ms = _predicted_ms(engine, problem)
        if ms is not None:
            predicted[engine.name] = ms
    if len(predicted) < 2:
        return CostChoice(predicted)
    best = min(predicted, key=predicted.__getitem__)  # the first of equals: priority order
    passed = {name: [f"auto prefers {best}: predicted {predicted[best]:.3g} ms vs {name} "
                     f"{ms:.3g} ms (roofline cost model); backend={name!r} runs it"]
              for name, ms in predicted.items() if name != best}
    return CostChoice(predicted, best, passed)


def auto_verdicts(problem: AttnProblem, backend: str = "auto") -> tuple[dict, CostChoice]:
    """What ``explain()`` shows: each engine's verdict (``"selected"``, ``"available"`` or its
    reasons) as ``plan_for`` would choose without building anything (declined builds already
    remembered count), and the cost rule's choice (``auto`` only)."""
    choice = cost_choice(problem) if backend == "auto" else CostChoice()
    shown: dict = {}
    chosen = None
    for engine in BACKENDS:
        reasons = reasons_of(engine, problem)
        eligible = backend in ("auto", engine.name)
        passed = backend == "auto" and (auto_reasons(engine, problem)
                                         or choice.passed_over.get(engine.name))
        if reasons:
            shown[engine.name] = reasons
        elif eligible and chosen is None and not passed:
            shown[engine.name] = chosen = "selected"
        else:
            shown[engine.name] = "available"
    return shown, choice


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
    return _auto_plan(problem)


def _auto_plan(problem: AttnProblem, costs_used: bool = False):
    """``plan_for``'s auto walk. When the engine the cost rule preferred declines its plan
    build (remembered), the walk runs once more: the rule then weighs only what is left, so a
    decline never hands the call to a slower engine than the one passed over."""
    collected: dict = {}
    costs: Optional[CostChoice] = None
    for candidate in BACKENDS:
        reasons = reasons_of(candidate, problem) or auto_reasons(candidate, problem)
        if not reasons and _predicted_ms(candidate, problem) is not None:
            costs = costs or cost_choice(problem)
            reasons = costs.passed_over.get(candidate.name, [])
        if not reasons:
            plan = _try_plan(candidate, problem)
            if plan is not None:
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug("selected %s for %s (skipped: %s)", candidate.name,
                                 problem.describe(), collected or "none")
                return candidate, plan
            if costs is not None and costs.passed_over and not costs_used:
                return _auto_plan(problem, costs_used=True)
            reasons = reasons_of(candidate, problem)
        collected[candidate.name] = reasons
    raise NotSupportedError(problem, collected)


def select(problem: AttnProblem, backend: str = "auto"):
    """The engine that runs ``problem`` (see ``plan_for``; its plan is built and cached)."""
    return plan_for(problem, backend)[0]
