"""The cuDNN frontend's SDPA attribute builder, in Python, on every engine.

``SdpaAttributes`` / ``SdpaBackwardAttributes`` mirror cuDNN's ``SDPA_attributes`` /
``SDPA_backward_attributes``: chainable setters, then ``scaled_dot_product_flash_attention(q, k, v,
attrs) -> (o, stats)`` and ``scaled_dot_product_flash_attention_backward(q, k, v, o, dO, stats,
attrs) -> (dQ, dK, dV)``. Tensors are cuDNN's logical ``[B, H, S, D]`` (any strides). The
attributes translate into the unified problem (``Causal``, ``SlidingWindow``, ``Padding``,
``Alibi``) and run through the dispatcher, so the CPU (torch engine) runs them too.

Conventions (where cuDNN leaves a choice or this library differs):

* ``attn_scale`` unset means **1.0** (cuDNN: "Default is None (no scaling)"), not ``D ** -0.5``.
* Stats are generated unless ``set_is_inference(True)`` / ``set_generate_stats(False)``.
  ``stats`` is ``[B, H, S_q, 1]``, natural-log LSE of the masked scores, float32 (float64 for
  float64 inputs, which only the torch engine takes). A query row that sees no key (padding)
  gets ``o = 0`` and ``stats = -inf``.
* ``set_causal_mask`` and ``set_causal_mask_bottom_right`` both set the one diagonal alignment, as
  in cuDNN: the last ``True`` wins. ``set_sliding_window(left, right)`` is FlashAttention's
  inclusive window ``i' - left <= j <= i' + right`` (``-1``: unbounded), ``i'`` aligned like the
  causal mask (bottom-right when it is) unless ``alignment=`` says otherwise. cuDNN's exclusive left
  bound is ``left + 1``: see ``diagonal_band_bounds()``. Causal and window masks combine as an AND
  (cuDNN instead lets an explicit right bound > 0 override causal's bound of 0).
* ``set_alibi_mask(True)``: the ALiBi paper's slopes for ``H_q`` heads, aligned like the causal /
  window mask. With a bias tensor too, ALiBi is materialised and added to the bias.
* ``set_dropout(p, seed, offset)``: a generator derived from ``(seed, offset)`` draws the mask, so
  the same pair gives the same mask in forward and backward (the backward re-runs the forward's
  draw). The mask is this library's, not the bits cuDNN's Philox would draw for that pair.
* ``set_dropout(mask, scale[, scale_inv])``: ``o = (P * mask * scale) @ V`` with ``mask``
  broadcastable to ``[B, H, S_q, S_kv]``. The unified API cannot express an explicit mask, so this
  form runs densely in torch ops (memory O(B * H * S_q * S_kv)) on the inputs' device.
  ``scale_inv`` must equal ``1 / scale``.
* ``set_compute_data_type`` takes ``torch.float32`` or ``cudnn.data_type.FLOAT`` (every engine
  computes in float32; float64 inputs stay float64 on the torch engine).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import operator

import torch

from ... import dispatch
from ...torch_engine.tiles import Visibility
from ...masks import Alibi, Causal, Padding, SlidingWindow, mask_parts
from ...problem import AttnProblem
from ...runtime import DropoutState, Inputs

__all__ = ["SdpaAttributes", "SdpaBackwardAttributes", "scaled_dot_product_flash_attention",
           "scaled_dot_product_flash_attention_backward"]

_ALIGNMENTS = ("top_left", "bottom_right")


def _flag(setter: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{setter}: expected a bool, got {value!r}")
    return value


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
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{setter}: {what} must be {'an int' if integer else 'a real number'}, "
                        f"got {value!r}")
    if integer:
        return int(value)
    if not math.isfinite(value):
        raise ValueError(f"{setter}: {what} must be finite, got {value!r}")
    return float(value)


def _lengths(setter: str, what: str, value) -> tuple[int, ...]:
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{setter}: {what} must be an integer tensor, got {value.dtype}")
        if value.dim() not in (1, 4) or (value.dim() == 4 and value.shape[1:] != (1, 1, 1)):
            raise ValueError(f"{setter}: {what} must have shape [B] or [B, 1, 1, 1], got "
                             f"{tuple(value.shape)}")
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


def _check_broadcast(what: str, t: torch.Tensor, full: tuple) -> None:
    ok = t.dim() <= 4 and all(a in (1, b) for a, b in zip(reversed(t.shape), reversed(full)))
    if not ok:
        raise ValueError(f"{what} of shape {tuple(t.shape)} does not broadcast to "
                         f"[B, H, S_q, S_kv] = {list(full)}")


class _Attributes:
    """Setters shared by the forward and backward attributes (see the module doc)."""

    def __init__(self):
        self.name = ""
        self.causal: str | None = None          # None | "top_left" | "bottom_right"
        self.window: tuple | None = None         # (left, right, alignment or None)
        self.bias: torch.Tensor | None = None
        self.attn_scale = 1.0                       # cuDNN: unset means no scaling
        self.dropout: tuple | None = None        # ("philox", p, seed, offset) | ("mask", m, s)
        self.compute_data_type = torch.float32
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

    def set_name(self, name):
        """An operation name (kept for ``repr`` and logs)."""
        if not isinstance(name, str):
            raise TypeError(f"set_name: expected a str, got {name!r}")
        self.name = name
        return self

    def set_causal_mask(self, value):
        """Top-left causal: key ``j`` visible from query ``i`` iff ``j <= i``."""
        if _flag("set_causal_mask", value):
            self.causal = "top_left"
        elif self.causal == "top_left":
            self.causal = None
        return self

    def set_causal_mask_bottom_right(self, value):
        """Bottom-right causal: ``j <= i + S_kv - S_q`` (per batch with padding)."""
        if _flag("set_causal_mask_bottom_right", value):
            self.causal = "bottom_right"
        elif self.causal == "bottom_right":
            self.causal = None
        return self

    def set_sliding_window(self, left, right, alignment=None):
        """FlashAttention's inclusive window ``i' - left <= j <= i' + right``; ``-1`` leaves a
        side unbounded, ``(-1, -1)`` removes the window. ``alignment`` (``"top_left"`` /
        ``"bottom_right"``) defaults to the causal mask's alignment, top-left without one."""
        for what, n in (("left", left), ("right", right)):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral):
                raise TypeError(f"set_sliding_window: {what} must be an int, got {n!r}")
            if n < -1:
                raise ValueError(f"set_sliding_window: {what} must be >= -1 (-1: unbounded), "
                                 f"got {n!r}")
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

    def set_bias(self, bias):
        """Additive bias broadcastable to ``[B, H_q, S_q, S_kv]`` (``None`` removes it)."""
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(f"set_bias: expected a tensor or None, got {type(bias).__name__}")
        if bias is not None and not bias.dtype.is_floating_point:
            raise TypeError(f"set_bias: bias must be a float tensor, got {bias.dtype}")
        self.bias = bias
        return self

    def set_attn_scale(self, scale):
        """Scores are ``scale * q . k`` (a float or a 1-element tensor; unset: 1.0)."""
        self.attn_scale = _scalar("set_attn_scale", "attn_scale", scale)
        return self

    def set_dropout(self, *args):
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

    def set_compute_data_type(self, dtype):
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

    def set_padding_mask(self, seq_len_q, seq_len_kv=None):
        """Per-batch valid lengths (``[B]`` or ``[B, 1, 1, 1]`` integer tensors, or int
        sequences); rows ``i >= seq_len_q[b]`` see nothing, keys ``j >= seq_len_kv[b]`` are
        hidden. ``set_padding_mask(False)`` removes it."""
        if seq_len_q is False or seq_len_q is None:
            if seq_len_kv is not None:
                raise TypeError(f"set_padding_mask: got seq_len_kv={seq_len_kv!r} with "
                                f"seq_len_q={seq_len_q!r}")
            self.padding = None
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

    def set_alibi_mask(self, value):
        """ALiBi: adds ``-slope_h * |i' - j|`` with the paper's slopes for ``H_q`` heads."""
        self.alibi = _flag("set_alibi_mask", value)
        return self


