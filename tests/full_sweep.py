"""The suite's one switch between a sweep's default sample and the whole sweep.

A few sweeps are too big for the CPU suite's time budget (under ~15 minutes on 2 cores), so by
default they run a deterministic sample that still has every distinct kind of case (each grid
entry, geometry, dtype, kernel, direction, target); ``CUDNN_ATTN_FULL_SWEEP=1`` runs all of them::

    CUDNN_ATTN_FULL_SWEEP=1 python -m pytest -q

``rotate`` is the sampling rule the sweeps share: of a case's variants, keep the first (the base
case) and one more, chosen by the case's index, so consecutive cases together visit every variant.
``pick`` is the rule for variants that are interchangeable (no base case): keep one, chosen the
same way.
"""

from __future__ import annotations

import os
from typing import Sequence, TypeVar

FULL = os.environ.get("CUDNN_ATTN_FULL_SWEEP", "") not in ("", "0")

T = TypeVar("T")


def rotate(variants: Sequence[T], index: int) -> list[T]:
    """All ``variants`` under ``FULL``; else the first and ``variants[1 + index % (n - 1)]``."""
    variants = list(variants)
    if FULL or len(variants) <= 2:
        return variants
    return [variants[0], variants[1 + index % (len(variants) - 1)]]


def pick(variants: Sequence[T], index: int) -> list[T]:
    """All ``variants`` under ``FULL``; else the one ``variants[index % n]``."""
    variants = list(variants)
    if FULL or len(variants) <= 1:
        return variants
    return [variants[index % len(variants)]]
