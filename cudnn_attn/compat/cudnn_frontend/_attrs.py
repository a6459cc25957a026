"""The attribute objects of the cuDNN frontend's SDPA builder (``SdpaAttributes`` /
``SdpaBackwardAttributes``) and their setters' argument checks (``cudnn_attn.model.checks``).
Semantics: ``cudnn_attn.compat.cudnn_frontend.attributes``' docstring."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Union

import torch

from ...model import checks
from ...packed import calls
from ._score_attrs import CudnnEnum, ScoreModBackwardSetters, ScoreModSetters

__all__ = ["SdpaAttributes", "SdpaBackwardAttributes"]

_ALIGNMENTS = ("top_left", "bottom_right")

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's own from Python 3.11

# The argument types of the setters, as cuDNN's frontend takes them.
Alignment = Literal["top_left", "bottom_right"]
# Per-batch lengths (or cumulative offsets): an integer tensor ``[B]`` / ``[B, 1, 1, 1]`` or ints.
Lengths = Union[torch.Tensor, Sequence[int]]


def _flag(setter: str, value) -> bool:
    return checks.flag("value", value, prefix=f"{setter}: ")


def _scalar(setter: str, what: str, value, *, integer: bool = False):
    """A Python number or a 1-element tensor (cuDNN passes scalars as (1,1,1,1) tensors)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{setter}: {what} must be a number or a 1-element tensor, got a "
                             f"tensor of shape {tuple(value.shape)}")
        if integer and (value.dtype.is_floating_point or value.dtype.is_complex
                        or value.dtype == torch.bool):
            raise TypeError(f"{setter}: {what} must be an integer tensor, got {value.dtype}")
        value = value.item()
    prefix = f"{setter}: "
    if integer:
        return checks.integer(what, value, prefix=prefix)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{prefix}{what} must be a real number, got {value!r}")
    return checks.real(what, value, prefix=prefix)


