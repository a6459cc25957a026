"""Problem specs shared by ``explain`` and ``cache warm``: masks, shapes, dtypes -> inputs; the
paged decode call ``cache warm --decode`` builds (``DecodeSpec``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "half": "float16", "fp32": "float32", "float32": "float32", "fp64": "float64",
          "float64": "float64"}
SPEC_KEYS = {"name", "shape", "heads_kv", "seq_kv", "dim_v", "dtype", "mask", "layout", "alibi",
             "softcap", "dropout_p", "backward"}


class UsageError(ValueError):
    """A command-line argument that cannot work; ``main`` prints it as one line (status 2)."""


MASK_SYNTAX = ("none | causal[:bottom_right] | window:L,R[,bottom_right] | "
               "neighborhood:32x32,7x7[,dilation=2x2][,stride=1x1][,causal] | "
               "padding:LENS[/KV_LENS] (comma-separated, one per batch); join with '+'")


def _ints(name: str, text: str, sep: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(sep))
    except ValueError:
        raise ValueError(f"{name} must be integers separated by {sep!r}, got {text!r}") from None


def _neighborhood(rest: str) -> Any:
    import cudnn_attn as ca

    shape, kernel, *options = rest.split(",")
    kwargs: dict = {}
    for option in options:
        name, _, value = option.partition("=")
        if name == "causal" and not value:
            kwargs["is_causal"] = True
        elif name in ("dilation", "stride") and value:
            kwargs[name] = _ints(name, value, "x")
        else:
            raise ValueError(f"unknown neighborhood option {option!r}")
    return ca.Neighborhood(_ints("spatial shape", shape, "x"), _ints("kernel", kernel, "x"),
                           **kwargs)


def _padding(rest: str) -> Any:
    import cudnn_attn as ca

    lens_q, _, lens_kv = rest.partition("/")
    return ca.Padding(_ints("lengths", lens_q, ","), _ints("kv lengths", lens_kv, ",")
                      if lens_kv else None)


def parse_mask(text: str | None) -> Any:
    """A mask object from its command-line spelling (``MASK_SYNTAX``); None for ``none``."""
    import cudnn_attn as ca

    text = (text or "none").strip().lower()
    if "+" in text:
        parts = [parse_mask(part) for part in text.split("+")]
        combined = None
        for part in parts:
            combined = part if combined is None else combined if part is None else combined & part
        return combined
    kind, _, rest = text.partition(":")
    try:
        if kind == "none" and not rest:
            return None
        if kind == "causal":
            return ca.Causal(rest or "top_left")
        if kind == "window":
            parts = rest.split(",")
            if not 2 <= len(parts) <= 3:
                raise ValueError("a window needs its left and right bounds: window:L,R or "
                                 "window:L,R,bottom_right (-1 leaves a side unbounded)")
            left, right = _ints("window bounds", ",".join(parts[:2]), ",")
            return ca.SlidingWindow(left, right, *parts[2:])
        if kind == "neighborhood":
            if rest.count(",") < 1:
                raise ValueError("a neighborhood needs its grid and kernel: "
                                 "neighborhood:32x32,7x7")
            return _neighborhood(rest)
        if kind == "padding":
            return _padding(rest)
    except (ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"mask {text!r}: {exc}") from None
    raise ValueError(f"mask must be {MASK_SYNTAX}; got {text!r}")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def device_arg(text: str) -> str:
    """argparse type: a torch device this machine has (``cpu``, ``cuda``, ``cuda:1``, ``meta``)."""
    import argparse

    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device is available to torch")
    if device.type not in ("cpu", "cuda", "meta"):
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu, cuda[:N] or meta")
    return text


def parse_shape(value: Any) -> tuple[int, int, int, int]:
    parts = value.split(",") if isinstance(value, str) else value
    try:
        dims = tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        dims = ()
    if len(dims) != 4 or min(dims) < 1 or max(dims) > 2**31 - 1:
        raise ValueError(f"shape must be four positive ints B,H,S,D (each < 2**31), got {value!r}")
    return dims  # type: ignore[return-value]


def build_inputs(spec: dict, device: str) -> tuple[Any, Any, Any, dict]:
    """Uninitialized q, k, v (on ``device``; ``"meta"`` allocates nothing) and the attention
    kwargs a problem spec describes.

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
    h_kv, s_kv, d_v = (_positive(key, spec.get(key), dflt) for key, dflt in
                       (("heads_kv", H), ("seq_kv", S), ("dim_v", D)))
    dtype_name = DTYPES.get(str(spec.get("dtype", "bf16")).lower())
    if dtype_name is None:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {spec.get('dtype')!r}")
    layout = spec.get("layout", "bhsd")
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout must be 'bhsd' or 'bshd', got {layout!r}")
    grad = bool(spec.get("backward", False))

    def make(h: int, s: int, d: int) -> Any:
        shape = (B, h, s, d) if layout == "bhsd" else (B, s, h, d)
        return torch.empty(shape, dtype=getattr(torch, dtype_name), device=device,
                           requires_grad=grad)

    kwargs = {"mask": parse_mask(spec.get("mask")), "layout": layout,
              "bias": ca.Alibi() if spec.get("alibi") else None,
              "softcap": spec.get("softcap"), "dropout_p": float(spec.get("dropout_p", 0.0))}
    return make(H, S, D), make(h_kv, s_kv, D), make(h_kv, s_kv, d_v), kwargs


