"""A paged KV-cache step (``attention_with_kvcache`` with a block table and device lengths) as
one runner bound once per kept call signature: the direct path of cuDNN's page-table graphs.

Why: a decode step of a paged cache is a serving loop's hottest call, once per layer and token.
With its problem and plan kept (``packed.prepared``), a step still rebuilt a ``Padding`` and
``Paged`` storage, a rebound problem and the plan's buffer dict (about 40 us of host time on the
CPU stand-in, ``benchmarks/cudnn_host.py`` row "paged decode"). ``PagedCall`` makes only what
the step brings: the key lengths and the page table in the graph's int32 shapes, and out.

The results are the full path's (``CudnnPlan.forward``): the pools are read through the table
as they lie (nothing past the lengths is copied or hidden: cuDNN reads only the pages the
lengths reach), and a sequence without keys gets out 0.
"""

from __future__ import annotations

import torch

from . import _runtime
from .launch import aligned_inputs, execute
from ._emit import UID

__all__ = ["PagedCall"]

_Q, _K, _V, _O, _SCALE = (int(UID.Q), int(UID.K), int(UID.V), int(UID.O), int(UID.SCALE))
_SEQ_LEN_Q, _SEQ_LEN_KV = int(UID.SEQ_LEN_Q), int(UID.SEQ_LEN_KV)
_TABLE_K, _TABLE_V = int(UID.PAGE_TABLE_K), int(UID.PAGE_TABLE_V)


class PagedCall:
    """``(q, k_pool, v_pool, padding, storage) -> out`` of a kept paged signature whose forward
    graph binds q, the pools, the scale, out, the lengths and the page tables: no bias tensor,
    dropout, returned lse, gradient or sign-carrying scale (``CudnnPlan.storage_direct``
    decides). ``padding``: the step's runtime ``Padding`` (``packed.calls.kvcache_padding``),
    ``storage``: its ``Paged`` storage (``packed.calls.paged_storage``)."""

    __slots__ = ("forward", "spec", "device", "scale")

    def __init__(self, spec, forward, scale: torch.Tensor, device: torch.device):
        self.forward, self.spec, self.device, self.scale = forward, spec, device, scale

    def __call__(self, q, k_cache, v_cache, padding, storage) -> torch.Tensor:
        s, device = self.spec, self.device
        lens_q, lens_kv = _runtime.device_lengths(s, padding, device)
        table_k, table_v = _runtime.page_tables(s, storage)
        q, k_cache, v_cache = aligned_inputs(q, k_cache, v_cache)
        out = torch.empty_like(q, memory_format=torch.contiguous_format) \
            if q.shape[3] == s.dim_v else q.new_empty((*q.shape[:3], s.dim_v))
        execute(self.forward, {_Q: q, _K: k_cache, _V: v_cache, _SCALE: self.scale, _O: out,
                               _SEQ_LEN_Q: lens_q, _SEQ_LEN_KV: lens_kv, _TABLE_K: table_k,
                               _TABLE_V: table_v}, device)
        # every query row is a token (a KV-cache step): only sequences without keys, or rows a
        # band leaves keyless, see none
        empty, _ = _runtime.padded_row_views(s, lens_q, lens_kv, True)
        return out.masked_fill_(empty, 0)
