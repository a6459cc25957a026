"""Random configurations of the cuDNN frontend's SDPA tests (``test_mhas``), run three ways:
through cuDNN's own C++ validator (sm_90, no GPU needed), through this library's attribute builder
on the CPU, and through a float64 reference written from the frontend's published semantics.

Used by ``tests/test_builder_cudnn_semantics.py`` (a sample) and ``benchmarks/builder_grid.py``
(counts, JSON). The sampler draws what ``test_mhas``' random configs vary: sequence lengths
(``s_q > s_kv`` included), heads (GQA), ALiBi, a bias, padding, dropout, the diagonal alignment and
band bounds (via the causal setters, the band setters or the sliding window length), and the
direction.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

F64 = torch.float64


@dataclass
class Config:
    seed: int
    b: int = 2
    h_q: int = 4
    h_kv: int = 4
    h_v: int | None = None        # None: h_kv (cuDNN allows H_k != H_v, both dividing H_q)
    s_q: int = 8
    s_kv: int = 8
    d: int = 16
    alibi: bool = False
    bias: bool = False
    padding: bool = False
    dropout: bool = False
    backward: bool = False
    spelling: str = "band"       # "causal", "band" or "window_length"
    align: str = "top_left"
    left: int | None = None      # cuDNN's exclusive left bound
    right: int | None = None
    seq_len_q: list = field(default_factory=list)
    seq_len_kv: list = field(default_factory=list)

    @property
    def band(self):
        return self.left is not None or self.right is not None

    @property
    def heads_v(self) -> int:
        return self.h_kv if self.h_v is None else self.h_v


def sample(seed: int) -> Config:
    rng = random.Random(seed)
    h_q = rng.choice([1, 2, 4, 6])
    c = Config(seed=seed, b=rng.choice([1, 2, 3]), h_q=h_q,
               h_kv=rng.choice([h for h in (1, 2, 3, 4, 6) if h_q % h == 0]),
               s_q=rng.choice([1, 3, 8, 13, 16]), s_kv=rng.choice([1, 5, 8, 16, 19]),
               d=rng.choice([8, 16, 8, 16, 12]), alibi=rng.random() < 0.3, bias=rng.random() < 0.3,
               padding=rng.random() < 0.4, dropout=rng.random() < 0.15,
               backward=rng.random() < 0.35)
    c.spelling = rng.choice(["none", "causal", "band", "window_length"])
    c.align = rng.choice(["top_left", "bottom_right"])
    if c.spelling == "causal":
        c.right = 0
    elif c.spelling == "band":
        c.left = rng.choice([None, 1, 2, 5])
        c.right = rng.choice([None, 0, 0, 1, 3])
    elif c.spelling == "window_length":
        c.left, c.right = rng.choice([1, 3, 6]), 0
    if c.padding:
        c.seq_len_q = [rng.randint(1, c.s_q) for _ in range(c.b)]
        c.seq_len_kv = [rng.randint(1, c.s_kv) for _ in range(c.b)]
    if rng.random() < 0.15:  # drawn last: the earlier fields of every seed stay as they were
        c.h_v = rng.choice([h for h in (1, 2, 3, 4, 6) if h_q % h == 0])
    return c


# ------------------------------------------------------------------------------------------------
# cuDNN's verdict (its C++ validator, sm_90)
# ------------------------------------------------------------------------------------------------

def cudnn_verdict(c: Config) -> str | None:
    """``None`` if cuDNN's validator accepts the configuration, else its message."""
    import cudnn

    g = cudnn._pybind_module.backend_graph(
        name="grid", io_data_type=cudnn.data_type.HALF,
        intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT,
        sm_version=90, sm_count=132)

    def tensor(name, dims, dtype=cudnn.data_type.HALF):
        strides, acc = [], 1
        for n in reversed(dims):
            strides.insert(0, acc)
            acc *= n
        return g.tensor(name=name, dim=list(dims), stride=strides, data_type=dtype)

    q = tensor("q", (c.b, c.h_q, c.s_q, c.d))
    k = tensor("k", (c.b, c.h_kv, c.s_kv, c.d))
    v = tensor("v", (c.b, c.heads_v, c.s_kv, c.d))
    kw = dict(attn_scale=0.3, use_alibi_mask=c.alibi)
    if c.spelling == "causal":
        kw["use_causal_mask_bottom_right" if c.align == "bottom_right" else "use_causal_mask"] = True
    elif c.band:
        kw["diagonal_alignment"] = getattr(cudnn.diagonal_alignment, c.align.upper())
        if c.spelling == "window_length":
            kw["sliding_window_length"] = c.left
        elif c.left is not None:
            kw["diagonal_band_left_bound"] = c.left
        if c.right is not None:
            kw["diagonal_band_right_bound"] = c.right
    if c.bias:
        kw["bias"] = tensor("bias", (1, c.h_q, c.s_q, c.s_kv))
    if c.padding:
        kw.update(use_padding_mask=True,
                  seq_len_q=tensor("lq", (c.b, 1, 1, 1), cudnn.data_type.INT32),
                  seq_len_kv=tensor("lkv", (c.b, 1, 1, 1), cudnn.data_type.INT32))
    if c.dropout:
        kw["dropout"] = (0.1, tensor("seed", (1, 1, 1, 1), cudnn.data_type.INT64),
                         tensor("offset", (1, 1, 1, 1), cudnn.data_type.INT64))
    dims = lambda s: [c.b, c.h_q, s, c.d]  # noqa: E731
    if c.backward:
        o, d_o = tensor("o", dims(c.s_q)), tensor("dO", dims(c.s_q))
        stats = tensor("stats", (c.b, c.h_q, c.s_q, 1), cudnn.data_type.FLOAT)
        dq, dk, dv = g.sdpa_backward(q=q, k=k, v=v, o=o, dO=d_o, stats=stats, **kw)
        for t, heads, s in ((dq, c.h_q, c.s_q), (dk, c.h_kv, c.s_kv), (dv, c.heads_v, c.s_kv)):
            t.set_output(True).set_dim([c.b, heads, s, c.d]).set_stride(
                [heads * s * c.d, s * c.d, c.d, 1])
    else:
        o, stats = g.sdpa(q=q, k=k, v=v, generate_stats=True, **kw)
        o.set_output(True).set_dim(dims(c.s_q)).set_stride([c.h_q * c.s_q * c.d, c.s_q * c.d,
                                                            c.d, 1])
        stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    try:
        g.validate()
    except cudnn.cudnnGraphNotSupportedError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------------------------------------
