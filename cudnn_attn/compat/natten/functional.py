"""NATTEN-compatible neighborhood attention: the fused ``na1d/na2d/na3d`` (NATTEN 0.21 API, plus
0.17's ``rpb``) and ``merge_attentions``; the unfused ``na{1,2,3}d_qk`` / ``na{1,2,3}d_av``
(NATTEN 0.17) are re-exported from :mod:`.unfused`.

Neighbor rule: NATTEN 0.21 per axis (kernel, stride, dilation, causal), see ``masks.Neighborhood``.
The fused functions run ``cudnn_attn.attention(mask=Neighborhood(...))`` on the flattened tokens, so
they pick the fastest engine (the CuPy kernels on a GPU, the tiled torch engine on CPU). Layouts:

* fused: heads-last ``[B, *spatial, H, D]`` (k/v may have ``H_kv`` heads, ``H % H_kv == 0``);
* unfused: heads-first ``[B, H, *spatial, D]``, see :mod:`.unfused`.

The public namespace ``cudnn_attn.neighborhood`` adds the modules (:mod:`.modules`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from ...model import checks
from ...api import attention as _attention
from ...core.caches import LRU
from ...errors import NotSupportedError
from ...model.masks import Causal
from ...varlen import attention_varlen
from . import options, varlen_args
from .context import deterministic_scope
from ...rewrites.merging import merge_partials
from .common import (NattenValueError, check_rpb, check_tensors, doc_fields, geometry,
                     neighborhood_attention)
from .unfused import na1d_av, na1d_qk, na2d_av, na2d_qk, na3d_av, na3d_qk

__all__ = [
    "attention",
    "merge_attentions",
    "na1d",
    "na1d_av",
    "na1d_qk",
    "na2d",
    "na2d_av",
    "na2d_qk",
    "na3d",
    "na3d_av",
    "na3d_qk",
    "neighborhood_attention_generic",
]

# ---------------------------------------------------------------------------------------------
# merge_attentions
# ---------------------------------------------------------------------------------------------

def merge_attentions(outputs: Sequence[torch.Tensor], lse_tensors: Sequence[torch.Tensor],
                     torch_compile: bool = True, use_autograd_fix: bool = True,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention results over disjoint key sets through their log-sum-exps (NATTEN 0.21).

    ``outputs[i]`` is ``[B, *S, H, D]`` (heads-last) and ``lse_tensors[i]`` ``[B, *S, H]`` (natural
    log); at least two. Returns ``(out, lse)`` of attention over the union of the key sets: out in
    ``outputs[0]``'s dtype, lse float32 (float64 if an input is float64). Rows that are ``-inf`` in
    every input give ``out = 0`` and ``lse = -inf`` (never NaN). Differentiable in every output
    and lse, exactly, whatever produced them: ``use_autograd_fix`` (NATTEN's workaround for its
    fused ops) and ``torch_compile`` (fusing the elementwise ops) are accepted and change nothing.

    Equivalent PyTorch::

        lse = torch.logsumexp(torch.stack(lse_tensors), 0)
        out = sum(torch.exp(l - lse)[..., None] * o for o, l in zip(outputs, lse_tensors))
    """
    checks.flag("torch_compile", torch_compile)
    checks.flag("use_autograd_fix", use_autograd_fix)
    if not isinstance(outputs, (list, tuple)) or not isinstance(lse_tensors, (list, tuple)):
        raise TypeError("outputs and lse_tensors must be lists of tensors")
    if len(outputs) < 2:
        raise ValueError("`merge_attentions` expects at least two tensors.")
    if len(outputs) != len(lse_tensors):
        raise ValueError(f"`merge_attentions` expected number of outputs and LSE tensors to "
                         f"match, got {len(outputs)} != {len(lse_tensors)}.")
    return merge_partial(outputs, lse_tensors)


