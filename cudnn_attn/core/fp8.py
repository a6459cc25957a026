"""FP8 attention in the problem model: one ``Fp8Problem`` per call, the engines that run it
(cuDNN's ``sdpa_fp8`` graphs, ``graphs/fp8.py``; the torch engine's exact semantics,
``torch_engine/fp8.py``) and the choice between them.

Every FP8 surface (the cuDNN builder's ``sdpa_fp8`` / ``sdpa_fp8_backward``, ``attention_fp8``
and ``FP8Attention``) translates its arguments into an ``Fp8Problem`` plus ``Fp8Tensors`` and calls
``run_forward`` / ``run_backward``. ``backend="auto"`` runs cuDNN where it can (a CUDA device,
cuDNN's limits, the graph builds) and the torch engine elsewhere; ``"cudnn"`` / ``"torch"`` force
one and raise ``NotSupportedError`` with its reasons when it cannot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch

from . import dispatch
from ..errors import NotSupportedError
from ..graphs._spec import cudnn_band
from ..graphs.fp8 import BACKWARD_SCALES, FORWARD_SCALES, FP8_TYPE_NAMES, UID, Fp8Spec, fp8_graph, fp8_reasons
from ..model.masks import Causal, Padding, SlidingWindow, mask_parts
from ..model.problem import AttnProblem
from ..torch_engine.fp8 import FP8_DTYPES, fp8_backward, fp8_forward, visibility

# BACKWARD_SCALES, FORWARD_SCALES and FP8_DTYPES are re-exported for the surfaces (compat imports
# no engine module).
__all__ = ["BACKWARD_SCALES", "FORWARD_SCALES", "FP8_DTYPES", "Fp8Problem", "Fp8Tensors", "fp8_problem", "as_scale", "cudnn_fp8_reasons",
           "run_forward", "run_backward", "BACKENDS", "Scale"]

BACKENDS = ("auto", "cudnn", "torch")
# A scale or descale as the FP8 entry points take it (``as_scale``): a Python number or a
# one-element float tensor (float32 ``[1, 1, 1, 1]`` as cuDNN binds it).
Scale = Union[float, torch.Tensor]
_OUT_DTYPES = FP8_DTYPES + (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp8Problem:
    """An FP8 call: the logical attention (``AttnProblem`` of the same shapes, mask and scale;
    its dtype stands in for the FP8 ones) and what FP8 adds."""

    logical: AttnProblem
    io: torch.dtype          # Q, K, V (and the forward's O) FP8 type
    out: torch.dtype         # forward: O's type; backward: dO's type
    grad: Optional[torch.dtype] = None   # backward: dQ/dK/dV type
    o_type: Optional[torch.dtype] = None  # backward: the forward's O type
    sink: bool = False
    dsink: bool = False
    heads_k: int = 0          # K's and V's head counts (both divide H_q; may differ)
    heads_v: int = 0

    def describe(self) -> str:  # the logical problem's dtype is a stand-in: name the FP8 one
        return "FP8 " + self.logical.describe().replace(str(self.logical.dtype), str(self.io))


@dataclass
class Fp8Tensors:
    """The runtime tensors of one call (dense ``[B, H, S, D]``; scales float32 ``[1,1,1,1]``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scales: dict
    sinks: Optional[torch.Tensor] = None
    o: Optional[torch.Tensor] = None
    dO: Optional[torch.Tensor] = None
    stats: Optional[torch.Tensor] = None


def as_scale(name: str, value, device) -> torch.Tensor:
    """A Python number or a 1-element float tensor -> float32 ``[1, 1, 1, 1]`` on ``device``
    (a device tensor is never read on the host)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(f"{name} must be a float32 [1, 1, 1, 1] tensor or a number, got "
                             f"{value.dtype} of shape {tuple(value.shape)}")
        return value.detach().to(device=device, dtype=torch.float32).reshape(1, 1, 1, 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float32 [1, 1, 1, 1] tensor or a number, got "
                        f"{type(value).__name__}")
    return torch.full((1, 1, 1, 1), float(value), dtype=torch.float32, device=device)


def _check_fp8(name: str, t, dtypes=FP8_DTYPES) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; FP8 attention takes {names}")
    return t


def fp8_problem(q, k, v, *, mask=None, scale: float = 1.0, out: torch.dtype | None = None,
                grad: torch.dtype | None = None, o_type: torch.dtype | None = None,
                sink: bool = False, dsink: bool = False) -> Fp8Problem:
    """Check ``[B, H, S, D]`` FP8 ``q``, ``k``, ``v`` (one FP8 type) and describe the call."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_fp8(name, t)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one FP8 type, got q={q.dtype}, k={k.dtype}, "
                        f"v={v.dtype}")
    if out is not None and out not in _OUT_DTYPES:
        raise TypeError(f"the output type must be an FP8 type, bfloat16 or float16, got {out}")
    if q.dim() == k.dim() == v.dim() == 4 and q.shape[1] % v.shape[1]:
        raise ValueError(f"H_q={q.shape[1]} must be a multiple of H_v={v.shape[1]}")
    # The logical call: V's heads as K's (H_k != H_v is GQA over each separately).
    v_shape = (v.shape[0], k.shape[1], *v.shape[2:]) if v.dim() == 4 == k.dim() else v.shape
    stand_ins = [torch.empty(shape, dtype=torch.bfloat16, device="meta")
                 for shape in (q.shape, k.shape, v_shape)]
    logical = AttnProblem.from_tensors(*stand_ins, mask=mask, scale=scale, layout="bhsd",
                                       return_lse=True)
    logical = dataclasses.replace(logical, device=q.device)
    others = [m for m in mask_parts(mask) if not isinstance(m, (Causal, SlidingWindow, Padding))]
    if others:
        raise NotSupportedError(f"FP8 attention with {others[0]!r}", {
            "cudnn": ["cuDNN's FP8 graphs express causal, band and padding masks only"],
            "torch": ["FP8 attention takes causal, band and padding masks only"]})
    return Fp8Problem(logical, q.dtype, out or q.dtype, grad, o_type, sink, dsink,
                      k.shape[1], v.shape[1])


