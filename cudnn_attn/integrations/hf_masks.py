"""transformers' attention masks kept structured: the mask builder cudnn_attn registers with
``AttentionMaskInterface``.

transformers builds every mask from a *mask function* (``causal_mask_function``,
``sliding_window_causal_mask_function(w)``, ``bidirectional_mask_function``, ...), the 2-D
``attention_mask`` of ``forward``/``generate`` (1 = real token) and the query/key offsets of the
cache. Its "sdpa" builder evaluates all that into a dense boolean ``[B, 1, S_q, S_k]`` tensor. For
the patterns cudnn_attn's masks express, :func:`structured_mask` instead returns a
:class:`StructuredMask` that keeps the pieces (causal or not, window, padding, offsets, packed
sequence ids), so the attention function can hand the engines ``Causal`` / ``SlidingWindow`` /
per-sequence lengths instead of an O(S^2) bias. Any other mask function (custom ``or``/``and``
masks, chunked or block-wise overlays) gets transformers' own dense mask, unchanged.

Recognized mask functions (transformers 5.x ``masking_utils``), positions absolute:

* ``causal_mask_function``: key ``k`` visible from query ``q`` iff ``k <= q``;
* ``sliding_window_causal_mask_function(w)`` (``and_masks(sliding_window_overlay(w), causal)``):
  ``q - w < k <= q``;
* ``bidirectional_mask_function``: every key;
* ``sliding_window_bidirectional_mask_function(w)`` (``and_masks(
  sliding_window_bidirectional_overlay(w), bidirectional)``, ModernBERT): ``|q - k| <= w``;
* packed sequences (no 2-D mask, no cache, ``position_ids`` restarting: ``and_masks(
  remap_positions_for_packed_sequence(f, position_ids), packed_sequence_mask_function(ids))``
  with ``f`` one of the causal functions above): ``f`` inside each packed sequence.

Static caches pass the query offset as a 0-d tensor (so a compiled decode step does not
recompile): it is kept as a tensor (a snapshot: the cache updates its own counter in place).
``generate()`` builds a static cache's masks before its (compiled) forward and passes them in;
the builder hands such a prepared mask back unchanged.

Under ``torch.compile`` the combined functions (windows, packed sequences) that transformers
creates *inside* the compiled region cannot be looked into (dynamo does not expose a closure's
contents), so only ``causal_mask_function`` / ``bidirectional_mask_function`` are recognized
there; the others get the dense mask.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping, Optional

import torch

__all__ = ["StructuredMask", "structured_mask", "mask_pattern", "packed_pattern"]


@dataclasses.dataclass(frozen=True, eq=False)
class StructuredMask:
    """One layer's mask as transformers described it.

    ``causal``: key position ``<=`` query position. ``window``: transformers' ``sliding_window``
    (causal: the ``window`` most recent positions, the query's own included; bidirectional: keys
    within distance ``window``). ``padding``: ``[B, kv_length]`` bool (True = real token) or
    None. Query ``i`` is at absolute position ``q_offset + i`` (``q_offset`` an int, or a 0-d
    tensor from a static cache), key ``j`` at ``kv_offset + j``. ``segments``: ``[B, S]`` packed
    sequence ids (keys see only their own sequence), or None. ``dense()`` builds transformers'
    own boolean mask (the fallback for a call the structure cannot serve).
    """

    causal: bool
    window: Optional[int]
    padding: Optional[torch.Tensor]
    q_offset: Any
    kv_offset: int
    q_length: int
    kv_length: int
    dense: Callable[[], Optional[torch.Tensor]]
    segments: Optional[torch.Tensor] = None

    # transformers' mask preparation reads ``ndim`` of the mask it is given: generate() builds
    # the masks of a static cache ahead of the forward and passes them in; a mask that is not
    # 2-D goes on to the registered builder, which hands it back unchanged.
    ndim = 4


def _closure(fn, qualname: str) -> Optional[Mapping[str, Any]]:
    """The nonlocals of ``fn`` when it is the inner function ``qualname``, else None."""
    if getattr(fn, "__qualname__", "") != qualname:
        return None
    return inspect.getclosurevars(fn).nonlocals


def _window_of(fn, overlay: str) -> Optional[int]:
    """``w`` when ``fn`` is ``overlay(w)``'s inner function (an int window)."""
    found = _closure(fn, f"{overlay}.<locals>.inner_mask")
    window = None if found is None else found.get("sliding_window")
    return window if isinstance(window, int) and not isinstance(window, bool) else None