def merge_partial(outputs, lses):
    """``merge_attentions`` for one or more parts, without NATTEN's flags (internal callers)."""
    for i, (o, l) in enumerate(zip(outputs, lses)):
        checks.tensor(f"outputs[{i}]", o, floating=True)
        checks.tensor(f"lse_tensors[{i}]", l, floating=True)
        if o.dim() < 2 or tuple(l.shape) != tuple(o.shape[:-1]):
            raise ValueError(f"lse_tensors[{i}] must have shape outputs[{i}].shape[:-1] = "
                             f"{tuple(o.shape[:-1])}, got {tuple(l.shape)}")
        if o.shape != outputs[0].shape:
            raise ValueError(f"outputs[{i}] has shape {tuple(o.shape)}, outputs[0] has "
                             f"{tuple(outputs[0].shape)}")
        if o.device != outputs[0].device or l.device != outputs[0].device:
            raise ValueError(f"outputs[{i}]/lse_tensors[{i}] are not on {outputs[0].device}")
    return merge_partials(outputs, lses)


# ---------------------------------------------------------------------------------------------
# Fused: na1d / na2d / na3d
# ---------------------------------------------------------------------------------------------

# Recently validated plain na{rank}d calls (no extra keys, rpb or tuning hints) -> their
# (Neighborhood, scale, engine): a hit skips NATTEN's argument checks, a third of a small
# call's host time (benchmarks/na_host.py).
_VALIDATED = LRU("natten.fused_calls", 256)
_Tensor, _is_compiling = torch.Tensor, torch.compiler.is_compiling


def _typed(x):
    """``x`` as a key that tells ``1``, ``1.0`` and ``True`` apart (they hash alike, and a valid
    call must not vouch for an invalid one)."""
    if type(x) is tuple or type(x) is list:
        return (type(x), tuple(_typed(e) for e in x))
    return (type(x), x)


def _call_key(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale, backend,
              return_lse):
    """The hashable summary of a plain call's arguments (``None``: not cacheable)."""
    if _is_compiling() or not (type(query) is type(key) is type(value) is _Tensor) \
            or type(scale) not in (float, int, type(None)):  # a tensor scale: its value counts
        return None
    try:
        return (rank, _typed(kernel_size), _typed(stride), _typed(dilation), _typed(is_causal),
                _typed(scale), _typed(backend), _typed(return_lse),
                *((t.layout, t.is_nested, t.shape, t.dtype, t.device)
                  for t in (query, key, value)))
    except (TypeError, RuntimeError):  # an unhashable argument; a nested tensor's shape
        return None


def _validate(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
              additional_keys, additional_values, attention_kwargs, backend, hints, return_lse,
              rpb):
    """NATTEN's checks of one call, raising what NATTEN raises; ``(Neighborhood, scale,
    engine)``. ``hints``: the tuning arguments (``None``: all their defaults, valid)."""
    layout = "[B, *spatial, H, D]"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if getattr(t, "is_nested", False):
            raise NotSupportedError(f"na{rank}d with a nested {name}", {"natten": [
                f"{name} is a nested tensor: fused neighborhood attention does not support "
                f"nested tensors (as NATTEN); the unfused na*d_qk / na*d_av ops do"]})
    check_tensors(query, key, value, rank + 3, layout)
    B, spatial, H, D = query.shape[0], tuple(query.shape[1:-2]), query.shape[-2], query.shape[-1]
    Hkv, Dv = key.shape[-2], value.shape[-1]
    checks.like("key", key, query, "query", expected=(B, *spatial, Hkv, D),
                 what="[B, *spatial, H_kv, D] of query")
    checks.like("value", value, query, "query", expected=(B, *spatial, Hkv, Dv),
                 what="[B, *spatial, H_kv, D_v] of key")
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    # NATTEN: None means the default (stride 1, dilation 1, not causal).
    geom = geometry(spatial, kernel_size, 1 if stride is None else stride,
                    1 if dilation is None else dilation, False if is_causal is None else is_causal)
    # operator.index: the default scale from a concrete head dim, even under dynamic shapes.
    scale = checks.softmax_scale("scale", scale, operator.index(D), error=TypeError)
    engine = options.engine_for(backend, options.NATTEN_NA_BACKENDS)
    if hints is not None:
        options.check_hints(rank, **hints)
    if attention_kwargs is not None and not isinstance(attention_kwargs, dict):
        raise TypeError(f"attention_kwargs must be a dict or None, got "
                        f"{type(attention_kwargs).__name__}")
    _check_extra_pair(additional_keys, additional_values)
    checks.flag("return_lse", return_lse)
    if rpb is not None:
        checks.tensor("rpb", rpb, floating=True)
        check_rpb(rpb, H, geom.kernel_size, geom.is_causal, query)
    return geom, scale, engine


