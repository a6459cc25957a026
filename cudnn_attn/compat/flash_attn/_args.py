"""Argument checks and small result helpers shared by FlashAttention's entry points.

Validators come from ``cudnn_attn.model.checks`` (one wording: the argument's name and the value).
FlashAttention reports bad input as ``RuntimeError`` (``TORCH_CHECK``); every entry point here is
wrapped by :func:`runtime_errors`, so its ``ValueError``/``TypeError`` are also ``RuntimeError``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from ...model import checks
from ...model.masks import Alibi
from ...model.problem import accumulator_dtype
from ...model.inputs import DropoutState

__all__ = ["FlashAttnValueError", "FlashAttnTypeError", "runtime_errors", "Options", "like",
           "generator_arg", "same_dtype", "alibi_arg", "philox_state", "seed_tensors", "into", "softmax_d_of",
           "dense_qkv", "flag"]

flag = checks.flag


class FlashAttnValueError(ValueError, RuntimeError):
    """A bad value: our ``ValueError``, and the ``RuntimeError`` FlashAttention raises."""


class FlashAttnTypeError(TypeError, RuntimeError):
    """A value of the wrong kind: our ``TypeError``, and FlashAttention's ``RuntimeError``."""


P = ParamSpec("P")
R = TypeVar("R")


def runtime_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Re-raise ``fn``'s ``ValueError``/``TypeError`` as the subclasses that are also
    ``RuntimeError`` (same message), so code written for FlashAttention catches them. Typed so
    that the decorated function keeps its signature for type checkers."""
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except RuntimeError:
            raise
        except ValueError as e:
            raise FlashAttnValueError(*e.args).with_traceback(e.__traceback__) from None
        except TypeError as e:
            raise FlashAttnTypeError(*e.args).with_traceback(e.__traceback__) from None
    return wrapper


def _window(name: str, value) -> int:
    """A window size: an int or a 0-d integer tensor, negative = unbounded (normalized to -1)."""
    return max(checks.integer(name, value, tensors=True), -1)


@dataclasses.dataclass(frozen=True)
class Options:
    """The scalar arguments every ``mha_*`` takes, validated."""

    p_dropout: float
    scale: float
    causal: bool
    left: int
    right: int
    softcap: float | None

    @staticmethod
    def of(head_size, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right,
           softcap) -> Options:
        scale = checks.default_scale(head_size) if softmax_scale is None else \
            checks.real("softmax_scale", softmax_scale)
        p = checks.real("p_dropout", p_dropout, ok=lambda x: 0 <= x < 1, bound=" in [0, 1)")
        return Options(p, scale,
                        checks.flag("is_causal", is_causal),
                        _window("window_size_left", window_size_left),
                        _window("window_size_right", window_size_right),
                        checks.real("softcap", softcap, ok=lambda x: x >= 0, bound=" >= 0") or None)


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Some element of ``t`` is reachable by two indices (an expanded tensor, a stride-0 view):
    dims ordered by stride, each stride must step past everything the smaller ones span."""
    span = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride < span:
            return True
        span = stride * size
    return False


def like(name: str, t, shape: tuple, ref: torch.Tensor, *, optional=False, any_float=False):
    """``t`` is a tensor of ``shape`` on ``ref``'s (q's) device with q's dtype (any float dtype
    with ``any_float``); ``None`` passes when ``optional`` (an output buffer, which must not
    overlap itself: writing one value to two places is not a result)."""
    if t is None and optional:
        return None
    t = checks.like(name, t, ref, "q", expected=shape, any_float=any_float)
    if optional and t.numel() and _overlaps_itself(t):
        raise ValueError(f"{name} must not overlap itself (an expanded or stride-0 view), got "
                         f"shape {tuple(t.shape)} with strides {t.stride()}")
    return t


def generator_arg(gen_):
    if gen_ is not None and not isinstance(gen_, torch.Generator):
        raise TypeError(f"gen_ must be None or a torch.Generator, got {type(gen_).__name__}")
    return gen_


def same_dtype(q, k, v) -> None:
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, "
                        f"v={v.dtype}")


def alibi_arg(slopes, batch: int, heads: int, device):
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes_ must be None or a torch.Tensor, got "
                        f"{type(slopes).__name__}")
    if slopes.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"alibi_slopes_ must be float32 (or float64), got {slopes.dtype}")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes_ must have shape [{heads}] or [{batch}, {heads}] "
                         f"(num_heads or batch_size x num_heads), got {tuple(slopes.shape)}")
    if slopes.device != device and slopes.device.type != "cpu":
        raise ValueError(f"alibi_slopes_ must be on q's device {device}, got {slopes.device}")
    return Alibi(slopes.detach())


def _seed_arg(name: str, value) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a one-element integer tensor (as mha_fwd returns), "
                             f"got {value.dtype} of shape {tuple(value.shape)}")
        value = int(value.reshape(()).item())
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int64 tensor from mha_fwd, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (as mha_fwd returns), got {value}")
    return int(value)


def philox_state(philox_seed, philox_offset) -> DropoutState:
    """The dropout stream ``mha_fwd`` returned, as the engines' ``DropoutState``."""
    return DropoutState(_seed_arg("philox_seed", philox_seed),
                        _seed_arg("philox_offset", philox_offset))


def seed_tensors(dropout: DropoutState):
    """``(philox_seed, philox_offset)`` as 0-dim int64 host tensors (``scalar_tensor``: a third
    of ``torch.tensor``'s host time)."""
    return (torch.scalar_tensor(dropout.seed, dtype=torch.int64),
            torch.scalar_tensor(dropout.offset, dtype=torch.int64))


def into(buf, value: torch.Tensor) -> torch.Tensor:
    if buf is None:
        return value.contiguous()
    buf.copy_(value)
    return buf


def softmax_d_of(dout, out, dtype) -> torch.Tensor:
    """``rowsum(dout * out)`` in the lse dtype (float32; float64 for float64 inputs)."""
    dtype = accumulator_dtype(dtype)
    return (dout.to(dtype) * out.to(dtype)).sum(-1)


def dense_qkv(q, k, v):
    return (checks.tensor("q", q, ndim=4, what="[batch_size, seqlen_q, num_heads, head_size]"),
            checks.tensor("k", k, ndim=4, what="[batch_size, seqlen_k, num_heads_k, head_size]"),
            checks.tensor("v", v, ndim=4, what="[batch_size, seqlen_k, num_heads_k, head_size_v]"))
