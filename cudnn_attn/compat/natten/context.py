"""NATTEN 0.21's context flags (``natten.use_deterministic_algorithms`` and the rest).

Same names, defaults, accepted values and errors as NATTEN. What they mean here:

* deterministic mode: neighborhood and ``attention`` calls of this surface plan their backward as
  under ``torch.use_deterministic_algorithms(True)`` (the engines' deterministic backwards);
* KV parallelism, the memory-usage preference and Flex compilation tune NATTEN's own kernels,
  which do not exist here: the flags are kept and reported, and change no result.
"""

from __future__ import annotations

import contextlib
import logging
from enum import Enum

import torch

from ... import _checks

__all__ = [
    "MemoryUsagePreference",
    "allow_flex_compile",
    "allow_flex_compile_backprop",
    "are_deterministic_algorithms_enabled",
    "deterministic_scope",
    "disable_flex_compile",
    "disable_flex_compile_backprop",
    "get_memory_usage_preference",
    "is_flex_compile_allowed",
    "is_flex_compile_backprop_allowed",
    "is_kv_parallelism_in_fused_na_enabled",
    "is_memory_usage_default",
    "is_memory_usage_strict",
    "is_memory_usage_unrestricted",
    "reset",
    "set_memory_usage_preference",
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
    """Every flag back to NATTEN's default."""
    _state.update(_DEFAULTS)


def use_deterministic_algorithms(mode: bool = True) -> None:
    """Deterministic backwards for this surface's calls (``mode=False``: back to the default)."""
    _state["deterministic"] = bool(mode)


def are_deterministic_algorithms_enabled() -> bool:
    return _state["deterministic"]


@contextlib.contextmanager
def deterministic_scope():
    """Within it, a call plans as under ``torch.use_deterministic_algorithms(True)`` when NATTEN's
    deterministic mode is on (plans keep the flag, so their backward later is deterministic too)."""
    if not _state["deterministic"] or torch.are_deterministic_algorithms_enabled():
        yield
        return
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


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
    return _state["kv_parallelism"]


_PREFERENCES = {"default": MemoryUsagePreference.Default, "strict": MemoryUsagePreference.Strict,
                "unrestricted": MemoryUsagePreference.Unrestricted}


def set_memory_usage_preference(pref: str = "default") -> None:
    if pref not in _PREFERENCES:
        raise ValueError("natten.set_memory_usage_preference allows only one of three settings: "
                         "`default`, `strict`, and `unrestricted`.")
    _state["memory"] = _PREFERENCES[pref]


def get_memory_usage_preference() -> MemoryUsagePreference:
    return _state["memory"]


def is_memory_usage_default() -> bool:
    return _state["memory"] is MemoryUsagePreference.Default


def is_memory_usage_strict() -> bool:
    return _state["memory"] is MemoryUsagePreference.Strict


def is_memory_usage_unrestricted() -> bool:
    return _state["memory"] is MemoryUsagePreference.Unrestricted


def allow_flex_compile(mode: bool = True, backprop: bool = False) -> None:
    """``mode=False`` also turns off ``backprop``. (NATTEN 0.21.7 documents the same but leaves
    compilation allowed after ``disable_flex_compile()``; the documented behaviour is kept here.)"""
    _checks.flag("mode", mode)
    _checks.flag("backprop", backprop)
    _state["flex_compile"] = mode
    _state["flex_compile_backprop"] = mode and backprop


def allow_flex_compile_backprop(mode: bool = True) -> None:
    allow_flex_compile(is_flex_compile_allowed(), mode)


def disable_flex_compile() -> None:
    allow_flex_compile(False)


def disable_flex_compile_backprop() -> None:
    allow_flex_compile(is_flex_compile_allowed(), False)


def is_flex_compile_allowed() -> bool:
    return _state["flex_compile"]


def is_flex_compile_backprop_allowed() -> bool:
    return _state["flex_compile_backprop"]
