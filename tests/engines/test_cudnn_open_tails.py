"""cuDNN's open tails: without a padding mask its SM90 backward lets the zero-filled rows past
the tensors' ends into ``exp(S - LSE)`` (``limits.CudnnLimits.key_tile``), which overflows to inf
and gives NaN gradients once a row's LSE is below -88.7. The engine gives every graph that would
have such a tail a padding mask with the full lengths.

On the CPU the graphs run on ``cudnn_fake``, whose backward models the tails as the reports
describe them (``FakeGraph._open_tails``); the first test shows the model does fail a graph
without the mask, so that the others can fail too. The GPU test
(``test_cudnn_gpu.test_seq_len_mod_128_is_64_with_a_mask_and_tiny_lse``) runs the same inputs on
cuDNN itself.
"""

import dataclasses

import cudnn_fake
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import cudnn_attn as ca
from cudnn_attn.core.caches import clear_caches
from cudnn_attn.graphs._spec import analyze

pytestmark = pytest.mark.skipif(not cudnn_fake.frontend_present(),
                                reason="nvidia-cudnn-frontend is not installed")

F16 = torch.float16


@pytest.fixture
def fake(monkeypatch):
    yield cudnn_fake.install(monkeypatch)
    clear_caches()


def _anti_aligned(b, h, s_q, s_kv, d=64, seed=0):
    """q, k, v (bhsd, fp16, requiring grad) whose every score is about -106: each row's LSE is
    about -106 + log(S_kv), far below -88.7."""
    g = torch.Generator().manual_seed(seed)
    q = 0.1 * torch.randn(b, h, s_q, d, generator=g)
    k = 0.1 * torch.randn(b, h, s_kv, d, generator=g)
    q[..., 0], k[..., 0] = 1.0, -850.0  # score = (1 * -850 + small) / sqrt(64)
    v = torch.randn(b, h, s_kv, d, generator=g)
    return [t.to(F16).requires_grad_(True) for t in (q, k, v)]


def _gradients(q, k, v, backend, **kwargs):
    out, lse = ca.attention(q, k, v, return_lse=True, backend=backend, **kwargs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return lse, torch.autograd.grad(out, (q, k, v), dout)


# (id, B, H, S_q, S_kv, mask): the key tail (S_kv % 128 == 64, cudnn-frontend PR #628) and the
# query tail (S_q = 1 against 128 keys, cudnn-frontend #1072)
TAILS = [("keys-192", 1, 2, 192, 192, None), ("keys-64-cross", 2, 1, 100, 64, None),
         ("queries-1x128", 1, 2, 1, 128, None),
         ("queries-top-left-causal", 1, 2, 70, 256, ca.Causal())]


@pytest.mark.parametrize("case", TAILS, ids=[c[0] for c in TAILS])
def test_the_stand_in_fails_such_rows_without_a_padding_mask(case):
    """The model is live: the same backward graph without the padding mask gives NaN."""
    _, b, h, s_q, s_kv, mask = case
    q, k, v = _anti_aligned(b, h, s_q, s_kv)
    problem = ca.AttnProblem.from_tensors(q, k, v, mask=mask)
    spec = analyze(problem, target_sm=90)[0].backward_variant()
    bare = dataclasses.replace(spec, padding=False, synthetic_padding=False)
    graph = cudnn_fake.FakeGraph(*cudnn_fake.serialized_graph(bare, True))
    out, lse = ca.attention(q, k, v, mask=mask, return_lse=True, backend="torch")
    grads = [torch.empty_like(t) for t in (q, k, v)]
    scale = torch.full((1, 1, 1, 1), 64 ** -0.5)
    buffers = {graph.uid(role): t for role, t in (
        ("Q", q.detach()), ("K", k.detach()), ("V", v.detach()), ("O", out.detach()),
        ("dO", torch.ones_like(out)), ("Stats", lse.detach()[..., None].contiguous()),
        ("Attn_scale", scale), ("dQ", grads[0]), ("dK", grads[1]), ("dV", grads[2]))}
    graph.execute(buffers, None, None)
    assert not all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("case", TAILS, ids=[c[0] for c in TAILS])
def test_rows_with_a_very_negative_lse_get_finite_exact_gradients(fake, case):
    _, b, h, s_q, s_kv, mask = case
    q, k, v = _anti_aligned(b, h, s_q, s_kv)
    want_lse, want = _gradients(*(t.detach().double().requires_grad_(True) for t in (q, k, v)),
                                "torch", mask=mask)
    assert want_lse.max() < -95
    lse, got = _gradients(q, k, v, "cudnn", mask=mask)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-3, rtol=1e-4)
    # FlashAttention's rule: within 3x the error of a plain computation in the same dtype (dQ
    # is ill-conditioned here: K's large first column multiplies dS, whose rows sum to 0)
    _, plain = _gradients(q, k, v, "torch", mask=mask)
    for name, g, p, w in zip("qkv", got, plain, want):
        assert torch.isfinite(g).all(), f"d{name}"
        error, bar = (g.double() - w).abs().max(), (p.double() - w).abs().max()
        assert error <= 3 * bar + 1e-4, (f"d{name}", error.item(), bar.item())


