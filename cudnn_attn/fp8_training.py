"""Training with FP8 attention: ``attention_fp8``, the ``FP8Attention`` module and the
delayed-scaling recipe (``DelayedScaling``) that feeds them, the way Transformer Engine feeds
cuDNN: the descales are the inputs' ``scale_inv``, the amaxes every call reports go into a
history, and the next step's scales come from that history.

``attention_fp8(q, k, v, recipe)`` takes high-precision ``q``, ``k``, ``v`` (float32 / bf16 / fp16;
they are cast to FP8 with the recipe's current scales) **or** FP8 tensors with their descales
(``descale_q=``, ...; FP8 inputs are forward-only: no gradient reaches an FP8 tensor). It runs
``sdpa_fp8`` and returns ``(out, amaxes)``: ``out`` dequantized in q's dtype (bf16 for FP8 inputs),
``amaxes`` a dict with the forward's ``q, k, v, s, o`` amaxes, to which the backward
(``sdpa_fp8_backward``, through autograd) adds ``dO, dP, dq, dk, dv``. Every amax is also recorded
into ``recipe``; ``recipe.update()`` turns the history into the next scales.

Equivalent PyTorch (up to the FP8 rounding at cuDNN's quantization points)::

    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=..., scale=...)
"""

from __future__ import annotations

import torch

from .model import checks
from .model.masks import Mask
from .core.fp8 import (BACKENDS, Fp8Tensors, Scale, as_scale, fp8_problem, run_backward,
                       run_forward)
from .torch_engine.fp8 import FP8_DTYPES, fp8_max, saturating_cast

__all__ = ["DelayedScaling", "attention_fp8", "FP8Attention"]

