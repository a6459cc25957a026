"""The builder's setters for cuDNN's score modifiers, extra outputs and kernel hints (mixed into
``SdpaAttributes`` / ``SdpaBackwardAttributes``; semantics in ``attributes``' docstring).

* ``set_score_mod(fn)`` / ``set_score_mod_bprop(fn)``: cuDNN's callables ``fn(graph, tensor) ->
  tensor``, recorded by ``cudnn_attn.model.score_mods.trace`` when the call runs;
* ``set_block_mask(mask)``: cuDNN's uint8 tile bitmask ``[B, H_q, ceil(S_q / 128),
  ceil(ceil(S_kv / 128) / 8)]``; bit ``t % 8`` (least significant first) of byte ``t // 8`` keeps
  key tile ``t`` of a 128-row query tile;
* ``set_logit_max(t)`` / ``set_score_sum_exp(t)`` / ``set_rng_dump(t)``: outputs written into
  ``t`` (``[B, H_q, S_q, 1]`` float32 row max and sum of ``exp(s - max)``; ``[B, H_q, S_q, S_kv]``
  the dropout keep mask, 0/1);
* ``set_unfuse_fma(flag)``, ``set_mma_core_mode(dtype)``: cuDNN kernel hints, recorded (they
  pick cuDNN kernel variants; the CPU engines have no fused FMA or MMA cores to switch);
* ``set_stats_use_log2(flag)``: stats in base 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from ...model import checks

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's own from Python 3.11

__all__ = ["ScoreModSetters", "BLOCK_TILE", "BLOCK_BITS", "block_mask_visibility", "CudnnEnum",
           "ScoreModFn"]

# cuDNN's score modifiers: ``fn(graph, tensor) -> tensor`` over the builder's graph recorder
# (``cudnn_attn.model.score_mods``), written against cuDNN's own pygraph API, so typed loosely.
ScoreModFn = Callable[..., object]


class CudnnEnum(Protocol):
    """A value of one of the cuDNN frontend's enums (``cudnn.diagonal_alignment.TOP_LEFT``,
    ``cudnn.data_type.FLOAT``, ...): read by its ``name``."""

    @property
    def name(self) -> str: ...

BLOCK_TILE = 128    # rows and keys per tile of cuDNN's block mask
BLOCK_BITS = 8      # key tiles per byte

_MMA_CORE_MODES = ("HALF", "BFLOAT16", "FLOAT", "FP8_E4M3", "FP8_E5M2")


def _output(setter: str, what: str, t, dtypes=(torch.float32, torch.float64)):
    return checks.tensor(what, t, dtypes=dtypes, prefix=f"{setter}: ")


def block_mask_visibility(mask: torch.Tensor, seq_q: int, seq_kv: int) -> torch.Tensor:
    """Bool ``[B|1, H|1, S_q, S_kv]``: the (query, key) pairs a cuDNN block mask keeps."""
    tiles_kv = -(-seq_kv // BLOCK_TILE)
    bits = torch.arange(BLOCK_BITS, device=mask.device)
    keep = (mask.to(torch.int64)[..., None] >> bits) & 1          # [B, H, tq, bytes, 8]
    keep = keep.flatten(-2)[..., :tiles_kv].bool()                # [B, H, tq, tiles_kv]
    keep = keep.repeat_interleave(BLOCK_TILE, -2).repeat_interleave(BLOCK_TILE, -1)
    return keep[..., :seq_q, :seq_kv]


class ScoreModSetters:
    """cuDNN's ``set_score_mod``, ``set_block_mask``, extra outputs and hints."""

    def _init_score_mod(self) -> None:
        self.score_mod: ScoreModFn | None = None
        self.block_mask: torch.Tensor | None = None
        self.logit_max: torch.Tensor | None = None
        self.score_sum_exp: torch.Tensor | None = None
        self.rng_dump: torch.Tensor | None = None
        self.unfuse_fma = False
        self.mma_core_mode = "HALF"   # cuDNN's default
        self.stats_use_log2 = False

    def set_score_mod(self, score_mod: ScoreModFn | None) -> Self:
        """cuDNN's score modifier: ``score_mod(graph, score) -> tensor`` adds pointwise ops on
        the scaled scores (before bias and masks); ``None`` removes it."""
        if score_mod is not None and not callable(score_mod):
            raise TypeError(f"set_score_mod: expected a callable (graph, score) -> tensor, got "
                            f"{score_mod!r}")
        self.score_mod = score_mod
        return self

    def set_block_mask(self, block_mask: torch.Tensor | None) -> Self:
        """cuDNN's uint8 block mask (forward; see the module doc for the layout); ``None``
        removes it."""
        if block_mask is not None:
            block_mask = checks.tensor("block_mask", block_mask, dtypes=(torch.uint8,),
                                        prefix="set_block_mask: ")
            if block_mask.dim() != 4:
                raise ValueError(f"set_block_mask: block_mask must be [B, H_q, ceil(S_q/128), "
                                 f"ceil(ceil(S_kv/128)/8)], got {tuple(block_mask.shape)}")
        self.block_mask = block_mask
        return self

    def set_logit_max(self, logit_max: torch.Tensor) -> Self:
        """Receives each row's maximum score, ``[B, H_q, S_q, 1]`` float32 (cuDNN's
        ``score_max``)."""
        self.logit_max = _output("set_logit_max", "logit_max", logit_max)
        return self

    def set_score_sum_exp(self, score_sum_exp: torch.Tensor) -> Self:
        """Receives ``sum_j exp(s_ij - max_i)``, ``[B, H_q, S_q, 1]`` float32 (cuDNN's
        ``score_sum_exp``): ``stats = max + log(sum_exp)``."""
        self.score_sum_exp = _output("set_score_sum_exp", "score_sum_exp", score_sum_exp)
        return self

    def set_rng_dump(self, rng_dump: torch.Tensor) -> Self:
        """Receives the dropout keep mask (0/1), ``[B, H_q, S_q, S_kv]`` float (a debug
        output)."""
        self.rng_dump = _output("set_rng_dump", "rng_dump", rng_dump,
                                dtypes=(torch.float32, torch.float64, torch.float16,
                                        torch.bfloat16))
        return self

    def set_unfuse_fma(self, value: bool) -> Self:
        """cuDNN's hint to split fused multiply-adds (a rounding choice of its SM100 kernels;
        the torch engine computes ``scale * (q . k)`` unfused already)."""
        self.unfuse_fma = checks.flag("value", value, prefix="set_unfuse_fma: ")
        return self

    def set_stats_use_log2(self, value: bool) -> Self:
        """Stats in base 2 (``log2(sum exp(s))``) instead of natural log (the backward then
        reads base-2 stats)."""
        self.stats_use_log2 = checks.flag("value", value, prefix="set_stats_use_log2: ")
        return self

    def set_mma_core_mode(self, mode: str | CudnnEnum) -> Self:
        """cuDNN's MMA core data type (``HALF`` default, or a ``cudnn.data_type``)."""
        name = getattr(mode, "name", mode)
        name = name.upper() if isinstance(name, str) else name
        if name not in _MMA_CORE_MODES:
            raise ValueError(f"set_mma_core_mode: expected one of {_MMA_CORE_MODES} (or the "
                             f"cudnn.data_type), got {mode!r}")
        self.mma_core_mode = name
        return self


class ScoreModBackwardSetters(ScoreModSetters):
    """The backward's: ``set_score_mod_bprop`` and ``set_dsink_token`` too."""

    def _init_score_mod(self) -> None:
        super()._init_score_mod()
        self.score_mod_bprop: ScoreModFn | None = None

    def set_score_mod_bprop(self, score_mod_bprop: ScoreModFn | None) -> Self:
        """cuDNN's backward modifier: ``fn(graph, dP) -> tensor`` maps the gradient of the
        modified scores to the raw ones' (default: the chain rule of ``set_score_mod``'s ops)."""
        if score_mod_bprop is not None and not callable(score_mod_bprop):
            raise TypeError(f"set_score_mod_bprop: expected a callable (graph, dP) -> tensor, "
                            f"got {score_mod_bprop!r}")
        self.score_mod_bprop = score_mod_bprop
        return self

    def set_dsink_token(self, dsink_token: torch.Tensor) -> Self:
        """cuDNN's spelling of ``set_dSink_token``."""
        return self.set_dSink_token(dsink_token)  # type: ignore[attr-defined]  # the attributes'
