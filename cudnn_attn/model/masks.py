"""Attention masks and positional biases: frozen, hashable descriptions, composable with ``&``.

A mask says which keys a query may see; it never holds tensors, so it can sit inside a cache key.
Every engine reads the same objects: the torch engine turns them into tile tables, the cuDNN
engine into graph attributes, the CuPy engine into compile-time kernel choices.

Alignment of a query row ``i`` against ``S_kv`` keys (used by ``Causal``, ``SlidingWindow`` and
``Alibi``)::

    top_left:      i' = i
    bottom_right:  i' = i + S_kv - S_q      (with Padding, per batch: i + len_kv[b] - len_q[b])
"""

from __future__ import annotations


import dataclasses
import math
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import is_fake

from . import checks

__all__ = [
    "Mask",
    "MaskSet",
    "Causal",
    "SlidingWindow",
    "Neighborhood",
    "Padding",
    "Alibi",
    "RelPosBias",
    "ALIGNMENTS",
    "mask_parts",
    "without_full_neighborhoods",
    "without_open_lines",
    "Band",
    "band_of",
    "line_bounds",
    "same_alignment",
    "alibi_slopes",
    "split_bias",
    "alibi_distance",
]

ALIGNMENTS = ("top_left", "bottom_right")


class Mask:
    """Base class of every mask; ``a & b`` keeps the keys both masks keep."""

    def __and__(self, other: "Mask") -> "MaskSet":
        if not isinstance(other, Mask):
            return NotImplemented
        return MaskSet.of(self, other)  # type: ignore[return-value]

    def parts(self) -> tuple["Mask", ...]:
        return (self,)


def _check_alignment(alignment: str) -> None:
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment must be one of {ALIGNMENTS}, got {alignment!r}")


@dataclass(frozen=True)
class Causal(Mask):
    """Key ``j`` is visible from query ``i`` iff ``j <= i'`` (``i'`` aligned, see module doc).

    ``S_q = 3, S_kv = 5``::

        top_left        bottom_right
        1 0 0 0 0       1 1 1 0 0
        1 1 0 0 0       1 1 1 1 0
        1 1 1 0 0       1 1 1 1 1
    """

    alignment: str = "top_left"

    def __post_init__(self):
        _check_alignment(self.alignment)


@dataclass(frozen=True)
class SlidingWindow(Mask):
    """FlashAttention's window: ``i' - left <= j <= i' + right``, both ends inclusive.

    ``-1`` leaves that side unbounded, so ``SlidingWindow(-1, 0)`` is causal. ``SlidingWindow(1, 1)``
    on 5 tokens::

        1 1 0 0 0
        1 1 1 0 0
        0 1 1 1 0
        0 0 1 1 1
        0 0 0 1 1
    """

    left: int = -1
    right: int = -1
    alignment: str = "top_left"

    def __post_init__(self):
        for name in ("left", "right"):
            checks.integer(name, getattr(self, name), -1, maximum=checks.MAX_POSITION)
        _check_alignment(self.alignment)


