"""Cheap, cached facts about the machine that backends turn into availability reasons."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.lru_cache(maxsize=None)
def module_missing(module: str, extra_hint: str) -> list[str]:
    """A reason if ``module`` cannot be imported (checked without importing it)."""
    if importlib.util.find_spec(module) is None:
        return [f"{module} is not installed (pip install 'cudnn-attn[{extra_hint}]')"]
    return []


def cuda_missing() -> list[str]:
    if not torch.cuda.is_available():
        return ["no CUDA device is available to torch"]
    return []
