"""How a built graph runs: on torch's current stream, and, for the plainest calls, as one
runner bound once per cached call signature.

* ``execute(built, buffers, device)``: ``built`` on torch's current stream of ``device`` with that
  device's handle (under its lock: the backward may run on autograd's thread) and the stream's
  pooled workspace; a graph to autotune is tuned first, on these buffers (never inside a
  CUDA-graph capture: nothing can be timed there). Every graph the engine runs goes through here.
* ``DirectCall``: ``(q, k, v[, bias[, generator[, padding]]]) -> out`` of a call whose graphs
  bind nothing but q, k, v, the scale, out (and the stats and gradients of its backward), the
  lengths of a ``Padding`` (host ints, part of the call's signature, bound once; or tensors,
  passed per call), a bias that needs no gradient and a Philox dropout seed drawn per call: no
  explicit dropout mask, packed or paged storage, sign-carrying scale or lse.
  ``CudnnPlan.direct`` decides which calls qualify.
  Why: such a call spends most of its host time rebuilding, per call, what its signature already
  fixes (buffer dicts, uid lists, the scale tensor, shapes, device lengths); the runner binds
  those once, so the eager path costs about what a minimal ``autograd.Function`` around
  ``execute`` costs (plus, padded, the elementwise ops that hide the padded positions).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from . import _runtime, autotune
from ._emit import UID
from ._spec import contiguous_strides, problem_lengths
from ..core.autograd_node import record_direct
from ..core.probe import kept_if_captured
from ..model.inputs import (DropoutState, Inputs, hide_padded_rows, hide_padding, hides_keys,
                            is_full_lengths, length_positions)

__all__ = ["execute", "execute_backward", "aligned_inputs", "DirectCall", "Extras", "NO_EXTRAS",
           "PerCall", "extras_of"]

_Q, _K, _V, _O, _SCALE, _STATS = (int(UID.Q), int(UID.K), int(UID.V), int(UID.O),
                                  int(UID.SCALE), int(UID.STATS))
_DO, _DQ, _DK, _DV = int(UID.DO), int(UID.DQ), int(UID.DK), int(UID.DV)
_SEQ_LEN_Q, _SEQ_LEN_KV, _BIAS = int(UID.SEQ_LEN_Q), int(UID.SEQ_LEN_KV), int(UID.BIAS)
_SEED, _OFFSET = int(UID.DROPOUT_SEED), int(UID.DROPOUT_OFFSET)


def execute(built, buffers: dict, device: torch.device) -> None:
    """``built`` on torch's current stream of ``device`` (see the module's docstring)."""
    context = _runtime.stream_context(device)
    if built.autotune and not built.tuned and not _runtime.capturing():
        with context.shared.lock:
            if not built.tuned:  # another thread may have tuned it meanwhile
                built.tune(buffers, context.workspace, context.shared.bind(context.stream),
                           autotune.cuda_time_ms)
    context.execute(built, buffers, built.workspace_size)


def aligned_inputs(q, k, v) -> tuple:
    """``(q, k, v)`` themselves when their base pointers are ``ALIGNMENT``-byte aligned (one
    test for the three), else aligned copies (rare: ``_runtime.aligned``)."""
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % _runtime.ALIGNMENT:
        return _runtime.aligned(q), _runtime.aligned(k), _runtime.aligned(v)
    return q, k, v


def execute_backward(built, buffers: dict, dout, stats, grads: tuple, device) -> tuple:
    """``built`` (a backward graph) on ``buffers`` (what its forward bound, out included), with
    dO as the graph reads O (contiguous and aligned: autograd may hand an expanded one), the
    forward's stats, and ``grads`` (dq, dk, dv) to write; returns ``grads``."""
    buffers[_DO] = _runtime.aligned(dout.contiguous())
    buffers[_STATS] = stats
    buffers[_DQ], buffers[_DK], buffers[_DV] = grads
    execute(built, buffers, device)
    return grads


class Extras(NamedTuple):
    """What a runner binds besides q, k, v, the scale and out (each ``None`` when its graphs
    have none): ``padded``, the problem of a ``Padding`` whose padded positions are hidden per
    call as the full path hides them (``model.inputs.hide_padding``); ``lengths``, the
    ``[B, 1, 1, 1]`` int32 device lengths of static lengths the graphs read (also a bias graph's
    full-length padding mask); ``empty``, the ``empty_views`` of their rows that see no key;
    ``runtime_spec``, the graph spec of a ``Padding`` with tensor lengths, which each call
    brings (``__call__``'s ``padding``: its lengths, empty rows and positions are made per call,
    on the device); ``bias_spec``, the graph spec of a bias the call passes, which ``bias_copy``
    says ``_runtime.bias_operand`` copies (else the bias is bound itself); ``dropout``: the
    graphs drop weights with a Philox stream whose seed each call draws from its generator
    (``DropoutState.draw``); ``fixed``: the ``PerCall`` of every call, when nothing but the
    bound-once lengths is bound (a graph's full-length padding mask: ``_spec._open_tiles``)."""

    padded: object = None
    lengths: Optional[tuple] = None
    empty: Optional[tuple] = None
    runtime_spec: object = None
    bias_spec: object = None
    bias_copy: bool = False
    dropout: bool = False
    fixed: object = None


