"""Calls whose sequence lengths change from call to call, run on a few bucketed cuDNN graphs.

A cuDNN graph is specialised on its sizes, and building one costs milliseconds to tens of
milliseconds (about 40 ms per graph in the H200 record). A decode loop over a growing cache
(Hugging Face's dynamic cache through ``flash_attn_func`` or ``attention()``: keys one longer at
every step) or dynamic padding per batch would build a graph per call, and the builds would be
the whole cost. So once ``BUCKET_AFTER`` shapes of one kind (``churn.shapes_built``: the graph's
spec without its sizes) have been built at call time, a call of that kind whose own graphs are
not cached runs on the graph of its bucket instead:

* each sequence length ``n`` above ``EXACT_UP_TO`` rounds up to a multiple of a quarter of its
  power of two, at least 64 (``bucket``): less than 25 % (or 64) more rows, four graphs per
  octave;
* q, k and v are zero-padded along the sequence axis to the bucket's lengths, the real lengths
  become the graph's padding mask as device tensors (one graph for every length in the bucket,
  nothing read on the host), and out, the LSE and the gradients are sliced back.

Exact: the padded keys lie past ``seq_len_kv`` (masked, and zero, so ``0 * 0`` in ``P V``); the
padded query rows see no key (out 0, LSE ``-inf``) and are dropped; a bottom-right band under a
padding mask aligns on the lengths (cuDNN's rule), which are the call's own sizes. What a
position index means beyond that (a bias tensor, ALiBi, an explicit dropout mask, a score_mod,
a neighborhood), dropout (whose Philox pattern follows the graph's sizes) and calls whose
copies would exceed ``MAX_COPY_BYTES`` (their work dwarfs a build) keep exact graphs:
``reasons`` says why. The price is the copies in and out (q, k, v and out; dout and the
gradients in a backward), bandwidth where the alternative is a graph build; a shape that keeps
coming back (``PROMOTE_AFTER`` forwards: a training loop at a fixed length, not a decode step
over the layers) then gets its own graph and stops paying them.
``CUDNN_ATTN_LENGTH_BUCKETS=0`` keeps exact graphs for every shape (a warmed server, a
benchmark of one shape at a time).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any, Optional

import torch

from ..core.caches import LRU
from ..core.probe import capturing
from ..model.inputs import Inputs, device_constant
from ..model.masks import Causal, MaskSet, Padding, SlidingWindow, mask_parts
from ..model.problem import AttnProblem, TensorSpec
from ._spec import contiguous_strides

__all__ = ["BUCKET_AFTER", "PROMOTE_AFTER", "MAX_COPY_BYTES", "EXACT_UP_TO", "ENV", "enabled",
           "bucket", "reasons", "copy_bytes", "bucketed_problem", "BucketPlan"]

# Shapes of one kind built at call time with their exact sizes before the next ones bucket.
BUCKET_AFTER = 8
# Forwards of one shape on its bucket's graph before that shape gets its own: more than the
# calls of one decode step over a deep model's layers (each of a new length), fewer than a
# training loop at a fixed length makes in a few steps.
PROMOTE_AFTER = 256
# A call whose bucketed copies would exceed this keeps its own graph: its work dwarfs a build,
# and the copies would add to its peak memory.
MAX_COPY_BYTES = 1 << 30
# Lengths up to this stay exact (a decode step's one query; a short draft of speculative decoding).
EXACT_UP_TO = 16
ENV = "CUDNN_ATTN_LENGTH_BUCKETS"

# (batch, length, device) -> int32 [B] lengths on the device: the padding mask of a call
# without one, made by a fill (no host copy), kept for the calls of the same sizes.
_FULL_LENGTHS = LRU("length_buckets.full_lengths", 64)


def enabled() -> bool:
    """Whether calls may bucket (``CUDNN_ATTN_LENGTH_BUCKETS``, read at planning; ``0`` off)."""
    return os.environ.get(ENV, "1").strip() != "0"


def bucket(n: int) -> int:
    """The bucket of sequence length ``n``: ``n`` itself up to ``EXACT_UP_TO``, else ``n``
    rounded up to a multiple of ``max(64, 2 ** (bit_length(n) - 3))`` (a quarter of the
    power of two at or below ``n``: four buckets per octave, less than 25 % more)."""
    if n <= EXACT_UP_TO:
        return n
    step = max(64, 1 << (n.bit_length() - 3))
    return -(-n // step) * step


def reasons(problem: AttnProblem) -> list[str]:
    """Why ``problem`` cannot run on its bucket's graph (empty: it can)."""
    why = []
    if problem.storage is not None:
        why.append("packed or paged storage (its lengths are runtime values already)")
    if problem.bias is not None or problem.alibi is not None or problem.rpb is not None:
        why.append("a bias or ALiBi (sized by, or reading, the positions)")
    if problem.dropout_p > 0 or problem.dropout_mask is not None:
        why.append("dropout (its pattern follows the graph's sizes)")
    if problem.softcap is not None or problem.score_mod is not None:
        why.append("a score_mod program (its band is folded in with the call's sizes)")
    if any(not isinstance(m, (Causal, SlidingWindow, Padding)) for m in mask_parts(problem.mask)):
        why.append("a mask other than Causal, SlidingWindow and Padding")
    if problem.dtype not in (torch.float16, torch.bfloat16):
        why.append(f"{problem.dtype} inputs")
    copies = copy_bytes(problem)
    if copies > MAX_COPY_BYTES:
        why.append(f"the bucket's copies of q, k, v and out ({copies / 2**20:.0f} MiB) exceed "
                   f"{MAX_COPY_BYTES / 2**20:.0f} MiB: a call this large repays its own graph, "
                   f"and the copies would raise its peak memory")
    return why


