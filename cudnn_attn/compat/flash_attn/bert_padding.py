"""FlashAttention 2.8.3's ``flash_attn.bert_padding`` helpers: between a padded batch
``[B, S, ...]`` with a 2-D attention mask and the packed ``[total, ...]`` rows the varlen
functions take. All are differentiable (plain indexing; autograd scatters the gradients back).

Equivalent PyTorch::

    rows, indices, cu_seqlens, max_len, used = unpad_input(x, mask)   # rows = x.flatten(0, 1)[mask.flatten().bool()]
    x_again = pad_input(rows, indices, B, S)                         # zeros where mask == 0
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["index_first_axis", "index_put_first_axis", "unpad_input", "pad_input",
           "unpad_input_for_concatenated_sequences"]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]`` along dim 0 (``input`` at least 2-D)."""
    if input.dim() < 2:
        raise ValueError(f"input must have at least 2 dims, got shape {tuple(input.shape)}")
    return input.index_select(0, indices)


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor,
                         first_axis_dim: int) -> torch.Tensor:
    """A ``[first_axis_dim, *values.shape[1:]]`` zero tensor with ``values`` at rows ``indices``."""
    if indices.dim() != 1 or values.dim() < 2:
        raise ValueError(f"indices must be 1-D and values at least 2-D, got indices "
                         f"{tuple(indices.shape)} and values {tuple(values.shape)}")
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_copy(0, indices, values)


def _packed(hidden_states, keep, seqlens):
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    max_len = int(seqlens.max()) if seqlens.numel() else 0
    return index_first_axis(hidden_states.flatten(0, 1), indices), indices, cu_seqlens, max_len


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """``(rows [total, ...], indices [total], cu_seqlens [B + 1] int32, max_seqlen int,
    used_seqlens [B] int32)`` of the tokens where ``attention_mask`` (or ``unused_mask``, tokens
    that are kept but not attended) is nonzero; ``hidden_states`` is ``[B, S, ...]``."""
    keep = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = keep.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    return (*_packed(hidden_states, keep, seqlens), used)


def unpad_input_for_concatenated_sequences(hidden_states: torch.Tensor,
                                           attention_mask_in_length: torch.Tensor):
    """Several samples packed in each row: ``attention_mask_in_length[b]`` lists the lengths of
    row ``b``'s samples (then zeros). Returns ``(rows, indices, cu_seqlens, max_seqlen)`` with one
    ``cu_seqlens`` entry per sample."""
    lengths = attention_mask_in_length
    seqlen = lengths.shape[-1]
    row_len = lengths.sum(dim=-1)
    keep = torch.arange(seqlen, device=lengths.device)[None, :] < row_len[:, None]
    samples = lengths.flatten()
    samples = samples[samples != 0].to(torch.int32)
    return _packed(hidden_states, keep, samples)


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int,
              seqlen: int) -> torch.Tensor:
    """The inverse of ``unpad_input``: ``[batch, seqlen, ...]`` with zeros at padded tokens."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.view(batch, seqlen, *hidden_states.shape[1:])
