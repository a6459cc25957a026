"""The cuDNN engine's FP8 attention: ``sdpa_fp8`` / ``sdpa_fp8_backward`` graphs.

``Fp8Spec`` describes one call (shapes, FP8 types, mask, sink) and is the graph's cache key;
``fp8_reasons`` derives every "cuDNN cannot" from ``FP8_LIMITS`` (pure: no graph is built);
``emit_fp8`` writes the node onto a ``cudnn.pygraph`` or the C++ ``backend_graph`` (their APIs
match), ``validate_fp8`` runs the frontend's C++ validator for a described SM without a GPU, and
``Fp8Graph`` builds and runs the graph on a CUDA device.

Tensors are contiguous ``[B, H, S, D]``; the nine (forward) / eighteen (backward) scale and descale
inputs are float32 ``[1, 1, 1, 1]`` device tensors; the amaxes are float32 ``[1, 1, 1, 1]``
outputs. Semantics: ``cudnn_attn.torch_engine.fp8``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..core.caches import LRU
from .build_stages import GraphRefused, run_build_stages
from ._spec import contiguous_strides
from ._emit import UID, cudnn_module  # one uid space for every graph the engine builds

__all__ = ["UID", "Fp8Limits", "FP8_LIMITS", "Fp8Spec", "FP8_TYPE_NAMES", "fp8_reasons", "emit_fp8",
           "cudnn_module", "validate_fp8", "Fp8Graph", "fp8_graph", "FORWARD_SCALES", "BACKWARD_SCALES"]

FP8_TYPE_NAMES = {torch.float8_e4m3fn: "FP8_E4M3", torch.float8_e5m2: "FP8_E5M2",
                  torch.bfloat16: "BFLOAT16", torch.float16: "HALF"}

# The scale inputs in cuDNN's argument order.
FORWARD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
BACKWARD_SCALES = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s",
                   "descale_dP", "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")


@dataclass(frozen=True)
class Fp8Limits:
    """What cuDNN's FP8 SDPA graphs can express, and where (frontend 1.32 validators,
    ``sdpa_fp8_bwd.h``; H200 runs with cuDNN 9.19: the Hopper backward needs D = 128)."""

    min_version: int = 90100             # FP8 SDPA needs cuDNN 9.1.0 ...
    broken_versions: tuple = (91000,)    # ... and not 9.10.0
    min_sm_major: int = 9                # Hopper and newer (no sm_89)
    head_dim_multiple: int = 16
    forward_max_head_dim: int = 256      # Hopper's forward (Blackwell: validated per call)
    hopper_backward_dims: tuple = ((128, 128),)
    blackwell_backward_max_dim: int = 128
    blackwell_backward_extra: tuple = ((192, 128),)
    bottom_right_min_major: int = 10     # bottom-right causal: Blackwell only ...
    bottom_right_min_version: int = 90700
    bottom_right_seq_multiple: int = 64  # ... with S_q, S_kv multiples of 64 (backward)
    half_output_min_major: int = 10      # BF16/FP16 O or gradients: Blackwell, cuDNN >= 9.13
    half_output_min_version: int = 91300
    ragged_backward_excluded_majors: tuple = (9,)
    # The Hopper FP8 forward with sink tokens: cuDNN 9.28 passes check_support, then its
    # runtime-compiled kernel fails NVRTC at build_plans (deviceless plans for H100).
    hopper_forward_sink: bool = False
    features_absent: tuple = ("bias", "ALiBi", "dropout")
    gqa: bool = True
    amax_outputs: bool = True            # every amax is a graph output
    notes: dict = field(default_factory=dict, compare=False)


FP8_LIMITS = Fp8Limits()


@dataclass(frozen=True)
class Fp8Spec:
    """One FP8 graph: everything that fixes it (runtime values stay out: scales, lengths)."""

    batch: int
    heads_q: int
    heads_k: int
    heads_v: int
    seq_q: int
    seq_kv: int
    dim_qk: int
    dim_v: int
    io: str                  # Q/K/V type name (FP8_TYPE_NAMES)
    out: str                 # forward: O's type; backward: dO's type
    grad: str = ""           # backward: dQ/dK/dV type
    o_type: str = ""         # backward: O's type (default: io)
    stats: bool = True
    padding: bool = False
    alignment: str = "top_left"
    left_bound: Optional[int] = None   # cuDNN's exclusive left bound
    right_bound: Optional[int] = None
    sink: bool = False
    dsink: bool = False
    ragged: bool = False
    deterministic: bool = False


def fp8_reasons(spec: Fp8Spec, backward: bool, sm: int, version: int) -> list[str]:
    """Why cuDNN ``version`` (e.g. 92800) on ``sm`` (e.g. 90) cannot run ``spec``; ``[]`` if it
    can. Derived from ``FP8_LIMITS`` alone."""
    lim, major, reasons = FP8_LIMITS, sm // 10, []
    what = "sdpa fp8 backward" if backward else "sdpa fp8"
    if version < lim.min_version or version in lim.broken_versions:
        reasons.append(f"{what} needs cuDNN >= 9.1.0 and not 9.10.0, have {version}")
    if major < lim.min_sm_major:
        reasons.append(f"{what} is only supported on Hopper (sm_90) and newer, not sm_{sm}")
        return reasons
    dims = (spec.dim_qk, spec.dim_v)
    if any(d % lim.head_dim_multiple for d in dims):
        reasons.append(f"FP8 head dims must be multiples of {lim.head_dim_multiple}, got "
                       f"D_qk={dims[0]}, D_v={dims[1]}")
    if spec.heads_q % spec.heads_k or spec.heads_q % spec.heads_v:
        reasons.append(f"H_k={spec.heads_k} and H_v={spec.heads_v} must divide H_q={spec.heads_q}")
    if not backward and major == 9 and max(dims) > lim.forward_max_head_dim:
        reasons.append(f"the Hopper FP8 forward takes head dims <= {lim.forward_max_head_dim}, "
                       f"got {max(dims)}")
    if backward and major == 9 and dims not in lim.hopper_backward_dims:
        reasons.append(f"the Hopper FP8 backward needs D_qk = D_v = 128, got D_qk={dims[0]}, "
                       f"D_v={dims[1]}")
    if backward and major >= 10 and max(dims) > lim.blackwell_backward_max_dim \
            and dims not in lim.blackwell_backward_extra:
        reasons.append(f"the Blackwell FP8 backward takes head dims <= "
                       f"{lim.blackwell_backward_max_dim} (or 192/128), got {dims}")
    if spec.alignment == "bottom_right" and spec.right_bound is not None:
        if major < lim.bottom_right_min_major:
            reasons.append(f"FP8 bottom-right causal masks need Blackwell (sm_100+), not sm_{sm}")
        if version < lim.bottom_right_min_version:
            reasons.append("FP8 bottom-right causal masks need cuDNN >= 9.7.0")
        if spec.seq_q > spec.seq_kv:
            reasons.append("Bottom right causal mask does not support max_s_q > max_s_kv.")
        if backward and (spec.seq_q % lim.bottom_right_seq_multiple
                         or spec.seq_kv % lim.bottom_right_seq_multiple):
            reasons.append("the FP8 backward's bottom-right causal mask needs S_q and S_kv "
                           "multiples of 64")
    if not backward and spec.sink and major == 9 and not lim.hopper_forward_sink:
        reasons.append("the Hopper FP8 forward with sink tokens does not build (cuDNN 9.28: "
                       "its runtime-compiled kernel fails NVRTC)")
    if backward and spec.ragged and major in lim.ragged_backward_excluded_majors:
        reasons.append("sdpa fp8 backward with THD (ragged) is not supported on Hopper")
    halves = [t for t in ((spec.grad,) if backward else (spec.out,)) if t in ("BFLOAT16", "HALF")]
    if halves and (major < lim.half_output_min_major or version < lim.half_output_min_version):
        reasons.append(f"BF16/FP16 {'gradients' if backward else 'O'} from FP8 attention need "
                       f"Blackwell and cuDNN >= 9.13")
    return reasons


# ---------------------------------------------------------------------------------------------
# emission
# ---------------------------------------------------------------------------------------------

class _Emitter:
    def __init__(self, g, spec: Fp8Spec):
        self.g, self.spec, self.dt = g, spec, cudnn_module().data_type
        self.uids: list[int] = []

    def tensor(self, uid: int, dim, dtype: str):
        t = self.g.tensor(name=f"t{uid}", dim=list(dim), stride=list(contiguous_strides(dim)),
                          data_type=getattr(self.dt, dtype))
        t.set_uid(int(uid))
        self.uids.append(int(uid))
        return t

    def output(self, t, uid: int, dim, dtype: str):
        t.set_output(True).set_dim(list(dim)).set_stride(list(contiguous_strides(dim))).set_uid(int(uid))
        t.set_data_type(getattr(self.dt, dtype))
        self.uids.append(int(uid))

    def masks(self) -> dict:
        s, kw = self.spec, {}
        b = s.batch
        if s.padding:
            kw["use_padding_mask"] = True
            kw["seq_len_q"] = self.tensor(UID.SEQ_LEN_Q, (b, 1, 1, 1), "INT32")
            kw["seq_len_kv"] = self.tensor(UID.SEQ_LEN_KV, (b, 1, 1, 1), "INT32")
        if s.left_bound is not None or s.right_bound is not None:
            cd = cudnn_module()
            kw["diagonal_alignment"] = (cd.diagonal_alignment.BOTTOM_RIGHT
                                        if s.alignment == "bottom_right"
                                        else cd.diagonal_alignment.TOP_LEFT)
            if s.left_bound is not None:
                kw["left_bound"] = s.left_bound
            if s.right_bound is not None:
                kw["right_bound"] = s.right_bound
        if s.sink:
            kw["sink_token"] = self.tensor(UID.SINK, (1, s.heads_q, 1, 1), "FLOAT")
        return kw

    def qkv(self):
        s = self.spec
        return (self.tensor(UID.Q, (s.batch, s.heads_q, s.seq_q, s.dim_qk), s.io),
                self.tensor(UID.K, (s.batch, s.heads_k, s.seq_kv, s.dim_qk), s.io),
                self.tensor(UID.V, (s.batch, s.heads_v, s.seq_kv, s.dim_v), s.io))

    def attn_scale(self):
        """The softmax scale: a runtime value, passed by value (a host float32 scalar)."""
        t = self.g.tensor(name="attn_scale", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1],
                          data_type=self.dt.FLOAT, is_pass_by_value=True)
        t.set_uid(int(UID.SCALE))
        self.uids.append(int(UID.SCALE))
        return t

    def scales(self, names) -> list:
        return [self.tensor(UID.FP8_SCALES + i, (1, 1, 1, 1), "FLOAT") for i in range(len(names))]

    def forward(self):
        s = self.spec
        q, k, v = self.qkv()
        o, stats, amax_s, amax_o = self.g.sdpa_fp8(
            q, k, v, *self.scales(FORWARD_SCALES), attn_scale=self.attn_scale(),
            generate_stats=s.stats, name="sdpa_fp8", **self.masks())
        self.output(o, UID.O, (s.batch, s.heads_q, s.seq_q, s.dim_v), s.out)
        if s.stats:
            self.output(stats, UID.STATS, (s.batch, s.heads_q, s.seq_q, 1), "FLOAT")
        self.output(amax_s, UID.AMAX_S, (1, 1, 1, 1), "FLOAT")
        self.output(amax_o, UID.AMAX_O, (1, 1, 1, 1), "FLOAT")

    def backward(self):
        s = self.spec
        q, k, v = self.qkv()
        o_dim = (s.batch, s.heads_q, s.seq_q, s.dim_v)
        o = self.tensor(UID.O, o_dim, s.o_type or s.io)
        d_o = self.tensor(UID.DO, o_dim, s.out)
        stats = self.tensor(UID.STATS, (s.batch, s.heads_q, s.seq_q, 1), "FLOAT")
        kw = self.masks()
        if s.dsink:
            kw["dSink_token"] = self.tensor(UID.DSINK, (1, s.heads_q, 1, 1), "FLOAT")
            kw["dSink_token"].set_output(True)
        if s.deterministic:
            kw["use_deterministic_algorithm"] = True
        outs = self.g.sdpa_fp8_backward(q, k, v, o, d_o, stats, *self.scales(BACKWARD_SCALES),
                                        attn_scale=self.attn_scale(), name="sdpa_fp8_backward", **kw)
        for t, uid, heads, seq, dim in ((outs[0], UID.DQ, s.heads_q, s.seq_q, s.dim_qk),
                                        (outs[1], UID.DK, s.heads_k, s.seq_kv, s.dim_qk),
                                        (outs[2], UID.DV, s.heads_v, s.seq_kv, s.dim_v)):
            self.output(t, uid, (s.batch, heads, seq, dim), s.grad)
        for t, uid in zip(outs[3:7], (UID.AMAX_DQ, UID.AMAX_DK, UID.AMAX_DV, UID.AMAX_DP)):
            self.output(t, uid, (1, 1, 1, 1), "FLOAT")


def emit_fp8(g, spec: Fp8Spec, backward: bool) -> tuple[int, ...]:
    """Write ``spec``'s FP8 node onto ``g``; returns the uids it binds."""
    e = _Emitter(g, spec)
    e.backward() if backward else e.forward()
    return tuple(e.uids)