def copy_bytes(problem: AttnProblem) -> int:
    """Bytes of the bucket's copies of q, k, v and out for ``problem``."""
    rows_q, rows_kv = problem.batch * bucket(problem.seq_q), problem.batch * bucket(problem.seq_kv)
    return problem.dtype.itemsize * (rows_q * problem.heads_q * (problem.dim_qk + problem.dim_v)
                + rows_kv * problem.heads_kv * (problem.dim_qk + problem.dim_v))


def bucketed_problem(problem: AttnProblem, planning: bool = False) -> AttnProblem:
    """``problem`` at its bucket's lengths: q, k, v contiguous in the call's layout, the mask
    with the call's own ``Padding`` (else the full lengths as device tensors:
    ``full_padding``; ``planning``: as meta tensors, for a decision or a plan, which read no
    length)."""
    seq_q, seq_kv = bucket(problem.seq_q), bucket(problem.seq_kv)
    padding = problem.padding
    if padding is None:
        padding = Padding(torch.empty(problem.batch, dtype=torch.int32, device="meta")) \
            if planning else full_padding(problem)
    others = tuple(m for m in mask_parts(problem.mask) if not isinstance(m, Padding))
    mask = MaskSet.of(*others, padding)
    axis = _seq_axis(problem)

    def spec(t: TensorSpec, seq: int) -> TensorSpec:
        shape = list(t.shape)
        shape[axis] = seq
        return TensorSpec(tuple(shape), contiguous_strides(shape), t.dtype)

    fresh = problem._copied({"seq_q": seq_q, "seq_kv": seq_kv, "q": spec(problem.q, seq_q),
                             "k": spec(problem.k, seq_kv), "v": spec(problem.v, seq_kv),
                             "mask": mask, "padding": padding})
    fresh.__post_init__()  # a new plan key
    return fresh


def full_padding(problem: AttnProblem) -> Padding:
    """The ``Padding`` of every row and key of ``problem``, as int32 device tensors (made by a
    fill, kept per size and device)."""
    def lengths(n: int) -> torch.Tensor:
        key = (problem.batch, n, problem.device)
        return device_constant(_FULL_LENGTHS, key, lambda: torch.full(
            (problem.batch,), n, dtype=torch.int32, device=problem.device))

    lens_q = lengths(problem.seq_q)
    return Padding(lens_q, lens_q if problem.seq_kv == problem.seq_q else lengths(problem.seq_kv))


def _seq_axis(problem: AttnProblem) -> int:
    return 1 if problem.layout == "bshd" else 2


