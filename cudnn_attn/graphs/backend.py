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

import dataclasses
import math
from types import SimpleNamespace
from typing import Optional

import torch

from ..core.probe import cuda_missing, module_missing
from ..core.caches import LRU, memoize
from ..errors import NotSupportedError
from ..model.inputs import is_full_lengths
from ..model.problem import AttnProblem
from ..model.storage import Paged, Ragged
from . import _runtime, churn, decode_rows, launch, length_buckets
from ..core import roofline
from .head_pad import HeadPadPlan, needs_padding, padded_problem
from .score_mod_masks import mask_program, neighborhood_as_band, tile_bitmask
from ._spec import GraphSpec, analyze, problem_lengths
from .notes import plan_notes
from .two_row_plan import TwoRowPlan
from .length_buckets import BucketPlan
from .sdpa import UID, BuiltGraph, build_graph
from .backward_inputs import fold_dlse, like_layout
from .paged_call import PagedCall
from .ragged_call import RaggedCall

__all__ = ["CudnnBackend", "CudnnPlan", "graph_specs"]

PLAN_CACHE_SIZE = 128
# UID's values as plain ints for the per-call buffer dicts: an IntEnum member costs the hot path
# a metaclass lookup each time it is named (the graphs bind by the same int values).
_U = SimpleNamespace(**{uid.name: int(uid) for uid in UID})


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
    # Runs packed/paged storage and whole caches as they lie (ragged offsets, page tables, lengths)
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

    def predicted_ms(self, problem: AttnProblem) -> Optional[float]:
        """Predicted ms of a NATTEN neighborhood run as dense attention with the exact mask (a
        score_mod program: every score is computed), for ``auto``'s cost rule
        (``dispatch.cost_choice``); ``None`` for other masks (and a causal 1-D neighborhood,
        which runs as cuDNN's own band and skips tiles): no prediction, priority order.
        Conservative from sm_100 on, where the block mask lets cuDNN skip empty tiles."""
        hood = problem.neighborhood
        if hood is None or neighborhood_as_band(hood) is not None:
            return None
        return _dense_prediction(problem.batch, problem.heads_q, problem.heads_kv,
                                 problem.seq_q, problem.seq_kv, problem.dim_qk, problem.dim_v,
                                 problem.dtype, hood, problem.softcap, problem.requires_grad,
                                 roofline.ceilings_for(problem.device))

    def plan(self, problem: AttnProblem) -> "CudnnPlan | TwoRowPlan | HeadPadPlan | BucketPlan":
        """The plan with every graph ``problem``'s calls need built; ``NotSupportedError`` when
        cuDNN declines one (at any build stage)."""
        if needs_padding(problem):
            return HeadPadPlan(self.plan(padded_problem(problem)))
        spec, reasons = analyze(problem)
        if reasons:
            raise NotSupportedError(problem, {self.name: reasons}, forced=self.name)
        if churn.buckets(problem, spec):
            try:
                bucketed = self.plan(length_buckets.bucketed_problem(problem, True))
            except NotSupportedError:  # cuDNN refused the bucket's graph: the call's own then
                pass
            else:
                return BucketPlan(bucketed, lambda: self._exact_plan(problem, spec))
        return self._exact_plan(problem, spec)

    def _exact_plan(self, problem: AttnProblem, spec: GraphSpec) -> "CudnnPlan | TwoRowPlan":
        """The plan of ``problem``'s own graphs (``spec``), built."""
        plan: CudnnPlan | TwoRowPlan
        if decode_rows.needed(problem):  # spec is the two-row graph's (decode_rows)
            where = decode_rows.side(problem)
            plan = self._plans.get_or_create(
                _plan_key(problem, spec) + (where,),
                lambda: _two_row_plan(problem, spec, where))
        else:
            plan = self._plans.get_or_create(_plan_key(problem, spec),
                                              lambda: CudnnPlan(problem, spec))
        plan.prepare(problem)
        return plan

    def notes(self, problem: AttnProblem) -> list[str]:
        """How the plan runs ``problem`` when that is not plain (for ``explain()``)."""
        return plan_notes(problem)

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


