"""The cuDNN engine's per-call host path (issue 35), run on this CPU through the stand-in executor
of ``cudnn_fake`` (which plays cuDNN's ``execute``):

* a runtime-length ``Padding`` call with new lengths rebuilds no problem and re-runs no analysis
  (the call cache serves it, with this call's lengths: the results follow them);
* one handle per device, the same object for a forward and for its backward run on another
  thread, bound to each call's stream when it changes (a new stream, a capture's, creates none);
* the workspace comes from a per-(device, stream) pool, sized once and grown, never from the
  call; a stream being captured gets its own;
* static ``Padding`` lengths are copied to the device once per value set, not per call;
* a CUDA generator's dropout seed is drawn from its host state (no device draw to read back).

Behaviour, not timings: the host microseconds are ``benchmarks/cudnn_host.py``'s.
"""

from __future__ import annotations

import threading

import pytest
import torch

import cudnn_attn as ca
import cudnn_fake
import oracle
from cudnn_attn.core import dispatch
from cudnn_attn.core.caches import clear_caches
from cudnn_attn.graphs import _runtime
from cudnn_attn.graphs import backend as cudnn_backend
from cudnn_attn.model import inputs as model_inputs
from cudnn_attn.model import masks
from cudnn_attn.model.problem import AttnProblem

F16, F64 = torch.float16, torch.float64
pytestmark = pytest.mark.skipif(not cudnn_fake.frontend_present(),
                                reason="nvidia-cudnn-frontend is not installed")


@pytest.fixture
def fake(monkeypatch):
    """The fake cuDNN engine; CPU length tensors count as device (runtime) lengths."""
    monkeypatch.setattr(masks, "_runtime_lengths", lambda value: isinstance(value, torch.Tensor))
    state = cudnn_fake.install(monkeypatch)
    yield state
    clear_caches()


def _qkv(B=2, H=2, S=24, D=16, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(F16) for _ in range(3))
    if grad:
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    return q, k, v


def _count_calls(monkeypatch, owner, name):
    calls = []
    original = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


class _Recorder:
    """Wraps every built graph's ``execute`` to record the handle and workspace it gets."""

    def __init__(self, monkeypatch, workspace_size: int = 0):
        self.seen = []
        build = cudnn_backend.build_graph

        def recording_build(problem, spec, backward):
            graph = build(problem, spec, backward)
            graph.workspace_size = workspace_size
            run = graph.execute

            def execute(buffers, workspace, handle):
                self.seen.append((graph.backward, handle, workspace,
                                  threading.get_ident()))
                return run(buffers, workspace, handle)

            graph.execute = execute
            return graph

        monkeypatch.setattr(cudnn_backend, "build_graph", recording_build)


# ---------------------------------------------------------------------------------------------
# runtime-length Padding: the call cache serves it
# ---------------------------------------------------------------------------------------------

def test_runtime_padding_calls_reuse_the_prepared_problem_with_their_own_lengths(fake,
                                                                                monkeypatch):
    q, k, v = _qkv(B=3, S=20)
    lengths = [([20, 7, 1], [20, 3, 5]), ([5, 20, 13], [9, 20, 20]), ([2, 2, 2], [1, 20, 4])]
    first = ca.Causal("bottom_right") & ca.Padding(torch.tensor(lengths[0][0]),
                                                   torch.tensor(lengths[0][1]))
    ca.attention(q, k, v, mask=first, backend="cudnn")
    problems = _count_calls(monkeypatch, AttnProblem, "from_tensors")
    analyses = _count_calls(monkeypatch, cudnn_backend, "analyze")
    plans = _count_calls(monkeypatch, dispatch, "plan_for")
    for lens_q, lens_kv in lengths:
        mask = ca.Causal("bottom_right") & ca.Padding(torch.tensor(lens_q), torch.tensor(lens_kv))
        out, lse = ca.attention(q, k, v, mask=mask, return_lse=True, backend="cudnn")
        vis = oracle.build_visibility(3, 20, 20, causal="bottom_right", seq_lens_q=lens_q,
                                      seq_lens_kv=lens_kv)
        ref, ref_lse = oracle.reference_attention(q.to(F64), k.to(F64), v.to(F64), vis)
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse.to(F64), ref_lse, atol=1e-3, rtol=1e-3)
    # return_lse=True is another signature than the first call's: prepared once, then served.
    assert len(problems) == 1 and len(plans) == 1, (problems, plans)
    assert len(analyses) <= 2  # that one preparation's (supports + plan), none per call


