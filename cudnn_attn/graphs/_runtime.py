"""Per-call plumbing of the cuDNN engine: handles, workspaces, and the small runtime inputs.

* One cuDNN handle per device (``DeviceHandle``, in the registered LRU ``cudnn.handles``, so
  ``clear_caches()`` drops it), shared by every thread: a forward (on the caller's thread) and
  its backward (on autograd's device thread) run with the same handle. cuDNN forbids using one
  handle from two threads at once, so each ``execute`` holds the handle's lock, and binds it to
  torch's current stream there (``cudnn.set_stream`` only when the stream changed). One handle
  per device rather than per stream: a CUDA-graph capture runs on a stream of its own, and
  creating a cuDNN handle inside a capture is not allowed; a new stream only needs a new
  ``StreamContext``, a Python object.
* Workspaces come from a pool, one buffer per (device, stream) (``StreamContext``), grown to the
  largest size asked for and never shrunk (no per-call allocation of the backward's ~100 MiB).
  Work on one stream is ordered, so the calls sharing its buffer never overlap. While the stream
  is being captured into a CUDA graph, a workspace comes from torch's allocator instead (the
  graph's private pool keeps it for the replays; the shared buffer may be reused by eager calls
  in between).
* Runtime values are graph inputs, never graph attributes: the softmax scale (pass-by-value
  fp32), the padding lengths (``[B, 1, 1, 1]`` int32 on the device), the Philox seed/offset
  (pass-by-value int64), ragged offsets and page tables. Small bounded caches keep the host-side
  cost of host lengths off the hot path (their device tensors are made once per value set, so a
  call never copies host lengths to the device); lengths, offsets and tables given as device
  tensors are converted on the device and never read (no host synchronisation, so a call can be
  captured in a CUDA graph).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..core.caches import LRU
from ..core.probe import capturing, kept_if_captured, raw_stream
from ..model.inputs import device_constant, row_positions, scalar_zero, sequence_axis
from ._emit import UID

# the ragged offsets' uids in ragged_offsets_of's row order
_RAGGED_UIDS = (UID.RAGGED_Q, UID.RAGGED_O, UID.RAGGED_STATS, UID.RAGGED_K, UID.RAGGED_V)

if TYPE_CHECKING:  # annotations only: _spec imports the runtime's users
    from ._spec import Band, GraphSpec

__all__ = ["DeviceHandle", "StreamContext", "stream_context", "handle_for", "workspace",
           "capturing", "ScalarCache", "LengthCache", "device_lengths", "ragged_offsets",
           "ragged_offsets_of", "int32_column", "token_rows_without_keys", "token_positions",
           "PAST_THE_END", "page_tables", "aligned", "philox_tensors", "positive_scale",
           "scaled_same_strides", "empty_rows", "padded_rows", "empty_views", "padded_row_views",
           "bias_needs_copy"]

# device index -> DeviceHandle: the device's one cuDNN handle.
_HANDLES = LRU("cudnn.handles", 64)
# (device index, raw stream) -> StreamContext: that stream's workspace and its device's handle.
_STREAMS = LRU("cudnn.streams", 256)
# (dtype, value) -> pass-by-value (1, 1, 1, 1) host tensor.
_SCALARS = LRU("cudnn.scalars", 256)
# (elements per token, device) -> [5, 1] int32 elements per token of Q, O, Stats, K, V.
_OFFSET_MULTIPLIERS = LRU("cudnn.offset_multipliers", 64)
# (spec, lens_q, lens_kv, device) -> device seq_len_q, seq_len_kv and the empty-row mask.
_LENGTHS = LRU("cudnn.lengths", 256)
# (power of two, device) -> int32 arange: the packed tokens' positions.
_TOKENS = LRU("cudnn.token_positions", 16)


def _current_device() -> int:
    return torch.cuda.current_device()


class DeviceHandle:
    """A device's cuDNN handle, the lock that keeps two threads from using it at once, and the
    stream it is bound to now."""

    __slots__ = ("handle", "lock", "stream", "_set_stream")

    def __init__(self, handle, set_stream):
        self.handle, self._set_stream = handle, set_stream
        self.lock = threading.Lock()
        self.stream: Optional[int] = None

    def bind(self, stream: int) -> Any:
        """The handle, bound to ``stream`` (call with the lock held)."""
        if self.stream != stream:
            self._set_stream(self.handle, stream)
            self.stream = stream
        return self.handle


class StreamContext:
    """What calls on one (device, stream) share: the device's handle and the pooled
    workspace."""

    __slots__ = ("device", "stream", "shared", "_workspace")

    def __init__(self, device: torch.device, stream: int, shared: DeviceHandle):
        self.device, self.stream, self.shared = device, stream, shared
        self._workspace: Optional[torch.Tensor] = None

    @property
    def handle(self):
        return self.shared.handle

    def workspace(self, size: int) -> Optional[torch.Tensor]:
        """At least ``size`` bytes of device memory for one ``execute`` on this stream."""
        if not size:
            return None
        if capturing():  # a captured graph keeps its own (torch's graph pool holds it)
            return torch.empty(size, dtype=torch.uint8, device=self.device)
        buffer = self._workspace
        if buffer is None or buffer.numel() < size:
            # The old buffer goes back to torch's allocator on this stream: ordered after the
            # work already queued that uses it.
            buffer = self._workspace = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buffer

    def execute(self, graph, buffers, workspace_size: int) -> None:
        """``graph.execute(buffers, workspace, handle)`` on this stream, under the handle's
        lock."""
        shared = self.shared
        with shared.lock:
            if shared.stream != self.stream:
                shared.bind(self.stream)
            graph.execute(buffers, self.workspace(workspace_size), shared.handle)


def _new_handle(index: int) -> DeviceHandle:
    import cudnn

    with torch.cuda.device(index):  # a handle binds the current device
        return DeviceHandle(cudnn.create_handle(), cudnn.set_stream)


def stream_context(device: torch.device) -> StreamContext:
    """The ``StreamContext`` of torch's current stream on ``device`` (made on first use)."""
    index = device.index
    if index is None:  # tensors on CUDA always name theirs; a bare "cuda" may not
        index = _current_device()
    key = (index, raw_stream(index))
    context = _STREAMS.get(key)
    if context is None:
        if device.index is None:
            device = torch.device(device.type, index)
        shared = _HANDLES.get(index)
        if shared is None:
            shared = _HANDLES.put(index, _new_handle(index))
        context = _STREAMS.put(key, StreamContext(device, key[1], shared))
    return context