def _padding(problem: Fp8Problem) -> Optional[Padding]:
    return next((m for m in mask_parts(problem.logical.mask) if isinstance(m, Padding)), None)


def _spec_of(problem: Fp8Problem, backward: bool, reasons: list) -> Fp8Spec:
    p = problem.logical
    padded = _padding(problem) is not None
    band = cudnn_band(p, padded, False, reasons)
    return Fp8Spec(p.batch, p.heads_q, problem.heads_k, problem.heads_v, p.seq_q, p.seq_kv,
                   p.dim_qk, p.dim_v, FP8_TYPE_NAMES[problem.io], FP8_TYPE_NAMES[problem.out],
                   FP8_TYPE_NAMES[problem.grad or problem.out] if backward else "",
                   stats=True, padding=padded,
                   alignment=band.alignment if band else "top_left",
                   left_bound=band.left if band else None,
                   right_bound=band.right if band else None,
                   o_type=FP8_TYPE_NAMES[problem.o_type] if problem.o_type else "",
                   sink=problem.sink, dsink=problem.dsink)


def _device_facts(device) -> tuple[list[str], int, int]:
    """``(reasons, sm, cudnn version)`` of running cuDNN graphs on ``device``."""
    reasons = list(dispatch.get_backend("cudnn").availability())
    if torch.device(device).type != "cuda":
        reasons.append(f"cuDNN runs CUDA tensors; these are on {device}")
    if reasons:
        return reasons, 0, 0
    import cudnn

    major, minor = torch.cuda.get_device_capability(device)
    return [], major * 10 + minor, int(cudnn.backend_version())


def cudnn_fp8_reasons(problem: Fp8Problem, backward: bool, *, sm: int | None = None,
                      version: int | None = None) -> tuple[Optional[Fp8Spec], list[str]]:
    """``(spec, reasons)`` for the cuDNN engine; with ``sm`` and ``version`` for a described
    device (no GPU needed), else for the problem's device."""
    reasons: list[str] = []
    if sm is None or version is None:
        found, dev_sm, dev_version = _device_facts(problem.logical.device)
        reasons += found
        sm, version = sm or dev_sm, version or dev_version
    spec = _spec_of(problem, backward, reasons)
    if sm:
        reasons += fp8_reasons(spec, backward, sm, version)
    return spec, reasons


