"""NATTEN 0.21's context flags (``natten.use_deterministic_algorithms`` and the rest).

Same names, defaults, accepted values and errors as NATTEN. What they mean here:

* deterministic mode: neighborhood and ``attention`` calls of this surface carry it in their
  problems and plan the engines' deterministic backwards (torch's own flag is left alone);
* KV parallelism, the memory-usage preference and Flex compilation tune NATTEN's own kernels,
  which do not exist here: the flags are kept and reported, and change no result.
* NATTEN 0.17's kernel autotuner (``use_autotuner``, ``disable_autotuner``, ``is_autotuner_*``,
  ``AutotunerContext``): NATTEN benchmarks its compiled tile configurations and keeps the fastest.
  cudnn_attn's engines pick their own tiles, so these are hints: recorded, validated with NATTEN's
  rules and errors (a non-bool mode or non-int step count is a ``ValueError``; enabling it under
  NATTEN's deterministic mode a ``RuntimeError``; under torch's deterministic mode a warning and
  no change), reported by the ``is_autotuner_*`` queries, and never change a result.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import logging
from enum import Enum

import torch

from ...model import checks
from ...model.problem import deterministic_calls

__all__ = [
    "AutotunerContext",
    "MemoryUsagePreference",
    "NattenContext",
    "allow_flex_compile",
    "allow_flex_compile_backprop",
    "are_deterministic_algorithms_enabled",
    "deterministic_scope",
    "disable_autotuner",
    "disable_flex_compile",
    "disable_flex_compile_backprop",
    "get_memory_usage_preference",
    "is_autotuner_enabled",
    "is_autotuner_enabled_for_backward",
    "is_autotuner_enabled_for_forward",
    "is_autotuner_thorough_for_backward",
    "is_autotuner_thorough_for_forward",
    "is_flex_compile_allowed",
    "is_flex_compile_backprop_allowed",
    "is_kv_parallelism_in_fused_na_enabled",
    "is_memory_usage_default",
    "is_memory_usage_strict",
    "is_memory_usage_unrestricted",
    "reset",
    "set_memory_usage_preference",
    "use_autotuner",
    "use_deterministic_algorithms",
    "use_kv_parallelism_in_fused_na",
]

_log = logging.getLogger(__name__)


class MemoryUsagePreference(Enum):
    Default = 0
    Strict = 1
    Unrestricted = 2


_DEFAULTS = dict(deterministic=False, kv_parallelism=True, memory=MemoryUsagePreference.Default,
                 flex_compile=False, flex_compile_backprop=False)
_state = dict(_DEFAULTS)


def reset() -> None:
    """Every flag back to NATTEN's default (the autotuner's too)."""
    _state.update(_DEFAULTS)
    AutotunerContext.reset()


class NattenContext:
    """NATTEN's ``natten.context.NattenContext``: ``reset()`` puts NATTEN 0.21's flags
    (deterministic mode, KV parallelism, memory preference, Flex compilation) back to their
    defaults; the autotuner has its own ``AutotunerContext.reset()``."""

    @staticmethod
    def reset() -> None:
        _state.update(_DEFAULTS)


def use_deterministic_algorithms(mode: bool = True) -> None:
    """Deterministic backwards for this surface's calls (``mode=False``: back to the default)."""
    _state["deterministic"] = bool(mode)


def are_deterministic_algorithms_enabled() -> bool:
    return _state["deterministic"]  # type: ignore[return-value]


def deterministic_scope() -> AbstractContextManager[None]:
    """Within it, the calls of this surface carry NATTEN's deterministic mode in their problems
    (``problem.deterministic_calls``: a per-call field, torch's global flag untouched)."""
    return deterministic_calls(bool(_state["deterministic"]))


