"""Neighborhood attention sharded along the first spatial axis, by halo exchange.

Rank ``r`` holds rows ``[a_r, b_r)`` of axis 0 (any split). Its queries reach, under NATTEN's
rules on the *global* axis (windows shifted at the global borders, dilation groups, stride,
causal), a set of rows a little wider than its own: it fetches exactly those rows of keys and
values it does not hold from their owners, lays them out in a *slab* of axis 0 (rows it does
not need stay zero) and runs the ordinary ``na{1,2,3}d`` on the slab. The slab is chosen so
that every local query's window on the slab is its window on the whole axis (its start is a
multiple of ``stride * dilation``, and it is checked against the global rule); the backward
returns the halo rows' gradients to their owners.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..model import checks
from ..model.geometry import neighborhood_axis_mask
from ..model.masks import Neighborhood
from .agreement import DTYPE, agreed_lengths, encode_dtype, encode_real, integers, real
from .p2p import Exchange
from .sharding import world

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["neighborhood_attention", "halo_plan"]

# What every rank must pass alike (checked in the length all-gather, see agreement.py); per-axis
# values padded to 3 axes.
_SHARED = (integers("batch size B"), integers("number of spatial axes"),
           integers("spatial extent of axes 1, 2", 2), integers("heads H"), integers("head dim D"),
           integers("value head dim D_v"), DTYPE, integers("kernel_size", 3),
           integers("stride", 3), integers("dilation", 3), integers("is_causal", 3), real("scale"))


def _needed(axis_mask: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows of axis 0 that queries ``[a, b)`` see."""
    return axis_mask[a:b].any(0)


def _slab(axis_mask, length, a, b, kernel, stride, dilation, causal) -> tuple[int, int]:
    """``[lo, hi)``: the rows of axis 0 the local computation spans (see the module doc)."""
    need = _needed(axis_mask, a, b).nonzero().flatten()
    lo = min(a, int(need.min())) if len(need) else a
    hi = max(b, int(need.max()) + 1) if len(need) else b
    lo -= lo % (stride * dilation)
    while hi - lo < kernel * dilation and (hi < length or lo > 0):  # NATTEN's k * d <= L
        hi, lo = (hi + 1, lo) if hi < length else (hi, max(lo - stride * dilation, 0))
    local = neighborhood_axis_mask(hi - lo, kernel, stride, dilation, causal)
    if torch.equal(local[a - lo:b - lo], axis_mask[a:b, lo:hi]):
        return lo, hi
    return 0, length  # not reached for the shapes we know; the whole axis is always right


def halo_plan(lengths: list[int], kernel, stride, dilation, causal):
    """Per rank: ``(slab, fetch)`` with ``slab = (lo, hi)`` and ``fetch[o]`` the rows it needs
    from rank ``o`` (global indices). The same on every rank, so sends match receives."""
    total = sum(lengths)
    starts = [sum(lengths[:r]) for r in range(len(lengths))]
    axis_mask = neighborhood_axis_mask(total, kernel, stride, dilation, causal)
    plans = []
    for r, (a, n) in enumerate(zip(starts, lengths)):
        lo, hi = _slab(axis_mask, total, a, a + n, kernel, stride, dilation, causal)
        need = _needed(axis_mask, a, a + n)
        need[a:a + n] = False
        need[:lo] = need[hi:] = False
        rows = need.nonzero().flatten()
        fetch = {o: rows[(rows >= starts[o]) & (rows < starts[o] + lengths[o])]
                 for o in range(len(lengths)) if o != r}
        plans.append(((lo, hi), {o: idx for o, idx in fetch.items() if len(idx)}))
    return plans, starts


class _Halo(torch.autograd.Function):
    """Local key/value rows -> the slab of axis 0 (halo rows from their owners, zeros where
    nothing is needed); backward: halo gradients go back and are added to their owners' rows."""

    @staticmethod
    def forward(ctx, k, v, plans, starts, rank, group):
        (lo, hi), fetch = plans[rank]
        a, n = starts[rank], k.shape[1]
        exchange = Exchange(group)
        for o, (_, other_fetch) in enumerate(plans):
            if o != rank and rank in other_fetch:
                idx = (other_fetch[rank] - a).to(k.device)
                exchange.send(k.index_select(1, idx), o).send(v.index_select(1, idx), o)
        received = {o: (exchange.recv(k, (k.shape[0], len(idx), *k.shape[2:]), o),
                        exchange.recv(v, (v.shape[0], len(idx), *v.shape[2:]), o))
                    for o, idx in fetch.items()}
        exchange.start().wait()
        slabs = []
        for t, which in ((k, 0), (v, 1)):
            slab = t.new_zeros(t.shape[0], hi - lo, *t.shape[2:])
            slab[:, a - lo:a - lo + n] = t
            for o, idx in fetch.items():
                slab[:, (idx - lo).to(t.device)] = received[o][which]
            slabs.append(slab)
        ctx.plans, ctx.starts, ctx.rank, ctx.group, ctx.n = plans, starts, rank, group, n
        return tuple(slabs)

    @staticmethod
    def backward(ctx, dk_slab, dv_slab):
        plans, starts, rank, group, n = ctx.plans, ctx.starts, ctx.rank, ctx.group, ctx.n
        (lo, _), fetch = plans[rank]
        a = starts[rank]
        dk = dk_slab[:, a - lo:a - lo + n].clone()
        dv = dv_slab[:, a - lo:a - lo + n].clone()
        exchange = Exchange(group)
        for o, idx in fetch.items():
            rows = (idx - lo).to(dk.device)
            exchange.send(dk_slab.index_select(1, rows), o).send(dv_slab.index_select(1, rows), o)
        back = {}
        for o, (_, other_fetch) in enumerate(plans):
            if o != rank and rank in other_fetch:
                m = len(other_fetch[rank])
                back[o] = (exchange.recv(dk, (dk.shape[0], m, *dk.shape[2:]), o),
                           exchange.recv(dv, (dv.shape[0], m, *dv.shape[2:]), o))
        exchange.start().wait()
        for o, (gk, gv) in back.items():
            idx = (plans[o][1][rank] - a).to(dk.device)
            dk.index_add_(1, idx, gk)
            dv.index_add_(1, idx, gv)
        return dk, dv, None, None, None, None


