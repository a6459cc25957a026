"""FlashAttention's encoding of the attention probabilities it returns for testing
(``return_attn_probs`` / ``return_softmax``, the ``S_dmask`` tensor).

FlashAttention writes, for each query row, ``exp(s_ij - m)`` where ``s`` is the scaled (capped,
biased) score and ``m`` the running row maximum of its forward loop, which walks the key blocks of
``block_size_n`` columns from the last block to the first: ``m`` for a key in block ``c`` is the
maximum score over blocks ``c, c + 1, ...``. Entries the dropout mask drops are negated (a kept
entry is ``>= 0``). The tensor is ``[B, H, S_q, S_k]`` padded with zeros to multiples of 128.
``|S| * exp(m - lse)`` gives the pre-dropout probabilities back.

Since ``exp(s - m) = p / max(p over the same blocks)`` for the normalized probabilities ``p``,
the encoding is computed here from the probabilities an engine returns (no scores recomputed).
"""

from __future__ import annotations

import torch

from ...model.problem import accumulator_dtype

__all__ = ["block_size_n", "encode"]

_ROUND = 128


def block_size_n(head_dim: int, is_dropout: bool, is_causal: bool) -> int:
    """The key-block width of FlashAttention 2's forward kernel on sm80/sm90 (the table of its
    ``_get_block_size_n``); ``is_causal`` only matters on sm86/sm89, which this ignores."""
    if head_dim > 256:
        raise ValueError(f"head_dim must be <= 256 for FlashAttention's block sizes, got {head_dim}")
    if head_dim <= 32:
        return 128
    if head_dim <= 64:
        return 64 if is_dropout else 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 32 if is_dropout else 64
    return 64


def _round(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


def encode(probs: torch.Tensor, keep, head_dim: int, is_causal: bool, dtype) -> torch.Tensor:
    """``probs`` ``[B, H, S_q, S_k]`` (pre-dropout, normalized) and ``keep`` (bool, same shape,
    or None without dropout) -> FlashAttention's ``S_dmask`` in ``dtype``."""
    batch, heads, seq_q, seq_k = probs.shape
    width = block_size_n(min(head_dim, 256), keep is not None, is_causal)
    out = probs.new_zeros(batch, heads, _round(seq_q), _round(seq_k),
                          dtype=accumulator_dtype(probs.dtype))
    if seq_k and seq_q:
        rows = out[:, :, :seq_q]
        rows[..., :seq_k] = probs
        # The padded width is a multiple of every block width; padding zeros change no maximum
        # (weights are >= 0).
        blocks = rows.unflatten(-1, (-1, width))
        suffix_max = blocks.amax(dim=-1).flip(-1).cummax(dim=-1).values.flip(-1)
        # A block whose suffix maximum is 0 holds only zeros: 0 / tiny stays 0.
        blocks.div_(suffix_max.clamp_min(torch.finfo(out.dtype).tiny)[..., None])
        if keep is not None:
            rows[..., :seq_k].mul_(keep.to(out.dtype).mul_(2).sub_(1))
    return out.to(dtype)