def _lengths(setter: str, what: str, value):
    """Checked lengths: a tuple of ints, or (a tensor on an accelerator) the flat tensor itself,
    a runtime value never read on the host (as cuDNN's seq_len tensors)."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{setter}: {what} must be an integer tensor, got {value.dtype}")
        if value.dim() not in (1, 4) or (value.dim() == 4 and value.shape[1:] != (1, 1, 1)):
            raise ValueError(f"{setter}: {what} must have shape [B] or [B, 1, 1, 1], got "
                             f"{tuple(value.shape)}")
        if calls.on_accelerator(value):
            if value.numel() == 0:
                raise ValueError(f"{setter}: {what} must not be empty")
            return value.reshape(-1)
        value = value.reshape(-1).tolist()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{setter}: {what} must be an integer tensor or a sequence of ints, "
                        f"got {value!r}")
    out = []
    for n in value:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{setter}: {what} must hold ints, got {value!r}")
        if n < 0:
            raise ValueError(f"{setter}: {what} must be >= 0, got {value!r}")
        out.append(int(n))
    if not out:
        raise ValueError(f"{setter}: {what} must not be empty")
    return tuple(out)


def _cumulative(setter: str, offsets):
    """Lengths from cumulative offsets ``[B + 1]`` (``[B + 1, 1, 1, 1]`` too): 0, non-decreasing
    (checked unless they are a runtime tensor on an accelerator)."""
    if isinstance(offsets, torch.Tensor) and offsets.dim() == 4:
        offsets = offsets.reshape(-1)
    values = _lengths(setter, "offsets", offsets)
    if isinstance(values, torch.Tensor):
        if values.shape[0] < 2:
            raise ValueError(f"{setter}: offsets must have B + 1 >= 2 entries, got shape "
                             f"{tuple(values.shape)}")
        return values[1:] - values[:-1]
    if len(values) < 2 or values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{setter}: offsets must start at 0, be non-decreasing and have B + 1 "
                         f"entries, got {values}")
    return tuple(b - a for a, b in zip(values, values[1:]))


def _page_table(setter: str, table) -> torch.Tensor:
    table = checks.tensor("table", table, dtypes=(torch.int32, torch.int64), prefix=f"{setter}: ")
    if table.dim() == 4 and table.shape[1] == table.shape[3] == 1:
        table = table[:, 0, :, 0]
    if table.dim() != 2:
        raise ValueError(f"{setter}: table must be [B, 1, pages, 1] or [B, pages], got "
                         f"{tuple(table.shape)}")
    return table


def check_broadcast(what: str, t: torch.Tensor, full: tuple) -> None:
    ok = t.dim() <= 4 and all(a in (1, b) for a, b in zip(reversed(t.shape), reversed(full)))
    if not ok:
        raise ValueError(f"{what} of shape {tuple(t.shape)} does not broadcast to "
                         f"[B, H, S_q, S_kv] = {list(full)}")


class _Attributes:
    """Setters shared by the forward and backward attributes (see the module doc)."""

    def __init__(self) -> None:
        self.name = ""
        self.causal: str | None = None          # None | "top_left" | "bottom_right"
        self.window: tuple | None = None         # (left, right, alignment or None)
        self.bias: torch.Tensor | None = None
        self.attn_scale = 1.0                       # cuDNN: unset means no scaling
        self.dropout: tuple | None = None        # ("philox", p, seed, offset) | ("mask", m, s)
        self.compute_data_type = torch.float32
        self.sink_token: torch.Tensor | None = None
        # cuDNN's diagonal band (see band()): alignment, exclusive left bound, right bound.
        self.alignment: str | None = None
        self.left_bound: int | None = None
        self.right_bound: int | None = None
        self.window_length: int | None = None
        self.use_padding = False
        self.seq_len_q: tuple | None = None
        self.seq_len_kv: tuple | None = None
        self.cu_seq_len_q: tuple | None = None
        self.cu_seq_len_kv: tuple | None = None
        self.max_total_seq_len_q: int | None = None
        self.max_total_seq_len_kv: int | None = None
        self.implementation = "AUTO"
        self.k_table: torch.Tensor | None = None
        self.v_table: torch.Tensor | None = None
        self.max_seq_len_kv: int | None = None
        self.padding: tuple | None = None        # (seq_len_q, seq_len_kv) tuples
        self.alibi = False

    def __repr__(self) -> str:
        fields = {k: v for k, v in vars(self).items()
                  if not (v is None or v is False or (isinstance(v, str) and not v))}
        if isinstance(self.bias, torch.Tensor):
            fields["bias"] = f"tensor{list(self.bias.shape)}"
        if self.dropout and self.dropout[0] == "mask":
            fields["dropout"] = ("mask", f"tensor{list(self.dropout[1].shape)}", self.dropout[2])
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"

    def set_name(self, name: str) -> Self:
        """An operation name (kept for ``repr`` and logs)."""
        if not isinstance(name, str):
            raise TypeError(f"set_name: expected a str, got {name!r}")
        self.name = name
        return self

    def set_causal_mask(self, value: bool) -> Self:
        """Top-left causal: key ``j`` visible from query ``i`` iff ``j <= i``."""
        if _flag("set_causal_mask", value):
            self.causal = "top_left"
        elif self.causal == "top_left":
            self.causal = None
        return self

    def set_causal_mask_bottom_right(self, value: bool) -> Self:
        """Bottom-right causal: ``j <= i + S_kv - S_q`` (per batch with padding)."""
        if _flag("set_causal_mask_bottom_right", value):
            self.causal = "bottom_right"
        elif self.causal == "bottom_right":
            self.causal = None
        return self

    def set_sliding_window(self, left: int, right: int, alignment: Alignment | None = None) -> Self:
        """FlashAttention's inclusive window ``i' - left <= j <= i' + right``; ``-1`` leaves a
        side unbounded, ``(-1, -1)`` removes the window. ``alignment`` (``"top_left"`` /
        ``"bottom_right"``) defaults to the causal mask's alignment, top-left without one."""
        for what, n in (("left", left), ("right", right)):  # -1: unbounded
            checks.integer(what, n, minimum=-1, prefix="set_sliding_window: ")
        if alignment is not None and alignment not in _ALIGNMENTS:
            raise ValueError(f"set_sliding_window: alignment must be None or one of "
                             f"{_ALIGNMENTS}, got {alignment!r}")
        self.window = None if left == right == -1 else (int(left), int(right), alignment)
        return self

    def diagonal_band_bounds(self) -> tuple[int | None, int | None]:
        """cuDNN's ``(diagonal_band_left_bound, diagonal_band_right_bound)`` for this window and
        causal mask (``None``: unbounded). cuDNN's left bound is exclusive: FA ``left`` -> ``left +
        1``."""
        bounds = [None, 0 if self.causal else None]
        if self.window is not None:
            left, right = self.window[:2]
            if left >= 0:
                bounds[0] = left + 1
            if right >= 0:
                bounds[1] = right if bounds[1] is None else min(bounds[1], right)
        return bounds[0], bounds[1]

    def set_diagonal_alignment(self, alignment: str | CudnnEnum) -> Self:
        """cuDNN's diagonal alignment: ``"top_left"`` / ``"bottom_right"`` (or
        ``cudnn.diagonal_alignment.TOP_LEFT`` / ``BOTTOM_RIGHT``). The causal setters override it."""
        name = getattr(alignment, "name", alignment)
        name = name.lower() if isinstance(name, str) else name
        if name not in _ALIGNMENTS:
            raise ValueError(f"set_diagonal_alignment: expected one of {_ALIGNMENTS} (or cuDNN's "
                             f"TOP_LEFT / BOTTOM_RIGHT), got {alignment!r}")
        self.alignment = name
        return self

    def set_diagonal_band_left_bound(self, left_bound: int | torch.Tensor | None) -> Self:
        """cuDNN's left bound ``L`` (exclusive): query ``i`` sees keys ``j > i' - L``; ``None``
        removes it. Overrides ``set_sliding_window_length``."""
        self.left_bound = self._bound("set_diagonal_band_left_bound", left_bound, 1,
                                      "Left bound needs to be greater than zero")
        return self

    def set_diagonal_band_right_bound(self, right_bound: int | torch.Tensor | None) -> Self:
        """cuDNN's right bound ``R``: query ``i`` sees keys ``j <= i' + R``; ``None`` removes it.
        The causal setters pin it to 0."""
        self.right_bound = self._bound("set_diagonal_band_right_bound", right_bound, 0,
                                       "Right bound needs to be larger than or equal to zero")
        return self

    def set_sliding_window_length(self, window_length: int | torch.Tensor | None) -> Self:
        """cuDNN's older spelling of the left bound (``diagonal_band_left_bound`` wins)."""
        self.window_length = self._bound("set_sliding_window_length", window_length, 1,
                                         "Sliding window length needs to be greater than zero")
        return self

    @staticmethod
    def _bound(setter: str, value, minimum: int, message: str):
        if value is None:
            return None
        value = _scalar(setter, "bound", value, integer=True)
        if value < minimum:
            raise ValueError(f"{setter}: {message}, got {value}")
        return value

    def band(self) -> tuple[str, int | None, int | None]:
        """cuDNN's effective ``(alignment, left_bound, right_bound)``: a causal setter fixes the
        alignment and a right bound of 0; the left bound falls back on the sliding window
        length; the alignment defaults to top-left."""
        alignment = self.causal or self.alignment or "top_left"
        right = 0 if self.causal else self.right_bound
        left = self.left_bound if self.left_bound is not None else self.window_length
        return alignment, left, right

    def set_seq_len_q(self, seq_len_q: Lengths) -> Self:
        """Per-batch query lengths (``[B]`` or ``[B, 1, 1, 1]``), with ``set_padding_mask(True)``."""
        self.seq_len_q = _lengths("set_seq_len_q", "seq_len_q", seq_len_q)
        return self

    def set_seq_len_kv(self, seq_len_kv: Lengths) -> Self:
        """Per-batch key lengths (``[B]`` or ``[B, 1, 1, 1]``), with ``set_padding_mask(True)``."""
        self.seq_len_kv = _lengths("set_seq_len_kv", "seq_len_kv", seq_len_kv)
        return self

    def set_cu_seq_len_q(self, cu_seq_len_q: Lengths) -> Self:
        """Query lengths as cumulative offsets ``[B + 1]`` (cuDNN's alternative to
        ``set_seq_len_q``; not both), with ``set_padding_mask(True)``."""
        self.cu_seq_len_q = _cumulative("set_cu_seq_len_q", cu_seq_len_q)
        return self

    def set_cu_seq_len_kv(self, cu_seq_len_kv: Lengths) -> Self:
        """Key lengths as cumulative offsets ``[B + 1]``, as ``set_cu_seq_len_q``."""
        self.cu_seq_len_kv = _cumulative("set_cu_seq_len_kv", cu_seq_len_kv)
        return self

    def set_max_total_seq_len_q(self, value: int | torch.Tensor) -> Self:
        """cuDNN's bound of a packed (ragged) query axis; this builder's tensors are dense
        ``[B, H, S, D]``, so a call with it is rejected as cuDNN rejects it."""
        self.max_total_seq_len_q = _scalar("set_max_total_seq_len_q", "value", value,
                                           integer=True)
        return self

    def set_max_total_seq_len_kv(self, value: int | torch.Tensor) -> Self:
        """As ``set_max_total_seq_len_q``, for the keys."""
        self.max_total_seq_len_kv = _scalar("set_max_total_seq_len_kv", "value", value,
                                            integer=True)
        return self

    def set_implementation(self, implementation: str | CudnnEnum) -> Self:
        """cuDNN's engine family (``AUTO``, ``COMPOSITE``, ``UNIFIED``, or
        ``cudnn.attention_implementation``): a hint; the result is the same."""
        name = getattr(implementation, "name", implementation)
        if not isinstance(name, str) or name.upper() not in ("AUTO", "COMPOSITE", "UNIFIED"):
            raise ValueError(f"set_implementation: expected AUTO, COMPOSITE or UNIFIED, got "
                             f"{implementation!r}")
        self.implementation = name.upper()
        return self

    def set_bias(self, bias: torch.Tensor | None) -> Self:
        """Additive bias broadcastable to ``[B, H_q, S_q, S_kv]`` (``None`` removes it)."""
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(f"set_bias: expected a tensor or None, got {type(bias).__name__}")
        if bias is not None and not bias.dtype.is_floating_point:
            raise TypeError(f"set_bias: bias must be a float tensor, got {bias.dtype}")
        self.bias = bias
        return self

    def set_attn_scale(self, scale: float | torch.Tensor) -> Self:
        """Scores are ``scale * q . k`` (a float or a 1-element tensor; unset: 1.0)."""
        self.attn_scale = _scalar("set_attn_scale", "attn_scale", scale)
        return self

    def set_dropout(self, *args: float | torch.Tensor | None) -> Self:
        """``set_dropout(p, seed, offset)`` (random mask, kept weights scaled by ``1 / (1 - p)``)
        or ``set_dropout(mask, scale[, scale_inv])`` (``P * mask * scale``); ``None`` removes it."""
        if len(args) == 1 and args[0] is None:
            self.dropout = None
        elif args and isinstance(args[0], torch.Tensor):
            self.dropout = self._mask_dropout(*args)
        elif len(args) == 3:
            p = _scalar("set_dropout", "probability", args[0])
            if not 0.0 <= p < 1.0:
                raise ValueError(f"set_dropout: probability must be in [0, 1), got {args[0]!r}")
            seed = _scalar("set_dropout", "seed", args[1], integer=True)
            offset = _scalar("set_dropout", "offset", args[2], integer=True)
            self.dropout = ("philox", p, seed, offset)
        else:
            raise TypeError(f"set_dropout: expected (p, seed, offset) or (mask, scale[, scale_inv]), "
                            f"got {len(args)} arguments {args!r}")
        return self

    @staticmethod
    def _mask_dropout(mask, *rest):
        if len(rest) not in (1, 2):
            raise TypeError(f"set_dropout: the mask form takes (mask, scale[, scale_inv]), got "
                            f"{1 + len(rest)} arguments")
        if mask.dtype.is_complex:
            raise TypeError(f"set_dropout: mask must be a bool, integer or float tensor, got "
                            f"{mask.dtype}")
        scale = _scalar("set_dropout", "scale", rest[0])
        if len(rest) == 2:
            inv = _scalar("set_dropout", "scale_inv", rest[1])
            # The gradient is fixed by mask and scale; a mismatched scale_inv is a caller bug.
            if abs(scale * inv - 1.0) > 1e-2:
                raise ValueError(f"set_dropout: scale_inv must be 1 / scale, got scale={scale!r}, "
                                 f"scale_inv={inv!r}")
        return ("mask", mask, scale)

    def set_compute_data_type(self, dtype: torch.dtype | CudnnEnum) -> Self:
        """The compute type: ``torch.float32`` or ``cudnn.data_type.FLOAT`` only."""
        if isinstance(dtype, torch.dtype):
            if dtype != torch.float32:
                raise ValueError(f"set_compute_data_type: only torch.float32 is supported, got "
                                 f"{dtype}")
        elif type(dtype).__module__.startswith("cudnn") or type(dtype).__name__ == "data_type":
            import cudnn  # lazily: only a cudnn enum can bring us here

            if dtype != cudnn.data_type.FLOAT:
                raise ValueError(f"set_compute_data_type: only cudnn.data_type.FLOAT is "
                                 f"supported, got {dtype}")
        else:
            raise TypeError(f"set_compute_data_type: expected torch.float32 or "
                            f"cudnn.data_type.FLOAT, got {dtype!r}")
        self.compute_data_type = torch.float32
        return self

    def set_padding_mask(self, seq_len_q: bool | Lengths | None,
                         seq_len_kv: Lengths | None = None) -> Self:
        """Per-batch valid lengths (``[B]`` or ``[B, 1, 1, 1]`` integer tensors, or int
        sequences); rows ``i >= seq_len_q[b]`` see nothing, keys ``j >= seq_len_kv[b]`` are
        hidden. ``set_padding_mask(True)`` is cuDNN's form, the lengths then come from
        ``set_seq_len_q`` / ``set_seq_len_kv``. ``set_padding_mask(False)`` removes it."""
        if seq_len_q is False or seq_len_q is None:
            if seq_len_kv is not None:
                raise TypeError(f"set_padding_mask: got seq_len_kv={seq_len_kv!r} with "
                                f"seq_len_q={seq_len_q!r}")
            self.padding = None
            self.use_padding = False
            return self
        if seq_len_q is True and seq_len_kv is None:  # cuDNN's form: lengths from set_seq_len_*
            self.use_padding = True
            return self
        if seq_len_kv is None:
            raise TypeError("set_padding_mask: seq_len_kv is required with seq_len_q (cuDNN "
                            "needs both)")
        lens_q = _lengths("set_padding_mask", "seq_len_q", seq_len_q)
        lens_kv = _lengths("set_padding_mask", "seq_len_kv", seq_len_kv)
        if len(lens_q) != len(lens_kv):
            raise ValueError(f"set_padding_mask: seq_len_q and seq_len_kv need one entry per "
                             f"batch each, got {len(lens_q)} and {len(lens_kv)}")
        self.padding = (lens_q, lens_kv)
        return self

    def set_alibi_mask(self, value: bool) -> Self:
        """cuDNN's ALiBi: adds ``slope_h * (j - i)`` (the paper's slopes for ``H_q`` heads); cuDNN
        needs right bound 0 and top-left alignment with it, and so does this builder."""
        self.alibi = _flag("set_alibi_mask", value)
        return self

    def set_sink_token(self, sink_token: torch.Tensor) -> Self:
        """Attention sinks: one float logit per query head, ``[1, H_q, 1, 1]`` (or ``[H_q]``),
        joining every row's softmax with no value (``cudnn_attn.rewrites.sinks``)."""
        self.sink_token = checks.tensor("sink_token", sink_token, floating=True,
                                         prefix="set_sink_token: ")
        return self


