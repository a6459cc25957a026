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
from compile_cases import (ATTENTION, ENTRIES, MODULES, SURFACES, assert_eager_equal,
                           assert_one_graph, cold, rand)

import cudnn_attn as ca
from cudnn_attn import Causal, Padding


@pytest.mark.parametrize("case", sorted(ATTENTION))
def test_attention_compiles_without_breaks(case):
    fn, make = ATTENTION[case]
    args = make()
    assert_one_graph(fn, *args)
    assert_eager_equal(fn, args)


@pytest.mark.parametrize("case", sorted(SURFACES))
def test_neighborhood_functions_compile_without_breaks(case):
    fn, make = SURFACES[case]
    args = make()
    assert_one_graph(fn, *args)
    assert_eager_equal(fn, args)


@pytest.mark.parametrize("case", sorted(ENTRIES))
def test_varlen_and_kvcache_compile_without_breaks(case):
    fn, make = ENTRIES[case]
    args = make()
    assert_one_graph(fn, *args)
    assert_eager_equal(fn, args)


@pytest.mark.parametrize("case", sorted(MODULES))
def test_modules_compile_without_breaks(case):
    factory, make, call = MODULES[case]
    module, args = factory(), make()
    assert_one_graph(lambda *a: call(module, *a), *args)
    assert_eager_equal(lambda *a: call(module, *a), args, extra_wrt=list(module.parameters()))


def test_padding_lengths_are_runtime_inputs():
    """New tensor lengths reuse the compiled graph (no recompile) and give eager's results."""
    counter = torch._dynamo.testing.CompileCounter()
    cold()
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
    cold()
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
    cold()
    torch.manual_seed(0)
    module = ca.nn.MultiheadAttention(16, 4, num_kv_heads=2, mask=Causal(), scale=0.3).double()
    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=counter)
    for length in (5, 9, 12):
        x = rand(2, length, 16)
        torch.testing.assert_close(compiled(x), module(x), rtol=1e-12, atol=1e-12)
    assert counter.frame_count == 1
    assert_eager_equal(torch.compile(module, dynamic=True, backend="aot_eager"), (rand(2, 7, 16),),
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

    assert_eager_equal(fn, (q, k, v, lens), backend="inductor", tol=1e-5)


def test_validation_errors_surface_while_tracing():
    """The fake implementation validates like eager: a bad call fails at compile time with the
    eager error's text."""
    cold()
    q = rand(1, 2, 10, 8, grad=False)
    fn = lambda q: ca.attention(q, q, q, mask=ca.Neighborhood(12, 3))
    with pytest.raises(ValueError, match="needs S_q == S_kv == 12"):
        fn(q)
    with pytest.raises(Exception, match="needs S_q == S_kv == 12"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(q)
