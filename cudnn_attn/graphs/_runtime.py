"""Per-call plumbing of the cuDNN engine: handles, workspaces, and the small runtime inputs.

* One cuDNN handle per (thread, device), kept in the registered LRU ``cudnn.handles`` (so
  ``clear_caches()`` drops them), re-bound to torch's current stream on every call
  (``cudnn.set_stream`` skips the driver call when the stream is unchanged).
* Workspaces come from torch's caching allocator, so they follow torch's stream semantics.
* Runtime values are graph inputs, never graph attributes: the softmax scale (pass-by-value
  fp32), the padding lengths (``[B, 1, 1, 1]`` int32 on the device), the Philox seed/offset
  (pass-by-value int64), ragged offsets and page tables. Small bounded caches (``caches.LRU``)
  keep the host-side cost of host lengths off the hot path; lengths, offsets and tables given as
  device tensors are converted on the device and never read (no host synchronisation, so a call
  can be captured in a CUDA graph).
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from ..core.caches import LRU

__all__ = ["handle_for", "workspace", "ScalarCache", "LengthCache", "device_lengths",
           "ragged_offsets", "token_rows", "page_tables", "aligned", "philox_tensors",
           "positive_scale", "scaled_same_strides"]

# (thread id, device index) -> (handle, cudnn.set_stream). A handle is only ever used by the
# thread that created it; a dead thread's id reused by a new thread reuses its handle safely.
_HANDLES = LRU("cudnn.handles", None)
# (dtype, value) -> pass-by-value (1, 1, 1, 1) host tensor.
_SCALARS = LRU("cudnn.scalars", 256)
# (spec, lens_q, lens_kv, device) -> device seq_len_q, seq_len_kv and the empty-row mask.
_LENGTHS = LRU("cudnn.lengths", 256)


def _raw_stream(index: int) -> int:
    try:  # the raw cudaStream_t without building a torch.cuda.Stream object (hot path)
        return torch._C._cuda_getCurrentRawStream(index)
    except AttributeError:
        return torch.cuda.current_stream(index).cuda_stream


def handle_for(device: torch.device):
    """This thread's cuDNN handle for ``device``, bound to torch's current stream there."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (threading.get_ident(), index)
    entry = _HANDLES.get(key)
    if entry is None:
        import cudnn

        with torch.cuda.device(index):  # a handle binds the current device
            entry = _HANDLES.put(key, (cudnn.create_handle(), cudnn.set_stream))
    handle, set_stream = entry
    set_stream(handle, _raw_stream(index))  # skips the driver call when the stream is unchanged
    return handle


def workspace(size: int, device: torch.device) -> Optional[torch.Tensor]:
    return torch.empty(size, dtype=torch.uint8, device=device) if size else None


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its base pointer is 16-byte aligned (cuDNN faults otherwise), else a
    copy with the same strides (the graph was built for them)."""
    if t.data_ptr() % 16 == 0:
        return t
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return copy.copy_(t)


def bias_operand(spec, bias: torch.Tensor) -> torch.Tensor:
    """The bias as ``spec`` declares it: ``bias`` itself (16-byte aligned), or, where the graph
    spans S_q or S_kv along which the bias broadcasts (a backward graph: cuDNN's backward reads
    ``(1|B, 1|H_q, S_q, S_kv)`` only), a contiguous copy broadcast to ``spec.bias_dim``."""
    full = bias[(None,) * (4 - bias.dim())]
    spans = [n > 1 and st != 0 for n, st in zip(full.shape, full.stride())]
    if all(spans[a] or spec.bias_dim[a] == 1 for a in (2, 3)):
        return aligned(bias)
    source = full
    for axis in range(4):  # broadcast axes read from their first element
        if not spans[axis]:
            source = source.narrow(axis, 0, 1)
    return torch.empty(spec.bias_dim, dtype=bias.dtype, device=bias.device).copy_(source)


def positive_scale(scale: float) -> tuple[float, float]:
    """``(q_factor, graph_scale)`` with ``graph_scale > 0`` and ``q_factor * graph_scale ==
    scale``: the scale cuDNN is given and the factor q is multiplied by first.

    cuDNN's kernels hide pairs by writing ``-inf`` into the unscaled ``Q K^T`` and scale
    afterwards, so a scale <= 0 turns hidden pairs into NaN or ``+inf`` (an H200 with cuDNN
    9.19, causal band, issue 36). ``softmax(s * q.k) == softmax(|s| * (-q).k)`` and, at
    ``s == 0``, ``softmax(1 * 0.k)``: negating q is exact; zeroing it is the uniform softmax."""
    if scale > 0:
        return 1.0, scale
    if scale < 0:
        return -1.0, -scale
    return 0.0, 1.0


def scaled_same_strides(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor`` in a fresh, aligned buffer with ``t``'s exact strides (the graph was built
    for them; packed, strided or broadcast views included): the whole memory span ``t``
    covers is multiplied and viewed again."""
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    flat = t.as_strided((span,), (1,), t.storage_offset()) * factor
    return flat.as_strided(t.shape, t.stride(), 0)


