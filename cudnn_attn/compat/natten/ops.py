"""The libnatten op layer in Python: out-parameter ops with rank-sized tuples.

Every op writes its results into tensors the caller allocated and returns ``None``, as NATTEN's C++
ops (``libnatten``) do. Layouts follow libnatten: the fused op is heads-last, the unfused qk/av ops
are heads-first, and the unfused attention weights hold one slot per kernel position::

    na{n}d_forward      query/key/value/output  [B, *spatial, H, D]          (fused)
    na{n}d_qk_*         query/key               [B, H, *spatial, D]
                        attn                    [B, H, *spatial, prod(kernel_size)]
    na{n}d_av_*         attn as above, value/output [B, H, *spatial, D_v]

Slot ``(k0, k1, ...)`` of ``attn`` (row-major over the kernel dims) holds the key at
``window_start + (k0, k1, ...) * dilation`` with the window of the NATTEN rule; slots a causal window
does not fill are ``-inf`` after ``qk_forward`` and ignored (zero gradient) by the other ops.
``rpb`` is NATTEN 0.17's relative positional bias ``[H, 2*k0-1(, 2*k1-1(, 2*k2-1))]``, odd kernels
without causal masking only, added after scaling.

``kernel_size``, ``dilation``, ``is_causal`` and the tile sizes are tuples with one entry per
spatial axis, as libnatten's Python layer passes them; a plain int/bool applies to every axis.
Per axis ``kernel_size * dilation <= length``; the unfused ops take odd kernel sizes only
(NATTEN 0.17), the fused op any size >= 2.
On CUDA, when the cupy backend can run, the ops launch the package's RawKernels; elsewhere (CPU
included) they run the torch engine through :mod:`cudnn_attn.neighborhood`.

Equivalent PyTorch of ``na1d_qk_forward`` then ``na1d_av_forward`` (non-causal, no rpb)::

    idx = window_start[:, None] + torch.arange(k) * d        # [L, k] key index per slot
    attn[...] = torch.einsum("bhld,bhlkd->bhlk", q, k_[:, :, idx])
    out[...] = torch.einsum("bhlk,bhlkd->bhld", attn.softmax(-1), v[:, :, idx])
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers

import torch

from ..._probe import module_missing
from ...fallback_kernels.tiles import FUSED_DTYPES, check_tile_sizes, valid_tile_sizes
from ...masks import Neighborhood

__all__ = [f"na{n}d_{op}" for op in ("forward", "qk_forward", "qk_backward", "av_forward",
                                     "av_backward") for n in (1, 2, 3)] + ["valid_tile_sizes"]

UNFUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------


def _tensor(op: str, name: str, t, rank: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank + 3:
        raise ValueError(f"{op}: {name} must have {rank + 3} dims for a {rank}-D problem, got shape "
                         f"{tuple(t.shape)}")
    return t


def _like(op: str, name: str, t, shape, ref: torch.Tensor, ref_name: str) -> torch.Tensor:
    """Check ``t`` is a tensor of ``shape`` with ``ref``'s dtype and device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}, but {ref_name} has {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device}, but {ref_name} is on {ref.device}")
    return t


def _dtype(op: str, name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: "
                        f"{', '.join(str(d) for d in allowed)}")


def _geometry(op: str, spatial, kernel_size, dilation, is_causal, *, odd: bool = False):
    """Rank-sized (kernel, dilation, causal) tuples, checked against the spatial shape."""
    try:
        nb = Neighborhood(tuple(spatial), kernel_size, 1, dilation, is_causal)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{op}: {exc}") from None
    if odd and any(k % 2 == 0 for k in nb.kernel_size):  # NATTEN 0.17's unfused ops: odd only
        raise ValueError(f"{op}: kernel_size must be odd for the unfused ops, got {kernel_size!r}")
    return nb.kernel_size, nb.dilation, nb.is_causal


def _rpb_shape(heads: int, kernel) -> tuple[int, ...]:
    return (heads, *(2 * k - 1 for k in kernel))


def _check_rpb(op: str, name: str, rpb, heads: int, kernel, causal, ref: torch.Tensor, ref_name: str):
    _like(op, name, rpb, _rpb_shape(heads, kernel), ref, ref_name)
    if any(k % 2 == 0 for k in kernel):
        raise ValueError(f"{op}: {name} needs odd kernel sizes, got kernel_size={kernel}")
    if any(causal):
        raise ValueError(f"{op}: {name} cannot be combined with causal masking, got is_causal={causal}")


