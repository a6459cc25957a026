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
The unfused ops are dispatched by ``cudnn_attn.core.unfused_ops`` (the CuPy RawKernels on CUDA when
they can run, else the torch engine; ``unfused_ops.explain`` says why); the fused op is one
``cudnn_attn.attention`` call like ``na{n}d`` (its tile sizes are validated, then hints).

Equivalent PyTorch of ``na1d_qk_forward`` then ``na1d_av_forward`` (non-causal, no rpb)::

    idx = window_start[:, None] + torch.arange(k) * d        # [L, k] key index per slot
    attn[...] = torch.einsum("bhld,bhlkd->bhlk", q, k_[:, :, idx])
    out[...] = torch.einsum("bhlk,bhlkd->bhld", attn.softmax(-1), v[:, :, idx])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Concatenate, ParamSpec

import inspect
import math

import torch

from ...model import checks
from ...core import unfused_ops
from ...fallback_kernels import FUSED_DTYPES, check_tile_sizes, valid_tile_sizes
from ...model.masks import Neighborhood
from .common import check_rpb, neighborhood_attention

# Written out (not computed) so that static readers (mypy, griffe) see the names.
__all__ = [
    "na1d_forward", "na2d_forward", "na3d_forward",
    "na1d_qk_forward", "na2d_qk_forward", "na3d_qk_forward",
    "na1d_qk_backward", "na2d_qk_backward", "na3d_qk_backward",
    "na1d_av_forward", "na2d_av_forward", "na3d_av_forward",
    "na1d_av_backward", "na2d_av_backward", "na3d_av_backward",
    "valid_tile_sizes",
]

P = ParamSpec("P")


# ----------------------------------------------------------------------------------------------------
# Validation (``cudnn_attn.model.checks`` with the op's name as prefix)
# ----------------------------------------------------------------------------------------------------


def _tensor(op: str, name: str, t, rank: int) -> torch.Tensor:
    return checks.tensor(name, t, ndim=rank + 3, what=f"for a {rank}-D problem", prefix=f"{op}: ")


def _like(op: str, name: str, t, shape, ref: torch.Tensor, ref_name: str) -> torch.Tensor:
    """``t`` is a tensor of ``shape`` with ``ref``'s dtype and device."""
    return checks.like(name, t, ref, ref_name, expected=shape, prefix=f"{op}: ")


def _checked_kernel_args(op: str, spatial, kernel_size, dilation, is_causal, *,
                         odd: bool = False) -> Neighborhood:
    """The stride-1 ``Neighborhood`` of the arguments (rank-sized tuples), checked against the
    spatial shape."""
    try:
        nb = Neighborhood(tuple(spatial), kernel_size, 1, dilation, is_causal)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{op}: {exc}") from None
    if odd and any(k % 2 == 0 for k in nb.kernel_size):  # NATTEN 0.17's unfused ops: odd only
        raise ValueError(f"{op}: kernel_size must be odd for the unfused ops, got {kernel_size!r}")
    return nb


def _write(out: torch.Tensor, result: torch.Tensor) -> None:
    if result is not out:
        out.copy_(result)


# ----------------------------------------------------------------------------------------------------
# One N-d implementation per op; the rank wrappers below only fix ``rank``.
# ----------------------------------------------------------------------------------------------------


def _forward(rank: int, output: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             rpb: torch.Tensor | None, kernel_size: int | Sequence[int], dilation: int | Sequence[int],
             is_causal: bool | Sequence[bool], attn_scale: float | None,
             query_tile_size: int | Sequence[int] | None,
             key_tile_size: int | Sequence[int] | None) -> None:
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
    if query.dtype not in FUSED_DTYPES:
        raise TypeError(f"{op}: query has dtype {query.dtype}; supported: "
                        f"{', '.join(str(d) for d in FUSED_DTYPES)}")
    batch, *spatial, heads, dim = query.shape
    heads_kv = key.shape[-2]
    _like(op, "key", key, (batch, *spatial, heads_kv, dim), query, "query")
    dim_v = value.shape[-1]
    _like(op, "value", value, (batch, *spatial, heads_kv, dim_v), query, "query")
    if heads % heads_kv:
        raise ValueError(f"{op}: query heads ({heads}) must be a multiple of key heads ({heads_kv})")
    _like(op, "output", output, (batch, *spatial, heads, dim_v), query, "query")
    nb = _checked_kernel_args(op, spatial, kernel_size, dilation, is_causal)
    if rpb is not None:
        check_rpb(rpb, heads, nb.kernel_size, nb.is_causal, query, same_dtype=True,
                  prefix=f"{op}: ")
    attn_scale = checks.softmax_scale("attn_scale", attn_scale, dim, error=TypeError,
                                       prefix=f"{op}: ")
    if query_tile_size is not None or key_tile_size is not None or not valid_tile_sizes(
            rank, max(dim, dim_v), query.dtype):
        # Validated as libnatten does; then a hint only: the engine picks its own tiles.
        check_tile_sizes(rank, max(dim, dim_v), query.dtype, query_tile_size, key_tile_size)
    with torch.no_grad():  # one attention call, dispatched like any other
        result, _ = neighborhood_attention(query, key, value, nb, attn_scale, rpb)
    _write(output, result.reshape(output.shape))