class SdpaAttributes(ScoreModSetters, _Attributes):
    """Forward attributes (cuDNN ``SDPA_attributes``); every setter returns ``self``."""

    def __init__(self) -> None:
        super().__init__()
        self._init_score_mod()
        self.generate_stats = True

    def set_is_inference(self, value: bool) -> Self:
        """``True``: no stats (``stats`` is returned as ``None``)."""
        self.generate_stats = not _flag("set_is_inference", value)
        return self

    def set_generate_stats(self, value: bool) -> Self:
        """cuDNN's newer spelling: the opposite of ``set_is_inference``."""
        self.generate_stats = _flag("set_generate_stats", value)
        return self

    def set_paged_attention_k_table(self, table: torch.Tensor) -> Self:
        """Paged K: ``k`` is then a container ``[num_blocks, H_k, page_size, D]`` and this
        int32/int64 ``[B, 1, pages, 1]`` (or ``[B, pages]``) table says which block holds each
        page of each sequence (forward only, as cuDNN; needs padding with ``seq_len_kv``)."""
        self.k_table = _page_table("set_paged_attention_k_table", table)
        return self

    def set_paged_attention_v_table(self, table: torch.Tensor) -> Self:
        """Paged V: as ``set_paged_attention_k_table``, for ``v``."""
        self.v_table = _page_table("set_paged_attention_v_table", table)
        return self

    def set_paged_attention_max_seq_len_kv(self, max_seq_len_kv: int | torch.Tensor) -> Self:
        """The logical key length of a paged call (default: pages x page size)."""
        self.max_seq_len_kv = _scalar("set_paged_attention_max_seq_len_kv", "max_seq_len_kv",
                                      max_seq_len_kv, integer=True)
        return self


