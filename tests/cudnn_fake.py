"""A stand-in for cuDNN's ``execute``: what an SDPA graph documents, computed in float64 from the
buffers the engine binds, so ``CudnnPlan``'s host logic runs on the CPU.

It reads every layout cuDNN documents: dense tensors through their strides, packed (THD) tensors
through their ragged offsets (element offsets of each sequence's first token, ``[B + 1, 1, 1,
1]``), paged K/V through the page tables (``[B, 1, pages, 1]`` over ``[num_blocks, page_size, H,
D]`` pools). Rows that see no key come out NaN (out and stats): the engine must not rely on what
cuDNN writes there. Positions past a sequence's length are never read and never written.

``install(monkeypatch)`` makes ``backend="cudnn"`` run through it on this machine.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from cudnn_attn import dispatch
from cudnn_attn.caches import clear_caches
from cudnn_attn.graphs import _runtime
from cudnn_attn.graphs import backend as cudnn_backend
from cudnn_attn.graphs._spec import analyze
from cudnn_attn.graphs.sdpa import UID


def frontend_present() -> bool:
    return importlib.util.find_spec("cudnn") is not None


def host(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: the executor plays the GPU, which reads device-only values."""
    return t.as_subclass(torch.Tensor)


def cudnn_alibi_slopes(h):
    """cudnn_frontend_utils.h get_alibi_slope, transcribed."""
    n = 1 << int(math.log2(h))
    exps = [i + 1.0 for i in range(n)] + [(i + 1) * 0.5 for i in range(0, 2 * (h - n), 2)]
    return torch.tensor([2.0 ** (-8.0 * e / n) for e in exps], dtype=torch.float64)


def cudnn_visibility(spec, B, lens_q=None, lens_kv=None):
    """What cuDNN keeps, from its documented rule: padding, then i' - L < j <= i' + R."""
    sq, skv = spec.seq_q, spec.seq_kv
    lq = torch.tensor(lens_q if lens_q else [sq] * B).view(B, 1, 1)
    lkv = torch.tensor(lens_kv if lens_kv else [skv] * B).view(B, 1, 1)
    i = torch.arange(sq).view(1, -1, 1)
    j = torch.arange(skv).view(1, 1, -1)
    vis = torch.ones(B, sq, skv, dtype=torch.bool)
    if spec.padding:
        vis &= (i < lq) & (j < lkv)
    band = spec.band
    if band is not None:
        aligned = i + ((lkv - lq if spec.padding else skv - sq) if band.alignment == "bottom_right" else 0)
        if band.left is not None:
            vis &= j > aligned - band.left
        if band.right is not None:
            vis &= j <= aligned + band.right
    return vis


