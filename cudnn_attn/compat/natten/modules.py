"""``NeighborhoodAttention1D/2D/3D`` (NATTEN 0.17-style modules) and the fused/unfused switch.

NATTEN 0.17 runs the unfused path (qk -> softmax -> dropout -> av) unless ``natten.use_fused_na()``
was called. Here the same process-wide switch exists (``use_fused_na`` / ``is_fna_enabled``), and
each module can override it with its ``use_fused`` attribute (``None`` follows the switch).
Re-exported by ``cudnn_attn.neighborhood`` (this module imports :mod:`.functional`, never the
other way round).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from . import context, functional
from ...model import checks
from ...core import unfused_ops
from .common import geometry

__all__ = [
    "NeighborhoodAttention1D",
    "NeighborhoodAttention2D",
    "NeighborhoodAttention3D",
    "is_fna_enabled",
    "is_fused_na_enabled",
    "use_fused_na",
]

_FUSED_NA = False


def use_fused_na(mode: bool = True, kv_parallel: bool = True, use_flex_attention: bool = False,
                 force_flex_attention: bool = False) -> None:
    """Make every module whose ``use_fused`` is ``None`` take the fused path (``mode=False``: the
    unfused path, the default). NATTEN 0.17's signature and rules: turning it on also sets KV
    parallelism to ``kv_parallel`` (:func:`.context.use_kv_parallelism_in_fused_na`, with its
    errors), turning it off turns KV parallelism off. NATTEN's FlexAttention switches are accepted
    as hints: the fused path runs on cudnn_attn's engines either way."""
    global _FUSED_NA
    mode = checks.flag("mode", mode)
    for name, value in (("kv_parallel", kv_parallel), ("use_flex_attention", use_flex_attention),
                        ("force_flex_attention", force_flex_attention)):
        checks.flag(name, value)
    if not mode:
        _FUSED_NA = False
        context.use_kv_parallelism_in_fused_na(False)
        return
    context.use_kv_parallelism_in_fused_na(kv_parallel)
    _FUSED_NA = True


def is_fna_enabled() -> bool:
    """Whether ``use_fused_na()`` switched the modules to the fused path (default ``False``)."""
    return _FUSED_NA


is_fused_na_enabled = is_fna_enabled  # NATTEN 0.17's name


