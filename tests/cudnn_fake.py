"""A stand-in for cuDNN's ``execute``: what an SDPA graph documents, computed in float64 from the
buffers the engine binds, so ``CudnnPlan``'s host logic runs on the CPU.

It reads the graph cuDNN received, not the engine's analysis of the problem: each graph the
engine builds is emitted onto the frontend's C++ graph (validated for sm_90) and its serialized
form (``str(graph)``: the node's attributes — scale input, bias, ALiBi, padding, diagonal
alignment and bounds, dropout probability — and every tensor's uid, dims, strides and ragged
offset) is all the executor uses, plus the score_mod program the graph's ``score_mod`` callback
replays (cuDNN's JSON does not carry the callback's ops; ``ScoreMod.to_json`` does).

Tensors are read through their graph strides (``as_strided``): dense layouts, packed (THD)
tensors through their ragged offsets (element offsets of each sequence's first token), paged K/V
through the page tables (``[B, 1, pages, 1]`` over the graph's ``[num_blocks, H, page, D]``
containers). Rows that see no key come out NaN (out and stats): the engine must not rely on what
cuDNN writes there. Hidden pairs are hidden before the scale multiplies, as cuDNN's kernels
do. Positions past a sequence's length are never read and never written.

``install(monkeypatch)`` makes ``backend="cudnn"`` run through it on this machine.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct

import torch

from cudnn_attn.core import dispatch
from cudnn_attn.core.caches import clear_caches
from cudnn_attn.graphs import _emit, _runtime
from cudnn_attn.graphs import backend as cudnn_backend
from cudnn_attn.model.score_mods import ScoreMod


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


def serialized_graph(spec, backward):
    """``(graph JSON, score_mod JSON or None)`` of the graph the engine emits for ``spec``."""
    import cudnn

    g = cudnn._pybind_module.backend_graph(
        name="fake", io_data_type=_emit.cudnn_dtype(spec.dtype),
        intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT,
        sm_version=90, sm_count=132)
    _emit.emit(g, spec, backward)
    g.validate()
    return str(g), (None if spec.score_mod is None else spec.score_mod.to_json())


def _float32(hex_text):
    return struct.unpack(">f", bytes.fromhex(hex_text))[0]


class FakeGraph:
    """One forward or backward SDPA graph, from its serialized form; ``seeds`` records the
    dropout seeds it drew with."""

    autotune = tuned = False  # (BuiltGraph's flags: the stand-in has one plan, nothing to tune)

    def __init__(self, graph_json: str, score_mod_json=None):
        graph = json.loads(graph_json)
        (self.node,) = graph["nodes"]
        self.tensors = {t["uid"]: t for t in graph["tensors"]}
        self.backward = self.node["tag"] == "SDPA_BWD"
        self.score_mod = None if score_mod_json is None else ScoreMod.from_json(score_mod_json)
        self.workspace_size, self.seeds = 0, []

    # -- the graph's tensors -----------------------------------------------------------------
    def uid(self, role):
        return self.node["inputs"].get(role, self.node["outputs"].get(role))

    def dims(self, role):
        return self.tensors[self.uid(role)]["dim"]

    def _offsets(self, buffers, uid):
        return host(buffers[uid]).flatten().tolist()

    def _view(self, buffers, role, lens=None):
        """The logical ``[B, H, S, D]`` view of a bound tensor through its graph strides;
        ragged tensors as one view per sequence (``lens`` tokens each)."""
        t = self.tensors[self.uid(role)]
        buf = buffers[t["uid"]]
        if "ragged_offset_uid" not in t:
            return buf.as_strided(t["dim"], t["stride"], buf.storage_offset())
        starts = self._offsets(buffers, t["ragged_offset_uid"])
        _, h, _, d = t["dim"]
        return [buf.as_strided((h, n, d), t["stride"][1:], buf.storage_offset() + starts[b])
                for b, n in enumerate(lens)]

    def _read(self, buffers, role, lens):
        view = self._view(buffers, role, lens)
        if isinstance(view, torch.Tensor):
            return view.to(torch.float64)
        b, h, s, d = self.dims(role)
        out = torch.zeros(b, h, s, d, dtype=torch.float64)
        for i, rows in enumerate(view):
            out[i, :, :rows.shape[1]] = rows.to(torch.float64)
        return out

    def _write(self, buffers, role, value, lens):
        view = self._view(buffers, role, lens)
        if isinstance(view, torch.Tensor):
            view.copy_(value.to(view.dtype))
            return
        for i, rows in enumerate(view):
            rows.copy_(value[i, :, :rows.shape[1]].to(rows.dtype))

    def _read_kv(self, buffers, role, lens_kv, seq_kv):
        table_uid = self.node["inputs"].get(f"Page_table_{role}")
        if table_uid is None:
            kv = self._read(buffers, role, lens_kv)
            if self.node["padding_mask"] and not self.backward and self.dims("Q")[2] == 1:
                # What an H200 showed (cuDNN 9.19, benchmarks/results/cudnn-2026-11-29.json,
                # decode_rows' probe): a one-row forward (cuDNN's decode kernel) keeps whatever
                # lies past the key lengths (NaN in K, V or both) out of every result. Graphs of
                # more rows multiply the V rows there by P = 0 (the same run's two-row decode
                # over NaN pages gave NaN; cudnn-frontend #624), and no GPU has shown what a
                # backward does with them: those keep the pessimistic model.
                past = torch.arange(kv.shape[2]).view(1, -1) >= torch.tensor(lens_kv).view(-1, 1)
                kv = kv.masked_fill(past[:, None, :, None], 0.0)
            return kv
        pool = self._view(buffers, role)                       # [num_blocks, H, page, D]
        page = pool.shape[2]
        table = host(buffers[table_uid]).view(len(lens_kv), -1).tolist()
        out = torch.zeros(len(lens_kv), pool.shape[1], seq_kv, pool.shape[3], dtype=torch.float64)
        for b, n in enumerate(lens_kv):
            for t in range(n):
                out[b, :, t] = pool[table[b][t // page], :, t % page].to(torch.float64)
        return out

    # -- what the node's attributes say ------------------------------------------------------
    def visibility(self, B, sq, skv, lens_q, lens_kv):
        """cuDNN's documented rule: padding, then ``i' - L < j <= i' + R``."""
        n = self.node
        lq = torch.tensor(lens_q).view(B, 1, 1)
        lkv = torch.tensor(lens_kv).view(B, 1, 1)
        i = torch.arange(sq).view(1, -1, 1)
        j = torch.arange(skv).view(1, 1, -1)
        vis = torch.ones(B, sq, skv, dtype=torch.bool)
        if n["padding_mask"]:
            vis &= (i < lq) & (j < lkv)
        shift = (lkv - lq) if n["diagonal_alignment"] == "BOTTOM_RIGHT" else 0
        if n["left_bound"] is not None:
            vis &= j > i + shift - n["left_bound"]
        if n["right_bound"] is not None:
            vis &= j <= i + shift + n["right_bound"]
        return vis

    def execute(self, buffers, workspace, handle):
        n = self.node
        B, hq, sq, _ = self.dims("Q")
        if n["padding_mask"]:
            lens_q = host(buffers[self.uid("SEQ_LEN_Q")]).flatten().tolist()
            lens_kv = host(buffers[self.uid("SEQ_LEN_KV")]).flatten().tolist()
        paged = "Page_table_K" in n["inputs"]
        skv = n["max_seq_len_kv"] if paged else self.dims("K")[2]
        if not n["padding_mask"]:
            lens_q, lens_kv = [sq] * B, [skv] * B
        q = self._read(buffers, "Q", lens_q)
        k = self._read_kv(buffers, "K", lens_kv, skv)
        v = self._read_kv(buffers, "V", lens_kv, skv)
        k, v = k.repeat_interleave(hq // k.shape[1], 1), v.repeat_interleave(hq // v.shape[1], 1)
        scale = buffers[self.uid("Attn_scale")].item()
        sc = scale * q @ k.transpose(-1, -2)
        if self.score_mod is not None:  # the callback's ops, on the scaled scores
            shape = sc.shape
            sc = self.score_mod.apply(sc, lambda axis: torch.arange(shape[axis], dtype=sc.dtype)
                                      .view([-1 if a == axis else 1 for a in range(4)]))
        if "Bias" in n["inputs"]:
            # cuDNN's backward documents biases of dims (1|B, 1|H_q, S_q, S_kv) only (one
            # broadcast along S_q gave dQ errors of ~1.4 on an H200, issue 23): refused here.
            if self.backward and tuple(self.dims("Bias")[2:]) != (sq, skv):
                raise AssertionError(f"cuDNN's backward reads a bias of dims (1|B, 1|H_q, S_q, "
                                     f"S_kv) only; this graph declares {self.dims('Bias')}")
            sc = sc + self._view(buffers, "Bias").to(torch.float64)
        if n["alibi_mask"]:
            i = torch.arange(sq).view(-1, 1)
            j = torch.arange(skv).view(1, -1)
            sc = sc + cudnn_alibi_slopes(hq).view(1, -1, 1, 1) * (j - i)
        vis = self.visibility(B, sq, skv, lens_q, lens_kv)[:, None]
        # cuDNN's kernels write -inf into the unscaled Q K^T and scale afterwards (an H200 with
        # cuDNN 9.19 gave NaN for scale <= 0 with a causal band, issue 36): a hidden pair then
        # scores -inf * scale (NaN at 0, +inf below), so the engine must bind a positive scale.
        sc = sc.masked_fill(~vis, -math.inf * scale)
        vis = vis & (sc > -math.inf)  # a score_mod may hide pairs too
        keep = 1.0
        if n["dropout_probability"] is not None:
            p = _float32(n["dropout_probability"])
            seed = buffers[self.uid("Seed")].item()
            self.seeds.append(seed)
            # cuDNN promises no mapping from (seed, offset, position) to the pattern: its
            # Philox stream follows the kernel, which the graph's sizes choose (an H200 gave
            # another pattern for D_v = 128 than for D_v = 192). So the draw depends on every
            # Q/K/V dim (forward and backward graphs share them): only the call's own graph
            # replays its mask.
            sizes = (seed, *self.dims("Q"), *self.dims("K"), *self.dims("V"))
            draw = torch.rand(sc.shape, dtype=torch.float64, generator=torch.Generator()
                              .manual_seed(hash(sizes) & 0x7FFF_FFFF_FFFF_FFFF))
            keep = (draw >= p).to(torch.float64) / (1 - p)
        if not self.backward:
            lse = sc.logsumexp(-1, keepdim=True)
            lse = torch.where(vis.any(-1, keepdim=True), lse, math.nan)
            p = torch.exp(sc - lse)
            self._write(buffers, "O", (p * keep) @ v, lens_q)
            if "Stats" in n["outputs"]:
                self._write(buffers, "Stats", lse, lens_q)
            return
        p = torch.exp(sc - self._read(buffers, "Stats", lens_q))
        do = self._read(buffers, "dO", lens_q)
        o = self._read(buffers, "O", lens_q)
        delta = (do * o).sum(-1, keepdim=True)
        ds = p * ((do @ v.transpose(-1, -2)) * keep - delta)
        if "Bias" in n["inputs"] and "dBias" in n["outputs"]:
            dims = [d for d, m in enumerate(self.dims("dBias")) if m == 1]
            self._view(buffers, "dBias").copy_(ds.sum(dims, keepdim=True) if dims else ds)
        if self.score_mod is not None:  # the raw scores' gradient, through the program
            raw = scale * q @ k.transpose(-1, -2)
            shape = raw.shape
            ds = self.score_mod.gradient(raw, ds, lambda axis: torch.arange(
                shape[axis], dtype=raw.dtype).view([-1 if a == axis else 1 for a in range(4)]))
        hk, hv = self.dims("K")[1], self.dims("V")[1]
        dq = scale * ds @ k
        dk = (scale * ds.transpose(-1, -2) @ q).view(B, hk, hq // hk, skv, -1).sum(2)
        dv = ((p * keep).transpose(-1, -2) @ do).view(B, hv, hq // hv, skv, -1).sum(2)
        if not n["padding_mask"] and self.score_mod is None:
            dq, dk, dv = self._open_tails(buffers, delta, dq, dk, dv)
        self._write(buffers, "dQ", dq, lens_q)
        self._write(buffers, "dK", dk, lens_kv)
        self._write(buffers, "dV", dv, lens_kv)


    # -- cuDNN's open tails (limits.CudnnLimits.key_tile) ------------------------------------
    def _open_tails(self, buffers, delta, dq, dk, dv):
        """The backward as cuDNN's SM90 kernels run it without a padding mask: the zero-filled
        rows past the tensors' ends enter ``exp(S - LSE)`` unmasked (but for the diagonal's
        bounds), in fp32. Keys: the second half of the last 128-key tile when S_kv % 128 == 64
        (cudnn-frontend PR #628): score 0, so ``exp(-LSE)`` of the real rows, times their zero K
        rows, into dQ. Queries: the rows up to the next multiple of 64 (a 64-row tile) with the
        LSE that lies next in the stats buffer (the next head's rows; 0 past its end) and zero
        Q and dO, into dK and dV (cudnn-frontend #1072). With ordinary data ``exp(-LSE)`` is
        finite and these terms are 0; a row whose LSE is below -88.7 makes them NaN."""
        B, hq, sq, _ = dq.shape
        skv = dk.shape[2]

        def overflowing(lse):  # exp(0 - LSE) in fp32
            return torch.exp(-lse.float()).double()

        if skv % 128 == 64:
            vis = self.visibility(B, sq, skv + 64, [sq] * B, [skv + 64] * B)[:, None, :, skv:]
            p = torch.where(vis, overflowing(self._read(buffers, "Stats", [sq] * B)), 0.0)
            # dS = P (dP - delta) with dP = dO V^T = 0 on these keys; dQ += dS K, K = 0 there
            dq = dq + (p * -delta * 0.0).sum(-1, keepdim=True)  # inf * 0 = NaN, as the MMA
        tail = -sq % 64
        if tail:
            stats = self.tensors[self.uid("Stats")]
            flat = host(buffers[stats["uid"]]).reshape(-1).double()
            st = stats["stride"]
            index = (torch.arange(B).view(B, 1, 1) * st[0] + torch.arange(hq).view(1, hq, 1) * st[1]
                     + torch.arange(sq, sq + tail).view(1, 1, tail) * st[2])
            lse = torch.where(index < flat.numel(), flat[index.clamp(max=flat.numel() - 1)], 0.0)
            vis = self.visibility(B, sq + tail, skv, [sq + tail] * B, [skv] * B)[:, None, sq:]
            p = torch.where(vis, overflowing(lse[..., None]), 0.0)  # [B, H_q, tail, S_kv]
            # dV += P^T dO and dK += dS^T Q over these rows, whose dO and Q are 0
            poison = (p * 0.0).sum(2)[..., None]  # [B, H_q, S_kv, 1]: 0, or NaN
            hk, hv = dk.shape[1], dv.shape[1]
            dk = dk + poison.view(B, hk, hq // hk, skv, 1).sum(2)
            dv = dv + poison.view(B, hv, hq // hv, skv, 1).sum(2)
        return dq, dk, dv


class FakeHandle:
    """Stands for a cuDNN handle (``execute`` receives it); ``streams`` records each
    ``cudnn.set_stream`` it gets."""

    def __init__(self):
        self.streams = []

    @staticmethod
    def set_stream(handle, stream):
        handle.streams.append(stream)


def install(monkeypatch):
    """``backend="cudnn"`` runs on this CPU through ``FakeGraph`` and a private graph cache;
    returns ``(cache, built)`` where ``built`` lists the ``(spec, backward)`` of each build."""
    import pytest

    from cudnn_attn.graphs import cache

    pytest.importorskip("cudnn")  # the executor reads the frontend's serialized graph
    engine = dispatch.get_backend("cudnn")
    engine.clear()
    built = []

    def build(problem, spec, backward):
        built.append((spec, backward))
        return FakeGraph(*serialized_graph(spec, backward))

    fresh = cache.GraphCache(16)
    monkeypatch.setattr(cache, "graph_cache", fresh)
    monkeypatch.setattr(cudnn_backend, "build_graph", build)
    # The stream plumbing runs as on a GPU (one handle per device, bound to each call's stream
    # under its lock; one pooled workspace per stream), around an object standing for cuDNN's
    # handle.
    monkeypatch.setattr(_runtime, "_new_handle",
                        lambda index: _runtime.DeviceHandle(FakeHandle(), FakeHandle.set_stream))
    monkeypatch.setattr(_runtime, "raw_stream", lambda index: 0)
    monkeypatch.setattr(_runtime, "_current_device", lambda: 0)
    monkeypatch.setattr(_runtime, "capturing", lambda: False)
    monkeypatch.setattr(engine, "supports", engine.graph_reasons)  # every rule but the device
    clear_caches()  # no plan, call or decline from before the fake engine
    return fresh, built
