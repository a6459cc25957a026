"""torch.export (strict and non-strict) with a save/load round trip, FakeTensor and meta inputs, and
``torch.library.opcheck`` on the custom ops (schema, fake implementation, autograd registration)."""

from __future__ import annotations

import io

import pytest
import torch
from compile_cases import ATTENTION, ENTRIES, MODULES, SURFACES, outputs, rand
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import cudnn_attn as ca
from cudnn_attn import Causal, Neighborhood, Padding

EXPORTED = ["padding_tensor", "alibi", "neighborhood_2d", "rel_pos_bias", "gqa",
            "dv_ne_dqk_bshd_lse", "softcap", "tensor_bias"]


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _detached(args):
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


def _round_trip(program):
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def _ours(program):
    return [n for n in program.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("cudnn_attn.")]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
@pytest.mark.parametrize("case", EXPORTED)
def test_export_round_trip(case, strict):
    fn, make = ATTENTION[case]
    args = _detached(make())
    program = _round_trip(torch.export.export(_Wrap(fn), args, strict=strict))
    # The engine is one opaque op in the graph; masks and constants are its spec string.
    (node,) = _ours(program)
    assert str(node.target) == "cudnn_attn.attention_forward.default"
    assert isinstance(node.args[-1], str) and node.args[-1].startswith('{"mask":')
    got, want = program.module()(*args), fn(*args)
    for g, w in zip(outputs(got), outputs(want), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["na2d_rpb", "na3d_stride"])
def test_export_neighborhood_functions(case):
    fn, make = SURFACES[case]
    args = _detached(make())
    program = _round_trip(torch.export.export(_Wrap(fn), args, strict=False))
    torch.testing.assert_close(program.module()(*args), fn(*args), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["MultiheadAttention_gqa_alibi_padding",
                                  "NeighborhoodAttention2D_rpb"])
def test_export_modules(case):
    factory, make, call = MODULES[case]
    module, args = factory().eval(), _detached(make())
    program = _round_trip(torch.export.export(_Wrap(lambda *a: call(module, *a)), args))
    torch.testing.assert_close(program.module()(*args), call(module, *args), rtol=0, atol=0)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
@pytest.mark.parametrize("case", ["varlen_causal_alibi_lse", "kvcache_paged_lse"])
def test_export_varlen_and_kvcache(case, strict):
    fn, make = ENTRIES[case]
    args = _detached(make())
    program = _round_trip(torch.export.export(_Wrap(fn), args, strict=strict))
    (node,) = _ours(program)
    assert str(node.target) == "cudnn_attn.entry_forward.default"
    for g, w in zip(outputs(program.module()(*args)), outputs(fn(*args)), strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_exported_padding_lengths_stay_runtime_inputs():
    fn = lambda q, k, v, lens: ca.attention(q, k, v, mask=Padding(lens) & Causal())
    q, k, v = (rand(2, 2, 10, 8, grad=False) for _ in range(3))
    program = _round_trip(torch.export.export(_Wrap(fn), (q, k, v, torch.tensor([3, 10]))))
    for lens in ([10, 1], [0, 6]):
        lens = torch.tensor(lens)
        torch.testing.assert_close(program.module()(q, k, v, lens), fn(q, k, v, lens),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_meta_tensors_propagate_shapes(layout):
    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dtype)
    if layout == "bhsd":
        q, k, v = meta(2, 4, 7, 16), meta(2, 2, 11, 16), meta(2, 2, 11, 24)
        want_out = (2, 4, 7, 24)
    else:
        q, k, v = meta(2, 7, 4, 16), meta(2, 11, 2, 16), meta(2, 11, 2, 24)
        want_out = (2, 7, 4, 24)
    out, lse = ca.attention(q, k, v, mask=Causal("bottom_right"), layout=layout, return_lse=True)
    assert out.device.type == "meta" and tuple(out.shape) == want_out
    assert out.dtype == torch.bfloat16
    assert tuple(lse.shape) == (2, 4, 7) and lse.dtype == torch.float32
    q64 = meta(1, 2, 9, 8, dtype=torch.float64)
    assert ca.attention(q64, q64, q64, return_lse=True)[1].dtype == torch.float64


def test_fake_tensors_propagate_shapes_and_validate():
    with FakeTensorMode():
        x = torch.empty(2, 3, 4, 2, 8)  # [B, *spatial, H, D]
        out, lse = ca.neighborhood.na2d(x, x, x, kernel_size=3, return_lse=True)
        assert tuple(out.shape) == (2, 3, 4, 2, 8) and tuple(lse.shape) == (2, 3, 4, 2)
        q = torch.empty(1, 2, 10, 8)
        with pytest.raises(ValueError, match="needs S_q == S_kv == 12"):
            ca.attention(q, q, q, mask=Neighborhood(12, 3))
        lens = torch.empty(1, dtype=torch.int64)
        out = ca.attention(q, q, q, mask=Padding(lens))  # lengths have no values: runtime input
        assert tuple(out.shape) == (1, 2, 10, 8)


class _Capture(TorchDispatchMode):
    """Records the arguments of every ``cudnn_attn::attention_forward`` call."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.cudnn_attn.attention_forward.default:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["padding_tensor", "rel_pos_bias", "dv_ne_dqk_bshd_lse"])
def test_opcheck(case):
    """PyTorch's own checks of the custom op: schema, fake vs real implementation, autograd
    registration, AOT dispatch; on the arguments attention() gives it for this case."""
    fn, make = ATTENTION[case]
    with _Capture() as capture:  # a dispatch mode routes attention() through the op
        fn(*make())
    (args,) = capture.calls
    torch.library.opcheck(torch.ops.cudnn_attn.attention_forward.default, args)
