"""What NATTEN's surfaces share: geometry from NATTEN arguments, the one rpb check, and the fused
neighborhood call (heads-last, optional rpb) translated into one ``cudnn_attn.attention`` call.
"""

from __future__ import annotations

import operator

import torch

from ... import _checks
from ...api import attention
from ...masks import Neighborhood, RelPosBias

__all__ = ["NattenValueError", "NattenNotImplementedError", "check_tensors", "check_rpb",
           "doc_fields", "geometry", "neighborhood_attention", "unfused_geometry"]


class NattenValueError(ValueError, TypeError):
    """An argument of the wrong kind: the ``ValueError`` NATTEN 0.21 raises, and our
    ``TypeError`` (code written for either catches it)."""


class NattenNotImplementedError(NotImplementedError, TypeError):
    """A tensor NATTEN 0.21 has no kernel for (an integer dtype, a sparse or mkldnn layout): its
    ``NotImplementedError``, and our ``TypeError``."""


def check_tensors(query, key, value, ndim: int, what: str) -> None:
    """NATTEN 0.21's checks of its fused entries' tensors, with its error types, each naming the
    argument: ``ndim``-D (laid out as ``what``) float tensors of one dtype and one device."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise NattenNotImplementedError(f"{name} must be a dense tensor (NATTEN supports no "
                                            f"{t.layout} tensors)")
        if t.dtype not in _checks.FLOAT_DTYPES:
            raise NattenNotImplementedError(
                f"{name} has dtype {t.dtype}: NATTEN has no backend for it (float64, float32, "
                f"float16 or bfloat16)")
    for name, t in (("key", key), ("value", value)):
        if t.device != query.device:
            raise ValueError(f"query, key and value must be on one device, got query on "
                             f"{query.device}, {name} on {t.device}")
        if t.dtype != query.dtype:
            raise NattenValueError(f"query, key and value must share a dtype, got query "
                                   f"{query.dtype}, {name} {t.dtype}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _checks.tensor(name, t, ndim=ndim, what=what)


def geometry(spatial, kernel_size, stride, dilation, is_causal) -> Neighborhood:
    """The ``Neighborhood`` of one call (it validates every rule, per-axis tuples). The spatial extent
    is made concrete with ``operator.index`` (which dynamo specialises, unlike ``int``): under
    ``torch.compile``'s dynamic shapes the mask is specialised to it, never a symbolic size."""
    try:
        return Neighborhood(tuple(operator.index(s) for s in spatial), kernel_size, stride,
                            dilation, is_causal)
    except TypeError as e:  # kernel_size=3.0, is_causal="yes": NATTEN says ValueError
        raise NattenValueError(*e.args).with_traceback(e.__traceback__) from None


def unfused_geometry(spatial, kernel_size, dilation, is_causal, prefix: str = "") -> Neighborhood:
    """Stride-1 neighborhoods with odd kernel sizes (NATTEN 0.17's unfused ops)."""
    nb = geometry(spatial, kernel_size, 1, dilation, is_causal)
    if any(k % 2 == 0 for k in nb.kernel_size):
        raise ValueError(f"{prefix}kernel_size must be odd for the unfused ops (NATTEN 0.17), got "
                         f"{kernel_size!r}")
    return nb


def check_rpb(rpb, heads: int, kernel, causal, ref: torch.Tensor, ref_name: str = "query", *,
              name: str = "rpb", same_dtype: bool = False, prefix: str = "") -> torch.Tensor:
    """NATTEN 0.17's relative positional bias ``[heads, 2*k-1 per axis]``: a float tensor on
    ``ref``'s device (of ``ref``'s dtype with ``same_dtype``), odd kernel sizes, no causal axis."""
    _checks.like(name, rpb, ref, ref_name, expected=(heads, *(2 * k - 1 for k in kernel)),
                 what="[heads, 2*kernel_size-1 per axis]", any_float=not same_dtype, prefix=prefix)
    if any(k % 2 == 0 for k in kernel):
        raise ValueError(f"{prefix}{name} needs odd kernel sizes (NATTEN 0.17), got "
                         f"kernel_size={tuple(kernel)}")
    if any(causal):
        raise ValueError(f"{prefix}{name} cannot be combined with causal masking, got "
                         f"is_causal={tuple(causal)}")
    return rpb


def neighborhood_attention(query, key, value, nb: Neighborhood, scale: float, rpb=None,
                           backend: str = "auto"):
    """Heads-last ``[B, *spatial, H(_kv), D]`` in (validated), ``([B, S, H, D_v], [B, S, H])`` out:
    one ``attention`` call with a ``Neighborhood`` mask (and a ``RelPosBias`` for ``rpb``)."""
    B, H, D = query.shape[0], query.shape[-2], query.shape[-1]
    S = nb.num_tokens
    out, lse = attention(query.reshape(B, S, H, D), key.reshape(B, S, *key.shape[-2:]),
                         value.reshape(B, S, *value.shape[-2:]), mask=nb,
                         bias=None if rpb is None else RelPosBias(rpb), scale=scale,
                         layout="bshd", return_lse=True, backend=backend)
    return out, lse.transpose(1, 2)


def doc_fields(rank: int) -> dict:
    """The per-rank words of the na{rank}d docstrings: axis names and the rpb table's shape."""
    axes = ("L", "X, Y", "X, Y, Z")[rank - 1]
    rpb = ", ".join(f"2k{a}-1" for a in range(rank)) if rank > 1 else "2k-1"
    return {"rank": rank, "axes": axes, "rpb": rpb}