NO_EXTRAS = Extras()


class PerCall(NamedTuple):
    """What one call of a runner with ``Extras`` binds: its bias (hidden where padded), its
    dropout stream (a ``DropoutState``), its ``[B, 1, 1, 1]`` lengths and the views of its rows
    that see no key (each ``None`` when the graphs have none). The backward replays them."""

    bias: Optional[torch.Tensor]
    dropout: Optional[DropoutState]
    lengths: Optional[tuple]
    empty: Optional[tuple]


def extras_of(problem, spec, lengths: "_runtime.LengthCache | None") -> Extras:
    """The ``Extras`` a runner of ``problem`` binds (``spec`` its graphs', ``lengths`` its plan's
    cache of device lengths)."""
    if not (spec.padding or spec.bias_dim is not None or spec.dropout_p > 0):
        return NO_EXTRAS
    padding = problem.padding
    runtime = padding is not None and padding.runtime is not None
    seq_lens = empty = None
    if spec.padding and not runtime:  # host lengths (a bias graph's full-length mask too):
        seq_q, seq_kv, _, empty = lengths.get(*problem_lengths(problem), problem.device)
        seq_lens = (seq_q, seq_kv)  # bound once
    bias = problem.bias
    fixed = None
    if padding is None and spec.bias_dim is None and spec.dropout_p == 0:
        fixed = PerCall(None, None, seq_lens, empty)
    return Extras(padded=problem if padding is not None else None, lengths=seq_lens,
                  empty=empty, runtime_spec=spec if runtime else None,
                  bias_spec=spec if spec.bias_dim is not None else None,
                  bias_copy=bias is not None and _runtime.bias_needs_copy(spec, bias.shape,
                                                                          bias.stride),
                  dropout=spec.dropout_p > 0, fixed=fixed)