_FORMATS = {"hybrid": (torch.float8_e4m3fn, torch.float8_e5m2),
            "e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fn)}


class DelayedScaling:
    """Transformer Engine's delayed scaling for one attention's FP8 tensors.

    ``fp8_format`` ``"hybrid"`` (E4M3 forward, E5M2 backward: TE's default) or ``"e4m3"``;
    ``amax_history_len`` steps of amax per tensor; ``scale = fp8_max / max(history) / 2**margin``
    (a tensor whose history is all zero, or not finite, keeps its scale). Tensors: ``q, k, v, s``
    (softmax probabilities), ``o``, ``dO``, ``dP`` (dS, the softmax gradient), ``dq, dk, dv``.
    """

    TENSORS = ("q", "k", "v", "s", "o", "dO", "dP", "dq", "dk", "dv")
    BACKWARD = ("dO", "dP", "dq", "dk", "dv")

    def __init__(self, fp8_format: str = "hybrid", amax_history_len: int = 16, margin: int = 0):
        if fp8_format not in _FORMATS:
            raise ValueError(f"fp8_format must be one of {tuple(_FORMATS)}, got {fp8_format!r}")
        checks.integer("amax_history_len", amax_history_len, 1)
        checks.integer("margin", margin, 0)
        self.fp8_format, self.margin = fp8_format, margin
        self.forward_dtype, self.backward_dtype = _FORMATS[fp8_format]
        self.amax_history = torch.zeros(amax_history_len, len(self.TENSORS))
        self.scale = torch.ones(len(self.TENSORS))
        self.scale[self.TENSORS.index("s")] = fp8_max(self.forward_dtype)  # P <= 1

    def dtype(self, name: str) -> torch.dtype:
        return self.backward_dtype if name in self.BACKWARD else self.forward_dtype

    def _to(self, device) -> None:
        if self.scale.device != torch.device(device):
            self.amax_history = self.amax_history.to(device)
            self.scale = self.scale.to(device)

    def scale_of(self, name: str, device: torch.device | str | int) -> torch.Tensor:
        """The current scale of ``name``, float32 ``[1, 1, 1, 1]`` on ``device`` (a copy)."""
        self._to(device)
        return self.scale[self.TENSORS.index(name)].reshape(1, 1, 1, 1).clone()

    def record(self, name: str, amax: torch.Tensor) -> None:
        """This step's amax of ``name`` (the history's newest row keeps the largest seen)."""
        self._to(amax.device)
        i = self.TENSORS.index(name)
        self.amax_history[0, i] = torch.maximum(self.amax_history[0, i],
                                                amax.detach().float().reshape(()))

    def update(self) -> None:
        """Next scales from the history, then a fresh newest row (TE's update after a step)."""
        amax = self.amax_history.amax(0)
        top = torch.tensor([fp8_max(self.dtype(n)) for n in self.TENSORS],
                           device=self.scale.device)
        new = top / amax / (2.0 ** self.margin)
        ok = torch.isfinite(amax) & (amax > 0)
        self.scale = torch.where(ok, new, self.scale)
        self.amax_history = torch.roll(self.amax_history, 1, 0)
        self.amax_history[0].zero_()


def _quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return saturating_cast(x.float() * scale, dtype)


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float().reshape(1, 1, 1, 1)


class _Fp8Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, call):
        recipe, problem, backend, amaxes = call["recipe"], call["problem"], call["backend"], \
            call["amaxes"]
        device, scales, fp8 = q.device, {}, q.dtype in FP8_DTYPES
        tensors = []
        for name, x in (("q", q), ("k", k), ("v", v)):
            if fp8:
                tensors.append(x)
                scales["descale_" + name] = call["descales"][name]
            else:
                scale = recipe.scale_of(name, device)
                amaxes[name] = _amax(x)
                tensors.append(_quantize(x, scale, recipe.forward_dtype))
                scales["descale_" + name] = 1.0 / scale
        scale_s, scale_o = recipe.scale_of("s", device), recipe.scale_of("o", device)
        scales.update(descale_s=1.0 / scale_s, scale_s=scale_s, scale_o=scale_o)
        o8, stats, amax_s, amax_o = run_forward(problem, Fp8Tensors(*tensors, scales, sinks),
                                                backend)
        amaxes.update(s=amax_s, o=amax_o)
        for name in ("q", "k", "v", "s", "o"):
            if name in amaxes:
                recipe.record(name, amaxes[name])
        ctx.save_for_backward(*tensors, o8, stats)
        ctx.call, ctx.scales, ctx.sinks = call, scales, sinks
        out_dtype = torch.bfloat16 if fp8 else q.dtype
        return (o8.float() / scale_o).to(out_dtype)

    @staticmethod
    def backward(ctx, dout):
        q8, k8, v8, o8, stats = ctx.saved_tensors
        call, fwd = ctx.call, ctx.scales
        recipe, amaxes, device = call["recipe"], call["amaxes"], dout.device
        s = {n: recipe.scale_of(n, device) for n in ("dO", "dP", "dq", "dk", "dv")}
        amaxes["dO"] = _amax(dout)
        dO8 = _quantize(dout, s["dO"], recipe.backward_dtype)
        scales = {k: fwd[k] for k in ("descale_q", "descale_k", "descale_v", "descale_s",
                                      "scale_s")}
        scales.update(descale_o=1.0 / fwd["scale_o"], descale_dO=1.0 / s["dO"],
                      descale_dP=1.0 / s["dP"], scale_dQ=s["dq"], scale_dK=s["dk"],
                      scale_dV=s["dv"], scale_dP=s["dP"])
        grad_problem = call["grad_problem"]
        tensors = Fp8Tensors(q8, k8, v8, scales, ctx.sinks, o=o8, dO=dO8, stats=stats)
        dq, dk, dv, a_dq, a_dk, a_dv, a_dp, dsink = run_backward(grad_problem, tensors,
                                                                 call["backend"])
        amaxes.update(dq=a_dq, dk=a_dk, dv=a_dv, dP=a_dp)
        for name in ("dO", "dP", "dq", "dk", "dv"):
            recipe.record(name, amaxes[name])
        grads = [(g.float() / s[n]).to(dout.dtype) for g, n in ((dq, "dq"), (dk, "dk"),
                                                               (dv, "dv"))]
        if call["fp8"]:
            grads = [None, None, None]
        if dsink is not None and ctx.sinks is not None and ctx.needs_input_grad[3]:
            dsink = dsink.reshape(ctx.sinks.shape).to(ctx.sinks.dtype)
        else:
            dsink = None
        return (*grads, dsink, None)