@pytest.mark.parametrize("s_q, s_kv, backward, bias, padded", [
    (256, 256, True, False, False),   # whole tiles
    (192, 192, False, False, False),  # forward only: its tails are masked
    (192, 192, True, False, True),
    (256, 200, True, False, True),
    (100, 256, True, False, True),
    (1, 128, True, False, True),
    (128, 100, False, True, True),    # a bias: forward too (PyTorch #196678)
    (128, 128, False, True, False),
])
def test_which_graphs_get_the_full_length_padding_mask(s_q, s_kv, backward, bias, padded):
    q = torch.empty(2, 2, s_q, 64, dtype=F16, device="meta").requires_grad_(backward)
    k = v = torch.empty(2, 2, s_kv, 64, dtype=F16, device="meta")
    table = torch.empty(1, 2, s_q, s_kv, dtype=F16, device="meta") if bias else None
    spec, reasons = analyze(ca.AttnProblem.from_tensors(q, k, v, bias=table), target_sm=90)
    assert not reasons and spec.padding == spec.synthetic_padding == padded


def test_real_padding_and_score_mods_are_left_as_they_are():
    q = torch.empty(2, 2, 192, 64, dtype=F16, device="meta").requires_grad_(True)
    spec = analyze(ca.AttnProblem.from_tensors(q, q, q, mask=ca.Padding([192, 150])),
                   target_sm=90)[0]
    assert spec.padding and not spec.synthetic_padding  # the call's own lengths
    # cuDNN's score_mod excludes the padding mask: a softcap graph keeps its tails (noted)
    spec = analyze(ca.AttnProblem.from_tensors(q, q, q, softcap=30.0), target_sm=90)[0]
    assert spec.score_mod is not None and not spec.padding


def test_explain_names_the_padding_mask_it_adds(fake):
    q, k, v = _anti_aligned(1, 2, 192, 192)
    notes = ca.explain(q, k, v, backend="cudnn").notes
    assert len(notes) == 1 and "padding mask with the full lengths" in notes[0]
    q, k, v = _anti_aligned(1, 2, 256, 256)
    assert ca.explain(q, k, v, backend="cudnn").notes == []  # whole tiles
    q, k, v = (t.detach() for t in _anti_aligned(1, 2, 192, 192))
    assert ca.explain(q, k, v, backend="cudnn").notes == []  # no backward: tails masked


class _CountOps(TorchDispatchMode):
    def __init__(self, name):
        super().__init__()
        self.name, self.count = name, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket.__name__ == self.name
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("padding, conversions", [(None, 0), (ca.Padding([192, 150]), 1)])
def test_full_lengths_leave_no_row_without_keys_to_convert(fake, padding, conversions):
    """The backward turns the forward's -inf stats (rows that see no key) into +inf only where a
    call's own lengths can leave such rows: full lengths cannot (one kernel less)."""
    q, k, v = _anti_aligned(2, 2, 192, 192)
    out, lse = ca.attention(q, k, v, mask=padding, return_lse=True, backend="cudnn")
    with _CountOps("nan_to_num") as counted:
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert counted.count == conversions