# The builder, on the CPU
# ------------------------------------------------------------------------------------------------

def inputs(c: Config):
    g = torch.Generator().manual_seed(c.seed)
    q = torch.randn(c.b, c.h_q, c.s_q, c.d, generator=g, dtype=F64)
    k = torch.randn(c.b, c.h_kv, c.s_kv, c.d, generator=g, dtype=F64)
    v = torch.randn(c.b, c.heads_v, c.s_kv, c.d, generator=g, dtype=F64)
    bias = torch.randn(1, c.h_q, c.s_q, c.s_kv, generator=g, dtype=F64) if c.bias else None
    return q, k, v, bias


def attributes(c: Config, cls, bias):
    import cudnn_attn as ca

    a = getattr(ca, cls)().set_attn_scale(0.3).set_alibi_mask(c.alibi)
    if c.spelling == "causal":
        if c.align == "bottom_right":
            a.set_causal_mask_bottom_right(True)
        else:
            a.set_causal_mask(True)
    elif c.band:
        a.set_diagonal_alignment(c.align)
        if c.spelling == "window_length":
            a.set_sliding_window_length(c.left)
        elif c.left is not None:
            a.set_diagonal_band_left_bound(c.left)
        if c.right is not None:
            a.set_diagonal_band_right_bound(c.right)
    if bias is not None:
        a.set_bias(bias)
    if c.padding:
        a.set_padding_mask(True).set_seq_len_q(torch.tensor(c.seq_len_q, dtype=torch.int32)) \
            .set_seq_len_kv(torch.tensor(c.seq_len_kv, dtype=torch.int32))
    if c.dropout:
        a.set_dropout(0.1, 7, 0)
    return a