def _unfused_inputs(op, rank, query, key, kernel_size, dilation, is_causal):
    """Check heads-first query/key of one shape; return (geometry, attn shape)."""
    checks.tensor("query", query, ndim=rank + 3, what=f"for a {rank}-D problem", floating=True,
                   prefix=f"{op}: ")
    _like(op, "key", key, query.shape, query, "query")
    batch, heads, *spatial, _ = query.shape
    nb = _checked_kernel_args(op, spatial, kernel_size, dilation, is_causal, odd=True)
    return nb, (batch, heads, *spatial, math.prod(nb.kernel_size))


def _attn_value(op, rank, attn, value, kernel_size, dilation, is_causal):
    """Check attn ``[B, H, *spatial, prod(k)]`` against value ``[B, H, *spatial, D_v]``."""
    checks.tensor("value", value, ndim=rank + 3, what=f"for a {rank}-D problem", floating=True,
                   prefix=f"{op}: ")
    batch, heads, *spatial, _ = value.shape
    nb = _checked_kernel_args(op, spatial, kernel_size, dilation, is_causal, odd=True)
    _like(op, "attn", attn, (batch, heads, *spatial, math.prod(nb.kernel_size)), value, "value")
    return nb


def _qk_forward(rank: int, attn: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                rpb: torch.Tensor | None, kernel_size: int | Sequence[int],
                dilation: int | Sequence[int], is_causal: bool | Sequence[bool]) -> None:
    """Unfused {rank}-D QK: ``attn[b, h, *i, slot] = <query[b, h, *i], key[b, h, *j(slot)]>
    (+ rpb)``, unscaled, invalid causal slots ``-inf``; written into ``attn``, returns None.

    ``query``/``key`` ``[B, H, *spatial, D]`` (float64/32/16, bfloat16), ``attn``
    ``[B, H, *spatial, prod(kernel_size)]``, ``rpb`` ``[H, 2*k-1, ...]`` or None.

    Equivalent PyTorch: ``attn[...] = (query[..., None, :] * key_neighbors).sum(-1) + rpb_bias``.
    """
    op = f"na{rank}d_qk_forward"
    nb, attn_shape = _unfused_inputs(op, rank, query, key, kernel_size, dilation, is_causal)
    _like(op, "attn", attn, attn_shape, query, "query")
    if rpb is not None:
        check_rpb(rpb, query.shape[1], nb.kernel_size, nb.is_causal, query, name="rpb",
                  same_dtype=True, prefix=f"{op}: ")
    result = unfused_ops.qk_forward(query.contiguous(), key.contiguous(),
                                    None if rpb is None else rpb.contiguous(), nb, attn=attn)
    _write(attn, result)


def _qk_backward(rank: int, d_query: torch.Tensor, d_key: torch.Tensor,
                 d_rpb: torch.Tensor | None, d_attn: torch.Tensor, query: torch.Tensor,
                 key: torch.Tensor, kernel_size: int | Sequence[int],
                 dilation: int | Sequence[int], is_causal: bool | Sequence[bool]) -> None:
    """Gradients of {rank}-D QK: writes ``d_query``, ``d_key`` and, unless it is None, ``d_rpb``
    (``[H, 2*k-1, ...]``) from ``d_attn``; returns None. Invalid causal slots get no gradient.

    Equivalent PyTorch: ``torch.autograd.grad(na{rank}d_qk(query, key, ...), (query, key, rpb),
    d_attn)``.
    """
    op = f"na{rank}d_qk_backward"
    nb, attn_shape = _unfused_inputs(op, rank, query, key, kernel_size, dilation, is_causal)
    _like(op, "d_attn", d_attn, attn_shape, query, "query")
    _like(op, "d_query", d_query, query.shape, query, "query")
    _like(op, "d_key", d_key, key.shape, query, "query")
    if d_rpb is not None:
        check_rpb(d_rpb, query.shape[1], nb.kernel_size, nb.is_causal, query, name="d_rpb",
                  same_dtype=True, prefix=f"{op}: ")
    dq, dk, drpb = unfused_ops.qk_backward(d_attn.contiguous(), query.contiguous(),
                                           key.contiguous(), nb, d_rpb is not None)
    _write(d_query, _zeros_if_none(dq, d_query))
    _write(d_key, _zeros_if_none(dk, d_key))
    if d_rpb is not None:
        _write(d_rpb, _zeros_if_none(drpb, d_rpb))


