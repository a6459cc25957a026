"""Shape churn: cuDNN graphs built at call time for shapes that differ only in their sizes.

A cuDNN graph is specialised on its shapes, and building one costs milliseconds to tens of
milliseconds of host time (about 40 ms per graph in the H200 record, ``docs/benchmarks.md``). A
workload whose batch or sequence lengths change at every call -- a decode loop over a growing
cache (Hugging Face's dynamic cache), dynamic padding per batch -- therefore builds a graph per
call, and the builds dominate. ``built`` is told of every graph the engine builds at call time
(never of a graph loaded from the disk cache or warmed ahead) and counts the distinct shapes
per family (the graph's spec without its sizes and strides); when a family reaches
``CHURN_WARNING`` shapes it logs one warning (the ``cudnn_attn`` logger) naming the remedies.
Counts live in a registered cache: ``clear_caches()`` starts them over.
"""

from __future__ import annotations

import dataclasses
import logging

from ..core.caches import LRU
from ._spec import GraphSpec

__all__ = ["CHURN_WARNING", "built"]

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


def built(spec: GraphSpec, backward: bool, graph):
    """Count ``graph``, just built at call time for ``spec``; returns it."""
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
            "milliseconds to tens of milliseconds. When the lengths change at every call (a "
            "decode loop over a growing cache, dynamic padding), pad to a few buckets "
            "(cudnn_attn.graphs.BucketPolicy), keep a whole cache with device lengths "
            "(cudnn_attn.varlen.attention_with_kvcache), or run these calls on another engine "
            "(with cudnn_attn.exclude_backend('cudnn'): ...).", len(shapes),
            "backward" if backward else "forward", spec.batch, spec.seq_q, spec.seq_kv)
    return graph

