"""KV-cache and varlen calls on the native route, their problem and plan made once per call
signature.

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
Varlen calls (``stored_varlen``) likewise, with their offsets (``calls.varlen_runtime``): their
problem never depends on the packed token count, so the signature leaves it out (a batch of
other lengths with the same bucketed maxima reuses the entry).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from . import args, calls
from ..core import dispatch, execution
from ..core.caches import LRU
from ..model.problem import deterministic_default

__all__ = ["stored_kvcache", "stored_varlen", "direct_or_stored_kvcache",
           "direct_or_stored_varlen", "tensor_key", "modes_key"]

# call signature -> plan_stored's (engine, problem, plan) and a direct runner (or None), or
# _DENSE when no engine runs the storage as it lies (the surface then builds dense batches).
_PREPARED = LRU("packed.prepared", maxsize=256)
_DENSE = object()
_MISSING = object()
_Tensor = torch.Tensor
_functorch_active = torch._C._are_functorch_transforms_active


def _runtime_tensor(t) -> bool:
    """A tensor whose values the call passes on unread (a subclass too: never looked into),
    not a meta or fake one (tracing: the traced path decides)."""
    if type(t) is _Tensor:  # the common case, and never a fake one
        return not t.is_meta
    return isinstance(t, _Tensor) and not t.is_meta and not is_fake(t)


def tensor_key(t: torch.Tensor) -> tuple:
    """What a problem reads of a tensor: shape, strides, dtype, device, whether it needs a grad."""
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def modes_key() -> tuple:
    """The modes a problem and its plan read when they are made: the deterministic default and
    the backend policy (a kept plan is valid only under the same)."""
    return deterministic_default(), dispatch.policy_key()


def _flags(mask, bias, backend, adjust: Optional[dict], kwargs: dict) -> tuple:
    """What besides the tensors a problem depends on: the call's arguments and the modes."""
    return (mask, bias, backend, tuple(sorted((adjust or {}).items())),
            tuple(sorted(kwargs.items())), *modes_key())


def _hashable(key: tuple) -> Optional[tuple]:
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _lookup(key) -> tuple:
    """``(entry, runner)``: the key's entry (``_MISSING`` without a key, ``None`` when not
    kept) and the direct runner kept with it (``None`` when it has none, and under a functorch
    transform: a runner's node enters through the C entry point, which skips functorch's
    handling of wrapped tensors, so such a call takes the full path)."""
    if key is None:
        return _MISSING, None
    found = _PREPARED.get(key)
    if found is None or found is _DENSE or _functorch_active():
        return found, None
    return found, found[3]


def _stored(key, build, adjust: Optional[dict], backend: str, required: bool, rebind,
            found=_MISSING, runner_of=None):
    """``plan_stored(build())`` (``adjust`` replaced first) once per ``key`` (``None``: every
    call); a kept answer gets this call's runtime tensors through ``rebind(problem)``.
    ``found``: the key's entry when the caller looked it up already; ``runner_of(planned)``:
    the direct runner kept beside a new entry (its fourth field)."""
    if found is _MISSING:
        found = None if key is None else _PREPARED.get(key)
    if found is None:
        problem = build()
        if adjust:
            problem = dataclasses.replace(problem, **adjust)
        planned = execution.plan_stored(problem, backend, required=required)
        if key is not None:
            _PREPARED.put(key, _DENSE if planned is None else
                          (*planned, None if runner_of is None else runner_of(planned)))
        return planned
    if found is _DENSE:
        return None
    engine, problem, plan, _ = found
    return engine, rebind(problem), plan


def _kvcache_key(q, k_cache, v_cache, cache_seqlens, block_table, mask, bias, backend,
                 adjust: Optional[dict], kwargs: dict) -> Optional[tuple]:
    """The signature of a KV-cache call whose lengths (and page table) stay on the device, or
    ``None`` for a call the cache does not keep (host lengths, q, k or v of a tensor subclass,
    unhashable arguments)."""
    if not (type(q) is _Tensor and type(k_cache) is _Tensor and type(v_cache) is _Tensor
            and _runtime_tensor(cache_seqlens) and calls.on_accelerator(cache_seqlens)
            and (block_table is None or _runtime_tensor(block_table))
            and not torch.compiler.is_compiling()):
        return None
    table = None if block_table is None else \
        (block_table.shape, block_table.dtype, block_table.device)
    return _hashable((tensor_key(q), tensor_key(k_cache), tensor_key(v_cache),
                      (cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.device), table,
                      *_flags(mask, bias, backend, adjust, kwargs)))


def stored_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, *, mask=None, bias=None,
                   backend: str = "auto", adjust: Optional[dict] = None,
                   **kwargs: Any) -> Optional[tuple]:
    """``execution.plan_stored(kvcache_problem(..., read=False, **kwargs), backend)`` (the
    problem's fields in ``adjust`` replaced first): ``(engine, problem, plan)`` with this call's
    lengths and page table, or ``None`` when no engine runs the cache as it lies. Raises what
    those raise (a forced backend that declines: ``NotSupportedError``)."""
    key = _kvcache_key(q, k_cache, v_cache, cache_seqlens, block_table, mask, bias, backend,
                       adjust, kwargs)
    return _stored_kvcache(key, _MISSING, q, k_cache, v_cache, cache_seqlens, block_table, mask,
                           bias, backend, adjust, kwargs)


