"""The description of one attention call: shapes, strides, dtypes, layout, mask and flags.

``AttnProblem.from_tensors`` is the only place user input is validated. The problem is frozen and
hashable; ``plan_key`` is the part that decides how a backend builds its plan (runtime values such
as the softmax scale, dropout probability and padding lengths stay out of it).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Optional

import torch

from . import checks
from .checks import FLOAT_DTYPES
from .masks import (Alibi,
    Causal,
    Mask,
    MaskSet,
    Neighborhood,
    Padding,
    RelPosBias,
    SlidingWindow,
    mask_parts,
    without_full_neighborhoods,
    without_open_lines,
)
from .storage import Storage

if TYPE_CHECKING:
    from .score_mods import ScoreMod

__all__ = ["TensorSpec", "AttnProblem", "LAYOUTS", "FLOAT_DTYPES", "accumulator_dtype",
           "deterministic_default", "deterministic_calls", "deterministic_requested"]

LAYOUTS = ("bhsd", "bshd")

# A surface's own deterministic mode (NATTEN's), for the calls made inside ``deterministic_calls``
# in this thread/task only: torch's process-wide flag is never flipped for it.
_DETERMINISTIC_CALLS = contextvars.ContextVar("cudnn_attn.deterministic_calls", default=False)


# Whether a surface asked for deterministic calls here (a bound method: callers on the hot path
# read it without a Python frame).
deterministic_requested = _DETERMINISTIC_CALLS.get


def deterministic_default() -> bool:
    """The ``deterministic`` field of a problem built now: torch's deterministic mode, or a
    surface's per-call request (``deterministic_calls``)."""
    return _DETERMINISTIC_CALLS.get() or torch.are_deterministic_algorithms_enabled()