def _padded(t: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """``t`` contiguous with ``axis`` grown to ``size`` by zeros (``t`` itself when it is
    contiguous at that size already)."""
    n = t.shape[axis]
    if n == size and t.is_contiguous():
        return t
    shape = list(t.shape)
    shape[axis] = size
    out = t.new_empty(shape)
    out.narrow(axis, 0, n).copy_(t)
    if size > n:
        out.narrow(axis, n, size - n).zero_()
    return out


class BucketPlan:
    """Runs a call through ``inner``, the plan of its ``bucketed_problem`` (module docstring),
    until its ``PROMOTE_AFTER``-th forward: from then on through ``exact()``, the plan of the
    call's own graphs (built then), which a shape that keeps coming back repays."""

    name = "cudnn"

    @property
    def forward_ignores_padded_keys(self) -> bool:
        return getattr(self.inner, "forward_ignores_padded_keys", False)  # its graphs'

    def __init__(self, inner, exact: Callable[[], Any]):
        self.inner, self._exact = inner, exact
        self._forwards = 0
        self.promoted: Any = None

    @property
    def spec(self):
        return self.inner.spec

    def direct(self, problem):
        """None: the moves in and out of the bucket run in ``forward`` and ``backward``."""
        return None

    def _moved(self, problem: AttnProblem, inputs: Inputs, *rows: Optional[torch.Tensor]):
        """The bucketed problem of this call, its inputs, and ``rows`` (out-like tensors,
        ``None`` kept) grown to its query rows."""
        bucketed = bucketed_problem(problem)
        axis = _seq_axis(problem)
        q = _padded(inputs.q, axis, bucketed.seq_q)
        k, v = (_padded(t, axis, bucketed.seq_kv) for t in (inputs.k, inputs.v))
        grown = [None if t is None else _padded(t, axis, bucketed.seq_q) for t in rows]
        return bucketed, Inputs(q, k, v, None, None, None), grown

    def forward(self, problem: AttnProblem, inputs: Inputs, need_lse: bool = True):
        if self.promoted is None:
            self._forwards += 1
            if self._forwards > PROMOTE_AFTER and not capturing():  # no build in a capture
                self.promoted = self._exact()
        if self.promoted is not None:
            return self.promoted.forward(problem, inputs, need_lse)
        bucketed, moved, _ = self._moved(problem, inputs)
        out, lse = self.inner.forward(bucketed, moved, need_lse=need_lse)
        axis = _seq_axis(problem)
        out = out.narrow(axis, 0, problem.seq_q).contiguous()
        return out, None if lse is None else lse.narrow(2, 0, problem.seq_q).contiguous()

    def backward(self, problem: AttnProblem, inputs: Inputs, out, lse, dout, dlse=None):
        """The padded rows: ``O = dO = 0``, ``lse = -inf`` (a row that sees no key), ``dlse = 0``:
        they add nothing to dK, dV; their dQ rows are dropped. (A promoted plan's backward
        takes a bucketed forward's out and LSE as they are: the call's own rows.)"""
        if self.promoted is not None:
            return self.promoted.backward(problem, inputs, out, lse, dout, dlse)
        bucketed, moved, (out, dout) = self._moved(problem, inputs, out, dout)
        lse = _grown_rows(lse, bucketed.seq_q, -math.inf)
        dlse = None if dlse is None else _grown_rows(dlse, bucketed.seq_q, 0.0)
        dq, dk, dv, _ = self.inner.backward(bucketed, moved, out, lse, dout, dlse)
        axis = _seq_axis(problem)
        return (dq.narrow(axis, 0, problem.seq_q).contiguous(),
                dk.narrow(axis, 0, problem.seq_kv).contiguous(),
                dv.narrow(axis, 0, problem.seq_kv).contiguous(), None)


def _grown_rows(t: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    """``[B, H, S_q]`` ``t`` grown to ``rows`` along its last axis by ``fill``."""
    n = t.shape[2]
    if n == rows:
        return t
    out = t.new_empty((*t.shape[:2], rows))
    out.narrow(2, 0, n).copy_(t)
    out.narrow(2, n, rows - n).fill_(fill)
    return out