def direct_or_stored_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, *, mask=None,
                             bias=None, backend: str = "auto", **kwargs: Any) -> tuple:
    """``(out, None)`` when the call's kept runner ran it (a dense cache's
    ``graphs.launch.DirectCall``, which takes the call's lengths as a runtime ``Padding``; a
    paged cache's ``graphs.paged_call.PagedCall``), else ``(None, stored_kvcache(...)'s
    answer)``, with one signature lookup either way."""
    key = _kvcache_key(q, k_cache, v_cache, cache_seqlens, block_table, mask, bias, backend,
                       None, kwargs)
    found, runner = _lookup(key)
    if runner is not None:
        padding = calls.kvcache_padding(q, cache_seqlens)
        out = runner(q, k_cache, v_cache, None, None, padding) if block_table is None else \
            runner(q, k_cache, v_cache, padding, calls.paged_storage(q, k_cache, block_table))
        if out is not None:
            return out, None
    return None, _stored_kvcache(key, found, q, k_cache, v_cache, cache_seqlens, block_table,
                                 mask, bias, backend, None, kwargs)


def _kvcache_runner(planned) -> Any:
    """The plan's direct runner of a kept KV-cache problem: a dense cache's when it takes the
    lengths per call (``execution.direct_runner``), a paged one's ``storage_direct``; or
    ``None``."""
    _, problem, plan = planned
    if problem.storage is not None:
        return _storage_runner(planned)
    runner = execution.direct_runner(problem, plan)
    return runner if getattr(runner, "takes_lengths", False) else None


def _stored_kvcache(key, found, q, k_cache, v_cache, cache_seqlens, block_table, mask, bias,
                    backend: str, adjust: Optional[dict], kwargs: dict):
    def build():
        return calls.kvcache_problem(q, k_cache, v_cache, cache_seqlens, block_table, mask=mask,
                                     bias=bias, read=False, **kwargs)

    def rebind(problem):
        storage = None if block_table is None else calls.paged_storage(q, k_cache, block_table)
        return problem.rebound(calls.kvcache_padding(q, cache_seqlens), storage)

    return _stored(key, build, adjust, backend, False, rebind, found, _kvcache_runner)


def _varlen_key(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, mask, bias, backend,
                adjust: Optional[dict], kwargs: dict) -> Optional[tuple]:
    """The signature of a varlen call whose offsets stay on the device (the token count left
    out, the maxima bucketed as the problem buckets them), or ``None`` for one the cache does
    not keep (host offsets, a bias tensor, which fixes the maxima, q, k or v of a tensor
    subclass)."""
    if not (type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor
            and _runtime_tensor(cu_q) and _runtime_tensor(cu_k)
            and (calls.on_accelerator(cu_q) or calls.on_accelerator(cu_k)
                 or seqused_k is not None)
            and (seqused_k is None or _runtime_tensor(seqused_k))
            and not isinstance(bias, _Tensor) and not torch.compiler.is_compiling()):
        return None
    max_q, max_k = (calls.bucket_seqlen(n) for n in args.check_maxima(max_q, max_k, None, None))
    used = None if seqused_k is None else (seqused_k.shape, seqused_k.dtype, seqused_k.device)
    return _hashable((*(tensor_key(t)[1:] + (t.shape[1:],) for t in (q, k, v)),
                      k.shape[0] == v.shape[0], (cu_q.shape, cu_q.dtype, cu_q.device),
                      (cu_k.shape, cu_k.dtype, cu_k.device), used, max_q, max_k,
                      *_flags(mask, bias, backend, adjust, kwargs)))


def stored_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, mask=None, bias=None, seqused_k=None,
                  backend: str = "auto", required: bool = False, adjust: Optional[dict] = None,
                  **kwargs: Any) -> Optional[tuple]:
    """``execution.plan_stored(varlen_problem(..., read=False, **kwargs), backend, required=...)``
    (the problem's fields in ``adjust`` replaced first): ``(engine, problem, plan)`` with this
    call's offsets and lengths, or ``None`` when no engine runs the packed tensors as they lie.
    Raises what those raise."""
    key = _varlen_key(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, mask, bias, backend, adjust,
                      kwargs)
    key = None if key is None else (key, required)  # a decline raises or answers None
    return _stored_varlen(key, _MISSING, q, k, v, cu_q, cu_k, max_q, max_k, mask, bias,
                          seqused_k, backend, required, adjust, kwargs)


def direct_or_stored_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, mask=None, bias=None,
                            backend: str = "auto", **kwargs: Any) -> tuple:
    """``(out, None)`` when the call's kept runner ran it (``graphs.ragged_call.RaggedCall``:
    packed self-attention whose graphs bind nothing the offsets do not give), else
    ``(None, stored_varlen(...)'s answer)``, with one signature lookup either way."""
    key = _varlen_key(q, k, v, cu_q, cu_k, max_q, max_k, None, mask, bias, backend, None,
                      kwargs)
    key = None if key is None else (key, False)
    found, runner = _lookup(key)
    out = None if runner is None else runner(q, k, v, cu_q, cu_k)
    if out is not None:
        return out, None
    return None, _stored_varlen(key, found, q, k, v, cu_q, cu_k, max_q, max_k, mask, bias,
                                None, backend, False, None, kwargs)


def _storage_runner(planned) -> Any:
    """The plan's direct runner of a kept packed or paged problem (``CudnnPlan.storage_direct``),
    or ``None``."""
    _, problem, plan = planned
    make = getattr(plan, "storage_direct", None)
    return None if make is None else make(problem)


def _stored_varlen(key, found, q, k, v, cu_q, cu_k, max_q, max_k, mask, bias, seqused_k,
                   backend: str, required: bool, adjust: Optional[dict], kwargs: dict):
    def build():
        return calls.varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k, mask=mask, bias=bias,
                                    read=False, seqused_k=seqused_k, **kwargs)

    def rebind(problem):
        return problem.rebound(*calls.varlen_runtime(q, cu_q, cu_k, seqused_k))

    return _stored(key, build, adjust, backend, required, rebind, found, _storage_runner)