class FakeGraph:
    """One forward or backward SDPA graph of ``spec``; ``seeds`` records the dropout seeds."""

    def __init__(self, spec, backward):
        self.spec, self.backward, self.workspace_size, self.seeds = spec, backward, 0, []

    # -- reading and writing the bound tensors ------------------------------------------------
    def _offsets(self, buffers, uid):
        return host(buffers[uid]).flatten().tolist()

    def _read(self, buffers, uid, ragged_uid, heads, seq, lens):
        """``[B, heads, seq, D]`` float64 of a bound tensor; zeros past a packed sequence."""
        s, t = self.spec, buffers[uid]
        if not s.ragged:
            t = t if s.layout == "bhsd" else t.transpose(1, 2)
            return t.to(torch.float64)
        flat, offsets = t.reshape(-1), self._offsets(buffers, ragged_uid)
        dim = t.shape[-1]
        out = torch.zeros(s.batch, heads, seq, dim, dtype=torch.float64)
        for b, n in enumerate(lens):
            rows = flat[offsets[b]:offsets[b] + n * heads * dim].view(n, heads, dim)
            out[b, :, :n] = rows.transpose(0, 1).to(torch.float64)
        return out

    def _read_kv(self, buffers, uid, table_uid, lens_kv):
        s = self.spec
        if s.paged is None:
            ragged = UID.RAGGED_K if uid == UID.K else UID.RAGGED_V
            return self._read(buffers, uid, ragged, s.heads_kv, s.seq_kv, lens_kv)
        pool, page = buffers[uid], s.paged.page_size
        if s.paged.layout == "bhsd":  # cuDNN's [num_blocks, H, page, D] containers
            pool = pool.transpose(1, 2)  # -> [num_blocks, page, H, D], as bshd pools
        table = host(buffers[table_uid]).view(s.batch, -1).tolist()
        out = torch.zeros(s.batch, s.heads_kv, s.seq_kv, pool.shape[-1], dtype=torch.float64)
        for b, n in enumerate(lens_kv):
            for t in range(n):
                out[b, :, t] = pool[table[b][t // page], t % page].to(torch.float64)
        return out

    def _write(self, buffers, uid, ragged_uid, value, lens):
        s, dst = self.spec, buffers[uid]
        if not s.ragged:
            value = value if s.layout == "bhsd" else value.transpose(1, 2)
            dst.copy_(value.to(dst.dtype))
            return
        flat, offsets = dst.view(-1), self._offsets(buffers, ragged_uid)
        heads, dim = value.shape[1], value.shape[3]
        for b, n in enumerate(lens):
            rows = value[b, :, :n].transpose(0, 1).reshape(-1)
            flat[offsets[b]:offsets[b] + n * heads * dim] = rows.to(dst.dtype)

    def _read_stats(self, buffers, lens_q):
        s, t = self.spec, buffers[UID.STATS]
        if not s.ragged:
            return t.to(torch.float64)
        flat, offsets = t.reshape(-1), self._offsets(buffers, UID.RAGGED_STATS)
        out = torch.zeros(s.batch, s.heads_q, s.seq_q, 1, dtype=torch.float64)
        for b, n in enumerate(lens_q):  # token-major "TH1": (b, h, i) at offset + i * H + h
            out[b, :, :n, 0] = flat[offsets[b]:offsets[b] + n * s.heads_q].view(n, s.heads_q).t()
        return out

    def _write_stats(self, buffers, lse, lens_q):
        s, dst = self.spec, buffers[UID.STATS]
        if not s.ragged:
            dst.copy_(lse)
            return
        flat, offsets = dst.view(-1), self._offsets(buffers, UID.RAGGED_STATS)
        for b, n in enumerate(lens_q):
            flat[offsets[b]:offsets[b] + n * s.heads_q] = lse[b, :, :n, 0].t().reshape(-1).float()

    def _read_bias(self, bias):
        """The bias through the dims and strides the graph declares (as cuDNN reads the
        pointer), broadcast to ``[B, H_q, S_q, S_kv]``. cuDNN's backward documents biases of
        dims ``(1|B, 1|H_q, S_q, S_kv)`` only (one broadcast along S_q gave dQ errors of ~1.4 on
        an H200, issue 23): a backward graph declaring another shape is refused here."""
        s = self.spec
        if self.backward and tuple(s.bias_dim[2:]) != (s.seq_q, s.seq_kv):
            raise AssertionError(f"cuDNN's backward reads a bias of dims (1|B, 1|H_q, S_q, "
                                 f"S_kv) only; this graph declares {s.bias_dim}")
        declared = torch.as_strided(bias, s.bias_dim, s.bias_stride)
        return declared.to(torch.float64).expand(s.batch, s.heads_q, s.seq_q, s.seq_kv)

    # -- the graph --------------------------------------------------------------------------------
    def execute(self, buffers, workspace, handle):
        s = self.spec
        g = s.heads_q // s.heads_kv
        B = s.batch
        if s.padding:
            lens_q = host(buffers[UID.SEQ_LEN_Q]).flatten().tolist()
            lens_kv = host(buffers[UID.SEQ_LEN_KV]).flatten().tolist()
        else:
            lens_q, lens_kv = [s.seq_q] * B, [s.seq_kv] * B
        q = self._read(buffers, UID.Q, UID.RAGGED_Q, s.heads_q, s.seq_q, lens_q)
        k = self._read_kv(buffers, UID.K, UID.PAGE_TABLE_K, lens_kv).repeat_interleave(g, 1)
        v = self._read_kv(buffers, UID.V, UID.PAGE_TABLE_V, lens_kv).repeat_interleave(g, 1)
        scale = buffers[UID.SCALE].item()
        sc = scale * q @ k.transpose(-1, -2)
        if UID.BIAS in buffers:
            sc = sc + self._read_bias(buffers[UID.BIAS])
        if s.alibi:
            i = torch.arange(s.seq_q).view(-1, 1)
            j = torch.arange(s.seq_kv).view(1, -1)
            sc = sc + cudnn_alibi_slopes(s.heads_q).view(1, -1, 1, 1) * (j - i)
        vis = cudnn_visibility(s, B, *((lens_q, lens_kv) if s.padding else (None, None)))[:, None]
        sc = sc.masked_fill(~vis, -math.inf)
        keep = 1.0
        if UID.DROPOUT_SEED in buffers:
            seed = buffers[UID.DROPOUT_SEED].item()
            self.seeds.append(seed)
            gen = torch.Generator().manual_seed(seed)
            draw = torch.rand(sc.shape, generator=gen, dtype=torch.float64)
            keep = (draw >= s.dropout_p).to(torch.float64) / (1 - s.dropout_p)
        if not self.backward:
            lse = sc.logsumexp(-1, keepdim=True)
            lse = torch.where(vis.any(-1, keepdim=True), lse, math.nan)
            p = torch.exp(sc - lse)
            self._write(buffers, UID.O, UID.RAGGED_O, (p * keep) @ v, lens_q)
            if UID.STATS in buffers:
                self._write_stats(buffers, lse, lens_q)
            return
        p = torch.exp(sc - self._read_stats(buffers, lens_q))
        do = self._read(buffers, UID.DO, UID.RAGGED_O, s.heads_q, s.seq_q, lens_q)
        o = self._read(buffers, UID.O, UID.RAGGED_O, s.heads_q, s.seq_q, lens_q)
        delta = (do * o).sum(-1, keepdim=True)
        ds = p * ((do @ v.transpose(-1, -2)) * keep - delta)
        hkv = s.heads_kv
        self._write(buffers, UID.DQ, UID.RAGGED_Q, scale * ds @ k, lens_q)
        dk = (scale * ds.transpose(-1, -2) @ q).view(B, hkv, g, s.seq_kv, -1).sum(2)
        dv = ((p * keep).transpose(-1, -2) @ do).view(B, hkv, g, s.seq_kv, -1).sum(2)
        self._write(buffers, UID.DK, UID.RAGGED_K, dk, lens_kv)
        self._write(buffers, UID.DV, UID.RAGGED_V, dv, lens_kv)
        if UID.DBIAS in buffers:
            dims = [d for d, n in enumerate(s.bias_dim) if n == 1]
            buffers[UID.DBIAS].copy_(ds.sum(dims, keepdim=True) if dims else ds)


def install(monkeypatch):
    """``backend="cudnn"`` runs on this CPU through ``FakeGraph`` and a private graph cache;
    returns ``(cache, built)`` where ``built`` lists the ``(spec, backward)`` of each build."""
    from cudnn_attn.graphs import cache

    engine = dispatch.get_backend("cudnn")
    engine.clear()
    built = []

    def build(problem, spec, backward):
        built.append((spec, backward))
        return FakeGraph(spec, backward)

    fresh = cache.GraphCache(16)
    monkeypatch.setattr(cache, "graph_cache", fresh)
    monkeypatch.setattr(cudnn_backend, "build_graph", build)
    monkeypatch.setattr(_runtime, "handle_for", lambda device: None)
    monkeypatch.setattr(engine, "supports", lambda problem: analyze(problem)[1])
    clear_caches()  # no plan, call or decline from before the fake engine
    return fresh, built
