"""Masks and softcap as cuDNN ``score_mod`` programs (``cudnn_attn.model.score_mods``).

cuDNN's ``score_mod`` excludes the built-in masks in the same node, so when a call needs one
(softcap, NATTEN neighborhoods, the builder's own ``set_score_mod``) its diagonal band is folded
into the program too. Visibility is computed from ``gen_index`` with ``floor``/``min``/``max`` and
comparisons on 0/1 INT32 values ANDed by ``mul`` (cuDNN plans INT32 comparisons where it refuses
``logical_and`` on BOOLEAN tensors), then ``binary_select(score, -inf, visible)``.

* band (cuDNN's convention): ``i' - L < j <= i' + R``, ``i' = i + offset`` (static offsets only:
  top-left, or bottom-right without padding);
* NATTEN neighborhoods, per axis of length ``n`` (kernel ``k``, stride ``s``, dilation ``d``):
  ``g = x mod d``, ``idx = floor(x / d)``, group length ``m = floor((n - g + d - 1) / d)``;
  non-causal ``leader = min(floor(idx / s) * s + floor(s / 2), m - 1)``, window start
  ``clamp(leader - floor(k / 2), 0, m - k)``, end ``start + k``; causal ``leader = min(floor(idx /
  s) * s + s - 1, m - 1)``, ``[max(leader - k + 1, 0), idx + 1)``; a key is visible iff its group
  matches and its index lies in the window on every axis. Tokens are row-major: in 2-D
  ``y = floor(i / W)``, ``x = i - y * W``.
"""

from __future__ import annotations

import math
from typing import Optional

from ..model.score_mods import DP, SCORE, Node, ScoreMod, ScoreModGraph

__all__ = ["mask_program", "program_for", "band_misses_rows", "neighborhood_as_band",
           "tile_bitmask", "BLOCK_TILE"]

BLOCK_TILE = 128  # rows and keys per tile of cuDNN's block mask; 8 key tiles per byte

NEG_INF = float("-inf")


def _int(g, t):
    return t.set_data_type("INT32")


def _cmp(g, op: str, a, b):
    return _int(g, getattr(g, op)(input=a, comparison=b))


def _and(g, parts):
    out = parts[0]
    for p in parts[1:]:
        out = _int(g, g.mul(a=out, b=p))
    return out


def _band_visible(g, s, band, offset: int):
    i, j = _int(g, g.gen_index(input=s, axis=2)), _int(g, g.gen_index(input=s, axis=3))
    aligned = g.add(a=i, b=offset) if offset else i
    parts = []
    if band.right is not None:
        parts.append(_cmp(g, "cmp_le", j, g.add(a=aligned, b=band.right)))
    if band.left is not None:
        parts.append(_cmp(g, "cmp_gt", j, g.sub(a=aligned, b=band.left)))
    return parts


def _coordinates(g, token, shape):
    """Row-major coordinates of a flat token index (one node per axis)."""
    coords, rest = [], token
    for axis in range(len(shape)):
        inner = math.prod(shape[axis + 1:])
        if inner == 1:
            coords.append(rest)
            break
        c = g.floor(input=g.div(a=rest, b=inner))
        coords.append(c)
        rest = g.sub(a=rest, b=g.mul(a=c, b=inner))
    return coords


