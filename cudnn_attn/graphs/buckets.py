"""Shape bucketing for serving: many request lengths and batch sizes, a small set of graphs.

A cuDNN graph is specialised on its shapes, so a server that built one graph per request shape
would spend its time building. ``BucketPolicy`` rounds the batch size and the sequence lengths up
to a few buckets (powers of two by default); ``pad_to_bucket`` zero-pads the inputs to the
bucketed shape and carries the real lengths as a ``Padding`` mask (the per-batch ``seq_len_q`` /
``seq_len_kv`` tensors of the cuDNN graph), so the result on the real rows is unchanged::

    policy = BucketPolicy(min_seq=128, max_seq=4096, max_batch=32)
    padded = pad_to_bucket(policy, [q0, q1], [k0, k1], [v0, v1], mask=Causal())
    out = cudnn_attn.attention(padded.q, padded.k, padded.v, mask=padded.mask)
    outs = padded.unpad(out)             # one [H, S_i, D_v] tensor per request

At most ``policy.num_shapes`` distinct padded shapes (hence graphs per dtype/mask) can occur.
"""

from __future__ import annotations

import bisect
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..model.masks import Mask, Padding, mask_parts

__all__ = ["BucketPolicy", "BucketShape", "Bucketed", "pad_to_bucket"]


class BucketShape(NamedTuple):
    batch: int
    seq_q: int
    seq_kv: int


def _int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def _buckets(name: str, explicit, lo: int, hi: int) -> tuple[int, ...]:
    if explicit is not None:
        if isinstance(explicit, (str, bytes)) or not isinstance(explicit, Sequence) or not explicit:
            raise TypeError(f"{name} must be a non-empty sequence of ints, got {explicit!r}")
        return tuple(sorted({_int(name, b) for b in explicit}))
    lo, hi = _int(f"min of {name}", lo), _int(f"max of {name}", hi)
    if lo > hi:
        raise ValueError(f"{name}: minimum {lo} exceeds maximum {hi}")
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


