"""The cuDNN engine's direct runner (``graphs.launch.DirectCall``, issue 35's host time), on this
CPU through the stand-in executor of ``cudnn_fake`` (float64 from the buffers each graph binds):

* the plainest calls (no bias, tensor lengths, dropout, packed/paged storage, lse; a positive
  scale), with or without grad, run through it from their second call, and give the float64
  oracle's outputs and gradients; ``Padding`` lengths too (host ints bound once, tensors passed
  per call), NaN past them hidden as on the full path; a bias that needs no gradient; dropout, a
  seed per call as the full path draws it;
* every call it cannot take (a bias that requires grad, a negative scale, return_lse, new
  strides, ``torch.no_grad`` on tensors that require grad) takes the full path, with the same
  results; a plan whose graphs read a tile mask, ragged offsets or page tables has
  no runner, and varlen and paged-cache calls never reach one;
* what it binds: 16-byte aligned base pointers, a contiguous dO, gradients contiguous in the
  call's layout, the graphs the plan built (one execute per direction).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cudnn_attn as ca
import cudnn_fake
import oracle
from test_cudnn_host_path import fake  # noqa: F401  (fixture: the fake engine)
from cudnn_attn.core import dispatch
from cudnn_attn.graphs import launch
from cudnn_attn.graphs._spec import PagedKV
from cudnn_attn.graphs.backend import CudnnPlan
from cudnn_attn.model.problem import AttnProblem
from cudnn_attn.packed import calls
from cudnn_attn.varlen import attention_varlen, attention_with_kvcache
from cudnn_attn.graphs._emit import UID

F16, F64 = torch.float16, torch.float64
pytestmark = pytest.mark.skipif(not cudnn_fake.frontend_present(),
                                reason="nvidia-cudnn-frontend is not installed")


@pytest.fixture
def direct(monkeypatch):
    """Each ``DirectCall`` call's answer: ``"ran"`` or ``"declined"`` (``None``: full path)."""
    seen = []
    original = launch.DirectCall.__call__

    def spy(self, q, k, v, *operands):
        out = original(self, q, k, v, *operands)
        seen.append("declined" if out is None else "ran")
        return out

    monkeypatch.setattr(launch.DirectCall, "__call__", spy)
    return seen


def _qkv(B=2, H=2, S=24, D=16, grad=False, seed=0, layout="bhsd"):
    g = torch.Generator().manual_seed(seed)
    shape = (B, H, S, D) if layout == "bhsd" else (B, S, H, D)
    return tuple(torch.randn(shape, generator=g).to(F16).requires_grad_(grad) for _ in range(3))


def _reference(q, k, v, layout="bhsd", **visibility):
    b, s = q.shape[0], q.shape[2] if layout == "bhsd" else q.shape[1]
    vis = oracle.build_visibility(b, s, s, **visibility) if visibility else None
    leaves = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    out, _ = oracle.reference_attention(*leaves, vis, layout=layout)
    return out, leaves


CASES = {  # name -> (mask, oracle visibility)
    "dense": (None, {}),
    "causal": (ca.Causal(), {"causal": "top_left"}),
    "window": (ca.SlidingWindow(5, 0), {"window": (5, 0)}),
}


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_through_the_runner_match_the_oracle(fake, direct, case, layout):
    mask, visibility = CASES[case]
    q, k, v = _qkv(grad=True, layout=layout)
    ref, leaves = _reference(q, k, v, layout, **visibility)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1)).to(F16)
    ref_grads = torch.autograd.grad(ref, leaves, dout.to(F64))
    for call in range(3):  # the first call prepares the runner, and each runs through it
        out = ca.attention(q, k, v, mask=mask, layout=layout, backend="cudnn")
        torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got.to(F64), want, atol=5e-3, rtol=5e-3)
    assert direct == ["ran"] * 3
    # and so does a call that needs no gradient (a signature, and a runner, of its own)
    with torch.no_grad():
        plain = [t.detach() for t in (q, k, v)]
        for _ in range(2):
            out = ca.attention(*plain, mask=mask, layout=layout, backend="cudnn")
            torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
    assert direct == ["ran"] * 5