@functools.lru_cache(maxsize=None)
def _kernels_usable() -> bool:
    """True when the cupy backend reports no reason against itself (CuPy, CUDA, kernels)."""
    if module_missing("cupy", "cu12"):
        return False
    from ...dispatch import get_backend

    return not get_backend("cupy").availability()


def _use_kernels(t: torch.Tensor) -> bool:
    """The CuPy RawKernels serve CUDA tensors when they can run; the torch engine the rest."""
    return t.is_cuda and _kernels_usable()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _write(out: torch.Tensor, result: torch.Tensor) -> None:
    if result is not out:
        out.copy_(result)


def _neighborhood(rank: int, name: str):
    from . import functional as neighborhood  # deferred: the op layer must import without the engine's extras

    return getattr(neighborhood, f"na{rank}d{name}")


# ----------------------------------------------------------------------------------------------------
# One N-d implementation per op; the rank wrappers below only fix ``rank``.
# ----------------------------------------------------------------------------------------------------


def _forward(output, query, key, value, rpb, kernel_size, dilation, is_causal, attn_scale,
             query_tile_size, key_tile_size, *, rank):
    """Fused {rank}-D neighborhood attention, written into ``output``; returns None.

    ``query`` ``[B, *spatial, H, D]``, ``key`` ``[B, *spatial, H_kv, D]``, ``value``
    ``[B, *spatial, H_kv, D_v]`` (``H % H_kv == 0``), ``output`` ``[B, *spatial, H, D_v]``, all one
    dtype (float16, bfloat16, float32) and device. ``rpb`` ``[H, 2*k-1, ...]`` or None.
    ``attn_scale`` None means ``D ** -0.5``. ``query_tile_size``/``key_tile_size`` must be a pair
    from ``valid_tile_sizes({rank}, max(D, D_v), dtype)`` (ints mean the same size on every axis;
    both None lets the engine choose); another pair raises a ValueError listing the valid ones.

    Equivalent PyTorch (heads-first ``q, k, v`` and the dense NATTEN mask ``visible``)::

        s = (q @ k.transpose(-1, -2)) * attn_scale + rpb_bias
        output[...] = s.masked_fill(~visible, -inf).softmax(-1) @ v
    """
    op = f"na{rank}d_forward"
    for name, t in (("query", query), ("key", key), ("value", value)):
        _tensor(op, name, t, rank)
    _dtype(op, "query", query, FUSED_DTYPES)
    batch, *spatial, heads, dim = query.shape
    heads_kv = key.shape[-2]
    _like(op, "key", key, (batch, *spatial, heads_kv, dim), query, "query")
    dim_v = value.shape[-1]
    _like(op, "value", value, (batch, *spatial, heads_kv, dim_v), query, "query")
    if heads % heads_kv:
        raise ValueError(f"{op}: query heads ({heads}) must be a multiple of key heads ({heads_kv})")
    _like(op, "output", output, (batch, *spatial, heads, dim_v), query, "query")
    kernel, dil, causal = _geometry(op, spatial, kernel_size, dilation, is_causal)
    if rpb is not None:
        _check_rpb(op, "rpb", rpb, heads, kernel, causal, query, "query")
    if attn_scale is None:
        attn_scale = dim ** -0.5
    elif isinstance(attn_scale, bool) or not isinstance(attn_scale, numbers.Real):
        raise TypeError(f"{op}: attn_scale must be a float or None, got {attn_scale!r}")
    tiles = (None, None)
    if query_tile_size is not None or key_tile_size is not None or not valid_tile_sizes(
            rank, max(dim, dim_v), query.dtype):
        tiles = check_tile_sizes(rank, max(dim, dim_v), query.dtype, query_tile_size, key_tile_size)

    if _use_kernels(query):
        from ...fallback_kernels import fused

        out = output if output.stride(-1) == 1 else None
        result, _ = fused.na_forward(
            *map(_last_dim_contiguous, (query, key, value)), kernel_size=kernel, stride=(1,) * rank,
            dilation=dil, is_causal=causal, scale=float(attn_scale), rpb=rpb, query_tile=tiles[0],
            key_tile=tiles[1], out=out)
    else:
        with torch.no_grad():
            result = _neighborhood(rank, "")(query, key, value, kernel, stride=1, dilation=dil,
                                             is_causal=causal, scale=float(attn_scale), rpb=rpb)
    _write(output, result)


