"""The cuDNN backend: declines what cuDNN cannot run (with reasons), runs the rest as cached
cuDNN-frontend SDPA graphs on torch's current stream.

``supports(problem)`` is pure: availability (cudnn importable, a CUDA device) + ``cudnn_reasons``
(every rule knowable without a GPU) + a CUDA-device check. ``plan(problem)`` builds the graphs the
call needs (through ``graph_cache``); a ``cudnnGraphNotSupportedError`` at any build stage raises
``NotSupportedError`` and the dispatcher moves on to the next engine, remembering the decline.
The plan's ``forward`` / ``backward`` follow the protocol of ``cudnn_attn.core.dispatch``.

The backward is cuDNN's deterministic one while ``torch.use_deterministic_algorithms(True)`` is
on (read when a call's plan is made). Dropout runs cuDNN's Philox stream at the call's
``DropoutState`` (seed, offset); the backward replays it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..core.probe import cuda_missing, module_missing
from ..core.caches import LRU, memoize
from ..errors import NotSupportedError
from ..model.problem import AttnProblem
from ..model.storage import Paged, Ragged
from . import _runtime
from .head_pad import HeadPadPlan, needs_padding, padded_problem
from .limits import LIMITS
from .score_mod_masks import density, neighborhood_as_band, tile_bitmask
from ._spec import GraphSpec, analyze, problem_lengths
from .sdpa import UID, BuiltGraph, build_graph

__all__ = ["CudnnBackend", "CudnnPlan", "graph_specs"]

PLAN_CACHE_SIZE = 128


@memoize("cudnn.import_error", 1)
def _import_error() -> list[str]:
    try:
        import cudnn  # noqa: F401
    except Exception as exc:  # installed but unloadable (missing shared libraries, ...)
        return (f"cudnn failed to import: {exc}",)
    return ()


class CudnnBackend:
    """Backend ``"cudnn"``: cuDNN-frontend SDPA graphs, cached by ``cudnn_attn.graph_cache``."""

    name = "cudnn"
    # Runs packed/paged storage and whole caches as they lie (binds ragged offsets, page tables and device lengths).
    runs_stored = True

    def __init__(self):
        self._plans = LRU("cudnn.plans", PLAN_CACHE_SIZE)

    def availability(self) -> list[str]:
        reasons = module_missing("cudnn", "cu12") + cuda_missing()
        if not reasons:  # import only where it can run: the import costs about a second
            reasons = list(_import_error())
        return reasons

    def supports(self, problem: AttnProblem) -> list[str]:
        reasons = self.availability()
        if problem.device.type != "cuda":
            reasons.append(f"cuDNN runs CUDA tensors; these are on {problem.device}")
        return reasons + self.graph_reasons(problem)

    def graph_reasons(self, problem: AttnProblem) -> list[str]:
        """Every rule knowable without a GPU (pure Python), for the graph this engine builds:
        head dims cuDNN does not take are zero-padded first (``head_pad``)."""
        return analyze(padded_problem(problem) if needs_padding(problem) else problem)[1]

    def auto_reasons(self, problem: AttnProblem) -> list[str]:
        """The density rule (``LIMITS.neighborhood_auto_density``): a neighborhood that cuDNN
        runs as a score_mod computes every tile, so ``auto`` leaves sparse ones to the CuPy
        kernels; ``backend="cudnn"`` serves them."""
        hood = problem.neighborhood
        if hood is None or neighborhood_as_band(hood) is not None:
            return []
        kept = density(hood)
        if kept < LIMITS.neighborhood_auto_density:
            return [f"the neighborhood keeps {kept:.0%} of the pairs; cuDNN's score_mod computes "
                    f"every tile, and auto picks it from "
                    f"{LIMITS.neighborhood_auto_density:.0%} (declared limit, to be measured on a "
                    f"GPU); backend='cudnn' runs it"]
        return []

    def plan(self, problem: AttnProblem) -> "CudnnPlan | HeadPadPlan":
        """The plan with every graph ``problem``'s calls need built; ``NotSupportedError`` when
        cuDNN declines one (at any build stage)."""
        if needs_padding(problem):
            return HeadPadPlan(self.plan(padded_problem(problem)))
        spec, reasons = analyze(problem)
        if reasons:
            raise NotSupportedError(problem, {self.name: reasons}, forced=self.name)
        plan = self._plans.get_or_create(_plan_key(problem, spec),
                                          lambda: CudnnPlan(problem, spec))
        plan.prepare(problem)
        return plan

    def clear(self) -> None:
        """Forget plans (graphs stay in ``graph_cache``)."""
        self._plans.clear()

    def known_engines(self, problem: AttnProblem) -> dict:
        """``{tag: EngineChoice}`` of the graphs ``problem`` needs that ``graph_cache`` already
        holds with a plan (built by an earlier call, or loaded from a warmed cache and used);
        builds, loads and counts nothing."""
        if needs_padding(problem):
            problem = padded_problem(problem)
        spec, reasons = analyze(problem)
        if reasons:
            return {}
        from .cache import graph_cache, make_key

        found = {}
        for tag, gspec, _ in graph_specs(problem, spec):
            built = graph_cache.peek(make_key((tag, gspec), problem.device))
            if built is not None and getattr(built, "engine", None) is not None:
                found[tag] = built.engine
        return found


def graph_specs(problem: AttnProblem, spec: GraphSpec) -> list[tuple[str, GraphSpec, bool]]:
    """``(tag, spec, backward)`` of every graph the engine builds for ``problem`` (the rule of
    ``CudnnPlan.prepare``): the forward, with stats when a backward or the LSE is needed, and
    the backward when the problem requires grad."""
    stats = problem.requires_grad or problem.return_lse
    out = [("sdpa_forward", spec.forward_variant(stats), False)]
    if problem.requires_grad:
        out.append(("sdpa_backward", spec.backward_variant(), True))
    return out


def _plan_key(problem: AttnProblem, spec: GraphSpec) -> tuple:
    return (spec, problem.requires_grad, str(problem.device))


def _graph(problem: AttnProblem, spec: GraphSpec, backward: bool) -> BuiltGraph:
    from .cache import graph_cache, make_key

    tag = "sdpa_backward" if backward else "sdpa_forward"
    key = make_key((tag, spec), problem.device)
    return graph_cache.get_or_build(key, lambda: build_graph(problem, spec, backward))


class CudnnPlan:
    """The graphs of one normalized problem (forward with/without stats, backward), built
    lazily through ``graph_cache`` and kept for the plan's lifetime."""

    def __init__(self, problem: AttnProblem, spec: GraphSpec):
        self.spec = spec
        self.dropout_p = problem.dropout_p
        self._graphs: dict = {}
        self._block_mask = None
        self._scales = _runtime.ScalarCache(torch.float32)
        self._lengths = _runtime.LengthCache(spec) if spec.padding else None
        s = spec
        self.o_shape = ((s.batch, s.heads_q, s.seq_q, s.dim_v) if s.layout == "bhsd"
                        else (s.batch, s.seq_q, s.heads_q, s.dim_v))

    def direct(self, problem):
        """No single public op runs these graphs/kernels: every call takes ``forward``."""
        return None

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
            buffers[UID.BIAS] = _runtime.bias_operand(self.spec, bias)
        empty = None
        if self._lengths is not None:
            padding = problem.padding
            if padding is not None and padding.runtime is not None:
                seq_q, seq_kv, empty = _runtime.device_lengths(self.spec, padding, device)
            else:
                lens_q, lens_kv = problem_lengths(problem)
                seq_q, seq_kv, empty = self._lengths.get(lens_q, lens_kv, device)
            buffers[UID.SEQ_LEN_Q], buffers[UID.SEQ_LEN_KV] = seq_q, seq_kv
        storage = problem.storage
        if isinstance(storage, Ragged):
            buffers.update(_runtime.ragged_offsets(self.spec, storage))
            if empty is not None:  # [B, S_q] -> one flag per packed token
                empty = _runtime.token_rows(empty, storage.cu_seqlens_q, q.shape[0])
        elif isinstance(storage, Paged):
            buffers[UID.PAGE_TABLE_K], buffers[UID.PAGE_TABLE_V] = \
                _runtime.page_tables(self.spec, storage)
        return buffers, empty

    def _dropout_buffers(self, problem, inputs, buffers: dict, backward: bool) -> None:
        """Philox ``(seed, offset)`` of the call's ``DropoutState``, or the explicit mask form
        (``problem.dropout_mask``): the ``[B, H_q, S_q, S_kv]`` mask in q's dtype and
        pass-by-value ``scale`` (and ``1 / scale`` for the backward)."""
        s = self.spec
        if s.dropout_mask:
            keep = inputs.dropout_mask
            full = (s.batch, s.heads_q, s.seq_q, s.seq_kv)
            buffers[UID.DROPOUT_MASK] = _runtime.aligned(
                keep.to(device=inputs.q.device, dtype=problem.dtype).expand(full).contiguous())
            scale = float(problem.dropout_scale)
            buffers[UID.DROPOUT_SCALE] = self._scales.get(scale)
            if backward:
                buffers[UID.DROPOUT_SCALE_INV] = self._scales.get(1.0 / scale)
        elif s.dropout_p > 0:
            buffers[UID.DROPOUT_SEED], buffers[UID.DROPOUT_OFFSET] = \
                _runtime.philox_tensors(inputs.dropout)

    def _empty_views(self, empty):
        """``empty`` broadcast against out and stats: ``[B, S_q]`` against out (call layout) and
        stats ``[B, H, S_q, 1]``; packed (``[total_q]``) against ``[total_q, H, *]`` both."""
        if self.spec.ragged:
            return empty[:, None, None], empty[:, None, None]
        rows = empty[:, :, None, None] if self.spec.layout == "bshd" else empty[:, None, :, None]
        return rows, empty[:, None, :, None]

    def _shapes(self, q) -> tuple[tuple, tuple]:
        """Shapes of out and stats: the call layout's, or packed ``[total_q, H, *]``."""
        s = self.spec
        if s.ragged:
            return (q.shape[0], s.heads_q, s.dim_v), (q.shape[0], s.heads_q, 1)
        return self.o_shape, (s.batch, s.heads_q, s.seq_q, 1)

    def _lse(self, stats: torch.Tensor) -> torch.Tensor:
        """Stats as the package's lse: ``[B, H, S_q]``, or ``[H, total_q]`` when packed (the
        varlen convention)."""
        s = self.spec
        if s.ragged:
            return stats.view(stats.shape[0], s.heads_q).t()
        return stats.view(s.batch, s.heads_q, s.seq_q)

    # -- Backend protocol ------------------------------------------------------------------------
    def forward(self, problem, inputs, need_lse=True):
        """``(out, lse)``: out in the call's layout and dtype; lse ``[B, H, S_q]`` fp32
        (natural log; ``-inf`` and out 0 on rows that see no key), ``None`` unless
        ``need_lse``. Packed (ragged) problems: out ``[total_q, H, D_v]``, lse ``[H, total_q]``."""
        q, k, v, bias = inputs.q, inputs.k, inputs.v, inputs.bias
        device = q.device
        built = self._get(problem, "stats" if need_lse else "plain")
        handle = _runtime.handle_for(device)
        buffers, empty = self._common(problem, q, k, v, bias, device)
        self._dropout_buffers(problem, inputs, buffers, backward=False)
        if self.spec.block_mask:  # the neighborhood's tiles, built once per plan
            if self._block_mask is None:
                self._block_mask = tile_bitmask(problem.neighborhood, self.spec.batch,
                                                self.spec.heads_q, device)
            buffers[UID.BLOCK_MASK] = self._block_mask
        o_shape, stats_shape = self._shapes(q)
        out = torch.empty(o_shape, dtype=problem.dtype, device=device)
        buffers[UID.O] = out
        stats = None
        if need_lse:
            stats = torch.empty(stats_shape, dtype=torch.float32, device=device)
            buffers[UID.STATS] = stats
        built.execute(buffers, _runtime.workspace(built.workspace_size, device), handle)
        if stats is None:
            if empty is not None:
                out.masked_fill_(self._empty_views(empty)[0], 0)
            return out, None
        if empty is not None:
            rows, stat_rows = self._empty_views(empty)
            out.masked_fill_(rows, 0)
            stats = stats.masked_fill(stat_rows, -math.inf)
        return out, self._lse(stats)

    def backward(self, problem, inputs, out, lse, dout, dlse=None):
        """``(dq, dk, dv, dbias)`` from the forward's LSE; ``dlse`` (the gradient reaching the
        returned LSE) enters through ``delta = rowsum(dO * O) - dlse``."""
        q, k, v, bias = inputs.q, inputs.k, inputs.v, inputs.bias
        s, device = self.spec, q.device
        built = self._get(problem, "backward")
        handle = _runtime.handle_for(device)
        buffers, _ = self._common(problem, q, k, v, bias, device)
        # exp(S - (+inf)) = 0: rows that see no key (lse -inf) contribute nothing, whatever
        # cuDNN wrote for them in the forward (FlashAttention's convention).
        o_shape, stats_shape = self._shapes(q)
        packed = lse.t() if s.ragged else lse  # back to the stats' own row order
        stats = packed.reshape(stats_shape).to(torch.float32)
        if s.padding:  # only padded graphs have rows that see no key (the forward's -inf rows)
            stats = stats.masked_fill(stats == -math.inf, math.inf)
        self._dropout_buffers(problem, inputs, buffers, backward=True)
        dout = _like_layout(dout, o_shape)
        if dlse is not None:
            out = _fold_dlse(out, dout, dlse.t() if s.ragged else dlse,
                             "ragged" if s.ragged else s.layout)
        buffers[UID.O] = _like_layout(out, o_shape)
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
    # -> out's row order: [B, H, S] (bhsd), [B, S, H] (bshd), [total, H] (ragged, given so)
    d = dlse if layout in ("bhsd", "ragged") else dlse.transpose(1, 2)
    d = d.to(torch.float32).unsqueeze(-1)
    g = dout.to(torch.float32)
    norm = (g * g).sum(-1, keepdim=True)
    step = torch.where(norm > 0, d / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return (out.to(torch.float32) - step * g).to(out.dtype)
