"""Tensors of another layout and flags of another type, on every path a call can take.

Sparse (COO), mkldnn and nested (strided and jagged) tensors are refused with a message naming
the argument, by every surface, including ``attention``'s cached fast path (a dense call of the
same shape cached first) and ``explain``. Boolean flags are type-checked eager, on meta inputs,
under autocast and under ``torch.compile``: ``flash_attn_func(deterministic="yes")`` raises
``TypeError`` (FlashAttention's op schema takes a bool; ours is also the ``RuntimeError`` its
callers catch), ``attention(return_lse="no")`` raises ``TypeError`` everywhere.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import cudnn_attn as ca
from cudnn_attn import natten as N
from cudnn_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

SHAPE = (1, 2, 8, 16)


def _dense():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*SHAPE, generator=g) for _ in range(3)]


def _nested(dense):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided nested layout is a "prototype"
        return torch.nested.nested_tensor(list(dense))


def _jagged(dense):
    return torch.nested.nested_tensor(list(dense), layout=torch.jagged)


LAYOUTS = {
    "sparse": lambda t: t.to_sparse(),
    "mkldnn": lambda t: t.to_mkldnn(),
    "nested": _nested,
    "jagged": _jagged,
}


def _refused(call, name):
    """``call()`` raises a TypeError or NotImplementedError naming ``name`` (as a word)."""
    with pytest.raises((TypeError, NotImplementedError)) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{name} ") or f" {name} " in message or f"{name}=" in message, \
        message
    assert "NestedTensorImpl" not in message and "Sparse" not in message.split(":")[0], message


@pytest.mark.parametrize("position", [0, 1, 2], ids=["q", "k", "v"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_attention_and_explain_refuse_other_layouts(layout, position):
    dense = _dense()
    ca.attention(*dense)  # a dense call of this shape is cached (the fast path's signature)
    ca.attention(*dense, mask=ca.Causal())
    bad = list(dense)
    bad[position] = LAYOUTS[layout](dense[position])
    name = "qkv"[position]
    _refused(lambda: ca.attention(*bad), name)
    _refused(lambda: ca.attention(*bad, mask=ca.Causal()), name)
    _refused(lambda: ca.explain(*bad), name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_surface_refuses_other_layouts(layout):
    dense = [t.transpose(1, 2).contiguous() for t in _dense()]  # bshd / heads-last
    q = LAYOUTS[layout](dense[0])
    k, v = dense[1], dense[2]
    _refused(lambda: flash_attn_func(q, k, v), "q")
    _refused(lambda: flash_attn_func(q, k, v, causal=True), "q")
    _refused(lambda: N.attention(q, k, v), "query")
    _refused(lambda: N.na1d(q, k, v, kernel_size=3), "query")
    _refused(lambda: ca.attention(q, k, v, layout="bshd"), "q")


def test_a_sparse_bias_is_refused_naming_it():
    q, k, v = _dense()
    bias = torch.zeros(8, 8).to_sparse()
    _refused(lambda: ca.attention(q, k, v, bias=bias), "bias")


# ---------------------------------------------------------------------------------------------
# flags
# ---------------------------------------------------------------------------------------------

def _meta(ts):
    return [t.to("meta") for t in ts]


# Under torch.compile(fullgraph=True) an error raised while tracing reaches the caller inside
# Dynamo's Unsupported ("raised exception TypeError(...)"): either proves the traced path checked.
_TRACED_ERRORS = (TypeError, torch._dynamo.exc.Unsupported)


@pytest.mark.parametrize("path", ["eager", "meta", "autocast", "compile"])
def test_return_lse_must_be_a_bool_on_every_path(path):
    q, k, v = _dense()

    def call(q, k, v):
        return ca.attention(q, k, v, return_lse="no")

    with pytest.raises(_TRACED_ERRORS if path == "compile" else TypeError, match="return_lse"):
        if path == "eager":
            call(q, k, v)
        elif path == "meta":
            call(*_meta((q, k, v)))
        elif path == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                call(q, k, v)
        else:
            torch._dynamo.reset()
            torch.compile(call, fullgraph=True, backend="eager")(q, k, v)


@pytest.mark.parametrize("path", ["eager", "meta", "autocast", "compile"])
def test_flash_attn_deterministic_must_be_a_bool_on_every_path(path):
    q, k, v = (t.transpose(1, 2).contiguous() for t in _dense())

    def call(q, k, v):
        return flash_attn_func(q, k, v, causal=True, deterministic="yes")

    with pytest.raises(_TRACED_ERRORS if path == "compile" else TypeError,
                       match="deterministic"):
        if path == "eager":
            call(q, k, v)
        elif path == "meta":
            call(*_meta((q, k, v)))
        elif path == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                call(q, k, v)
        else:
            torch._dynamo.reset()
            torch.compile(call, fullgraph=True, backend="eager")(q, k, v)


def test_flash_attn_deterministic_is_also_the_runtime_error_flash_attn_raises():
    q, k, v = (t.transpose(1, 2).contiguous() for t in _dense())
    with pytest.raises(RuntimeError, match="deterministic"):
        flash_attn_func(q, k, v, deterministic=1)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="deterministic"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 8, 8, deterministic="yes")