@dataclass(frozen=True, init=False)
class Neighborhood(Mask):
    """NATTEN 0.21 neighborhood attention on the row-major flattening of ``spatial_shape``.

    Per axis of length ``L`` with kernel ``k``, stride ``s``, dilation ``d``: the axis splits into
    ``d`` interleaved groups; inside its group a query sees ``k`` consecutive group members around
    its stride group's centre (shifted, not cut, at the borders), or, when causal, up to ``k``
    members ending at itself. A query sees the Cartesian product of its per-axis sets.
    ``L = 8, k = 3``::

        query 0 -> keys 0 1 2     (window shifted right at the border)
        query 3 -> keys 2 3 4
        query 7 -> keys 5 6 7

    Scalars apply to every axis. Rules (as NATTEN): ``k >= 2``, ``s >= 1``, ``d >= 1``,
    ``s <= k`` and ``k * d <= L`` on each axis.
    """

    spatial_shape: tuple[int, ...]
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    is_causal: tuple[bool, ...]

    def __init__(self, spatial_shape: int | Sequence[int], kernel_size: int | Sequence[int],
                 stride: int | Sequence[int] = 1, dilation: int | Sequence[int] = 1,
                 is_causal: bool | Sequence[bool] = False):
        if isinstance(spatial_shape, (tuple, list)):
            shape = tuple(checks.integer("spatial_shape", n, 1) for n in spatial_shape)
        else:
            shape = (checks.integer("spatial_shape", spatial_shape, 1),)
        if not 1 <= len(shape) <= 3:
            raise ValueError(f"spatial_shape must have 1, 2 or 3 axes, got {spatial_shape!r}")
        ndim = len(shape)
        kernel = checks.per_axis("kernel_size", kernel_size, ndim, lambda n, v: checks.integer(n, v, 2))
        strides = checks.per_axis("stride", stride, ndim, lambda n, v: checks.integer(n, v, 1))
        dilations = checks.per_axis("dilation", dilation, ndim, lambda n, v: checks.integer(n, v, 1))
        causal = checks.per_axis("is_causal", is_causal, ndim, checks.boolean)
        for axis, (length, k, s, d) in enumerate(zip(shape, kernel, strides, dilations)):
            if s > k:
                raise ValueError(f"stride must be <= kernel_size on every axis; axis {axis}: "
                                 f"stride={s} > kernel_size={k}")
            if k * d > length:
                raise ValueError(f"kernel_size * dilation must be <= the axis length; axis {axis}: "
                                 f"kernel_size={k} * dilation={d} > spatial_shape[{axis}]={length}")
        for name, value in (("spatial_shape", shape), ("kernel_size", kernel), ("stride", strides),
                            ("dilation", dilations), ("is_causal", causal)):
            object.__setattr__(self, name, value)

    @property
    def ndim(self) -> int:
        return len(self.spatial_shape)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.spatial_shape)

    def axes(self) -> Iterator[tuple[int, int, int, int, bool]]:
        """``(length, kernel, stride, dilation, causal)`` for each axis."""
        return zip(self.spatial_shape, self.kernel_size, self.stride, self.dilation, self.is_causal)

    def plain_equivalent(self) -> Optional[Mask]:
        """The same visibility without a neighborhood, when the kernel spans whole axes: ``None``
        (every key) when it spans every axis, non-causally; ``Causal()`` in 1-D when causal (a
        full causal window is ``0..i``); else ``self``. A full-axis kernel has dilation 1 and makes
        stride irrelevant. As NATTEN's self-attention fast path, which this mirrors."""
        if self.kernel_size != self.spatial_shape:
            return self
        if not any(self.is_causal):
            return None
        return Causal() if self.ndim == 1 else self


def _as_lengths(name: str, value) -> tuple[int, ...]:
    if isinstance(value, torch.Tensor):
        _check_length_tensor(name, value)
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"{name} must be a sequence of ints or a 1-D integer tensor, got {value!r}")
    return tuple(checks.integer(name, n, 0, maximum=checks.MAX_POSITION) for n in value)


def _check_length_tensor(name: str, value: torch.Tensor) -> None:
    if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor, got {value.dtype} of shape "
                         f"{tuple(value.shape)}")


def _runtime_lengths(value) -> bool:
    """A length tensor whose values stay on the device: one that cannot be read now (under
    torch.compile / torch.export, fake or meta) or one on an accelerator, where reading it would
    synchronise the host (and break CUDA-graph capture)."""
    return isinstance(value, torch.Tensor) and (
        value.device.type != "cpu" or torch.compiler.is_compiling() or is_fake(value))