def _round_up(buckets: tuple[int, ...], n, name: str) -> int:
    n = _int(name, n)
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{name}={n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class BucketPolicy:
    """Rounds ``(batch, seq_q, seq_kv)`` up to configured buckets.

    Args:
        seq_buckets: explicit key-length buckets; default powers of two from ``min_seq`` up to
            ``max_seq`` (the last bucket is ``max_seq`` itself).
        query_buckets: explicit query-length buckets (default: the key-length buckets). A
            decode server would use e.g. ``(1, 8, 128, ...)``.
        batch_buckets: explicit batch buckets; default powers of two ``min_batch..max_batch``.

    The default ``min_seq=128`` keeps every bucket a multiple of 128 once past it: cuDNN's
    backward has a known NaN case at ``seq_len % 128 == 64`` with a mask (reference §5.2).
    """

    def __init__(self, seq_buckets: Sequence[int] | None = None, *, min_seq: int = 128,
                 max_seq: int = 16384, query_buckets: Sequence[int] | None = None,
                 batch_buckets: Sequence[int] | None = None, min_batch: int = 1,
                 max_batch: int = 64):
        self.seq_buckets = _buckets("seq_buckets", seq_buckets, min_seq, max_seq)
        self.query_buckets = (self.seq_buckets if query_buckets is None
                              else _buckets("query_buckets", query_buckets, 1, 1))
        self.batch_buckets = _buckets("batch_buckets", batch_buckets, min_batch, max_batch)

    def __repr__(self) -> str:
        return (f"BucketPolicy(seq_buckets={self.seq_buckets}, query_buckets={self.query_buckets}, "
                f"batch_buckets={self.batch_buckets})")

    def seq_bucket(self, n: int) -> int:
        """The smallest key-length bucket >= ``n`` (ValueError past the largest)."""
        return _round_up(self.seq_buckets, n, "seq_kv")

    def query_bucket(self, n: int) -> int:
        """The smallest query-length bucket >= ``n``."""
        return _round_up(self.query_buckets, n, "seq_q")

    def batch_bucket(self, b: int) -> int:
        """The smallest batch bucket >= ``b``."""
        return _round_up(self.batch_buckets, b, "batch")

    def bucket(self, batch: int, seq_q: int, seq_kv: int | None = None) -> BucketShape:
        """The bucketed ``(batch, seq_q, seq_kv)``; ``seq_kv`` defaults to ``seq_q``."""
        seq_kv = seq_q if seq_kv is None else seq_kv
        return BucketShape(self.batch_bucket(batch), self.query_bucket(seq_q),
                           self.seq_bucket(seq_kv))

    @property
    def num_shapes(self) -> int:
        """How many distinct bucketed shapes exist: the bound on graphs per dtype/head/mask."""
        return len(self.batch_buckets) * len(self.query_buckets) * len(self.seq_buckets)


@dataclass(frozen=True)
class Bucketed:
    """Inputs padded to a bucket. ``mask`` = ``Padding(real lengths)`` & the caller's mask."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: Mask
    seq_lens_q: tuple[int, ...]  # per padded batch row; filler rows get length 1
    seq_lens_kv: tuple[int, ...]
    batch: int  # real batch size
    shape: BucketShape
    layout: str

    def unpad(self, out: torch.Tensor) -> list[torch.Tensor]:
        """Per request ``b``: ``out[b, :, :len_q[b]]`` (bhsd) or ``out[b, :len_q[b]]`` (bshd)."""
        if self.layout == "bhsd":
            return [out[b, :, :n] for b, n in zip(range(self.batch), self.seq_lens_q)]
        return [out[b, :n] for b, n in zip(range(self.batch), self.seq_lens_q)]


def _lengths(name: str, lens, batch: int, full: int) -> list[int]:
    if lens is None:
        return [full] * batch
    if isinstance(lens, torch.Tensor):
        lens = lens.tolist()
    lens = [_int(name, n, 0) for n in lens]
    if len(lens) != batch:
        raise ValueError(f"{name} must have one entry per batch row ({batch}), got {len(lens)}")
    if max(lens) > full:
        raise ValueError(f"{name} has a length {max(lens)} beyond the sequence dimension {full}")
    return lens


def _stack(name: str, x, seq_dim: int, batch: int, seq: int, lens: list[int]) -> torch.Tensor:
    """Zero-filled ``[batch_bucket, ..., seq_bucket, ...]`` copy of the real part of ``x``."""
    if isinstance(x, torch.Tensor):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D or a list of 3-D tensors, got {tuple(x.shape)}")
        parts = [x[b] for b in range(x.shape[0])]
    else:
        parts = list(x)
    shape = list(parts[0].shape)
    shape[seq_dim] = seq
    out = parts[0].new_zeros([batch, *shape])
    for b, (part, n) in enumerate(zip(parts, lens)):
        if part.dim() != 3:
            raise ValueError(f"{name}[{b}] must be 3-D, got shape {tuple(part.shape)}")
        out[b].narrow(seq_dim, 0, n).copy_(part.narrow(seq_dim, 0, n))
    return out


def pad_to_bucket(policy: BucketPolicy, q, k, v, *, seq_lens_q=None, seq_lens_kv=None,
                  mask: Mask | None = None, layout: str = "bhsd") -> Bucketed:
    """Zero-pad a batch of requests to ``policy``'s bucket and describe the real lengths.

    ``q``, ``k``, ``v`` are either lists of per-request 3-D tensors (``[H, S_i, D]`` for
    ``layout="bhsd"``, ``[S_i, H, D]`` for ``"bshd"``) or 4-D batches, optionally with
    ``seq_lens_q``/``seq_lens_kv`` (ints or 1-D int tensors; default: the full length). ``mask``
    (Causal, SlidingWindow, ...; no Padding, the lengths come from here) is ANDed with the
    ``Padding`` of the real lengths, so bottom-right alignment follows each request's lengths.

    Equivalent: running each request alone with ``mask`` gives ``Bucketed.unpad(out)``.
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    if mask is not None:
        if not isinstance(mask, Mask):
            raise TypeError(f"mask must be a cudnn_attn mask, got {type(mask).__name__}")
        if any(isinstance(m, Padding) for m in mask_parts(mask)):
            raise ValueError("mask must not contain Padding: pass seq_lens_q/seq_lens_kv instead")
    seq_dim = 1 if layout == "bhsd" else 0  # inside one request
    batches = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, torch.Tensor):
            batches.append((x.shape[0], x.shape[seq_dim + 1]))
        elif isinstance(x, Sequence) and x and all(isinstance(t, torch.Tensor) for t in x):
            lens = [t.shape[seq_dim] if t.dim() == 3 else -1 for t in x]
            if (name == "q" and seq_lens_q is not None) or (name != "q" and seq_lens_kv is not None):
                raise ValueError("seq_lens_q/seq_lens_kv go with 4-D tensors, not request lists")
            batches.append((len(x), lens))
        else:
            raise TypeError(f"{name} must be a 4-D tensor or a non-empty list of tensors, "
                            f"got {type(x).__name__}")
    batch = batches[0][0]
    if any(b != batch for b, _ in batches):
        raise ValueError(f"q, k and v must hold the same number of requests, got "
                         f"{[b for b, _ in batches]}")

    def real(name, entry, given):
        full = entry[1]
        if isinstance(full, list):  # request list: lengths are the tensors' own
            if min(full) < 0:
                raise ValueError(f"each {name} request must be a 3-D tensor")
            return full
        return _lengths(f"seq_lens_{name}", given, batch, full)

    lens_q = real("q", batches[0], seq_lens_q)
    lens_kv = real("kv", batches[1], seq_lens_kv)
    if batches[2][1] != batches[1][1] and isinstance(batches[1][1], list):
        raise ValueError(f"k and v requests must have equal lengths, got {batches[1][1]} and "
                         f"{batches[2][1]}")
    shape = policy.bucket(batch, max(max(lens_q), 1), max(max(lens_kv), 1))
    # Filler rows get one token each: every engine stays off its fully-masked path and the
    # (discarded) result is 0 = softmax over one zero key times a zero value.
    fill = [1] * (shape.batch - batch)
    lens_q, lens_kv = lens_q + fill, lens_kv + fill
    qp = _stack("q", q, seq_dim, shape.batch, shape.seq_q, lens_q)
    kp = _stack("k", k, seq_dim, shape.batch, shape.seq_kv, lens_kv)
    vp = _stack("v", v, seq_dim, shape.batch, shape.seq_kv, lens_kv)
    padding = Padding(tuple(lens_q), tuple(lens_kv))
    full_mask = padding if mask is None else padding & mask
    return Bucketed(qp, kp, vp, full_mask, tuple(lens_q), tuple(lens_kv), batch, shape, layout)
