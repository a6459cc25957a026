"""Malformed input raises the right exception type with a message naming the argument (and value);
Neighborhood constructor / call-time checks; forced unavailable backends raise NotSupportedError with
reasons for that backend; unknown backend names are ValueError. Nothing here may raise AssertionError."""

import math

import pytest
import torch
from common import ca, qkv



def attention(*a, **kw):
    return ca().attention(*a, **kw)


def _i64(t):
    return t.to(torch.int64)


def _r(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


# (id, call(fn, lib, q, k, v), exception, message regex); fn is attention or explain. Masks are built
# inside the call so that a check done at construction instead of call time is accepted too.
MALFORMED = [
    ("q-not-tensor", lambda f, L, q, k, v: f(q.tolist(), k, v), TypeError, r"\bq\b"),
    ("k-not-tensor", lambda f, L, q, k, v: f(q, None, v), TypeError, r"\bk\b"),
    ("v-not-tensor", lambda f, L, q, k, v: f(q, k, 3.0), TypeError, r"\bv\b"),
    ("bias-not-tensor", lambda f, L, q, k, v: f(q, k, v, bias="alibi"), TypeError, r"bias"),
    ("q-int-dtype", lambda f, L, q, k, v: f(_i64(q), _i64(k), _i64(v)), TypeError, r"\bq\b"),
    ("k-dtype-mismatch", lambda f, L, q, k, v: f(q, k.double(), v), TypeError, r"\bk\b|dtype"),
    ("v-dtype-mismatch", lambda f, L, q, k, v: f(q, k, v.half()), TypeError, r"\bv\b|dtype"),
    ("q-rank-3", lambda f, L, q, k, v: f(q[0], k, v), ValueError, r"\bq\b"),
    ("k-rank-5", lambda f, L, q, k, v: f(q, k[None], v), ValueError, r"\bk\b"),
    ("batch-mismatch", lambda f, L, q, k, v: f(q, k[:1], v[:1]), ValueError, r"batch|\bk\b"),
    ("dqk-mismatch", lambda f, L, q, k, v: f(q, k[..., :3], v), ValueError, r"\bk\b"),
    ("skv-k-vs-v", lambda f, L, q, k, v: f(q, k, v[:, :, :4]), ValueError, r"\bv\b"),
    # H_k != H_v is allowed when both divide H_q (cuDNN's rule); 3 value heads do not divide 2.
    ("heads-k-vs-v", lambda f, L, q, k, v: f(q, k, torch.cat([v, v[:, :1]], 1)), ValueError,
     r"H_v=3"),
    (
        "gqa-not-divisible",
        lambda f, L, q, k, v: f(_r(1, 3, 5, 4), _r(1, 2, 5, 4), _r(1, 2, 5, 4)),
        ValueError,
        r"head|H_q|H_kv",
    ),
    ("device-mismatch", lambda f, L, q, k, v: f(q, k.to("meta"), v), ValueError, r"device|meta"),
    ("bad-layout", lambda f, L, q, k, v: f(q, k, v, layout="bsdh"), ValueError, r"layout(.|\n)*bsdh"),
    ("bad-backend", lambda f, L, q, k, v: f(q, k, v, backend="nope"), ValueError, r"backend(.|\n)*nope"),
    (
        "dropout-negative",
        lambda f, L, q, k, v: f(q, k, v, dropout_p=-0.1),
        ValueError,
        r"dropout_p(.|\n)*-0\.1",
    ),
    ("dropout-one", lambda f, L, q, k, v: f(q, k, v, dropout_p=1.0), ValueError, r"dropout_p"),
    ("dropout-big", lambda f, L, q, k, v: f(q, k, v, dropout_p=1.5), ValueError, r"dropout_p(.|\n)*1\.5"),
    ("softcap-negative", lambda f, L, q, k, v: f(q, k, v, softcap=-1.0), ValueError, r"softcap(.|\n)*-1"),
    ("scale-nan", lambda f, L, q, k, v: f(q, k, v, scale=math.nan), ValueError, r"scale(.|\n)*nan"),
    ("scale-inf", lambda f, L, q, k, v: f(q, k, v, scale=math.inf), ValueError, r"scale(.|\n)*inf"),
    ("zero-size-seq", lambda f, L, q, k, v: f(q[:, :, :0], k, v), ValueError, r"\bq\b"),
    ("zero-size-head-dim", lambda f, L, q, k, v: f(q[..., :0], k[..., :0], v), ValueError, r"\bq\b"),
    ("zero-size-kv", lambda f, L, q, k, v: f(q, k[:, :, :0], v[:, :, :0]), ValueError, r"\bk\b"),
    ("zero-size-batch", lambda f, L, q, k, v: f(q[:0], k[:0], v[:0]), ValueError, r"\bq\b"),
    ("mask-string", lambda f, L, q, k, v: f(q, k, v, mask="causal"), TypeError, r"mask"),
    (
        "mask-bool-tensor",
        lambda f, L, q, k, v: f(q, k, v, mask=torch.ones(5, 5, dtype=torch.bool)),
        TypeError,
        r"mask",
    ),
    ("bias-bad-shape", lambda f, L, q, k, v: f(q, k, v, bias=_r(3, 5, 5)), ValueError, r"bias"),
    (
        "padding-wrong-batch",
        lambda f, L, q, k, v: f(q, k, v, mask=L.Padding([5, 5, 5], [5, 5, 5])),
        ValueError,
        r"seq_lens",
    ),
    (
        "padding-len-too-long",
        lambda f, L, q, k, v: f(q, k, v, mask=L.Padding([5, 9], [5, 5])),
        ValueError,
        r"seq_lens_q",
    ),
    (
        "neighborhood-S-mismatch",
        lambda f, L, q, k, v: f(q, k, v, mask=L.Neighborhood((2, 3), 2)),
        ValueError,
        r"spatial_shape|Neighborhood",
    ),
    (
        "neighborhood-k*d>axis",
        lambda f, L, q, k, v: f(q, k, v, mask=L.Neighborhood(5, 3, dilation=2)),
        ValueError,
        r"kernel_size|dilation",
    ),
    (
        "neighborhood-k>axis-2d",
        lambda f, L, q, k, v: f(*(_r(1, 1, 12, 4),) * 3, mask=L.Neighborhood((3, 4), (4, 2))),
        ValueError,
        r"kernel_size",
    ),
    (
        "alibi-slopes-wrong-count",
        lambda f, L, q, k, v: f(q, k, v, bias=L.Alibi(slopes=[0.5, 0.25, 0.125])),
        ValueError,
        r"slopes",
    ),
]

MALFORMED_PARAMS = [pytest.param(call, exc, rx, id=cid) for cid, call, exc, rx in MALFORMED]


@pytest.mark.parametrize("call,exc,rx", MALFORMED_PARAMS)
def test_malformed_input(call, exc, rx):
    lib = ca()
    with pytest.raises(exc, match=rx):
        call(lib.attention, lib, *qkv())


@pytest.mark.parametrize("call,exc,rx", MALFORMED_PARAMS)
def test_explain_still_raises_on_malformed_input(call, exc, rx):
    lib = ca()
    with pytest.raises(exc, match=rx):
        call(lib.explain, lib, *qkv())


def test_errors_are_not_notsupported():
    """ValueError for malformed input must not be a NotSupportedError (and vice versa)."""
    lib = ca()
    assert issubclass(lib.NotSupportedError, NotImplementedError)
    assert not issubclass(lib.NotSupportedError, ValueError)
    q, k, v = qkv()
    with pytest.raises(ValueError) as ei:
        attention(q, k, v, layout="nope")
    assert not isinstance(ei.value, lib.NotSupportedError)


# ---------------------------------------------------------------------------------------------------
# Mask constructors
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,rx",
    [
        pytest.param({"spatial_shape": 8, "kernel_size": 1}, r"kernel_size", id="k=1"),
        pytest.param({"spatial_shape": 8, "kernel_size": 0}, r"kernel_size", id="k=0"),
        pytest.param({"spatial_shape": (8, 8), "kernel_size": (3, 1)}, r"kernel_size", id="k=1-on-axis1"),
        pytest.param({"spatial_shape": 8, "kernel_size": 3, "stride": 4}, r"stride", id="stride>kernel"),
        pytest.param({"spatial_shape": 8, "kernel_size": 3, "stride": 0}, r"stride", id="stride=0"),
        pytest.param({"spatial_shape": 8, "kernel_size": 3, "dilation": 0}, r"dilation", id="dilation=0"),
        pytest.param(
            {"spatial_shape": (8, 8), "kernel_size": 3, "dilation": (1, 0)},
            r"dilation",
            id="dilation=0-axis1",
        ),
        pytest.param(
            {"spatial_shape": (8, 8), "kernel_size": (3, 3, 3)}, r"kernel_size", id="kernel-rank-mismatch"
        ),
        pytest.param(
            {"spatial_shape": (8, 8), "kernel_size": 3, "is_causal": (True,)},
            r"is_causal",
            id="causal-rank-mismatch",
        ),
        pytest.param({"spatial_shape": (8, 8, 8, 8), "kernel_size": 3}, r"spatial_shape", id="4-d"),
        pytest.param({"spatial_shape": (8, 0), "kernel_size": 2}, r"spatial_shape", id="zero-axis"),
    ],
)
def test_neighborhood_constructor_errors(kwargs, rx):
    with pytest.raises(ValueError, match=rx):
        ca().Neighborhood(**kwargs)