def _na(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
        additional_keys, additional_values, attention_kwargs, backend, hints, return_lse, rpb):
    cache = None
    if hints is None and additional_keys is None and attention_kwargs is None and rpb is None:
        cache = _call_key(rank, query, key, value, kernel_size, stride, dilation, is_causal,
                          scale, backend, return_lse)
    found = None if cache is None else _VALIDATED.get(cache)
    if found is None:
        found = _validate(rank, query, key, value, kernel_size, stride, dilation, is_causal,
                          scale, additional_keys, additional_values, attention_kwargs, backend,
                          hints, return_lse, rpb)
        if cache is not None:
            _VALIDATED.put(cache, found)
    geom, scale, engine = found
    B, spatial, H, D = query.shape[0], tuple(query.shape[1:-2]), query.shape[-2], query.shape[-1]
    Hkv, Dv = key.shape[-2], value.shape[-1]
    S = geom.num_tokens
    with deterministic_scope():
        out, lse = neighborhood_attention(query, key, value, geom, scale, rpb, backend=engine)
        if additional_keys is not None:
            checks.tensor("additional_keys", additional_keys, ndim=4,
                           what="[B, n_extra, H_kv, D]", floating=True)
            checks.tensor("additional_values", additional_values, ndim=4,
                           what="[B, n_extra, H_kv, D_v]", floating=True)
            n = additional_keys.shape[1]
            checks.like("additional_keys", additional_keys, query, "query",
                         expected=(B, n, Hkv, D), what="[B, n_extra, H_kv, D]")
            checks.like("additional_values", additional_values, query, "query",
                         expected=(B, n, Hkv, Dv), what="[B, n_extra, H_kv, D_v]")
            # NATTEN sends attention_kwargs to the attention over the additional keys.
            extra, extra_lse = attention(query.reshape(B, S, H, D), additional_keys,
                                         additional_values, scale=scale, return_lse=True,
                                         **(attention_kwargs or {}))
            out, lse = merge_partial([out, extra], [lse, extra_lse])
    out = out.reshape(B, *spatial, H, Dv)
    lse = lse.reshape(B, *spatial, H)
    return (out, lse) if return_lse else out


def _check_extra_pair(additional_keys, additional_values) -> None:
    if (additional_keys is None) != (additional_values is None):
        raise ValueError("additional_keys and additional_values must be given together")