def neighborhood_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                           dilation: int | Sequence[int] = 1, is_causal: bool | Sequence[bool] = False, *,
                           group: ProcessGroup | None = None, scale: float | None = None,
                           ) -> torch.Tensor:
    """NATTEN's ``na{1,2,3}d`` on a grid sharded contiguously along its first spatial axis.

    ``query``/``key``/``value``: this rank's rows, heads-last ``[B, X0_local, *rest, H, D]``
    (``rest`` whole on every rank; uneven shards allowed; ranks in order along axis 0).
    ``kernel_size``, ``stride``, ``dilation``, ``is_causal``: as NATTEN, on the global grid. Each
    rank receives exactly the halo rows its queries need (from any rank, however far) and
    returns its rows of the output; the backward sends the halo gradients home.

    Equivalent PyTorch::

        full = na2d(gather(query), gather(key), gather(value), kernel_size, stride, dilation,
                    is_causal, scale=scale)
        out = full[:, a_rank:b_rank]
    """
    from .. import neighborhood as na

    rank, _ = world(group)
    local = {}

    def validate():
        # Everything a rank can get wrong on its own, before the gather (agreement module doc).
        for name, t in (("query", query), ("key", key), ("value", value)):
            checks.tensor(name, t, floating=True)
        for name, t in (("key", key), ("value", value)):
            checks.like(name, t, query, "query")
        spatial = query.dim() - 3
        if not 1 <= spatial <= 3:
            raise ValueError(f"query must be [B, X0, ..., H, D] with 1 to 3 spatial axes, got "
                             f"shape {tuple(query.shape)}")
        if key.shape != query.shape or value.shape[:-1] != query.shape[:-1]:
            raise ValueError(f"query and key must share [B, *spatial, H, D], and value "
                             f"[B, *spatial, H], got {tuple(query.shape)}, {tuple(key.shape)}, "
                             f"{tuple(value.shape)}")
        geometry = [checks.per_axis(name, x, spatial, cast) for name, x, cast in (
            ("kernel_size", kernel_size, checks.integer), ("stride", stride, checks.integer),
            ("dilation", dilation, checks.integer), ("is_causal", is_causal, checks.boolean))]
        head_dim = query.shape[-1]
        resolved = checks.softmax_scale("scale", scale, head_dim)
        checks.fits_scores("scale", resolved, query.dtype)
        local["spatial"] = spatial
        rest = list(query.shape[2:1 + spatial]) + [0] * (3 - spatial)
        padded = [list(g) + [0] * (3 - spatial) for g in geometry]
        return query.shape[1], (query.shape[0], spatial, *rest[:2], query.shape[-2], head_dim,
                                value.shape[-1], encode_dtype(query.dtype),
                                *(int(x) for g in padded for x in g), encode_real(resolved))

    lengths = agreed_lengths("neighborhood_attention", group, query, _SHARED, validate)
    spatial = local["spatial"]
    grid = (sum(lengths), *query.shape[2:1 + spatial])
    mask = Neighborhood(grid, kernel_size, stride, dilation, is_causal)  # the same on every rank
    axis0 = next(iter(mask.axes()))
    plans, starts = halo_plan(lengths, *axis0[1:])
    k_slab, v_slab = _Halo.apply(key, value, plans, starts, rank, group)
    (lo, hi), _ = plans[rank]
    a, n = starts[rank], query.shape[1]
    q_slab = torch.nn.functional.pad(
        query.movedim(1, -1), (a - lo, hi - a - n)).movedim(-1, 1)
    fn = (na.na1d, na.na2d, na.na3d)[spatial - 1]  # type: ignore[attr-defined]  # lazy attributes
    out = fn(q_slab, k_slab, v_slab, kernel_size=mask.kernel_size, stride=mask.stride,
             dilation=mask.dilation, is_causal=mask.is_causal, scale=scale)
    return out[:, a - lo:a - lo + n]
