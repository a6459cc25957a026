"""The emitter: one ``GraphSpec`` -> the tensors and the single ``sdpa`` / ``sdpa_backward`` node
of a cuDNN-frontend graph. It drives both ``cudnn.pygraph`` and the C++ ``backend_graph`` (their
tensor and node APIs match), so the graph the engine runs is the one the C++ validator checks.

Tensor uids and names are fixed (``UID``); the keyword arguments passed to the nodes are
whitelisted (``pygraph`` silently swallows misspelled ones).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, Optional

from ..core.caches import memoize
from ._spec import GraphSpec
from .callback_cycles import freed_with

__all__ = ["UID", "FORWARD_KWARGS", "BACKWARD_KWARGS", "emit", "io_uids", "cudnn_module", "cudnn_dtype"]


class UID(IntEnum):
    """Fixed tensor uids (and names: ``uid.name.lower()``) of every graph the engine builds."""

    Q = 1
    K = 2
    V = 3
    O = 4  # noqa: E741 - the frontend's name
    STATS = 5
    DO = 6
    DQ = 7
    DK = 8
    DV = 9
    SCALE = 10
    BIAS = 11
    DBIAS = 12
    SEQ_LEN_Q = 13
    SEQ_LEN_KV = 14
    DROPOUT_SEED = 15
    DROPOUT_OFFSET = 16
    DROPOUT_MASK = 17
    DROPOUT_SCALE = 18
    DROPOUT_SCALE_INV = 19
    PAGE_TABLE_K = 20
    PAGE_TABLE_V = 21
    RAGGED_Q = 22
    RAGGED_K = 23
    RAGGED_V = 24
    RAGGED_O = 25
    RAGGED_STATS = 26
    BLOCK_MASK = 27
    # FP8 graphs (``graphs.fp8``): sink logits, amax outputs, and the scale/descale inputs at
    # ``FP8_SCALES + i`` (i: index in FORWARD_SCALES / BACKWARD_SCALES, at most 12).
    SINK = 28
    DSINK = 29
    AMAX_S = 30
    AMAX_O = 31
    AMAX_DQ = 32
    AMAX_DK = 33
    AMAX_DV = 34
    AMAX_DP = 35
    FP8_SCALES = 40


# The only keyword arguments this module passes (checked against the C++ binding in the tests).
FORWARD_KWARGS = frozenset({
    "q", "k", "v", "name", "generate_stats", "attn_scale", "bias", "use_alibi_mask",
    "use_padding_mask", "seq_len_q", "seq_len_kv", "diagonal_alignment",
    "diagonal_band_left_bound", "diagonal_band_right_bound", "dropout",
    "paged_attention_k_table", "paged_attention_v_table", "paged_attention_max_seq_len_kv",
    "max_total_seq_len_q", "max_total_seq_len_kv", "score_mod", "block_mask"})
BACKWARD_KWARGS = frozenset({
    "q", "k", "v", "o", "dO", "stats", "name", "attn_scale", "bias", "dBias", "use_alibi_mask",
    "use_padding_mask", "seq_len_q", "seq_len_kv", "diagonal_alignment",
    "diagonal_band_left_bound", "diagonal_band_right_bound", "dropout",
    "use_deterministic_algorithm", "max_total_seq_len_q", "max_total_seq_len_kv", "score_mod",
    "score_mod_bprop"})

@memoize("cudnn.module", maxsize=1)
def cudnn_module():
    import cudnn  # deferred: importing cudnn_attn must not need it

    from .exit_release import register

    register()  # after the frontend's import: our exit hook runs before its own
    return cudnn


def cudnn_dtype(name: str):
    dt = cudnn_module().data_type
    return {"float16": dt.HALF, "bfloat16": dt.BFLOAT16, "float32": dt.FLOAT,
            "int32": dt.INT32, "int64": dt.INT64, "uint8": dt.UINT8}[name]


def _call(op, allowed: frozenset, **kwargs):
    unknown = set(kwargs) - allowed
    if unknown:  # a bug in this module, not user input
        raise TypeError(f"{op.__name__}: keyword(s) {sorted(unknown)} are not whitelisted")
    return op(**kwargs)


# ---------------------------------------------------------------------------------------------
# the emitter: GraphSpec -> tensors and one sdpa / sdpa_backward node on ``g``
# ---------------------------------------------------------------------------------------------

class _Emitter:
    def __init__(self, g, spec: GraphSpec):
        self.g, self.spec, self.tensors = g, spec, {}
        self.score_mod_bprop = None

    def tensor(self, uid: UID, dim, stride, dtype: str, *, by_value=False, ragged=None):
        kwargs = {} if ragged is None else {"ragged_offset": self.tensors[ragged]}
        t = self.g.tensor(name=uid.name.lower(), dim=list(dim), stride=list(stride),
                          data_type=cudnn_dtype(dtype), is_pass_by_value=by_value, **kwargs)
        t.set_uid(int(uid))
        self.tensors[uid] = t
        return t

    def scalar(self, uid: UID, dtype: str):
        return self.tensor(uid, (1, 1, 1, 1), (1, 1, 1, 1), dtype, by_value=True)

    def output(self, t, uid: UID, dim, stride, dtype: Optional[str] = None, ragged=None):
        t.set_output(True).set_dim(list(dim)).set_stride(list(stride)).set_uid(int(uid))
        t.set_name(uid.name.lower())
        if dtype is not None:
            t.set_data_type(cudnn_dtype(dtype))
        if ragged is not None:
            t.set_ragged_offset(self.tensors[ragged])
        self.tensors[uid] = t
        return t

    def common_inputs(self) -> dict:
        """Q, K, V, scale and every optional input; returns the node's keyword arguments."""
        s, cd = self.spec, cudnn_module()
        b, hq, hkv = s.batch, s.heads_q, s.heads_kv
        if s.ragged:
            for uid in (UID.RAGGED_Q, UID.RAGGED_K, UID.RAGGED_V, UID.RAGGED_O):
                self.tensor(uid, (b + 1, 1, 1, 1), (1, 1, 1, 1), "int32")
        rq = UID.RAGGED_Q if s.ragged else None
        q = self.tensor(UID.Q, (b, hq, s.seq_q, s.dim_qk), s.q_stride, s.dtype, ragged=rq)
        if s.paged is not None:
            k_dim, k_stride = _paged_container(s, s.dim_qk)
            v_dim, v_stride = _paged_container(s, s.dim_v)
        else:
            k_dim, k_stride = (b, hkv, s.seq_kv, s.dim_qk), s.k_stride
            v_dim, v_stride = (b, hkv, s.seq_kv, s.dim_v), s.v_stride
        k = self.tensor(UID.K, k_dim, k_stride, s.dtype,
                        ragged=UID.RAGGED_K if s.ragged else None)
        v = self.tensor(UID.V, v_dim, v_stride, s.dtype,
                        ragged=UID.RAGGED_V if s.ragged else None)
        kw: dict[str, Any] = {"q": q, "k": k, "v": v,
                              "attn_scale": self.scalar(UID.SCALE, "float32")}
        if s.bias_dim is not None:
            kw["bias"] = self.tensor(UID.BIAS, s.bias_dim, s.bias_stride, s.bias_dtype)
        if s.padding:
            kw["use_padding_mask"] = True
            kw["seq_len_q"] = self.tensor(UID.SEQ_LEN_Q, (b, 1, 1, 1), (1, 1, 1, 1), "int32")
            kw["seq_len_kv"] = self.tensor(UID.SEQ_LEN_KV, (b, 1, 1, 1), (1, 1, 1, 1), "int32")
        if s.alibi:
            kw["use_alibi_mask"] = True
        if s.score_mod is not None:  # the program's ops, replayed with cuDNN's pointwise ops
            forward, bprop = s.score_mod.callbacks()
            kw["score_mod"] = freed_with(self.g, forward)
            self.score_mod_bprop = freed_with(self.g, bprop)
        band = s.band
        if band is not None:
            kw["diagonal_alignment"] = (cd.diagonal_alignment.BOTTOM_RIGHT
                                        if band.alignment == "bottom_right"
                                        else cd.diagonal_alignment.TOP_LEFT)
            if band.left is not None:
                kw["diagonal_band_left_bound"] = band.left
            if band.right is not None:
                kw["diagonal_band_right_bound"] = band.right
        if s.ragged:
            if s.max_total_seq_len_q is not None:
                kw["max_total_seq_len_q"] = s.max_total_seq_len_q
            if s.max_total_seq_len_kv is not None:
                kw["max_total_seq_len_kv"] = s.max_total_seq_len_kv
        return kw

    def dropout(self, backward: bool):
        s = self.spec
        if s.dropout_mask:
            mask = self.tensor(UID.DROPOUT_MASK, (s.batch, s.heads_q, s.seq_q, s.seq_kv),
                               (s.heads_q * s.seq_q * s.seq_kv, s.seq_q * s.seq_kv, s.seq_kv, 1),
                               s.dtype)
            scale = self.scalar(UID.DROPOUT_SCALE, "float32")
            if backward:
                return (mask, scale, self.scalar(UID.DROPOUT_SCALE_INV, "float32"))
            return (mask, scale)
        if s.dropout_p > 0:
            return (s.dropout_p, self.scalar(UID.DROPOUT_SEED, "int64"),
                    self.scalar(UID.DROPOUT_OFFSET, "int64"))
        return None

    def forward(self):
        s = self.spec
        kw = self.common_inputs()
        if s.paged is not None:
            pages = s.seq_kv // s.paged.page_size
            for uid, name in ((UID.PAGE_TABLE_K, "paged_attention_k_table"),
                              (UID.PAGE_TABLE_V, "paged_attention_v_table")):
                kw[name] = self.tensor(uid, (s.batch, 1, pages, 1), (pages, pages, 1, 1), "int32")
            kw["paged_attention_max_seq_len_kv"] = s.seq_kv
        drop = self.dropout(backward=False)
        if drop is not None:
            kw["dropout"] = drop
        if s.block_mask:
            tiles = -(-s.seq_q // 128), -(-(-(-s.seq_kv // 128)) // 8)
            dim = (s.batch, s.heads_q) + tiles
            kw["block_mask"] = self.tensor(UID.BLOCK_MASK, dim, _packed(dim), "uint8")
        if s.ragged and s.stats:
            self.tensor(UID.RAGGED_STATS, (s.batch + 1, 1, 1, 1), (1, 1, 1, 1), "int32")
        o, stats = _call(self.g.sdpa, FORWARD_KWARGS, name="sdpa", generate_stats=s.stats, **kw)
        self.output(o, UID.O, (s.batch, s.heads_q, s.seq_q, s.dim_v), s.o_stride, s.dtype,
                    ragged=UID.RAGGED_O if s.ragged else None)
        if s.stats:
            self.output(stats, UID.STATS, (s.batch, s.heads_q, s.seq_q, 1), s.stats_stride,
                        "float32", ragged=UID.RAGGED_STATS if s.ragged else None)

    def backward(self):
        s = self.spec
        kw = self.common_inputs()
        ro = UID.RAGGED_O if s.ragged else None
        o_dim = (s.batch, s.heads_q, s.seq_q, s.dim_v)
        kw["o"] = self.tensor(UID.O, o_dim, s.o_stride, s.dtype, ragged=ro)
        kw["dO"] = self.tensor(UID.DO, o_dim, s.o_stride, s.dtype, ragged=ro)
        if s.ragged:
            self.tensor(UID.RAGGED_STATS, (s.batch + 1, 1, 1, 1), (1, 1, 1, 1), "int32")
        kw["stats"] = self.tensor(UID.STATS, (s.batch, s.heads_q, s.seq_q, 1), s.stats_stride,
                                  "float32", ragged=UID.RAGGED_STATS if s.ragged else None)
        if s.dbias:
            kw["dBias"] = self.tensor(UID.DBIAS, s.bias_dim, _packed(s.bias_dim), s.bias_dtype)
            kw["dBias"].set_output(True)
        drop = self.dropout(backward=True)
        if drop is not None:
            kw["dropout"] = drop
        if s.deterministic:
            kw["use_deterministic_algorithm"] = True
        if self.score_mod_bprop is not None:
            kw["score_mod_bprop"] = self.score_mod_bprop
        dq, dk, dv = _call(self.g.sdpa_backward, BACKWARD_KWARGS, name="sdpa_backward", **kw)
        ragged = (UID.RAGGED_Q, UID.RAGGED_K, UID.RAGGED_V) if s.ragged else (None,) * 3
        for t, uid, heads, seq, dim, rag in (
                (dq, UID.DQ, s.heads_q, s.seq_q, s.dim_qk, ragged[0]),
                (dk, UID.DK, s.heads_kv, s.seq_kv, s.dim_qk, ragged[1]),
                (dv, UID.DV, s.heads_kv, s.seq_kv, s.dim_v, ragged[2])):
            self.output(t, uid, (s.batch, heads, seq, dim), s.out_stride(heads, seq, dim),
                        s.dtype, ragged=rag)


def _packed(dim) -> tuple:
    out, inner = [0] * len(dim), 1
    for axis in range(len(dim) - 1, -1, -1):
        out[axis] = inner
        inner *= dim[axis]
    return tuple(out)


def _paged_container(s: GraphSpec, dim: int) -> tuple[tuple, tuple]:
    nb, ps, h = s.paged.num_blocks, s.paged.page_size, s.heads_kv
    if s.paged.layout == "bshd":
        return (nb, h, ps, dim), (ps * h * dim, dim, h * dim, 1)
    return (nb, h, ps, dim), (h * ps * dim, ps * dim, dim, 1)


def io_uids(spec: GraphSpec, backward: bool) -> tuple[tuple, tuple]:
    inputs = [UID.Q, UID.K, UID.V]
    if backward:
        inputs += [UID.O, UID.DO, UID.STATS]
    inputs.append(UID.SCALE)
    if spec.bias_dim is not None:
        inputs.append(UID.BIAS)
    if spec.padding:
        inputs += [UID.SEQ_LEN_Q, UID.SEQ_LEN_KV]
    if spec.dropout_mask:
        inputs += [UID.DROPOUT_MASK, UID.DROPOUT_SCALE]
        if backward:
            inputs.append(UID.DROPOUT_SCALE_INV)
    elif spec.dropout_p > 0:
        inputs += [UID.DROPOUT_SEED, UID.DROPOUT_OFFSET]
    if spec.paged is not None and not backward:
        inputs += [UID.PAGE_TABLE_K, UID.PAGE_TABLE_V]
    if spec.block_mask and not backward:
        inputs.append(UID.BLOCK_MASK)
    if spec.ragged:
        inputs += [UID.RAGGED_Q, UID.RAGGED_K, UID.RAGGED_V, UID.RAGGED_O]
        if backward or spec.stats:
            inputs.append(UID.RAGGED_STATS)
    if backward:
        outputs = [UID.DQ, UID.DK, UID.DV] + ([UID.DBIAS] if spec.dbias else [])
    else:
        outputs = [UID.O] + ([UID.STATS] if spec.stats else [])
    return tuple(inputs), tuple(outputs)


def emit(g, spec: GraphSpec, backward: bool):
    """Write ``spec``'s forward or backward node onto ``g`` (a ``pygraph`` or a C++ graph)."""
    e = _Emitter(g, spec)
    e.backward() if backward else e.forward()
    return e.tensors
