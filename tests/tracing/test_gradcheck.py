"""torch.autograd.gradcheck (fp64, eps 1e-6, atol 1e-6, rtol 1e-4) of attention() w.r.t. q, k, v and, where
present, a tensor bias: dense, causal, sliding window, 1-D / 2-D neighborhoods (dilation, stride, causal),
GQA, softcap, ALiBi, padding, bshd layout."""

import pytest
import torch
from common import Problem, ca

P = Problem


def NB(shape, **kw):
    """Neighborhood kwargs (the oracle's and the library's constructor share them)."""
    return dict(spatial_shape=shape, **kw)


CASES = [
    P(id="dense", B=1, Hq=2, Sq=5, Skv=6, D=4),
    P(id="dense-bias", B=1, Hq=2, Sq=5, Skv=6, D=4, bias_shape=(1, 2, 5, 6)),
    P(id="causal-tl", B=1, Hq=2, Sq=6, D=3, causal="top_left"),
    P(id="causal-br", B=1, Hq=1, Sq=4, Skv=7, D=3, causal="bottom_right"),
    P(id="window", B=1, Hq=2, Sq=7, D=3, window=(2, 1)),
    P(id="window-br-bias", B=1, Hq=1, Sq=5, Skv=7, D=3, window=(-1, 0, "bottom_right"), bias_shape=(5, 7)),
    P(id="na1d-k3", B=1, Hq=1, D=3, neighborhood=NB(shape=7, kernel_size=3)),
    P(
        id="na1d-dil-stride-causal",
        B=1,
        Hq=1,
        D=3,
        neighborhood=NB(shape=9, kernel_size=2, stride=2, dilation=3, is_causal=True),
    ),
    P(
        id="na2d",
        B=1,
        Hq=1,
        D=3,
        neighborhood=NB(shape=(3, 4), kernel_size=(2, 3), stride=(1, 2), dilation=1),
    ),
    P(
        id="na2d-dil-causal",
        B=1,
        Hq=1,
        D=2,
        neighborhood=NB(shape=(4, 5), kernel_size=2, dilation=(2, 1), is_causal=(False, True)),
    ),
    P(id="gqa", B=1, Hq=4, Hkv=2, Sq=4, Skv=5, D=3, causal="bottom_right"),
    P(id="mqa-dv", B=1, Hq=2, Hkv=1, Sq=4, D=3, Dv=2),
    P(id="softcap", B=1, Hq=1, Sq=5, D=3, softcap=1.2),
    P(id="alibi", B=1, Hq=2, Sq=5, Skv=6, D=3, alibi="default", causal="top_left"),
    P(id="padding", B=2, Hq=1, Sq=4, Skv=5, D=3, seq_lens_q=(4, 2), seq_lens_kv=(3, 5)),
    P(
        id="padding&causal-br-bias",
        B=2,
        Hq=1,
        Sq=4,
        Skv=5,
        D=3,
        seq_lens_q=(2, 4),
        seq_lens_kv=(5, 3),
        causal="bottom_right",
        bias_shape=(2, 1, 4, 5),
    ),
    P(id="bshd-gqa-window", B=1, Hq=2, Hkv=1, Sq=5, D=3, window=(1, 1), layout="bshd"),
]


@pytest.mark.parametrize("problem", [pytest.param(c, id=c.id) for c in CASES])
def test_gradcheck(problem):
    inp = problem.make_inputs(torch.float64, seed=5, requires_grad=True)
    names = [n for n in ("q", "k", "v", "bias") if inp[n] is not None]
    base_kw = problem.kwargs(inp)

    def fn(*tensors):
        kw = dict(base_kw)
        t = dict(zip(names, tensors))
        if "bias" in t:
            kw["bias"] = t["bias"]
        return ca().attention(t["q"], t["k"], t["v"], **kw)

    assert torch.autograd.gradcheck(fn, tuple(inp[n] for n in names), eps=1e-6, atol=1e-6, rtol=1e-4)