def run_builder(c: Config):
    """``(verdict, out, stats, grads)``: ``verdict`` None (ran) or the builder's reasons, joined
    by `` | `` (``same_reason`` compares them with cuDNN's message)."""
    import cudnn_attn as ca

    q, k, v, bias = inputs(c)
    try:
        o, stats = ca.scaled_dot_product_flash_attention(
            q, k, v, attributes(c, "SdpaAttributes", bias))
        grads = None
        if c.backward:
            d_o = torch.randn(o.shape, generator=torch.Generator().manual_seed(c.seed + 1),
                              dtype=F64)
            grads = ca.scaled_dot_product_flash_attention_backward(
                q, k, v, o, d_o, stats, attributes(c, "SdpaBackwardAttributes", bias))
    except ca.NotSupportedError as exc:
        return " | ".join(r for reasons in exc.reasons.values() for r in reasons), None, None, None
    return None, o, stats, grads


# ------------------------------------------------------------------------------------------------
# The frontend's published semantics, in float64
# ------------------------------------------------------------------------------------------------

def cudnn_slopes(h: int) -> torch.Tensor:
    n = 2 ** math.floor(math.log2(h))
    slopes = [(2.0 ** (-8.0 / n)) ** i for i in range(1, n + 1)]
    slopes += [(2.0 ** (-4.0 / n)) ** i for i in range(1, 1 + 2 * (h - n), 2)]
    return torch.tensor(slopes, dtype=F64)


