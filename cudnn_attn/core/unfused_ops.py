"""NATTEN's unfused neighborhood ops (0.17's ``qk`` / ``av``) dispatched like attention.

A call is an ``UnfusedProblem`` (the op, its ``masks.Neighborhood``, dtype, device, whether it
has a relative positional bias, and whether it must be deterministic). Each engine declares what
it runs (``supports(problem)``: reasons, empty when it can) — the CuPy RawKernels
(``fallback_kernels.backend.CupyUnfusedOps``) first, then the torch composites
(``torch_engine.neighborhood_ops.TorchUnfusedOps``) — ``select`` takes the first without reasons
and ``explain`` shows every verdict. Surfaces speak only ``Neighborhood``; nothing else picks an
implementation.

Layouts (heads-first, as NATTEN 0.17): token functions ``qk``/``av`` take ``[B, H, S, D]`` with the
spatial axes flattened row-major and give/take ``attn`` ``[B, H, S, prod(kernel)]``; the launcher
functions (``qk_forward``, ``qk_backward``, ``av_forward``, ``av_backward``) take the spatial layout
``[B, H, *spatial, C]`` of libnatten's ops. Equivalent PyTorch of ``qk`` then ``av`` (1-D,
non-causal; ``idx[i, s]`` the key of slot ``s`` of query ``i``)::

    attn = torch.einsum("bhid,bhisd->bhis", q, k[:, :, idx])
    out = torch.einsum("bhis,bhisd->bhid", attn.softmax(-1), v[:, :, idx])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .explanation import Explanation
from ..errors import NotSupportedError
from ..fallback_kernels.backend import CupyUnfusedOps
from ..model.masks import Neighborhood
from ..torch_engine.neighborhood_ops import NaGeometry, TorchUnfusedOps, na_table, rpb_logits

__all__ = ["UnfusedProblem", "ENGINES", "verdicts", "select", "explain", "qk", "av",
           "extra_logits", "qk_forward", "qk_backward", "av_forward", "av_backward"]


@dataclass(frozen=True)
class UnfusedProblem:
    """One unfused op call: ``op`` ``"qk"`` or ``"av"`` over ``mask``'s neighborhoods."""

    op: str
    mask: Neighborhood
    dtype: torch.dtype
    device: torch.device
    rpb: bool = False
    deterministic: bool = False

    @staticmethod
    def of(op: str, x: torch.Tensor, mask: Neighborhood, rpb: bool = False,
           deterministic: Optional[bool] = None) -> "UnfusedProblem":
        """The problem of a call on ``x``'s dtype and device; ``deterministic`` None reads
        ``torch.are_deterministic_algorithms_enabled()`` once, for this call."""
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        return UnfusedProblem(op, mask, x.dtype, x.device, bool(rpb), bool(deterministic))

    def describe(self) -> str:
        m = self.mask
        extras = ", rpb" if self.rpb else ""
        extras += ", deterministic" if self.deterministic else ""
        return (f"unfused {self.op} over {m.spatial_shape} kernel={m.kernel_size} "
                f"stride={m.stride} dilation={m.dilation} causal={m.is_causal} "
                f"{str(self.dtype).replace('torch.', '')} on {self.device}{extras}")


ENGINES: tuple = (CupyUnfusedOps(), TorchUnfusedOps())


def verdicts(problem: UnfusedProblem) -> dict[str, list[str]]:
    """Every engine's reasons for ``problem``, in priority order (empty: it can run it)."""
    return {e.name: e.supports(problem) for e in ENGINES}


def select(problem: UnfusedProblem, backend: str = "auto"):
    """The first engine (or the forced one) with no reasons; ``NotSupportedError`` with them
    all otherwise."""
    found = verdicts(problem)
    if backend != "auto" and backend not in found:
        raise ValueError(f"backend must be 'auto' or one of {tuple(found)}, got {backend!r}")
    for engine in ENGINES:
        if backend in ("auto", engine.name) and not found[engine.name]:
            return engine
    if backend == "auto":
        raise NotSupportedError(problem, found)
    raise NotSupportedError(problem, {backend: found[backend]}, forced=backend)