def real_device_arg(text: str) -> str:
    """argparse type: ``device_arg`` without ``meta`` (for commands that compute)."""
    import argparse

    if device_arg(text).startswith("meta"):
        raise argparse.ArgumentTypeError("meta tensors hold no data; use cpu or cuda[:N]")
    return text


def _positive(name: str, value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class DecodeSpec:
    """A paged KV-cache decode call (``attention_with_kvcache`` with ``block_table``): what fixes
    its graph. ``q`` is ``[batch, seq_q, heads_q, head_dim]``; the K/V pools are
    ``[num_blocks, page_size, heads_kv, head_dim]``; the block table ``[batch, max_blocks]``."""

    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    page_size: int
    max_blocks: int
    num_blocks: int
    seq_q: int
    dtype: str
    mask: Any

    def describe(self) -> str:
        return (f"decode B={self.batch} H_q={self.heads_q} H_kv={self.heads_kv} D={self.head_dim} "
                f"S_q={self.seq_q}, pages of {self.page_size}, {self.max_blocks} per sequence, "
                f"pool of {self.num_blocks}, {self.dtype}, mask {self.mask}")


DECODE_MASKS = ("none", "causal", "window")  # what attention_with_kvcache takes


def parse_decode(text: str, *, page_size: int | None, max_blocks: int | None,
                 num_blocks: int | None, seq_q: int, dtype: str, mask: str) -> DecodeSpec:
    """A ``DecodeSpec`` from ``cache warm``'s ``--decode B,H_Q,H_KV,D`` and its options."""
    try:
        dims = tuple(int(part) for part in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        raise ValueError(f"--decode must be four positive ints B,H_Q,H_KV,D, got {text!r}")
    batch, heads_q, heads_kv, head_dim = dims
    if heads_q % heads_kv:
        raise ValueError(f"--decode: H_Q ({heads_q}) must be a multiple of H_KV ({heads_kv})")
    if page_size is None or max_blocks is None:
        raise ValueError("--decode needs --page-size and --max-blocks")
    if seq_q > page_size * max_blocks:
        raise ValueError(f"--seq-q {seq_q} exceeds a sequence's capacity ({max_blocks} pages of "
                         f"{page_size} tokens)")
    dtype_name = DTYPES.get(dtype.lower())
    if dtype_name is None:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    kinds = {part.strip().lower().partition(":")[0] for part in mask.split("+")}
    if not kinds <= set(DECODE_MASKS):
        raise ValueError(f"--mask for --decode must be none, causal[:...] or window:... "
                         f"(joined with '+'), got {mask!r}")
    return DecodeSpec(batch, heads_q, heads_kv, head_dim, page_size, max_blocks,
                      num_blocks or batch * max_blocks, seq_q, dtype_name, parse_mask(mask))


def decode_inputs(spec: DecodeSpec, device: str) -> tuple[tuple, dict]:
    """Zero-filled ``(q, k_pool, v_pool, cache_seqlens), kwargs`` of one ``attention_with_kvcache``
    call of ``spec``'s shapes: int32 lengths (``seq_q`` each) and block table on ``device``."""
    import torch

    dtype = getattr(torch, spec.dtype)
    q = torch.zeros(spec.batch, spec.seq_q, spec.heads_q, spec.head_dim, dtype=dtype,
                    device=device)
    k = torch.zeros(spec.num_blocks, spec.page_size, spec.heads_kv, spec.head_dim, dtype=dtype,
                    device=device)
    lens = torch.full((spec.batch,), spec.seq_q, dtype=torch.int32, device=device)
    table = (torch.arange(spec.batch * spec.max_blocks, dtype=torch.int32, device=device)
             % spec.num_blocks).view(spec.batch, spec.max_blocks)
    return (q, k, torch.zeros_like(k), lens), {"block_table": table, "mask": spec.mask}