def test_runtime_padding_of_another_batch_size_is_prepared_anew(fake):
    q, k, v = _qkv(B=2, S=16)
    ca.attention(q, k, v, mask=ca.Padding(torch.tensor([16, 4])), backend="cudnn")
    q3, k3, v3 = _qkv(B=3, S=16)
    with pytest.raises(ValueError, match="one length per batch"):
        ca.attention(q3, k3, v3, mask=ca.Padding(torch.tensor([16, 4])), backend="cudnn")


def test_runtime_padding_gradients_follow_each_calls_lengths(fake):
    for lens in ([24, 10], [3, 24]):
        q, k, v = _qkv(grad=True, seed=len(lens) + lens[0])
        mask = ca.Causal() & ca.Padding(torch.tensor(lens))
        out = ca.attention(q, k, v, mask=mask, backend="cudnn")
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        q64, k64, v64 = (t.detach().to(F64).requires_grad_(True) for t in (q, k, v))
        vis = oracle.build_visibility(2, 24, 24, causal="top_left", seq_lens_q=lens,
                                      seq_lens_kv=lens)
        ref, _ = oracle.reference_attention(q64, k64, v64, vis)
        refs = torch.autograd.grad(ref, (q64, k64, v64), dout.to(F64))
        for got, want in zip(grads, refs):
            torch.testing.assert_close(got.to(F64), want, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# one handle and one workspace per (device, stream)
# ---------------------------------------------------------------------------------------------

def test_forward_and_backward_on_another_thread_share_the_streams_handle(fake, monkeypatch):
    recorder = _Recorder(monkeypatch)
    q, k, v = _qkv(grad=True)
    out = ca.attention(q, k, v, mask=ca.Causal(), backend="cudnn")
    grads = []
    # autograd runs a CUDA backward on its own device thread: the same here, by hand.
    worker = threading.Thread(target=lambda: grads.append(
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))))
    worker.start()
    worker.join()
    assert grads, "the backward failed on its thread"
    (fwd, fwd_handle, fwd_ws, fwd_thread), (bwd, bwd_handle, bwd_ws, bwd_thread) = recorder.seen
    assert (fwd, bwd) == (False, True) and fwd_thread != bwd_thread
    assert fwd_handle is bwd_handle and isinstance(fwd_handle, cudnn_fake.FakeHandle)


def test_another_stream_shares_the_devices_handle_and_gets_its_own_workspace(fake,
                                                                           monkeypatch):
    recorder = _Recorder(monkeypatch, workspace_size=512)
    q, k, v = _qkv()
    ca.attention(q, k, v, backend="cudnn")
    first = _runtime.stream_context(torch.device("cpu"))
    assert _runtime.stream_context(torch.device("cpu")) is first
    # A new stream (a capture's, say) makes no handle: it binds the device's to itself.
    monkeypatch.setattr(_runtime, "_new_handle", lambda index: pytest.fail("a second handle"))
    monkeypatch.setattr(_runtime, "raw_stream", lambda index: 7)
    ca.attention(q, k, v, backend="cudnn")
    other = _runtime.stream_context(torch.device("cpu"))
    assert other is not first and other.handle is first.handle
    (_, handle, ws_first, _), (_, handle_again, ws_other, _) = recorder.seen
    assert handle is handle_again and ws_other is not ws_first
    assert handle.streams == [0, 7]  # bound once per change of stream, not per call
    ca.attention(q, k, v, backend="cudnn")
    assert handle.streams == [0, 7]


def test_the_workspace_is_pooled_per_stream_and_grows_once(fake):
    context = _runtime.stream_context(torch.device("cpu"))
    small = context.workspace(100)
    assert small.numel() >= 100 and small.dtype == torch.uint8
    assert context.workspace(100) is small and context.workspace(50) is small
    big = context.workspace(1000)
    assert big is not small and big.numel() >= 1000
    assert context.workspace(100) is big  # never shrinks back
    assert context.workspace(0) is None


