"""The argument validators every surface uses: one family, one wording.

Each raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for a value of the right
kind out of range, naming the argument and the value. ``prefix`` (e.g. ``"na2d_qk_forward: "``)
lets an op layer say which op complained. Never ``assert`` on user input.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Optional, Sequence

import torch

__all__ = ["FLOAT_DTYPES", "INDEX_DTYPES", "tensor", "index_tensor", "like", "shape", "integer",
           "flag", "boolean", "real", "per_axis", "softmax_scale", "dense", "fits_scores"]

FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def tensor(name: str, t, *, ndim: Optional[int] = None, what: str = "", floating: bool = False,
           dtypes: Optional[Sequence[torch.dtype]] = None, prefix: str = "") -> torch.Tensor:
    """``t`` is a tensor (of ``ndim`` dims, described by ``what``; a float dtype if ``floating``;
    one of ``dtypes`` when given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{prefix}{name} must be a torch.Tensor, got {type(t).__name__}")
    dense(name, t, prefix)
    if floating and t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{prefix}{name} must be float64, float32, float16 or bfloat16, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{prefix}{name} has dtype {t.dtype}; supported: {names}")
    if ndim is not None and t.dim() != ndim:
        layout = f" {what}" if what else ""
        raise ValueError(f"{prefix}{name} must be {ndim}-D{layout}, got shape {tuple(t.shape)}")
    return t


def dense(name: str, t: torch.Tensor, prefix: str = "") -> torch.Tensor:
    """``t`` is a dense (strided, not nested) tensor: sparse, mkldnn and nested tensors have no
    strides to read, and torch's own error about them names no argument."""
    if t.is_nested:
        raise TypeError(f"{prefix}{name} must be a dense tensor, got a nested tensor")
    if t.layout != torch.strided:
        raise TypeError(f"{prefix}{name} must be a dense (torch.strided) tensor, got layout "
                        f"{t.layout}")
    return t


def index_tensor(name: str, t, *, ndim: int, device: torch.device, device_name: str = "",
                 prefix: str = "") -> torch.Tensor:
    """An int32/int64 tensor of ``ndim`` dims on ``device`` (called ``device_name``) or the CPU."""
    tensor(name, t, prefix=prefix)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{prefix}{name} must be int32 or int64, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{prefix}{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.device != device and t.device.type != "cpu":
        where = f"{device_name} {device}" if device_name else str(device)
        raise ValueError(f"{prefix}{name} must be on {where} (or the CPU), got {t.device}")
    return t


def shape(name: str, t: torch.Tensor, expected: Sequence[int], what: str = "",
          prefix: str = "") -> torch.Tensor:
    """``t`` has exactly ``expected`` as its shape (``what`` names the layout in the message)."""
    if tuple(t.shape) != tuple(expected):
        label = f"{what} = " if what else ""
        raise ValueError(f"{prefix}{name} must have shape {label}{tuple(expected)}, got "
                         f"{tuple(t.shape)}")
    return t


def like(name: str, t, ref: torch.Tensor, ref_name: str, *, expected: Optional[Sequence[int]] = None,
         what: str = "", any_float: bool = False, prefix: str = "") -> torch.Tensor:
    """``t`` is a tensor with ``ref``'s dtype (any float dtype with ``any_float``) and device,
    and the shape ``expected`` when given."""
    tensor(name, t, prefix=prefix)
    if expected is not None:
        shape(name, t, expected, what, prefix)
    if any_float:
        if not t.dtype.is_floating_point:
            raise TypeError(f"{prefix}{name} must be a float tensor, got {t.dtype}")
    elif t.dtype != ref.dtype:
        raise TypeError(f"{prefix}{name} has dtype {t.dtype}, but {ref_name} has {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{prefix}{name} is on {t.device}, but {ref_name} is on {ref.device}")
    return t


# Sequence lengths, window sizes and positions are int32 in every engine (cuDNN's attributes,
# the kernels' tables); a larger value is a mistake to report, not an overflow to crash on.
MAX_POSITION = 2 ** 31 - 1


def integer(name: str, value, minimum: Optional[int] = None, *, maximum: Optional[int] = None,
            tensors: bool = False, prefix: str = "") -> int:
    """A Python int (a 0-d integer tensor too with ``tensors``) in ``[minimum, maximum]``."""
    if tensors and isinstance(value, torch.Tensor) and value.dim() == 0 \
            and value.dtype in INDEX_DTYPES:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{prefix}{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{prefix}{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{prefix}{name} must be <= {maximum}, got {value!r}")
    return int(value)


def flag(name: str, value, prefix: str = "") -> bool:
    """Strictly a ``bool``."""
    if not isinstance(value, bool):
        raise TypeError(f"{prefix}{name} must be a bool, got {value!r}")
    return value


def boolean(name: str, value, prefix: str = "") -> bool:
    """A ``bool`` or the ints 0/1 (NATTEN's per-axis flags accept both)."""
    if not isinstance(value, (bool, int)) or value not in (0, 1):
        raise TypeError(f"{prefix}{name} must be a bool or a tuple of bools, got {value!r}")
    return bool(value)


def real(name: str, value, *, ok: Callable[[float], bool] = lambda x: True, bound: str = "",
         error: type = ValueError, prefix: str = "") -> float:
    """A finite real number (not a bool) for which ``ok`` holds; ``bound`` words the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not ok(value):
        raise error(f"{prefix}{name} must be a finite number{bound}, got {value!r}")
    return float(value)


def per_axis(name: str, value, ndim: int, cast: Callable, prefix: str = "") -> tuple:
    """A scalar repeated on every axis, or a tuple/list of exactly ``ndim`` entries; each entry
    goes through ``cast(name, entry)``."""
    if isinstance(value, (tuple, list)):
        if len(value) != ndim:
            raise ValueError(f"{prefix}{name} must have {ndim} entries (one per axis), got {value!r}")
        return tuple(cast(name, v) for v in value)
    return (cast(name, value),) * ndim


def default_scale(head_dim: int) -> float:
    """The softmax scale of a call that gives none: ``head_dim ** -0.5`` (every peer's)."""
    return head_dim ** -0.5


def softmax_scale(name: str, value, head_dim: int, *, error: type = ValueError,
                  prefix: str = "") -> float:
    """``default_scale(head_dim)`` for ``None``, else a finite number."""
    if head_dim < 1:
        raise ValueError(f"{prefix}the head dim (the last axis of the query) must be >= 1, got "
                         f"{head_dim}")
    if value is None:
        return default_scale(head_dim)
    return real(name, value, error=error, prefix=prefix)


_FLOAT32 = torch.finfo(torch.float32)


def fits_scores(name: str, value: float, dtype: torch.dtype, *, smallest: bool = False,
                prefix: str = "") -> float:
    """``value`` (a scale or softcap) held in the dtype scores are computed in: float32 for every
    input dtype but float64 (cuDNN, FlashAttention and torch SDPA hold it in a C float too).
    Outside float32's range it becomes inf (or, with ``smallest``, 0) and every score NaN, which
    no peer reports; here it is an error."""
    if dtype == torch.float64 or value == 0:
        return value
    low = _FLOAT32.tiny if smallest else 0.0
    if not low <= abs(value) <= _FLOAT32.max:
        bound = f"in [{low:.3g}, {_FLOAT32.max:.3g}]" if smallest else f"<= {_FLOAT32.max:.3g}"
        raise ValueError(f"{prefix}{name}={value!r} does not fit float32, the dtype scores of "
                         f"{dtype} inputs are computed in: |{name}| must be {bound}")
    return value