@contextlib.contextmanager
def deterministic_calls(on: bool = True) -> Iterator[None]:
    """The calls made inside (this thread or task) plan deterministic backwards when ``on``; the
    flag lands in each problem, so a later backward of such a call stays deterministic.

    Under ``torch.compile`` this is a no-op (Dynamo cannot trace a context variable): compiled
    calls follow torch's own deterministic mode only."""
    if not on or torch.compiler.is_compiling():
        yield
        return
    token = _DETERMINISTIC_CALLS.set(True)
    try:
        yield
    finally:
        _DETERMINISTIC_CALLS.reset(token)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of accumulators and of the lse: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class TensorSpec:
    """Shape, strides and dtype of one tensor, without its data."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "TensorSpec":
        return TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype)


def _check_bias_shape(bias: torch.Tensor, full: tuple[int, int, int, int], name="bias") -> None:
    ok = bias.dim() <= 4 and all(
        b in (1, f) for b, f in zip(reversed(bias.shape), reversed(full)))
    if not ok:
        raise ValueError(f"{name} of shape {tuple(bias.shape)} does not broadcast to "
                         f"[B, H, S_q, S_kv] = {list(full)}")


def _check_rpb(table: torch.Tensor, mask, heads: int, q: torch.Tensor) -> TensorSpec:
    hoods = [m for m in mask_parts(mask) if isinstance(m, Neighborhood)]
    if len(hoods) != 1:
        raise ValueError("RelPosBias needs exactly one Neighborhood mask in mask=")
    expected = (heads, *(2 * k - 1 for k in hoods[0].kernel_size))
    if tuple(table.shape) != expected:
        raise ValueError(f"RelPosBias table must have shape [H, 2k-1, ...] = {expected}, got "
                         f"{tuple(table.shape)}")
    if table.device != q.device:
        raise ValueError(f"RelPosBias table must be on q's device {q.device}, got {table.device}")
    return TensorSpec.of(table)


@dataclass(frozen=True)
class AttnProblem:
    """One attention call, normalised to ``[B, H, S, D]`` sizes whatever the layout."""

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    dim_qk: int
    dim_v: int
    dtype: torch.dtype
    device: torch.device
    layout: str
    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    mask: Optional[Mask] = None
    bias: Optional[TensorSpec] = None
    alibi: Optional[Alibi] = None
    rpb: Optional[TensorSpec] = None           # RelPosBias table (with a Neighborhood mask)
    # An explicit dropout mask (cuDNN builder's set_dropout(mask, scale)): p * mask * scale.
    dropout_mask: Optional[TensorSpec] = None
    dropout_scale: float = 1.0
    scale: float = 1.0
    dropout_p: float = 0.0
    softcap: Optional[float] = None
    # A recorded cuDNN score_mod (cudnn_attn.model.score_mods.ScoreMod): pointwise ops on the scores,
    # applied after the scale and softcap, before bias and masks (the cuDNN builder's).
    score_mod: Optional[object] = None
    return_lse: bool = False
    requires_grad: bool = False
    bias_requires_grad: bool = False
    # torch.use_deterministic_algorithms at call time: engines pick deterministic backwards.
    deterministic: bool = False
    # A surface whose forward promises bitwise repeatable results (FlashAttention's): engines
    # avoid kernels that are not (cuDNN's S_q = 1 decode path), whatever ``deterministic`` says.
    repeatable: bool = False
    # Packed (ragged) or paged tensors (cudnn_attn.model.storage); None: dense [B, S, H, D] batches.
    storage: Optional[Storage] = None
    plan_key: tuple = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        # Everything a plan specialises on; runtime scalars (scale, dropout_p, padding lengths,
        # ALiBi slopes) are read from the problem at call time instead.
        parts = tuple(("padding",) if isinstance(m, Padding) else m for m in mask_parts(self.mask))
        key = (self.batch, self.heads_q, self.heads_kv, self.seq_q, self.seq_kv, self.dim_qk,
               self.dim_v, self.dtype, self.device, self.layout, self.q, self.k, self.v, parts,
               self.bias, self.alibi is not None, self.rpb, self.dropout_mask,
               self.softcap is not None, self.dropout_p > 0, self.deterministic, self.storage,
               self.score_mod, self.repeatable)
        object.__setattr__(self, "plan_key", key)

    # -- convenience views used by every backend ----------------------------------------------
    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv

    def masks_of(self, kind: type) -> tuple:
        return tuple(m for m in mask_parts(self.mask) if isinstance(m, kind))

    # Cached (in the instance's __dict__, which a frozen dataclass leaves writable): every layer
    # of a call asks, and walking the mask's parts each time cost a padded call microseconds.
    @cached_property
    def padding(self) -> Optional[Padding]:
        found = self.masks_of(Padding)
        return found[0] if found else None

    @cached_property
    def neighborhood(self) -> Optional[Neighborhood]:
        found = self.masks_of(Neighborhood)
        return found[0] if found else None

    def rebound(self, padding: Padding, storage: Optional[Storage] = None) -> "AttnProblem":
        """This problem with ``padding`` (another call's runtime lengths) in place of its own
        ``Padding`` and, when given, ``storage`` (its offsets or page tables) in place of its
        storage. Equal as values (runtime lengths and storage tensors are not compared), so
        nothing validation or a plan read changes. Copied field by field:
        ``dataclasses.replace`` would re-run the whole construction, the per-call cost this
        saves a cached call."""
        parts = tuple(padding if isinstance(m, Padding) else m for m in mask_parts(self.mask))
        fields: dict[str, object] = {
            "mask": parts[0] if len(parts) == 1 else MaskSet(parts),
            "padding": padding}  # the cached property's value, copied with the rest
        if storage is not None:
            fields["storage"] = storage
        return self._copied(fields)

    def with_query_rows(self, seq_q: int, q: TensorSpec) -> "AttnProblem":
        """This problem with ``seq_q`` query rows laid out as ``q``, every other field (the
        runtime values too) its own: copied as ``rebound`` copies, the plan key made anew."""
        fresh = self._copied({"seq_q": seq_q, "q": q})
        fresh.__post_init__()
        return fresh

    def _copied(self, fields: dict) -> "AttnProblem":
        """This problem with ``fields`` replaced, copied field by field (cached properties
        too): ``dataclasses.replace`` would re-run the whole construction, a per-call cost."""
        fresh = object.__new__(AttnProblem)
        fresh.__dict__.update(self.__dict__)
        fresh.__dict__.update(fields)
        return fresh

    def describe(self) -> str:
        masks = " & ".join(repr(m) for m in mask_parts(self.mask)) or "none"
        extras = [f"bias={list(self.bias.shape)}" if self.bias else "",
                  "alibi" if self.alibi else "",
                  f"rpb={list(self.rpb.shape)}" if self.rpb else "",
                  f"dropout_mask={list(self.dropout_mask.shape)}" if self.dropout_mask else "",
                  f"softcap={self.softcap}" if self.softcap else "",
                  f"score_mod={getattr(self.score_mod, 'label', self.score_mod)}" if self.score_mod else "",
                  f"dropout_p={self.dropout_p}" if self.dropout_p else "",
                  f"storage={self.storage!r}" if self.storage else ""]
        return (f"q=[B={self.batch}, H={self.heads_q}, S={self.seq_q}, D={self.dim_qk}] "
                f"k/v=[H={self.heads_kv}, S={self.seq_kv}, D_v={self.dim_v}] {self.dtype} "
                f"{self.device} layout={self.layout} mask={masks} "
                + " ".join(e for e in extras if e)).rstrip()

    # -- construction and validation ----------------------------------------------------------
    @staticmethod
    def from_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: Mask | None = None,
                     bias: torch.Tensor | Alibi | RelPosBias | None = None,
                     scale: float | None = None, dropout_p: float = 0.0, softcap: float | None = None,
                     layout: str = "bhsd", return_lse: bool = False, alibi: bool | None = None,
                     dropout_mask: torch.Tensor | None = None, dropout_scale: float = 1.0,
                     score_mod: ScoreMod | None = None) -> "AttnProblem":
        """Validate the arguments of ``attention()`` and describe the call.

        Surfaces may also pass ``alibi`` (an ``Alibi``) next to a bias tensor: the engine adds
        both (the cuDNN builder's ``set_bias`` + ``set_alibi_mask``).
        ``dropout_mask`` (a bool, integer or float tensor broadcastable to ``[B, H_q, S_q, S_kv]``,
        exclusive with ``dropout_p``) multiplies the attention weights, times ``dropout_scale``.
        ``score_mod`` (a ``cudnn_attn.model.score_mods.ScoreMod``, the builder's ``set_score_mod``)
        modifies the scores before bias and masks.
        """
        q, k, v = (checks.tensor(n, t, floating=True) for n, t in (("q", q), ("k", k), ("v", v)))
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, "
                            f"v={v.dtype}")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() != 4:
                raise ValueError(f"{name} must be 4-D ({layout}), got shape {tuple(t.shape)}")
            if t.numel() == 0:
                raise ValueError(f"{name} must not be empty, got shape {tuple(t.shape)}")
        if q.device != k.device or q.device != v.device:
            raise ValueError(f"q, k and v must be on one device, got q={q.device}, k={k.device}, "
                             f"v={v.device}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        s_dim, h_dim = (2, 1) if layout == "bhsd" else (1, 2)
        B, Hq, Sq, Dqk = q.shape[0], q.shape[h_dim], q.shape[s_dim], q.shape[3]
        Hkv, Skv = k.shape[h_dim], k.shape[s_dim]
        if k.shape[0] != B or v.shape[0] != B:
            raise ValueError(f"q, k and v must share the batch size, got q={tuple(q.shape)}, "
                             f"k={tuple(k.shape)}, v={tuple(v.shape)}")
        if k.shape[3] != Dqk:
            raise ValueError(f"k head dim must equal q head dim, got q={tuple(q.shape)}, "
                             f"k={tuple(k.shape)}")
        if v.shape[h_dim] != Hkv or v.shape[s_dim] != Skv:
            raise ValueError(f"v must have k's heads and sequence length ({layout}), got "
                             f"k={tuple(k.shape)}, v={tuple(v.shape)}")
        if Hq % Hkv:
            raise ValueError(f"query heads must be a multiple of kv heads (GQA/MQA), got "
                             f"H_q={Hq}, H_kv={Hkv}")

        if mask is not None and not isinstance(mask, Mask):
            raise TypeError(f"mask must be a cudnn_attn mask (Causal, SlidingWindow, Neighborhood, "
                            f"Padding or their & combination), got {type(mask).__name__}")
        _check_masks(mask, B, Sq, Skv, isinstance(bias, Alibi) or alibi is not None)
        if not isinstance(bias, RelPosBias):  # a table indexes neighborhood offsets
            mask = without_full_neighborhoods(mask)

        if alibi is not None and (not isinstance(alibi, Alibi) or isinstance(bias, Alibi)):
            raise TypeError(f"alibi must be an Alibi next to a bias tensor, got alibi={alibi!r}, "
                            f"bias={type(bias).__name__}")
        bias_spec, rpb_spec, bias_grad = None, None, False
        if isinstance(bias, Alibi):
            alibi, bias = bias, None  # type: ignore[assignment]
        if alibi is not None:
            alibi.slope_table(B, Hq)  # validates the slope shape
        if isinstance(bias, RelPosBias):
            rpb_spec = _check_rpb(bias.table, mask, Hq, q)
            bias_grad = bias.table.requires_grad
        elif bias is not None:
            bias = checks.tensor("bias", bias, floating=True)
            if bias.device != q.device:
                raise ValueError(f"bias must be on q's device {q.device}, got {bias.device}")
            _check_bias_shape(bias, (B, Hq, Sq, Skv))
            bias_spec, bias_grad = TensorSpec.of(bias), bias.requires_grad

        if scale is None:
            scale = checks.default_scale(Dqk)
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number, got {scale!r}")
        checks.fits_scores("scale", scale, q.dtype)
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) \
                or not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
        if softcap is not None:
            if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) \
                    or not math.isfinite(softcap) or softcap < 0:
                raise ValueError(f"softcap must be None or a finite number >= 0, got {softcap!r}")
            softcap = float(softcap) or None  # FlashAttention's convention: 0 means off
            if softcap is not None:  # tiny: s / softcap is 0 / 0 at a zero score
                checks.fits_scores("softcap", softcap, q.dtype, smallest=True)
        mask_spec = None
        if dropout_mask is not None:
            dropout_mask = checks.tensor("dropout_mask", dropout_mask)  # bool, int or float
            if dropout_mask.device != q.device:
                raise ValueError(f"dropout_mask must be on q's device {q.device}, got "
                                 f"{dropout_mask.device}")
            _check_bias_shape(dropout_mask, (B, Hq, Sq, Skv), "dropout_mask")
            if dropout_p:
                raise ValueError(f"dropout_mask and dropout_p={dropout_p} are exclusive")
            mask_spec = TensorSpec.of(dropout_mask)
            dropout_scale = checks.real("dropout_scale", dropout_scale)

        if alibi is None and type(Sq) is int and type(Skv) is int:  # not symbolic sizes
            mask = without_open_lines(mask, Sq, Skv)
        return AttnProblem(
            batch=B, heads_q=Hq, heads_kv=Hkv, seq_q=Sq, seq_kv=Skv, dim_qk=Dqk,
            dim_v=v.shape[3], dtype=q.dtype, device=q.device, layout=layout,
            q=TensorSpec.of(q), k=TensorSpec.of(k), v=TensorSpec.of(v), mask=mask,
            bias=bias_spec, alibi=alibi, rpb=rpb_spec, dropout_mask=mask_spec,
            dropout_scale=float(dropout_scale), scale=float(scale), dropout_p=float(dropout_p),
            softcap=softcap, score_mod=_score_mod(score_mod),
            return_lse=checks.flag("return_lse", return_lse),
            requires_grad=q.requires_grad or k.requires_grad or v.requires_grad or bias_grad,
            bias_requires_grad=bias_grad,
            deterministic=deterministic_default())


def _score_mod(program):
    from .score_mods import ScoreMod

    if program is not None and not isinstance(program, ScoreMod):
        raise TypeError(f"score_mod must be a cudnn_attn.model.score_mods.ScoreMod (trace() a "
                        f"callable), got {type(program).__name__}")
    return program


def _check_masks(mask, batch: int, seq_q: int, seq_kv: int, alibi: bool) -> None:
    parts = mask_parts(mask)
    for m in parts:
        if isinstance(m, Neighborhood) and not (seq_q == seq_kv == m.num_tokens):
            raise ValueError(f"Neighborhood over spatial_shape={m.spatial_shape} needs "
                             f"S_q == S_kv == {m.num_tokens} tokens, got S_q={seq_q}, S_kv={seq_kv}")
        if isinstance(m, Padding):
            if m.batch != batch:
                raise ValueError(f"Padding needs one length per batch ({batch}), got "
                                 f"{m.batch}: {m!r}")
            if m.runtime is not None:  # runtime lengths are never read on the host
                continue
            if max(m.seq_lens_q) > seq_q or max(m.seq_lens_kv) > seq_kv:  # type: ignore[arg-type]
                raise ValueError(f"Padding lengths exceed the sequence: seq_lens_q={m.seq_lens_q} "
                                 f"(S_q={seq_q}), seq_lens_kv={m.seq_lens_kv} (S_kv={seq_kv})")
    if sum(isinstance(m, Padding) for m in parts) > 1:
        raise ValueError("mask may contain at most one Padding")
    aligned = {m.alignment for m in parts if isinstance(m, (Causal, SlidingWindow))}
    if len(aligned) > 1 and alibi:
        raise ValueError("Alibi aligns like the call's Causal/SlidingWindow masks, but they mix "
                         f"alignments {sorted(aligned)}; give them one alignment")
