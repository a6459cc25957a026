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
  bound is ``left + 1``: see ``diagonal_band_bounds()``.
* cuDNN's diagonal band: ``set_diagonal_alignment``, ``set_diagonal_band_left_bound(L)``
  (exclusive: ``j > i' - L``), ``set_diagonal_band_right_bound(R)`` (``j <= i' + R``),
  ``set_sliding_window_length`` (the left bound wins over it); the causal setters fix the
  alignment and ``R = 0`` (``band()`` gives the effective triple). The FlashAttention-style
  ``set_sliding_window`` above is this builder's extra, ANDed with the band.
* ``set_alibi_mask(True)``: cuDNN's ALiBi, ``slope_h * (j - i)`` with the paper's slopes for
  ``H_q`` heads; cuDNN accepts it only with ``R = 0`` and top-left alignment (so it equals
  ``Alibi()``), and so does this builder. With a bias tensor too, the engine adds both.
* What cuDNN's validator rejects raises ``NotSupportedError`` with cuDNN's reason
  (``_translate``); ``tests/builder_grid.py`` checks the verdicts against cuDNN's own validator.
* ``set_dropout(p, seed, offset)``: the call's ``DropoutState(seed, offset)``: every engine draws
  its mask from that pair alone, so forward and backward see the same mask. Only the cuDNN engine
  draws the bits cuDNN's Philox would; the torch engine has its own stream for the pair.
* ``set_dropout(mask, scale[, scale_inv])``: ``o = (P * mask * scale) @ V`` with ``mask``
  broadcastable to ``[B, H, S_q, S_kv]``; it becomes the problem's ``dropout_mask`` (and
  ``dropout_scale``) and runs on the selected engine like any other call. ``scale_inv`` must
  equal ``1 / scale``.
* ``set_sink_token(t)`` (``[1, H_q, 1, 1]`` float logits): attention sinks; the stats include
  them, as cuDNN's. The backward's ``set_dSink_token(t)`` receives their gradient (written into
  ``t``), as ``set_dbias(t)`` receives the bias's. ``k`` and ``v`` may have different head counts, both dividing ``H_q``.
* ``set_paged_attention_k_table`` / ``_v_table`` (forward): ``k``/``v`` are cuDNN's paged containers
  ``[num_blocks, H_k, page_size, D]``; ``set_paged_attention_max_seq_len_kv`` bounds the keys. On an
  accelerator the cuDNN engine reads the containers through the tables (no gathering); elsewhere,
  or where cuDNN declines, the pages are gathered into dense keys.
* ``set_compute_data_type`` takes ``torch.float32`` or ``cudnn.data_type.FLOAT`` (every engine
  computes in float32; float64 inputs stay float64 on the torch engine).
* ``set_score_mod(fn)`` / ``set_score_mod_bprop(fn)``: cuDNN's callables, recorded as a program
  (``cudnn_attn.model.score_mods``) that every engine means the same way: the torch engine interprets
  it, the cuDNN engine replays it onto its graph. Applied to the scaled scores before bias and
  masks; like cuDNN, it excludes the built-in band, padding and ALiBi.