class SdpaBackwardAttributes(ScoreModBackwardSetters, _Attributes):
    """Backward attributes (cuDNN ``SDPA_backward_attributes``); must describe the forward call."""

    def __init__(self) -> None:
        super().__init__()
        self._init_score_mod()
        self.deterministic = False
        self.dsink_token: torch.Tensor | None = None
        self.dbias: torch.Tensor | None = None

    def set_deterministic_algorithm(self, value: bool) -> Self:
        """Ask for a bitwise-repeatable backward (the torch engine always is)."""
        self.deterministic = _flag("set_deterministic_algorithm", value)
        return self

    def set_dbias(self, dbias: torch.Tensor) -> Self:
        """The bias's gradient is written into this tensor (the bias's shape; cuDNN's dBias
        output); needs ``set_bias``."""
        self.dbias = checks.tensor("dbias", dbias, floating=True, prefix="set_dbias: ")
        return self

    def set_dSink_token(self, dsink_token: torch.Tensor) -> Self:
        """The sinks' gradient is written into this float32 ``[1, H_q, 1, 1]`` tensor (cuDNN's
        output); needs ``set_sink_token``."""
        self.dsink_token = checks.tensor("dSink_token", dsink_token,
                                          dtypes=(torch.float32, torch.float64),
                                          prefix="set_dSink_token: ")
        return self
