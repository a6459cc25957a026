"""cuDNN-frontend SDPA graphs: the forward/backward builders (``sdpa``), the backend that runs
them (``backend``), the graph cache (``cache``) and shape bucketing (``buckets``).

Import-light: nothing here imports ``cudnn``; the builders import it when they first run.
``describe(q, k, v, **attention_kwargs)`` returns the validated graph the engine would build,
without a GPU; with ``cu_seqlens_q/k`` + ``max_seqlen_q/k`` (a varlen call) or ``cache_seqlens``
[+ ``block_table``] (a KV-cache call) it is the ragged or page-table graph (``entry_calls``).
"""

from __future__ import annotations

from .sdpa import UID, GraphOptions, PagedKV, build_backward, build_forward, cudnn_reasons, describe

__all__ = ["describe", "cudnn_reasons", "build_forward", "build_backward", "UID", "GraphOptions",
           "PagedKV", "GraphCache", "graph_cache", "BucketPolicy"]

_LAZY = {"GraphCache": ".cache", "graph_cache": ".cache", "BucketPolicy": ".buckets"}


def __getattr__(name):
    # The cache and bucketing modules belong to other parts of the engine; load them on use.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