class ScalarCache:
    """Pass-by-value ``(1, 1, 1, 1)`` host tensors, one per value (shared LRU
    ``cudnn.scalars``)."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self._dtype = dtype

    def get(self, value) -> torch.Tensor:
        dtype = self._dtype
        return _SCALARS.get_or_create((dtype, value),
                                      lambda: torch.full((1, 1, 1, 1), value, dtype=dtype))


class LengthCache:
    """Per padding-length tuple: device ``seq_len_q``/``seq_len_kv`` and the empty-row mask
    (shared LRU ``cudnn.lengths``, keyed by the graph spec too)."""

    def __init__(self, spec):
        self._spec = spec

    def get(self, lens_q: tuple, lens_kv: tuple, device: torch.device):
        return _LENGTHS.get_or_create((self._spec, lens_q, lens_kv, device),
                                      lambda: self._make(lens_q, lens_kv, device))

    def _make(self, lens_q, lens_kv, device):
        from ._spec import padded_rows

        b = self._spec.batch
        host = torch.tensor([lens_q, lens_kv], dtype=torch.int32).view(2, b, 1, 1, 1)
        lens = host.to(device, non_blocking=False)
        empty = padded_rows(self._spec, lens_q, lens_kv)
        empty_dev = empty.to(device) if bool(empty.any()) else None
        return lens[0], lens[1], empty_dev


def philox_tensors(state) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's pass-by-value Philox ``(seed, offset)`` tensors of a call's ``DropoutState``."""
    return (torch.full((1, 1, 1, 1), state.seed, dtype=torch.int64),
            torch.full((1, 1, 1, 1), state.offset, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# Device-side lengths, ragged offsets and page tables (never read on the host)
# ---------------------------------------------------------------------------------------------

def _int32(t: torch.Tensor, shape: tuple) -> torch.Tensor:
    return aligned(t.to(torch.int32).contiguous().view(shape))


def device_lengths(spec, padding, device):
    """``(seq_len_q, seq_len_kv, empty)`` of a ``Padding`` with runtime (device) lengths:
    ``[B, 1, 1, 1]`` int32 graph inputs and the ``[B, S_q]`` bool of rows that see no key."""
    from ._spec import padded_rows

    b = spec.batch
    lens_q, lens_kv = padding.tensors(device)
    return (_int32(lens_q, (b, 1, 1, 1)), _int32(lens_kv, (b, 1, 1, 1)),
            padded_rows(spec, lens_q, lens_kv))


def ragged_offsets(spec, storage) -> dict:
    """Element offsets of each sequence's first token in the packed (contiguous, token-major)
    Q, K, V, O and Stats, ``[B + 1, 1, 1, 1]`` int32, from the cumulative lengths."""
    from ._emit import UID

    shape = (spec.batch + 1, 1, 1, 1)
    cu_q = storage.cu_seqlens_q.to(torch.int64)
    cu_k = storage.cu_seqlens_k.to(torch.int64)
    return {UID.RAGGED_Q: _int32(cu_q * (spec.heads_q * spec.dim_qk), shape),
            UID.RAGGED_K: _int32(cu_k * (spec.heads_kv * spec.dim_qk), shape),
            UID.RAGGED_V: _int32(cu_k * (spec.heads_kv * spec.dim_v), shape),
            UID.RAGGED_O: _int32(cu_q * (spec.heads_q * spec.dim_v), shape),
            UID.RAGGED_STATS: _int32(cu_q * spec.heads_q, shape)}


def token_rows(per_row: torch.Tensor, cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """A ``[B, S]`` per-(sequence, row) tensor read at each of ``total`` packed tokens."""
    token = torch.arange(total, device=per_row.device)
    cu = cu_seqlens.to(device=per_row.device, dtype=torch.int64)
    seq = torch.searchsorted(cu[1:].contiguous(), token, right=True)
    seq = seq.clamp_(max=per_row.shape[0] - 1)  # tokens past cu[-1] (none in a valid call)
    row = (token - cu[seq]).clamp_(0, per_row.shape[1] - 1)
    return per_row[seq, row]


def page_tables(spec, storage) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V block tables as cuDNN's ``[B, 1, pages, 1]`` int32 page tables."""
    shape = (spec.batch, 1, spec.seq_kv // spec.paged.page_size, 1)
    table_k = _int32(storage.block_table, shape)
    table_v = table_k if storage.v_table is None else _int32(storage.v_table, shape)
    return table_k, table_v
