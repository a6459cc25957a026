"""The cuDNN graph of a varlen or KV-cache call, as ``graphs.describe`` shows it: the problem of
``cudnn_attn.packed.calls`` (what ``attention_varlen`` / ``attention_with_kvcache`` run on an
accelerator) with its packed or paged storage spelled as builder options (ragged offsets on
Q/K/V/O/Stats, or page tables). Lengths, offsets and page tables are graph inputs: one graph
serves every batch of lengths.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..packed.calls import kvcache_problem, varlen_problem
from . import _spec
from ._spec import GraphOptions

__all__ = ["CALL_ARGS", "call_problem"]

CALL_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "cache_seqlens",
             "block_table")


def call_problem(q, k, v, *, options: Optional[GraphOptions] = None, cu_seqlens_q=None,
                 cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, cache_seqlens=None,
                 block_table=None, mask=None, bias=None, **attention_kwargs):
    """``(problem, options)`` of the graph cuDNN builds for a varlen call (``cu_seqlens_*``) or a
    KV-cache call (``cache_seqlens``; ``k``/``v`` are the caches), or ``None`` for neither.

    ``options`` (other builder options, e.g. ``deterministic``) is merged with the call's ragged
    layout or page tables. The problem is a ``bshd`` one with a ``Padding`` mask of the call's
    lengths (full lengths when they are ``meta``).
    """
    varlen = any(a is not None for a in (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    kvcache = cache_seqlens is not None or block_table is not None
    if not (varlen or kvcache):
        return None
    if varlen and kvcache:
        raise ValueError("pass the varlen arguments (cu_seqlens_q/k, max_seqlen_q/k) or the "
                         "KV-cache ones (cache_seqlens, block_table), not both")
    layout = attention_kwargs.pop("layout", "bshd")
    if layout != "bshd":
        raise ValueError(f"varlen and KV-cache calls are token-major: layout must be 'bshd', "
                         f"got {layout!r}")
    if varlen:
        problem = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 mask=mask, bias=bias, **attention_kwargs)
    else:
        if cache_seqlens is None:
            raise ValueError("a KV-cache call needs cache_seqlens")
        problem = kvcache_problem(q, k, v, cache_seqlens, block_table, mask=mask, bias=bias,
                                  **attention_kwargs)
    # describe's contract: the dense-batch problem, with its storage as builder options.
    options = _spec.with_storage(options or GraphOptions(), problem.storage)
    return dataclasses.replace(problem, storage=None), options
