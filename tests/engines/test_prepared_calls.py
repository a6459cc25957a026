"""``packed.prepared``: a KV-cache call with device lengths builds and plans its problem once per
call signature; later decode steps bring only their own lengths and page tables, never read on
the host, and get the float64 oracle's results. Varlen calls likewise with their offsets, across
token counts and maxima of one bucket. Run on this CPU through ``cudnn_fake`` (as
``test_native_storage``, whose fixture and oracles these reuse)."""

from __future__ import annotations

import pytest
import torch
from test_native_storage import (F16, F64, _kvcache_oracle, _paged_cache, _varlen_inputs,
                                 device_only, fake)  # noqa: F401  (fake: the fixture)
from test_varlen import cu, oracle_varlen

import cudnn_attn as ca
import cudnn_fake
from cudnn_attn.core import execution
from cudnn_attn.packed import calls, prepared
from cudnn_attn.varlen import attention_varlen, attention_with_kvcache


@pytest.fixture
def builds(monkeypatch):
    """Counts the problems built and the plans looked up for KV-cache and varlen calls."""
    counts = {"problems": 0, "plans": 0}

    def counting(name, key):
        real = getattr(owner_of[name], name)

        def counted(*args, **kwargs):
            counts[key] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(owner_of[name], name, counted)

    owner_of = {"kvcache_problem": calls, "varlen_problem": calls, "plan_stored": execution}
    counting("kvcache_problem", "problems")
    counting("varlen_problem", "problems")
    counting("plan_stored", "plans")
    return counts


def _step(lens, seed, page=16, pages=4, B_heads=(4, 2), D=16, mask=None, scale=None):
    Hq, Hkv = B_heads
    k_pool, v_pool, table, dense_k, dense_v = _paged_cache(lens, page, Hkv, D, seed=seed,
                                                           pages=pages)
    q = torch.randn(len(lens), 1, Hq, D, generator=torch.Generator().manual_seed(seed)).to(F16)
    out = attention_with_kvcache(q, k_pool, v_pool,
                                 device_only(torch.tensor(lens, dtype=torch.int32)),
                                 block_table=device_only(table), mask=mask, scale=scale,
                                 backend="cudnn")
    ref = torch.stack([oracle_varlen(q[b].to(F64), dense_k[b, :n].to(F64),
                                     dense_v[b, :n].to(F64), [1], [n],
                                     causal=None if mask is None else "bottom_right",
                                     **({} if scale is None else {"scale": scale}))[0]
                       for b, n in enumerate(lens)])
    torch.testing.assert_close(cudnn_fake.host(out).to(F64), ref, atol=2e-3, rtol=2e-3)


def test_decode_steps_build_and_plan_once_and_bind_their_own_lengths_and_tables(fake, builds):
    for seed, lens in enumerate(([40, 1, 17, 0], [41, 2, 18, 1], [57, 33, 3, 16], [0, 0, 1, 64])):
        _step(lens, seed, mask=ca.Causal("bottom_right"))  # new pools, tables and lengths
    assert builds == {"problems": 1, "plans": 1}


def test_another_signature_is_prepared_on_its_own(fake, builds):
    _step([5, 9], 0)
    _step([6, 10], 1)
    assert builds["problems"] == 1
    _step([5, 9, 3], 2)                        # another batch size
    _step([5, 9], 3, mask=ca.Causal("bottom_right"))  # another mask
    _step([5, 9], 4, scale=0.3)                # another scale
    _step([5, 9], 5, pages=5)                  # another table width (capacity)
    assert builds["problems"] == 5
    _step([1, 2], 6, scale=0.3)                # each of them again: kept
    _step([7, 2, 1], 7)
    assert builds["problems"] == 5
    torch.use_deterministic_algorithms(True)   # a problem field the signature must carry
    try:
        _step([5, 9], 8)
    finally:
        torch.use_deterministic_algorithms(False)
    assert builds["problems"] == 6


def test_host_lengths_are_not_kept(fake, builds, monkeypatch):
    monkeypatch.setattr(calls, "on_accelerator", lambda t: False)
    q = torch.randn(2, 1, 2, 16).to(F16)
    k_cache = torch.randn(2, 32, 2, 16).to(F16)
    for lens in ([3, 32], [4, 1]):  # read and checked on the host: part of each problem
        found = prepared.stored_kvcache(q, k_cache, k_cache, torch.tensor(lens), None,
                                        backend="cudnn")
        assert found[1].padding.seq_lens_kv == tuple(lens)
    assert builds["problems"] == 2