def test_calls_execute_with_the_pooled_workspace(fake, monkeypatch):
    recorder = _Recorder(monkeypatch, workspace_size=4096)
    q, k, v = _qkv()
    for _ in range(3):
        ca.attention(q, k, v, backend="cudnn")
    workspaces = [ws for _, _, ws, _ in recorder.seen]
    assert len(workspaces) == 3 and all(ws is workspaces[0] for ws in workspaces)
    assert workspaces[0].numel() >= 4096


def test_a_captured_stream_gets_its_own_workspace(fake, monkeypatch):
    context = _runtime.stream_context(torch.device("cpu"))
    pooled = context.workspace(256)
    monkeypatch.setattr(_runtime, "capturing", lambda: True)
    captured = context.workspace(256)
    assert captured is not pooled and captured.numel() >= 256
    assert context.workspace(256) is not captured  # each capture its own
    monkeypatch.setattr(_runtime, "capturing", lambda: False)
    assert context.workspace(256) is pooled


def test_clear_caches_drops_the_stream_contexts(fake):
    first = _runtime.stream_context(torch.device("cpu"))
    clear_caches()
    assert _runtime.stream_context(torch.device("cpu")) is not first


# ---------------------------------------------------------------------------------------------
# static Padding: lengths on the device once per value set
# ---------------------------------------------------------------------------------------------

def test_static_padding_lengths_are_made_once_per_value_set(fake, monkeypatch):
    q, k, v = _qkv(B=2, S=20)
    mask = ca.Causal() & ca.Padding([20, 9], [13, 20])
    vis = oracle.build_visibility(2, 20, 20, causal="top_left", seq_lens_q=[20, 9],
                                  seq_lens_kv=[13, 20])
    ref, _ = oracle.reference_attention(q.to(F64), k.to(F64), v.to(F64), vis)
    torch.testing.assert_close(ca.attention(q, k, v, mask=mask, backend="cudnn").to(F64), ref,
                               atol=2e-3, rtol=2e-3)
    # Host lengths reach the device through Padding.tensors (torch.tensor(list, device=...)) or
    # valid_positions (a .to of them): neither runs again for the same value set.
    spies = [_count_calls(monkeypatch, masks.Padding, "tensors"),
             _count_calls(monkeypatch, model_inputs, "valid_positions"),
             _count_calls(monkeypatch, _runtime.LengthCache, "_make")]
    outs = [ca.attention(q, k, v, mask=mask, backend="cudnn") for _ in range(3)]
    assert spies == [[], [], []], "the lengths were copied to the device again"
    for out in outs:
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)


def test_padding_positions_cache_per_value_set_and_skip_full_lengths():
    device = torch.device("cpu")
    padding = ca.Padding([5, 3], [4, 6])
    first = model_inputs.padding_positions(padding, 6, 6, device, "bshd")
    assert model_inputs.padding_positions(ca.Padding([5, 3], [4, 6]), 6, 6, device,
                                          "bshd") is first
    valid_q, valid_kv, rows, keys = first
    assert valid_q.tolist() == [[True] * 5 + [False], [True] * 3 + [False] * 3]
    assert valid_kv.tolist() == [[True] * 4 + [False] * 2, [True] * 6]
    assert model_inputs.padding_positions(ca.Padding([6, 6]), 6, 6, device, "bshd") is None
    other = model_inputs.padding_positions(ca.Padding([5, 3], [4, 6]), 7, 6, device, "bshd")
    assert other is not first and other.valid_q.shape == (2, 7)
    # The views broadcast along the call layout's sequence axis: [B, S, H, D] or [B, H, S, D].
    assert rows.shape == (2, 6, 1, 1) and keys.shape == (2, 6, 1, 1)
    heads_first = model_inputs.padding_positions(padding, 6, 6, device, "bhsd")
    assert heads_first is not first and heads_first.rows.shape == (2, 1, 6, 1)
    assert torch.equal(heads_first.rows[:, 0, :, 0], valid_q)
    assert torch.equal(keys[:, :, 0, 0], valid_kv)


