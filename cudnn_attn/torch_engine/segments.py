"""Sums scattered to indices in a fixed order: deterministic on every device.

``index_add_`` / ``scatter_add_`` accumulate with atomics on CUDA, so two identical backward
calls could differ in the last bits (issue 23: the RPB gradient on an H200). Here each target
gathers its sources (sorted, stable) into a padded ``[.., N, K, ..]`` block and sums along
``K``: only ``argsort``, ``bincount`` without weights, integer ``cumsum``, ``index_select`` and
``sum``, none of which is on torch's list of nondeterministic CUDA operations.
"""

from __future__ import annotations

import torch


def add_at(acc: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``acc[:, index[j]] += src[:, j]`` along dim 1, deterministically; returns ``acc``.

    Equivalent PyTorch (atomics on CUDA)::

        acc.index_add_(1, index, src)

    ``acc`` is ``[P, N, *rest]``, ``index`` ``[M]`` (int64, values in ``[0, N)``), ``src``
    ``[P, M, *rest]``. Repeated indices sum in ascending source order.
    """
    index = index.reshape(-1)
    size, count = acc.shape[1], index.numel()
    if count == 0:
        return acc
    order = torch.argsort(index, stable=True)
    per_target = torch.bincount(index, minlength=size)
    width = int(per_target.max())  # the most sources one target receives
    starts = torch.cumsum(per_target, 0) - per_target
    slot = torch.arange(width, device=index.device)
    taken = slot[None, :] < per_target[:, None]
    position = (starts[:, None] + slot[None, :]).clamp_(max=count - 1)
    # A slot past a target's sources reads the zero column appended at position ``count``.
    source = torch.where(taken, order[position], count).reshape(-1)
    zero = src.new_zeros((src.shape[0], 1) + tuple(src.shape[2:]))
    padded = torch.cat([src, zero], dim=1)
    gathered = padded.index_select(1, source)
    acc += gathered.view((src.shape[0], size, width) + tuple(src.shape[2:])).sum(2)
    return acc
