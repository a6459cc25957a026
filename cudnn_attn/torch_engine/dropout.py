"""The torch engine's dropout with a replayable stream: the backward regenerates the forward's
keep masks chunk by chunk (or reads the call's explicit ``dropout_mask``)."""

from __future__ import annotations

import torch

__all__ = ["DropoutStream", "stream_seed"]


class DropoutStream:
    """Dropout keep masks, chunk by chunk: either the explicit ``dropout_mask`` of the call
    (times ``dropout_scale``) at each tile's pairs, or a private generator seeded by the call's
    ``DropoutState``, so the backward (and any replay of the same state) regenerates the
    forward's masks."""

    def __init__(self, problem, inputs, device):
        self.problem, self.p = problem, problem.dropout_p
        self.generator = None
        self.mask = None
        if problem.dropout_mask is not None:
            self.mask, self.scale = inputs.dropout_mask, problem.dropout_scale
        elif self.p > 0:
            if inputs.dropout is None:
                raise ValueError("a dropout call needs its DropoutState")
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(stream_seed(inputs.dropout))

    def keep(self, plan, p, lo, hi, keys):
        """Scaled keep mask of tiles [lo, hi), broadcastable to ``p`` (``None``: keep all)."""
        if self.mask is not None:
            return plan.pairs_of(self.problem, self.mask, lo, hi, keys, p.dtype) * self.scale
        if self.generator is None:
            return None
        draw = torch.rand(p.shape, generator=self.generator, device=p.device, dtype=p.dtype)
        return (draw >= self.p).to(p.dtype) / (1.0 - self.p)


def stream_seed(state) -> int:
    """One generator seed per (seed, offset): offsets select distinct streams of one seed."""
    return (state.seed + state.offset * 0x9E3779B97F4A7C15) % (2 ** 63)