def test_device_constants_are_kept_only_when_they_hold_their_values(monkeypatch):
    """The position index and the 0-dim zero are made once per size, dtype and device, but not
    kept when made inside a CUDA-graph capture (their kernels run only at a replay: an eager
    call after it would read garbage) or under a tracing mode (a fake tensor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    clear_caches()
    monkeypatch.setattr(model_inputs, "capturing", lambda: True)
    first = model_inputs.position_index(7, torch.device("cpu"))
    assert model_inputs.position_index(7, torch.device("cpu")) is not first
    monkeypatch.setattr(model_inputs, "capturing", lambda: False)
    with FakeTensorMode():
        traced = model_inputs.row_positions(7, torch.device("cpu"), torch.int32)
    assert type(traced) is not torch.Tensor
    kept = model_inputs.position_index(7, torch.device("cpu"))
    assert model_inputs.position_index(7, torch.device("cpu")) is kept
    assert kept.tolist() == [list(range(7))]
    rows = model_inputs.row_positions(7, torch.device("cpu"), torch.int32)
    assert type(rows) is torch.Tensor and rows.dtype == torch.int32
    assert rows.shape == (1, 1, 7, 1) and rows.flatten().tolist() == list(range(7))
    assert model_inputs.row_positions(7, torch.device("cpu"), torch.int32) is rows
    clear_caches()


def test_runtime_positions_compute_only_the_side_asked_for(fake):
    """Tensor lengths are compared on the device per call: a forward without gradient hides no
    query row and asks for the key side alone; the output's rows need the query side alone."""
    padding = ca.Padding(torch.tensor([5, 3]), torch.tensor([4, 6]))
    keys_only = model_inputs.padding_positions(padding, 6, 6, torch.device("cpu"), "bhsd",
                                               queries=False)
    assert keys_only.valid_q is None and keys_only.rows is None
    assert keys_only.keys.shape == (2, 1, 6, 1)  # in the call's layout, no [B, S] mask
    assert keys_only.valid_kv is None
    assert keys_only.keys[:, 0, :, 0].tolist() == [[True] * 4 + [False] * 2, [True] * 6]
    rows_only = model_inputs.padding_positions(padding, 6, 6, torch.device("cpu"), "bshd",
                                               keys=False)
    assert rows_only.valid_kv is None and rows_only.keys is None
    assert rows_only.rows[:, :, 0, 0].tolist() == [[True] * 5 + [False], [True] * 3 + [False] * 3]


def test_runtime_positions_of_narrow_integer_lengths_cover_every_position(fake):
    """uint8 lengths against 300 positions: the positions are not made in uint8 (0..255 would
    wrap), so position 260 lies past a length of 250."""
    padding = ca.Padding(torch.tensor([250, 200], dtype=torch.uint8))
    keys = model_inputs.padding_positions(padding, 300, 300, torch.device("cpu"), "bhsd").keys
    assert keys[:, 0, :, 0].sum(1).tolist() == [250, 200]


# ---------------------------------------------------------------------------------------------
# dropout seeds from a CUDA generator: drawn on the host
# ---------------------------------------------------------------------------------------------

class FakeCudaGenerator(torch.Generator):
    """A generator that says it is a CUDA one; its Philox offset lives on the host, as a CUDA
    generator's does."""

    offset = 0

    @property
    def device(self):
        return torch.device("cuda", 0)

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        self.offset = offset


def _cuda_generator(seed: int) -> FakeCudaGenerator:
    gen = FakeCudaGenerator()
    gen.manual_seed(seed)
    return gen


def test_a_cuda_generator_seed_is_drawn_on_the_host(monkeypatch):
    draws = _count_calls(monkeypatch, torch, "randint")
    gen = _cuda_generator(1234)
    seeds = [model_inputs.DropoutState.draw(gen).seed for _ in range(4)]
    assert draws == [] and gen.offset == 16
    assert len(set(seeds)) == 4 and all(0 <= s < model_inputs.SEED_BOUND for s in seeds)
    again = _cuda_generator(1234)
    assert [model_inputs.DropoutState.draw(again).seed for _ in range(4)] == seeds
    assert model_inputs.DropoutState.draw(_cuda_generator(1235)).seed != seeds[0]