def test_grouped_heads_and_a_narrower_value_head_dim(fake, direct):
    """GQA (dK/dV of the kv heads) and D_v != D_qk (out from the plan's template, not q)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 24, 16, generator=g).to(F16).requires_grad_(True)
    k = torch.randn(2, 2, 24, 16, generator=g).to(F16).requires_grad_(True)
    v = torch.randn(2, 2, 24, 8, generator=g).to(F16).requires_grad_(True)
    ref, leaves = _reference(q, k, v, causal="top_left")
    want = torch.autograd.grad(ref.square().sum(), leaves)
    for _ in range(2):
        out = ca.attention(q, k, v, mask=ca.Causal(), backend="cudnn")
        assert out.shape == (2, 4, 24, 8) and out.is_contiguous()
        torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        for got, expected in zip(grads, want):
            torch.testing.assert_close(got.to(F64), expected, atol=1e-2, rtol=1e-2)
    assert direct == ["ran", "ran"]


def test_the_runner_executes_one_graph_per_direction_with_aligned_contiguous_buffers(fake,
                                                                                     monkeypatch):
    """Misaligned inputs are copied (cuDNN faults on them); an expanded dO (the gradient of a
    ``sum``) is bound contiguous; dQ/dK/dV are new contiguous tensors in the call's layout."""
    seen = []
    execute = launch.execute

    def recording(built, buffers, device):
        seen.append((built.backward, dict(buffers)))
        return execute(built, buffers, device)

    monkeypatch.setattr(launch, "execute", recording)
    q, k, v = _qkv(grad=True, layout="bshd")
    base = torch.zeros(q.numel() + 1, dtype=F16)
    shifted = base[1:].view(q.shape).copy_(q.detach()).requires_grad_(True)  # 2 bytes off
    assert shifted.data_ptr() % 16
    for _ in range(2):
        ca.attention(shifted, k, v, layout="bshd", backend="cudnn")
    seen.clear()
    out = ca.attention(shifted, k, v, layout="bshd", backend="cudnn")
    grads = torch.autograd.grad(out.float().sum(), (shifted, k, v))
    assert [backward for backward, _ in seen] == [False, True]
    for _, buffers in seen:
        assert all(t.data_ptr() % 16 == 0 for t in buffers.values() if t.device.type != "meta")
    dout = seen[1][1][int(UID.DO)]
    assert dout.is_contiguous() and dout.shape == out.shape
    assert all(g.is_contiguous() and g.shape == t.shape for g, t in zip(grads, (q, k, v)))
    ref, leaves = _reference(q, k, v, "bshd")
    for got, want in zip(grads, torch.autograd.grad(ref.sum(), leaves)):
        torch.testing.assert_close(got.to(F64), want, atol=5e-3, rtol=5e-3)


def test_calls_it_cannot_take_run_the_full_path_with_the_same_results(fake, direct):
    q, k, v = _qkv(grad=True)
    causal, visibility = CASES["causal"]
    ref, leaves = _reference(q, k, v, **visibility)
    for _ in range(2):  # prepared: the runner exists for this signature
        ca.attention(q, k, v, mask=causal, backend="cudnn")
    direct.clear()
    # grad mode off on tensors that require grad: the runner declines, no node is recorded
    with torch.no_grad():
        out = ca.attention(q, k, v, mask=causal, backend="cudnn")
    assert direct == ["declined"] and out.grad_fn is None
    torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
    # new strides (q inside a wider buffer): the stride-free signature finds the runner, whose
    # graphs were built for other strides: it declines, and the call prepares (and runs) a plan
    # and runner of its own
    wide = torch.zeros(*q.shape[:3], 2 * q.shape[3], dtype=F16)
    odd = wide[..., :q.shape[3]].copy_(q.detach()).requires_grad_(True)
    direct.clear()
    out = ca.attention(odd, k, v, mask=causal, backend="cudnn")
    assert direct == ["declined", "ran"]
    torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
    (dq,) = torch.autograd.grad(out.float().sum(), (odd,))
    (want,) = torch.autograd.grad(ref.sum(), leaves[:1])
    torch.testing.assert_close(dq.to(F64), want, atol=5e-3, rtol=5e-3)


