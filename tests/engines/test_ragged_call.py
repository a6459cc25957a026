"""Packed self-attention through its kept runner (``graphs.ragged_call.RaggedCall``), on this CPU
with the stand-in executor of ``cudnn_fake`` (it computes each ragged graph in float64 as cuDNN
documents it).

A varlen call whose signature is kept (``packed.prepared``) and whose queries and keys share one
offsets tensor runs from the second call on through a runner bound once: only the lengths, the
ragged offsets and the outputs are made per call. These tests hold it to the full path's
results against the float64 oracle on each sequence alone -- outputs, gradients, tokens past
the last sequence (0, whatever the allocator hands out) -- and check which calls it declines to
the full path: other offsets for the keys, grad mode off for a signature that requires grad,
and signatures whose graphs bind more than the offsets give.
"""

from __future__ import annotations

import pytest
import torch
from test_native_storage import _poisoned, device_only, fake  # noqa: F401  (fixture)
from test_varlen import cu, oracle_varlen, pack

import cudnn_attn as ca
import cudnn_fake
from cudnn_attn.core import execution
from cudnn_attn.graphs import ragged_call
from cudnn_attn.varlen import attention_varlen

F16, F64 = torch.float16, torch.float64
pytestmark = pytest.mark.skipif(not cudnn_fake.frontend_present(),
                                reason="nvidia-cudnn-frontend is not installed")

MASKS = {"none": (None, {}),
         "causal": (ca.Causal(), dict(causal="top_left")),
         "window": (ca.SlidingWindow(3, 0, "bottom_right"), dict(window=(3, 0, "bottom_right")))}


@pytest.fixture
def routes(monkeypatch):
    """Counts of the calls the runner took and those the full path (``execution.run``) took."""
    counts = {"runner": 0, "full": 0}
    run, call = execution.run, ragged_call.RaggedCall.__call__

    def full(*args, **kwargs):
        counts["full"] += 1
        return run(*args, **kwargs)

    def direct(self, *args):
        out = call(self, *args)
        counts["runner"] += out is not None
        return out

    monkeypatch.setattr(execution, "run", full)
    monkeypatch.setattr(ragged_call.RaggedCall, "__call__", direct)
    return counts