def test_dropout_with_a_cuda_generator_reaches_the_graph_and_its_backward(fake):
    q, k, v = _qkv(grad=True)
    out = ca.attention(q, k, v, dropout_p=0.25, generator=_cuda_generator(7), backend="cudnn")
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    expected = model_inputs.DropoutState.draw(_cuda_generator(7)).seed
    cache = fake[0]  # the fake engine's private graph cache: the forward's and backward's graphs
    seen = [seed for key in cache.keys() for seed in cache.peek(key).seeds]
    assert seen == [expected, expected]


# ---------------------------------------------------------------------------------------------
# CUDA-graph capture
# ---------------------------------------------------------------------------------------------

def test_dropout_under_capture_is_refused_not_repeated(fake, monkeypatch):
    q, k, v = _qkv()
    ca.attention(q, k, v, dropout_p=0.2, backend="cudnn")  # warmed up outside the capture
    monkeypatch.setattr(_runtime, "capturing", lambda: True)
    with pytest.raises(ca.NotSupportedError, match="CUDA graph capture"):
        ca.attention(q, k, v, dropout_p=0.2, backend="cudnn")
    # Without dropout the same capture is fine (the workspace is the capture's own).
    out = ca.attention(q, k, v, backend="cudnn")
    ref, _ = oracle.reference_attention(q.to(F64), k.to(F64), v.to(F64))
    torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shared", [False, True], ids=["two-offsets", "one-offsets"])
def test_ragged_offsets_are_the_element_offsets_of_each_first_token(batch, dtype, shared):
    """Q/O/Stats from cu_seqlens_q, K/V from cu_seqlens_k (the same tensor: self-attention),
    times the elements per token, as int32 ``[B + 1, 1, 1, 1]`` tensors cuDNN can bind
    (contiguous, 16-byte aligned), wrapping as an int64 product cast to int32 does."""
    from types import SimpleNamespace

    from cudnn_attn.graphs._emit import UID
    from cudnn_attn.model.storage import Ragged

    g = torch.Generator().manual_seed(batch)
    cu_q = torch.randint(0, 50, (batch + 1,), generator=g).cumsum(0).to(dtype)
    cu_k = torch.randint(0, 50, (batch + 1,), generator=g).cumsum(0).to(dtype)
    cu_k[-1] = 1 << 28  # its products pass 2**31: they wrap as cuDNN's int32 would read them
    cu_q = cu_k if shared else cu_q
    spec = SimpleNamespace(batch=batch, heads_q=8, heads_kv=2, dim_qk=128, dim_v=64)
    got = _runtime.ragged_offsets(spec, Ragged(cu_q, cu_k))
    per_token = {UID.RAGGED_Q: (cu_q, 8 * 128), UID.RAGGED_O: (cu_q, 8 * 64),
                 UID.RAGGED_STATS: (cu_q, 8), UID.RAGGED_K: (cu_k, 2 * 128),
                 UID.RAGGED_V: (cu_k, 2 * 64)}
    assert set(got) == set(per_token)
    for uid, (cu, n) in per_token.items():
        want = (cu.to(torch.int64) * n).to(torch.int32).view(batch + 1, 1, 1, 1)
        t = got[uid]
        assert t.dtype == torch.int32 and t.is_contiguous() and t.data_ptr() % 16 == 0
        assert torch.equal(t, want), uid


def _sees_no_key(band, i: int, n_q: int, n_kv: int) -> bool:
    """cuDNN's documented rule, brute force over every key: row ``i`` of a sequence with ``n_q``
    queries and ``n_kv`` keys sees key ``j < n_kv`` when ``i' - L < j <= i' + R`` (``i' = i +
    n_kv - n_q`` bottom-right, ``i`` top-left; an absent bound does not limit); a row past
    ``n_q`` sees none."""
    if i >= n_q:
        return True
    shifted = i + (n_kv - n_q if band is not None and band.alignment == "bottom_right" else 0)
    return not any(band is None or ((band.left is None or j > shifted - band.left)
                                    and (band.right is None or j <= shifted + band.right))
                   for j in range(n_kv))


def _band(name):
    from cudnn_attn.graphs._spec import Band

    return {None: None, "causal-top-left": Band("top_left", None, 0),
            "causal-bottom-right": Band("bottom_right", None, 0),
            "window-bottom-right": Band("bottom_right", 2, 0),
            "window-top-left": Band("top_left", 3, 1)}[name]


