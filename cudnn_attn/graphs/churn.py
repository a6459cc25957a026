"""Shape churn: cuDNN graphs built at call time for shapes that differ only in their sizes.

A cuDNN graph is specialised on its shapes, and building one costs milliseconds to tens of
milliseconds of host time (about 40 ms per graph in the H200 record, ``docs/benchmarks.md``). A
workload whose batch or sequence lengths change at every call -- a decode loop over a growing
cache (Hugging Face's dynamic cache), dynamic padding per batch -- therefore builds a graph per
call, and the builds dominate. ``built`` is told of every graph the engine builds at call time
(never of a graph loaded from the disk cache or warmed ahead) and counts the distinct shapes
per family (the graph's spec without its sizes and strides); ``shapes_built`` tells the engine,
which runs the later shapes of a family on a few bucketed graphs (``length_buckets``; their own
builds are not counted). When a family that cannot bucket reaches ``CHURN_WARNING`` shapes, it
logs one warning (the ``cudnn_attn`` logger) naming the remedies. Counts live in a registered
cache: ``clear_caches()`` starts them over.
"""

from __future__ import annotations

import dataclasses
import logging

from ..core.caches import LRU
from ..model.problem import AttnProblem
from . import length_buckets
from ._spec import GraphSpec, analyze
from .length_buckets import bucket

__all__ = ["CHURN_WARNING", "built", "shapes_built", "buckets", "kept_exact"]

logger = logging.getLogger("cudnn_attn")

# Distinct shapes of one family built at call time before the warning.
CHURN_WARNING = 16

# family -> the sizes of the shapes built (at most CHURN_WARNING), or _WARNED
_FAMILIES = LRU("cudnn.shape_churn", maxsize=256)
_WARNED = "warned"


def _family(spec: GraphSpec, backward: bool) -> tuple:
    """The spec without what follows the sizes: batch, lengths, strides, bias sizes, bounds."""
    return backward, dataclasses.replace(
        spec, batch=0, seq_q=0, seq_kv=0, q_stride=(), k_stride=(), v_stride=(), bias_dim=None,
        bias_stride=None, max_total_seq_len_q=None, max_total_seq_len_kv=None)


def _sizes(spec: GraphSpec) -> tuple:
    return spec.batch, spec.seq_q, spec.seq_kv, spec.q_stride, spec.k_stride, spec.v_stride


def shapes_built(spec: GraphSpec, backward: bool = False) -> int:
    """How many shapes of ``spec``'s family were built at call time (``CHURN_WARNING`` once it
    warned)."""
    shapes = _FAMILIES.get(_family(spec, backward))
    if shapes is None:
        return 0
    return CHURN_WARNING if shapes is _WARNED else len(shapes)


def buckets(problem: AttnProblem, spec: GraphSpec) -> bool:
    """Whether ``problem`` (which cuDNN takes as ``spec``) runs on its length bucket's graph
    (``length_buckets``): its kind churns and its own graph is not cached (``_churning``), and
    nothing keeps it on its own (``kept_exact``). A call of a bucket's sizes without a padding
    mask shares that graph (nothing copied when q, k, v are contiguous)."""
    return _churning(problem, spec) and not kept_exact(problem, spec)


def kept_exact(problem: AttnProblem, spec: GraphSpec) -> list[str]:
    """Why a call of a churning kind whose own graph is not cached still builds it rather than
    run on its length bucket's (empty: it buckets, or it is no such call): the switch, what
    the call reads of positions (``length_buckets.reasons``), or cuDNN's rules for the
    bucket's graph."""
    if not _churning(problem, spec):
        return []
    why = ([] if length_buckets.enabled() else [f"{length_buckets.ENV}=0"]) + \
        length_buckets.reasons(problem)
    if why:
        return why
    bucketed = length_buckets.bucketed_problem(problem, planning=True)
    return [f"cuDNN declines its bucket's graph: {r}" for r in analyze(bucketed)[1]]


def _churning(problem: AttnProblem, spec: GraphSpec) -> bool:
    """Whether ``BUCKET_AFTER`` shapes of ``problem``'s kind were built at call time, its own
    forward graph is neither built nor loaded, and it is not its bucket's graph already
    (bucket sizes with a padding mask)."""
    if problem.padding is not None and \
            (bucket(problem.seq_q), bucket(problem.seq_kv)) == (problem.seq_q, problem.seq_kv):
        return False
    forward = spec.forward_for(problem)
    if shapes_built(forward) < length_buckets.BUCKET_AFTER:
        return False
    from .cache import graph_cache, make_key

    return not graph_cache.available(make_key(("sdpa_forward", forward), problem.device))


def _bucket_graph(spec: GraphSpec) -> bool:
    """Whether ``spec`` is a length bucket's graph: lengths as a padding mask, sizes buckets."""
    return (spec.padding and not spec.synthetic_padding and bucket(spec.seq_q) == spec.seq_q
            and bucket(spec.seq_kv) == spec.seq_kv)


def built(spec: GraphSpec, backward: bool, graph):
    """Count ``graph``, just built at call time for ``spec``; returns it."""
    if _bucket_graph(spec):  # a few per family by construction
        return graph
    family = _family(spec, backward)
    shapes = _FAMILIES.get(family)
    if shapes is _WARNED:
        return graph
    if shapes is None:
        shapes = _FAMILIES.put(family, set())
    shapes.add(_sizes(spec))
    if len(shapes) >= CHURN_WARNING:
        _FAMILIES.pop(family)
        _FAMILIES.put(family, _WARNED)
        logger.warning(
            "cudnn_attn: %d cuDNN %s graphs built at call time for shapes that differ only in "
            "batch size or sequence lengths (latest B=%d, S_q=%d, S_kv=%d); each build costs "
            "milliseconds to tens of milliseconds. The engine buckets sequence lengths itself "
            "only for calls without a bias, ALiBi, dropout or score_mod (explain() says why "
            "not); when the batch or the lengths change at every call (a decode loop over a "
            "growing cache, dynamic padding), pad to a few buckets "
            "(cudnn_attn.graphs.BucketPolicy), keep a whole cache with device lengths "
            "(cudnn_attn.varlen.attention_with_kvcache), or run these calls on another engine "
            "(with cudnn_attn.exclude_backend('cudnn'): ...).", len(shapes),
            "backward" if backward else "forward", spec.batch, spec.seq_q, spec.seq_kv)
    return graph