def _inputs(lens, spare, heads_q, heads_kv, dim, dim_v, seed):
    g = torch.Generator().manual_seed(seed)
    total = (*lens, spare)
    q, k, v = pack(total, heads_q, dim, F16, g), pack(total, heads_kv, dim, F16, g), \
        pack(total, heads_kv, dim_v, F16, g)
    return [t.requires_grad_(True) for t in (q, k, v)]


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads", [(4, 2, 16, 8), (2, 2, 16, 16)], ids=["gqa-dv", "same-shape"])
def test_later_calls_take_the_runner_and_match_the_oracle(mask, heads, fake, routes,
                                                          monkeypatch):
    """Three calls of one signature with other lengths each (one bucket) and spare tokens past
    the last sequence: the first plans on the full path, the later ones run the runner; each
    matches the oracle, and out and the gradients read 0 past the last sequence though the
    allocator hands out NaN."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))
    lib_mask, oracle_mask = MASKS[mask]
    for n, lens in enumerate([(5, 0, 9), (1, 12, 3), (7, 7, 2)]):
        q, k, v = _inputs(lens, 3, *heads, seed=n)
        offsets = device_only(cu(lens))
        out = cudnn_fake.host(attention_varlen(q, k, v, offsets, offsets, 12, 12, mask=lib_mask,
                                               backend="cudnn"))
        assert routes == {"runner": n, "full": 1}, routes
        total = sum(lens)
        ref_in = [t.detach()[:total].to(F64).requires_grad_(True) for t in (q, k, v)]
        ref_out, _ = oracle_varlen(*ref_in, lens, lens, **oracle_mask)
        assert (out[total:] == 0).all()
        torch.testing.assert_close(out[:total].to(F64), ref_out, atol=2e-3, rtol=2e-3)
        g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(n), dtype=F64)
        got = torch.autograd.grad((out.to(F64) * g_out).sum(), [q, k, v])
        expected = torch.autograd.grad((ref_out * g_out[:total]).sum(), ref_in)
        for name, a, e in zip("qkv", got, expected):
            a = cudnn_fake.host(a)
            assert a.shape == e.shape[:0] + (total + 3, *e.shape[1:])
            assert (a[total:] == 0).all(), f"d{name} past the end"
            torch.testing.assert_close(a[:total].to(F64), e, atol=2e-2, rtol=2e-2,
                                       msg=lambda m, name=name: f"d{name}: {m}")


def test_a_forward_no_gradient_follows_takes_the_runner_too(fake, routes):
    lens = (4, 9)
    g = torch.Generator().manual_seed(1)
    q, k, v = (pack(lens, 2, 16, F16, g) for _ in range(3))
    offsets = device_only(cu(lens))
    for n in range(2):
        out = cudnn_fake.host(attention_varlen(q, k, v, offsets, offsets, 9, 9,
                                               mask=ca.Causal(), backend="cudnn"))
        ref, _ = oracle_varlen(q.to(F64), k.to(F64), v.to(F64), lens, lens, causal="top_left")
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
    assert routes == {"runner": 1, "full": 1}


def test_calls_the_runner_cannot_take_as_they_lie_take_the_full_path(fake, routes):
    """Other offsets for the keys (equal values, another tensor: the lengths are not known to
    agree), and a call that requires grad made under ``torch.no_grad``."""
    lens = (6, 3)
    q, k, v = _inputs(lens, 0, 2, 2, 16, 16, seed=2)
    offsets = device_only(cu(lens))
    ref, _ = oracle_varlen(*(t.detach().to(F64) for t in (q, k, v)), lens, lens)

    def check(out):
        torch.testing.assert_close(cudnn_fake.host(out).to(F64), ref, atol=2e-3, rtol=2e-3)

    check(attention_varlen(q, k, v, offsets, offsets, 6, 6, backend="cudnn"))  # plans
    check(attention_varlen(q, k, v, offsets, device_only(cu(lens)), 6, 6, backend="cudnn"))
    with torch.no_grad():
        check(attention_varlen(q, k, v, offsets, offsets, 6, 6, backend="cudnn"))
    assert routes == {"runner": 0, "full": 3}
    check(attention_varlen(q, k, v, offsets, offsets, 6, 6, backend="cudnn"))
    assert routes == {"runner": 1, "full": 3}


@pytest.mark.parametrize("extra", [dict(return_lse=True), dict(scale=-0.25),
                                   dict(dropout_p=0.2)], ids=["lse", "negative-scale", "dropout"])
def test_signatures_whose_graphs_bind_more_keep_no_runner(extra, fake, routes):
    """A returned lse, a scale whose sign rides on q, dropout: the full path binds what these
    need, so their signatures keep no runner and every call takes it."""
    from cudnn_attn.packed import prepared

    lens = (5, 2)
    q, k, v = _inputs(lens, 0, 2, 2, 16, 16, seed=3)
    offsets = device_only(cu(lens))
    for _ in range(2):
        attention_varlen(q, k, v, offsets, offsets, 5, 5, backend="cudnn", **extra)
    kept = [entry for entry in prepared._PREPARED._data.values() if entry is not prepared._DENSE]
    assert kept and all(entry[3] is None for entry in kept)
    assert routes == {"runner": 0, "full": 2}


def test_a_functorch_transform_never_reaches_the_runner(fake, routes):
    """Under ``torch.func.grad`` the kept runner stands aside: its autograd node enters through
    the C entry point, which skips functorch's handling of wrapped tensors. The full path's
    node refuses functorch transforms with torch's own error (eager ``attention_varlen`` has no
    functorch rule), as it did before the runner existed: an error, never a silent result."""
    lens = (4, 6)
    q, k, v = _inputs(lens, 0, 2, 2, 16, 16, seed=5)
    k, v = k.detach(), v.detach()
    offsets = device_only(cu(lens))

    def loss(q_):
        return attention_varlen(q_, k, v, offsets, offsets, 6, 6, backend="cudnn").sum()

    loss(q), loss(q)  # kept with a runner, which the second call takes
    assert routes == {"runner": 1, "full": 1}
    with pytest.raises(RuntimeError, match="functorch"):
        torch.func.grad(loss)(q.detach())
    assert routes == {"runner": 1, "full": 2}