* ``set_block_mask(mask)`` (cuDNN's uint8 tile bitmask, forward) becomes ``-inf`` on the dropped
  pairs, so it runs on every engine (cuDNN plans its own block mask only on sm_100+).
* ``set_logit_max`` / ``set_score_sum_exp`` / ``set_rng_dump`` receive those outputs (computed by
  the torch engine, which such calls run on); ``set_unfuse_fma`` / ``set_mma_core_mode`` are
  recorded kernel hints; ``set_stats_use_log2`` gives base-2 stats. See ``_score_attrs``.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ...model import checks
from ...core import execution
from ...packed import calls
from ...errors import NotSupportedError
from ...rewrites.kv_heads import head_counts_differ, repeat_to_common_heads, sum_to_heads
from ...model.problem import AttnProblem
from ...rewrites.sinks import check_sinks, merge_sinks, sink_gradient
from ...model.inputs import DropoutState, Inputs, hide_padded_rows
from ...model.storage import Paged
from ...packed.calls import meta_like
from . import _extras, packed
from ._attrs import SdpaAttributes, SdpaBackwardAttributes
from ._translate import check_broadcast, translate

__all__ = ["SdpaAttributes", "SdpaBackwardAttributes", "scaled_dot_product_flash_attention",
           "scaled_dot_product_flash_attention_backward"]


def _problem(attrs, q, k, v, need_stats, backward=False, storage=None):
    """``(problem, plan, inputs)`` of the call: dropout as Philox ``(p, seed, offset)`` or as an
    explicit ``(mask, scale)`` (``AttnProblem.dropout_mask``), run by the selected plan.
    With ``storage`` (paged pools), ``k``/``v`` only describe the logical keys (meta)."""
    mask, bias, alibi = translate(attrs, q, k, v, backward)
    if not backward:  # cuDNN's block mask is a forward attribute
        bias = _extras.with_block_mask(attrs, bias, q, k)
    dropout_p, dropout, extra, keep = 0.0, None, {}, None
    if attrs.dropout is not None and attrs.dropout[0] == "philox" and attrs.dropout[1] > 0:
        dropout_p, dropout = attrs.dropout[1], DropoutState(*attrs.dropout[2:])
    elif attrs.dropout is not None and attrs.dropout[0] == "mask":
        keep = attrs.dropout[1]
        if keep.device != q.device:
            raise ValueError(f"set_dropout: mask must be on q's device {q.device}, got "
                             f"{keep.device}")
        check_broadcast("set_dropout: mask", keep, (q.shape[0], q.shape[1], q.shape[2],
                                                    k.shape[2]))
        extra = dict(dropout_mask=keep, dropout_scale=attrs.dropout[2])
    described = (q, k, v, bias) if storage is None else map(meta_like, (q, k, v, bias))
    q_, k_, v_, bias_ = described
    if storage is not None and keep is not None:
        extra["dropout_mask"] = meta_like(keep)
    problem = AttnProblem.from_tensors(q_, k_, v_, mask=mask, bias=bias_, alibi=alibi,
                                       scale=attrs.attn_scale,
                                       dropout_p=dropout_p, layout="bhsd", return_lse=need_stats,
                                       score_mod=_extras.score_mod_of(attrs), **extra)
    if storage is not None:
        problem = dataclasses.replace(problem, device=q.device, storage=storage)
    if getattr(attrs, "deterministic", False):
        # A deterministic backward is a different plan (plan_key includes the flag).
        problem = dataclasses.replace(problem, deterministic=True)
    if backward and getattr(attrs, "dbias", None) is not None:
        problem = dataclasses.replace(problem, requires_grad=True, bias_requires_grad=True)
    # A Philox stream is replayed by the engine that drew it (execution.plan_call pins it); the
    # torch engine reports logit_max / score_sum_exp / rng_dump (cuDNN's are not bound).
    _, problem, plan = execution.plan_call(
        problem, "torch" if _extras.needs_torch_engine(attrs) else "auto")
    return problem, plan, Inputs(q, k, v, bias, dropout, dropout_mask=keep)


def _paged_natively(attrs, q, k, v, need_stats):
    """``(problem, plan, inputs)`` reading cuDNN's paged containers through the page tables on
    an engine that addresses them (cuDNN on an accelerator), or ``None`` (then ``_unpage``)."""
    if not calls.on_accelerator(q) or not isinstance(k, torch.Tensor) or k.dim() != 4 \
            or not isinstance(v, torch.Tensor) or v.dim() != 4 or k.shape[:3] != v.shape[:3] \
            or attrs.k_table.shape != attrs.v_table.shape:
        return None
    num_blocks, heads, page, _ = k.shape
    capacity = attrs.k_table.shape[1] * page
    if attrs.max_seq_len_kv not in (None, capacity) or q.shape[1] % heads:
        return None
    logical = [torch.empty(q.shape[0], heads, capacity, t.shape[3], dtype=t.dtype, device="meta")
               for t in (k, v)]
    storage = Paged(num_blocks, page, attrs.k_table.to(q.device, non_blocking=True), "bhsd",
                    attrs.v_table.to(q.device, non_blocking=True))
    try:
        problem, plan, inputs = _problem(attrs, q, *logical, need_stats, storage=storage)
    except NotSupportedError:
        return None
    return problem, plan, Inputs(q, k, v, inputs.bias, inputs.dropout, inputs.dropout_mask)


def _unpage(attrs, q, k, v):
    """Dense ``[B, H_k, S_kv, D]`` keys/values of a paged call (cuDNN's paged containers
    ``[num_blocks, H_k, page_size, D]`` read through the page tables), else ``k``, ``v``."""
    paged = attrs.k_table is not None or attrs.v_table is not None
    if not paged:
        if attrs.max_seq_len_kv is not None:
            raise NotSupportedError("cuDNN SDPA", {"cudnn": [
                "When not using paged attention, there is no need to explicitly set max kv "
                "sequence length."]})
        return k, v
    if attrs.k_table is None or attrs.v_table is None:
        raise ValueError("paged attention needs both set_paged_attention_k_table and "
                         "set_paged_attention_v_table")
    if not attrs.use_padding and attrs.padding is None:
        raise NotSupportedError("cuDNN SDPA", {"cudnn": [
            "Paged caches can only be used in combination with padding mask and variable "
            "sequence lengths for both Q and KV."]})
    dense = []
    for name, cache, table in (("k", k, attrs.k_table), ("v", v, attrs.v_table)):
        checks.tensor(name, cache, ndim=4, what="[num_blocks, H_k, page_size, D] (paged)")
        if table.shape[0] != q.shape[0] or table.device not in (cache.device,
                                                                 torch.device("cpu")):
            raise ValueError(f"the {name} page table must be [B={q.shape[0]}, pages] on "
                             f"{cache.device}, got {tuple(table.shape)} on {table.device}")
        if int(table.max()) >= cache.shape[0] or int(table.min()) < 0:
            raise ValueError(f"the {name} page table points outside the {cache.shape[0]} "
                             f"blocks of {name}")
        pages = cache[table.to(cache.device).long()]        # [B, pages, H, page_size, D]
        full = pages.permute(0, 2, 1, 3, 4).flatten(2, 3)   # [B, H, pages * page_size, D]
        length = attrs.max_seq_len_kv or full.shape[2]
        dense.append(full[:, :, :length])
    return dense[0], dense[1]


def _check_attrs(attrs, cls, fn):
    if not isinstance(attrs, cls):
        raise TypeError(f"{fn}: attrs must be {cls.__name__}, got {type(attrs).__name__}")


def scaled_dot_product_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                       attrs: SdpaAttributes,
                                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(o, stats)`` of SDPA with the attributes ``attrs`` (cuDNN's forward).

    ``q`` ``[B, H_q, S_q, D_qk]``, ``k`` ``[B, H_kv, S_kv, D_qk]``, ``v`` ``[B, H_kv, S_kv, D_v]``
    (any strides; ``H_q % H_kv == 0``). ``o`` is ``[B, H_q, S_q, D_v]`` in q's dtype, ``stats``
    ``[B, H_q, S_q, 1]`` float32 (float64 for float64 inputs) or ``None`` for inference.
    Packed (ragged) calls take ``[total, H, D]`` tensors with ``set_cu_seq_len_q/kv`` and give
    ``o`` ``[total_q, H_q, D_v]``, ``stats`` ``[total_q, H_q, 1]`` (``compat.cudnn_frontend.packed``).

    Equivalent PyTorch (no GQA; ``visible`` the causal/window/padding mask)::

        s = attn_scale * q @ k.transpose(-1, -2) + bias          # + ALiBi
        s = s.masked_fill(~visible, float("-inf"))
        stats = s.logsumexp(-1, keepdim=True)
        o = (torch.softmax(s, -1) * keep * dropout_scale) @ v
    """
    _check_attrs(attrs, SdpaAttributes, "scaled_dot_product_flash_attention")
    if packed.is_packed(q, k, v):  # [total, H, D]: cuDNN's ragged layout (compat.cudnn_frontend.packed)
        return packed.forward(attrs, q, k, v, attrs.generate_stats)
    q, k, v = (t.detach() if isinstance(t, torch.Tensor) else t for t in (q, k, v))
    need = attrs.generate_stats
    sinks = attrs.sink_token
    call = None
    if attrs.k_table is not None and attrs.v_table is not None and \
            (attrs.use_padding or attrs.padding is not None):
        call = _paged_natively(attrs, q, k, v, need or sinks is not None)
    if call is None:
        k, v = _unpage(attrs, q, k, v)
        if head_counts_differ(q, k, v, "bhsd"):  # H_k != H_v, as cuDNN allows
            k, v = repeat_to_common_heads(q, k, v, "bhsd")
        call = _problem(attrs, q, k, v, need or sinks is not None)
    problem, plan, inputs = call
    row_stats: dict | None = {} if attrs.logit_max is not None or attrs.score_sum_exp is not None else None
    o, lse = execution.forward(problem, plan, inputs, need_lse=need or sinks is not None,
                               row_stats=row_stats)
    if row_stats is not None:
        _extras.write_row_stats(attrs, row_stats)
    _dump_rng(attrs, problem, inputs)
    if sinks is not None:
        o, lse = merge_sinks(o, lse, check_sinks(sinks, problem.heads_q, q), "bhsd")
    if need and attrs.stats_use_log2:
        lse = lse / math.log(2.0)
    return o, (lse.unsqueeze(-1) if need else None)


def scaled_dot_product_flash_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                                o: torch.Tensor, dO: torch.Tensor, stats: torch.Tensor,
                                                attrs: SdpaBackwardAttributes,
                                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dQ, dK, dV)`` from the forward's ``o`` and ``stats`` (cuDNN's backward).

    ``attrs`` must describe the forward call (same masks, bias, scale and dropout); the gradients
    have the shapes and dtype of ``q``, ``k``, ``v``. ``stats`` is ``[B, H_q, S_q, 1]`` (or
    ``[B, H_q, S_q]``). Equivalent PyTorch: ``torch.autograd.grad(o, (q, k, v), dO)`` through the
    forward's formula with the same dropout mask.
    """
    fn = "scaled_dot_product_flash_attention_backward"
    _check_attrs(attrs, SdpaBackwardAttributes, fn)
    if packed.is_packed(q, k, v):
        for name, t in (("o", o), ("dO", dO), ("stats", stats)):
            checks.tensor(name, t)
        return packed.backward(attrs, q, k, v, o, dO, stats)
    q, k, v, o, dO, stats = (t.detach() if isinstance(t, torch.Tensor) else t
                             for t in (q, k, v, o, dO, stats))
    _check_backward_inputs(q, v, o, dO, stats)
    if attrs.dsink_token is not None and attrs.sink_token is None:
        raise ValueError("set_dSink_token needs set_sink_token (the forward's sinks)")
    if attrs.dbias is not None:
        if attrs.bias is None:
            raise ValueError("set_dbias needs set_bias (the forward's bias)")
        if tuple(attrs.dbias.shape) != tuple(attrs.bias.shape) \
                or attrs.dbias.device != attrs.bias.device:
            raise ValueError(f"set_dbias: dBias must have the bias's shape "
                             f"{tuple(attrs.bias.shape)} and device {attrs.bias.device}, got "
                             f"{tuple(attrs.dbias.shape)} on {attrs.dbias.device}")
    lse = stats.reshape(stats.shape[:3])
    if attrs.stats_use_log2:
        lse = lse * math.log(2.0)
    repeated = head_counts_differ(q, k, v, "bhsd")
    if repeated:
        heads_k, heads_v = k.shape[1], v.shape[1]
        k, v = repeat_to_common_heads(q, k, v, "bhsd")
    problem, plan, inputs = _problem(attrs, q, k, v, True, backward=True)
    # Positions past seq_len_q/kv are not tokens: whatever they hold never reaches a gradient.
    o, dO = hide_padded_rows(problem, o), hide_padded_rows(problem, dO)
    # With sinks, the forward's stats include them: the engine's backward is then already the
    # backward of attention with sinks (cudnn_attn.rewrites.sinks); only dSink is computed here.
    dq, dk, dv, dbias = execution.backward(problem, plan, inputs, o, lse, dO)
    _dump_rng(attrs, problem, inputs)
    if attrs.dbias is not None:
        attrs.dbias.copy_(dbias.reshape(attrs.dbias.shape))
    if attrs.dsink_token is not None:
        sinks = check_sinks(attrs.sink_token, problem.heads_q, q)
        dsink = sink_gradient(o, lse, dO, sinks, "bhsd")
        if attrs.dsink_token.numel() != dsink.numel():
            raise ValueError(f"set_dSink_token: dSink_token must have H_q = {dsink.numel()} "
                             f"elements, got shape {tuple(attrs.dsink_token.shape)}")
        attrs.dsink_token.copy_(dsink.view(attrs.dsink_token.shape))
    if repeated:
        dk, dv = sum_to_heads(dk, heads_k, "bhsd"), sum_to_heads(dv, heads_v, "bhsd")
    return dq, dk, dv


def _dump_rng(attrs, problem, inputs) -> None:
    """Fill ``set_rng_dump``'s tensor with the call's dropout keep mask (all ones without
    dropout)."""
    if attrs.rng_dump is None:
        return
    shape = (problem.batch, problem.heads_q, problem.seq_q, problem.seq_kv)
    if tuple(attrs.rng_dump.shape) != shape:
        raise ValueError(f"set_rng_dump: the tensor must be [B, H_q, S_q, S_kv] = {list(shape)}, "
                         f"got {tuple(attrs.rng_dump.shape)}")
    if inputs.dropout is None and inputs.dropout_mask is None:
        attrs.rng_dump.fill_(1.0)
    elif inputs.dropout_mask is not None:
        attrs.rng_dump.copy_((inputs.dropout_mask != 0).expand(shape))
    else:
        keep = _extras.keep_mask(problem, inputs)
        attrs.rng_dump.copy_(keep)


def _check_backward_inputs(q, v, o, dO, stats):
    for name, t in (("o", o), ("dO", dO), ("stats", stats)):
        checks.tensor(name, t)
    if not isinstance(q, torch.Tensor) or not isinstance(v, torch.Tensor) \
            or q.dim() != 4 or v.dim() != 4:
        raise ValueError("q and v must be 4-D [B, H, S, D] tensors")
    want_o = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    for name, t in (("o", o), ("dO", dO)):
        if tuple(t.shape) != want_o:
            raise ValueError(f"{name} must have shape [B, H_q, S_q, D_v] = {list(want_o)}, got "
                             f"{tuple(t.shape)}")
    for name, t in (("o", o), ("dO", dO), ("stats", stats)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    for name, t in (("o", o), ("dO", dO)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    want_stats = torch.float64 if q.dtype == torch.float64 else torch.float32
    if stats.dtype != want_stats:
        raise TypeError(f"stats must be {want_stats} (the forward's), got {stats.dtype}")
    if tuple(stats.shape) not in (want_o[:3] + (1,), want_o[:3]) \
            or not stats.dtype.is_floating_point:
        raise ValueError(f"stats must be a float tensor of shape [B, H_q, S_q, 1] = "
                         f"{list(want_o[:3]) + [1]}, got {stats.dtype} {tuple(stats.shape)}")


# Public for the FP8 builder calls (compat.cudnn_frontend.fp8): one paged-container rule.
unpage = _unpage
