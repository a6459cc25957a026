"""What one call hands an engine's plan besides its ``AttnProblem``: the tensors and the dropout state.

Runtime values are arguments, never plan keys: a plan built for one problem runs any inputs of
that problem. The dropout state is drawn once per call, saved for the backward, and replayable by
every surface (FlashAttention's ``philox_seed``/``philox_offset``, cuDNN's seed/offset tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["DropoutState", "Inputs"]

_SEED_BOUND = 2 ** 62


@dataclass(frozen=True)
class DropoutState:
    """A dropout stream: ``seed`` picks it, ``offset`` skips into it (cuDNN/Philox semantics).

    Each engine derives its keep masks from these two numbers alone, so a forward and its
    backward (or a later replay from a surface that kept the numbers) see the same masks.
    """

    seed: int
    offset: int = 0

    def __post_init__(self):
        for name in ("seed", "offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"dropout {name} must be an int >= 0, got {value!r}")

    @staticmethod
    def draw(generator: Optional[torch.Generator] = None) -> "DropoutState":
        """One fresh stream from ``generator`` (torch's default CPU generator when ``None``)."""
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got "
                            f"{type(generator).__name__}")
        source = generator.device if generator is not None else "cpu"
        seed = int(torch.randint(0, _SEED_BOUND, (1,), generator=generator, device=source))
        return DropoutState(seed, 0)


@dataclass(slots=True)
class Inputs:
    """The tensors of one call, in the call's layout.

    ``bias`` is the additive bias tensor (``problem.bias``) or the relative positional bias table
    (``problem.rpb``); ``dropout`` is set exactly when ``problem.dropout_p > 0``;
    ``dropout_mask`` exactly when ``problem.dropout_mask`` is.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: Optional[torch.Tensor] = None
    dropout: Optional[DropoutState] = None
    dropout_mask: Optional[torch.Tensor] = None