NO_RUNNER = {  # made inside the test: the fixture decides which lengths are runtime values
    "bias that requires grad": lambda: dict(
        bias=torch.zeros(1, 2, 24, 24, dtype=F16, requires_grad=True)),
    "negative scale": lambda: dict(scale=-0.25),
    "lse": lambda: dict(return_lse=True),
}


@pytest.mark.parametrize("name", list(NO_RUNNER))
def test_calls_that_bind_more_than_q_k_v_get_no_runner(fake, direct, name):
    q, k, v = _qkv()
    arguments = NO_RUNNER[name]()
    for _ in range(3):
        ca.attention(q, k, v, backend="cudnn", **arguments)
    assert direct == []


PADDED = {  # name -> (lengths q, lengths kv, mask, oracle visibility)
    # rows 20.. and 9.. of the two sequences see no key: out 0, no gradient through them
    "causal, short queries": ((20, 9), (24, 13), ca.Causal(), {"causal": "top_left"}),
    # every query row sees a key; only keys are padded (no empty rows to clear)
    "keys only": ((24, 24), (7, 18), None, {}),
    # a sequence without keys: all its rows see none
    "no keys": ((24, 5), (11, 0), ca.SlidingWindow(3, 2), {"window": (3, 2)}),
    # the same with a causal band, which alone empties no row of a sequence with keys
    "no keys, causal": ((20, 6), (24, 0), ca.Causal(), {"causal": "top_left"}),
}


def _poisoned(t, lengths, layout):
    """``t`` with NaN at every position past ``lengths`` (the engine must never let it in)."""
    seq_axis = 2 if layout == "bhsd" else 1
    past = torch.arange(t.shape[seq_axis])[None, :] >= torch.tensor(lengths)[:, None]
    shape = [t.shape[0], 1, 1, 1]
    shape[seq_axis] = t.shape[seq_axis]
    return t.detach().masked_fill(past.view(shape), float("nan")).requires_grad_(t.requires_grad)


def _padding(kind, lens_q, lens_kv):
    """Host lengths, tensors (runtime values under the fixture), or one tensor for both sides
    when the lengths agree (the usual self-attention ``Padding(lengths)``)."""
    if kind == "static":
        return ca.Padding(list(lens_q), list(lens_kv))
    if kind == "runtime" or lens_q != lens_kv:
        return ca.Padding(torch.tensor(lens_q), torch.tensor(lens_kv, dtype=torch.int32))
    return ca.Padding(torch.tensor(lens_q))


