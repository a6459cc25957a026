"""The selftest grid: every feature as a small, plainly described case.

A :class:`Case` is data only (ints, strings and tuples), so that the oracle can rebuild its
visibility without the library's mask objects, and so that a case prints and serialises as is.
Masks are tuples ``(kind, *params)``:

* ``("causal", alignment)``
* ``("window", left, right, alignment)``
* ``("padding", lens_q, lens_kv)``
* ``("neighborhood", spatial_shape, kernel_size, stride, dilation, is_causal)`` (per-axis tuples)

``surface`` picks the entry point: ``"attention"``, ``"varlen"`` (packed sequences of the padding
lengths) or ``"paged"`` (a paged KV cache holding ``lens_kv`` keys per sequence).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

__all__ = ["Case", "grid"]


@dataclass(frozen=True)
class Case:
    """One selftest problem (bhsd sizes; ``mask`` a tuple of mask tuples, see the module doc)."""

    feature: str
    name: str
    batch: int = 2
    heads_q: int = 2
    heads_kv: int = 2
    seq_q: int = 24
    seq_kv: int = 24
    dim_qk: int = 64
    dim_v: int = 64
    mask: tuple = ()
    bias: str | None = None  # None, "tensor", "alibi" or "rpb"
    softcap: float | None = None
    dropout_p: float = 0.0
    surface: str = "attention"
    backward: bool = True
    page_size: int = 8

    def masks_of(self, kind: str) -> list[tuple]:
        return [m for m in self.mask if m[0] == kind]

    @property
    def lengths(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Per-batch ``(lens_q, lens_kv)`` when the case has padding, else None."""
        pads = self.masks_of("padding")
        return (tuple(pads[0][1]), tuple(pads[0][2])) if pads else None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _neighborhood(feature, name, shape, kernel, stride=None, dilation=None, causal=None, **kw):
    rank = len(shape)
    nb = ("neighborhood", tuple(shape), tuple(kernel), tuple(stride or (1,) * rank),
          tuple(dilation or (1,) * rank), tuple(causal or (False,) * rank))
    tokens = math.prod(shape)
    return Case(feature, name, seq_q=tokens, seq_kv=tokens, mask=(nb,), **kw)


def _core_cases() -> list[Case]:
    """The features every engine is asked about, one or two small cases each."""
    return [
        Case("dense", "dense"),
        Case("causal", "causal-top-left", seq_q=20, seq_kv=28, mask=(("causal", "top_left"),)),
        Case("causal", "causal-bottom-right", seq_q=20, seq_kv=28,
             mask=(("causal", "bottom_right"),)),
        Case("sliding window", "window-8-0", mask=(("window", 8, 0, "top_left"),)),
        Case("sliding window", "window-3-5-br", seq_q=16, seq_kv=30,
             mask=(("window", 3, 5, "bottom_right"),)),
        Case("padding", "padding-empty-rows", batch=3, seq_q=20, seq_kv=24,
             mask=(("padding", (20, 7, 0), (24, 11, 5)),)),
        Case("padding", "padding-causal-br", batch=2, seq_q=20, seq_kv=24,
             mask=(("padding", (12, 20), (17, 24)), ("causal", "bottom_right"))),
        Case("alibi", "alibi", heads_q=4, heads_kv=4, bias="alibi"),
        Case("alibi", "alibi-causal", heads_q=4, heads_kv=4, bias="alibi",
             mask=(("causal", "top_left"),)),
        Case("tensor bias", "bias", bias="tensor"),
        Case("softcap", "softcap", softcap=2.5),
        Case("dropout", "dropout", dropout_p=0.3, seq_q=32, seq_kv=32, dim_v=32),
        Case("GQA/MQA", "gqa", heads_q=6, heads_kv=2),
        Case("GQA/MQA", "mqa", heads_q=4, heads_kv=1, mask=(("causal", "top_left"),)),
        Case("D_v != D_qk", "dv", dim_qk=64, dim_v=32),
        Case("odd sizes", "odd", batch=1, heads_q=3, heads_kv=3, seq_q=37, seq_kv=29, dim_qk=40,
             dim_v=40, mask=(("causal", "bottom_right"),)),
        Case("varlen", "varlen", batch=3, seq_q=20, seq_kv=24, surface="varlen",
             mask=(("padding", (20, 7, 1), (24, 11, 5)),)),
        Case("varlen", "varlen-causal", batch=3, seq_q=20, seq_kv=24, surface="varlen",
             mask=(("padding", (9, 20, 4), (12, 24, 4)), ("causal", "bottom_right"))),
        Case("paged KV", "paged", batch=3, seq_q=2, seq_kv=32, surface="paged", backward=False,
             heads_q=4, heads_kv=2, mask=(("padding", (2, 2, 2), (29, 8, 17)),)),
        _neighborhood("neighborhood 1-D", "na1d", (30,), (7,)),
        _neighborhood("neighborhood 1-D", "na1d-stride-dilation", (31,), (5,), (2,), (3,)),
        _neighborhood("neighborhood 1-D", "na1d-causal", (26,), (6,), causal=(True,)),
        _neighborhood("neighborhood 2-D", "na2d", (7, 6), (3, 5)),
        _neighborhood("neighborhood 2-D", "na2d-stride-dilation-causal", (8, 7), (3, 3), (2, 1),
                      (2, 1), (True, False)),
        _neighborhood("neighborhood 3-D", "na3d", (4, 5, 6), (3, 3, 3), (1, 2, 1), (1, 1, 2)),
        _neighborhood("neighborhood RPB", "na1d-rpb", (24,), (7,), bias="rpb"),
        _neighborhood("neighborhood RPB", "na2d-rpb", (6, 7), (3, 5), dilation=(2, 1), bias="rpb"),
    ]


def _head_dim_cases(dims) -> list[Case]:
    return [Case("head dims", f"head-dim-{d}", dim_qk=d, dim_v=d, mask=(("causal", "top_left"),))
            for d in dims]


def grid(quick: bool = True) -> list[Case]:
    """The cases of a ``--quick`` (one per feature variant, head dims 32/128/256) or ``--full``
    run (also every head dim from 32 to 256 in steps of 32 and larger sequences)."""
    cases = _core_cases()
    if quick:
        return cases + _head_dim_cases((32, 128, 256))
    larger = [dataclasses.replace(c, name=c.name + "-large", seq_q=c.seq_q * 4,
                                  seq_kv=c.seq_kv * 4)
              for c in cases if c.surface == "attention" and not c.mask and c.bias != "rpb"]
    return cases + _head_dim_cases(range(32, 257, 32)) + larger