def _zeros_if_none(grad, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _av_forward(rank: int, output: torch.Tensor, attn: torch.Tensor, value: torch.Tensor,
                kernel_size: int | Sequence[int], dilation: int | Sequence[int],
                is_causal: bool | Sequence[bool]) -> None:
    """Unfused {rank}-D AV: ``output[b, h, *i] = sum_slot attn[b, h, *i, slot] * value[b, h, *j(slot)]``
    over the valid slots; written into ``output``, returns None.

    ``attn`` ``[B, H, *spatial, prod(kernel_size)]``, ``value``/``output`` ``[B, H, *spatial, D_v]``.

    Equivalent PyTorch: ``output[...] = (attn[..., None] * value_neighbors).sum(-2)``.
    """
    op = f"na{rank}d_av_forward"
    nb = _attn_value(op, rank, attn, value, kernel_size, dilation, is_causal)
    _like(op, "output", output, value.shape, value, "value")
    result = unfused_ops.av_forward(attn.contiguous(), value.contiguous(), nb, out=output)
    _write(output, result)


def _av_backward(rank: int, d_attn: torch.Tensor, d_value: torch.Tensor, d_out: torch.Tensor,
                 attn: torch.Tensor, value: torch.Tensor, kernel_size: int | Sequence[int],
                 dilation: int | Sequence[int], is_causal: bool | Sequence[bool]) -> None:
    """Gradients of {rank}-D AV: writes ``d_attn`` (zero in invalid causal slots) and ``d_value``
    from ``d_out``; returns None.

    Equivalent PyTorch: ``torch.autograd.grad(na{rank}d_av(attn, value, ...), (attn, value), d_out)``.
    """
    op = f"na{rank}d_av_backward"
    nb = _attn_value(op, rank, attn, value, kernel_size, dilation, is_causal)
    _like(op, "d_out", d_out, value.shape, value, "value")
    _like(op, "d_attn", d_attn, attn.shape, value, "value")
    _like(op, "d_value", d_value, value.shape, value, "value")
    da, dv = unfused_ops.av_backward(d_out.contiguous(), attn.contiguous(), value.contiguous(),
                                     nb)
    _write(d_attn, _zeros_if_none(da, d_attn))
    _write(d_value, _zeros_if_none(dv, d_value))


def _ranked(impl: Callable[Concatenate[int, P], None], rank: int) -> Callable[P, None]:
    """``impl`` with its first argument, ``rank``, fixed: the public op ``na{rank}d_<op>`` with
    impl's other arguments (for type checkers too: ``Concatenate`` drops ``rank``)."""
    signature = inspect.signature(impl)
    public = signature.replace(parameters=list(signature.parameters.values())[1:])

    def op(*args: P.args, **kwargs: P.kwargs) -> None:
        try:  # a wrong argument count is reported against the public op, not impl
            public.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{op.__name__}(): {exc}") from None
        return impl(rank, *args, **kwargs)

    op.__signature__ = public  # type: ignore[attr-defined]
    op.__name__ = op.__qualname__ = f"na{rank}d{impl.__name__}"
    op.__module__ = __name__
    op.__doc__ = (impl.__doc__ or "").replace("{rank}", str(rank))
    return op


na1d_forward, na2d_forward, na3d_forward = (_ranked(_forward, n) for n in (1, 2, 3))
na1d_qk_forward, na2d_qk_forward, na3d_qk_forward = (_ranked(_qk_forward, n) for n in (1, 2, 3))
na1d_qk_backward, na2d_qk_backward, na3d_qk_backward = (_ranked(_qk_backward, n) for n in (1, 2, 3))
na1d_av_forward, na2d_av_forward, na3d_av_forward = (_ranked(_av_forward, n) for n in (1, 2, 3))
na1d_av_backward, na2d_av_backward, na3d_av_backward = (_ranked(_av_backward, n) for n in (1, 2, 3))