_FUSED_DOC = """{rank}-D neighborhood attention (NATTEN 0.21 ``na{rank}d``, same signature), heads-last.

    Args:
        query: ``[B, {axes}, H, D]``; key ``[B, {axes}, H_kv, D]``; value ``[B, {axes}, H_kv, D_v]``
            (``H % H_kv == 0``: query head ``h`` reads kv head ``h // (H // H_kv)``).
        kernel_size, stride, dilation: int or {rank}-tuple; ``kernel >= 2``, ``stride <= kernel``,
            ``kernel * dilation <= axis length``; ``None`` stride/dilation mean 1.
        is_causal: bool or {rank}-tuple of bools (per axis); ``None`` means ``False``.
        scale: softmax scale, ``D ** -0.5`` by default.
        additional_keys, additional_values: ``[B, n_extra, H_kv, D(_v)]`` keys every query also
            sees; merged with the neighborhood result through the log-sum-exps.
        attention_kwargs: keyword arguments of the ``attention`` call over the additional keys.
        backend: NATTEN's names (``"cutlass-fna"``, ``"hopper-fna"``, ``"blackwell-fna"``,
            ``"flex-fna"``) let cudnn_attn pick its fastest engine; ours (``"auto"``, ``"cudnn"``,
            ``"cupy"``, ``"torch"``) pick that one. Others raise ``NotImplementedError``.
        q_tile_shape, kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape,
        backward_kv_splits, backward_use_pt_reduction, run_persistent_kernel, kernel_schedule,
        torch_compile: tuning of NATTEN's kernels: validated as NATTEN does, then hints only
            (the engines choose their own tiles); they never change the result.
        return_lse: also return ``lse`` ``[B, {axes}, H]``, float32 (float64 for float64 inputs).
        rpb: keyword-only, relative positional bias ``[H, {rpb}]`` (NATTEN 0.17; odd kernels,
            non-causal), added after scaling: slot key ``j`` of query ``i`` reads ``(j - i) /
            dilation + kernel - 1`` per axis. Differentiable.

    Returns:
        ``out`` ``[B, {axes}, H, D_v]``, or ``(out, lse)``. A kernel spanning every axis runs as
        plain attention (as NATTEN's self-attention fast path).

    Equivalent PyTorch (``visible`` the NATTEN neighbor mask on the flattened tokens, ``bias`` the
    rpb per (query, key), ``-inf`` off the neighborhood)::

        s = scale * q @ k.transpose(-1, -2) + bias          # per head, tokens flattened
        s = torch.cat([s.masked_fill(~visible, -inf), scale * q @ k_extra.transpose(-1, -2)], -1)
        out = torch.softmax(s, -1) @ torch.cat([v, v_extra]);  lse = s.logsumexp(-1)
    """


def _call(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
          additional_keys, additional_values, attention_kwargs, backend, q_tile_shape,
          kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape, backward_kv_splits,
          backward_use_pt_reduction, run_persistent_kernel, kernel_schedule, torch_compile,
          return_lse, rpb):
    """One neighborhood call from the arguments of ``na{rank}d``, in their order. (Passed one by
    one, not as ``locals()``: torch.compile before torch 2.13 cannot trace ``locals()``.)"""
    hints = options.tuning(dict(q_tile_shape=q_tile_shape, kv_tile_shape=kv_tile_shape,
                                backward_q_tile_shape=backward_q_tile_shape,
                                backward_kv_tile_shape=backward_kv_tile_shape),
                           backward_kv_splits, backward_use_pt_reduction, run_persistent_kernel,
                           kernel_schedule, torch_compile)
    return _na(rank, query, key, value, kernel_size, stride, dilation, is_causal, scale,
               additional_keys, additional_values, attention_kwargs, backend, hints, return_lse,
               rpb)


# The signatures are written out (not generated) so that they read as NATTEN's, in the source
# and to inspect.signature.
def na1d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size: int | Sequence[int],
         stride: int | Sequence[int] = 1, dilation: int | Sequence[int] = 1,
         is_causal: bool | Sequence[bool] = False, scale: float | None = None,
         additional_keys: torch.Tensor | None = None, additional_values: torch.Tensor | None = None,
         attention_kwargs: dict | None = None, backend: str | None = None, q_tile_shape: Sequence[int] | None = None,
         kv_tile_shape: Sequence[int] | None = None,
         backward_q_tile_shape: Sequence[int] | None = None,
         backward_kv_tile_shape: Sequence[int] | None = None,
         backward_kv_splits: Sequence[int] | None = None, backward_use_pt_reduction: bool = False,
         run_persistent_kernel: bool = True, kernel_schedule: str | None = None, torch_compile: bool = False,
         return_lse: bool = False, *, rpb: torch.Tensor | None = None,
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return _call(1, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                 additional_keys, additional_values, attention_kwargs, backend, q_tile_shape,
                 kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape, backward_kv_splits,
                 backward_use_pt_reduction, run_persistent_kernel, kernel_schedule, torch_compile,
                 return_lse, rpb)