def explain(problem: UnfusedProblem) -> Explanation:
    """Each engine's verdict for ``problem``: ``"selected"``, ``"available"`` or its reasons."""
    chosen, shown = None, {}
    for name, reasons in verdicts(problem).items():
        if reasons:
            shown[name] = reasons
        elif chosen is None:
            shown[name] = chosen = "selected"
        else:
            shown[name] = "available"
    return Explanation(problem, shown)


def _geometry(mask: Neighborhood) -> NaGeometry:
    return NaGeometry(mask.spatial_shape, mask.kernel_size, mask.stride, mask.dilation,
                      mask.is_causal)


# ---------------------------------------------------------------------------------------------
# Token functions: differentiable (reverse and forward AD)
# ---------------------------------------------------------------------------------------------

def qk(query, key, mask: Neighborhood, rpb=None, *, deterministic: Optional[bool] = None):
    """``[B, H, S, D] x [B, H, S, D] -> [B, H, S, K]`` logits (unscaled, ``+ rpb``), slots a
    causal window does not fill ``-inf``."""
    engine = select(UnfusedProblem.of("qk", query, mask, rpb is not None, deterministic))
    geom = _geometry(mask)
    if engine.composites is not None:
        return engine.composites.qk_torch(query, key, geom, rpb)
    return _QKKernel.apply(query, key, rpb, geom, engine.launchers())


def av(attn, value, mask: Neighborhood, *, deterministic: Optional[bool] = None):
    """``[B, H, S, K] x [B, H, S, D_v] -> [B, H, S, D_v]``; unfilled slots ignored."""
    engine = select(UnfusedProblem.of("av", value, mask, False, deterministic))
    geom = _geometry(mask)
    if engine.composites is not None:
        return engine.composites.av_torch(attn, value, geom)
    return _AVKernel.apply(attn, value, geom, engine.launchers())


def extra_logits(query, additional_keys):
    """Logits against extra keys every query sees: ``[B, H, S, D] x [B, H, n, D] -> [B, H, S, n]``."""
    return query @ additional_keys.transpose(-1, -2)


# ---------------------------------------------------------------------------------------------
# Launcher functions (libnatten's op layer): spatial layout, no autograd
# ---------------------------------------------------------------------------------------------

def _launchers(op: str, x, mask: Neighborhood, rpb: bool = False):
    return select(UnfusedProblem.of(op, x, mask, rpb)).launchers()


def _args(mask: Neighborhood):
    return mask.kernel_size, mask.dilation, mask.is_causal


def qk_forward(query, key, rpb, mask: Neighborhood, attn=None):
    """``[B, H, *spatial, prod(kernel)]`` logits of spatial-layout ``query``/``key``."""
    return _launchers("qk", query, mask, rpb is not None).qk_forward(query, key, rpb,
                                                                     *_args(mask), attn=attn)


def qk_backward(d_attn, query, key, mask: Neighborhood, need_rpb_grad: bool):
    """``(d_query, d_key, d_rpb or None)`` of ``qk_forward``."""
    return _launchers("qk", query, mask, need_rpb_grad).qk_backward(d_attn, query, key,
                                                                    *_args(mask), need_rpb_grad)


def av_forward(attn, value, mask: Neighborhood, out=None):
    """``[B, H, *spatial, D_v]``: the weighted neighbor values."""
    return _launchers("av", value, mask).av_forward(attn, value, *_args(mask), out=out)


def av_backward(d_out, attn, value, mask: Neighborhood):
    """``(d_attn, d_value)`` of ``av_forward``."""
    return _launchers("av", value, mask).av_backward(d_out, attn, value, *_args(mask))


