"""KV-cache calls on the native route, their problem and plan made once per call signature.

A decode step (``attention_with_kvcache`` / ``flash_attn_with_kvcache`` with device lengths and
page tables) used to rebuild its problem (argument checks, meta tensors, the mask with its
``Padding``) and plan it on every call: about 200 us of host time per call on the CPU stand-in
(``benchmarks/cudnn_host.py``, row "ours paged decode"), 550 Python calls. With the lengths and
page tables as runtime tensors, the problem and so its plan depend on the call's signature only
(shapes, strides, dtypes, devices and flags: ``Padding``\\ s of runtime lengths compare equal, and
page tables are not compared), so ``stored_kvcache`` keeps ``execution.plan_stored``'s answer per
signature. A later call makes only its own runtime tensors (``calls.kvcache_padding``,
``calls.paged_storage``) and runs the kept problem with them in place (``AttnProblem.rebound``).
Every check the first call made reads shapes, dtypes and devices, which the signature fixes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from . import calls
from ..core import dispatch, execution
from ..core.caches import LRU
from ..model.problem import deterministic_default

__all__ = ["stored_kvcache"]

# call signature -> plan_stored's (engine, problem, plan), or _DENSE when no engine runs the
# cache as it lies (the surface then builds dense batches).
_PREPARED = LRU("packed.prepared", maxsize=256)
_DENSE = object()
_Tensor = torch.Tensor


def _runtime_tensor(t) -> bool:
    """A tensor whose values the call passes on unread (a subclass too: never looked into),
    not a meta or fake one (tracing: the traced path decides)."""
    if type(t) is _Tensor:  # the common case, and never a fake one
        return not t.is_meta
    return isinstance(t, _Tensor) and not t.is_meta and not is_fake(t)


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _kvcache_key(q, k_cache, v_cache, cache_seqlens, block_table, mask, bias, backend,
                 adjust: Optional[dict], kwargs: dict) -> Optional[tuple]:
    """The signature of a KV-cache call whose lengths (and page table) stay on the device, or
    ``None`` for a call the cache does not keep (host lengths, tensor subclasses, unhashable
    arguments)."""
    if not (type(q) is _Tensor and type(k_cache) is _Tensor and type(v_cache) is _Tensor
            and _runtime_tensor(cache_seqlens) and calls.on_accelerator(cache_seqlens)
            and (block_table is None or _runtime_tensor(block_table))
            and not torch.compiler.is_compiling()):
        return None
    table = None if block_table is None else \
        (block_table.shape, block_table.dtype, block_table.device)
    key = (_tensor_key(q), _tensor_key(k_cache), _tensor_key(v_cache),
           (cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device), table, mask, bias,
           backend, tuple(sorted((adjust or {}).items())), tuple(sorted(kwargs.items())),
           deterministic_default(), dispatch.policy_key())
    try:
        hash(key)
    except TypeError:
        return None
    return key


def stored_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, *, mask=None, bias=None,
                   backend: str = "auto", adjust: Optional[dict] = None,
                   **kwargs: Any) -> Optional[tuple]:
    """``execution.plan_stored(kvcache_problem(..., read=False, **kwargs), backend)`` (the
    problem's fields in ``adjust`` replaced first): ``(engine, problem, plan)`` with this call's
    lengths and page table, or ``None`` when no engine runs the cache as it lies. Raises what
    those raise (a forced backend that declines: ``NotSupportedError``)."""
    key = _kvcache_key(q, k_cache, v_cache, cache_seqlens, block_table, mask, bias, backend,
                       adjust, kwargs)
    found = None if key is None else _PREPARED.get(key)
    if found is None:
        problem = calls.kvcache_problem(q, k_cache, v_cache, cache_seqlens, block_table,
                                        mask=mask, bias=bias, read=False, **kwargs)
        if adjust:
            problem = dataclasses.replace(problem, **adjust)
        planned = execution.plan_stored(problem, backend)
        if key is not None:
            _PREPARED.put(key, _DENSE if planned is None else planned)
        return planned
    if found is _DENSE:
        return None
    engine, problem, plan = found
    storage = None if block_table is None else calls.paged_storage(q, k_cache, block_table)
    return engine, problem.rebound(calls.kvcache_padding(q, cache_seqlens), storage), plan