def use_kv_parallelism_in_fused_na(mode: bool = True) -> None:
    """NATTEN's rules: turning it on is ignored under torch's deterministic mode and an error
    under NATTEN's."""
    if not mode:
        _state["kv_parallelism"] = False
        return
    if torch.are_deterministic_algorithms_enabled():
        _log.warning("KV parallelism is non-deterministic and PyTorch's deterministic flag is "
                     "set; ignoring")
        return
    if _state["deterministic"]:
        raise RuntimeError("You enabled NATTEN's deterministic mode, but attempted to enable KV "
                           "parallelism, which results in non-determinism.")
    _state["kv_parallelism"] = True


def is_kv_parallelism_in_fused_na_enabled() -> bool:
    return _state["kv_parallelism"]  # type: ignore[return-value]


_PREFERENCES = {"default": MemoryUsagePreference.Default, "strict": MemoryUsagePreference.Strict,
                "unrestricted": MemoryUsagePreference.Unrestricted}


def set_memory_usage_preference(pref: str = "default") -> None:
    if pref not in _PREFERENCES:
        raise ValueError("natten.set_memory_usage_preference allows only one of three settings: "
                         "`default`, `strict`, and `unrestricted`.")
    _state["memory"] = _PREFERENCES[pref]


def get_memory_usage_preference() -> MemoryUsagePreference:
    return _state["memory"]  # type: ignore[return-value]


def is_memory_usage_default() -> bool:
    return _state["memory"] is MemoryUsagePreference.Default


def is_memory_usage_strict() -> bool:
    return _state["memory"] is MemoryUsagePreference.Strict


def is_memory_usage_unrestricted() -> bool:
    return _state["memory"] is MemoryUsagePreference.Unrestricted


def allow_flex_compile(mode: bool = True, backprop: bool = False) -> None:
    """``mode=False`` also turns off ``backprop``. (NATTEN 0.21.7 documents the same but leaves
    compilation allowed after ``disable_flex_compile()``; the documented behaviour is kept here.)"""
    checks.flag("mode", mode)
    checks.flag("backprop", backprop)
    _state["flex_compile"] = mode
    _state["flex_compile_backprop"] = mode and backprop


def allow_flex_compile_backprop(mode: bool = True) -> None:
    allow_flex_compile(is_flex_compile_allowed(), mode)


def disable_flex_compile() -> None:
    allow_flex_compile(False)


def disable_flex_compile_backprop() -> None:
    allow_flex_compile(is_flex_compile_allowed(), False)


def is_flex_compile_allowed() -> bool:
    return _state["flex_compile"]  # type: ignore[return-value]


def is_flex_compile_backprop_allowed() -> bool:
    return _state["flex_compile_backprop"]  # type: ignore[return-value]


# --- NATTEN 0.17's kernel autotuner: hints, validated and recorded --------------------------------

class AutotunerContext:
    """NATTEN 0.17's autotuner settings, as class attributes (as NATTEN keeps them). The setters
    take ``None`` as "leave unchanged" and validate like NATTEN's."""

    enabled_for_forward: bool = False
    enabled_for_backward: bool = False
    thorough_mode_forward: bool = False
    thorough_mode_backward: bool = False
    warmup_steps_forward: int = 5
    warmup_steps_backward: int = 5
    steps_forward: int = 5
    steps_backward: int = 5

    @staticmethod
    def reset() -> None:
        for name, value in _AUTOTUNER_DEFAULTS.items():
            setattr(AutotunerContext, name, value)

    @staticmethod
    def set_enabled_for_forward(mode: bool | None) -> None:
        _set_enabled("enabled_for_forward", mode, "forward pass")

    @staticmethod
    def set_enabled_for_backward(mode: bool | None) -> None:
        _set_enabled("enabled_for_backward", mode, "backward pass")

    @staticmethod
    def set_thorough_mode_forward(mode: bool | None) -> None:
        _set_checked("thorough_mode_forward", mode, bool)

    @staticmethod
    def set_thorough_mode_backward(mode: bool | None) -> None:
        _set_checked("thorough_mode_backward", mode, bool)

    @staticmethod
    def set_warmup_steps_forward(value: int | None) -> None:
        _set_checked("warmup_steps_forward", value, int)

    @staticmethod
    def set_warmup_steps_backward(value: int | None) -> None:
        _set_checked("warmup_steps_backward", value, int)

    @staticmethod
    def set_steps_forward(value: int | None) -> None:
        _set_checked("steps_forward", value, int)

    @staticmethod
    def set_steps_backward(value: int | None) -> None:
        _set_checked("steps_backward", value, int)