@dataclass(frozen=True, init=False)
class Padding(Mask):
    """Per-batch valid lengths: rows ``i >= seq_lens_q[b]`` see nothing (zeros out, ``-inf`` lse),
    keys ``j >= seq_lens_kv[b]`` are hidden. ``seq_lens_kv`` defaults to ``seq_lens_q``.

    ``seq_lens_q = seq_lens_kv = (3,)`` on 4 tokens::

        1 1 1 0
        1 1 1 0
        1 1 1 0
        0 0 0 0

    Lengths given as tensors on an accelerator (or meta/fake tensors, or any tensor while
    torch.compile / torch.export traces) are **runtime values**: they are never read on the host,
    ``seq_lens_q``/``seq_lens_kv`` are ``None``, ``runtime`` holds the two 1-D tensors, and every
    such ``Padding`` of a batch size compares equal, so one plan (one cuDNN graph) serves every
    batch of lengths and a call can be captured in a CUDA graph. Values past the sequence
    (``> S``) are then not checked. Ints and CPU tensors are read and checked.
    """

    seq_lens_q: Optional[tuple[int, ...]]
    seq_lens_kv: Optional[tuple[int, ...]]
    # init=False: torch.compile before 2.13 passes defaulted init fields to a custom __init__.
    runtime: Optional[tuple] = dataclasses.field(default=None, compare=False, repr=False,
                                                 init=False)

    def __init__(self, seq_lens_q: Sequence[int] | torch.Tensor,
                 seq_lens_kv: Sequence[int] | torch.Tensor | None = None) -> None:
        if _runtime_lengths(seq_lens_q) or _runtime_lengths(seq_lens_kv):
            self._init_runtime(seq_lens_q, seq_lens_q if seq_lens_kv is None else seq_lens_kv)
            return
        lens_q = _as_lengths("seq_lens_q", seq_lens_q)
        lens_kv = lens_q if seq_lens_kv is None else _as_lengths("seq_lens_kv", seq_lens_kv)
        if len(lens_q) != len(lens_kv):
            raise ValueError(f"seq_lens_q and seq_lens_kv must have one entry per batch, got "
                             f"{len(lens_q)} and {len(lens_kv)}")
        object.__setattr__(self, "seq_lens_q", lens_q)
        object.__setattr__(self, "seq_lens_kv", lens_kv)

    def _init_runtime(self, lens_q, lens_kv) -> None:
        tensors = []
        for name, value, other in (("seq_lens_q", lens_q, lens_kv), ("seq_lens_kv", lens_kv, lens_q)):
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(_as_lengths(name, value), device=other.device)
            _check_length_tensor(name, value)
            tensors.append(value)
        if tensors[0].shape != tensors[1].shape:
            raise ValueError(f"seq_lens_q and seq_lens_kv must have one entry per batch, got "
                             f"{tensors[0].shape[0]} and {tensors[1].shape[0]}")
        object.__setattr__(self, "seq_lens_q", None)
        object.__setattr__(self, "seq_lens_kv", None)
        object.__setattr__(self, "runtime", tuple(tensors))

    @property
    def batch(self) -> int:
        if self.runtime is None:
            return len(self.seq_lens_q)  # type: ignore[arg-type]  # ints when not runtime
        return self.runtime[0].shape[0]

    def tensors(self, device: torch.device | str | int | None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lens_q, lens_kv)`` as integer tensors on ``device``; runtime ones are moved, never
        read (no host synchronisation)."""
        if self.runtime is not None:
            return tuple(t.to(device, non_blocking=True) for t in self.runtime)
        return (torch.tensor(self.seq_lens_q, device=device),
                torch.tensor(self.seq_lens_kv, device=device))


@dataclass(frozen=True)
class MaskSet(Mask):
    """The AND of several masks; built by ``&``. Order and repeats do not matter."""

    members: tuple[Mask, ...]

    @staticmethod
    def of(*masks: Mask) -> "Mask":
        flat = {p for m in masks for p in m.parts()}
        ordered = tuple(sorted(flat, key=_order))
        return ordered[0] if len(ordered) == 1 else MaskSet(ordered)

    def parts(self) -> tuple[Mask, ...]:
        return self.members


def _order(mask: Mask) -> tuple:
    # A canonical order built from field values (not repr, which torch.compile cannot trace).
    fields = dataclasses.fields(mask)  # type: ignore[arg-type]  # every Mask is a dataclass
    return (type(mask).__name__, tuple(getattr(mask, f.name) for f in fields if f.compare))


def mask_parts(mask: Mask | None) -> tuple[Mask, ...]:
    """The atomic masks of ``mask`` (empty for no mask)."""
    return () if mask is None else mask.parts()


def without_full_neighborhoods(mask: Mask | None) -> Mask | None:
    """``mask`` with each ``Neighborhood`` whose kernel spans whole axes replaced by its
    ``plain_equivalent`` (dense or causal attention runs on every engine, and fastest there)."""
    parts = mask_parts(mask)
    if not any(isinstance(p, Neighborhood) for p in parts):
        return mask
    kept = [q for q in (p.plain_equivalent() if isinstance(p, Neighborhood) else p for p in parts)
            if q is not None]
    return MaskSet.of(*kept) if kept else None


def without_open_lines(mask: Mask | None, seq_q: int, seq_kv: int) -> Mask | None:
    """``mask`` without its ``Causal``/``SlidingWindow`` parts that hide no key of a dense
    ``seq_q x seq_kv`` call (one query aligned bottom-right, a window as wide as the keys: a
    decode step's causal mask), when every part is one of those (with ``Padding`` the alignment
    follows each sequence's lengths; ALiBi reads the alignment: callers keep its masks). Every
    engine runs an unmasked call on its plainest path."""
    parts = mask_parts(mask)
    lines = [p for p in parts if isinstance(p, (Causal, SlidingWindow))]
    if not parts or len(lines) != len(parts):
        return mask
    kept = [p for p in lines if not _hides_nothing(p, seq_q, seq_kv)]
    if len(kept) == len(parts):
        return mask
    return MaskSet.of(*kept) if kept else None


def _hides_nothing(mask: Causal | SlidingWindow, seq_q: int, seq_kv: int) -> bool:
    """Every query sees every key: query 0's band reaches the last key, the last query's the
    first (``line_bounds``' rule, ``i' = i + S_kv - S_q`` bottom-right)."""
    left, right = line_bounds(mask)
    offset = seq_kv - seq_q if mask.alignment == "bottom_right" else 0
    return (right < 0 or offset + right >= seq_kv - 1) and \
        (left < 0 or seq_q - 1 + offset - left <= 0)


# ---------------------------------------------------------------------------------------------
# Causal and window masks as one band
# ---------------------------------------------------------------------------------------------

def line_bounds(mask: Mask) -> tuple[int, int]:
    """``(left, right)`` of a ``Causal``/``SlidingWindow`` mask (``-1``: unbounded; causal is
    ``(-1, 0)``): key ``j`` is visible to query ``i`` iff ``i' - left <= j <= i' + right``."""
    if isinstance(mask, Causal):
        return (-1, 0)
    assert isinstance(mask, SlidingWindow)  # callers pass the band parts only
    return (mask.left, mask.right)


def same_alignment(alignment: str, equal_lengths: bool) -> str:
    """The alignment a mask may be read with: when every sequence has as many queries as keys
    (``S_q == S_kv``, no padding) both alignments are the same diagonal, read as ``top_left``."""
    return "top_left" if equal_lengths else alignment


@dataclass(frozen=True)
class Band:
    """The ``Causal``/``SlidingWindow`` parts of a mask intersected into one band: key ``j`` is
    visible to query ``i`` iff ``i' - left <= j <= i' + right`` (``-1``: unbounded side),
    ``i'`` aligned by ``alignment`` (``None`` when the parts keep different alignments)."""

    left: int
    right: int
    alignment: Optional[str]


def band_of(mask: Mask | None, seq_q: int = 0, seq_kv: int = -1,
            padded: bool = False) -> Optional[Band]:
    """The one band of ``mask``'s causal/window parts (``None`` without any); lengths given and
    equal (and no padding) read every part top-left (``same_alignment``). Every engine, the
    distributed schedule and the surfaces read bands here."""
    lines = [m for m in mask_parts(mask) if isinstance(m, (Causal, SlidingWindow))]
    if not lines:
        return None
    equal = not padded and seq_q == seq_kv
    alignments = {same_alignment(m.alignment, equal) for m in lines}
    lefts, rights = zip(*(line_bounds(m) for m in lines))
    left = min((b for b in lefts if b >= 0), default=-1)
    right = min((b for b in rights if b >= 0), default=-1)
    return Band(left, right, alignments.pop() if len(alignments) == 1 else None)


# ---------------------------------------------------------------------------------------------
# ALiBi
# ---------------------------------------------------------------------------------------------

def _geometric_slopes(n: int) -> list[float]:
    start = 2.0 ** (-8.0 / n)
    return [start ** (h + 1) for h in range(n)]


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi paper's head slopes: ``2**(-8(h+1)/n)``, interleaved for non-powers of two."""
    if num_heads & (num_heads - 1) == 0:
        return _geometric_slopes(num_heads)
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    extra = _geometric_slopes(2 * closest)[0::2][: num_heads - closest]
    return _geometric_slopes(closest) + extra


def _as_slopes(slopes) -> tuple | None:
    if slopes is None:
        return None
    if isinstance(slopes, torch.Tensor):
        if slopes.dim() not in (1, 2) or not slopes.dtype.is_floating_point:
            raise ValueError(f"Alibi slopes must be a float tensor of shape [H] or [B, H], got "
                             f"{slopes.dtype} of shape {tuple(slopes.shape)}")
        slopes = slopes.tolist()
    if not isinstance(slopes, Sequence) or not slopes:
        raise TypeError(f"Alibi slopes must be a non-empty sequence or tensor, got {slopes!r}")
    rows = slopes if isinstance(slopes[0], Sequence) else [slopes]
    table = tuple(tuple(checks.real("Alibi slopes", s)
                        for s in row) for row in rows)
    return table if isinstance(slopes[0], Sequence) else table[0]


@dataclass(frozen=True, init=False)
class Alibi:
    """ALiBi bias: adds ``-slope_h * |i' - j|`` (``i'`` aligned like the call's causal or window
    mask, top-left when there is none). ``slopes``: None (the paper's geometric sequence), or
    ``H`` floats, or a ``[H]`` / ``[B, H]`` tensor. Pass it as ``bias=Alibi()``."""

    slopes: tuple | None

    def __init__(self, slopes: Sequence[float] | torch.Tensor | None = None):
        object.__setattr__(self, "slopes", _as_slopes(slopes))

    def slope_table(self, batch: int, heads: int) -> torch.Tensor:
        """float64 ``[B or 1, H]`` slopes, validated against the call's batch and head counts."""
        if self.slopes is None:
            return torch.tensor([alibi_slopes(heads)], dtype=torch.float64)
        table = torch.tensor(self.slopes, dtype=torch.float64)
        if table.dim() == 1:
            table = table[None]
        if table.shape[1] != heads or table.shape[0] not in (1, batch):
            raise ValueError(f"Alibi slopes of shape {tuple(table.shape)} do not match batch={batch}, "
                             f"heads={heads}; expected [{heads}] or [{batch}, {heads}]")
        return table


# ---------------------------------------------------------------------------------------------
# Relative positional bias (NATTEN)
# ---------------------------------------------------------------------------------------------

def alibi_distance(aligned_rows: torch.Tensor, keys: torch.Tensor, dtype) -> torch.Tensor:
    """ALiBi's ``|i' - j|`` in ``dtype`` (broadcast), ``i'`` the query's aligned position: the bias
    is ``-slope_h`` times it."""
    return (aligned_rows - keys).abs().to(dtype)


def split_bias(bias) -> tuple:
    """``(kind, table, alibi)`` of a ``bias=`` argument: kind ``"none"``, ``"tensor"`` (``table``
    the tensor), ``"rpb"`` (``table`` the ``RelPosBias`` table) or ``"alibi"`` (``alibi`` set).
    Every call path reads a bias's kind and runtime tensor here."""
    if bias is None:
        return "none", None, None
    if isinstance(bias, Alibi):
        return "alibi", None, bias
    if isinstance(bias, RelPosBias):
        return "rpb", bias.table, None
    if isinstance(bias, torch.Tensor):
        return "tensor", bias, None
    raise TypeError(f"bias must be a tensor, Alibi or RelPosBias, got {type(bias).__name__}")


class RelPosBias:
    """NATTEN's relative positional bias, for a ``Neighborhood`` mask: ``table`` is
    ``[H_q, 2k_0-1, ..., 2k_{n-1}-1]``, and the score of query ``i`` and key ``j`` gains
    ``table[h, (j_0 - i_0) // d_0 + k_0 - 1, ...]`` (per-axis coordinates, dilation ``d``).
    Pass it as ``bias=RelPosBias(table)``; the table is differentiable.

    Equivalent PyTorch (1-D, no dilation)::

        s = s + table[h, (j - i) + k - 1]    # for every visible (i, j)
    """

    __slots__ = ("table",)

    def __init__(self, table: torch.Tensor):
        self.table = checks.tensor("RelPosBias table", table, floating=True)

    def __repr__(self) -> str:
        return f"RelPosBias(table={list(self.table.shape)})"