class DirectCall:
    """One cached call signature's runner (see the module's docstring).

    ``forward``: the forward graph (with stats when ``backward`` is given); ``backward``: the
    backward graph of a call that requires grad, else ``None``. What the call cache's key proves
    (shapes, dtypes, device, flags, so the graphs and the scale) is bound here; what it does not
    is checked per call: the strides (a call with others answers ``None`` and takes the full
    path, whose graphs are built for them), the base pointers' alignment (copies, as the full path
    makes), and grad mode (a call that requires grad under ``torch.no_grad`` answers ``None``).
    Outputs and gradients are contiguous in the call's layout, as the graphs were built.
    ``extras`` (``Extras``): a ``Padding``, whose padded positions are hidden as the full path
    hides them (``execution.run``) and whose rows that see no key come out 0 (their stats
    ``+inf`` for the backward, as ``CudnnPlan.backward`` sets them), its lengths bound once
    (static) or passed per call (``__call__(q, k, v, bias, generator, padding)``: runtime
    tensors, never read on the host); a bias tensor the call passes
    (``__call__(q, k, v, bias)``; one that requires grad has no runner); dropout
    (``__call__(q, k, v, bias, generator)``: a seed per call, the backward replays it; under a
    CUDA-graph capture the runner answers ``None`` and the full path refuses, with its reason).
    """

    __slots__ = ("forward", "backward", "device", "scale", "strides", "out_like",
                 "stats_like", "inputs_contiguous", "extras", "forward_ignores_padded_keys")

    def __init__(self, problem, forward, backward, scale: torch.Tensor,
                 out_template: torch.Tensor | None, stats_template: torch.Tensor | None,
                 extras: Extras = NO_EXTRAS, ignores_padded_keys: bool = False):
        self.forward, self.backward = forward, backward
        self.forward_ignores_padded_keys = ignores_padded_keys  # its plan's (CudnnPlan)
        self.device, self.scale, self.extras = problem.device, scale, extras
        self.strides = (problem.q.stride, problem.k.stride, problem.v.stride)
        # empty_like costs the host a third of an empty with explicit sizes, and without a
        # memory-format argument less again: it preserves a format that is contiguous already
        # (an expanded template's; q's when q is contiguous).
        self.out_like = out_template
        self.stats_like = stats_template
        self.inputs_contiguous = all(
            spec.stride == contiguous_strides(spec.shape)
            for spec in (problem.q, problem.k, problem.v))

    @property
    def takes_lengths(self) -> bool:
        """Whether each call passes its ``Padding`` (runtime lengths) to the runner."""
        return self.extras.runtime_spec is not None

    def __call__(self, q, k, v, bias=None, generator=None, padding=None):
        if (q.stride(), k.stride(), v.stride()) != self.strides:
            return None
        grad = self.backward is not None
        if grad and not torch.is_grad_enabled():
            return None
        extras = self.extras
        if extras is NO_EXTRAS:
            if grad:
                return record_direct(self, q, k, v)
            out = self._new_out(q)
            execute(self.forward, self._bind(q, k, v, out), self.device)
            return out
        spec = extras.runtime_spec
        if spec is not None and padding is None:
            return None
        if extras.lengths is not None:  # bound once: a captured graph keeps reading them
            kept_if_captured(extras)
        call, positions = extras.fixed, None
        if call is None:
            dropout = None
            if extras.dropout:
                if _runtime.capturing():
                    return None
                dropout = DropoutState.draw(generator)
            lengths, empty = extras.lengths, extras.empty
            keys = hides_keys(self, grad)
            # query rows past the lengths: hidden for a gradient, a bias's cells there too
            queries = grad or extras.bias_spec is not None
            if spec is not None:
                lengths = _runtime.device_lengths(spec, padding, self.device)
                empty = _runtime.padded_row_views(spec, *lengths, is_full_lengths(
                    padding.runtime[0], spec.batch, spec.seq_q, self.device))
                if queries or keys:  # else nothing is hidden (a decode step's one-row graph)
                    positions = length_positions(lengths[0] if queries else None, lengths[1],
                                                 spec.seq_q, spec.seq_kv, spec.layout)
            if extras.padded is not None and (queries or keys):
                hidden = hide_padding(extras.padded, Inputs(q, k, v, bias), grad, positions,
                                      keys=keys)
                q, k, v, bias = hidden.q, hidden.k, hidden.v, hidden.bias
            call = PerCall(bias, dropout, lengths, empty)
        if grad:
            out = record_direct(self, q, k, v, call)
            return out if extras.padded is None else \
                hide_padded_rows(extras.padded, out, positions)
        out = self._new_out(q)
        execute(self.forward, self._bind(q, k, v, out, call), self.device)
        if call.empty is not None:
            out.masked_fill_(call.empty[0], 0)
        return out

    def _new_out(self, q: torch.Tensor) -> torch.Tensor:
        if self.out_like is not None:
            return torch.empty_like(self.out_like)
        if self.inputs_contiguous:
            return torch.empty_like(q)
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    def _bind(self, q, k, v, out, call: Optional[PerCall] = None) -> dict:
        q, k, v = aligned_inputs(q, k, v)
        buffers = {_Q: q, _K: k, _V: v, _SCALE: self.scale, _O: out}
        if call is None:
            return buffers
        if call.lengths is not None:
            buffers[_SEQ_LEN_Q], buffers[_SEQ_LEN_KV] = call.lengths
        extras = self.extras
        if extras.bias_spec is not None:
            buffers[_BIAS] = _runtime.bias_operand(extras.bias_spec, call.bias) \
                if extras.bias_copy else _runtime.aligned(call.bias)
        if call.dropout is not None:
            buffers[_SEED], buffers[_OFFSET] = _runtime.philox_tensors(call.dropout)
        return buffers

    # -- the autograd node's two halves (core.autograd_node.record_direct) ----------------------------
    def record(self, q, k, v, call: Optional[PerCall]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, stats)`` of the forward with stats (``[B, H, S_q, 1]`` fp32); ``call``: the
        ``PerCall`` of a runner with ``Extras``, else ``None``."""
        out, stats = self._new_out(q), torch.empty_like(self.stats_like)
        buffers = self._bind(q, k, v, out, call)
        buffers[_STATS] = stats
        execute(self.forward, buffers, self.device)
        empty = None if call is None else call.empty
        if empty is not None:  # exp(S - (+inf)) = 0: such rows add nothing to the gradients
            out.masked_fill_(empty[0], 0)
            stats.masked_fill_(empty[1], math.inf)
        return out, stats

    def gradients(self, q, k, v, call: Optional[PerCall], out, stats, dout) -> tuple:
        """``(dq, dk, dv)`` from the forward's ``out`` and ``stats`` (and its ``call``, as
        ``record`` had it)."""
        if self.inputs_contiguous:
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        else:
            contiguous = torch.contiguous_format
            dq, dk, dv = (torch.empty_like(t, memory_format=contiguous) for t in (q, k, v))
        return execute_backward(self.backward, self._bind(q, k, v, out, call), dout, stats,
                                (dq, dk, dv), self.device)