def _new_graph(spec: Fp8Spec, *, handle=None, sm: Optional[int] = None):
    cd = cudnn_module()
    kwargs = dict(io_data_type=getattr(cd.data_type, spec.io),
                  intermediate_data_type=cd.data_type.FLOAT, compute_data_type=cd.data_type.FLOAT)
    if sm is not None:  # the C++ graph against a described device: no GPU needed
        return cd._pybind_module.backend_graph(name="cudnn_attn_sdpa_fp8", sm_version=sm,
                                               sm_count=132, **kwargs)
    if handle is not None:
        kwargs["handle"] = handle
    return cd.pygraph(name="cudnn_attn_sdpa_fp8", **kwargs)


def validate_fp8(spec: Fp8Spec, backward: bool, sm: int):
    """The frontend's C++ validator for ``sm`` (90, 100, ...) on ``spec``'s graph, without a GPU:
    the validated graph, or ``cudnn.cudnnGraphNotSupportedError`` with cuDNN's reason."""
    g = _new_graph(spec, sm=sm)
    emit_fp8(g, spec, backward)
    g.validate()
    return g


_GRAPHS = LRU("cudnn.fp8_graphs", 64)


class Fp8Graph:
    """A built FP8 graph on a CUDA device: ``run(buffers)`` binds uid -> tensor."""

    def __init__(self, spec: Fp8Spec, backward: bool, device: torch.device):
        from ._runtime import handle_for

        self.device = device
        g = _new_graph(spec, handle=handle_for(device))
        self.uids = emit_fp8(g, spec, backward)
        try:
            run_build_stages(g)
        except GraphRefused as refused:  # callers expect cuDNN's own exception
            raise refused.error from None
        self.graph, self.workspace_size = g, int(g.get_workspace_size())

    def run(self, buffers: dict) -> None:
        from ._runtime import handle_for, workspace

        order = tuple(u for u in self.uids if u in buffers)
        self.graph.execute([buffers[u] for u in order],
                           workspace(self.workspace_size, self.device),
                           handle=handle_for(self.device), tensor_uids=order)


def fp8_graph(spec: Fp8Spec, backward: bool, device: torch.device) -> Fp8Graph:
    """The cached built graph (``cudnnGraphNotSupportedError`` when cuDNN declines it)."""
    return _GRAPHS.get_or_create((spec, backward, str(device)),
                                 lambda: Fp8Graph(spec, backward, device))