def reference(c: Config, q, k, v, bias):
    """``(out, stats [B, H, S_q])`` as the frontend's reference computes them (no dropout):
    ``s = scale * q.k + bias + slope_h * (j - i)``; padding; the diagonal band with the left
    bound exclusive; rows that see nothing give 0."""
    k = k.repeat_interleave(c.h_q // c.h_kv, 1)
    v = v.repeat_interleave(c.h_q // c.heads_v, 1)
    s = 0.3 * q @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias
    i = torch.arange(c.s_q, dtype=F64)[:, None]
    j = torch.arange(c.s_kv, dtype=F64)[None, :]
    if c.alibi:
        s = s + cudnn_slopes(c.h_q).view(1, -1, 1, 1) * (j - i)
    lens_q = c.seq_len_q if c.padding else [c.s_q] * c.b
    lens_kv = c.seq_len_kv if c.padding else [c.s_kv] * c.b
    hidden = torch.zeros(c.b, 1, c.s_q, c.s_kv, dtype=torch.bool)
    for b in range(c.b):
        shift = lens_kv[b] - lens_q[b] if c.align == "bottom_right" and c.band else 0
        hidden[b, 0] |= (i >= lens_q[b]) | (j >= lens_kv[b])
        if c.right is not None:
            hidden[b, 0] |= j > i + shift + c.right
        if c.left is not None:
            hidden[b, 0] |= j <= i + shift - c.left
    s = s.masked_fill(hidden, -math.inf)
    stats = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(stats == -math.inf, 0.0, stats)[..., None])
    return p @ v, stats, hidden[:, 0].all(-1)


def compare(c: Config, out, stats, grads) -> float:
    """Largest error of the builder against the reference on the rows that hold tokens (the
    backward through autograd of the reference); ``nan`` when not comparable (dropout)."""
    if c.dropout:
        return float("nan")
    q, k, v, bias = inputs(c)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref, ref_stats, _ = reference(c, q, k, v, bias)
    lens_q = c.seq_len_q if c.padding else [c.s_q] * c.b
    rows = torch.arange(c.s_q)[None, :] < torch.tensor(lens_q)[:, None]   # [B, S_q]
    err = max((out - ref).abs()[rows[:, None].expand(-1, c.h_q, -1)].max().item(),
              (stats[..., 0] - ref_stats).nan_to_num(0.0, 0.0, 0.0).abs()[
                  rows[:, None].expand(-1, c.h_q, -1)].max().item())
    if grads is not None:
        d_o = torch.randn(out.shape, generator=torch.Generator().manual_seed(c.seed + 1),
                          dtype=F64)
        d_o = d_o * rows[:, None, :, None]
        want = torch.autograd.grad(ref, (q, k, v), d_o)
        err = max(err, *((a - b).abs().max().item() for a, b in zip(grads, want)))
    return err


# ------------------------------------------------------------------------------------------------
# The engine's verdict: the graph graphs.describe builds for the same call through attention()
# ------------------------------------------------------------------------------------------------

def attention_kwargs(c: Config, bias):
    """``attention()`` arguments meaning what the builder call means (cuDNN's left bound is
    exclusive: ``L`` -> ``SlidingWindow(L - 1, ...)``)."""
    import cudnn_attn as ca

    parts = []
    if c.right is not None or c.left is not None:
        align = c.align if c.spelling != "none" else "top_left"
        if c.left is None and c.right == 0:
            parts.append(ca.Causal(align))
        else:
            parts.append(ca.SlidingWindow(-1 if c.left is None else c.left - 1,
                                          -1 if c.right is None else c.right, align))
    if c.padding:
        parts.append(ca.Padding(c.seq_len_q, c.seq_len_kv))
    mask = None
    for m in parts:
        mask = m if mask is None else mask & m
    kw = dict(mask=mask, scale=0.3, dropout_p=0.1 if c.dropout else 0.0)
    if c.alibi:
        kw["alibi"] = ca.Alibi()
    if bias is not None:
        kw["bias"] = bias
    return kw


def engine_verdict(c: Config) -> str | None:
    """``None`` if ``graphs.describe`` builds (and cuDNN's validator accepts, sm_90) the cuDNN
    engine's graph for the call, else its reasons."""
    import cudnn_attn as ca
    from cudnn_attn import graphs

    meta = lambda *shape: torch.empty(*shape, dtype=torch.float16, device="meta")  # noqa: E731
    q, k, v = meta(c.b, c.h_q, c.s_q, c.d), meta(c.b, c.h_kv, c.s_kv, c.d), \
        meta(c.b, c.heads_v, c.s_kv, c.d)
    bias = meta(1, c.h_q, c.s_q, c.s_kv) if c.bias else None
    try:  # attention()'s own alibi= next to a bias tensor: the builder's set_alibi_mask
        graphs.describe(q, k, v, backward=c.backward, **attention_kwargs(c, bias))
    except ca.NotSupportedError as exc:
        return " | ".join(r for reasons in exc.reasons.values() for r in reasons)
    except ValueError as exc:  # describe refusing the call's arguments is a refusal too
        return f"ValueError: {exc}"
    return None


# The engine's declared correctness limits: cuDNN validates these graphs but its release notes
# say they compute wrong results, so the engine refuses them on purpose.
KNOWN_WRONG_RESULTS = ("cuDNN gives wrong results",)


def engine_disagrees(c: Config, theirs: str | None, engine: str | None) -> bool:
    """The engine refuses a call cuDNN validates, or runs one cuDNN refuses. Exempt: refusals
    for cuDNN's documented wrong results (``KNOWN_WRONG_RESULTS``) and the
    engine's equivalent rewrites of a call (its graph then passes cuDNN's validator, which
    ``describe`` runs): a bottom-right diagonal that is the top-left one (``S_q == S_kv`` without
    padding), bounds that hide no key dropped, and a padded decode query's right bound."""
    if (theirs is None) == (engine is None):
        return False
    if theirs is None and engine is not None and all(
            r.startswith(KNOWN_WRONG_RESULTS) for r in engine.split(" | ")):
        return False
    if theirs is not None and engine is None:
        rewritten = (c.align == "bottom_right" and not c.padding and c.s_q == c.s_kv) \
            or _bounds_hide_nothing(c) or _right_bound_hides_nothing(c) \
            or _decode_right_bound_dropped(c)
        return not rewritten
    return True


def _decode_right_bound_dropped(c: Config) -> bool:
    """A padded decode query (S_q = 1) aligned bottom-right sits at its sequence's last key:
    the right bound hides nothing, and the engine leaves it out (``_spec._band``)."""
    return (c.padding and c.align == "bottom_right" and c.s_q == 1 and not c.alibi
            and c.right is not None and c.left is None)


def _right_bound_hides_nothing(c: Config) -> bool:
    """Without padding, a right bound that even row 0 reaches past the last key hides nothing;
    the engine leaves it out (then the diagonal is no longer cuDNN's bottom-right *causal* one)."""
    offset = c.s_kv - c.s_q if c.align == "bottom_right" else 0
    return (not c.padding and not c.alibi and c.right is not None
            and offset + c.right >= c.s_kv - 1)


def _bounds_hide_nothing(c: Config) -> bool:
    if c.padding or not c.band:
        return False
    offset = c.s_kv - c.s_q if c.align == "bottom_right" else 0
    right_free = c.right is None or (offset + c.right >= c.s_kv - 1 and not c.alibi)
    left_free = c.left is None or c.s_q - 1 + offset - (c.left - 1) <= 0
    return right_free and left_free


# ------------------------------------------------------------------------------------------------
# Setter parity with the installed frontend
# ------------------------------------------------------------------------------------------------

# the frontend's sdpa / sdpa_backward keyword -> the SDPA_attributes setter it stands for
_SETTER_OF = {"use_alibi_mask": "set_alibi_mask", "use_padding_mask": "set_padding_mask",
              "use_causal_mask": "set_causal_mask",
              "use_causal_mask_bottom_right": "set_causal_mask_bottom_right",
              "use_deterministic_algorithm": "set_deterministic_algorithm",
              "score_max": "set_logit_max", "dBias": "set_dbias",
              "dSink_token": "set_dsink_token"}
# SDPA_attributes setters with no pygraph keyword (C++ only)
_CPP_ONLY = {"forward": ("set_mma_core_mode",), "backward": ()}
_OPERANDS = {"q", "k", "v", "o", "dO", "stats"}


def frontend_setters(direction: str) -> list[str]:
    """The setters of cuDNN's ``SDPA_attributes`` (``"forward"``) or
    ``SDPA_backward_attributes`` (``"backward"``), from the installed frontend's signatures."""
    import re

    import cudnn

    op = cudnn._pybind_module.backend_graph.sdpa if direction == "forward" \
        else cudnn._pybind_module.backend_graph.sdpa_backward
    signature = op.__doc__.strip().splitlines()[0]
    names = re.findall(r"(\w+):", signature.split("(", 1)[1])
    setters = [_SETTER_OF.get(n, f"set_{n}") for n in names if n not in _OPERANDS]
    return sorted(set(setters) | set(_CPP_ONLY[direction]))


def missing_setters() -> dict[str, list[str]]:
    import cudnn_attn as ca

    out = {}
    for direction, cls in (("forward", ca.SdpaAttributes), ("backward", ca.SdpaBackwardAttributes)):
        out[direction] = [s for s in frontend_setters(direction) if not hasattr(cls, s)]
    return out


def same_reason(mine: str, theirs: str) -> bool:
    """Whether one of the builder's reasons is (the start of) cuDNN's message."""
    return any(reason.rstrip(".") in theirs for reason in mine.split(" | "))