@pytest.mark.parametrize("kind", ["static", "runtime", "runtime, one tensor"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("case", list(PADDED))
def test_padding_runs_through_the_runner_and_hides_what_lies_past_the_lengths(
        fake, direct, case, layout, kind):
    """Host lengths are part of the call's signature: the runner binds their device tensors
    once; tensor lengths are passed per call (moved and compared on the device). NaN past the
    lengths (q, k, v and the incoming gradient) reaches no output or gradient; out is 0 on the
    rows that see no key, and so are their gradients."""
    lens_q, lens_kv, mask, visibility = PADDED[case]
    padding = _padding(kind, lens_q, lens_kv)
    mask = padding if mask is None else mask & padding
    clean = _qkv(grad=True, layout=layout)
    ref, leaves = _reference(*clean, layout, seq_lens_q=lens_q, seq_lens_kv=lens_kv, **visibility)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2)).to(F16)
    ref_grads = torch.autograd.grad(ref, leaves, dout.to(F64))
    q = _poisoned(clean[0], lens_q, layout)
    k, v = (_poisoned(t, lens_kv, layout) for t in clean[1:])
    dout = _poisoned(dout, lens_q, layout)
    for _ in range(3):  # the first call prepares the runner, and each runs through it
        out = ca.attention(q, k, v, mask=mask, layout=layout, backend="cudnn")
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        for got, want in zip(grads, ref_grads):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got.to(F64), want, atol=5e-3, rtol=5e-3)
    with torch.no_grad():
        plain = [t.detach() for t in (q, k, v)]
        for _ in range(2):
            out = ca.attention(*plain, mask=mask, layout=layout, backend="cudnn")
            assert torch.isfinite(out).all()
            torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
    assert direct == ["ran"] * 5


@pytest.mark.parametrize("one_tensor", [False, True])
def test_runtime_lengths_are_each_calls_own(fake, direct, one_tensor):
    """A runner serves every call of its signature whatever lengths it brings: new tensors,
    and one tensor updated in place between calls (as a CUDA graph's inputs are), including a
    sequence of length 0 (every row of it sees no key: out 0, no gradient)."""
    q, k, v = _qkv(grad=True)
    lens_q = torch.tensor([20, 9])
    lens_kv = lens_q if one_tensor else torch.tensor([20, 9], dtype=torch.int32)
    mask = ca.Causal() & ca.Padding(lens_q, lens_kv)
    for values in ([20, 9], [24, 3], [0, 17], [5, 24]):
        lens_q.copy_(torch.tensor(values))
        lens_kv.copy_(torch.tensor(values))
        for call_mask in (mask, ca.Causal() & ca.Padding(torch.tensor(values))):
            ref, leaves = _reference(q, k, v, causal="top_left", seq_lens_q=values,
                                     seq_lens_kv=values)
            out = ca.attention(q, k, v, mask=call_mask, backend="cudnn")
            torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
            grads = torch.autograd.grad(out.float().sum(), (q, k, v))
            for got, want in zip(grads, torch.autograd.grad(ref.sum(), leaves)):
                torch.testing.assert_close(got.to(F64), want, atol=5e-3, rtol=5e-3)
            with torch.no_grad():
                out = ca.attention(*(t.detach() for t in (q, k, v)), mask=call_mask,
                                   backend="cudnn")
            torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
    assert direct == ["ran"] * 16


def test_dropout_with_runtime_lengths_runs_through_the_runner(fake, direct):
    """Both per-call operands at once: the seed drawn from the call's generator and the call's
    lengths; bitwise the full path's outputs and gradients (equally seeded generators)."""
    q, k, v = _qkv(grad=True)
    ours, full = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for values in ([20, 9], [3, 24]):
        mask = ca.Causal() & ca.Padding(torch.tensor(values))
        out = ca.attention(q, k, v, mask=mask, dropout_p=0.3, generator=ours, backend="cudnn")
        want, _ = ca.attention(q, k, v, mask=mask, dropout_p=0.3, generator=full,
                               return_lse=True, backend="cudnn")
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        for got, expected in zip(torch.autograd.grad(out.float().sum(), (q, k, v)),
                                 torch.autograd.grad(want.float().sum(), (q, k, v))):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert direct == ["ran"] * 2


