"""What a backward graph reads besides q, k, v and the stats: O and dO as the graph's layout
has them, and the gradient reaching a returned LSE folded into O (cuDNN's backward has no input
for it)."""

from __future__ import annotations

import torch

from . import _runtime

__all__ = ["like_layout", "fold_dlse"]


def like_layout(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``t`` contiguous (the graph's O/dO layout) and 16-byte aligned."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"expected a tensor of shape {shape}, got {tuple(t.shape)}")
    return _runtime.aligned(t.contiguous())


def fold_dlse(out, dout, dlse, layout: str):
    """An ``O'`` with ``rowsum(dO * O') = rowsum(dO * O) - dlse``: cuDNN reads O only for that
    row sum, so the LSE's gradient rides along. Rows with ``dO = 0`` keep O (their dlse term is
    lost; a loss using a row's LSE but not its output is the one case this does not cover)."""
    # -> out's row order: [B, H, S] (bhsd), [B, S, H] (bshd), [total, H] (ragged, given so)
    d = dlse if layout in ("bhsd", "ragged") else dlse.transpose(1, 2)
    d = d.to(torch.float32).unsqueeze(-1)
    g = dout.to(torch.float32)
    norm = (g * g).sum(-1, keepdim=True)
    step = torch.where(norm > 0, d / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return (out.to(torch.float32) - step * g).to(out.dtype)