@memoize("cudnn.dense_prediction", maxsize=256)
def _dense_prediction(batch, heads, heads_kv, seq_q, seq_kv, dim_qk, dim_v, dtype, hood, softcap,
                      backward, ceilings) -> float:
    mask_ops = len(mask_program(softcap=softcap, neighborhood=hood).ops)
    shape = dict(batch=batch, heads=heads, heads_kv=heads_kv, seq_q=seq_q, seq_kv=seq_kv,
                 dim_qk=dim_qk, dim_v=dim_v, dtype=dtype)
    total = roofline.dense_ms("fwd", ceilings=ceilings, mask_ops=mask_ops, **shape)
    if backward:
        total += roofline.dense_ms("bwd", ceilings=ceilings, mask_ops=mask_ops, **shape)
    return total


def graph_specs(problem: AttnProblem, spec: GraphSpec) -> list[tuple[str, GraphSpec, bool]]:
    """``(tag, spec, backward)`` of every graph the engine builds for ``problem`` (the rule of
    ``CudnnPlan.prepare``): the forward, with stats when a backward or the LSE is needed, and
    the backward when the problem requires grad."""
    out = [("sdpa_forward", spec.forward_for(problem), False)]
    if problem.requires_grad:
        out.append(("sdpa_backward", spec.backward_variant(), True))
    return out


def _two_row_plan(problem: AttnProblem, spec: GraphSpec, where: str) -> TwoRowPlan:
    rows = dataclasses.replace(spec, seq_q=1)  # the call's own
    return TwoRowPlan(CudnnPlan(decode_rows.padded_problem(problem), spec, rows), where)


def _plan_key(problem: AttnProblem, spec: GraphSpec) -> tuple:
    return (spec, problem.requires_grad, str(problem.device))


def _graph(problem: AttnProblem, spec: GraphSpec, backward: bool) -> BuiltGraph:
    from .cache import graph_cache, make_key

    key = make_key(("sdpa_backward" if backward else "sdpa_forward", spec), problem.device)
    return graph_cache.get_or_build(
        key, lambda: churn.built(spec, backward, build_graph(problem, spec, backward)))