@pytest.mark.parametrize("band", [None, "causal-top-left", "causal-bottom-right",
                                  "window-bottom-right", "window-top-left"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("seq_q", [3, 1])  # one query row: the one-comparison rule
def test_rows_without_keys_of_full_queries_follow_cudnns_band_rule(band, layout, seq_q):
    """A KV-cache call's queries are all tokens (``queries_full``): its rows that see no key,
    against a brute force of cuDNN's documented rule (padding, then ``i' - L < j <= i' + R``,
    ``i' = i + (S_kv - S_q)`` bottom-right) over each row and key."""
    from types import SimpleNamespace

    batch, lens_kv = 5, [0, 1, 2, 4, 9]
    spec = SimpleNamespace(batch=batch, seq_q=seq_q, layout=layout, band=_band(band))
    lq = torch.full((batch, 1, 1, 1), seq_q, dtype=torch.int32)
    lkv = torch.tensor(lens_kv, dtype=torch.int32).view(batch, 1, 1, 1)
    out_rows, stats_rows = _runtime.padded_row_views(spec, lq, lkv, queries_full=True)
    want = torch.tensor([[_sees_no_key(spec.band, i, seq_q, n) for i in range(seq_q)]
                         for n in lens_kv])  # [b, i]: sees no key
    assert want.any() and not want.all()
    stats_shape = (batch, 2, seq_q, 1)
    out_shape = stats_shape if layout == "bhsd" else (batch, seq_q, 2, 1)
    assert torch.equal(stats_rows.expand(stats_shape), want[:, None, :, None].expand(stats_shape))
    out_want = want[:, None, :, None] if layout == "bhsd" else want[:, :, None, None]
    assert torch.equal(out_rows.expand(out_shape), out_want.expand(out_shape))


def _packed_want(band, lens_q: list, lens_kv: list, total: int) -> torch.Tensor:
    """Bool ``[total]``: each packed token's row in its sequence, by the brute-force rule; a
    token past the last sequence sees no key."""
    want = [_sees_no_key(band, i, n_q, n_kv) for n_q, n_kv in zip(lens_q, lens_kv)
            for i in range(n_q)]
    return torch.tensor(want + [True] * (total - len(want)), dtype=torch.bool)


_PACKED_CASES = {  # lens_q, lens_kv, tokens past the last sequence
    "self": ([3, 0, 5, 1], None, 0),
    "cross": ([3, 0, 5, 1, 2], [4, 2, 0, 6, 1], 0),
    "tokens-past-the-end": ([2, 4, 1], [0, 3, 5], 3),
    "one-sequence": ([6], [2], 1)}


@pytest.mark.parametrize("band", [None, "causal-top-left", "causal-bottom-right",
                                  "window-bottom-right", "window-top-left"])
@pytest.mark.parametrize("case", sorted(_PACKED_CASES))
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_packed_tokens_without_keys_follow_cudnns_band_rule(band, case, cu_dtype):
    """One flag per packed query token, from device offsets and lengths (self-attention: one
    lengths tensor for both sides), and from host lengths through the ``LengthCache`` of a
    ragged spec: both against the brute-force rule at each token's row in its sequence."""
    from collections import namedtuple

    lens_q, lens_kv, past = _PACKED_CASES[case]
    same = lens_kv is None
    lens_kv = lens_q if same else lens_kv
    total = sum(lens_q) + past
    want = _packed_want(_band(band), lens_q, lens_kv, total)
    cu_q = torch.tensor([0] + lens_q, dtype=cu_dtype).cumsum(0).to(cu_dtype)
    lq = torch.tensor(lens_q, dtype=torch.int32).view(-1, 1, 1, 1)
    lkv = lq if same else torch.tensor(lens_kv, dtype=torch.int32).view(-1, 1, 1, 1)
    got = _runtime.token_rows_without_keys(_band(band), cu_q, lq, lkv, total)
    assert got.shape == (total,) and torch.equal(got, want)
    spec = namedtuple("Spec", "batch seq_q layout band ragged")(  # hashable: an LRU key
        len(lens_q), 16, "bshd", _band(band), True)
    _, _, empty, views = _runtime.LengthCache(spec).get(tuple(lens_q), tuple(lens_kv),
                                                         torch.device("cpu"), total)
    if not want.any():
        assert empty is None and views is None
    else:
        assert torch.equal(empty, want) and torch.equal(views[0].view(-1), want)


def test_packed_token_positions_share_a_power_of_two():
    """Token counts that differ every batch share one cached arange per power of two."""
    cpu = torch.device("cpu")
    a, b = _runtime.token_positions(37, cpu), _runtime.token_positions(50, cpu)
    assert torch.equal(a, torch.arange(37, dtype=torch.int32)) and len(b) == 50
    assert a.data_ptr() == b.data_ptr() and _runtime.token_positions(1, cpu).tolist() == [0]


# ---------------------------------------------------------------------------------------------
# shape churn: graphs built at call time per shape
# ---------------------------------------------------------------------------------------------

def test_graphs_built_per_call_shape_warn_once_per_family(fake, caplog, monkeypatch):
    """With length buckets off (or for a call that cannot bucket), a decode loop over a growing
    cache builds a graph per step: once a family (the graph without its sizes) has
    CHURN_WARNING shapes built at call time, one warning names the count and the remedies;
    more shapes, or a fixed shape of another family, add none; every result still matches the
    oracle. ``clear_caches()`` starts the count over."""
    import logging

    from cudnn_attn.graphs import churn, length_buckets

    monkeypatch.setenv(length_buckets.ENV, "0")

    g = torch.Generator().manual_seed(4)
    cache = torch.randn(1, 2, 64, 16, generator=g).to(F16)
    q = torch.randn(1, 2, 1, 16, generator=g).to(F16)
    mask = ca.Causal("bottom_right")

    def step(n, query=q):
        out = ca.attention(query, cache[:, :, :n], cache[:, :, :n], mask=mask, backend="cudnn")
        keys = cache[:, :, :n].to(F64)
        vis = oracle.build_visibility(1, query.shape[2], n, window=(-1, 0, "bottom_right"))
        ref, _ = oracle.reference_attention(query.to(F64), keys, keys, vis)
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)

    def warnings_logged():
        return [r for r in caplog.records if "graphs built at call time" in r.getMessage()]

    caplog.set_level(logging.WARNING, logger="cudnn_attn")
    for n in range(8, 8 + churn.CHURN_WARNING - 1):
        step(n)
    assert warnings_logged() == []
    step(40)  # the CHURN_WARNING-th shape
    (record,) = warnings_logged()
    message = record.getMessage()
    assert f"{churn.CHURN_WARNING} cuDNN forward graphs" in message and "S_kv=40" in message
    assert "BucketPolicy" in message and "attention_with_kvcache" in message
    for n in (41, 42, 43):
        step(n)
    wide = torch.randn(1, 2, 3, 16, generator=g).to(F16)  # another family: S_q = 3, one shape
    for _ in range(3):
        step(20, wide)
    assert len(warnings_logged()) == 1
    clear_caches()
    for n in range(8, 8 + churn.CHURN_WARNING - 1):
        step(n)
    assert len(warnings_logged()) == 1


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_empty_rows_follow_the_band_rule_for_every_small_case(alignment):
    """``_runtime.empty_rows`` against cuDNN's documented rule (padding, then
    ``i' - L < j <= i' + R``) for every band with bounds up to 3 and every length pair up to 5."""
    from cudnn_attn.graphs._spec import Band

    s = 5
    i = torch.arange(s).view(1, s, 1)
    j = torch.arange(s).view(1, 1, s)
    pairs = [(a, b) for a in range(s + 1) for b in range(s + 1)]
    lq = torch.tensor([a for a, _ in pairs]).view(-1, 1, 1)
    lkv = torch.tensor([b for _, b in pairs]).view(-1, 1, 1)
    for left in (None, 1, 2, 3):
        for right in (None, 0, 1, 3):
            if left is None and right is None:
                continue
            band = Band(alignment, left, right)
            aligned = i + (lkv - lq if alignment == "bottom_right" else 0)
            vis = (i < lq) & (j < lkv)
            if left is not None:
                vis &= j > aligned - left
            if right is not None:
                vis &= j <= aligned + right
            got = _runtime.empty_rows(band, i, lq, lkv)
            assert torch.equal(got.expand(-1, s, 1).squeeze(-1), ~vis.any(-1)), (left, right)