def handle_for(device: torch.device):
    """``device``'s cuDNN handle, bound to torch's current stream there (for a caller that runs
    it itself: graph builds, deserialisation)."""
    context = stream_context(device)
    with context.shared.lock:
        return context.shared.bind(context.stream)


def workspace(size: int, device: torch.device) -> Optional[torch.Tensor]:
    """A pooled workspace of at least ``size`` bytes on torch's current stream of ``device``."""
    return stream_context(device).workspace(size)


ALIGNMENT = 16  # bytes: cuDNN faults on a base pointer aligned less


def aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its base pointer is ``ALIGNMENT``-byte aligned (cuDNN faults
    otherwise), else a copy with the same strides (the graph was built for them)."""
    if t.data_ptr() % ALIGNMENT == 0:
        return t
    copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return copy.copy_(t)


def bias_operand(spec, bias: torch.Tensor) -> torch.Tensor:
    """The bias as ``spec`` declares it: ``bias`` itself (16-byte aligned), or, where the graph
    spans S_q or S_kv along which the bias broadcasts (a backward graph: cuDNN's backward reads
    ``(1|B, 1|H_q, S_q, S_kv)`` only), a contiguous copy broadcast to ``spec.bias_dim``."""
    if not bias_needs_copy(spec, bias.shape, bias.stride()):
        return aligned(bias)
    full = bias[(None,) * (4 - bias.dim())]
    spans = _spans(full.shape, full.stride())
    source = full
    for axis in range(4):  # broadcast axes read from their first element
        if not spans[axis]:
            source = source.narrow(axis, 0, 1)
    return torch.empty(spec.bias_dim, dtype=bias.dtype, device=bias.device).copy_(source)


def _spans(shape, stride) -> list[bool]:
    """Per axis of a ``[B, H, S_q, S_kv]``-broadcastable tensor (leading axes implied), whether
    it holds more than one value along it."""
    implied = [False] * (4 - len(shape))
    return implied + [n > 1 and st != 0 for n, st in zip(shape, stride)]


def bias_needs_copy(spec, shape, stride) -> bool:
    """Whether ``bias_operand`` copies a bias of this shape and these strides for ``spec``
    (else it binds the bias itself): the call signature fixes both, so a runner asks once."""
    spans = _spans(shape, stride)
    return not all(spans[a] or spec.bias_dim[a] == 1 for a in (2, 3))


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
    """Pass-by-value ``(1, 1, 1, 1)`` host tensors, one per value: a small dict of this cache's
    own in front of the shared LRU ``cudnn.scalars`` (the hit costs one dict lookup)."""

    __slots__ = ("_dtype", "_local")
    _LOCAL_MAX = 16

    def __init__(self, dtype: torch.dtype = torch.float32):
        self._dtype = dtype
        self._local: dict = {}

    def get(self, value) -> torch.Tensor:
        found = self._local.get(value)
        if found is None:
            dtype = self._dtype
            found = _SCALARS.get_or_create((dtype, value),
                                           lambda: torch.full((1, 1, 1, 1), value, dtype=dtype))
            if len(self._local) >= self._LOCAL_MAX:
                self._local.clear()
            self._local[value] = found
        return found


_OFFSETS = ScalarCache(torch.int64)


class LengthCache:
    """Per padding-length tuple: device ``seq_len_q``/``seq_len_kv`` and the rows that see no
    key (``[B, S_q]``, or one flag per packed token of a ragged spec, and its ``empty_views``, or
    ``None`` when every row sees one), copied to the device once per value set (shared LRU
    ``cudnn.lengths``, keyed by the graph spec too, behind a small dict of this cache's own)."""

    __slots__ = ("_spec", "_local")
    _LOCAL_MAX = 64

    def __init__(self, spec):
        self._spec = spec
        self._local: dict = {}

    def get(self, lens_q: tuple, lens_kv: tuple, device: torch.device, total: int = 0):
        """``(seq_len_q, seq_len_kv, empty, views)`` of these lengths on ``device``; ``total``:
        the packed query tokens of a ragged spec."""
        key = (lens_q, lens_kv, device, total)
        found = self._local.get(key)
        if found is None:
            found = _LENGTHS.get_or_create((self._spec, *key),
                                           lambda: self._make(lens_q, lens_kv, device, total))
            if len(self._local) >= self._LOCAL_MAX:
                self._local.clear()
            self._local[key] = found
        return kept_if_captured(found)  # a captured graph keeps reading them, evicted or not

    def _make(self, lens_q, lens_kv, device, total):
        b = self._spec.batch
        host = torch.tensor([lens_q, lens_kv], dtype=torch.int32).view(2, b, 1, 1, 1)
        moved = host.to(device, non_blocking=False)  # once per value set (then cached)
        lens = aligned(moved[0]), aligned(moved[1])  # the kv row starts 4 * B bytes in
        if self._spec.ragged:  # the offsets are the lengths' running sums
            cu = torch.nn.functional.pad(host[0].view(b).cumsum(0), (1, 0))
            empty = token_rows_without_keys(self._spec.band, cu, host[0], host[1], total)
        else:
            empty = padded_rows(self._spec, lens_q, lens_kv)
        if not bool(empty.any()):
            return lens[0], lens[1], None, None
        empty = empty.to(device)
        return lens[0], lens[1], empty, empty_views(self._spec, empty)


def philox_tensors(state) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's pass-by-value Philox ``(seed, offset)`` tensors of a call's ``DropoutState``: a
    fresh seed per call, the offset (0 unless a surface replays a stream) from a cache."""
    return (torch.full((1, 1, 1, 1), state.seed, dtype=torch.int64),
            _OFFSETS.get(state.offset))


# ---------------------------------------------------------------------------------------------
# Device-side lengths, ragged offsets and page tables (never read on the host)
# ---------------------------------------------------------------------------------------------

def int32_column(t: torch.Tensor, shape: tuple, device=None) -> torch.Tensor:
    """``t`` as a contiguous, aligned int32 tensor of ``shape`` (moved to ``device`` when given,
    without waiting: one op for the move and the cast)."""
    moved = t.to(torch.int32) if device is None else \
        t.to(device=device, dtype=torch.int32, non_blocking=True)
    return aligned(moved.contiguous().view(shape))


def device_lengths(spec, padding, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(seq_len_q, seq_len_kv)`` of a ``Padding`` with runtime (device) lengths: the
    ``[B, 1, 1, 1]`` int32 graph inputs (``padded_row_views`` / ``padded_rows`` of them: the
    rows that see no key), moved to ``device`` and never read. One tensor for both sides (the
    usual self-attention ``Padding(lengths)``) is converted once and returned twice: the rows
    that see no key then take one comparison (``empty_rows``)."""
    shape = (spec.batch, 1, 1, 1)
    lens_q, lens_kv = padding.runtime
    seq_q = int32_column(lens_q, shape, device)
    return seq_q, seq_q if lens_kv is lens_q else int32_column(lens_kv, shape, device)


def ragged_offsets(spec, storage) -> dict:
    """Element offsets of each sequence's first token in the packed (contiguous, token-major)
    Q, K, V, O and Stats, ``[B + 1, 1, 1, 1]`` int32, from the cumulative lengths: two
    elementwise products (the q side's three, the k side's two, rows of one buffer whose rows
    start 16-byte aligned; one product when both sides share their offsets), where one product
    and one cast per offset cost ten kernels. int32 arithmetic wraps as the cast of an int64
    product would (cuDNN reads int32 offsets). Kept in ``storage.derived``: the call's backward
    binds the forward's."""
    per_token = (spec.heads_q * spec.dim_qk, spec.heads_q * spec.dim_v, spec.heads_q,
                 spec.heads_kv * spec.dim_qk, spec.heads_kv * spec.dim_v)
    found = storage.derived.get(per_token)
    if found is None:
        found = storage.derived[per_token] = ragged_offsets_of(
            spec.batch, per_token, storage.cu_seqlens_q, storage.cu_seqlens_k)
    return found


def ragged_offsets_of(batch: int, per_token: tuple, cu_seqlens_q: torch.Tensor,
                      cu_seqlens_k: torch.Tensor) -> dict:
    """``ragged_offsets``' buffers of these offsets (``per_token``: elements per token of the q
    side's Q, O, Stats and the k side's K, V)."""
    b1 = batch + 1
    width = -(-b1 // 4) * 4  # 4 int32 = 16 bytes: every row starts aligned
    # cu [B + 1, 1, 1, 1] times the multipliers [5, 1, 1, 1, 1]: five rows in the graph's shape
    column = (b1, 1, 1, 1)
    cu_q = cu_seqlens_q.to(torch.int32).view(column)
    # five rows of b1 in a [5, width] block: one allocation, no slicing op
    rows = torch.empty_strided((5, b1, 1, 1, 1), (width, 1, 1, 1, 1), dtype=torch.int32,
                               device=cu_q.device)
    multipliers = _offset_multipliers(per_token, cu_q.device)
    if cu_seqlens_k is cu_seqlens_q:
        torch.mul(cu_q, multipliers, out=rows)
    else:
        torch.mul(cu_q, multipliers[:3], out=rows[:3])
        torch.mul(cu_seqlens_k.to(torch.int32).view(column), multipliers[3:], out=rows[3:])
    return dict(zip(_RAGGED_UIDS, rows.unbind(0)))


def _offset_multipliers(per_token: tuple, device) -> torch.Tensor:
    """``per_token``, the elements per token of the q side's Q, O, Stats and the k side's K, V,
    as int32 ``[5, 1, 1, 1, 1]`` on ``device`` (made once per head counts, dims and device, by
    fills on the device: no host copy, which a capture would refuse)."""
    def make():
        both = torch.empty((5, 1, 1, 1, 1), dtype=torch.int32, device=device)
        for row, n in enumerate(per_token):
            both[row].fill_(n)
        return both

    return device_constant(_OFFSET_MULTIPLIERS, (per_token, device), make)


# ``CudnnPlan._common``'s answer for packed self-attention with device lengths: the only tokens
# that see no key are those past the last sequence, which cuDNN never writes, so out and stats are
# made as zeros and -inf (one fill each) where flagging the tokens and filling the flagged rows
# after the call cost three kernels, the fills of out reading it too.
PAST_THE_END = "tokens past the last sequence"


def token_rows_without_keys(band: Optional[Band], cu_seqlens_q: torch.Tensor,
                            lens_q: torch.Tensor, lens_kv: torch.Tensor,
                            total: int) -> torch.Tensor:
    """Bool ``[total]``: the packed query tokens that see no key (``empty_rows`` of each token's
    row in its sequence), from ``[B + 1]`` offsets and ``[B]`` lengths (any shape of ``B``
    elements) on one device, never read. Tokens past ``cu_seqlens_q[-1]`` (none in a valid call)
    see none. A token is a row of its sequence, so without a band that can empty rows only a
    sequence without keys has such rows, and with one lengths tensor for both sides none has:
    one to five ops where the ``[B, S_q]`` rows read back at every token cost eleven."""
    cu = cu_seqlens_q.view(-1)
    token = token_positions(total, cu.device)
    past_the_end = token >= cu[-1:]
    if lens_kv is lens_q:  # self-attention: a band keeps the diagonal (left >= 1, right >= 0),
        return past_the_end  # and a sequence without keys has no tokens either
    # the sequence of each token; past the end: the last one (the searchsorted bounds skip it)
    seq = torch.searchsorted(cu[1:-1], token, right=True)
    lkv = lens_kv.view(-1)
    if not _band_empties_rows(band):
        return (lkv == scalar_zero(lkv))[seq] | past_the_end
    return empty_rows(band, token - cu[seq], lens_q.view(-1)[seq], lkv[seq])


def token_positions(total: int, device) -> torch.Tensor:
    """``0 .. total - 1`` (int32) on ``device``: a view of one cached arange per power of two,
    so that the token counts of varlen calls (new each batch) share a few."""
    size = 1 << max(total - 1, 0).bit_length()
    return device_constant(_TOKENS, (size, device), lambda: torch.arange(
        size, dtype=torch.int32, device=device))[:total]


def page_tables(spec, storage) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V block tables as cuDNN's ``[B, 1, pages, 1]`` int32 page tables."""
    shape = (spec.batch, 1, spec.seq_kv // spec.paged.page_size, 1)
    table_k = int32_column(storage.block_table, shape)
    table_v = table_k if storage.v_table is None else int32_column(storage.v_table, shape)
    return table_k, table_v


def empty_rows(band: Optional[Band], i: torch.Tensor, lq: torch.Tensor,
               lkv: torch.Tensor) -> torch.Tensor:
    """Whether query row ``i`` of a sequence with ``lq`` queries and ``lkv`` keys sees no key
    (past its length, no keys, or a band that misses every key); broadcasts elementwise. The
    same tensor for both lengths: a sequence without keys has no rows either (one op less)."""
    empty = i >= lq
    if lkv is not lq:
        empty = empty | (lkv == scalar_zero(lkv))  # a 0-dim tensor: no scalar to wrap per call
    if not _band_empties_rows(band):
        return empty
    if band.left is None:  # bottom-right: row i sees keys 0 .. min(i + lkv - lq + R, lkv - 1),
        if band.right is not None:  # none iff i + R < lq - lkv (no keys: empty already)
            empty = empty | ((i + band.right if band.right else i) < lq - lkv)
        return empty
    aligned = i + (lkv - lq if band.alignment == "bottom_right" else 0)
    lo = torch.clamp(aligned - band.left + 1, min=0)
    hi = torch.minimum(aligned + band.right, lkv - 1) if band.right is not None else lkv - 1
    return empty | (hi < lo)


def _band_empties_rows(band: Optional[Band]) -> bool:
    """Whether ``band`` can leave a row of a sequence with keys without any: not when there is
    none, nor for a top-left band unbounded on the left (causal), which keeps key 0 for every
    row (the common runtime-padding call then skips six tensor ops)."""
    return band is not None and not (band.left is None and band.alignment == "top_left")


def padded_rows(spec: GraphSpec, lens_q, lens_kv) -> torch.Tensor:
    """Bool ``[B, S_q]``: query rows that see no key (padding, or a band with per-batch
    bottom-right alignment that misses every valid key). ``lens_q`` / ``lens_kv``: host ints
    (a CPU result) or ``[B]`` / ``[B, 1, 1, 1]`` integer tensors (kept on their device, never
    read)."""
    b = spec.batch
    lq, lkv = (torch.as_tensor(n).view(b, 1, 1, 1) for n in (lens_q, lens_kv))
    return _rows_without_keys(spec, lq, lkv).view(b, spec.seq_q)


def padded_row_views(spec: GraphSpec, seq_len_q: torch.Tensor, seq_len_kv: torch.Tensor,
                     queries_full: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``empty_views`` of the rows that see no key, from the ``[B, 1, 1, 1]`` graph lengths of a
    dense (not packed) spec: made in the stats' ``[B, 1, S_q, 1]`` shape (no ``[B, S_q]`` to
    view twice), out's a view of it in bshd. ``queries_full``: every query row is a token (a
    KV-cache call's): without a band that can empty rows, or with one query row (which every
    band keeps on a key: ``left >= 1``, ``right >= 0``, aligned at key 0 or at the last key), only
    a sequence without keys has rows that see none, one ``[B, 1, 1, 1]`` comparison that
    broadcasts against out and stats."""
    if queries_full and (spec.seq_q == 1 or not _band_empties_rows(spec.band)):
        empty = seq_len_kv == scalar_zero(seq_len_kv)
        return empty, empty
    empty = _rows_without_keys(spec, seq_len_q, seq_len_kv)
    if spec.layout == "bhsd":
        return empty, empty
    return empty.view(spec.batch, spec.seq_q, 1, 1), empty


def _rows_without_keys(spec: GraphSpec, lq: torch.Tensor, lkv: torch.Tensor) -> torch.Tensor:
    """``[B, 1, S_q, 1]`` ``empty_rows`` of ``[B, 1, 1, 1]`` lengths (positions of ``lq``'s
    dtype: no cast to compare)."""
    return empty_rows(spec.band, row_positions(spec.seq_q, lq.device, lq.dtype), lq, lkv)


def empty_views(spec: GraphSpec, empty: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that see no key broadcast against out and stats: ``[B, S_q]`` against out (the
    call's layout) and stats ``[B, H, S_q, 1]``; packed (``[total_q]``) against
    ``[total_q, H, *]`` both."""
    if spec.ragged:
        rows = empty.view(-1, 1, 1)
        return rows, rows
    return sequence_axis(empty, spec.layout), sequence_axis(empty, "bhsd")
