"""The builder's packed (THD) calls: cuDNN's ragged layout from the builder.

``q`` ``[total_q, H_q, D_qk]``, ``k``/``v`` ``[total_kv, H_kv, D]`` (token-major, each sequence's
tokens back to back) with ``set_cu_seq_len_q`` / ``set_cu_seq_len_kv`` (or ``set_seq_len_*``): the
cumulative lengths are the ragged offsets cuDNN would get (``cu * H * D`` elements). ``o`` is
``[total_q, H_q, D_v]``, ``stats`` ``[total_q, H_q, 1]`` (cuDNN's token-major "TH1" stats).

The cuDNN engine runs the packed tensors as they lie (``packed.calls.varlen_problem``); where no
engine addresses packed storage (the CPU) the call runs through ``attention_varlen``, which
batches the sequences by length. Masks and ALiBi are the builder's, applied inside each sequence.
"""

from __future__ import annotations

import dataclasses

import torch

from ...core import execution
from ...errors import NotSupportedError
from ...model.masks import Alibi
from ...model.inputs import DropoutState, Inputs
from ...packed.calls import varlen_problem
from ...varlen import attention_varlen
from ._translate import band_mask, translate

__all__ = ["is_packed", "forward", "backward"]


def is_packed(q, k, v) -> bool:
    """Whether a call's tensors are all packed ``[total, H, D]`` (otherwise the dense checks
    explain what is wrong)."""
    return all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (q, k, v))


def _side(attrs, side: str):
    lengths = getattr(attrs, f"seq_len_{side}")
    if lengths is None:
        lengths = getattr(attrs, f"cu_seq_len_{side}")
    if lengths is None and attrs.padding is not None:
        lengths = attrs.padding[0 if side == "q" else 1]
    if lengths is None:
        raise ValueError(f"packed [total, H, D] tensors need their lengths: set_cu_seq_len_{side} "
                         f"(or set_seq_len_{side}) with set_padding_mask(True)")
    return lengths


def _offsets(lengths, device) -> torch.Tensor:
    """``[B + 1]`` int32 cumulative offsets on ``device`` from host or device lengths."""
    t = lengths if isinstance(lengths, torch.Tensor) else torch.tensor(lengths)
    t = t.to(device, non_blocking=True)
    return torch.cat([t.new_zeros(1), t.cumsum(0)]).to(torch.int32)


class _Call:
    """One packed call's arguments, checked with cuDNN's rules."""

    def __init__(self, attrs, q, k, v, backward: bool):
        extras = [getattr(attrs, name, None) for name in ("bias", "k_table", "v_table",
                                                          "sink_token")]
        if any(x is not None for x in extras) \
                or (attrs.dropout is not None and attrs.dropout[0] == "mask"):
            raise NotSupportedError("cuDNN SDPA with packed tensors", {"cudnn": [
                "this builder runs packed (ragged) tensors without a bias, page tables, a "
                "dropout mask or sink tokens"]})
        lens_q, lens_kv = _side(attrs, "q"), _side(attrs, "kv")
        self.batch = len(lens_q)
        # Host lengths give the exact longest sequence; device ones are bounded by the tokens.
        self.max_q = q.shape[0] if isinstance(lens_q, torch.Tensor) else max(max(lens_q), 1)
        self.max_kv = k.shape[0] if isinstance(lens_kv, torch.Tensor) else max(max(lens_kv), 1)
        logical = [torch.empty(self.batch, t.shape[1], seq, t.shape[2], dtype=t.dtype,
                               device="meta") for t, seq in ((q, self.max_q), (k, self.max_kv),
                                                             (v, self.max_kv))]
        translate(attrs, *logical, backward=backward, packed=True)  # cuDNN's rejections
        self.cu_q, self.cu_kv = _offsets(lens_q, q.device), _offsets(lens_kv, q.device)
        self.mask = band_mask(attrs)
        self.alibi = Alibi() if attrs.alibi else None
        self.scale = attrs.attn_scale
        self.dropout_p, self.dropout = 0.0, None
        if attrs.dropout is not None and attrs.dropout[1] > 0:
            self.dropout_p, self.dropout = attrs.dropout[1], DropoutState(*attrs.dropout[2:])

    def native(self, q, k, v, grad: bool):
        """``(engine, problem, plan)`` on an engine that runs packed storage as it lies, or
        ``None`` (then ``varlen``: the dense-batch route every surface shares)."""
        problem = varlen_problem(q, k, v, self.cu_q, self.cu_kv, self.max_q, self.max_kv,
                                 mask=self.mask, bias=self.alibi, read=False, scale=self.scale,
                                 dropout_p=self.dropout_p, return_lse=True)
        # The Philox stream is cuDNN's: no other engine replays it, so a decline raises.
        return execution.plan_stored(dataclasses.replace(problem, requires_grad=grad),
                                     required=self.dropout_p > 0)

    def varlen(self, q, k, v):
        return attention_varlen(q, k, v, self.cu_q, self.cu_kv, self.max_q, self.max_kv,
                                mask=self.mask, bias=self.alibi, scale=self.scale,
                                return_lse=True)


def forward(attrs, q, k, v, need_stats: bool):
    """``(o [total_q, H_q, D_v], stats [total_q, H_q, 1] or None)``."""
    q, k, v = (t.detach().contiguous() for t in (q, k, v))
    call = _Call(attrs, q, k, v, backward=False)
    found = call.native(q, k, v, grad=False)
    if found is not None:
        _, problem, plan = found
        out, lse = execution.forward(problem, plan, Inputs(q, k, v, None, call.dropout))
    else:
        out, lse = call.varlen(q, k, v)
    return out, (lse.t().unsqueeze(-1).contiguous() if need_stats else None)


def backward(attrs, q, k, v, o, dO, stats):
    """``(dq, dk, dv)`` of a packed call from its ``o`` and ``stats``."""
    q, k, v, o, dO = (t.detach().contiguous() for t in (q, k, v, o, dO))
    call = _Call(attrs, q, k, v, backward=True)
    if tuple(stats.shape[:2]) != (q.shape[0], q.shape[1]):
        raise ValueError(f"stats of a packed call must be [total_q, H_q, 1] = "
                         f"{[q.shape[0], q.shape[1], 1]}, got {tuple(stats.shape)}")
    lse = stats.detach().reshape(q.shape[0], q.shape[1]).t()
    found = call.native(q, k, v, grad=True)
    if found is not None:
        _, problem, plan = found
        dq, dk, dv, _ = execution.backward(problem, plan, Inputs(q, k, v, None, call.dropout), o,
                                           lse, dO)
        return dq, dk, dv
    with torch.enable_grad():  # the same call again, differentiated (no dropout here)
        leaves = [t.requires_grad_(True) for t in (q.clone(), k.clone(), v.clone())]
        out, _ = call.varlen(*leaves)
        return torch.autograd.grad(out, leaves, dO)