def _unfused_inputs(op, rank, query, key, kernel_size, dilation, is_causal):
    """Check heads-first query/key of one shape; return (geometry, attn shape)."""
    _tensor(op, "query", query, rank)
    _dtype(op, "query", query, UNFUSED_DTYPES)
    _like(op, "key", key, query.shape, query, "query")
    batch, heads, *spatial, _ = query.shape
    kernel, dil, causal = _geometry(op, spatial, kernel_size, dilation, is_causal, odd=True)
    return (kernel, dil, causal), (batch, heads, *spatial, math.prod(kernel))


def _attn_value(op, rank, attn, value, kernel_size, dilation, is_causal):
    """Check attn ``[B, H, *spatial, prod(k)]`` against value ``[B, H, *spatial, D_v]``."""
    _tensor(op, "value", value, rank)
    _dtype(op, "value", value, UNFUSED_DTYPES)
    batch, heads, *spatial, _ = value.shape
    geometry = _geometry(op, spatial, kernel_size, dilation, is_causal, odd=True)
    _like(op, "attn", attn, (batch, heads, *spatial, math.prod(geometry[0])), value, "value")
    return geometry


def _qk_forward(attn, query, key, rpb, kernel_size, dilation, is_causal, *, rank):
    """Unfused {rank}-D QK: ``attn[b, h, *i, slot] = <query[b, h, *i], key[b, h, *j(slot)]>
    (+ rpb)``, unscaled, invalid causal slots ``-inf``; written into ``attn``, returns None.

    ``query``/``key`` ``[B, H, *spatial, D]`` (float64/32/16, bfloat16), ``attn``
    ``[B, H, *spatial, prod(kernel_size)]``, ``rpb`` ``[H, 2*k-1, ...]`` or None.

    Equivalent PyTorch: ``attn[...] = (query[..., None, :] * key_neighbors).sum(-1) + rpb_bias``.
    """
    op = f"na{rank}d_qk_forward"
    (kernel, dil, causal), attn_shape = _unfused_inputs(op, rank, query, key, kernel_size, dilation,
                                                        is_causal)
    _like(op, "attn", attn, attn_shape, query, "query")
    if rpb is not None:
        _check_rpb(op, "rpb", rpb, query.shape[1], kernel, causal, query, "query")
    if _use_kernels(query):
        from ...fallback_kernels import unfused

        result = unfused.qk_forward(query.contiguous(), key.contiguous(),
                                    None if rpb is None else rpb.contiguous(), kernel, dil, causal,
                                    attn=attn)
    else:
        with torch.no_grad():
            result = _neighborhood(rank, "_qk")(query, key, kernel, dil, is_causal=causal, rpb=rpb)
    _write(attn, result)


def _qk_backward(d_query, d_key, d_rpb, d_attn, query, key, kernel_size, dilation, is_causal, *, rank):
    """Gradients of {rank}-D QK: writes ``d_query``, ``d_key`` and, unless it is None, ``d_rpb``
    (``[H, 2*k-1, ...]``) from ``d_attn``; returns None. Invalid causal slots get no gradient.

    Equivalent PyTorch: ``torch.autograd.grad(na{rank}d_qk(query, key, ...), (query, key, rpb),
    d_attn)``.
    """
    op = f"na{rank}d_qk_backward"
    (kernel, dil, causal), attn_shape = _unfused_inputs(op, rank, query, key, kernel_size, dilation,
                                                        is_causal)
    _like(op, "d_attn", d_attn, attn_shape, query, "query")
    _like(op, "d_query", d_query, query.shape, query, "query")
    _like(op, "d_key", d_key, key.shape, query, "query")
    if d_rpb is not None:
        _check_rpb(op, "d_rpb", d_rpb, query.shape[1], kernel, causal, query, "query")
    if _use_kernels(query):
        from ...fallback_kernels import unfused

        dq, dk, drpb = unfused.qk_backward(d_attn.contiguous(), query.contiguous(), key.contiguous(),
                                           kernel, dil, causal, d_rpb is not None)
    else:
        with torch.enable_grad():
            q, k = (t.detach().requires_grad_(True) for t in (query, key))
            # The bias gradient does not depend on the bias value: a zero rpb makes autograd give it.
            rpb = None if d_rpb is None else torch.zeros_like(d_rpb, requires_grad=True)
            attn = _neighborhood(rank, "_qk")(q, k, kernel, dil, is_causal=causal, rpb=rpb)
            dq, dk, *drpb = torch.autograd.grad(attn, [q, k] + ([rpb] if rpb is not None else []),
                                                d_attn, allow_unused=True)
            drpb = drpb[0] if drpb else None
    _write(d_query, _zeros_if_none(dq, d_query))
    _write(d_key, _zeros_if_none(dk, d_key))
    if d_rpb is not None:
        _write(d_rpb, _zeros_if_none(drpb, d_rpb))