_AUTOTUNER_DEFAULTS = {name: getattr(AutotunerContext, name) for name in (
    "enabled_for_forward", "enabled_for_backward", "thorough_mode_forward",
    "thorough_mode_backward", "warmup_steps_forward", "warmup_steps_backward", "steps_forward",
    "steps_backward")}


def _set_checked(name: str, value, kind: type) -> None:
    if value is None:
        return
    if not isinstance(value, kind):  # NATTEN's check: an int flag also takes a bool
        raise ValueError(f"Expected `{kind.__name__}`, got {type(value)}.")
    setattr(AutotunerContext, name, value)


def _set_enabled(name: str, mode, which: str) -> None:
    if mode is None:
        return
    if not isinstance(mode, bool):
        raise ValueError(f"Expected `bool`, got {type(mode)}.")
    if mode and _state["deterministic"]:
        raise RuntimeError("You enabled NATTEN's deterministic mode, but attempted to enable "
                           f"auto-tuning for {which}, which results in non-determinism. ")
    setattr(AutotunerContext, name, mode)


def use_autotuner(forward_pass: bool | None = None, backward_pass: bool | None = None,
                  thorough_mode_forward: bool | None = None, thorough_mode_backward: bool | None = None,
                  warmup_steps_forward: int | None = None, warmup_steps_backward: int | None = None,
                  steps_forward: int | None = None, steps_backward: int | None = None) -> None:
    """NATTEN 0.17's ``use_autotuner``: ``None`` leaves a setting as it is; ``(False, False)``
    turns both passes off and changes nothing else. A hint here (tiles are the engines' own)."""
    if forward_pass is not None and backward_pass is not None and not forward_pass \
            and not backward_pass:
        AutotunerContext.enabled_for_forward = False
        AutotunerContext.enabled_for_backward = False
        return
    if (forward_pass or backward_pass) and torch.are_deterministic_algorithms_enabled():
        _log.warning("Failed to enable NATTEN auto-tuner; PyTorch's deterministic mode was "
                     "enabled, and using auto-tuner is non-deterministic.")
        return
    AutotunerContext.set_enabled_for_forward(forward_pass)
    AutotunerContext.set_enabled_for_backward(backward_pass)
    AutotunerContext.set_thorough_mode_forward(thorough_mode_forward)
    AutotunerContext.set_thorough_mode_backward(thorough_mode_backward)
    AutotunerContext.set_warmup_steps_forward(warmup_steps_forward)
    AutotunerContext.set_warmup_steps_backward(warmup_steps_backward)
    AutotunerContext.set_steps_forward(steps_forward)
    AutotunerContext.set_steps_backward(steps_backward)


def disable_autotuner() -> None:
    """Both passes off and thorough mode off (step counts are kept, as in NATTEN)."""
    AutotunerContext.enabled_for_forward = AutotunerContext.enabled_for_backward = False
    AutotunerContext.thorough_mode_forward = AutotunerContext.thorough_mode_backward = False


def is_autotuner_enabled() -> bool:
    return AutotunerContext.enabled_for_forward or AutotunerContext.enabled_for_backward


def is_autotuner_enabled_for_forward() -> bool:
    return AutotunerContext.enabled_for_forward


def is_autotuner_enabled_for_backward() -> bool:
    return AutotunerContext.enabled_for_backward


def is_autotuner_thorough_for_forward() -> bool:
    return AutotunerContext.thorough_mode_forward


def is_autotuner_thorough_for_backward() -> bool:
    return AutotunerContext.thorough_mode_backward