class CudnnPlan:
    """The graphs of one normalized problem (forward with/without stats, backward), built
    lazily through ``graph_cache`` and kept for the plan's lifetime. ``rows``: the spec of the
    query rows a caller keeps, when not all of ``spec``'s (``TwoRowPlan``'s one): a forward's
    views of the rows that see no key (runtime lengths) are made for those, and broadcast
    against the graph's."""

    name = "cudnn"
    def __init__(self, problem: AttnProblem, spec: GraphSpec, rows: Optional[GraphSpec] = None):
        self.spec = spec
        self._rows = spec if rows is None else rows
        self.dropout_p = problem.dropout_p
        self._graphs: dict = {}
        self._block_mask = None
        self._scales = _runtime.ScalarCache(torch.float32)
        self._lengths = _runtime.LengthCache(spec) if spec.padding else None
        s = spec
        self._dropout = s.dropout_mask or s.dropout_p > 0
        self.o_shape = ((s.batch, s.heads_q, s.seq_q, s.dim_v) if s.layout == "bhsd"
                        else (s.batch, s.seq_q, s.heads_q, s.dim_v))
        self._out_like_q = s.dim_v == s.dim_qk  # out has q's shape (any layout, packed too)
        self._templates: dict = {}  # (role, dtype, device) -> expanded one-element tensor

    def direct(self, problem):
        """``launch.DirectCall`` of ``problem`` when its graphs bind nothing but q, k, v, the
        scale and out (and the backward's stats and gradients), a ``Padding``'s lengths (static
        ones bound once, tensors passed per call), a bias that needs no gradient and a Philox
        dropout seed: no explicit dropout mask, tile mask, packed or paged storage, and a
        positive scale; else ``None`` (every call takes ``forward``)."""
        s = self.spec
        q_factor, scale = _runtime.positive_scale(problem.scale)
        if (problem.bias_requires_grad or s.dropout_mask or s.block_mask or s.ragged
                or s.paged is not None or problem.storage is not None or q_factor != 1.0
                or problem.dropout_p != self.dropout_p):
            return None
        extras = launch.extras_of(problem, s, self._lengths)
        grad = problem.requires_grad
        forward = self._get(problem, "stats" if grad else "plain")
        backward = self._get(problem, "backward") if grad else None
        out_like = None if self._out_like_q else \
            self._template("out", self.o_shape, problem.dtype, problem.device)
        stats_like = self._template("stats", self._stats_shape(None), torch.float32,  # not packed
                                    problem.device) if grad else None
        return launch.DirectCall(problem, forward, backward, self._scales.get(scale), out_like,
                                 stats_like, extras, self.forward_ignores_padded_keys)

    def storage_direct(self, problem):
        """The runner of a packed or paged ``problem`` whose graphs bind nothing but q, k, v,
        the scale, out (and the backward's stats and gradients) and what its offsets or page
        tables and lengths give: ``ragged_call.RaggedCall`` (packed), ``paged_call.PagedCall``
        (paged, forward only); no bias tensor, dropout, returned lse or sign-carrying scale;
        else ``None`` (every call takes ``forward``)."""
        s = self.spec
        q_factor, scale = _runtime.positive_scale(problem.scale)
        if (not (s.ragged or s.paged is not None) or not s.padding or s.bias_dim is not None
                or s.dropout_p > 0 or s.dropout_mask or s.block_mask or problem.return_lse
                or q_factor != 1.0 or (s.paged is not None and problem.requires_grad)):
            return None
        grad = problem.requires_grad
        forward = self._get(problem, "stats" if grad else "plain")
        if s.paged is not None:
            return PagedCall(s, forward, self._scales.get(scale), problem.device)
        backward = self._get(problem, "backward") if grad else None
        return RaggedCall(s, forward, backward, self._scales.get(scale), problem.device)

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
    def _common(self, problem, q, k, v, bias, device, forward: bool,
                ) -> tuple[dict, Optional[tuple[torch.Tensor, torch.Tensor]]]:
        """The buffers every graph of the plan binds (q, k, v, scale, bias, lengths, ragged
        offsets, page tables) and, for a ``forward``, the ``empty_views`` of the rows that see
        no key (``None`` when none can; ``PAST_THE_END``: out and stats to be made filled)."""
        if problem.dropout_p != self.dropout_p:
            raise ValueError(f"this plan was built for dropout_p={self.dropout_p}, got "
                             f"{problem.dropout_p}")
        q_factor, scale = _runtime.positive_scale(problem.scale)
        if q_factor != 1.0:  # cuDNN takes positive scales only; the sign rides on q
            q = _runtime.scaled_same_strides(q, q_factor)
        buffers = {_U.Q: _runtime.aligned(q), _U.K: _runtime.aligned(k),
                   _U.V: _runtime.aligned(v), _U.SCALE: self._scales.get(scale)}
        if self.spec.bias_dim is not None:
            buffers[_U.BIAS] = _runtime.bias_operand(self.spec, bias)
        empty = views = None
        storage = problem.storage
        if self._lengths is not None:
            padding = problem.padding
            if padding is not None and padding.runtime is not None:
                seq_q, seq_kv = _runtime.device_lengths(self.spec, padding, device)
                # the backward reads the forward's stats, -inf on those rows
                if forward and self.spec.ragged and seq_kv is seq_q:
                    views = _runtime.PAST_THE_END  # out and stats made filled (forward)
                elif forward and self.spec.ragged:  # one flag per packed token
                    empty = _runtime.token_rows_without_keys(
                        self.spec.band, storage.cu_seqlens_q, seq_q, seq_kv, q.shape[0])
                elif forward:
                    rows = self._rows
                    views = _runtime.padded_row_views(rows, seq_q, seq_kv, is_full_lengths(
                        padding.runtime[0], rows.batch, rows.seq_q, device))
            else:
                lens_q, lens_kv = problem_lengths(problem)
                seq_q, seq_kv, empty, views = self._lengths.get(
                    lens_q, lens_kv, device, q.shape[0] if self.spec.ragged else 0)
            buffers[_U.SEQ_LEN_Q], buffers[_U.SEQ_LEN_KV] = seq_q, seq_kv
        if isinstance(storage, Ragged):
            buffers.update(_runtime.ragged_offsets(self.spec, storage))
        elif isinstance(storage, Paged):
            buffers[_U.PAGE_TABLE_K], buffers[_U.PAGE_TABLE_V] = \
                _runtime.page_tables(self.spec, storage)
        if not forward:
            return buffers, None
        if empty is not None and views is None:
            views = _runtime.empty_views(self.spec, empty)
        return buffers, views

    def _dropout_buffers(self, problem, inputs, buffers: dict, backward: bool) -> None:
        """Philox ``(seed, offset)`` of the call's ``DropoutState``, or the explicit mask form
        (``problem.dropout_mask``): the ``[B, H_q, S_q, S_kv]`` mask in q's dtype and
        pass-by-value ``scale`` (and ``1 / scale`` for the backward)."""
        s = self.spec
        if s.dropout_mask:
            keep = inputs.dropout_mask
            full = (s.batch, s.heads_q, s.seq_q, s.seq_kv)
            buffers[_U.DROPOUT_MASK] = _runtime.aligned(
                keep.to(device=inputs.q.device, dtype=problem.dtype).expand(full).contiguous())
            scale = float(problem.dropout_scale)
            buffers[_U.DROPOUT_SCALE] = self._scales.get(scale)
            if backward:
                buffers[_U.DROPOUT_SCALE_INV] = self._scales.get(1.0 / scale)
        elif s.dropout_p > 0:
            if _runtime.capturing():
                # The seed is a pass-by-value input: a captured graph would bake this call's in
                # and every replay would drop the same weights. Refuse rather than repeat.
                raise NotSupportedError(problem, {self.name: [
                    "dropout inside a CUDA graph capture: the Philox seed is drawn on the host "
                    "per call, so every replay would repeat this call's mask; capture without "
                    "dropout, or pass an explicit dropout mask (the builder's set_dropout(mask, "
                    "scale))"]}, forced=self.name)
            buffers[_U.DROPOUT_SEED], buffers[_U.DROPOUT_OFFSET] = \
                _runtime.philox_tensors(inputs.dropout)

    def _out_shape(self, q) -> tuple:
        """Shape of out: the call layout's, or packed ``[total_q, H, D_v]``."""
        s = self.spec
        return (q.shape[0], s.heads_q, s.dim_v) if s.ragged else self.o_shape

    def _stats_shape(self, q) -> tuple:
        """Shape of the stats: ``[B, H, S_q, 1]``, or packed ``[total_q, H, 1]``."""
        s = self.spec
        return (q.shape[0], s.heads_q, 1) if s.ragged else (s.batch, s.heads_q, s.seq_q, 1)

    # Outputs come from empty_like, a third of an empty's host cost (no shape, dtype or device
    # to parse): like q when out has q's shape, else like a one-element template expanded to
    # the shape (contiguous). Packed shapes change with the token count: those use empty.
    def _new_out(self, q: torch.Tensor, dtype: torch.dtype, zeros: bool = False) -> torch.Tensor:
        """An uninitialised out (``zeros``: zeroed), contiguous in the call's layout."""
        if self._out_like_q and q.dtype == dtype:
            like = torch.zeros_like if zeros else torch.empty_like
            return like(q, memory_format=torch.contiguous_format)
        if self.spec.ragged:
            make = torch.zeros if zeros else torch.empty
            return make(self._out_shape(q), dtype=dtype, device=q.device)
        return torch.empty_like(self._template("out", self.o_shape, dtype, q.device))

    def _new_stats(self, q: torch.Tensor, minus_inf: bool = False) -> torch.Tensor:
        """Uninitialised fp32 stats, ``[B, H, S_q, 1]`` (or packed ``[total_q, H, 1]``, -inf
        with ``minus_inf``)."""
        if self.spec.ragged:
            stats = torch.empty(self._stats_shape(q), dtype=torch.float32, device=q.device)
            return stats.fill_(-math.inf) if minus_inf else stats
        return torch.empty_like(self._template("stats", self._stats_shape(q), torch.float32,
                                               q.device))

    def _template(self, role: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        found = self._templates.get((role, dtype, device))
        if found is None:
            found = torch.empty((1,) * len(shape), dtype=dtype, device=device).expand(shape)
            self._templates[(role, dtype, device)] = found
        return found

    def _lse(self, stats: torch.Tensor) -> torch.Tensor:
        """Stats as the package's lse: ``[B, H, S_q]``, or ``[H, total_q]`` when packed (the
        varlen convention)."""
        s = self.spec
        if s.ragged:
            return stats.view(stats.shape[0], s.heads_q).t()
        return stats.view(s.batch, s.heads_q, s.seq_q)

    @property
    def forward_ignores_padded_keys(self) -> bool:
        """Whether the forward keeps what lies past the key lengths out by itself (so a call
        no gradient follows binds K and V unzeroed: ``decode_rows.ignores_padded_keys``)."""
        return decode_rows.ignores_padded_keys(self.spec)

    # -- Backend protocol ------------------------------------------------------------------------
    def forward(self, problem, inputs, need_lse=True):
        """``(out, lse)``: out in the call's layout and dtype; lse ``[B, H, S_q]`` fp32
        (natural log; ``-inf`` and out 0 on rows that see no key), ``None`` unless
        ``need_lse``. Packed (ragged) problems: out ``[total_q, H, D_v]``, lse ``[H, total_q]``."""
        out, stats, empty = self.raw_forward(problem, inputs, need_lse)
        if empty is not None:
            out.masked_fill_(empty[0], 0)
        if stats is None:
            return out, None
        if empty is not None:
            stats = stats.masked_fill(empty[1], -math.inf)
        return out, self._lse(stats)

    def raw_forward(self, problem, inputs, need_lse: bool) -> tuple:
        """``(out, stats, empty)``: out and the stats (``None`` unless ``need_lse``) as the
        forward graph wrote them, and the ``empty_views`` of the rows that see no key, which
        ``forward`` fills (``None``: none can)."""
        q = inputs.q
        device = q.device
        built = self._graphs.get("stats" if need_lse else "plain") \
            or self._get(problem, "stats" if need_lse else "plain")
        buffers, empty = self._common(problem, q, inputs.k, inputs.v, inputs.bias, device,
                                      forward=True)
        # empty: (rows of out, rows of stats) that see no key, or None
        if self._dropout:
            self._dropout_buffers(problem, inputs, buffers, backward=False)
        if self.spec.block_mask:  # the neighborhood's tiles, built once per plan
            if self._block_mask is None:
                self._block_mask = tile_bitmask(problem.neighborhood, self.spec.batch,
                                                self.spec.heads_q, device)
            buffers[_U.BLOCK_MASK] = self._block_mask
        filled = empty is _runtime.PAST_THE_END  # cuDNN writes no token past the last sequence
        empty = None if filled else empty
        out = buffers[_U.O] = self._new_out(q, problem.dtype, filled)
        stats = None
        if need_lse:
            stats = buffers[_U.STATS] = self._new_stats(q, filled)
        launch.execute(built, buffers, device)
        return out, stats, empty

    def backward(self, problem, inputs, out, lse, dout, dlse=None):
        """``(dq, dk, dv, dbias)`` from the forward's LSE; ``dlse`` (the gradient reaching the
        returned LSE) enters through ``delta = rowsum(dO * O) - dlse``."""
        q, k, v, bias = inputs.q, inputs.k, inputs.v, inputs.bias
        s, device = self.spec, q.device
        built = self._graphs.get("backward") or self._get(problem, "backward")
        buffers, _ = self._common(problem, q, k, v, bias, device, forward=False)
        # exp(S - (+inf)) = 0: rows that see no key (lse -inf) contribute nothing, whatever
        # cuDNN wrote for them in the forward (FlashAttention's convention).
        packed = lse.t() if s.ragged else lse  # back to the stats' own row order
        stats = packed.reshape(self._stats_shape(q))
        if stats.dtype != torch.float32:
            stats = stats.to(torch.float32)
        if s.padding and not s.synthetic_padding:  # only a call's own lengths leave rows that
            # see no key (the forward's -inf rows): full lengths do not (_spec._open_tiles)
            # -inf -> +inf, into a contiguous buffer: one kernel (a comparison, a fill and the
            # packed lse's copy cost three)
            stats = torch.nan_to_num(stats, nan=math.nan, posinf=math.inf, neginf=math.inf,
                                     out=self._new_stats(q))
        if self._dropout:
            self._dropout_buffers(problem, inputs, buffers, backward=True)
        o_shape = self._out_shape(q)
        dout = like_layout(dout, o_shape)
        if dlse is not None:
            out = fold_dlse(out, dout, dlse.t() if s.ragged else dlse,
                             "ragged" if s.ragged else s.layout)
        buffers[_U.O] = like_layout(out, o_shape)
        buffers[_U.DO] = dout
        buffers[_U.STATS] = stats if stats.is_contiguous() else stats.contiguous()
        # Gradients contiguous in the call's layout (the strides the backward graph expects);
        # packed: zeroed, as cuDNN writes no token past the last sequence (which has none).
        like = torch.zeros_like if s.ragged else torch.empty_like
        dq, dk, dv = (like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        buffers[_U.DQ], buffers[_U.DK], buffers[_U.DV] = dq, dk, dv
        dbias = None
        if s.dbias:
            dbias = torch.empty(s.bias_dim, dtype=bias.dtype, device=device)
            buffers[_U.DBIAS] = dbias
        launch.execute(built, buffers, device)
        q_factor = _runtime.positive_scale(problem.scale)[0]
        if q_factor == 0.0:  # the graph differentiated w.r.t. q * q_factor
            dq.zero_()
        elif q_factor != 1.0:
            dq.mul_(q_factor)
        if dbias is not None:
            dbias = dbias.view(problem.bias.shape)
        return dq, dk, dv, dbias