def _and_parts(fn) -> Optional[tuple]:
    found = _closure(fn, "and_masks.<locals>.and_mask")
    return None if found is None else tuple(found.get("mask_functions", ()))


def mask_pattern(mask_function) -> Optional[tuple[bool, Optional[int]]]:
    """``(causal, window)`` of one of transformers' standard mask functions, else None."""
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None
    parts = _and_parts(mask_function)
    if parts is None or len(parts) != 2:
        return None
    if parts[1] is mu.causal_mask_function:
        window = _window_of(parts[0], "sliding_window_overlay")
        return (True, window) if window is not None and window > 0 else None
    if parts[1] is mu.bidirectional_mask_function:
        window = _window_of(parts[0], "sliding_window_bidirectional_overlay")
        return (False, window) if window is not None and window >= 0 else None
    return None


def packed_pattern(mask_function) -> Optional[tuple[bool, Optional[int], torch.Tensor]]:
    """``(causal, window, segments [B, S])`` of transformers' packed-sequence mask over a causal
    pattern, else None. Inside one packed sequence the positions step by 1 (that is how
    transformers splits them), so its causal or window rule on positions is the same rule on
    token indices within the sequence."""
    parts = _and_parts(mask_function)
    if parts is None or len(parts) != 2:
        return None
    remap = _closure(parts[0], "remap_positions_for_packed_sequence.<locals>.inner_mask")
    ids = _closure(parts[1], "packed_sequence_mask_function.<locals>.inner_mask")
    if remap is None or ids is None:
        return None
    pattern = mask_pattern(remap.get("mask_function"))
    segments = ids.get("packed_sequence_mask")
    if pattern is None or not pattern[0] or not isinstance(segments, torch.Tensor):
        return None
    return pattern[0], pattern[1], segments


def structured_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                    mask_function=None, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """transformers' mask-builder signature (as ``sdpa_mask``): a :class:`StructuredMask` for
    the standard patterns, otherwise transformers' dense ``sdpa_mask`` result. A
    :class:`StructuredMask` given as ``attention_mask`` (built ahead by ``generate()``) comes
    back unchanged."""
    from transformers import masking_utils as mu

    if isinstance(attention_mask, StructuredMask):
        return attention_mask
    if isinstance(q_offset, torch.Tensor):  # the cache's live counter: keep today's value
        q_offset = q_offset.clone()
    mask_function = mu.causal_mask_function if mask_function is None else mask_function
    dense = functools.partial(mu.sdpa_mask, batch_size, q_length, kv_length, q_offset, kv_offset,
                              mask_function, attention_mask, **kwargs)
    pattern, segments = mask_pattern(mask_function), None
    if pattern is None and attention_mask is None:
        packed = packed_pattern(mask_function)
        if packed is not None and packed[2].shape[1] == q_length == kv_length:
            pattern, segments = packed[:2], packed[2].expand(batch_size, -1)
    if pattern is None or isinstance(kv_offset, torch.Tensor):
        return dense()
    padding = None
    if attention_mask is not None:
        padded = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        assert padded is not None  # a 2-D mask in, its padded form out
        padding = padded[:, kv_offset:kv_offset + kv_length].to(torch.bool)
    q_offset = q_offset if isinstance(q_offset, torch.Tensor) else int(q_offset)
    return StructuredMask(pattern[0], pattern[1], padding, q_offset, int(kv_offset),
                          int(q_length), int(kv_length), dense, segments)
