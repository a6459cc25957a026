"""torch.compile(fullgraph=True) over every surface: zero graph breaks (``torch._dynamo.explain``),
cold (caches cleared, Dynamo reset), forward and backward, and the same results as eager.

Most cases compile with ``backend="aot_eager"``: it traces the forward and, through the ops'
registered autograd formula, the backward (a break or a data-dependent op fails the compile under
``fullgraph=True``) without generating C++; one case runs inductor end to end.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from compile_cases import ATTENTION, ENTRIES, MODULES, SURFACES, grads, outputs, rand

import cudnn_attn as ca
from cudnn_attn import Causal, Padding


def _cold():
    torch._dynamo.reset()
    ca.clear_caches()


def _assert_one_graph(fn, *args):
    _cold()
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_break_count == 0, [str(r.reason) for r in explanation.break_reasons]
    assert explanation.graph_count == 1


def _differentiable(args):
    return [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def _assert_eager_equal(fn, args, extra_wrt=(), backend="aot_eager", tol=1e-12):
    """Compiled forward and gradients equal eager's (same dropout stream: same seed first)."""
    _cold()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    wrt = _differentiable(args) + list(extra_wrt)
    torch.manual_seed(123)
    got = compiled(*args)
    torch.manual_seed(123)
    want = fn(*args)
    for g, w in zip(outputs(got), outputs(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    for g, w in zip(grads(got, wrt), grads(want, wrt), strict=True):
        assert w is not None and g is not None
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", sorted(ATTENTION))
def test_attention_compiles_without_breaks(case):
    fn, make = ATTENTION[case]
    args = make()
    _assert_one_graph(fn, *args)
    _assert_eager_equal(fn, args)


@pytest.mark.parametrize("case", sorted(SURFACES))
def test_neighborhood_functions_compile_without_breaks(case):
    fn, make = SURFACES[case]
    args = make()
    _assert_one_graph(fn, *args)
    _assert_eager_equal(fn, args)


@pytest.mark.parametrize("case", sorted(ENTRIES))
def test_varlen_and_kvcache_compile_without_breaks(case):
    fn, make = ENTRIES[case]
    args = make()
    _assert_one_graph(fn, *args)
    _assert_eager_equal(fn, args)


@pytest.mark.parametrize("case", sorted(MODULES))
def test_modules_compile_without_breaks(case):
    factory, make, call = MODULES[case]
    module, args = factory(), make()
    _assert_one_graph(lambda *a: call(module, *a), *args)
    _assert_eager_equal(lambda *a: call(module, *a), args, extra_wrt=list(module.parameters()))


def test_padding_lengths_are_runtime_inputs():
    """New tensor lengths reuse the compiled graph (no recompile) and give eager's results."""
    counter = torch._dynamo.testing.CompileCounter()
    _cold()
    fn = lambda q, k, v, lens: ca.attention(q, k, v, mask=Padding(lens) & Causal())
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    q, k, v = (rand(2, 2, 10, 8, grad=False) for _ in range(3))
    for lens in ([3, 10], [10, 1], [0, 7]):
        lens = torch.tensor(lens)
        torch.testing.assert_close(compiled(q, k, v, lens), fn(q, k, v, lens), rtol=0, atol=0)
    assert counter.frame_count == 1


def test_automatic_dynamic_shapes():
    """A new sequence length recompiles once with symbolic shapes (the fake implementation
    propagates them); later lengths reuse that graph."""
    counter = torch._dynamo.testing.CompileCounter()
    _cold()
    fn = lambda q, k, v: ca.attention(q, k, v, mask=Causal("bottom_right"))
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    for s_q, s_kv in ((5, 9), (7, 13), (8, 15)):
        q, k, v = rand(1, 2, s_q, 8, grad=False), rand(1, 2, s_kv, 8, grad=False), \
            rand(1, 2, s_kv, 8, grad=False)
        torch.testing.assert_close(compiled(q, k, v), fn(q, k, v), rtol=0, atol=0)
    assert counter.frame_count == 2


def test_dynamic_true_from_the_first_call():
    """``dynamic=True``: shapes and float scalars (a module's scale) are symbols from the start;
    one graph serves every length, forward and backward."""
    counter = torch._dynamo.testing.CompileCounter()
    _cold()
    torch.manual_seed(0)
    module = ca.nn.MultiheadAttention(16, 4, num_kv_heads=2, mask=Causal(), scale=0.3).double()
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=counter)
    for length in (5, 9, 12):
        x = rand(2, length, 16)
        torch.testing.assert_close(compiled(x), module(x), rtol=1e-12, atol=1e-12)
    assert counter.frame_count == 1
    _assert_eager_equal(torch.compile(module, dynamic=True, backend="aot_eager"), (rand(2, 7, 16),),
                        extra_wrt=list(module.parameters()))


def test_inductor_forward_and_backward():
    """One case end to end through inductor (C++ codegen on the CPU): runtime padding lengths,
    GQA, bottom-right causal, fp32."""
    q, k, v = rand(2, 4, 12, 8, dtype=torch.float32), rand(2, 2, 12, 8, dtype=torch.float32), \
        rand(2, 2, 12, 8, dtype=torch.float32)
    lens = torch.tensor([5, 12])

    def fn(q, k, v, lens):
        return torch.nn.functional.gelu(
            ca.attention(q * 2, k, v, mask=Padding(lens) & Causal("bottom_right")))

    _assert_eager_equal(fn, (q, k, v, lens), backend="inductor", tol=1e-5)


def test_validation_errors_surface_while_tracing():
    """The fake implementation validates like eager: a bad call fails at compile time with the
    eager error's text."""
    _cold()
    q = rand(1, 2, 10, 8, grad=False)
    fn = lambda q: ca.attention(q, q, q, mask=ca.Neighborhood(12, 3))
    with pytest.raises(ValueError, match="needs S_q == S_kv == 12"):
        fn(q)
    with pytest.raises(Exception, match="needs S_q == S_kv == 12"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(q)