def _axis_visible(g, xi, xj, length, kernel, stride, dilation, causal):
    parts = []
    if dilation > 1:
        idx_i = g.floor(input=g.div(a=xi, b=dilation))
        idx_j = g.floor(input=g.div(a=xj, b=dilation))
        grp_i = g.sub(a=xi, b=g.mul(a=idx_i, b=dilation))
        grp_j = g.sub(a=xj, b=g.mul(a=idx_j, b=dilation))
        parts.append(_cmp(g, "cmp_eq", grp_i, grp_j))
        glen = g.floor(input=g.div(a=g.sub(a=length + dilation - 1, b=grp_i), b=dilation))
    else:
        idx_i, idx_j, glen = xi, xj, length
    last = g.sub(a=glen, b=1) if dilation > 1 else length - 1
    block = g.mul(a=g.floor(input=g.div(a=idx_i, b=stride)), b=stride) if stride > 1 else idx_i
    if causal:
        leader = g.min(input0=g.add(a=block, b=stride - 1), input1=last) if stride > 1 else idx_i
        start = g.max(input0=g.sub(a=leader, b=kernel - 1), input1=0)
        end = g.add(a=idx_i, b=1)
    else:
        leader = (g.min(input0=g.add(a=block, b=stride // 2), input1=last)
                  if stride > 1 else idx_i)
        latest = g.sub(a=glen, b=kernel) if dilation > 1 else length - kernel
        start = g.min(input0=g.max(input0=g.sub(a=leader, b=kernel // 2), input1=0),
                      input1=latest)
        end = g.add(a=start, b=kernel)
    parts.append(_cmp(g, "cmp_ge", idx_j, start))
    parts.append(_cmp(g, "cmp_lt", idx_j, end))
    return parts


def _neighborhood_visible(g, s, hood):
    i, j = _int(g, g.gen_index(input=s, axis=2)), _int(g, g.gen_index(input=s, axis=3))
    shape = hood.spatial_shape
    parts = []
    for xi, xj, axis in zip(_coordinates(g, i, shape), _coordinates(g, j, shape), hood.axes()):
        parts += _axis_visible(g, xi, xj, *axis)
    return parts


def mask_program(*, softcap: Optional[float] = None, band=None, band_offset: int = 0,
                 neighborhood=None, base: Optional[ScoreMod] = None) -> ScoreMod:
    """One program: ``base`` (a user's score_mod) or the softcap, then the band's and the
    neighborhood's visibility as ``-inf``. Softcap's backward is its own ``score_mod_bprop``
    (cuDNN's ``Softcap::backward``: ``tanh_backward(dP * cap, s / cap) / cap``); masks need none."""
    g = ScoreModGraph()
    s = g.input(SCORE)  # a handle on the raw score in this graph
    labels, before_tanh, bprop = [], None, None
    if base is not None:
        remap = _replay(g, base, s)
        s = Node(g, remap[base.forward])
        bprop = None if base.bprop is None else remap[base.bprop]
        labels.append(base.label)
    if softcap is not None:  # cuDNN's Softcap score modifier, op for op
        before_tanh = g.div(a=s, b=softcap)
        s = g.mul(a=g.tanh(input=before_tanh), b=softcap)
        labels.append(f"softcap({softcap:g})")
    parts = []
    if band is not None:
        parts += _band_visible(g, s, band, band_offset)
        labels.append(f"band({band.alignment}, L={band.left}, R={band.right})")
    if neighborhood is not None:
        parts += _neighborhood_visible(g, s, neighborhood)
        labels.append(f"neighborhood({neighborhood.spatial_shape}, k={neighborhood.kernel_size})")
    if parts:
        s = g.binary_select(input0=s, input1=NEG_INF, mask=_and(g, parts))
    if before_tanh is not None:
        # cuDNN's Softcap backward: tanh_backward(dP * cap, s / cap) / cap
        if bprop is not None:
            raise ValueError("a score_mod with its own score_mod_bprop cannot be combined with "
                             "softcap")
        dp = g.input(DP)
        grad = g.tanh_backward(loss=g.mul(a=dp, b=softcap), input=before_tanh)
        bprop = g.div(a=grad, b=softcap).uid
    return ScoreMod(tuple(g.ops), tuple(sorted(g.dtypes.items())), s.uid, bprop,
                    " + ".join(labels) or "identity")


def program_for(problem, band, hood, padding: bool, alibi: bool, reasons: list):
    """``problem``'s score_mod program (softcap, the builder's score_mod, a neighborhood and
    ``band``, cuDNN's band of its mask, folded in), or ``None`` with reasons."""
    what = ", ".join(n for n, on in (("softcap", problem.softcap is not None),
                                     ("a score_mod", problem.score_mod is not None),
                                     ("a neighborhood mask", hood is not None)) if on)
    why = []
    if padding:
        why.append(f"cuDNN's score_mod ({what}) excludes the padding mask")
    if alibi:
        why.append(f"cuDNN's score_mod ({what}) excludes ALiBi")
    offset = problem.seq_kv - problem.seq_q if band is not None \
        and band.alignment == "bottom_right" else 0
    if band is not None and band_misses_rows(band, offset, problem.seq_q, problem.seq_kv):
        # cuDNN's own bottom-right band refuses S_q > S_kv without padding for the same reason
        why.append(f"cuDNN's score_mod ({what}) with a {band.alignment} band that leaves query "
                   f"rows without a key (S_q={problem.seq_q}, S_kv={problem.seq_kv}): what "
                   f"cuDNN writes for a row whose scores are all -inf is undefined, and without "
                   f"lengths nothing says which rows")
    if why:
        reasons.extend(why)
        return None
    return mask_program(softcap=problem.softcap, band=band, band_offset=offset,
                        neighborhood=hood, base=problem.score_mod)


def band_misses_rows(band, offset: int, seq_q: int, seq_kv: int) -> bool:
    """Whether a query row ``i < seq_q`` sees none of ``seq_kv`` keys under ``band`` (cuDNN's
    convention, as ``_band_visible`` emits it: ``i' - L < j <= i' + R``, ``i' = i + offset``).
    A row's keys move right with ``i`` and include ``i'`` itself when it is a key, so only row
    0 can end left of key 0 and only the last row start right of the last key."""
    ends_before = band.right is not None and offset + band.right < 0
    starts_after = band.left is not None and seq_q + offset - band.left > seq_kv - 1
    return ends_before or starts_after


def _replay(g: ScoreModGraph, program: ScoreMod, score) -> dict:
    """Append ``program``'s ops (forward and bprop) to ``g`` reading ``score``; returns the map
    from the program's node ids to ``g``'s."""
    remap = {SCORE: score.uid, DP: DP}
    for n, (op, inputs, attrs) in enumerate(program.ops):
        ins = tuple(a if isinstance(a, tuple) else remap[a] for a in inputs)
        g.ops.append((op, ins, attrs))
        remap[n + 2] = len(g.ops) + 1
    for uid, name in program.dtypes:
        g.dtypes[remap[uid]] = name
    return remap


def neighborhood_as_band(hood):
    """A causal 1-D neighborhood with stride and dilation 1 is cuDNN's built-in band (query
    ``i`` sees ``[max(i - k + 1, 0), i]``): that ``SlidingWindow``, else ``None``."""
    from ..model.masks import SlidingWindow

    if hood is None or hood.ndim != 1 or not hood.is_causal[0] or hood.stride[0] != 1 \
            or hood.dilation[0] != 1:
        return None
    return SlidingWindow(hood.kernel_size[0] - 1, 0)


def tile_bitmask(hood, batch: int, heads: int, device=None):
    """cuDNN's block mask of a neighborhood: uint8 ``[B, H, ceil(N / 128), ceil(ceil(N / 128) /
    8)]``, bit ``t % 8`` (least significant first; cuDNN does not document the order) of byte
    ``t // 8`` set when query tile and key tile ``t`` share a visible pair. The score_mod still
    masks every pair exactly: the block mask only lets cuDNN skip empty tiles (sm_100+)."""
    import torch

    from ..model.geometry import neighborhood_mask

    n = hood.num_tokens
    tiles = -(-n // BLOCK_TILE)
    visible = neighborhood_mask(hood.spatial_shape, hood.kernel_size, hood.stride,
                                hood.dilation, hood.is_causal)
    padded = torch.zeros(tiles * BLOCK_TILE, tiles * BLOCK_TILE, dtype=torch.bool)
    padded[:n, :n] = visible
    used = padded.view(tiles, BLOCK_TILE, tiles, BLOCK_TILE).any(3).any(1)   # [tq, tk]
    width = -(-tiles // 8)
    bits = torch.zeros(tiles, width * 8, dtype=torch.int64)
    bits[:, :tiles] = used.to(torch.int64)
    packed = (bits.view(tiles, width, 8) << torch.arange(8)).sum(-1).to(torch.uint8)
    return packed.expand(batch, heads, tiles, width).contiguous().to(device)
