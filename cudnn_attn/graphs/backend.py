"""The cuDNN backend: declines what cuDNN cannot run (with reasons), runs the rest as cached
cuDNN-frontend SDPA graphs on torch's current stream.

``supports(problem)`` = availability (cudnn importable, a CUDA device) + ``cudnn_reasons`` (every
rule knowable without a GPU) + a CUDA-device check; on a GPU it then builds the graphs the call
needs (through ``graph_cache``), so a ``cudnnGraphNotSupportedError`` at any build stage is one
more reason and the dispatcher moves on. ``plan(problem)`` returns a ``CudnnPlan`` whose
``forward`` / ``backward`` follow the ``Backend`` protocol of ``cudnn_attn.dispatch``.

The backward is cuDNN's deterministic one while ``torch.use_deterministic_algorithms(True)`` is
on (read when a call's plan is made). Dropout draws a Philox seed from the call's ``generator``
and the backward replays it.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from typing import Optional

import torch

from .._probe import cuda_missing, module_missing
from ..dispatch import NotSupportedError
from ..problem import AttnProblem
from . import _runtime
from ._spec import GraphSpec, analyze, problem_lengths
from .sdpa import UID, BuiltGraph, build_graph

__all__ = ["CudnnBackend", "CudnnPlan"]

PLAN_CACHE_SIZE = 128


@functools.lru_cache(maxsize=1)
def _import_error() -> list[str]:
    try:
        import cudnn  # noqa: F401
    except Exception as exc:  # installed but unloadable (missing shared libraries, ...)
        return [f"cudnn failed to import: {exc}"]
    return []


class CudnnBackend:
    """Backend ``"cudnn"``: cuDNN-frontend SDPA graphs, cached by ``cudnn_attn.graph_cache``."""

    name = "cudnn"

    def __init__(self):
        self._plans: OrderedDict = OrderedDict()
        self._declined: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def availability(self) -> list[str]:
        reasons = module_missing("cudnn", "cu12") + cuda_missing()
        if not reasons:  # import only where it can run: the import costs about a second
            reasons = _import_error()
        return reasons

    def supports(self, problem: AttnProblem) -> list[str]:
        reasons = self.availability()
        if problem.device.type != "cuda":
            reasons.append(f"cuDNN runs CUDA tensors; these are on {problem.device}")
        spec, rules = analyze(problem)  # pure Python: every rule knowable without a GPU
        reasons += rules
        if reasons:
            return reasons
        key = _plan_key(problem, spec)
        with self._lock:
            declined = self._declined.get(key)
        if declined is not None:
            return list(declined)
        try:
            self._plan(problem, spec, key).prepare(problem)
        except NotSupportedError as exc:
            found = exc.reasons.get(self.name) or [str(exc)]
            with self._lock:
                self._declined[key] = tuple(found)
                _trim(self._declined)
            return list(found)
        return []

    def plan(self, problem: AttnProblem) -> "CudnnPlan":
        spec, reasons = analyze(problem)
        if reasons:
            raise NotSupportedError(problem, {self.name: reasons}, forced=self.name)
        return self._plan(problem, spec, _plan_key(problem, spec))

    def _plan(self, problem, spec: GraphSpec, key) -> "CudnnPlan":
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = CudnnPlan(problem, spec)
        with self._lock:
            plan = self._plans.setdefault(key, plan)
            _trim(self._plans)
        return plan

    def clear(self) -> None:
        """Forget plans and declines (graphs stay in ``graph_cache``)."""
        with self._lock:
            self._plans.clear()
            self._declined.clear()


def _trim(table: OrderedDict) -> None:
    while len(table) > PLAN_CACHE_SIZE:
        table.popitem(last=False)


def _plan_key(problem: AttnProblem, spec: GraphSpec) -> tuple:
    return (spec, problem.requires_grad, str(problem.device))


def _graph(problem: AttnProblem, spec: GraphSpec, backward: bool) -> BuiltGraph:
    from .cache import graph_cache, make_key

    tag = "sdpa_backward" if backward else "sdpa_forward"
    key = make_key((tag, spec), problem.device)
    return graph_cache.get_or_build(key, lambda: build_graph(problem, spec, backward))


class _Saved:
    """What the backward needs beyond the autograd-saved tensors."""

    __slots__ = ("stats", "seed", "offset", "empty")

    def __init__(self, stats, seed, offset, empty):
        self.stats, self.seed, self.offset, self.empty = stats, seed, offset, empty


class CudnnPlan:
    """The graphs of one normalized problem (forward with/without stats, backward), built
    lazily through ``graph_cache`` and kept for the plan's lifetime."""

    def __init__(self, problem: AttnProblem, spec: GraphSpec):
        self.spec = spec
        self.dropout_p = problem.dropout_p
        self._graphs: dict = {}
        self._scales = _runtime.ScalarCache(torch.float32)
        self._lengths = _runtime.LengthCache(spec) if spec.padding else None
        s = spec
        self.o_shape = ((s.batch, s.heads_q, s.seq_q, s.dim_v) if s.layout == "bhsd"
                        else (s.batch, s.seq_q, s.heads_q, s.dim_v))

    # -- graphs --------------------------------------------------------------------------------
    def _get(self, problem, variant) -> BuiltGraph:
        built = self._graphs.get(variant)
        if built is None:
            if variant == "backward":
                built = _graph(problem, self.spec.backward_variant(), True)
            else:
                built = _graph(problem, self.spec.forward_variant(variant == "stats"), False)
            self._graphs[variant] = built
        return built

    def prepare(self, problem: AttnProblem) -> None:
        """Build (or fetch) every graph ``problem``'s calls will need; raises
        ``NotSupportedError`` when cuDNN declines one."""
        needs_stats = problem.requires_grad or problem.return_lse
        self._get(problem, "stats" if needs_stats else "plain")
        if problem.requires_grad:
            self._get(problem, "backward")

    # -- runtime inputs ------------------------------------------------------------------------
    def _common(self, problem, q, k, v, bias, device) -> tuple[dict, Optional[torch.Tensor]]:
        if problem.dropout_p != self.dropout_p:
            raise ValueError(f"this plan was built for dropout_p={self.dropout_p}, got "
                             f"{problem.dropout_p}")
        buffers = {UID.Q: _runtime.aligned(q), UID.K: _runtime.aligned(k),
                   UID.V: _runtime.aligned(v), UID.SCALE: self._scales.get(problem.scale)}
        if self.spec.bias_dim is not None:
            buffers[UID.BIAS] = _runtime.aligned(bias)
        empty = None
        if self._lengths is not None:
            lens_q, lens_kv = problem_lengths(problem)
            seq_q, seq_kv, empty = self._lengths.get(lens_q, lens_kv, device)
            buffers[UID.SEQ_LEN_Q], buffers[UID.SEQ_LEN_KV] = seq_q, seq_kv
        return buffers, empty

    def _empty_views(self, empty):
        """``empty`` [B, S_q] broadcast against out (call layout) and stats [B, H, S_q, 1]."""
        rows = empty[:, :, None, None] if self.spec.layout == "bshd" else empty[:, None, :, None]
        return rows, empty[:, None, :, None]

    # -- Backend protocol ------------------------------------------------------------------------
    def forward(self, problem, q, k, v, bias, generator, need_lse=True):
        """``(out, lse, saved)``: out in the call's layout and dtype; lse ``[B, H, S_q]`` fp32
        (natural log; ``-inf`` and out 0 on rows that see no key), ``None`` unless
        ``need_lse``."""
        s, device = self.spec, q.device
        built = self._get(problem, "stats" if need_lse else "plain")
        handle = _runtime.handle_for(device)
        buffers, empty = self._common(problem, q, k, v, bias, device)
        seed = offset = None
        if s.dropout_p > 0:
            seed, offset = _runtime.philox_state(generator)
            buffers[UID.DROPOUT_SEED], buffers[UID.DROPOUT_OFFSET] = seed, offset
        out = torch.empty(self.o_shape, dtype=problem.dtype, device=device)
        buffers[UID.O] = out
        stats = None
        if need_lse:
            stats = torch.empty((s.batch, s.heads_q, s.seq_q, 1), dtype=torch.float32,
                                device=device)
            buffers[UID.STATS] = stats
        built.execute(buffers, _runtime.workspace(built.workspace_size, device), handle)
        if stats is None:
            if empty is not None:
                out.masked_fill_(self._empty_views(empty)[0], 0)
            return out, None, _Saved(None, seed, offset, empty)
        lse = stats.view(s.batch, s.heads_q, s.seq_q)
        raw = None
        if empty is not None:
            rows, stat_rows = self._empty_views(empty)
            out.masked_fill_(rows, 0)
            raw = stats
            lse = stats.masked_fill(stat_rows, -math.inf).view(s.batch, s.heads_q, s.seq_q)
        return out, lse, _Saved(raw, seed, offset, empty)

    def backward(self, problem, q, k, v, bias, out, lse, dout, saved, dlse=None):
        """``(dq, dk, dv, dbias)`` from the forward's LSE; ``dlse`` (the gradient reaching the
        returned LSE) enters through ``delta = rowsum(dO * O) - dlse``."""
        s, device = self.spec, q.device
        built = self._get(problem, "backward")
        handle = _runtime.handle_for(device)
        buffers, empty = self._common(problem, q, k, v, bias, device)
        stats = saved.stats if saved is not None and saved.stats is not None else \
            lse.reshape(s.batch, s.heads_q, s.seq_q, 1)
        if saved is not None and saved.empty is not None:
            # exp(S - (+inf)) = 0: rows that see no key contribute nothing, whatever cuDNN
            # wrote for them in the forward (FlashAttention's convention).
            stats = stats.masked_fill(self._empty_views(saved.empty)[1], math.inf)
        if s.dropout_p > 0:
            buffers[UID.DROPOUT_SEED], buffers[UID.DROPOUT_OFFSET] = saved.seed, saved.offset
        dout = _like_layout(dout, self.o_shape)
        if dlse is not None:
            out = _fold_dlse(out, dout, dlse, s.layout)
        buffers[UID.O] = _like_layout(out, self.o_shape)
        buffers[UID.DO] = dout
        buffers[UID.STATS] = stats.contiguous()
        # Gradients contiguous in the call's layout (the strides the backward graph expects).
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=device) for t in (q, k, v))
        buffers[UID.DQ], buffers[UID.DK], buffers[UID.DV] = dq, dk, dv
        dbias = None
        if s.dbias:
            dbias = torch.empty(s.bias_dim, dtype=bias.dtype, device=device)
            buffers[UID.DBIAS] = dbias
        built.execute(buffers, _runtime.workspace(built.workspace_size, device), handle)
        if dbias is not None:
            dbias = dbias.view(problem.bias.shape)
        return dq, dk, dv, dbias


def _like_layout(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``t`` contiguous (the graph's O/dO layout) and 16-byte aligned."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"expected a tensor of shape {shape}, got {tuple(t.shape)}")
    return _runtime.aligned(t.contiguous())


def _fold_dlse(out, dout, dlse, layout: str):
    """An ``O'`` with ``rowsum(dO * O') = rowsum(dO * O) - dlse``: cuDNN reads O only for that
    row sum, so the LSE's gradient rides along. Rows with ``dO = 0`` keep O (their dlse term is
    lost; a loss using a row's LSE but not its output is the one case this does not cover)."""
    d = dlse if layout == "bhsd" else dlse.transpose(1, 2)  # -> out's [B, *, *] row order
    d = d.to(torch.float32).unsqueeze(-1)
    g = dout.to(torch.float32)
    norm = (g * g).sum(-1, keepdim=True)
    step = torch.where(norm > 0, d / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return (out.to(torch.float32) - step * g).to(out.dtype)