# ---------------------------------------------------------------------------------------------
# A launcher engine behind autograd Functions (jvp written out: each op is linear in each input)
# ---------------------------------------------------------------------------------------------

def _kernel_args(geom: NaGeometry):
    return geom.kernel, geom.dilation, geom.causal


# The launchers take the spatial layout ``[B, H, *spatial, C]``; the token functions work on
# flattened tokens ``[B, H, S, C]``. Both are views of the same contiguous memory.
def _spatial(x: torch.Tensor, geom: NaGeometry) -> torch.Tensor:
    return x.contiguous().view(*x.shape[:2], *geom.shape, x.shape[-1])


def _tokens(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(2, -2)


def _qk_kernel(impl, query, key, rpb, geom):
    return _tokens(impl.qk_forward(_spatial(query, geom), _spatial(key, geom), rpb,
                                   *_kernel_args(geom)))


def _av_kernel(impl, attn, value, geom):
    return _tokens(impl.av_forward(_spatial(attn, geom), _spatial(value, geom), *_kernel_args(geom)))


class _QKKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, rpb, geom, impl):
        attn = _qk_kernel(impl, query, key, rpb, geom)
        ctx.geom, ctx.impl, ctx.has_rpb = geom, impl, rpb is not None
        ctx.save_for_backward(query, key)
        ctx.save_for_forward(query, key)
        return attn

    @staticmethod
    def backward(ctx, d_attn):
        query, key = ctx.saved_tensors
        geom = ctx.geom
        need_rpb = ctx.has_rpb and ctx.needs_input_grad[2]
        dq, dk, drpb = ctx.impl.qk_backward(
            _spatial(d_attn, geom), _spatial(query, geom), _spatial(key, geom),
            *_kernel_args(geom), need_rpb)
        return _tokens(dq), _tokens(dk), drpb, None, None

    @staticmethod
    def jvp(ctx, dq, dk, drpb, _geom, _impl):
        # qk is bilinear in (q, k) and affine in rpb: d attn = qk(dq, k) + qk(q, dk) + rpb(drpb).
        query, key = ctx.saved_tensors
        geom = ctx.geom
        table = na_table(geom, query.device)
        tangent = torch.zeros(*query.shape[:3], geom.num_slots, dtype=query.dtype,
                              device=query.device)
        if dq is not None:
            tangent = tangent + _qk_kernel(ctx.impl, dq, key, None, geom)
        if dk is not None:
            tangent = tangent + _qk_kernel(ctx.impl, query, dk, None, geom)
        if drpb is not None:
            tangent = tangent + rpb_logits(drpb, table).to(tangent.dtype)
        return torch.where(table.valid, tangent, 0.0)  # the -inf slots are constant


class _AVKernel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, attn, value, geom, impl):
        out = _av_kernel(impl, attn, value, geom)
        ctx.geom, ctx.impl = geom, impl
        ctx.save_for_backward(attn, value)
        ctx.save_for_forward(attn, value)
        return out

    @staticmethod
    def backward(ctx, d_out):
        attn, value = ctx.saved_tensors
        geom = ctx.geom
        d_attn, d_value = ctx.impl.av_backward(
            _spatial(d_out, geom), _spatial(attn, geom), _spatial(value, geom),
            *_kernel_args(geom))
        return _tokens(d_attn), _tokens(d_value), None, None

    @staticmethod
    def jvp(ctx, d_attn, d_value, _geom, _impl):
        # av is bilinear: d out = av(d_attn, v) + av(attn, d_v).
        attn, value = ctx.saved_tensors
        tangent = torch.zeros(*attn.shape[:3], value.shape[-1], dtype=value.dtype,
                              device=value.device)
        if d_attn is not None:
            tangent = tangent + _av_kernel(ctx.impl, d_attn, value, ctx.geom)
        if d_value is not None:
            tangent = tangent + _av_kernel(ctx.impl, attn, d_value, ctx.geom)
        return tangent