@pytest.mark.parametrize("padded", [None, "static", "runtime"])
@pytest.mark.parametrize("shape", [(1, 2, 24, 24), (2, 1, 1, 24)])
def test_a_bias_that_needs_no_gradient_runs_through_the_runner(fake, direct, shape, padded,
                                                               monkeypatch):
    """The bias is the runner's fourth operand, bound per call (S_kv = 24, not a multiple of
    128: the graphs add a full-length padding mask, whose lengths the runner binds too). With a
    ``Padding`` (host or tensor lengths), NaN in the bias past the lengths reaches nothing: the
    graphs are given a bias without it (the stand-in executor masks by selection, so the output
    alone would not show an additive mask's ``-inf + NaN``)."""
    bound = []
    execute = launch.execute
    monkeypatch.setattr(launch, "execute", lambda built, buffers, device: (
        bound.append(buffers[int(UID.BIAS)]), execute(built, buffers, device)))
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(grad=True)
    bias = torch.randn(shape, generator=g).to(F16)
    lens = (20, 9)
    visibility = {"causal": "top_left", **({"seq_lens_q": lens, "seq_lens_kv": lens}
                                           if padded else {})}
    mask = ca.Causal() if padded is None else ca.Causal() & ca.Padding(
        list(lens) if padded == "static" else torch.tensor(lens))
    vis = oracle.build_visibility(2, 24, 24, **visibility)
    leaves = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
    ref, _ = oracle.reference_attention(*leaves, vis, bias=bias.to(F64))
    want = torch.autograd.grad(ref.sum(), leaves)
    if padded:  # NaN at every bias cell of a key past its sequence's length (a bias shared
        # by the batch: past the longest, as every sequence reads the cells inside its own)
        ends = torch.tensor(lens if shape[0] == 2 else [max(lens)])
        past = (torch.arange(24)[None, :] >= ends[:, None]).view(shape[0], 1, 1, 24)
        bias = bias.masked_fill(past, float("nan"))
    for _ in range(3):
        out = ca.attention(q, k, v, mask=mask, bias=bias, backend="cudnn")
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
        grads = torch.autograd.grad(out.float().sum(), (q, k, v))
        for got, expected in zip(grads, want):
            torch.testing.assert_close(got.to(F64), expected, atol=5e-3, rtol=5e-3)
    with torch.no_grad():
        out = ca.attention(*(t.detach() for t in (q, k, v)), mask=mask, bias=bias,
                           backend="cudnn")
        torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
    assert direct == ["ran"] * 4
    assert len(bound) == 7 and all(torch.isfinite(b).all() for b in bound)
    # another bias of the same signature: the runner binds each call's own
    other = torch.randn(shape, generator=g).to(F16)
    ref_other, _ = oracle.reference_attention(*leaves, vis, bias=other.to(F64))
    with torch.no_grad():
        out = ca.attention(*(t.detach() for t in (q, k, v)), mask=mask, bias=other,
                           backend="cudnn")
    torch.testing.assert_close(out.to(F64), ref_other.detach(), atol=2e-3, rtol=2e-3)
    assert direct[-1] == "ran"


def test_dropout_runs_through_the_runner_with_a_seed_per_call(fake, direct, monkeypatch):
    """The runner draws each call's seed from the call's generator, as the full path does, and
    the backward replays it: with equally seeded generators, the runner's outputs and gradients
    are the full path's (return_lse=True has no runner), call after call. Under a CUDA-graph
    capture it declines, and the full path refuses with its reason."""
    q, k, v = _qkv(grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(F16)
    ours, full = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    outs = []
    for _ in range(3):
        out = ca.attention(q, k, v, mask=ca.Causal(), dropout_p=0.3, generator=ours,
                           backend="cudnn")
        want, _ = ca.attention(q, k, v, mask=ca.Causal(), dropout_p=0.3, generator=full,
                               return_lse=True, backend="cudnn")
        torch.testing.assert_close(out, want, atol=0, rtol=0)
        for got, expected in zip(torch.autograd.grad(out, (q, k, v), dout),
                                 torch.autograd.grad(want, (q, k, v), dout)):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])  # a new stream per call
    with torch.no_grad():
        plain = [t.detach() for t in (q, k, v)]
        out = ca.attention(*plain, mask=ca.Causal(), dropout_p=0.3, generator=ours,
                           backend="cudnn")
        want, _ = ca.attention(*plain, mask=ca.Causal(), dropout_p=0.3, generator=full,
                               return_lse=True, backend="cudnn")
        torch.testing.assert_close(out, want, atol=0, rtol=0)
    assert direct == ["ran"] * 4
    from cudnn_attn.graphs import _runtime

    monkeypatch.setattr(_runtime, "capturing", lambda: True)
    with torch.no_grad(), pytest.raises(ca.NotSupportedError, match="CUDA graph capture"):
        ca.attention(*plain, mask=ca.Causal(), dropout_p=0.3, backend="cudnn")
    assert direct[-1] == "declined"


