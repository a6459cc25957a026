"""Problem specs shared by ``explain`` and ``cache warm``: masks, shapes, dtypes -> inputs."""

from __future__ import annotations

from typing import Any

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "half": "float16", "fp32": "float32", "float32": "float32", "fp64": "float64",
          "float64": "float64"}
SPEC_KEYS = {"name", "shape", "heads_kv", "seq_kv", "dim_v", "dtype", "mask", "layout", "alibi",
             "softcap", "dropout_p", "backward"}


def parse_mask(text: str | None) -> Any:
    """``none``, ``causal[:bottom_right]``, ``window:L,R[,bottom_right]`` -> a mask object."""
    import cudnn_attn as ca

    text = (text or "none").strip().lower()
    kind, _, rest = text.partition(":")
    try:
        if kind == "none" and not rest:
            return None
        if kind == "causal":
            return ca.Causal(rest or "top_left")
        if kind == "window":
            left, right, *align = rest.split(",")
            return ca.SlidingWindow(int(left), int(right), *align)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"mask {text!r}: {exc}") from None
    raise ValueError(f"mask must be none, causal[:bottom_right] or window:L,R[,bottom_right], "
                     f"got {text!r}")


def parse_shape(value: Any) -> tuple[int, int, int, int]:
    parts = value.split(",") if isinstance(value, str) else value
    try:
        dims = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise ValueError(f"shape must be four positive ints B,H,S,D, got {value!r}")
    return dims  # type: ignore[return-value]


def build_inputs(spec: dict, device: str) -> tuple[Any, Any, Any, dict]:
    """Uninitialized q, k, v and the attention kwargs a problem spec describes.

    ``spec``: ``shape`` [B, H, S, D] (of q, whatever the layout), optional ``heads_kv``,
    ``seq_kv``, ``dim_v``, ``dtype`` (bf16/fp16/fp32/fp64), ``mask`` (see ``parse_mask``),
    ``layout``, ``alibi`` (bool), ``softcap``, ``dropout_p``, ``backward`` (bool: inputs
    require grad), ``name``.
    """
    import torch

    import cudnn_attn as ca

    if not isinstance(spec, dict):
        raise ValueError(f"a problem must be a JSON object, got {spec!r}")
    unknown = sorted(set(spec) - SPEC_KEYS)
    if unknown:
        raise ValueError(f"unknown problem keys {unknown} (known: {sorted(SPEC_KEYS)})")
    if "shape" not in spec:
        raise ValueError("a problem needs a 'shape' [B, H, S, D]")
    B, H, S, D = parse_shape(spec["shape"])
    h_kv, s_kv, d_v = (int(spec.get(key) or dflt) for key, dflt in
                       (("heads_kv", H), ("seq_kv", S), ("dim_v", D)))
    dtype_name = DTYPES.get(str(spec.get("dtype", "bf16")).lower())
    if dtype_name is None:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.get('dtype')!r}")
    layout = spec.get("layout", "bhsd")
    grad = bool(spec.get("backward", False))

    def make(h: int, s: int, d: int) -> Any:
        shape = (B, h, s, d) if layout == "bhsd" else (B, s, h, d)
        return torch.empty(shape, dtype=getattr(torch, dtype_name), device=device,
                           requires_grad=grad)

    kwargs = {"mask": parse_mask(spec.get("mask")), "layout": layout,
              "bias": ca.Alibi() if spec.get("alibi") else None,
              "softcap": spec.get("softcap"), "dropout_p": float(spec.get("dropout_p", 0.0))}
    return make(H, S, D), make(h_kv, s_kv, D), make(h_kv, s_kv, d_v), kwargs


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
