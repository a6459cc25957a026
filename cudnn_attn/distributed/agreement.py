"""What the ranks of one distributed call must agree on, checked before anything is exchanged.

A distributed call starts with one all-gather of every rank's local length. That gather also
carries, per rank, whether its arguments passed local validation and the values every rank must
share (batch, heads, head dims, dtype, layout, sharding, mask, scale, neighborhood geometry),
each encoded as exact integers. Every rank then sees every rank's row and reaches the same
verdict: if one rank's validation failed, or two ranks differ on a shared value, every rank
raises the same ``RankDisagreement`` (naming the rank(s), the argument and each rank's value)
before any point-to-point exchange, so no rank blocks on a peer that gave up, no gloo/NCCL size
mismatch aborts a process, and no rank returns numbers computed with another rank's arguments.
A rank's own validation error is the ``__cause__`` of its ``RankDisagreement``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .._checks import FLOAT_DTYPES

__all__ = ["RankDisagreement", "Field", "agreed_lengths", "choice", "integers", "real"]


class RankDisagreement(ValueError):
    """The ranks of one distributed call cannot run it together (raised on every rank alike)."""


class Field:
    """One shared argument: ``size`` integers per rank, and how to show them."""

    def __init__(self, name: str, size: int = 1, show: Callable[[list[int]], str] = None):
        self.name, self.size = name, size
        self.show = show or (lambda ints: str(ints[0]) if size == 1 else str(tuple(ints)))


def integers(name: str, size: int = 1) -> Field:
    return Field(name, size)


def choice(name: str, options: Sequence) -> Field:
    """A value among ``options`` (sent as its index; -1 for anything else)."""
    return Field(name, 1, lambda ints: repr(options[ints[0]]) if 0 <= ints[0] < len(options)
                 else "(another value)")


def real(name: str) -> Field:
    """A float, sent as the 64 bits of its double (exact)."""
    return Field(name, 1, lambda ints: repr(struct.unpack("<d", struct.pack("<q", ints[0]))[0]))


def encode_choice(value, options: Sequence) -> int:
    return next((i for i, o in enumerate(options) if o == value), -1)


def encode_real(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def encode_dtype(dtype) -> int:
    return encode_choice(dtype, FLOAT_DTYPES)


DTYPE = choice("dtype", FLOAT_DTYPES)


def _gather_device(group, tensor_like) -> torch.device:
    """Where the gather's tensor lives: the call's tensor's device, else what the backend needs
    (a rank whose arguments are not tensors must still take part)."""
    if isinstance(tensor_like, torch.Tensor) and tensor_like.layout == torch.strided \
            and not tensor_like.is_nested:
        return tensor_like.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agreed_lengths(call: str, group, tensor_like, fields: Sequence[Field],
                   validate: Callable[[], tuple[int, Sequence[int]]]) -> list[int]:
    """Every rank's local length, after every rank agreed (module doc); one all-gather.

    ``validate()`` runs this rank's local checks and returns ``(local length, the shared values
    as ints, in the order of fields)``; any exception from it marks this rank invalid (raised,
    as the cause, after the gather: a rank that gave up must not leave the others waiting).
    ``tensor_like`` picks the gather's device.
    """
    width = sum(f.size for f in fields)
    device = _gather_device(group, tensor_like)
    try:
        length, values = validate()
        values = [int(x) for x in values]
        if len(values) != width:  # a programming error, not the user's: raise it here
            raise AssertionError(f"{call}: {len(values)} shared values for {width} fields")
        error, row = None, [int(length), 1, *values]
    except Exception as exc:  # noqa: BLE001 - whatever it is, every rank must hear of it
        error, row = exc, [0, 0] + [0] * width
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    invalid = [r for r, x in enumerate(rows) if x[1] != 1]
    if invalid:
        raise RankDisagreement(
            f"{call}: the arguments of rank(s) {invalid} failed validation there (its error says "
            f"why); no rank exchanged anything") from error
    differ = []
    at = 2
    for f in fields:
        shown = [f.show(x[at:at + f.size]) for x in rows]
        if any(x[at:at + f.size] != rows[0][at:at + f.size] for x in rows):
            differ.append(f"{f.name} (" + ", ".join(f"rank {r}: {s}" for r, s in
                                                   enumerate(shown)) + ")")
        at += f.size
    if differ:
        raise RankDisagreement(f"{call}: every rank must pass the same " + "; ".join(differ)
                               + "; no rank exchanged anything")
    return [x[0] for x in rows]
