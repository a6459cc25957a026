"""transformers' attention masks kept structured: the mask builder cudnn_attn registers with
``AttentionMaskInterface``.

transformers builds every mask from a *mask function* (``causal_mask_function``,
``sliding_window_causal_mask_function(w)``, ``bidirectional_mask_function``, ...), the 2-D
``attention_mask`` of ``forward``/``generate`` (1 = real token) and the query/key offsets of the
cache. Its "sdpa" builder evaluates all that into a dense boolean ``[B, 1, S_q, S_k]`` tensor. For
the patterns cudnn_attn's masks express, :func:`structured_mask` instead returns a
:class:`StructuredMask` that keeps the pieces (causal or not, window, padding, offsets), so the
attention function can hand the engines ``Causal`` / ``SlidingWindow`` / per-sequence lengths
instead of an O(S^2) bias. Any other mask function (custom ``or``/``and`` masks, packed sequences
found from ``position_ids``, chunked or block-wise overlays) and tensor offsets (static caches
under compile) get transformers' own dense mask, unchanged.

Recognized mask functions (transformers 5.x ``masking_utils``): ``causal_mask_function``,
``bidirectional_mask_function``, and ``and_masks(sliding_window_overlay(w),
causal_mask_function)`` (what ``sliding_window_causal_mask_function(w)`` returns: key ``k`` is
visible from query ``q`` iff ``q - w < k <= q``, positions absolute).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable, Optional

import torch

__all__ = ["StructuredMask", "structured_mask", "mask_pattern"]


@dataclasses.dataclass(frozen=True, eq=False)
class StructuredMask:
    """One layer's mask as transformers described it.

    ``causal``: key position ``<=`` query position. ``window``: transformers' ``sliding_window``
    (causal: the ``window`` most recent positions, the query's own included). ``padding``: ``[B,
    kv_length]`` bool (True = real token) or None. Query ``i`` is at absolute position
    ``q_offset + i``, key ``j`` at ``kv_offset + j``. ``dense()`` builds transformers' own
    boolean mask (the fallback for a call the structure cannot serve).
    """

    causal: bool
    window: Optional[int]
    padding: Optional[torch.Tensor]
    q_offset: int
    kv_offset: int
    q_length: int
    kv_length: int
    dense: Callable[[], Optional[torch.Tensor]]


def _overlay_window(fn) -> Optional[int]:
    """``w`` when ``fn`` is ``sliding_window_overlay(w)``'s inner function."""
    if getattr(fn, "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    window = inspect.getclosurevars(fn).nonlocals.get("sliding_window")
    return window if isinstance(window, int) and not isinstance(window, bool) else None


def mask_pattern(mask_function) -> Optional[tuple[bool, Optional[int]]]:
    """``(causal, window)`` of one of transformers' standard mask functions, else None."""
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None
    if getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask":
        parts = inspect.getclosurevars(mask_function).nonlocals.get("mask_functions", ())
        if len(parts) == 2 and parts[1] is mu.causal_mask_function:
            window = _overlay_window(parts[0])
            if window is not None and window > 0:
                return True, window
    return None


def structured_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                    mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """transformers' mask-builder signature (as ``sdpa_mask``): a :class:`StructuredMask` for
    the standard patterns, otherwise transformers' dense ``sdpa_mask`` result."""
    from transformers import masking_utils as mu

    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    dense = functools.partial(mu.sdpa_mask, batch_size, q_length, kv_length, q_offset, kv_offset,
                              mask_function, attention_mask, **kwargs)
    pattern = mask_pattern(mask_function)
    offsets_known = not isinstance(q_offset, torch.Tensor) and \
        not isinstance(kv_offset, torch.Tensor)
    if pattern is None or not offsets_known:
        return dense()
    padding = None
    if attention_mask is not None:
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        padding = padding[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    return StructuredMask(pattern[0], pattern[1], padding, int(q_offset), int(kv_offset),
                          int(q_length), int(kv_length), dense)
