"""``torch.nn`` modules on top of :func:`cudnn_attn.attention`.

``MultiheadAttention`` is a multi-head attention layer in the spirit of
``torch.nn.MultiheadAttention``: input projection, attention on the fastest engine that computes the
call exactly, output projection. It adds what that module lacks (GQA/MQA, every ``cudnn_attn`` mask,
ALiBi, softcap, the log-sum-exp, backend choice) and drops what an attention engine cannot give
cheaply (the attention-weight matrix).
"""

from __future__ import annotations

from typing import Any

import numbers

import torch
import torch.nn.functional as F
from torch import nn

from .model import checks
from .api import attention
from .core.dispatch import get_backend
from .model.masks import Alibi, Mask

__all__ = ["MultiheadAttention"]

def _probability(name: str, value) -> float:
    """A float in ``[0, 1)``: TypeError for a non-number, ValueError out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float in [0, 1), got {value!r}")
    return checks.real(name, value, ok=lambda p: 0.0 <= p < 1.0, bound=" in [0, 1)")


def _check_mask(name: str, mask):
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"{name} must be None or a cudnn_attn mask (Causal, SlidingWindow, "
                        f"Neighborhood, Padding or an & of them), got {type(mask).__name__}")
    return mask


class MultiheadAttention(nn.Module):
    """Multi-head attention with a fused input projection, GQA and any ``cudnn_attn`` mask.

    Args:
        embed_dim: model width ``E`` of the queries and of the output.
        num_heads: query heads ``H``; ``head_dim = embed_dim // num_heads`` (must divide exactly).
        num_kv_heads: key/value heads ``H_kv`` (default ``num_heads``); ``num_heads % num_kv_heads
            == 0``. Query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``; ``1`` is MQA.
        cross_attention: ``False`` (self-attention): one fused ``qkv_proj`` Linear
            ``E -> (H + 2 H_kv) * head_dim``. ``True``: ``q_proj`` ``E -> H * head_dim`` for the
            queries and a fused ``kv_proj`` ``kdim -> 2 H_kv * head_dim`` for the context.
        kdim: feature size of the key/value (context) inputs, cross-attention only (default ``E``).
        bias: add a learnable bias to the input and output projections (as torch's ``bias``).
        dropout: attention-weight dropout probability, applied only in training mode.
        out_dropout: dropout on the output (after the output projection), training mode only.
        mask: default mask of every call (``Causal()``, ``SlidingWindow(...)``,
            ``Neighborhood(...)``, ``Padding(...)`` or an ``&`` of them).
        alibi: ``False``; ``True`` for ALiBi with the paper's slopes for ``num_heads`` heads; or an
            ``Alibi(slopes)``.
        scale: softmax scale (default ``head_dim ** -0.5``). softcap: ``None`` or the tanh cap.
        batch_first: inputs and outputs are ``[B, S, E]`` (default ``True``); ``False`` means
            ``[S, B, E]`` as torch's default.
        backend: ``"auto"``, ``"cudnn"``, ``"cupy"`` or ``"torch"``, passed to ``attention()``.
        device, dtype: of the parameters.

    ``forward(query, key=None, value=None, *, mask=..., attn_bias=None, return_lse=False,
    generator=None)``:

        * self-attention: ``module(x)`` (``module(x, x, x)`` is accepted too); ``x`` ``[B, S, E]``.
        * cross-attention: ``module(x, context)`` with ``context`` ``[B, S_kv, kdim]`` (both k and v
          come from it through the fused ``kv_proj``); ``module(x, key, value)`` projects two
          different tensors with the two halves of ``kv_proj``.
        * ``mask``: a per-call mask, ANDed with the construction mask (e.g. ``Causal()`` at
          construction and a ``Padding(lengths)`` per batch). ``None`` adds nothing.
        * ``attn_bias``: a tensor broadcastable to ``[B, H, S_q, S_kv]`` added to the scores, or an
          ``Alibi``; not together with ``alibi=`` at construction.
        * returns ``out`` ``[B, S_q, E]`` (or ``[S_q, B, E]``), or ``(out, lse)`` with ``lse``
          ``[B, H, S_q]`` when ``return_lse=True``.

    Layout: the fused weight's rows are ``[q heads | k heads | v heads]``, each head ``head_dim``
    consecutive rows (``kv_proj``: ``[k heads | v heads]``), so with ``num_kv_heads == num_heads``
    ``qkv_proj.weight`` is exactly torch's ``in_proj_weight`` (see :meth:`from_torch`). Internally q, k
    and v stay ``[B, S, H, head_dim]`` views of the projection (``layout="bshd"``): no transposes.

    Differences from ``torch.nn.MultiheadAttention``: ``batch_first=True`` by default; returns the
    output alone (or with the lse), never the attention weights (``need_weights`` does not exist);
    masks are ``cudnn_attn`` mask objects instead of ``attn_mask`` / ``key_padding_mask`` /
    ``is_causal`` tensors (``Padding(lengths)`` replaces ``key_padding_mask``; an arbitrary additive
    mask goes in ``attn_bias``); GQA via ``num_kv_heads``; a separate ``out_dropout``;
    ``add_bias_kv`` / ``add_zero_attn`` and a ``vdim`` different from ``kdim`` are not supported.

    Equivalent PyTorch (self-attention, no GQA, ``visible`` the boolean ``[S, S]`` mask the masks
    describe, ``p`` the dropout probability in training mode, else 0)::

        B, S, E = x.shape
        q, k, v = F.linear(x, m.qkv_proj.weight, m.qkv_proj.bias).view(B, S, 3, H, E // H).unbind(2)
        s = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)) * m.scale          # [B, H, S, S]
        s = s.masked_fill(~visible, float("-inf"))
        a = F.dropout(s.softmax(-1), p) @ v.transpose(1, 2)                  # [B, H, S, D]
        out = F.dropout(m.out_proj(a.transpose(1, 2).reshape(B, S, E)), m.out_dropout, m.training)
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 cross_attention: bool = False, kdim: int | None = None, bias: bool = True,
                 dropout: float = 0.0, out_dropout: float = 0.0, mask: Mask | None = None,
                 alibi: bool | Alibi = False, scale: float | None = None,
                 softcap: float | None = None, batch_first: bool = True, backend: str = "auto",
                 device: torch.device | str | int | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        embed_dim = checks.integer("embed_dim", embed_dim, 1)
        num_heads = checks.integer("num_heads", num_heads, 1)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim}, "
                             f"num_heads={num_heads}")
        num_kv_heads = num_heads if num_kv_heads is None else checks.integer("num_kv_heads",
                                                                              num_kv_heads, 1)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads must be a multiple of num_kv_heads (GQA/MQA), got "
                             f"num_heads={num_heads}, num_kv_heads={num_kv_heads}")
        if kdim is not None:
            kdim = checks.integer("kdim", kdim, 1)
            if not cross_attention:
                raise ValueError(f"kdim={kdim} is only meaningful with cross_attention=True "
                                 f"(self-attention projects the query input)")
        if scale is not None:
            checks.real("scale", scale)
        if softcap is not None:
            checks.real("softcap", softcap, ok=lambda c: c >= 0, bound=" >= 0")
        if alibi is True:
            alibi = Alibi()
        elif alibi is False or alibi is None:
            alibi = None  # type: ignore[assignment]
        elif not isinstance(alibi, Alibi):
            raise TypeError(f"alibi must be a bool or an Alibi, got {type(alibi).__name__}")
        elif alibi.slopes is not None and not isinstance(alibi.slopes[0], tuple):
            alibi.slope_table(1, num_heads)  # [H] slopes: a wrong head count fails now
        if backend != "auto":
            get_backend(backend)  # an unknown name fails now, not at the first call

        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.cross_attention = bool(cross_attention)
        self.kdim = (kdim or embed_dim) if cross_attention else embed_dim
        self.dropout = _probability("dropout", dropout)
        self.out_dropout = _probability("out_dropout", out_dropout)
        self.mask = _check_mask("mask", mask)
        self.alibi = alibi
        self.scale = float(scale) if scale is not None else checks.default_scale(self.head_dim)
        self.softcap = float(softcap) if softcap else None
        self.batch_first = bool(batch_first)
        self.backend = backend

        factory = {"device": device, "dtype": dtype}
        q_width = num_heads * self.head_dim
        kv_width = num_kv_heads * self.head_dim
        if self.cross_attention:
            self.q_proj = nn.Linear(embed_dim, q_width, bias=bias, **factory)
            self.kv_proj = nn.Linear(self.kdim, 2 * kv_width, bias=bias, **factory)
        else:
            self.qkv_proj = nn.Linear(embed_dim, q_width + 2 * kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(q_width, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform input projections and zero biases, as torch.nn.MultiheadAttention."""
        for proj in ((self.q_proj, self.kv_proj) if self.cross_attention else (self.qkv_proj,)):
            nn.init.xavier_uniform_(proj.weight)
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        self.out_proj.reset_parameters()
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, **kwargs: Any) -> MultiheadAttention:
        """A self-attention module with ``module``'s weights (same ``embed_dim``/``num_heads``,
        ``batch_first``, ``dropout``); ``kwargs`` (e.g. ``mask=Causal()``) go to the constructor."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention, got "
                            f"{type(module).__name__}")
        if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
            raise ValueError("from_torch needs kdim == vdim == embed_dim, no add_bias_kv and no "
                             "add_zero_attn")
        weight = module.in_proj_weight
        kwargs.setdefault("batch_first", module.batch_first)
        kwargs.setdefault("dropout", module.dropout)
        new = cls(module.embed_dim, module.num_heads, bias=module.in_proj_bias is not None,
                  device=weight.device, dtype=weight.dtype, **kwargs)
        with torch.no_grad():
            new.qkv_proj.weight.copy_(weight)
            new.out_proj.weight.copy_(module.out_proj.weight)
            if module.in_proj_bias is not None:
                new.qkv_proj.bias.copy_(module.in_proj_bias)
                new.out_proj.bias.copy_(module.out_proj.bias)
        return new

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        if self.cross_attention:
            parts.append(f"cross_attention=True, kdim={self.kdim}")
        for name in ("dropout", "out_dropout"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name)}")
        if self.mask is not None:
            parts.append(f"mask={self.mask!r}")
        if self.alibi is not None:
            parts.append(f"alibi={self.alibi!r}")
        if not self.batch_first:
            parts.append("batch_first=False")
        if self.backend != "auto":
            parts.append(f"backend={self.backend!r}")
        return ", ".join(parts)

    # -----------------------------------------------------------------------------------------

    def _input(self, name: str, x, width: int) -> torch.Tensor:
        checks.tensor(name, x)
        if x.dim() != 3 or x.shape[-1] != width:
            order = "[B, S, E]" if self.batch_first else "[S, B, E]"
            raise ValueError(f"{name} must be 3-D {order} with E = {width}, got shape "
                             f"{tuple(x.shape)}")
        return x if self.batch_first else x.transpose(0, 1)

    def _project(self, query, key, value):
        """q ``[B, S_q, H, D]``, k and v ``[B, S_kv, H_kv, D]`` (views of the projections)."""
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = self._input("query", query, self.embed_dim)
        if not self.cross_attention:
            if (key is not None and key is not query) or (value is not None and value is not query):
                raise ValueError("this MultiheadAttention was built for self-attention: call it as "
                                 "module(x) (or module(x, x, x)); build it with "
                                 "cross_attention=True to attend to another sequence")
            qkv = self.qkv_proj(x).unflatten(-1, (h + 2 * h_kv, d))
            return qkv.split((h, h_kv, h_kv), dim=2)
        if key is None:
            raise ValueError("cross-attention needs a key (context) input: module(x, context)")
        q = self.q_proj(x).unflatten(-1, (h, d))
        key_in = self._input("key", key, self.kdim)
        if value is None or value is key:
            kv = self.kv_proj(key_in).unflatten(-1, (2 * h_kv, d))
            k, v = kv.split((h_kv, h_kv), dim=2)
        else:
            value_in = self._input("value", value, self.kdim)
            if value_in.shape[:2] != key_in.shape[:2]:
                raise ValueError(f"key and value must have the same batch and length, got key "
                                 f"{tuple(key.shape)}, value {tuple(value.shape)}")
            w_k, w_v = self.kv_proj.weight.chunk(2, dim=0)
            b_k, b_v = (None, None) if self.kv_proj.bias is None else self.kv_proj.bias.chunk(2)
            k = F.linear(key_in, w_k, b_k).unflatten(-1, (h_kv, d))
            v = F.linear(value_in, w_v, b_v).unflatten(-1, (h_kv, d))
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"query and key must have the same batch size, got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}")
        return q, k, v

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None,
                value: torch.Tensor | None = None, *, mask: Mask | None = None,
                attn_bias: torch.Tensor | None = None, return_lse: bool = False,
                generator: torch.Generator | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend; see the class docstring for arguments and shapes."""
        q, k, v = self._project(query, key, value)
        call_mask = self.mask
        if mask is not None:  # None (the default): the module's own mask only
            _check_mask("mask", mask)
            call_mask = mask if call_mask is None else call_mask & mask
        if attn_bias is not None and self.alibi is not None:
            raise ValueError("attn_bias cannot be combined with the module's alibi: pass one "
                             "positional bias")
        bias: Any = attn_bias if attn_bias is not None else self.alibi
        res: Any = attention(q, k, v, mask=call_mask, bias=bias, scale=self.scale,
                        dropout_p=self.dropout if self.training else 0.0, softcap=self.softcap,
                        layout="bshd", return_lse=return_lse, backend=self.backend,
                        generator=generator)
        out, lse = res if return_lse else (res, None)
        out = self.out_proj(out.flatten(2))
        if self.out_dropout and self.training:
            out = F.dropout(out, self.out_dropout, training=True)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out, lse) if return_lse else out  # type: ignore[return-value]