def test_static_lengths_reach_the_device_once_per_runner(fake, direct, monkeypatch):
    """The runner's graphs read the lengths its plan copied to the device when it was made:
    later calls copy nothing (``LengthCache`` makes them once per value set)."""
    from cudnn_attn.graphs import _runtime

    made = []
    original = _runtime.LengthCache._make
    monkeypatch.setattr(_runtime.LengthCache, "_make",
                        lambda self, *args: made.append(args) or original(self, *args))
    q, k, v = _qkv()
    mask = ca.Causal() & ca.Padding([20, 9])
    for _ in range(4):
        ca.attention(q, k, v, mask=mask, backend="cudnn")
    assert len(made) == 1 and direct == ["ran"] * 4


@pytest.mark.parametrize("which", [0, 1, 2])
def test_any_one_tensor_with_other_strides_is_declined(fake, direct, which):
    """The runner compares q's, k's and v's strides each: one of them alone inside a wider buffer
    sends the call to a plan (and runner) of its own, with the oracle's result."""
    tensors = list(_qkv())
    ref, _ = _reference(*tensors, causal="top_left")
    ca.attention(*tensors, mask=ca.Causal(), backend="cudnn")
    t = tensors[which]
    wide = torch.zeros(*t.shape[:3], 2 * t.shape[3], dtype=F16)
    tensors[which] = wide[..., :t.shape[3]].copy_(t)
    direct.clear()
    out = ca.attention(*tensors, mask=ca.Causal(), backend="cudnn")
    assert direct == ["declined", "ran"]
    torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)


SPEC_FEATURES = {  # a graph-spec field that binds tensors beyond q, k, v -> a value that sets it
    "tile mask": ("block_mask", True),
    "packed storage": ("ragged", True),
    "paged storage": ("paged", PagedKV(num_blocks=4, page_size=8)),
}


@pytest.mark.parametrize("name", list(SPEC_FEATURES))
def test_a_plan_whose_graphs_read_a_tile_mask_or_packed_or_paged_storage_has_no_runner(fake,
                                                                                      name):
    """The rule itself (``CudnnPlan.direct``), on the plain call's own spec with one field set:
    a runner would bind q, k, v alone to graphs that also read a bit mask, ragged offsets or
    page tables. (Such calls reach the engine through ``cudnn_attn.varlen`` and the cuDNN
    builder, not through ``attention``'s signature cache; this checks the plan, which every
    entry point asks.)"""
    q, k, v = _qkv(grad=True)
    problem = AttnProblem.from_tensors(q, k, v, mask=ca.Causal())
    _, plan = dispatch.plan_for(problem, "cudnn")
    assert isinstance(plan.direct(problem), launch.DirectCall)  # the plain call has one
    field, value = SPEC_FEATURES[name]
    assert CudnnPlan(problem, dataclasses.replace(plan.spec, **{field: value})).direct(
        problem) is None