def attention_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recipe: DelayedScaling, *,
                  mask: Mask | None = None, scale: float | None = None,
                  sinks: torch.Tensor | None = None, layout: str = "bhsd", backend: str = "auto",
                  descale_q: Scale | None = None, descale_k: Scale | None = None,
                  descale_v: Scale | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(out, amaxes)`` of FP8 attention (module doc): cuDNN's ``sdpa_fp8`` forward and, through
    autograd, its ``sdpa_fp8_backward``, with the scales of ``recipe``.

    ``q`` ``[B, H_q, S_q, D]`` (``layout="bshd"``: ``[B, S, H, D]``), ``k``/``v`` with ``H_kv``
    dividing ``H_q``; ``mask`` a ``Causal``, ``SlidingWindow`` and/or ``Padding``; ``scale``
    defaults to ``D ** -0.5``; ``sinks`` ``[H_q]`` float logits (differentiable).
    ``backend``: ``"auto"``, ``"cudnn"`` or ``"torch"`` (``cudnn_attn.core.fp8``).
    """
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(f"recipe must be a DelayedScaling, got {type(recipe).__name__}")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.tensor(name, t, dtypes=FP8_DTYPES + (torch.float32, torch.bfloat16,
                                                     torch.float16), ndim=4)
    fp8 = q.dtype in FP8_DTYPES
    if fp8 != (k.dtype in FP8_DTYPES) or fp8 != (v.dtype in FP8_DTYPES):
        raise TypeError(f"q, k and v must all be FP8 or all high precision, got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}")
    descales = {}
    if fp8:
        for name, d in (("q", descale_q), ("k", descale_k), ("v", descale_v)):
            if d is None:
                raise ValueError(f"FP8 {name} needs descale_{name} (its scale_inv)")
            descales[name] = as_scale(f"descale_{name}", d, q.device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    dtype = q.dtype if fp8 else recipe.forward_dtype
    metas = [torch.empty(t.shape, dtype=dtype, device="meta") for t in (q, k, v)]
    problem = fp8_problem(*metas, mask=mask, scale=scale, sink=sinks is not None)
    problem = _on(problem, q.device)
    dsink = sinks is not None and sinks.requires_grad
    grad_problem = _on(fp8_problem(*metas, mask=mask, scale=scale, out=recipe.backward_dtype,
                                   sink=sinks is not None, dsink=dsink), q.device)
    if sinks is not None:
        checks.tensor("sinks", sinks, floating=True)
        if sinks.numel() != q.shape[1]:
            raise ValueError(f"sinks must have H_q = {q.shape[1]} elements, got shape "
                             f"{tuple(sinks.shape)}")
    amaxes: dict[str, torch.Tensor] = {}
    call = dict(recipe=recipe, problem=problem, grad_problem=grad_problem, backend=backend,
                amaxes=amaxes, descales=descales, fp8=fp8)
    out = _Fp8Attention.apply(q, k, v, sinks, call)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return out, amaxes


def _on(problem, device):
    """A problem described on meta stand-ins, moved to the call's device."""
    import dataclasses

    return dataclasses.replace(problem, logical=dataclasses.replace(problem.logical,
                                                                    device=device))


class FP8Attention(torch.nn.Module):
    """Attention in FP8 with delayed scaling (``attention_fp8``) as a module.

    ``forward(q, k, v, descale_q=None, descale_k=None, descale_v=None)`` -> ``out``; the call's
    amaxes are in ``self.amaxes`` (the backward adds its own). In training mode each forward
    first updates the recipe's scales from the amax history (Transformer Engine's delayed
    scaling). ``mask``, ``scale``, ``layout``, ``backend`` as ``attention_fp8``; ``sinks``:
    ``num_sinks`` learnable per-head logits when ``num_sinks`` (= H_q) is given.
    """

    def __init__(self, *, mask: Mask | None = None, scale: float | None = None,
                 layout: str = "bhsd", backend: str = "auto",
                 recipe: DelayedScaling | None = None, num_sinks: int | None = None) -> None:
        super().__init__()
        self.mask, self.scale, self.layout, self.backend = mask, scale, layout, backend
        self.recipe = recipe if recipe is not None else DelayedScaling()
        self.sinks = None if num_sinks is None else torch.nn.Parameter(torch.zeros(num_sinks))
        self.amaxes: dict = {}
        self._calls = 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                descale_q: Scale | None = None, descale_k: Scale | None = None,
                descale_v: Scale | None = None) -> torch.Tensor:
        if self.training and self._calls:
            self.recipe.update()
        self._calls += 1
        out, self.amaxes = attention_fp8(q, k, v, self.recipe, mask=self.mask, scale=self.scale,
                                         sinks=self.sinks, layout=self.layout,
                                         backend=self.backend, descale_q=descale_q,
                                         descale_k=descale_k, descale_v=descale_v)
        return out