class SdpaAttributes(_Attributes):
    """Forward attributes (cuDNN ``SDPA_attributes``); every setter returns ``self``."""

    def __init__(self):
        super().__init__()
        self.generate_stats = True

    def set_is_inference(self, value):
        """``True``: no stats (``stats`` is returned as ``None``)."""
        self.generate_stats = not _flag("set_is_inference", value)
        return self

    def set_generate_stats(self, value):
        """cuDNN's newer spelling: the opposite of ``set_is_inference``."""
        self.generate_stats = _flag("set_generate_stats", value)
        return self


class SdpaBackwardAttributes(_Attributes):
    """Backward attributes (cuDNN ``SDPA_backward_attributes``); must describe the forward call."""

    def __init__(self):
        super().__init__()
        self.deterministic = False

    def set_deterministic_algorithm(self, value):
        """Ask for a bitwise-repeatable backward (the torch engine always is)."""
        self.deterministic = _flag("set_deterministic_algorithm", value)
        return self


# ---------------------------------------------------------------------------------------------
# Translation into the unified problem
# ---------------------------------------------------------------------------------------------

def _mask_of(attrs: _Attributes, batch: int, seq_q: int, seq_kv: int):
    parts = []
    if attrs.causal is not None:
        parts.append(Causal(attrs.causal))
    if attrs.window is not None:
        left, right, alignment = attrs.window
        parts.append(SlidingWindow(left, right, alignment or attrs.causal or "top_left"))
    if attrs.padding is not None:
        lens_q, lens_kv = attrs.padding
        if len(lens_q) != batch:
            raise ValueError(f"set_padding_mask: seq_len_q has {len(lens_q)} entries, q has "
                             f"batch {batch}")
        if max(lens_q) > seq_q or max(lens_kv) > seq_kv:
            raise ValueError(f"set_padding_mask: lengths exceed the tensors: seq_len_q={lens_q} "
                             f"(S_q={seq_q}), seq_len_kv={lens_kv} (S_kv={seq_kv})")
        parts.append(Padding(lens_q, lens_kv))
    return functools.reduce(operator.and_, parts) if parts else None


