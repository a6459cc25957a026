"""What one call hands an engine's plan besides its ``AttnProblem``: the tensors and the dropout state.

Runtime values are arguments, never plan keys: a plan built for one problem runs any inputs of
that problem. The dropout state is drawn once per call, saved for the backward, and replayable by
every surface (FlashAttention's ``philox_seed``/``philox_offset``, cuDNN's seed/offset tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..core.caches import LRU
from ..core.probe import capturing, kept_if_captured

__all__ = ["SEED_BOUND", "DropoutState", "draw_seed", "host_draw", "Inputs", "valid_positions",
           "position_index", "full_lengths", "is_full_lengths", "row_positions", "scalar_zero",
           "sequence_axis", "PaddedPositions", "padding_positions", "length_positions",
           "hide_padding", "hides_keys", "hide_padded_rows", "device_constant"]

# Seeds stay below 2**62: every engine (and cuDNN's int64 seed tensor) holds them exactly.
SEED_BOUND = 2 ** 62


@dataclass(frozen=True)
class DropoutState:
    """A dropout stream: ``seed`` picks it, ``offset`` skips into it (cuDNN/Philox semantics).

    Each engine derives its keep masks from these two numbers alone, so a forward and its
    backward (or a later replay from a surface that kept the numbers) see the same masks.
    """

    seed: int
    offset: int = 0

    def __post_init__(self):
        for name in ("seed", "offset"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"dropout {name} must be an int >= 0, got {value!r}")

    @staticmethod
    def draw(generator: Optional[torch.Generator] = None) -> "DropoutState":
        """One fresh stream from ``generator`` (torch's default CPU generator when ``None``)."""
        return DropoutState(int(draw_seed(generator)), 0)


def draw_seed(generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A ``[1]`` int64 seed in ``[0, SEED_BOUND)``, one draw of ``generator``'s stream (torch's
    default CPU generator when ``None``): every surface draws its dropout seed here, eager or
    traced, so a seeded generator gives the same masks either way.

    A CPU generator draws on the CPU. A CUDA generator is drawn on the host from its own state
    (``host_draw``): a device draw would have to be read back, a synchronisation per call. The
    seed is then a CPU tensor; under ``torch.compile`` (which cannot trace the generator's state)
    it is drawn on the generator's device instead, so with a CUDA generator an eager and a
    compiled call draw different (each reproducible) seeds."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got "
                        f"{type(generator).__name__}")
    if generator is not None and generator.device.type == "cuda" \
            and not torch.compiler.is_compiling():
        return torch.tensor([host_draw(generator)], dtype=torch.int64)
    source = generator.device if generator is not None else "cpu"
    return torch.randint(0, SEED_BOUND, (1,), generator=generator, device=source)


_MIX = (1 << 64) - 1


def host_draw(generator: torch.Generator) -> int:
    """A seed in ``[0, SEED_BOUND)`` from a CUDA generator's host-side state: its seed and its
    Philox offset, which advances by 4 (one draw of a Philox counter, as PyTorch's own kernels
    advance it), so successive calls get new seeds and a re-seeded generator repeats them. No
    kernel runs and nothing is read back from the device."""
    offset = generator.get_offset()
    generator.set_offset(offset + 4)
    x = (generator.initial_seed() * 0x9E3779B97F4A7C15 + offset + 1) & _MIX
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MIX  # splitmix64's finaliser
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MIX
    return (x ^ (x >> 31)) % SEED_BOUND


@dataclass(slots=True)
class Inputs:
    """The tensors of one call, in the call's layout.

    ``bias`` is the additive bias tensor (``problem.bias``) or the relative positional bias table
    (``problem.rpb``); ``dropout`` is set exactly when ``problem.dropout_p > 0``;
    ``dropout_mask`` exactly when ``problem.dropout_mask`` is.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    bias: Optional[torch.Tensor] = None
    dropout: Optional[DropoutState] = None
    dropout_mask: Optional[torch.Tensor] = None


# ---------------------------------------------------------------------------------------------
# Positions past a sequence's length
# ---------------------------------------------------------------------------------------------

# (seq, device) -> arange(seq) on the device, [1, seq]: what every padded call compares its
# lengths against (a kernel and two dispatcher rounds saved per use).
_INDEX = LRU("padding.index", 64)


def position_index(seq: int, device) -> torch.Tensor:
    """``[1, seq]`` int64 ``0 .. seq - 1`` on ``device`` (made once per size and device)."""
    return device_constant(_INDEX, (seq, device),
                           lambda: torch.arange(seq, device=device).view(1, seq))


def full_lengths(batch: int, seq: int, device) -> torch.Tensor:
    """``[batch]`` int32 lengths, every one ``seq``, on ``device`` (made once per size and
    device): the query side of a ``Padding`` whose every row is a token (a KV-cache call's)."""
    return device_constant(_INDEX, ("full", batch, seq, device), lambda: torch.full(
        (batch,), seq, dtype=torch.int32, device=device))


def is_full_lengths(t: torch.Tensor, batch: int, seq: int, device) -> bool:
    """Whether ``t`` is ``full_lengths(batch, seq, device)`` itself (never makes one)."""
    return _INDEX.get(("full", batch, seq, device)) is t


def row_positions(seq: int, device, dtype: torch.dtype, layout: str = "bhsd") -> torch.Tensor:
    """``0 .. seq - 1`` of ``dtype`` on ``device`` on the sequence axis of ``[B, H, S, *]``
    (``[1, 1, seq, 1]``, bhsd) or ``[B, S, H, *]`` (``[1, seq, 1, 1]``, bshd): compared with
    ``[B, 1, 1, 1]`` lengths of the same dtype (no cast), it broadcasts against that layout."""
    shape = (1, 1, seq, 1) if layout == "bhsd" else (1, seq, 1, 1)
    return device_constant(_INDEX, (seq, device, dtype, layout), lambda: torch.arange(
        seq, dtype=dtype, device=device).view(shape))


# (dtype, device) -> a 0-dim zero: torch.where's ``other`` as a tensor (a Python 0 is wrapped
# into one per call, three dispatcher rounds).
_ZEROS = LRU("padding.zeros", 64)


def scalar_zero(like: torch.Tensor) -> torch.Tensor:
    """A 0-dim zero of ``like``'s dtype on its device (made once per dtype and device): an
    elementwise op's operand without a Python scalar to wrap per call. Not for ``masked_fill``'s
    value: a 0-dim CUDA value is read back on the host there."""
    return device_constant(_ZEROS, (like.dtype, like.device),
                           lambda: torch.zeros((), dtype=like.dtype, device=like.device))


def device_constant(cache: LRU, key, make) -> torch.Tensor:
    """``cache[key]``, made by ``make()`` on a miss and kept when it is a real tensor with its
    values: not a fake one (a tracing mode made it), and not one made inside a CUDA-graph
    capture (its kernel runs only when the graph is replayed). One a capture reads is kept for
    good (``kept_if_captured``)."""
    found = cache.get(key)
    if found is None:
        found = make()
        if type(found) is torch.Tensor and not capturing():
            cache.put(key, found)
        return found
    return kept_if_captured(found)  # a captured graph keeps reading it, evicted or not


def valid_positions(lengths, seq: int, device) -> torch.Tensor:
    """``[B, seq]`` bool, ``position < lengths[b]``; ``lengths`` host ints or an integer tensor
    (moved, never read on the host, so a device tensor costs no synchronisation)."""
    lens = lengths if isinstance(lengths, torch.Tensor) else torch.tensor(lengths)
    lens = lens.to(device, non_blocking=True)
    return position_index(seq, device) < lens.view(lens.shape[0], 1)


class PaddedPositions(NamedTuple):
    """Which positions of a padded call are tokens: ``valid_q`` / ``valid_kv`` (``[B, S]`` bool;
    ``None`` where only the next two were made), and the same as ``rows`` / ``keys``,
    broadcastable against q / k and v in the call's layout (a side ``padding_positions`` was not
    asked for is ``None``)."""

    valid_q: Optional[torch.Tensor]
    valid_kv: Optional[torch.Tensor]
    rows: Optional[torch.Tensor]
    keys: Optional[torch.Tensor]


# (lens_q, lens_kv, S_q, S_kv, device, layout) -> the PaddedPositions of a static Padding, or None
# when it pads nothing: copied to the device once per value set, not once per call (and the
# broadcast views, a few microseconds each, made once too).
_STATIC_POSITIONS = LRU("padding.positions", 256)


def padding_positions(padding, seq_q: int, seq_kv: int, device, layout: str,
                      queries: bool = True, keys: bool = True) -> Optional[PaddedPositions]:
    """The ``PaddedPositions`` of ``padding`` on ``device``, or ``None`` when its lengths are ints
    that pad nothing. Static lengths: made on the host and copied to the device once per value
    set (cached; the copy completes before the first use), so a call never copies them again;
    runtime lengths: computed on the device (never read), the query side only when ``queries``
    and the key side only when ``keys`` (the other is ``None``)."""
    if padding.runtime is None:
        key = (padding.seq_lens_q, padding.seq_lens_kv, seq_q, seq_kv, device, layout)
        found = _STATIC_POSITIONS.get(key, _STATIC_POSITIONS)
        if found is _STATIC_POSITIONS:
            found = _STATIC_POSITIONS.put(key, _static_positions(padding, seq_q, seq_kv, device,
                                                                 layout))
        return found
    lens_q, lens_kv = padding.tensors(device)
    col_kv = lens_kv.view(-1, 1, 1, 1)
    col_q = col_kv if lens_q is lens_kv else lens_q.view(-1, 1, 1, 1)  # one comparison serves both
    return length_positions(col_q if queries else None, col_kv if keys else None, seq_q, seq_kv,
                            layout)


def length_positions(seq_len_q: Optional[torch.Tensor], seq_len_kv: Optional[torch.Tensor],
                     seq_q: int, seq_kv: int, layout: str) -> PaddedPositions:
    """The ``rows`` (when ``seq_len_q`` is given) and ``keys`` (when ``seq_len_kv`` is) of
    ``PaddedPositions`` from ``[B, 1, 1, 1]`` lengths (as a graph reads them): one comparison
    each with the cached positions of their dtype, made in the call's layout (no ``[B, S]``
    masks: ``valid_q`` / ``valid_kv`` are ``None``). One lengths tensor for both sides of a
    self-attention call: one comparison serves both."""
    def below(lengths, seq):
        # positions of the lengths' dtype (no cast per call) where it holds every position
        wide = lengths.dtype in (torch.int32, torch.int64)
        return row_positions(seq, lengths.device, lengths.dtype if wide else torch.int64,
                             layout) < lengths

    keys = None if seq_len_kv is None else below(seq_len_kv, seq_kv)
    if seq_len_q is None:
        rows = None
    elif seq_len_q is seq_len_kv and seq_q == seq_kv:
        rows = keys
    else:
        rows = below(seq_len_q, seq_q)
    return PaddedPositions(None, None, rows, keys)


def _static_positions(padding, seq_q: int, seq_kv: int, device, layout: str):
    if min(padding.seq_lens_q) >= seq_q and min(padding.seq_lens_kv) >= seq_kv:
        return None
    host = (valid_positions(padding.seq_lens_q, seq_q, "cpu"),
            valid_positions(padding.seq_lens_kv, seq_kv, "cpu"))
    # blocking: complete before any stream reads it
    return _positions(*(t.to(device) for t in host), layout)


def _positions(valid_q: Optional[torch.Tensor], valid_kv: Optional[torch.Tensor],
               layout: str) -> PaddedPositions:
    """``[B, S]`` masks with their views on the sequence axis of ``[B, H, S, D]`` (bhsd) or
    ``[B, S, H, D]`` (bshd)."""
    return PaddedPositions(valid_q, valid_kv,
                           None if valid_q is None else sequence_axis(valid_q, layout),
                           None if valid_kv is None else sequence_axis(valid_kv, layout))


def sequence_axis(per_position: torch.Tensor, layout: str) -> torch.Tensor:
    """A ``[B, S]`` tensor as a view broadcastable against ``[B, H, S, D]`` (bhsd) or
    ``[B, S, H, D]`` (bshd): one ``view`` (two ``None`` indices cost two ops)."""
    b, s = per_position.shape
    return per_position.view(b, 1, s, 1) if layout == "bhsd" else per_position.view(b, s, 1, 1)


def _bias_cells(valid_q: torch.Tensor, valid_kv: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Which cells of a bias of ``shape`` (``[B|1, H|1, S_q|1, S_kv|1]``) lie inside some
    sequence: a broadcast batch axis keeps a position any sequence uses."""
    if shape[0] == 1:
        valid_q, valid_kv = valid_q.any(0, keepdim=True), valid_kv.any(0, keepdim=True)
    rows = valid_q[:, None, :, None] if shape[2] != 1 else valid_q.any(1)[:, None, None, None]
    cols = valid_kv[:, None, None, :] if shape[3] != 1 else valid_kv.any(1)[:, None, None, None]
    return rows & cols


def hide_padding(problem, inputs: Inputs, queries: bool = True,
                 positions: Optional[PaddedPositions] = None, keys: bool = True) -> Inputs:
    """``inputs`` with every position past the ``Padding`` lengths replaced by 0 (the query
    rows only when ``queries``, the key and value rows only when ``keys``).

    Why: such positions are not tokens. Engines give them ``-inf`` scores, but a NaN or inf
    stored there would still reach real rows through ``0 * NaN`` (``p @ v``, ``ds^T @ q``) or an
    additive ``-inf + NaN`` mask. ``torch.where`` is differentiable (their gradient is exactly 0)
    and costs no host synchronisation. Calls without ``Padding`` pass through untouched.
    A forward that no gradient will follow may keep the padded query rows (``queries=False``):
    a query row reaches only its own output row, and a row past its length sees no key, so
    every engine writes it as 0 (and its lse as ``-inf``) whatever q holds there.
    ``keys=False`` is for an engine whose forward itself keeps what lies past the key lengths
    out of every result, in a call no gradient follows (``hides_keys``).
    ``positions``: the call's own (``length_positions``: runtime lengths a caller already holds
    as a graph reads them; with ``rows`` when a bias is hidden), in place of
    ``padding_positions``'.
    """
    padding = problem.padding
    if padding is None or problem.storage is not None:  # packed: no positions past a length;
        return inputs                                   # paged: the pools are read, not copied
    bias = inputs.bias
    with_bias = bias is not None and problem.bias is not None
    if not (queries or keys or with_bias):
        return inputs
    if positions is None:
        positions = padding_positions(padding, problem.seq_q, problem.seq_kv, inputs.q.device,
                                      problem.layout, queries=queries or with_bias)
    if positions is None:  # lengths that pad nothing
        return inputs
    valid_q, valid_kv, rows, kept = positions
    if with_bias:
        if valid_q is None:  # length_positions': the [B, S] masks are views of rows and keys
            valid_q, valid_kv = rows.view(rows.shape[0], -1), kept.view(kept.shape[0], -1)
        full = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        bias = torch.where(_bias_cells(valid_q, valid_kv, full.shape), full, 0).view(bias.shape)
    k, v = (_zeroed(kept, inputs.k), _zeroed(kept, inputs.v)) if keys else (inputs.k, inputs.v)
    return Inputs(_zeroed(rows, inputs.q) if queries else inputs.q, k, v, bias, inputs.dropout,
                  inputs.dropout_mask)


def hides_keys(runner, grad: bool) -> bool:
    """Whether a call's key and value rows past its ``Padding`` lengths are zeroed before
    ``runner`` (a plan, or the cuDNN engine's direct runner) sees them: always for a gradient
    (``torch.where`` gives those rows exactly 0), else unless the runner's forward keeps them
    out of every result itself (``forward_ignores_padded_keys``)."""
    return grad or not getattr(runner, "forward_ignores_padded_keys", False)


def _zeroed(keep: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``torch.where(keep, t, 0)`` laid out with ``t``'s strides: the problem (and a cuDNN graph
    built from it) describes the caller's tensor, so the tensor bound in its place must have the
    same strides (a sliced view would otherwise come back contiguous, and cuDNN would read it
    through the view's strides, past its end)."""
    out = torch.where(keep, t, scalar_zero(t))
    if out.stride() == t.stride() or 0 in t.stride():
        return out
    like = torch.empty_strided(t.shape, t.stride(), dtype=out.dtype, device=out.device)
    return like.copy_(out)


def hide_padded_rows(problem, out: torch.Tensor,
                     positions: Optional[PaddedPositions] = None) -> torch.Tensor:
    """``out`` with the query rows past the ``Padding`` lengths set to 0 (they already are): the
    gradient reaching them, whatever it holds, then stops here instead of entering the backward.
    ``positions``: the call's own, as ``hide_padding`` takes them."""
    padding = problem.padding
    if padding is None or problem.storage is not None:
        return out
    if positions is None:
        positions = padding_positions(padding, problem.seq_q, problem.seq_kv, out.device,
                                      problem.layout, keys=False)
    return out if positions is None else torch.where(positions.rows, out, scalar_zero(out))