def test_a_call_no_engine_runs_as_it_lies_is_remembered_as_such(fake, builds):
    lens, page = [7, 3], 5  # a page size cuDNN refuses: "auto" builds dense batches
    k_pool, v_pool, table, dense_k, dense_v = _paged_cache(lens, page, 2, 16, seed=0,
                                                           poison=False)
    table[table < 0] = 0
    q = torch.randn(2, 1, 2, 16).to(F16)
    for _ in range(3):
        out = attention_with_kvcache(q, k_pool, v_pool, torch.tensor(lens), block_table=table)
        ref, _ = _kvcache_oracle(q, dense_k, dense_v, lens, None)
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
    assert builds == {"problems": 1, "plans": 1}


def test_adjusted_fields_hold_on_every_call_and_the_tensors_are_the_calls(fake):
    q = torch.randn(2, 1, 2, 16).to(F16)
    k_pool = torch.randn(9, 16, 2, 16).to(F16)
    problems = []
    for lens in ([3, 20], [4, 21]):
        table = torch.randperm(8).view(2, 4).to(torch.int32)
        lengths = torch.tensor(lens, dtype=torch.int32)
        _, problem, _ = prepared.stored_kvcache(q, k_pool, k_pool, lengths, table,
                                                adjust={"repeatable": True}, return_lse=True)
        assert problem.repeatable and problem.return_lse
        assert torch.equal(problem.storage.block_table, table)
        assert torch.equal(problem.padding.runtime[1], lengths)
        assert problem.padding.runtime[0].tolist() == [1, 1]
        problems.append(problem)
    assert problems[0] == problems[1] and problems[0] is not problems[1]
    assert problems[0].storage.block_table is not problems[1].storage.block_table


def _varlen_step(lens_q, lens_k, **kwargs):
    q, k, v = _varlen_inputs(lens_q, lens_k, grad=kwargs.pop("grad", False))
    out = attention_varlen(q, k, v, device_only(cu(lens_q)), device_only(cu(lens_k)),
                           max(lens_q), max(lens_k), mask=ca.Causal("bottom_right"),
                           backend="cudnn", **kwargs)
    ref, _ = oracle_varlen(q.detach().to(F64), k.detach().to(F64), v.detach().to(F64), lens_q,
                           lens_k, causal="bottom_right", **kwargs)
    torch.testing.assert_close(cudnn_fake.host(out).to(F64), ref, atol=2e-3, rtol=2e-3)
    return q, k, v, out


def test_varlen_batches_of_one_bucket_share_a_problem_whatever_their_token_count(fake, builds):
    for lens_q, lens_k in (((30, 2, 9), (30, 2, 9)), ((1, 60, 4), (3, 64, 4)),
                           ((0, 0, 33), (5, 5, 40)), ((64, 64, 64), (64, 64, 64))):
        _varlen_step(lens_q, lens_k)  # 41 .. 192 tokens, maxima 33 .. 64: bucket 64
    assert builds == {"problems": 1, "plans": 1}
    _varlen_step((65, 1, 1), (65, 1, 1))  # bucket 128
    _varlen_step((3, 4), (3, 4))  # another batch size
    _varlen_step((3, 4, 5), (3, 4, 5), scale=0.3)
    assert builds["problems"] == 4
    q, k, v = _varlen_inputs((3, 4, 5), (3, 4, 5))
    for bad, error in ((2.5, TypeError), (1 << 40, ValueError)):  # checked on every call
        with pytest.raises(error, match="max_seqlen_q"):
            attention_varlen(q, k, v, device_only(cu((3, 4, 5))), device_only(cu((3, 4, 5))),
                             bad, 5, mask=ca.Causal("bottom_right"), scale=0.3,
                             backend="cudnn")