def test_varlen_and_paged_cache_calls_never_reach_a_runner(fake, direct, monkeypatch):
    """End to end: packed (``attention_varlen``) and paged (``attention_with_kvcache``) calls,
    repeated, run through their plans' full path only."""
    monkeypatch.setattr(calls, "on_accelerator", lambda t: isinstance(t, torch.Tensor))
    lens = (5, 11)
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    packed = [torch.randn(sum(lens), 2, 16, generator=g).to(F16) for _ in range(3)]
    page, pages = 8, 4
    pools = [torch.randn(pages, page, 2, 16, generator=g).to(F16) for _ in range(2)]
    table = torch.arange(pages, dtype=torch.int32).view(2, 2)
    q1 = torch.randn(2, 1, 2, 16, generator=g).to(F16)
    for _ in range(3):
        attention_varlen(*packed, cu, cu, max(lens), max(lens), mask=ca.Causal(),
                         backend="cudnn")
        attention_with_kvcache(q1, *pools, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                               block_table=table, backend="cudnn")
    assert direct == []
    kinds = {(spec.ragged, spec.paged is not None) for spec, _ in fake[1]}
    assert kinds == {(True, False), (False, True)}  # both ran on cuDNN's (fake) graphs


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_length_positions_compare_graph_lengths_in_the_calls_layout(layout):
    """``model.inputs.length_positions``: ``[B, 1, 1, 1]`` lengths against the positions of the
    sequence axis, broadcast against ``[B, H, S, D]`` or ``[B, S, H, D]``; the query side only
    when its lengths are given; one comparison when one tensor serves both sides."""
    from cudnn_attn.model.inputs import length_positions

    lens_q = torch.tensor([3, 6], dtype=torch.int32).view(2, 1, 1, 1)
    lens_kv = torch.tensor([5, 0], dtype=torch.int32).view(2, 1, 1, 1)
    seq_axis = 2 if layout == "bhsd" else 1
    shape = [2, 1, 1, 1]
    shape[seq_axis] = 6

    def want(lengths):
        return (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]).view(shape)

    positions = length_positions(lens_q, lens_kv, 6, 6, layout)
    assert positions.valid_q is None and positions.valid_kv is None
    assert torch.equal(positions.rows, want([3, 6])) and torch.equal(positions.keys, want([5, 0]))
    keys_only = length_positions(None, lens_kv, 6, 6, layout)
    assert keys_only.rows is None and torch.equal(keys_only.keys, want([5, 0]))
    shared = length_positions(lens_q, lens_q, 6, 6, layout)
    assert shared.rows is shared.keys and torch.equal(shared.rows, want([3, 6]))
    # other sequence lengths on the two sides: each side its own comparison
    longer = length_positions(lens_q, lens_q, 6, 8, layout)
    assert longer.rows is not longer.keys and longer.keys.shape[seq_axis] == 8


def test_runtime_lengths_through_the_runner_inside_a_capture(fake, direct, monkeypatch):
    """Inside a CUDA-graph capture (simulated: ``capturing()`` answers True) a runtime-Padding
    call still runs through the runner, with the oracle's result, and keeps none of the device
    constants it makes there (their kernels would run only at a replay)."""
    from cudnn_attn.graphs import _runtime
    from cudnn_attn.model import inputs as model_inputs

    q, k, v = _qkv()
    lens = torch.tensor([20, 9], dtype=torch.int32)
    ref, _ = _reference(q, k, v, causal="top_left", seq_lens_q=[20, 9], seq_lens_kv=[20, 9])
    mask = ca.Causal() & ca.Padding(lens)
    ca.attention(q, k, v, mask=mask, backend="cudnn")  # warm-up, outside the capture
    ca.clear_caches()
    monkeypatch.setattr(model_inputs, "capturing", lambda: True)
    monkeypatch.setattr(_runtime, "capturing", lambda: True)
    for _ in range(2):
        out = ca.attention(q, k, v, mask=mask, backend="cudnn")
        torch.testing.assert_close(out.to(F64), ref.detach(), atol=2e-3, rtol=2e-3)
    assert direct[-2:] == ["ran", "ran"]
    assert len(model_inputs._INDEX) == 0 and len(model_inputs._ZEROS) == 0