def _zeros_if_none(grad, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _av_forward(output, attn, value, kernel_size, dilation, is_causal, *, rank):
    """Unfused {rank}-D AV: ``output[b, h, *i] = sum_slot attn[b, h, *i, slot] * value[b, h, *j(slot)]``
    over the valid slots; written into ``output``, returns None.

    ``attn`` ``[B, H, *spatial, prod(kernel_size)]``, ``value``/``output`` ``[B, H, *spatial, D_v]``.

    Equivalent PyTorch: ``output[...] = (attn[..., None] * value_neighbors).sum(-2)``.
    """
    op = f"na{rank}d_av_forward"
    kernel, dil, causal = _attn_value(op, rank, attn, value, kernel_size, dilation, is_causal)
    _like(op, "output", output, value.shape, value, "value")
    if _use_kernels(value):
        from ...fallback_kernels import unfused

        result = unfused.av_forward(attn.contiguous(), value.contiguous(), kernel, dil, causal,
                                    out=output)
    else:
        with torch.no_grad():
            result = _neighborhood(rank, "_av")(attn, value, kernel, dil, is_causal=causal)
    _write(output, result)


def _av_backward(d_attn, d_value, d_out, attn, value, kernel_size, dilation, is_causal, *, rank):
    """Gradients of {rank}-D AV: writes ``d_attn`` (zero in invalid causal slots) and ``d_value``
    from ``d_out``; returns None.

    Equivalent PyTorch: ``torch.autograd.grad(na{rank}d_av(attn, value, ...), (attn, value), d_out)``.
    """
    op = f"na{rank}d_av_backward"
    kernel, dil, causal = _attn_value(op, rank, attn, value, kernel_size, dilation, is_causal)
    _like(op, "d_out", d_out, value.shape, value, "value")
    _like(op, "d_attn", d_attn, attn.shape, value, "value")
    _like(op, "d_value", d_value, value.shape, value, "value")
    if _use_kernels(value):
        from ...fallback_kernels import unfused

        da, dv = unfused.av_backward(d_out.contiguous(), attn.contiguous(), value.contiguous(), kernel,
                                     dil, causal)
    else:
        with torch.enable_grad():
            a, v = (t.detach().requires_grad_(True) for t in (attn, value))
            out = _neighborhood(rank, "_av")(a, v, kernel, dil, is_causal=causal)
            da, dv = torch.autograd.grad(out, (a, v), d_out, allow_unused=True)
    _write(d_attn, _zeros_if_none(da, d_attn))
    _write(d_value, _zeros_if_none(dv, d_value))


def _ranked(impl, rank: int):
    """``impl`` with ``rank`` fixed: the public op ``na{rank}d_<op>`` with impl's other arguments."""
    def op(*args, **kwargs):
        return impl(*args, **kwargs, rank=rank)

    signature = inspect.signature(impl)
    op.__signature__ = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.name != "rank"])
    op.__name__ = op.__qualname__ = f"na{rank}d{impl.__name__}"
    op.__module__ = __name__
    op.__doc__ = impl.__doc__.replace("{rank}", str(rank))
    return op


na1d_forward, na2d_forward, na3d_forward = (_ranked(_forward, n) for n in (1, 2, 3))
na1d_qk_forward, na2d_qk_forward, na3d_qk_forward = (_ranked(_qk_forward, n) for n in (1, 2, 3))
na1d_qk_backward, na2d_qk_backward, na3d_qk_backward = (_ranked(_qk_backward, n) for n in (1, 2, 3))
na1d_av_forward, na2d_av_forward, na3d_av_forward = (_ranked(_av_forward, n) for n in (1, 2, 3))
na1d_av_backward, na2d_av_backward, na3d_av_backward = (_ranked(_av_backward, n) for n in (1, 2, 3))