def _choose(problem: Fp8Problem, backward: bool, backend: str):
    """``(spec or None)``: the cuDNN spec to run, or ``None`` for the torch engine."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return None
    spec, reasons = cudnn_fp8_reasons(problem, backward)
    if reasons and backend == "cudnn":
        raise NotSupportedError(problem, {"cudnn": reasons}, forced="cudnn")
    return None if reasons else spec


def _graph_or_none(problem, spec, backward: bool, backend: str):
    import cudnn

    try:
        return fp8_graph(spec, backward, problem.logical.device)
    except cudnn.cudnnGraphNotSupportedError as exc:
        if backend == "cudnn":
            raise NotSupportedError(problem, {"cudnn": [f"cuDNN declined the FP8 graph: {exc}"]},
                                    forced="cudnn") from exc
        return None


def _torch_masks(problem: Fp8Problem):
    p = problem.logical
    return visibility(p.mask, p.batch, p.seq_q, p.seq_kv, p.device)


def _cudnn_buffers(problem: Fp8Problem, t: Fp8Tensors, names) -> dict:
    buffers = {UID.Q: t.q.contiguous(), UID.K: t.k.contiguous(), UID.V: t.v.contiguous(),
               UID.SCALE: torch.full((1, 1, 1, 1), problem.logical.scale,
                                          dtype=torch.float32)}
    for i, name in enumerate(names):
        buffers[UID.FP8_SCALES + i] = t.scales[name].contiguous()
    padding = _padding(problem)
    if padding is not None:
        lens = padding.tensors(t.q.device)
        buffers[UID.SEQ_LEN_Q], buffers[UID.SEQ_LEN_KV] = (
            x.to(torch.int32).reshape(-1, 1, 1, 1).contiguous() for x in lens)
    if t.sinks is not None:
        buffers[UID.SINK] = t.sinks.float().reshape(1, -1, 1, 1).contiguous()
    return buffers


def _amax_buffer(device) -> torch.Tensor:
    return torch.zeros(1, 1, 1, 1, dtype=torch.float32, device=device)


def _hide_padded_rows(problem, out, stats):
    """Padded query rows are not tokens: ``o = 0`` and ``stats = -inf`` there, as everywhere
    (``[B, 1, S_q, 1]`` from the lengths alone; never the ``S_q x S_kv`` visibility)."""
    padding = _padding(problem)
    if padding is None:
        return out, stats
    lens_q = padding.tensors(out.device)[0].view(-1, 1, 1, 1)
    live = torch.arange(out.shape[2], device=out.device).view(1, 1, -1, 1) < lens_q
    return out.masked_fill(~live, 0), stats.masked_fill(~live, float("-inf"))


def run_forward(problem: Fp8Problem, t: Fp8Tensors, backend: str = "auto"):
    """``(o, stats [B, H, S_q, 1], amax_s, amax_o)`` on the chosen engine."""
    spec = _choose(problem, False, backend)
    graph = None if spec is None else _graph_or_none(problem, spec, False, backend)
    if graph is None:
        visible, live = _torch_masks(problem)
        s = t.scales
        with torch.no_grad():
            return fp8_forward(t.q, t.k, t.v, *(s[n] for n in FORWARD_SCALES),
                               attn_scale=problem.logical.scale, visible=visible, live=live,
                               sinks=t.sinks, o_dtype=problem.out)
    p, dev = problem.logical, t.q.device
    buffers = _cudnn_buffers(problem, t, FORWARD_SCALES)
    o = torch.empty(p.batch, p.heads_q, p.seq_q, p.dim_v, dtype=problem.out, device=dev)
    stats = torch.empty(p.batch, p.heads_q, p.seq_q, 1, dtype=torch.float32, device=dev)
    amax_s, amax_o = _amax_buffer(dev), _amax_buffer(dev)
    buffers.update({UID.O: o, UID.STATS: stats, UID.AMAX_S: amax_s, UID.AMAX_O: amax_o})
    graph.run(buffers)
    o, stats = _hide_padded_rows(problem, o.view(torch.uint8), stats)
    return o.view(problem.out), stats, amax_s, amax_o


def run_backward(problem: Fp8Problem, t: Fp8Tensors, backend: str = "auto"):
    """``(dq, dk, dv, amax_dq, amax_dk, amax_dv, amax_dP, dsink or None)``."""
    spec = _choose(problem, True, backend)
    graph = None if spec is None else _graph_or_none(problem, spec, True, backend)
    if graph is None:
        visible, live = _torch_masks(problem)
        s = t.scales
        with torch.no_grad():
            return fp8_backward(t.q, t.k, t.v, t.o, t.dO, t.stats,
                                *(s[n] for n in BACKWARD_SCALES),
                                attn_scale=problem.logical.scale, visible=visible, live=live,
                                sinks=t.sinks, grad_dtype=problem.grad)
    p, dev = problem.logical, t.q.device
    grad = problem.grad or problem.out
    buffers = _cudnn_buffers(problem, t, BACKWARD_SCALES)
    stats = t.stats.float().reshape(p.batch, p.heads_q, p.seq_q, 1)
    buffers.update({UID.O: t.o.contiguous(), UID.DO: t.dO.contiguous(),
                    UID.STATS: stats.masked_fill(~torch.isfinite(stats), 0).contiguous()})
    dq = torch.empty(p.batch, p.heads_q, p.seq_q, p.dim_qk, dtype=grad, device=dev)
    dk = torch.empty(p.batch, problem.heads_k, p.seq_kv, p.dim_qk, dtype=grad, device=dev)
    dv = torch.empty(p.batch, problem.heads_v, p.seq_kv, p.dim_v, dtype=grad, device=dev)
    amaxes = [_amax_buffer(dev) for _ in range(4)]
    buffers.update({UID.DQ: dq, UID.DK: dk, UID.DV: dv, UID.AMAX_DQ: amaxes[0],
                    UID.AMAX_DK: amaxes[1], UID.AMAX_DV: amaxes[2], UID.AMAX_DP: amaxes[3]})
    dsink = None
    if problem.dsink:
        dsink = buffers[UID.DSINK] = torch.zeros(1, p.heads_q, 1, 1, dtype=torch.float32,
                                                 device=dev)
    graph.run(buffers)
    return dq, dk, dv, *amaxes, dsink