class _NeighborhoodAttention(nn.Module):
    """Neighborhood self-attention layer over ``[B, *spatial, embed_dim]`` inputs.

    Args (NATTEN 0.21's order ``embed_dim, num_heads, kernel_size, stride, dilation,
    is_causal, qkv_bias, qk_scale, proj_drop``; the rest keyword-only):
        embed_dim: channels ``C`` (NATTEN 0.17's ``dim=`` too); num_heads ``H`` (``C % H == 0``,
            ``head_dim = C // H``).
        kernel_size, stride, dilation: int or per-axis tuple (NATTEN 0.21 rule, per axis);
            ``None`` stride/dilation mean 1.
        is_causal: bool or per-axis tuple (``None``: not causal).
        qkv_bias: bias of the fused ``qkv`` Linear ``C -> 3C``; ``proj`` is ``C -> C``.
        qk_scale: softmax scale (default ``head_dim ** -0.5``).
        proj_drop: dropout after ``proj``.
        rel_pos_bias: learn an RPB ``rpb`` ``[H, 2k-1 per axis]`` (NATTEN 0.17: trunc-normal,
            std 0.02), added after scaling. Needs odd kernels and no causal axis.
        attn_drop: dropout on the attention weights (training only).
        use_experimental_ops: NATTEN 0.17's switch between its kernels; accepted, no effect.
        use_fused: ``None`` (default) follows ``use_fused_na()``/``is_fna_enabled()``;
            ``True``/``False`` forces the fused/unfused path for this module. Also an attribute.

    Paths (see ``uses_fused``):
        * unfused: heads-first ``q * scale``, ``qk`` (+ rpb), softmax, ``attn_drop``, ``av``. Any
          stride (the torch composite runs strided windows; the CUDA unfused kernels need
          stride 1) and any kernel size.
        * fused: ``na{rank}d(q, k, v, ..., scale, rpb)``. It has no attention weights, so a call
          in training mode with ``attn_drop > 0`` or with ``return_attn_weights=True`` takes the
          unfused path instead (exact either way; NATTEN 0.17 silently skipped the dropout).

    ``forward(x, return_attn_weights=False)`` returns ``[B, *spatial, C]``, or ``(out, weights)``
    with ``weights`` the softmax probabilities before dropout, ``[B, H, *spatial, prod(kernel)]``
    (NATTEN 0.17's ``attn`` layout; causally cut slots are 0).

    Equivalent PyTorch (per head, tokens flattened, ``visible``/``bias`` the neighborhood mask and
    the rpb per query/key pair)::

        q, k, v = qkv(x).chunk(3, -1)
        w = torch.softmax((scale * q @ k.T + bias).masked_fill(~visible, -inf), -1)
        out = proj(dropout(w) @ v)
    """

    rank = 0

    def __init__(self, embed_dim: int | None = None, num_heads: int | None = None,
                 kernel_size: int | Sequence[int] | None = None,
                 stride: int | Sequence[int] | None = 1, dilation: int | Sequence[int] | None = 1,
                 is_causal: bool | Sequence[bool] | None = False, qkv_bias: bool = True,
                 qk_scale: float | None = None, proj_drop: float = 0.0, *,
                 rel_pos_bias: bool = False, attn_drop: float = 0.0,
                 use_fused: bool | None = None, dim: int | None = None,
                 use_experimental_ops: bool = False) -> None:
        # None is accepted for embed_dim/num_heads/kernel_size only so that NATTEN 0.17's
        # ``dim=`` can stand in for embed_dim; a missing one raises NATTEN's TypeError.
        super().__init__()
        # NATTEN 0.21's positional order; NATTEN 0.17's keywords: dim (= embed_dim),
        # rel_pos_bias, attn_drop, use_experimental_ops (its kernels' switch: no effect here).
        if dim is not None:
            if embed_dim is not None:
                raise TypeError("give embed_dim (NATTEN 0.21) or dim (NATTEN 0.17), not both")
            embed_dim = dim
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads),
                            ("kernel_size", kernel_size)):
            if value is None:
                raise TypeError(f"{type(self).__name__}() missing required argument: {name!r}")
        checks.flag("use_experimental_ops", use_experimental_ops)
        stride = 1 if stride is None else stride
        dilation = 1 if dilation is None else dilation
        is_causal = False if is_causal is None else is_causal
        embed_dim = checks.integer("embed_dim", embed_dim, 1)
        num_heads = checks.integer("num_heads", num_heads, 1)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        rank = self.rank
        at_least = lambda low: lambda n, v: checks.integer(n, v, low)  # noqa: E731
        self.kernel_size = checks.per_axis("kernel_size", kernel_size, rank, at_least(2))
        self.stride = checks.per_axis("stride", stride, rank, at_least(1))
        self.dilation = checks.per_axis("dilation", dilation, rank, at_least(1))
        self.is_causal = checks.per_axis("is_causal", is_causal, rank, checks.boolean)
        for k, s in zip(self.kernel_size, self.stride):
            if s > k:
                raise ValueError(f"stride must be <= kernel_size on every axis, got stride="
                                 f"{self.stride}, kernel_size={self.kernel_size}")
        if use_fused is not None:
            checks.flag("use_fused", use_fused)
        attn_drop, proj_drop = (checks.real(name, p, ok=lambda x: 0.0 <= x < 1.0, bound=" in [0, 1)")
                                for name, p in (("attn_drop", attn_drop), ("proj_drop", proj_drop)))
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = checks.softmax_scale("qk_scale", qk_scale, self.head_dim, error=TypeError)
        self._default_scale = qk_scale is None
        self.use_fused = use_fused
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim, bias=bool(qkv_bias))
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.attn_drop_rate = float(attn_drop)
        self.attn_drop = nn.Dropout(self.attn_drop_rate)
        self.proj_drop = nn.Dropout(float(proj_drop))
        if rel_pos_bias:
            if any(k % 2 == 0 for k in self.kernel_size) or any(self.is_causal):
                raise ValueError(f"rel_pos_bias needs odd kernel sizes and no causal axis, got "
                                 f"kernel_size={self.kernel_size}, is_causal={self.is_causal}")
            self.rpb = nn.Parameter(torch.zeros(num_heads, *(2 * k - 1 for k in self.kernel_size)))
            nn.init.trunc_normal_(self.rpb, std=0.02, a=-2.0, b=2.0)
        else:
            self.register_parameter("rpb", None)

    def uses_fused(self, return_attn_weights: bool = False) -> bool:
        """Whether the next ``forward`` takes the fused path."""
        if return_attn_weights or (self.training and self.attn_drop_rate > 0):
            return False
        return is_fna_enabled() if self.use_fused is None else self.use_fused

    def forward(self, x: torch.Tensor, return_attn_weights: bool = False,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        checks.tensor("x", x)
        if x.dim() != self.rank + 2 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be [B, *spatial ({self.rank} axes), {self.embed_dim}], got "
                             f"shape {tuple(x.shape)}")
        B, spatial, H, hd = x.shape[0], tuple(x.shape[1:-1]), self.num_heads, self.head_dim
        q, k, v = self.qkv(x).reshape(B, *spatial, 3, H, hd).unbind(-3)
        weights = None
        params = (self.kernel_size, self.stride, self.dilation, self.is_causal)
        if self.uses_fused(return_attn_weights):
            na = getattr(functional, f"na{self.rank}d")
            # The default scale goes as None (na*d derives it from the head dim): a float attribute
            # that differs between modules would turn symbolic under torch.compile's recompiles.
            scale = None if self._default_scale else self.scale
            out = na(q, k, v, *params, scale=scale, rpb=self.rpb)
        else:
            geom = geometry(spatial, *params)
            q, k, v = (t.reshape(B, -1, H, hd).transpose(1, 2) for t in (q, k, v))
            attn = unfused_ops.qk(q * self.scale, k, geom, self.rpb)
            weights = torch.softmax(attn, -1)  # a causal row always keeps its own query
            out = unfused_ops.av(self.attn_drop(weights), v, geom).transpose(1, 2)
        out = self.proj_drop(self.proj(out.reshape(B, *spatial, self.embed_dim)))
        if return_attn_weights:
            assert weights is not None  # return_attn_weights takes the unfused path
            return out, weights.unflatten(2, spatial)
        return out

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}, "
                f"is_causal={self.is_causal}, rel_pos_bias={self.rpb is not None}, "
                f"use_fused={self.use_fused}")


class NeighborhoodAttention1D(_NeighborhoodAttention):
    __doc__ = "1-D " + (_NeighborhoodAttention.__doc__ or "")
    rank = 1


class NeighborhoodAttention2D(_NeighborhoodAttention):
    __doc__ = "2-D " + (_NeighborhoodAttention.__doc__ or "")
    rank = 2


class NeighborhoodAttention3D(_NeighborhoodAttention):
    __doc__ = "3-D " + (_NeighborhoodAttention.__doc__ or "")
    rank = 3