def test_a_kept_varlen_problem_still_gets_its_gradients(fake, builds):
    for lens in ((5, 9, 2), (7, 1, 8)):
        q, k, v, out = _varlen_step(lens, lens, grad=True)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(sum(lens)))
        got = torch.autograd.grad(cudnn_fake.host(out).to(F64), (q, k, v), dout.to(F64))
        ref_inputs = [t.detach().to(F64).requires_grad_(True) for t in (q, k, v)]
        ref, _ = oracle_varlen(*ref_inputs, lens, lens, causal="bottom_right")
        expected = torch.autograd.grad(ref, ref_inputs, dout.to(F64))
        for a, e in zip(got, expected):
            torch.testing.assert_close(a.to(F64), e, atol=2e-2, rtol=2e-2)
    assert builds["problems"] == 1


@pytest.mark.parametrize("rows", [1, 3], ids=["decode", "three-queries"])
@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_dense_cache_steps_take_the_kept_runner_and_match_the_oracle(rows, causal, fake,
                                                                     monkeypatch):
    """A dense cache with device lengths keeps its plan's direct runner
    (``graphs.launch.DirectCall``, the lengths passed per call as a runtime ``Padding``): from
    the second step on no problem is rebound and nothing is planned. Each step matches the
    oracle, a sequence without cached keys gets zeros, and NaN stored past the lengths (a
    cache's unused tail) reaches no result."""
    full = []
    run = execution.run
    monkeypatch.setattr(execution, "run", lambda *a, **kw: full.append(1) or run(*a, **kw))
    g = torch.Generator().manual_seed(4)
    capacity, Hq, Hkv, D = 48, 4, 2, 16
    for step, lens in enumerate(([40, 1, 17, 0], [41, 2, 18, 3], [0, 48, 5, 9])):
        k_cache, v_cache = (torch.randn(4, capacity, Hkv, D, generator=g).to(F16)
                            for _ in range(2))
        for b, n in enumerate(lens):  # the unused tail holds NaN
            k_cache[b, n:] = float("nan")
            v_cache[b, n:] = float("nan")
        q = torch.randn(4, rows, Hq, D, generator=g).to(F16)
        out = attention_with_kvcache(q, k_cache, v_cache,
                                     device_only(torch.tensor(lens, dtype=torch.int32)),
                                     mask=None if causal is None else ca.Causal(causal),
                                     backend="cudnn")
        assert len(full) == 1, f"step {step} took the full path"
        out = cudnn_fake.host(out)
        ref, _ = _kvcache_oracle(q, k_cache.nan_to_num(), v_cache.nan_to_num(), lens, causal)
        ref = torch.nan_to_num(ref)  # the oracle's rows without keys: 0, as the engine's
        assert not out.isnan().any()
        torch.testing.assert_close(out.to(F64), ref, atol=2e-3, rtol=2e-3)
        for b, n in enumerate(lens):
            if n == 0:
                assert (out[b] == 0).all()


@pytest.mark.parametrize("causal", [None, "bottom_right"])
def test_paged_steps_take_the_kept_runner_and_match_the_oracle(causal, fake, monkeypatch):
    """A paged cache with device lengths keeps a ``graphs.paged_call.PagedCall``: from the
    second step on (new pools, shuffled tables, new lengths, NaN in every unused page) no
    problem is rebound; each step matches the oracle, a sequence without keys gets zeros."""
    from test_native_storage import _poisoned

    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))  # as a GPU hands out
    full = []
    run = execution.run
    monkeypatch.setattr(execution, "run", lambda *a, **kw: full.append(1) or run(*a, **kw))
    for step, lens in enumerate(([40, 1, 17, 0], [41, 2, 18, 1], [57, 33, 3, 0])):
        _step(lens, step, mask=None if causal is None else ca.Causal(causal))
        assert len(full) == 1, f"step {step} took the full path"


def test_a_returned_lse_keeps_no_runner(fake):
    """A returned lse needs the stats, which no runner binds: the kept signature has no
    runner and every call takes the full path."""
    k_cache = torch.randn(2, 16, 2, 16).to(F16)
    q = torch.randn(2, 1, 4, 16).to(F16)
    for _ in range(2):
        attention_with_kvcache(q, k_cache, k_cache, device_only(torch.tensor([3, 16])),
                               return_lse=True, backend="cudnn")
    kept = [entry for entry in prepared._PREPARED._data.values() if entry is not prepared._DENSE]
    assert len(kept) == 1 and kept[0][3] is None
