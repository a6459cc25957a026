"""How a call's tensors are laid out when they are not dense ``[B, S, H, D]`` batches.

* ``Ragged`` — packed variable-length sequences (FlashAttention's varlen layout, cuDNN's THD):
  ``q`` ``[total_q, H_q, D]``, ``k``/``v`` ``[total_k, H_kv, D]``, contiguous; sequence ``b`` owns
  tokens ``cu_seqlens[b]:cu_seqlens[b+1]``. The problem's ``S_q``/``S_kv`` are bounds on the
  longest sequence; its ``Padding`` holds the lengths.
* ``Paged`` — a paged KV cache (vLLM / FlashAttention / cuDNN): ``k``/``v`` are page pools
  ``[num_blocks, page_size, H_kv, D]`` (or cuDNN's ``[num_blocks, H_kv, page_size, D]``); token
  ``t`` of sequence ``b`` lives in page ``block_table[b, t // page_size]``. The problem's
  ``S_kv`` is ``pages_per_seq * page_size``.

The offsets and the block table are runtime tensors (``compare=False``): they never enter a plan
key, and engines read them on the device, never on the host. Engines that cannot address such
storage decline the problem; ``attention_varlen`` / ``attention_with_kvcache`` then run it as
dense batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

__all__ = ["Ragged", "Paged", "Storage"]


@dataclass(frozen=True)
class Ragged:
    """Packed sequences with cumulative lengths ``cu_seqlens_q``/``cu_seqlens_k`` (``[B + 1]``).

    ``derived``: what an engine computed from these offsets (its element offsets), kept for the
    call's backward, which holds the same storage: one call's offsets never serve another."""

    cu_seqlens_q: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    cu_seqlens_k: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    derived: dict = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class Paged:
    """Page pools of ``num_blocks`` pages of ``page_size`` tokens, read through ``block_table``
    (``[B, pages_per_seq]``; ``v_table`` for the values when it differs).

    ``layout``: ``"bshd"`` pools are ``[num_blocks, page_size, H_kv, D]`` (FlashAttention, vLLM),
    ``"bhsd"`` pools ``[num_blocks, H_kv, page_size, D]`` (cuDNN's containers)."""

    num_blocks: int
    page_size: int
    block_table: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    layout: str = "bshd"
    v_table: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)


Storage = Union[Ragged, Paged]