def na2d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size: int | Sequence[int],
         stride: int | Sequence[int] = 1, dilation: int | Sequence[int] = 1,
         is_causal: bool | Sequence[bool] = False, scale: float | None = None,
         additional_keys: torch.Tensor | None = None, additional_values: torch.Tensor | None = None,
         attention_kwargs: dict | None = None, backend: str | None = None, q_tile_shape: Sequence[int] | None = None,
         kv_tile_shape: Sequence[int] | None = None,
         backward_q_tile_shape: Sequence[int] | None = None,
         backward_kv_tile_shape: Sequence[int] | None = None,
         backward_kv_splits: Sequence[int] | None = None, backward_use_pt_reduction: bool = False,
         run_persistent_kernel: bool = True, kernel_schedule: str | None = None, torch_compile: bool = False,
         return_lse: bool = False, *, rpb: torch.Tensor | None = None,
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return _call(2, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                 additional_keys, additional_values, attention_kwargs, backend, q_tile_shape,
                 kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape, backward_kv_splits,
                 backward_use_pt_reduction, run_persistent_kernel, kernel_schedule, torch_compile,
                 return_lse, rpb)


def na3d(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel_size: int | Sequence[int],
         stride: int | Sequence[int] = 1, dilation: int | Sequence[int] = 1,
         is_causal: bool | Sequence[bool] = False, scale: float | None = None,
         additional_keys: torch.Tensor | None = None, additional_values: torch.Tensor | None = None,
         attention_kwargs: dict | None = None, backend: str | None = None, q_tile_shape: Sequence[int] | None = None,
         kv_tile_shape: Sequence[int] | None = None,
         backward_q_tile_shape: Sequence[int] | None = None,
         backward_kv_tile_shape: Sequence[int] | None = None,
         backward_kv_splits: Sequence[int] | None = None, backward_use_pt_reduction: bool = False,
         run_persistent_kernel: bool = True, kernel_schedule: str | None = None, torch_compile: bool = False,
         return_lse: bool = False, *, rpb: torch.Tensor | None = None,
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return _call(3, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                 additional_keys, additional_values, attention_kwargs, backend, q_tile_shape,
                 kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape, backward_kv_splits,
                 backward_use_pt_reduction, run_persistent_kernel, kernel_schedule, torch_compile,
                 return_lse, rpb)


def neighborhood_attention_generic(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                   kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                                   dilation: int | Sequence[int] = 1,
                                   is_causal: bool | Sequence[bool] = False, scale: float | None = None,
                                   additional_keys: torch.Tensor | None = None,
                                   additional_values: torch.Tensor | None = None,
                                   attention_kwargs: dict | None = None, backend: str | None = None,
                                   q_tile_shape: Sequence[int] | None = None,
                                   kv_tile_shape: Sequence[int] | None = None,
                                   backward_q_tile_shape: Sequence[int] | None = None,
                                   backward_kv_tile_shape: Sequence[int] | None = None,
                                   backward_kv_splits: Sequence[int] | None = None,
                                   backward_use_pt_reduction: bool = False,
                                   run_persistent_kernel: bool = True, kernel_schedule: str | None = None,
                                   torch_compile: bool = False, return_lse: bool = False, *,
                                   rpb: torch.Tensor | None = None,
                                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``na1d``/``na2d``/``na3d`` by the query's rank (NATTEN 0.21's ``natten.functional`` name)."""
    checks.tensor("query", query)
    if not 4 <= query.dim() <= 6:
        raise ValueError(f"query must be [B, *spatial, H, D] with 1 to 3 spatial axes, got shape "
                         f"{tuple(query.shape)}")
    return _call(query.dim() - 3, query, key, value, kernel_size, stride, dilation, is_causal, scale,
                 additional_keys, additional_values, attention_kwargs, backend, q_tile_shape,
                 kv_tile_shape, backward_q_tile_shape, backward_kv_tile_shape, backward_kv_splits,
                 backward_use_pt_reduction, run_persistent_kernel, kernel_schedule, torch_compile,
                 return_lse, rpb)


# ---------------------------------------------------------------------------------------------
# attention (NATTEN 0.21's dense and varlen entry)
# ---------------------------------------------------------------------------------------------

def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              is_causal: bool | Sequence[bool] = False, scale: float | None = None,
              seqlens_Q: torch.Tensor | None = None, seqlens_KV: torch.Tensor | None = None,
              cumulative_seqlen_Q: torch.Tensor | None = None,
              cumulative_seqlen_KV: torch.Tensor | None = None, max_seqlen_Q: int | None = None,
              max_seqlen_KV: int | None = None, backend: str | None = None, q_tile_size: int | None = None,
              kv_tile_size: int | None = None, backward_q_tile_size: int | None = None,
              backward_kv_tile_size: int | None = None, backward_kv_splits: int | None = None,
              backward_use_pt_reduction: bool = False,
              run_persistent_kernel: bool = True, kernel_schedule: str | None = None,
              torch_compile: bool = False, return_lse: bool = False,
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain attention with NATTEN 0.21's ``natten.attention`` signature, heads-last.

    Args:
        query: ``[B, S_q, H, D]``; key ``[B, S_kv, H_kv, D]``; value ``[B, S_kv, H_kv, D_v]``.
        is_causal: causal mask, top-left aligned (query ``i`` sees keys ``j <= i``).
        scale: softmax scale, ``D ** -0.5`` by default.
        seqlens_Q, seqlens_KV: varlen by lengths (``B == 1``, sequences packed on axis 1), or
        cumulative_seqlen_Q, cumulative_seqlen_KV, max_seqlen_Q, max_seqlen_KV: by offsets.
        backend and the tuning arguments: as in ``na1d`` (NATTEN's ``*-fmha`` names).
        return_lse: also return ``lse`` ``[B, S_q, H]``.

    Returns:
        ``out`` ``[B, S_q, H, D_v]``, or ``(out, lse)``.

    Equivalent PyTorch::

        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=is_causal,
                                             scale=scale, enable_gqa=True).transpose(1, 2)
    """
    engine = options.engine_for(backend, options.NATTEN_FMHA_BACKENDS)
    hints = options.tuning(dict(q_tile_size=q_tile_size, kv_tile_size=kv_tile_size,
                                backward_q_tile_size=backward_q_tile_size,
                                backward_kv_tile_size=backward_kv_tile_size),
                           backward_kv_splits, backward_use_pt_reduction, run_persistent_kernel,
                           kernel_schedule, torch_compile)
    if hints is not None:
        options.check_hints(None, **hints)
    check_tensors(query, key, value, 4, "[B, S, H, D]")
    if not isinstance(is_causal, bool):
        raise NattenValueError(f"is_causal must be a bool, got {is_causal!r}")
    checks.flag("return_lse", return_lse)
    mask = Causal() if is_causal else None
    with deterministic_scope():
        cu = varlen_args.offsets(query, key, seqlens_Q, seqlens_KV, cumulative_seqlen_Q,
                            cumulative_seqlen_KV, max_seqlen_Q, max_seqlen_KV)
        if cu is None:
            out, lse = _attention(query, key, value, mask=mask, scale=scale, layout="bshd",
                                  return_lse=True, backend=engine)
            lse = lse.transpose(1, 2)
        else:
            out, lse = attention_varlen(query[0], key[0], value[0], *cu, mask=mask, scale=scale,
                                        return_lse=True, backend=engine)
            out, lse = out[None], lse.transpose(0, 1)[None]
    return (out, lse) if return_lse else out


def _document():
    for rank in (1, 2, 3):
        globals()[f"na{rank}d"].__doc__ = _FUSED_DOC.format(**doc_fields(rank))


_document()