def _alignment(mask) -> str:
    lines = [m.alignment for m in mask_parts(mask) if isinstance(m, (Causal, SlidingWindow))]
    return lines[0] if lines else "top_left"


def _alibi_dense(mask, B, H, Sq, Skv, device, dtype) -> torch.Tensor:
    """ALiBi as a ``[1|B, H, S_q, S_kv]`` tensor, aligned as the engine aligns it."""
    slopes = Alibi().slope_table(B, H).to(device, dtype).view(1, H, 1, 1)
    parts = mask_parts(mask)
    padding = next((m for m in parts if isinstance(m, Padding)), None)
    offset = Visibility(parts, Sq, Skv).offset(_alignment(mask), device, padding)
    i = torch.arange(Sq, device=device)[:, None] + offset
    dist = (i - torch.arange(Skv, device=device)).abs().to(dtype)
    return -slopes * (dist if dist.dim() == 4 else dist[None, None])


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _translate(attrs: _Attributes, q, k):
    """``(mask, bias)`` for the call; ``bias`` is a tensor, an ``Alibi`` or ``None``."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D [B, H, S, D] tensor, got {tuple(t.shape)}")
    B, H, Sq, Skv = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = _mask_of(attrs, B, Sq, Skv)
    bias = attrs.bias
    if bias is not None:
        if bias.device != q.device:
            raise ValueError(f"set_bias: bias must be on q's device {q.device}, got {bias.device}")
        _check_broadcast("set_bias: bias", bias, (B, H, Sq, Skv))
        bias = bias.detach()
    if attrs.alibi:
        if bias is None:
            return mask, Alibi()
        # The unified problem takes a tensor bias or ALiBi: fold ALiBi into the tensor.
        bias = bias.to(_compute_dtype(q.dtype)) + _alibi_dense(mask, B, H, Sq, Skv, q.device,
                                                              _compute_dtype(q.dtype))
    return mask, bias


def _problem(attrs, q, k, v, need_stats):
    mask, bias = _translate(attrs, q, k)
    dropout_p, dropout = 0.0, None
    if attrs.dropout is not None and attrs.dropout[0] == "philox" and attrs.dropout[1] > 0:
        dropout_p, dropout = attrs.dropout[1], DropoutState(*attrs.dropout[2:])
    problem = AttnProblem.from_tensors(q, k, v, mask=mask, bias=bias, scale=attrs.attn_scale,
                                       dropout_p=dropout_p, layout="bhsd", return_lse=need_stats)
    if getattr(attrs, "deterministic", False):
        # A deterministic backward is a different plan (plan_key includes the flag).
        problem = dataclasses.replace(problem, deterministic=True)
    plan = dispatch.plan_for(problem)[1]
    tensor_bias = bias if isinstance(bias, torch.Tensor) else None
    return problem, plan, Inputs(q, k, v, tensor_bias, dropout)


def _check_attrs(attrs, cls, fn):
    if not isinstance(attrs, cls):
        raise TypeError(f"{fn}: attrs must be {cls.__name__}, got {type(attrs).__name__}")


def scaled_dot_product_flash_attention(q, k, v, attrs: SdpaAttributes):
    """``(o, stats)`` of SDPA with the attributes ``attrs`` (cuDNN's forward).

    ``q`` ``[B, H_q, S_q, D_qk]``, ``k`` ``[B, H_kv, S_kv, D_qk]``, ``v`` ``[B, H_kv, S_kv, D_v]``
    (any strides; ``H_q % H_kv == 0``). ``o`` is ``[B, H_q, S_q, D_v]`` in q's dtype, ``stats``
    ``[B, H_q, S_q, 1]`` float32 (float64 for float64 inputs) or ``None`` for inference.

    Equivalent PyTorch (no GQA; ``visible`` the causal/window/padding mask)::

        s = attn_scale * q @ k.transpose(-1, -2) + bias          # + ALiBi
        s = s.masked_fill(~visible, float("-inf"))
        stats = s.logsumexp(-1, keepdim=True)
        o = (torch.softmax(s, -1) * keep * dropout_scale) @ v
    """
    _check_attrs(attrs, SdpaAttributes, "scaled_dot_product_flash_attention")
    q, k, v = (t.detach() if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    need = attrs.generate_stats
    if attrs.dropout is not None and attrs.dropout[0] == "mask":
        problem, bias = _dense_problem(attrs, q, k, v)
        o, lse = _dense_forward(problem, attrs, q, k, v, bias)
    else:
        problem, plan, inputs = _problem(attrs, q, k, v, need)
        o, lse = plan.forward(problem, inputs, need_lse=need)
    return o, (lse.unsqueeze(-1) if need else None)


def scaled_dot_product_flash_attention_backward(q, k, v, o, dO, stats,
                                                attrs: SdpaBackwardAttributes):
    """``(dQ, dK, dV)`` from the forward's ``o`` and ``stats`` (cuDNN's backward).

    ``attrs`` must describe the forward call (same masks, bias, scale and dropout); the gradients
    have the shapes and dtype of ``q``, ``k``, ``v``. ``stats`` is ``[B, H_q, S_q, 1]`` (or
    ``[B, H_q, S_q]``). Equivalent PyTorch: ``torch.autograd.grad(o, (q, k, v), dO)`` through the
    forward's formula with the same dropout mask.
    """
    fn = "scaled_dot_product_flash_attention_backward"
    _check_attrs(attrs, SdpaBackwardAttributes, fn)
    q, k, v, o, dO, stats = (t.detach() if isinstance(t, torch.Tensor) else t
                             for t in (q, k, v, o, dO, stats))
    _check_backward_inputs(q, v, o, dO, stats)
    lse = stats.reshape(stats.shape[:3])
    if attrs.dropout is not None and attrs.dropout[0] == "mask":
        problem, bias = _dense_problem(attrs, q, k, v)
        return _dense_backward(problem, attrs, q, k, v, bias, o, dO, lse)
    problem, plan, inputs = _problem(attrs, q, k, v, True)
    dq, dk, dv, _ = plan.backward(problem, inputs, o, lse, dO)
    return dq, dk, dv


def _check_backward_inputs(q, v, o, dO, stats):
    for name, t in (("o", o), ("dO", dO), ("stats", stats)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(q, torch.Tensor) or not isinstance(v, torch.Tensor) \
            or q.dim() != 4 or v.dim() != 4:
        raise ValueError("q and v must be 4-D [B, H, S, D] tensors")
    want_o = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    for name, t in (("o", o), ("dO", dO)):
        if tuple(t.shape) != want_o:
            raise ValueError(f"{name} must have shape [B, H_q, S_q, D_v] = {list(want_o)}, got "
                             f"{tuple(t.shape)}")
    if tuple(stats.shape) not in (want_o[:3] + (1,), want_o[:3]) \
            or not stats.dtype.is_floating_point:
        raise ValueError(f"stats must be a float tensor of shape [B, H_q, S_q, 1] = "
                         f"{list(want_o[:3]) + [1]}, got {stats.dtype} {tuple(stats.shape)}")


# ---------------------------------------------------------------------------------------------
# The explicit-mask dropout form: dense torch ops (the unified problem has no explicit mask)
# ---------------------------------------------------------------------------------------------

def _dense_problem(attrs, q, k, v):
    """Validate as the engine path does (no dropout in the problem) and fold ALiBi into a bias."""
    mask, bias = _translate(attrs, q, k)
    problem = AttnProblem.from_tensors(q, k, v, mask=mask, bias=bias, scale=attrs.attn_scale,
                                       layout="bhsd")
    if isinstance(bias, Alibi):
        bias = _alibi_dense(mask, problem.batch, problem.heads_q, problem.seq_q, problem.seq_kv,
                            q.device, _compute_dtype(q.dtype))
    keep = attrs.dropout[1]
    if keep.device != q.device:
        raise ValueError(f"set_dropout: mask must be on q's device {q.device}, got {keep.device}")
    _check_broadcast("set_dropout: mask", keep, (problem.batch, problem.heads_q, problem.seq_q,
                                                  problem.seq_kv))
    return problem, bias


def _dense_scores(problem, attrs, q, k, bias):
    """Masked scores ``[B, H_q, S_q, S_kv]`` (``-inf`` where hidden) and the expanded keys."""
    ct = _compute_dtype(q.dtype)
    kx = k.to(ct).repeat_interleave(problem.group_size, dim=1)
    s = attrs.attn_scale * torch.matmul(q.to(ct), kx.transpose(-1, -2))
    if bias is not None:
        s = s + bias.to(ct)
    parts = mask_parts(problem.mask)
    if parts:
        vis = Visibility(parts, problem.seq_q, problem.seq_kv)
        qi = torch.arange(problem.seq_q, device=q.device)[:, None]
        kj = torch.arange(problem.seq_kv, device=q.device)[None, :]
        visible = None
        for part in (vis.lines(qi, kj, problem.padding), vis.padded(qi, kj, problem.padding)):
            if part is not None:
                visible = part if visible is None else visible & part
        if visible is not None:
            s = s.masked_fill(~(visible if visible.dim() == 4 else visible[None, None]),
                              -math.inf)
    return s.expand(problem.batch, problem.heads_q, problem.seq_q, problem.seq_kv), kx


def _probs(s, lse):
    """``exp(s - lse)``; rows with ``lse = -inf`` (no visible key) are exactly 0."""
    return torch.exp(s - lse.masked_fill(lse == -math.inf, 0.0)[..., None])


def _keep(attrs, dtype):
    return attrs.dropout[1].to(dtype) * attrs.dropout[2]


def _group_sum(x, problem):
    B, _, S, D = x.shape
    return x.view(B, problem.heads_kv, problem.group_size, S, D).sum(2)


def _dense_forward(problem, attrs, q, k, v, bias):
    s, _ = _dense_scores(problem, attrs, q, k, bias)
    lse = s.logsumexp(-1)
    vx = v.to(s.dtype).repeat_interleave(problem.group_size, dim=1)
    o = torch.matmul(_probs(s, lse) * _keep(attrs, s.dtype), vx)
    return o.to(q.dtype), lse.to(_compute_dtype(q.dtype))


def _dense_backward(problem, attrs, q, k, v, bias, o, dO, lse):
    s, kx = _dense_scores(problem, attrs, q, k, bias)
    ct = s.dtype
    p = _probs(s, lse.to(ct))
    keep = _keep(attrs, ct)
    vx = v.to(ct).repeat_interleave(problem.group_size, dim=1)
    do, qc = dO.to(ct), q.to(ct)
    dv = torch.matmul((p * keep).transpose(-1, -2), do)
    dp = torch.matmul(do, vx.transpose(-1, -2)) * keep
    # delta = rowsum(dO * o) = rowsum(P * dP) because o = (P * keep) @ V.
    ds = p * (dp - (do * o.to(ct)).sum(-1, keepdim=True))
    dq = attrs.attn_scale * torch.matmul(ds, kx)
    dk = attrs.attn_scale * torch.matmul(ds.transpose(-1, -2), qc)
    return (dq.to(q.dtype), _group_sum(dk, problem).to(k.dtype),
            _group_sum(dv, problem).to(v.dtype))