def test_neighborhood_valid_edge_cases_construct():
    lib = ca()
    lib.Neighborhood(8, 2)
    lib.Neighborhood(8, 8)  # k == L
    lib.Neighborhood(8, 4, stride=4)  # s == k
    lib.Neighborhood(9, 3, dilation=3)  # k * d == L
    lib.Neighborhood(
        (4, 5, 6), (2, 3, 4), stride=(1, 2, 3), dilation=(2, 1, 1), is_causal=(True, False, True)
    )


@pytest.mark.parametrize(
    "build,exc,rx",
    [
        pytest.param(
            lambda lib: lib.Causal(alignment="top-left"), ValueError, r"alignment", id="causal-alignment"
        ),
        pytest.param(
            lambda lib: lib.SlidingWindow(2, 2, alignment="center"),
            ValueError,
            r"alignment",
            id="window-alignment",
        ),
        pytest.param(lambda lib: lib.SlidingWindow(-2, 2), ValueError, r"left", id="window-left=-2"),
        pytest.param(lambda lib: lib.SlidingWindow(2, -5), ValueError, r"right", id="window-right=-5"),
        pytest.param(
            lambda lib: lib.Padding([3, -1], [3, 3]), ValueError, r"seq_lens_q", id="padding-negative"
        ),
    ],
)
def test_mask_constructor_errors(build, exc, rx):
    with pytest.raises(exc, match=rx):
        build(ca())


# ---------------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this checks the CPU-only behaviour of forced backends")
@pytest.mark.parametrize("name", ["cudnn", "cupy"])
def test_forced_gpu_backend_raises_not_supported(name):
    lib = ca()
    q, k, v = qkv()
    with pytest.raises(lib.NotSupportedError) as ei:
        attention(q, k, v, backend=name, mask=lib.Causal())
    err = ei.value
    assert isinstance(err, NotImplementedError)
    assert isinstance(err.reasons, dict)
    assert name in err.reasons, f"reasons {err.reasons!r} do not name backend {name!r}"
    assert err.reasons[name] and all(isinstance(r, str) and r for r in err.reasons[name])
    assert name in str(err)


def test_forced_torch_backend_works():
    q, k, v = qkv()
    out = attention(q, k, v, backend="torch")
    assert out.shape == q.shape and torch.isfinite(out).all()
