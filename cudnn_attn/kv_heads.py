"""Keys and values with different head counts (``H_k != H_v``, as cuDNN allows).

Query head ``h`` reads key head ``h // (H_q / H_k)`` and value head ``h // (H_q / H_v)``. With
``L = lcm(H_k, H_v)`` (which divides ``H_q``, as both do), repeating each key head ``L / H_k``
times and each value head ``L / H_v`` times gives an ordinary GQA call with ``L`` kv heads that
reads the same pairs: ``(h // (H_q / L)) // (L / H_k) == h // (H_q / H_k)``. Every engine runs
that call; autograd sums the repeats' gradients back onto the shared heads.
"""

from __future__ import annotations

import math

import torch

from . import _checks

__all__ = ["head_counts_differ", "repeat_to_common_heads", "sum_to_heads"]


def _heads(t: torch.Tensor, layout: str) -> int:
    return t.shape[1] if layout == "bhsd" else t.shape[2]


def head_counts_differ(q, k, v, layout) -> bool:
    """Whether ``q``, ``k``, ``v`` are 4-D tensors in a known layout and ``k``, ``v`` have different
    head counts (anything malformed answers ``False``: validation then explains it)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor):
            _checks.dense(name, t)  # before reading shapes: torch's errors there name no argument
    return (all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v))
            and layout in ("bhsd", "bshd") and _heads(k, layout) != _heads(v, layout))


def repeat_to_common_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str):
    """``(k, v)`` repeated to ``lcm(H_k, H_v)`` heads each (module doc)."""
    h_q, h_k, h_v = _heads(q, layout), _heads(k, layout), _heads(v, layout)
    if h_q % h_k or h_q % h_v:
        raise ValueError(f"query heads must be a multiple of the key heads and of the value heads, "
                         f"got H_q={h_q}, H_k={h_k}, H_v={h_v} ({layout})")
    common = math.lcm(h_k, h_v)
    dim = 1 if layout == "bhsd" else 2
    return (k.repeat_interleave(common // h_k, dim), v.repeat_interleave(common // h_v, dim))


def sum_to_heads(grad: torch.Tensor, heads: int, layout: str) -> torch.Tensor:
    """The gradient of ``repeat_to_common_heads`` for one side: ``grad`` of the repeated heads
    summed back onto ``heads`` (for surfaces with their own backward, as the cuDNN builder's)."""
    dim = 1 if layout == "bhsd" else 2
    repeats = grad.shape[dim] // heads
    return grad.unflatten(dim, (heads, repeats)).sum(dim + 1)
