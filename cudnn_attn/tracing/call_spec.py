"""A call's constants as one string: what ``attention()`` hands its custom ops besides tensors.

Custom ops take tensors, scalars and strings only, and ``torch.compile`` / ``torch.export`` treat
a string argument as a constant baked into the graph. So masks, the bias kind, ALiBi slopes,
scale, dropout probability, softcap, layout and backend travel as one JSON text (a serialised
graph keeps it, no registry behind it); tensors (bias, RelPosBias table, padding lengths given as
tensors, the dropout seed) travel as op arguments.

``encode`` is plain string building on the masks' fields, so Dynamo folds it to a constant while it
traces; ``decode`` (cached) turns the text back into mask objects for the op's implementation.
"""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass
from typing import Optional

from ..core.caches import memoize
from ..model.masks import Alibi, Causal, Mask, MaskSet, Neighborhood, Padding, SlidingWindow, mask_parts

__all__ = ["BIAS_KINDS", "CallSpec", "decode", "encode", "forward_only"]

BIAS_KINDS = ("none", "tensor", "rpb")


def _ints(values) -> str:
    # operator.index, not int(): Dynamo specialises a symbolic size through it (a guard) where
    # int() of a SymInt breaks the graph.
    return "[" + ",".join(str(operator.index(x)) for x in values) + "]"


def _number(x) -> str:
    # Under torch.compile(dynamic=True) Dynamo may hand over a float default as a symbol, which
    # has no text; the usual values become constants through a comparison (a guard).
    if x == 0:
        return "0.0"
    if x == 1:
        return "1.0"
    # repr() of a float round-trips exactly through json.loads.
    return repr(x if type(x) is float else float(x))


def _mask_text(m: Mask) -> str:
    if isinstance(m, Causal):
        return f'["causal","{m.alignment}"]'
    if isinstance(m, SlidingWindow):
        return f'["window",{int(m.left)},{int(m.right)},"{m.alignment}"]'
    if isinstance(m, Neighborhood):
        fields = (m.spatial_shape, m.kernel_size, m.stride, m.dilation, m.is_causal)
        return '["neighborhood",' + ",".join(_ints(f) for f in fields) + "]"
    if isinstance(m, Padding):
        if m.runtime is not None:
            return '["padding"]'  # lengths are the op's lens_q / lens_kv tensors
        return f'["padding",{_ints(m.seq_lens_q)},{_ints(m.seq_lens_kv)}]'
    raise TypeError(f"mask must be a cudnn_attn mask (Causal, SlidingWindow, Neighborhood, "
                    f"Padding or their & combination), got {type(m).__name__}")


def _slopes_text(alibi: Optional[Alibi]) -> str:
    if alibi is None:
        return "null"
    if alibi.slopes is None:
        return '"default"'
    rows = alibi.slopes if isinstance(alibi.slopes[0], tuple) else (alibi.slopes,)
    text = ",".join("[" + ",".join(_number(s) for s in row) + "]" for row in rows)
    return f"[{text}]" if isinstance(alibi.slopes[0], tuple) else text


def encode(*, mask, bias_kind: str, alibi: Optional[Alibi], scale, dropout_p, softcap,
           layout: str, backend: str, return_lse: bool, requires_grad: bool,
           bias_requires_grad: bool, dropout_scale=1.0) -> str:
    """The constants of one call as JSON text (``scale=None``: the default ``D_qk ** -0.5``, resolved
    when the op runs, so a symbolic head dim never needs a value while tracing)."""
    masks = ",".join(_mask_text(m) for m in mask_parts(mask))
    cap = "null" if softcap is None else _number(softcap)
    scale_text = "null" if scale is None else _number(scale)
    return (f'{{"mask":[{masks}],"bias":"{bias_kind}","alibi":{_slopes_text(alibi)},'
            f'"scale":{scale_text},"dropout_p":{_number(dropout_p)},"softcap":{cap},'
            f'"dropout_scale":{_number(dropout_scale)},"layout":"{layout}",'
            f'"backend":"{backend}","return_lse":{int(bool(return_lse))},"grad":[{int(bool(requires_grad))},'
            f'{int(bool(bias_requires_grad))}]}}')


@dataclass(frozen=True)
class CallSpec:
    """``encode``'s text, decoded: everything of a call that is not a tensor."""

    masks: tuple                 # atomic masks; a runtime Padding is left out (see runtime_padding)
    runtime_padding: bool        # lengths come as tensors (the op's lens_q / lens_kv)
    bias_kind: str
    alibi: Optional[Alibi]
    scale: Optional[float]       # None: D_qk ** -0.5
    dropout_p: float
    softcap: Optional[float]
    dropout_scale: float
    layout: str
    backend: str
    return_lse: bool             # the caller sees the lse (so it may carry a gradient)
    requires_grad: bool          # the call runs backward: engines plan for it
    bias_requires_grad: bool

    def mask(self, padding: Optional[Padding] = None):
        """The call's mask, with ``padding`` (built from the runtime lengths) if given."""
        parts = self.masks + ((padding,) if padding is not None else ())
        return MaskSet.of(*parts) if parts else None


def _mask_of(item):
    kind, *args = item
    if kind == "causal":
        return Causal(*args)
    if kind == "window":
        return SlidingWindow(*args)
    if kind == "neighborhood":
        shape, kernel, stride, dilation, causal = args
        return Neighborhood(tuple(shape), tuple(kernel), tuple(stride), tuple(dilation),
                            tuple(bool(c) for c in causal))
    if kind == "padding" and args:
        return Padding(args[0], args[1])
    raise ValueError(f"unknown mask {item!r} in a cudnn_attn call spec")


@memoize("call_spec.decode", maxsize=512)
def decode(text: str) -> CallSpec:
    """Parse ``encode``'s text (cached: compiled graphs call with the same text every time)."""
    raw = json.loads(text)
    items = raw["mask"]
    runtime = any(item == ["padding"] for item in items)
    masks = tuple(_mask_of(item) for item in items if item != ["padding"])
    alibi = raw["alibi"]
    if alibi is not None:
        alibi = Alibi() if alibi == "default" else Alibi(alibi)
    softcap = raw["softcap"] or None  # 0 means off, as in attention()
    if raw["bias"] not in BIAS_KINDS:
        raise ValueError(f"unknown bias kind {raw['bias']!r} in a cudnn_attn call spec")
    for name in ("scale", "dropout_p", "dropout_scale"):
        if raw[name] is not None and not math.isfinite(raw[name]):
            raise ValueError(f"{name} must be finite in a cudnn_attn call spec, got {raw[name]}")
    return CallSpec(masks=masks, runtime_padding=runtime, bias_kind=raw["bias"], alibi=alibi,
                    scale=raw["scale"], dropout_p=raw["dropout_p"], softcap=softcap,
                    dropout_scale=raw["dropout_scale"], layout=raw["layout"],
                    backend=raw["backend"], return_lse=bool(raw["return_lse"]),
                    requires_grad=bool(raw["grad"][0]),
                    bias_requires_grad=bool(raw["grad"][1]))


def forward_only(text: str) -> str:
    """``text`` for a call that runs no backward (an inner call, e.g. a forward-mode tangent)."""
    raw = json.loads(text)
    raw["grad"], raw["return_lse"] = [0, 0], 1
    return json.dumps(raw, separators=(",", ":"))
